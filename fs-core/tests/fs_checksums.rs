//! Data checksums (issue 38): the format of an image made with
//! `MkfsOptions::data_checksums`, its checksum table, and what mount and
//! fsck make of it.

mod common;

use std::sync::Arc;

use common::{busy_reactor, channel, check, mount, ram_device};
use keelfs_base::testing::splitmix64;
use keelfs_bdev::{AlignedBuf, BlockDevice, MappedDevice};
use keelfs_fs::{fsck_with, mkfs, BadBlock, FallocateMode, FsConfig, FsckOptions, ScrubCursor, SeenShared, SetAttr};
use keelfs_fs::{Creds, FileOffset, Fs, Ino, MkfsOptions, CSUMS_PER_TABLE_BLOCK, FEATURE_DATA_CHECKSUMS, ROOT_INO};

const BYTES: u64 = 64 << 20;

async fn format_with_checksums(dev: &Arc<dyn BlockDevice>) -> keelfs_fs::Superblock {
    let options = MkfsOptions { force: true, data_checksums: true, ..MkfsOptions::default() };
    mkfs(channel(dev), &options).await.expect("mkfs --data-checksums")
}

#[test]
fn mkfs_with_data_checksums_reserves_the_table_after_the_journal() {
    let mut r = busy_reactor();
    let dev = ram_device(BYTES);
    r.block_on(async move {
        let sb = format_with_checksums(&dev).await;
        let total = BYTES / 4096;
        assert_ne!(sb.features & FEATURE_DATA_CHECKSUMS, 0);
        let entries = total.div_ceil(CSUMS_PER_TABLE_BLOCK);
        assert_eq!(
            sb.csum_table_blocks,
            entries + entries.div_ceil(CSUMS_PER_TABLE_BLOCK * 32),
            "the entries, then the region map"
        );
        assert_eq!(sb.csum_table_start(), 2 + sb.journal_blocks);
        assert_eq!(sb.data_start(), sb.csum_table_start() + sb.csum_table_blocks);
        // Fill a quarter of the device: no block of it may fall in the
        // table, which check_block_ownership holds as reserved.
        let fs = mount(&dev).await;
        let c = Creds::root();
        for f in 0..16u8 {
            let (a, fh) = fs.create(&c, ROOT_INO, format!("f{f}").as_bytes(), 0o644, 2).await.unwrap();
            fs.data().write(a.ino(), FileOffset::new(0), &vec![f; 1 << 20]).await.unwrap();
            fs.release(fh).await.unwrap();
        }
        fs.sync().await.unwrap();
        fs.inspect().check_block_ownership().expect("no block of the table is handed out");
        assert_eq!(fs.inspect().superblock().csum_table_blocks, sb.csum_table_blocks, "checkpoints keep the table");
        fs.unmount().await.unwrap();
        let report = check(&dev).await;
        assert!(report.is_clean(), "{:?}", report.problems);
        let fs = mount(&dev).await;
        assert_ne!(fs.inspect().superblock().features & FEATURE_DATA_CHECKSUMS, 0, "the bit survives a remount");
        fs.unmount().await.unwrap();
    });
}

#[test]
fn mkfs_without_data_checksums_leaves_no_table() {
    let mut r = busy_reactor();
    let dev = ram_device(BYTES);
    r.block_on(async move {
        let sb = mkfs(channel(&dev), &MkfsOptions { force: true, ..MkfsOptions::default() }).await.unwrap();
        assert_eq!(sb.features & FEATURE_DATA_CHECKSUMS, 0);
        assert_eq!(sb.csum_table_blocks, 0);
        assert_eq!(sb.data_start(), 2 + sb.journal_blocks);
    });
}

/// A RAM device, both as itself (to snapshot or search) and as the
/// device a filesystem mounts.
fn ram_pair() -> (Arc<MappedDevice>, Arc<dyn BlockDevice>) {
    let ram = Arc::new(MappedDevice::ram(BYTES, 4096).unwrap());
    let dev: Arc<dyn BlockDevice> = ram.clone();
    (ram, dev)
}

/// A formatted image with a checksum table, as bytes.
fn checksummed_image() -> (Vec<u8>, keelfs_fs::Superblock) {
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    let sb = r.block_on(async move { format_with_checksums(&dev).await });
    (ram.snapshot(), sb)
}

fn check_image(image: &[u8]) -> keelfs_fs::FsckReport {
    let mut r = busy_reactor();
    let ram = Arc::new(MappedDevice::ram(BYTES, 4096).unwrap());
    ram.restore(image);
    let dev: Arc<dyn BlockDevice> = ram;
    r.block_on(async move { check(&dev).await })
}

#[test]
fn mkfs_over_a_stale_table_writes_every_sector_anew() {
    // A device whose table area holds garbage (an earlier format, or
    // anything): mkfs must leave every sector checking.
    let mut r = busy_reactor();
    let ram = Arc::new(MappedDevice::ram(BYTES, 4096).unwrap());
    let mut junk = vec![0u8; BYTES as usize];
    for (i, b) in junk.iter_mut().enumerate() {
        *b = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3];
    }
    ram.restore(&junk);
    let dev: Arc<dyn BlockDevice> = ram.clone();
    r.block_on(async move {
        format_with_checksums(&dev).await;
        let report = check(&dev).await;
        assert!(report.is_clean(), "{:?}", report.problems);
    });
}

#[test]
fn fsck_names_a_table_sector_that_fails_its_crc() {
    let (mut image, sb) = checksummed_image();
    assert!(check_image(&image).is_clean());
    // Table block 1, sector 5: one flipped bit.
    let at = ((sb.csum_table_start() + 1) * 4096 + 5 * 512 + 40) as usize;
    image[at] ^= 0x08;
    let report = check_image(&image);
    let bad: Vec<_> = report.problems.iter().filter(|p| p.kind == "csum-table-sector").collect();
    assert_eq!(bad.len(), 1, "{:?}", report.problems);
    assert!(bad[0].detail.contains("table block 1 ") && bad[0].detail.contains("0b00100000"), "{}", bad[0].detail);
}

/// fsck --repair rebuilds a table sector that fails its crc from the data
/// of the blocks it covers: before, the file's block under it reads as
/// EIO; after, fsck with --data is clean and the file reads back whole. A
/// sector over no data (table block 0's first: the superblocks and the
/// journal) is rebuilt too, and a bad sector of the dirty-region map is
/// rewritten.
#[test]
fn repair_rebuilds_table_sectors_from_the_data() {
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    let want = pattern(7, 1 << 20);
    let (a, sb) = r.block_on({
        let (dev, want) = (dev.clone(), want.clone());
        async move {
            let sb = format_with_checksums(&dev).await;
            let fs = mount(&dev).await;
            let (a, _) = fs.create(&Creds::root(), ROOT_INO, b"a", 0o644, 2).await.unwrap();
            fs.data().write(a.ino(), FileOffset::new(0), &want).await.unwrap();
            fs.unmount().await.unwrap();
            (a.ino(), sb)
        }
    });
    let block = find_block(&ram, &want[..4096]).expect("the file is on the device") as u64;
    let sector_byte =
        |table_block: u64, sector: u64| ((sb.csum_table_start() + table_block) * 4096 + sector * 512) as usize;
    let mut image = ram.snapshot();
    let index = block % CSUMS_PER_TABLE_BLOCK;
    image[sector_byte(block / CSUMS_PER_TABLE_BLOCK, index / 127) + 9] ^= 0x10;
    image[sector_byte(0, 0) + 3] ^= 0x01;
    // And a sector of the dirty-region map past the table's regions,
    // which the mount does not rewrite by itself.
    let entry_blocks = (BYTES / 4096).div_ceil(CSUMS_PER_TABLE_BLOCK);
    image[sector_byte(entry_blocks, 2) + 5] ^= 0x20;
    ram.restore(&image);
    r.block_on(async move {
        let report = check(&dev).await;
        let bad: Vec<_> = report.problems.iter().filter(|p| p.kind == "csum-table-sector").collect();
        assert!(!bad.is_empty() && bad.len() == report.problems.len(), "{:?}", report.problems);
        assert!(bad.iter().all(|p| p.repairable), "{bad:?}");
        let fs = mount(&dev).await;
        let read = fs.data().read(a, FileOffset::new(0), 4096).await;
        assert!(read.is_err(), "a block under a bad sector is vouched for by nothing");
        fs.unmount().await.unwrap();
        let report = keelfs_fs::repair(channel(&dev), |_| {}).await.expect("repair ran");
        assert!(report.is_clean(), "{:?}", report.problems);
        let rebuilt = report.repaired.iter().filter(|f| f.starts_with("rebuilt data checksum table block")).count();
        assert_eq!(rebuilt, if block < CSUMS_PER_TABLE_BLOCK { 1 } else { 2 }, "{:?}", report.repaired);
        assert!(report.repaired.iter().any(|f| f.starts_with("rewrote the data checksum table's dirty-region map")));
        assert_clean_with_data(&dev, "after the repair", 256).await;
        let fs = mount(&dev).await;
        assert_eq!(read_all(&fs, a).await, want, "every block checks again");
        fs.unmount().await.unwrap();
    });
}

async fn check_data(dev: &Arc<dyn BlockDevice>) -> keelfs_fs::FsckReport {
    fsck_with(channel(dev), FsckOptions { data: true }, |_| {}).await.expect("fsck ran")
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut s = seed;
    (0..len).map(|_| splitmix64(&mut s) as u8).collect()
}

fn aligned(data: &[u8]) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(data.len(), 4096);
    buf.copy_from_slice(data);
    buf
}

/// Every way data reaches blocks: buffered appends and overwrites
/// (whole and partial blocks), direct writes into holes, over written
/// blocks and unaligned, writes into fallocated space, truncation of a
/// block's tail, and a clone overwritten on both sides. After each stage,
/// and after a remount that replays it and one that checkpoints it, every
/// written block matches its checksum and the files read back whole.
#[test]
fn every_write_path_keeps_the_checksums_of_what_it_wrote() {
    let mut r = busy_reactor();
    let dev = ram_device(BYTES);
    r.block_on(async move {
        format_with_checksums(&dev).await;
        let fs = mount(&dev).await;
        let c = Creds::root();
        let (a, _) = fs.create(&c, ROOT_INO, b"a", 0o644, 2).await.unwrap();
        let (b, _) = fs.create(&c, ROOT_INO, b"b", 0o644, 2).await.unwrap();
        let (a, b) = (a.ino(), b.ino());
        let mut want_a = pattern(1, 300_000);
        fs.data().write(a, FileOffset::new(0), &want_a).await.unwrap();
        fs.data().writeback_all().await.unwrap();
        // Buffered overwrites: a partial block, and whole ones.
        for (at, len, seed) in [(5000usize, 100usize, 2u64), (8192, 3 * 4096, 3), (299_000, 1000, 4)] {
            let data = pattern(seed, len);
            fs.data().write(a, FileOffset::new(at as u64), &data).await.unwrap();
            want_a[at..at + len].copy_from_slice(&data);
        }
        fs.data().fsync(a, false).await.unwrap();
        // Direct: into a hole, over written blocks, and unaligned.
        let mut want_b = vec![0u8; 64 << 10];
        for (at, len, seed) in [(16384usize, 16384usize, 5u64), (0, 8192, 6), (20480, 8192, 7)] {
            let data = pattern(seed, len);
            fs.data().write_direct(b, FileOffset::new(at as u64), aligned(&data)).await.1.unwrap();
            want_b[at..at + len].copy_from_slice(&data);
        }
        let odd = pattern(8, 5000);
        let mut odd_buf = AlignedBuf::zeroed(odd.len(), 512);
        odd_buf.copy_from_slice(&odd);
        fs.data().write_direct(b, FileOffset::new(30_001), odd_buf).await.1.unwrap();
        want_b[30_001..35_001].copy_from_slice(&odd);
        // Fallocated space, then a direct write into it.
        fs.data()
            .fallocate(b, FallocateMode::Allocate { keep_size: false }, FileOffset::new(0), 128 << 10)
            .await
            .unwrap();
        want_b.resize(128 << 10, 0);
        let data = pattern(9, 8192);
        fs.data().write_direct(b, FileOffset::new(65536), aligned(&data)).await.1.unwrap();
        want_b[65536..65536 + 8192].copy_from_slice(&data);
        // Truncate inside a block: its tail is zeroed on the device.
        let set = SetAttr { size: Some(290_001), ..SetAttr::default() };
        fs.setattr(&c, a, &set, false).await.unwrap();
        want_a.truncate(290_001);
        // A clone, then both sides overwritten.
        let (k, _) = fs.create(&c, ROOT_INO, b"k", 0o644, 2).await.unwrap();
        let k = k.ino();
        let len = want_a.len() as u64;
        fs.data().copy_range(a, FileOffset::new(0), k, FileOffset::new(0), len).await.unwrap();
        let mut want_k = want_a.clone();
        let data = pattern(10, 4096);
        fs.data().write_direct(k, FileOffset::new(4096), aligned(&data)).await.1.unwrap();
        want_k[4096..8192].copy_from_slice(&data);
        fs.data().write(a, FileOffset::new(12_000), &data[..50]).await.unwrap();
        want_a[12_000..12_050].copy_from_slice(&data[..50]);
        fs.sync().await.unwrap();
        fs.inspect().check_block_ownership().unwrap();
        let files = [(a, &want_a), (b, &want_b), (k, &want_k)];
        for (ino, want) in files {
            assert_eq!(&read_all(&fs, ino).await, want, "inode {ino} reads back");
        }
        // a's 71 blocks, b's written ones and the two the clone's sides
        // copied on write: more than 80. (The 70 that a and k still share
        // are read once.)
        assert_clean_with_data(&dev, "after the writes, by replay", 80).await;
        fs.unmount().await.unwrap();
        assert_clean_with_data(&dev, "after unmount's checkpoint", 80).await;
        let fs = mount(&dev).await;
        for (ino, want) in files {
            assert_eq!(&read_all(&fs, ino).await, want, "inode {ino} reads back after a remount");
        }
        fs.unmount().await.unwrap();
    });
}

async fn read_all(fs: &Fs, ino: Ino) -> Vec<u8> {
    let size = fs.getattr(ino).await.unwrap().inode.size;
    fs.data().read(ino, FileOffset::new(0), size as u32).await.unwrap()
}

async fn assert_clean_with_data(dev: &Arc<dyn BlockDevice>, when: &str, at_least: u64) {
    let report = check_data(dev).await;
    assert!(report.is_clean(), "{when}: {:?}", report.problems);
    assert!(report.data_blocks_checked >= at_least, "{when}: only {} blocks checked", report.data_blocks_checked);
    assert_eq!(report.data_blocks_unverifiable, 0, "{when}");
}

/// Step C5: a direct overwrite goes in place and logs nothing; its
/// region is open on the device until a checkpoint writes its entries
/// back. A crash before that leaves new data under old entries, which
/// fsck calls unverifiable (not damage) and the next mount sets from the
/// data; a clean unmount closes the region.
#[test]
fn an_overwrite_goes_in_place_and_a_crash_is_settled_at_mount() {
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    let (old, new) = (pattern(1, 8192), pattern(2, 8192));
    let (a, crashed) = r.block_on({
        let (dev, ram, old, new) = (dev.clone(), ram.clone(), old.clone(), new.clone());
        async move {
            format_with_checksums(&dev).await;
            let fs = mount(&dev).await;
            let (a, _) = fs.create(&Creds::root(), ROOT_INO, b"a", 0o644, 2).await.unwrap();
            let a = a.ino();
            fs.data().write_direct(a, FileOffset::new(0), aligned(&old)).await.1.unwrap();
            fs.sync().await.unwrap();
            let before = find_block(&ram, &old[..4096]).expect("the first write is on the device");
            let (free_before, records_before) = (fs.inspect().free_blocks(), fs.inspect().counters().records_logged);
            fs.data().write_direct(a, FileOffset::new(0), aligned(&new)).await.1.unwrap();
            fs.sync().await.unwrap();
            assert_eq!(find_block(&ram, &new[..4096]), Some(before), "the overwrite went in place");
            assert_eq!(fs.inspect().free_blocks(), free_before, "no block taken or freed");
            assert_eq!(fs.inspect().counters().records_logged, records_before, "and no record logged");
            assert_eq!(read_all(&fs, a).await, new, "it reads back checked");
            (a, ram.snapshot())
        }
    });
    // The crash: the entries on the device are the old data's.
    ram.restore(&crashed);
    r.block_on({
        let (dev, new) = (dev.clone(), new.clone());
        async move {
            let report = check_data(&dev).await;
            assert!(report.is_clean(), "{:?}", report.problems);
            assert_eq!((report.data_regions_open, report.data_blocks_unverifiable), (1, 2));
            let fs = mount(&dev).await;
            assert_eq!(read_all(&fs, a).await, new, "the mount set the entries from the data");
            fs.unmount().await.unwrap();
            let report = check_data(&dev).await;
            assert!(report.is_clean(), "{:?}", report.problems);
            assert_eq!((report.data_regions_open, report.data_blocks_unverifiable), (0, 0), "closed");
            assert_clean_with_data(&dev, "after the crash was settled", 2).await;
        }
    });
}

fn find_block(ram: &MappedDevice, content: &[u8]) -> Option<usize> {
    let image = ram.snapshot();
    (0..image.len() / 4096).find(|&b| &image[b * 4096..(b + 1) * 4096] == content)
}

#[test]
fn fsck_data_names_the_inode_and_offset_of_a_corrupted_block() {
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    let (ino, image) = r.block_on(async move {
        format_with_checksums(&dev).await;
        let fs = mount(&dev).await;
        let (a, _) = fs.create(&Creds::root(), ROOT_INO, b"a", 0o644, 2).await.unwrap();
        fs.data().write(a.ino(), FileOffset::new(0), &pattern(3, 40_960)).await.unwrap();
        fs.unmount().await.unwrap();
        (a.ino(), ())
    });
    let _ = (ino, image);
    // The file's sixth block: find it by its content.
    let want = pattern(3, 40_960);
    let block = find_block(&ram, &want[5 * 4096..6 * 4096]).expect("the block is on the device");
    let mut image = ram.snapshot();
    image[block * 4096 + 123] ^= 0x01;
    ram.restore(&image);
    let dev: Arc<dyn BlockDevice> = ram;
    let report = r.block_on(async move { check_data(&dev).await });
    let bad: Vec<_> = report.problems.iter().filter(|p| p.kind == "data-checksum").collect();
    assert_eq!(bad.len(), 1, "{:?}", report.problems);
    let detail = &bad[0].detail;
    assert!(detail.contains(&format!("inode {ino} at offset 20480 (device block {block})")), "{detail}");
}

/// What a faulty device did to one block of the file, behind the
/// filesystem's back.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// One bit of the block flipped at rest.
    FlipBit,
    /// The block's last write never reached the medium: its location
    /// holds what it held before (zeros: it was free).
    LostWrite,
    /// The block's last write went to another block of the file: its own
    /// location holds zeros, and the other block's location holds its data.
    Misdirected,
}

const FILE_BLOCKS: u64 = 48;

/// Block `b` of the test file at `generation`: unique on the device.
fn block_image(b: u64, generation: u64) -> Vec<u8> {
    pattern(b * 1000 + generation, 4096)
}

/// A file of FILE_BLOCKS blocks, half of them overwritten once (so they
/// live in blocks that were free, as any copy on write does), unmounted.
fn faulty_image_base() -> (Vec<u8>, Vec<Vec<u8>>) {
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    let want = r.block_on(async move {
        format_with_checksums(&dev).await;
        let fs = mount(&dev).await;
        let (f, _) = fs.create(&Creds::root(), ROOT_INO, b"f", 0o644, 2).await.unwrap();
        let mut want = Vec::new();
        for b in 0..FILE_BLOCKS {
            let data = block_image(b, 1);
            fs.data().write_direct(f.ino(), FileOffset::new(b * 4096), aligned(&data)).await.1.unwrap();
            want.push(data);
        }
        fs.sync().await.unwrap();
        for b in (0..FILE_BLOCKS).step_by(2) {
            let data = block_image(b, 2);
            fs.data().write_direct(f.ino(), FileOffset::new(b * 4096), aligned(&data)).await.1.unwrap();
            want[b as usize] = data;
        }
        fs.unmount().await.unwrap();
        want
    });
    (ram.snapshot(), want)
}

/// Seeded runs of silent device faults (flipped bits, lost and misdirected
/// writes) on a checksummed image: every block a fault touched reads as
/// EIO, buffered and direct, and every other block reads back intact.
/// `KEELFS_CSUM_SEED` replays a run.
#[test]
fn every_silent_device_fault_reads_as_eio() {
    let (base, want) = faulty_image_base();
    let locate = |image: &[u8], b: usize| {
        (0..image.len() / 4096).find(|&d| image[d * 4096..(d + 1) * 4096] == want[b][..]).expect("a block of the file")
    };
    let mut seed = keelfs_base::testing::test_seed("KEELFS_CSUM_SEED", "checksum faults");
    let (mut injected, mut detected) = (0u64, 0u64);
    for run in 0..12 {
        let mut image = base.clone();
        let mut hurt = std::collections::BTreeSet::new();
        for _ in 0..1 + splitmix64(&mut seed) % 4 {
            let victim = (splitmix64(&mut seed) % FILE_BLOCKS) as usize;
            let at = locate(&base, victim) * 4096;
            let fault = [Fault::FlipBit, Fault::LostWrite, Fault::Misdirected][(splitmix64(&mut seed) % 3) as usize];
            match fault {
                Fault::FlipBit => {
                    image[at + (splitmix64(&mut seed) % 4096) as usize] ^= 1 << (splitmix64(&mut seed) % 8)
                }
                Fault::LostWrite => image[at..at + 4096].fill(0),
                Fault::Misdirected => {
                    let other =
                        (victim + 1 + (splitmix64(&mut seed) % (FILE_BLOCKS - 1)) as usize) % FILE_BLOCKS as usize;
                    let to = locate(&base, other) * 4096;
                    image[to..to + 4096].copy_from_slice(&want[victim]);
                    image[at..at + 4096].fill(0);
                    hurt.insert(other);
                }
            }
            hurt.insert(victim);
            eprintln!("run {run}: {fault:?} on file block {victim}");
        }
        injected += hurt.len() as u64;
        for direct in [false, true] {
            detected += read_each_block(&image, &want, &hurt, direct);
        }
    }
    assert_eq!(detected, 2 * injected, "of {injected} damaged blocks read twice each, {detected} reads failed");
}

/// Mount `image` and read each file block alone (a fresh mount, so no
/// page is cached): the blocks in `hurt` must fail with EIO, the others
/// read back as `want`. Returns how many reads failed.
fn read_each_block(image: &[u8], want: &[Vec<u8>], hurt: &std::collections::BTreeSet<usize>, direct: bool) -> u64 {
    let mut r = busy_reactor();
    let ram = Arc::new(MappedDevice::ram(BYTES, 4096).unwrap());
    ram.restore(image);
    let dev: Arc<dyn BlockDevice> = ram;
    let (want, hurt) = (want.to_vec(), hurt.clone());
    r.block_on(async move {
        let fs = Fs::mount(channel(&dev), FsConfig { read_only: true, ..FsConfig::default() }).await.unwrap();
        let f = fs.lookup(&Creds::root(), ROOT_INO, b"f").await.unwrap().ino();
        let mut failed = 0;
        for (b, data) in want.iter().enumerate() {
            let at = FileOffset::new(b as u64 * 4096);
            let got = match direct {
                true => {
                    let (buf, result) = fs.data().read_direct(f, at, AlignedBuf::zeroed(4096, 4096)).await;
                    result.map(|_| buf.to_vec())
                }
                false => fs.data().read(f, at, 4096).await,
            };
            match (got, hurt.contains(&b)) {
                (Err(e), true) => {
                    assert_eq!(e.errno(), libc::EIO, "block {b}: {e}");
                    failed += 1;
                }
                (Ok(got), false) => assert_eq!(&got, data, "block {b} (direct: {direct}) reads back"),
                (got, hurt) => panic!("block {b} (direct: {direct}, damaged: {hurt}): {:?}", got.map(|g| g.len())),
            }
        }
        assert_eq!(fs.inspect().counters().data_checksum_errors, failed, "each failure counted");
        failed
    })
}

/// Walk a whole scrub, `max` blocks a step: the blocks checked, and the
/// bad ones found.
async fn scrub_all(fs: &Fs, max: u64) -> (u64, Vec<BadBlock>, u64) {
    let (mut at, mut checked, mut bad, mut steps) = (Some(ScrubCursor::START), 0, Vec::new(), 0);
    let mut seen = SeenShared::default();
    while let Some(cursor) = at {
        let step = fs.admin().scrub_step(cursor, max, &mut seen).await.unwrap();
        assert!(step.blocks_checked <= max, "a step reads at most what it is asked");
        checked += step.blocks_checked;
        bad.extend(step.bad);
        at = step.next;
        steps += 1;
    }
    (checked, bad, steps)
}

#[test]
fn a_scrub_checks_every_written_block_and_names_the_bad_one() {
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    let (ram2, dev2) = (ram.clone(), dev.clone());
    r.block_on(async move {
        format_with_checksums(&dev).await;
        let fs = mount(&dev).await;
        let c = Creds::root();
        let mut inos = Vec::new();
        for (i, blocks) in [3u64, 40, 1, 300].iter().enumerate() {
            let (f, _) = fs.create(&c, ROOT_INO, format!("f{i}").as_bytes(), 0o644, 2).await.unwrap();
            let data = pattern(100 + i as u64, (blocks * 4096) as usize);
            fs.data().write(f.ino(), FileOffset::new(0), &data).await.unwrap();
            inos.push((f.ino(), data));
        }
        // A sparse file: a hole, then one block far out.
        let (sparse, _) = fs.create(&c, ROOT_INO, b"sparse", 0o644, 2).await.unwrap();
        fs.data().write(sparse.ino(), FileOffset::new(1 << 30), &pattern(7, 4096)).await.unwrap();
        fs.sync().await.unwrap();
        let (checked, bad, _) = scrub_all(&fs, 64).await;
        assert_eq!((checked, bad.len()), (3 + 40 + 1 + 300 + 1, 0));
        fs.unmount().await.unwrap();
        // Damage file f1's block 17.
        let (ino, data) = inos[1].clone();
        let block = find_block(&ram2, &data[17 * 4096..18 * 4096]).unwrap();
        let mut image = ram2.snapshot();
        image[block * 4096 + 9] ^= 0x80;
        ram2.restore(&image);
        let fs = mount(&dev2).await;
        let (checked, bad, steps) = scrub_all(&fs, 256).await;
        assert_eq!(checked, 345);
        assert!(steps >= 5, "one step per extent piece at least");
        assert_eq!(bad, vec![BadBlock { file: Some((ino, 17 * 4096)), device_block: block as u64, unreadable: false }]);
        assert_eq!(fs.inspect().counters().data_checksum_errors, 1);
        fs.unmount().await.unwrap();
    });
}

/// Blocks only snapshots hold (a file overwritten since) are data a guest
/// reads later, through a snapshot or a clone of it: the scrub walks them
/// after the files, once however many snapshots hold them, and fsck
/// --data checks them. A block a snapshot holds and a file still names is
/// read with the file, and only then. One of each corrupted is found by
/// both once, named as a snapshot's and as the file's; a cursor in the
/// snapshots' part of the walk survives a remount.
#[test]
fn a_scrub_and_fsck_data_check_the_blocks_only_snapshots_hold() {
    const WHEN: keelfs_fs::Timespec = keelfs_fs::Timespec { sec: 1_764_000_000, nsec: 0 };
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    let (old, new, kept) = (pattern(11, 8 * 4096), pattern(12, 8 * 4096), pattern(13, 4 * 4096));
    let kept_ino = r.block_on({
        let (dev, old, new, kept) = (dev.clone(), old.clone(), new.clone(), kept.clone());
        async move {
            format_with_checksums(&dev).await;
            let fs = mount(&dev).await;
            let (a, b) = two_files(&fs, &old, &kept).await;
            fs.admin().snapshot_create("s1", WHEN).await.unwrap();
            fs.admin().snapshot_create("s2", WHEN).await.unwrap();
            fs.data().write(a, FileOffset::new(0), &new).await.unwrap();
            fs.sync().await.unwrap();
            let (checked, bad, _) = scrub_all(&fs, 64).await;
            assert_eq!((checked, bad.len()), (8 + 4 + 8, 0), "a's 8 and b's 4, then the 8 only snapshots hold");
            fs.unmount().await.unwrap();
            b
        }
    });
    let old_block = find_block(&ram, &old[3 * 4096..4 * 4096]).expect("the snapshots keep the old data");
    let kept_block = find_block(&ram, &kept[2 * 4096..3 * 4096]).expect("b is on the device");
    let mut image = ram.snapshot();
    image[old_block * 4096 + 77] ^= 0x04;
    image[kept_block * 4096 + 78] ^= 0x04;
    ram.restore(&image);
    r.block_on(async move {
        let report = check_data(&dev).await;
        let mut details: Vec<&str> = report.problems.iter().map(|p| p.detail.as_str()).collect();
        details.sort_unstable();
        assert_eq!(details.len(), 2, "each bad block once: {details:?}");
        assert!(details[0].starts_with(&format!("a block only snapshots hold (device block {old_block})")));
        assert!(details[1].starts_with(&format!("inode {kept_ino} at offset 8192 (device block {kept_block})")));
        let fs = mount(&dev).await;
        let (checked, mut bad, _) = scrub_all(&fs, 3).await;
        assert_eq!(checked, 20);
        bad.sort_by_key(|b| b.file.is_some());
        let want = vec![
            BadBlock { file: None, device_block: old_block as u64, unreadable: false },
            BadBlock { file: Some((kept_ino, 8192)), device_block: kept_block as u64, unreadable: false },
        ];
        assert_eq!(bad, want);
        assert_eq!(fs.inspect().counters().data_checksum_errors, 2);
        let at = ScrubCursor::in_snapshots(old_block as u64);
        fs.admin().scrub_save(Some((at, 1 << 20))).unwrap();
        fs.unmount().await.unwrap();
        let fs = mount(&dev).await;
        assert_eq!(fs.admin().scrub_saved(), Some((at, 1 << 20)));
        let step = fs.admin().scrub_step(at, 256, &mut SeenShared::default()).await.unwrap();
        assert_eq!(step.bad.len(), 1, "the walk goes on from the saved block");
        fs.unmount().await.unwrap();
    });
}

/// A block clones share is read once by a scrub pass and by fsck --data,
/// with the first file that names it: two clones of a 10-block file, one
/// of them overwritten in one block, are 11 blocks to read, not 30. A bad
/// shared block is found once, as the first file's.
#[test]
fn a_block_clones_share_is_read_once() {
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    let data = pattern(21, 10 * 4096);
    let (a, k1) = r.block_on({
        let (dev, data) = (dev.clone(), data.clone());
        async move {
            format_with_checksums(&dev).await;
            let fs = mount(&dev).await;
            let (a, _) = two_files(&fs, &data, &[]).await;
            let clones = two_clones(&fs, a, data.len() as u64).await;
            fs.data().write(clones[0], FileOffset::new(4 * 4096), &pattern(22, 4096)).await.unwrap();
            fs.sync().await.unwrap();
            let (checked, bad, _) = scrub_all(&fs, 4).await;
            assert_eq!((checked, bad.len()), (11, 0), "10 shared blocks once, and k1's own");
            fs.unmount().await.unwrap();
            (a, clones[0])
        }
    });
    assert!(a < k1, "a is met first");
    let block = corrupt_block_holding(&ram, &data[7 * 4096..8 * 4096]);
    r.block_on(async move {
        let report = check_data(&dev).await;
        assert_eq!(report.data_blocks_checked, 11);
        let details: Vec<&str> = report.problems.iter().map(|p| p.detail.as_str()).collect();
        assert_eq!(details.len(), 1, "the bad block once: {details:?}");
        assert!(details[0].starts_with(&format!("inode {a} at offset {} (device block {block})", 7 * 4096)));
        let fs = mount(&dev).await;
        let (checked, bad, _) = scrub_all(&fs, 3).await;
        assert_eq!(checked, 11);
        assert_eq!(bad, vec![BadBlock { file: Some((a, 7 * 4096)), device_block: block as u64, unreadable: false }]);
        fs.unmount().await.unwrap();
    });
}

/// The race `SeenShared::forget` answers. A scrub reads a block that a
/// file shares with two clones, and while that read is in flight the
/// file's block is copied on write, so the file names a new one. The old
/// block fails its check: it is not the file's to report, but both
/// clones still name it, unchanged and bad. The first clone's turn must
/// read it again, not step over it as read.
#[test]
fn a_shared_block_whose_first_name_moves_mid_read_is_checked_at_the_next() {
    use std::sync::atomic::Ordering::SeqCst;
    let gate = Arc::new(common::Gate::default());
    let mut r = busy_reactor();
    let (ram, raw) = ram_pair();
    let dev: Arc<dyn BlockDevice> = Arc::new(common::GateDevice { inner: raw, gate: gate.clone() });
    let data = pattern(31, 10 * 4096);
    r.block_on(async move {
        format_with_checksums(&dev).await;
        let fs = mount(&dev).await;
        let (a, _) = two_files(&fs, &data, &[]).await;
        let clones = two_clones(&fs, a, data.len() as u64).await;
        fs.sync().await.unwrap();
        // a is met first: were a clone first, its own read would find the
        // block bad with no forget at all.
        assert!(a < clones[0] && clones[0] < clones[1]);
        let block = corrupt_block_holding(&ram, &data[7 * 4096..8 * 4096]) as u64;
        // The scrub's read of a's piece that holds the bad block is held.
        *gate.hold_reads_at.lock().unwrap() = Some(block * 4096);
        let pass = std::rc::Rc::new(std::cell::RefCell::new(None));
        keelfs_reactor::spawn_local({
            let (fs, pass) = (fs.clone(), pass.clone());
            async move {
                *pass.borrow_mut() = Some(scrub_all(&fs, 16).await);
            }
        });
        while gate.reads_held.load(SeqCst) == 0 {
            assert!(pass.borrow().is_none(), "the scrub never read the bad block through the gate");
            keelfs_reactor::yield_now().await;
        }
        fs.data().write_direct(a, FileOffset::new(7 * 4096), aligned(&pattern(32, 4096))).await.1.unwrap();
        *gate.hold_reads_at.lock().unwrap() = None;
        while pass.borrow().is_none() {
            keelfs_reactor::yield_now().await;
        }
        let (checked, bad, _) = pass.take().unwrap();
        let k1 = clones[0];
        assert_eq!(bad, vec![BadBlock { file: Some((k1, 7 * 4096)), device_block: block, unreadable: false }]);
        assert_eq!(checked, 11, "a's 10 blocks, and the one whose check moved again at k1");
        fs.unmount().await.unwrap();
    });
}

#[test]
fn a_scrub_cursor_survives_replay_and_checkpoints() {
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    r.block_on(async move {
        format_with_checksums(&dev).await;
        let fs = mount(&dev).await;
        assert_eq!(fs.admin().scrub_saved(), None);
        let at = ScrubCursor { ino: Ino::new(5), file_block: 77 };
        fs.admin().scrub_save(Some((at, 3 << 20))).unwrap();
        fs.sync().await.unwrap();
        // A crash now: the record is replayed.
        let crashed = ram.snapshot();
        fs.unmount().await.unwrap();
        let fs = mount(&dev).await;
        assert_eq!(fs.admin().scrub_saved(), Some((at, 3 << 20)), "kept by the unmount's checkpoint");
        fs.admin().scrub_save(None).unwrap();
        fs.unmount().await.unwrap();
        assert_eq!(mount(&dev).await.admin().scrub_saved(), None, "a cleared cursor stays cleared");
        ram.restore(&crashed);
        assert_eq!(mount(&dev).await.admin().scrub_saved(), Some((at, 3 << 20)), "replayed from the journal");
    });
}

#[test]
fn a_scrub_of_an_image_without_checksums_is_not_supported() {
    common::with_fs(BYTES, async |fs, _dev| {
        let e = fs.admin().scrub_step(ScrubCursor::START, 16, &mut SeenShared::default()).await.unwrap_err();
        assert_eq!(e.errno(), libc::EOPNOTSUPP);
        assert_eq!(fs.admin().scrub_save(None).unwrap_err().errno(), libc::EOPNOTSUPP);
    });
}

fn recorded(report: &keelfs_fs::FsckReport) -> Vec<&str> {
    report.problems.iter().filter(|p| p.kind == "data-checksum-recorded").map(|p| p.detail.as_str()).collect()
}

/// Flip one bit of the device block that holds `content`; its index.
fn corrupt_block_holding(ram: &MappedDevice, content: &[u8]) -> usize {
    let block = find_block(ram, content).expect("the block is on the device");
    let mut image = ram.snapshot();
    image[block * 4096 + 77] ^= 0x04;
    ram.restore(&image);
    block
}

/// Files "k1" and "k2" in the root, each a clone of `a`'s first `len`
/// bytes (copy_range: they share its blocks).
async fn two_clones(fs: &Fs, a: Ino, len: u64) -> [Ino; 2] {
    let mut clones = [ROOT_INO; 2];
    for (clone, name) in clones.iter_mut().zip([b"k1", b"k2"]) {
        let (k, _) = fs.create(&Creds::root(), ROOT_INO, name, 0o644, 2).await.unwrap();
        fs.data().copy_range(a, FileOffset::new(0), k.ino(), FileOffset::new(0), len).await.unwrap();
        *clone = k.ino();
    }
    clones
}

/// Files "a" and "b" in the root, holding `a` and `b`.
async fn two_files(fs: &Fs, a: &[u8], b: &[u8]) -> (Ino, Ino) {
    let mut inos = [ROOT_INO; 2];
    for (ino, (name, data)) in inos.iter_mut().zip([(b"a", a), (b"b", b)]) {
        let (f, _) = fs.create(&Creds::root(), ROOT_INO, name, 0o644, 2).await.unwrap();
        fs.data().write(f.ino(), FileOffset::new(0), data).await.unwrap();
        *ino = f.ino();
    }
    (inos[0], inos[1])
}

#[test]
fn a_bad_block_found_at_run_time_is_recorded_for_fsck() {
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    let (a_data, b_data) = (pattern(41, 10 * 4096), pattern(42, 2 * 4096));
    let (a, b) = r.block_on({
        let (dev, a_data, b_data) = (dev.clone(), a_data.clone(), b_data.clone());
        async move {
            format_with_checksums(&dev).await;
            let fs = mount(&dev).await;
            let files = two_files(&fs, &a_data, &b_data).await;
            fs.unmount().await.unwrap();
            files
        }
    });
    // A read finds a's block 5 bad; a scrub finds b's block 1.
    let a_block = corrupt_block_holding(&ram, &a_data[5 * 4096..6 * 4096]);
    let b_block = corrupt_block_holding(&ram, &b_data[4096..]);
    let crashed = r.block_on({
        let (dev, ram) = (dev.clone(), ram.clone());
        async move {
            let fs = mount(&dev).await;
            assert_eq!(check(&dev).await.data_errors_recorded, 0, "nothing recorded before it is found");
            let e = fs.data().read(a, FileOffset::new(5 * 4096), 4096).await.unwrap_err();
            assert_eq!(e.errno(), libc::EIO);
            let (_, bad, _) = scrub_all(&fs, 64).await;
            assert_eq!(bad.len(), 2, "the scrub finds both: {bad:?}");
            fs.sync().await.unwrap();
            let crashed = ram.snapshot();
            fs.unmount().await.unwrap();
            crashed
        }
    });
    // Kept by the unmount's checkpoint, and by the journal before it.
    for (image, when) in [(ram.snapshot(), "after the unmount"), (crashed, "replayed after a crash")] {
        ram.restore(&image);
        let report = r.block_on({
            let dev = dev.clone();
            async move { check(&dev).await }
        });
        assert_eq!(report.data_errors_recorded, 2, "{when}");
        let found = recorded(&report);
        assert_eq!(found.len(), 2, "{when}: {:?}", report.problems);
        assert!(found.iter().any(|d| d.contains(&format!("inode {a} at offset 20480 (device block {a_block})"))));
        assert!(found.iter().any(|d| d.contains(&format!("inode {b} at offset 4096 (device block {b_block})"))));
    }
    // The rewrite of a's block (in place) forgets it; the unlink of b
    // frees its bad block, which forgets it too.
    r.block_on({
        let (dev, a_data) = (dev.clone(), a_data.clone());
        async move {
            let fs = mount(&dev).await;
            fs.data().write(a, FileOffset::new(5 * 4096), &a_data[5 * 4096..6 * 4096]).await.unwrap();
            fs.unlink(&Creds::root(), ROOT_INO, b"b").await.unwrap();
            fs.unmount().await.unwrap();
            let report = check(&dev).await;
            assert_eq!(report.data_errors_recorded, 0, "a's block rewritten, b's freed: both forgotten");
            assert!(report.is_clean(), "{:?}", report.problems);
            assert!(check_data(&dev).await.is_clean());
        }
    });
}

/// Regions open for overwrites in place are bounded: past the bound a
/// direct overwrite copies on write instead; a checkpoint then closes the
/// least recently overwritten of the regions it wrote back, down to half
/// the bound, and overwrites there go in place again.
#[test]
fn open_regions_are_bounded_and_a_checkpoint_closes_them() {
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    r.block_on(async move {
        format_with_checksums(&dev).await;
        let config = FsConfig { csum_open_regions_max: 2, ..FsConfig::default() };
        let fs = Fs::mount(channel(&dev), config).await.unwrap();
        let f = file_over_three_regions(&fs, &ram).await;
        let picked = THREE_REGIONS;
        let at = |b: u64, generation: u64| find_block(&ram, &block_image(b, generation)).map(|d| d as u64);
        let homes: Vec<u64> = picked.iter().map(|&b| at(b, 0).expect("written")).collect();
        let overwrite = async |b: u64, generation: u64| overwrite_block(&fs, f, b, generation).await;
        overwrite(picked[0], 1).await;
        overwrite(picked[1], 1).await;
        assert_eq!(fs.inspect().counters().data_regions_open, 2);
        assert_eq!((at(picked[0], 1), at(picked[1], 1)), (Some(homes[0]), Some(homes[1])), "in place");
        overwrite(picked[2], 1).await;
        let moved = at(picked[2], 1);
        assert_ne!(moved, Some(homes[2]), "a third region would pass the bound: copied on write");
        assert_eq!(fs.inspect().counters().data_regions_open, 2);
        fs.admin().checkpoint().await.unwrap();
        assert_eq!(fs.inspect().counters().data_regions_open, 1, "the checkpoint closed the older one");
        overwrite(picked[2], 2).await;
        assert_eq!(at(picked[2], 2), moved, "room for another region: in place");
        overwrite(picked[0], 2).await;
        assert_ne!(at(picked[0], 2), Some(homes[0]), "its region closed, and the bound is reached again");
        for (i, &b) in picked.iter().enumerate() {
            let want = block_image(b, if i == 1 { 1 } else { 2 });
            assert_eq!(fs.data().read(f, FileOffset::new(b * 4096), 4096).await.unwrap(), want);
        }
        fs.unmount().await.unwrap();
        assert_clean_with_data(&dev, "after the bound was reached", 2300).await;
    });
}

/// Below the point where a checkpoint is due, a checkpoint closes only
/// the regions idle since the one before: a region still being
/// overwritten stays open (closing it would cost a map write when the
/// next overwrite reopens it). An unmount closes every one.
#[test]
fn a_checkpoint_keeps_regions_still_being_overwritten_open() {
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    r.block_on(async move {
        format_with_checksums(&dev).await;
        let fs = mount(&dev).await;
        let f = file_over_three_regions(&fs, &ram).await;
        let open = || fs.inspect().counters().data_regions_open;
        let overwrite = async |b: u64, generation: u64| overwrite_block(&fs, f, b, generation).await;
        overwrite(0, 1).await;
        overwrite(1100, 1).await;
        assert_eq!(open(), 2);
        fs.admin().checkpoint().await.unwrap();
        assert_eq!(open(), 2, "both were overwritten since the last pass: open");
        overwrite(0, 2).await;
        fs.admin().checkpoint().await.unwrap();
        assert_eq!(open(), 1, "the idle one closed, the busy one did not");
        fs.admin().checkpoint().await.unwrap();
        assert_eq!(open(), 0, "idle for a whole pass: closed");
        overwrite(1100, 2).await;
        assert_eq!(open(), 1);
        fs.unmount().await.unwrap();
        let report = check_data(&dev).await;
        assert!(report.is_clean(), "{:?}", report.problems);
        assert_eq!(report.data_regions_open, 0, "the unmount closed the busy one");
    });
}

/// Opening the regions that make a checkpoint due asks for it at once,
/// not at the commit timer's next tick: overwrites past the bound would
/// copy on write meanwhile.
#[test]
fn opening_regions_up_to_the_due_point_asks_for_a_checkpoint() {
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    r.block_on(async move {
        format_with_checksums(&dev).await;
        // Due at three regions open of four; the timer never ticks here.
        let config = FsConfig {
            csum_open_regions_max: 4,
            commit_interval: std::time::Duration::from_secs(3600),
            ..FsConfig::default()
        };
        let fs = Fs::mount(channel(&dev), config).await.unwrap();
        let f = file_over_three_regions(&fs, &ram).await;
        let checkpoints = || fs.inspect().counters().checkpoints;
        let before = checkpoints();
        for b in THREE_REGIONS {
            overwrite_block(&fs, f, b, 1).await;
        }
        for _ in 0..10_000 {
            if checkpoints() > before {
                break;
            }
            keelfs_reactor::yield_now().await;
        }
        assert_eq!(checkpoints(), before + 1, "the third region asked for a checkpoint");
        assert_eq!(fs.inspect().counters().data_regions_open, 2, "which closed the oldest, down to half the bound");
        fs.unmount().await.unwrap();
        assert_clean_with_data(&dev, "after the asked checkpoint", 2300).await;
    });
}

/// File blocks of [`file_over_three_regions`] in three regions.
const THREE_REGIONS: [u64; 3] = [0, 1100, 2200];

/// A file of 2300 blocks written whole and synced: the blocks of
/// [`THREE_REGIONS`] lie in three different regions (asserted).
async fn file_over_three_regions(fs: &Fs, ram: &MappedDevice) -> Ino {
    let (f, _) = fs.create(&Creds::root(), ROOT_INO, b"f", 0o644, 2).await.unwrap();
    let f = f.ino();
    for first in (0..2300u64).step_by(256) {
        let body: Vec<u8> = (first..(first + 256).min(2300)).flat_map(|b| block_image(b, 0)).collect();
        fs.data().write_direct(f, FileOffset::new(first * 4096), aligned(&body)).await.1.unwrap();
    }
    fs.sync().await.unwrap();
    let regions: std::collections::BTreeSet<u64> = THREE_REGIONS
        .iter()
        .map(|&b| find_block(ram, &block_image(b, 0)).expect("written") as u64 / CSUMS_PER_TABLE_BLOCK)
        .collect();
    assert_eq!(regions.len(), 3, "three regions: {regions:?}");
    f
}

/// Overwrite block `b` of file `f` directly with its image of `generation`.
async fn overwrite_block(fs: &Fs, f: Ino, b: u64, generation: u64) {
    let data = block_image(b, generation);
    fs.data().write_direct(f, FileOffset::new(b * 4096), aligned(&data)).await.1.unwrap();
}

/// A read of a block whose overwrite in place is still in flight (its
/// data on the device, its completion held back) finds new data under the
/// old entry: it is let through unchecked, never EIO.
#[test]
fn a_read_racing_an_overwrite_of_its_block_is_not_an_error() {
    let gate = Arc::new(common::Gate::default());
    let mut r = busy_reactor();
    let dev: Arc<dyn BlockDevice> = Arc::new(common::GateDevice { inner: ram_device(BYTES), gate: gate.clone() });
    r.block_on(async move {
        format_with_checksums(&dev).await;
        let fs = mount(&dev).await;
        let (f, _) = fs.create(&Creds::root(), ROOT_INO, b"f", 0o644, 2).await.unwrap();
        let f = f.ino();
        fs.data().write_direct(f, FileOffset::new(0), aligned(&block_image(0, 0))).await.1.unwrap();
        // Opened, so that the overwrite below writes its data at once
        // (a map write would be held by the gate first).
        fs.data().write_direct(f, FileOffset::new(0), aligned(&block_image(0, 0))).await.1.unwrap();
        fs.sync().await.unwrap();
        assert_eq!(fs.inspect().counters().data_regions_open, 1);
        gate.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        let done = std::rc::Rc::new(std::cell::Cell::new(false));
        keelfs_reactor::spawn_local({
            let (fs, done) = (fs.clone(), done.clone());
            async move {
                fs.data().write_direct(f, FileOffset::new(0), aligned(&block_image(0, 1))).await.1.unwrap();
                done.set(true);
            }
        });
        while gate.held.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            keelfs_reactor::yield_now().await;
        }
        for _ in 0..10 {
            keelfs_reactor::yield_now().await; // the device copies the data
        }
        let (buf, result) = fs.data().read_direct(f, FileOffset::new(0), AlignedBuf::zeroed(4096, 4096)).await;
        result.expect("a read racing an overwrite of its block");
        assert_eq!(buf.to_vec(), block_image(0, 1), "it found the new data, on the device already");
        assert!(!done.get());
        gate.closed.store(false, std::sync::atomic::Ordering::SeqCst);
        while !done.get() {
            keelfs_reactor::yield_now().await;
        }
        assert_eq!(read_all(&fs, f).await, block_image(0, 1), "checked, once the overwrite ended");
        assert_eq!(fs.inspect().counters().data_checksum_errors, 0);
    });
}

/// A read-only mount cannot settle the regions a crash left open: their
/// blocks that fail their check are read as they are, not as EIO.
#[test]
fn a_read_only_mount_tolerates_regions_a_crash_left_open() {
    let mut r = busy_reactor();
    let (ram, dev) = ram_pair();
    let crashed = r.block_on({
        let (dev, ram) = (dev.clone(), ram.clone());
        async move {
            format_with_checksums(&dev).await;
            let fs = mount(&dev).await;
            let (f, _) = fs.create(&Creds::root(), ROOT_INO, b"f", 0o644, 2).await.unwrap();
            fs.data().write_direct(f.ino(), FileOffset::new(0), aligned(&block_image(0, 0))).await.1.unwrap();
            fs.sync().await.unwrap();
            fs.data().write_direct(f.ino(), FileOffset::new(0), aligned(&block_image(0, 1))).await.1.unwrap();
            fs.sync().await.unwrap();
            ram.snapshot()
        }
    });
    ram.restore(&crashed);
    r.block_on(async move {
        let config = FsConfig { read_only: true, ..FsConfig::default() };
        let fs = Fs::mount(channel(&dev), config).await.unwrap();
        let f = fs.lookup(&Creds::root(), ROOT_INO, b"f").await.unwrap().ino();
        assert_eq!(read_all(&fs, f).await, block_image(0, 1), "the new data, under its old entry");
        assert_eq!(fs.inspect().counters().data_checksum_errors, 0);
    });
}
