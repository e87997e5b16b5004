//! Who may do what: the caller's credentials and the permission checks
//! fs-core applies to them.

use super::format::Inode;

pub const R_OK: u32 = 4;
pub const W_OK: u32 = 2;
pub const X_OK: u32 = 1;

/// Who is asking, as FUSE passes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Creds {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

impl Creds {
    pub fn root() -> Self {
        Self { uid: 0, gid: 0, groups: Vec::new() }
    }
    pub fn user(uid: u32, gid: u32) -> Self {
        Self { uid, gid, groups: Vec::new() }
    }
    pub(crate) fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

pub(crate) fn permitted(inode: &Inode, c: &Creds, mask: u32) -> bool {
    if c.uid == 0 {
        return mask & X_OK == 0 || inode.is_dir() || inode.mode & 0o111 != 0;
    }
    let bits = if c.uid == inode.uid {
        (inode.mode >> 6) & 7
    } else if c.in_group(inode.gid) {
        (inode.mode >> 3) & 7
    } else {
        inode.mode & 7
    };
    bits & mask == mask
}
