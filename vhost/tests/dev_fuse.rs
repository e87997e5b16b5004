//! keelfs mounted on the host through /dev/fuse: ordinary file calls from
//! this thread, served by a reactor thread, leave a clean filesystem. Each
//! test runs on both transports: /dev/fuse read/write, and FUSE over
//! io_uring (which needs `enable_uring`, as scripts/setup.sh sets it; the
//! io_uring test fails without it rather than skip).

use std::cell::RefCell;
use std::io::{Read, Write};
use std::rc::Rc;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use keelfs_bdev::{BlockDevice, MappedDevice, QueueConfig};
use keelfs_fs::fsck;
use keelfs_fs::{mkfs, MkfsOptions};
use keelfs_fs::{Fs, FsConfig};
use keelfs_reactor::DeviceChannel;
use keelfs_reactor::{self as reactor, PollMode, Reactor, ReactorConfig};
use keelfs_vhost::{probe_fuse_uring, serve_dev_fuse_over, FuseMount, FuseUringPlan, FUSE_URING_PARAMETER};
use keelfs_vhost::{Session, SessionConfig};

/// What the reactor serves: the filesystem, the mount and its session.
type Served = (Fs, Rc<FuseMount>, Rc<Session>);

thread_local! {
    static SERVED: RefCell<Option<Served>> = const { RefCell::new(None) };
}

fn channel(dev: &Arc<dyn BlockDevice>) -> DeviceChannel {
    DeviceChannel::attach(dev.open_queue(QueueConfig::default()).unwrap())
}

/// The plan for FUSE over io_uring, or a failure that says how to get it.
fn uring_plan() -> FuseUringPlan {
    probe_fuse_uring(std::path::Path::new(FUSE_URING_PARAMETER), true)
        .unwrap_or_else(|e| panic!("this test needs FUSE over io_uring (scripts/setup.sh turns it on): {e}"))
}

#[test]
fn host_mount_serves_ordinary_file_calls_and_unmounts_clean_on_dev_fuse() {
    serves_ordinary_file_calls(None);
}

#[test]
fn host_mount_serves_ordinary_file_calls_and_unmounts_clean_over_io_uring() {
    serves_ordinary_file_calls(Some(uring_plan()));
}

/// The served session's transport and the requests that came through
/// ring entries, asked on its reactor.
fn served_transport(handle: &keelfs_reactor::ReactorHandle) -> (Option<&'static str>, u64) {
    let (stats_tx, stats_rx) = mpsc::channel();
    handle
        .send(move || {
            let stats = SERVED.with(|s| s.borrow().as_ref().map(|(_, _, session)| Rc::clone(session.stats()))).unwrap();
            stats_tx.send((stats.transport(), stats.ring_requests())).unwrap();
        })
        .unwrap();
    stats_rx.recv_timeout(Duration::from_secs(30)).expect("stats")
}

fn serves_ordinary_file_calls(uring: Option<FuseUringPlan>) {
    assert!(std::path::Path::new("/dev/fuse").exists(), "/dev/fuse is required (CI runs as root with it)");
    let want = if uring.is_some() { "uring" } else { "dev" };
    let dev: Arc<dyn BlockDevice> = Arc::new(MappedDevice::ram(64 << 20, 4096).unwrap());
    let dir = std::env::temp_dir().join(format!("keelfs-fuse-test-{want}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ready_tx, ready_rx) = mpsc::channel();
    let (dev2, dir2) = (dev.clone(), dir.clone());
    let config = ReactorConfig { mode: PollMode::ADAPTIVE_DEFAULT, ..ReactorConfig::default() };
    let (handle, join) = Reactor::spawn(config, move || {
        reactor::spawn_local(async move {
            mkfs(channel(&dev2), &MkfsOptions { force: true, ..MkfsOptions::default() }).await.unwrap();
            let fs = Fs::mount(channel(&dev2), FsConfig::default()).await.unwrap();
            let session = Rc::new(Session::new(fs.clone(), SessionConfig::default()));
            let mount = Rc::new(FuseMount::mount(&dir2, "keelfs").expect("mount through /dev/fuse"));
            serve_dev_fuse_over(session.clone(), mount.clone(), None, uring, Box::new(|| {})).expect("the ring set up");
            SERVED.with(|s| *s.borrow_mut() = Some((fs, mount, session)));
            ready_tx.send(()).unwrap();
        });
    })
    .unwrap();
    ready_rx.recv_timeout(Duration::from_secs(30)).expect("served");

    // Ordinary calls through the kernel.
    let sub = dir.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let payload: Vec<u8> = (0..3_000_000u32).map(|i| (i % 253) as u8).collect();
    {
        let mut f = std::fs::File::create(sub.join("data")).unwrap();
        f.write_all(&payload).unwrap();
        f.sync_all().unwrap();
    }
    let mut back = Vec::new();
    std::fs::File::open(sub.join("data")).unwrap().read_to_end(&mut back).unwrap();
    assert!(back == payload, "data read back through the mount");
    std::fs::rename(sub.join("data"), dir.join("moved")).unwrap();
    std::os::unix::fs::symlink("moved", dir.join("link")).unwrap();
    assert_eq!(std::fs::read_link(dir.join("link")).unwrap().to_str(), Some("moved"));
    std::fs::write(dir.join("small"), b"hello").unwrap();
    assert_eq!(std::fs::read(dir.join("small")).unwrap(), b"hello");
    let mut names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, vec!["link", "moved", "small", "sub"]);
    assert_eq!(std::fs::metadata(dir.join("moved")).unwrap().len(), payload.len() as u64);
    std::fs::remove_file(dir.join("small")).unwrap();
    assert!(std::fs::metadata(dir.join("small")).is_err());
    std::fs::remove_dir(&sub).unwrap();

    // The transport asked for is the one that served, not a fallback.
    let (transport, ring_requests) = served_transport(&handle);
    assert_eq!((transport, ring_requests > 0), (Some(want), uring.is_some()), "{ring_requests} through the ring");

    // Unmount, then check the device offline.
    let (done_tx, done_rx) = mpsc::channel();
    handle
        .send(move || {
            reactor::spawn_local(async move {
                let (fs, mount, _) = SERVED.with(|s| s.borrow_mut().take()).unwrap();
                mount.unmount().unwrap();
                fs.unmount().await.unwrap();
                done_tx.send(()).unwrap();
            })
        })
        .unwrap();
    done_rx.recv_timeout(Duration::from_secs(30)).expect("unmounted");
    handle.stop();
    join.join().unwrap();
    let _ = std::fs::remove_dir(&dir);

    let mut r = Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() }).unwrap();
    r.block_on(async move {
        let report = fsck(channel(&dev), |_| {}).await.unwrap();
        assert!(report.is_clean(), "{report:?}");
        let fs = Fs::mount(channel(&dev), FsConfig::default()).await.unwrap();
        let moved = fs.lookup(&keelfs_fs::Creds::root(), keelfs_fs::ROOT_INO, b"moved").await.unwrap();
        assert_eq!(moved.inode.size, 3_000_000);
    });
}
