//! FUSE requests decoded into typed values. Every field is read through
//! the bounds-checked [`Cursor`]; anything malformed is a [`ParseError`].

use keelfs_fs::{FallocateMode, Fh, FsResult, Ino, RenameMode, SeekTo, SetAttr, TimeSet, Timespec, XattrFlags};

use super::abi::{Cursor, InHeader, Opcode, ParseError, IN_HEADER_BYTES, OUT_HEADER_BYTES, WRITE_OUT_BYTES};

/// fuse_setattr_in.valid bits.
mod fattr {
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
    pub const ATIME: u32 = 1 << 4;
    pub const MTIME: u32 = 1 << 5;
    pub const FH: u32 = 1 << 6;
    pub const ATIME_NOW: u32 = 1 << 7;
    pub const MTIME_NOW: u32 = 1 << 8;
    pub const CTIME: u32 = 1 << 10;
    /// Clear set-id bits on truncate (FUSE_HANDLE_KILLPRIV_V2).
    pub const KILL_SUIDGID: u32 = 1 << 11;
}

/// fuse_write_in.write_flags: clear set-id bits (FUSE_HANDLE_KILLPRIV_V2).
pub const WRITE_KILL_SUIDGID: u32 = 1 << 2;
/// fuse_write_in.write_flags: pages written back from the client's
/// writeback cache (FUSE_WRITE_CACHE), not a write(2) of their own.
pub const WRITE_CACHE: u32 = 1 << 0;
/// fuse_open_in.open_flags: clear set-id bits on an O_TRUNC open.
pub const OPEN_KILL_SUIDGID: u32 = 1 << 0;
/// FITRIM, `_IOWR('X', 121, struct fstrim_range)`: the one ioctl served.
pub const FITRIM: u32 = 0xC018_5879;
/// struct fstrim_range { u64 start, len, minlen }.
pub const FSTRIM_RANGE_BYTES: usize = 24;
/// fuse_ioctl_in.flags: an unrestricted ioctl (CUSE), whose data the
/// server must ask for by retries; keelfs serves restricted ones only.
pub const IOCTL_UNRESTRICTED: u32 = 1 << 1;

/// fuse_setxattr_in.setxattr_flags: the caller is outside the file's
/// group, so setting an access ACL clears S_ISGID.
pub const SETXATTR_ACL_KILL_SGID: u32 = 1 << 0;
/// fuse_release_in.release_flags: the file's flock locks go with it.
pub const RELEASE_FLOCK_UNLOCK: u32 = 1 << 1;
/// fuse_lk_in.lk_flags: the lock is a flock(2) lock.
pub const LK_FLOCK: u32 = 1 << 0;

/// A lock request's fields (fuse_lk_in), as the wire gave them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockIn {
    pub op: LockOp,
    pub fh: Fh,
    pub owner: u64,
    pub start: u64,
    pub end: u64,
    /// F_RDLCK, F_WRLCK or F_UNLCK, checked by the dispatcher.
    pub kind: u32,
    pub pid: u32,
    /// FUSE_LK_FLOCK: a flock(2) lock, not a POSIX one.
    pub flock: bool,
}

/// Which lock request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockOp {
    /// F_GETLK: who stands in the way.
    Test,
    /// F_SETLK: take or release now, or EAGAIN.
    Set,
    /// F_SETLKW: take, waiting for the way to clear.
    SetWaiting,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request<'a> {
    Init {
        major: u32,
        minor: u32,
        max_readahead: u32,
        flags: u64,
    },
    Destroy,
    Lookup {
        name: &'a [u8],
    },
    Forget {
        nlookup: u64,
    },
    BatchForget {
        items: Vec<(Ino, u64)>,
    },
    Getattr,
    /// FUSE_STATX (7.39): getattr with the birth time.
    Statx,
    /// The FATTR mask read into what changes; `via_handle` is FATTR_FH (the
    /// caller holds an open handle, so truncation needs no write access).
    Setattr {
        set: SetAttr,
        via_handle: bool,
    },
    Readlink,
    Symlink {
        name: &'a [u8],
        target: &'a [u8],
    },
    Mknod {
        mode: u32,
        rdev: u32,
        umask: u32,
        name: &'a [u8],
    },
    Mkdir {
        mode: u32,
        umask: u32,
        name: &'a [u8],
    },
    Unlink {
        name: &'a [u8],
    },
    Rmdir {
        name: &'a [u8],
    },
    /// `mode` is an error for flags renameat2 refuses.
    Rename {
        newdir: Ino,
        mode: FsResult<RenameMode>,
        name: &'a [u8],
        newname: &'a [u8],
    },
    Link {
        oldnodeid: Ino,
        newname: &'a [u8],
    },
    Open {
        flags: u32,
        open_flags: u32,
    },
    Opendir {
        flags: u32,
    },
    Create {
        flags: u32,
        mode: u32,
        umask: u32,
        open_flags: u32,
        name: &'a [u8],
    },
    /// O_TMPFILE in the directory `nodeid`: fuse_create_in, then a name
    /// the kernel makes up ("/"), ignored.
    Tmpfile {
        flags: u32,
        mode: u32,
        umask: u32,
    },
    Read {
        fh: Fh,
        offset: u64,
        size: u32,
    },
    Write {
        fh: Fh,
        offset: u64,
        write_flags: u32,
        data: &'a [u8],
    },
    Readdir {
        fh: Fh,
        offset: u64,
        size: u32,
        plus: bool,
    },
    Statfs,
    Release {
        fh: Fh,
        /// FUSE_RELEASE_FLOCK_UNLOCK was set: the file's flock locks go.
        flock_unlock: bool,
        lock_owner: u64,
    },
    Releasedir {
        fh: Fh,
    },
    /// A close(2): the closing process's POSIX locks go.
    Flush {
        fh: Fh,
        lock_owner: u64,
    },
    /// GETLK, SETLK and SETLKW (fuse_lk_in).
    Lock(LockIn),
    Fsync {
        fh: Fh,
        datasync: bool,
        dir: bool,
    },
    Setxattr {
        flags: XattrFlags,
        setxattr_flags: u32,
        name: &'a [u8],
        value: &'a [u8],
    },
    Getxattr {
        size: u32,
        name: &'a [u8],
    },
    Listxattr {
        size: u32,
    },
    Removexattr {
        name: &'a [u8],
    },
    Access {
        mask: u32,
    },
    Interrupt {
        unique: u64,
    },
    /// `mode` is an error for a mode keelfs does not implement.
    Fallocate {
        fh: Fh,
        offset: u64,
        length: u64,
        mode: FsResult<FallocateMode>,
    },
    /// `to` is None for a whence other than SEEK_DATA and SEEK_HOLE.
    Lseek {
        fh: Fh,
        offset: u64,
        to: Option<SeekTo>,
    },
    Syncfs,
    /// FUSE_COPY_FILE_RANGE from `nodeid`'s handle `fh_in`.
    CopyFileRange {
        fh_in: Fh,
        off_in: u64,
        nodeid_out: Ino,
        fh_out: Fh,
        off_out: u64,
        len: u64,
        flags: u64,
    },
    /// FUSE_IOCTL, a restricted one (the kernel sized its data from the
    /// command): `input` is the in_size bytes that followed.
    Ioctl {
        fh: Fh,
        flags: u32,
        cmd: u32,
        input: &'a [u8],
        out_size: u32,
    },
    /// A known opcode keelfs does not implement: the reply is ENOSYS.
    Unsupported(Opcode),
}

impl Request<'_> {
    /// Whether the request would change the filesystem: refused with
    /// EROFS on a read-only export. Opening for writing or truncation
    /// counts, as on a read-only Linux mount.
    pub fn modifies(&self) -> bool {
        match self {
            Request::Setattr { .. }
            | Request::Symlink { .. }
            | Request::Mknod { .. }
            | Request::Mkdir { .. }
            | Request::Unlink { .. }
            | Request::Rmdir { .. }
            | Request::Rename { .. }
            | Request::Link { .. }
            | Request::Create { .. }
            | Request::Tmpfile { .. }
            | Request::Write { .. }
            | Request::Setxattr { .. }
            | Request::Removexattr { .. }
            | Request::Fallocate { .. }
            | Request::CopyFileRange { .. } => true,
            // An fstrim changes no data, but writes to the device.
            Request::Ioctl { cmd, .. } => *cmd == FITRIM,
            Request::Open { flags, .. } => {
                let flags = *flags as i32;
                flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0
            }
            _ => false,
        }
    }
}

/// Largest batch of forgets accepted in one request.
const BATCH_FORGET_MAX: u32 = 1 << 16;

/// Decode a request body. `setxattr_ext` says whether the extended
/// fuse_setxattr_in was negotiated.
// A flat table, one arm per opcode, each the layout of that opcode's
// body: split, it would scatter the one place that reads the wire format.
#[allow(clippy::too_many_lines)]
pub fn parse<'a>(header: &InHeader, body: &'a [u8], setxattr_ext: bool) -> Result<Request<'a>, ParseError> {
    let op = Opcode::from_u32(header.opcode).ok_or(ParseError::UnknownOpcode(header.opcode))?;
    let mut c = Cursor::new(body);
    let r = match op {
        Opcode::Init => {
            let major = c.u32("init.major")?;
            let minor = c.u32("init.minor")?;
            let max_readahead = c.u32("init.max_readahead")?;
            let flags = u64::from(c.u32("init.flags")?);
            // flags2 exists from 7.36 on.
            let flags2 = if minor >= 36 { u64::from(c.u32("init.flags2")?) } else { 0 };
            Request::Init { major, minor, max_readahead, flags: flags | (flags2 << 32) }
        }
        Opcode::Destroy => Request::Destroy,
        Opcode::Lookup => Request::Lookup { name: c.name()? },
        Opcode::Forget => Request::Forget { nlookup: c.u64("forget.nlookup")? },
        Opcode::BatchForget => {
            let count = c.u32("batch_forget.count")?;
            c.u32("batch_forget.dummy")?;
            if count > BATCH_FORGET_MAX {
                return Err(ParseError::Invalid("batch forget count too large"));
            }
            let mut items = Vec::with_capacity(count as usize);
            for _ in 0..count {
                items.push((Ino::new(c.u64("forget_one.nodeid")?), c.u64("forget_one.nlookup")?));
            }
            Request::BatchForget { items }
        }
        Opcode::Getattr => Request::Getattr,
        Opcode::Statx => {
            // getattr_flags, reserved, fh, sx_flags, sx_mask: keelfs
            // answers every basic field and btime whatever was asked.
            c.take(4 + 4 + 8 + 4 + 4, "statx_in")?;
            Request::Statx
        }
        Opcode::Setattr => parse_setattr(&mut c)?,
        Opcode::Readlink => Request::Readlink,
        Opcode::Symlink => {
            let name = c.name()?;
            let target = c.cstr()?;
            Request::Symlink { name, target }
        }
        Opcode::Mknod => {
            let (mode, rdev, umask) = (c.u32("mknod.mode")?, c.u32("mknod.rdev")?, c.u32("mknod.umask")?);
            c.u32("mknod.padding")?;
            Request::Mknod { mode, rdev, umask, name: c.name()? }
        }
        Opcode::Mkdir => {
            let (mode, umask) = (c.u32("mkdir.mode")?, c.u32("mkdir.umask")?);
            Request::Mkdir { mode, umask, name: c.name()? }
        }
        Opcode::Unlink => Request::Unlink { name: c.name()? },
        Opcode::Rmdir => Request::Rmdir { name: c.name()? },
        Opcode::Rename => {
            let newdir = c.u64("rename.newdir")?;
            Request::Rename {
                newdir: Ino::new(newdir),
                mode: Ok(RenameMode::Replace),
                name: c.name()?,
                newname: c.name()?,
            }
        }
        Opcode::Rename2 => {
            let newdir = c.u64("rename2.newdir")?;
            let mode = RenameMode::from_linux(c.u32("rename2.flags")?);
            c.u32("rename2.padding")?;
            Request::Rename { newdir: Ino::new(newdir), mode, name: c.name()?, newname: c.name()? }
        }
        Opcode::Link => {
            let oldnodeid = c.u64("link.oldnodeid")?;
            Request::Link { oldnodeid: Ino::new(oldnodeid), newname: c.name()? }
        }
        Opcode::Open | Opcode::Opendir => {
            let flags = c.u32("open.flags")?;
            let open_flags = c.u32("open.open_flags")?;
            if op == Opcode::Open {
                Request::Open { flags, open_flags }
            } else {
                Request::Opendir { flags }
            }
        }
        Opcode::Create => {
            let (flags, mode, umask) = (c.u32("create.flags")?, c.u32("create.mode")?, c.u32("create.umask")?);
            let open_flags = c.u32("create.open_flags")?;
            Request::Create { flags, mode, umask, open_flags, name: c.name()? }
        }
        Opcode::Tmpfile => {
            let (flags, mode, umask) = (c.u32("tmpfile.flags")?, c.u32("tmpfile.mode")?, c.u32("tmpfile.umask")?);
            c.u32("tmpfile.open_flags")?;
            Request::Tmpfile { flags, mode, umask }
        }
        Opcode::Read | Opcode::Readdir | Opcode::Readdirplus => {
            let (fh, offset, size) = parse_read_in(&mut c)?;
            match op {
                Opcode::Read => Request::Read { fh: Fh::new(fh), offset, size },
                _ => Request::Readdir { fh: Fh::new(fh), offset, size, plus: op == Opcode::Readdirplus },
            }
        }
        Opcode::Write => {
            let (fh, offset, size, write_flags) = parse_write_in(&mut c)?;
            let data = c.take(size as usize, "write data")?;
            Request::Write { fh: Fh::new(fh), offset, write_flags, data }
        }
        Opcode::Statfs => Request::Statfs,
        Opcode::Release | Opcode::Releasedir => {
            let fh = c.u64("release.fh")?;
            c.u32("release.flags")?;
            let release_flags = c.u32("release.release_flags")?;
            let lock_owner = c.u64("release.lock_owner")?;
            if op == Opcode::Release {
                Request::Release {
                    fh: Fh::new(fh),
                    flock_unlock: release_flags & RELEASE_FLOCK_UNLOCK != 0,
                    lock_owner,
                }
            } else {
                Request::Releasedir { fh: Fh::new(fh) }
            }
        }
        Opcode::Flush => {
            let fh = c.u64("flush.fh")?;
            c.take(8, "flush_in")?;
            Request::Flush { fh: Fh::new(fh), lock_owner: c.u64("flush.lock_owner")? }
        }
        Opcode::Getlk | Opcode::Setlk | Opcode::Setlkw => parse_lock(&mut c, op)?,
        Opcode::Fsync | Opcode::Fsyncdir => {
            let fh = c.u64("fsync.fh")?;
            let flags = c.u32("fsync.flags")?;
            c.u32("fsync.padding")?;
            Request::Fsync { fh: Fh::new(fh), datasync: flags & 1 != 0, dir: op == Opcode::Fsyncdir }
        }
        Opcode::Setxattr => {
            let size = c.u32("setxattr.size")?;
            let flags = XattrFlags::from_linux(c.u32("setxattr.flags")?);
            let mut setxattr_flags = 0;
            if setxattr_ext {
                setxattr_flags = c.u32("setxattr.setxattr_flags")?;
                c.u32("setxattr.padding")?;
            }
            let name = c.cstr()?;
            let value = c.take(size as usize, "xattr value")?;
            Request::Setxattr { flags, setxattr_flags, name, value }
        }
        Opcode::Getxattr => {
            let size = c.u32("getxattr.size")?;
            c.u32("getxattr.padding")?;
            Request::Getxattr { size, name: c.cstr()? }
        }
        Opcode::Listxattr => {
            let size = c.u32("listxattr.size")?;
            c.u32("listxattr.padding")?;
            Request::Listxattr { size }
        }
        Opcode::Removexattr => Request::Removexattr { name: c.cstr()? },
        Opcode::Access => {
            let mask = c.u32("access.mask")?;
            Request::Access { mask }
        }
        Opcode::Interrupt => Request::Interrupt { unique: c.u64("interrupt.unique")? },
        Opcode::Fallocate => {
            let (fh, offset, length) = (c.u64("fallocate.fh")?, c.u64("fallocate.offset")?, c.u64("fallocate.length")?);
            Request::Fallocate {
                fh: Fh::new(fh),
                offset,
                length,
                mode: FallocateMode::from_linux(c.u32("fallocate.mode")?),
            }
        }
        Opcode::Lseek => {
            let (fh, offset) = (c.u64("lseek.fh")?, c.u64("lseek.offset")?);
            Request::Lseek { fh: Fh::new(fh), offset, to: SeekTo::from_whence(c.u32("lseek.whence")?) }
        }
        Opcode::Syncfs => Request::Syncfs,
        Opcode::CopyFileRange => Request::CopyFileRange {
            fh_in: Fh::new(c.u64("copy_file_range.fh_in")?),
            off_in: c.u64("copy_file_range.off_in")?,
            nodeid_out: Ino::new(c.u64("copy_file_range.nodeid_out")?),
            fh_out: Fh::new(c.u64("copy_file_range.fh_out")?),
            off_out: c.u64("copy_file_range.off_out")?,
            len: c.u64("copy_file_range.len")?,
            flags: c.u64("copy_file_range.flags")?,
        },
        Opcode::Ioctl => {
            let (fh, flags, cmd) = (c.u64("ioctl.fh")?, c.u32("ioctl.flags")?, c.u32("ioctl.cmd")?);
            c.u64("ioctl.arg")?;
            let (in_size, out_size) = (c.u32("ioctl.in_size")?, c.u32("ioctl.out_size")?);
            let input = c.take(in_size as usize, "ioctl input")?;
            Request::Ioctl { fh: Fh::new(fh), flags, cmd, input, out_size }
        }
        other => Request::Unsupported(other),
    };
    Ok(r)
}

fn parse_read_in(c: &mut Cursor<'_>) -> Result<(u64, u64, u32), ParseError> {
    let fh = c.u64("read.fh")?;
    let offset = c.u64("read.offset")?;
    let size = c.u32("read.size")?;
    c.take(4 + 8 + 4 + 4, "read_in")?;
    Ok((fh, offset, size))
}

/// fuse_write_in: (fh, offset, size, write_flags).
fn parse_write_in(c: &mut Cursor<'_>) -> Result<(u64, u64, u32, u32), ParseError> {
    let fh = c.u64("write.fh")?;
    let offset = c.u64("write.offset")?;
    let size = c.u32("write.size")?;
    let write_flags = c.u32("write.write_flags")?;
    c.take(8 + 4 + 4, "write_in")?;
    Ok((fh, offset, size, write_flags))
}

/// Where a READ's or WRITE's `size` sits: 16 bytes into fuse_read_in or
/// fuse_write_in.
pub const IO_SIZE_AT: usize = IN_HEADER_BYTES + 16;

/// The `size` of the READ or WRITE whose first bytes are `prefix`,
/// unchecked (the request path checks it); None when `prefix` ends
/// before it.
pub fn io_size_of(prefix: &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(prefix.get(IO_SIZE_AT..IO_SIZE_AT + 4)?.try_into().expect("4 bytes")))
}

/// Where a COPY_FILE_RANGE's fields sit: fuse_in_header, then fh_in,
/// off_in, nodeid_out, fh_out, off_out, len and flags, 8 bytes each.
const COPY_RANGE_OFF_IN_AT: usize = IN_HEADER_BYTES + 8;
const COPY_RANGE_OFF_OUT_AT: usize = IN_HEADER_BYTES + 32;
const COPY_RANGE_LEN_AT: usize = IN_HEADER_BYTES + 40;
/// Bytes of a COPY_FILE_RANGE through its length.
pub const COPY_RANGE_PREFIX_BYTES: usize = COPY_RANGE_LEN_AT + 8;

/// The (off_in, off_out, len) of the COPY_FILE_RANGE whose first bytes
/// are `prefix`, unchecked; None when `prefix` ends before them.
pub fn copy_range_of(prefix: &[u8]) -> Option<(u64, u64, u64)> {
    let field = |at: usize| Some(u64::from_le_bytes(prefix.get(at..at + 8)?.try_into().expect("8 bytes")));
    Some((field(COPY_RANGE_OFF_IN_AT)?, field(COPY_RANGE_OFF_OUT_AT)?, field(COPY_RANGE_LEN_AT)?))
}

/// fuse_read_in and fuse_write_in are both 40 bytes.
pub const IO_IN_BYTES: usize = 40;
const _: () = assert!(IO_IN_BYTES == 8 + 8 + 4 + 4 + 8 + 4 + 4);

/// What a transport reads of a READ or WRITE before its data:
/// fuse_in_header, then fuse_read_in or fuse_write_in.
pub const IO_PREFIX_BYTES: usize = IN_HEADER_BYTES + IO_IN_BYTES;

/// A READ or WRITE whose data stays in the transport's memory (guest
/// pages), parsed from its fixed-size prefix alone: the data is never
/// copied to be parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InPlaceIo {
    pub write: bool,
    pub unique: u64,
    pub nodeid: Ino,
    pub fh: Fh,
    pub offset: u64,
    /// Bytes to write, or to read at most. Never 0.
    pub size: u32,
    /// fuse_write_in.write_flags; 0 for a READ.
    pub write_flags: u32,
    pub uid: u32,
    pub gid: u32,
}

impl InPlaceIo {
    /// The READ or WRITE that `prefix` starts, in a request of `len`
    /// bytes. None for any other request, for an empty one, one with
    /// extensions, or one whose lengths disagree: the copying path then
    /// parses the whole request and answers it, errors included.
    pub fn parse(prefix: &[u8; IO_PREFIX_BYTES], len: usize) -> Option<Self> {
        let mut c = Cursor::new(prefix);
        let h = InHeader::decode(&mut c).ok()?;
        let write = match Opcode::from_u32(h.opcode)? {
            Opcode::Write => true,
            Opcode::Read => false,
            _ => return None,
        };
        let (fh, offset, size, write_flags) = match write {
            true => parse_write_in(&mut c).ok()?,
            false => parse_read_in(&mut c).ok().map(|(fh, offset, size)| (fh, offset, size, 0))?,
        };
        debug_assert!(c.remaining().is_empty());
        let (unique, nodeid, fh, uid, gid) = (h.unique, Ino::new(h.nodeid), Fh::new(fh), h.uid, h.gid);
        let io = Self { write, unique, nodeid, fh, offset, size, write_flags, uid, gid };
        let agrees = h.len as usize == len && len == io.request_len() && h.total_extlen == 0;
        (agrees && size != 0).then_some(io)
    }

    /// The whole request's length: the prefix, then a WRITE's data.
    pub fn request_len(&self) -> usize {
        IO_PREFIX_BYTES + if self.write { self.size as usize } else { 0 }
    }

    /// The room its reply needs: a header, then fuse_write_out or the
    /// data read.
    pub fn reply_room(&self) -> usize {
        OUT_HEADER_BYTES + if self.write { WRITE_OUT_BYTES } else { self.size as usize }
    }

    /// Where the data sits: a WRITE's after the prefix of the request,
    /// a READ's after the header of the reply.
    pub fn data_at(&self) -> usize {
        if self.write {
            IO_PREFIX_BYTES
        } else {
            OUT_HEADER_BYTES
        }
    }
}

/// fuse_lk_in: fh, owner, fuse_file_lock {start, end, type, pid},
/// lk_flags, padding.
fn parse_lock<'a>(c: &mut Cursor<'_>, op: Opcode) -> Result<Request<'a>, ParseError> {
    let (fh, owner) = (Fh::new(c.u64("lk.fh")?), c.u64("lk.owner")?);
    let (start, end) = (c.u64("lk.start")?, c.u64("lk.end")?);
    let (kind, pid) = (c.u32("lk.type")?, c.u32("lk.pid")?);
    let flock = c.u32("lk.lk_flags")? & LK_FLOCK != 0;
    c.u32("lk.padding")?;
    let op = match op {
        Opcode::Getlk => LockOp::Test,
        Opcode::Setlk => LockOp::Set,
        _ => LockOp::SetWaiting,
    };
    Ok(Request::Lock(LockIn { op, fh, owner, start, end, kind, pid, flock }))
}

fn parse_setattr<'a>(c: &mut Cursor<'_>) -> Result<Request<'a>, ParseError> {
    let valid = c.u32("setattr.valid")?;
    c.u32("setattr.padding")?;
    c.u64("setattr.fh")?;
    let size = c.u64("setattr.size")?;
    c.u64("setattr.lock_owner")?;
    let (atime, mtime, ctime) = (c.u64("setattr.atime")?, c.u64("setattr.mtime")?, c.u64("setattr.ctime")?);
    let (atimensec, mtimensec, ctimensec) =
        (c.u32("setattr.atimensec")?, c.u32("setattr.mtimensec")?, c.u32("setattr.ctimensec")?);
    let mode = c.u32("setattr.mode")?;
    c.u32("setattr.unused4")?;
    let (uid, gid) = (c.u32("setattr.uid")?, c.u32("setattr.gid")?);
    c.u32("setattr.unused5")?;
    if atimensec >= 1_000_000_000 || mtimensec >= 1_000_000_000 || ctimensec >= 1_000_000_000 {
        return Err(ParseError::Invalid("nanoseconds out of range"));
    }
    let set = |bit: u32| valid & bit != 0;
    let time = |given: bool, now: bool, sec: u64, nsec: u32| {
        if now {
            Some(TimeSet::Now)
        } else if given {
            Some(TimeSet::At(Timespec { sec: sec as i64, nsec }))
        } else {
            None
        }
    };
    let set_attr = SetAttr {
        mode: set(fattr::MODE).then_some(mode),
        uid: set(fattr::UID).then_some(uid),
        gid: set(fattr::GID).then_some(gid),
        size: set(fattr::SIZE).then_some(size),
        atime: time(set(fattr::ATIME), set(fattr::ATIME_NOW), atime, atimensec),
        mtime: time(set(fattr::MTIME), set(fattr::MTIME_NOW), mtime, mtimensec),
        ctime: set(fattr::CTIME).then_some(Timespec { sec: ctime as i64, nsec: ctimensec }),
        kill_setid: set(fattr::KILL_SUIDGID),
    };
    Ok(Request::Setattr { set: set_attr, via_handle: set(fattr::FH) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A READ's or WRITE's prefix, and the whole request's length.
    fn io_request(opcode: Opcode, size: u32, data: usize) -> ([u8; IO_PREFIX_BYTES], usize) {
        let mut body = Vec::new();
        for word in [7u64, 8192] {
            body.extend_from_slice(&word.to_le_bytes()); // fh, offset
        }
        body.extend_from_slice(&size.to_le_bytes());
        body.extend_from_slice(&super::WRITE_KILL_SUIDGID.to_le_bytes());
        body.extend_from_slice(&[0u8; 16]);
        body.resize(body.len() + data, 0xaa);
        let request = super::super::abi::encode_request(opcode as u32, 3, 5, 1000, 100, &body);
        (request[..IO_PREFIX_BYTES].try_into().unwrap(), request.len())
    }

    #[test]
    fn in_place_io_is_parsed_from_its_prefix_and_checked_against_the_length() {
        let (prefix, len) = io_request(Opcode::Write, 4096, 4096);
        let io = InPlaceIo::parse(&prefix, len).expect("a WRITE");
        let (fh, nodeid) = (Fh::new(7), Ino::new(5));
        let expected = InPlaceIo {
            write: true,
            unique: 3,
            nodeid,
            fh,
            offset: 8192,
            size: 4096,
            write_flags: WRITE_KILL_SUIDGID,
            uid: 1000,
            gid: 100,
        };
        assert_eq!(io, expected);
        assert_eq!((io.request_len(), io.reply_room(), io.data_at()), (len, 24, IO_PREFIX_BYTES));
        assert_eq!(InPlaceIo::parse(&prefix, len - 1), None, "a length the header does not declare");

        let (prefix, len) = io_request(Opcode::Write, 4096, 4095);
        assert_eq!(InPlaceIo::parse(&prefix, len), None, "less data than the size");
        let (prefix, len) = io_request(Opcode::Write, 0, 0);
        assert_eq!(InPlaceIo::parse(&prefix, len), None, "an empty write");

        let (prefix, len) = io_request(Opcode::Read, 1 << 20, 0);
        let io = InPlaceIo::parse(&prefix, len).expect("a READ");
        assert_eq!((io.write, io.write_flags, io.size), (false, 0, 1 << 20));
        assert_eq!((io.request_len(), io.reply_room(), io.data_at()), (len, 16 + (1 << 20), 16));
        let (prefix, len) = io_request(Opcode::Read, 4096, 8);
        assert_eq!(InPlaceIo::parse(&prefix, len), None, "a READ with a tail");

        let (prefix, len) = io_request(Opcode::Fsync, 4096, 0);
        assert_eq!(InPlaceIo::parse(&prefix, len), None, "not a READ or WRITE");
        let (mut prefix, len) = io_request(Opcode::Read, 4096, 0);
        prefix[36] = 1; // total_extlen
        assert_eq!(InPlaceIo::parse(&prefix, len), None, "extensions");
    }

    fn setattr_body(valid: u32) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&valid.to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        for word in [7u64, 4096, 0, 11, 22, 33] {
            b.extend_from_slice(&word.to_le_bytes()); // fh, size, lock_owner, atime, mtime, ctime
        }
        for word in [1u32, 2, 3, 0o4755, 0, 1000, 100, 0] {
            b.extend_from_slice(&word.to_le_bytes()); // nsecs, mode, unused, uid, gid, unused
        }
        b
    }

    fn parse_setattr_body(valid: u32) -> (SetAttr, bool) {
        let body = setattr_body(valid);
        let header = InHeader {
            len: 40 + body.len() as u32,
            opcode: Opcode::Setattr as u32,
            unique: 1,
            nodeid: 1,
            uid: 0,
            gid: 0,
            pid: 0,
            total_extlen: 0,
        };
        let Request::Setattr { set, via_handle } = parse(&header, &body, false).unwrap() else {
            panic!("not a setattr")
        };
        (set, via_handle)
    }

    fn header(opcode: Opcode, body: &[u8]) -> InHeader {
        InHeader {
            len: 40 + body.len() as u32,
            opcode: opcode as u32,
            unique: 1,
            nodeid: 1,
            uid: 0,
            gid: 0,
            pid: 0,
            total_extlen: 0,
        }
    }

    /// fuse_ioctl_in.flags: the ioctl was made on a directory.
    const IOCTL_DIR: u32 = 1 << 4;

    fn ioctl_body(cmd: u32, in_size: u32, input: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&9u64.to_le_bytes()); // fh
        b.extend_from_slice(&IOCTL_DIR.to_le_bytes());
        b.extend_from_slice(&cmd.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes()); // arg
        b.extend_from_slice(&in_size.to_le_bytes());
        b.extend_from_slice(&24u32.to_le_bytes()); // out_size
        b.extend_from_slice(input);
        b
    }

    #[test]
    fn ioctl_carries_its_input_and_a_short_one_is_an_error() {
        let range = [7u8; 24];
        let body = ioctl_body(FITRIM, 24, &range);
        let req = parse(&header(Opcode::Ioctl, &body), &body, false).unwrap();
        assert_eq!(req, Request::Ioctl { fh: Fh::new(9), flags: IOCTL_DIR, cmd: FITRIM, input: &range, out_size: 24 });
        assert!(req.modifies());
        // in_size larger than what came: refused, not read past the end.
        let body = ioctl_body(FITRIM, 4096, &range);
        assert!(parse(&header(Opcode::Ioctl, &body), &body, false).is_err());
        let body = ioctl_body(FITRIM, 24, &range)[..20].to_vec();
        assert!(parse(&header(Opcode::Ioctl, &body), &body, false).is_err());
        let body = ioctl_body(0x5401, 0, &[]);
        assert!(!parse(&header(Opcode::Ioctl, &body), &body, false).unwrap().modifies(), "only FITRIM writes");
    }

    /// The FATTR mask becomes a SetAttr where the request is parsed: only
    /// what the mask names changes, and *_NOW wins over a given time.
    #[test]
    fn setattr_masks_become_a_set_attr() {
        let all = fattr::MODE | fattr::UID | fattr::SIZE | fattr::ATIME | fattr::MTIME_NOW | fattr::CTIME;
        let (set, via_handle) = parse_setattr_body(all | fattr::FH);
        assert!(via_handle);
        assert_eq!(
            set,
            SetAttr {
                mode: Some(0o4755),
                uid: Some(1000),
                gid: None,
                size: Some(4096),
                atime: Some(TimeSet::At(Timespec { sec: 11, nsec: 1 })),
                mtime: Some(TimeSet::Now),
                ctime: Some(Timespec { sec: 33, nsec: 3 }),
                kill_setid: false,
            }
        );
        let (set, via_handle) = parse_setattr_body(fattr::GID | fattr::KILL_SUIDGID);
        assert!(!via_handle);
        assert_eq!(set, SetAttr { gid: Some(100), kill_setid: true, ..SetAttr::default() });
    }
}
