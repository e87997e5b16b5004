//! Opening the device a command names.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use keelfs_bdev::{
    BlockDevice, MappedDevice, NvmeAddress, NvmeDevice, NvmeError, NvmeOptions, RbdAddress, RbdDevice, RbdError,
    RbdOptions, UringDevice, UringOptions,
};

use crate::config::BackendName;

use crate::tools::UsageError;

/// Open a file or block device with io_uring and O_DIRECT.
pub fn open(path: &Path) -> anyhow::Result<Arc<dyn BlockDevice>> {
    open_backend(path, BackendName::Uring, None, false)
}

/// Open an export's device with the backend its config names. A path that
/// is missing or a directory is a usage error, whatever the backend.
pub fn open_backend(
    path: &Path,
    backend: BackendName,
    sqpoll_idle_ms: Option<u32>,
    read_only: bool,
) -> anyhow::Result<Arc<dyn BlockDevice>> {
    let name = path.to_string_lossy();
    if RbdAddress::is_rbd_name(&name) || backend == BackendName::Rbd {
        return Ok(Arc::new(open_rbd(path, RbdOptions { read_only, defer_lock: false })?));
    }
    if NvmeAddress::is_nvme_name(&name) || backend == BackendName::Nvme {
        if read_only {
            // The driver has no read-only mode: a controller cannot be
            // opened so that writes are impossible, as a file can.
            return Err(UsageError(format!("{name}: read-only exports are not supported on NVMe devices")).into());
        }
        if backend == BackendName::Pmem {
            return Err(UsageError(format!("{name} names an NVMe controller; the pmem backend needs a file")).into());
        }
        let address = NvmeAddress::parse(&name).map_err(|e| UsageError(e.to_string()))?;
        let device = NvmeDevice::open(&address, NvmeOptions::default()).map_err(|e| match e {
            // The device cannot be opened as named: a usage error (exit 2),
            // whose message says how to fix it.
            NvmeError::Setup(_) | NvmeError::NoNamespace { .. } | NvmeError::BadAddress(_) => {
                anyhow::Error::new(UsageError(format!("opening {address}: {e}")))
            }
            e => anyhow::Error::new(e).context(format!("opening NVMe controller {address} through VFIO")),
        })?;
        return Ok(Arc::new(device));
    }
    let meta = std::fs::metadata(path).map_err(|e| UsageError(format!("cannot open {}: {e}", path.display())))?;
    if meta.is_dir() {
        return Err(UsageError(format!("{} is a directory, not a file or block device", path.display())).into());
    }
    Ok(match backend {
        BackendName::Uring => Arc::new(
            UringDevice::open(path, UringOptions { sqpoll_idle_ms, read_only })
                .with_context(|| format!("opening {} with io_uring and O_DIRECT", path.display()))?,
        ),
        BackendName::Nvme | BackendName::Rbd => unreachable!("handled above"),
        BackendName::Pmem => Arc::new(
            MappedDevice::pmem_with(path, 4096, read_only)
                .with_context(|| format!("mapping {} as pmem", path.display()))?,
        ),
    })
}

/// Whether `path` names an RBD image (`rbd:POOL/IMAGE...`).
pub fn is_rbd(path: &Path) -> bool {
    RbdAddress::is_rbd_name(&path.to_string_lossy())
}

/// Parse an `rbd:` name; a malformed one is a usage error.
pub fn rbd_address(path: &Path) -> anyhow::Result<RbdAddress> {
    RbdAddress::parse(&path.to_string_lossy()).map_err(|e| UsageError(e.to_string()).into())
}

/// Open an RBD image. A wrong name, configuration, credential, pool or
/// image, or a lock another client holds, is a usage error (exit 2) whose
/// message says what to fix; a failing cluster is not.
pub fn open_rbd(path: &Path, options: RbdOptions) -> anyhow::Result<RbdDevice> {
    let address = rbd_address(path)?;
    RbdDevice::open(&address, options).map_err(rbd_error)
}

/// Read an RBD image's conf and key, to connect later (see
/// [`keelfs_bdev::RbdPrepared`]); errors as [`open_rbd`]'s.
pub fn prepare_rbd(path: &Path, options: RbdOptions) -> anyhow::Result<keelfs_bdev::RbdPrepared> {
    let address = rbd_address(path)?;
    RbdDevice::prepare(&address, options).map_err(rbd_error)
}

/// An RBD error as keelfsd reports it (see [`open_rbd`]).
pub fn rbd_error(e: RbdError) -> anyhow::Error {
    if e.is_usage() {
        UsageError(e.to_string()).into()
    } else {
        anyhow::Error::new(e)
    }
}
