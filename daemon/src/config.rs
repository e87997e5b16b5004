//! keelfsd's TOML config: reactors, devices, exports, journal, logging and
//! the RPC socket. `keelfsd.example.toml` at the repository root documents
//! every key. Errors name the file, line and column.

use std::collections::HashSet;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use keelfs_base::parse_size;
use keelfs_vhost::{CacheMode, QosLimits};
use serde::Deserialize;
use toml::Spanned;

use crate::sandbox::SandboxMode;

/// Request queues one export may have (kicks travel as bits of a u64).
pub const REQUEST_QUEUES_MAX: u16 = 63;

#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}:{column}: {message}")]
pub struct ConfigError {
    pub file: String,
    pub line: usize,
    pub column: usize,
    pub message: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    daemon: RawDaemon,
    #[serde(default, rename = "device")]
    devices: Vec<Spanned<RawDevice>>,
    #[serde(default, rename = "export")]
    exports: Vec<Spanned<RawExport>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDaemon {
    reactors: Option<Spanned<RawReactors>>,
    poll_mode: Option<PollModeName>,
    rpc_socket: Option<PathBuf>,
    log: Option<String>,
    log_format: Option<LogFormat>,
    metrics_listen: Option<Spanned<String>>,
    export_dirs: Option<Vec<PathBuf>>,
    commit_interval_ms: Option<Spanned<u64>>,
    sandbox: Option<SandboxMode>,
}

/// How log lines are written to stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One line per event; without a terminal (journald, a file), no
    /// timestamp and a syslog level prefix (`<4>`) that journald reads.
    #[default]
    Plain,
    /// One JSON object per event, fields and span (the export's tag)
    /// included.
    Json,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawReactors {
    Count(usize),
    Cpus(Vec<usize>),
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PollModeName {
    Busy,
    #[default]
    Adaptive,
    Interrupt,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendName {
    #[default]
    Uring,
    Pmem,
    /// A PCI NVMe controller driven from userspace through VFIO.
    Nvme,
    /// A Ceph RBD image through librbd: `path = "rbd:POOL/IMAGE..."`.
    Rbd,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDevice {
    name: Spanned<String>,
    #[serde(default)]
    backend: BackendName,
    path: Option<PathBuf>,
    sqpoll_idle_ms: Option<u32>,
    /// NVMe only: the controller's PCI address and the namespace.
    pci: Option<String>,
    namespace: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawExport {
    tag: Spanned<String>,
    device: Spanned<String>,
    socket: Option<Spanned<PathBuf>>,
    socket_owner: Option<Spanned<String>>,
    socket_mode: Option<Spanned<String>>,
    #[serde(default)]
    cache: Option<CacheName>,
    locks: Option<Locks>,
    request_queues: Option<Spanned<u16>>,
    spread_queues: Option<bool>,
    page_cache: Option<Spanned<String>>,
    inodes_max: Option<Spanned<u64>>,
    open_handles_max: Option<Spanned<u64>>,
    xattr_bytes_per_inode_max: Option<Spanned<String>>,
    requests_in_flight_max: Option<Spanned<u64>>,
    host_dirty_ratio: Option<Spanned<u64>>,
    read_only: Option<bool>,
    snapshot: Option<Spanned<String>>,
    xattr: Option<bool>,
    atime: Option<AtimeName>,
    fuse_mount: Option<PathBuf>,
    fuse_transport: Option<FuseTransport>,
    session_file: Option<PathBuf>,
    discard: Option<bool>,
    discard_mib_per_sec: Option<Spanned<u64>>,
    quota_bytes: Option<Spanned<String>>,
    quota_inodes: Option<Spanned<u64>>,
    qos: Option<Spanned<RawQos>>,
}

/// `[export.qos]`: limits on the export's READs and WRITEs, 0 or absent
/// for none.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQos {
    read_iops: Option<u64>,
    write_iops: Option<u64>,
    iops: Option<u64>,
    read_mib_per_sec: Option<u64>,
    write_mib_per_sec: Option<u64>,
    mib_per_sec: Option<u64>,
    burst_ms: Option<Spanned<u64>>,
}

#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum AtimeName {
    Relatime,
    Noatime,
    Strictatime,
}

/// How a host mount's requests travel after INIT (`fuse_transport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum FuseTransport {
    /// FUSE over io_uring where the kernel has it on, else /dev/fuse.
    #[default]
    Auto,
    /// FUSE over io_uring only: an error at start without it.
    Uring,
    /// /dev/fuse read and write.
    Dev,
}

/// Who holds the export's file locks (`--locks`, `locks =`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Locks {
    /// keelfs, when the export has more than one client (a guest beside
    /// a host mount); a sole client's kernel keeps its own otherwise, at
    /// no cost.
    Auto,
    /// keelfs, for every client: POSIX and flock locks are offered, and
    /// every close(2) reaches keelfs to release its POSIX locks.
    Export,
    /// Each client's kernel, as before issue 36: clients do not see each
    /// other's locks.
    Client,
}

impl Locks {
    /// Whether keelfs holds the locks of an export with these clients.
    pub fn held_by_keelfs(self, clients_beside: bool) -> bool {
        match self {
            Locks::Auto => clients_beside,
            Locks::Export => true,
            Locks::Client => false,
        }
    }
}

/// How the guest may cache what it reads (`--cache`, `cache =`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Cache {
    None,
    Auto,
    Always,
}

impl From<Cache> for CacheMode {
    fn from(c: Cache) -> Self {
        match c {
            Cache::None => CacheMode::None,
            Cache::Auto => CacheMode::Auto,
            Cache::Always => CacheMode::Always,
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum CacheName {
    None,
    Auto,
    Always,
}

/// The export's per-session and per-queue limits, each checked against
/// the range where it still means something.
fn apply_limits(src: &Source, e: &RawExport, export: &mut Export) -> Result<(), ConfigError> {
    if let Some(n) = &e.open_handles_max {
        if !(16..=1 << 24).contains(n.get_ref()) {
            return Err(src.error(n.span(), "open_handles_max must be between 16 and 16777216"));
        }
        export.open_handles_max = *n.get_ref() as usize;
    }
    if let Some(size) = &e.xattr_bytes_per_inode_max {
        let bytes = parse_size(size.get_ref()).map_err(|m| src.error(size.span(), m.to_string()))?;
        let format_max = keelfs_fs::XATTR_INODE_BYTES_MAX as u64;
        if !(4096..=format_max).contains(&bytes) {
            return Err(src.error(
                size.span(),
                format!("xattr_bytes_per_inode_max must be between 4K and {}K", format_max >> 10),
            ));
        }
        export.xattr_bytes_per_inode_max = bytes as usize;
    }
    if let Some(n) = &e.requests_in_flight_max {
        if !(1..=1 << 15).contains(n.get_ref()) {
            return Err(src.error(n.span(), "requests_in_flight_max must be between 1 and 32768"));
        }
        export.requests_in_flight_max = Some(*n.get_ref() as usize);
    }
    if let Some(n) = &e.host_dirty_ratio {
        if *n.get_ref() > 100 {
            return Err(src.error(n.span(), "host_dirty_ratio must be between 0 (the kernel's FUSE limit) and 100"));
        }
        export.host_dirty_ratio = *n.get_ref() as u8;
    }
    Ok(())
}

/// Giving space back (discard) and the export's quota.
fn apply_space(src: &Source, e: &RawExport, export: &mut Export) -> Result<(), ConfigError> {
    export.discard = e.discard.unwrap_or(false);
    if let Some(n) = &e.discard_mib_per_sec {
        if *n.get_ref() > 1 << 20 {
            return Err(src.error(n.span(), "discard_mib_per_sec must be at most 1048576 (0: unpaced)"));
        }
        export.discard_mib_per_sec = *n.get_ref();
    }
    if let Some(size) = &e.quota_bytes {
        let bytes = parse_size(size.get_ref()).map_err(|m| src.error(size.span(), m.to_string()))?;
        if bytes < 1 << 20 {
            return Err(src.error(size.span(), "quota_bytes must be at least 1M"));
        }
        export.quota.bytes = Some(bytes);
    }
    if let Some(n) = &e.quota_inodes {
        if *n.get_ref() < 16 {
            return Err(src.error(n.span(), "quota_inodes must be at least 16"));
        }
        export.quota.inodes = Some(*n.get_ref());
    }
    Ok(())
}

/// The path an export's device is opened by: the file for uring and pmem,
/// `nvme:PCI/NSID` for NVMe, the `rbd:POOL/IMAGE...` name for RBD.
fn device_path(device: &RawDevice) -> Result<PathBuf, String> {
    let name = device.name.get_ref();
    match (device.backend, &device.path, &device.pci) {
        (BackendName::Nvme, None, Some(pci)) => {
            let address = keelfs_bdev::NvmeAddress::new(pci, device.namespace.unwrap_or(1))
                .map_err(|e| format!("device \"{name}\": {e}"))?;
            Ok(PathBuf::from(address.to_string()))
        }
        (BackendName::Nvme, _, _) => Err(format!(
            "device \"{name}\": an nvme device takes pci = \"DOMAIN:BUS:DEVICE.FUNCTION\" (and namespace), not path"
        )),
        (BackendName::Rbd, Some(path), None) if device.namespace.is_none() => {
            keelfs_bdev::RbdAddress::parse(&path.to_string_lossy()).map_err(|e| format!("device \"{name}\": {e}"))?;
            Ok(path.clone())
        }
        (_, Some(path), None) if device.namespace.is_none() => Ok(path.clone()),
        (_, None, _) => Err(format!("device \"{name}\" needs a path")),
        _ => Err(format!("device \"{name}\": pci and namespace apply only to backend = \"nvme\"")),
    }
}

/// A validated config.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// One entry per reactor: the CPU it is pinned to, if a list was given.
    pub reactors: Vec<Option<usize>>,
    pub poll_mode: PollModeName,
    /// Whether the config file chose `poll_mode` (not the default): a
    /// default gives way to RBD exports, a choice does not.
    pub poll_mode_chosen: bool,
    pub rpc_socket: Option<PathBuf>,
    /// A tracing filter (`info`, `keelfs=debug`, ...); RUST_LOG wins.
    pub log: String,
    pub log_format: LogFormat,
    /// Where the Prometheus endpoint listens (`GET /metrics`); None: off.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Where a sandboxed daemon's `export_add` may open images and bind
    /// sockets (its supervisor does it); empty: nowhere.
    pub export_dirs: Vec<PathBuf>,
    pub commit_interval: Duration,
    /// The sandbox `serve` enters once its files are open.
    pub sandbox: SandboxMode,
    /// The destination of a live migration (`serve --incoming`): images
    /// are taken when the guests' sessions arrive.
    pub incoming: bool,
    pub exports: Vec<Export>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Export {
    pub tag: String,
    pub device: PathBuf,
    pub backend: BackendName,
    pub sqpoll_idle_ms: Option<u32>,
    pub socket: Option<PathBuf>,
    /// uid and gid to chown the socket to.
    pub socket_owner: Option<(u32, u32)>,
    pub socket_mode: Option<u32>,
    pub cache: Cache,
    /// Who holds file locks.
    pub locks: Locks,
    pub request_queues: usize,
    /// Poll request queues on the other reactors too (cached reads served
    /// there, the rest sent to the export's reactor).
    pub spread_queues: bool,
    pub page_cache_bytes: u64,
    /// Inodes the export's filesystem may hold; None: derived from the
    /// device size (one per 16 KiB).
    pub inodes_max: Option<u64>,
    /// Open handles each session (guest, host mount) may hold.
    pub open_handles_max: usize,
    /// Bytes of xattr names and values one inode may hold.
    pub xattr_bytes_per_inode_max: usize,
    /// Requests in flight per virtqueue; None: as many as the ring holds.
    pub requests_in_flight_max: Option<usize>,
    /// With a writeback-cached host mount (cache `always`, or `auto` on
    /// an export no guest shares), the share (percent) of the host's dirty-page
    /// allowance the host mount's writeback cache may hold, without
    /// FUSE's strict per-mount limit; 0 keeps the kernel's FUSE default
    /// (1%, strict), under which writers stall on writeback at once.
    pub host_dirty_ratio: u8,
    /// Serve without ever writing the device (opened read-only); changes
    /// fail with EROFS.
    pub read_only: bool,
    /// Serve this snapshot of the image (read-only; issue 37) instead of
    /// its live state.
    pub snapshot: Option<String>,
    /// Serve extended attributes (and so POSIX ACLs and security labels).
    /// Off, clients are told xattrs are not implemented (ENOSYS), as by
    /// virtiofsd's default, and stop asking.
    pub xattr: bool,
    /// Record the host mount's FUSE exchanges here (`--trace-requests`).
    pub trace_requests: Option<PathBuf>,
    /// When reads move atime, for every client: FUSE leaves it to the
    /// server, and a guest's own mount options never reach it. A host
    /// mount's noatime or strictatime overrides it.
    pub atime: keelfs_fs::AtimeUpdates,
    pub fuse_mount: Option<PathBuf>,
    /// The host mount's source and type as mount(8) and mountinfo show
    /// them: "keelfs" and "fuse.keelfs", or what the mount helper was given.
    pub fuse_source: String,
    pub fuse_type: String,
    /// mount(2) flags of the host mount (MS_RDONLY is added for a
    /// read-only export): nosuid and nodev unless asked otherwise.
    pub fuse_mount_flags: libc::c_ulong,
    /// How the host mount's requests travel.
    pub fuse_transport: FuseTransport,
    /// Where a clean shutdown keeps the guest's session for the next
    /// start to restore. None: beside an image that is a regular file
    /// (IMAGE.session); an empty path: nowhere.
    pub session_file: Option<PathBuf>,
    /// Discard the space the filesystem frees (a hole punched in an image
    /// file, a discard on a block device), at most this many MiB/s (0:
    /// unpaced).
    pub discard: bool,
    pub discard_mib_per_sec: u64,
    /// Limits on bytes and inodes below the device's; past them EDQUOT.
    pub quota: keelfs_fs::Quota,
    /// Limits on the export's READs and WRITEs, over all its transports.
    pub qos: QosLimits,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            reactors: vec![None],
            poll_mode: PollModeName::Adaptive,
            poll_mode_chosen: false,
            rpc_socket: None,
            log: "info".into(),
            log_format: LogFormat::Plain,
            metrics_listen: None,
            export_dirs: Vec::new(),
            commit_interval: Duration::from_secs(5),
            sandbox: SandboxMode::Namespace,
            incoming: false,
            exports: Vec::new(),
        }
    }
}

/// A fifth of the host's dirty allowance: enough that writers do not
/// stall behind writeback, bounded so one mount cannot take it all.
pub const HOST_DIRTY_RATIO_DEFAULT: u8 = 20;

impl Export {
    pub fn new(tag: &str, device: PathBuf) -> Self {
        Self {
            tag: tag.into(),
            device,
            backend: BackendName::Uring,
            sqpoll_idle_ms: None,
            socket: None,
            socket_owner: None,
            socket_mode: None,
            cache: Cache::Auto,
            locks: Locks::Auto,
            request_queues: 1,
            spread_queues: false,
            page_cache_bytes: 256 << 20,
            inodes_max: None,
            open_handles_max: keelfs_vhost::SESSION_HANDLES_MAX,
            xattr_bytes_per_inode_max: keelfs_fs::XATTR_INODE_BYTES_MAX,
            requests_in_flight_max: None,
            host_dirty_ratio: HOST_DIRTY_RATIO_DEFAULT,
            read_only: false,
            snapshot: None,
            xattr: true,
            trace_requests: None,
            atime: keelfs_fs::AtimeUpdates::Relative,
            fuse_mount: None,
            fuse_source: "keelfs".into(),
            fuse_type: "fuse.keelfs".into(),
            fuse_mount_flags: libc::MS_NOSUID | libc::MS_NODEV,
            fuse_transport: FuseTransport::Auto,
            session_file: None,
            discard: false,
            discard_mib_per_sec: DISCARD_MIB_PER_SEC_DEFAULT,
            quota: keelfs_fs::Quota::default(),
            qos: QosLimits::UNLIMITED,
        }
    }
}

/// A pace at which discards cost a fast device little and still return a
/// large delete's space within seconds.
pub const DISCARD_MIB_PER_SEC_DEFAULT: u64 = 256;

/// 1-based line and column of a byte offset.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rfind('\n').map_or(before.len(), |nl| before.len() - nl - 1) + 1;
    (line, column)
}

struct Source<'a> {
    file: &'a str,
    text: &'a str,
}

impl Source<'_> {
    fn error(&self, span: Range<usize>, message: impl Into<String>) -> ConfigError {
        let (line, column) = line_column(self.text, span.start);
        ConfigError { file: self.file.into(), line, column, message: message.into() }
    }
}

pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: path.display().to_string(),
        line: 0,
        column: 0,
        message: format!("cannot read: {e}"),
    })?;
    parse(&path.display().to_string(), &text)
}

/// Parse and validate `text`, naming `file` in errors.
pub fn parse(file: &str, text: &str) -> Result<Config, ConfigError> {
    let src = Source { file, text };
    let raw: RawConfig = toml::from_str(text).map_err(|e| {
        let span = e.span().unwrap_or(0..0);
        src.error(span, e.message().trim_end().to_string())
    })?;
    let mut config = Config::default();
    apply_daemon(&src, raw.daemon, &mut config)?;
    let mut device_names = HashSet::new();
    for device in &raw.devices {
        let name = &device.get_ref().name;
        if !device_names.insert(name.get_ref().clone()) {
            return Err(src.error(name.span(), format!("device \"{}\" is defined twice", name.get_ref())));
        }
    }
    let mut seen = SeenInExports::default();
    for spanned in &raw.exports {
        config.exports.push(parse_export(&src, spanned, &raw.devices, &mut seen)?);
    }
    Ok(config)
}

/// Keys of an export added at runtime that belong to its `[[device]]`
/// (NVMe's `pci` is not among them: a VFIO device is opened only at start).
const DEVICE_KEYS: [&str; 2] = ["backend", "sqpoll_idle_ms"];

/// An export given to the `export_add` RPC: the keys of an `[[export]]`
/// table, except that `device` is the device's path (or NVMe name) and the
/// `[[device]]` keys (`backend`, ...) sit beside it. Checked as a config
/// file's export is; what it may not share with running exports is the
/// caller's to check.
pub fn parse_runtime_export(params: &serde_json::Value) -> Result<Export, ConfigError> {
    let fail = |message: String| ConfigError { file: "export_add".into(), line: 0, column: 0, message };
    let serde_json::Value::Object(fields) = params else {
        return Err(fail("the export is a JSON object with an [[export]] table's keys".into()));
    };
    let mut export = toml::Table::new();
    let mut device = toml::Table::new();
    device.insert("name".into(), toml::Value::String("export_add".into()));
    for (key, value) in fields {
        let value: toml::Value = serde_json::from_value(value.clone()).map_err(|e| fail(format!("{key}: {e}")))?;
        match key.as_str() {
            "device" => {
                if !value.is_str() {
                    return Err(fail("device is the device's path, a string".into()));
                }
                device.insert("path".into(), value);
                export.insert("device".into(), toml::Value::String("export_add".into()));
            }
            k if DEVICE_KEYS.contains(&k) => drop(device.insert(key.clone(), value)),
            _ => drop(export.insert(key.clone(), value)),
        }
    }
    let mut document = toml::Table::new();
    document.insert("device".into(), toml::Value::Array(vec![toml::Value::Table(device)]));
    document.insert("export".into(), toml::Value::Array(vec![toml::Value::Table(export)]));
    let text = toml::to_string(&document).map_err(|e| fail(e.to_string()))?;
    let mut config = parse("export_add", &text)?;
    config.exports.pop().ok_or_else(|| fail("no export".into()))
}

fn apply_daemon(src: &Source, daemon: RawDaemon, config: &mut Config) -> Result<(), ConfigError> {
    if let Some(reactors) = &daemon.reactors {
        config.reactors = match reactors.get_ref() {
            RawReactors::Count(0) => return Err(src.error(reactors.span(), "reactors must be at least 1")),
            RawReactors::Count(n) if *n > 64 => return Err(src.error(reactors.span(), "at most 64 reactors")),
            RawReactors::Count(n) => vec![None; *n],
            RawReactors::Cpus(cpus) if cpus.is_empty() => {
                return Err(src.error(reactors.span(), "the CPU list is empty"))
            }
            RawReactors::Cpus(cpus) => {
                let unique: HashSet<_> = cpus.iter().collect();
                if unique.len() != cpus.len() {
                    return Err(src.error(reactors.span(), "a CPU appears twice in the list"));
                }
                cpus.iter().map(|&c| Some(c)).collect()
            }
        };
    }
    config.poll_mode = daemon.poll_mode.unwrap_or_default();
    config.poll_mode_chosen = daemon.poll_mode.is_some();
    config.rpc_socket = daemon.rpc_socket;
    config.sandbox = daemon.sandbox.unwrap_or_default();
    if let Some(log) = daemon.log {
        config.log = log;
    }
    config.log_format = daemon.log_format.unwrap_or_default();
    config.export_dirs = daemon.export_dirs.unwrap_or_default();
    if let Some(addr) = &daemon.metrics_listen {
        let parsed = addr.get_ref().parse().map_err(|e| {
            src.error(addr.span(), format!("metrics_listen: {e}; give an address and port, e.g. \"127.0.0.1:9560\""))
        })?;
        config.metrics_listen = Some(parsed);
    }
    if let Some(ms) = &daemon.commit_interval_ms {
        if *ms.get_ref() == 0 {
            return Err(src.error(ms.span(), "commit_interval_ms must be at least 1"));
        }
        config.commit_interval = Duration::from_millis(*ms.get_ref());
    }
    Ok(())
}

/// What two exports may not share: tags, sockets and devices.
#[derive(Default)]
struct SeenInExports {
    tags: HashSet<String>,
    sockets: HashSet<PathBuf>,
    devices: HashSet<String>,
}

fn parse_export(
    src: &Source,
    spanned: &Spanned<RawExport>,
    devices: &[Spanned<RawDevice>],
    seen: &mut SeenInExports,
) -> Result<Export, ConfigError> {
    let e = spanned.get_ref();
    let tag = e.tag.get_ref();
    if tag.is_empty() || tag.len() > 36 {
        return Err(src.error(e.tag.span(), "a tag is 1 to 36 bytes (virtio-fs's limit)"));
    }
    if !seen.tags.insert(tag.clone()) {
        return Err(src.error(e.tag.span(), format!("tag \"{tag}\" is exported twice")));
    }
    let device = devices
        .iter()
        .map(Spanned::get_ref)
        .find(|d| d.name.get_ref() == e.device.get_ref())
        .ok_or_else(|| src.error(e.device.span(), format!("no [[device]] is named \"{}\"", e.device.get_ref())))?;
    if !seen.devices.insert(e.device.get_ref().clone()) {
        return Err(src.error(
            e.device.span(),
            format!("device \"{}\" is already exported: one filesystem per device", e.device.get_ref()),
        ));
    }
    let path = device_path(device).map_err(|m| src.error(device.name.span(), m))?;
    let mut export = Export::new(tag, path);
    export.backend = device.backend;
    export.sqpoll_idle_ms = device.sqpoll_idle_ms;
    if let Some(socket) = &e.socket {
        if !seen.sockets.insert(socket.get_ref().clone()) {
            return Err(src.error(socket.span(), "two exports share this socket"));
        }
        export.socket = Some(socket.get_ref().clone());
    }
    if e.socket.is_none() && e.fuse_mount.is_none() {
        return Err(src.error(spanned.span(), format!("export \"{tag}\" has neither a socket nor a fuse_mount")));
    }
    apply_socket_access(src, e, &mut export)?;
    apply_serving(src, e, &mut export)?;
    apply_limits(src, e, &mut export)?;
    apply_space(src, e, &mut export)?;
    export.read_only = e.read_only.unwrap_or(false);
    if let Some(name) = &e.snapshot {
        keelfs_fs::check_snapshot_name(name.get_ref()).map_err(|why| src.error(name.span(), why))?;
        if !export.read_only {
            return Err(src.error(name.span(), "a snapshot is served read-only: set read_only = true"));
        }
        export.snapshot = Some(name.get_ref().clone());
    }
    export.xattr = e.xattr.unwrap_or(true);
    export.fuse_mount = e.fuse_mount.clone();
    export.session_file = e.session_file.clone();
    apply_qos(src, e, &mut export)?;
    Ok(export)
}

/// The export's QoS limits. Refused with spread_queues: the limiter lives
/// on the export's reactor, and the other reactors' queues cannot share it.
fn apply_qos(src: &Source, e: &RawExport, export: &mut Export) -> Result<(), ConfigError> {
    let Some(spanned) = &e.qos else { return Ok(()) };
    let q = spanned.get_ref();
    let mib = |n: Option<u64>| n.map(|n| n.saturating_mul(1 << 20));
    let mut limits = QosLimits {
        read_iops: q.read_iops,
        write_iops: q.write_iops,
        iops: q.iops,
        read_bytes_per_sec: mib(q.read_mib_per_sec),
        write_bytes_per_sec: mib(q.write_mib_per_sec),
        bytes_per_sec: mib(q.mib_per_sec),
        ..QosLimits::UNLIMITED
    };
    if let Some(ms) = &q.burst_ms {
        let max = u64::from(QosLimits::BURST_MS_MAX);
        if !(1..=max).contains(ms.get_ref()) {
            return Err(src.error(ms.span(), format!("burst_ms must be between 1 and {max}")));
        }
        limits.burst_ms = *ms.get_ref() as u32;
    }
    if export.spread_queues && !limits.is_unlimited() {
        return Err(src.error(
            spanned.span(),
            "qos limits cannot be combined with spread_queues (the limiter lives on the export's reactor)",
        ));
    }
    export.qos = limits;
    Ok(())
}

/// Who may connect to the export's socket.
fn apply_socket_access(src: &Source, e: &RawExport, export: &mut Export) -> Result<(), ConfigError> {
    if let Some(owner) = &e.socket_owner {
        export.socket_owner = Some(resolve_owner(owner.get_ref()).map_err(|m| src.error(owner.span(), m))?);
    }
    if let Some(mode) = &e.socket_mode {
        let parsed = u32::from_str_radix(mode.get_ref().trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o777)
            .ok_or_else(|| src.error(mode.span(), "socket_mode is an octal string such as \"0660\""))?;
        export.socket_mode = Some(parsed);
    }
    Ok(())
}

/// How the export is served: caching, queues, page cache and atime.
fn apply_serving(src: &Source, e: &RawExport, export: &mut Export) -> Result<(), ConfigError> {
    if let Some(cache) = e.cache {
        export.cache = match cache {
            CacheName::None => Cache::None,
            CacheName::Auto => Cache::Auto,
            CacheName::Always => Cache::Always,
        };
    }
    if let Some(locks) = e.locks {
        export.locks = locks;
    }
    if let Some(queues) = &e.request_queues {
        let n = *queues.get_ref();
        if n == 0 || n > REQUEST_QUEUES_MAX {
            return Err(src.error(queues.span(), format!("request_queues must be 1 to {REQUEST_QUEUES_MAX}")));
        }
        export.request_queues = usize::from(n);
    }
    export.spread_queues = e.spread_queues.unwrap_or(false);
    export.fuse_transport = e.fuse_transport.unwrap_or_default();
    if let Some(size) = &e.page_cache {
        let bytes = parse_size(size.get_ref()).map_err(|m| src.error(size.span(), m.to_string()))?;
        if bytes < 1 << 20 {
            return Err(src.error(size.span(), "page_cache must be at least 1M"));
        }
        export.page_cache_bytes = bytes;
    }
    if let Some(n) = &e.inodes_max {
        if *n.get_ref() < 16 {
            return Err(src.error(n.span(), "inodes_max must be at least 16"));
        }
        export.inodes_max = Some(*n.get_ref());
    }
    if let Some(atime) = e.atime {
        export.atime = match atime {
            AtimeName::Relatime => keelfs_fs::AtimeUpdates::Relative,
            AtimeName::Noatime => keelfs_fs::AtimeUpdates::Never,
            AtimeName::Strictatime => keelfs_fs::AtimeUpdates::Always,
        };
    }
    Ok(())
}

/// "user" or "user:group", by name or number.
fn resolve_owner(text: &str) -> Result<(u32, u32), String> {
    let (user, group) = match text.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (text, None),
    };
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let (uid, primary_gid) = match user.parse::<u32>() {
        Ok(uid) => (uid, uid),
        Err(_) => passwd
            .lines()
            .map(|l| l.split(':').collect::<Vec<_>>())
            .find(|f| f.len() > 3 && f[0] == user)
            .and_then(|f| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
            .ok_or_else(|| format!("no user \"{user}\""))?,
    };
    let gid = match group {
        None => primary_gid,
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => std::fs::read_to_string("/etc/group")
                .unwrap_or_default()
                .lines()
                .map(|l| l.split(':').collect::<Vec<_>>())
                .find(|f| f.len() > 2 && f[0] == g)
                .and_then(|f| f[2].parse().ok())
                .ok_or_else(|| format!("no group \"{g}\""))?,
        },
    };
    Ok((uid, gid))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[daemon]
reactors = [0, 1]
poll_mode = "busy"
rpc_socket = "/run/keelfsd/rpc.sock"
log = "debug"
commit_interval_ms = 250

[[device]]
name = "fast"
path = "/dev/shm/fast.img"

[[device]]
name = "pm"
backend = "pmem"
path = "/dev/shm/pm.img"

[[export]]
tag = "vm1"
device = "fast"
socket = "/run/keelfsd/vm1.sock"
socket_owner = "0:0"
socket_mode = "0660"
cache = "none"
request_queues = 2
spread_queues = true
page_cache = "64M"

[[export]]
tag = "host"
device = "pm"
fuse_mount = "/mnt/keelfs"
atime = "noatime"
"#;

    #[test]
    fn a_full_config_parses_into_what_it_says() {
        let c = parse("good.toml", GOOD).unwrap();
        assert_eq!(c.reactors, vec![Some(0), Some(1)]);
        assert_eq!(c.poll_mode, PollModeName::Busy);
        assert_eq!(c.rpc_socket.as_deref(), Some(Path::new("/run/keelfsd/rpc.sock")));
        assert_eq!(c.log, "debug");
        assert_eq!(c.commit_interval, Duration::from_millis(250));
        assert_eq!(c.exports.len(), 2);
        let vm1 = &c.exports[0];
        assert_eq!(
            (vm1.tag.as_str(), vm1.device.as_path(), vm1.request_queues, vm1.cache),
            ("vm1", Path::new("/dev/shm/fast.img"), 2, Cache::None)
        );
        assert_eq!((vm1.socket_owner, vm1.socket_mode, vm1.page_cache_bytes), (Some((0, 0)), Some(0o660), 64 << 20));
        let host = &c.exports[1];
        assert!(vm1.spread_queues && !host.spread_queues, "spread_queues is read, and off by default");
        use keelfs_fs::AtimeUpdates;
        assert_eq!(
            (vm1.atime, host.atime),
            (AtimeUpdates::Relative, AtimeUpdates::Never),
            "atime, relatime by default"
        );
        assert_eq!(
            (host.backend, host.socket.as_ref(), host.fuse_mount.as_deref()),
            (BackendName::Pmem, None, Some(Path::new("/mnt/keelfs")))
        );
    }

    #[test]
    fn an_empty_file_means_the_defaults() {
        let c = parse("empty.toml", "").unwrap();
        assert_eq!(c, Config::default());
    }

    fn error_of(text: &str) -> String {
        parse("bad.toml", text).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_file_line_and_column() {
        assert_eq!(error_of("[daemon]\nreactors = 0\n"), "bad.toml:2:12: reactors must be at least 1");
        assert_eq!(
            error_of("[daemon]\npoll_mode = \"spin\"\n"),
            "bad.toml:2:13: unknown variant `spin`, expected one of `busy`, `adaptive`, `interrupt`"
        );
        assert_eq!(error_of("[daemon]\nreactor = 2\n"), "bad.toml:2:1: unknown field `reactor`, expected one of `reactors`, `poll_mode`, `rpc_socket`, `log`, `log_format`, `metrics_listen`, `export_dirs`, `commit_interval_ms`, `sandbox`");
        assert_eq!(
            error_of("[[export]]\ntag = \"a\"\ndevice = \"nope\"\nsocket = \"/s\"\n"),
            "bad.toml:3:10: no [[device]] is named \"nope\""
        );
        let two = "[[device]]\nname = \"d\"\npath = \"/x\"\n[[export]]\ntag = \"a\"\ndevice = \"d\"\nsocket = \"/s\"\n\
                   [[export]]\ntag = \"b\"\ndevice = \"d\"\nsocket = \"/t\"\n";
        assert_eq!(error_of(two), "bad.toml:10:10: device \"d\" is already exported: one filesystem per device");
        let mode = "[[device]]\nname = \"d\"\npath = \"/x\"\n[[export]]\ntag = \"a\"\ndevice = \"d\"\nsocket = \"/s\"\nsocket_mode = \"rw\"\n";
        assert_eq!(error_of(mode), "bad.toml:8:15: socket_mode is an octal string such as \"0660\"");
        let queues = "[[device]]\nname = \"d\"\npath = \"/x\"\n[[export]]\ntag = \"a\"\ndevice = \"d\"\nsocket = \"/s\"\nrequest_queues = 64\n";
        assert_eq!(error_of(queues), "bad.toml:8:18: request_queues must be 1 to 63");
        assert_eq!(error_of("[daemon\n"), "bad.toml:1:8: invalid table header\nexpected `.`, `]`");
    }

    #[test]
    fn nvme_devices_name_a_pci_address_and_namespace() {
        let text = "[[device]]\nname = \"n\"\nbackend = \"nvme\"\npci = \"0000:00:05.0\"\nnamespace = 2\n\
                    [[export]]\ntag = \"a\"\ndevice = \"n\"\nsocket = \"/s\"\n";
        let c = parse("nvme.toml", text).unwrap();
        assert_eq!(c.exports[0].device, Path::new("nvme:0000:00:05.0/2"));
        assert_eq!(c.exports[0].backend, BackendName::Nvme);
        let export = "[[export]]\ntag = \"a\"\ndevice = \"n\"\nsocket = \"/s\"\n";
        let with_path = format!("[[device]]\nname = \"n\"\nbackend = \"nvme\"\npath = \"/dev/nvme0n1\"\n{export}");
        assert!(
            error_of(&with_path).starts_with("bad.toml:2:8: device \"n\": an nvme device takes pci"),
            "{}",
            error_of(&with_path)
        );
        let pci_on_uring = format!("[[device]]\nname = \"n\"\npath = \"/x\"\npci = \"0000:00:05.0\"\n{export}");
        assert_eq!(
            error_of(&pci_on_uring),
            "bad.toml:2:8: device \"n\": pci and namespace apply only to backend = \"nvme\""
        );
        let bad_pci = format!("[[device]]\nname = \"n\"\nbackend = \"nvme\"\npci = \"00:05.0\"\n{export}");
        assert!(error_of(&bad_pci).contains("nvme:DOMAIN:BUS:DEVICE.FUNCTION"), "{}", error_of(&bad_pci));
    }

    #[test]
    fn rbd_devices_take_an_rbd_name_as_their_path() {
        let export = "[[export]]\ntag = \"a\"\ndevice = \"r\"\nsocket = \"/s\"\n";
        let text = format!(
            "[[device]]\nname = \"r\"\nbackend = \"rbd\"\npath = \"rbd:keelfs/vm1@/etc/ceph/c.conf:id=keelfs\"\n{export}"
        );
        let c = parse("rbd.toml", &text).unwrap();
        assert_eq!(c.exports[0].device, Path::new("rbd:keelfs/vm1@/etc/ceph/c.conf:id=keelfs"));
        assert_eq!(c.exports[0].backend, BackendName::Rbd);
        let not_rbd = format!("[[device]]\nname = \"r\"\nbackend = \"rbd\"\npath = \"/dev/rbd0\"\n{export}");
        assert!(error_of(&not_rbd).contains("rbd:POOL/IMAGE"), "{}", error_of(&not_rbd));
        let no_pool = format!("[[device]]\nname = \"r\"\nbackend = \"rbd\"\npath = \"rbd:vm1\"\n{export}");
        assert!(error_of(&no_pool).contains("no '/' between pool and image"), "{}", error_of(&no_pool));
    }

    #[test]
    fn fuse_transport_is_auto_unless_set() {
        let base = "[[device]]\nname = \"d\"\npath = \"/x\"\n[[export]]\ntag = \"a\"\ndevice = \"d\"\n";
        let e =
            |extra: &str| parse("t.toml", &format!("{base}fuse_mount = \"/m\"\n{extra}")).map(|c| c.exports[0].clone());
        assert_eq!(e("").unwrap().fuse_transport, FuseTransport::Auto);
        assert_eq!(e("fuse_transport = \"uring\"\n").unwrap().fuse_transport, FuseTransport::Uring);
        assert_eq!(e("fuse_transport = \"dev\"\n").unwrap().fuse_transport, FuseTransport::Dev);
        assert!(e("fuse_transport = \"splice\"\n").is_err());
    }

    #[test]
    fn per_export_limits_parse_and_refuse_the_absurd() {
        let base =
            "[[device]]\nname = \"d\"\npath = \"/x\"\n[[export]]\ntag = \"a\"\ndevice = \"d\"\nsocket = \"/s\"\n";
        let limits = format!(
            "{base}open_handles_max = 1000\nxattr_bytes_per_inode_max = \"64K\"\nrequests_in_flight_max = 128\nhost_dirty_ratio = 0\n"
        );
        let e = &parse("limits.toml", &limits).unwrap().exports[0];
        assert_eq!(
            (e.open_handles_max, e.xattr_bytes_per_inode_max, e.requests_in_flight_max, e.host_dirty_ratio),
            (1000, 65536, Some(128), 0)
        );
        let defaults = &parse("limits.toml", base).unwrap().exports[0];
        assert_eq!((defaults.open_handles_max, defaults.requests_in_flight_max), (65536, None));
        assert_eq!(defaults.host_dirty_ratio, HOST_DIRTY_RATIO_DEFAULT);
        assert_eq!(
            error_of(&format!("{base}host_dirty_ratio = 101\n")),
            "bad.toml:8:20: host_dirty_ratio must be between 0 (the kernel's FUSE limit) and 100"
        );
        assert!(!defaults.read_only);
        assert!(parse("ro.toml", &format!("{base}read_only = true\n")).unwrap().exports[0].read_only);
        assert!(defaults.xattr, "xattrs are served unless turned off");
        assert!(!parse("x.toml", &format!("{base}xattr = false\n")).unwrap().exports[0].xattr);
        assert_eq!(defaults.locks, Locks::Auto, "keelfs holds locks only for a shared export");
        assert_eq!(parse("l.toml", &format!("{base}locks = \"export\"\n")).unwrap().exports[0].locks, Locks::Export);
        assert!(parse("l.toml", &format!("{base}locks = \"everywhere\"\n")).is_err());
        assert!(Locks::Auto.held_by_keelfs(true) && !Locks::Auto.held_by_keelfs(false));
        assert!(Locks::Export.held_by_keelfs(false) && !Locks::Client.held_by_keelfs(true));
        assert_eq!(
            error_of(&format!("{base}open_handles_max = 0\n")),
            "bad.toml:8:20: open_handles_max must be between 16 and 16777216"
        );
        assert_eq!(
            error_of(&format!("{base}xattr_bytes_per_inode_max = \"1G\"\n")),
            "bad.toml:8:29: xattr_bytes_per_inode_max must be between 4K and 256K"
        );
        assert_eq!(
            error_of(&format!("{base}requests_in_flight_max = 0\n")),
            "bad.toml:8:26: requests_in_flight_max must be between 1 and 32768"
        );
    }

    #[test]
    fn discard_and_quota_keys_parse_and_default_off() {
        let base =
            "[[device]]\nname = \"d\"\npath = \"/x\"\n[[export]]\ntag = \"a\"\ndevice = \"d\"\nsocket = \"/s\"\n";
        let set =
            format!("{base}discard = true\ndiscard_mib_per_sec = 64\nquota_bytes = \"16M\"\nquota_inodes = 1000\n");
        let e = &parse("space.toml", &set).unwrap().exports[0];
        assert_eq!((e.discard, e.discard_mib_per_sec), (true, 64));
        assert_eq!(e.quota, keelfs_fs::Quota { bytes: Some(16 << 20), inodes: Some(1000) });
        let defaults = &parse("space.toml", base).unwrap().exports[0];
        assert_eq!((defaults.discard, defaults.discard_mib_per_sec), (false, DISCARD_MIB_PER_SEC_DEFAULT));
        assert_eq!(defaults.quota, keelfs_fs::Quota::default());
        assert_eq!(
            error_of(&format!("{base}quota_bytes = \"4K\"\n")),
            "bad.toml:8:15: quota_bytes must be at least 1M"
        );
        assert_eq!(error_of(&format!("{base}quota_inodes = 1\n")), "bad.toml:8:16: quota_inodes must be at least 16");
        assert!(error_of(&format!("{base}discard_mib_per_sec = 9999999\n")).contains("discard_mib_per_sec must be"));
    }

    #[test]
    fn qos_limits_parse_and_refuse_spread_queues() {
        let base =
            "[[device]]\nname = \"d\"\npath = \"/x\"\n[[export]]\ntag = \"a\"\ndevice = \"d\"\nsocket = \"/s\"\n";
        let qos = format!(
            "{base}[export.qos]\nread_iops = 1000\nwrite_iops = 500\niops = 1200\nread_mib_per_sec = 100\n\
             write_mib_per_sec = 50\nmib_per_sec = 120\nburst_ms = 250\n"
        );
        let q = parse("qos.toml", &qos).unwrap().exports[0].qos;
        let expected = QosLimits {
            read_iops: Some(1000),
            write_iops: Some(500),
            iops: Some(1200),
            read_bytes_per_sec: Some(100 << 20),
            write_bytes_per_sec: Some(50 << 20),
            bytes_per_sec: Some(120 << 20),
            burst_ms: 250,
        };
        assert_eq!(q, expected);
        assert_eq!(parse("qos.toml", base).unwrap().exports[0].qos, QosLimits::UNLIMITED, "no limits by default");
        assert_eq!(
            error_of(&format!("{base}[export.qos]\nburst_ms = 0\n")),
            "bad.toml:9:12: burst_ms must be between 1 and 60000"
        );
        assert!(
            error_of(&format!("{base}[export.qos]\niop = 5\n")).starts_with("bad.toml:9:1: unknown field `iop`"),
            "{}",
            error_of(&format!("{base}[export.qos]\niop = 5\n"))
        );
        let spread = format!("{base}spread_queues = true\n[export.qos]\niops = 5000\n");
        assert!(error_of(&spread).contains("cannot be combined with spread_queues"), "{}", error_of(&spread));
        let spread_unlimited = format!("{base}spread_queues = true\n[export.qos]\niops = 0\n");
        assert!(parse("qos.toml", &spread_unlimited).is_ok(), "0 is no limit");
    }
}
