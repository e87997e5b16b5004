//! scripts/setup.sh, seen from a fresh machine: with a PATH that holds only
//! a shell and a few text tools (no QEMU, fio, mkfs.xfs, busybox, cargo),
//! an empty HOME and an empty /boot, `setup.sh --dry-run` exits 0, names
//! every package and cargo tool the tests need, and changes nothing. The
//! list below is kept apart from setup.sh on purpose: deleting a package
//! line there fails this test on any machine, including one that already
//! has everything.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// What the test suite needs on a fresh bookworm machine, as setup.sh must
/// name it: (kind, name). Change it only with a test that needs it.
const NEEDED: &[(&str, &str)] = &[
    ("apt package", "build-essential"),
    ("apt package", "fio"),
    ("apt package", "busybox-static"),
    ("apt package", "cpio"),
    ("apt package", "xz-utils"),
    ("apt package", "attr"),
    ("apt package", "xfsprogs"),
    ("apt package", "e2fsprogs"),
    ("apt package", "shellcheck"),
    ("apt package", "systemd"),
    ("apt package", "systemd-container from bookworm-backports"),
    ("apt package", "python3"),
    ("apt package", "python3-prometheus-client"),
    ("apt package", "tmux"),
    ("apt package", "qemu-system-x86 from bookworm-backports"),
    ("apt package", "linux-image-amd64 from bookworm-backports"),
    ("apt package", "ceph-mon"),
    ("apt package", "ceph-osd"),
    ("apt package", "ceph-mgr"),
    ("apt package", "ceph-common"),
    ("apt package", "librbd-dev"),
    ("apt package", "librados-dev"),
    ("apt package", "iproute2"),
    ("apt package", "qemu-block-extra from bookworm-backports"),
    ("cargo tool", "pjdfstest"),
    ("cargo tool", "fsx"),
    ("rust toolchain", "nightly"),
];

/// The few tools a bare machine is sure to have; everything setup.sh probes
/// for is missing from this PATH.
const BASIC_TOOLS: &[&str] = &["bash", "sed", "grep", "cat", "env"];

struct Bare {
    dir: PathBuf,
}

impl Bare {
    /// A bare machine of its own for each test (tests run in parallel, and
    /// each removes its tree when done).
    fn new(test: &str) -> Bare {
        let dir = std::env::temp_dir().join(format!("keelfs-setup-bare-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["bin", "home", "cargo", "root"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        for tool in BASIC_TOOLS {
            let found = which(tool).unwrap_or_else(|| panic!("this machine has no {tool}"));
            std::os::unix::fs::symlink(found, dir.join("bin").join(tool)).unwrap();
        }
        Bare { dir }
    }

    fn dry_run(&self, script: &Path) -> Output {
        Command::new(self.dir.join("bin/bash"))
            .arg(script)
            .arg("--dry-run")
            .env_clear()
            .env("PATH", self.dir.join("bin"))
            .env("HOME", self.dir.join("home"))
            .env("CARGO_HOME", self.dir.join("cargo"))
            .env("KEELFS_SETUP_ROOT", self.dir.join("root"))
            .output()
            .unwrap()
    }
}

impl Drop for Bare {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(tool)).find(|c| c.is_file())
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// The lines of NEEDED that a dry run's output does not print.
fn unnamed(stdout: &str) -> Vec<String> {
    NEEDED
        .iter()
        .map(|(kind, name)| format!("setup: install {kind} {name}:"))
        .filter(|line| !stdout.lines().any(|l| l.starts_with(line.as_str())))
        .collect()
}

#[test]
fn setup_dry_run_on_a_bare_machine_names_every_needed_package() {
    let bare = Bare::new("names");
    let out = bare.dry_run(&repo().join("scripts/setup.sh"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let text = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "setup.sh --dry-run must exit 0 on a bare machine:\n{text}");
    let missing = unnamed(&stdout);
    assert!(missing.is_empty(), "setup.sh --dry-run does not name {missing:#?}\n{text}");
    assert!(stdout.contains("setup: add user tests"), "the pjdfstest user is not named:\n{text}");
    assert!(stdout.contains("setup: enable FUSE over io_uring"), "FUSE over io_uring is not named:\n{text}");
    assert!(stdout.contains("missing: cargo"), "a machine without cargo is not told so:\n{text}");
    assert!(stdout.contains("nothing changed"), "{text}");
    // A dry run writes nothing, not even the backports source.
    let written: Vec<_> = std::fs::read_dir(bare.dir.join("root")).unwrap().collect();
    assert!(written.is_empty(), "the dry run wrote {written:?}");
}

#[test]
fn setup_rejects_an_unknown_argument_with_exit_2() {
    let out = Command::new("bash").arg(repo().join("scripts/setup.sh")).arg("--bogus").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown argument '--bogus'"));
}

/// The check above can fail: a copy of setup.sh with one package line cut
/// leaves exactly that package unnamed.
#[test]
fn the_dry_run_test_catches_a_deleted_package_line() {
    let script = std::fs::read_to_string(repo().join("scripts/setup.sh")).unwrap();
    let cut: String = script.lines().filter(|l| !l.contains("want_apt xfsprogs")).map(|l| format!("{l}\n")).collect();
    assert_ne!(cut.len(), script.len(), "setup.sh has no want_apt xfsprogs line to cut");
    let bare = Bare::new("cut");
    let copy = bare.dir.join("setup-cut.sh");
    std::fs::write(&copy, cut).unwrap();
    let out = bare.dry_run(&copy);
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(unnamed(&stdout), ["setup: install apt package xfsprogs:"], "{stdout}");
}
