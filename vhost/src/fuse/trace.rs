//! A recording of a session's FUSE exchanges, so that the requests a
//! real workload makes (a source untar, a package install) can be replayed
//! against any vhost-user-fs daemon: `keelfs-bench vhost --workload trace`
//! (issue 34's mixed profile).
//!
//! The format, all integers little-endian:
//! - the 8 bytes `KFSTRC01`;
//! - per exchange: the request's length (u32) and bytes, then the
//!   reply's length (u32, 0 where FUSE expects none) and bytes. No file
//!   data is kept: a WRITE request keeps its headers (80 bytes, whose
//!   size field says how much a replay writes) and a READ reply its
//!   16-byte header, so a trace of an untar is mostly names.

use std::cell::RefCell;
use std::fs::File;
use std::io::{BufWriter, Write};

use super::abi::{Opcode, IN_HEADER_BYTES};

pub const TRACE_MAGIC: &[u8; 8] = b"KFSTRC01";

/// The longest request or reply a trace holds: a 1 MiB WRITE or READDIR
/// with its headers, and some room.
pub const TRACE_RECORD_BYTES_MAX: usize = (1 << 20) + 4096;

/// fuse_write_in's size.
const WRITE_IN_BYTES: usize = 40;

/// What a trace keeps of a WRITE request: fuse_in_header and
/// fuse_write_in.
pub const WRITE_HEADERS: usize = IN_HEADER_BYTES + WRITE_IN_BYTES;

/// Writes a trace; shared by the session that records into it.
#[derive(Debug)]
pub struct TraceWriter {
    /// None once a write has failed: tracing stops, the session goes on.
    out: RefCell<Option<BufWriter<File>>>,
}

impl TraceWriter {
    /// Start a trace in `file` (opened by the caller, before any sandbox).
    pub fn new(file: File) -> std::io::Result<Self> {
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(TRACE_MAGIC)?;
        Ok(Self { out: RefCell::new(Some(out)) })
    }

    /// Append one exchange.
    pub fn exchange(&self, request: &[u8], reply: Option<&[u8]>) {
        let mut out = self.out.borrow_mut();
        let Some(w) = out.as_mut() else { return };
        let opcode = request.get(4..8).map(|o| u32::from_le_bytes(o.try_into().expect("4 bytes")));
        let reply = reply.unwrap_or(&[]);
        let reply = if opcode == Some(Opcode::Read as u32) { &reply[..reply.len().min(16)] } else { reply };
        let request =
            if opcode == Some(Opcode::Write as u32) { &request[..request.len().min(WRITE_HEADERS)] } else { request };
        // Flushed at each exchange, one write(2): a daemon that is killed
        // leaves a whole trace up to its last request.
        let result = [request, reply]
            .iter()
            .try_for_each(|part| {
                w.write_all(&(part.len() as u32).to_le_bytes())?;
                w.write_all(part)
            })
            .and_then(|()| w.flush());
        if let Err(e) = result {
            tracing::warn!(error = %e, "writing the request trace failed: tracing stops");
            *out = None;
        }
    }

    /// Write out what is buffered.
    pub fn flush(&self) {
        if let Some(w) = self.out.borrow_mut().as_mut() {
            if let Err(e) = w.flush() {
                tracing::warn!(error = %e, "flushing the request trace failed");
            }
        }
    }
}

impl Drop for TraceWriter {
    fn drop(&mut self) {
        self.flush();
    }
}

/// One recorded exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exchange {
    pub request: Vec<u8>,
    /// Empty where FUSE expects no reply.
    pub reply: Vec<u8>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TraceError {
    #[error("not a request trace (no KFSTRC01 header)")]
    NotATrace,
    #[error("exchange {index} is cut short")]
    Truncated { index: usize },
    #[error("exchange {index} holds a record of {len} bytes (at most {TRACE_RECORD_BYTES_MAX})")]
    TooLong { index: usize, len: usize },
    #[error("exchange {index}'s request is shorter than a FUSE header")]
    NoHeader { index: usize },
}

/// Parse a whole trace.
pub fn parse_trace(bytes: &[u8]) -> Result<Vec<Exchange>, TraceError> {
    let mut rest = bytes.strip_prefix(&TRACE_MAGIC[..]).ok_or(TraceError::NotATrace)?;
    let mut out = Vec::new();
    while !rest.is_empty() {
        let index = out.len();
        let mut part = || -> Result<Vec<u8>, TraceError> {
            let len = rest.get(..4).ok_or(TraceError::Truncated { index })?;
            let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
            if len > TRACE_RECORD_BYTES_MAX {
                return Err(TraceError::TooLong { index, len });
            }
            let bytes = rest.get(4..4 + len).ok_or(TraceError::Truncated { index })?.to_vec();
            rest = &rest[4 + len..];
            Ok(bytes)
        };
        let request = part()?;
        let reply = part()?;
        if request.len() < IN_HEADER_BYTES {
            return Err(TraceError::NoHeader { index });
        }
        out.push(Exchange { request, reply });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(opcode: Opcode, unique: u64, body: &[u8]) -> Vec<u8> {
        super::super::abi::encode_request(opcode as u32, unique, 1, 0, 0, body)
    }

    #[test]
    fn a_trace_round_trips_and_keeps_no_read_data() {
        let scratch = keelfs_base::testing::ScratchFile::new("trace", 0);
        let writer = TraceWriter::new(File::create(&scratch.path).unwrap()).unwrap();
        let lookup = request(Opcode::Lookup, 1, b"a\0");
        let read = request(Opcode::Read, 2, &[0u8; 40]);
        let forget = request(Opcode::Forget, 3, &[0u8; 8]);
        let write = request(Opcode::Write, 4, &[9u8; 40 + 4096]);
        let read_reply = vec![0u8; 16 + 4096];
        writer.exchange(&lookup, Some(&[7u8; 144]));
        writer.exchange(&read, Some(&read_reply));
        writer.exchange(&forget, None);
        writer.exchange(&write, Some(&[0u8; 24]));
        drop(writer);
        let bytes = std::fs::read(&scratch.path).unwrap();
        let trace = parse_trace(&bytes).unwrap();
        assert_eq!(trace.len(), 4);
        assert_eq!(trace[0], Exchange { request: lookup, reply: vec![7u8; 144] });
        assert_eq!(trace[1].reply.len(), 16, "a READ reply keeps its header only");
        assert!(trace[2].reply.is_empty(), "a FORGET has no reply");
        assert_eq!(trace[3].request, write[..WRITE_HEADERS], "a WRITE keeps its headers, not its data");
        assert_eq!(parse_trace(&bytes[..bytes.len() - 1]), Err(TraceError::Truncated { index: 3 }));
        assert_eq!(parse_trace(b"KFSTRC02"), Err(TraceError::NotATrace));
        let mut huge = TRACE_MAGIC.to_vec();
        huge.extend(u32::MAX.to_le_bytes());
        assert!(matches!(parse_trace(&huge), Err(TraceError::TooLong { .. })), "no allocation of 4 GiB");
    }
}
