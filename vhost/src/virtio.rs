//! Serving FUSE requests from a virtqueue: each descriptor chain carries a
//! request in its device-readable part and room for the reply in its
//! device-writable part.
//!
//! The guest is untrusted. A chain whose descriptors leave guest memory, a
//! request larger than the protocol allows, or a reply that does not fit
//! is answered with an error when the chain has room for one and dropped
//! (returned unused) otherwise; nothing a guest writes can panic the
//! daemon.

use std::io::{Read, Write};
use std::ops::Deref;

use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::GuestMemoryMmap;

use crate::fuse::abi::{error_reply, IN_HEADER_BYTES, OUT_HEADER_BYTES};
use crate::fuse::dispatch::Session;

/// Largest request a chain may carry: a 1 MiB write and its headers.
pub const REQUEST_BYTES_MAX: usize = (1 << 20) + 4096;

/// What happened to one chain, for counters and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainOutcome {
    /// The reply was written: this many bytes.
    Replied(u32),
    /// FUSE expects no reply (FORGET and friends).
    NoReply,
    /// The chain could not be read or answered.
    Dropped(&'static str),
}

/// Serve one chain. Returns its head index, the bytes written into it (for
/// the used ring) and what happened.
/// The chain keeps its guest memory (`M`, an `Arc` of the table on the
/// device path) alive until the reply is written, whatever the frontend
/// does to the memory table meanwhile.
pub async fn serve_chain<M>(session: &Session, chain: DescriptorChain<M>) -> (u16, u32, ChainOutcome)
where
    M: Deref<Target = GuestMemoryMmap> + Clone,
{
    let head = chain.head_index();
    if revisits_a_descriptor(&chain) {
        return (head, 0, ChainOutcome::Dropped("descriptor chain loops"));
    }
    let keep = chain.clone();
    let mem = keep.memory();
    let (Ok(mut reader), Ok(mut writer)) = (chain.clone().reader(mem), chain.writer(mem)) else {
        return (head, 0, ChainOutcome::Dropped("descriptor outside guest memory or malformed chain"));
    };
    let len = reader.available_bytes();
    if len < IN_HEADER_BYTES {
        return (head, 0, ChainOutcome::Dropped("request shorter than a FUSE header"));
    }
    let reply = if len > REQUEST_BYTES_MAX {
        let mut header = [0u8; IN_HEADER_BYTES];
        if reader.read_exact(&mut header).is_err() {
            return (head, 0, ChainOutcome::Dropped("unreadable request"));
        }
        let unique = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
        Some(error_reply(unique, libc::E2BIG))
    } else {
        let mut request = vec![0u8; len];
        if reader.read_exact(&mut request).is_err() {
            return (head, 0, ChainOutcome::Dropped("unreadable request"));
        }
        session.handle(&request).await
    };
    let Some(mut reply) = reply else { return (head, 0, ChainOutcome::NoReply) };
    if reply.len() > writer.available_bytes() {
        // The guest gave too little room: say so if even a header fits.
        let unique = u64::from_le_bytes(reply[8..16].try_into().expect("replies have a header"));
        reply = error_reply(unique, libc::EIO);
        if reply.len() > writer.available_bytes() {
            return (head, 0, ChainOutcome::Dropped("no room for a reply"));
        }
    }
    debug_assert!(reply.len() >= OUT_HEADER_BYTES);
    match writer.write_all(&reply) {
        Ok(()) => (head, reply.len() as u32, ChainOutcome::Replied(reply.len() as u32)),
        Err(_) => (head, 0, ChainOutcome::Dropped("unwritable reply buffer")),
    }
}

/// True if the chain's direct descriptors name one index twice. The
/// queue's iterator already stops after as many descriptors as the ring
/// holds; this catches the loop itself, so that a looping chain is refused
/// rather than served through the same buffer over and over.
fn revisits_a_descriptor<M>(chain: &DescriptorChain<M>) -> bool
where
    M: Deref<Target = GuestMemoryMmap> + Clone,
{
    let mut seen = [0u64; 1024 / 64];
    let mut index = chain.head_index();
    for descriptor in chain.clone() {
        if descriptor.refers_to_indirect_table() {
            return false; // the rest lives in a table the iterator bounds
        }
        let (word, bit) = (usize::from(index / 64) % seen.len(), 1u64 << (index % 64));
        if seen[word] & bit != 0 {
            return true;
        }
        seen[word] |= bit;
        if !descriptor.has_next() {
            return false;
        }
        index = descriptor.next();
    }
    false
}

/// Serve every chain available on `queue`, in order, returning their
/// outcomes. The caller signals the guest afterwards if the queue says so.
pub async fn serve_queue(session: &Session, queue: &mut Queue, mem: &GuestMemoryMmap) -> Vec<ChainOutcome> {
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
