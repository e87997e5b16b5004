//! Filesystem errors, each mapping to the POSIX errno a caller expects.

use keelfs_bdev::BdevError;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    Exists,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("permission denied")]
    Access,
    #[error("operation not permitted")]
    Perm,
    #[error("name too long")]
    NameTooLong,
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    #[error("no space left on device")]
    NoSpace,
    /// The filesystem's quota, not its device, is full.
    #[error("disk quota exceeded")]
    Quota,
    #[error("no such attribute")]
    NoData,
    #[error("result too large")]
    Range,
    #[error("too many links")]
    TooManyLinks,
    #[error("bad file handle")]
    BadHandle,
    #[error("stale inode")]
    Stale,
    #[error("file too large")]
    FileTooBig,
    #[error("operation not supported")]
    Unsupported,
    #[error("too many levels of symbolic links")]
    Loop,
    #[error("offset beyond the end of the file")]
    Nxio,
    #[error("read-only filesystem")]
    ReadOnly,
    /// One of a kind that runs alone is running already (an fstrim).
    #[error("device or resource busy")]
    Busy,
    #[error("device I/O failed: {0}")]
    Io(#[from] BdevError),
    #[error("filesystem is damaged: {0}")]
    Corrupt(String),
    /// A data block read from the device does not match its checksum, or
    /// its checksum is unreadable (issue 38): the read fails, as EIO.
    #[error("inode {ino} at offset {offset}: device block {block} does not match its data checksum")]
    ChecksumMismatch { ino: crate::Ino, offset: u64, block: u64 },
}

/// One owner's claim on a run of device blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockClaim {
    pub start: u64,
    pub len: u64,
    /// Who claims it, for the message: "inode 12 file block 3", "the free list".
    pub owner: String,
}

/// Two owners claim one block: what `Inspect::check_block_ownership` finds in a
/// filesystem that lost track of its space.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "blocks [{}, +{}) ({}) overlap [{}, +{}) ({})",
    first.start, first.len, first.owner, second.start, second.len, second.owner
)]
pub struct DoubleOwner {
    pub first: BlockClaim,
    pub second: BlockClaim,
}

impl FsError {
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::Exists => libc::EEXIST,
            FsError::NotDir => libc::ENOTDIR,
            FsError::IsDir => libc::EISDIR,
            FsError::NotEmpty => libc::ENOTEMPTY,
            FsError::Access => libc::EACCES,
            FsError::Perm => libc::EPERM,
            FsError::NameTooLong => libc::ENAMETOOLONG,
            FsError::Invalid(_) => libc::EINVAL,
            FsError::NoSpace => libc::ENOSPC,
            FsError::Quota => libc::EDQUOT,
            FsError::NoData => libc::ENODATA,
            FsError::Range => libc::ERANGE,
            FsError::TooManyLinks => libc::EMLINK,
            FsError::BadHandle => libc::EBADF,
            FsError::Stale => libc::ESTALE,
            FsError::FileTooBig => libc::EFBIG,
            FsError::Unsupported => libc::EOPNOTSUPP,
            FsError::Loop => libc::ELOOP,
            FsError::Nxio => libc::ENXIO,
            FsError::Busy => libc::EBUSY,
            FsError::ReadOnly | FsError::Io(BdevError::ReadOnly) => libc::EROFS,
            FsError::Io(_) | FsError::Corrupt(_) | FsError::ChecksumMismatch { .. } => libc::EIO,
        }
    }
}

pub type FsResult<T> = Result<T, FsError>;
