//! keelfs-vhost: FUSE protocol, virtio-fs vhost-user backend and /dev/fuse transport (built in a later issue).
