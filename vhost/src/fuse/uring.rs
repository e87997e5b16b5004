//! FUSE over io_uring (Linux 6.14+, Documentation/filesystems/
//! fuse-io-uring.rst): after INIT, which still goes over /dev/fuse, the
//! server registers ring entries (a header and a payload buffer each) for
//! every queue the kernel keeps, one per possible CPU; the kernel fills an
//! entry with a request and completes its command, and the server answers
//! and asks for the next request in one IORING_OP_URING_CMD
//! (COMMIT_AND_FETCH). FORGETs, INTERRUPTs and notifications stay on
//! /dev/fuse, as do requests sent before every queue is registered, so
//! the /dev/fuse poller keeps running beside this one.
//!
//! Each request is made into the bytes a /dev/fuse read gives (in_header,
//! the opcode's header, the payload) and handled by the same
//! [`Session::handle`] as /dev/fuse and virtio-fs; a WRITE the session
//! may serve in place keeps its data in the entry's payload instead
//! ([`Session::write_in_place`]), as the other transports' WRITEs do.

use std::cell::{Cell, RefCell};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::rc::Rc;
use std::time::Instant;

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use keelfs_reactor::{self as reactor, Poller, PollerClass};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use keelfs_bdev::AlignedBuf;

use keelfs_reactor::AlignedWindow;

use super::abi::{error_reply, ShortReply, IN_HEADER_BYTES, OUT_HEADER_BYTES};
use super::dev_fuse::FuseMount;
use super::dispatch::Session;
use super::request::{InPlaceIo, IO_IN_BYTES, IO_PREFIX_BYTES};
use crate::qos::{Charge, Gate, Qos};

/// Where the fuse module says whether it may use io_uring.
pub const ENABLE_PARAMETER: &str = "/sys/module/fuse/parameters/enable_uring";
/// The CPUs the kernel may ever run: it keeps one queue for each.
const POSSIBLE_CPUS: &str = "/sys/devices/system/cpu/possible";
/// Ring entries registered per queue at most: requests one CPU may have
/// in this server at once (the rest wait in the kernel's queue).
pub const ENTRIES_PER_QUEUE_MAX: usize = 8;
/// Ring entries in all, unless the queues need more for one each: each
/// holds a payload buffer of max_write (1 MiB).
pub const ENTRIES_MAX: usize = 64;
/// Queues this server serves at most (possible CPUs): with one entry
/// each, the bound on its buffers' memory.
pub const QUEUES_MAX: usize = 128;
/// Completions handled per poll: bounds one reactor iteration.
const COMPLETIONS_PER_POLL_MAX: usize = 32;

/// struct fuse_uring_req_header: in_out (fuse_in_header, then
/// fuse_out_header), op_in (the opcode's own header) and
/// fuse_uring_ent_in_out.
const IN_OUT_BYTES: usize = 128;
const OP_IN_BYTES: usize = 128;
const ENT_IN_OUT_AT: usize = IN_OUT_BYTES + OP_IN_BYTES;
const HEADER_BYTES: usize = ENT_IN_OUT_AT + 32;
/// fuse_uring_ent_in_out's commit_id and payload_sz.
const COMMIT_ID_AT: usize = ENT_IN_OUT_AT + 8;
const PAYLOAD_SZ_AT: usize = ENT_IN_OUT_AT + 16;
/// enum fuse_uring_cmd.
const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// A payload buffer starts on a page, so that a WRITE's data, which
/// starts it, can go to the device as it is.
const PAYLOAD_ALIGN: usize = 4096;
/// The kernel's smallest payload buffer (FUSE_MIN_READ_BUFFER).
const MIN_PAYLOAD_BYTES: usize = 8192;
/// IORING_ENTER_GETEVENTS (include/uapi/linux/io_uring.h).
const ENTER_GETEVENTS: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum UringError {
    #[error("FUSE over io_uring is unavailable: {0}")]
    Unavailable(String),
    #[error("FUSE over io_uring: {what}: {source}")]
    Setup { what: &'static str, source: io::Error },
    /// The kernel refused a registration, and with it io_uring for this
    /// connection: /dev/fuse serves on.
    #[error("FUSE over io_uring: the kernel refused FUSE_IO_URING_CMD_REGISTER: {0}")]
    Refused(io::Error),
    #[error("FUSE over io_uring: malformed ring entry from the kernel: {0}")]
    BadEntry(&'static str),
}

/// What a host mount needs to serve over io_uring, found before the
/// daemon's sandbox hides /sys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UringPlan {
    /// The kernel's queues: one per possible CPU.
    pub queues: usize,
    /// Unmount rather than serve on /dev/fuse when registration fails
    /// (`fuse_transport = "uring"`).
    pub required: bool,
}

/// Whether the kernel serves FUSE over io_uring: `parameter` (normally
/// [`ENABLE_PARAMETER`]) must exist and say Y.
pub fn probe(parameter: &Path, required: bool) -> Result<UringPlan, UringError> {
    let value = std::fs::read_to_string(parameter).map_err(|e| {
        UringError::Unavailable(format!("{}: {e} (a kernel without CONFIG_FUSE_IO_URING)", parameter.display()))
    })?;
    if value.trim() != "Y" {
        return Err(UringError::Unavailable(format!(
            "{} is {:?}: `echo Y > {}` as root turns it on",
            parameter.display(),
            value.trim(),
            parameter.display()
        )));
    }
    let cpus = std::fs::read_to_string(POSSIBLE_CPUS)
        .map_err(|source| UringError::Setup { what: "reading the possible CPUs", source })?;
    let queues = count_cpus(&cpus).ok_or_else(|| UringError::Unavailable(format!("{POSSIBLE_CPUS}: {cpus:?}")))?;
    if queues == 0 || queues > QUEUES_MAX {
        return Err(UringError::Unavailable(format!("{queues} possible CPUs; at most {QUEUES_MAX} served")));
    }
    Ok(UringPlan { queues, required })
}

/// Entries for each of `queues` queues: [`ENTRIES_MAX`] shared out, at
/// least one (the kernel uses the ring only once every queue has one).
fn entries_per_queue(queues: usize) -> usize {
    (ENTRIES_MAX / queues.max(1)).clamp(1, ENTRIES_PER_QUEUE_MAX)
}

/// The number of CPUs in a list such as "0-3,6".
fn count_cpus(list: &str) -> Option<usize> {
    let mut n = 0usize;
    for range in list.trim().split(',') {
        let (first, last) = match range.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
            None => (range.parse().ok()?, range.parse().ok()?),
        };
        n = n.checked_add(last.checked_sub(first)?.checked_add(1)?)?;
    }
    Some(n)
}

/// One ring entry: the buffers the kernel copies a request into and the
/// reply out of. The kernel holds their addresses from registration until
/// the ring is closed, so they never move (boxed, or an aligned heap
/// buffer) and outlive the ring (see [`Ring`]'s field order).
struct Entry {
    header: Box<[u8; HEADER_BYTES]>,
    /// None only while a request served in place holds it (the kernel
    /// does not touch it until the entry is committed).
    payload: Option<AlignedBuf>,
    iov: Box<[libc::iovec; 2]>,
    qid: u16,
    /// The kernel handed it a request that is not answered yet.
    in_server: bool,
    /// The kernel gave it back for good (the connection ended).
    dead: bool,
}

impl Entry {
    fn new(qid: u16, payload_bytes: usize) -> Self {
        let mut header = Box::new([0u8; HEADER_BYTES]);
        let mut payload = AlignedBuf::zeroed(payload_bytes, PAYLOAD_ALIGN);
        let iov = Box::new([
            libc::iovec { iov_base: header.as_mut_ptr().cast(), iov_len: HEADER_BYTES },
            libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: payload.len() },
        ]);
        Self { header, payload: Some(payload), iov, qid, in_server: false, dead: false }
    }

    fn payload(&self) -> &AlignedBuf {
        self.payload.as_ref().expect("only a request served in place holds the payload")
    }

    fn payload_mut(&mut self) -> &mut AlignedBuf {
        self.payload.as_mut().expect("only a request served in place holds the payload")
    }

    fn u32_at(&self, at: usize) -> u32 {
        u32::from_le_bytes(self.header[at..at + 4].try_into().expect("4 bytes"))
    }

    fn u64_at(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.header[at..at + 8].try_into().expect("8 bytes"))
    }

    /// The request in this entry as /dev/fuse would give it, and the
    /// commit id to answer it with.
    fn request(&self) -> Result<(Vec<u8>, u64), UringError> {
        let len = self.u32_at(0) as usize;
        let commit_id = self.u64_at(COMMIT_ID_AT);
        let payload = self.u32_at(PAYLOAD_SZ_AT) as usize;
        if commit_id == 0 {
            return Err(UringError::BadEntry("commit id 0"));
        }
        if payload > self.payload().len() {
            return Err(UringError::BadEntry("payload larger than its buffer"));
        }
        // The kernel's in_header.len counts every argument: the opcode's
        // header in op_in is what the payload does not hold.
        let op_in = len.checked_sub(IN_HEADER_BYTES + payload).ok_or(UringError::BadEntry("length too short"))?;
        if op_in > OP_IN_BYTES {
            return Err(UringError::BadEntry("opcode header larger than op_in"));
        }
        let mut request = Vec::with_capacity(len);
        request.extend_from_slice(&self.header[..IN_HEADER_BYTES]);
        request.extend_from_slice(&self.header[IN_OUT_BYTES..IN_OUT_BYTES + op_in]);
        request.extend_from_slice(&self.payload()[..payload]);
        debug_assert_eq!(request.len(), len);
        Ok((request, commit_id))
    }

    /// Put `reply` (fuse_out_header and its arguments) in place for the
    /// commit: the header in in_out, the arguments in the payload.
    fn set_reply(&mut self, commit_id: u64, reply: Option<&[u8]>) {
        let refused;
        let reply = match reply {
            Some(r) if r.len() >= OUT_HEADER_BYTES && r.len() - OUT_HEADER_BYTES <= self.payload().len() => r,
            // No reply for a request the kernel waits on, or one too big
            // for the buffer the kernel sized (a bug): an error, not a hang.
            _ => {
                refused = error_reply(commit_id, libc::EIO);
                &refused[..]
            }
        };
        let body = &reply[OUT_HEADER_BYTES..];
        self.header[..OUT_HEADER_BYTES].copy_from_slice(&reply[..OUT_HEADER_BYTES]);
        self.payload_mut()[..body.len()].copy_from_slice(body);
        let size = u32::try_from(body.len()).expect("bounded by the payload buffer");
        self.header[PAYLOAD_SZ_AT..PAYLOAD_SZ_AT + 4].copy_from_slice(&size.to_le_bytes());
    }
}

/// The ring and its entries. Field order matters: the ring is dropped
/// (closed, its commands cancelled) before the buffers it points into.
struct Ring {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    /// Signalled when the kernel has work for this thread (a request for
    /// an entry): the reactor sleeps on it.
    wake: EventFd,
    entries: Vec<Entry>,
    /// SQEs pushed but not yet submitted.
    unsubmitted: usize,
    /// Completions reaped while registering, for the poller.
    early: Vec<(u64, i32)>,
    _mount: Rc<FuseMount>,
}

/// fuse_uring_cmd_req in the SQE's command area.
fn cmd_req(commit_id: u64, qid: u16) -> [u8; 80] {
    let mut cmd = [0u8; 80];
    cmd[8..16].copy_from_slice(&commit_id.to_le_bytes());
    cmd[16..18].copy_from_slice(&qid.to_le_bytes());
    cmd
}

impl Ring {
    fn new(mount: Rc<FuseMount>, plan: UringPlan, payload_bytes: usize) -> Result<Self, UringError> {
        assert!(plan.queues > 0 && plan.queues <= QUEUES_MAX, "queues checked by probe");
        let per_queue = entries_per_queue(plan.queues);
        let total = plan.queues * per_queue;
        let depth = u32::try_from(total.next_power_of_two()).expect("bounded");
        let setup = |what| move |source| UringError::Setup { what, source };
        // The kernel hands a request to an entry as task work of this
        // thread. Deferred (DEFER_TASKRUN), it waits for the next enter
        // and signals `wake`, where ordinary task work would interrupt
        // whatever this thread is blocked in with EINTR (the unmount's
        // call to the supervisor, for one).
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .setup_cqsize(depth * 2)
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_taskrun_flag()
            .setup_r_disabled()
            .build(depth)
            .map_err(setup("io_uring_setup"))?;
        let wake = EventFd::new(EFD_NONBLOCK).map_err(setup("eventfd"))?;
        ring.submitter().register_eventfd(wake.as_raw_fd()).map_err(setup("registering the eventfd"))?;
        restrict(&ring).map_err(setup("restricting the ring"))?;
        // Queue 0 last: the kernel starts using the ring once every queue
        // has an entry, so a failure before that leaves /dev/fuse in use.
        let entries = (0..plan.queues)
            .rev()
            .flat_map(|q| (0..per_queue).map(move |_| q as u16))
            .map(|qid| Entry::new(qid, payload_bytes))
            .collect();
        Ok(Self { ring, wake, entries, unsubmitted: 0, early: Vec::new(), _mount: mount })
    }

    fn device_fd(&self) -> RawFd {
        self._mount.fd()
    }

    /// Register every entry with the kernel; an error here (the kernel
    /// refuses at submission) means the ring is not used.
    fn register(&mut self) -> Result<(), UringError> {
        for index in 0..self.entries.len() {
            let entry = &self.entries[index];
            let sqe = opcode::UringCmd80::new(types::Fd(self.device_fd()), CMD_REGISTER)
                .cmd(cmd_req(0, entry.qid))
                .addr(Some(entry.iov.as_ptr() as u64))
                .build()
                .user_data(index as u64);
            self.push(with_len(sqe, 2));
            // Submit as we go: the SQ is sized for every entry, but one
            // refused early should stop the rest.
            self.submit().map_err(|source| UringError::Setup { what: "submitting a registration", source })?;
            // A refusal completes at once; a request may already have come
            // to an entry registered before: kept for the poller.
            let reaped: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            self.early.extend(reaped);
            if let Some(&(_, res)) = self.early.iter().find(|(_, res)| *res < 0) {
                return Err(UringError::Refused(errno(res)));
            }
        }
        Ok(())
    }

    fn push(&mut self, sqe: squeue::Entry128) {
        // SAFETY: the SQE points at an entry's iovecs (registration), or
        // carries no address (commit); both are kept alive by `self`
        // until the ring is closed, as [`Ring`]'s field order guarantees.
        let pushed = unsafe { self.ring.submission().push(&sqe) };
        // At most one command per entry is ever pending, and the SQ has
        // room for all of them.
        pushed.expect("the SQ holds a command for every entry");
        self.unsubmitted += 1;
    }

    /// Submit what is pushed, and run the kernel's deferred task work
    /// (which posts the completions of entries handed requests).
    fn submit(&mut self) -> io::Result<()> {
        if self.unsubmitted == 0 && !self.ring.submission().taskrun() {
            return Ok(());
        }
        let to_submit = u32::try_from(self.unsubmitted).expect("bounded by the SQ");
        // SAFETY: no argument pointer is passed (None); the SQEs were
        // pushed under the rules of `push`.
        let entered = unsafe { self.ring.submitter().enter::<libc::sigset_t>(to_submit, 0, ENTER_GETEVENTS, None) };
        match entered {
            Ok(n) => {
                self.unsubmitted -= n.min(self.unsubmitted);
                Ok(())
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Answer the request in entry `index` and fetch the next one.
    fn commit(&mut self, index: usize, commit_id: u64, reply: Option<&[u8]>) {
        let fd = self.device_fd();
        let entry = &mut self.entries[index];
        assert!(entry.in_server, "only an entry holding a request is answered");
        entry.in_server = false;
        entry.set_reply(commit_id, reply);
        let sqe = opcode::UringCmd80::new(types::Fd(fd), CMD_COMMIT_AND_FETCH)
            .cmd(cmd_req(commit_id, entry.qid))
            .build()
            .user_data(index as u64);
        self.push(sqe);
    }
}

/// Set the SQE's `len` (the iovec count), which UringCmd80 leaves 0.
fn with_len(sqe: squeue::Entry128, len: u32) -> squeue::Entry128 {
    // SAFETY: Entry128 is repr(C): a 64-byte io_uring_sqe of integers (no
    // padding, every bit pattern valid) and 64 bytes of command; `len`
    // is the u32 at offset 24 of struct io_uring_sqe.
    let mut bytes: [u8; 128] = unsafe { std::mem::transmute(sqe) };
    bytes[24..28].copy_from_slice(&len.to_le_bytes());
    // SAFETY: as above; any bytes make a valid Entry128.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(bytes) }
}

fn errno(res: i32) -> io::Error {
    io::Error::from_raw_os_error(-res)
}

/// Allow only IORING_OP_URING_CMD on the ring, then enable it.
fn restrict(ring: &IoUring<squeue::Entry128, cqueue::Entry>) -> io::Result<()> {
    use io_uring::register::Restriction;
    let mut restrictions = [Restriction::sqe_op(opcode::UringCmd80::CODE)];
    ring.submitter().register_restrictions(&mut restrictions)?;
    ring.submitter().register_enable_rings()
}

/// Serves a host mount's ring entries on the export's reactor.
struct UringPoller {
    session: Rc<Session>,
    /// None once closed; requests still being served hold it until they
    /// are answered.
    ring: Option<Rc<RefCell<Ring>>>,
    wake_fd: RawFd,
    /// Set by the /dev/fuse poller when the kernel ends the session.
    ended: Rc<Cell<bool>>,
    closed: bool,
    deferred: Option<Gate<(usize, u64, Vec<u8>)>>,
}

/// A ring set up for a host mount before its INIT is answered: only a
/// server that has one offers FUSE_OVER_IO_URING, since the kernel holds
/// every request after INIT until the ring's queues are registered (or a
/// registration is refused).
pub struct Prepared(Ring);

/// Set up the ring and entries for `mount` (payload buffers of
/// `payload_bytes`, at least the session's max_write).
pub fn prepare(mount: Rc<FuseMount>, plan: UringPlan, payload_bytes: usize) -> Result<Prepared, UringError> {
    Ring::new(mount, plan, payload_bytes.max(MIN_PAYLOAD_BYTES)).map(Prepared)
}

impl Prepared {
    /// Ring entries in all.
    pub fn entries(&self) -> usize {
        self.0.entries.len()
    }
}

/// Register the ring entries with the kernel and serve them on this
/// reactor, once INIT agreed on io_uring.
pub(super) fn start(
    session: Rc<Session>,
    prepared: Prepared,
    qos: Option<Rc<Qos>>,
    ended: Rc<Cell<bool>>,
) -> Result<(), UringError> {
    let Prepared(mut ring) = prepared;
    assert!(ring.entries.iter().all(|e| e.payload().len() >= session.max_write()), "payload buffers fit a WRITE");
    ring.register()?;
    let wake_fd = ring.wake.as_raw_fd();
    let poller = UringPoller {
        session,
        ring: Some(Rc::new(RefCell::new(ring))),
        wake_fd,
        ended,
        closed: false,
        deferred: qos.map(Gate::new),
    };
    reactor::register_poller(PollerClass::Source, Box::new(poller));
    Ok(())
}

impl UringPoller {
    fn ring(&self) -> &Rc<RefCell<Ring>> {
        self.ring.as_ref().expect("an open poller has its ring")
    }

    fn start_request(&self, index: usize, commit_id: u64, request: Vec<u8>) {
        let (session, ring) = (Rc::clone(&self.session), Rc::clone(self.ring()));
        reactor::spawn_local(async move {
            let reply = session.handle(&request).await;
            ring.borrow_mut().commit(index, commit_id, reply.as_deref());
        });
    }

    /// A completion: a request in the entry, or the entry's end.
    fn complete(&mut self, index: usize, result: i32, now: Instant) {
        let mut ring = self.ring().borrow_mut();
        let Some(entry) = ring.entries.get_mut(index) else {
            tracing::error!(index, "FUSE over io_uring: a completion for no entry");
            return;
        };
        if entry.in_server || entry.dead {
            // Only one command per entry is ever in the kernel's hands.
            tracing::error!(index, result, "FUSE over io_uring: a completion for an entry not in the kernel");
            return;
        }
        if result < 0 {
            // ENOTCONN or ECANCELED: the connection ended; anything else
            // is a broken entry. Either way the kernel gave it back.
            if !matches!(-result, libc::ENOTCONN | libc::ECANCELED | libc::ECONNABORTED) {
                tracing::warn!(index, error = %errno(result), "FUSE over io_uring: an entry failed");
            }
            entry.dead = true;
            return;
        }
        entry.in_server = true;
        if let Some((io, direct)) = self.in_place_write(entry) {
            let commit_id = entry.u64_at(COMMIT_ID_AT);
            let payload = entry.payload.take().expect("an entry the kernel filled has its payload");
            drop(ring);
            self.session.stats().count_ring_request();
            return self.start_write(index, commit_id, (io, direct), payload);
        }
        let parsed = entry.request();
        drop(ring);
        self.session.stats().count_ring_request();
        let (request, commit_id) = match parsed {
            Ok(parsed) => parsed,
            Err(e) => {
                tracing::error!(index, "{e}");
                let commit_id = self.ring().borrow().entries[index].u64_at(COMMIT_ID_AT);
                if commit_id == 0 {
                    // Nothing to answer with: the entry is lost.
                    self.ring().borrow_mut().entries[index].dead = true;
                } else {
                    self.ring().borrow_mut().commit(index, commit_id, Some(&error_reply(commit_id, libc::EIO)));
                }
                return;
            }
        };
        let item = match &mut self.deferred {
            Some(gate) if !gate.open() => {
                let charge = Charge::of_request(&request);
                match gate.offer((index, commit_id, request), charge, now) {
                    Some(item) => item,
                    None => return,
                }
            }
            _ => (index, commit_id, request),
        };
        self.start_request(item.0, item.1, item.2);
    }

    /// The WRITE in `entry`, when it can be served with its data where
    /// the kernel put it, in the payload: none is copied on an O_DIRECT
    /// handle, and only into the page cache on another. Not while a QoS
    /// limit is on, whose gate holds requests as copies.
    fn in_place_write(&self, entry: &Entry) -> Option<(InPlaceIo, bool)> {
        if self.deferred.as_ref().is_some_and(|gate| !gate.open()) {
            return None;
        }
        let mut prefix = [0u8; IO_PREFIX_BYTES];
        prefix[..IN_HEADER_BYTES].copy_from_slice(&entry.header[..IN_HEADER_BYTES]);
        prefix[IN_HEADER_BYTES..].copy_from_slice(&entry.header[IN_OUT_BYTES..IN_OUT_BYTES + IO_IN_BYTES]);
        let (io, direct) = self.session.in_place_request(&prefix, entry.u32_at(0) as usize)?;
        if !io.write || entry.u32_at(PAYLOAD_SZ_AT) != io.size || entry.u64_at(COMMIT_ID_AT) == 0 {
            return None; // the copying path serves it, or says what is wrong
        }
        Some((io, direct))
    }

    /// Serve the WRITE in entry `index` with `payload`, the entry's own,
    /// which goes back to the entry before the commit: the kernel, which
    /// holds its address, touches it only after that.
    fn start_write(&self, index: usize, commit_id: u64, (io, direct): (InPlaceIo, bool), payload: AlignedBuf) {
        self.session.stats().count_in_place_write();
        let (session, ring) = (Rc::clone(&self.session), Rc::clone(self.ring()));
        reactor::spawn_local(async move {
            let (payload, reply) = match AlignedWindow::new(payload, 0, io.size as usize) {
                Ok(data) => {
                    let (data, reply) = session.write_in_place(&io, direct, data).await;
                    (data.into_inner(), reply)
                }
                // The payload holds max_write, which the size is within.
                Err(payload) => (payload, ShortReply::error(io.unique, libc::EIO)),
            };
            let mut ring = ring.borrow_mut();
            ring.entries[index].payload = Some(payload);
            ring.commit(index, commit_id, Some(reply.as_bytes()));
        });
    }

    fn release_deferred(&mut self, now: Instant) -> bool {
        let Some(mut gate) = self.deferred.take() else { return false };
        let ran = gate.drain(now, |(index, commit_id, request)| self.start_request(index, commit_id, request));
        self.deferred = Some(gate);
        ran
    }

    /// The session ended: close the ring (the kernel has stopped its
    /// queues) and give back the buffers.
    fn close(&mut self) {
        self.closed = true;
        self.deferred = None;
        self.ring = None;
        tracing::debug!("FUSE over io_uring: ring closed");
    }
}

impl Poller for UringPoller {
    fn poll(&mut self, now: Instant) -> bool {
        if self.closed {
            return false;
        }
        let mut busy = self.release_deferred(now);
        if let Err(e) = self.ring().borrow_mut().submit() {
            tracing::error!("FUSE over io_uring: submitting: {e}");
        }
        for _ in 0..COMPLETIONS_PER_POLL_MAX {
            let next = {
                let mut ring = self.ring().borrow_mut();
                ring.early.pop().or_else(|| ring.ring.completion().next().map(|c| (c.user_data(), c.result())))
            };
            let Some((user_data, result)) = next else { break };
            busy = true;
            self.complete(usize::try_from(user_data).unwrap_or(usize::MAX), result, now);
        }
        let all_dead = self.ring().borrow().entries.iter().all(|e| e.dead);
        if self.ended.get() || all_dead {
            self.close();
        }
        busy
    }

    fn wake_fd(&self) -> Option<RawFd> {
        (!self.closed).then_some(self.wake_fd)
    }

    fn can_sleep(&self) -> bool {
        if self.closed {
            return true;
        }
        let mut ring = self.ring().borrow_mut();
        let idle = ring.unsubmitted == 0 && ring.early.is_empty();
        idle && !ring.ring.submission().taskrun() && ring.ring.completion().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_count() {
        assert_eq!(count_cpus("0\n"), Some(1));
        assert_eq!(count_cpus("0-3,6\n"), Some(5));
        assert_eq!(count_cpus("3-1"), None);
        assert_eq!(count_cpus("x"), None);
    }

    #[test]
    fn a_missing_or_off_parameter_is_unavailable() {
        let dir = std::env::temp_dir().join(format!("keelfs-uring-probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let off = dir.join("enable_uring");
        std::fs::write(&off, "N\n").unwrap();
        assert!(matches!(probe(&off, true), Err(UringError::Unavailable(_))));
        assert!(matches!(probe(&dir.join("missing"), false), Err(UringError::Unavailable(_))));
        assert_eq!((entries_per_queue(2), entries_per_queue(16), entries_per_queue(QUEUES_MAX)), (8, 4, 1));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn entry_with(len: u32, payload: u32, commit_id: u64) -> Entry {
        let mut e = Entry::new(0, 4096);
        e.header[..4].copy_from_slice(&len.to_le_bytes());
        e.header[COMMIT_ID_AT..COMMIT_ID_AT + 8].copy_from_slice(&commit_id.to_le_bytes());
        e.header[PAYLOAD_SZ_AT..PAYLOAD_SZ_AT + 4].copy_from_slice(&payload.to_le_bytes());
        e
    }

    #[test]
    fn a_malformed_entry_is_an_error() {
        assert!(entry_with(40, 0, 0).request().is_err(), "commit id 0");
        assert!(entry_with(40 + 8192, 8192, 7).request().is_err(), "payload past its buffer");
        assert!(entry_with(39, 0, 7).request().is_err(), "shorter than its header");
        assert!(entry_with(40 + 129, 0, 7).request().is_err(), "op_in overflow");
        let (request, id) = entry_with(40 + 16 + 5, 5, 7).request().unwrap();
        assert_eq!((request.len(), id), (61, 7));
    }

    #[test]
    fn a_reply_too_big_for_the_payload_becomes_an_error() {
        let mut e = entry_with(40, 0, 9);
        e.set_reply(9, Some(&[0u8; OUT_HEADER_BYTES + 5000]));
        assert_eq!(e.u32_at(PAYLOAD_SZ_AT), 0);
        assert_eq!(i32::from_le_bytes(e.header[4..8].try_into().unwrap()), -libc::EIO);
    }
}
