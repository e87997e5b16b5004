//! keelfs-vhost: the FUSE protocol, the virtio-fs vhost-user backend and the
//! /dev/fuse transport over keelfs-core.
//!
//! So far only the wire protocol ([`fuse::abi`]) exists; the dispatcher,
//! the vhost-user backend and the /dev/fuse transport are the next steps
//! (issue 5).

pub mod fuse {
    pub mod abi;
}
