//! Data checksums (issue 38): the format of an image made with
//! `MkfsOptions::data_checksums`, its checksum table, and what mount and
//! fsck make of it.

mod common;

use std::sync::Arc;

use common::{busy_reactor, channel, check, mount, ram_device};
use keelfs_bdev::{BlockDevice, MappedDevice};
use keelfs_fs::{mkfs, Creds, FileOffset, MkfsOptions, CSUMS_PER_TABLE_BLOCK, FEATURE_DATA_CHECKSUMS, ROOT_INO};

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
        assert_eq!(sb.csum_table_blocks, total.div_ceil(CSUMS_PER_TABLE_BLOCK));
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

/// A formatted image with a checksum table, as bytes.
fn checksummed_image() -> (Vec<u8>, keelfs_fs::Superblock) {
    let mut r = busy_reactor();
    let ram = Arc::new(MappedDevice::ram(BYTES, 4096).unwrap());
    let dev: Arc<dyn BlockDevice> = ram.clone();
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
