//! The guest harness (qemu-scripts/run-guest.sh) turns a stalled guest
//! into a failure with a reason within about a minute, instead of waiting
//! for its timeout: the guest's /init prints a heartbeat every 10 s, and a
//! silence of --stall-after seconds stops QEMU, prints the console's tail
//! and exits 126. Here a guest script silences its own heartbeat and then
//! waits, as a guest whose timers stopped would; and one whose kernel
//! reports a stall while the heartbeat goes on (one vCPU stuck, the other
//! not) and whose test then prints nothing.
//!
//! scripts/setup.sh installs QEMU and the guest kernel; nothing is skipped
//! when they are missing.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// Runs SCRIPT in a guest with --stall-after 30: (exit code, output, time).
fn run_guest(name: &str, script_text: &str) -> (Option<i32>, String, Duration) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    assert!(
        Command::new("sh").arg("-c").arg("command -v qemu-system-x86_64").status().unwrap().success(),
        "qemu-system-x86_64 is missing: run scripts/setup.sh"
    );
    let dir = std::env::temp_dir().join(format!("keelfs-stall-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("guest.sh");
    std::fs::write(&script, script_text).unwrap();
    // The harness needs some device; a small NVMe image is the cheapest.
    let image = dir.join("nvme.img");
    std::fs::File::create(&image).unwrap().set_len(64 << 20).unwrap();
    let started = Instant::now();
    let out = Command::new("bash")
        .arg(repo.join("qemu-scripts/run-guest.sh"))
        .arg("--nvme")
        .arg(&image)
        .args(["--stall-after", "30", "--timeout", "600", "--script"])
        .arg(&script)
        .output()
        .unwrap();
    let elapsed = started.elapsed();
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text, elapsed)
}

#[test]
fn a_stall_report_then_silence_fails_even_while_the_heartbeat_goes_on() {
    // A kernel error-level message (printed on the console) as the RCU
    // stall detector words it, then a test that never prints again.
    let (code, text, elapsed) = run_guest(
        "report",
        "#!/bin/sh\necho 'guest: faking a stall report'\n\
         echo '<3>rcu: INFO: rcu_preempt self-detected stall on CPU' >/dev/kmsg\nsleep 3600\n",
    );
    assert_eq!(code, Some(126), "want exit 126 (stalled):\n{text}");
    assert!(text.contains("the kernel reported a stall and the test printed nothing for 30s"), "{text}");
    assert!(text.contains("self-detected stall on CPU"), "the kernel's report is shown:\n{text}");
    // Found as a stall (exit 126, not the timeout's), however long it took.
    eprintln!("stall found after {elapsed:?}");
}

#[test]
fn a_silent_guest_fails_as_stalled_long_before_its_timeout() {
    let (code, text, elapsed) = run_guest(
        "silent",
        "#!/bin/sh\necho 'guest: silencing the heartbeat'\nkill -STOP \"$KEELFS_HEARTBEAT_PID\"\nsleep 3600\n",
    );
    assert_eq!(code, Some(126), "want exit 126 (stalled):\n{text}");
    assert!(text.contains("the guest stalled: no heartbeat for 30s"), "{text}");
    assert!(text.contains("console tail:") && text.contains("guest: silencing the heartbeat"), "{text}");
    // The stall is found 30-40 s after the last heartbeat, however long the
    // boot took: as a stall (exit 126 and its message), not by the 600 s
    // timeout, whose exit and message differ.
    eprintln!("stall found after {elapsed:?}");
}
