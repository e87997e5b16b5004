//! Metadata records: the unit of the journal and of checkpoints. Every
//! change to metadata is one of these, applied the same way live, at
//! replay and when loading a checkpoint.

use std::borrow::Cow;

use super::codec::{DecodeError, Reader, Writer};
use super::format::{Inode, NAME_MAX, SYMLINK_MAX, XATTR_NAME_MAX, XATTR_VALUE_MAX};
use super::ids::Ino;

/// Names, values and targets are borrowed where they can be: from the
/// request at a live change, from the stream at replay and mount, so
/// neither allocates for them (issue 34).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record<'a> {
    /// The full image of an inode (created or changed).
    InodeSet(Inode),
    /// The inode and everything it owns are gone.
    InodeFree {
        ino: Ino,
    },
    DirentSet {
        dir: Ino,
        name: Cow<'a, [u8]>,
        ino: Ino,
        cookie: u64,
    },
    DirentDelete {
        dir: Ino,
        name: Cow<'a, [u8]>,
    },
    /// Map file blocks [file_block, +len) to device blocks [disk_block, +len).
    ExtentMap {
        ino: Ino,
        file_block: u64,
        disk_block: u64,
        len: u64,
        unwritten: bool,
    },
    /// Unmap file blocks [file_block, +len); their device blocks are freed.
    ExtentPunch {
        ino: Ino,
        file_block: u64,
        len: u64,
    },
    XattrSet {
        ino: Ino,
        name: Cow<'a, [u8]>,
        value: Cow<'a, [u8]>,
    },
    XattrDelete {
        ino: Ino,
        name: Cow<'a, [u8]>,
    },
    Symlink {
        ino: Ino,
        target: Cow<'a, [u8]>,
    },
    /// Allocator state carried in a checkpoint: the next inode number.
    NextIno {
        next: u64,
    },
    /// Data checksums (FEATURE_DATA_CHECKSUMS): the crc32c of device
    /// blocks [first_block, +n), as n little-endian u32s, 1 <= n <=
    /// CSUM_SET_BLOCKS_MAX. Journal only: the checksum table is not part
    /// of the state, and a checkpoint writes it back instead.
    CsumSet {
        first_block: u64,
        crcs: Cow<'a, [u8]>,
    },
    /// Where a scrub stands (an image with data checksums only), so that
    /// a restarted daemon resumes it: the next inode and file block, and
    /// its rate. `ino` 0: no scrub.
    ScrubCursor {
        ino: u64,
        file_block: u64,
        bytes_per_sec: u64,
    },
    /// A data block that failed its checksum at run time (a read or a
    /// scrub), kept so that fsck finds it: the device block, and the inode
    /// and file block that named it. Freeing the block forgets it, and so
    /// does `ino` 0 (logged when it is overwritten in place). At most
    /// [`DATA_ERRORS_MAX`] are kept.
    DataError {
        block: u64,
        ino: u64,
        file_block: u64,
    },
}

/// Data blocks an image records as failing their checksum at most; those
/// found past it are logged and counted, not recorded.
pub const DATA_ERRORS_MAX: usize = 1024;

/// Blocks one `CsumSet` covers at most: 4 KiB of crcs, 4 MiB of data.
pub const CSUM_SET_BLOCKS_MAX: usize = 1024;

const TAG_INODE_SET: u8 = 1;
const TAG_INODE_FREE: u8 = 2;
const TAG_DIRENT_SET: u8 = 3;
const TAG_DIRENT_DELETE: u8 = 4;
const TAG_EXTENT_MAP: u8 = 5;
const TAG_EXTENT_PUNCH: u8 = 6;
const TAG_XATTR_SET: u8 = 7;
const TAG_XATTR_DELETE: u8 = 8;
const TAG_SYMLINK: u8 = 9;
const TAG_NEXT_INO: u8 = 10;
const TAG_CSUM_SET: u8 = 11;
const TAG_SCRUB_CURSOR: u8 = 12;
const TAG_DATA_ERROR: u8 = 13;

impl<'a> Record<'a> {
    pub fn encode(&self, w: &mut Writer) {
        match self {
            Record::InodeSet(inode) => {
                w.u8(TAG_INODE_SET);
                inode.encode(w);
            }
            Record::InodeFree { ino } => {
                w.u8(TAG_INODE_FREE);
                w.u64(ino.get());
            }
            Record::DirentSet { dir, name, ino, cookie } => {
                w.u8(TAG_DIRENT_SET);
                w.u64(dir.get());
                w.blob(name);
                w.u64(ino.get());
                w.u64(*cookie);
            }
            Record::DirentDelete { dir, name } => {
                w.u8(TAG_DIRENT_DELETE);
                w.u64(dir.get());
                w.blob(name);
            }
            Record::ExtentMap { ino, file_block, disk_block, len, unwritten } => {
                w.u8(TAG_EXTENT_MAP);
                w.u64(ino.get());
                w.u64(*file_block);
                w.u64(*disk_block);
                w.u64(*len);
                w.u8(u8::from(*unwritten));
            }
            Record::ExtentPunch { ino, file_block, len } => {
                w.u8(TAG_EXTENT_PUNCH);
                w.u64(ino.get());
                w.u64(*file_block);
                w.u64(*len);
            }
            Record::XattrSet { ino, name, value } => {
                w.u8(TAG_XATTR_SET);
                w.u64(ino.get());
                w.blob(name);
                w.blob(value);
            }
            Record::XattrDelete { ino, name } => {
                w.u8(TAG_XATTR_DELETE);
                w.u64(ino.get());
                w.blob(name);
            }
            Record::Symlink { ino, target } => {
                w.u8(TAG_SYMLINK);
                w.u64(ino.get());
                w.blob(target);
            }
            Record::NextIno { next } => {
                w.u8(TAG_NEXT_INO);
                w.u64(*next);
            }
            Record::CsumSet { .. } | Record::ScrubCursor { .. } | Record::DataError { .. } => {
                self.encode_data_checksums(w)
            }
        }
    }

    /// The records of an image with data checksums.
    fn encode_data_checksums(&self, w: &mut Writer) {
        match self {
            Record::CsumSet { first_block, crcs } => {
                assert!(!crcs.is_empty() && crcs.len() % 4 == 0 && crcs.len() <= CSUM_SET_BLOCKS_MAX * 4);
                w.u8(TAG_CSUM_SET);
                w.u64(*first_block);
                w.blob(crcs);
            }
            Record::ScrubCursor { ino, file_block, bytes_per_sec } => {
                w.u8(TAG_SCRUB_CURSOR);
                w.u64(*ino);
                w.u64(*file_block);
                w.u64(*bytes_per_sec);
            }
            Record::DataError { block, ino, file_block } => {
                w.u8(TAG_DATA_ERROR);
                w.u64(*block);
                w.u64(*ino);
                w.u64(*file_block);
            }
            _ => unreachable!("encode passes only data checksum records"),
        }
    }

    pub fn decode(r: &mut Reader<'a>) -> Result<Self, DecodeError> {
        let at = r.pos();
        Ok(match r.u8("record tag")? {
            TAG_INODE_SET => Record::InodeSet(Inode::decode(r)?),
            TAG_INODE_FREE => Record::InodeFree { ino: Ino::new(r.u64("ino")?) },
            TAG_DIRENT_SET => Record::DirentSet {
                dir: Ino::new(r.u64("dir")?),
                name: name(r.blob(NAME_MAX, "dirent name")?, at)?,
                ino: Ino::new(r.u64("ino")?),
                cookie: r.u64("cookie")?,
            },
            TAG_DIRENT_DELETE => {
                Record::DirentDelete { dir: Ino::new(r.u64("dir")?), name: name(r.blob(NAME_MAX, "dirent name")?, at)? }
            }
            TAG_EXTENT_MAP => Record::ExtentMap {
                ino: Ino::new(r.u64("ino")?),
                file_block: r.u64("file block")?,
                disk_block: r.u64("disk block")?,
                len: r.u64("extent length")?,
                unwritten: match r.u8("unwritten flag")? {
                    0 => false,
                    1 => true,
                    _ => return Err(DecodeError { what: "unwritten flag", at }),
                },
            },
            TAG_EXTENT_PUNCH => Record::ExtentPunch {
                ino: Ino::new(r.u64("ino")?),
                file_block: r.u64("file block")?,
                len: r.u64("length")?,
            },
            TAG_XATTR_SET => Record::XattrSet {
                ino: Ino::new(r.u64("ino")?),
                name: Cow::Borrowed(r.blob(XATTR_NAME_MAX, "xattr name")?),
                value: Cow::Borrowed(r.blob(XATTR_VALUE_MAX, "xattr value")?),
            },
            TAG_XATTR_DELETE => Record::XattrDelete {
                ino: Ino::new(r.u64("ino")?),
                name: Cow::Borrowed(r.blob(XATTR_NAME_MAX, "xattr name")?),
            },
            TAG_SYMLINK => {
                Record::Symlink { ino: Ino::new(r.u64("ino")?), target: Cow::Borrowed(r.blob(SYMLINK_MAX, "symlink")?) }
            }
            TAG_NEXT_INO => Record::NextIno { next: r.u64("next ino")? },
            TAG_CSUM_SET => {
                let first_block = r.u64("checksum block")?;
                let crcs = r.blob(CSUM_SET_BLOCKS_MAX * 4, "checksums")?;
                if crcs.is_empty() || crcs.len() % 4 != 0 {
                    return Err(DecodeError { what: "checksum count", at });
                }
                Record::CsumSet { first_block, crcs: Cow::Borrowed(crcs) }
            }
            TAG_SCRUB_CURSOR => Record::ScrubCursor {
                ino: r.u64("scrub inode")?,
                file_block: r.u64("scrub file block")?,
                bytes_per_sec: r.u64("scrub rate")?,
            },
            TAG_DATA_ERROR => Record::DataError {
                block: r.u64("bad block")?,
                ino: r.u64("bad block's inode")?,
                file_block: r.u64("bad block's file block")?,
            },
            _ => return Err(DecodeError { what: "record tag", at }),
        })
    }
}

fn name(bytes: &[u8], at: usize) -> Result<Cow<'_, [u8]>, DecodeError> {
    if bytes.is_empty() || bytes.contains(&b'/') || bytes.contains(&0) || bytes == b"." || bytes == b".." {
        return Err(DecodeError { what: "dirent name", at });
    }
    Ok(Cow::Borrowed(bytes))
}

/// Decode a whole stream of records.
pub fn decode_all(bytes: &[u8]) -> Result<Vec<Record<'_>>, DecodeError> {
    let mut r = Reader::new(bytes);
    let mut out = Vec::new();
    while r.remaining() > 0 {
        out.push(Record::decode(&mut r)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Timespec;

    #[test]
    fn records_round_trip_and_garbage_is_an_error() {
        let inode = Inode {
            ino: Ino::new(7),
            generation: 2,
            mode: 0o100644,
            uid: 1,
            gid: 2,
            nlink: 1,
            rdev: 0,
            flags: 0,
            size: 12345,
            atime: Timespec { sec: 1, nsec: 2 },
            mtime: Timespec { sec: 3, nsec: 4 },
            ctime: Timespec { sec: 5, nsec: 6 },
            btime: Timespec { sec: -7, nsec: 8 },
            i_version: 9,
        };
        let records = vec![
            Record::InodeSet(inode),
            Record::InodeFree { ino: Ino::new(3) },
            Record::DirentSet { dir: Ino::new(1), name: b"a".to_vec().into(), ino: Ino::new(7), cookie: 3 },
            Record::DirentDelete { dir: Ino::new(1), name: b"a".to_vec().into() },
            Record::ExtentMap { ino: Ino::new(7), file_block: 0, disk_block: 100, len: 8, unwritten: true },
            Record::ExtentPunch { ino: Ino::new(7), file_block: 2, len: 1 },
            Record::XattrSet { ino: Ino::new(7), name: b"user.x".to_vec().into(), value: vec![1, 2, 3].into() },
            Record::XattrDelete { ino: Ino::new(7), name: b"user.x".to_vec().into() },
            Record::Symlink { ino: Ino::new(8), target: b"/etc".to_vec().into() },
            Record::NextIno { next: 99 },
            Record::CsumSet { first_block: 700, crcs: vec![1, 2, 3, 4, 5, 6, 7, 8].into() },
            Record::ScrubCursor { ino: 7, file_block: 3, bytes_per_sec: 1 << 20 },
            Record::DataError { block: 900, ino: 7, file_block: 5 },
        ];
        let mut w = Writer::new();
        for r in &records {
            r.encode(&mut w);
        }
        assert_eq!(decode_all(&w.buf).unwrap(), records);
        for cut in 0..w.buf.len() {
            // Every truncation either decodes a prefix or errors; none panics.
            let _ = decode_all(&w.buf[..cut]);
        }
        assert!(decode_all(&[200]).is_err());
        let mut bad = Writer::new();
        Record::DirentSet { dir: Ino::new(1), name: b"a/b".to_vec().into(), ino: Ino::new(2), cookie: 3 }
            .encode(&mut bad);
        assert!(decode_all(&bad.buf).is_err(), "a name with '/' is refused");
        for bytes in [0usize, 3, CSUM_SET_BLOCKS_MAX * 4 + 4] {
            let mut bad = Writer::new();
            bad.u8(TAG_CSUM_SET);
            bad.u64(5);
            bad.blob(&vec![0; bytes]);
            assert!(decode_all(&bad.buf).is_err(), "{bytes} bytes of checksums are refused");
        }
    }
}
