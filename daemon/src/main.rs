//! keelfsd's entry point: the daemon lives in the library (src/lib.rs).

fn main() -> std::process::ExitCode {
    keelfsd::run()
}
