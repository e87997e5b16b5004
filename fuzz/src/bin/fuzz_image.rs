//! Images under AFL++ (`cargo afl build --features afl`), or, without the
//! feature, replaying inputs: `fuzz_image FILE...` runs each (a crash
//! AFL++ saved, say), and `fuzz_image --seeds DIR N` writes N generated
//! inputs to DIR as a starting corpus. See `keelfs_fuzz::image`.

#![forbid(unsafe_code)]

#[cfg(feature = "afl")]
fn main() {
    let mut harness = keelfs_fuzz::image::ImageHarness::new();
    keelfs_fuzz::afl_main(|data| harness.run(data));
}

#[cfg(not(feature = "afl"))]
fn main() -> std::process::ExitCode {
    let mut harness = keelfs_fuzz::image::ImageHarness::new();
    keelfs_fuzz::replay_main(
        "fuzz_image",
        |input| harness.run(input),
        |count| keelfs_fuzz::image::generated_image_inputs(0x1ea6e, count),
    )
}
