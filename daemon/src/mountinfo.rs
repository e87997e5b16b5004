//! Reading /proc/self/mountinfo: which mount sits at a mountpoint.

use std::path::Path;

/// One mount, as mountinfo lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    /// The mount id (first field): unique while the mount exists.
    pub id: u64,
    /// The superblock's device, "MAJOR:MINOR" (third field); a FUSE
    /// mount's backing-device info lives at /sys/class/bdi/MAJOR:MINOR.
    pub dev: String,
}

/// The topmost mount of type `fstype` at `mountpoint` (later lines are
/// mounted on top of earlier ones).
pub fn topmost(mountpoint: &Path, fstype: &str) -> Option<MountEntry> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    topmost_in(&info, mountpoint, fstype)
}

fn topmost_in(info: &str, mountpoint: &Path, fstype: &str) -> Option<MountEntry> {
    // mountinfo escapes space, tab, newline and backslash as octal.
    let escaped = mountpoint
        .to_string_lossy()
        .replace('\\', "\\134")
        .replace(' ', "\\040")
        .replace('\t', "\\011")
        .replace('\n', "\\012");
    info.lines()
        .filter(|line| {
            let at = line.split(' ').nth(4) == Some(escaped.as_str());
            at && line.split(" - ").nth(1).is_some_and(|rest| rest.split(' ').next() == Some(fstype))
        })
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let id = fields.next()?.parse().ok()?;
            let dev = fields.nth(1)?.to_string();
            Some(MountEntry { id, dev })
        })
        .next_back()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_topmost_mount_of_the_type_wins() {
        let info = "\
22 1 0:21 / /mnt/a\\040b rw,relatime shared:1 - fuse.keelfs keelfs rw,user_id=0
23 22 0:22 / /mnt/a\\040b rw,relatime shared:2 - tmpfs tmpfs rw
24 23 0:39 / /mnt/a\\040b rw,relatime shared:3 - fuse.keelfs keelfs rw,user_id=0
25 1 0:40 / /mnt/c rw - fuse.keelfs keelfs rw
";
        let at = Path::new("/mnt/a b");
        assert_eq!(topmost_in(info, at, "fuse.keelfs"), Some(MountEntry { id: 24, dev: "0:39".into() }));
        assert_eq!(topmost_in(info, at, "tmpfs"), Some(MountEntry { id: 23, dev: "0:22".into() }));
        assert_eq!(topmost_in(info, Path::new("/mnt/d"), "fuse.keelfs"), None);
    }
}
