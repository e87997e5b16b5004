//! The FUSE dispatcher under AFL++ (`cargo afl build --features afl`), or,
//! without the feature, replaying inputs: `fuzz_requests FILE...` runs each
//! (a crash AFL++ saved, say), and `fuzz_requests --seeds DIR N` writes N
//! generated inputs to DIR as a starting corpus.

#![forbid(unsafe_code)]

/// The harness as afl wants it. A panic is a crash AFL++ records and the
/// process ends with it: nothing observes the harness after an unwind.
#[cfg(feature = "afl")]
struct Runner(keelfs_fuzz::Harness);

#[cfg(feature = "afl")]
impl std::panic::RefUnwindSafe for Runner {}

#[cfg(feature = "afl")]
impl Runner {
    fn run(&mut self, data: &[u8]) {
        self.0.run(data);
    }
}

#[cfg(feature = "afl")]
fn main() {
    let mut runner = Runner(keelfs_fuzz::Harness::new());
    afl::fuzz!(|data: &[u8]| runner.run(data));
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
