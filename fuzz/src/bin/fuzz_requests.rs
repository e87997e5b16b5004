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
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, dir, count] = args.as_slice() {
        if flag == "--seeds" {
            let Ok(count) = count.parse::<usize>() else {
                eprintln!("fuzz_requests: --seeds DIR N: N must be a number");
                return std::process::ExitCode::from(2);
            };
            for (i, input) in keelfs_fuzz::generated_inputs(0x5eed, count).iter().enumerate() {
                if let Err(e) = std::fs::write(std::path::Path::new(dir).join(format!("seed-{i:03}")), input) {
                    eprintln!("fuzz_requests: writing seeds to {dir}: {e}");
                    return std::process::ExitCode::FAILURE;
                }
            }
            return std::process::ExitCode::SUCCESS;
        }
    }
    let mut harness = keelfs_fuzz::Harness::new();
    for path in &args {
        match std::fs::read(path) {
            Ok(input) => {
                harness.run(&input);
                println!("{path}: ok");
            }
            Err(e) => {
                eprintln!("fuzz_requests: {path}: {e}");
                return std::process::ExitCode::FAILURE;
            }
        }
    }
    std::process::ExitCode::SUCCESS
}
