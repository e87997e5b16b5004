//! The filesystem operation API: POSIX behaviour, persistence across
//! remounts, and a clean fsck afterwards.

mod common;

use keelfs_fs::FileOffset;
use std::sync::Arc;

use common::{busy_reactor, check, format, mount, ram_device, with_fs};
use keelfs_bdev::BlockDevice;
use keelfs_fs::Fs;
use keelfs_fs::ROOT_INO;
use keelfs_fs::{Creds, FsError, SeekTo, SetAttr, TimeSet};
use keelfs_fs::{FallocateMode, RenameMode, XattrFlags};

const MIB: u64 = 1 << 20;

fn root() -> Creds {
    Creds::root()
}

#[test]
fn files_and_directories_persist_across_remount() {
    with_fs(64 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = root();
        let d = fs.mkdir(&c, ROOT_INO, b"dir", 0o755).await.unwrap();
        let (f, fh) = fs.create(&c, d.ino(), b"file", 0o644, libc::O_RDWR as u32).await.unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(fs.data().write(f.ino(), FileOffset::new(1000), &data).await.unwrap(), data.len() as u32);
        fs.release(fh).await.unwrap();
        fs.symlink(&c, d.ino(), b"link", b"file").await.unwrap();
        fs.link(&c, f.ino(), ROOT_INO, b"hard").await.unwrap();
        fs.setxattr(&c, f.ino(), b"user.k", b"v", XattrFlags::default()).await.unwrap();
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());

        let fs = mount(&dev).await;
        assert_eq!(fs.inspect().replayed_at_mount(), 0, "a clean unmount leaves nothing to replay");
        let d = fs.lookup(&c, ROOT_INO, b"dir").await.unwrap();
        let f = fs.lookup(&c, d.ino(), b"file").await.unwrap();
        assert_eq!(f.inode.size, 101_000);
        assert_eq!(f.inode.nlink, 2);
        let back = fs.data().read(f.ino(), FileOffset::new(1000), 100_000).await.unwrap();
        assert!(back == data);
        let head = fs.data().read(f.ino(), FileOffset::new(0), 1000).await.unwrap();
        assert!(head.iter().all(|&b| b == 0), "the gap before the write reads as zeros");
        let l = fs.lookup(&c, d.ino(), b"link").await.unwrap();
        assert_eq!(fs.readlink(l.ino()).await.unwrap(), b"file");
        assert_eq!(fs.getxattr(&c, f.ino(), b"user.k").await.unwrap(), b"v");
        let h = fs.lookup(&c, ROOT_INO, b"hard").await.unwrap();
        assert_eq!(h.ino(), f.ino());
        assert_eq!(fs.getattr(ROOT_INO).await.unwrap().inode.nlink, 3);
    });
}

/// Found by the guest crash test: a directory that gains an entry and is
/// removed within one transaction left records naming an inode whose image
/// the transaction never carried, and replay refused the journal, so the
/// filesystem could not be mounted again.
#[test]
fn inodes_created_and_freed_in_one_transaction_replay() {
    with_fs(64 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = root();
        let d = fs.mkdir(&c, ROOT_INO, b"s", 0o755).await.unwrap().ino();
        let (f, fh) = fs.create(&c, d, b"x", 0o644, libc::O_RDWR as u32).await.unwrap();
        fs.data().write(f.ino(), FileOffset::new(0), b"x\n").await.unwrap();
        fs.release(fh).await.unwrap();
        let sym = fs.symlink(&c, d, b"l", b"x").await.unwrap().ino();
        fs.unlink(&c, d, b"x").await.unwrap();
        fs.unlink(&c, d, b"l").await.unwrap();
        fs.rmdir(&c, ROOT_INO, b"s").await.unwrap();
        // The kernel drops its references at once (FORGET), so the inodes
        // are freed inside the same transaction.
        for ino in [f.ino(), sym, d] {
            fs.forget(ino, 1).await.unwrap();
        }
        // And one that lives on, created in the same transaction.
        let keep = fs.mkdir(&c, ROOT_INO, b"keep", 0o755).await.unwrap().ino();
        fs.mkdir(&c, keep, b"inner", 0o755).await.unwrap();
        fs.sync().await.unwrap();
        drop(fs); // crash after the commit, before any checkpoint
        let report = check(&dev).await;
        assert!(report.is_clean(), "{report:?}");
        let fs = mount(&dev).await;
        assert!(fs.inspect().replayed_at_mount() >= 1);
        assert_eq!(fs.lookup(&c, ROOT_INO, b"s").await.err(), Some(FsError::NotFound));
        for gone in [d, f.ino(), sym] {
            assert_eq!(fs.getattr(gone).await.err(), Some(FsError::NotFound));
        }
        let keep = fs.lookup(&c, ROOT_INO, b"keep").await.unwrap().ino();
        fs.lookup(&c, keep, b"inner").await.unwrap();
        fs.unmount().await.unwrap();
        let report = check(&dev).await;
        assert!(report.is_clean(), "{report:?}");
    });
}

#[test]
fn synced_changes_survive_without_unmount() {
    with_fs(64 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = root();
        let (f, _) = fs.create(&c, ROOT_INO, b"a", 0o644, libc::O_RDWR as u32).await.unwrap();
        fs.data().write(f.ino(), FileOffset::new(0), b"hello").await.unwrap();
        fs.data().fsync(f.ino(), false).await.unwrap();
        fs.mkdir(&c, ROOT_INO, b"unsynced", 0o755).await.unwrap();
        drop(fs); // no unmount: as after a crash, on a device that lost nothing
        let fs = mount(&dev).await;
        assert!(fs.inspect().replayed_at_mount() >= 1);
        let f = fs.lookup(&c, ROOT_INO, b"a").await.unwrap();
        assert_eq!(fs.data().read(f.ino(), FileOffset::new(0), 10).await.unwrap(), b"hello");
        assert_eq!(fs.lookup(&c, ROOT_INO, b"unsynced").await.err(), Some(FsError::NotFound));
        fs.unmount().await.unwrap();
        let report = check(&dev).await;
        assert!(report.is_clean(), "{report:?}");
    });
}

#[test]
fn namespace_errors_follow_posix() {
    with_fs(32 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = root();
        let d = fs.mkdir(&c, ROOT_INO, b"d", 0o755).await.unwrap().ino();
        fs.mknod(&c, d, b"f", libc::S_IFREG | 0o644, 0).await.unwrap();
        assert_eq!(fs.mkdir(&c, ROOT_INO, b"d", 0o755).await.err(), Some(FsError::Exists));
        assert_eq!(fs.rmdir(&c, ROOT_INO, b"d").await.err(), Some(FsError::NotEmpty));
        assert_eq!(fs.unlink(&c, ROOT_INO, b"d").await.err(), Some(FsError::IsDir));
        assert_eq!(fs.rmdir(&c, d, b"f").await.err(), Some(FsError::NotDir));
        assert_eq!(fs.lookup(&c, d, b"nope").await.err(), Some(FsError::NotFound));
        assert_eq!(fs.lookup(&c, d, &[b'x'; 256]).await.err(), Some(FsError::NameTooLong));
        assert_eq!(fs.mkdir(&c, ROOT_INO, b"a/b", 0o755).await.err().map(|e| e.errno()), Some(libc::EINVAL));
        let f = fs.lookup(&c, d, b"f").await.unwrap().ino();
        assert_eq!(fs.mkdir(&c, f, b"x", 0o755).await.err(), Some(FsError::NotDir));
        assert_eq!(fs.link(&c, d, ROOT_INO, b"dlink").await.err(), Some(FsError::Perm));
        // rename of a directory into its own subtree
        let sub = fs.mkdir(&c, d, b"sub", 0o755).await.unwrap().ino();
        assert_eq!(
            fs.rename(&c, ROOT_INO, b"d", sub, b"x", RenameMode::Replace).await.err().map(|e| e.errno()),
            Some(libc::EINVAL)
        );
        assert_eq!(fs.lookup(&c, sub, b"..").await.unwrap().ino(), d);
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
    });
}

#[test]
fn rename_replace_noreplace_and_exchange() {
    with_fs(32 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = root();
        let a = fs.mknod(&c, ROOT_INO, b"a", libc::S_IFREG | 0o644, 0).await.unwrap().ino();
        let b = fs.mknod(&c, ROOT_INO, b"b", libc::S_IFREG | 0o644, 0).await.unwrap().ino();
        let d1 = fs.mkdir(&c, ROOT_INO, b"d1", 0o755).await.unwrap().ino();
        let d2 = fs.mkdir(&c, ROOT_INO, b"d2", 0o755).await.unwrap().ino();
        assert_eq!(
            fs.rename(&c, ROOT_INO, b"a", ROOT_INO, b"b", RenameMode::NoReplace).await.err(),
            Some(FsError::Exists)
        );
        fs.rename(&c, ROOT_INO, b"a", ROOT_INO, b"b", RenameMode::Exchange).await.unwrap(); // exchange
        assert_eq!(fs.lookup(&c, ROOT_INO, b"a").await.unwrap().ino(), b);
        assert_eq!(fs.lookup(&c, ROOT_INO, b"b").await.unwrap().ino(), a);
        fs.rename(&c, ROOT_INO, b"a", ROOT_INO, b"b", RenameMode::Replace).await.unwrap(); // replace
        assert_eq!(fs.lookup(&c, ROOT_INO, b"b").await.unwrap().ino(), b);
        assert_eq!(fs.lookup(&c, ROOT_INO, b"a").await.err(), Some(FsError::NotFound));
        assert_eq!(fs.getattr(a).await.unwrap().inode.nlink, 0, "replaced file lost its last link");
        assert_eq!(
            fs.rename(&c, ROOT_INO, b"b", ROOT_INO, b"d1", RenameMode::Replace).await.err(),
            Some(FsError::IsDir)
        );
        assert_eq!(
            fs.rename(&c, ROOT_INO, b"d1", ROOT_INO, b"b", RenameMode::Replace).await.err(),
            Some(FsError::NotDir)
        );
        fs.rename(&c, ROOT_INO, b"d1", d2, b"moved", RenameMode::Replace).await.unwrap();
        assert_eq!(fs.getattr(ROOT_INO).await.unwrap().inode.nlink, 3);
        assert_eq!(fs.getattr(d2).await.unwrap().inode.nlink, 3);
        assert_eq!(fs.lookup(&c, d1, b"..").await.unwrap().ino(), d2);
        // Two lookups named `a` (mknod, then the lookup of "b" after the
        // exchange): the kernel forgets both before it can be freed.
        fs.forget(a, 1).await.unwrap();
        assert!(fs.getattr(a).await.is_ok());
        fs.forget(a, 1).await.unwrap();
        assert_eq!(fs.getattr(a).await.err(), Some(FsError::NotFound));
        fs.unmount().await.unwrap();
        let report = check(&dev).await;
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(report.orphans, 0);
    });
}

#[test]
fn rename_whiteout_leaves_a_whiteout_device_at_the_old_name() {
    with_fs(32 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = root();
        let file = fs.mknod(&c, ROOT_INO, b"file", libc::S_IFREG | 0o644, 0).await.unwrap().ino();
        fs.mknod(&c, ROOT_INO, b"taken", libc::S_IFREG | 0o644, 0).await.unwrap();
        let whiteout = RenameMode::Whiteout { no_replace: false };
        let noreplace = RenameMode::Whiteout { no_replace: true };
        let refused = fs.rename(&c, ROOT_INO, b"file", ROOT_INO, b"taken", noreplace).await;
        assert_eq!(refused.err(), Some(FsError::Exists));
        let refused = RenameMode::from_linux(libc::RENAME_WHITEOUT | libc::RENAME_EXCHANGE);
        assert!(matches!(refused, Err(FsError::Invalid(_))));
        assert_eq!(fs.lookup(&c, ROOT_INO, b"file").await.unwrap().ino(), file, "a refused rename moved");

        let before = fs.statfs().await.unwrap().files_free;
        fs.rename(&c, ROOT_INO, b"file", ROOT_INO, b"moved", whiteout).await.unwrap();
        assert_eq!(fs.lookup(&c, ROOT_INO, b"moved").await.unwrap().ino(), file);
        let wh = fs.lookup(&c, ROOT_INO, b"file").await.unwrap().inode;
        assert_eq!((wh.mode, wh.rdev, wh.nlink), (libc::S_IFCHR, 0, 1), "a whiteout is a 0:0 char device");
        assert_eq!(fs.statfs().await.unwrap().files_free, before - 1);
        // Unlinked and forgotten, the whiteout's inode is freed.
        fs.unlink(&c, ROOT_INO, b"file").await.unwrap();
        fs.forget(wh.ino, 1).await.unwrap();
        assert_eq!(fs.getattr(wh.ino).await.err(), Some(FsError::NotFound));
        assert_eq!(fs.statfs().await.unwrap().files_free, before);
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
    });
}

#[test]
fn a_tmpfile_is_freed_at_release_unless_linked_and_copies_stay_in_the_daemon() {
    with_fs(32 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = root();
        let free = fs.statfs().await.unwrap().files_free;
        let (gone, fh) = fs.tmpfile(&c, ROOT_INO, 0o600, libc::O_RDWR as u32).await.unwrap();
        assert_eq!(gone.inode.nlink, 0);
        fs.data().write(gone.ino(), FileOffset::new(0), b"scratch").await.unwrap();
        fs.release(fh).await.unwrap();
        fs.forget(gone.ino(), 1).await.unwrap();
        assert_eq!(fs.getattr(gone.ino()).await.err(), Some(FsError::NotFound));
        assert_eq!(fs.statfs().await.unwrap().files_free, free);

        let (kept, fh) = fs.tmpfile(&c, ROOT_INO, 0o600, libc::O_RDWR as u32).await.unwrap();
        fs.data().write(kept.ino(), FileOffset::new(0), b"linked later").await.unwrap();
        fs.link(&c, kept.ino(), ROOT_INO, b"named").await.unwrap();
        let (copy, copy_fh) = fs.create(&c, ROOT_INO, b"copy", 0o644, libc::O_RDWR as u32).await.unwrap();
        assert_eq!(
            fs.data()
                .copy_range(kept.ino(), FileOffset::new(7), copy.ino(), FileOffset::new(0), 1 << 40)
                .await
                .unwrap(),
            5
        );
        let same = fs.data().copy_range(kept.ino(), FileOffset::new(0), kept.ino(), FileOffset::new(4), 8).await;
        assert!(matches!(same, Err(FsError::Invalid(_))), "overlapping ranges of one file");
        fs.release(fh).await.unwrap();
        fs.release(copy_fh).await.unwrap();
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
        let fs = mount(&dev).await;
        let named = fs.lookup(&c, ROOT_INO, b"named").await.unwrap();
        assert_eq!(
            (named.inode.nlink, fs.data().read(named.ino(), FileOffset::new(0), 64).await.unwrap()),
            (1, b"linked later".to_vec())
        );
        let copy = fs.lookup(&c, ROOT_INO, b"copy").await.unwrap();
        assert_eq!(fs.data().read(copy.ino(), FileOffset::new(0), 64).await.unwrap(), b"later");
    });
}

/// A new inode's four times, and its directory's change, come from the
/// filesystem's file clock, not the system's: on a manual clock set far
/// from today, every kind of new inode is stamped with the clock's now.
#[test]
fn new_inodes_are_stamped_by_the_file_clock() {
    use keelfs_fs::{FileClock, FsConfig, ManualClock, Timespec};
    let dev = ram_device(32 * MIB);
    busy_reactor().block_on(async move {
        format(&dev).await;
        let start = Timespec { sec: 1_000_000_000, nsec: 7 };
        let clock = ManualClock::new(start);
        let config = FsConfig { file_clock: FileClock::Manual(clock.clone()), ..FsConfig::default() };
        let fs = Fs::mount(common::channel(&dev), config).await.unwrap();
        let c = root();
        let d = fs.mkdir(&c, ROOT_INO, b"d", 0o755).await.unwrap().inode;
        clock.advance(std::time::Duration::from_secs(60));
        let at = clock.now();
        let (f, fh) = fs.create(&c, d.ino, b"f", 0o644, libc::O_RDWR as u32).await.unwrap();
        let n = fs.mknod(&c, d.ino, b"n", libc::S_IFIFO | 0o644, 0).await.unwrap().inode;
        let l = fs.symlink(&c, d.ino, b"l", b"f").await.unwrap().inode;
        let (t, th) = fs.tmpfile(&c, d.ino, 0o600, libc::O_RDWR as u32).await.unwrap();
        assert_eq!((d.atime, d.mtime, d.ctime, d.btime), (start, start, start, start), "mkdir");
        for (what, i) in [("create", &f.inode), ("mknod", &n), ("symlink", &l), ("tmpfile", &t.inode)] {
            assert_eq!((i.atime, i.mtime, i.ctime, i.btime), (at, at, at, at), "{what}");
        }
        let dir = fs.getattr(d.ino).await.unwrap().inode;
        assert_eq!((dir.mtime, dir.ctime), (at, at), "the directory changed when its entries were made");
        fs.release(fh).await.unwrap();
        fs.release(th).await.unwrap();
        fs.unmount().await.unwrap();
    });
}

/// On a file clock the test moves: which reads move atime, and to when.
#[test]
fn reads_move_atime_as_relatime_strictatime_and_noatime_say() {
    use keelfs_fs::{AtimeUpdates, FileClock, FsConfig, ManualClock, Timespec};
    let old = Timespec { sec: 1_000, nsec: 0 };
    let day = std::time::Duration::from_secs(24 * 3600);
    // What each read does to atime: the first (atime older than mtime),
    // a second 25 ms later, a third a day later.
    for (mode, moves) in [
        (AtimeUpdates::Relative, [true, false, true]),
        (AtimeUpdates::Always, [true, true, true]),
        (AtimeUpdates::Never, [false, false, false]),
    ] {
        let dev = ram_device(32 * MIB);
        busy_reactor().block_on(async move {
            format(&dev).await;
            let clock = ManualClock::new(Timespec { sec: 1_700_000_000, nsec: 0 });
            let file_clock = FileClock::Manual(clock.clone());
            let config = FsConfig { atime: mode, file_clock, ..FsConfig::default() };
            let fs = Fs::mount(common::channel(&dev), config).await.unwrap();
            let c = root();
            let (f, fh) = fs.create(&c, ROOT_INO, b"f", 0o644, libc::O_RDWR as u32).await.unwrap();
            let ino = f.ino();
            fs.data().write(ino, FileOffset::new(0), b"data").await.unwrap();
            // Old atime, newer mtime: relatime's case for an update.
            let set = SetAttr { atime: Some(TimeSet::At(old)), ..Default::default() };
            fs.setattr(&c, ino, &set, true).await.unwrap();
            let changed = fs.getattr(ino).await.unwrap().inode;
            let mut atime = old;
            for (read, (advance, moves)) in [std::time::Duration::ZERO, std::time::Duration::from_millis(25), day]
                .into_iter()
                .zip(moves)
                .enumerate()
            {
                clock.advance(advance);
                fs.data().read(ino, FileOffset::new(0), 4).await.unwrap();
                let now = fs.getattr(ino).await.unwrap().inode.atime;
                // Never before the last change: relatime would otherwise
                // update on every read.
                let expected =
                    if moves { clock.now().max(changed.mtime.next()).max(changed.ctime.next()) } else { atime };
                assert_eq!(now, expected, "{mode:?}: read {read}");
                atime = now;
            }
            fs.release(fh).await.unwrap();
            fs.unmount().await.unwrap();
        });
    }
}

#[test]
fn permissions_use_the_callers_credentials() {
    with_fs(32 * MIB, async |fs: Fs, _dev: Arc<dyn BlockDevice>| {
        let c = root();
        let alice = Creds::user(1000, 1000);
        let bob = Creds { groups: vec![1000], ..Creds::user(1001, 1001) };
        let d = fs.mkdir(&c, ROOT_INO, b"home", 0o755).await.unwrap().ino();
        assert_eq!(fs.mkdir(&alice, d, b"x", 0o755).await.err(), Some(FsError::Access));
        fs.setattr(&c, d, &SetAttr { uid: Some(1000), gid: Some(1000), ..Default::default() }, false).await.unwrap();
        let f = fs.mknod(&alice, d, b"f", libc::S_IFREG | 0o640, 0).await.unwrap().inode;
        assert_eq!((f.uid, f.gid), (1000, 1000));
        assert!(fs.open(&bob, f.ino, libc::O_RDONLY as u32).await.is_ok(), "group read");
        assert_eq!(fs.open(&bob, f.ino, libc::O_WRONLY as u32).await.err(), Some(FsError::Access));
        assert_eq!(
            fs.setattr(&bob, f.ino, &SetAttr { mode: Some(0o777), ..Default::default() }, false).await.err(),
            Some(FsError::Perm)
        );
        assert_eq!(
            fs.setattr(&alice, f.ino, &SetAttr { uid: Some(0), ..Default::default() }, false).await.err(),
            Some(FsError::Perm)
        );
        let times = SetAttr { mtime: Some(TimeSet::Now), ..Default::default() };
        assert_eq!(fs.setattr(&bob, f.ino, &times, false).await.err(), Some(FsError::Access));
        // sticky directory: bob may not remove alice's file
        fs.setattr(&c, d, &SetAttr { mode: Some(0o1777), ..Default::default() }, false).await.unwrap();
        assert_eq!(fs.unlink(&bob, d, b"f").await.err(), Some(FsError::Perm));
        fs.unlink(&alice, d, b"f").await.unwrap();
        assert_eq!(fs.access(&bob, d, 2).await, Ok(()));
        assert_eq!(fs.getxattr(&alice, d, b"trusted.x").await.err(), Some(FsError::Perm));
    });
}

#[test]
fn readdir_offsets_stay_valid_while_the_directory_changes() {
    with_fs(32 * MIB, async |fs: Fs, _dev: Arc<dyn BlockDevice>| {
        let c = root();
        for i in 0..100 {
            fs.mknod(&c, ROOT_INO, format!("f{i:03}").as_bytes(), libc::S_IFREG | 0o644, 0).await.unwrap();
        }
        let first = fs.readdir(ROOT_INO, 0, 30).await.unwrap();
        assert_eq!(*first[0].name, *b".");
        assert_eq!(*first[1].name, *b"..");
        let resume = first.last().unwrap().next_offset;
        // Remove some already listed and some not yet listed; add new ones.
        for i in [0, 5, 50, 60] {
            fs.unlink(&c, ROOT_INO, format!("f{i:03}").as_bytes()).await.unwrap();
        }
        fs.mknod(&c, ROOT_INO, b"late", libc::S_IFREG | 0o644, 0).await.unwrap();
        let mut names: Vec<Vec<u8>> = first.iter().map(|e| e.name.to_vec()).collect();
        let mut off = resume;
        loop {
            let batch = fs.readdir(ROOT_INO, off, 17).await.unwrap();
            if batch.is_empty() {
                break;
            }
            off = batch.last().unwrap().next_offset;
            names.extend(batch.into_iter().map(|e| e.name.to_vec()));
        }
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "no entry listed twice");
        for i in 0..100 {
            let n = format!("f{i:03}").into_bytes();
            if ![50, 60].contains(&i) {
                assert!(names.contains(&n), "entry {i} present throughout was listed");
            } else {
                assert!(!names.contains(&n), "entry {i} removed before it was reached is not listed");
            }
        }
        assert!(names.contains(&b"late".to_vec()));
    });
}

#[test]
fn readdir_through_a_handle_ends_while_renames_add_entries() {
    with_fs(32 * MIB, async |fs: Fs, _dev: Arc<dyn BlockDevice>| {
        let c = root();
        let d = fs.mkdir(&c, ROOT_INO, b"d", 0o755).await.unwrap().ino();
        for i in 0..100 {
            fs.mknod(&c, d, format!("f{i}").as_bytes(), libc::S_IFREG | 0o644, 0).await.unwrap();
        }
        let fh = fs.opendir(&c, d).await.unwrap();
        let (mut offset, mut seen, mut renamed) = (0, 0, 0);
        loop {
            let batch = fs.readdir_handle(fh, offset, 10, false).await.unwrap();
            let Some(last) = batch.last() else { break };
            offset = last.next_offset;
            for e in batch.iter().filter(|e| *e.name != *b"." && *e.name != *b"..") {
                seen += 1;
                // Each name read is renamed: a new entry, with a new cookie.
                let new_name = format!("r{renamed}");
                fs.rename(&c, d, &e.name, d, new_name.as_bytes(), RenameMode::Replace).await.unwrap();
                renamed += 1;
            }
            assert!(seen <= 100, "readdir returned renamed entries again");
        }
        assert_eq!(seen, 100, "every entry there at opendir is listed once");
        // A rewind (offset 0) lists the directory as it is now.
        let now: Vec<_> = fs.readdir_handle(fh, 0, 1000, false).await.unwrap();
        assert_eq!(now.len(), 102);
        fs.releasedir(fh).await.unwrap();
    });
}

#[test]
fn file_unlinked_while_open_is_freed_at_last_release() {
    with_fs(32 * MIB, async |fs: Fs, _dev: Arc<dyn BlockDevice>| {
        let c = root();
        let free0 = fs.inspect().free_blocks();
        let (f, fh) = fs.create(&c, ROOT_INO, b"tmp", 0o644, libc::O_RDWR as u32).await.unwrap();
        fs.data().write(f.ino(), FileOffset::new(0), &vec![7u8; 1 << 20]).await.unwrap();
        fs.unlink(&c, ROOT_INO, b"tmp").await.unwrap();
        fs.forget(f.ino(), 1).await.unwrap();
        assert_eq!(
            fs.data().read(f.ino(), FileOffset::new(0), 4).await.unwrap(),
            vec![7u8; 4],
            "still readable while open"
        );
        fs.release(fh).await.unwrap();
        assert_eq!(fs.getattr(f.ino()).await.err(), Some(FsError::NotFound));
        fs.sync().await.unwrap();
        assert_eq!(fs.inspect().free_blocks(), free0, "space came back after the commit");
    });
}

#[test]
fn orphan_left_by_a_crash_is_freed_at_the_next_mount() {
    with_fs(32 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = root();
        let (f, _fh) = fs.create(&c, ROOT_INO, b"tmp", 0o644, libc::O_RDWR as u32).await.unwrap();
        fs.data().write(f.ino(), FileOffset::new(0), &vec![1u8; 65536]).await.unwrap();
        fs.unlink(&c, ROOT_INO, b"tmp").await.unwrap();
        fs.sync().await.unwrap();
        drop(fs); // crash with the file still open
        let report = check(&dev).await;
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(report.orphans, 1);
        let fs = mount(&dev).await;
        assert_eq!(fs.getattr(f.ino()).await.err(), Some(FsError::NotFound));
        fs.unmount().await.unwrap();
        let report = check(&dev).await;
        assert!(report.is_clean() && report.orphans == 0, "{report:?}");
    });
}

#[test]
fn truncate_fallocate_and_seek() {
    with_fs(32 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = root();
        let (f, _) = fs.create(&c, ROOT_INO, b"f", 0o644, libc::O_RDWR as u32).await.unwrap();
        let ino = f.ino();
        fs.data().write(ino, FileOffset::new(0), &vec![0xaa; 20000]).await.unwrap();
        let shrink = SetAttr { size: Some(5000), ..Default::default() };
        fs.setattr(&c, ino, &shrink, true).await.unwrap();
        let grow = SetAttr { size: Some(12000), ..Default::default() };
        fs.setattr(&c, ino, &grow, true).await.unwrap();
        let data = fs.data().read(ino, FileOffset::new(0), 20000).await.unwrap();
        assert_eq!(data.len(), 12000);
        assert!(data[..5000].iter().all(|&b| b == 0xaa));
        assert!(data[5000..].iter().all(|&b| b == 0), "bytes past a truncation read as zeros after growing");

        // fallocate: unwritten space reads as zeros and counts as a hole.
        fs.data()
            .fallocate(ino, FallocateMode::Allocate { keep_size: false }, FileOffset::new(40960), 40960)
            .await
            .unwrap();
        assert_eq!(fs.getattr(ino).await.unwrap().inode.size, 81920);
        assert!(fs.data().read(ino, FileOffset::new(40960), 4096).await.unwrap().iter().all(|&b| b == 0));
        assert_eq!(fs.data().lseek(ino, FileOffset::new(0), SeekTo::Data).await.unwrap(), FileOffset::new(0));
        assert_eq!(
            fs.data().lseek(ino, FileOffset::new(0), SeekTo::Hole).await.unwrap(),
            FileOffset::new(8192),
            "first hole after the data"
        );
        assert_eq!(
            fs.data().lseek(ino, FileOffset::new(40960), SeekTo::Data).await.err(),
            Some(FsError::Nxio),
            "unwritten is not data"
        );
        fs.data().write(ino, FileOffset::new(45056), b"x").await.unwrap();
        assert_eq!(fs.data().lseek(ino, FileOffset::new(40960), SeekTo::Data).await.unwrap(), FileOffset::new(45056));

        // punch a hole through written data
        fs.data().fallocate(ino, FallocateMode::PunchHole, FileOffset::new(1000), 2000).await.unwrap();
        let data = fs.data().read(ino, FileOffset::new(0), 5000).await.unwrap();
        assert!(data[..1000].iter().all(|&b| b == 0xaa) && data[1000..3000].iter().all(|&b| b == 0));
        assert!(data[3000..5000].iter().all(|&b| b == 0xaa));
        assert_eq!(FallocateMode::from_linux(0x02).err().map(|e| e.errno()), Some(libc::EINVAL));
        assert_eq!(FallocateMode::from_linux(0x08).err(), Some(FsError::Unsupported));
        fs.unmount().await.unwrap();
        let report = check(&dev).await;
        assert!(report.is_clean(), "{report:?}");
    });
}

#[test]
fn xattrs_follow_create_and_replace_flags() {
    with_fs(32 * MIB, async |fs: Fs, _dev: Arc<dyn BlockDevice>| {
        let c = root();
        let f = fs.mknod(&c, ROOT_INO, b"f", libc::S_IFREG | 0o644, 0).await.unwrap().ino();
        assert_eq!(
            fs.setxattr(&c, f, b"user.a", b"1", XattrFlags { create_only: false, replace_only: true }).await.err(),
            Some(FsError::NoData)
        );
        fs.setxattr(&c, f, b"user.a", b"1", XattrFlags { create_only: true, replace_only: false }).await.unwrap();
        assert_eq!(
            fs.setxattr(&c, f, b"user.a", b"2", XattrFlags { create_only: true, replace_only: false }).await.err(),
            Some(FsError::Exists)
        );
        fs.setxattr(&c, f, b"user.a", b"2", XattrFlags { create_only: false, replace_only: true }).await.unwrap();
        fs.setxattr(&c, f, b"user.b", b"", XattrFlags::default()).await.unwrap();
        assert_eq!(fs.listxattr(f).await.unwrap(), b"user.a\0user.b\0");
        fs.removexattr(&c, f, b"user.a").await.unwrap();
        assert_eq!(fs.getxattr(&c, f, b"user.a").await.err(), Some(FsError::NoData));
        assert_eq!(
            fs.setxattr(&c, f, b"user.big", &vec![0; 70000], XattrFlags::default()).await.err(),
            Some(FsError::Range)
        );
    });
}

#[test]
fn filling_the_device_gives_enospc_and_deleting_frees_it() {
    with_fs(16 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = root();
        let chunk = vec![0x5a; 256 << 10];
        let mut files = Vec::new();
        let mut hit_enospc = false;
        'fill: for i in 0..200 {
            let (f, fh) = fs.create(&c, ROOT_INO, format!("f{i}").as_bytes(), 0o644, 2).await.unwrap();
            files.push((f.ino(), fh));
            for k in 0..4u64 {
                match fs.data().write(f.ino(), FileOffset::new(k * chunk.len() as u64), &chunk).await {
                    Ok(_) => {}
                    Err(FsError::NoSpace) => {
                        hit_enospc = true;
                        break 'fill;
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
        }
        assert!(hit_enospc);
        fs.sync().await.unwrap();
        let full_free = fs.inspect().free_blocks();
        fs.unmount().await.unwrap();
        let report = check(&dev).await;
        assert!(report.is_clean(), "full filesystem is consistent: {report:?}");
        let fs = mount(&dev).await;
        for (i, _) in files.iter().enumerate() {
            fs.unlink(&c, ROOT_INO, format!("f{i}").as_bytes()).await.unwrap();
        }
        fs.sync().await.unwrap();
        assert!(fs.inspect().free_blocks() > full_free + 3000, "deleting gave space back");
        let (f, _) = fs.create(&c, ROOT_INO, b"again", 0o644, 2).await.unwrap();
        fs.data().write(f.ino(), FileOffset::new(0), &chunk).await.unwrap();
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
    });
}

#[test]
fn mkfs_refuses_an_existing_filesystem_without_force() {
    let mut r = busy_reactor();
    let dev = ram_device(32 * MIB);
    r.block_on(async move {
        format(&dev).await;
        let err = keelfs_fs::mkfs(common::channel(&dev), &Default::default()).await.unwrap_err();
        assert!(err.to_string().contains("--force"), "{err}");
        let report = check(&dev).await;
        assert!(report.is_clean());
    });
}

/// Found by the request fuzzer: a removed directory that a client still
/// holds took new entries, each with a link but no path from the root,
/// which outlived the directory (fsck: "not reachable from the root").
/// Linux refuses them with ENOENT, and so does keelfs now.
#[test]
fn a_removed_directory_takes_no_new_entries() {
    with_fs(32 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = root();
        let d = fs.mkdir(&c, ROOT_INO, b"gone", 0o755).await.unwrap().ino();
        let (f, _) = fs.create(&c, ROOT_INO, b"f", 0o644, libc::O_RDWR as u32).await.unwrap();
        fs.rmdir(&c, ROOT_INO, b"gone").await.unwrap();
        let enoent = Some(libc::ENOENT);
        fn errno<T>(r: Result<T, FsError>) -> Option<i32> {
            r.err().map(|e| e.errno())
        }
        assert_eq!(errno(fs.symlink(&c, d, b"s", b"target").await), enoent);
        assert_eq!(errno(fs.mkdir(&c, d, b"m", 0o755).await), enoent);
        assert_eq!(errno(fs.mknod(&c, d, b"n", libc::S_IFREG | 0o644, 0).await), enoent);
        assert_eq!(errno(fs.create(&c, d, b"c", 0o644, 2).await), enoent);
        assert_eq!(errno(fs.link(&c, f.ino(), d, b"l").await), enoent);
        assert_eq!(errno(fs.rename(&c, ROOT_INO, b"f", d, b"r", RenameMode::Replace).await), enoent);
        fs.forget(d, 1).await.unwrap();
        fs.unmount().await.unwrap();
        let report = check(&dev).await;
        assert!(report.is_clean(), "{report:?}");
    });
}

/// Found by the request fuzzer: a commit that filled half the journal
/// scheduled a background checkpoint, unmount checkpointed first, and the
/// scheduled one then ran after unmount had returned, writing to a device
/// the filesystem no longer owned (an fsck reading it at that moment saw a
/// checkpoint change under its feet). Nothing may touch the device after
/// unmount.
#[test]
fn a_scheduled_checkpoint_never_runs_after_unmount() {
    with_fs(64 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = root();
        let journal_blocks = fs.inspect().superblock().journal_blocks;
        // Commits until the journal is half full: the last one schedules a
        // checkpoint for later.
        let mut i = 0;
        while (fs.inspect().counters().journal_blocks_written) * 2 < journal_blocks {
            fs.mknod(&c, ROOT_INO, format!("n{i}").as_bytes(), libc::S_IFREG | 0o644, 0).await.unwrap();
            fs.sync().await.unwrap();
            i += 1;
            assert!(i < 100_000, "the journal never filled");
        }
        fs.unmount().await.unwrap();
        let after_unmount = fs.inspect().counters().checkpoints;
        let superblock = fs.inspect().superblock();
        // Give anything scheduled every chance to run.
        keelfs_reactor::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(fs.inspect().counters().checkpoints, after_unmount, "a checkpoint ran after unmount");
        assert_eq!(fs.inspect().superblock(), superblock);
        let report = check(&dev).await;
        assert!(report.is_clean(), "{report:?}");
    });
}

/// Mount streams the checkpoint a read at a time, applying records as
/// they are decoded (issue 34). A checkpoint of several reads, with
/// records larger than a block that straddle the reads' ends, and a
/// directory whose entries were removed and renamed (so its cookies have
/// gaps and are out of creation order) loads to the same namespace, the
/// same values and the same readdir offsets.
#[test]
fn a_checkpoint_of_many_reads_loads_whole() {
    with_fs(64 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = root();
        let d = fs.mkdir(&c, ROOT_INO, b"d", 0o755).await.unwrap().ino();
        for i in 0..40u32 {
            let f = fs.mknod(&c, d, format!("big-{i}").as_bytes(), libc::S_IFREG | 0o644, 0).await.unwrap().ino();
            let value: Vec<u8> = (0..60_000u32).map(|k| (k * 7 + i) as u8).collect();
            fs.setxattr(&c, f, b"user.v", &value, XattrFlags::default()).await.unwrap();
        }
        for i in 0..3000u32 {
            let name = format!("file-with-a-name-of-some-length-{i:06}");
            fs.mknod(&c, d, name.as_bytes(), libc::S_IFREG | 0o644, 0).await.unwrap();
        }
        for i in (0..3000u32).step_by(3) {
            let name = format!("file-with-a-name-of-some-length-{i:06}");
            fs.rename(&c, d, name.as_bytes(), d, format!("moved-{i}").as_bytes(), RenameMode::Replace).await.unwrap();
        }
        for i in (1..3000u32).step_by(3) {
            fs.unlink(&c, d, format!("file-with-a-name-of-some-length-{i:06}").as_bytes()).await.unwrap();
        }
        let listing = |fs: Fs| async move {
            let mut all = Vec::new();
            let mut off = 0;
            loop {
                let batch = fs.readdir(d, off, 100).await.unwrap();
                let Some(last) = batch.last() else { break };
                off = last.next_offset;
                all.extend(batch.into_iter().map(|e| (e.name, e.ino, e.next_offset)));
            }
            all
        };
        let before = listing(fs.clone()).await;
        assert_eq!(before.len(), 2 + 40 + 2000);
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());

        let fs = mount(&dev).await;
        assert_eq!(fs.inspect().replayed_at_mount(), 0, "everything came from the checkpoint");
        assert_eq!(listing(fs.clone()).await, before, "names, inodes and offsets are as they were");
        for i in 0..40u32 {
            let f = fs.lookup(&c, d, format!("big-{i}").as_bytes()).await.unwrap().ino();
            let want: Vec<u8> = (0..60_000u32).map(|k| (k * 7 + i) as u8).collect();
            assert!(fs.getxattr(&c, f, b"user.v").await.unwrap() == want, "xattr {i}");
        }
    });
}
