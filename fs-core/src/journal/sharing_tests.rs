//! Images whose files share blocks (`FEATURE_SHARED_EXTENTS`, issue 37):
//! loading counts the names from the checkpoint and from the journal,
//! refuses what may not be shared, and frees a block with its last name.
//! These tests make such images by hand, logging a second file's extent
//! over the first's blocks, so that they can also make the damaged ones a
//! clone never would (fs-core/tests/fs_clone.rs clones for real).

use std::sync::Arc;

use keelfs_bdev::{BlockDevice, MappedDevice, QueueConfig};
use keelfs_reactor::{DeviceChannel, PollMode, Reactor, ReactorConfig};

use crate::format::{BlockRun, FEATURE_SHARED_EXTENTS};
use crate::record::Record;
use crate::{
    fsck, mkfs, Creds, FallocateMode, FileOffset, Fs, FsConfig, FsError, FsResult, Ino, MkfsOptions, ROOT_INO,
};

const BLOCK: usize = 4096;
/// Blocks of file `a`.
const LEN: u64 = 3;

fn on_a_formatted_ram_device(test: impl AsyncFnOnce(Arc<dyn BlockDevice>) + 'static) {
    let mut reactor = Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() }).unwrap();
    let dev: Arc<dyn BlockDevice> = Arc::new(MappedDevice::ram(32 << 20, 4096).unwrap());
    reactor.block_on(async move {
        mkfs(channel(&dev), &MkfsOptions { force: true, ..MkfsOptions::default() }).await.unwrap();
        test(dev).await;
    });
}

fn channel(dev: &Arc<dyn BlockDevice>) -> DeviceChannel {
    DeviceChannel::attach(dev.open_queue(QueueConfig { depth: 64, completion_eventfd: false }).unwrap())
}

async fn mount(dev: &Arc<dyn BlockDevice>, read_only: bool) -> FsResult<Fs> {
    Fs::mount(channel(dev), FsConfig { read_only, ..FsConfig::default() }).await
}

/// File `a`, its blocks written with 0xab (or left unwritten), and an
/// empty file `b`; returns both and the run of `a`'s blocks.
async fn two_files(fs: &Fs, a_written: bool) -> (Ino, Ino, BlockRun) {
    let c = Creds::root();
    let (a, _) = fs.create(&c, ROOT_INO, b"a", 0o644, 2).await.unwrap();
    let (b, _) = fs.create(&c, ROOT_INO, b"b", 0o644, 2).await.unwrap();
    let (a, b) = (a.ino(), b.ino());
    if a_written {
        fs.data().write(a, FileOffset::new(0), &[0xab; LEN as usize * BLOCK]).await.unwrap();
        fs.data().writeback(a, 0, u64::MAX).await.unwrap();
    } else {
        let mode = FallocateMode::Allocate { keep_size: false };
        fs.data().fallocate(a, mode, FileOffset::new(0), LEN * BLOCK as u64).await.unwrap();
    }
    let extents: Vec<_> = fs.inner().meta.state().node(a).unwrap().extents.iter().collect();
    assert_eq!(extents.len(), 1, "one extent: {extents:?}");
    (a, b, BlockRun { start: extents[0].disk_block.get(), len: LEN })
}

/// Map `b`'s first blocks onto `run`, as a clone logs it (and counts it
/// live, so that this session frees nothing twice).
fn name_again(fs: &Fs, b: Ino, run: BlockRun, unwritten: bool) {
    let inner = fs.inner();
    inner.space.free_mut().shared.share(run);
    let mapped = Record::ExtentMap { ino: b, file_block: 0, disk_block: run.start, len: run.len, unwritten };
    inner.change().log(mapped).unwrap();
    inner.change().update_inode(b, |i| i.size = run.len * BLOCK as u64).unwrap();
}

fn set_sharing_bit(fs: &Fs) {
    fs.inner().journal.sb.borrow_mut().features |= FEATURE_SHARED_EXTENTS;
}

/// Whether the allocator holds every block of `run` as in use.
fn in_use(fs: &Fs, run: BlockRun) -> bool {
    fs.inner().space.free().alloc.free_within(run).is_empty()
}

async fn refusal(dev: &Arc<dyn BlockDevice>) -> String {
    match mount(dev, true).await {
        Err(FsError::Corrupt(why)) => why,
        other => panic!("a damaged image mounted: {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_shared_run_loads_from_the_checkpoint_and_from_the_journal() {
    for through_journal in [false, true] {
        on_a_formatted_ram_device(async move |dev| {
            let fs = mount(&dev, false).await.unwrap();
            set_sharing_bit(&fs);
            let (a, b, run) = two_files(&fs, true).await;
            if through_journal {
                // The bit reaches the superblock first, the sharing after.
                fs.admin().checkpoint().await.unwrap();
                name_again(&fs, b, run, false);
                fs.sync().await.unwrap();
                drop(fs); // a crash: the clone is in the journal only
            } else {
                name_again(&fs, b, run, false);
                fs.unmount().await.unwrap();
            }
            let fs = mount(&dev, true).await.unwrap();
            assert_eq!(fs.inspect().replayed_at_mount() > 0, through_journal);
            assert_eq!(fs.inspect().shared_blocks(), LEN, "each block named twice");
            for ino in [a, b] {
                let data = fs.data().read(ino, FileOffset::new(0), LEN as u32 * BLOCK as u32).await.unwrap();
                assert!(data.len() == LEN as usize * BLOCK && data.iter().all(|&x| x == 0xab), "inode {ino}");
            }
            assert!(in_use(&fs, run));
            let report = fsck(channel(&dev), |_| {}).await.unwrap();
            assert!(report.problems.is_empty(), "{:?}", report.problems);
        });
    }
}

#[test]
fn sharing_without_the_feature_bit_is_refused() {
    on_a_formatted_ram_device(async |dev| {
        let fs = mount(&dev, false).await.unwrap();
        let (_, b, run) = two_files(&fs, true).await;
        name_again(&fs, b, run, false);
        fs.unmount().await.unwrap();
        assert!(refusal(&dev).await.contains("already in use"));
        let report = fsck(channel(&dev), |_| {}).await.unwrap();
        assert!(report.problems.iter().any(|p| p.kind == "checkpoint"), "{:?}", report.problems);
    });
}

#[test]
fn an_unwritten_extent_never_shares() {
    // b unwritten over a's written blocks, then b written over a's
    // unwritten ones: a block-in-place write of either would show in both.
    for a_written in [true, false] {
        on_a_formatted_ram_device(async move |dev| {
            let fs = mount(&dev, false).await.unwrap();
            set_sharing_bit(&fs);
            let (_, b, run) = two_files(&fs, a_written).await;
            name_again(&fs, b, run, a_written);
            fs.unmount().await.unwrap();
            let why = refusal(&dev).await;
            let expected = if a_written { "already in use" } else { "unwritten extent" };
            assert!(why.contains(expected), "{why}");
        });
    }
}

#[test]
fn a_file_naming_the_checkpoint_is_refused() {
    on_a_formatted_ram_device(async |dev| {
        let fs = mount(&dev, false).await.unwrap();
        set_sharing_bit(&fs);
        let (_, b, _) = two_files(&fs, true).await;
        fs.admin().checkpoint().await.unwrap();
        let checkpoint = fs.inspect().superblock().checkpoint_extents[0];
        name_again(&fs, b, BlockRun { start: checkpoint.start, len: 1 }, false);
        fs.sync().await.unwrap();
        drop(fs);
        assert!(refusal(&dev).await.contains("belong to a checkpoint"));
        let report = fsck(channel(&dev), |_| {}).await.unwrap();
        assert!(report.problems.iter().any(|p| p.kind == "shared-extents"), "{:?}", report.problems);
    });
}

#[test]
fn a_shared_run_is_freed_with_its_last_name_only() {
    for punch_both in [false, true] {
        on_a_formatted_ram_device(async move |dev| {
            let fs = mount(&dev, false).await.unwrap();
            set_sharing_bit(&fs);
            let (a, b, run) = two_files(&fs, true).await;
            name_again(&fs, b, run, false);
            fs.admin().checkpoint().await.unwrap();
            // Replayed over the checkpoint, which holds both names.
            for ino in if punch_both { vec![b, a] } else { vec![b] } {
                fs.inner().change().log(Record::ExtentPunch { ino, file_block: 0, len: LEN }).unwrap();
            }
            fs.sync().await.unwrap();
            drop(fs);
            let fs = mount(&dev, true).await.unwrap();
            assert_eq!(fs.inspect().shared_blocks(), 0);
            assert_eq!(in_use(&fs, run), !punch_both, "freed only when both names are gone");
            if !punch_both {
                let data = fs.data().read(a, FileOffset::new(0), BLOCK as u32).await.unwrap();
                assert!(data.iter().all(|&x| x == 0xab), "a keeps its data");
            }
        });
    }
}
