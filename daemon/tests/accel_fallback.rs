//! Guests run under TCG on a host whose KVM cannot boot Linux (issue 32).
//! Some hosts have a /dev/kvm that runs firmware but stops a Linux kernel
//! at once ("KVM internal error. Suberror: 1"), after which QEMU sits
//! paused and silent. run-guest.sh must see that by booting the guest
//! kernel itself, fall back to TCG and say so, and every driver script
//! must then pass. Here a stand-in `qemu-system-x86_64`, first on PATH,
//! behaves like such a host with accel=kvm and runs the real QEMU
//! otherwise; a scratch file stands in for /dev/kvm, so the probe runs
//! whatever this host has.
//!
//! The same stand-in also aborts as QEMU 10's multi-threaded TCG was
//! seen to in CI (its iotlb_to_section assertion, 3 s into a boot):
//! run-guest.sh boots again when that happens before the guest's script
//! starts, and only then.
//!
//! scripts/setup.sh installs QEMU and the guest kernel; nothing is skipped
//! when they are missing.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::Scratch;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

fn real_qemu() -> String {
    let out = Command::new("sh").arg("-c").arg("command -v qemu-system-x86_64").output().unwrap();
    assert!(out.status.success(), "qemu-system-x86_64 is missing: run scripts/setup.sh");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// A host whose QEMU misbehaves as its prelude says (shell made from the
/// host's scratch directory, run first on every start) and runs the real
/// QEMU otherwise; with a usable-looking KVM device and a probe cache of
/// its own.
struct FakeQemuHost {
    scratch: Scratch,
}

impl FakeQemuHost {
    fn new(name: &str, prelude: impl FnOnce(&Scratch) -> String) -> Self {
        let scratch = Scratch::new(name);
        let prelude = prelude(&scratch);
        let bin = scratch.path("bin");
        std::fs::create_dir(&bin).unwrap();
        let fake = bin.join("qemu-system-x86_64");
        std::fs::write(&fake, format!("#!/bin/sh\n{prelude}exec '{real}' \"$@\"\n", real = real_qemu())).unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(scratch.path("kvm"), b"").unwrap();
        FakeQemuHost { scratch }
    }

    /// A host whose KVM stops Linux: with accel=kvm, what QEMU printed on
    /// such a host, then silence until killed. Every KVM start is counted.
    fn broken_kvm(name: &str) -> Self {
        Self::new(name, |scratch| {
            format!(
                "case \"$*\" in\n*accel=kvm*)\n  echo kvm >>'{count}'\n  \
                 echo 'KVM internal error. Suberror: 1' >&2\n  echo 'emulation failure' >&2\n  \
                 exec sleep 3600 ;;\nesac\n",
                count = scratch.path("kvm-starts").display()
            )
        })
    }

    /// `bash SCRIPT ARGS` with this host's QEMU, KVM device and cache.
    fn run(&self, script: &str, args: &[&std::ffi::OsStr]) -> (Output, String) {
        let path = format!("{}:{}", self.scratch.path("bin").display(), std::env::var("PATH").unwrap());
        let out = Command::new("bash")
            .arg(repo().join(script))
            .args(args)
            .env("PATH", path)
            .env("KEELFS_KVM_DEV", self.scratch.path("kvm"))
            .env("KEELFS_KVM_PROBE_CACHE", self.scratch.path("probe-cache"))
            .env_remove("KEELFS_ACCEL")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        (out, text)
    }

    fn kvm_starts(&self) -> usize {
        std::fs::read_to_string(self.scratch.path("kvm-starts")).unwrap_or_default().lines().count()
    }

    fn guest_script(&self, text: &str) -> PathBuf {
        let script = self.scratch.path("guest.sh");
        std::fs::write(&script, text).unwrap();
        script
    }

    fn nvme_image(&self) -> PathBuf {
        let image = self.scratch.path("nvme.img");
        std::fs::File::create(&image).unwrap().set_len(64 << 20).unwrap();
        image
    }
}

#[test]
fn a_kvm_that_stops_linux_falls_back_to_tcg_once_per_boot() {
    let host = FakeQemuHost::broken_kvm("accel-fallback");
    let script = host.guest_script(
        "#!/bin/sh\necho \"guest: running under $(cat /proc/cpuinfo | grep -c ^processor) CPUs\"\nexit 0\n",
    );
    let image = host.nvme_image();
    let args = [
        "--nvme".as_ref(),
        image.as_os_str(),
        "--timeout".as_ref(),
        "600".as_ref(),
        "--script".as_ref(),
        script.as_os_str(),
    ];
    let (out, text) = host.run("qemu-scripts/run-guest.sh", &args);
    assert!(out.status.success(), "the guest must pass under TCG:\n{text}");
    assert!(
        text.contains(
            "KVM cannot run the guest here (KVM stopped the guest kernel (KVM internal error)); falling back to TCG"
        ),
        "the fallback is logged with its reason:\n{text}"
    );
    assert!(text.contains("booting: accel=tcg"), "{text}");
    assert!(text.contains("guest: running under"), "the guest ran its script:\n{text}");
    assert_eq!(host.kvm_starts(), 1, "one probe under KVM");

    // The answer holds for this boot: a second guest does not probe again.
    let (out, text) = host.run("qemu-scripts/run-guest.sh", &args);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("falling back to TCG") && text.contains("booting: accel=tcg"), "{text}");
    assert_eq!(host.kvm_starts(), 1, "the probe's answer was reused");
}

#[test]
fn kvm_asked_for_by_name_fails_at_once_instead_of_hanging() {
    let host = FakeQemuHost::broken_kvm("accel-kvm");
    let script = host.guest_script("#!/bin/sh\nexit 0\n");
    let image = host.nvme_image();
    let args = [
        "--accel".as_ref(),
        "kvm".as_ref(),
        "--nvme".as_ref(),
        image.as_os_str(),
        "--script".as_ref(),
        script.as_os_str(),
    ];
    let (out, text) = host.run("qemu-scripts/run-guest.sh", &args);
    assert_eq!(out.status.code(), Some(125), "QEMU stopped without the guest's status:\n{text}");
    assert!(text.contains("KVM stopped the guest (KVM internal error): use --accel tcg (or auto)"), "{text}");
    assert_eq!(host.kvm_starts(), 1, "no probe when KVM was named");
}

#[test]
fn the_demo_runs_to_its_summary_on_such_a_host() {
    let host = FakeQemuHost::broken_kvm("accel-demo");
    let keelfsd = env!("CARGO_BIN_EXE_keelfsd");
    let (out, text) = host.run("qemu-scripts/demo.sh", &["--keelfsd".as_ref(), keelfsd.as_ref()]);
    eprintln!("{text}");
    assert!(out.status.success(), "demo.sh failed:\n{text}");
    assert!(text.contains("falling back to TCG"), "{text}");
    assert!(text.contains("keelfs demo: fio workloads in a QEMU guest (accel=tcg) over vhost-user-fs"), "{text}");
    for workload in ["w1-dio-overwrite", "w2-aio-append", "w3-buffered-randrw"] {
        let row =
            text.lines().find(|l| l.starts_with(workload)).unwrap_or_else(|| panic!("no {workload} row:\n{text}"));
        assert!(row.trim_end().ends_with(" ok"), "{workload}: {row}\n{text}");
    }
    assert!(text.contains("demo.sh: done"), "{text}");
}

/// A host whose multi-threaded TCG aborts on QEMU 10's iotlb_to_section
/// assertion on its first `aborts` starts (every start is counted); with
/// `after_start`, only after the guest's script has started (its marker
/// written to the console, as the guest's /init does).
fn tcg_aborting(name: &str, aborts: usize, after_start: bool) -> FakeQemuHost {
    FakeQemuHost::new(name, |scratch| {
        let mark = if after_start { "  echo KEELFS-GUEST-START >>\"$con\"\n" } else { "" };
        format!(
            "echo start >>'{count}'\nif [ \"$(wc -l <'{count}')\" -le {aborts} ]; then\n  con=\n  \
             for a in \"$@\"; do case \"$a\" in file,id=con,path=*) con=${{a#*path=}}; con=${{con%%,*}} ;; \
             esac; done\n{mark}  echo \"qemu-system-x86_64: ../system/physmem.c:2678: iotlb_to_section: \
             Assertion \\`section_index < d->map.sections_nb' failed.\" >&2\n  ulimit -c 0\n  \
             kill -ABRT $$\nfi\n",
            count = scratch.path("qemu-starts").display()
        )
    })
}

/// A host whose QEMU hangs silently, before the guest kernel prints a
/// line, on its first `hangs` starts (every start is counted), as TCG was
/// seen to in CI.
fn tcg_hanging(name: &str, hangs: usize) -> FakeQemuHost {
    FakeQemuHost::new(name, |scratch| {
        format!(
            "echo start >>'{count}'\nif [ \"$(wc -l <'{count}')\" -le {hangs} ]; then\n  \
             exec sleep 3600\nfi\n",
            count = scratch.path("qemu-starts").display()
        )
    })
}

impl FakeQemuHost {
    fn qemu_starts(&self) -> usize {
        std::fs::read_to_string(self.scratch.path("qemu-starts")).unwrap_or_default().lines().count()
    }

    /// run-guest.sh under TCG with `script_text` as the guest's script.
    fn run_tcg_guest(&self, script_text: &str) -> (Output, String) {
        self.run_tcg_guest_with(script_text, &[])
    }

    /// run_tcg_guest with `extra` arguments to run-guest.sh.
    fn run_tcg_guest_with(&self, script_text: &str, extra: &[&str]) -> (Output, String) {
        let script = self.guest_script(script_text);
        let image = self.nvme_image();
        let args = ["--accel".as_ref(), "tcg".as_ref(), "--timeout".as_ref(), "600".as_ref(), "--nvme".as_ref()];
        let extra: Vec<&std::ffi::OsStr> = extra.iter().map(|a| a.as_ref()).collect();
        let args = [&args[..], &[image.as_os_str(), "--script".as_ref(), script.as_os_str()], &extra].concat();
        self.run("qemu-scripts/run-guest.sh", &args)
    }
}

#[test]
fn a_tcg_abort_before_the_script_starts_boots_the_guest_again() {
    let host = tcg_aborting("tcg-abort-retry", 1, false);
    let (out, text) = host.run_tcg_guest("#!/bin/sh\necho 'guest: the script ran'\nexit 0\n");
    assert!(out.status.success(), "the second boot must pass:\n{text}");
    assert!(text.contains("QEMU aborted before the guest's script started (boot 1"), "{text}");
    assert!(text.contains("qemu: qemu-system-x86_64: ../system/physmem.c:2678: iotlb_to_section"), "{text}");
    assert!(text.contains("guest: the script ran"), "{text}");
    assert_eq!(host.qemu_starts(), 2, "one abort, one boot that ran the script");
}

#[test]
fn a_tcg_abort_every_time_fails_after_three_boots() {
    let host = tcg_aborting("tcg-abort-always", 99, false);
    let (out, text) = host.run_tcg_guest("#!/bin/sh\nexit 0\n");
    assert_eq!(out.status.code(), Some(125), "QEMU ended without the guest's status:\n{text}");
    assert!(text.contains("QEMU exited (status 134)"), "{text}");
    assert_eq!(host.qemu_starts(), 3, "three boots, then the failure");
}

#[test]
fn a_tcg_abort_after_the_script_started_is_a_failure() {
    let host = tcg_aborting("tcg-abort-late", 1, true);
    let (out, text) = host.run_tcg_guest("#!/bin/sh\nexit 0\n");
    assert_eq!(out.status.code(), Some(125), "the test had begun: no second boot:\n{text}");
    assert!(!text.contains("booting again"), "{text}");
    assert_eq!(host.qemu_starts(), 1);
}

// With --verbose, the guest kernel prints its first line about 1.4 s into
// a TCG boot here: a 30 s deadline holds the stand-in's hang to it and
// leaves the real boot twenty times what it needs.
#[test]
fn a_guest_silent_past_its_boot_deadline_is_booted_again() {
    let host = tcg_hanging("tcg-hang-retry", 1);
    let script = "#!/bin/sh\necho 'guest: the script ran'\nexit 0\n";
    let (out, text) = host.run_tcg_guest_with(script, &["--verbose", "--boot-within", "30"]);
    assert!(out.status.success(), "the second boot must pass:\n{text}");
    assert!(text.contains("the guest printed nothing in 30s (boot 1, accel=tcg)"), "{text}");
    assert!(text.contains("a hang before its first line; booting again"), "{text}");
    assert!(text.contains("guest: the script ran"), "{text}");
    assert_eq!(host.qemu_starts(), 2, "one hang, one boot that ran the script");
}

#[test]
fn a_guest_silent_on_every_boot_fails_after_three() {
    let host = tcg_hanging("tcg-hang-always", 99);
    let (out, text) = host.run_tcg_guest_with("#!/bin/sh\nexit 0\n", &["--boot-within", "3"]);
    assert_eq!(out.status.code(), Some(126), "{text}");
    assert!(text.contains("the guest printed nothing in 3s on each of 3 boots (accel=tcg)"), "{text}");
    assert_eq!(host.qemu_starts(), 3, "three boots, then the failure");
}
