//! A blocking adapter over an [`IoQueue`], for tools (mkfs, fsck) and tests.
//! Nothing on an I/O path of the daemon uses it.

use super::{AlignedBuf, BdevError, BlockDevice, Completion, Geometry, IoQueue, IoRequest, IoVec, QueueConfig};

pub struct BlockingIo {
    queue: Box<dyn IoQueue>,
    next_token: u64,
    completions: Vec<Completion>,
}

impl BlockingIo {
    pub fn new(queue: Box<dyn IoQueue>) -> Self {
        Self { queue, next_token: 1, completions: Vec::with_capacity(4) }
    }

    pub fn open(device: &dyn BlockDevice) -> Result<Self, BdevError> {
        Ok(Self::new(device.open_queue(QueueConfig { depth: 4, completion_eventfd: false })?))
    }

    pub fn geometry(&self) -> Geometry {
        self.queue.geometry()
    }

    pub fn read_at(&mut self, offset: u64, buf: &mut AlignedBuf) -> Result<u32, BdevError> {
        let iov = [buf.iovec()];
        // SAFETY: `buf` is borrowed mutably until `wait` returns the completion.
        unsafe { self.run(|token| IoRequest::read(token, offset, &iov)) }
    }

    pub fn write_at(&mut self, offset: u64, buf: &mut AlignedBuf) -> Result<u32, BdevError> {
        let iov = [buf.iovec()];
        // SAFETY: as in read_at.
        unsafe { self.run(|token| IoRequest::write(token, offset, &iov)) }
    }

    /// # Safety
    /// As for [`IoQueue::submit`]: the iovecs stay valid until this returns,
    /// which it does only after the completion arrived.
    pub unsafe fn readv_at(&mut self, offset: u64, iov: &[IoVec]) -> Result<u32, BdevError> {
        // SAFETY: forwarded contract.
        unsafe { self.run(|token| IoRequest::read(token, offset, iov)) }
    }

    /// # Safety
    /// As for [`BlockingIo::readv_at`].
    pub unsafe fn writev_at(&mut self, offset: u64, iov: &[IoVec]) -> Result<u32, BdevError> {
        // SAFETY: forwarded contract.
        unsafe { self.run(|token| IoRequest::write(token, offset, iov)) }
    }

    pub fn flush(&mut self) -> Result<u32, BdevError> {
        // SAFETY: a flush names no memory.
        unsafe { self.run(IoRequest::flush) }
    }

    pub fn discard(&mut self, offset: u64, bytes: u64) -> Result<u32, BdevError> {
        // SAFETY: a discard names no memory.
        unsafe { self.run(|token| IoRequest::discard(token, offset, bytes)) }
    }

    /// # Safety
    /// The request's memory must stay valid until this returns.
    unsafe fn run<'a>(&mut self, make: impl FnOnce(u64) -> IoRequest<'a>) -> Result<u32, BdevError> {
        let token = self.next_token;
        self.next_token += 1;
        let req = make(token);
        // SAFETY: forwarded contract; we do not return before the completion.
        unsafe { self.queue.submit(&req)? };
        loop {
            self.completions.clear();
            if self.queue.poll(&mut self.completions, 1) == 1 {
                let c = self.completions[0];
                assert_eq!(c.token, token, "blocking adapter saw a foreign completion");
                return c.result;
            }
            std::hint::spin_loop();
        }
    }
}
