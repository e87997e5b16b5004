//! Images under AFL++ (`cargo afl build --features afl`), or, without the
//! feature, replaying inputs: `fuzz_image FILE...` runs each (a crash
//! AFL++ saved, say), and `fuzz_image --seeds DIR N` writes N generated
//! inputs to DIR as a starting corpus. See `keelfs_fuzz::image`.

#![forbid(unsafe_code)]

/// The harness as afl wants it. A panic is a crash AFL++ records and the
/// process ends with it: nothing observes the harness after an unwind.
#[cfg(feature = "afl")]
struct Runner(keelfs_fuzz::image::ImageHarness);

#[cfg(feature = "afl")]
impl std::panic::RefUnwindSafe for Runner {}

#[cfg(feature = "afl")]
impl Runner {
    /// A method, not the field: the closure then captures the whole
    /// runner, which is unwind-safe by the impl above.
    fn run(&mut self, data: &[u8]) {
        self.0.run(data);
    }
}

#[cfg(feature = "afl")]
fn main() {
    let mut runner = Runner(keelfs_fuzz::image::ImageHarness::new());
    afl::fuzz!(|data: &[u8]| runner.run(data));
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
