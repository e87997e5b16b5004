//! Block numbers as types: a block's index within a file and a block's
//! index on the device are different quantities, and neither is a byte
//! offset. The conversions say which way they round.

use std::ops::{Add, Sub};

use crate::format::{BLOCK_BYTES, BLOCK_SIZE};

// The page cache indexes pages by file block: a page is a block.
const _: () = assert!(crate::cache::PAGE_BYTES == BLOCK_BYTES);

/// The index of a block within a file: it holds the file's bytes
/// [index * BLOCK_SIZE, (index + 1) * BLOCK_SIZE).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FileBlock(u64);

/// The index of a block on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevBlock(u64);

impl FileBlock {
    pub const fn new(index: u64) -> Self {
        Self(index)
    }

    /// The block's index within its file.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The block that holds byte `offset` (rounds down).
    pub const fn containing(offset: u64) -> Self {
        Self(offset / BLOCK_SIZE)
    }

    /// The first block that starts at or after byte `offset` (rounds up).
    pub const fn starting_at_or_after(offset: u64) -> Self {
        Self(offset.div_ceil(BLOCK_SIZE))
    }

    /// The file offset of the block's first byte.
    pub const fn offset(self) -> u64 {
        self.0 * BLOCK_SIZE
    }
}

impl DevBlock {
    pub const fn new(index: u64) -> Self {
        Self(index)
    }

    /// The block's index on the device.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The device offset of the block's first byte.
    pub const fn offset(self) -> u64 {
        self.0 * BLOCK_SIZE
    }
}

/// The bytes of `blocks` whole blocks.
pub const fn block_bytes(blocks: u64) -> u64 {
    blocks * BLOCK_SIZE
}

/// Whole blocks in `bytes` (rounds down): a device's or a buffer's size.
pub const fn whole_blocks(bytes: u64) -> u64 {
    bytes / BLOCK_SIZE
}

/// Where byte `offset` falls within its block.
pub const fn offset_in_block(offset: u64) -> u64 {
    offset % BLOCK_SIZE
}

macro_rules! block_arithmetic {
    ($t:ident) => {
        impl Add<u64> for $t {
            type Output = $t;
            fn add(self, blocks: u64) -> $t {
                $t(self.0 + blocks)
            }
        }
        impl Sub<u64> for $t {
            type Output = $t;
            fn sub(self, blocks: u64) -> $t {
                $t(self.0 - blocks)
            }
        }
        /// The number of blocks from `other` up to `self`.
        impl Sub<$t> for $t {
            type Output = u64;
            fn sub(self, other: $t) -> u64 {
                self.0 - other.0
            }
        }
    };
}
block_arithmetic!(FileBlock);
block_arithmetic!(DevBlock);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_round_the_way_they_say() {
        assert_eq!(FileBlock::containing(0), FileBlock(0));
        assert_eq!(FileBlock::containing(BLOCK_SIZE - 1), FileBlock(0));
        assert_eq!(FileBlock::containing(BLOCK_SIZE), FileBlock(1));
        assert_eq!(FileBlock::starting_at_or_after(1), FileBlock(1));
        assert_eq!(FileBlock::starting_at_or_after(BLOCK_SIZE), FileBlock(1));
        assert_eq!(FileBlock(3).offset(), 3 * BLOCK_SIZE);
        assert_eq!(DevBlock(5).offset(), 5 * BLOCK_SIZE);
        assert_eq!(FileBlock(7) - FileBlock(2), 5);
        assert_eq!(FileBlock(2) + 5, FileBlock(7));
        assert_eq!(block_bytes(3), 3 * BLOCK_SIZE);
        assert_eq!(whole_blocks(3 * BLOCK_SIZE + 1), 3);
        assert_eq!(offset_in_block(3 * BLOCK_SIZE + 7), 7);
        assert_eq!(
            FileBlock::containing(3 * BLOCK_SIZE + 7).offset() + offset_in_block(3 * BLOCK_SIZE + 7),
            3 * BLOCK_SIZE + 7
        );
    }
}
