//! The FUSE dispatcher under AFL++ (`cargo afl build --features afl`), or,
//! without the feature, replaying inputs: `fuzz_requests FILE...` runs each
//! (a crash AFL++ saved, say), and `fuzz_requests --seeds DIR N` writes N
//! generated inputs to DIR as a starting corpus.

#![forbid(unsafe_code)]

#[cfg(feature = "afl")]
fn main() {
    let mut harness = keelfs_fuzz::Harness::new();
    keelfs_fuzz::afl_main(|data| harness.run(data));
}

#[cfg(not(feature = "afl"))]
fn main() -> std::process::ExitCode {
    let mut harness = keelfs_fuzz::Harness::new();
    keelfs_fuzz::replay_main(
        "fuzz_requests",
        |input| harness.run(input),
        |count| keelfs_fuzz::generated_inputs(0x5eed, count),
    )
}
