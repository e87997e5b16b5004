//! The snapshot table (issue 37; docs/FORMAT.md, "Snapshots"): the
//! retained checkpoints an image keeps, by name. Its payload is written in
//! checkpoint blocks (numbered with the checkpoint sequence of the
//! superblock that names it), and is itself checked: a magic, bounded
//! counts, names of a safe alphabet, checkpoints inside the data area, and
//! a checksum over the whole.

use crate::codec::{DecodeError, Reader, Writer};
use crate::format::{crc, runs_in_data_area, BlockRun, Timespec, CHECKPOINT_EXTENTS_MAX, COUNTER_MAX};

/// Snapshots one image keeps at most: each is a whole checkpoint, held
/// on the device and, while mounted, as a list of runs in memory.
pub const SNAPSHOTS_MAX: usize = 32;
/// The longest snapshot name, in bytes.
pub const SNAPSHOT_NAME_MAX: usize = 64;
const TABLE_MAGIC: u32 = u32::from_le_bytes(*b"KFSN");
/// One entry's largest encoding: name, time, sequence, size, extents.
const ENTRY_BYTES_MAX: usize = 1 + SNAPSHOT_NAME_MAX + 12 + 8 + 8 + 4 + 16 * CHECKPOINT_EXTENTS_MAX;
/// The largest table: what loading reads at most, whatever a superblock
/// claims.
pub const TABLE_BYTES_MAX: u64 = (4 + 4 + SNAPSHOTS_MAX * ENTRY_BYTES_MAX + 4) as u64;

/// One snapshot: a name, when it was taken, and the checkpoint that holds
/// the export as it was then.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotEntry {
    pub name: String,
    pub created: Timespec,
    pub checkpoint_seq: u64,
    pub checkpoint_bytes: u64,
    pub checkpoint_extents: Vec<BlockRun>,
}

impl SnapshotEntry {
    pub fn checkpoint_blocks(&self) -> u64 {
        self.checkpoint_extents.iter().map(|r| r.len).sum()
    }
}

/// Whether `name` may name a snapshot: 1 to 64 bytes of letters, digits,
/// '.', '_' and '-', not starting with '.' (it may become a path on the
/// host, for a backup's mount point).
pub fn check_snapshot_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > SNAPSHOT_NAME_MAX {
        return Err("a snapshot name is 1 to 64 bytes");
    }
    if name.starts_with('.') {
        return Err("a snapshot name does not start with '.'");
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')) {
        return Err("a snapshot name holds only letters, digits, '.', '_' and '-'");
    }
    Ok(())
}

pub fn encode_table(entries: &[SnapshotEntry]) -> Vec<u8> {
    assert!(entries.len() <= SNAPSHOTS_MAX, "{} snapshots, past the limit", entries.len());
    let mut w = Writer::new();
    w.u32(TABLE_MAGIC);
    w.u32(entries.len() as u32);
    for e in entries {
        assert!(check_snapshot_name(&e.name).is_ok(), "a snapshot named {:?}", e.name);
        assert!(e.checkpoint_extents.len() <= CHECKPOINT_EXTENTS_MAX, "too many checkpoint extents");
        w.u8(e.name.len() as u8);
        w.bytes(e.name.as_bytes());
        w.i64(e.created.sec);
        w.u32(e.created.nsec);
        w.u64(e.checkpoint_seq);
        w.u64(e.checkpoint_bytes);
        w.u32(e.checkpoint_extents.len() as u32);
        for run in &e.checkpoint_extents {
            w.u64(run.start);
            w.u64(run.len);
        }
    }
    let sum = crc(&w.buf);
    w.u32(sum);
    assert!(w.buf.len() as u64 <= TABLE_BYTES_MAX);
    w.buf
}

/// Decode a table, refusing anything a honest writer would not have
/// written: the data area is [data_start, total).
pub fn decode_table(bytes: &[u8], data_start: u64, total: u64) -> Result<Vec<SnapshotEntry>, String> {
    let Some(body_len) = bytes.len().checked_sub(4) else { return Err("shorter than its checksum".into()) };
    let stored = u32::from_le_bytes(bytes[body_len..].try_into().expect("4 bytes"));
    if crc(&bytes[..body_len]) != stored {
        return Err("checksum mismatch".into());
    }
    let mut r = Reader::new(&bytes[..body_len]);
    let field = |e: DecodeError| e.to_string();
    if r.u32("table magic").map_err(field)? != TABLE_MAGIC {
        return Err("bad magic".into());
    }
    let count = r.u32("snapshot count").map_err(field)? as usize;
    if count > SNAPSHOTS_MAX {
        return Err(format!("{count} snapshots, past the limit of {SNAPSHOTS_MAX}"));
    }
    let mut entries: Vec<SnapshotEntry> = Vec::with_capacity(count);
    for _ in 0..count {
        let entry = decode_entry(&mut r, data_start, total)?;
        if entries.iter().any(|e| e.name == entry.name || e.checkpoint_seq == entry.checkpoint_seq) {
            return Err(format!("snapshot {:?} named or numbered twice", entry.name));
        }
        entries.push(entry);
    }
    if r.remaining() != 0 {
        return Err(format!("{} bytes after the last snapshot", r.remaining()));
    }
    Ok(entries)
}

fn decode_entry(r: &mut Reader<'_>, data_start: u64, total: u64) -> Result<SnapshotEntry, String> {
    let field = |e: DecodeError| e.to_string();
    let len = r.u8("name length").map_err(field)? as usize;
    let name = String::from_utf8(r.take(len, "name").map_err(field)?.to_vec()).map_err(|_| "a name not UTF-8")?;
    check_snapshot_name(&name).map_err(|why| format!("snapshot {name:?}: {why}"))?;
    let created = Timespec { sec: r.i64("created").map_err(field)?, nsec: r.u32("created").map_err(field)? };
    if created.nsec >= 1_000_000_000 {
        return Err(format!("snapshot {name:?}: nanoseconds out of range"));
    }
    let checkpoint_seq = r.u64("checkpoint seq").map_err(field)?;
    let checkpoint_bytes = r.u64("checkpoint bytes").map_err(field)?;
    let extents = r.u32("extent count").map_err(field)? as usize;
    if extents > CHECKPOINT_EXTENTS_MAX || checkpoint_seq >= COUNTER_MAX {
        return Err(format!("snapshot {name:?}: extent count or sequence out of range"));
    }
    let mut checkpoint_extents = Vec::with_capacity(extents);
    for _ in 0..extents {
        checkpoint_extents
            .push(BlockRun { start: r.u64("extent").map_err(field)?, len: r.u64("extent").map_err(field)? });
    }
    let blocks = runs_in_data_area(&checkpoint_extents, data_start, total)
        .ok_or_else(|| format!("snapshot {name:?}: a checkpoint extent outside the data area"))?;
    if checkpoint_bytes < 8 || checkpoint_bytes > crate::blocks::block_bytes(blocks) {
        return Err(format!("snapshot {name:?}: checkpoint of {checkpoint_bytes} bytes in {blocks} blocks"));
    }
    Ok(SnapshotEntry { name, created, checkpoint_seq, checkpoint_bytes, checkpoint_extents })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, seq: u64) -> SnapshotEntry {
        SnapshotEntry {
            name: name.into(),
            created: Timespec { sec: 1_700_000_000, nsec: 5 },
            checkpoint_seq: seq,
            checkpoint_bytes: 5000,
            checkpoint_extents: vec![BlockRun { start: 100, len: 1 }, BlockRun { start: 300, len: 1 }],
        }
    }

    #[test]
    fn a_table_decodes_to_what_was_encoded_and_refuses_damage() {
        let entries = vec![entry("nightly-1", 4), entry("before_upgrade.2", 9)];
        let bytes = encode_table(&entries);
        assert_eq!(decode_table(&bytes, 50, 1000), Ok(entries.clone()));
        assert_eq!(decode_table(&encode_table(&[]), 50, 1000), Ok(vec![]));
        // Every flipped byte is caught (the checksum covers the whole).
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(decode_table(&bad, 50, 1000).is_err(), "byte {i} flipped went unnoticed");
        }
        assert!(decode_table(&bytes[..bytes.len() - 1], 50, 1000).is_err());
        assert!(decode_table(&[], 50, 1000).is_err());
        // A checkpoint outside the data area, with a valid checksum.
        assert!(decode_table(&bytes, 200, 1000).is_err());
        assert!(decode_table(&bytes, 50, 300).is_err());
        // Two snapshots of one name.
        assert!(decode_table(&encode_table(&[entry("a", 1), entry("b", 1)]), 50, 1000).is_err());
    }

    #[test]
    fn names_are_short_and_plain() {
        assert!(check_snapshot_name("daily-2026.12.05_1").is_ok());
        for bad in ["", ".hidden", "a/b", "..", "a b", "ü", &"x".repeat(65)] {
            assert!(check_snapshot_name(bad).is_err(), "{bad:?} accepted");
        }
        assert!(check_snapshot_name(&"x".repeat(64)).is_ok());
    }
}
