//! keelfsd mkfs and fsck keep the command-line contract: exit codes,
//! refusals, JSON, and reports of damage.

use std::path::PathBuf;
use std::process::{Command, Output};

use keelfs_fs::Superblock;

fn keelfsd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keelfsd")).args(args).output().expect("run keelfsd")
}

struct Image(PathBuf);

impl Image {
    fn new(tag: &str) -> Self {
        let dir =
            if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let p = dir.join(format!("keelfsd-test-{tag}-{}.img", std::process::id()));
        let _ = std::fs::remove_file(&p);
        Image(p)
    }
    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn mkfs_creates_a_sparse_file_and_refuses_to_reformat() {
    let img = Image::new("mkfs");
    let out = keelfsd(&["mkfs", img.path(), "--size", "64M"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let meta = std::fs::metadata(&img.0).unwrap();
    assert_eq!(meta.len(), 64 << 20);
    use std::os::unix::fs::MetadataExt;
    assert!(meta.blocks() * 512 < 8 << 20, "the image is sparse");
    let again = keelfsd(&["mkfs", img.path()]);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    let forced = keelfsd(&["mkfs", img.path(), "--force"]);
    assert!(forced.status.success());
    let check = keelfsd(&["fsck", img.path()]);
    assert_eq!(check.status.code(), Some(0), "{}", String::from_utf8_lossy(&check.stdout));
    assert!(String::from_utf8_lossy(&check.stdout).contains("clean"));
}

#[test]
fn fsck_reports_damage_as_json_and_exit_code_one() {
    let img = Image::new("fsck");
    assert!(keelfsd(&["mkfs", img.path(), "--size", "32M"]).status.success());
    let out = keelfsd(&["fsck", img.path(), "--json"]);
    assert_eq!(out.status.code(), Some(0));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["clean"], true);
    assert_eq!(report["inodes"], 1);

    // Damage the checkpoint block the newest superblock names.
    let mut bytes = std::fs::read(&img.0).unwrap();
    let sb = (0..2)
        .filter_map(|s| Superblock::decode(&bytes[s * 4096..(s + 1) * 4096]).ok())
        .max_by_key(|s| s.generation)
        .unwrap();
    let at = (sb.checkpoint_extents[0].start * 4096 + 50) as usize;
    bytes[at] ^= 0x40;
    std::fs::write(&img.0, &bytes).unwrap();
    let before = std::fs::read(&img.0).unwrap();
    let out = keelfsd(&["fsck", img.path(), "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["clean"], false);
    assert_eq!(report["problems"][0]["kind"], "checkpoint");
    assert!(report["problems"][0]["detail"].as_str().unwrap().contains("checksum"));
    assert_eq!(std::fs::read(&img.0).unwrap(), before, "fsck without --repair modified nothing");
    let text = keelfsd(&["fsck", img.path()]);
    assert_eq!(text.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&text.stdout).contains("damage [checkpoint]"));
}

#[test]
fn usage_errors_exit_two() {
    assert_eq!(keelfsd(&["fsck"]).status.code(), Some(2));
    assert_eq!(keelfsd(&["fsck", "/nonexistent/keelfs.img"]).status.code(), Some(2));
    assert_eq!(keelfsd(&["mkfs", "/tmp", "--size", "1G"]).status.code(), Some(2));
    assert_eq!(keelfsd(&["mkfs", "x.img", "--size", "12q"]).status.code(), Some(2));
    let img = Image::new("tiny");
    let out = keelfsd(&["mkfs", img.path(), "--size", "1M"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs at least"));
}

#[test]
fn mkfs_data_checksums_makes_a_table_that_fsck_checks_and_repairs() {
    let img = Image::new("csums");
    let out = keelfsd(&["mkfs", img.path(), "--size", "64M", "--data-checksums"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("data checksums"));
    let mut bytes = std::fs::read(&img.0).unwrap();
    let sb = Superblock::decode(&bytes[..4096]).unwrap();
    assert!(sb.has_data_checksums() && sb.csum_table_blocks > 0);
    let out = keelfsd(&["fsck", img.path(), "--data", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["data_blocks_unverifiable"], 0);
    // One flipped bit in the table: its sector vouches for nothing more.
    let at = (sb.csum_table_start() * 4096 + 1000) as usize;
    bytes[at] ^= 0x02;
    std::fs::write(&img.0, &bytes).unwrap();
    let out = keelfsd(&["fsck", img.path(), "--data", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["problems"][0]["kind"], "csum-table-sector", "{report}");
    assert_eq!(report["problems"][0]["repairable"], true, "{report}");
    // --repair rebuilds the sector from the data it covers.
    let out = keelfsd(&["fsck", img.path(), "--repair", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["repaired"].to_string().contains("rebuilt data checksum table block 0"), "{report}");
    let out = keelfsd(&["fsck", img.path(), "--data", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
}
