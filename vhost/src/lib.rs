//! keelfs-vhost: the FUSE protocol, the virtio-fs vhost-user backend and the
//! /dev/fuse transport over keelfs-fs.
//!
//! - [`fuse`]: the wire protocol ([`fuse::abi`]), typed requests
//!   ([`fuse::request`]), the dispatcher over keelfs-fs ([`fuse::dispatch`])
//!   with its per-opcode counters, and the /dev/fuse transport
//!   ([`fuse::dev_fuse`]);
//! - [`virtio`]: serving FUSE requests from virtqueue descriptor chains,
//!   with READ and WRITE using the guest's pages in place ([`guest_io`]);
//! - [`vhost_user`]: the virtio-fs device on vhost-user-backend, its
//!   queues polled by the reactors, and [`socket`] for its listener;
//! - [`frontend`]: a vhost-user-fs frontend that plays VMM and guest, for
//!   the tests and keelfs-bench.

pub mod frontend;
pub mod guest_io;
pub mod socket;
pub mod vhost_user;
pub mod virtio;

pub mod fuse {
    pub mod abi;
    pub mod dev_fuse;
    pub mod dispatch;
    pub mod request;
    pub mod stats;
}
