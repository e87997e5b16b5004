//! `mount -t fuse.keelfs IMAGE DIR [-o OPTIONS]`, and fstab lines of that
//! type: mount(8) runs /sbin/mount.fuse.keelfs (a link to keelfsd) as
//! `mount.fuse.keelfs IMAGE DIR [-n] [-s] [-v] [-o OPTIONS]`. The helper
//! starts `keelfsd serve` in the background with a host mount only, waits
//! until it is ready, and returns; the server exits by itself once the
//! mount is unmounted.

use std::ffi::OsString;
use std::io::{Read, Seek};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::tools::UsageError;

/// The name mount(8) runs for `-t fuse.keelfs`.
pub const HELPER_NAME: &str = "mount.fuse.keelfs";
/// How long the helper waits for the server to be ready (a large journal
/// to replay takes a while).
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// The line `keelfsd serve` prints once every export is served.
const READY_LINE: &str = "keelfsd: ready (";

/// What the command line asks for.
#[derive(Debug, Default, PartialEq, Eq)]
struct Request {
    image: PathBuf,
    dir: PathBuf,
    read_only: bool,
    remount: bool,
    /// The mount's type is fuse.SUBTYPE, or plain fuse when empty.
    subtype: Option<String>,
    fsname: Option<String>,
    /// Flags passed on to `keelfsd serve`.
    serve_flags: Vec<String>,
    /// mount(2) options, for `keelfsd serve --fuse-options`.
    mount_options: Vec<String>,
    /// Where the server's messages go (appended); by default nowhere once
    /// it is ready.
    log: Option<PathBuf>,
}

/// mount(2) options a host mount takes, and their flags. nosuid and nodev
/// are the default: an image is untrusted, so its device nodes and set-id
/// files count only when the mount asks for `dev` and `suid`.
const MOUNT_FLAGS: &[(&str, libc::c_ulong)] = &[
    ("noexec", libc::MS_NOEXEC),
    ("noatime", libc::MS_NOATIME),
    ("nodiratime", libc::MS_NODIRATIME),
    ("relatime", libc::MS_RELATIME),
    ("strictatime", libc::MS_STRICTATIME),
    ("lazytime", libc::MS_LAZYTIME),
    ("sync", libc::MS_SYNCHRONOUS),
    ("dirsync", libc::MS_DIRSYNC),
];

/// mount(2) flags for a comma-separated list of [`MOUNT_FLAGS`] names,
/// `dev`, `suid` and their opposites.
pub fn mount_flags(options: &str) -> Result<libc::c_ulong, UsageError> {
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
    for option in options.split(',').filter(|o| !o.is_empty()) {
        match option {
            "dev" => flags &= !libc::MS_NODEV,
            "suid" => flags &= !libc::MS_NOSUID,
            "nodev" => flags |= libc::MS_NODEV,
            "nosuid" => flags |= libc::MS_NOSUID,
            "exec" | "async" | "atime" | "diratime" => {}
            _ => match MOUNT_FLAGS.iter().find(|(name, _)| *name == option) {
                Some((_, flag)) => flags |= flag,
                None => return Err(UsageError(format!("unknown host mount option {option:?}"))),
            },
        }
    }
    Ok(flags)
}

/// Options mount(8) and fstab pass that change nothing here: keelfsd's
/// host mounts are always allow_other and default_permissions.
const IGNORED: &[&str] = &[
    "defaults",
    "auto",
    "noauto",
    "user",
    "nouser",
    "users",
    "owner",
    "group",
    "_netdev",
    "nofail",
    "allow_other",
    "default_permissions",
    "silent",
    "loud",
];

fn parse_options(request: &mut Request, options: &str) -> Result<(), UsageError> {
    for option in options.split(',').filter(|o| !o.is_empty()) {
        let (key, value) = option.split_once('=').map_or((option, None), |(k, v)| (k, Some(v)));
        match (key, value) {
            ("ro", None) => request.read_only = true,
            ("rw", None) => request.read_only = false,
            ("remount", None) => request.remount = true,
            ("subtype", Some(v)) => request.subtype = Some(v.to_owned()),
            ("fsname", Some(v)) => request.fsname = Some(v.to_owned()),
            ("cache" | "locks" | "sandbox" | "reactors" | "rpc" | "socket" | "tag" | "queues" | "config", Some(v)) => {
                request.serve_flags.extend([format!("--{key}"), v.to_owned()]);
            }
            ("snapshot", Some(v)) => {
                request.read_only = true;
                request.serve_flags.extend(["--snapshot".into(), v.to_owned()]);
            }
            ("fuse_transport", Some(v)) => request.serve_flags.extend(["--fuse-transport".into(), v.to_owned()]),
            ("log", Some(v)) => request.log = Some(PathBuf::from(v)),
            (k, None) if mount_flags(k).is_ok() => request.mount_options.push(k.to_owned()),
            (k, None) if IGNORED.contains(&k) => {}
            (k, _) if k.starts_with("x-") || k == "comment" => {}
            _ => return Err(UsageError(format!("unknown mount option {option:?} (see README, \"Mounting\")"))),
        }
    }
    Ok(())
}

fn parse(args: &[OsString]) -> Result<Request, UsageError> {
    let mut request = Request::default();
    let mut positional = Vec::new();
    let mut args = args.iter().map(|a| a.to_string_lossy().into_owned());
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-o" => parse_options(&mut request, &args.next().ok_or(UsageError("-o needs options".into()))?)?,
            "-t" => {
                let fstype = args.next().ok_or(UsageError("-t needs a type".into()))?;
                request.subtype = request.subtype.take().or(fstype.strip_prefix("fuse.").map(str::to_owned));
            }
            "-n" | "-s" | "-f" | "-v" => {}
            o if o.starts_with("-o") => parse_options(&mut request, &o[2..])?,
            o if o.starts_with('-') => return Err(UsageError(format!("unknown flag {o}"))),
            _ => positional.push(arg),
        }
    }
    let [image, dir] = <[String; 2]>::try_from(positional)
        .map_err(|_| UsageError(format!("usage: {HELPER_NAME} IMAGE DIR [-o OPTIONS]")))?;
    (request.image, request.dir) = (PathBuf::from(image), PathBuf::from(dir));
    Ok(request)
}

/// The mount(2) options of a helper's mount. mount(8) hands a helper only
/// the flags that differ from its defaults (`nosuid`, never `suid`), so a
/// helper's mount starts from mount(8)'s defaults, dev and suid, as
/// libfuse's does for root; `--fuse-mount` keeps nosuid,nodev.
fn helper_mount_options(given: &[String]) -> String {
    ["dev", "suid"].iter().map(|o| o.to_string()).chain(given.iter().cloned()).collect::<Vec<_>>().join(",")
}

/// Run as mount(8)'s helper with `args` (after the program name).
pub fn run(args: &[OsString]) -> anyhow::Result<ExitCode> {
    let request = parse(args)?;
    if request.remount {
        return remount(&request);
    }
    let fstype = match request.subtype.as_deref() {
        Some("") => "fuse".to_owned(),
        Some(subtype) => format!("fuse.{subtype}"),
        None => "fuse.keelfs".to_owned(),
    };
    let source = request.fsname.clone().unwrap_or_else(|| request.image.to_string_lossy().into_owned());
    let mut serve = Command::new(std::env::current_exe().context("finding keelfsd's own path")?);
    serve.arg("serve").arg("--device").arg(&request.image).arg("--fuse-mount").arg(&request.dir);
    serve.args(["--fuse-source", &source, "--fuse-type", &fstype]).args(&request.serve_flags);
    if request.read_only {
        serve.arg("--read-only");
    }
    serve.arg("--fuse-options").arg(helper_mount_options(&request.mount_options));
    let log = match &request.log {
        Some(path) => std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .with_context(|| format!("the log file {}", path.display()))?,
        None => unlinked_log_file()?,
    };
    serve.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log.try_clone()?);
    // Its own process group: a terminal's hangup or ^C is not its concern.
    serve.process_group(0);
    let start = log.metadata()?.len();
    let child = serve.spawn().context("starting keelfsd serve")?;
    wait_ready(child, log, start)
}

/// A file for the server's messages: read back if it fails to start.
fn unlinked_log_file() -> anyhow::Result<std::fs::File> {
    let path = std::env::temp_dir().join(format!("keelfsd-mount-{}.log", std::process::id()));
    let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
    std::fs::remove_file(&path)?;
    Ok(file)
}

/// Wait until the server says it is ready in `log`, reading from `start`
/// (a log= file may hold earlier runs).
fn wait_ready(mut child: std::process::Child, mut log: std::fs::File, start: u64) -> anyhow::Result<ExitCode> {
    let deadline = Instant::now() + READY_TIMEOUT;
    let mut text = String::new();
    loop {
        text.clear();
        log.seek(std::io::SeekFrom::Start(start))?;
        // The log is the server's start-up messages: a few lines.
        (&mut log).take(1 << 20).read_to_string(&mut text)?;
        if text.contains(READY_LINE) {
            return Ok(ExitCode::SUCCESS);
        }
        if let Some(status) = child.try_wait()? {
            bail!("keelfsd serve exited ({status}) before the mount was ready:\n{}", text.trim_end());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("keelfsd serve was not ready after {READY_TIMEOUT:?}:\n{}", text.trim_end());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `mount -o remount,ro DIR` (or rw): the kernel's FUSE mount takes the
/// flag; a read-only remount makes the host kernel refuse changes.
fn remount(request: &Request) -> anyhow::Result<ExitCode> {
    use std::os::unix::ffi::OsStrExt;
    let dir = std::ffi::CString::new(request.dir.as_os_str().as_bytes())?;
    let flags = mount_flags(&helper_mount_options(&request.mount_options))?;
    let flags = libc::MS_REMOUNT | flags | if request.read_only { libc::MS_RDONLY } else { 0 };
    // SAFETY: a NUL-terminated path that outlives the call; no source,
    // type or data.
    let rc = unsafe { libc::mount(std::ptr::null(), dir.as_ptr(), std::ptr::null(), flags, std::ptr::null()) };
    if rc != 0 {
        bail!("remounting {}: {}", request.dir.display(), std::io::Error::last_os_error());
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(args: &[&str]) -> Result<Request, UsageError> {
        parse(&args.iter().map(OsString::from).collect::<Vec<_>>())
    }

    #[test]
    fn a_snapshot_option_serves_it_read_only() {
        let r = parsed(&["/img", "/mnt", "-o", "rw,snapshot=nightly"]).unwrap();
        assert!(r.read_only, "a snapshot is read-only");
        assert_eq!(r.serve_flags, ["--snapshot", "nightly"]);
    }

    #[test]
    fn mount_8_argument_forms_are_understood() {
        let r = parsed(&["/img", "/mnt", "-o", "rw,ro,cache=none,subtype=,x-systemd.automount", "-n"]).unwrap();
        assert_eq!((r.image.to_str(), r.dir.to_str(), r.read_only), (Some("/img"), Some("/mnt"), true));
        assert_eq!(r.subtype.as_deref(), Some(""));
        assert_eq!(r.serve_flags, ["--cache", "none"]);
        let r = parsed(&["-t", "fuse.other", "/img", "/mnt", "-ofsname=disk,remount"]).unwrap();
        assert_eq!((r.subtype.as_deref(), r.fsname.as_deref(), r.remount), (Some("other"), Some("disk"), true));
        assert!(parsed(&["/img"]).is_err());
        assert!(parsed(&["/img", "/mnt", "/extra"]).is_err());
        assert!(parsed(&["/img", "/mnt", "-o", "bogus"]).is_err());
        assert!(parsed(&["/img", "/mnt", "-o", "cache"]).is_err(), "cache needs a value");
        assert!(parsed(&["/img", "/mnt", "-X"]).is_err());
        let r = parsed(&["/img", "/mnt", "-o", "fuse_transport=uring"]).unwrap();
        assert_eq!(r.serve_flags, ["--fuse-transport", "uring"]);
    }
}
