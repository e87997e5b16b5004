//! Opening the device a command names.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use keelfs_core::bdev::{BlockDevice, UringDevice, UringOptions};

use crate::tools::UsageError;

/// Open a file or block device with io_uring and O_DIRECT.
pub fn open(path: &Path) -> anyhow::Result<Arc<dyn BlockDevice>> {
    let meta = std::fs::metadata(path).map_err(|e| UsageError(format!("cannot open {}: {e}", path.display())))?;
    if meta.is_dir() {
        return Err(UsageError(format!("{} is a directory, not a file or block device", path.display())).into());
    }
    let dev = UringDevice::open(path, UringOptions::default())
        .with_context(|| format!("opening {} with io_uring and O_DIRECT", path.display()))?;
    Ok(Arc::new(dev))
}
