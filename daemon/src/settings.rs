//! The RPC methods that change one running export's settings or run an
//! operation on it: each is a task on the export's reactor, which owns
//! the filesystem. Nothing here is written back to the config file, which
//! stays the boot-time source.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::control::{Control, LocalJob};
use crate::rpc::{code, RpcError};

/// How long a setting change may take on the reactor.
const SETTING_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an fstrim may take (it goes on if the call gives up).
const TRIM_TIMEOUT: Duration = Duration::from_secs(110);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaParams {
    tag: String,
    /// Bytes the export may hold; 0 lifts the limit; absent: unchanged.
    bytes: Option<u64>,
    /// Inodes the export may hold; 0 lifts the limit; absent: unchanged.
    inodes: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TrimParams {
    tag: String,
    /// Free runs shorter than this are left alone (fstrim's --minimum).
    min_bytes: Option<u64>,
}

fn parse<T: for<'de> Deserialize<'de>>(params: Value) -> Result<T, RpcError> {
    serde_json::from_value(params)
        .map_err(|e| RpcError { code: code::INVALID_PARAMS, message: format!("invalid params: {e}") })
}

/// A job on the export's filesystem, which must be mounted on its reactor.
fn on_fs<F, Fut>(tag: &str, work: F) -> LocalJob
where
    F: FnOnce(keelfs_fs::Fs) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<Value, String>> + 'static,
{
    let tag = tag.to_string();
    Box::new(move || {
        Box::pin(async move {
            match crate::serve::local_fs(&tag) {
                Some(fs) => work(fs).await,
                None => Err(format!("export {tag} has no image mounted here (handed to a migration?)")),
            }
        })
    })
}

/// `export_set_quota {tag, bytes?, inodes?}`: the new quota.
pub fn set_quota(params: Value, control: &Control) -> Result<Value, RpcError> {
    let p: QuotaParams = parse(params)?;
    if p.bytes.is_some_and(|b| b != 0 && b < 1 << 20) || p.inodes.is_some_and(|i| i != 0 && i < 16) {
        return Err(RpcError { code: code::INVALID_PARAMS, message: "a quota is at least 1 MiB and 16 inodes".into() });
    }
    let job = on_fs(&p.tag, move |fs| async move {
        let mut quota = fs.quota();
        if let Some(bytes) = p.bytes {
            quota.bytes = (bytes != 0).then_some(bytes);
        }
        if let Some(inodes) = p.inodes {
            quota.inodes = (inodes != 0).then_some(inodes);
        }
        fs.set_quota(quota).map_err(|e| e.to_string())?;
        let quota = fs.quota();
        Ok(json!({"bytes": quota.bytes, "inodes": quota.inodes}))
    });
    Ok(control.on_export_reactor(&p.tag, SETTING_TIMEOUT, job)?)
}

/// `export_trim {tag, min_bytes?}`: discard the free space; the bytes
/// trimmed.
pub fn trim(params: Value, control: &Control) -> Result<Value, RpcError> {
    let p: TrimParams = parse(params)?;
    let min_bytes = p.min_bytes.unwrap_or(0);
    let job = on_fs(&p.tag, move |fs| async move {
        let trimmed = fs.trim(min_bytes).await.map_err(|e| e.to_string())?;
        Ok(json!({"trimmed_bytes": trimmed}))
    });
    Ok(control.on_export_reactor(&p.tag, TRIM_TIMEOUT, job)?)
}
