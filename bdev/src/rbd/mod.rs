//! Ceph RBD backend: an image in a Ceph pool, through librbd's
//! asynchronous API.
//!
//! Each queue submits with `rbd_aio_*` from its reactor; librbd's threads
//! finish the requests and leave completions in the queue's lock-free
//! [`sys::Sink`], which `poll` drains. librbd's own cache is off: keelfs
//! has a page cache, and without librbd's a completed write is on the OSDs
//! (the device still asks for flushes, in case an image's config turns
//! the cache back on).
//!
//! A writable open takes the image's exclusive lock (enabling the
//! exclusive-lock feature if the image lacks it) and keeps it: librbd then
//! refuses other clients' requests for it, so a second keelfsd, on this
//! host or another, is refused and told who holds it.

#[cfg(feature = "test-utils")]
mod scratch;
mod sys;

#[cfg(feature = "test-utils")]
pub use scratch::{dev_cluster_up, ScratchImage};

use std::fmt;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use super::{
    validate_request, BdevError, BlockDevice, Completion, Geometry, IoKind, IoQueue, IoRequest, QueueConfig, Token,
    MAX_IOVECS_PER_REQUEST, MAX_REQUEST_BYTES,
};

/// How long connecting waits for the monitors before saying the cluster
/// is unreachable (librados's own default is 300 s).
pub const CONNECT_TIMEOUT_SECS: u32 = 10;

/// The features `keelfsd mkfs` gives an image it creates: rbd's defaults.
/// Object map and fast-diff make discards and sparse reads cheap; they
/// need the exclusive lock, which keelfs relies on anyway.
const CREATE_FEATURES: u64 = sys::FEATURE_LAYERING
    | sys::FEATURE_EXCLUSIVE_LOCK
    | sys::FEATURE_OBJECT_MAP
    | sys::FEATURE_FAST_DIFF
    | sys::FEATURE_DEEP_FLATTEN;

/// `rbd:POOL/IMAGE[@CLUSTER_CONF][:id=CLIENT]`, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RbdAddress {
    pub pool: String,
    pub image: String,
    /// The cluster's ceph.conf; None: Ceph's default search
    /// (`$CEPH_CONF`, /etc/ceph/ceph.conf, ...).
    pub conf: Option<String>,
    /// The client's id (`keelfs` for client.keelfs); None: admin.
    pub client: Option<String>,
}

const NAME_FORM: &str = "rbd:POOL/IMAGE[@CLUSTER_CONF][:id=CLIENT]";

impl RbdAddress {
    pub fn is_rbd_name(name: &str) -> bool {
        name.starts_with("rbd:")
    }

    pub fn parse(name: &str) -> Result<Self, RbdError> {
        let bad = |why: &'static str| RbdError::BadName { name: name.to_string(), why };
        let rest = name.strip_prefix("rbd:").ok_or_else(|| bad("it does not start with rbd:"))?;
        let (rest, client) = match rest.rsplit_once(":id=") {
            Some((rest, client)) => (rest, Some(client.to_string())),
            None => (rest, None),
        };
        let (spec, conf) = match rest.split_once('@') {
            Some((spec, conf)) => (spec, Some(conf.to_string())),
            None => (rest, None),
        };
        let (pool, image) = spec.split_once('/').ok_or_else(|| bad("no '/' between pool and image"))?;
        let valid = |s: &str| {
            !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        };
        if !valid(pool) || !valid(image) {
            return Err(bad("pool and image are 1 to 128 of A-Z a-z 0-9 . _ -"));
        }
        if conf.as_deref().is_some_and(|c| c.is_empty() || c.contains('\0')) {
            return Err(bad("an empty or invalid CLUSTER_CONF after '@'"));
        }
        if client.as_deref().is_some_and(|c| !valid(c)) {
            return Err(bad("CLIENT after ':id=' is 1 to 128 of A-Z a-z 0-9 . _ -"));
        }
        Ok(Self { pool: pool.to_string(), image: image.to_string(), conf, client })
    }

    fn client_name(&self) -> String {
        format!("client.{}", self.client.as_deref().unwrap_or("admin"))
    }

    fn conf_name(&self) -> &str {
        self.conf.as_deref().unwrap_or("the default ceph.conf")
    }
}

impl fmt::Display for RbdAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rbd:{}/{}", self.pool, self.image)?;
        if let Some(conf) = &self.conf {
            write!(f, "@{conf}")?;
        }
        if let Some(client) = &self.client {
            write!(f, ":id={client}")?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RbdError {
    #[error("bad RBD device name {name:?}: {why} (expected {NAME_FORM})")]
    BadName { name: String, why: &'static str },
    #[error("cannot read the Ceph configuration ({conf}): {}", strerror(*errno))]
    Config { conf: String, errno: i32 },
    #[error("cannot reach the Ceph cluster of {conf} within {CONNECT_TIMEOUT_SECS} s: {}", strerror(*errno))]
    Unreachable { conf: String, errno: i32 },
    #[error("the Ceph cluster refused {client}: {} (check its keyring and caps)", strerror(*errno))]
    Credentials { client: String, errno: i32 },
    #[error("pool {pool} does not exist in the Ceph cluster")]
    NoPool { pool: String },
    #[error("RBD image {pool}/{image} does not exist (keelfsd mkfs rbd:{pool}/{image} --size SIZE creates it)")]
    NoImage { pool: String, image: String },
    #[error("rbd:{device} is locked by {holder}: another keelfsd serves it")]
    Locked { device: String, holder: String },
    #[error(
        "rbd:{device} is locked by {holder}, which still watches the image: it may be alive. Wait until its watch \
         expires (about 30 s after its death), or, once its host is known to be down, break the lock with \
         --fence-live"
    )]
    StillWatched { device: String, holder: String },
    #[error(
        "rbd:{device} is held by {holder}, serving it read-only; a reader watches nothing, so whether it is alive \
         cannot be told. Once its host is known to be down, break its lock with --fence-live"
    )]
    ReadersUnknown { device: String, holder: String },
    #[error("rbd:{device}: {call}: {}", strerror(*errno))]
    Ceph { device: String, call: &'static str, errno: i32 },
}

fn strerror(errno: i32) -> String {
    format!("{} (errno {errno})", std::io::Error::from_raw_os_error(errno))
}

impl RbdError {
    fn ceph(addr: &RbdAddress, e: sys::CephError) -> Self {
        RbdError::Ceph { device: format!("{}/{}", addr.pool, addr.image), call: e.call, errno: e.errno }
    }

    /// Whether the name, the configuration or the cluster's contents are
    /// wrong (the operator's to fix) rather than the cluster failing.
    pub fn is_usage(&self) -> bool {
        !matches!(self, RbdError::Ceph { .. } | RbdError::Unreachable { .. })
    }
}

/// How to open an image.
#[derive(Clone, Copy, Debug, Default)]
pub struct RbdOptions {
    /// Open it read-only: no lock is taken, and queues refuse writes.
    pub read_only: bool,
    /// Leave the exclusive lock to [`RbdDevice::take_lock`] (the
    /// destination of a migration takes it when the session arrives).
    pub defer_lock: bool,
}

pub struct RbdDevice {
    address: RbdAddress,
    name: String,
    image: Arc<sys::Image>,
    cluster: Arc<sys::Cluster>,
    geometry: Geometry,
    read_only: bool,
}

/// Whether `client` ("client.4123") is among an image's watchers: a live
/// client watches the images it has open.
fn watching(watchers: &[(i64, String)], client: &str) -> bool {
    let id = client.strip_prefix("client.").and_then(|id| id.parse::<i64>().ok());
    watchers.iter().any(|(w, _)| Some(*w) == id)
}

/// Whether Ceph's default search finds a conf: `$CEPH_CONF`,
/// /etc/ceph/ceph.conf, ~/.ceph/ceph.conf or ./ceph.conf.
fn default_conf_exists() -> bool {
    let home = std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".ceph/ceph.conf"));
    let candidates = [
        std::env::var_os("CEPH_CONF").map(std::path::PathBuf::from),
        Some("/etc/ceph/ceph.conf".into()),
        home,
        Some("ceph.conf".into()),
    ];
    candidates.into_iter().flatten().any(|p| p.is_file())
}

/// What keelfs sets on every cluster handle, over the conf and CEPH_ARGS.
/// `timeout`: [`CONNECT_TIMEOUT_SECS`], as text.
fn cluster_settings(timeout: &str) -> [(&'static str, &str); 6] {
    [
        ("client_mount_timeout", timeout),
        ("rbd_cache", "false"),
        // Breaking a lock (ours, or librbd's own of a dead holder) must
        // fence the holder first; a site's conf may not turn that off.
        ("rbd_blocklist_on_break_lock", "true"),
        // librados logs to files by default; keelfsd logs through tracing.
        ("log_file", ""),
        ("log_to_stderr", "false"),
        // A conf may give clients an admin socket; a sandboxed daemon can
        // neither bind one nor be reached on it (keelfsd's stats and RPC
        // serve instead).
        ("admin_socket", ""),
    ]
}

/// A cluster handle for `address`, configured but not connected.
fn configure(address: &RbdAddress) -> Result<sys::Configured, RbdError> {
    let timeout = CONNECT_TIMEOUT_SECS.to_string();
    let settings = cluster_settings(&timeout);
    sys::Cluster::configure(address.conf.as_deref(), address.client.as_deref(), &settings).map_err(|e| {
        match (e.call, e.errno) {
            ("reading the Ceph configuration", errno) => {
                RbdError::Config { conf: address.conf_name().to_string(), errno }
            }
            _ => RbdError::ceph(address, e),
        }
    })
}

/// Connect a configured handle and open the pool `address` names.
/// `conf_found`: whether a conf was named or Ceph's default search finds
/// one, as seen where the handle was configured (a sandbox sees none).
fn connect_configured(
    address: &RbdAddress,
    configured: sys::Configured,
    conf_found: bool,
) -> Result<(Arc<sys::Cluster>, Arc<sys::Pool>), RbdError> {
    let conf = address.conf_name().to_string();
    let cluster = configured.connect().map_err(|e| match e.errno {
        // No conf was found (CEPH_ARGS alone may do), and connecting
        // failed: the missing conf is the likelier cause.
        _ if !conf_found => RbdError::Config { conf, errno: libc::ENOENT },
        errno @ (libc::EACCES | libc::EPERM | libc::ENOENT) => {
            RbdError::Credentials { client: address.client_name(), errno }
        }
        errno => RbdError::Unreachable { conf, errno },
    })?;
    let cluster = Arc::new(cluster);
    let pool = cluster.pool(&address.pool).map_err(|e| match e.errno {
        libc::ENOENT => RbdError::NoPool { pool: address.pool.clone() },
        _ => RbdError::ceph(address, e),
    })?;
    Ok((cluster, Arc::new(pool)))
}

/// Connect to the cluster `address` names and open its pool.
fn connect(address: &RbdAddress) -> Result<(Arc<sys::Cluster>, Arc<sys::Pool>), RbdError> {
    let configured = configure(address)?;
    connect_configured(address, configured, conf_found(address))
}

fn conf_found(address: &RbdAddress) -> bool {
    address.conf.is_some() || default_conf_exists()
}

/// The longest keyring or key file keelfs reads (a keyring of a few
/// hundred entries); a longer one is not read, and connecting then looks
/// for the key itself.
const KEYRING_MAX_BYTES: u64 = 1 << 20;

/// The key of `client` ("client.admin") in a keyring's text: the `key`
/// line of its `[client]` section.
fn key_in_keyring(text: &str, client: &str) -> Option<String> {
    let mut in_section = false;
    for line in text.lines().map(str::trim) {
        if let Some(section) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            in_section = section.trim() == client;
        } else if let Some((name, value)) = line.split_once('=') {
            if in_section && name.trim() == "key" && !value.trim().is_empty() {
                return Some(value.trim().to_string());
            }
        }
    }
    None
}

fn read_small(path: &str) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    let file = std::fs::File::open(path).ok()?;
    file.take(KEYRING_MAX_BYTES).read_to_string(&mut text).ok()?;
    Some(text)
}

/// The key connecting would use, found where librados would look: the
/// `key` setting, else the `keyfile`, else the first readable file of the
/// `keyring` list that holds the client's section.
fn find_key(configured: &sys::Configured, client: &str) -> Result<Option<String>, sys::CephError> {
    let key = configured.setting("key")?;
    if !key.is_empty() {
        return Ok(Some(key));
    }
    let keyfile = configured.setting("keyfile")?;
    if !keyfile.is_empty() {
        return Ok(read_small(&keyfile).map(|k| k.trim().to_string()).filter(|k| !k.is_empty()));
    }
    let list = configured.setting("keyring")?;
    let paths = list.split([',', ';', ' ', '\t']).filter(|p| !p.is_empty());
    Ok(paths.filter_map(read_small).find_map(|text| key_in_keyring(&text, client)))
}

/// `mon_host` with every monitor named by DNS name replaced by its address
/// (the first the resolver gives), so that connecting needs no resolver:
/// in keelfsd's sandbox there is no /etc/resolv.conf. Plain `HOST[:PORT]`
/// lists only; one with Ceph's address vectors (`[v2:...,v1:...]`) holds
/// addresses already. None when nothing changes or a name does not
/// resolve (connecting then says the cluster is unreachable).
fn monitors_by_address(mon_host: &str) -> Option<String> {
    use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
    if mon_host.contains(['[', ']']) {
        return None;
    }
    let mut changed = false;
    let mut out = Vec::new();
    for token in mon_host.split([',', ';', ' ', '\t']).filter(|t| !t.is_empty()) {
        if token.parse::<IpAddr>().is_ok() || token.parse::<SocketAddr>().is_ok() {
            out.push(token.to_string());
            continue;
        }
        let (host, port) = match token.rsplit_once(':') {
            Some((host, port)) => (host, Some(port.parse::<u16>().ok()?)),
            None => (token, None),
        };
        let ip = (host, port.unwrap_or(0)).to_socket_addrs().ok()?.next()?.ip();
        changed = true;
        out.push(match (port, ip) {
            (None, ip) => ip.to_string(),
            (Some(port), ip) => SocketAddr::new(ip, port).to_string(),
        });
    }
    changed.then(|| out.join(","))
}

/// An image's cluster handle, configured and holding the client's key:
/// everything of opening that reads files is done, so that the rest
/// (connecting, which starts librados's threads) can happen where no file
/// can be read, as in keelfsd's sandbox.
pub struct RbdPrepared {
    address: RbdAddress,
    options: RbdOptions,
    configured: sys::Configured,
    conf_found: bool,
}

impl RbdPrepared {
    /// Connect and open the image, as [`RbdDevice::open`] does.
    pub fn open(self) -> Result<RbdDevice, RbdError> {
        let (cluster, pool) = connect_configured(&self.address, self.configured, self.conf_found)?;
        RbdDevice::open_in(&self.address, self.options, cluster, &pool)
    }
}

impl RbdDevice {
    /// Create the image with `size_bytes` if it does not exist, or grow it
    /// to that size if it is smaller: `keelfsd mkfs --size`. Returns
    /// whether it created or grew it, and its size.
    pub fn create_or_grow(address: &RbdAddress, size_bytes: u64) -> Result<(bool, u64), RbdError> {
        let (_cluster, pool) = connect(address)?;
        match pool.create_image(&address.image, size_bytes, CREATE_FEATURES) {
            Ok(()) => return Ok((true, size_bytes)),
            Err(e) if e.errno == libc::EEXIST => {}
            Err(e) => return Err(RbdError::ceph(address, e)),
        }
        let image = pool.open_image(&address.image, false).map_err(|e| RbdError::ceph(address, e))?;
        let size = image.size().map_err(|e| RbdError::ceph(address, e))?;
        if size >= size_bytes {
            return Ok((false, size));
        }
        image.resize(size_bytes).map_err(|e| RbdError::ceph(address, e))?;
        Ok((true, size_bytes))
    }

    /// Remove the image and its data; refused while a client has it open.
    pub fn remove(address: &RbdAddress) -> Result<(), RbdError> {
        let (_cluster, pool) = connect(address)?;
        pool.remove_image(&address.image).map_err(|e| RbdError::ceph(address, e))
    }

    pub fn open(address: &RbdAddress, options: RbdOptions) -> Result<Self, RbdError> {
        let (cluster, pool) = connect(address)?;
        Self::open_in(address, options, cluster, &pool)
    }

    /// Configure the cluster handle, read the client's key into it and
    /// resolve monitors named by DNS name; [`RbdPrepared::open`] does the
    /// rest. Fails on a conf that cannot be read; a key not found is left
    /// for connecting to report.
    pub fn prepare(address: &RbdAddress, options: RbdOptions) -> Result<RbdPrepared, RbdError> {
        let ceph = |e| RbdError::ceph(address, e);
        let configured = configure(address)?;
        if let Some(key) = find_key(&configured, &address.client_name()).map_err(ceph)? {
            // The key in memory, and no file left to search.
            for (name, value) in [("key", key.as_str()), ("keyfile", ""), ("keyring", "")] {
                configured.set(name, value).map_err(ceph)?;
            }
        }
        if let Some(resolved) = monitors_by_address(&configured.setting("mon_host").map_err(ceph)?) {
            configured.set("mon_host", &resolved).map_err(ceph)?;
        }
        Ok(RbdPrepared { address: address.clone(), options, configured, conf_found: conf_found(address) })
    }

    fn open_in(
        address: &RbdAddress,
        options: RbdOptions,
        cluster: Arc<sys::Cluster>,
        pool: &Arc<sys::Pool>,
    ) -> Result<Self, RbdError> {
        let image = pool.open_image(&address.image, options.read_only).map_err(|e| match e.errno {
            libc::ENOENT => RbdError::NoImage { pool: address.pool.clone(), image: address.image.clone() },
            errno @ (libc::EPERM | libc::EACCES) => RbdError::Credentials { client: address.client_name(), errno },
            _ => RbdError::ceph(address, e),
        })?;
        let size = image.size().map_err(|e| RbdError::ceph(address, e))?;
        let capacity = size - size % 4096;
        if capacity == 0 {
            let device = format!("{}/{}", address.pool, address.image);
            return Err(RbdError::Ceph { device, call: "sizing the image", errno: libc::EINVAL });
        }
        let geometry = Geometry {
            capacity_bytes: capacity,
            logical_block_size: 512,
            memory_alignment: 512,
            // With librbd's cache off a completed write is on the OSDs,
            // but a pool's or image's own config (`rbd config pool set`)
            // can turn the cache back on: flush as if it could be on (a
            // flush with nothing cached costs one call into librbd).
            volatile_write_cache: true,
            max_iovecs_per_request: MAX_IOVECS_PER_REQUEST,
            max_request_bytes: MAX_REQUEST_BYTES,
        };
        let device = Self {
            name: address.to_string(),
            address: address.clone(),
            image: Arc::new(image),
            cluster,
            geometry,
            read_only: options.read_only,
        };
        if !options.read_only {
            device.ensure_exclusive_lock_feature()?;
            if !options.defer_lock {
                device.take_lock()?;
            }
        }
        Ok(device)
    }

    fn ensure_exclusive_lock_feature(&self) -> Result<(), RbdError> {
        let features = self.image.features().map_err(|e| RbdError::ceph(&self.address, e))?;
        if features & sys::FEATURE_EXCLUSIVE_LOCK == 0 {
            self.image.enable_features(sys::FEATURE_EXCLUSIVE_LOCK).map_err(|e| RbdError::ceph(&self.address, e))?;
            tracing::info!("{}: enabled the exclusive-lock feature", self.name);
        }
        Ok(())
    }

    /// Take the image's exclusive lock, or say who holds it. Blocks for a
    /// round trip to the cluster (more if it must fence a dead holder).
    pub fn take_lock(&self) -> Result<(), RbdError> {
        match self.try_take_lock()? {
            true => Ok(()),
            false => Err(self.locked_error()),
        }
    }

    /// Whether readers hold the image (a shared advisory lock). librbd's
    /// exclusive lock would not refuse them but wait for ever, retrying:
    /// a writer asks first.
    fn readers_hold(&self) -> Result<bool, RbdError> {
        let record = self.image.lock_record().map_err(|e| RbdError::ceph(&self.address, e))?;
        Ok(!record.exclusive && !record.lockers.is_empty())
    }

    /// Take a reader's shared lock (a read-only export): it keeps writers
    /// out for as long as it is held, and is refused while a writer holds
    /// the image. Released when the guard drops; a reader that dies leaves
    /// it behind, for [`Self::break_lock`] to clear once the reader no
    /// longer watches the image.
    pub fn take_reader_lock(&self) -> Result<RbdReaderLock, RbdError> {
        let cookie = format!("keelfs-reader-{}", self.cluster.instance_id());
        match self.image.lock_shared(&cookie, READER_TAG) {
            Ok(()) => Ok(RbdReaderLock { image: Arc::clone(&self.image), cookie, name: self.name.clone() }),
            Err(e) if matches!(e.errno, libc::EBUSY | libc::EEXIST) => Err(self.locked_error()),
            Err(e) => Err(RbdError::ceph(&self.address, e)),
        }
    }

    /// Take the lock if nobody else holds it: false if somebody does. Blocks
    /// as [`Self::take_lock`] does, but asks nothing more of the cluster
    /// when refused (a caller that retries needs no holder's name).
    pub fn try_take_lock(&self) -> Result<bool, RbdError> {
        if self.readers_hold()? {
            return Ok(false);
        }
        match self.image.lock_acquire() {
            Ok(()) => Ok(true),
            Err(e) if matches!(e.errno, libc::EROFS | libc::EBUSY | libc::EAGAIN) => Ok(false),
            Err(e) => Err(RbdError::ceph(&self.address, e)),
        }
    }

    /// Let go of the lock (a clean handover); the image stays open.
    pub fn release_lock(&self) -> Result<(), RbdError> {
        self.image.lock_release().map_err(|e| RbdError::ceph(&self.address, e))
    }

    pub fn owns_lock(&self) -> Result<bool, RbdError> {
        self.image.is_lock_owner().map_err(|e| RbdError::ceph(&self.address, e))
    }

    fn locked_error(&self) -> RbdError {
        let holder = self.holders().unwrap_or_else(|e| format!("another client ({e})"));
        RbdError::Locked { device: format!("{}/{}", self.address.pool, self.address.image), holder }
    }

    /// The lock's holders with their addresses, each marked when it no
    /// longer watches the image ("client.4123 at 10.87.0.11:0/2345"), or
    /// "nobody".
    pub fn holders(&self) -> Result<String, RbdError> {
        let record = self.image.lock_record().map_err(|e| RbdError::ceph(&self.address, e))?;
        if record.lockers.is_empty() {
            return Ok("nobody".into());
        }
        if !record.exclusive {
            // A shared lock is readers' (read-only exports), whose
            // read-only opens watch nothing: alive or dead, unknown.
            let named: Vec<String> =
                record.lockers.iter().map(|l| format!("reader {} at {}", l.client, l.address)).collect();
            return Ok(named.join(", "));
        }
        let watchers = self.image.watchers();
        let named: Vec<String> = record
            .lockers
            .iter()
            .map(|l| match &watchers {
                Ok(watchers) if watching(watchers, &l.client) => format!("{} at {}", l.client, l.address),
                Ok(_) => {
                    format!("{} at {} (no longer watching the image: dead, or cut off)", l.client, l.address)
                }
                Err(e) => {
                    format!("{} at {} (alive or not: watchers unknown, {} failed)", l.client, l.address, e.call)
                }
            })
            .collect();
        Ok(named.join(", "))
    }

    /// This client's name in the cluster ("client.4123").
    pub fn client_name(&self) -> String {
        format!("client.{}", self.cluster.instance_id())
    }

    /// Fence the lock's holder and break its lock (`keelfsd break-lock`).
    /// librbd blocklists the holder first (rbd_blocklist_on_break_lock), so
    /// a holder that is only cut off, not dead, can write no more. Refuses
    /// while the holder still watches the image, unless `live_too`.
    /// Returns the holders it broke.
    pub fn break_lock(&self, live_too: bool) -> Result<Vec<String>, RbdError> {
        if self.readers_hold()? {
            return self.break_readers(live_too);
        }
        let lockers = self.image.lockers().map_err(|e| RbdError::ceph(&self.address, e))?;
        let watchers = self.image.watchers().map_err(|e| RbdError::ceph(&self.address, e))?;
        if !live_too && lockers.iter().any(|(client, _)| watching(&watchers, client)) {
            let holder = self.holders().unwrap_or_else(|e| e.to_string());
            return Err(RbdError::StillWatched {
                device: format!("{}/{}", self.address.pool, self.address.image),
                holder,
            });
        }
        for (_, addr) in &lockers {
            // librbd names a lock's owner by its address here.
            self.image.lock_break(addr).map_err(|e| RbdError::ceph(&self.address, e))?;
        }
        Ok(lockers.into_iter().map(|(client, addr)| format!("{client} at {addr}")).collect())
    }
}

impl RbdDevice {
    /// Break the readers' shared locks, each reader fenced first. A
    /// read-only open watches nothing, so whether a reader is alive cannot
    /// be told: only `live_too` (`--fence-live`, for hosts known down)
    /// breaks them.
    fn break_readers(&self, live_too: bool) -> Result<Vec<String>, RbdError> {
        let record = self.image.lock_record().map_err(|e| RbdError::ceph(&self.address, e))?;
        if !live_too {
            let holder = self.holders().unwrap_or_else(|e| e.to_string());
            let device = format!("{}/{}", self.address.pool, self.address.image);
            return Err(RbdError::ReadersUnknown { device, holder });
        }
        for locker in &record.lockers {
            self.image.break_advisory(&locker.client, &locker.cookie).map_err(|e| RbdError::ceph(&self.address, e))?;
        }
        Ok(record.lockers.into_iter().map(|l| format!("reader {} at {}", l.client, l.address)).collect())
    }
}

/// The tag of a read-only export's shared lock on an RBD image.
pub const READER_TAG: &str = "keelfs-reader";

/// A reader's shared lock on an RBD image ([`RbdDevice::take_reader_lock`]):
/// released when dropped.
pub struct RbdReaderLock {
    image: Arc<sys::Image>,
    cookie: String,
    name: String,
}

impl std::fmt::Debug for RbdReaderLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdReaderLock").field("image", &self.name).field("cookie", &self.cookie).finish()
    }
}

impl Drop for RbdReaderLock {
    fn drop(&mut self) {
        if let Err(e) = self.image.unlock(&self.cookie) {
            tracing::warn!("{}: releasing the reader's shared lock failed ({} errno {})", self.name, e.call, e.errno);
        }
    }
}

impl BlockDevice for RbdDevice {
    fn name(&self) -> &str {
        &self.name
    }
    fn geometry(&self) -> Geometry {
        self.geometry
    }
    fn open_queue(&self, config: QueueConfig) -> Result<Box<dyn IoQueue>, BdevError> {
        Ok(Box::new(RbdQueue::new(Arc::clone(&self.image), self.geometry, self.read_only, config)?))
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn supports_discard(&self) -> bool {
        !self.read_only
    }
}

struct Slot {
    token: Token,
    kind: IoKind,
    /// Bytes a read or write moves; librbd returns it on success.
    bytes: u64,
    /// The request's segments, kept until it completes (librbd reads
    /// them after submission returns).
    iov: Vec<libc::iovec>,
}

pub struct RbdQueue {
    image: Arc<sys::Image>,
    geometry: Geometry,
    read_only: bool,
    sink: Arc<sys::Sink>,
    /// One per slot, at a fixed address librbd hands back.
    args: Box<[sys::SlotArg]>,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    in_flight: usize,
}

// SAFETY: the iovec pointers in slots name caller memory that the
// `IoQueue::submit` contract keeps valid; the queue is used by one thread
// at a time, and librbd's threads touch only the Sink (lock-free).
unsafe impl Send for RbdQueue {}

impl RbdQueue {
    fn new(
        image: Arc<sys::Image>,
        geometry: Geometry,
        read_only: bool,
        config: QueueConfig,
    ) -> Result<Self, BdevError> {
        let depth = config.depth.clamp(1, 4096);
        let wake = if config.completion_eventfd {
            // SAFETY: eventfd takes no pointers.
            let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if fd < 0 {
                return Err(BdevError::last_os("eventfd"));
            }
            // SAFETY: a descriptor we just opened and own.
            Some(unsafe { OwnedFd::from_raw_fd(fd) })
        } else {
            None
        };
        let sink = Arc::new(sys::Sink::new(depth as usize, wake));
        let args = (0..depth).map(|slot| sys::SlotArg { sink: Arc::clone(&sink), slot }).collect();
        let slots =
            (0..depth).map(|_| Slot { token: 0, kind: IoKind::Flush, bytes: 0, iov: Vec::with_capacity(8) }).collect();
        let free_slots = (0..depth).rev().collect();
        Ok(Self { image, geometry, read_only, sink, args, slots, free_slots, in_flight: 0 })
    }

    fn result_of(slot: &Slot, ret: i64) -> Result<u32, BdevError> {
        match (slot.kind, ret) {
            (_, ret) if ret == -i64::from(libc::EOPNOTSUPP) => {
                Err(BdevError::Unsupported("the image refused a discard"))
            }
            (_, ret) if ret < 0 => Err(BdevError::Io(i32::try_from(-ret).unwrap_or(libc::EIO))),
            // A write answers 0; a read the bytes it filled (all of them:
            // librbd zero-fills what was never written).
            (IoKind::Read, ret) if (ret as u64) < slot.bytes => {
                Err(BdevError::ShortTransfer { done: ret as u64, len: slot.bytes })
            }
            _ => Ok(slot.bytes as u32),
        }
    }
}

impl IoQueue for RbdQueue {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), BdevError> {
        let bytes = validate_request(&self.geometry, req)?;
        if self.read_only && matches!(req.kind, IoKind::Write | IoKind::Discard { .. }) {
            return Err(BdevError::ReadOnly);
        }
        let Some(&slot_id) = self.free_slots.last() else { return Err(BdevError::QueueFull) };
        let slot = &mut self.slots[slot_id as usize];
        slot.token = req.token;
        slot.kind = req.kind;
        slot.bytes = bytes;
        slot.iov.clear();
        slot.iov.extend(req.iovecs.iter().map(|v| libc::iovec { iov_base: v.base.cast(), iov_len: v.len }));
        let op = match req.kind {
            IoKind::Read => sys::Op::Read { offset: req.offset_bytes, iov: &slot.iov },
            IoKind::Write => sys::Op::Write { offset: req.offset_bytes, iov: &slot.iov },
            IoKind::Flush => sys::Op::Flush,
            IoKind::Discard { bytes } => sys::Op::Discard { offset: req.offset_bytes, bytes },
        };
        // SAFETY: the caller keeps the iovecs' memory valid until the
        // completion (submit's contract); the slot's iovec array and its
        // SlotArg stay put until the slot is freed in `poll`, after the
        // completion was popped; Drop waits for every slot in flight.
        unsafe { sys::submit(&self.image, &op, &self.args[slot_id as usize]) }.map_err(|e| BdevError::Io(e.errno))?;
        self.free_slots.pop();
        self.in_flight += 1;
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let mut n = 0;
        while n < max {
            let Some(done) = self.sink.pop() else { break };
            let slot = &self.slots[done.slot as usize];
            out.push(Completion { token: slot.token, result: Self::result_of(slot, done.ret) });
            self.free_slots.push(done.slot);
            self.in_flight -= 1;
            n += 1;
        }
        n
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn completion_eventfd(&self) -> Option<RawFd> {
        self.sink.wake_fd()
    }
}

impl Drop for RbdQueue {
    fn drop(&mut self) {
        // librbd may still write into caller memory and will call back with
        // our slots' arguments: wait for every request in flight. A cluster
        // that never answers holds shutdown here, and says so.
        let mut waited = std::time::Duration::ZERO;
        let step = std::time::Duration::from_millis(1);
        while self.in_flight > 0 {
            match self.sink.pop() {
                Some(done) => {
                    self.free_slots.push(done.slot);
                    self.in_flight -= 1;
                }
                None => {
                    std::thread::sleep(step);
                    waited += step;
                    if waited.as_millis().is_multiple_of(10_000) {
                        tracing::warn!(in_flight = self.in_flight, "waiting for librbd to finish requests");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A conf that asks for an hour's wait, and keelfs's settings over
    /// it: connecting to an unreachable cluster gives up after keelfs's
    /// timeout. Read back from librados, not timed.
    #[test]
    fn keelfs_settings_win_over_the_conf() {
        let dir = std::env::temp_dir().join(format!("keelfs-rbd-conf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let conf = dir.join("ceph.conf");
        std::fs::write(&conf, "[global]\nmon_host = 192.0.2.1\nclient_mount_timeout = 3600\nrbd_cache = true\n")
            .unwrap();
        let conf = conf.to_str().unwrap();
        let timeout = CONNECT_TIMEOUT_SECS.to_string();
        let plain = sys::Cluster::configure(Some(conf), None, &[]).unwrap();
        assert_eq!(plain.setting("client_mount_timeout").unwrap(), "3600", "the conf is read");
        let ours = sys::Cluster::configure(Some(conf), None, &cluster_settings(&timeout)).unwrap();
        assert_eq!(ours.setting("client_mount_timeout").unwrap(), timeout);
        assert_eq!(ours.setting("rbd_cache").unwrap(), "false");
        assert_eq!(ours.setting("rbd_blocklist_on_break_lock").unwrap(), "true");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_keyrings_section_gives_its_clients_key() {
        let text = "[client.admin]\n\tkey = AQAdmin==\n\tcaps mon = \"allow *\"\n[client.keelfs]\nkey=AQKeelfs==\n";
        assert_eq!(key_in_keyring(text, "client.admin").as_deref(), Some("AQAdmin=="));
        assert_eq!(key_in_keyring(text, "client.keelfs").as_deref(), Some("AQKeelfs=="));
        assert_eq!(key_in_keyring(text, "client.other"), None);
        assert_eq!(key_in_keyring("key = AQNoSection==\n", "client.admin"), None);
    }

    /// Preparing reads the key from the keyring the conf names and leaves
    /// librados no file to look for: connecting then opens nothing.
    #[test]
    fn preparing_keeps_the_key_in_memory_and_no_keyring_to_search() {
        let dir = std::env::temp_dir().join(format!("keelfs-rbd-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let keyring = dir.join("keyring");
        std::fs::write(&keyring, "[client.keelfs]\n\tkey = AQBXZGVsZnNrZXk=\n").unwrap();
        let conf = dir.join("ceph.conf");
        std::fs::write(&conf, format!("[global]\nmon_host = 192.0.2.1\nkeyring = {}\n", keyring.display())).unwrap();
        let name = format!("rbd:p/i@{}:id=keelfs", conf.display());
        let address = RbdAddress::parse(&name).unwrap();
        let prepared = RbdDevice::prepare(&address, RbdOptions::default()).unwrap();
        assert_eq!(prepared.configured.setting("key").unwrap(), "AQBXZGVsZnNrZXk=");
        assert_eq!(prepared.configured.setting("keyring").unwrap(), "");
        assert_eq!(prepared.configured.setting("admin_socket").unwrap(), "");
        // Another client's section is not taken for this one's.
        let other = RbdAddress::parse(&format!("rbd:p/i@{}:id=other", conf.display())).unwrap();
        let prepared = RbdDevice::prepare(&other, RbdOptions::default()).unwrap();
        assert_eq!(prepared.configured.setting("key").unwrap(), "");
        assert_eq!(prepared.configured.setting("keyring").unwrap(), keyring.display().to_string());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn monitors_named_by_dns_are_given_by_address() {
        assert_eq!(monitors_by_address("10.0.0.1,10.0.0.2:6789"), None, "addresses already");
        assert_eq!(monitors_by_address("[v2:10.0.0.1:3300,v1:10.0.0.1:6789]"), None);
        let resolved = monitors_by_address("localhost:6789, 10.0.0.2").unwrap();
        let (first, second) = resolved.split_once(',').unwrap();
        let first: std::net::SocketAddr = first.parse().unwrap();
        assert!(first.ip().is_loopback() && first.port() == 6789, "{resolved}");
        assert_eq!(second, "10.0.0.2");
        assert!(monitors_by_address("localhost").unwrap().parse::<std::net::IpAddr>().unwrap().is_loopback());
        assert_eq!(monitors_by_address("no-such-monitor.invalid"), None, "left for connecting to report");
    }

    #[test]
    fn names_parse_and_print_back() {
        let a = RbdAddress::parse("rbd:keelfs/vm1").unwrap();
        assert_eq!(
            (a.pool.as_str(), a.image.as_str(), a.conf.as_deref(), a.client.as_deref()),
            ("keelfs", "vm1", None, None)
        );
        assert_eq!(a.to_string(), "rbd:keelfs/vm1");
        let full = "rbd:p.1/img_2@/etc/ceph/other.conf:id=keelfs";
        let b = RbdAddress::parse(full).unwrap();
        assert_eq!(b.conf.as_deref(), Some("/etc/ceph/other.conf"));
        assert_eq!(b.client.as_deref(), Some("keelfs"));
        assert_eq!(b.to_string(), full);
        let c = RbdAddress::parse("rbd:p/i:id=x").unwrap();
        assert_eq!((c.conf, c.client.as_deref()), (None, Some("x")));
    }

    #[test]
    fn bad_names_say_what_is_wrong() {
        for (name, why) in [
            ("rbd:keelfs", "no '/'"),
            ("rbd:/vm1", "pool and image"),
            ("rbd:k/", "pool and image"),
            ("rbd:k/a b", "pool and image"),
            ("rbd:k/v@", "CLUSTER_CONF"),
            ("rbd:k/v:id=", "CLIENT"),
            ("nvme:0000:00:05.0", "rbd:"),
        ] {
            let e = RbdAddress::parse(name).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(NAME_FORM), "{name}: {e}");
        }
    }
}
