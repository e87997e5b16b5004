//! Space given back and quotas, through a host FUSE mount of a sparse
//! image file: continuous discard punches the freed space out of the
//! image, FITRIM on the mount does it on demand, and a quota answers
//! EDQUOT and is the size statvfs shows.

mod common;

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{fsck, mkfs, Scratch, Served};

const MIB: u64 = 1 << 20;

/// FITRIM, `_IOWR('X', 121, struct fstrim_range)`.
const FITRIM: libc::c_ulong = 0xC018_5879;

/// Serve `image` on a host mount at DIR/mnt with `extra` config lines.
fn serve(dir: &Scratch, image: &Path, extra: &str) -> (Served, PathBuf) {
    let mnt = dir.path("mnt");
    let config = dir.path("keelfsd.toml");
    let text = format!(
        "[[device]]\nname = \"d\"\npath = \"{}\"\n[[export]]\ntag = \"space\"\ndevice = \"d\"\nfuse_mount = \"{}\"\n{extra}",
        image.display(),
        mnt.display()
    );
    std::fs::write(&config, text).unwrap();
    let served = Served::start(&["--config".as_ref(), config.as_os_str()], &[&mnt]);
    (served, mnt)
}

/// fsync the mount's root: the filesystem commits all it holds, frees
/// too (a host FUSE mount's syncfs does not reach the server).
fn commit(mnt: &Path) {
    File::open(mnt).unwrap().sync_all().unwrap();
}

/// Write `bytes` of non-zero data to `path` and make it durable.
fn write_file(path: &Path, bytes: u64) {
    let mut f = File::create(path).unwrap();
    let chunk = vec![0x6b; MIB as usize];
    for _ in 0..bytes / MIB {
        f.write_all(&chunk).unwrap();
    }
    f.sync_all().unwrap();
}

/// Poll (committing, since the kernel's FORGET of an unlinked inode may come
/// after a sync) until the image has shrunk by `by` bytes from `from`.
fn wait_for_shrink(image: &Path, mnt: &Path, from: u64, by: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        commit(mnt);
        let now = keelfs_base::testing::allocated_bytes(image);
        if from.saturating_sub(now) >= by {
            return now;
        }
        assert!(Instant::now() < deadline, "the image stayed at {now} bytes (from {from})");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn statvfs(path: &Path) -> libc::statvfs {
    // SAFETY: statvfs is plain old data, valid when zeroed.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path and a valid out-pointer.
    assert_eq!(unsafe { libc::statvfs(path.as_ptr(), &mut st) }, 0);
    st
}

#[test]
fn continuous_discard_punches_deleted_files_out_of_the_image() {
    let dir = Scratch::new("discard-on");
    let image = dir.path("k.img");
    mkfs(&image, "256M");
    let (served, mnt) = serve(&dir, &image, "discard = true\n");
    let file = mnt.join("big");
    write_file(&file, 64 * MIB);
    commit(&mnt);
    let full = keelfs_base::testing::allocated_bytes(&image);
    assert!(full >= 64 * MIB, "64 MiB written, the image holds {full} bytes");
    std::fs::remove_file(&file).unwrap();
    let started = Instant::now();
    let after = wait_for_shrink(&image, &mnt, full, 48 * MIB);
    eprintln!(
        "discard: image {} -> {} MiB in {:.2} s after rm",
        full / MIB,
        after / MIB,
        started.elapsed().as_secs_f64()
    );
    assert!(served.stop().success());
    assert_eq!(fsck(&image).0, 0);
}

#[test]
fn fitrim_on_the_mount_trims_with_continuous_discard_off() {
    let dir = Scratch::new("fitrim");
    let image = dir.path("k.img");
    mkfs(&image, "256M");
    let (served, mnt) = serve(&dir, &image, "");
    let file = mnt.join("big");
    write_file(&file, 64 * MIB);
    let used_free = statvfs(&mnt).f_bfree;
    std::fs::remove_file(&file).unwrap();
    // The frees commit once the kernel has forgotten the inode; discard is
    // off, so the image keeps its blocks until the fstrim.
    let deadline = Instant::now() + Duration::from_secs(20);
    while statvfs(&mnt).f_bfree < used_free + 60 * MIB / 4096 {
        assert!(Instant::now() < deadline, "the deleted file's blocks were never freed");
        commit(&mnt);
        std::thread::sleep(Duration::from_millis(100));
    }
    let full = keelfs_base::testing::allocated_bytes(&image);
    assert!(full >= 64 * MIB, "the image holds {full} bytes");
    let root = File::open(&mnt).unwrap();
    let mut range = [0u64, u64::MAX, 0]; // start, len, minlen
                                         // SAFETY: FITRIM reads and writes the 24-byte range we pass.
    let rc = unsafe { libc::ioctl(root.as_raw_fd(), FITRIM, range.as_mut_ptr()) };
    assert_eq!(rc, 0, "FITRIM: {}", std::io::Error::last_os_error());
    assert!(range[1] >= 64 * MIB, "trimmed {} bytes", range[1]);
    let after = keelfs_base::testing::allocated_bytes(&image);
    assert!(full - after >= 48 * MIB, "the image went from {full} to {after} bytes");
    eprintln!("fitrim: {} MiB trimmed, image {} -> {} MiB", range[1] / MIB, full / MIB, after / MIB);
    drop(root);
    assert!(served.stop().success());
    assert_eq!(fsck(&image).0, 0);
}

#[test]
fn a_quota_answers_edquot_and_is_the_size_statvfs_shows() {
    let dir = Scratch::new("quota");
    let image = dir.path("k.img");
    mkfs(&image, "256M");
    let (served, mnt) = serve(&dir, &image, "quota_bytes = \"16M\"\nquota_inodes = 100\n");
    let st = statvfs(&mnt);
    let size = st.f_blocks * st.f_frsize;
    assert_eq!(size, 16 * MIB, "df shows the quota as the size");
    assert_eq!(st.f_files, 100);
    // O_DIRECT, so the error comes from the write itself and not from a
    // later writeback.
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(mnt.join("big"))
        .unwrap();
    let layout = std::alloc::Layout::from_size_align(MIB as usize, 4096).unwrap();
    // SAFETY: a non-zero layout; freed below with the same layout.
    let buf = unsafe { std::alloc::alloc_zeroed(layout) };
    // SAFETY: buf holds MIB initialised bytes until freed.
    let chunk = unsafe { std::slice::from_raw_parts(buf, MIB as usize) };
    let mut written = 0;
    let err = loop {
        match f.write_all(chunk) {
            Ok(()) => written += MIB,
            Err(e) => break e,
        }
        assert!(written <= 32 * MIB, "32 MiB went into a 16 MiB quota");
    };
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(buf, layout) };
    assert_eq!(err.raw_os_error(), Some(libc::EDQUOT), "{err}");
    assert!((12 * MIB..=16 * MIB).contains(&written), "{written} bytes fit");
    drop(f);
    // Deleting makes room again.
    std::fs::remove_file(mnt.join("big")).unwrap();
    write_file(&mnt.join("again"), 8 * MIB);
    assert!(served.stop().success());
    assert_eq!(fsck(&image).0, 0);
}
