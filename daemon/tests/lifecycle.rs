//! keelfsd as an operator runs it: config files, clean shutdown and
//! restart, kill -9 under load, several exports from one daemon, and the
//! stats RPC.

mod common;

use std::ffi::OsStr;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{fsck, is_mounted, keelfsd, mkfs, require_fuse_transport, Scratch, Served};

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

#[test]
fn a_bad_config_is_one_line_naming_file_line_and_column() {
    let dir = Scratch::new("badconfig");
    let config = dir.path("bad.toml");
    std::fs::write(&config, "[daemon]\nreactors = 0\n").unwrap();
    let out = keelfsd().arg("serve").arg("--config").arg(&config).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "a config error is a usage error");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim(), format!("keelfsd: {}:2:12: reactors must be at least 1", config.display()));

    std::fs::write(&config, "[[export]]\ntag = \"a\"\ndevice = \"missing\"\nsocket = \"/tmp/x.sock\"\n").unwrap();
    let out = keelfsd().arg("serve").arg("--config").arg(&config).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad.toml:3:10: no [[device]] is named \"missing\""));
}

#[test]
fn sigterm_leaves_a_clean_filesystem_that_a_restart_serves() {
    let dir = Scratch::new("restart");
    let (image, mnt) = (dir.path("fs.img"), dir.path("mnt"));
    mkfs(&image, "256M");
    let args = [os("--device"), image.as_os_str(), os("--fuse-mount"), mnt.as_os_str()];
    let served = Served::start(&args, &[&mnt]);
    std::fs::create_dir(mnt.join("d")).unwrap();
    for i in 0..20 {
        std::fs::write(mnt.join("d").join(format!("f{i}")), format!("file {i}").repeat(100)).unwrap();
    }
    let status = served.stop();
    assert!(status.success(), "exit after SIGTERM: {status}");
    assert!(!is_mounted(&mnt));
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "{report}");

    let served = Served::start(&args, &[&mnt]);
    for i in 0..20 {
        assert_eq!(
            std::fs::read_to_string(mnt.join("d").join(format!("f{i}"))).unwrap(),
            format!("file {i}").repeat(100)
        );
    }
    assert!(served.stop().success());
}

/// A file's name and the bytes fsync made durable.
type SyncedFile = (String, Vec<u8>);

#[test]
fn kill_9_under_a_write_load_loses_no_fsynced_file_on_dev_fuse() {
    kill_9_under_a_write_load("dev");
}

#[test]
fn kill_9_under_a_write_load_loses_no_fsynced_file_over_io_uring() {
    kill_9_under_a_write_load("uring");
}

fn kill_9_under_a_write_load(transport: &str) {
    require_fuse_transport(transport);
    let dir = Scratch::new(&format!("kill9-{transport}"));
    let (image, mnt) = (dir.path("fs.img"), dir.path("mnt"));
    mkfs(&image, "256M");
    let args =
        [os("--fuse-transport"), os(transport), os("--device"), image.as_os_str(), os("--fuse-mount"), mnt.as_os_str()];
    let mut served = Served::start(&args, &[&mnt]);

    let synced: Arc<Mutex<Vec<SyncedFile>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..2)
        .map(|w| {
            let (mnt, synced, stop) = (mnt.clone(), synced.clone(), stop.clone());
            std::thread::spawn(move || {
                for i in 0.. {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let name = format!("w{w}-{i}");
                    let data: Vec<u8> = (0..(4096 + i * 977 % 20_000)).map(|b| (b * 31 + i + w) as u8).collect();
                    let Ok(mut f) = std::fs::File::create(mnt.join(&name)) else { break };
                    if f.write_all(&data).is_err() || f.sync_all().is_err() {
                        break; // the daemon is gone
                    }
                    // Unsynced churn too, which may or may not survive.
                    let _ = std::fs::write(mnt.join(format!("scratch{w}")), &data[..100]);
                    synced.lock().unwrap().push((name, data));
                }
            })
        })
        .collect();
    // Writers stop at their first error: a deadline, not a hang.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while synced.lock().unwrap().len() < 40 {
        assert!(std::time::Instant::now() < deadline, "40 fsynced files took more than 120 s");
        assert!(!writers.iter().all(|w| w.is_finished()), "the writers stopped early (an I/O error)");
        std::thread::sleep(Duration::from_millis(20));
    }
    served.signal(libc::SIGKILL);
    let _ = served.child.wait();
    stop.store(true, Ordering::Release);
    let _ = std::process::Command::new("umount").arg("-l").arg(&mnt).status();
    for w in writers {
        let _ = w.join();
    }
    drop(served);
    let synced = synced.lock().unwrap().clone();
    assert!(synced.len() >= 40);

    // fsck replays the journal in memory and must find nothing wrong.
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "after kill -9: {report}");
    let served = Served::start(&args, &[&mnt]);
    for (name, data) in &synced {
        let got = std::fs::read(mnt.join(name)).unwrap_or_else(|e| panic!("fsynced {name} lost: {e}"));
        assert!(got == *data, "fsynced {name} differs");
    }
    assert!(served.stop().success());
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "after the restart: {report}");
}

#[test]
fn two_exports_from_one_daemon_stay_apart_and_report_stats() {
    let dir = Scratch::new("exports");
    let (a, b) = (dir.path("a.img"), dir.path("b.img"));
    mkfs(&a, "256M");
    mkfs(&b, "256M");
    let (ma, mb, rpc) = (dir.path("ma"), dir.path("mb"), dir.path("rpc.sock"));
    let config = dir.path("keelfsd.toml");
    std::fs::write(
        &config,
        format!(
            "[daemon]\nreactors = 2\nrpc_socket = \"{}\"\n\
             [[device]]\nname = \"a\"\npath = \"{}\"\n[[device]]\nname = \"b\"\npath = \"{}\"\n\
             [[export]]\ntag = \"alpha\"\ndevice = \"a\"\nfuse_mount = \"{}\"\n\
             [[export]]\ntag = \"beta\"\ndevice = \"b\"\nfuse_mount = \"{}\"\ncache = \"none\"\n",
            rpc.display(),
            a.display(),
            b.display(),
            ma.display(),
            mb.display()
        ),
    )
    .unwrap();
    let served = Served::start(&[os("--config"), config.as_os_str()], &[&ma, &mb]);
    std::fs::write(ma.join("only-in-alpha"), b"alpha").unwrap();
    std::fs::write(mb.join("only-in-beta"), b"beta").unwrap();
    assert!(!mb.join("only-in-alpha").exists() && !ma.join("only-in-beta").exists());
    assert_eq!(std::fs::read(mb.join("only-in-beta")).unwrap(), b"beta");

    let out = keelfsd().arg("stats").arg("--rpc").arg(&rpc).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let reactors = stats["reactors"].as_array().unwrap();
    assert_eq!(reactors.len(), 2);
    assert!(reactors.iter().all(|r| r["answered"] == true && r["busy_share"].as_f64().is_some()));
    let exports = stats["exports"].as_array().unwrap();
    let by_tag = |t: &str| exports.iter().find(|e| e["tag"] == t).unwrap_or_else(|| panic!("no {t} in {stats}"));
    let (alpha, beta) = (by_tag("alpha"), by_tag("beta"));
    assert_ne!(alpha["reactor"], beta["reactor"], "exports are spread over the reactors");
    for e in [alpha, beta] {
        let creates = &e["fuse_mount_ops"]["create"];
        assert_eq!(creates["requests"], 1, "{e}");
        assert!(creates["p99_us"].as_f64().unwrap() > 0.0);
        assert!(e["fs"]["journal_commits"].as_u64().is_some());
        assert!(e["cache"]["hits"].as_u64().is_some());
    }

    assert!(served.stop().success());
    for image in [&a, &b] {
        let (code, report) = fsck(image);
        assert_eq!(code, 0, "{report}");
    }
    assert!(!Path::new(&rpc).exists(), "the RPC socket goes away at shutdown");
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

#[test]
fn an_idle_adaptive_daemon_uses_almost_no_cpu() {
    let dir = Scratch::new("idle");
    let (image, mnt, socket) = (dir.path("fs.img"), dir.path("mnt"), dir.path("fs.sock"));
    mkfs(&image, "256M");
    let args = [
        os("--device"),
        image.as_os_str(),
        os("--fuse-mount"),
        mnt.as_os_str(),
        os("--socket"),
        socket.as_os_str(),
        os("--reactors"),
        os("2"),
    ];
    let served = Served::start(&args, &[&mnt]);
    std::fs::write(mnt.join("f"), b"some work first").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let before = cpu_ticks(served.child.id());
    std::thread::sleep(Duration::from_secs(2));
    let used = cpu_ticks(served.child.id()) - before;
    // Ticks are 10 ms: two busy-polling reactors would show ~400.
    assert!(used <= 4, "idle daemon used {used} ticks of CPU in 2 s");
    assert!(served.stop().success());
}

#[test]
fn spread_queues_serve_cached_reads_on_the_other_reactor() {
    use keelfs_vhost::abi::{init_flags, Opcode, Reply, ENTRY_OUT_BYTES};
    use keelfs_vhost::frontend::{io_in, FrontendConfig, FsFrontend};

    let dir = Scratch::new("spread");
    let image = dir.path("k.img");
    mkfs(&image, "256M");
    let (socket, rpc) = (dir.path("k.sock"), dir.path("rpc.sock"));
    let served = Served::start(
        &[
            os("--device"),
            image.as_os_str(),
            os("--socket"),
            socket.as_os_str(),
            os("--queues"),
            os("2"),
            os("--reactors"),
            os("2"),
            os("--spread-queues"),
            os("--rpc"),
            rpc.as_os_str(),
        ],
        &[],
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        assert!(std::time::Instant::now() < deadline, "keelfsd did not create its socket");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut fe =
        FsFrontend::connect(&socket, FrontendConfig { request_queues: 2, ..FrontendConfig::default() }).unwrap();
    fe.init(init_flags::INIT_EXT).unwrap();
    // Queue 2 is the helper reactor's: the CREATE and WRITE go to the
    // export's reactor, the READs of cached pages do not.
    let mut create = Reply::default();
    create.u32(libc::O_RDWR as u32).u32(0o100644).u32(0).u32(0).raw(b"spread\0");
    let (err, reply) = fe.fuse(2, Opcode::Create, 1, &create.bytes).unwrap();
    assert_eq!(err, 0);
    let nodeid = u64::from_le_bytes(reply[..8].try_into().unwrap());
    let fh = u64::from_le_bytes(reply[ENTRY_OUT_BYTES..ENTRY_OUT_BYTES + 8].try_into().unwrap());
    let data: Vec<u8> = (0..65_536u32).map(|i| (i % 251) as u8).collect();
    let mut write = Reply::default();
    write.raw(&io_in(fh, 0, data.len() as u32)).raw(&data);
    assert_eq!(fe.fuse(2, Opcode::Write, nodeid, &write.bytes).unwrap().0, 0);
    for (offset, len) in [(0u64, 65_536u32), (4000, 200), (60_000, 10_000)] {
        let mut read = Reply::default();
        read.raw(&io_in(fh, offset, len));
        let (err, got) = fe.fuse(2, Opcode::Read, nodeid, &read.bytes).unwrap();
        assert_eq!(err, 0);
        let end = (offset as usize + len as usize).min(data.len());
        assert_eq!(got, &data[offset as usize..end], "read at {offset}");
    }
    let out = keelfsd().arg("stats").arg("--rpc").arg(&rpc).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let helpers = &stats["exports"][0]["virtio_fs"]["helpers"];
    assert_eq!(helpers["reactors"], 1, "{stats}");
    assert!(helpers["from_cache"].as_u64().unwrap() >= 3, "{helpers}");
    assert!(helpers["forwarded"].as_u64().unwrap() >= 2, "{helpers}");
    drop(fe);
    assert!(served.stop().success());
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "{report}");
}

/// Events carry where they happened: the reactor, the export, and for a
/// request its opcode, inode and errno. RUST_LOG picks the levels (a
/// failed request is a trace event, the mount and the session info).
#[test]
fn log_lines_name_the_reactor_the_export_and_the_request() {
    let dir = Scratch::new("tracing");
    let (image, mnt, log) = (dir.path("fs.img"), dir.path("mnt"), dir.path("stderr.log"));
    mkfs(&image, "64M");
    std::fs::create_dir_all(&mnt).unwrap();
    let child = keelfsd()
        .args([os("serve"), os("--device"), image.as_os_str(), os("--fuse-mount"), mnt.as_os_str()])
        .args([os("--tag"), os("traced")])
        .env("RUST_LOG", "info,keelfs_vhost=trace")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let served = Served { child, mounts: vec![mnt.clone()] };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !is_mounted(&mnt) {
        assert!(std::time::Instant::now() < deadline, "keelfsd did not mount");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // A request that fails: GETXATTR of an attribute the root lacks (a
    // missing name is no failure: it is a negative entry).
    let root = std::ffi::CString::new(mnt.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: two valid C strings, and no buffer (size 0).
    let got = unsafe { libc::getxattr(root.as_ptr(), c"user.missing".as_ptr(), std::ptr::null_mut(), 0) };
    assert_eq!((got, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::ENODATA)));
    assert!(served.stop().success());
    let text = std::fs::read_to_string(&log).unwrap();
    let line =
        |what: &str| text.lines().find(|l| l.contains(what)).unwrap_or_else(|| panic!("no {what:?} in:\n{text}"));
    for what in ["mounted", "session started", "request failed"] {
        assert!(line(what).contains("reactor{id=0}:export{tag=traced}"), "{what}: {}", line(what));
    }
    let failed = line("request failed");
    assert!(
        failed.contains("opcode=Some(Getxattr)") && failed.contains("ino=1") && failed.contains("errno=61"),
        "{failed}"
    );
}
