//! Serving FUSE requests from a virtqueue: each descriptor chain carries a
//! request in its device-readable part and room for the reply in its
//! device-writable part.
//!
//! The guest is untrusted. A chain whose descriptors leave guest memory, a
//! request larger than the protocol allows, or a reply that does not fit
//! is answered with an error when the chain has room for one and dropped
//! (returned unused) otherwise; nothing a guest writes can panic the
//! daemon.

use std::future::Future;
use std::io::{Read, Write};
use std::ops::Deref;

use std::sync::Arc;

use keelfs_fs::{Fh, Ino};
use smallvec::SmallVec;
use virtio_queue::{DescriptorChain, Queue, QueueT, Writer};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

/// Guest memory as the vhost-user backend maps it: each region carries
/// the dirty log that live migration reads (`DirtyLog`), which
/// vm-memory's own writes mark and [`GuestBuffer`] marks for device I/O.
pub type GuestRam = vm_memory::GuestMemoryMmap<crate::dirty_log::DirtyLog>;

use crate::bufpool;
use crate::fuse::abi::{error_reply, unique_of, ShortReply, IN_HEADER_BYTES};
use crate::fuse::dispatch::{Session, SharedHandle};
use crate::fuse::request::{InPlaceIo, IO_PREFIX_BYTES};
use crate::guest_io::GuestBuffer;
use crate::qos::{Charge, Charged, CHARGE_PREFIX_BYTES};

/// Largest request a chain may carry: a 1 MiB write and its headers.
pub const REQUEST_BYTES_MAX: usize = (1 << 20) + 4096;

/// What happened to one chain, for counters and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainOutcome {
    /// The reply was written: this many bytes.
    Replied(u32),
    /// Replied, with the data moved between guest pages and the device
    /// with no copy in between (direct I/O).
    Direct(u32),
    /// Replied to a buffered read or write whose data was copied once,
    /// between guest pages and the page cache.
    OneCopy(u32),
    /// FUSE expects no reply (FORGET and friends).
    NoReply,
    /// The chain could not be read or answered.
    Dropped(&'static str),
}

/// Serve one chain. Returns its head index, the bytes written into it (for
/// the used ring) and what happened.
/// The chain keeps its guest memory (`M`) alive until the reply is
/// written. Every request's bytes are copied out of the chain; see
/// `serve_chain_zero_copy` for the device path.
pub async fn serve_chain<M>(session: &Session, chain: DescriptorChain<M>) -> (u16, u32, ChainOutcome)
where
    M: Deref<Target = GuestRam> + Clone,
{
    serve(session, chain, None, None).await
}

/// [`serve_chain`], except that reads and writes on O_DIRECT handles move
/// data straight between the guest's pages and the device. `mem` is the
/// table the chain was popped against; the I/O holds it.
pub fn serve_chain_zero_copy<'a, M>(
    session: &'a Session,
    chain: DescriptorChain<M>,
    mem: Arc<GuestRam>,
) -> impl Future<Output = (u16, u32, ChainOutcome)> + 'a
where
    M: Deref<Target = GuestRam> + Clone + 'a,
{
    serve(session, chain, Some(mem), None)
}

/// [`serve_chain_zero_copy`] for a request QoS charged when it was taken:
/// what it costs as served is settled against that first (see
/// [`Charged::settle`]).
///
/// Not an `async fn`: it returns `serve`'s future itself. An async wrapper
/// would hold that future in its own state and move it there, about 3 KB,
/// on every request's first poll.
pub(crate) fn serve_chain_charged<'a, M>(
    session: &'a Session,
    chain: DescriptorChain<M>,
    mem: Arc<GuestRam>,
    charged: Option<Charged>,
) -> impl Future<Output = (u16, u32, ChainOutcome)> + 'a
where
    M: Deref<Target = GuestRam> + Clone + 'a,
{
    serve(session, chain, Some(mem), charged)
}

async fn serve<M>(
    session: &Session,
    chain: DescriptorChain<M>,
    direct: Option<Arc<GuestRam>>,
    mut charged: Option<Charged>,
) -> (u16, u32, ChainOutcome)
where
    M: Deref<Target = GuestRam> + Clone,
{
    let head = chain.head_index();
    let Some(buffers) = walk(&chain) else {
        return (head, 0, ChainOutcome::Dropped("descriptor chain loops, overruns the ring or ends in NEXT"));
    };
    if let Some(mem) = direct {
        if let Some(done) = serve_in_place(session, &buffers, chain.memory(), mem, charged.as_mut()).await {
            return (head, done.0, done.1);
        }
    }
    let mem = chain.memory();
    // Every buffer in guest memory before anything is served, as
    // virtio-queue's reader and writer checked (they allocated two
    // vectors a request; the walked buffers are inline).
    let inside = |&(addr, n): &(u64, u32)| mem.check_range(GuestAddress(addr), n as usize);
    if !buffers.readable.iter().chain(&buffers.writable).all(inside) {
        return (head, 0, ChainOutcome::Dropped("descriptor outside guest memory or malformed chain"));
    }
    let len = buffers.readable.iter().fold(0usize, |sum, &(_, n)| sum.saturating_add(n as usize));
    if len < IN_HEADER_BYTES {
        return (head, 0, ChainOutcome::Dropped("request shorter than a FUSE header"));
    }
    let readable = if len > REQUEST_BYTES_MAX { IN_HEADER_BYTES } else { len };
    let mut request = bufpool::take(readable);
    request.resize(readable, 0);
    if !read_guest(mem, &buffers.readable, &mut request) {
        return (head, 0, ChainOutcome::Dropped("unreadable request"));
    }
    let reply = if len > REQUEST_BYTES_MAX {
        let unique = unique_of(&request).expect("a whole header was read");
        Some(error_reply(unique, libc::E2BIG))
    } else {
        // These bytes are what is served, whatever the chain held when
        // it was charged.
        if let Some(charged) = &mut charged {
            charged.settle(&request).await;
        }
        session.handle(&request).await
    };
    bufpool::give(request);
    let Some(reply) = reply else { return (head, 0, ChainOutcome::NoReply) };
    let done = write_reply(head, &reply, &mut ReplyWriter::new(mem, &buffers.writable));
    bufpool::give(reply);
    done
}

/// A READ or WRITE served with the guest's buffers in place (see
/// [`serve_direct`]), its headers read and its reply written straight
/// through the walked buffers: no copy of the chain and no allocation.
/// None when the chain is anything else, or odd: the copying path then
/// serves it, errors included. The headers read here are settled with
/// `charged` before they are served.
async fn serve_in_place(
    session: &Session,
    buffers: &ChainBuffers,
    mem: &GuestRam,
    io_mem: Arc<GuestRam>,
    charged: Option<&mut Charged>,
) -> Option<(u32, ChainOutcome)> {
    let len = buffers.readable.iter().try_fold(0usize, |sum, &(_, n)| sum.checked_add(n as usize))?;
    let mut prefix = [0u8; IO_PREFIX_BYTES];
    if !(prefix.len()..=REQUEST_BYTES_MAX).contains(&len) || !read_guest(mem, &buffers.readable, &mut prefix) {
        return None;
    }
    if let Some(charged) = charged {
        charged.settle(&prefix).await;
    }
    let mut writer = ReplyWriter::new(mem, &buffers.writable);
    serve_direct(session, buffers, &prefix, len, io_mem, &mut writer).await
}

/// Fill `out` from the start of `buffers`. False when they are shorter or
/// leave guest memory.
fn read_guest(mem: &GuestRam, buffers: &[(u64, u32)], out: &mut [u8]) -> bool {
    let mut at = 0;
    for &(addr, len) in buffers {
        if at == out.len() {
            break;
        }
        let n = (len as usize).min(out.len() - at);
        if mem.read_slice(&mut out[at..at + n], GuestAddress(addr)).is_err() {
            return false;
        }
        at += n;
    }
    at == out.len()
}

/// Where a reply goes: the chain's device-writable part.
trait ReplySink {
    fn room(&self) -> usize;
    /// Append `bytes`; false when they do not fit or are unwritable.
    fn put(&mut self, bytes: &[u8]) -> bool;
}

impl ReplySink for Writer<'_, vm_memory::bitmap::RefSlice<'_, crate::dirty_log::DirtyLog>> {
    fn room(&self) -> usize {
        self.available_bytes()
    }
    fn put(&mut self, bytes: &[u8]) -> bool {
        self.write_all(bytes).is_ok()
    }
}

/// Writes a reply into walked device-writable buffers, in order.
struct ReplyWriter<'a> {
    mem: &'a GuestRam,
    buffers: &'a [(u64, u32)],
    /// The buffer being filled, and the bytes of it already written.
    index: usize,
    offset: usize,
    room: usize,
}

impl<'a> ReplyWriter<'a> {
    fn new(mem: &'a GuestRam, buffers: &'a [(u64, u32)]) -> Self {
        let room = buffers.iter().fold(0usize, |sum, &(_, n)| sum.saturating_add(n as usize));
        Self { mem, buffers, index: 0, offset: 0, room }
    }
}

impl ReplySink for ReplyWriter<'_> {
    fn room(&self) -> usize {
        self.room
    }

    fn put(&mut self, mut bytes: &[u8]) -> bool {
        if bytes.len() > self.room {
            return false;
        }
        // Bounded: each pass writes bytes or moves to the next buffer, and
        // `room` says the buffers hold them all.
        while !bytes.is_empty() {
            let (addr, len) = self.buffers[self.index];
            let n = (len as usize - self.offset).min(bytes.len());
            if n == 0 {
                (self.index, self.offset) = (self.index + 1, 0);
                continue;
            }
            let Some(at) = addr.checked_add(self.offset as u64) else { return false };
            if self.mem.write_slice(&bytes[..n], GuestAddress(at)).is_err() {
                return false;
            }
            (bytes, self.offset, self.room) = (&bytes[n..], self.offset + n, self.room - n);
        }
        true
    }
}

/// Serve a chain on a reactor that does not own the filesystem, if it is a
/// READ whose pages are all cached: `reader_of(fh, nodeid)` gives the
/// handle's reader (asking the owner the first time). None, with the chain
/// untouched, for anything else; the caller then sends it to the owner.
pub async fn serve_read_from_cache<M, F, Fut>(
    chain: &DescriptorChain<M>,
    reader_of: F,
) -> Option<(u16, u32, ChainOutcome)>
where
    M: Deref<Target = GuestRam> + Clone,
    F: FnOnce(Fh, Ino) -> Fut,
    Fut: std::future::Future<Output = Option<SharedHandle>>,
{
    let head = chain.head_index();
    let mem = chain.memory();
    let (Ok(mut reader), Ok(mut writer)) = (chain.clone().reader(mem), chain.clone().writer(mem)) else { return None };
    let mut prefix = [0u8; IO_PREFIX_BYTES];
    let len = reader.available_bytes();
    if len != prefix.len() || reader.read_exact(&mut prefix).is_err() {
        return None;
    }
    let io = InPlaceIo::parse(&prefix, len).filter(|io| !io.write)?;
    if writer.available_bytes() < io.reply_room() {
        return None;
    }
    let handle = reader_of(io.fh, io.nodeid).await?;
    if handle.reader.ino() != io.nodeid || handle.released.load(std::sync::atomic::Ordering::Acquire) {
        return None;
    }
    let mut data = Vec::new();
    handle.reader.read_into(io.offset, io.size, &mut data).ok()?;
    let header = ShortReply::data_header(io.unique, data.len());
    let len = header.total_len();
    // Room for both was checked above.
    Some(match writer.write_all(header.as_bytes()).and_then(|()| writer.write_all(&data)) {
        Ok(()) => (head, len, ChainOutcome::OneCopy(len)),
        Err(_) => (head, 0, ChainOutcome::Dropped("unwritable reply buffer")),
    })
}

fn write_reply(head: u16, reply: &[u8], writer: &mut impl ReplySink) -> (u16, u32, ChainOutcome) {
    debug_assert!(reply.len() >= crate::fuse::abi::OUT_HEADER_BYTES);
    if reply.len() > writer.room() {
        // The guest gave too little room: say so if even a header fits.
        let unique = unique_of(reply).expect("replies have a header");
        let error = ShortReply::error(unique, libc::EIO);
        let error = error.as_bytes();
        return match writer.put(error) {
            true => (head, error.len() as u32, ChainOutcome::Replied(error.len() as u32)),
            false => (head, 0, ChainOutcome::Dropped("no room for a reply")),
        };
    }
    match writer.put(reply) {
        true => (head, reply.len() as u32, ChainOutcome::Replied(reply.len() as u32)),
        false => (head, 0, ChainOutcome::Dropped("unwritable reply buffer")),
    }
}

/// READ or WRITE with the guest's data buffers used in place: on an
/// O_DIRECT handle as the device I/O memory (no copy), on a buffered one as
/// the source or sink of the one copy to or from the page cache. The
/// session parses, checks and answers it; this moves the bytes. None
/// when the request is anything else, or is odd in any way: the copying
/// path then serves it, errors included.
async fn serve_direct(
    session: &Session,
    buffers: &ChainBuffers,
    prefix: &[u8; IO_PREFIX_BYTES],
    len: usize,
    mem: Arc<GuestRam>,
    writer: &mut ReplyWriter<'_>,
) -> Option<(u32, ChainOutcome)> {
    let (io, direct) = session.in_place_request(prefix, len)?; // else the copying path answers
    if !buffers.ordered || writer.room() < io.reply_room() {
        return None; // readable after writable, or no room: let the copying path refuse it
    }
    let reply = if io.write {
        let data = GuestBuffer::new(mem, &buffers.readable, io.data_at(), io.size as usize)?;
        session.write_in_place(&io, direct, data).await.1
    } else {
        let into = GuestBuffer::new(mem, &buffers.writable, io.data_at(), io.size as usize)?;
        session.read_in_place(&io, direct, into).await
    };
    if !writer.put(reply.as_bytes()) {
        return Some((0, ChainOutcome::Dropped("unwritable reply buffer")));
    }
    // A READ's data is in place after its header.
    let total = if io.write { reply.as_bytes().len() } else { reply.total_len() as usize } as u32;
    Some(match (reply.is_error() && !io.write, direct) {
        (true, _) => (total, ChainOutcome::Replied(total)),
        (false, true) => (total, ChainOutcome::Direct(total)),
        (false, false) => (total, ChainOutcome::OneCopy(total)),
    })
}

/// (guest address, length) of a chain's buffers of one direction. Inline
/// up to a 4 KiB request's (Linux sends headers, data and reply in at
/// most four), so that walking allocates nothing on the steady path.
type Buffers = SmallVec<[(u64, u32); 4]>;

/// A chain's buffers as (guest address, length), walked once.
struct ChainBuffers {
    readable: Buffers,
    writable: Buffers,
    /// Every readable buffer comes before every writable one, as virtio
    /// requires.
    ordered: bool,
}

/// Walk the chain once. None if it ends on a descriptor that still says
/// "next": the queue's iterator stopped early because the chain loops, is
/// longer than the ring (or its indirect table), or points past it. A
/// well-formed chain's last descriptor never has NEXT, so such chains are
/// refused rather than served through whatever prefix was walked.
fn walk<M>(chain: &DescriptorChain<M>) -> Option<ChainBuffers>
where
    M: Deref<Target = GuestRam> + Clone,
{
    let mut buffers = ChainBuffers { readable: Buffers::new(), writable: Buffers::new(), ordered: true };
    let mut last_has_next = true;
    for d in chain.clone() {
        if d.is_write_only() {
            buffers.writable.push((d.addr().0, d.len()));
        } else {
            buffers.ordered &= buffers.writable.is_empty();
            buffers.readable.push((d.addr().0, d.len()));
        }
        last_has_next = d.has_next();
    }
    (!last_has_next).then_some(buffers)
}

/// What admitting `chain` costs under QoS, read from its first readable
/// bytes. A chain too odd to read is free here: the request path refuses
/// it.
pub(crate) fn charge_of_chain<M>(chain: &DescriptorChain<M>) -> Charge
where
    M: Deref<Target = GuestRam> + Clone,
{
    let mut prefix = [0u8; CHARGE_PREFIX_BYTES];
    let mut filled = 0;
    for d in chain.clone() {
        if d.is_write_only() || filled == prefix.len() {
            break;
        }
        let n = (d.len() as usize).min(prefix.len() - filled);
        if chain.memory().read_slice(&mut prefix[filled..filled + n], d.addr()).is_err() {
            break;
        }
        filled += n;
    }
    Charge::of_request(&prefix[..filled])
}

/// Serve every chain available on `queue`, in order, returning their
/// outcomes. The caller signals the guest afterwards if the queue says so.
pub async fn serve_queue(session: &Session, queue: &mut Queue, mem: &GuestRam) -> Vec<ChainOutcome> {
    let mut outcomes = Vec::new();
    while let Some(chain) = queue.pop_descriptor_chain(mem) {
        let (head, written, outcome) = serve_chain(session, chain).await;
        if queue.add_used(mem, head, written).is_err() {
            outcomes.push(ChainOutcome::Dropped("used ring not writable"));
            break;
        }
        outcomes.push(outcome);
    }
    outcomes
}
