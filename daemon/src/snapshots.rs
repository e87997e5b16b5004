//! The snapshot RPCs (issue 37; docs/RPC.md): `snapshot_create`,
//! `snapshot_list` and `snapshot_delete`, each a task on the export's
//! reactor, which owns the filesystem. The filesystem does the work
//! (fs-core's `Admin`); this module checks the parameters, gives the
//! filesystem the time, and shapes the answers.

use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{json, Value};

use keelfs_fs::{SnapshotInfo, Timespec};

use crate::control::Control;
use crate::rpc::{code, RpcError};
use crate::settings::{on_fs, parse};

/// How long a snapshot may take: it writes a whole checkpoint, which on
/// a million files is some hundreds of megabytes. It goes on if the call
/// gives up.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(110);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NamedParams {
    export: String,
    name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListParams {
    export: String,
}

fn named(params: Value) -> Result<NamedParams, RpcError> {
    let p: NamedParams = parse(params)?;
    keelfs_fs::check_snapshot_name(&p.name)
        .map_err(|why| RpcError { code: code::INVALID_PARAMS, message: why.to_string() })?;
    Ok(p)
}

fn info_json(s: &SnapshotInfo) -> Value {
    let Timespec { sec, nsec } = s.created;
    json!({
        "name": s.name,
        "created": {"sec": sec, "nsec": nsec},
        "data_bytes": s.data_blocks * keelfs_fs::BLOCK_BYTES as u64,
        "exclusive_bytes": s.exclusive_bytes(),
    })
}

/// `snapshot_create {export, name}`: the new snapshot, as `snapshot_list`
/// shows it, and `took_ns`: how long the call took on the reactor (the
/// guest's requests go on meanwhile but for the state's encoding; fsyncs
/// wait for the whole).
pub fn create(params: Value, control: &Control) -> Result<Value, RpcError> {
    let p = named(params)?;
    let tag = p.export.clone();
    let job = on_fs(&p.export, move |fs| async move {
        let started = Instant::now();
        fs.admin().snapshot_create(&p.name, Timespec::now()).await?;
        let took = started.elapsed();
        let list = fs.admin().snapshot_list();
        let made = list.iter().find(|s| s.name == p.name).expect("the snapshot just made");
        let mut answer = info_json(made);
        answer["took_ns"] = json!(took.as_nanos() as u64);
        Ok(answer)
    });
    Ok(control.on_export_reactor(&tag, SNAPSHOT_TIMEOUT, job)?)
}

/// `snapshot_delete {export, name}`: `{"name", "deleted": true}`; the
/// space only it held is free when the call returns.
pub fn delete(params: Value, control: &Control) -> Result<Value, RpcError> {
    let p = named(params)?;
    let tag = p.export.clone();
    if let Some(user) = control.snapshot_users(&tag, &p.name).first() {
        let message = format!("snapshot {:?} is served as export {user:?}; remove that export first", p.name);
        return Err(RpcError { code: code::BUSY, message });
    }
    let job = on_fs(&p.export, move |fs| async move {
        fs.admin().snapshot_delete(&p.name).await?;
        Ok(json!({"name": p.name, "deleted": true}))
    });
    Ok(control.on_export_reactor(&tag, SNAPSHOT_TIMEOUT, job)?)
}

/// `snapshot_list {export}`: every snapshot, oldest first.
pub fn list(params: Value, control: &Control) -> Result<Value, RpcError> {
    let p: ListParams = parse(params)?;
    let job = on_fs(&p.export, move |fs| async move {
        Ok(Value::Array(fs.admin().snapshot_list().iter().map(info_json).collect()))
    });
    Ok(control.on_export_reactor(&p.export, SNAPSHOT_TIMEOUT, job)?)
}
