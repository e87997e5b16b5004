//! The flags of rename(2), setxattr(2) and fallocate(2) as types. The raw
//! Linux numbers are converted once, where a request is parsed, and each
//! conversion refuses what Linux refuses, with Linux's errno.

use crate::error::{FsError, FsResult};

const RENAME_NOREPLACE: u32 = 1;
const RENAME_EXCHANGE: u32 = 2;
/// Leave a 0:0 character device at the old name (overlayfs's upper layer).
const RENAME_WHITEOUT: u32 = 4;
const XATTR_CREATE: u32 = 1;
const XATTR_REPLACE: u32 = 2;
const FALLOC_FL_KEEP_SIZE: u32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: u32 = 0x02;
const FALLOC_FL_ZERO_RANGE: u32 = 0x10;

/// What a rename does with the entry at the new name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RenameMode {
    /// Replace it, if there is one (plain rename(2)).
    Replace,
    /// Fail with EEXIST if there is one (RENAME_NOREPLACE).
    NoReplace,
    /// Swap the two entries, which must both exist (RENAME_EXCHANGE).
    Exchange,
    /// Move, and leave a whiteout at the old name (RENAME_WHITEOUT), with
    /// or without RENAME_NOREPLACE.
    Whiteout { no_replace: bool },
}

impl RenameMode {
    /// renameat2's flags. Unknown bits, and EXCHANGE with either other
    /// flag, are EINVAL, as in Linux.
    pub fn from_linux(flags: u32) -> FsResult<Self> {
        let known = RENAME_NOREPLACE | RENAME_EXCHANGE | RENAME_WHITEOUT;
        let exchange = flags & RENAME_EXCHANGE != 0;
        if flags & !known != 0 || (exchange && flags & (RENAME_NOREPLACE | RENAME_WHITEOUT) != 0) {
            return Err(FsError::Invalid("rename flags"));
        }
        let no_replace = flags & RENAME_NOREPLACE != 0;
        Ok(if flags & RENAME_WHITEOUT != 0 {
            Self::Whiteout { no_replace }
        } else if exchange {
            Self::Exchange
        } else if no_replace {
            Self::NoReplace
        } else {
            Self::Replace
        })
    }

    /// True when an existing entry at the new name is an error.
    pub fn refuses_existing(self) -> bool {
        matches!(self, Self::NoReplace | Self::Whiteout { no_replace: true })
    }
}

/// When setxattr may set a name: XATTR_CREATE and XATTR_REPLACE. Both at
/// once is allowed, as Linux allows it, and then always fails.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct XattrFlags {
    /// Fail with EEXIST if the name exists.
    pub create_only: bool,
    /// Fail with ENODATA if it does not.
    pub replace_only: bool,
}

impl XattrFlags {
    /// setxattr(2)'s flags. Other bits are ignored: the client kernel has
    /// refused them already (setxattr(2) answers EINVAL).
    pub fn from_linux(flags: u32) -> Self {
        Self { create_only: flags & XATTR_CREATE != 0, replace_only: flags & XATTR_REPLACE != 0 }
    }
}

/// What fallocate does to its range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FallocateMode {
    /// Allocate unwritten blocks (mode 0, or KEEP_SIZE to leave the size).
    Allocate { keep_size: bool },
    /// Free the range's blocks; it reads as zeros (PUNCH_HOLE|KEEP_SIZE).
    PunchHole,
    /// Make the range read as zeros, allocated (ZERO_RANGE, with or
    /// without KEEP_SIZE).
    ZeroRange { keep_size: bool },
}

impl FallocateMode {
    /// fallocate(2)'s mode. Bits keelfs does not implement (COLLAPSE_RANGE,
    /// INSERT_RANGE, UNSHARE_RANGE, NO_HIDE_STALE and unknown ones) are
    /// EOPNOTSUPP; PUNCH_HOLE with ZERO_RANGE, or without KEEP_SIZE, is
    /// EINVAL. (Linux's vfs_fallocate answers EOPNOTSUPP to those two, but
    /// a FUSE kernel refuses them before keelfs sees them.)
    pub fn from_linux(mode: u32) -> FsResult<Self> {
        if mode & !(FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE) != 0 {
            return Err(FsError::Unsupported);
        }
        let keep_size = mode & FALLOC_FL_KEEP_SIZE != 0;
        match (mode & FALLOC_FL_PUNCH_HOLE != 0, mode & FALLOC_FL_ZERO_RANGE != 0) {
            (false, false) => Ok(Self::Allocate { keep_size }),
            (false, true) => Ok(Self::ZeroRange { keep_size }),
            (true, false) if keep_size => Ok(Self::PunchHole),
            (true, _) => Err(FsError::Invalid("punch hole needs KEEP_SIZE alone")),
        }
    }

    /// The file's size stays as it is, even if the range passes its end.
    pub fn keeps_size(self) -> bool {
        match self {
            Self::Allocate { keep_size } | Self::ZeroRange { keep_size } => keep_size,
            Self::PunchHole => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_flags_follow_renameat2() {
        assert_eq!(RenameMode::from_linux(0).unwrap(), RenameMode::Replace);
        assert_eq!(RenameMode::from_linux(1).unwrap(), RenameMode::NoReplace);
        assert_eq!(RenameMode::from_linux(2).unwrap(), RenameMode::Exchange);
        assert_eq!(RenameMode::from_linux(4).unwrap(), RenameMode::Whiteout { no_replace: false });
        assert_eq!(RenameMode::from_linux(5).unwrap(), RenameMode::Whiteout { no_replace: true });
        for bad in [3, 6, 7, 8, 1 << 31] {
            assert!(matches!(RenameMode::from_linux(bad), Err(FsError::Invalid(_))), "{bad}");
        }
        assert!(RenameMode::NoReplace.refuses_existing() && !RenameMode::Exchange.refuses_existing());
    }

    #[test]
    fn xattr_flags_follow_setxattr() {
        assert_eq!(XattrFlags::from_linux(0), XattrFlags::default());
        let both = XattrFlags::from_linux(3);
        assert!(both.create_only && both.replace_only);
        assert_eq!(XattrFlags::from_linux(4 | 1), XattrFlags { create_only: true, replace_only: false });
    }

    #[test]
    fn fallocate_modes_follow_vfs_fallocate() {
        use FallocateMode::*;
        assert_eq!(FallocateMode::from_linux(0).unwrap(), Allocate { keep_size: false });
        assert_eq!(FallocateMode::from_linux(0x01).unwrap(), Allocate { keep_size: true });
        assert_eq!(FallocateMode::from_linux(0x03).unwrap(), PunchHole);
        assert_eq!(FallocateMode::from_linux(0x10).unwrap(), ZeroRange { keep_size: false });
        assert_eq!(FallocateMode::from_linux(0x11).unwrap(), ZeroRange { keep_size: true });
        // COLLAPSE_RANGE, INSERT_RANGE, UNSHARE_RANGE and an unknown bit.
        for bad in [0x08, 0x20, 0x40, 0x1000] {
            assert!(matches!(FallocateMode::from_linux(bad), Err(FsError::Unsupported)), "{bad:#x}");
        }
        // PUNCH_HOLE alone, and with ZERO_RANGE.
        for bad in [0x02, 0x03 | 0x10] {
            assert!(matches!(FallocateMode::from_linux(bad), Err(FsError::Invalid(_))), "{bad:#x}");
        }
        assert!(PunchHole.keeps_size() && !ZeroRange { keep_size: false }.keeps_size());
    }
}
