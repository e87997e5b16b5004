//! keelfs-vhost: the FUSE protocol, the virtio-fs vhost-user backend and the
//! /dev/fuse transport over keelfs-core.
//!
//! So far: the wire protocol ([`fuse::abi`]), typed requests
//! ([`fuse::request`]), the dispatcher over fs-core ([`fuse::dispatch`])
//! and the /dev/fuse transport ([`fuse::dev_fuse`]), and serving requests
//! from virtqueue descriptor chains ([`virtio`]). Wiring that to the
//! vhost-user protocol (vhost-user-backend) is the next step (issue 5).

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
