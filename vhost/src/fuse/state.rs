//! A FUSE session's state as bytes, for a session that moves to another
//! keelfsd (live migration) or outlives a restart: what the client holds,
//! by number. The filesystem's data does not travel: both ends serve the
//! same image, handed over committed.
//!
//! The format (little-endian) is versioned and checksummed, and every
//! count is checked against the length before anything is allocated:
//!
//! ```text
//! header (32 bytes): magic "KEELSESS", u32 version, u32 0,
//!                    u64 body length, u32 crc32c of the body, u32 0
//! body:              the filesystem's 16-byte uuid,
//!                    u64 bits (bit 0: INIT done), u64 INIT flags,
//!                    u64 lookups, u64 handles,
//!                    lookups x {u64 inode, u64 references},
//!                    handles x {u64 handle, u64 inode, u32 open flags,
//!                               u32 0, u64 readdir end cookie}
//! ```
//!
//! Version 2 adds the locks keelfs holds for the session (issue 36): a
//! u64 count of them after the handles' count, and after the handles
//!
//! ```text
//! locks x {u64 inode, u64 owner, u64 start, u64 end, u64 handle,
//!          u32 bits (bit 0: write, bit 1: flock), u32 pid}
//! ```
//!
//! A session that holds no lock is saved as version 1, so that a keelfsd
//! of the version before can still take it.
//!
//! A blob that decodes is still untrusted: [`crate::Session::restore`]
//! checks every inode and handle against the image before it takes any.

use keelfs_fs::{Fh, HandleState, Ino};

pub const STATE_MAGIC: [u8; 8] = *b"KEELSESS";
/// The newest version written (when the session holds locks) and read.
pub const STATE_VERSION: u32 = 2;
/// The version without locks, still written when none is held.
const STATE_VERSION_NO_LOCKS: u32 = 1;
const LOCK_BYTES: usize = 48;
const LOCK_WRITE: u32 = 1;
const LOCK_FLOCK: u32 = 2;
/// The largest state accepted: 4M lookups' worth. A guest holds one
/// lookup per inode its kernel caches, far fewer than this.
pub const STATE_BYTES_MAX: usize = 64 << 20;
const HEADER_BYTES: usize = 32;
const COUNTS_BYTES: usize = 48;
const LOOKUP_BYTES: usize = 16;
const HANDLE_BYTES: usize = 32;
const INITIALIZED: u64 = 1;

/// A lock the session holds, as it travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SavedLock {
    pub ino: Ino,
    /// The client's own number for the owner.
    pub owner: u64,
    pub start: u64,
    pub end: u64,
    /// The handle it was taken through.
    pub fh: Fh,
    pub write: bool,
    pub flock: bool,
    pub pid: u32,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StateError {
    #[error("the session state is {0} bytes, more than the {STATE_BYTES_MAX} accepted")]
    TooLong(usize),
    #[error("the session state is truncated ({0} bytes)")]
    Truncated(usize),
    #[error("not a keelfs session state (bad magic)")]
    Magic,
    #[error("session state version {0} is not one this keelfsd reads (it reads {STATE_VERSION})")]
    Version(u32),
    #[error("the session state's checksum does not match its contents")]
    Checksum,
    #[error("the session state is malformed: {0}")]
    Malformed(&'static str),
    #[error("the session state names inode {0}, which the image does not have")]
    NoInode(u64),
    #[error("the session state's handle {fh} cannot be restored: {why}")]
    Handle { fh: u64, why: String },
    #[error("the session state holds {0} handles, more than this export allows")]
    TooManyHandles(usize),
    #[error("the session state's locks cannot be taken here: {0}")]
    Locks(&'static str),
    #[error("the session state is of another filesystem (uuid {0})")]
    OtherFilesystem(String),
}

/// What one session holds, by number.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionState {
    /// The filesystem the inode and handle numbers belong to.
    pub fs_uuid: [u8; 16],
    /// Whether the client's INIT was answered, and the flags agreed.
    pub initialized: bool,
    pub init_flags: u64,
    /// Lookup references per inode, as the client counts them for FORGET.
    pub lookups: Vec<(Ino, u64)>,
    pub handles: Vec<(Fh, HandleState)>,
    /// The locks keelfs holds for the session's client.
    pub locks: Vec<SavedLock>,
}

impl SessionState {
    pub fn encode(&self) -> Vec<u8> {
        let with_locks = !self.locks.is_empty();
        let (version, counts) =
            if with_locks { (STATE_VERSION, COUNTS_BYTES + 8) } else { (STATE_VERSION_NO_LOCKS, COUNTS_BYTES) };
        let body_len = counts
            + self.lookups.len() * LOOKUP_BYTES
            + self.handles.len() * HANDLE_BYTES
            + self.locks.len() * LOCK_BYTES;
        let mut body = Vec::with_capacity(body_len);
        let put = |b: &mut Vec<u8>, v: u64| b.extend_from_slice(&v.to_le_bytes());
        body.extend_from_slice(&self.fs_uuid);
        put(&mut body, if self.initialized { INITIALIZED } else { 0 });
        put(&mut body, self.init_flags);
        put(&mut body, self.lookups.len() as u64);
        put(&mut body, self.handles.len() as u64);
        if with_locks {
            put(&mut body, self.locks.len() as u64);
        }
        for (ino, n) in &self.lookups {
            put(&mut body, ino.get());
            put(&mut body, *n);
        }
        for (fh, h) in &self.handles {
            put(&mut body, fh.get());
            put(&mut body, h.ino.get());
            put(&mut body, u64::from(h.flags));
            put(&mut body, h.dir_end);
        }
        for l in &self.locks {
            for word in [l.ino.get(), l.owner, l.start, l.end, l.fh.get()] {
                put(&mut body, word);
            }
            let bits = if l.write { LOCK_WRITE } else { 0 } | if l.flock { LOCK_FLOCK } else { 0 };
            put(&mut body, u64::from(bits) | u64::from(l.pid) << 32);
        }
        assert_eq!(body.len(), body_len);
        let mut out = Vec::with_capacity(HEADER_BYTES + body_len);
        out.extend_from_slice(&STATE_MAGIC);
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&(body_len as u64).to_le_bytes());
        out.extend_from_slice(&keelfs_fs::crc(&body).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Decode `bytes`, refusing anything malformed. Inodes and handles are
    /// not checked against an image here.
    pub fn decode(bytes: &[u8]) -> Result<Self, StateError> {
        if bytes.len() > STATE_BYTES_MAX {
            return Err(StateError::TooLong(bytes.len()));
        }
        if bytes.len() < HEADER_BYTES {
            return Err(StateError::Truncated(bytes.len()));
        }
        let mut header = Reader(&bytes[8..HEADER_BYTES]);
        if bytes[..8] != STATE_MAGIC {
            return Err(StateError::Magic);
        }
        let version = header.u32();
        if version != STATE_VERSION && version != STATE_VERSION_NO_LOCKS {
            return Err(StateError::Version(version));
        }
        let (reserved, body_len, crc, reserved2) = (header.u32(), header.u64(), header.u32(), header.u32());
        if reserved != 0 || reserved2 != 0 {
            return Err(StateError::Malformed("reserved header fields are not zero"));
        }
        let body = &bytes[HEADER_BYTES..];
        if body_len != body.len() as u64 {
            return Err(StateError::Truncated(bytes.len()));
        }
        if keelfs_fs::crc(body) != crc {
            return Err(StateError::Checksum);
        }
        Self::decode_body(body, version == STATE_VERSION)
    }

    fn decode_body(body: &[u8], with_locks: bool) -> Result<Self, StateError> {
        let counts = if with_locks { COUNTS_BYTES + 8 } else { COUNTS_BYTES };
        if body.len() < counts {
            return Err(StateError::Malformed("the body is shorter than its counts"));
        }
        let mut r = Reader(body);
        let fs_uuid = r.take::<16>();
        let (bits, init_flags, lookups, handles) = (r.u64(), r.u64(), r.u64(), r.u64());
        let locks = if with_locks { r.u64() } else { 0 };
        if bits & !INITIALIZED != 0 {
            return Err(StateError::Malformed("unknown session bits"));
        }
        // Counts are bounded by the length before anything is allocated.
        let expected = lookups
            .checked_mul(LOOKUP_BYTES as u64)
            .zip(handles.checked_mul(HANDLE_BYTES as u64))
            .and_then(|(l, h)| l.checked_add(h))
            .zip(locks.checked_mul(LOCK_BYTES as u64))
            .and_then(|(n, l)| n.checked_add(l))
            .and_then(|n| n.checked_add(counts as u64));
        if expected != Some(body.len() as u64) {
            return Err(StateError::Malformed("the counts do not match the length"));
        }
        let mut state = Self { fs_uuid, initialized: bits & INITIALIZED != 0, init_flags, ..Self::default() };
        state.lookups.reserve_exact(lookups as usize);
        for _ in 0..lookups {
            let (ino, n) = (r.u64(), r.u64());
            if ino == 0 || n == 0 {
                return Err(StateError::Malformed("a lookup of inode 0, or of no references"));
            }
            state.lookups.push((Ino::new(ino), n));
        }
        state.handles.reserve_exact(handles as usize);
        for _ in 0..handles {
            let (fh, ino, flags, dir_end) = (r.u64(), r.u64(), r.u64(), r.u64());
            if fh == 0 || ino == 0 || flags > u64::from(u32::MAX) {
                return Err(StateError::Malformed("a handle numbered 0, of inode 0, or with flags past 32 bits"));
            }
            let h = HandleState { ino: Ino::new(ino), flags: flags as u32, dir_end };
            state.handles.push((Fh::new(fh), h));
        }
        state.locks.reserve_exact(locks as usize);
        for _ in 0..locks {
            let (ino, owner, start, end, fh, word) = (r.u64(), r.u64(), r.u64(), r.u64(), r.u64(), r.u64());
            let (bits, pid) = (word as u32, (word >> 32) as u32);
            if ino == 0 || fh == 0 || start > end || bits & !(LOCK_WRITE | LOCK_FLOCK) != 0 {
                return Err(StateError::Malformed("a lock of inode 0 or handle 0, backwards, or with unknown bits"));
            }
            let (write, flock) = (bits & LOCK_WRITE != 0, bits & LOCK_FLOCK != 0);
            state.locks.push(SavedLock { ino: Ino::new(ino), owner, start, end, fh: Fh::new(fh), write, flock, pid });
        }
        state.check_unique()?;
        Ok(state)
    }

    fn check_unique(&self) -> Result<(), StateError> {
        let mut inos: Vec<u64> = self.lookups.iter().map(|(i, _)| i.get()).collect();
        inos.sort_unstable();
        if inos.windows(2).any(|w| w[0] == w[1]) {
            return Err(StateError::Malformed("an inode's lookups appear twice"));
        }
        let mut fhs: Vec<u64> = self.handles.iter().map(|(f, _)| f.get()).collect();
        fhs.sort_unstable();
        if fhs.windows(2).any(|w| w[0] == w[1]) {
            return Err(StateError::Malformed("a handle appears twice"));
        }
        Ok(())
    }
}

/// Reads fixed-size fields from a slice whose length was checked first.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let (head, rest) = self.0.split_at(N);
        self.0 = rest;
        head.try_into().expect("split_at gave N bytes")
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> SessionState {
        SessionState {
            fs_uuid: *b"0123456789abcdef",
            initialized: true,
            init_flags: 0x1234_5678_9abc,
            lookups: vec![(Ino::new(1), 3), (Ino::new(77), 1)],
            handles: vec![
                (Fh::new(5), HandleState { ino: Ino::new(77), flags: 2, dir_end: 0 }),
                (Fh::new(9), HandleState { ino: Ino::new(1), flags: 0o200000, dir_end: 42 }),
            ],
            locks: Vec::new(),
        }
    }

    fn with_locks() -> SessionState {
        let lock = SavedLock {
            ino: Ino::new(77),
            owner: 0xfeed,
            start: 10,
            end: LOCK_END,
            fh: Fh::new(5),
            write: true,
            flock: false,
            pid: 4242,
        };
        let flock = SavedLock { owner: 5, start: 0, write: false, flock: true, ..lock };
        SessionState { locks: vec![lock, flock], ..sample() }
    }

    const LOCK_END: u64 = i64::MAX as u64;

    #[test]
    fn locks_travel_in_version_2_and_a_state_without_them_stays_version_1() {
        let locked = with_locks().encode();
        assert_eq!(locked[8..12], 2u32.to_le_bytes());
        assert_eq!(SessionState::decode(&locked), Ok(with_locks()));
        let plain = sample().encode();
        assert_eq!(plain[8..12], 1u32.to_le_bytes(), "the keelfsd before can still take it");
        assert_eq!(SessionState::decode(&plain), Ok(sample()));
        // Damage in the locks' fields, re-checksummed, is refused by name.
        let mut bytes = locked.clone();
        let body_at = HEADER_BYTES;
        let last_lock = bytes.len() - LOCK_BYTES;
        bytes[last_lock + 40] |= 4; // an unknown bit
        let body = bytes[body_at..].to_vec();
        bytes[24..28].copy_from_slice(&keelfs_fs::crc(&body).to_le_bytes());
        assert!(matches!(SessionState::decode(&bytes), Err(StateError::Malformed(_))));
        // A count that claims more locks than the bytes hold.
        let mut counted = locked.clone();
        let count_at = body_at + COUNTS_BYTES;
        counted[count_at..count_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let body = counted[body_at..].to_vec();
        counted[24..28].copy_from_slice(&keelfs_fs::crc(&body).to_le_bytes());
        assert!(matches!(SessionState::decode(&counted), Err(StateError::Malformed(_))));
    }

    #[test]
    fn a_state_round_trips() {
        let s = sample();
        assert_eq!(SessionState::decode(&s.encode()), Ok(s));
        let empty = SessionState::default();
        assert_eq!(SessionState::decode(&empty.encode()), Ok(empty));
    }

    #[test]
    fn damaged_states_are_refused_with_the_reason() {
        let good = sample().encode();
        for cut in [0, 7, 31, 32, good.len() - 1] {
            assert!(matches!(SessionState::decode(&good[..cut]), Err(StateError::Truncated(_))), "cut at {cut}");
        }
        let mut magic = good.clone();
        magic[0] ^= 1;
        assert_eq!(SessionState::decode(&magic), Err(StateError::Magic));
        let mut version = good.clone();
        version[8] = 3;
        assert_eq!(SessionState::decode(&version), Err(StateError::Version(3)));
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 0x80;
        assert_eq!(SessionState::decode(&flipped), Err(StateError::Checksum));
        let mut longer = good.clone();
        longer.push(0);
        assert!(matches!(SessionState::decode(&longer), Err(StateError::Truncated(_))));
        let huge = vec![0u8; STATE_BYTES_MAX + 1];
        assert_eq!(SessionState::decode(&huge), Err(StateError::TooLong(STATE_BYTES_MAX + 1)));
    }

    /// A body re-checksummed after editing: only the structural checks
    /// stand between it and the session.
    fn with_body(edit: impl FnOnce(&mut Vec<u8>)) -> Result<SessionState, StateError> {
        let good = sample().encode();
        let mut body = good[HEADER_BYTES..].to_vec();
        edit(&mut body);
        let mut out = good[..HEADER_BYTES].to_vec();
        out[16..24].copy_from_slice(&(body.len() as u64).to_le_bytes());
        out[24..28].copy_from_slice(&keelfs_fs::crc(&body).to_le_bytes());
        out.extend_from_slice(&body);
        SessionState::decode(&out)
    }

    /// Random damage, re-checksummed so that it reaches the structural
    /// checks: decoding returns, never panics, and whatever it accepts
    /// encodes back to the same bytes.
    #[test]
    fn randomly_damaged_states_decode_or_are_refused() {
        let good = sample().encode();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut accepted = 0;
        for _ in 0..20_000 {
            let mut body = good[HEADER_BYTES..].to_vec();
            for _ in 0..1 + next() % 4 {
                let at = (next() % body.len() as u64) as usize;
                body[at] = next() as u8;
            }
            body.truncate(body.len() - (next() % 3 == 0) as usize * (next() % 40) as usize);
            let mut bytes = good[..HEADER_BYTES].to_vec();
            bytes[16..24].copy_from_slice(&(body.len() as u64).to_le_bytes());
            bytes[24..28].copy_from_slice(&keelfs_fs::crc(&body).to_le_bytes());
            bytes.extend_from_slice(&body);
            if let Ok(state) = SessionState::decode(&bytes) {
                assert_eq!(state.encode(), bytes);
                accepted += 1;
            }
        }
        assert!(accepted > 0, "some damage (to flags, cookies) still decodes");
    }

    #[test]
    fn checksummed_lies_are_refused_before_anything_is_allocated() {
        // A count of 2^61 lookups in a 100-byte state.
        let absurd = with_body(|b| b[32..40].copy_from_slice(&(1u64 << 61).to_le_bytes()));
        assert!(matches!(absurd, Err(StateError::Malformed(_))));
        let wrapping = with_body(|b| b[32..40].copy_from_slice(&u64::MAX.to_le_bytes()));
        assert!(matches!(wrapping, Err(StateError::Malformed(_))));
        let unknown_bits = with_body(|b| b[16] = 3);
        assert!(matches!(unknown_bits, Err(StateError::Malformed(_))));
        // The second lookup names inode 1 again.
        let twice = with_body(|b| b[64..72].copy_from_slice(&1u64.to_le_bytes()));
        assert!(matches!(twice, Err(StateError::Malformed(_))));
        let zero_refs = with_body(|b| b[56..64].fill(0));
        assert!(matches!(zero_refs, Err(StateError::Malformed(_))));
        let handle_zero = with_body(|b| b[80..88].fill(0));
        assert!(matches!(handle_zero, Err(StateError::Malformed(_))));
    }
}
