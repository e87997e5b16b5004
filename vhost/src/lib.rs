//! keelfs-vhost: the FUSE protocol, the virtio-fs vhost-user backend and the
//! /dev/fuse transport over keelfs-core.
//!
//! So far: the wire protocol ([`fuse::abi`]), typed requests
//! ([`fuse::request`]) and the dispatcher over fs-core
//! ([`fuse::dispatch`]). The vhost-user backend and the /dev/fuse
//! transport are the next steps (issue 5).

pub mod fuse {
    pub mod abi;
    pub mod dispatch;
    pub mod request;
}
