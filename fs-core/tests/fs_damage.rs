//! Damaged images: flipped bytes in metadata blocks give an fsck report or
//! a refused mount with a clear message, never a panic.

mod common;

use keelfs_fs::FileOffset;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use common::{busy_reactor, channel, check, format, mount, ram_device};
use keelfs_base::testing::{splitmix64, test_seed};
use keelfs_bdev::{BlockDevice, MappedDevice};
use keelfs_fs::repair;
use keelfs_fs::XattrFlags;
use keelfs_fs::{Creds, Fs, FsConfig};
use keelfs_fs::{Superblock, FEATURE_DATA_CHECKSUMS, ROOT_INO};

const BYTES: u64 = 16 << 20;

/// An image with a checkpoint and journal transactions after it, and the
/// metadata blocks worth damaging.
fn build_image() -> (Vec<u8>, Vec<u64>) {
    let mut r = busy_reactor();
    let ram = Arc::new(MappedDevice::ram(BYTES, 4096).unwrap());
    let dev: Arc<dyn BlockDevice> = ram.clone();
    let sb = r.block_on(async move {
        format(&dev).await;
        let fs = mount(&dev).await;
        let c = Creds::root();
        for d in 0..5 {
            let dir = fs.mkdir(&c, ROOT_INO, format!("d{d}").as_bytes(), 0o755).await.unwrap().ino();
            for f in 0..20 {
                let (a, _) = fs.create(&c, dir, format!("f{f}").as_bytes(), 0o644, 2).await.unwrap();
                fs.data().write(a.ino(), FileOffset::new(0), &vec![f as u8; 5000]).await.unwrap();
                fs.setxattr(&c, a.ino(), b"user.tag", b"value", XattrFlags::default()).await.unwrap();
            }
        }
        fs.symlink(&c, ROOT_INO, b"sym", b"d0/f0").await.unwrap();
        fs.unmount().await.unwrap();
        let fs = mount(&dev).await;
        for f in 0..30 {
            fs.mknod(&c, ROOT_INO, format!("late{f}").as_bytes(), libc::S_IFREG | 0o600, 0).await.unwrap();
            if f % 10 == 9 {
                fs.sync().await.unwrap();
            }
        }
        fs.inspect().superblock()
    });
    let image = ram.snapshot();
    let mut blocks = vec![0u64, 1];
    blocks.extend(sb.checkpoint_extents.iter().flat_map(|r| r.start..r.end()));
    // Journal blocks that hold something.
    for b in 2..2 + sb.journal_blocks {
        if image[(b * 4096) as usize..((b + 1) * 4096) as usize].iter().any(|&x| x != 0) {
            blocks.push(b);
        }
    }
    (image, blocks)
}

/// The superblock copy of `image` mount would use.
fn newest_superblock(image: &[u8]) -> Superblock {
    (0..2)
        .map(|slot| Superblock::decode(&image[slot * 4096..(slot + 1) * 4096]).unwrap())
        .max_by_key(|sb| sb.generation)
        .unwrap()
}

/// fsck and mount an image; returns (fsck clean?, mount error).
fn examine(image: &[u8]) -> (bool, Option<String>) {
    let ram = MappedDevice::ram(BYTES, 4096).unwrap();
    ram.restore(image);
    let dev: Arc<dyn BlockDevice> = Arc::new(ram);
    let mut r = busy_reactor();
    r.block_on(async move {
        let report = check(&dev).await;
        let mounted = Fs::mount(channel(&dev), FsConfig::default()).await;
        (report.is_clean(), mounted.err().map(|e| e.to_string()))
    })
}

#[test]
fn random_byte_flips_in_metadata_never_panic() {
    let (image, blocks) = build_image();
    assert!(blocks.len() > 4, "checkpoint and journal blocks found: {blocks:?}");
    let seed = test_seed("KEELFS_DAMAGE_SEED", "damage");
    let mut s = seed;
    let (mut detected, mut cases) = (0, 0);
    for case in 0..150 {
        let mut damaged = image.clone();
        let block = blocks[(splitmix64(&mut s) % blocks.len() as u64) as usize];
        let flips = 1 + splitmix64(&mut s) % 4;
        // Flip within the first 512 bytes half the time: headers and small
        // payloads live there, so damage is not mostly in zero padding.
        let span = if splitmix64(&mut s).is_multiple_of(2) { 512 } else { 4096 };
        for _ in 0..flips {
            let at = (block * 4096 + splitmix64(&mut s) % span) as usize;
            damaged[at] ^= 1 << (splitmix64(&mut s) % 8);
        }
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| examine(&damaged)));
        let (clean, mount_error) =
            outcome.unwrap_or_else(|_| panic!("case {case}: block {block} damage caused a panic"));
        cases += 1;
        if !clean || mount_error.is_some() {
            detected += 1;
        }
        if let Some(msg) = &mount_error {
            assert!(!msg.is_empty());
            assert!(!clean, "case {case}: mount refused ({msg}) but fsck said clean");
        }
    }
    eprintln!("{detected} of {cases} damaged images detected");
    assert!(detected > cases / 3, "checksums caught only {detected} of {cases} damaged images");
}

#[test]
fn a_damaged_superblock_copy_is_reported_survived_and_repaired() {
    let (image, _) = build_image();
    let mut damaged = image.clone();
    // Damage the newest copy: the older one and its checkpoint still serve.
    let gens: Vec<u64> =
        (0..2).map(|slot| Superblock::decode(&image[slot * 4096..(slot + 1) * 4096]).unwrap().generation).collect();
    let newest = if gens[0] > gens[1] { 0 } else { 1 };
    damaged[newest * 4096 + 40] ^= 0xff;
    let ram = MappedDevice::ram(BYTES, 4096).unwrap();
    ram.restore(&damaged);
    let dev: Arc<dyn BlockDevice> = Arc::new(ram);
    let mut r = busy_reactor();
    r.block_on(async move {
        let report = check(&dev).await;
        assert!(!report.is_clean());
        assert_eq!(report.problems[0].kind, "superblock-copy");
        let fs = Fs::mount(channel(&dev), FsConfig::default()).await.expect("mount from the other copy");
        assert!(fs.lookup(&Creds::root(), ROOT_INO, b"late9").await.is_ok(), "synced work survived");
        drop(fs);
        let after = repair(channel(&dev), |_| {}).await.unwrap();
        assert!(after.is_clean(), "{after:?}");
        assert!(!after.repaired.is_empty());
    });
}

#[test]
fn a_damaged_checkpoint_refuses_the_mount_with_a_clear_message() {
    let (image, _) = build_image();
    let sb = newest_superblock(&image);
    let mut damaged = image.clone();
    let block = sb.checkpoint_extents[0].start;
    damaged[(block * 4096 + 100) as usize] ^= 0x10;
    let (clean, err) = examine(&damaged);
    assert!(!clean);
    let err = err.expect("mount refused");
    assert!(err.contains("checkpoint") && err.contains("checksum"), "{err}");
}

#[test]
fn fsck_finds_and_repairs_a_wrong_link_count() {
    let mut r = busy_reactor();
    let dev = ram_device(BYTES);
    r.block_on(async move {
        format(&dev).await;
        let fs = mount(&dev).await;
        let c = Creds::root();
        let f = fs.mknod(&c, ROOT_INO, b"f", libc::S_IFREG | 0o644, 0).await.unwrap().ino();
        fs.link(&c, f, ROOT_INO, b"g").await.unwrap();
        // Damage through the API's back door: a link count that lies.
        let bad = keelfs_fs::SetAttr::default();
        fs.setattr(&c, f, &bad, false).await.unwrap();
        fs.inspect().debug_set_nlink(f, 5);
        fs.unmount().await.unwrap();
        let report = check(&dev).await;
        assert_eq!(report.problems.len(), 1, "{report:?}");
        assert_eq!(report.problems[0].kind, "link-count");
        let after = repair(channel(&dev), |_| {}).await.unwrap();
        assert!(after.is_clean(), "{after:?}");
        let fs = mount(&dev).await;
        assert_eq!(fs.getattr(f).await.unwrap().inode.nlink, 2);
    });
}

/// Crafted superblocks: every field set to hostile values, the checksum
/// recomputed so that it passes, written over both copies. Mount and fsck
/// must refuse them with a message (or, for values that are merely odd,
/// work), never panic, overflow or allocate by what the image claims.
#[test]
fn crafted_superblocks_with_valid_checksums_never_panic() {
    let (image, _) = build_image();
    let newest = newest_superblock(&image);
    let device_blocks = BYTES / 4096;
    let hostile = [
        0,
        1,
        2,
        15,
        16,
        device_blocks - 1,
        device_blocks,
        device_blocks + 1,
        1 << 40,
        1 << 62,
        u64::MAX / 2,
        u64::MAX - 1,
        u64::MAX,
    ];
    type Mutation = (&'static str, fn(&mut Superblock, u64));
    let fields: &[Mutation] = &[
        ("total_blocks", |sb, v| sb.total_blocks = v),
        ("journal_blocks", |sb, v| sb.journal_blocks = v),
        ("allocation_groups", |sb, v| sb.allocation_groups = v as u32),
        ("journal_start", |sb, v| sb.journal_start = v),
        ("journal_seq", |sb, v| sb.journal_seq = v),
        ("checkpoint_seq", |sb, v| sb.checkpoint_seq = v),
        ("checkpoint_bytes", |sb, v| sb.checkpoint_bytes = v),
        ("generation", |sb, v| sb.generation = v),
        ("checkpoint extent start", |sb, v| sb.checkpoint_extents[0].start = v),
        ("checkpoint extent len", |sb, v| sb.checkpoint_extents[0].len = v),
        ("data checksum table blocks", |sb, v| {
            sb.features |= FEATURE_DATA_CHECKSUMS;
            sb.csum_table_blocks = v;
        }),
    ];
    let mut refused = 0;
    for (name, set) in fields {
        for &value in &hostile {
            let mut sb = newest.clone();
            set(&mut sb, value);
            let block = sb.encode();
            let mut crafted = image.clone();
            crafted[..4096].copy_from_slice(&block);
            crafted[4096..8192].copy_from_slice(&block);
            refused += usize::from(examine_crafted(&crafted, &format!("{name} = {value}")));
        }
    }
    eprintln!("{refused} of {} crafted superblocks refused", fields.len() * hostile.len());
    assert!(refused > fields.len() * 4, "only {refused} crafted superblocks were refused");
}

/// Examine a crafted image (`what` names it): no panic, and never a
/// refused mount with a clean fsck. Whether the mount refused it.
fn examine_crafted(crafted: &[u8], what: &str) -> bool {
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| examine(crafted)));
    let (clean, mount_error) = outcome.unwrap_or_else(|_| panic!("{what}: a panic"));
    if let Some(msg) = &mount_error {
        assert!(!clean, "{what}: mount refused ({msg}) but fsck said clean");
    }
    mount_error.is_some()
}

/// Journal transactions whose records are mutated and whose checksums are
/// then recomputed, so that replay trusts them: hostile record fields
/// (lengths, inode numbers, block numbers, names) reach the decoder and
/// the loader. Mount and fsck must refuse or survive, never panic.
/// `KEELFS_DAMAGE_SEED` replays a case.
#[test]
fn journal_records_with_valid_checksums_never_panic() {
    use keelfs_fs::crc;
    let (image, _) = build_image();
    let sb = newest_superblock(&image);
    // The transactions in the ring that do not wrap: (offset, payload_len).
    let mut txs = Vec::new();
    for b in 2..2 + sb.journal_blocks {
        let at = (b * 4096) as usize;
        if &image[at..at + 4] != b"KFTX" {
            continue;
        }
        let blocks = u32::from_le_bytes(image[at + 32..at + 36].try_into().unwrap()) as u64;
        let len = u32::from_le_bytes(image[at + 36..at + 40].try_into().unwrap()) as usize;
        if b + blocks <= 2 + sb.journal_blocks && len > 0 {
            txs.push((at, len));
        }
    }
    assert!(!txs.is_empty(), "the image has journal transactions");
    let seed = test_seed("KEELFS_DAMAGE_SEED", "journal mutation");
    eprintln!("{} transactions", txs.len());
    let mut s = seed;
    let (mut refused, cases) = (0, 300);
    for case in 0..cases {
        let mut crafted = image.clone();
        let (at, len) = txs[(splitmix64(&mut s) % txs.len() as u64) as usize];
        let payload = at + 64..at + 64 + len;
        for _ in 0..1 + splitmix64(&mut s) % 4 {
            let off = payload.start + (splitmix64(&mut s) % len as u64) as usize;
            match splitmix64(&mut s) % 4 {
                // A whole field at an edge: lengths, numbers, counts.
                0 if off + 8 <= payload.end => crafted[off..off + 8].copy_from_slice(&u64::MAX.to_le_bytes()),
                1 if off + 4 <= payload.end => crafted[off..off + 4].copy_from_slice(&u32::MAX.to_le_bytes()),
                2 => crafted[off] = 0,
                _ => crafted[off] ^= 1 << (splitmix64(&mut s) % 8),
            }
        }
        let sum = crc(&crafted[payload.clone()]);
        crafted[at + 40..at + 44].copy_from_slice(&sum.to_le_bytes());
        let header_sum = crc(&crafted[at + 8..at + 64]);
        crafted[at + 4..at + 8].copy_from_slice(&header_sum.to_le_bytes());
        refused += usize::from(examine_crafted(&crafted, &format!("case {case} (seed {seed})")));
    }
    eprintln!("{refused} of {cases} crafted journals refused at mount");
    assert!(refused > 0, "no crafted journal was refused: the mutation never reached replay");
}

/// Checkpoint blocks whose record stream is mutated and whose block
/// checksums are then recomputed, so that the loader trusts them: hostile
/// inode numbers, sizes, extent maps, names and counts reach it. Mount and
/// fsck must refuse or survive, never panic. `KEELFS_DAMAGE_SEED` replays
/// a case.
#[test]
fn checkpoint_records_with_valid_checksums_never_panic() {
    use keelfs_fs::crc;
    // Block header: magic u32, crc32c u32 of the rest of the block, seq
    // u64, index u32, payload length u32 (docs/FORMAT.md, "Checkpoint").
    const HEADER: usize = 24;
    let (image, _) = build_image();
    let sb = newest_superblock(&image);
    let blocks: Vec<(usize, usize)> = sb
        .checkpoint_extents
        .iter()
        .flat_map(|r| r.start..r.end())
        .map(|b| (b * 4096) as usize)
        .filter(|&at| &image[at..at + 4] == b"KFCP")
        .map(|at| (at, u32::from_le_bytes(image[at + 20..at + 24].try_into().unwrap()) as usize))
        .filter(|&(_, len)| len > 0 && len <= 4096 - HEADER)
        .collect();
    assert!(!blocks.is_empty(), "the image has a checkpoint");
    let seed = test_seed("KEELFS_DAMAGE_SEED", "checkpoint mutation");
    eprintln!("{} blocks", blocks.len());
    let mut s = seed;
    let (mut refused, cases) = (0, 300);
    for case in 0..cases {
        let mut crafted = image.clone();
        let (at, len) = blocks[(splitmix64(&mut s) % blocks.len() as u64) as usize];
        let payload = at + HEADER..at + HEADER + len;
        for _ in 0..1 + splitmix64(&mut s) % 4 {
            let off = payload.start + (splitmix64(&mut s) % len as u64) as usize;
            match splitmix64(&mut s) % 5 {
                0 if off + 8 <= payload.end => crafted[off..off + 8].copy_from_slice(&u64::MAX.to_le_bytes()),
                1 if off + 8 <= payload.end => crafted[off..off + 8].copy_from_slice(&(1u64 << 62).to_le_bytes()),
                2 if off + 4 <= payload.end => crafted[off..off + 4].copy_from_slice(&u32::MAX.to_le_bytes()),
                3 => crafted[off] = 0,
                _ => crafted[off] ^= 1 << (splitmix64(&mut s) % 8),
            }
        }
        let sum = crc(&crafted[at + 8..at + 4096]);
        crafted[at + 4..at + 8].copy_from_slice(&sum.to_le_bytes());
        refused += usize::from(examine_crafted(&crafted, &format!("case {case} (seed {seed})")));
    }
    eprintln!("{refused} of {cases} crafted checkpoints refused at mount");
    assert!(refused > 0, "no crafted checkpoint was refused: the mutation never reached the loader");
}

/// The first transaction after the checkpoint in `image`: its byte
/// offset in the ring.
fn first_transaction(image: &[u8]) -> usize {
    let sb = newest_superblock(image);
    let at = ((2 + sb.journal_start % sb.journal_blocks) * 4096) as usize;
    assert_eq!(&image[at..at + 4], b"KFTX", "the image has a transaction at the journal's start");
    at
}

/// Write `value` at `field` of the transaction header at `at`, and seal
/// the header again, as a crafted image would.
fn sealed_header_field(image: &mut [u8], at: usize, field: usize, value: &[u8]) {
    image[at + field..at + field + value.len()].copy_from_slice(value);
    let sum = keelfs_fs::crc(&image[at + 8..at + 64]);
    image[at + 4..at + 8].copy_from_slice(&sum.to_le_bytes());
}

/// A header whose checksum holds was written whole: impossible lengths in
/// it are damage, not a torn tail that ends the log (docs/FORMAT.md,
/// "Journal transaction"; found by the image fuzzer).
#[test]
fn a_whole_header_with_impossible_lengths_refuses_the_mount() {
    let (image, _) = build_image();
    let at = first_transaction(&image);
    // blocks (offset 32): none, and past any ring.
    for blocks in [0u32, 1 << 24] {
        let mut crafted = image.clone();
        sealed_header_field(&mut crafted, at, 32, &blocks.to_le_bytes());
        let (clean, refused) = examine(&crafted);
        let message = refused.unwrap_or_else(|| panic!("blocks = {blocks}: the mount took it"));
        assert!(message.contains("past the ring"), "blocks = {blocks}: {message}");
        assert!(!clean, "blocks = {blocks}: fsck found it clean");
    }
}

/// Past the end of the log, a transaction numbered at or above the one
/// expected there could be taken by a later replay for the continuation
/// of new transactions. Here the first transaction after the checkpoint
/// is renumbered (its header sealed again), so replay ends there while
/// the ones after it, numbered on, remain: fsck reports them, and a
/// mount erases them before it writes, so what it then writes mounts
/// again (found by the image fuzzer, where a transaction claiming more
/// blocks than it held hid the ones it covered).
#[test]
fn transactions_numbered_on_past_the_end_are_erased_by_mount() {
    let (image, _) = build_image();
    let at = first_transaction(&image);
    let seq = u64::from_le_bytes(image[at + 24..at + 32].try_into().unwrap());
    let mut crafted = image.clone();
    sealed_header_field(&mut crafted, at, 24, &(seq + 1000).to_le_bytes());
    let ram = MappedDevice::ram(BYTES, 4096).unwrap();
    ram.restore(&crafted);
    let dev: Arc<dyn BlockDevice> = Arc::new(ram);
    let mut r = busy_reactor();
    r.block_on(async move {
        let before = check(&dev).await;
        let stale = before.problems.iter().find(|p| p.kind == "journal-stale").expect("fsck reports them");
        assert!(stale.repairable, "{stale:?}");
        let fs = mount(&dev).await;
        let erased = check(&dev).await;
        assert!(erased.problems.iter().all(|p| p.kind != "journal-stale"), "the mount erased them: {erased:?}");
        let c = Creds::root();
        for f in 0..40 {
            fs.mknod(&c, ROOT_INO, format!("after{f}").as_bytes(), libc::S_IFREG | 0o600, 0).await.unwrap();
            fs.sync().await.unwrap();
        }
        drop(fs); // a crash: no checkpoint, the new transactions replay
        let fs = mount(&dev).await;
        assert!(fs.lookup(&c, ROOT_INO, b"after39").await.is_ok(), "the new transactions replayed");
        fs.unmount().await.unwrap();
        let after = check(&dev).await;
        assert!(after.is_clean(), "{after:?}");
    });
}

/// A ring whose every transaction is numbered lower than the one expected
/// is an earlier lap's, as in any honest ring: nothing to report or erase.
#[test]
fn a_log_that_ends_at_an_earlier_lap_is_clean() {
    let (image, _) = build_image();
    let mut stale = image.clone();
    let ring = 2..2 + newest_superblock(&image).journal_blocks as usize;
    for header in ring.map(|b| b * 4096).filter(|&h| &image[h..h + 4] == b"KFTX") {
        sealed_header_field(&mut stale, header, 24, &0u64.to_le_bytes());
    }
    let (clean, refused) = examine(&stale);
    assert_eq!(refused, None, "a log that ends at an earlier lap mounts");
    assert!(clean, "and fsck finds nothing");
}
