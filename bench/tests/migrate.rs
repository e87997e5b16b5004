//! `keelfs-bench migrate` runs in CI with small defaults (issue 32: every
//! subcommand runs once): two keelfsd on one image, the second
//! `--incoming`, as bench/run-migrate.sh starts them. The session moves,
//! its handles work on the destination, and the JSON line has its figures.
//! What the figures are worth is bench/RESULTS.md's business, not this
//! test's.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{keelfsd, wait_for, Daemon};

fn serve(image: &Path, socket: &Path, incoming: bool) -> Daemon {
    let mut cmd = keelfsd();
    cmd.arg("serve").arg("--device").arg(image).arg("--socket").arg(socket);
    cmd.args(["--tag", "bench", "--sandbox", "none"]).stdout(Stdio::null()).stderr(Stdio::null());
    if incoming {
        cmd.arg("--incoming");
    }
    let daemon = Daemon(cmd.spawn().unwrap());
    wait_for(socket);
    daemon
}

#[test]
fn migrate_moves_a_small_session_and_reports_its_cost() {
    let dir: PathBuf = std::env::temp_dir().join(format!("keelfs-bench-migrate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let image = dir.join("image");
    let out = keelfsd().arg("mkfs").arg(&image).args(["--size", "256M"]).output().unwrap();
    assert!(out.status.success(), "mkfs: {}", String::from_utf8_lossy(&out.stderr));
    let (source, dest) = (dir.join("k1.sock"), dir.join("k2.sock"));
    let daemons = [serve(&image, &source, false), serve(&image, &dest, true)];

    let out = Command::new(env!("CARGO_BIN_EXE_keelfs-bench"))
        .arg("migrate")
        .arg("--source")
        .arg(&source)
        .arg("--dest")
        .arg(&dest)
        .args(["--inodes", "200", "--handles", "20", "--precopy-ms", "50", "--label", "keelfsd", "--json"])
        .output()
        .unwrap();
    drop(daemons);
    assert!(out.status.success(), "migrate: {}", String::from_utf8_lossy(&out.stderr));
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(line["bench"], "migrate", "{line}");
    assert_eq!(line["label"], "keelfsd", "{line}");
    assert_eq!(line["lookups"], 200, "{line}");
    assert_eq!(line["handles"], 20, "{line}");
    assert!(line["state_bytes"].as_u64().unwrap() > 0, "the session's state travels: {line}");
    for key in ["save_ms", "load_ms", "downtime_added_ms"] {
        assert!(line[key].as_f64().is_some(), "{key} missing: {line}");
    }

    let out = keelfsd().arg("fsck").arg(&image).output().unwrap();
    assert!(out.status.success(), "fsck: {}", String::from_utf8_lossy(&out.stdout));
    let _ = std::fs::remove_dir_all(&dir);
}
