//! Scrub through keelfsd's RPCs (issue 38): a scrub of an image with data
//! checksums finds a block damaged on the host side, which a read through
//! the host mount then fails with EIO; a scrub stopped by a restart
//! resumes where the image says it stood.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{keelfsd, Scratch, Served};
use serde_json::{json, Value};

const FILE_BYTES: usize = 16 << 20;

fn rpc(socket: &Path, method: &str, params: Value) -> Result<Value, String> {
    let out = keelfsd().args(["rpc", method, &params.to_string(), "--rpc"]).arg(socket).output().unwrap();
    match out.status.success() {
        true => Ok(serde_json::from_slice(&out.stdout).expect("keelfsd rpc prints JSON")),
        false => Err(String::from_utf8_lossy(&out.stderr).to_string()),
    }
}

/// Block `b` of the test file: its number, then bytes that depend on it.
fn block(b: usize) -> Vec<u8> {
    let mut out = vec![0u8; 4096];
    out[..8].copy_from_slice(&(b as u64).to_le_bytes());
    let mut s = b as u64 ^ 0x5eed;
    for x in &mut out[8..] {
        *x = keelfs_base::testing::splitmix64(&mut s) as u8;
    }
    out
}

struct Setup {
    scratch: Scratch,
}

impl Setup {
    fn new(name: &str) -> Self {
        let scratch = Scratch::new(name);
        let out = keelfsd().arg("mkfs").arg(scratch.path("img")).args(["--size", "96M", "--data-checksums"]).output();
        let out = out.unwrap();
        assert!(out.status.success(), "mkfs: {}", String::from_utf8_lossy(&out.stderr));
        Setup { scratch }
    }

    fn serve(&self) -> Served {
        let (image, mnt, rpc) = (self.scratch.path("img"), self.scratch.path("mnt"), self.scratch.path("rpc.sock"));
        let args = ["--device".as_ref(), image.as_os_str(), "--fuse-mount".as_ref(), mnt.as_os_str()];
        let served = Served::start(&[&args[..], &["--rpc".as_ref(), rpc.as_os_str()]].concat(), &[&mnt]);
        let deadline = Instant::now() + Duration::from_secs(30);
        while rpc_ok(&rpc, "scrub_status").is_none() {
            assert!(Instant::now() < deadline, "keelfsd's RPC socket never answered");
            std::thread::sleep(Duration::from_millis(50));
        }
        served
    }

    fn rpc(&self) -> std::path::PathBuf {
        self.scratch.path("rpc.sock")
    }

    fn file(&self) -> std::path::PathBuf {
        self.scratch.path("mnt").join("f")
    }
}

fn rpc_ok(socket: &Path, method: &str) -> Option<Value> {
    rpc(socket, method, json!({"export": "keelfs"})).ok()
}

/// Poll scrub_status until `done` holds of it.
fn status_until(socket: &Path, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let status = rpc(socket, "scrub_status", json!({"export": "keelfs"})).unwrap();
        if done(&status) {
            return status;
        }
        assert!(Instant::now() < deadline, "{what}: the scrub never got there: {status}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn write_file(path: &Path) {
    let data: Vec<u8> = (0..FILE_BYTES / 4096).flat_map(block).collect();
    std::fs::write(path, &data).unwrap();
    std::fs::File::open(path).unwrap().sync_all().unwrap();
}

#[test]
fn a_scrub_finds_a_block_damaged_on_the_host_and_the_read_fails() {
    let setup = Setup::new("scrub-damage");
    let served = setup.serve();
    write_file(&setup.file());
    let ino = std::fs::metadata(setup.file()).unwrap().ino();
    assert!(served.stop().success());

    // Damage the file's block 777 in the image, as a device would.
    let image = setup.scratch.path("img");
    let mut bytes = std::fs::read(&image).unwrap();
    let want = block(777);
    let at = (0..bytes.len() / 4096).find(|&d| bytes[d * 4096..(d + 1) * 4096] == want[..]).expect("block 777") * 4096;
    bytes[at + 100] ^= 0x10;
    std::fs::write(&image, &bytes).unwrap();

    let served = setup.serve();
    let started = rpc(&setup.rpc(), "scrub_start", json!({"export": "keelfs", "mib_per_sec": 1000})).unwrap();
    assert_eq!(started["state"], "running", "{started}");
    let again = rpc(&setup.rpc(), "scrub_start", json!({"export": "keelfs", "mib_per_sec": 1000}));
    let status = status_until(&setup.rpc(), "damage", |s| s["state"] == "done");
    if let Err(e) = again {
        assert!(e.contains("running"), "a second start while one runs is refused: {e}");
    }
    assert_eq!(status["errors"], 1, "{status}");
    let bad = &status["bad_blocks"][0];
    assert_eq!(bad["ino"], ino, "{status}");
    assert_eq!(bad["offset"], 777 * 4096, "{status}");
    assert!(status["blocks_checked"].as_u64().unwrap() >= (FILE_BYTES / 4096) as u64, "{status}");

    // A read of the damaged block fails with EIO; the others read.
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(setup.file()).unwrap();
    let mut buf = vec![0u8; 4096];
    f.seek(SeekFrom::Start(776 * 4096)).unwrap();
    f.read_exact(&mut buf).unwrap();
    assert_eq!(buf, block(776));
    f.seek(SeekFrom::Start(777 * 4096)).unwrap();
    let err = f.read_exact(&mut buf).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    let stats = common::stats(&setup.rpc());
    let errors = stats["exports"][0]["fs"]["data_checksum_errors"].as_u64();
    assert!(errors.is_some_and(|e| e >= 2), "scrub's and the read's mismatches counted: {stats}");
    let cancelled = rpc(&setup.rpc(), "scrub_cancel", json!({"export": "keelfs"})).unwrap();
    assert_eq!(cancelled["cancelled"], false, "nothing runs after done");
    assert!(served.stop().success());
    let out = keelfsd().arg("fsck").arg(&image).args(["--data", "--json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stdout).contains("data-checksum"));
}

#[test]
fn a_scrub_resumes_after_a_restart_where_the_image_says() {
    let setup = Setup::new("scrub-resume");
    let served = setup.serve();
    write_file(&setup.file());
    rpc(&setup.rpc(), "scrub_start", json!({"export": "keelfs", "mib_per_sec": 2})).unwrap();
    let before = status_until(&setup.rpc(), "first part", |s| s["bytes_checked"].as_u64().unwrap() >= 5 << 20);
    std::thread::sleep(Duration::from_millis(1500)); // a save after it, by the reactor's clock
    assert!(served.stop().success());
    assert_eq!(before["state"], "running");

    let served = setup.serve();
    let resumed = rpc(&setup.rpc(), "scrub_status", json!({"export": "keelfs"})).unwrap();
    assert_eq!(resumed["state"], "running", "the scrub resumed at mount: {resumed}");
    assert!(resumed["cursor"]["offset"].as_u64().unwrap() >= 3 << 20, "it resumed past its start: {resumed}");
    let done = status_until(&setup.rpc(), "the rest", |s| s["state"] == "done");
    let after = done["bytes_checked"].as_u64().unwrap();
    assert!(after > 0 && after < FILE_BYTES as u64 - (3 << 20), "it did not start over: {done}");
    assert_eq!(done["errors"], 0, "{done}");
    // Done is forgotten: the next mount resumes nothing.
    assert!(served.stop().success());
    let served = setup.serve();
    assert_eq!(rpc(&setup.rpc(), "scrub_status", json!({"export": "keelfs"})).unwrap()["state"], "none");
    assert!(served.stop().success());
}

#[test]
fn scrub_is_refused_on_an_image_without_checksums_and_for_bad_rates() {
    let scratch = Scratch::new("scrub-plain");
    common::mkfs(&scratch.path("img"), "64M");
    let (image, mnt, rpc_path) = (scratch.path("img"), scratch.path("mnt"), scratch.path("rpc.sock"));
    let args = [
        "--device".as_ref(),
        image.as_os_str(),
        "--fuse-mount".as_ref(),
        mnt.as_os_str(),
        "--rpc".as_ref(),
        rpc_path.as_os_str(),
    ];
    let served = Served::start(&args, &[&mnt]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while rpc_ok(&rpc_path, "scrub_status").is_none() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(50));
    }
    let e = rpc(&rpc_path, "scrub_start", json!({"export": "keelfs", "mib_per_sec": 10})).unwrap_err();
    assert!(e.contains("not supported"), "{e}");
    let e = rpc(&rpc_path, "scrub_start", json!({"export": "keelfs", "mib_per_sec": 0})).unwrap_err();
    assert!(e.contains("mib_per_sec"), "{e}");
    assert!(served.stop().success());
}
