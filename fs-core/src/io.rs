//! The filesystem's device: every read, write, flush and discard it
//! issues goes through [`Io`], in whole blocks named by [`DevBlock`].
//!
//! Invariants, asserted on every request in debug builds: a request
//! starts at a block, its buffer is as many whole blocks as it says, and
//! it lies inside the device. The filesystem never
//! asks for anything else (extents are checked against the device's size
//! when an image is loaded, and buffers are sized in blocks), so a request
//! that breaks them is a bug in keelfs-fs, not a crafted image.

use std::cell::Cell;

use keelfs_bdev::{AlignedBuf, Geometry};
use keelfs_reactor::{await_all, DeviceChannel, IoBuffer, IoFuture, IoVecs, NoBuffer};

use crate::blocks::{block_bytes, DevBlock};
use crate::format::BLOCK_BYTES;
use crate::FsResult;

/// The device one filesystem owns.
pub(crate) struct Io {
    dev: DeviceChannel,
    geometry: Geometry,
    /// Cache flushes issued (none on a device without a volatile cache).
    flushes: Cell<u64>,
}

impl Io {
    pub fn new(dev: DeviceChannel) -> Self {
        let geometry = dev.geometry();
        Self { dev, geometry, flushes: Cell::new(0) }
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    pub fn flushes(&self) -> u64 {
        self.flushes.get()
    }

    /// Asserts that `blocks` blocks from `at` lie inside the device.
    /// Loading checks an image's extents and areas against the device's
    /// size, so a request past it is keelfs-fs's bug; a release build
    /// leaves it to the device, which refuses it with an error rather
    /// than the daemon stopping on it.
    fn check(&self, at: DevBlock, blocks: u64) {
        let end = at.get().checked_add(blocks).map(block_bytes);
        debug_assert!(
            blocks > 0 && end.is_some_and(|end| end <= self.geometry.capacity_bytes),
            "a device request of {blocks} blocks at block {} (the device holds {} bytes)",
            at.get(),
            self.geometry.capacity_bytes
        );
    }

    /// Asserts (in debug builds: it walks the buffer's segments) that
    /// `buffer` is `blocks` blocks long.
    fn check_buffer<B: IoBuffer>(buffer: &mut B, blocks: u64) {
        if cfg!(debug_assertions) {
            let mut iovecs = IoVecs::new();
            buffer.iovecs(&mut iovecs);
            let bytes: usize = iovecs.iter().map(|v| v.len).sum();
            assert_eq!(bytes as u64, block_bytes(blocks), "a buffer of {bytes} bytes for {blocks} blocks");
        }
    }

    /// Read `blocks` blocks from `at` into `buffer`, which is that long.
    pub fn read<B: IoBuffer>(&self, at: DevBlock, blocks: u64, mut buffer: B) -> IoFuture<B> {
        self.check(at, blocks);
        Self::check_buffer(&mut buffer, blocks);
        self.dev.read(at.offset(), buffer)
    }

    /// Write `buffer`, `blocks` blocks long, at `at`.
    pub fn write<B: IoBuffer>(&self, at: DevBlock, blocks: u64, mut buffer: B) -> IoFuture<B> {
        self.check(at, blocks);
        Self::check_buffer(&mut buffer, blocks);
        self.dev.write(at.offset(), buffer)
    }

    /// Discard `blocks` blocks from `at`.
    pub fn discard(&self, at: DevBlock, blocks: u64) -> IoFuture<NoBuffer> {
        self.check(at, blocks);
        self.dev.discard(at.offset(), block_bytes(blocks))
    }

    /// Make completed writes durable: a flush where the device has a
    /// volatile write cache, nothing where it has none.
    pub async fn flush(&self) -> FsResult<()> {
        if !self.geometry.volatile_write_cache {
            return Ok(());
        }
        let (_, result) = self.dev.flush().await;
        self.flushes.set(self.flushes.get() + 1);
        result?;
        Ok(())
    }

    /// `count` blocks from `block`, in a new buffer.
    pub async fn read_blocks(&self, block: DevBlock, count: usize) -> FsResult<AlignedBuf> {
        let buf = AlignedBuf::zeroed(count * BLOCK_BYTES, BLOCK_BYTES);
        let (buf, result) = self.read(block, count as u64, buf).await;
        result?;
        Ok(buf)
    }

    /// Write `buf` at `block`, in as many requests as the device's
    /// largest allows.
    pub async fn write_blocks(&self, block: DevBlock, buf: AlignedBuf) -> FsResult<()> {
        let max = self.geometry.max_request_bytes as usize;
        if buf.len() <= max {
            let blocks = (buf.len() / BLOCK_BYTES) as u64;
            let (_, result) = self.write(block, blocks, buf).await;
            result?;
            return Ok(());
        }
        let max_blocks = max / BLOCK_BYTES;
        assert!(max_blocks > 0, "a device whose largest request is below a block");
        let mut pending = Vec::new();
        for (i, chunk) in buf.chunks(max_blocks * BLOCK_BYTES).enumerate() {
            let mut part = AlignedBuf::zeroed(chunk.len(), BLOCK_BYTES);
            part.copy_from_slice(chunk);
            let blocks = (part.len() / BLOCK_BYTES) as u64;
            pending.push(self.write(block + (i * max_blocks) as u64, blocks, part));
        }
        await_all(pending).await?;
        Ok(())
    }
}
