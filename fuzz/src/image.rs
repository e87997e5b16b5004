//! Coverage-guided fuzzing of images (issue 36): an image is as untrusted
//! as a guest, so a mutated one is checked, mounted and put through a
//! fixed workload, and nothing it holds may make keelfs panic, hang,
//! allocate without bound or write an image it cannot read back.
//!
//! The base image is formatted and filled once: directories, files with
//! data and extended attributes, a symlink and a hard link, checkpointed
//! by an unmount, then changed again so that journal transactions follow
//! the checkpoint. Mount then reads both the checkpoint loader's input and
//! journal replay's. An input is a list of patches over that image:
//!
//! | byte | meaning |
//! |---|---|
//! | 0 | where: bits 0-1 choose a superblock copy, a journal transaction, a checkpoint block or a raw journal block; bits 2-7 pick which |
//! | 1, 2 | the offset in it, little-endian, modulo its length |
//! | 3 | bits 0-4: how many bytes follow (0 to 31); bit 7: leave the checksums as they fall |
//! | ... | the bytes, written at the offset |
//!
//! Unless a patch says otherwise, the checksums over what it touched are
//! then computed again, as a crafted image would carry them: the mutation
//! reaches the decoders and the loader behind the checksums instead of
//! dying at them. A raw journal block has no checksum of its own (it may
//! be a torn tail).
//!
//! Each input runs on a fresh copy, so a run is deterministic. What must
//! hold, or the harness panics (a crash to AFL++):
//! - fsck, repair and mount answer, with a report or an error;
//! - on a mounted image, a bounded walk (lookups, attributes, reads,
//!   links, extended attributes) and a few changes answer, and after them
//!   the blocks have one owner each and every part's invariants hold;
//! - what keelfs wrote mounts again, and fsck finds it clean when it found
//!   the input clean;
//! - when repair says it repaired an image, fsck then finds it clean.

use std::sync::Arc;

use keelfs_base::testing::splitmix64;
use keelfs_bdev::MappedDevice;
use keelfs_fs::{crc, fsck, repair, FsckReport, Superblock, CHECKPOINT_BLOCK_MAGIC, JOURNAL_TX_MAGIC};
use keelfs_fs::{mkfs, MkfsOptions};
use keelfs_fs::{Creds, FileOffset, Fs, FsConfig, Ino, RenameMode, SetAttr, XattrFlags, ROOT_INO};
use keelfs_fs::{FileClock, ManualClock, Timespec};
use keelfs_reactor::{PollMode, Reactor, ReactorConfig};

use crate::channel;

const DEVICE_BYTES: u64 = 8 << 20;
const BLOCK: usize = 4096;
/// Patches one input may hold.
const PATCHES_MAX: usize = 32;
/// The bytes one patch writes at most.
const PATCH_BYTES_MAX: usize = 31;
/// Nodes the walk visits, entries it lists per directory and bytes it
/// reads per file, at most: the workload is bounded whatever the image
/// claims.
const WALK_NODES_MAX: usize = 256;
const WALK_ENTRIES_MAX: usize = 64;
const READ_BYTES_MAX: u32 = 64 << 10;
/// A journal transaction's header, before its payload (docs/FORMAT.md).
const TX_HEADER: usize = 64;
/// A regular file's type bits in a mode.
const S_IFREG: u32 = 0o100_000;
/// Where the superblock's checkpoint extent count sits, and its limit.
const SB_EXTENT_COUNT_AT: usize = 100;
const SB_EXTENTS_MAX: usize = 128;

/// The structures of the base image that patches aim at.
struct Sites {
    /// The transactions that do not wrap the ring: byte offset, and
    /// length with the header.
    transactions: Vec<(usize, usize)>,
    /// Byte offsets of the checkpoint's blocks.
    checkpoint: Vec<usize>,
    /// The journal ring's device blocks.
    ring: std::ops::Range<usize>,
}

pub struct ImageHarness {
    reactor: Reactor,
    device: Arc<MappedDevice>,
    image: Vec<u8>,
    scratch: Vec<u8>,
    sites: Sites,
}

/// Times from a clock that stands still: the same input writes the same
/// image.
fn still_clock() -> FileClock {
    FileClock::Manual(ManualClock::new(Timespec { sec: 1_700_000_000, nsec: 0 }))
}

fn fs_config() -> FsConfig {
    FsConfig { file_clock: still_clock(), ..FsConfig::default() }
}

impl ImageHarness {
    /// The base image, built once (module documentation).
    pub fn new() -> Self {
        let mut reactor =
            Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() }).expect("a reactor");
        let device = Arc::new(MappedDevice::ram(DEVICE_BYTES, BLOCK as u32).expect("a RAM device"));
        let dev = Arc::clone(&device);
        let sb = reactor.block_on(async move { fill(&dev).await });
        let image = device.snapshot();
        let sites = Sites::find(&image, &sb);
        assert!(!sites.transactions.is_empty() && !sites.checkpoint.is_empty(), "the base image has both");
        let scratch = image.clone();
        Self { reactor, device, image, scratch, sites }
    }

    /// Run one input (module documentation). Panics when what must hold
    /// does not.
    pub fn run(&mut self, input: &[u8]) {
        self.scratch.copy_from_slice(&self.image);
        apply_patches(&mut self.scratch, &self.sites, input);
        self.device.restore(&self.scratch);
        let device = Arc::clone(&self.device);
        self.reactor.block_on(async move { examine(&device).await });
    }
}

impl Default for ImageHarness {
    fn default() -> Self {
        Self::new()
    }
}

/// Format `dev` and fill it: a checkpoint, then transactions after it.
async fn fill(dev: &Arc<MappedDevice>) -> Superblock {
    let options = MkfsOptions { force: true, journal_blocks: 64, file_clock: still_clock(), ..MkfsOptions::default() };
    mkfs(channel(dev), &options).await.expect("mkfs");
    let c = Creds::root();
    let fs = Fs::mount(channel(dev), fs_config()).await.expect("mount");
    for d in 0..3u8 {
        let dir = fs.mkdir(&c, ROOT_INO, format!("d{d}").as_bytes(), 0o755).await.expect("mkdir").ino();
        for f in 0..6u8 {
            let (a, fh) = fs.create(&c, dir, format!("f{f}").as_bytes(), 0o644, 2).await.expect("create");
            fs.release(fh).await.expect("release");
            let data = vec![f; 3000 * usize::from(f + 1)];
            fs.data().write(a.ino(), FileOffset::new(0), &data).await.expect("write");
            fs.setxattr(&c, a.ino(), b"user.tag", &[d, f], XattrFlags::default()).await.expect("setxattr");
        }
    }
    fs.symlink(&c, ROOT_INO, b"sym", b"d0/f0").await.expect("symlink");
    let d1 = fs.lookup(&c, ROOT_INO, b"d1").await.expect("lookup").ino();
    let f1 = fs.lookup(&c, d1, b"f1").await.expect("lookup").ino();
    fs.link(&c, f1, ROOT_INO, b"hard").await.expect("link");
    fs.unmount().await.expect("unmount");
    let fs = Fs::mount(channel(dev), fs_config()).await.expect("mount again");
    for f in 0..8u8 {
        let a = fs.mknod(&c, ROOT_INO, format!("late{f}").as_bytes(), S_IFREG | 0o600, 0).await.expect("mknod");
        fs.data().write(a.ino(), FileOffset::new(u64::from(f) * 5000), b"late").await.expect("write");
        if f % 3 == 2 {
            fs.sync().await.expect("sync");
        }
    }
    fs.rename(&c, ROOT_INO, b"late0", d1, b"moved", RenameMode::Replace).await.expect("rename");
    fs.unlink(&c, ROOT_INO, b"late1").await.expect("unlink");
    fs.sync().await.expect("sync");
    // Not unmounted: what it committed stays in the journal, to replay.
    fs.inspect().superblock()
}

impl Sites {
    fn find(image: &[u8], sb: &Superblock) -> Self {
        let ring = 2..2 + sb.journal_blocks as usize;
        let transactions = ring
            .clone()
            .map(|b| b * BLOCK)
            .filter(|&at| u32_at(image, at) == JOURNAL_TX_MAGIC)
            .filter(|&at| {
                let blocks = u32_at(image, at + 32) as usize;
                blocks > 0 && at / BLOCK + blocks <= ring.end
            })
            .map(|at| (at, TX_HEADER + u32_at(image, at + 36) as usize))
            .collect();
        let checkpoint = sb
            .checkpoint_extents
            .iter()
            .flat_map(|r| r.start..r.end())
            .map(|b| b as usize * BLOCK)
            .filter(|&at| u32_at(image, at) == CHECKPOINT_BLOCK_MAGIC)
            .collect();
        Self { transactions, checkpoint, ring }
    }
}

fn u32_at(image: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(image[at..at + 4].try_into().expect("4 bytes"))
}

fn put_u32(image: &mut [u8], at: usize, value: u32) {
    image[at..at + 4].copy_from_slice(&value.to_le_bytes());
}

/// What a patch aims at.
#[derive(Clone, Copy)]
enum Site {
    Superblock(usize),
    Transaction(usize),
    CheckpointBlock(usize),
    RingBlock,
}

impl Site {
    /// The site that `where_` picks, with its start and length in the
    /// image (as the base image laid it out: a patch may change a length
    /// field, and later ones still aim at what was there).
    fn pick(sites: &Sites, where_: u8) -> (Self, usize, usize) {
        let index = usize::from(where_ >> 2);
        match where_ & 3 {
            0 => (Site::Superblock(index % 2), index % 2 * BLOCK, BLOCK),
            1 => {
                let (at, len) = sites.transactions[index % sites.transactions.len()];
                (Site::Transaction(at), at, len)
            }
            2 => {
                let at = sites.checkpoint[index % sites.checkpoint.len()];
                (Site::CheckpointBlock(at), at, BLOCK)
            }
            _ => {
                let block = sites.ring.start + index % sites.ring.len();
                (Site::RingBlock, block * BLOCK, BLOCK)
            }
        }
    }
}

/// Apply the patches of `input` to `image` and seal what they touched.
fn apply_patches(image: &mut [u8], sites: &Sites, mut input: &[u8]) {
    let mut touched: Vec<Site> = Vec::with_capacity(PATCHES_MAX);
    for _ in 0..PATCHES_MAX {
        let [where_, off_lo, off_hi, len_flags, rest @ ..] = input else { break };
        let len = usize::from(len_flags & 0x1f).min(rest.len()).min(PATCH_BYTES_MAX);
        let (bytes, left) = rest.split_at(len);
        input = left;
        let (site, start, site_len) = Site::pick(sites, *where_);
        let offset = (usize::from(*off_lo) | usize::from(*off_hi) << 8) % site_len;
        let end = (start + offset + bytes.len()).min(start + site_len).min(image.len());
        let at = start + offset;
        image[at..end].copy_from_slice(&bytes[..end - at]);
        if len_flags & 0x80 == 0 {
            touched.push(site);
        }
    }
    for site in touched {
        seal(image, sites, site);
    }
}

/// Compute the checksums over `site` again, where its fields still say
/// where they are.
fn seal(image: &mut [u8], sites: &Sites, site: Site) {
    match site {
        Site::Superblock(slot) => {
            let block = &mut image[slot * BLOCK..(slot + 1) * BLOCK];
            let count = u32_at(block, SB_EXTENT_COUNT_AT) as usize;
            if count <= SB_EXTENTS_MAX {
                let covered = SB_EXTENT_COUNT_AT + 4 + count * 16;
                let sum = crc(&block[..covered]);
                put_u32(block, covered, sum);
            }
        }
        Site::Transaction(at) => {
            let payload_len = u32_at(image, at + 36) as usize;
            let payload = at + TX_HEADER..at + TX_HEADER + payload_len;
            if payload.end <= sites.ring.end * BLOCK {
                let sum = crc(&image[payload]);
                put_u32(image, at + 40, sum);
            }
            let sum = crc(&image[at + 8..at + TX_HEADER]);
            put_u32(image, at + 4, sum);
        }
        Site::CheckpointBlock(at) => {
            let sum = crc(&image[at + 8..at + BLOCK]);
            put_u32(image, at + 4, sum);
        }
        Site::RingBlock => {}
    }
}

/// fsck, repair, mount and the workload on the image in `dev` (module
/// documentation).
async fn examine(dev: &Arc<MappedDevice>) {
    let before = fsck(channel(dev), |_| {}).await.ok();
    let clean_before = before.as_ref().is_some_and(FsckReport::is_clean);
    let mounted = Fs::mount(channel(dev), fs_config()).await;
    if let Ok(fs) = mounted {
        exercise(&fs).await;
        if let Err(why) = fs.inspect().check_block_ownership() {
            panic!("after the workload, {why}");
        }
        fs.inspect().assert_invariants();
        fs.unmount().await.expect("what mounted unmounts");
        let again = Fs::mount(channel(dev), fs_config()).await;
        let fs = again.unwrap_or_else(|e| panic!("the image keelfs wrote does not mount again: {e}"));
        fs.unmount().await.expect("unmount");
        if clean_before {
            let after = fsck(channel(dev), |_| {}).await.expect("fsck of what keelfs wrote");
            assert!(after.is_clean(), "a clean image is no longer clean after the workload: {after:?}");
        }
    }
    if before.is_some_and(|report| !report.is_clean()) {
        if let Ok(repaired) = repair(channel(dev), |_| {}).await {
            let after = fsck(channel(dev), |_| {}).await.expect("fsck after repair");
            assert!(after.is_clean(), "repair answered {repaired:?} but fsck then found {after:?}");
        }
    }
}

/// The fixed workload: a bounded walk from the root, then changes. Every
/// error is an answer; only a panic is a finding.
async fn exercise(fs: &Fs) {
    let c = Creds::root();
    let mut queue = vec![ROOT_INO];
    let mut seen = 0;
    let mut a_file = None;
    while let Some(ino) = queue.pop() {
        seen += 1;
        if seen > WALK_NODES_MAX {
            break;
        }
        visit(fs, &c, ino).await;
        let Ok(entries) = fs.readdir(ino, 0, WALK_ENTRIES_MAX).await else { continue };
        for entry in entries {
            let name = &entry.name[..];
            if name == b"." || name == b".." {
                continue;
            }
            if let Ok(attr) = fs.lookup(&c, ino, name).await {
                if attr.inode.is_dir() {
                    queue.push(attr.ino());
                } else {
                    visit(fs, &c, attr.ino()).await;
                    if attr.inode.is_reg() && a_file.is_none() {
                        a_file = Some((ino, name.to_vec(), attr.ino()));
                    }
                }
            }
        }
    }
    change(fs, &c, a_file).await;
}

/// Read what a node holds: attributes, data, link target, xattrs.
async fn visit(fs: &Fs, c: &Creds, ino: Ino) {
    let _ = fs.getattr(ino).await;
    let _ = fs.data().read(ino, FileOffset::new(0), READ_BYTES_MAX).await;
    let _ = fs.readlink(ino).await;
    if let Ok(names) = fs.listxattr(ino).await {
        for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()).take(8) {
            let _ = fs.getxattr(c, ino, name).await;
        }
    }
}

/// Changes over the tree: a new file written, a directory, a rename, an
/// existing file grown, cut and unlinked, and a sync.
async fn change(fs: &Fs, c: &Creds, a_file: Option<(Ino, Vec<u8>, Ino)>) {
    if let Ok((a, fh)) = fs.create(c, ROOT_INO, b"fz", 0o644, 2).await {
        let _ = fs.data().write(a.ino(), FileOffset::new(4000), &[7u8; 10_000]).await;
        let _ = fs.release(fh).await;
    }
    if fs.mkdir(c, ROOT_INO, b"fzd", 0o755).await.is_ok() {
        if let Ok(dir) = fs.lookup(c, ROOT_INO, b"fzd").await {
            let _ = fs.rename(c, ROOT_INO, b"fz", dir.ino(), b"fz2", RenameMode::Replace).await;
        }
    }
    if let Some((parent, name, ino)) = a_file {
        let _ = fs.data().write(ino, FileOffset::new(1 << 20), b"grown").await;
        let _ = fs.setxattr(c, ino, b"user.fz", b"v", XattrFlags::default()).await;
        let _ = fs.setattr(c, ino, &SetAttr { size: Some(100), ..SetAttr::default() }, false).await;
        let _ = fs.unlink(c, parent, &name).await;
    }
    let _ = fs.sync().await;
}

/// `count` inputs from `seed`: a starting corpus for AFL++ and the fixed
/// cases CI runs. Each aims a few patches of edge values (zeros, all
/// ones, small and large numbers) at the image's structures.
pub fn generated_image_inputs(seed: u64, count: usize) -> Vec<Vec<u8>> {
    const VALUES: [&[u8]; 6] =
        [&[0; 8], &[0xff; 8], &[1, 0, 0, 0, 0, 0, 0, 0], &[0, 0, 0, 0, 0, 0, 0, 0x40], &[0x10, 0], &[2]];
    let mut s = seed;
    (0..count)
        .map(|_| {
            let mut input = Vec::new();
            for _ in 0..1 + splitmix64(&mut s) % 4 {
                let where_ = (splitmix64(&mut s) % 256) as u8;
                let offset = (splitmix64(&mut s) % 4096) as u16;
                let value = VALUES[(splitmix64(&mut s) % VALUES.len() as u64) as usize];
                let raw = if splitmix64(&mut s).is_multiple_of(8) { 0x80 } else { 0 };
                input.extend_from_slice(&[where_, offset as u8, (offset >> 8) as u8, value.len() as u8 | raw]);
                input.extend_from_slice(value);
            }
            input
        })
        .collect()
}
