//! An image belongs to one keelfsd at a time: while it is served, a second
//! `serve`, `mkfs` or `fsck --repair` is refused (exit 2) with a message
//! naming the holder; a plain `fsck` may read it and says it is live; and
//! one config cannot export one image twice, even by two paths.

mod common;

use std::ffi::OsStr;

use common::{fsck, keelfsd, mkfs, Scratch, Served};

fn refused(args: &[&OsStr], what: &str) -> String {
    let out = keelfsd().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{what} must be refused with exit 2: {stderr}");
    assert!(stderr.contains("is in use"), "{what}: {stderr}");
    stderr
}

#[test]
fn a_served_image_refuses_a_second_owner_and_names_the_holder() {
    let dir = Scratch::new("ownership");
    let image = dir.path("k.img");
    mkfs(&image, "256M");
    let mnt = dir.path("mnt");
    let served = Served::start(
        &[OsStr::new("--device"), image.as_os_str(), OsStr::new("--fuse-mount"), mnt.as_os_str()],
        &[&mnt],
    );
    // The image is held by the sandboxed server, named with the pid of the
    // daemon that was started.
    let holder = format!("(keelfsd, the server of pid {})", served.child.id());

    let second_mnt = dir.path("mnt2");
    std::fs::create_dir_all(&second_mnt).unwrap();
    let stderr = refused(
        &[
            OsStr::new("serve"),
            OsStr::new("--device"),
            image.as_os_str(),
            OsStr::new("--fuse-mount"),
            second_mnt.as_os_str(),
        ],
        "a second serve",
    );
    assert!(stderr.contains(&holder), "the holder is named: {stderr}");
    refused(&[OsStr::new("fsck"), image.as_os_str(), OsStr::new("--repair")], "fsck --repair");
    refused(&[OsStr::new("mkfs"), image.as_os_str(), OsStr::new("--force")], "mkfs --force");
    // A symlink is another path to the same file.
    let alias = dir.path("alias.img");
    std::os::unix::fs::symlink(&image, &alias).unwrap();
    refused(&[OsStr::new("fsck"), alias.as_os_str(), OsStr::new("--repair")], "fsck --repair by another path");

    let out = keelfsd().arg("fsck").arg(&image).arg("--json").output().unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["live"], true, "{report}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("in use (being served)"));

    assert!(served.stop().success());
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "{report}");
    let out = keelfsd().arg("fsck").arg(&image).arg("--json").output().unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["live"], false, "no longer served: {report}");
}

#[test]
fn one_config_cannot_export_one_image_twice() {
    let dir = Scratch::new("twice");
    let image = dir.path("k.img");
    mkfs(&image, "256M");
    let alias = dir.path("alias.img");
    std::os::unix::fs::symlink(&image, &alias).unwrap();
    let config = dir.path("keelfsd.toml");
    std::fs::write(
        &config,
        format!(
            "[[device]]\nname = \"a\"\npath = \"{}\"\n[[device]]\nname = \"b\"\npath = \"{}\"\n\
             [[export]]\ntag = \"alpha\"\ndevice = \"a\"\nfuse_mount = \"{}\"\n\
             [[export]]\ntag = \"beta\"\ndevice = \"b\"\nfuse_mount = \"{}\"\n",
            image.display(),
            alias.display(),
            dir.path("ma").display(),
            dir.path("mb").display()
        ),
    )
    .unwrap();
    std::fs::create_dir_all(dir.path("ma")).unwrap();
    std::fs::create_dir_all(dir.path("mb")).unwrap();
    let stderr = refused(&[OsStr::new("serve"), OsStr::new("--config"), config.as_os_str()], "the same image twice");
    assert!(stderr.contains("this process"), "the holder is this daemon itself: {stderr}");
}
