//! `keelfsd serve`: reactors, exports, and their lifecycle.
//!
//! One reactor per configured CPU (or count). Each export (a filesystem on
//! its own device, served on a vhost-user-fs socket and/or a /dev/fuse
//! mount) is owned by one reactor: its filesystem, its device queue and
//! its virtqueues live there (with `spread_queues`, the other reactors
//! poll some request queues too and send the owner what they cannot serve
//! from the cache), and exports are spread over the reactors round-robin. The main thread owns nothing on an I/O path: it
//! starts the reactors, waits for signals, and talks to reactors only
//! through their lock-free inboxes.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;

use anyhow::{bail, Context};
use keelfs_bdev::{BlockDevice, QueueConfig};
use keelfs_fs::{AtimeUpdates, DiscardConfig, Fs, FsConfig};
use keelfs_reactor::DeviceChannel;
use keelfs_reactor::{self as reactor, CpuLoadProbe, PollMode, Reactor, ReactorConfig, ReactorHandle};
use keelfs_vhost::OpStats;
use keelfs_vhost::SocketAccess;
use keelfs_vhost::{probe_fuse_uring, serve_dev_fuse_over as serve_fuse, FuseMount, FuseUringPlan};
use keelfs_vhost::{CacheMode, Clients, Coherence, Session, SessionConfig, SessionState, TraceWriter};
use keelfs_vhost::{ImageAccess, ServeOptions, VhostUserServer};
use keelfs_vhost::{Qos, QosError, QosLimits};
use serde_json::{json, Value};

pub use crate::config::Cache;
use crate::config::{self, Config, Export, FuseTransport, PollModeName};
use crate::control::{Control, ExportEntry, ExportTable, Lifecycle};
use crate::image::{ExportImage, SessionFile};
use crate::lock::ImageLock;
use crate::sandbox::{Needs, SandboxMode};
use crate::signals::{block_termination_signals, Signals};
use crate::supervisor::{Cleanup, Role, SupervisorLink};
use crate::{device, rpc, sandbox, supervisor, tools};

pub const DEFAULT_DIR: &str = "keelfs-data";

/// Command-line flags; each one given overrides the config file.
#[derive(Default)]
pub struct ServeArgs {
    pub config: Option<PathBuf>,
    pub device: Option<PathBuf>,
    pub fuse_mount: Option<PathBuf>,
    pub fuse_source: Option<String>,
    pub fuse_type: Option<String>,
    pub fuse_options: Option<String>,
    pub fuse_transport: Option<config::FuseTransport>,
    pub socket: Option<PathBuf>,
    pub tag: Option<String>,
    pub queues: Option<usize>,
    pub spread_queues: bool,
    pub cache: Option<Cache>,
    pub locks: Option<config::Locks>,
    pub reactors: Option<usize>,
    pub rpc: Option<PathBuf>,
    pub check: bool,
    pub sandbox: Option<SandboxMode>,
    pub read_only: bool,
    pub snapshot: Option<String>,
    pub no_xattr: bool,
    pub trace_requests: Option<PathBuf>,
    pub incoming: bool,
}

/// The embedded default image, created and formatted on first use.
fn default_device() -> anyhow::Result<PathBuf> {
    let dir = Path::new(DEFAULT_DIR);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let image = dir.join("keelfs.img");
    if !image.exists() {
        format_default_image(&image)?;
    }
    Ok(image)
}

/// Format the embedded default image in a child `keelfsd mkfs`, under a
/// temporary name that becomes `image` only once the format succeeded.
///
/// A child, because formatting uses io_uring, whose kernel workers are
/// threads of the process that submitted and outlive the ring for a
/// while; the sandbox must then be entered by a process of one thread
/// (issue 32: the first `keelfsd serve` in an empty directory failed on
/// exactly this). The temporary name keeps an interrupted format from
/// leaving an unformatted image that the next run would try to serve.
fn format_default_image(image: &Path) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding keelfsd's own binary to run mkfs")?;
    let partial = image.with_extension("img.new");
    // A leftover of an interrupted first run: it was never served.
    match std::fs::remove_file(&partial) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("removing {}", partial.display()));
        }
        _ => {}
    }
    // std::process resets the child's signal mask, so a ^C during the
    // format reaches it.
    let out = std::process::Command::new(exe)
        .arg("mkfs")
        .arg(&partial)
        .arg("--size")
        .arg(tools::DEFAULT_IMAGE_BYTES.to_string())
        .output()
        .context("starting keelfsd mkfs for the embedded default image")?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&partial);
        bail!(
            "formatting the embedded default image {} failed ({}): {}",
            image.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    std::fs::rename(&partial, image)
        .with_context(|| format!("renaming {} to {}", partial.display(), image.display()))?;
    eprintln!(
        "keelfsd: created and formatted the embedded default image {} ({} GiB, sparse)",
        image.display(),
        tools::DEFAULT_IMAGE_BYTES >> 30
    );
    Ok(())
}

/// The config file (or the defaults), with the flags applied on top.
/// Flags that describe an export apply to the first one, and create it
/// when the file names none.
fn resolve(args: ServeArgs) -> anyhow::Result<Config> {
    let mut config = match &args.config {
        Some(path) => config::load(path).map_err(|e| tools::UsageError(e.to_string()))?,
        None => Config::default(),
    };
    if let Some(n) = args.reactors {
        config.reactors = vec![None; n];
    }
    if args.rpc.is_some() {
        config.rpc_socket = args.rpc.clone();
    }
    if let Some(mode) = args.sandbox {
        config.sandbox = mode;
    }
    config.incoming |= args.incoming;
    let flags_shape_an_export = args.device.is_some()
        || args.socket.is_some()
        || args.fuse_mount.is_some()
        || args.fuse_source.is_some()
        || args.fuse_type.is_some()
        || args.fuse_options.is_some()
        || args.fuse_transport.is_some()
        || args.tag.is_some()
        || args.queues.is_some()
        || args.spread_queues
        || args.read_only
        || args.snapshot.is_some()
        || args.cache.is_some()
        || args.locks.is_some();
    if config.exports.is_empty() || flags_shape_an_export {
        if config.exports.is_empty() {
            config.exports.push(Export::new("keelfs", PathBuf::new()));
        }
        let export = &mut config.exports[0];
        apply_export_flags(&args, export)?;
        if export.device.as_os_str().is_empty() {
            export.device = default_device()?;
        }
        if export.socket.is_none() && export.fuse_mount.is_none() {
            std::fs::create_dir_all(DEFAULT_DIR).with_context(|| format!("creating {DEFAULT_DIR}"))?;
            export.socket = Some(Path::new(DEFAULT_DIR).join("keelfs.sock"));
        }
    }
    Ok(config)
}

/// The flags that describe an export, applied to `export`.
fn apply_export_flags(args: &ServeArgs, export: &mut Export) -> anyhow::Result<()> {
    if let Some(tag) = &args.tag {
        export.tag = tag.clone();
    }
    if let Some(device) = &args.device {
        export.device = device.clone();
    }
    if let Some(socket) = &args.socket {
        export.socket = Some(socket.clone());
    }
    if let Some(mount) = &args.fuse_mount {
        export.fuse_mount = Some(mount.clone());
    }
    if let Some(source) = &args.fuse_source {
        export.fuse_source = source.clone();
    }
    if let Some(fstype) = &args.fuse_type {
        export.fuse_type = fstype.clone();
    }
    if let Some(options) = &args.fuse_options {
        export.fuse_mount_flags = crate::mount_helper::mount_flags(options)?;
    }
    if let Some(transport) = args.fuse_transport {
        export.fuse_transport = transport;
    }
    if let Some(queues) = args.queues {
        export.request_queues = queues;
    }
    if args.spread_queues {
        export.spread_queues = true;
    }
    if args.read_only {
        export.read_only = true;
    }
    if let Some(name) = &args.snapshot {
        keelfs_fs::check_snapshot_name(name).map_err(|why| anyhow::anyhow!("--snapshot {name:?}: {why}"))?;
        export.snapshot = Some(name.clone());
        export.read_only = true;
    }
    if args.no_xattr {
        export.xattr = false;
    }
    if let Some(path) = &args.trace_requests {
        if export.fuse_mount.is_none() {
            anyhow::bail!("--trace-requests records a host mount's requests: it needs --fuse-mount");
        }
        export.trace_requests = Some(path.clone());
    }
    if let Some(cache) = args.cache {
        export.cache = cache;
    }
    if let Some(locks) = args.locks {
        export.locks = locks;
    }
    Ok(())
}

fn init_logging(config: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&config.log));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // systemd sets JOURNAL_STREAM when stderr is the journal.
    let journal = std::env::var_os("JOURNAL_STREAM").is_some();
    let _ = match config.log_format {
        config::LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).try_init(),
        config::LogFormat::Plain if journal && !terminal => builder
            .event_format(crate::logs::SyslogPrefixed(
                tracing_subscriber::fmt::format().without_time().with_target(false),
            ))
            .try_init(),
        config::LogFormat::Plain => builder.with_ansi(terminal).with_target(false).try_init(),
    };
}

/// What export tasks tell the main thread.
pub(crate) enum Event {
    Ready {
        tag: String,
        reactor: usize,
        socket: Option<PathBuf>,
        queues: usize,
    },
    Failed {
        tag: String,
        error: String,
    },
    Stopped {
        tag: String,
        error: Option<String>,
    },
    /// The export's host mount was unmounted (by keelfsd at shutdown, or
    /// by anyone with `umount`).
    MountGone {
        tag: String,
    },
}

pub fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    block_termination_signals().context("blocking SIGTERM/SIGINT")?;
    let signals = Signals::new().context("opening a signalfd")?;
    let check = args.check;
    let mut config = resolve(args)?;
    let rbd_interrupt = sleep_between_rbd_completions(&mut config);
    if check {
        print_check(&config);
        return Ok(ExitCode::SUCCESS);
    }
    make_paths_absolute(&mut config)?;
    if config.incoming {
        if let Some(e) = config.exports.iter().find(|e| !crate::image::migratable(e)) {
            bail!(tools::UsageError(format!(
                "--incoming: export {} cannot be migrated (a host mount's session cannot follow a guest, and a \
                 read-only export is not handed over)",
                e.tag
            )));
        }
    }
    init_logging(&config);
    if rbd_interrupt {
        tracing::info!("every export is on RBD: the reactors sleep between completions (poll_mode = \"interrupt\")");
    }
    // Everything up to here is single-threaded, as a pid namespace and the
    // sandbox need.
    let (link, signals) = match config.sandbox {
        SandboxMode::Namespace => match supervisor::fork_into_pid_namespace(cleanup_of(&config), &signals)? {
            Role::Supervisor(code) => return Ok(code),
            // The supervisor passes each SIGTERM or SIGINT on as this one.
            Role::Server(link) => (Some(Arc::new(link)), Signals::forwarded().context("opening a signalfd")?),
        },
        SandboxMode::None => (None, signals),
    };
    let prepared = open_exports(&config, link.as_ref())?;
    let listeners = Listeners {
        rpc: config.rpc_socket.as_deref().map(rpc::bind).transpose()?,
        metrics: config.metrics_listen.map(crate::metrics::bind).transpose()?,
        cpu_load: open_cpu_load(config.poll_mode),
    };
    let needs = needs_of(&config);
    let sandboxed = config.sandbox == SandboxMode::Namespace;
    if sandboxed {
        sandbox::enter_namespaces(needs).context("entering the sandbox")?;
    }
    // librados starts its threads here: inside the namespaces, before the
    // filter, which then covers them too.
    let opened = connect_exports(prepared, config.incoming)?;
    if sandboxed {
        sandbox::confine(needs, crate::hooks::seccomp_action()).context("entering the sandbox")?;
    } else if has_rbd_export(&config) {
        // What of the sandbox holds for a process with threads: no core
        // dump of guest memory, bounded descriptors.
        sandbox::limit_resources().context("limiting resources")?;
    }
    let result = run(&config, opened, listeners, &signals, link);
    if !sandboxed {
        // Sandboxed, the supervisor does this: the server cannot see them.
        for socket in cleanup_of(&config).sockets {
            let _ = keelfs_vhost::clear_stale(&socket);
        }
    }
    result
}

fn print_check(config: &Config) {
    println!(
        "reactors: {:?}, poll mode {:?}, rpc {:?}, sandbox {:?}",
        config.reactors, config.poll_mode, config.rpc_socket, config.sandbox
    );
    for e in &config.exports {
        println!(
            "export {}: {:?} device {} socket {:?} fuse_mount {:?} cache {:?} queues {} page cache {} MiB{}",
            e.tag,
            e.backend,
            e.device.display(),
            e.socket,
            e.fuse_mount,
            e.cache,
            e.request_queues,
            e.page_cache_bytes >> 20,
            if e.read_only { " read-only" } else { "" }
        );
    }
}

/// Sockets and mount points as absolute paths: the supervisor cleans them
/// up from its own view, and the QEMU arguments name them from inside the
/// sandbox, where nothing can be looked up.
fn make_paths_absolute(config: &mut Config) -> anyhow::Result<()> {
    let absolute_socket = |socket: &Path| -> anyhow::Result<PathBuf> {
        let dir = socket.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let Some(name) = socket.file_name() else {
            bail!(tools::UsageError(format!("{} names no socket file", socket.display())));
        };
        match std::fs::canonicalize(dir) {
            Ok(dir) if dir.is_dir() => Ok(dir.join(name)),
            _ => bail!(tools::UsageError(format!("socket directory {} does not exist", dir.display()))),
        }
    };
    for export in &mut config.exports {
        if let Some(socket) = &export.socket {
            export.socket = Some(absolute_socket(socket)?);
        }
        if let Some(dir) = &export.fuse_mount {
            let dir = std::fs::canonicalize(dir)
                .map_err(|e| tools::UsageError(format!("mount point {}: {e}", dir.display())))?;
            export.fuse_mount = Some(dir);
        }
    }
    if let Some(rpc) = &config.rpc_socket {
        config.rpc_socket = Some(absolute_socket(rpc)?);
    }
    Ok(())
}

fn cleanup_of(config: &Config) -> Cleanup {
    let with_mounts = || config.exports.iter().filter(|e| e.fuse_mount.is_some());
    Cleanup {
        fuse_mounts: with_mounts().filter_map(|e| e.fuse_mount.clone()).collect(),
        fuse_types: with_mounts().map(|e| e.fuse_type.clone()).collect(),
        sockets: config.exports.iter().filter_map(|e| e.socket.clone()).chain(config.rpc_socket.clone()).collect(),
        export_dirs: config.export_dirs.clone(),
    }
}

fn is_rbd_export(export: &Export) -> bool {
    device::is_rbd(&export.device) || export.backend == config::BackendName::Rbd
}

fn has_rbd_export(config: &Config) -> bool {
    config.exports.iter().any(is_rbd_export)
}

/// An RBD request completes after a network round trip (tens to hundreds
/// of microseconds), so an adaptive reactor, which spins for a
/// millisecond after its last work, never sleeps while any is in flight:
/// it spins on a core the OSDs and librbd's threads need. When every
/// export is on RBD and the config did not choose a poll mode, the
/// reactors sleep in epoll instead, woken by the completions' eventfd
/// (bench/RESULTS.md, issue 22: more IOPS at half the CPU per op).
/// Returns whether it chose so.
fn sleep_between_rbd_completions(config: &mut Config) -> bool {
    if config.poll_mode_chosen || config.exports.is_empty() || !config.exports.iter().all(is_rbd_export) {
        return false;
    }
    config.poll_mode = PollModeName::Interrupt;
    true
}

/// What the sandbox must leave to the configured backends.
fn needs_of(config: &Config) -> Needs {
    let vfio = config.exports.iter().any(|e| {
        e.backend == config::BackendName::Nvme || keelfs_bdev::NvmeAddress::is_nvme_name(&e.device.to_string_lossy())
    });
    Needs { vfio, network: has_rbd_export(config) }
}

/// An export with everything it needs from the host already open, so that
/// it can start inside the sandbox.
pub(crate) struct Opened {
    export: Export,
    dev: Arc<dyn BlockDevice>,
    listener: Option<std::os::unix::net::UnixListener>,
    fuse: Option<HostMount>,
    /// The image's lock, held until the export stops (taken later by an
    /// `--incoming` export); None for NVMe.
    lock: Option<ImageLock>,
    /// Where the session is kept across a clean restart, and the one the
    /// last shutdown kept.
    session: Option<(SessionFile, Option<SessionState>)>,
}

/// Lock and open each export's device, bind its socket and mount it
/// through /dev/fuse. The locks are held until the exports stop; an image
/// named by two exports is refused. `--incoming` opens the images without
/// locking them: they are taken when the guests' sessions arrive.
/// A sandboxed daemon only prepares its RBD images (see
/// [`PreparedDevice`]), and [`connect_exports`] finishes them inside the
/// sandbox; an unsandboxed one opens them here, before it binds or mounts
/// anything, as it opens every other device.
fn open_exports(config: &Config, link: Option<&Arc<SupervisorLink>>) -> anyhow::Result<Vec<Prepared>> {
    let defer_rbd = config.sandbox == SandboxMode::Namespace;
    let open = |export: &Export| -> anyhow::Result<Prepared> {
        let device = prepare_device(export, config.incoming, defer_rbd)?;
        Ok(Prepared { device, host: open_host_side(export, link)?, export: export.clone() })
    };
    config.exports.iter().map(open).collect()
}

/// Connect the exports' RBD images (librados starts its threads here) and
/// take their locks: what [`open_exports`] left for inside the sandbox.
fn connect_exports(prepared: Vec<Prepared>, incoming: bool) -> anyhow::Result<Vec<Opened>> {
    prepared.into_iter().map(|p| p.finish(incoming)).collect()
}

/// Lock and open one export's device, bind its socket and mount it (see
/// [`open_exports`]); also what the `export_add` RPC does.
pub(crate) fn open_export(
    export: &Export,
    incoming: bool,
    link: Option<&Arc<SupervisorLink>>,
) -> anyhow::Result<Opened> {
    let device = prepare_device(export, incoming, false)?;
    Prepared { device, host: open_host_side(export, link)?, export: export.clone() }.finish(incoming)
}

impl Opened {
    /// The open device.
    pub(crate) fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.dev
    }
}

/// Open an export's host side on `dev`, a device another export opened
/// and locked (a snapshot export beside the export that serves its image).
pub(crate) fn open_export_on(export: &Export, dev: Arc<dyn BlockDevice>) -> anyhow::Result<Opened> {
    let device = PreparedDevice::Open(dev, None);
    Prepared { device, host: open_host_side(export, None)?, export: export.clone() }.finish(false)
}

/// [`open_export_on`] for a sandboxed server: `listener` is the socket its
/// supervisor bound; no host mount, no session file.
pub(crate) fn open_export_on_listener(
    export: &Export,
    dev: Arc<dyn BlockDevice>,
    listener: std::os::unix::net::UnixListener,
) -> Opened {
    let export = Export { session_file: Some(PathBuf::new()), ..export.clone() };
    Opened { export, dev, listener: Some(listener), fuse: None, lock: None, session: None }
}

/// An export with its host side open and its device opened, or, for an
/// RBD image, prepared: the conf and key read, not yet connected.
pub(crate) struct Prepared {
    export: Export,
    device: PreparedDevice,
    host: HostSide,
}

/// An export's device before the sandbox. An RBD image connects inside it:
/// librados starts threads when it connects, and the sandbox's mount
/// namespace can only be entered while the process has one thread.
enum PreparedDevice {
    Open(Arc<dyn BlockDevice>, Option<ImageLock>),
    Rbd(keelfs_bdev::RbdPrepared),
}

/// What an export opens on the host besides its device: its vhost-user
/// socket, its host mount and the file its session is kept in.
struct HostSide {
    listener: Option<std::os::unix::net::UnixListener>,
    fuse: Option<HostMount>,
    session: Option<(SessionFile, Option<SessionState>)>,
}

impl Prepared {
    fn finish(self, incoming: bool) -> anyhow::Result<Opened> {
        let (dev, lock) = match self.device {
            PreparedDevice::Open(dev, lock) => (dev, lock),
            PreparedDevice::Rbd(rbd) => open_rbd_locked(&self.export, rbd, incoming)?,
        };
        let HostSide { listener, fuse, session } = self.host;
        Ok(Opened { export: self.export, dev, listener, fuse, lock, session })
    }
}

fn open_host_side(export: &Export, link: Option<&Arc<SupervisorLink>>) -> anyhow::Result<HostSide> {
    let listener = match &export.socket {
        Some(socket) => {
            let access = SocketAccess {
                mode: export.socket_mode.unwrap_or(SocketAccess::default().mode),
                owner: export.socket_owner,
            };
            let listener = keelfs_vhost::bind_listener(socket, access)
                .with_context(|| format!("export {}: the vhost-user socket", export.tag))?;
            Some(listener)
        }
        None => None,
    };
    let fuse = match &export.fuse_mount {
        Some(dir) => {
            let uring = fuse_uring_plan(export)?;
            // Opened here, before the sandbox hides the filesystem.
            let trace = match &export.trace_requests {
                Some(path) => Some(
                    std::fs::File::create(path)
                        .with_context(|| format!("export {}: the request trace {}", export.tag, path.display()))?,
                ),
                None => None,
            };
            Some(HostMount { mount: mount_on_host(export, dir, link)?, uring, trace })
        }
        None => None,
    };
    let session = match SessionFile::path_of(export) {
        None => None,
        // One the operator named must work; the default beside the
        // image is a convenience, and a directory keelfsd may not
        // write costs only the restart's session.
        Some(path) if export.session_file.is_some() => Some(SessionFile::open(&path)?),
        Some(path) => SessionFile::open(&path)
            .map_err(|e| tracing::warn!("export {}: no session kept across restarts: {e:#}", export.tag))
            .ok(),
    };
    Ok(HostSide { listener, fuse, session })
}

/// Lock and open an export's device (see [`open_export`]); with
/// `defer_rbd`, an RBD image is only prepared. Its lock is its exclusive
/// lock, which opening it writable takes (or, with `incoming`, leaves for
/// the session's arrival).
fn prepare_device(export: &Export, incoming: bool, defer_rbd: bool) -> anyhow::Result<PreparedDevice> {
    if is_rbd_export(export) {
        let options = keelfs_bdev::RbdOptions { read_only: export.read_only, defer_lock: incoming };
        let rbd = device::prepare_rbd(&export.device, options)?;
        if defer_rbd {
            return Ok(PreparedDevice::Rbd(rbd));
        }
        let (dev, lock) = open_rbd_locked(export, rbd, incoming)?;
        return Ok(PreparedDevice::Open(dev, lock));
    }
    let lock = match (export.read_only, incoming) {
        (true, _) => ImageLock::shared(&export.device, "serve")?,
        (false, false) => ImageLock::exclusive(&export.device, "serve")?,
        (false, true) => ImageLock::unlocked(&export.device)?,
    };
    let dev = device::open_backend(&export.device, export.backend, export.sqpoll_idle_ms, export.read_only)?;
    Ok(PreparedDevice::Open(dev, lock))
}

/// Connect a prepared RBD image and take its lock: readers share the image
/// and keep writers out while they serve.
fn open_rbd_locked(
    export: &Export,
    rbd: keelfs_bdev::RbdPrepared,
    incoming: bool,
) -> anyhow::Result<(Arc<dyn BlockDevice>, Option<ImageLock>)> {
    let rbd = Arc::new(rbd.open().map_err(device::rbd_error)?);
    let lock = if export.read_only {
        let held = (!incoming).then(|| rbd.take_reader_lock()).transpose().map_err(device::rbd_error)?;
        ImageLock::RbdReader(Arc::clone(&rbd), std::sync::Mutex::new(held))
    } else {
        ImageLock::Rbd(Arc::clone(&rbd))
    };
    Ok((rbd, Some(lock)))
}

/// Open an export for a sandboxed server through its supervisor (see
/// [`crate::broker`]): a vhost-user export on an io_uring image, without a
/// session kept across restarts (the server cannot open its file). Returns
/// it with the supervisor's index of its socket.
pub(crate) fn open_export_brokered(export: &Export, link: &SupervisorLink) -> anyhow::Result<(Opened, usize)> {
    let socket = export.socket.clone().context("a sandboxed daemon adds vhost-user exports only")?;
    let request = crate::broker::OpenRequest {
        device: export.device.clone(),
        read_only: export.read_only,
        sqpoll_idle_ms: export.sqpoll_idle_ms,
        socket,
        socket_mode: export.socket_mode,
        socket_owner: export.socket_owner,
    };
    let opened = link.open_export(&request).with_context(|| format!("export {}: the supervisor", export.tag))?;
    let index = opened.socket_index;
    let dev: Arc<dyn BlockDevice> = Arc::new(opened.device);
    let export = Export { session_file: Some(PathBuf::new()), ..export.clone() };
    let opened =
        Opened { export, dev, listener: Some(opened.listener), fuse: None, lock: Some(opened.lock), session: None };
    Ok((opened, index))
}

/// A host mount, and the ring to move its requests to after INIT.
pub(crate) struct HostMount {
    mount: FuseMount,
    uring: Option<FuseUringPlan>,
    /// Where `--trace-requests` records the mount's exchanges.
    trace: Option<std::fs::File>,
}

/// Whether the export's host mount moves to FUSE over io_uring after INIT
/// (`fuse_transport`): decided before the sandbox hides /sys. `uring`
/// without it is an error; `auto` says why it serves /dev/fuse.
fn fuse_uring_plan(export: &Export) -> anyhow::Result<Option<FuseUringPlan>> {
    let parameter = crate::hooks::fuse_uring_parameter();
    match export.fuse_transport {
        FuseTransport::Dev => Ok(None),
        FuseTransport::Uring => probe_fuse_uring(&parameter, true)
            .map(Some)
            .with_context(|| format!("export {}: fuse_transport = \"uring\"", export.tag)),
        FuseTransport::Auto => match probe_fuse_uring(&parameter, false) {
            Ok(plan) => Ok(Some(plan)),
            Err(e) => {
                tracing::info!("export {}: {e}; the host mount is served through /dev/fuse", export.tag);
                Ok(None)
            }
        },
    }
}

/// The session settings of the export's host mount. Without a vhost-user
/// socket no guest shares the export, so the host kernel is its sole
/// client and cache `auto` gives it long timeouts and the writeback
/// cache. Beside a guest it is told of each of the guest's changes
/// (`coherence`), so it keeps the long timeouts, but writes through, so
/// that the guest sees its writes.
fn host_session_config(export: &Export, coherence: Option<Rc<Coherence>>) -> SessionConfig {
    let clients = if export.socket.is_some() { Clients::SharedNotified } else { Clients::Sole };
    session_config(export, clients, coherence)
}

/// The export's cache mode and handle limit for a client of this kind.
fn session_config(export: &Export, clients: Clients, coherence: Option<Rc<Coherence>>) -> SessionConfig {
    SessionConfig {
        open_handles_max: export.open_handles_max,
        coherence,
        xattr: export.xattr,
        ..CacheMode::from(export.cache).session_config_for(clients)
    }
}

/// The session settings of the export's guest. A guest cannot be told of
/// another client's changes (Linux's virtio-fs has no notification
/// queue), so beside a host mount it keeps names and attributes for
/// short timeouts only; alone, it is the sole client and keeps them long,
/// with its pages across opens.
///
/// Not the writeback cache, unless the mode is `always`: Linux's FUSE
/// client then sends the times in a SETATTR of its own at each close,
/// unlink and rename, a round trip more for every small file. In a TCG
/// guest that made creating and removing 2000 small files 1.3-1.4x
/// slower (bench/RESULTS.md, issue 34). The host mount, whose buffered
/// writes it batches, keeps it.
fn guest_session_config(export: &Export, coherence: Option<Rc<Coherence>>) -> SessionConfig {
    let clients = if export.fuse_mount.is_some() { Clients::Shared } else { Clients::Sole };
    SessionConfig {
        writeback_cache: CacheMode::from(export.cache) == CacheMode::Always,
        ..session_config(export, clients, coherence)
    }
}

/// Mount the export at `dir` through /dev/fuse.
fn mount_on_host(export: &Export, dir: &Path, link: Option<&Arc<SupervisorLink>>) -> anyhow::Result<FuseMount> {
    let flags = export.fuse_mount_flags | if export.read_only { libc::MS_RDONLY } else { 0 };
    let mut mount = FuseMount::mount_with(dir, &export.fuse_source, &export.fuse_type, flags)
        .with_context(|| format!("export {}: mounting {} through /dev/fuse", export.tag, dir.display()))?;
    if host_session_config(export, None).writeback_cache && export.host_dirty_ratio > 0 {
        // Not fatal: the cache still works, only stalls sooner.
        match crate::host_writeback::lift_dirty_limit(dir, &export.fuse_type, export.host_dirty_ratio) {
            Ok(bdi) => tracing::info!(
                "export {}: writeback cache may hold {}% of the dirty allowance ({})",
                export.tag,
                export.host_dirty_ratio,
                bdi.display()
            ),
            Err(e) => tracing::warn!("export {}: FUSE's 1% dirty limit stays: {e:#}", export.tag),
        }
    }
    if let Some(link) = link {
        link.mounted(dir, &export.fuse_type)
            .with_context(|| format!("export {}: reporting the mount to the supervisor", export.tag))?;
        let (unmounter, told) = (Arc::clone(link), Arc::clone(link));
        mount.set_unmounter(Box::new(move |dir| unmounter.unmount(dir)));
        mount.set_on_gone(Box::new(move |dir| told.gone(dir)));
    }
    Ok(mount)
}

/// Hands each reactor its exports, each as a task of its own, and lists
/// them in `table`.
fn start_exports(
    assigned: Vec<Vec<Opened>>,
    handles: &[ReactorHandle],
    timing: (Duration, bool),
    events: &mpsc::Sender<Event>,
    table: &Arc<ExportTable>,
) -> anyhow::Result<()> {
    for (id, exports) in assigned.into_iter().enumerate() {
        for opened in exports {
            let entry = ExportEntry {
                export: opened.export.clone(),
                reactor: id,
                state: Lifecycle::Starting,
                runtime: false,
                brokered_socket: None,
                awaited: false,
                device: Some(crate::control::SharedDevice(Arc::clone(&opened.dev))),
                image_away: false,
            };
            table.insert(entry);
            start_export(handles, id, opened, timing, events.clone(), Arc::clone(table))?;
        }
    }
    Ok(())
}

/// Start `opened` on reactor `id`; it reports to `events` and `table`.
pub(crate) fn start_export(
    handles: &[ReactorHandle],
    id: usize,
    opened: Opened,
    timing: (Duration, bool),
    events: mpsc::Sender<Event>,
    table: Arc<ExportTable>,
) -> anyhow::Result<()> {
    let helpers: Vec<ReactorHandle> = match opened.export.spread_queues {
        true => handles.iter().filter(|h| h.id() != id).cloned().collect(),
        false => Vec::new(),
    };
    let start = move || {
        // Everything the export starts logs under its tag: the
        // filesystem, its sessions and the listener keep this span.
        let span = tracing::info_span!("export", tag = %opened.export.tag);
        let run = run_export(id, opened, helpers, timing, (events, table));
        reactor::spawn_local(tracing::Instrument::instrument(run, span));
    };
    if handles[id].send(start).is_err() {
        anyhow::bail!("reactor {id} stopped before its exports started");
    }
    Ok(())
}

/// Waits until each of `exports` is ready, printing the QEMU arguments of
/// each socket; the first failure ends the wait and is returned.
fn await_start_up(event_rx: &mpsc::Receiver<Event>, exports: usize) -> Option<String> {
    for _ in 0..exports {
        match event_rx.recv() {
            Ok(Event::Ready { tag, reactor, socket, queues }) => {
                tracing::info!("export {tag} ready on reactor {reactor}");
                if let Some(socket) = socket {
                    eprintln!("{}", qemu_arguments(&socket, &tag, queues));
                }
            }
            Ok(Event::Failed { tag, error }) => return Some(format!("export {tag}: {error}")),
            Ok(Event::Stopped { .. }) | Err(_) => return Some("a reactor stopped during start-up".into()),
            Ok(Event::MountGone { tag }) => {
                return Some(format!("export {tag}: the host mount was unmounted during start-up"))
            }
        }
    }
    None
}

/// The listeners bound before the sandbox, for the RPC and the metrics,
/// and the run queue the adaptive reactors read (the sandbox has no /proc).
pub(crate) struct Listeners {
    pub rpc: Option<std::os::unix::net::UnixListener>,
    pub metrics: Option<(std::net::TcpListener, std::net::SocketAddr)>,
    pub cpu_load: Option<Arc<CpuLoadProbe>>,
}

/// The machine's run queue and CPU pressure for the adaptive idle policy;
/// without them the policy still works, from the reactors' own time off
/// the CPU.
fn open_cpu_load(mode: PollModeName) -> Option<Arc<CpuLoadProbe>> {
    if mode != PollModeName::Adaptive {
        return None;
    }
    match CpuLoadProbe::open() {
        Ok(probe) => {
            if !probe.has_pressure() {
                tracing::info!("no CPU pressure (PSI) here: adaptive polling judges by the run queue and CPU time");
            }
            Some(Arc::new(probe))
        }
        Err(e) => {
            tracing::warn!("adaptive polling without the run queue (/proc/loadavg: {e}): it judges by CPU time alone");
            None
        }
    }
}

fn start_reactors(
    config: &Config,
    cpu_load: Option<Arc<CpuLoadProbe>>,
) -> anyhow::Result<Vec<(ReactorHandle, std::thread::JoinHandle<()>)>> {
    let mode = match config.poll_mode {
        PollModeName::Busy => PollMode::Busy,
        PollModeName::Adaptive => PollMode::ADAPTIVE_DEFAULT,
        PollModeName::Interrupt => PollMode::Interrupt,
    };
    let mut reactors = Vec::new();
    for (id, cpu) in config.reactors.iter().enumerate() {
        let reactor_config =
            ReactorConfig { id, cpu: *cpu, mode, cpu_load: cpu_load.clone(), ..ReactorConfig::default() };
        let spawned = Reactor::spawn(reactor_config, || {}).with_context(|| format!("starting reactor {id}"))?;
        reactors.push(spawned);
    }
    Ok(reactors)
}

/// The RPC and metrics servers, once the exports are up.
fn start_control(
    config: &Config,
    listeners: Listeners,
    handles: &[ReactorHandle],
    (events, table): (&mpsc::Sender<Event>, &Arc<ExportTable>),
    link: Option<Arc<SupervisorLink>>,
) -> anyhow::Result<(Option<rpc::RpcServer>, Option<crate::metrics::MetricsServer>)> {
    let rpc = match listeners.rpc {
        Some(listener) => {
            let control = Control {
                reactors: handles.to_vec(),
                table: Arc::clone(table),
                events: std::sync::Mutex::new(events.clone()),
                commit_interval: config.commit_interval,
                sandbox: config.sandbox,
                link,
            };
            Some(rpc::RpcServer::start(listener, Arc::new(control)).context("starting the RPC")?)
        }
        None => None,
    };
    let metrics = match listeners.metrics {
        Some(listener) => {
            let server =
                crate::metrics::MetricsServer::start(listener, handles.to_vec()).context("starting metrics")?;
            Some(server)
        }
        None => None,
    };
    Ok((rpc, metrics))
}

/// Start the reactors and the exports on them, serve until a signal, and
/// shut down.
fn run(
    config: &Config,
    opened: Vec<Opened>,
    listeners: Listeners,
    signals: &Signals,
    link: Option<Arc<SupervisorLink>>,
) -> anyhow::Result<ExitCode> {
    let (events, event_rx) = mpsc::channel();
    let reactor_count = config.reactors.len();
    let mut assigned: Vec<Vec<Opened>> = (0..reactor_count).map(|_| Vec::new()).collect();
    for (i, export) in opened.into_iter().enumerate() {
        assigned[i % reactor_count].push(export);
    }
    let reactors = start_reactors(config, listeners.cpu_load.clone())?;
    let handles: Vec<ReactorHandle> = reactors.iter().map(|(h, _)| h.clone()).collect();
    let table = Arc::new(ExportTable::default());
    // Exports start once every reactor runs, so that each knows the others
    // (its helpers, with spread_queues).
    start_exports(assigned, &handles, (config.commit_interval, config.incoming), &events, &table)?;

    let mut failure = await_start_up(&event_rx, config.exports.len());
    let mut servers = (None, None);
    if failure.is_none() {
        match start_control(config, listeners, &handles, (&events, &table), link) {
            Ok(started) => servers = started,
            Err(e) => failure = Some(format!("{e:#}")),
        }
    }
    if failure.is_none() {
        eprintln!("keelfsd: ready ({} export(s) on {reactor_count} reactor(s))", config.exports.len());
        if let Some(metrics) = &servers.1 {
            eprintln!("keelfsd: metrics on http://{}/metrics", metrics.local_addr());
        }
        crate::hooks::after_ready();
        let fuse_only = config.exports.iter().all(|e| e.socket.is_none());
        let mounts = || config.exports.iter().map(|e| e.tag.clone()).collect();
        wait_for_shutdown(signals, &event_rx, &table, fuse_only.then(mounts));
    }
    // No more runtime changes while the exports stop: an export_add
    // still running is refused at its next step, or stopped with the rest.
    table.close();
    drop(servers);
    let result = shut_down(&handles, &event_rx, signals, &table, std::time::Instant::now());
    for (handle, thread) in reactors {
        handle.stop();
        let _ = thread.join();
    }
    if let Some(failure) = failure {
        bail!(failure);
    }
    result?;
    eprintln!("keelfsd: clean shutdown");
    Ok(ExitCode::SUCCESS)
}

/// Wait for SIGTERM or SIGINT. A daemon that serves only host mounts
/// (the `mounts` of these exports, as the mount helper starts it) also
/// shuts down once each was unmounted, as a FUSE filesystem does after
/// `umount`; an `export_remove` does not count.
fn wait_for_shutdown(signals: &Signals, events: &Receiver<Event>, table: &ExportTable, mounts: Option<Vec<String>>) {
    let mut mounted = mounts;
    loop {
        if signals.wait(Some(Duration::from_millis(100))).is_some() {
            eprintln!("keelfsd: shutting down (a second signal, a second from now or later, forces the exit)");
            return;
        }
        // Runtime exports report here too; only an unmount counts.
        while let Ok(event) = events.try_recv() {
            if let Event::MountGone { tag } = event {
                tracing::info!("export {tag}: its host mount was unmounted");
                // export_remove unmounts too: its export leaves the list,
                // but its going never stops the daemon.
                let removed = table.take_removed(&tag);
                if let Some(tags) = &mut mounted {
                    let before = tags.len();
                    tags.retain(|t| *t != tag);
                    if removed && before > 0 && tags.is_empty() {
                        mounted = None;
                    }
                }
            }
        }
        if mounted.as_ref().is_some_and(Vec::is_empty) {
            eprintln!("keelfsd: every host mount was unmounted; shutting down");
            return;
        }
    }
}

/// A signal this soon after the shutdown began is taken as the same
/// request, not as the second signal that forces an exit: timeout(1), for
/// one, signals the daemon and then its process group, and the sandbox's
/// supervisor forwards each copy it reads. A person who presses ^C twice
/// to force it presses again after this.
const SAME_REQUEST_WITHIN: Duration = Duration::from_secs(1);

/// Whether a signal `since_start` after the shutdown began forces an exit.
fn forces_exit(since_start: Duration) -> bool {
    since_start >= SAME_REQUEST_WITHIN
}

/// Ask every reactor to stop its exports, then wait for them, exiting at
/// once on a second signal ([`forces_exit`]; the shutdown began at
/// `started`).
fn shut_down(
    handles: &[ReactorHandle],
    events: &Receiver<Event>,
    signals: &Signals,
    table: &ExportTable,
    started: std::time::Instant,
) -> anyhow::Result<()> {
    crate::hooks::as_shutdown_begins();
    for handle in handles {
        // A full inbox only delays the message.
        let mut message: Box<dyn FnOnce() + Send> = Box::new(request_local_shutdown);
        loop {
            match handle.send_boxed(message) {
                Ok(()) => break,
                Err(reactor::SendError::Full(m)) => {
                    message = m;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(reactor::SendError::Stopped(_)) => break,
            }
        }
    }
    let mut errors = Vec::new();
    // Every export leaves the table once it has stopped, those added at
    // runtime included.
    while table.live() > 0 {
        if signals.wait(Some(Duration::from_millis(0))).is_some() {
            if forces_exit(started.elapsed()) {
                eprintln!("keelfsd: second signal, exiting without a clean shutdown");
                std::process::exit(1);
            }
            tracing::info!("a signal within {SAME_REQUEST_WITHIN:?} of the first: the same shutdown");
        }
        match events.recv_timeout(Duration::from_millis(100)) {
            Ok(Event::Stopped { tag, error: Some(e) }) => errors.push(format!("export {tag}: {e}")),
            Ok(_) => {}
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    // An export reports before it leaves the table.
    while let Ok(event) = events.try_recv() {
        if let Event::Stopped { tag, error: Some(e) } = event {
            errors.push(format!("export {tag}: {e}"));
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        bail!(errors.join("; "))
    }
}

/// What one reactor knows locally: its exports, for stats, and whether
/// shutdown (of all, or of some exports) was asked for.
#[derive(Default)]
struct Local {
    shutdown: bool,
    /// Exports asked to stop alone (`export_remove`).
    stopping: Vec<String>,
    waiters: Vec<Waker>,
    exports: Vec<LocalExport>,
}

struct LocalExport {
    tag: String,
    /// The filesystem, unless the server may give it up (then ask it).
    fs: Option<Fs>,
    server: Option<Rc<VhostUserServer>>,
    fuse_stats: Option<Rc<OpStats>>,
    /// The limiter both transports share; None with spread_queues.
    qos: Option<Rc<Qos>>,
    /// The export's locks, when keelfs holds them.
    locks: Option<Rc<keelfs_vhost::Locks>>,
}

thread_local! {
    static LOCAL: RefCell<Local> = RefCell::new(Local::default());
}

fn request_local_shutdown() {
    LOCAL.with(|l| {
        let mut l = l.borrow_mut();
        l.shutdown = true;
        for w in l.waiters.drain(..) {
            w.wake();
        }
    });
}

/// On the export's reactor: ask export `tag` alone to stop.
pub(crate) fn request_export_stop(tag: &str) {
    LOCAL.with(|l| {
        let mut l = l.borrow_mut();
        l.stopping.push(tag.to_string());
        for w in l.waiters.drain(..) {
            w.wake();
        }
    });
}

/// Ready once the reactor shuts down, or export `tag` is asked to stop.
async fn stop_asked(tag: &str) {
    std::future::poll_fn(|cx| {
        LOCAL.with(|l| {
            let mut l = l.borrow_mut();
            if l.shutdown || l.stopping.iter().any(|t| t == tag) {
                l.stopping.retain(|t| t != tag);
                std::task::Poll::Ready(())
            } else {
                l.waiters.push(cx.waker().clone());
                std::task::Poll::Pending
            }
        })
    })
    .await
}

/// On the export's reactor: its filesystem, if it is mounted here.
/// The QoS limiter of this reactor's export `tag`, if it has one.
pub(crate) fn local_qos(tag: &str) -> Option<Rc<Qos>> {
    LOCAL.with(|l| l.borrow().exports.iter().find(|e| e.tag == tag).and_then(|e| e.qos.clone()))
}

pub(crate) fn local_fs(tag: &str) -> Option<Fs> {
    LOCAL.with(|l| {
        let l = l.borrow();
        let e = l.exports.iter().find(|e| e.tag == tag)?;
        e.fs.clone().or_else(|| e.server.as_ref().and_then(|s| s.fs()))
    })
}

/// How an export's filesystem is reached: mounted here for good, or
/// through an image its vhost-user server may give up and take back.
enum Mounted {
    /// The lock is held for as long as the filesystem is mounted.
    Fixed {
        fs: Fs,
        _lock: Option<ImageLock>,
    },
    Movable(Rc<ExportImage>, Option<Fs>),
}

/// Mount the export's filesystem, or (`incoming`) prepare to take it.
async fn mount_export(
    reactor_id: usize,
    export: &Export,
    dev: &Arc<dyn BlockDevice>,
    lock: Option<ImageLock>,
    (commit_interval, incoming): (Duration, bool),
    table: &Arc<ExportTable>,
) -> anyhow::Result<Mounted> {
    if !crate::image::migratable(export) {
        let fs = mount(reactor_id, export, dev, commit_interval, false).await?;
        return Ok(Mounted::Fixed { fs, _lock: lock });
    }
    let locked = !incoming;
    let held = (lock, locked);
    let image = Rc::new(ExportImage::new(export.clone(), Arc::clone(dev), reactor_id, commit_interval, held, table));
    if incoming {
        table.set_image_away(&export.tag, true);
        return Ok(Mounted::Movable(image, None));
    }
    // Orphans a kept session holds stay; the server frees the rest once
    // it has restored it.
    let fs = image.attach().await.map_err(anyhow::Error::msg)?;
    Ok(Mounted::Movable(image, Some(fs)))
}

async fn run_export(
    reactor_id: usize,
    opened: Opened,
    helpers: Vec<ReactorHandle>,
    timing: (Duration, bool),
    (events, table): (Sender<Event>, Arc<ExportTable>),
) {
    let Opened { export, dev, listener, fuse, lock, session } = opened;
    let (session_file, restore) = match session {
        Some((file, restore)) => (Some(file), restore),
        None => (None, None),
    };
    let tag = export.tag.clone();
    let mounted = match mount_export(reactor_id, &export, &dev, lock, timing, &table).await {
        Ok(mounted) => mounted,
        Err(e) => {
            table.fail(&tag, format!("{e:#}"));
            let _ = events.send(Event::Failed { tag, error: format!("{e:#}") });
            return;
        }
    };
    let gone = (events.clone(), tag.clone());
    let on_mount_gone = Box::new(move || drop(gone.0.send(Event::MountGone { tag: gone.1 })));
    // Every export gets one, unlimited unless configured, so that limits
    // can be set at run time; not with spread_queues (config refuses it).
    let qos = (!export.spread_queues).then(|| Qos::new(export.qos).expect("limits checked by the config"));
    // One lock table for all the export's clients, when keelfs holds them.
    let beside = export.socket.is_some() && fuse.is_some();
    let locks = export.locks.held_by_keelfs(beside).then(keelfs_vhost::Locks::new);
    let shared = (helpers, qos.clone(), locks.clone());
    let transports = start_transports(&export, (&mounted, restore), &dev, shared, listener, fuse, on_mount_gone).await;
    let (server, mount, fuse_stats) = match transports {
        Ok(started) => started,
        Err(e) => {
            table.fail(&tag, format!("{e:#}"));
            let _ = events.send(Event::Failed { tag, error: format!("{e:#}") });
            let _ = match &mounted {
                Mounted::Fixed { fs, .. } | Mounted::Movable(_, Some(fs)) => fs.unmount().await,
                Mounted::Movable(_, None) => Ok(()),
            };
            return;
        }
    };
    let server = server.map(Rc::new);
    let fixed_fs = match &mounted {
        Mounted::Fixed { fs, .. } => Some(fs.clone()),
        Mounted::Movable(..) => None,
    };
    LOCAL.with(|l| {
        l.borrow_mut().exports.push(LocalExport {
            tag: tag.clone(),
            fs: fixed_fs.clone(),
            server: server.clone(),
            fuse_stats,
            qos,
            locks,
        })
    });
    table.set_state(&tag, Lifecycle::Ready);
    crate::scrub::resume_if_saved(&tag);
    let _ = events.send(Event::Ready {
        tag: tag.clone(),
        reactor: reactor_id,
        socket: export.socket.clone(),
        queues: export.request_queues,
    });
    tracing::info!("export {tag}: serving");

    stop_asked(&tag).await;
    tracing::info!("export {tag}: stopping");
    LOCAL.with(|l| l.borrow_mut().exports.retain(|e| e.tag != tag));
    let error = stop_export(server, mount, fixed_fs, session_file.as_ref()).await;
    // The lock goes last, once everything is on the device.
    drop(mounted);
    match &error {
        None => tracing::info!("export {tag}: stopped"),
        Some(e) => tracing::error!("export {tag}: stopped with an error: {e}"),
    }
    let _ = events.send(Event::Stopped { tag: tag.clone(), error });
    table.remove(&tag);
}

/// Stop taking requests and drain the ones in flight, then commit,
/// checkpoint and flush: the server does it for an image it may give up
/// (`fixed_fs` None), this function for the others.
async fn stop_export(
    server: Option<Rc<VhostUserServer>>,
    mount: Option<Rc<FuseMount>>,
    fixed_fs: Option<Fs>,
    session_file: Option<&SessionFile>,
) -> Option<String> {
    let mut error = None;
    if let Some(server) = server.and_then(|s| Rc::try_unwrap(s).ok()) {
        if fixed_fs.is_some() {
            server.stop().await;
        } else {
            match (server.stop_and_release(session_file.is_some()).await, session_file) {
                (Ok(Some(state)), Some(file)) => {
                    if let Err(e) = file.write(&state) {
                        error = Some(format!("keeping the session: {e:#}"));
                    }
                }
                (Ok(_), _) => {}
                (Err(e), _) => error = Some(format!("giving the image up: {e}")),
            }
        }
    }
    if let Some(mount) = mount {
        if let Err(e) = mount.unmount() {
            error = Some(format!("unmounting: {e}"));
        }
    }
    if let Some(fs) = fixed_fs {
        if let Err(e) = fs.unmount().await {
            error = Some(format!("committing and checkpointing: {e}"));
        }
    }
    error
}

/// The export's vhost-user-fs device and host mount, as configured, on the
/// socket and mount already opened. On failure whatever was started is
/// stopped again.
async fn start_transports(
    export: &Export,
    (mounted, restore): (&Mounted, Option<SessionState>),
    dev: &Arc<dyn BlockDevice>,
    (helpers, qos, locks): (Vec<ReactorHandle>, Option<Rc<Qos>>, Option<Rc<keelfs_vhost::Locks>>),
    listener: Option<std::os::unix::net::UnixListener>,
    fuse: Option<HostMount>,
    on_mount_gone: Box<dyn FnOnce()>,
) -> anyhow::Result<(Option<VhostUserServer>, Option<Rc<FuseMount>>, Option<Rc<OpStats>>)> {
    // A guest beside a host mount: the host mount is told of the guest's
    // changes.
    let coherence = (export.socket.is_some() && fuse.is_some()).then(Coherence::new);
    let guest_config = SessionConfig { locks: locks.clone(), ..guest_session_config(export, coherence.clone()) };
    let (fs, image) = match mounted {
        Mounted::Fixed { fs, .. } => (Some(fs), None),
        Mounted::Movable(image, fs) => (fs.as_ref(), Some(Rc::clone(image) as Rc<dyn ImageAccess>)),
    };
    let server = match (&export.socket, listener) {
        (Some(socket), Some(listener)) => {
            let options = ServeOptions {
                dma: Some(Arc::clone(dev)),
                helpers,
                socket_access: SocketAccess::default(),
                listener: Some(listener),
                requests_in_flight_max: export.requests_in_flight_max,
                image,
                restore,
                qos: qos.clone(),
                poll_idle: None,
            };
            let queues = export.request_queues;
            let server = match fs {
                Some(fs) => VhostUserServer::start_with(fs.clone(), guest_config.clone(), socket, queues, options),
                None => VhostUserServer::start_detached(guest_config.clone(), socket, queues, options),
            };
            Some(server.context("starting the vhost-user-fs device")?)
        }
        _ => None,
    };
    let Some(HostMount { mount, uring, trace }) = fuse else { return Ok((server, None, None)) };
    let fs = fs.context("a host mount needs its filesystem mounted")?;
    let mount = Rc::new(mount);
    let trace = trace.map(TraceWriter::new).transpose().context("starting the request trace")?.map(Rc::new);
    let config = SessionConfig { trace, locks, ..host_session_config(export, coherence) };
    let session = Rc::new(Session::new(fs.clone(), config));
    let stats = session.stats().clone();
    serve_fuse(session, mount.clone(), qos, uring, on_mount_gone).context("setting up FUSE over io_uring")?;
    Ok((server, Some(mount), Some(stats)))
}

/// The atime mode of an export: its host mount's noatime or strictatime,
/// else the config's (relatime, Linux's default, unless set). Under FUSE
/// the server applies it; a guest's own atime mount options do not reach
/// the server.
fn atime_updates(configured: AtimeUpdates, mount_flags: libc::c_ulong) -> AtimeUpdates {
    if mount_flags & libc::MS_NOATIME != 0 {
        AtimeUpdates::Never
    } else if mount_flags & libc::MS_STRICTATIME != 0 {
        AtimeUpdates::Always
    } else {
        configured
    }
}

/// Mount the export's filesystem on this reactor; `keep_orphans` for an
/// image whose session is to be restored (see [`FsConfig::keep_orphans`]).
pub async fn mount(
    reactor_id: usize,
    export: &Export,
    dev: &Arc<dyn BlockDevice>,
    commit_interval: Duration,
    keep_orphans: bool,
) -> anyhow::Result<Fs> {
    let queue = dev.open_queue(QueueConfig { depth: 256, completion_eventfd: true })?;
    let config = FsConfig {
        commit_interval,
        preferred_group: reactor_id,
        cache_bytes: export.page_cache_bytes,
        inodes_max: export.inodes_max,
        xattr_bytes_per_inode_max: export.xattr_bytes_per_inode_max,
        read_only: export.read_only,
        snapshot: export.snapshot.clone(),
        atime: atime_updates(export.atime, export.fuse_mount_flags),
        dir_atime: export.fuse_mount_flags & libc::MS_NODIRATIME == 0,
        keep_orphans,
        quota: export.quota,
        discard: DiscardConfig {
            enabled: export.discard,
            bytes_per_sec: export.discard_mib_per_sec << 20,
            ..DiscardConfig::default()
        },
        ..FsConfig::default()
    };
    Fs::mount(DeviceChannel::attach(queue), config).await.with_context(|| match &export.snapshot {
        // ENOENT alone would say nothing of which name was missing.
        Some(name) => format!("mounting snapshot {name:?} of the keelfs on {}", export.device.display()),
        None => format!("mounting keelfs on {}", export.device.display()),
    })
}

/// Per-opcode counters as a JSON object keyed by opcode name.
fn ops_json(stats: &OpStats) -> Value {
    stats
        .snapshot()
        .into_iter()
        .map(|op| {
            let line = json!({"requests": op.requests, "errors": op.errors, "bytes": op.bytes,
                              "p50_us": op.p50_us, "p99_us": op.p99_us,
                              "latency_sum_ns": op.latency_sum_ns, "latency_buckets": op.latency_buckets});
            (op.op, line)
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// The export's vhost-user-fs device counters.
fn device_json(server: &VhostUserServer) -> Value {
    let d = server.stats();
    let mut device = json!({
        "socket": server.socket(),
        "connections": d.connections.get(), "chains": d.chains.get(),
        "replies": d.replies.get(), "zero_copy": d.zero_copy.get(), "one_copy": d.one_copy.get(),
        "no_reply": d.no_reply.get(), "dropped": d.dropped.get(),
        "last_drop": d.last_drop.get(), "kicks": d.kicks.get(),
        "signals": d.signals.get(), "in_flight": server.in_flight(),
        "in_flight_max": d.in_flight_max.get(),
    });
    let (helpers, h) = server.helper_stats();
    if helpers > 0 {
        let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        device["helpers"] = json!({
            "reactors": helpers, "chains": load(&h.chains), "from_cache": load(&h.from_cache),
            "forwarded": load(&h.forwarded), "in_flight": load(&h.in_flight),
        });
    }
    device
}

/// The filesystem's counters, cache and space, as the stats carry them.
async fn fs_json(fs: Option<&Fs>) -> (Value, Value, Value) {
    let c = fs.map(|fs| fs.inspect().counters()).unwrap_or_default();
    let cache = fs.map(|fs| fs.inspect().cache_stats()).unwrap_or_default();
    let counters = json!({
        "journal_commits": c.journal_commits, "journal_blocks_written": c.journal_blocks_written,
        "device_flushes": c.device_flushes, "checkpoints": c.checkpoints,
        "fsyncs": c.fsyncs, "data_bytes_read": c.data_bytes_read,
        "data_bytes_written": c.data_bytes_written, "direct_overwrites": c.direct_overwrites,
        "direct_in_flight": c.direct_in_flight, "direct_in_flight_max": c.direct_in_flight_max,
        "discards": c.discards, "discard_bytes": c.discard_bytes, "discard_errors": c.discard_errors,
        "discard_pending_blocks": c.discard_pending_blocks, "data_checksum_errors": c.data_checksum_errors,
        "data_regions_open": c.data_regions_open,
    });
    let cache = json!({"hits": cache.hits, "misses": cache.misses, "evictions": cache.evictions,
                       "pages": cache.pages, "dirty_pages": cache.dirty_pages,
                       "capacity_pages": cache.capacity_pages});
    let snapshots = fs.map(|fs| fs.inspect().snapshot_space()).unwrap_or_default();
    let space = match fs {
        Some(fs) => match fs.statfs().await {
            Ok(s) => json!({
                "size_bytes": s.blocks * u64::from(s.block_size),
                "free_bytes": s.blocks_free * u64::from(s.block_size),
                "inodes": s.files, "inodes_free": s.files_free,
                "quota_bytes": fs.admin().quota().bytes, "quota_inodes": fs.admin().quota().inodes,
                "snapshots": snapshots.snapshots,
                "snapshot_held_bytes": (snapshots.metadata_blocks + snapshots.data_blocks) * keelfs_fs::BLOCK_BYTES as u64,
            }),
            Err(_) => Value::Null,
        },
        None => Value::Null,
    };
    (counters, cache, space)
}

/// An export's QoS limits (null: off) and counters, per class.
fn qos_json(qos: &Qos) -> Value {
    let (l, s) = (qos.limits(), qos.stats());
    let on = |limit: Option<u64>| limit.filter(|&n| n != 0);
    json!({
        "read_iops": on(l.read_iops), "write_iops": on(l.write_iops), "iops": on(l.iops),
        "read_bytes_per_sec": on(l.read_bytes_per_sec), "write_bytes_per_sec": on(l.write_bytes_per_sec),
        "bytes_per_sec": on(l.bytes_per_sec), "burst_ms": l.burst_ms,
        "deferred": {"read": s.deferred[0], "write": s.deferred[1]},
        "waiting": {"read": s.waiting[0], "write": s.waiting[1]},
        "debts": s.debts,
    })
}

/// Why an export's QoS limits could not be changed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SetQosError {
    /// Not on this reactor: each reactor knows only its own exports.
    #[error("no export {0} on this reactor")]
    NoExport(String),
    #[error("export {0} polls its queues on several reactors (spread_queues), which QoS does not support")]
    SpreadQueues(String),
    #[error("export {0}: {1}")]
    Limits(String, QosError),
}

/// Change the QoS limits of export `tag` to `change` of its current ones,
/// on the reactor that owns it; returns the export's QoS as the stats show
/// it. Both transports take them at once; requests held keep their order.
pub(crate) fn set_export_qos(tag: &str, change: impl FnOnce(QosLimits) -> QosLimits) -> Result<Value, SetQosError> {
    LOCAL.with(|l| {
        let l = l.borrow();
        let export = l.exports.iter().find(|e| e.tag == tag).ok_or_else(|| SetQosError::NoExport(tag.into()))?;
        let qos = export.qos.as_ref().ok_or_else(|| SetQosError::SpreadQueues(tag.into()))?;
        let limits = change(qos.limits());
        qos.set_limits(limits).map_err(|e| SetQosError::Limits(tag.into(), e))?;
        tracing::info!("export {tag}: QoS limits now {limits:?}");
        Ok(qos_json(qos))
    })
}

/// This reactor's exports as JSON, for the stats RPC.
pub async fn local_stats() -> Vec<Value> {
    type Parts = (String, Option<Fs>, Option<Rc<VhostUserServer>>, Option<Rc<OpStats>>, Option<Rc<Qos>>, Value);
    let exports: Vec<Parts> = LOCAL.with(|l| {
        let l = l.borrow();
        l.exports
            .iter()
            .map(|e| {
                let fs = e.fs.clone().or_else(|| e.server.as_ref().and_then(|s| s.fs()));
                let locks = e.locks.as_deref().map_or(Value::Null, locks_json);
                (e.tag.clone(), fs, e.server.clone(), e.fuse_stats.clone(), e.qos.clone(), locks)
            })
            .collect()
    });
    let mut lines = Vec::new();
    for (tag, fs, server, fuse_stats, qos, locks) in exports {
        let (counters, cache, space) = fs_json(fs.as_ref()).await;
        lines.push(json!({
            "tag": tag,
            "qos": qos.as_deref().map(qos_json),
            "image_attached": fs.is_some(),
            "virtio_fs": server.as_deref().map_or(Value::Null, device_json),
            "ops": server.as_ref().map_or_else(|| Value::Object(Default::default()), |s| ops_json(s.op_stats())),
            "fuse_mount_ops": fuse_stats.as_deref().map(ops_json),
            "fuse_transport": fuse_stats.as_deref().and_then(OpStats::transport),
            "fuse_ring_requests": fuse_stats.as_deref().map(OpStats::ring_requests),
            "fuse_mount_notifications": fuse_stats.as_deref().map(OpStats::notifications),
            "fuse_in_place_writes": fuse_stats.as_deref().map(OpStats::in_place_writes),
            "locks": locks,
            "fs": counters,
            "cache": cache,
            "space": space,
        }));
    }
    lines
}

/// The export's lock table, when keelfs holds its locks (null when each
/// client's kernel does).
fn locks_json(locks: &keelfs_vhost::Locks) -> Value {
    let c = locks.counters();
    json!({ "held": c.held, "waiting": c.waiting, "granted": c.granted, "conflicts": c.conflicts, "waits": c.waits })
}

/// What to add to a QEMU command line to attach a guest to `socket`.
fn qemu_arguments(socket: &Path, tag: &str, queues: usize) -> String {
    // Absolute already (make_paths_absolute): nothing is looked up here,
    // inside the sandbox.
    format!(
        "keelfsd: export {tag}: attach a VM with these QEMU arguments (guest memory must be shared; size= is the VM's -m):\n  \
         -object memory-backend-memfd,id=mem,size=4G,share=on -numa node,memdev=mem \\\n  \
         -chardev socket,id={tag}-fs,path={} \\\n  \
         -device vhost-user-fs-pci,chardev={tag}-fs,tag={tag},queue-size=1024,num-request-queues={queues}\n\
         keelfsd: then in the guest: mount -t virtiofs {tag} /mnt",
        socket.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local_export(tag: &str, qos: Option<Rc<Qos>>) -> LocalExport {
        LocalExport { tag: tag.into(), fs: None, server: None, fuse_stats: None, qos, locks: None }
    }

    #[test]
    fn export_qos_changes_on_its_reactor_and_shows_in_the_stats() {
        // The limiter keeps the reactor's time: it lives on one.
        let mut reactor = keelfs_reactor::Reactor::new(keelfs_reactor::ReactorConfig::default()).unwrap();
        reactor.block_on(async { export_qos_changes_and_shows_in_the_stats() });
    }

    fn export_qos_changes_and_shows_in_the_stats() {
        let qos = Qos::new(QosLimits::UNLIMITED).unwrap();
        LOCAL.with(|l| {
            let exports = &mut l.borrow_mut().exports;
            exports.push(local_export("limited", Some(qos.clone())));
            exports.push(local_export("spread", None));
        });
        let limits = QosLimits { iops: Some(5000), read_bytes_per_sec: Some(0), ..QosLimits::UNLIMITED };
        set_export_qos("limited", |_| limits).unwrap();
        assert_eq!(qos.limits(), limits, "the transports' shared limiter took them");
        // Without filesystems the stats never wait: one poll finishes them.
        let mut stats = std::pin::pin!(local_stats());
        let std::task::Poll::Ready(stats) =
            std::future::Future::poll(stats.as_mut(), &mut std::task::Context::from_waker(std::task::Waker::noop()))
        else {
            panic!("the stats waited with no filesystem to ask");
        };
        let shown = &stats[0]["qos"];
        assert_eq!((shown["iops"].as_u64(), shown["burst_ms"].as_u64()), (Some(5000), Some(100)));
        assert!(shown["read_bytes_per_sec"].is_null(), "0 is shown as no limit");
        assert_eq!((shown["deferred"]["read"].as_u64(), shown["waiting"]["write"].as_u64()), (Some(0), Some(0)));
        assert!(stats[1]["qos"].is_null());
        assert!(matches!(set_export_qos("absent", |_| limits), Err(SetQosError::NoExport(_))));
        assert!(matches!(set_export_qos("spread", |_| limits), Err(SetQosError::SpreadQueues(_))));
        let bad = QosLimits { burst_ms: 0, ..limits };
        assert!(matches!(set_export_qos("limited", |_| bad), Err(SetQosError::Limits(..))));
        assert_eq!(qos.limits(), limits, "a refused change changes nothing");
    }
}
