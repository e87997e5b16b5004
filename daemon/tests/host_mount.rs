//! `keelfsd serve --fuse-mount` passes the real POSIX suites from
//! crates.io (pjdfstest, fsx), shuts down cleanly on SIGTERM, and leaves a
//! clean filesystem. scripts/setup.sh installs the suites and the dummy
//! user pjdfstest needs.

use std::path::{Path, PathBuf};
use std::process::Command;

fn tool(name: &str) -> PathBuf {
    let in_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|c| c.exists()))
        .unwrap_or_default();
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cargo"));
    in_path
        .or_else(|| Some(cargo_home.join("bin").join(name)).filter(|p| p.exists()))
        .unwrap_or_else(|| panic!("{name} is not installed: run scripts/setup.sh"))
}

mod common;
use common::{is_mounted, keelfsd, Served};

fn serve(image: &Path, mountpoint: &Path, cache: &str) -> Served {
    Served::start(
        &[
            "--cache".as_ref(),
            cache.as_ref(),
            "--device".as_ref(),
            image.as_os_str(),
            "--fuse-mount".as_ref(),
            mountpoint.as_os_str(),
        ],
        &[mountpoint],
    )
}

const PJDFSTEST_CONFIG: &str = r#"
[features]
posix_fallocate = {}
utimensat = {}
utime_now = {}
rename_ctime = {}

[settings]
naptime = 0.01
allow_remount = false

[dummy_auth]
entries = [["nobody", "nogroup"], ["tests", "tests"]]
"#;

fn run_fsx(file: &Path, seed: &str) {
    let fsx = Command::new(tool("fsx"))
        .args(["-N", "20000", "-S", seed, "-P"])
        .arg(std::env::temp_dir())
        .arg(file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&fsx.stdout).to_string() + &String::from_utf8_lossy(&fsx.stderr);
    assert!(fsx.status.success() && text.contains("All operations completed A-OK"), "fsx on {file:?} failed:\n{text}");
}

#[test]
fn pjdfstest_and_fsx_pass_on_a_host_mount() {
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let image = base.join(format!("keelfsd-suites-{}.img", std::process::id()));
    let mountpoint = std::env::temp_dir().join(format!("keelfsd-suites-mnt-{}", std::process::id()));
    let _ = std::fs::remove_file(&image);
    assert!(keelfsd().arg("mkfs").arg(&image).args(["--size", "1G"]).status().unwrap().success());
    let served = serve(&image, &mountpoint, "auto");

    let work = mountpoint.join("pjd");
    std::fs::create_dir(&work).unwrap();
    let config = std::env::temp_dir().join(format!("pjdfstest-{}.toml", std::process::id()));
    std::fs::write(&config, PJDFSTEST_CONFIG).unwrap();
    let out = Command::new(tool("pjdfstest"))
        .arg("-c")
        .arg(&config)
        .arg("-p")
        .arg(&work)
        .current_dir(&work)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let summary = text.lines().find(|l| l.starts_with("Summary:")).unwrap_or("no summary").to_string();
    eprintln!("pjdfstest: {summary}");
    assert!(out.status.success() && summary.starts_with("Summary: 0 failed"), "pjdfstest failed:\n{text}");
    let passed: u32 =
        summary.split(", ").find_map(|p| p.strip_suffix(" passed")).and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(passed >= 350, "only {passed} pjdfstest cases ran and passed");

    // fsx in the default cache mode: pread/pwrite, mmap reads and writes,
    // truncates, fallocate, fsync, all through the page caches.
    run_fsx(&mountpoint.join("fsx-cached"), "7");
    let status = served.stop();
    assert!(status.success(), "keelfsd exit after SIGTERM: {status}");
    assert!(!is_mounted(&mountpoint), "unmounted at shutdown");

    // And with --cache none, where every open is direct I/O: keelfs's
    // direct paths (aligned and bounced), mmap allowed on direct files.
    let served = serve(&image, &mountpoint, "none");
    run_fsx(&mountpoint.join("fsx-direct"), "8");
    assert!(served.stop().success());
    let check = keelfsd().arg("fsck").arg(&image).output().unwrap();
    assert_eq!(check.status.code(), Some(0), "{}", String::from_utf8_lossy(&check.stdout));
    let _ = std::fs::remove_file(&image);
    let _ = std::fs::remove_file(&config);
    let _ = std::fs::remove_dir(&mountpoint);
}
