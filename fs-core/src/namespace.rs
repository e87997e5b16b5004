//! The namespace's rules, shared by the operations in ops.rs: name and
//! permission checks, making a node and its entry, removing and renaming
//! entries, listing a directory, ACLs and attribute changes.
//!
//! `Namespace` is a view (step S11 of docs/plans/fs-parts.md), a `Copy`
//! bundle of references to the parts these rules touch, made per call by
//! [`FsInner::ns`]. It owns nothing. Nothing here awaits: a namespace
//! operation is one synchronous step, atomic with respect to other tasks.

use std::borrow::Cow;

use crate::access::{permitted, Acl, Creds, ACL_ACCESS, ACL_DEFAULT, R_OK, W_OK, X_OK};
use crate::change::Change;
use crate::flags::RenameMode;
use crate::format::{Inode, NAME_MAX, ROOT_INO, S_IFDIR, S_IFLNK, S_IFMT, XATTR_NAME_MAX};
use crate::handles::{Handle, HandleTable};
use crate::ids::{Fh, Ino};
use crate::journal::Journal;
use crate::meta::Meta;
use crate::ops::{check_name, DirEntry, EntryName, InheritedXattrs, SetAttr, TimeSet, LINK_MAX};
use crate::record::Record;
use crate::space::Space;
use crate::{FsConfig, FsError, FsInner, FsResult};

/// The parts the namespace's rules touch, lent for one call.
#[derive(Clone, Copy)]
pub(crate) struct Namespace<'a> {
    meta: &'a Meta,
    space: &'a Space,
    journal: &'a Journal,
    handles: &'a HandleTable,
    config: &'a FsConfig,
    change: Change<'a>,
}

impl FsInner {
    pub(crate) fn ns(&self) -> Namespace<'_> {
        Namespace {
            meta: &self.meta,
            space: &self.space,
            journal: &self.journal,
            handles: &self.handles,
            config: &self.config,
            change: self.change(),
        }
    }
}

impl<'a> Namespace<'a> {
    fn change(&self) -> Change<'a> {
        self.change
    }

    /// The access ACL of a node, if it has a valid one. setxattr stores
    /// only valid ACLs; one that a crafted image holds may not be, and then
    /// counts as none.
    pub(crate) fn access_acl_of(&self, node: &super::state::Node) -> Option<Acl> {
        node.xattrs().get(ACL_ACCESS).and_then(|v| Acl::parse(v).ok())
    }

    /// chmod on an inode with an access ACL rewrites the ACL's owner,
    /// mask (or group) and other entries to match: posix_acl_chmod.
    pub(crate) fn couple_acl_to_mode(&self, ino: Ino, mode: u32) -> FsResult<()> {
        let acl = self.meta.state().node(ino).and_then(|n| self.access_acl_of(n));
        let Some(mut acl) = acl else { return Ok(()) };
        acl.chmod(mode);
        self.change().log(Record::XattrSet { ino, name: Cow::Borrowed(ACL_ACCESS), value: Cow::Owned(acl.encode()) })
    }

    /// May `c` access `inode` for `mask`, ACL included?
    pub(crate) fn may(&self, inode: &Inode, c: &Creds, mask: u32) -> bool {
        if c.kernel_checked() || c.uid == 0 || c.uid == inode.uid {
            return permitted(inode, None, c, mask);
        }
        let acl = self.meta.state().node(inode.ino).and_then(|n| self.access_acl_of(n));
        permitted(inode, acl.as_ref(), c, mask)
    }

    /// A directory the caller may search, and the inode `name` names in it.
    pub(crate) fn lookup_in(&self, c: &Creds, parent: Ino, name: &[u8]) -> FsResult<Option<Ino>> {
        if name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        let state = self.meta.state();
        let node = state.node(parent).ok_or(FsError::NotFound)?;
        let dir = node.dir.as_ref().ok_or(FsError::NotDir)?;
        if !permitted(&node.inode, self.access_acl_of(node).as_ref(), c, X_OK) {
            return Err(FsError::Access);
        }
        Ok(match name {
            b"." => Some(parent),
            b".." => Some(dir.parent),
            _ => dir.lookup(name),
        })
    }

    /// Checks for adding or removing an entry of `parent`.
    pub(crate) fn writable_dir(&self, c: &Creds, parent: Ino) -> FsResult<Inode> {
        let inode = self.meta.inode(parent)?;
        if !inode.is_dir() {
            return Err(FsError::NotDir);
        }
        // A removed directory still open (or looked up) takes no new
        // entries, as Linux's dead directories: one made there would have
        // a link but no path, and outlive the directory.
        if inode.nlink == 0 {
            return Err(FsError::NotFound);
        }
        if !self.may(&inode, c, W_OK | X_OK) {
            return Err(FsError::Access);
        }
        Ok(inode)
    }

    /// The sticky-directory rule: only the owner of the entry or of the
    /// directory (or root) may remove or replace it.
    pub(crate) fn check_sticky(&self, c: &Creds, dir: &Inode, victim: Ino) -> FsResult<()> {
        if dir.mode & libc::S_ISVTX == 0 || c.kernel_checked() || c.uid == 0 || c.uid == dir.uid {
            return Ok(());
        }
        if self.meta.inode(victim)?.uid == c.uid {
            return Ok(());
        }
        Err(FsError::Perm)
    }

    pub(crate) fn new_inode(&self, c: &Creds, parent: &Inode, mode: u32, rdev: u32) -> (Inode, InheritedXattrs) {
        let ino = self.meta.take_next_ino();
        let (mode, acls) = self.inherit_acls(c, parent, mode);
        let mut mode = mode;
        let is_dir = mode & S_IFMT == S_IFDIR;
        let gid = if parent.mode & libc::S_ISGID != 0 {
            if is_dir {
                mode |= libc::S_ISGID;
            } else if !c.kernel_checked() && c.uid != 0 && !c.in_group(parent.gid) && mode & 0o010 != 0 {
                // mode_strip_sgid: no setgid file in a group one is not in.
                mode &= !libc::S_ISGID;
            }
            parent.gid
        } else {
            c.gid
        };
        (Inode::new(ino, mode, c.uid, gid, rdev, self.change().file_time()), acls)
    }

    /// Create `inode` with the ACLs [`Self::new_inode`] gave it.
    pub(crate) fn create_inode_with(&self, inode: Inode, acls: InheritedXattrs) -> FsResult<()> {
        let ino = inode.ino;
        self.change().create_inode(inode)?;
        for (name, value) in acls {
            self.change().log(Record::XattrSet { ino, name: Cow::Borrowed(name), value: Cow::Owned(value) })?;
        }
        Ok(())
    }

    /// The mode of a new inode and the ACLs it inherits, as Linux's
    /// posix_acl_create: with a default ACL on the directory, the umask is
    /// ignored and the ACL, masked by the mode, becomes the access ACL
    /// (and a directory's default ACL too); without one, the umask applies.
    pub(crate) fn inherit_acls(&self, c: &Creds, parent: &Inode, mode: u32) -> (u32, InheritedXattrs) {
        if mode & S_IFMT == S_IFLNK {
            return (mode, Vec::new());
        }
        let default = self.meta.state().node(parent.ino).and_then(|n| n.xattrs().get(ACL_DEFAULT).cloned());
        let Some(default) = default.and_then(|v| Acl::parse(&v).ok()).filter(|a| !a.is_empty()) else {
            return (mode & !(c.umask & 0o777), Vec::new());
        };
        let mut acls = Vec::new();
        if mode & S_IFMT == S_IFDIR {
            acls.push((ACL_DEFAULT, default.encode()));
        }
        let mut access = default;
        let masked = access.create_masq(mode & 0o777);
        if !access.mode_bits().1 {
            acls.push((ACL_ACCESS, access.encode()));
        }
        ((mode & !0o777) | masked, acls)
    }

    /// A directory holds a bounded number of entries (2 GiB of names):
    /// past that, adding one is ENOSPC. Checked before an operation logs
    /// anything, so that none stops halfway.
    pub(crate) fn check_dir_room(&self, parent: Ino, name: &[u8]) -> FsResult<()> {
        let state = self.meta.state();
        let dir = state.node(parent).and_then(|n| n.dir.as_ref()).ok_or(FsError::NotDir)?;
        if dir.has_room(name) {
            Ok(())
        } else {
            Err(FsError::NoSpace)
        }
    }

    pub(crate) fn add_entry(&self, parent: Ino, name: &[u8], ino: Ino) -> FsResult<()> {
        self.check_dir_room(parent, name)?;
        let cookie = {
            let mut state = self.meta.state_mut();
            let dir = state.node_mut(parent).and_then(|n| n.dir.as_mut()).ok_or(FsError::NotDir)?;
            dir.take_cookie()
        };
        self.change().log(Record::DirentSet { dir: parent, name: Cow::Borrowed(name), ino, cookie })
    }

    pub(crate) fn touch_dir(&self, dir: Ino, nlink_delta: i32) -> FsResult<()> {
        let t = self.change().file_time();
        self.change().update_inode(dir, |i| {
            i.mtime = t;
            i.ctime = t;
            i.nlink = i.nlink.saturating_add_signed(nlink_delta);
        })
    }

    /// How many inodes this filesystem may hold ([`super::FsConfig::inodes_max`]).
    pub(crate) fn inodes_max(&self) -> u64 {
        self.config
            .inodes_max
            .unwrap_or_else(|| (self.journal.sb.borrow().total_blocks / 4).clamp(1024, u64::from(u32::MAX)))
    }

    /// Create an inode and its entry: the common part of mknod, mkdir,
    /// symlink and create.
    pub(crate) fn make_node(&self, c: &Creds, parent: Ino, name: &[u8], mode: u32, rdev: u32) -> FsResult<Inode> {
        check_name(name)?;
        let dir = self.writable_dir(c, parent)?;
        if self.lookup_in(c, parent, name)?.is_some() {
            return Err(FsError::Exists);
        }
        let is_dir = mode & S_IFMT == S_IFDIR;
        if is_dir && dir.nlink >= LINK_MAX {
            return Err(FsError::TooManyLinks);
        }
        self.space.check_inode_room(self.meta.inode_count() as u64, self.inodes_max())?;
        self.check_dir_room(parent, name)?;
        let (inode, acls) = self.new_inode(c, &dir, mode, rdev);
        self.create_inode_with(inode.clone(), acls)?;
        self.add_entry(parent, name, inode.ino)?;
        self.touch_dir(parent, i32::from(is_dir))?;
        self.meta.add_lookup(inode.ino, 1);
        Ok(inode)
    }

    pub(crate) fn remove_entry(&self, c: &Creds, parent: Ino, name: &[u8], want_dir: bool) -> FsResult<()> {
        if want_dir && name == b"." {
            return Err(FsError::Invalid("rmdir of '.'"));
        }
        if want_dir && name == b".." {
            return Err(FsError::NotEmpty);
        }
        check_name(name)?;
        let dir = self.writable_dir(c, parent)?;
        let ino = self.lookup_in(c, parent, name)?.ok_or(FsError::NotFound)?;
        let victim = self.meta.inode(ino)?;
        match (want_dir, victim.is_dir()) {
            (true, false) => return Err(FsError::NotDir),
            (false, true) => return Err(FsError::IsDir),
            _ => {}
        }
        if want_dir {
            let state = self.meta.state();
            if state.node(ino).and_then(|n| n.dir.as_ref()).is_some_and(|d| !d.is_empty()) {
                return Err(FsError::NotEmpty);
            }
        }
        self.check_sticky(c, &dir, ino)?;
        self.change().log(Record::DirentDelete { dir: parent, name: Cow::Borrowed(name) })?;
        let t = self.change().file_time();
        self.change().update_inode(ino, |i| {
            i.nlink = if want_dir { 0 } else { i.nlink.saturating_sub(1) };
            i.ctime = t;
        })?;
        self.touch_dir(parent, if want_dir { -1 } else { 0 })?;
        self.change().maybe_free(ino)?;
        Ok(())
    }

    pub(crate) fn rename_plain(
        &self,
        c: &Creds,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        mode: RenameMode,
    ) -> FsResult<()> {
        check_name(name)?;
        check_name(new_name)?;
        let src_dir = self.writable_dir(c, parent)?;
        let dst_dir = self.writable_dir(c, new_parent)?;
        let ino = self.lookup_in(c, parent, name)?.ok_or(FsError::NotFound)?;
        let target = self.lookup_in(c, new_parent, new_name)?;
        let src = self.meta.inode(ino)?;
        self.check_sticky(c, &src_dir, ino)?;
        if let Some(t) = target {
            self.check_sticky(c, &dst_dir, t)?;
        }
        if mode == RenameMode::Exchange {
            let other = target.ok_or(FsError::NotFound)?;
            return self.exchange(parent, name, ino, new_parent, new_name, other);
        }
        if target.is_some() && mode.refuses_existing() {
            return Err(FsError::Exists);
        }
        if target == Some(ino) {
            return Ok(()); // two names of one inode: POSIX says do nothing
        }
        if src.is_dir() {
            self.check_not_ancestor(ino, new_parent)?;
            // Moving a directory rewrites its "..": it must be writable.
            if parent != new_parent && !self.may(&src, c, W_OK) {
                return Err(FsError::Access);
            }
        }
        if let Some(t) = target {
            self.check_replace(&src, t)?;
        }
        if src.is_dir() && parent != new_parent && target.is_none() && dst_dir.nlink >= LINK_MAX {
            return Err(FsError::TooManyLinks);
        }
        self.check_dir_room(new_parent, new_name)?;
        self.change().log(Record::DirentDelete { dir: parent, name: Cow::Borrowed(name) })?;
        if target.is_some() {
            self.change().log(Record::DirentDelete { dir: new_parent, name: Cow::Borrowed(new_name) })?;
        }
        self.add_entry(new_parent, new_name, ino)?;
        let t = self.change().file_time();
        self.change().update_inode(ino, |i| i.ctime = t)?;
        let moved_dir = i32::from(src.is_dir());
        if let Some(victim) = target {
            let victim_is_dir = self.meta.inode(victim)?.is_dir();
            self.change().update_inode(victim, |i| {
                i.nlink = if victim_is_dir { 0 } else { i.nlink.saturating_sub(1) };
                i.ctime = t;
            })?;
            self.touch_dir(new_parent, -i32::from(victim_is_dir))?;
            self.change().maybe_free(victim)?;
        }
        self.touch_dir(parent, -moved_dir)?;
        self.touch_dir(new_parent, moved_dir)?;
        Ok(())
    }

    /// rename, then a whiteout at the old name, in one journal transaction
    /// (no await between them). Room for the whiteout's inode is checked
    /// first, so the rename never happens without it.
    pub(crate) fn rename_whiteout(
        &self,
        c: &Creds,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        mode: RenameMode,
    ) -> FsResult<()> {
        self.space.check_inode_room(self.meta.inode_count() as u64, self.inodes_max())?;
        let moved = self.lookup_in(c, parent, name)?.ok_or(FsError::NotFound)?;
        if self.lookup_in(c, new_parent, new_name)? == Some(moved) {
            return Ok(()); // two names of one inode: nothing moves, no whiteout
        }
        self.rename_plain(c, parent, name, new_parent, new_name, mode)?;
        let whiteout = self.make_node(c, parent, name, libc::S_IFCHR, 0)?;
        // make_node counts a lookup for the entry a create replies with;
        // the kernel gets none for a whiteout.
        if let Some(node) = self.meta.state_mut().node_mut(whiteout.ino) {
            node.lookups.sub(1);
        }
        Ok(())
    }

    pub(crate) fn check_replace(&self, src: &Inode, target: Ino) -> FsResult<()> {
        let victim = self.meta.inode(target)?;
        match (src.is_dir(), victim.is_dir()) {
            (true, false) => Err(FsError::NotDir),
            (false, true) => Err(FsError::IsDir),
            (true, true) => {
                let state = self.meta.state();
                let empty = state.node(target).and_then(|n| n.dir.as_ref()).is_none_or(|d| d.is_empty());
                if empty {
                    Ok(())
                } else {
                    Err(FsError::NotEmpty)
                }
            }
            (false, false) => Ok(()),
        }
    }

    /// A directory cannot move under itself.
    pub(crate) fn check_not_ancestor(&self, dir: Ino, mut at: Ino) -> FsResult<()> {
        let state = self.meta.state();
        for _ in 0..state.inode_count() + 1 {
            if at == dir {
                return Err(FsError::Invalid("rename of a directory into itself"));
            }
            if at == ROOT_INO {
                return Ok(());
            }
            at = state.node(at).and_then(|n| n.dir.as_ref()).map(|d| d.parent).ok_or(FsError::NotFound)?;
        }
        Err(FsError::Corrupt("directory parent chain loops".into()))
    }

    pub(crate) fn exchange(
        &self,
        parent: Ino,
        name: &[u8],
        a: Ino,
        new_parent: Ino,
        new_name: &[u8],
        b: Ino,
    ) -> FsResult<()> {
        if a == b {
            return Ok(()); // one inode under both names: nothing changes
        }
        let (ia, ib) = (self.meta.inode(a)?, self.meta.inode(b)?);
        if ia.is_dir() {
            self.check_not_ancestor(a, new_parent)?;
        }
        if ib.is_dir() {
            self.check_not_ancestor(b, parent)?;
        }
        self.change().log(Record::DirentDelete { dir: parent, name: Cow::Borrowed(name) })?;
        self.change().log(Record::DirentDelete { dir: new_parent, name: Cow::Borrowed(new_name) })?;
        self.add_entry(parent, name, b)?;
        self.add_entry(new_parent, new_name, a)?;
        let t = self.change().file_time();
        self.change().update_inode(a, |i| i.ctime = t)?;
        self.change().update_inode(b, |i| i.ctime = t)?;
        let delta = i32::from(ia.is_dir()) - i32::from(ib.is_dir());
        self.touch_dir(parent, -delta)?;
        self.touch_dir(new_parent, delta)?;
        Ok(())
    }

    pub(crate) fn new_handle(&self, ino: Ino, flags: u32) -> Fh {
        let dir_end = self.meta.state().node(ino).and_then(|n| n.dir.as_ref()).map_or(0, |d| d.cookie_end());
        let fh = self.handles.open(Handle { ino, flags, dir_end });
        self.meta.add_open(ino);
        fh
    }

    /// Up to `max` entries of `ino` after cookie `offset` and before `end`,
    /// appended to `out`.
    pub(crate) fn read_dir(
        &self,
        ino: Ino,
        offset: u64,
        max: usize,
        plus: bool,
        end: u64,
        out: &mut Vec<DirEntry>,
    ) -> FsResult<()> {
        self.change().accessed(ino);
        let first = out.len();
        {
            let state = self.meta.state();
            let node = state.node(ino).ok_or(FsError::NotFound)?;
            let dir = node.dir.as_ref().ok_or(FsError::NotDir)?;
            let dot = [(1u64, b".".as_slice(), ino), (2, b"..", dir.parent)];
            let listed = dot.into_iter().filter(|(c, _, _)| *c > offset);
            let rest = dir.entries_from(offset.max(super::state::FIRST_COOKIE)).take_while(|&(c, _, _)| c < end);
            for (cookie, name, child) in listed.chain(rest).take(max) {
                let file_type = state.node(child).map_or(0, |n| n.inode.file_type());
                let next_offset = if cookie <= 2 { cookie } else { cookie + 1 };
                out.push(DirEntry {
                    ino: child,
                    next_offset,
                    file_type,
                    name: EntryName::from_slice(name),
                    attr: None,
                });
            }
        }
        if plus {
            for e in &mut out[first..] {
                e.attr = Some(self.meta.attr(e.ino)?);
                if *e.name != *b"." && *e.name != *b".." {
                    self.meta.add_lookup(e.ino, 1);
                }
            }
        }
        Ok(())
    }

    /// SETATTR's atime and mtime, with Linux's rules: "now" needs write
    /// access or ownership, an explicit time needs ownership.
    pub(crate) fn change_times(
        &self,
        c: &Creds,
        owner: bool,
        inode: &Inode,
        set: &SetAttr,
        new: &mut Inode,
    ) -> FsResult<()> {
        for (want, slot) in [(set.atime, 0), (set.mtime, 1)] {
            let Some(want) = want else { continue };
            let t = match want {
                TimeSet::Now => {
                    if !owner && !self.may(inode, c, W_OK) {
                        return Err(FsError::Access);
                    }
                    self.change().file_time()
                }
                TimeSet::At(t) => {
                    if !owner {
                        return Err(FsError::Perm);
                    }
                    t
                }
            };
            if slot == 0 {
                new.atime = t;
            } else {
                new.mtime = t;
            }
        }
        Ok(())
    }

    /// setxattr of an ACL, as Linux's set_posix_acl: a default ACL only on
    /// a directory; an access ACL that the mode can say is not stored; the
    /// mode follows the access ACL; an empty ACL removes one.
    pub(crate) fn set_acl(&self, c: &Creds, ino: Ino, name: &[u8], acl: &Acl) -> FsResult<()> {
        let inode = self.meta.inode(ino)?;
        let mut mode = inode.mode;
        let mut store = !acl.is_empty();
        if name == ACL_DEFAULT && !inode.is_dir() {
            return if acl.is_empty() { Ok(()) } else { Err(FsError::Access) };
        }
        if name == ACL_ACCESS && !acl.is_empty() {
            let (bits, equivalent) = acl.mode_bits();
            mode = (mode & !0o777) | bits;
            store = !equivalent;
            if !c.kernel_checked() && c.uid != 0 && !c.in_group(inode.gid) {
                mode &= !libc::S_ISGID;
            }
        }
        let stored = self.meta.state().node(ino).is_some_and(|n| n.xattrs().contains_key(name));
        if store {
            self.change().log(Record::XattrSet { ino, name: Cow::Borrowed(name), value: Cow::Owned(acl.encode()) })?;
        } else if stored {
            self.change().log(Record::XattrDelete { ino, name: Cow::Borrowed(name) })?;
        }
        let t = self.change().file_time();
        self.change().update_inode(ino, |i| {
            i.mode = mode;
            i.ctime = t;
        })
    }

    pub(crate) fn clear_mode_bits(&self, ino: Ino, clear: u32) -> FsResult<()> {
        if clear == 0 {
            return Ok(());
        }
        let t = self.change().file_time();
        self.change().update_inode(ino, |i| {
            i.mode &= !clear;
            i.ctime = t;
        })
    }

    pub(crate) fn check_xattr_access(&self, c: &Creds, ino: Ino, name: &[u8], write: bool) -> FsResult<()> {
        if name.is_empty() || name.len() > XATTR_NAME_MAX {
            return Err(if name.is_empty() { FsError::Invalid("empty xattr name") } else { FsError::Range });
        }
        let inode = self.meta.inode(ino)?;
        let acl = name == ACL_ACCESS || name == ACL_DEFAULT;
        if name.starts_with(b"system.") && !acl {
            return Err(FsError::Unsupported);
        }
        if c.kernel_checked() {
            return Ok(());
        }
        let privileged = name.starts_with(b"trusted.") || (write && name.starts_with(b"security."));
        if (privileged && c.uid != 0) || (write && acl && !c.owns(&inode)) {
            return Err(FsError::Perm);
        }
        if name.starts_with(b"user.") && !(inode.is_reg() || inode.is_dir()) {
            return Err(if write { FsError::Perm } else { FsError::NoData });
        }
        let mask = if write { W_OK } else { R_OK };
        if name.starts_with(b"user.") && !self.may(&inode, c, mask) {
            return Err(FsError::Access);
        }
        Ok(())
    }
}
