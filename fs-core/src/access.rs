//! Who may do what: the caller's credentials, the permission checks
//! keelfs-fs applies to them, and POSIX ACLs.
//!
//! A FUSE client kernel mounted with `default_permissions` (virtio-fs
//! always is, and keelfsd mounts /dev/fuse so) checks permissions itself
//! with the caller's full credentials, ACLs included, before it sends a
//! request. Its requests carry [`PermissionCheck::ByKernel`]: keelfs-fs then
//! applies only what the kernel leaves to the filesystem (ownership of new
//! files, setgid inheritance, ACL inheritance and mode coupling, clearing
//! set-id bits). Other callers get keelfs-fs's own checks
//! ([`PermissionCheck::ByFs`]), which follow Linux's generic_permission.

use super::format::{Inode, S_IFMT};
use super::{FsError, FsResult};

pub const R_OK: u32 = 4;
pub const W_OK: u32 = 2;
pub const X_OK: u32 = 1;

pub const ACL_ACCESS: &[u8] = b"system.posix_acl_access";
pub const ACL_DEFAULT: &[u8] = b"system.posix_acl_default";

/// Who decides whether a request is permitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PermissionCheck {
    /// keelfs-fs checks mode bits and ACLs against the credentials.
    ByFs,
    /// The client kernel checked already, with credentials keelfs-fs cannot
    /// see in full (FUSE sends one supplementary group at most). It is
    /// trusted with its own export: a request can only name inodes of it.
    ByKernel,
}

/// Who is asking, as FUSE passes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Creds {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups known to be the caller's.
    pub groups: Vec<u32>,
    /// Applied to the mode of a new inode unless its directory has a
    /// default ACL (Linux's rule); 0 when the mode arrives masked already.
    pub umask: u32,
    pub check: PermissionCheck,
}

impl Creds {
    pub fn root() -> Self {
        Self::user(0, 0)
    }
    pub fn user(uid: u32, gid: u32) -> Self {
        Self { uid, gid, groups: Vec::new(), umask: 0, check: PermissionCheck::ByFs }
    }
    /// A request the client kernel has checked already.
    pub fn checked_by_kernel(uid: u32, gid: u32) -> Self {
        Self { check: PermissionCheck::ByKernel, ..Self::user(uid, gid) }
    }
    pub(crate) fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
    pub(crate) fn kernel_checked(&self) -> bool {
        self.check == PermissionCheck::ByKernel
    }
    /// May act as the owner of `inode` (chmod, utimes to a given time).
    pub(crate) fn owns(&self, inode: &Inode) -> bool {
        self.kernel_checked() || self.uid == 0 || self.uid == inode.uid
    }
}

/// generic_permission: may `c` access `inode` for `mask` (R_OK|W_OK|X_OK)?
/// `acl` is the inode's access ACL, if it has one.
pub(crate) fn permitted(inode: &Inode, acl: Option<&Acl>, c: &Creds, mask: u32) -> bool {
    if c.kernel_checked() {
        return true;
    }
    if c.uid == 0 {
        return mask & X_OK == 0 || inode.is_dir() || inode.mode & 0o111 != 0;
    }
    if c.uid == inode.uid {
        return (inode.mode >> 6) & mask == mask;
    }
    // As acl_permission_check: an ACL whose mask grants nothing is skipped.
    if let Some(acl) = acl.filter(|_| inode.mode & 0o070 != 0) {
        return acl.allows(inode, c, mask);
    }
    let bits = if c.in_group(inode.gid) { (inode.mode >> 3) & 7 } else { inode.mode & 7 };
    bits & mask == mask
}

/// Linux's setattr_should_drop_suidgid: the set-id bits a write,
/// truncate or fallocate by a caller without CAP_FSETID clears. S_ISGID
/// without group execute marks mandatory locking, not privilege: it stays
/// if the writer is in the file's group (`writer_in_group`).
pub(crate) fn setid_bits_to_clear(mode: u32, writer_in_group: bool) -> u32 {
    if mode & S_IFMT == libc::S_IFDIR {
        return 0;
    }
    let mut clear = mode & libc::S_ISUID;
    if mode & libc::S_ISGID != 0 && (mode & libc::S_IXGRP != 0 || !writer_in_group) {
        clear |= libc::S_ISGID;
    }
    clear
}

const ACL_XATTR_VERSION: u32 = 2;
const TAG_USER_OBJ: u16 = 0x01;
const TAG_USER: u16 = 0x02;
const TAG_GROUP_OBJ: u16 = 0x04;
const TAG_GROUP: u16 = 0x08;
const TAG_MASK: u16 = 0x10;
const TAG_OTHER: u16 = 0x20;
const ACL_UNDEFINED_ID: u32 = u32::MAX;
/// Entries one ACL may hold: ext4 stores at most about 500 in a block;
/// this bounds the work of one permission check.
pub const ACL_ENTRIES_MAX: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AclEntry {
    tag: u16,
    perm: u16,
    id: u32,
}

/// A POSIX ACL, validated: entries sorted by tag then id, one each of
/// USER_OBJ, GROUP_OBJ and OTHER, a MASK when there are named entries,
/// and no id twice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acl {
    entries: Vec<AclEntry>,
}

impl Acl {
    /// Decode and validate the xattr form (`posix_acl_xattr_header` and
    /// entries). Anything malformed is EINVAL, as on Linux.
    pub fn parse(value: &[u8]) -> FsResult<Self> {
        let bad = FsError::Invalid("malformed POSIX ACL");
        if value.len() < 4 || !(value.len() - 4).is_multiple_of(8) || (value.len() - 4) / 8 > ACL_ENTRIES_MAX {
            return Err(bad);
        }
        if u32::from_le_bytes(value[..4].try_into().expect("4 bytes")) != ACL_XATTR_VERSION {
            return Err(FsError::Unsupported);
        }
        let entries = value[4..]
            .chunks_exact(8)
            .map(|e| {
                let tag = u16::from_le_bytes([e[0], e[1]]);
                let id = u32::from_le_bytes(e[4..8].try_into().expect("4 bytes"));
                let id = if matches!(tag, TAG_USER | TAG_GROUP) { id } else { ACL_UNDEFINED_ID };
                AclEntry { tag, perm: u16::from_le_bytes([e[2], e[3]]), id }
            })
            .collect();
        let acl = Acl { entries };
        if acl.entries.is_empty() {
            return Ok(acl);
        }
        acl.validate().then_some(acl).ok_or(bad)
    }

    fn validate(&self) -> bool {
        let mut prev: Option<(u16, u32)> = None;
        let mut named = false;
        let count = |tag| self.entries.iter().filter(|e| e.tag == tag).count();
        for e in &self.entries {
            if e.perm & !7 != 0
                || ![TAG_USER_OBJ, TAG_USER, TAG_GROUP_OBJ, TAG_GROUP, TAG_MASK, TAG_OTHER].contains(&e.tag)
            {
                return false;
            }
            if prev.is_some_and(|p| p >= (e.tag, e.id)) {
                return false; // unsorted, or a duplicate
            }
            named |= matches!(e.tag, TAG_USER | TAG_GROUP);
            prev = Some((e.tag, e.id));
        }
        let single = [TAG_USER_OBJ, TAG_GROUP_OBJ, TAG_OTHER].iter().all(|&t| count(t) == 1);
        single && (!named || count(TAG_MASK) == 1)
    }

    /// An ACL with no entries: what `setfacl -k` writes to remove one.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = ACL_XATTR_VERSION.to_le_bytes().to_vec();
        for e in &self.entries {
            out.extend_from_slice(&e.tag.to_le_bytes());
            out.extend_from_slice(&e.perm.to_le_bytes());
            out.extend_from_slice(&e.id.to_le_bytes());
        }
        out
    }

    fn perm_of(&self, tag: u16) -> Option<u32> {
        self.entries.iter().find(|e| e.tag == tag).map(|e| u32::from(e.perm))
    }

    fn set_perm(&mut self, tag: u16, perm: u32) {
        if let Some(e) = self.entries.iter_mut().find(|e| e.tag == tag) {
            e.perm = (perm & 7) as u16;
        }
    }

    /// The permission bits the ACL implies, and whether the mode says it
    /// all (only the three base entries): posix_acl_equiv_mode.
    pub fn mode_bits(&self) -> (u32, bool) {
        let group_class = self.perm_of(TAG_MASK).or(self.perm_of(TAG_GROUP_OBJ)).unwrap_or(0);
        let bits =
            self.perm_of(TAG_USER_OBJ).unwrap_or(0) << 6 | group_class << 3 | self.perm_of(TAG_OTHER).unwrap_or(0);
        (bits, self.entries.len() <= 3)
    }

    /// chmod on an inode with this access ACL: posix_acl_chmod.
    pub fn chmod(&mut self, mode: u32) {
        self.set_perm(TAG_USER_OBJ, mode >> 6);
        let group_tag = if self.perm_of(TAG_MASK).is_some() { TAG_MASK } else { TAG_GROUP_OBJ };
        self.set_perm(group_tag, mode >> 3);
        self.set_perm(TAG_OTHER, mode);
    }

    /// A new inode's access ACL from its directory's default ACL, masked by
    /// the requested `mode`: posix_acl_create_masq. Returns the mode to
    /// give the inode.
    pub fn create_masq(&mut self, mode: u32) -> u32 {
        let mut mode = mode;
        let has_mask = self.perm_of(TAG_MASK).is_some();
        for e in &mut self.entries {
            let (shift, applies) = match e.tag {
                TAG_USER_OBJ => (6, true),
                TAG_OTHER => (0, true),
                TAG_MASK => (3, true),
                TAG_GROUP_OBJ => (3, !has_mask),
                _ => (0, false),
            };
            if applies {
                e.perm &= ((mode >> shift) & 7) as u16;
                mode &= (u32::from(e.perm) << shift) | !(7 << shift);
            }
        }
        mode
    }

    /// posix_acl_permission for a caller who is not the owner: a named
    /// user's entry, else one group entry that grants all of `want`, else
    /// other. Named entries and the owning group are limited by the mask.
    fn allows(&self, inode: &Inode, c: &Creds, want: u32) -> bool {
        let mask = self.perm_of(TAG_MASK).unwrap_or(7);
        let grants = |perm: u16| u32::from(perm) & want == want;
        if let Some(e) = self.entries.iter().find(|e| e.tag == TAG_USER && e.id == c.uid) {
            return grants(e.perm) && mask & want == want;
        }
        let mut in_some_group = false;
        for e in &self.entries {
            let member = match e.tag {
                TAG_GROUP_OBJ => c.in_group(inode.gid),
                TAG_GROUP => c.in_group(e.id),
                _ => false,
            };
            if member && grants(e.perm) {
                return mask & want == want;
            }
            in_some_group |= member;
        }
        !in_some_group && self.perm_of(TAG_OTHER).is_some_and(|p| p & want == want)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Timespec;

    fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
        let mut v = ACL_XATTR_VERSION.to_le_bytes().to_vec();
        for &(tag, perm, id) in entries {
            v.extend_from_slice(&tag.to_le_bytes());
            v.extend_from_slice(&perm.to_le_bytes());
            v.extend_from_slice(&id.to_le_bytes());
        }
        v
    }

    const NAMED: &[(u16, u16, u32)] = &[
        (TAG_USER_OBJ, 7, 0),
        (TAG_USER, 6, 1000),
        (TAG_GROUP_OBJ, 5, 0),
        (TAG_GROUP, 4, 2000),
        (TAG_MASK, 4, 0),
        (TAG_OTHER, 0, 0),
    ];

    #[test]
    fn malformed_acls_are_refused() {
        assert!(Acl::parse(&acl(NAMED)).is_ok());
        let bad: &[&[(u16, u16, u32)]] = &[
            &[(TAG_USER_OBJ, 7, 0), (TAG_OTHER, 0, 0)], // no group
            &[(TAG_USER_OBJ, 7, 0), (TAG_USER, 6, 1), (TAG_GROUP_OBJ, 5, 0), (TAG_OTHER, 0, 0)], // no mask
            &[(TAG_USER_OBJ, 7, 0), (TAG_GROUP_OBJ, 5, 0), (TAG_GROUP_OBJ, 5, 0), (TAG_OTHER, 0, 0)],
            &[(TAG_GROUP_OBJ, 5, 0), (TAG_USER_OBJ, 7, 0), (TAG_OTHER, 0, 0)], // unsorted
            &[(TAG_USER_OBJ, 8, 0), (TAG_GROUP_OBJ, 5, 0), (TAG_OTHER, 0, 0)], // perm bits
            &[(TAG_USER_OBJ, 7, 0), (0x40, 5, 0), (TAG_OTHER, 0, 0)],          // unknown tag
        ];
        for entries in bad {
            assert!(Acl::parse(&acl(entries)).is_err(), "{entries:?} accepted");
        }
        assert!(Acl::parse(&[2, 0, 0]).is_err());
        assert!(Acl::parse(&acl(NAMED)[..13]).is_err());
        assert_eq!(Acl::parse(&[1, 0, 0, 0]), Err(FsError::Unsupported));
        let too_many = vec![(TAG_USER, 7, 0); ACL_ENTRIES_MAX + 1];
        assert!(Acl::parse(&acl(&too_many)).is_err());
        assert!(Acl::parse(&acl(&[])).unwrap().is_empty());
    }

    #[test]
    fn the_mask_limits_named_entries_and_the_mode_follows_it() {
        let mut a = Acl::parse(&acl(NAMED)).unwrap();
        assert_eq!(a.mode_bits(), (0o740, false));
        let inode = Inode::new(crate::Ino::new(5), libc::S_IFREG | 0o740, 0, 0, 0, Timespec::default());
        let user = |uid, gid, groups: &[u32]| Creds { groups: groups.to_vec(), ..Creds::user(uid, gid) };
        assert!(permitted(&inode, Some(&a), &user(1000, 1, &[]), R_OK));
        assert!(!permitted(&inode, Some(&a), &user(1000, 1, &[]), W_OK), "the mask r-- allowed a write");
        assert!(permitted(&inode, Some(&a), &user(7, 7, &[2000]), R_OK));
        assert!(!permitted(&inode, Some(&a), &user(7, 7, &[]), R_OK), "other has nothing");
        assert!(permitted(&inode, Some(&a), &user(7, 7, &[]).clone_checked(), W_OK), "the kernel decided");
        a.chmod(0o750);
        assert_eq!(a.mode_bits(), (0o750, false));
        let mut inherited = Acl::parse(&acl(NAMED)).unwrap();
        assert_eq!(inherited.create_masq(0o600), 0o600);
        assert_eq!(inherited.mode_bits(), (0o600, false));
    }

    #[test]
    fn setid_bits_cleared_by_a_write_are_linuxs() {
        assert_eq!(setid_bits_to_clear(libc::S_IFREG | 0o6755, true), libc::S_ISUID | libc::S_ISGID);
        assert_eq!(setid_bits_to_clear(libc::S_IFREG | 0o6745, true), libc::S_ISUID);
        assert_eq!(setid_bits_to_clear(libc::S_IFREG | 0o6745, false), libc::S_ISUID | libc::S_ISGID);
        assert_eq!(setid_bits_to_clear(libc::S_IFDIR | 0o6755, false), 0);
    }

    impl Creds {
        fn clone_checked(&self) -> Self {
            Creds { check: PermissionCheck::ByKernel, ..self.clone() }
        }
    }
}
