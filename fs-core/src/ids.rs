//! The identifiers at the filesystem's API. A FUSE request's node id and
//! file handle become these where the request is parsed, so an inode
//! number can no longer be passed where a handle belongs, or the reverse.

use std::fmt;

/// A u64 identifier with a type of its own.
macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(u64);

        impl $name {
            pub const fn new(n: u64) -> Self {
                Self(n)
            }

            pub const fn get(self) -> u64 {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

id_type!(
    /// An inode number: the FUSE node id, stable for the inode's life.
    Ino
);
id_type!(
    /// A byte offset within a file, as reads, writes, fallocate and lseek
    /// take it: not a block number, not a length, not a directory cookie.
    FileOffset
);
id_type!(
    /// An open file or directory handle, as `open`, `create` and `opendir`
    /// return it.
    Fh
);
