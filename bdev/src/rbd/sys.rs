//! librados and librbd (Ceph's client libraries, 16.2 on Debian bookworm),
//! declared by hand from their headers: every call into them is in this
//! file, behind types that own what they open (mod.rs keeps only the
//! queue's eventfd and the submit contract's unsafe).
//!
//! Completions arrive on librbd's own threads. [`on_complete`] moves each
//! one into a lock-free queue ([`Sink`]) that the owning reactor polls,
//! and signals the queue's eventfd when the reactor may be asleep; it never
//! takes a lock or touches anything else the reactor owns.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use crossbeam::queue::ArrayQueue;

type RadosT = *mut c_void;
type IoctxT = *mut c_void;
type ImageT = *mut c_void;
type CompletionT = *mut c_void;
type Callback = extern "C" fn(CompletionT, *mut c_void);

/// rbd_lock_mode_t's RBD_LOCK_MODE_EXCLUSIVE.
const LOCK_MODE_EXCLUSIVE: c_int = 0;

/// RBD_FEATURE_* (rbd/features.h).
pub const FEATURE_LAYERING: u64 = 1 << 0;
pub const FEATURE_EXCLUSIVE_LOCK: u64 = 1 << 2;
pub const FEATURE_OBJECT_MAP: u64 = 1 << 3;
pub const FEATURE_FAST_DIFF: u64 = 1 << 4;
pub const FEATURE_DEEP_FLATTEN: u64 = 1 << 5;

#[repr(C)]
struct ImageWatcher {
    addr: *mut c_char,
    id: i64,
    /// Written by librbd; keelfs names watchers by id and address only.
    #[allow(dead_code)]
    cookie: u64,
}

#[link(name = "rados")]
extern "C" {
    fn rados_create2(cluster: *mut RadosT, cluster_name: *const c_char, name: *const c_char, flags: u64) -> c_int;
    fn rados_conf_read_file(cluster: RadosT, path: *const c_char) -> c_int;
    fn rados_conf_parse_env(cluster: RadosT, var: *const c_char) -> c_int;
    fn rados_conf_set(cluster: RadosT, option: *const c_char, value: *const c_char) -> c_int;
    fn rados_conf_get(cluster: RadosT, option: *const c_char, buf: *mut c_char, len: usize) -> c_int;
    fn rados_connect(cluster: RadosT) -> c_int;
    fn rados_shutdown(cluster: RadosT);
    fn rados_get_instance_id(cluster: RadosT) -> u64;
    fn rados_ioctx_create(cluster: RadosT, pool_name: *const c_char, ioctx: *mut IoctxT) -> c_int;
    fn rados_ioctx_destroy(io: IoctxT);
}

#[link(name = "rbd")]
extern "C" {
    fn rbd_create2(io: IoctxT, name: *const c_char, size: u64, features: u64, order: *mut c_int) -> c_int;
    fn rbd_remove(io: IoctxT, name: *const c_char) -> c_int;
    fn rbd_open(io: IoctxT, name: *const c_char, image: *mut ImageT, snap_name: *const c_char) -> c_int;
    fn rbd_open_read_only(io: IoctxT, name: *const c_char, image: *mut ImageT, snap_name: *const c_char) -> c_int;
    fn rbd_close(image: ImageT) -> c_int;
    fn rbd_get_size(image: ImageT, size: *mut u64) -> c_int;
    fn rbd_resize(image: ImageT, size: u64) -> c_int;
    fn rbd_get_features(image: ImageT, features: *mut u64) -> c_int;
    fn rbd_update_features(image: ImageT, features: u64, enabled: u8) -> c_int;
    fn rbd_is_exclusive_lock_owner(image: ImageT, is_owner: *mut c_int) -> c_int;
    fn rbd_lock_acquire(image: ImageT, lock_mode: c_int) -> c_int;
    fn rbd_lock_release(image: ImageT) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn rbd_list_lockers(
        image: ImageT,
        exclusive: *mut c_int,
        tag: *mut c_char,
        tag_len: *mut usize,
        clients: *mut c_char,
        clients_len: *mut usize,
        cookies: *mut c_char,
        cookies_len: *mut usize,
        addrs: *mut c_char,
        addrs_len: *mut usize,
    ) -> isize;
    fn rbd_lock_break(image: ImageT, lock_mode: c_int, lock_owner: *const c_char) -> c_int;
    fn rbd_lock_shared(image: ImageT, cookie: *const c_char, tag: *const c_char) -> c_int;
    fn rbd_unlock(image: ImageT, cookie: *const c_char) -> c_int;
    fn rbd_break_lock(image: ImageT, client: *const c_char, cookie: *const c_char) -> c_int;
    fn rbd_watchers_list(image: ImageT, watchers: *mut ImageWatcher, max_watchers: *mut usize) -> c_int;
    fn rbd_watchers_list_cleanup(watchers: *mut ImageWatcher, num_watchers: usize);
    fn rbd_aio_create_completion(cb_arg: *mut c_void, complete_cb: Callback, c: *mut CompletionT) -> c_int;
    fn rbd_aio_get_return_value(c: CompletionT) -> isize;
    fn rbd_aio_release(c: CompletionT);
    fn rbd_aio_readv(image: ImageT, iov: *const libc::iovec, iovcnt: c_int, off: u64, c: CompletionT) -> c_int;
    fn rbd_aio_writev(image: ImageT, iov: *const libc::iovec, iovcnt: c_int, off: u64, c: CompletionT) -> c_int;
    fn rbd_aio_flush(image: ImageT, c: CompletionT) -> c_int;
    fn rbd_aio_discard(image: ImageT, off: u64, len: u64, c: CompletionT) -> c_int;
}

/// One holder of an image's lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Locker {
    /// "client.4123".
    pub client: String,
    pub cookie: String,
    /// "10.87.0.11:0/2345".
    pub address: String,
}

/// What an image's lock record says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LockRecord {
    pub exclusive: bool,
    pub tag: String,
    pub lockers: Vec<Locker>,
}

/// A negative errno from librados or librbd, with the call that gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CephError {
    pub call: &'static str,
    pub errno: i32,
}

fn check(call: &'static str, rc: c_int) -> Result<(), CephError> {
    if rc < 0 {
        Err(CephError { call, errno: -rc })
    } else {
        Ok(())
    }
}

fn cstring(call: &'static str, s: &str) -> Result<CString, CephError> {
    CString::new(s).map_err(|_| CephError { call, errno: libc::EINVAL })
}

impl Configured {
    /// The value `key` came to, from the conf, CEPH_ARGS and the settings
    /// (with `$cluster` and `$name` expanded). Values longer than 4 KiB
    /// are refused (ENAMETOOLONG); none that keelfs reads comes near.
    pub fn setting(&self, key: &str) -> Result<String, CephError> {
        let key = cstring("rados_conf_get", key)?;
        let mut buf = vec![0u8; 4096];
        // SAFETY: a live handle, a C string, and a writable buffer of the
        // length passed; librados writes a NUL-terminated value into it or
        // fails with ENAMETOOLONG.
        let rc = unsafe { rados_conf_get(self.0.handle, key.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        check("rados_conf_get", rc)?;
        let value =
            CStr::from_bytes_until_nul(&buf).map_err(|_| CephError { call: "rados_conf_get", errno: libc::EINVAL })?;
        Ok(value.to_string_lossy().into_owned())
    }

    /// Set `key` before connecting (it wins over the conf and CEPH_ARGS).
    pub fn set(&self, key: &str, value: &str) -> Result<(), CephError> {
        let (k, v) = (cstring("rados_conf_set", key)?, cstring("rados_conf_set", value)?);
        // SAFETY: a live handle not yet connected, and two C strings.
        check("rados_conf_set", unsafe { rados_conf_set(self.0.handle, k.as_ptr(), v.as_ptr()) })
    }

    pub fn connect(self) -> Result<Cluster, CephError> {
        // SAFETY: a live, configured handle; connect blocks until the
        // monitors answer or client_mount_timeout passes.
        check("connecting to the Ceph cluster", unsafe { rados_connect(self.0.handle) })?;
        Ok(self.0)
    }
}

/// A cluster handle, connected once it leaves [`Configured::connect`]
/// (librados starts its threads at connect).
pub struct Cluster {
    handle: RadosT,
}

// SAFETY: a rados_t may be used from any thread; librados locks inside.
unsafe impl Send for Cluster {}
// SAFETY: as above; no method takes `&mut self` state of our own.
unsafe impl Sync for Cluster {}

/// A cluster handle configured but not yet connected: what its settings
/// came to can be read back.
pub struct Configured(Cluster);

impl Cluster {
    /// A handle for `client.ID` (client.admin without one), with settings
    /// from `conf` (Ceph's default search without one), CEPH_ARGS, then
    /// `settings`, which win; [`Configured::connect`] connects it.
    pub fn configure(conf: Option<&str>, id: Option<&str>, settings: &[(&str, &str)]) -> Result<Configured, CephError> {
        let name = cstring("rados_create2", &format!("client.{}", id.unwrap_or("admin")))?;
        let mut handle: RadosT = std::ptr::null_mut();
        // SAFETY: both strings are NUL-terminated and outlive the call;
        // `handle` is a valid out-pointer.
        check("rados_create2", unsafe { rados_create2(&mut handle, c"ceph".as_ptr(), name.as_ptr(), 0) })?;
        // From here `cluster` owns the handle and shuts it down on error.
        let cluster = Cluster { handle };
        let conf = conf.map(|c| cstring("rados_conf_read_file", c)).transpose()?;
        let conf_ptr = conf.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
        // SAFETY: a live handle not yet connected; NULL asks for the default
        // search path.
        let read = check("reading the Ceph configuration", unsafe { rados_conf_read_file(cluster.handle, conf_ptr) });
        match read {
            // No conf named and none found: CEPH_ARGS may say it all (as
            // QEMU allows); connecting says what is missing otherwise.
            Err(e) if conf.is_none() && e.errno == libc::ENOENT => {}
            other => other?,
        }
        // SAFETY: as above; NULL names CEPH_ARGS.
        check("rados_conf_parse_env", unsafe { rados_conf_parse_env(cluster.handle, std::ptr::null()) })?;
        for (key, value) in settings {
            let (k, v) = (cstring("rados_conf_set", key)?, cstring("rados_conf_set", value)?);
            // SAFETY: a live handle not yet connected, and two C strings.
            check("rados_conf_set", unsafe { rados_conf_set(cluster.handle, k.as_ptr(), v.as_ptr()) })?;
        }
        Ok(Configured(cluster))
    }

    /// This client's id in the cluster: it is `client.ID` in lock owners.
    pub fn instance_id(&self) -> u64 {
        // SAFETY: a connected handle.
        unsafe { rados_get_instance_id(self.handle) }
    }

    pub fn pool(self: &Arc<Self>, name: &str) -> Result<Pool, CephError> {
        let pool = cstring("rados_ioctx_create", name)?;
        let mut ioctx: IoctxT = std::ptr::null_mut();
        // SAFETY: a connected handle, a C string and an out-pointer.
        check("opening the pool", unsafe { rados_ioctx_create(self.handle, pool.as_ptr(), &mut ioctx) })?;
        Ok(Pool { ioctx, _cluster: Arc::clone(self) })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: every Pool and Image holds an Arc of this cluster, so
        // none is left when it drops.
        unsafe { rados_shutdown(self.handle) }
    }
}

/// An open pool (an I/O context).
pub struct Pool {
    ioctx: IoctxT,
    _cluster: Arc<Cluster>,
}

// SAFETY: an ioctx may be used from any thread (librados locks inside).
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

impl Pool {
    /// Create image `name` of `size` bytes with `features`, 4 MiB objects.
    pub fn create_image(&self, name: &str, size: u64, features: u64) -> Result<(), CephError> {
        let name = cstring("rbd_create2", name)?;
        let mut order: c_int = 0;
        // SAFETY: a live ioctx, a C string and an out-pointer (0: default).
        check("creating the image", unsafe { rbd_create2(self.ioctx, name.as_ptr(), size, features, &mut order) })
    }

    /// Remove image `name` and its data (refused while it is open).
    pub fn remove_image(&self, name: &str) -> Result<(), CephError> {
        let name = cstring("rbd_remove", name)?;
        // SAFETY: a live ioctx and a C string.
        check("removing the image", unsafe { rbd_remove(self.ioctx, name.as_ptr()) })
    }

    pub fn open_image(self: &Arc<Self>, name: &str, read_only: bool) -> Result<Image, CephError> {
        let cname = cstring("rbd_open", name)?;
        let mut image: ImageT = std::ptr::null_mut();
        // SAFETY: a live ioctx, a C string, an out-pointer, and no snapshot.
        let rc = unsafe {
            if read_only {
                rbd_open_read_only(self.ioctx, cname.as_ptr(), &mut image, std::ptr::null())
            } else {
                rbd_open(self.ioctx, cname.as_ptr(), &mut image, std::ptr::null())
            }
        };
        check("opening the image", rc)?;
        Ok(Image { handle: image, _pool: Arc::clone(self) })
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: every Image holds an Arc of this pool.
        unsafe { rados_ioctx_destroy(self.ioctx) }
    }
}

/// An open image. librbd serialises inside, so any thread may call it.
pub struct Image {
    handle: ImageT,
    _pool: Arc<Pool>,
}

// SAFETY: librbd's image context is thread-safe (QEMU submits from
// several iothreads); we add no state of our own.
unsafe impl Send for Image {}
// SAFETY: as above.
unsafe impl Sync for Image {}

impl Image {
    pub fn size(&self) -> Result<u64, CephError> {
        let mut size = 0;
        // SAFETY: an open image and an out-pointer.
        check("rbd_get_size", unsafe { rbd_get_size(self.handle, &mut size) })?;
        Ok(size)
    }

    pub fn resize(&self, size: u64) -> Result<(), CephError> {
        // SAFETY: an open image.
        check("rbd_resize", unsafe { rbd_resize(self.handle, size) })
    }

    pub fn features(&self) -> Result<u64, CephError> {
        let mut features = 0;
        // SAFETY: an open image and an out-pointer.
        check("rbd_get_features", unsafe { rbd_get_features(self.handle, &mut features) })?;
        Ok(features)
    }

    pub fn enable_features(&self, features: u64) -> Result<(), CephError> {
        // SAFETY: an open image.
        check("enabling image features", unsafe { rbd_update_features(self.handle, features, 1) })
    }

    pub fn lock_acquire(&self) -> Result<(), CephError> {
        // SAFETY: an open image; blocks until the lock is taken or refused.
        check("taking the exclusive lock", unsafe { rbd_lock_acquire(self.handle, LOCK_MODE_EXCLUSIVE) })
    }

    pub fn lock_release(&self) -> Result<(), CephError> {
        // SAFETY: an open image.
        check("releasing the exclusive lock", unsafe { rbd_lock_release(self.handle) })
    }

    pub fn is_lock_owner(&self) -> Result<bool, CephError> {
        let mut owner: c_int = 0;
        // SAFETY: an open image and an out-pointer.
        check("rbd_is_exclusive_lock_owner", unsafe { rbd_is_exclusive_lock_owner(self.handle, &mut owner) })?;
        Ok(owner != 0)
    }

    /// The clients holding the lock and their addresses
    /// (("client.4123", "10.87.0.11:0/2345")); empty when none does. Read
    /// from the image's lock record, so it works on a read-only open too.
    pub fn lockers(&self) -> Result<Vec<(String, String)>, CephError> {
        Ok(self.lock_record()?.lockers.into_iter().map(|l| (l.client, l.address)).collect())
    }

    /// The image's lock record: librbd's own exclusive lock (tag
    /// "internal") or advisory locks, shared or not.
    pub fn lock_record(&self) -> Result<LockRecord, CephError> {
        const LIST_BYTES: usize = 4096;
        let mut exclusive: c_int = 0;
        let mut bufs = [[0u8; LIST_BYTES]; 4];
        let mut lens = [LIST_BYTES; 4];
        let [tag, clients, cookies, addrs] = &mut bufs;
        let [tag_len, clients_len, cookies_len, addrs_len] = &mut lens;
        // SAFETY: an open image; each buffer has the room its length says,
        // and librbd writes NUL-separated lists within it (or -ERANGE).
        let n = unsafe {
            rbd_list_lockers(
                self.handle,
                &mut exclusive,
                tag.as_mut_ptr().cast(),
                tag_len,
                clients.as_mut_ptr().cast(),
                clients_len,
                cookies.as_mut_ptr().cast(),
                cookies_len,
                addrs.as_mut_ptr().cast(),
                addrs_len,
            )
        };
        if n < 0 {
            return Err(CephError { call: "listing the image's lockers", errno: -(n as i32) });
        }
        let list = |buf: &[u8], len: usize| -> Vec<String> {
            let used = &buf[..len.min(LIST_BYTES)];
            used.split(|&b| b == 0).filter(|s| !s.is_empty()).map(|s| String::from_utf8_lossy(s).into_owned()).collect()
        };
        let (clients, cookies, addrs) = (list(&bufs[1], lens[1]), list(&bufs[2], lens[2]), list(&bufs[3], lens[3]));
        let tag = list(&bufs[0], lens[0]).into_iter().next().unwrap_or_default();
        let mut cookies = cookies.into_iter().chain(std::iter::repeat(String::new()));
        let mut addrs = addrs.into_iter().chain(std::iter::repeat(String::new()));
        let lockers = clients
            .into_iter()
            .map(|client| Locker {
                client,
                cookie: cookies.next().unwrap_or_default(),
                address: addrs.next().unwrap_or_default(),
            })
            .collect();
        Ok(LockRecord { exclusive: exclusive != 0, tag, lockers })
    }

    /// Take an advisory shared lock under `cookie` and `tag`: refused
    /// (EBUSY) while librbd's exclusive lock, or another tag's, holds the
    /// image.
    pub fn lock_shared(&self, cookie: &str, tag: &str) -> Result<(), CephError> {
        let (cookie, tag) = (cstring("rbd_lock_shared", cookie)?, cstring("rbd_lock_shared", tag)?);
        // SAFETY: an open image and two C strings that outlive the call.
        check("taking a shared lock", unsafe { rbd_lock_shared(self.handle, cookie.as_ptr(), tag.as_ptr()) })
    }

    /// Let go of this client's advisory lock under `cookie`.
    pub fn unlock(&self, cookie: &str) -> Result<(), CephError> {
        let cookie = cstring("rbd_unlock", cookie)?;
        // SAFETY: an open image and a C string that outlives the call.
        check("releasing a shared lock", unsafe { rbd_unlock(self.handle, cookie.as_ptr()) })
    }

    /// Break another client's advisory lock (librbd blocklists the client
    /// first when rbd_blocklist_on_break_lock is on).
    pub fn break_advisory(&self, client: &str, cookie: &str) -> Result<(), CephError> {
        let (client, cookie) = (cstring("rbd_break_lock", client)?, cstring("rbd_break_lock", cookie)?);
        // SAFETY: an open image and two C strings that outlive the call.
        check("breaking a shared lock", unsafe { rbd_break_lock(self.handle, client.as_ptr(), cookie.as_ptr()) })
    }

    /// Fence `owner`, the holder's address as the lockers list gives it
    /// (librbd blocklists it when rbd_blocklist_on_break_lock is on, its
    /// default), and break its lock.
    pub fn lock_break(&self, owner: &str) -> Result<(), CephError> {
        let owner = cstring("rbd_lock_break", owner)?;
        // SAFETY: an open image and a C string.
        check("breaking the lock", unsafe { rbd_lock_break(self.handle, LOCK_MODE_EXCLUSIVE, owner.as_ptr()) })
    }

    /// The image's watchers: (client id, address). More than
    /// WATCHERS_MAX is an error (-ERANGE), never a partial list: a holder
    /// left out would look dead.
    pub fn watchers(&self) -> Result<Vec<(i64, String)>, CephError> {
        const WATCHERS_MAX: usize = 256;
        let mut list: Vec<ImageWatcher> =
            (0..WATCHERS_MAX).map(|_| ImageWatcher { addr: std::ptr::null_mut(), id: 0, cookie: 0 }).collect();
        let mut count = WATCHERS_MAX;
        // SAFETY: an open image; `list` has room for `count` entries.
        check("rbd_watchers_list", unsafe { rbd_watchers_list(self.handle, list.as_mut_ptr(), &mut count) })?;
        let count = count.min(WATCHERS_MAX);
        let out = list[..count]
            .iter()
            // SAFETY: librbd set each listed entry's addr to a C string.
            .map(|w| (w.id, unsafe { CStr::from_ptr(w.addr) }.to_string_lossy().into_owned()))
            .collect();
        // SAFETY: frees what librbd allocated in the first `count` entries.
        unsafe { rbd_watchers_list_cleanup(list.as_mut_ptr(), count) };
        Ok(out)
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: every queue of this image holds an Arc of it and waits for
        // its requests before dropping, so nothing is in flight.
        unsafe { rbd_close(self.handle) };
    }
}

/// One finished request: the queue's slot and librbd's return value.
#[derive(Clone, Copy, Debug)]
pub struct Done {
    pub slot: u32,
    pub ret: i64,
}

/// Where librbd's threads leave completions for one queue.
pub struct Sink {
    done: ArrayQueue<Done>,
    wake: Option<OwnedFd>,
}

impl Sink {
    /// Room for `depth` completions: a queue never has more in flight.
    pub fn new(depth: usize, wake: Option<OwnedFd>) -> Self {
        Self { done: ArrayQueue::new(depth.max(1)), wake }
    }
    pub fn pop(&self) -> Option<Done> {
        self.done.pop()
    }
    pub fn wake_fd(&self) -> Option<std::os::fd::RawFd> {
        self.wake.as_ref().map(|fd| fd.as_raw_fd())
    }
}

/// The argument librbd hands back to [`on_complete`]: which slot of which
/// queue. A queue keeps one per slot at a fixed address.
pub struct SlotArg {
    pub sink: Arc<Sink>,
    pub slot: u32,
}

extern "C" fn on_complete(completion: CompletionT, arg: *mut c_void) {
    // SAFETY: `arg` is the SlotArg `submit` registered; the queue keeps it
    // at a fixed address until this slot's completion is popped, which
    // happens only after the push below.
    let arg = unsafe { &*(arg as *const SlotArg) };
    // Our own reference: the queue may free `arg` once the push is seen.
    let sink = Arc::clone(&arg.sink);
    let slot = arg.slot;
    // SAFETY: librbd passes a completion it has finished; we release it
    // exactly once, here.
    let ret = unsafe { rbd_aio_get_return_value(completion) } as i64;
    // SAFETY: as above.
    unsafe { rbd_aio_release(completion) };
    if sink.done.push(Done { slot, ret }).is_err() {
        // A queue never has more requests in flight than the sink holds;
        // losing a completion would leave memory with librbd forever.
        eprintln!("keelfs-bdev: rbd completion queue overflowed; aborting");
        std::process::abort();
    }
    // Push first, then wake: a reactor that reset the eventfd and found
    // the queue empty is woken again.
    if let Some(fd) = &sink.wake {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd the sink owns.
        let _ = unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

/// What a queue asks librbd to do.
pub enum Op<'a> {
    Read { offset: u64, iov: &'a [libc::iovec] },
    Write { offset: u64, iov: &'a [libc::iovec] },
    Flush,
    Discard { offset: u64, bytes: u64 },
}

/// Start `op` on `image`; its completion lands in `arg.sink`.
///
/// # Safety
/// The memory the iovecs name, the iovec array and `arg` must stay valid
/// and untouched by others until the completion for `arg.slot` has been
/// popped from the sink.
pub unsafe fn submit(image: &Image, op: &Op<'_>, arg: &SlotArg) -> Result<(), CephError> {
    let mut c: CompletionT = std::ptr::null_mut();
    let arg_ptr = arg as *const SlotArg as *mut c_void;
    // SAFETY: `on_complete` matches rbd_callback_t; `c` is an out-pointer.
    check("rbd_aio_create_completion", unsafe { rbd_aio_create_completion(arg_ptr, on_complete, &mut c) })?;
    let h = image.handle;
    // SAFETY: an open image, a fresh completion, and memory the caller
    // keeps valid until the completion (this function's contract).
    let rc = unsafe {
        match op {
            Op::Read { offset, iov } => rbd_aio_readv(h, iov.as_ptr(), iov.len() as c_int, *offset, c),
            Op::Write { offset, iov } => rbd_aio_writev(h, iov.as_ptr(), iov.len() as c_int, *offset, c),
            Op::Flush => rbd_aio_flush(h, c),
            Op::Discard { offset, bytes } => rbd_aio_discard(h, *offset, *bytes, c),
        }
    };
    if rc < 0 {
        // Refused before it started: librbd will not call back.
        // SAFETY: our completion, never handed over.
        unsafe { rbd_aio_release(c) };
    }
    check("submitting to librbd", rc)
}
