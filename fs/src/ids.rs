//! The identifiers at the filesystem's API. A FUSE request's node id and
//! file handle become these where the request is parsed, so an inode
//! number can no longer be passed where a handle belongs, or the reverse.

use std::fmt;

/// An inode number: the FUSE node id, stable for the inode's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ino(u64);

impl Ino {
    pub const fn new(n: u64) -> Self {
        Self(n)
    }

    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Ino {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// An open file or directory handle, as `open`, `create` and `opendir`
/// return it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fh(u64);

impl Fh {
    pub const fn new(n: u64) -> Self {
        Self(n)
    }

    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Fh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The root directory.
pub const ROOT_INO: Ino = Ino(crate::format::ROOT_INO);
