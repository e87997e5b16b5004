//! Little-endian encoding of on-disk structures. Every reader is bounded
//! and returns an error on short or malformed input: a corrupt image is a
//! report, never a panic.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {what} at byte {at}")]
pub struct DecodeError {
    pub what: &'static str,
    pub at: usize,
}

#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn i64(&mut self, v: i64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn bytes(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(v);
    }
    /// A length-prefixed byte string (u32 length).
    pub fn blob(&mut self, v: &[u8]) {
        // Names, values and symlink targets are bounded far below 4 GiB
        // before they get here; a longer one would wrap its prefix.
        self.u32(u32::try_from(v.len()).expect("a blob longer than its u32 length prefix"));
        self.bytes(v);
    }
}

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }
    pub fn pos(&self) -> usize {
        self.pos
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.remaining() < n {
            return Err(DecodeError { what, at: self.pos });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    pub fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(what)?[0])
    }
    pub fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    pub fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    pub fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    pub fn i64(&mut self, what: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(self.array(what)?))
    }
    /// A length-prefixed byte string, refused when longer than `max`.
    pub fn blob(&mut self, max: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let at = self.pos;
        let len = self.u32(what)? as usize;
        if len > max {
            return Err(DecodeError { what, at });
        }
        self.take(len, what)
    }
}
