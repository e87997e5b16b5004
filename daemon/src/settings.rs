//! The RPC methods that change one running export's settings or run an
//! operation on it: each is a task on the export's reactor, which owns
//! the filesystem. Nothing here is written back to the config file, which
//! stays the boot-time source.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

use keelfs_vhost::QosLimits;

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

/// `export_set_qos`: as `[export.qos]`; a key left out keeps its value,
/// 0 lifts that limit.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QosParams {
    tag: String,
    read_iops: Option<u64>,
    write_iops: Option<u64>,
    iops: Option<u64>,
    read_mib_per_sec: Option<u64>,
    write_mib_per_sec: Option<u64>,
    mib_per_sec: Option<u64>,
    burst_ms: Option<u32>,
}

impl QosParams {
    /// `current` with the keys given applied.
    fn apply(&self, current: QosLimits) -> QosLimits {
        let count = |given: Option<u64>, now: Option<u64>| given.map_or(now, |n| (n != 0).then_some(n));
        let mib = |given: Option<u64>, now: Option<u64>| match given {
            None => now,
            Some(0) => None,
            Some(n) => Some(n.saturating_mul(1 << 20)),
        };
        QosLimits {
            read_iops: count(self.read_iops, current.read_iops),
            write_iops: count(self.write_iops, current.write_iops),
            iops: count(self.iops, current.iops),
            read_bytes_per_sec: mib(self.read_mib_per_sec, current.read_bytes_per_sec),
            write_bytes_per_sec: mib(self.write_mib_per_sec, current.write_bytes_per_sec),
            bytes_per_sec: mib(self.mib_per_sec, current.bytes_per_sec),
            burst_ms: self.burst_ms.unwrap_or(current.burst_ms),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TrimParams {
    tag: String,
    /// Free runs shorter than this are left alone (fstrim's --minimum).
    min_bytes: Option<u64>,
}

/// The params as `T`; a mismatch is -32602 with serde's reason.
pub(crate) fn parse<T: for<'de> Deserialize<'de>>(params: Value) -> Result<T, RpcError> {
    serde_json::from_value(params)
        .map_err(|e| RpcError { code: code::INVALID_PARAMS, message: format!("invalid params: {e}") })
}

/// A job on the export's filesystem, which must be mounted on its reactor.
pub(crate) fn on_fs<F, Fut>(tag: &str, work: F) -> LocalJob
where
    F: FnOnce(keelfs_fs::Fs) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<Value>> + 'static,
{
    let tag = tag.to_string();
    Box::new(move || {
        Box::pin(async move {
            match crate::serve::local_fs(&tag) {
                Some(fs) => work(fs).await,
                None => Err(anyhow::anyhow!("export {tag} has no image mounted here (handed to a migration?)")),
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
        let mut quota = fs.admin().quota();
        if let Some(bytes) = p.bytes {
            quota.bytes = (bytes != 0).then_some(bytes);
        }
        if let Some(inodes) = p.inodes {
            quota.inodes = (inodes != 0).then_some(inodes);
        }
        fs.admin().set_quota(quota)?;
        let quota = fs.admin().quota();
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
        let trimmed = fs.admin().trim(min_bytes).await?;
        Ok(json!({"trimmed_bytes": trimmed}))
    });
    Ok(control.on_export_reactor(&p.tag, TRIM_TIMEOUT, job)?)
}

/// `export_set_qos {tag, read_iops?, ...}`: the export's QoS afterwards, as
/// the stats show it.
pub fn set_qos(params: Value, control: &Control) -> Result<Value, RpcError> {
    let p: QosParams = parse(params)?;
    let tag = p.tag.clone();
    let job: LocalJob =
        Box::new(move || Box::pin(async move { Ok(crate::serve::set_export_qos(&p.tag, |now| p.apply(now))?) }));
    Ok(control.on_export_reactor(&tag, SETTING_TIMEOUT, job)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qos_params_change_only_what_they_name() {
        let now = QosLimits { iops: Some(5000), read_bytes_per_sec: Some(100 << 20), ..QosLimits::UNLIMITED };
        let p: QosParams =
            serde_json::from_value(json!({"tag": "a", "write_iops": 10, "iops": 0, "mib_per_sec": 3})).unwrap();
        let next = p.apply(now);
        assert_eq!(next.iops, None, "0 lifts a limit");
        assert_eq!(next.write_iops, Some(10));
        assert_eq!(next.read_bytes_per_sec, Some(100 << 20), "left out: kept");
        assert_eq!(next.bytes_per_sec, Some(3 << 20), "MiB/s, as the config");
        assert_eq!(next.burst_ms, now.burst_ms);
        assert!(serde_json::from_value::<QosParams>(json!({"tag": "a", "iop": 1})).is_err());
    }
}
