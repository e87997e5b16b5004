//! The FUSE wire protocol (linux/fuse.h, protocol 7.31 and later): the
//! structures Linux sends and expects, parsed from untrusted bytes.
//!
//! Nothing here trusts the input: every read is bounds-checked, every
//! length is validated against the bytes actually present, and a bad
//! request is a [`ParseError`], never a panic. All integers are
//! little-endian, as on every architecture keelfs runs on.

/// The protocol version keelfs speaks.
pub const KERNEL_VERSION: u32 = 7;
pub const KERNEL_MINOR_VERSION: u32 = 39;
/// The oldest minor version keelfs accepts (Linux 5.4-era kernels).
pub const MIN_MINOR_VERSION: u32 = 31;

pub const IN_HEADER_BYTES: usize = 40;
pub const OUT_HEADER_BYTES: usize = 16;
pub const ATTR_BYTES: usize = 88;
pub const ENTRY_OUT_BYTES: usize = 40 + ATTR_BYTES;
pub const ATTR_OUT_BYTES: usize = 16 + ATTR_BYTES;
pub const INIT_OUT_BYTES: usize = 64;
pub const NAME_MAX: usize = 255;

/// Request opcodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Opcode {
    Lookup = 1,
    Forget = 2,
    Getattr = 3,
    Setattr = 4,
    Readlink = 5,
    Symlink = 6,
    Mknod = 8,
    Mkdir = 9,
    Unlink = 10,
    Rmdir = 11,
    Rename = 12,
    Link = 13,
    Open = 14,
    Read = 15,
    Write = 16,
    Statfs = 17,
    Release = 18,
    Fsync = 20,
    Setxattr = 21,
    Getxattr = 22,
    Listxattr = 23,
    Removexattr = 24,
    Flush = 25,
    Init = 26,
    Opendir = 27,
    Readdir = 28,
    Releasedir = 29,
    Fsyncdir = 30,
    Getlk = 31,
    Setlk = 32,
    Setlkw = 33,
    Access = 34,
    Create = 35,
    Interrupt = 36,
    Bmap = 37,
    Destroy = 38,
    Ioctl = 39,
    Poll = 40,
    NotifyReply = 41,
    BatchForget = 42,
    Fallocate = 43,
    Readdirplus = 44,
    Rename2 = 45,
    Lseek = 46,
    CopyFileRange = 47,
    SetupMapping = 48,
    RemoveMapping = 49,
    Syncfs = 50,
    Tmpfile = 51,
    Statx = 52,
}

impl Opcode {
    pub fn from_u32(v: u32) -> Option<Self> {
        use Opcode::*;
        const ALL: [Opcode; 50] = [
            Lookup,
            Forget,
            Getattr,
            Setattr,
            Readlink,
            Symlink,
            Mknod,
            Mkdir,
            Unlink,
            Rmdir,
            Rename,
            Link,
            Open,
            Read,
            Write,
            Statfs,
            Release,
            Fsync,
            Setxattr,
            Getxattr,
            Listxattr,
            Removexattr,
            Flush,
            Init,
            Opendir,
            Readdir,
            Releasedir,
            Fsyncdir,
            Getlk,
            Setlk,
            Setlkw,
            Access,
            Create,
            Interrupt,
            Bmap,
            Destroy,
            Ioctl,
            Poll,
            NotifyReply,
            BatchForget,
            Fallocate,
            Readdirplus,
            Rename2,
            Lseek,
            CopyFileRange,
            SetupMapping,
            RemoveMapping,
            Syncfs,
            Tmpfile,
            Statx,
        ];
        ALL.into_iter().find(|op| *op as u32 == v)
    }
}

/// INIT flags (fuse_init_in/out.flags, and flags2 shifted by 32).
pub mod init_flags {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const POSIX_LOCKS: u64 = 1 << 1;
    pub const ATOMIC_O_TRUNC: u64 = 1 << 3;
    pub const EXPORT_SUPPORT: u64 = 1 << 4;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const DONT_MASK: u64 = 1 << 6;
    pub const FLOCK_LOCKS: u64 = 1 << 10;
    pub const AUTO_INVAL_DATA: u64 = 1 << 12;
    pub const DO_READDIRPLUS: u64 = 1 << 13;
    pub const READDIRPLUS_AUTO: u64 = 1 << 14;
    pub const ASYNC_DIO: u64 = 1 << 15;
    pub const WRITEBACK_CACHE: u64 = 1 << 16;
    pub const PARALLEL_DIROPS: u64 = 1 << 18;
    pub const HANDLE_KILLPRIV: u64 = 1 << 19;
    pub const POSIX_ACL: u64 = 1 << 20;
    pub const MAX_PAGES: u64 = 1 << 22;
    pub const CACHE_SYMLINKS: u64 = 1 << 23;
    pub const EXPLICIT_INVAL_DATA: u64 = 1 << 25;
    pub const MAP_ALIGNMENT: u64 = 1 << 26;
    pub const INIT_EXT: u64 = 1 << 30;
    pub const INIT_RESERVED: u64 = 1 << 31;
    pub const SECURITY_CTX: u64 = 1 << 32;
    pub const HAS_INODE_DAX: u64 = 1 << 33;
    pub const CREATE_SUPP_GROUP: u64 = 1 << 34;
    pub const HAS_EXPIRE_ONLY: u64 = 1 << 35;
    pub const DIRECT_IO_ALLOW_MMAP: u64 = 1 << 36;
    /// FUSE_OVER_IO_URING (protocol 7.42): requests after INIT may come
    /// through io_uring ring entries (fuse-io-uring.rst).
    pub const OVER_IO_URING: u64 = 1 << 41;
    pub const SETXATTR_EXT: u64 = 1 << 29;
    pub const HANDLE_KILLPRIV_V2: u64 = 1 << 28;
}

/// fuse_open_out.open_flags.
pub mod open_flags {
    pub const DIRECT_IO: u32 = 1 << 0;
    pub const KEEP_CACHE: u32 = 1 << 1;
    pub const NONSEEKABLE: u32 = 1 << 2;
    pub const CACHE_DIR: u32 = 1 << 3;
    pub const STREAM: u32 = 1 << 4;
    pub const NOFLUSH: u32 = 1 << 5;
    pub const PARALLEL_DIRECT_WRITES: u32 = 1 << 6;
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("request is {have} bytes, its {what} needs {need}")]
    Short { what: &'static str, need: usize, have: usize },
    #[error("header length {claimed} does not match the {actual} bytes received")]
    LengthMismatch { claimed: u32, actual: usize },
    #[error("unknown opcode {0}")]
    UnknownOpcode(u32),
    #[error("name is empty or contains '/'")]
    BadName,
    #[error("name longer than 255 bytes")]
    NameTooLong,
    #[error("string is not NUL-terminated")]
    Unterminated,
    #[error("{0}")]
    Invalid(&'static str),
}

impl ParseError {
    /// The errno the reply carries.
    pub fn errno(&self) -> i32 {
        match self {
            ParseError::UnknownOpcode(_) => libc::ENOSYS,
            ParseError::BadName => libc::EINVAL,
            ParseError::NameTooLong => libc::ENAMETOOLONG,
            ParseError::Short { .. }
            | ParseError::LengthMismatch { .. }
            | ParseError::Unterminated
            | ParseError::Invalid(_) => libc::EINVAL,
        }
    }
}

/// A bounds-checked little-endian reader over request bytes.
pub struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, at: 0 }
    }
    pub fn remaining(&self) -> &'a [u8] {
        &self.buf[self.at..]
    }
    pub fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], ParseError> {
        let have = self.buf.len() - self.at;
        if have < n {
            return Err(ParseError::Short { what, need: n, have });
        }
        let s = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    pub fn u16(&mut self, what: &'static str) -> Result<u16, ParseError> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().expect("2 bytes")))
    }
    pub fn u32(&mut self, what: &'static str) -> Result<u32, ParseError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    pub fn u64(&mut self, what: &'static str) -> Result<u64, ParseError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    /// A NUL-terminated string (the NUL is consumed, not returned).
    pub fn cstr(&mut self) -> Result<&'a [u8], ParseError> {
        let rest = self.remaining();
        let nul = rest.iter().position(|&b| b == 0).ok_or(ParseError::Unterminated)?;
        self.at += nul + 1;
        Ok(&rest[..nul])
    }
    /// A NUL-terminated directory-entry name, validated.
    pub fn name(&mut self) -> Result<&'a [u8], ParseError> {
        let name = self.cstr()?;
        if name.len() > NAME_MAX {
            return Err(ParseError::NameTooLong);
        }
        if name.is_empty() || name.contains(&b'/') {
            return Err(ParseError::BadName);
        }
        Ok(name)
    }
}

/// fuse_in_header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    pub total_extlen: u16,
}

impl InHeader {
    /// Parse the header and check its length against the request: the
    /// first thing done with any request.
    pub fn parse(request: &[u8]) -> Result<(Self, &[u8]), ParseError> {
        Self::parse_with_extensions(request).map(|(h, body, _)| (h, body))
    }

    /// [`Self::parse`], also returning the request extensions that follow
    /// the body (`total_extlen` 8-byte units).
    pub fn parse_with_extensions(request: &[u8]) -> Result<(Self, &[u8], &[u8]), ParseError> {
        let mut c = Cursor::new(request);
        let h = Self::decode(&mut c)?;
        if h.len as usize != request.len() {
            return Err(ParseError::LengthMismatch { claimed: h.len, actual: request.len() });
        }
        let ext = usize::from(h.total_extlen) * 8;
        let body = c.remaining();
        if ext > body.len() {
            return Err(ParseError::Short { what: "request extensions", need: ext, have: body.len() });
        }
        let (body, extensions) = body.split_at(body.len() - ext);
        Ok((h, body, extensions))
    }

    /// The header's fields, its length not yet checked against anything.
    pub fn decode(c: &mut Cursor<'_>) -> Result<Self, ParseError> {
        // One length check for the whole header, then fixed offsets: every
        // request passes here, and a check (and error) per field cost about
        // 240 instructions a request under callgrind.
        let b: &[u8; IN_HEADER_BYTES] = c.take(IN_HEADER_BYTES, "in_header")?.try_into().expect("a whole header");
        let u16_at = |at: usize| u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"));
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        Ok(InHeader {
            len: u32_at(0),
            opcode: u32_at(4),
            unique: u64_at(8),
            nodeid: u64_at(16),
            uid: u32_at(24),
            gid: u32_at(28),
            pid: u32_at(32),
            total_extlen: u16_at(36),
        })
    }
}

/// fuse_ext_header.type of the supplementary-group extension. Types 0 to
/// 31 are a security context header, whose type field is its count.
const FUSE_EXT_GROUPS: u32 = 32;

/// The extensions of a request, as (type, payload), in order. Malformed
/// trailing bytes end the walk.
fn extensions_of(mut extensions: &[u8]) -> impl Iterator<Item = (u32, &[u8])> {
    std::iter::from_fn(move || {
        // Bounded: every step consumes at least 8 bytes.
        if extensions.len() < 8 {
            return None;
        }
        let size = u32::from_le_bytes(extensions[0..4].try_into().expect("4 bytes")) as usize;
        let kind = u32::from_le_bytes(extensions[4..8].try_into().expect("4 bytes"));
        if size < 8 || !size.is_multiple_of(8) || size > extensions.len() {
            return None;
        }
        let payload = &extensions[8..size];
        extensions = &extensions[size..];
        Some((kind, payload))
    })
}

/// The security contexts FUSE_SECURITY_CTX sends with a create, mkdir,
/// mknod, symlink or tmpfile: (xattr name, value) pairs for the new inode,
/// so that an SELinux guest labels it in the same transaction. Each is
/// fuse_secctx {size, padding}, the NUL-terminated name, then the value.
pub fn security_contexts(extensions: &[u8]) -> Vec<(&[u8], &[u8])> {
    let mut out = Vec::new();
    for (count, mut payload) in extensions_of(extensions).filter(|&(kind, _)| kind < FUSE_EXT_GROUPS) {
        for _ in 0..count {
            let Some(size) = payload.get(0..4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
            else {
                return out;
            };
            let rest = &payload[8.min(payload.len())..];
            let Some(nul) = rest.iter().position(|&b| b == 0) else { return out };
            let (name, value) = (&rest[..nul], &rest[nul + 1..]);
            if value.len() < size || name.is_empty() {
                return out;
            }
            out.push((name, &value[..size]));
            payload = &value[size..];
        }
    }
    out
}

/// The group FUSE_CREATE_SUPP_GROUP sends: the parent directory's group,
/// when the caller holds it as a supplementary group. Extensions that are
/// malformed or of other types are ignored.
pub fn supplementary_group(extensions: &[u8]) -> Option<u32> {
    let (_, groups) = extensions_of(extensions).find(|&(kind, _)| kind == FUSE_EXT_GROUPS)?;
    let count = u32::from_le_bytes(groups.get(0..4)?.try_into().expect("4 bytes"));
    let group = u32::from_le_bytes(groups.get(4..8)?.try_into().expect("4 bytes"));
    (count >= 1).then_some(group)
}

/// fuse_attr, as replies carry it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime: u64,
    pub mtime: u64,
    pub ctime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub ctimensec: u32,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
    pub flags: u32,
}

/// Building replies: fixed-size little-endian fields appended in order.
pub struct Reply {
    pub bytes: Vec<u8>,
}

/// Bytes a new [`Reply`] has room for: the largest fixed-size reply
/// (fuse_statx_out, 288 bytes; fuse_entry_out and fuse_open_out, 144)
/// and its header, so that building and finishing one allocates at most
/// once (never, with a buffer from the thread's pool).
pub const REPLY_ROOM: usize = OUT_HEADER_BYTES + 288;

impl Default for Reply {
    fn default() -> Self {
        Self { bytes: crate::bufpool::take(REPLY_ROOM) }
    }
}

impl Reply {
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn raw(&mut self, v: &[u8]) -> &mut Self {
        self.bytes.extend_from_slice(v);
        self
    }
    pub fn attr(&mut self, a: &Attr) -> &mut Self {
        self.u64(a.ino).u64(a.size).u64(a.blocks).u64(a.atime).u64(a.mtime).u64(a.ctime);
        self.u32(a.atimensec).u32(a.mtimensec).u32(a.ctimensec).u32(a.mode).u32(a.nlink);
        self.u32(a.uid).u32(a.gid).u32(a.rdev).u32(a.blksize).u32(a.flags)
    }
    /// fuse_entry_out.
    pub fn entry(&mut self, nodeid: u64, generation: u64, valid_ns: u64, attr: &Attr) -> &mut Self {
        let (s, ns) = (valid_ns / 1_000_000_000, (valid_ns % 1_000_000_000) as u32);
        self.u64(nodeid).u64(generation).u64(s).u64(s).u32(ns).u32(ns).attr(attr)
    }
    /// fuse_attr_out.
    pub fn attr_out(&mut self, valid_ns: u64, attr: &Attr) -> &mut Self {
        self.u64(valid_ns / 1_000_000_000).u32((valid_ns % 1_000_000_000) as u32).u32(0).attr(attr)
    }
    /// fuse_statx_out: the basic stats and the birth time (what keelfs
    /// keeps of struct statx), valid for `valid_ns`.
    pub fn statx_out(&mut self, valid_ns: u64, a: &Attr, btime: (u64, u32)) -> &mut Self {
        const STATX_BASIC_STATS: u32 = 0x7ff;
        const STATX_BTIME: u32 = 0x800;
        self.u64(valid_ns / 1_000_000_000).u32((valid_ns % 1_000_000_000) as u32).u32(0).raw(&[0u8; 16]);
        self.u32(STATX_BASIC_STATS | STATX_BTIME).u32(a.blksize).u64(0); // mask, blksize, attributes
        self.u32(a.nlink).u32(a.uid).u32(a.gid).u16(a.mode as u16).u16(0);
        self.u64(a.ino).u64(a.size).u64(a.blocks).u64(0); // attributes_mask
        for (sec, nsec) in [(a.atime, a.atimensec), btime, (a.ctime, a.ctimensec), (a.mtime, a.mtimensec)] {
            self.u64(sec).u32(nsec).u32(0);
        }
        // rdev in the kernel's new_encode_dev form, split; dev is the
        // kernel's to fill.
        let (major, minor) = ((a.rdev & 0xfff00) >> 8, (a.rdev & 0xff) | ((a.rdev >> 12) & 0xfff00));
        self.u32(major).u32(minor).u32(0).u32(0).raw(&[0u8; 14 * 8])
    }
    /// The whole reply: fuse_out_header then this body (none with an
    /// error), made in this reply's own buffer.
    pub fn finish(self, unique: u64, error: i32) -> Vec<u8> {
        let mut out = self.bytes;
        if error != 0 {
            out.clear();
        }
        let mut header = [0u8; OUT_HEADER_BYTES];
        header[..4].copy_from_slice(&((OUT_HEADER_BYTES + out.len()) as u32).to_le_bytes());
        header[4..8].copy_from_slice(&error.to_le_bytes());
        header[8..].copy_from_slice(&unique.to_le_bytes());
        let body = out.len();
        out.resize(OUT_HEADER_BYTES + body, 0);
        out.copy_within(..body, OUT_HEADER_BYTES);
        out[..OUT_HEADER_BYTES].copy_from_slice(&header);
        out
    }
}

/// A request as the kernel sends it: fuse_in_header, then `body`. For
/// test frontends and load generators.
pub fn encode_request(opcode: u32, unique: u64, nodeid: u64, uid: u32, gid: u32, body: &[u8]) -> Vec<u8> {
    let mut r = Reply::default();
    r.u32((IN_HEADER_BYTES + body.len()) as u32).u32(opcode).u64(unique).u64(nodeid);
    r.u32(uid).u32(gid).u32(0).u16(0).u16(0).raw(body);
    r.bytes
}

/// An error reply: a bare header carrying -errno.
pub fn error_reply(unique: u64, errno: i32) -> Vec<u8> {
    Reply::default().finish(unique, -errno.abs())
}

/// The `unique` of a request (fuse_in_header) or a reply
/// (fuse_out_header), which both keep at bytes 8..16; None when the
/// message is shorter than that.
pub fn unique_of(message: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(message.get(8..16)?.try_into().expect("8 bytes")))
}

/// The opcode of a request (fuse_in_header), unchecked; None when the
/// request is shorter than its header's first two fields.
pub fn opcode_of(request: &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(request.get(4..8)?.try_into().expect("4 bytes")))
}

/// A reply of a header and at most fuse_write_out, built in place
/// without allocating: what a READ or WRITE served in the transport's
/// memory answers. A READ's data is not in it: the header counts data
/// already placed after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShortReply {
    bytes: [u8; OUT_HEADER_BYTES + WRITE_OUT_BYTES],
    len: usize,
}

/// fuse_write_out.
pub const WRITE_OUT_BYTES: usize = 8;

impl ShortReply {
    /// The header alone, of a reply `total` bytes long.
    fn header(unique: u64, error: i32, total: usize) -> Self {
        debug_assert!(total >= OUT_HEADER_BYTES);
        let mut bytes = [0u8; OUT_HEADER_BYTES + WRITE_OUT_BYTES];
        bytes[0..4].copy_from_slice(&u32::try_from(total).unwrap_or(u32::MAX).to_le_bytes());
        bytes[4..8].copy_from_slice(&error.to_le_bytes());
        bytes[8..16].copy_from_slice(&unique.to_le_bytes());
        Self { bytes, len: OUT_HEADER_BYTES }
    }

    /// An error reply: the header alone.
    pub fn error(unique: u64, errno: i32) -> Self {
        Self::header(unique, -errno.abs(), OUT_HEADER_BYTES)
    }

    /// The header of a successful reply whose `data_len` bytes of data
    /// are already in place after it.
    pub fn data_header(unique: u64, data_len: usize) -> Self {
        Self::header(unique, 0, OUT_HEADER_BYTES.saturating_add(data_len))
    }

    /// A WRITE's reply: `written` bytes.
    pub fn written(unique: u64, written: u32) -> Self {
        let mut reply = Self::header(unique, 0, OUT_HEADER_BYTES + WRITE_OUT_BYTES);
        reply.bytes[OUT_HEADER_BYTES..OUT_HEADER_BYTES + 4].copy_from_slice(&written.to_le_bytes());
        reply.len += WRITE_OUT_BYTES;
        reply
    }

    /// The bytes to write where the reply starts.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// The whole reply's length, as its header declares it (the data
    /// placed after a READ's header included).
    pub fn total_len(&self) -> u32 {
        u32::from_le_bytes(self.bytes[0..4].try_into().expect("4 bytes"))
    }

    /// Whether this answers with an error.
    pub fn is_error(&self) -> bool {
        self.bytes[4..8] != [0; 4]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_and_opcode_are_read_from_either_header() {
        let request = encode_request(Opcode::Init as u32, 77, 1, 0, 0, &[0u8; 64]);
        assert_eq!((unique_of(&request), opcode_of(&request)), (Some(77), Some(Opcode::Init as u32)));
        assert_eq!(unique_of(&error_reply(78, libc::EIO)), Some(78));
        assert_eq!((unique_of(&request[..15]), opcode_of(&request[..7])), (None, None));
    }

    #[test]
    fn short_replies_match_the_reply_builder() {
        let written = ShortReply::written(9, 4096);
        let mut body = Reply::default();
        body.u32(4096).u32(0);
        assert_eq!(written.as_bytes(), &body.finish(9, 0)[..]);
        assert_eq!((written.total_len(), written.is_error()), (24, false));

        let error = ShortReply::error(9, libc::EBADF);
        assert_eq!(error.as_bytes(), &error_reply(9, libc::EBADF)[..]);
        assert_eq!((error.total_len(), error.is_error()), (16, true));

        let read = ShortReply::data_header(9, 3);
        let mut body = Reply::default();
        body.raw(b"abc");
        assert_eq!(read.as_bytes(), &body.finish(9, 0)[..OUT_HEADER_BYTES]);
        assert_eq!(read.total_len(), 19);
    }

    fn header(len: u32, opcode: u32, extlen: u16) -> Vec<u8> {
        let mut r = Reply::default();
        r.u32(len).u32(opcode).u64(7).u64(1).u32(1000).u32(1000).u32(42).u16(extlen).u16(0);
        r.bytes
    }

    #[test]
    fn header_parses_and_checks_its_length() {
        let mut req = header(40 + 6, Opcode::Lookup as u32, 0);
        req.extend_from_slice(b"hello\0");
        let (h, body) = InHeader::parse(&req).unwrap();
        assert_eq!((h.opcode, h.unique, h.nodeid, h.uid), (1, 7, 1, 1000));
        assert_eq!(Cursor::new(body).name().unwrap(), b"hello");
        let mut lying = header(100, 1, 0);
        lying.extend_from_slice(b"x\0");
        assert!(matches!(InHeader::parse(&lying), Err(ParseError::LengthMismatch { .. })));
        assert!(matches!(InHeader::parse(&req[..20]), Err(ParseError::Short { .. })));
        let ext = header(40, 1, 3);
        assert!(matches!(InHeader::parse(&ext), Err(ParseError::Short { .. })));
    }

    #[test]
    fn every_header_field_comes_from_its_own_bytes() {
        let mut r = Reply::default();
        r.u32(48).u32(0x0a0b_0c0d).u64(0x1122_3344_5566_7788).u64(0x0102_0304_0506_0708);
        r.u32(0xa1a2_a3a4).u32(0xb1b2_b3b4).u32(0xc1c2_c3c4).u16(1).u16(0xffff).raw(&[0; 8]);
        let mut c = Cursor::new(&r.bytes);
        let h = InHeader::decode(&mut c).unwrap();
        assert_eq!(
            (h.len, h.opcode, h.unique, h.nodeid),
            (48, 0x0a0b_0c0d, 0x1122_3344_5566_7788, 0x0102_0304_0506_0708)
        );
        assert_eq!((h.uid, h.gid, h.pid, h.total_extlen), (0xa1a2_a3a4, 0xb1b2_b3b4, 0xc1c2_c3c4, 1));
        assert_eq!(c.remaining().len(), 8, "the header is 40 bytes, padding included");
        for short in 0..IN_HEADER_BYTES {
            let err = InHeader::decode(&mut Cursor::new(&r.bytes[..short])).unwrap_err();
            assert_eq!(err, ParseError::Short { what: "in_header", need: IN_HEADER_BYTES, have: short });
        }
    }

    #[test]
    fn names_are_validated() {
        assert_eq!(Cursor::new(b"a/b\0").name(), Err(ParseError::BadName));
        assert_eq!(Cursor::new(b"\0").name(), Err(ParseError::BadName));
        assert_eq!(Cursor::new(b"abc").name(), Err(ParseError::Unterminated));
        let long = [vec![b'x'; 256], vec![0]].concat();
        assert_eq!(Cursor::new(&long).name(), Err(ParseError::NameTooLong));
        assert_eq!(ParseError::NameTooLong.errno(), libc::ENAMETOOLONG);
        let ok = [vec![b'x'; 255], vec![0]].concat();
        assert_eq!(Cursor::new(&ok).name().unwrap().len(), 255);
    }

    #[test]
    fn opcodes_round_trip_and_unknown_ones_are_refused() {
        for v in 0..100 {
            if let Some(op) = Opcode::from_u32(v) {
                assert_eq!(op as u32, v);
            }
        }
        assert_eq!(Opcode::from_u32(7), None, "7 is unused in the protocol");
        assert_eq!(Opcode::from_u32(4096), None);
        assert_eq!(ParseError::UnknownOpcode(4096).errno(), libc::ENOSYS);
    }

    #[test]
    fn the_supplementary_group_extension_is_read_and_bounded() {
        let ext = |size: u32, kind: u32, payload: &[u32]| {
            let mut v = [size, kind].iter().chain(payload).flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            v.resize(v.len().next_multiple_of(8), 0);
            v
        };
        assert_eq!(supplementary_group(&ext(16, FUSE_EXT_GROUPS, &[1, 2000])), Some(2000));
        // A security context first (types 0..31), then the groups.
        let both = [ext(16, 1, &[0, 0]), ext(16, FUSE_EXT_GROUPS, &[1, 7])].concat();
        assert_eq!(supplementary_group(&both), Some(7));
        assert_eq!(supplementary_group(&ext(16, FUSE_EXT_GROUPS, &[0, 2000])), None, "no groups");
        assert_eq!(supplementary_group(&ext(64, FUSE_EXT_GROUPS, &[1, 2000])), None, "size past the end");
        assert_eq!(supplementary_group(&ext(4, FUSE_EXT_GROUPS, &[1, 2000])), None, "size below a header");
        assert_eq!(supplementary_group(&[]), None);
    }

    #[test]
    fn replies_have_the_kernel_sizes() {
        let mut r = Reply::default();
        r.attr(&Attr::default());
        assert_eq!(r.bytes.len(), ATTR_BYTES);
        let mut e = Reply::default();
        e.entry(2, 1, 1_500_000_000, &Attr::default());
        assert_eq!(e.bytes.len(), ENTRY_OUT_BYTES);
        let mut a = Reply::default();
        a.attr_out(0, &Attr::default());
        assert_eq!(a.bytes.len(), ATTR_OUT_BYTES);
        let mut x = Reply::default();
        x.statx_out(0, &Attr::default(), (0, 0));
        assert_eq!(x.bytes.len(), 32 + 256, "sizeof(struct fuse_statx_out)");
        let reply = e.finish(9, 0);
        assert_eq!(u32::from_le_bytes(reply[..4].try_into().unwrap()) as usize, OUT_HEADER_BYTES + ENTRY_OUT_BYTES);
        let err = error_reply(9, libc::ENOENT);
        assert_eq!(err.len(), OUT_HEADER_BYTES);
        assert_eq!(i32::from_le_bytes(err[4..8].try_into().unwrap()), -libc::ENOENT);
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_parser() {
        let mut state = 0x1234_5678u64;
        for len in 0..200usize {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (state >> 33) as u8
                })
                .collect();
            if let Ok((_, body)) = InHeader::parse(&bytes) {
                let mut c = Cursor::new(body);
                let _ = c.name();
                let _ = c.u64("x");
            }
        }
    }
}
