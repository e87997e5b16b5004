//! `keelfsd serve --fuse-mount` passes the real POSIX suites from
//! crates.io (pjdfstest, fsx), shuts down cleanly on SIGTERM, and leaves a
//! clean filesystem, on each FUSE transport: /dev/fuse and io_uring.
//! scripts/setup.sh installs the suites and the dummy user pjdfstest
//! needs, and turns FUSE over io_uring on.

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
use common::{is_mounted, keelfsd, require_fuse_transport, Served};

fn serve(image: &Path, mountpoint: &Path, cache: &str, transport: &str) -> Served {
    serve_with(
        image,
        mountpoint,
        &["--fuse-transport".as_ref(), transport.as_ref(), "--cache".as_ref(), cache.as_ref()],
    )
}

fn serve_with(image: &Path, mountpoint: &Path, args: &[&std::ffi::OsStr]) -> Served {
    let mut all = args.to_vec();
    all.extend(["--device".as_ref(), image.as_os_str(), "--fuse-mount".as_ref(), mountpoint.as_os_str()]);
    Served::start(&all, &[mountpoint])
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

/// The pjdfstest cases this run skips, each kind with its reason; a skip
/// of any other case, or more of them, fails the test.
const PJDFSTEST_SKIPS: &[(&str, &str)] = &[
    ("::erofs_", "needs a read-only remount (allow_remount = false)"),
    ("::exdev_", "needs a second filesystem to cross into"),
    ("link::link_count_max", "needs the link_count_max feature (65,000 links a case)"),
];
const PJDFSTEST_SKIPPED_MAX: usize = 16;

/// fsx's configs, shared with the guest suite.
fn fsx_config(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../qemu-scripts/guest-tests/fsx").join(format!("{name}.toml"))
}

/// fsx with one of the shared configs; every operation in `must_run` has
/// to have run at least once (fsx logs each at -v), so a config that
/// stops exercising an operation fails here instead of passing quietly.
fn run_fsx(file: &Path, config: &str, seed: &str, must_run: &[&str]) {
    let fsx = Command::new(tool("fsx"))
        .arg("-f")
        .arg(fsx_config(config))
        .args(["-N", "10000", "-S", seed, "-v", "-P"])
        .arg(std::env::temp_dir())
        .arg(file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&fsx.stdout).to_string() + &String::from_utf8_lossy(&fsx.stderr);
    assert!(fsx.status.success() && text.contains("All operations completed A-OK"), "fsx on {file:?} failed:\n{text}");
    let mut ran = std::collections::BTreeMap::<&str, u32>::new();
    for line in text.lines() {
        // "[INFO  fsx]  45 fsync", "[INFO  fsx]  47 mapread   0x6d52a .."
        let Some((_, rest)) = line.split_once("fsx]") else { continue };
        let mut words = rest.split_whitespace();
        if words.next().is_some_and(|n| n.parse::<u64>().is_ok()) {
            if let Some(op) = words.next() {
                *ran.entry(op.split('(').next().unwrap_or(op)).or_default() += 1;
            }
        }
    }
    eprintln!("fsx {config} (seed {seed}) on {}: {ran:?}", file.display());
    let missing: Vec<&&str> = must_run.iter().filter(|op| !ran.contains_key(**op)).collect();
    assert!(missing.is_empty(), "fsx {config} never ran {missing:?}: {ran:?}");
}

/// What the shared configs must exercise.
const FSX_BUFFERED_OPS: &[&str] = &[
    "read",
    "write",
    "truncate",
    "fsync",
    "fdatasync",
    "posix_fallocate",
    "punch_hole",
    "copy_file_range",
    "sendfile",
    "close/open",
];
const FSX_MMAP_OPS: &[&str] = &["read", "write", "mapread", "mapwrite", "msync", "truncate", "fsync"];

#[test]
fn pjdfstest_and_fsx_pass_on_a_host_mount_on_dev_fuse() {
    suites_pass("dev");
}

#[test]
fn pjdfstest_and_fsx_pass_on_a_host_mount_over_io_uring() {
    suites_pass("uring");
}

fn suites_pass(transport: &str) {
    require_fuse_transport(transport);
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let image = base.join(format!("keelfsd-suites-{transport}-{}.img", std::process::id()));
    let mountpoint = std::env::temp_dir().join(format!("keelfsd-suites-mnt-{transport}-{}", std::process::id()));
    let _ = std::fs::remove_file(&image);
    assert!(keelfsd().arg("mkfs").arg(&image).args(["--size", "1G"]).status().unwrap().success());
    let served = serve(&image, &mountpoint, "auto", transport);

    let work = mountpoint.join("pjd");
    std::fs::create_dir(&work).unwrap();
    let config = std::env::temp_dir().join(format!("pjdfstest-{transport}-{}.toml", std::process::id()));
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
    let count = |what: &str| -> usize {
        summary.split(", ").find_map(|p| p.strip_suffix(what)).and_then(|n| n.trim().parse().ok()).unwrap_or(0)
    };
    let passed = count(" passed");
    assert!(passed >= 350, "only {passed} pjdfstest cases ran and passed");
    // Skips are counted, named and bounded, never passed over.
    let skipped: Vec<&str> = text
        .lines()
        .filter(|l| l.trim_end().ends_with(" skipped"))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    eprintln!("pjdfstest: {} skipped: {}", skipped.len(), skipped.join(" "));
    assert_eq!(skipped.len(), count(" skipped"), "skipped cases named != the summary's count");
    let unexpected: Vec<&&str> =
        skipped.iter().filter(|case| !PJDFSTEST_SKIPS.iter().any(|(kind, _)| case.contains(kind))).collect();
    assert!(unexpected.is_empty(), "pjdfstest skipped cases with no known reason: {unexpected:?}");
    assert!(
        skipped.len() <= PJDFSTEST_SKIPPED_MAX,
        "{} pjdfstest cases skipped, more than the {PJDFSTEST_SKIPPED_MAX} expected",
        skipped.len()
    );

    // fsx in the default cache mode, through the page caches (with the
    // host kernel's writeback cache: no guest shares this export): pread
    // and pwrite, truncate, fsync, fdatasync, fallocate, punch hole,
    // copy_file_range, sendfile; then mmap reads and writes with msync.
    run_fsx(&mountpoint.join("fsx-cached"), "buffered", "7", FSX_BUFFERED_OPS);
    run_fsx(&mountpoint.join("fsx-cached-mmap"), "mmap", "17", FSX_MMAP_OPS);
    let status = served.stop();
    assert!(status.success(), "keelfsd exit after SIGTERM: {status}");
    assert!(!is_mounted(&mountpoint), "unmounted at shutdown");

    // And in the default mode beside a guest's socket (none connects):
    // the page cache without writeback caching, each write(2) a WRITE.
    let socket = std::env::temp_dir().join(format!("keelfsd-suites-{transport}-{}.sock", std::process::id()));
    let args = ["--fuse-transport".as_ref(), transport.as_ref(), "--socket".as_ref(), socket.as_os_str()];
    let served = serve_with(&image, &mountpoint, &args);
    run_fsx(&mountpoint.join("fsx-shared"), "buffered", "6", FSX_BUFFERED_OPS);
    run_fsx(&mountpoint.join("fsx-shared-mmap"), "mmap", "16", FSX_MMAP_OPS);
    assert!(served.stop().success());
    let _ = std::fs::remove_file(&socket);

    // And with --cache none, where every open is direct I/O: keelfs's
    // direct paths (aligned and bounced), mmap allowed on direct files.
    let served = serve(&image, &mountpoint, "none", transport);
    run_fsx(&mountpoint.join("fsx-direct"), "buffered", "8", FSX_BUFFERED_OPS);
    run_fsx(&mountpoint.join("fsx-direct-mmap"), "mmap", "18", FSX_MMAP_OPS);
    assert!(served.stop().success());

    // And with --cache always: writeback caching in the host kernel,
    // which reads through write-only handles and owns size and mtime.
    let served = serve(&image, &mountpoint, "always", transport);
    run_fsx(&mountpoint.join("fsx-writeback"), "buffered", "9", FSX_BUFFERED_OPS);
    run_fsx(&mountpoint.join("fsx-writeback-mmap"), "mmap", "19", FSX_MMAP_OPS);
    assert!(served.stop().success());
    let check = keelfsd().arg("fsck").arg(&image).output().unwrap();
    assert_eq!(check.status.code(), Some(0), "{}", String::from_utf8_lossy(&check.stdout));
    let _ = std::fs::remove_file(&image);
    let _ = std::fs::remove_file(&config);
    let _ = std::fs::remove_dir(&mountpoint);
}
