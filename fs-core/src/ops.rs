//! The operation API, shaped like the FUSE low-level protocol without its
//! wire format. Namespace operations change only memory and the pending
//! journal, so they complete without I/O; data operations await the device.

use std::borrow::Cow;
use std::rc::Rc;

use super::access::{setid_bits_to_clear, Acl, Creds, ACL_ACCESS, ACL_DEFAULT, R_OK, W_OK};
use super::flags::{RenameMode, XattrFlags};
use super::format::{
    Inode, Timespec, BLOCK_SIZE, NAME_MAX, SYMLINK_MAX, S_IFDIR, S_IFLNK, S_IFMT, S_IFREG, XATTR_INODE_BYTES_MAX,
    XATTR_LIST_BYTES_MAX, XATTR_VALUE_MAX,
};
use super::ids::{Fh, Ino};
use super::record::Record;
use super::{Fs, FsError, FsInner, FsResult};

/// The ACLs a new inode inherits: xattr names and values.
pub(crate) type InheritedXattrs = Vec<(&'static [u8], Vec<u8>)>;

/// Most one copy_file_range copies byte by byte (callers loop on short
/// copies): as much as one WRITE carries, so that it holds its reactor's
/// attention no longer, and a QoS limiter can charge it as one.
pub const COPY_RANGE_MAX: u64 = 1 << 20;
/// Largest file: 2^52 bytes keeps block arithmetic far from overflow.
pub const MAX_FILE_BYTES: u64 = 1 << 52;
pub(crate) const LINK_MAX: u32 = 65_000;

/// What lseek looks for from an offset (the kernel answers SEEK_SET,
/// SEEK_CUR and SEEK_END itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeekTo {
    /// SEEK_DATA: the next byte that holds data.
    Data,
    /// SEEK_HOLE: the next byte of a hole (or the end of the file).
    Hole,
}

impl SeekTo {
    /// From lseek's whence: SEEK_DATA (3) and SEEK_HOLE (4), None for any
    /// other.
    pub fn from_whence(whence: u32) -> Option<Self> {
        match whence {
            3 => Some(SeekTo::Data),
            4 => Some(SeekTo::Hole),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attr {
    pub inode: Inode,
    /// Allocated space in 512-byte units, as st_blocks.
    pub blocks_512: u64,
}

impl Attr {
    pub fn ino(&self) -> Ino {
        self.inode.ino
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeSet {
    Now,
    At(Timespec),
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<TimeSet>,
    pub mtime: Option<TimeSet>,
    pub ctime: Option<Timespec>,
    /// Clear the set-id bits, as a truncate by a caller without
    /// CAP_FSETID does (FUSE's FATTR_KILL_SUIDGID).
    pub kill_setid: bool,
}

/// A directory entry's name as readdir returns it.
pub type EntryName = smallvec::SmallVec<[u8; 48]>;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: Ino,
    /// The offset to pass to continue after this entry.
    pub next_offset: u64,
    pub file_type: u32,
    /// Inline up to 48 bytes, which holds most names: a READDIR of 64
    /// entries then allocates once, for the list (issue 34).
    pub name: EntryName,
    /// Filled by readdirplus, which also counts a lookup for the entry.
    pub attr: Option<Attr>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatFs {
    pub block_size: u32,
    pub blocks: u64,
    pub blocks_free: u64,
    pub files: u64,
    pub files_free: u64,
    pub name_max: u32,
}

pub(crate) fn check_name(name: &[u8]) -> FsResult<()> {
    if name.len() > NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0) {
        return Err(FsError::Invalid("bad file name"));
    }
    Ok(())
}

impl Fs {
    pub(crate) fn inner(&self) -> &Rc<FsInner> {
        &self.inner
    }

    pub async fn lookup(&self, c: &Creds, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        // "." of any inode is the inode: how a client that kept only an
        // inode number (an NFS-style file handle, FUSE_EXPORT_SUPPORT)
        // finds it again. A freed inode is ENOENT, and the client compares
        // the generation.
        let ino = if name == b"." && c.kernel_checked() {
            self.inner.meta.inode(parent)?.ino
        } else {
            self.inner.ns().lookup_in(c, parent, name)?.ok_or(FsError::NotFound)?
        };
        self.inner.meta.add_lookup(ino, 1);
        self.inner.meta.attr(ino)
    }

    /// The kernel dropped `n` references obtained by lookups.
    pub async fn forget(&self, ino: Ino, n: u64) -> FsResult<()> {
        self.inner.meta.drop_lookups(ino, n);
        self.inner.change().maybe_free(ino)?;
        Ok(())
    }

    pub async fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        self.inner.meta.attr(ino)
    }

    /// The inode's change counter (statx's change cookie). Reading it
    /// arms the next change to bump it; unread, changes leave it alone.
    pub async fn i_version(&self, ino: Ino) -> FsResult<u64> {
        let mut state = self.inner.meta.state_mut();
        let node = state.node_mut(ino).ok_or(FsError::NotFound)?;
        node.i_version_queried = true;
        Ok(node.inode.i_version)
    }

    pub async fn mknod(&self, c: &Creds, parent: Ino, name: &[u8], mode: u32, rdev: u32) -> FsResult<Attr> {
        let kind = mode & S_IFMT;
        let kind = if kind == 0 { S_IFREG } else { kind };
        if ![S_IFREG, libc::S_IFIFO, libc::S_IFCHR, libc::S_IFBLK, libc::S_IFSOCK].contains(&kind) {
            return Err(FsError::Invalid("mknod of this file type"));
        }
        let inode = self.inner.ns().make_node(c, parent, name, kind | (mode & 0o7777), rdev)?;
        self.inner.meta.attr(inode.ino)
    }

    pub async fn mkdir(&self, c: &Creds, parent: Ino, name: &[u8], mode: u32) -> FsResult<Attr> {
        let inode = self.inner.ns().make_node(c, parent, name, S_IFDIR | (mode & 0o7777), 0)?;
        self.inner.meta.attr(inode.ino)
    }

    pub async fn symlink(&self, c: &Creds, parent: Ino, name: &[u8], target: &[u8]) -> FsResult<Attr> {
        if target.len() > SYMLINK_MAX {
            return Err(FsError::NameTooLong);
        }
        if target.is_empty() || target.contains(&0) {
            return Err(FsError::Invalid("symlink target"));
        }
        let inode = self.inner.ns().make_node(c, parent, name, S_IFLNK | 0o777, 0)?;
        self.inner.change().log(Record::Symlink { ino: inode.ino, target: Cow::Borrowed(target) })?;
        self.inner.change().update_inode(inode.ino, |i| i.size = target.len() as u64)?;
        self.inner.meta.attr(inode.ino)
    }

    pub async fn readlink(&self, ino: Ino) -> FsResult<Vec<u8>> {
        let state = self.inner.meta.state();
        let node = state.node(ino).ok_or(FsError::NotFound)?;
        node.symlink().map(<[u8]>::to_vec).ok_or(FsError::Invalid("not a symlink"))
    }

    pub async fn link(&self, c: &Creds, ino: Ino, new_parent: Ino, new_name: &[u8]) -> FsResult<Attr> {
        check_name(new_name)?;
        let inode = self.inner.meta.inode(ino)?;
        if inode.is_dir() {
            return Err(FsError::Perm);
        }
        if inode.nlink >= LINK_MAX {
            return Err(FsError::TooManyLinks);
        }
        self.inner.ns().writable_dir(c, new_parent)?;
        if self.inner.ns().lookup_in(c, new_parent, new_name)?.is_some() {
            return Err(FsError::Exists);
        }
        self.inner.ns().add_entry(new_parent, new_name, ino)?;
        let t = self.inner.change().file_time();
        self.inner.change().update_inode(ino, |i| {
            i.nlink += 1;
            i.ctime = t;
        })?;
        self.inner.ns().touch_dir(new_parent, 0)?;
        self.inner.meta.add_lookup(ino, 1);
        self.inner.meta.attr(ino)
    }

    pub async fn unlink(&self, c: &Creds, parent: Ino, name: &[u8]) -> FsResult<()> {
        self.inner.ns().remove_entry(c, parent, name, false)
    }

    pub async fn rmdir(&self, c: &Creds, parent: Ino, name: &[u8]) -> FsResult<()> {
        self.inner.ns().remove_entry(c, parent, name, true)
    }

    pub async fn rename(
        &self,
        c: &Creds,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        mode: RenameMode,
    ) -> FsResult<()> {
        if let RenameMode::Whiteout { .. } = mode {
            return self.inner.ns().rename_whiteout(c, parent, name, new_parent, new_name, mode);
        }
        self.inner.ns().rename_plain(c, parent, name, new_parent, new_name, mode)
    }

    pub async fn open(&self, c: &Creds, ino: Ino, flags: u32) -> FsResult<Fh> {
        let inode = self.inner.meta.inode(ino)?;
        let mask = match flags as i32 & libc::O_ACCMODE {
            libc::O_RDONLY => R_OK,
            libc::O_WRONLY => W_OK,
            _ => R_OK | W_OK,
        };
        if inode.is_dir() && mask & W_OK != 0 {
            return Err(FsError::IsDir);
        }
        if !self.inner.ns().may(&inode, c, mask) {
            return Err(FsError::Access);
        }
        if flags as i32 & libc::O_TRUNC != 0 && mask & W_OK != 0 && inode.is_reg() && inode.size > 0 {
            self.data().truncate(ino, 0).await?;
        }
        Ok(self.inner.ns().new_handle(ino, flags))
    }

    /// Create and open a regular file. With O_EXCL an existing name is an
    /// error; without it the existing file is opened.
    pub async fn create(&self, c: &Creds, parent: Ino, name: &[u8], mode: u32, flags: u32) -> FsResult<(Attr, Fh)> {
        if let Some(ino) = self.inner.ns().lookup_in(c, parent, name)? {
            if flags as i32 & libc::O_EXCL != 0 {
                return Err(FsError::Exists);
            }
            let fh = self.open(c, ino, flags & !(libc::O_CREAT as u32)).await?;
            self.inner.meta.add_lookup(ino, 1);
            return Ok((self.inner.meta.attr(ino)?, fh));
        }
        let inode = self.inner.ns().make_node(c, parent, name, S_IFREG | (mode & 0o7777), 0)?;
        let fh = self.inner.ns().new_handle(inode.ino, flags);
        Ok((self.inner.meta.attr(inode.ino)?, fh))
    }

    /// O_TMPFILE: an open regular file with no name (nlink 0), in
    /// `parent`'s group and ACLs. It is freed at its last release, or at
    /// the next mount after a crash, unless `link` gives it a name first.
    pub async fn tmpfile(&self, c: &Creds, parent: Ino, mode: u32, flags: u32) -> FsResult<(Attr, Fh)> {
        let dir = self.inner.ns().writable_dir(c, parent)?;
        self.inner.space.check_inode_room(self.inner.meta.inode_count() as u64, self.inner.ns().inodes_max())?;
        let (mut inode, acls) = self.inner.ns().new_inode(c, &dir, S_IFREG | (mode & 0o7777), 0);
        inode.nlink = 0;
        let ino = inode.ino;
        self.inner.ns().create_inode_with(inode, acls)?;
        self.inner.meta.add_lookup(ino, 1);
        let fh = self.inner.ns().new_handle(ino, flags);
        Ok((self.inner.meta.attr(ino)?, fh))
    }

    pub async fn release(&self, fh: Fh) -> FsResult<()> {
        let handle = self.inner.handles.close(fh).ok_or(FsError::BadHandle)?;
        self.inner.meta.drop_open(handle.ino);
        self.inner.change().maybe_free(handle.ino)?;
        Ok(())
    }

    /// The inode and open flags of a handle.
    pub fn handle(&self, fh: Fh) -> FsResult<(Ino, u32)> {
        self.inner.handles.get(fh).map(|h| (h.ino, h.flags)).ok_or(FsError::BadHandle)
    }

    pub async fn opendir(&self, c: &Creds, ino: Ino) -> FsResult<Fh> {
        let inode = self.inner.meta.inode(ino)?;
        if !inode.is_dir() {
            return Err(FsError::NotDir);
        }
        if !self.inner.ns().may(&inode, c, R_OK) {
            return Err(FsError::Access);
        }
        Ok(self.inner.ns().new_handle(ino, libc::O_RDONLY as u32 | libc::O_DIRECTORY as u32))
    }

    pub async fn releasedir(&self, fh: Fh) -> FsResult<()> {
        self.release(fh).await
    }

    /// Up to `max` entries from `offset` (0 at the start). Offsets are
    /// per-entry cookies, so they stay valid while the directory changes.
    pub async fn readdir(&self, ino: Ino, offset: u64, max: usize) -> FsResult<Vec<DirEntry>> {
        let mut out = Vec::new();
        self.inner.ns().read_dir(ino, offset, max, false, u64::MAX, &mut out)?;
        Ok(out)
    }

    /// readdir through the directory handle `fh`: entries made since the
    /// opendir (or since the last read from offset 0, a rewind) are left
    /// out, so that a reader whose directory keeps gaining entries (files
    /// renamed within it, each getting a new cookie) reaches its end.
    pub async fn readdir_handle(&self, fh: Fh, offset: u64, max: usize, plus: bool) -> FsResult<Vec<DirEntry>> {
        let mut out = Vec::new();
        self.readdir_handle_into(fh, offset, max, plus, &mut out).await?;
        Ok(out)
    }

    /// [`Fs::readdir_handle`] into `out`, which is cleared first: a caller
    /// that keeps its list from one call to the next allocates nothing for
    /// it in steady state.
    pub async fn readdir_handle_into(
        &self,
        fh: Fh,
        offset: u64,
        max: usize,
        plus: bool,
        out: &mut Vec<DirEntry>,
    ) -> FsResult<()> {
        out.clear();
        let ino = self.handle(fh)?.0;
        if offset == 0 {
            let end = self.inner.meta.state().node(ino).and_then(|n| n.dir.as_ref()).map(|d| d.cookie_end());
            if let Some(end) = end {
                self.inner.handles.set_dir_end(fh, end);
            }
        }
        let end = self.inner.handles.get(fh).map_or(0, |h| h.dir_end);
        self.inner.ns().read_dir(ino, offset, max, plus, end, out)
    }

    /// readdir with attributes; each returned entry other than "." and ".."
    /// counts as a lookup, as in FUSE.
    pub async fn readdirplus(&self, ino: Ino, offset: u64, max: usize) -> FsResult<Vec<DirEntry>> {
        let mut out = Vec::new();
        self.inner.ns().read_dir(ino, offset, max, true, u64::MAX, &mut out)?;
        Ok(out)
    }

    pub async fn statfs(&self) -> FsResult<StatFs> {
        let state = self.inner.meta.state();
        let usage = self.inner.usage();
        let files = self.inner.space.inodes_limit(self.inner.ns().inodes_max());
        Ok(StatFs {
            block_size: BLOCK_SIZE as u32,
            // With a quota, df shows it as the size.
            blocks: self.inner.space.blocks_limit(),
            blocks_free: self.inner.space.shown_free_blocks(usage),
            // Inodes are not preallocated: the limit is the configured
            // (or device-derived) inodes_max, or the quota. Total = in use
            // + free.
            files,
            files_free: files.saturating_sub(state.inode_count() as u64),
            name_max: NAME_MAX as u32,
        })
    }

    pub async fn access(&self, c: &Creds, ino: Ino, mask: u32) -> FsResult<()> {
        let inode = self.inner.meta.inode(ino)?;
        if mask == 0 || self.inner.ns().may(&inode, c, mask & 7) {
            Ok(())
        } else {
            Err(FsError::Access)
        }
    }

    pub async fn setattr(&self, c: &Creds, ino: Ino, set: &SetAttr, via_handle: bool) -> FsResult<Attr> {
        let inode = self.inner.meta.inode(ino)?;
        let owner = c.owns(&inode);
        let mut new = inode.clone();
        change_mode_and_owner(c, owner, set, &mut new)?;
        self.inner.ns().change_times(c, owner, &inode, set, &mut new)?;
        if let Some(size) = set.size {
            if new.is_dir() {
                return Err(FsError::IsDir);
            }
            if !new.is_reg() {
                return Err(FsError::Invalid("truncate of a special file"));
            }
            if !via_handle && !self.inner.ns().may(&inode, c, W_OK) {
                return Err(FsError::Access);
            }
            self.data().truncate(ino, size).await?;
            if set.kill_setid || (!c.kernel_checked() && c.uid != 0) {
                new.mode &= !setid_bits_to_clear(new.mode, c.uid == 0 || c.in_group(new.gid));
            }
            let after = self.inner.meta.inode(ino)?;
            new.size = after.size;
            if set.mtime.is_none() {
                new.mtime = after.mtime;
            }
        }
        new.ctime = set.ctime.unwrap_or_else(|| self.inner.change().file_time());
        if new.mode != inode.mode {
            self.inner.ns().couple_acl_to_mode(ino, new.mode)?;
        }
        self.inner.change().update_inode(ino, |i| *i = new)?;
        self.inner.meta.attr(ino)
    }

    pub async fn setxattr(&self, c: &Creds, ino: Ino, name: &[u8], value: &[u8], flags: XattrFlags) -> FsResult<()> {
        self.inner.ns().check_xattr_access(c, ino, name, true)?;
        if value.len() > XATTR_VALUE_MAX {
            return Err(FsError::Range);
        }
        let (exists, names_bytes, all_bytes) = {
            let state = self.inner.meta.state();
            let node = state.node(ino).ok_or(FsError::NotFound)?;
            // Bounded: the limits below bound how many there can be.
            let others = node.xattrs().iter().filter(|(n, _)| n.as_slice() != name);
            let (names, values) = others.fold((0, 0), |(n, v), (k, val)| (n + k.len() + 1, v + val.len()));
            (node.xattrs().contains_key(name), names + name.len() + 1, names + values + name.len() + 1 + value.len())
        };
        if flags.create_only && exists {
            return Err(FsError::Exists);
        }
        if flags.replace_only && !exists {
            return Err(FsError::NoData);
        }
        let inode_bytes_max = self.inner.config.xattr_bytes_per_inode_max.min(XATTR_INODE_BYTES_MAX);
        if names_bytes > XATTR_LIST_BYTES_MAX || all_bytes > inode_bytes_max {
            return Err(FsError::NoSpace);
        }
        if name == ACL_ACCESS || name == ACL_DEFAULT {
            return self.inner.ns().set_acl(c, ino, name, &Acl::parse(value)?);
        }
        self.inner.change().log(Record::XattrSet { ino, name: Cow::Borrowed(name), value: Cow::Borrowed(value) })?;
        let t = self.inner.change().file_time();
        self.inner.change().update_inode(ino, |i| i.ctime = t)?;
        Ok(())
    }

    /// Clear S_ISUID, and S_ISGID with group execute, as a write by a
    /// caller without CAP_FSETID does (FUSE_WRITE_KILL_SUIDGID and
    /// FUSE_OPEN_KILL_SUIDGID). Free when there is nothing to clear.
    /// `writer` counts as in the file's group if its gid or one of the
    /// groups it carries is the file's (FUSE sends no more of them).
    /// Whether the mode changed.
    pub fn kill_setid(&self, ino: Ino, writer: &Creds) -> FsResult<bool> {
        let inode = self.inner.meta.inode(ino)?;
        let clear = setid_bits_to_clear(inode.mode, writer.in_group(inode.gid));
        self.inner.ns().clear_mode_bits(ino, clear)?;
        Ok(clear != 0)
    }

    /// Clear S_ISGID: an access ACL set by a caller outside the file's
    /// group (FUSE_SETXATTR_ACL_KILL_SGID).
    pub fn kill_sgid(&self, ino: Ino) -> FsResult<()> {
        let clear = self.inner.meta.inode(ino)?.mode & libc::S_ISGID;
        self.inner.ns().clear_mode_bits(ino, clear)
    }

    pub async fn getxattr(&self, c: &Creds, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>> {
        self.inner.ns().check_xattr_access(c, ino, name, false)?;
        let state = self.inner.meta.state();
        state.node(ino).ok_or(FsError::NotFound)?.xattrs().get(name).cloned().ok_or(FsError::NoData)
    }

    /// Attribute names, each followed by a NUL, as listxattr returns them.
    pub async fn listxattr(&self, ino: Ino) -> FsResult<Vec<u8>> {
        let state = self.inner.meta.state();
        let node = state.node(ino).ok_or(FsError::NotFound)?;
        let mut out = Vec::new();
        for name in node.xattrs().keys() {
            out.extend_from_slice(name);
            out.push(0);
        }
        Ok(out)
    }

    pub async fn removexattr(&self, c: &Creds, ino: Ino, name: &[u8]) -> FsResult<()> {
        self.inner.ns().check_xattr_access(c, ino, name, true)?;
        let exists = self.inner.meta.state().node(ino).is_some_and(|n| n.xattrs().contains_key(name));
        if !exists {
            return Err(FsError::NoData);
        }
        self.inner.change().log(Record::XattrDelete { ino, name: Cow::Borrowed(name) })?;
        let t = self.inner.change().file_time();
        self.inner.change().update_inode(ino, |i| i.ctime = t)?;
        Ok(())
    }
}

/// SETATTR's mode, uid and gid, with chmod's and chown's rules.
fn change_mode_and_owner(c: &Creds, owner: bool, set: &SetAttr, new: &mut Inode) -> FsResult<()> {
    if let Some(mode) = set.mode {
        if !owner {
            return Err(FsError::Perm);
        }
        let mut mode = mode & 0o7777;
        if !c.kernel_checked() && c.uid != 0 && !c.in_group(new.gid) {
            mode &= !libc::S_ISGID;
        }
        new.mode = (new.mode & S_IFMT) | mode;
    }
    if set.uid.is_some() || set.gid.is_some() {
        let uid = set.uid.unwrap_or(new.uid);
        let gid = set.gid.unwrap_or(new.gid);
        let uid_ok = c.uid == 0 || (uid == new.uid && c.uid == new.uid);
        let gid_ok = c.uid == 0 || (gid == new.gid && owner) || (c.uid == new.uid && c.in_group(gid));
        if !c.kernel_checked() && (!uid_ok || !gid_ok) {
            return Err(FsError::Perm);
        }
        // chown clears set-id bits whoever does it (Linux's
        // ATTR_KILL_SUID); the kernel leaves that to us under
        // FUSE_HANDLE_KILLPRIV_V2.
        new.mode &= !setid_bits_to_clear(new.mode, true);
        new.uid = uid;
        new.gid = gid;
    }
    Ok(())
}
