//! keelfs-vhost: the FUSE protocol, the virtio-fs vhost-user backend and the
//! /dev/fuse transport over keelfs-fs.
//!
//! - `fuse`: the wire protocol (`fuse::abi`), typed requests
//!   (`fuse::request`), the dispatcher over keelfs-fs (`fuse::dispatch`)
//!   with its per-opcode counters, and the /dev/fuse transport
//!   (`fuse::dev_fuse`);
//! - `virtio`: serving FUSE requests from virtqueue descriptor chains,
//!   with READ and WRITE using the guest's pages in place (`guest_io`);
//! - `vhost_user`: the virtio-fs device on vhost-user-backend, its
//!   queues polled by the reactors, and `socket` for its listener;
//! - `qos`: IOPS and bandwidth limits per export, shared by both
//!   transports on the export's reactor ([`Qos`]);
//! - `frontend`: a vhost-user-fs frontend that plays VMM and guest, for
//!   the tests and keelfs-bench.

mod bufpool;
mod dirty_log;
#[cfg(feature = "test-utils")]
pub mod frontend;
mod guest_io;
mod qos;
mod socket;
mod vhost_user;
mod virtio;

mod fuse {
    pub mod abi;
    pub mod coherence;
    pub mod dev_fuse;
    pub mod dispatch;
    pub mod locks;
    pub mod request;
    pub mod state;
    pub mod stats;
    pub mod trace;
    pub mod uring;
}

/// The FUSE wire format: opcodes, init flags and reply layouts, named as
/// linux/fuse.h names them. It stays a module, as the header is one
/// vocabulary, for the tests and tools that speak FUSE bytes.
pub use fuse::abi;
pub use fuse::coherence::{Change, Coherence};
pub use fuse::dev_fuse::{
    serve as serve_dev_fuse, serve_over as serve_dev_fuse_over, serve_with as serve_dev_fuse_with, FuseMount,
};
pub use fuse::dispatch::{
    CacheMode, Clients, Notify, Session, SessionConfig, LONG_TIMEOUT as LONG_CACHE_TIMEOUT, SESSION_HANDLES_MAX,
    SHARED_TIMEOUT as SHARED_CACHE_TIMEOUT,
};
pub use fuse::locks::{LockCounters, Locks, LOCKS_PER_CLIENT_MAX, LOCK_END_MAX, WAITS_PER_CLIENT_MAX};
pub use fuse::request::{InPlaceIo, IO_PREFIX_BYTES};
pub use fuse::state::{SessionState, StateError, STATE_BYTES_MAX, STATE_VERSION};
pub use fuse::stats::OpStats;
pub use fuse::trace::{parse_trace, Exchange, TraceError, TraceWriter, TRACE_MAGIC, WRITE_HEADERS};
pub use fuse::uring::{
    probe as probe_fuse_uring, UringError as FuseUringError, UringPlan as FuseUringPlan,
    ENABLE_PARAMETER as FUSE_URING_PARAMETER,
};
pub use qos::{Qos, QosError, QosLimits, QosStats, IO_BYTES_MAX as QOS_IO_BYTES_MAX};
pub use socket::{bind_listener, clear_stale, stop_accepting, SocketAccess};
pub use vhost_user::{ImageAccess, LocalFuture, ServeOptions, TransferError, VhostUserServer};
pub use virtio::{serve_chain, serve_queue, ChainOutcome, GuestRam, REQUEST_BYTES_MAX};
