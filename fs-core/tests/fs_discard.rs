//! Giving space back: continuous discard holds freed runs until their
//! discard completes, fstrim discards all free space, and a device that
//! cannot discard turns it off without losing space.

mod common;

use keelfs_fs::FileOffset;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::Ordering;

use common::{busy_reactor, channel, check, format, ram_device, Gate, GateDevice};
use keelfs_base::testing::ScratchFile;
use keelfs_bdev::{BlockDevice, UringDevice, UringOptions};
use keelfs_fs::{Creds, DiscardConfig, Fs, FsConfig, FsError, Ino, ROOT_INO};
use keelfs_reactor as reactor;

const MIB: u64 = 1 << 20;

fn image(tag: &str, bytes: u64) -> (ScratchFile, Arc<dyn BlockDevice>) {
    let file = ScratchFile::new(tag, bytes);
    let dev = UringDevice::open(&file.path, UringOptions::default()).expect("open image");
    (file, Arc::new(dev))
}

/// An image whose discard completions wait while `gate.hold_discards` is
/// set: an fstrim then holds its piece out of the allocator.
fn gated_image(tag: &str, bytes: u64) -> (ScratchFile, Arc<dyn BlockDevice>, Arc<Gate>) {
    let (file, inner) = image(tag, bytes);
    let gate = Arc::new(Gate::default());
    let dev: Arc<dyn BlockDevice> = Arc::new(GateDevice { inner, gate: gate.clone() });
    (file, dev, gate)
}

/// Start `fs.trim(min_bytes)` in its own task; its result lands in the
/// returned cell.
fn spawn_trim(fs: &Fs, min_bytes: u64) -> Rc<RefCell<Option<Result<u64, FsError>>>> {
    let out = Rc::new(RefCell::new(None));
    let (fs, cell) = (fs.clone(), out.clone());
    reactor::spawn_local(async move {
        let result = fs.admin().trim(min_bytes).await;
        *cell.borrow_mut() = Some(result);
    });
    out
}

/// Write `bytes` to a new file through the page cache, without syncing:
/// its blocks are only promised (delayed allocation).
async fn write_buffered(fs: &Fs, name: &[u8], bytes: u64) -> Ino {
    let (f, fh) = fs.create(&Creds::root(), ROOT_INO, name, 0o644, 2).await.unwrap();
    let chunk = vec![0x5a; MIB as usize];
    let mut at = 0;
    while at < bytes {
        let n = (bytes - at).min(MIB);
        fs.data().write(f.ino(), FileOffset::new(at), &chunk[..n as usize]).await.unwrap();
        at += n;
    }
    fs.release(fh).await.unwrap();
    f.ino()
}

fn config(discard: DiscardConfig) -> FsConfig {
    FsConfig { discard, commit_interval: Duration::from_secs(3600), ..FsConfig::default() }
}

fn on() -> DiscardConfig {
    DiscardConfig { enabled: true, ..DiscardConfig::default() }
}

/// A closed, forgotten file of `bytes`, written and synced.
async fn write_file(fs: &Fs, name: &[u8], bytes: u64) -> Result<Ino, FsError> {
    let (f, fh) = fs.create(&Creds::root(), ROOT_INO, name, 0o644, 2).await?;
    let chunk = vec![0x3c; MIB as usize];
    let mut result = Ok(());
    for i in 0..bytes / MIB {
        if let Err(e) = fs.data().write(f.ino(), FileOffset::new(i * MIB), &chunk).await {
            result = Err(e);
            break;
        }
    }
    if result.is_ok() {
        result = fs.sync().await;
    }
    fs.release(fh).await?;
    fs.forget(f.ino(), 1).await?;
    result.map(|()| f.ino())
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        reactor::sleep(Duration::from_millis(5)).await;
    }
}

#[test]
fn continuous_discard_gives_freed_runs_back_after_the_commit() {
    let (file, dev) = image("fs-discard", 64 * MIB);
    let mut r = busy_reactor();
    r.block_on(async move {
        format(&dev).await;
        let fs = Fs::mount(channel(&dev), config(on())).await.unwrap();
        write_file(&fs, b"keep", 4 * MIB).await.unwrap();
        write_file(&fs, b"gone", 16 * MIB).await.unwrap();
        let before = keelfs_base::testing::allocated_bytes(&file.path);
        assert!(before >= 20 * MIB, "{before} bytes allocated");
        let free_before = fs.statfs().await.unwrap().blocks_free;
        fs.unlink(&Creds::root(), ROOT_INO, b"gone").await.unwrap();
        fs.sync().await.unwrap();
        // Right after the commit the runs are out of the allocator, owned
        // by the queue, and df already counts them free.
        fs.inspect().check_block_ownership().unwrap();
        fs.inspect().assert_invariants();
        assert!(fs.statfs().await.unwrap().blocks_free >= free_before + 16 * MIB / 4096);
        wait_for("the queue to drain", || fs.inspect().counters().discard_pending_blocks == 0).await;
        let c = fs.inspect().counters();
        assert!(c.discards >= 1 && c.discard_bytes >= 16 * MIB && c.discard_errors == 0, "{c:?}");
        let after = keelfs_base::testing::allocated_bytes(&file.path);
        assert!(before - after >= 15 * MIB, "the image went from {before} to {after} bytes");
        // The space is reusable, and the kept file intact.
        write_file(&fs, b"again", 16 * MIB).await.unwrap();
        fs.inspect().check_block_ownership().unwrap();
        fs.inspect().assert_invariants();
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
    });
}

#[test]
fn fstrim_discards_free_space_with_continuous_discard_off() {
    let (file, dev) = image("fs-trim", 64 * MIB);
    let mut r = busy_reactor();
    r.block_on(async move {
        format(&dev).await;
        let fs = Fs::mount(channel(&dev), config(DiscardConfig::default())).await.unwrap();
        let keep = write_file(&fs, b"keep", 4 * MIB).await.unwrap();
        write_file(&fs, b"gone", 16 * MIB).await.unwrap();
        fs.unlink(&Creds::root(), ROOT_INO, b"gone").await.unwrap();
        fs.sync().await.unwrap();
        let before = keelfs_base::testing::allocated_bytes(&file.path);
        assert_eq!(fs.inspect().counters().discards, 0, "discard is off");
        // Runs shorter than the minimum are left alone.
        assert_eq!(fs.admin().trim(1 << 40).await.unwrap(), 0);
        let trimmed = fs.admin().trim(0).await.unwrap();
        assert!(trimmed >= 16 * MIB, "trimmed {trimmed} bytes");
        let after = keelfs_base::testing::allocated_bytes(&file.path);
        assert!(before - after >= 15 * MIB, "the image went from {before} to {after} bytes");
        assert_eq!(fs.inspect().counters().discard_pending_blocks, 0);
        fs.inspect().check_block_ownership().unwrap();
        fs.inspect().assert_invariants();
        let back = fs.data().read(keep, FileOffset::new(0), MIB as u32).await.unwrap();
        assert_eq!(back.len() as u64, MIB);
        assert!(back.iter().all(|&b| b == 0x3c), "the kept file is intact");
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
    });
}

#[test]
fn a_device_that_cannot_discard_turns_it_off_and_loses_no_space() {
    let dev = ram_device(32 * MIB);
    let mut r = busy_reactor();
    r.block_on(async move {
        format(&dev).await;
        let fs = Fs::mount(channel(&dev), config(on())).await.unwrap();
        write_file(&fs, b"gone", 8 * MIB).await.unwrap();
        let free = fs.inspect().free_blocks();
        fs.unlink(&Creds::root(), ROOT_INO, b"gone").await.unwrap();
        fs.sync().await.unwrap();
        wait_for("the queue to give up", || fs.inspect().counters().discard_pending_blocks == 0).await;
        assert!(fs.inspect().free_blocks() >= free + 8 * MIB / 4096);
        assert_eq!(fs.inspect().counters().discards, 0);
        assert_eq!(fs.admin().trim(0).await.err(), Some(FsError::Unsupported));
        assert_eq!(FsError::Unsupported.errno(), libc::EOPNOTSUPP);
        fs.inspect().check_block_ownership().unwrap();
        fs.inspect().assert_invariants();
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
    });
}

#[test]
fn a_writer_short_of_room_takes_runs_awaiting_discard_back() {
    let (_file, dev) = image("fs-discard-full", 32 * MIB);
    let mut r = busy_reactor();
    r.block_on(async move {
        format(&dev).await;
        // Paced to a crawl: the queue holds what the delete frees.
        let slow = DiscardConfig { bytes_per_sec: 4096, ..on() };
        let fs = Fs::mount(channel(&dev), config(slow)).await.unwrap();
        let mut n = 0;
        while write_file(&fs, format!("f{n}").as_bytes(), 4 * MIB).await.is_ok() {
            n += 1;
        }
        assert!(n >= 4, "{n} files fit");
        for i in 0..=n {
            fs.unlink(&Creds::root(), ROOT_INO, format!("f{i}").as_bytes()).await.unwrap();
        }
        fs.sync().await.unwrap();
        assert!(fs.inspect().counters().discard_pending_blocks > 1000, "{:?}", fs.inspect().counters());
        fs.inspect().check_block_ownership().unwrap();
        fs.inspect().assert_invariants();
        for i in 0..n {
            write_file(&fs, format!("g{i}").as_bytes(), 4 * MIB).await.unwrap();
        }
        fs.inspect().check_block_ownership().unwrap();
        fs.inspect().assert_invariants();
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
    });
}

#[test]
fn unmount_with_discards_queued_leaves_a_clean_image() {
    let (_file, dev) = image("fs-discard-unmount", 32 * MIB);
    let mut r = busy_reactor();
    r.block_on(async move {
        format(&dev).await;
        let slow = DiscardConfig { bytes_per_sec: 4096, ..on() };
        let fs = Fs::mount(channel(&dev), config(slow)).await.unwrap();
        write_file(&fs, b"gone", 8 * MIB).await.unwrap();
        fs.unlink(&Creds::root(), ROOT_INO, b"gone").await.unwrap();
        fs.sync().await.unwrap();
        assert!(fs.inspect().counters().discard_pending_blocks > 0);
        let free = fs.statfs().await.unwrap().blocks_free;
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
        let fs = Fs::mount(channel(&dev), config(DiscardConfig::default())).await.unwrap();
        assert_eq!(fs.statfs().await.unwrap().blocks_free, free, "the queued runs are free after remount");
    });
}

#[test]
fn fstrim_leaves_space_promised_to_dirty_pages_and_the_checkpoint() {
    let (_file, dev, gate) = gated_image("fs-trim-reserved", 64 * MIB);
    let mut r = busy_reactor();
    r.block_on(async move {
        format(&dev).await;
        let cfg = FsConfig { writeback_interval: Duration::from_secs(3600), ..config(DiscardConfig::default()) };
        let fs = Fs::mount(channel(&dev), cfg).await.unwrap();
        // Promise all but 1 MiB of the free space to dirty pages.
        let room = 256;
        let dirty = (fs.inspect().free_blocks() - room) * 4096;
        let ino = write_buffered(&fs, b"dirty", dirty).await;
        assert!(fs.inspect().free_blocks() <= room, "{} blocks still free", fs.inspect().free_blocks());
        // An fstrim holds its first piece while writeback allocates.
        gate.hold_discards.store(true, Ordering::SeqCst);
        let trim = spawn_trim(&fs, 0);
        wait_for("the trim to hold a piece", || gate.discards_held.load(Ordering::SeqCst) > 0).await;
        let held = fs.inspect().counters().discard_pending_blocks;
        assert!(held <= room, "the trim holds {held} blocks, more than the {room} not promised");
        fs.sync().await.expect("writeback gets the space it was promised");
        gate.hold_discards.store(false, Ordering::SeqCst);
        wait_for("the trim to end", || trim.borrow().is_some()).await;
        trim.take().unwrap().unwrap();
        fs.inspect().check_block_ownership().unwrap();
        fs.inspect().assert_invariants();
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
        let fs = Fs::mount(channel(&dev), config(DiscardConfig::default())).await.unwrap();
        let back = fs.data().read(ino, FileOffset::new(dirty - MIB), MIB as u32).await.unwrap();
        assert!(back.len() as u64 == MIB && back.iter().all(|&b| b == 0x5a), "the dirty file was written back whole");
        fs.unmount().await.unwrap();
    });
}

#[test]
fn a_second_fstrim_while_one_runs_is_busy() {
    let (_file, dev, gate) = gated_image("fs-trim-busy", 64 * MIB);
    let mut r = busy_reactor();
    r.block_on(async move {
        format(&dev).await;
        let fs = Fs::mount(channel(&dev), config(DiscardConfig::default())).await.unwrap();
        gate.hold_discards.store(true, Ordering::SeqCst);
        let first = spawn_trim(&fs, 0);
        wait_for("the trim to hold a piece", || gate.discards_held.load(Ordering::SeqCst) > 0).await;
        let held = fs.inspect().counters().discard_pending_blocks;
        // Spawned, so that a second trim that waits on the held discards
        // fails the test instead of hanging it.
        let second = spawn_trim(&fs, 0);
        wait_for("the second trim to answer", || second.borrow().is_some()).await;
        assert_eq!(second.take(), Some(Err(FsError::Busy)));
        assert_eq!(FsError::Busy.errno(), libc::EBUSY);
        assert_eq!(fs.inspect().counters().discard_pending_blocks, held, "the refused trim took nothing");
        gate.hold_discards.store(false, Ordering::SeqCst);
        wait_for("the trim to end", || first.borrow().is_some()).await;
        let trimmed = first.take().unwrap().unwrap();
        assert!(trimmed >= 32 * MIB, "trimmed {trimmed} bytes");
        // Once it has ended, the next may run.
        assert_eq!(fs.admin().trim(0).await, Ok(trimmed));
        fs.inspect().check_block_ownership().unwrap();
        fs.inspect().assert_invariants();
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
    });
}

#[test]
fn unmount_stops_an_fstrim_and_waits_for_its_piece() {
    let (_file, dev, gate) = gated_image("fs-trim-unmount", 512 * MIB);
    let mut r = busy_reactor();
    r.block_on(async move {
        format(&dev).await;
        let cfg = FsConfig { writeback_interval: Duration::from_secs(3600), ..config(DiscardConfig::default()) };
        let fs = Fs::mount(channel(&dev), cfg).await.unwrap();
        // Dirty pages, so that the unmount's writeback takes a while.
        let ino = write_buffered(&fs, b"dirty", 4 * MIB).await;
        gate.hold_discards.store(true, Ordering::SeqCst);
        let trim = spawn_trim(&fs, 0);
        wait_for("the trim to hold a piece", || gate.discards_held.load(Ordering::SeqCst) > 0).await;
        // The unmount starts while the piece is out, and its writeback
        // waits on the held writes.
        gate.closed.store(true, Ordering::SeqCst);
        let unmounted = Rc::new(RefCell::new(None));
        let (fs2, cell) = (fs.clone(), unmounted.clone());
        reactor::spawn_local(async move {
            let result = fs2.unmount().await;
            *cell.borrow_mut() = Some(result);
        });
        wait_for("the writeback to start", || gate.held.load(Ordering::SeqCst) > 0).await;
        // The piece comes back, and the trim takes no other.
        gate.hold_discards.store(false, Ordering::SeqCst);
        wait_for("the trim to end", || trim.borrow().is_some()).await;
        let trimmed = trim.take().unwrap().unwrap();
        assert_eq!(fs.inspect().counters().discards, 1, "the trim stopped after its piece");
        assert!(trimmed <= 64 * MIB, "trimmed {trimmed} bytes");
        assert_eq!(fs.inspect().counters().discard_pending_blocks, 0, "no piece is left out of the allocator");
        assert!(unmounted.borrow().is_none(), "the unmount is still writing back");
        gate.closed.store(false, Ordering::SeqCst);
        wait_for("the unmount to end", || unmounted.borrow().is_some()).await;
        unmounted.take().unwrap().unwrap();
        assert!(check(&dev).await.is_clean());
        let fs = Fs::mount(channel(&dev), config(DiscardConfig::default())).await.unwrap();
        fs.inspect().check_block_ownership().unwrap();
        fs.inspect().assert_invariants();
        let back = fs.data().read(ino, FileOffset::new(0), MIB as u32).await.unwrap();
        assert!(back.iter().all(|&b| b == 0x5a));
        // A trim after a remount covers what the stopped one left.
        assert!(fs.admin().trim(0).await.unwrap() > 256 * MIB);
        fs.unmount().await.unwrap();
    });
}
