//! Data checksums seen from a guest (issue 38): a guest that rewrites its
//! buffers while its direct writes are in flight hurts only its own file.
//! The daemon computes each block's checksum from the guest's memory and
//! the device reads that memory later: a block whose bytes changed in
//! between reads back as EIO, never as another file's data, and the
//! daemon goes on serving.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use keelfs_base::testing::splitmix64;
use keelfs_vhost::abi::{init_flags as f, Opcode, Reply, ENTRY_OUT_BYTES};
use keelfs_vhost::frontend::{io_request, FsFrontend};
use vm_memory::{Bytes, GuestAddress};

const BLOCKS: u64 = 64;

/// CREATE `name` opened O_DIRECT: (nodeid, fh).
fn create_direct(fe: &mut FsFrontend, name: &str) -> (u64, u64) {
    let mut body = Reply::default();
    body.u32((libc::O_RDWR | libc::O_DIRECT) as u32).u32(0o100644).u32(0).u32(0).raw(&named(name));
    let (err, reply) = fe.fuse(1, Opcode::Create, 1, &body.bytes).unwrap();
    assert_eq!(err, 0, "create {name}");
    let nodeid = u64::from_le_bytes(reply[..8].try_into().unwrap());
    (nodeid, u64::from_le_bytes(reply[ENTRY_OUT_BYTES..ENTRY_OUT_BYTES + 8].try_into().unwrap()))
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut s = seed;
    (0..len).map(|_| splitmix64(&mut s) as u8).collect()
}

#[test]
fn a_guest_rewriting_its_buffers_during_direct_writes_hurts_only_its_file() {
    let daemon = Daemon::start_with_checksums(1);
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let bystander = create_direct(&mut fe, "bystander");
    let kept = pattern(1, (BLOCKS * 4096) as usize);
    for b in 0..BLOCKS as usize {
        let (_, (_, err)) = split_io(&mut fe, bystander, Opcode::Write, b as u64 * 4096, &kept[b * 4096..][..4096], 0);
        assert_eq!(err, 0);
    }
    let victim = create_direct(&mut fe, "victim");

    // The hostile vCPU: scribbles over every slot's write data while the
    // other writes its requests, as fast as it can.
    let (mem, areas, stop) = (fe.memory().clone(), fe.write_data_areas(1), Arc::new(AtomicBool::new(false)));
    let scribbler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut s = 7u64;
            let mut scribbles = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for &(at, len) in &areas {
                    let off = splitmix64(&mut s) % (16 << 10).min(len);
                    mem.write_slice(&splitmix64(&mut s).to_le_bytes(), GuestAddress(at + off)).unwrap();
                }
                scribbles += 1;
            }
            scribbles
        })
    };
    // Writes of 16 KiB each, several in flight at once, over and over.
    let mut heads = Vec::new();
    for round in 0..40u64 {
        for i in 0..4u64 {
            let offset = ((round * 4 + i) % (BLOCKS / 4)) * 16384;
            let unique = fe.next_unique();
            let header = io_request(Opcode::Write, unique, victim.0, victim.1, offset, 16384);
            heads.push(fe.submit_split(1, &header, &pattern(round * 4 + i, 16384), 0).unwrap());
        }
        let mut waiting: std::collections::HashSet<u16> = heads.drain(..).collect();
        while !waiting.is_empty() {
            for used in fe.wait(1, TIMEOUT).unwrap() {
                if waiting.remove(&used.head) {
                    let (_, err) = fuse_status(&fe.reply(1, used).unwrap());
                    assert_eq!(err, 0, "a write the guest rewrote is still written");
                }
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let scribbles = scribbler.join().unwrap();
    assert!(scribbles > 0);

    // Each of the victim's blocks reads as some data or as EIO; the
    // bystander's as written; and the daemon answers all of it.
    let (mut eio, mut read) = (0, 0);
    for b in 0..BLOCKS {
        let (_, (_, err)) = split_io(&mut fe, victim, Opcode::Read, b * 4096, &[], 4096);
        match err {
            0 => read += 1,
            e if e == libc::EIO || e == -libc::EIO => eio += 1,
            e => panic!("victim block {b}: errno {e}"),
        }
    }
    for b in 0..BLOCKS as usize {
        let (used, (_, err)) = split_io(&mut fe, bystander, Opcode::Read, b as u64 * 4096, &[], 4096);
        assert_eq!(err, 0, "bystander block {b}");
        assert_eq!(fe.read_data(1, used, 4096).unwrap(), kept[b * 4096..][..4096], "bystander block {b}");
    }
    eprintln!("victim: {read} blocks read, {eio} failed their checksum ({scribbles} scribble rounds)");
    drop(fe);
    daemon.stop();
}
