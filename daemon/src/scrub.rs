//! The scrub RPCs (issue 38; docs/RPC.md): `scrub_start`, `scrub_status`
//! and `scrub_cancel`. A scrub is a task on the export's reactor that
//! asks the filesystem for one bounded step at a time (fs-core's
//! `Admin::scrub_step`), paced by a [`Pacer`] at the rate asked and
//! charged to the export's QoS as background reads, after the guest's.
//! The filesystem keeps the cursor in the image, so a restarted daemon
//! (or the destination of a migration) resumes the scrub when it mounts
//! the image.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

use keelfs_fs::{BadBlock, Fs, ScrubCursor, SCRUB_STEP_BLOCKS_MAX};
use keelfs_reactor as reactor;

use crate::control::Control;
use crate::rpc::{code, RpcError};
use crate::settings::parse;

/// The rates a scrub may be asked for, MiB/s.
const MIB_PER_SEC_MAX: u64 = 100_000;
/// Bytes one step reads at most.
const STEP_BYTES: u64 = SCRUB_STEP_BLOCKS_MAX * keelfs_fs::BLOCK_BYTES as u64;
/// Bad blocks a status lists (the count goes on).
const BAD_LISTED_MAX: usize = 64;
/// The cursor is recorded in the image every this many steps, or this
/// often by the reactor's clock, whichever comes first (and at the end):
/// a restart goes back at most this far.
const SAVE_EVERY_STEPS: u64 = 16;
const SAVE_EVERY: Duration = Duration::from_secs(1);
const RPC_TIMEOUT: Duration = Duration::from_secs(10);

/// Paces a scrub at `bytes_per_sec`, with time as an input: a bucket of
/// credit that fills at the rate and holds two steps at most. The second
/// step absorbs a wake-up that comes late (a reactor's sleep overshoots
/// by its poll interval: with one step of room the first measurement
/// lost 4.6% of the rate to that); a scrub that fell far behind (the
/// reactor busy, QoS holding it) still never bursts to catch up.
#[derive(Clone, Debug)]
pub struct Pacer {
    bytes_per_sec: u64,
    /// Credit in byte-nanoseconds (bytes × 10^9), so that no rounding is
    /// lost between refills.
    credit: u128,
    cap: u128,
    last: Duration,
}

const NANOS: u128 = 1_000_000_000;

impl Pacer {
    /// A pacer at `bytes_per_sec` (at least 1), full, at time `now`.
    pub fn new(bytes_per_sec: u64, step_bytes: u64, now: Duration) -> Self {
        assert!(bytes_per_sec > 0 && step_bytes > 0);
        let step = u128::from(step_bytes) * NANOS;
        Self { bytes_per_sec, credit: step, cap: 2 * step, last: now }
    }

    /// Take `bytes` (at most a step) at time `now`: Ok, or Err with how
    /// long until there is credit for them.
    pub fn take(&mut self, bytes: u64, now: Duration) -> Result<(), Duration> {
        let cost = u128::from(bytes) * NANOS;
        assert!(2 * cost <= self.cap, "{bytes} bytes is more than a step");
        let elapsed = now.saturating_sub(self.last).as_nanos();
        self.last = self.last.max(now);
        self.credit = (self.credit + elapsed * u128::from(self.bytes_per_sec)).min(self.cap);
        if self.credit >= cost {
            self.credit -= cost;
            return Ok(());
        }
        let wait_ns = (cost - self.credit).div_ceil(u128::from(self.bytes_per_sec));
        Err(Duration::from_nanos(wait_ns.min(u128::from(u64::MAX)) as u64))
    }
}

/// Where a scrub is, as `scrub_status` names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum ScrubState {
    /// No scrub of the export has run since the daemon started.
    #[default]
    None,
    Running,
    Done,
    Cancelled,
    /// Its export stopped being served before it ended.
    Stopped,
    Failed,
}

impl ScrubState {
    fn name(self) -> &'static str {
        match self {
            ScrubState::None => "none",
            ScrubState::Running => "running",
            ScrubState::Done => "done",
            ScrubState::Cancelled => "cancelled",
            ScrubState::Stopped => "stopped",
            ScrubState::Failed => "failed",
        }
    }
}

/// What a scrub has done, for `scrub_status`.
#[derive(Clone, Debug, Default)]
struct Progress {
    state: ScrubState,
    cursor: Option<ScrubCursor>,
    bytes_per_sec: u64,
    blocks_checked: u64,
    errors: u64,
    bad: Vec<BadBlock>,
    started_at: Option<Duration>,
    error: Option<String>,
}

/// One export's scrub on this reactor.
struct Job {
    progress: RefCell<Progress>,
    cancel: Cell<bool>,
}

thread_local! {
    /// The scrubs of this reactor's exports, by export tag: the last one
    /// of each (its status stays after it ends).
    static JOBS: RefCell<HashMap<String, Rc<Job>>> = RefCell::new(HashMap::new());
}

fn running(tag: &str) -> bool {
    JOBS.with(|j| j.borrow().get(tag).is_some_and(|job| job.progress.borrow().state == ScrubState::Running))
}

/// Start a scrub of export `tag` at `from`: a task on this reactor.
fn spawn(tag: &str, from: ScrubCursor, bytes_per_sec: u64) {
    let now = reactor_time();
    let progress = Progress {
        state: ScrubState::Running,
        cursor: Some(from),
        bytes_per_sec,
        started_at: Some(now),
        ..Progress::default()
    };
    let job = Rc::new(Job { progress: RefCell::new(progress), cancel: Cell::new(false) });
    JOBS.with(|j| j.borrow_mut().insert(tag.to_string(), job.clone()));
    let tag = tag.to_string();
    reactor::spawn_local(async move {
        let ended = drive(&tag, &job, from, bytes_per_sec).await;
        let mut p = job.progress.borrow_mut();
        match ended {
            Ok(state) => p.state = state,
            Err(e) => {
                tracing::warn!("export {tag}: scrub stopped: {e:#}");
                (p.state, p.error) = (ScrubState::Failed, Some(format!("{e:#}")));
            }
        }
    });
}

/// The reactor's clock as time since an arbitrary start (the pacer's
/// input).
fn reactor_time() -> Duration {
    thread_local! {
        static EPOCH: std::time::Instant = reactor::now();
    }
    EPOCH.with(|e| reactor::now().saturating_duration_since(*e))
}

/// The scrub's loop: pace, pass QoS, step, record. Returns the state it
/// ended in.
async fn drive(tag: &str, job: &Job, from: ScrubCursor, bytes_per_sec: u64) -> anyhow::Result<ScrubState> {
    let mut pacer = Pacer::new(bytes_per_sec, STEP_BYTES, reactor_time());
    let mut cursor = from;
    let (mut steps, mut saved_at) = (0u64, reactor_time());
    // This pass's shared blocks read (a restart forgets them, and reads
    // some again).
    let mut seen = keelfs_fs::SeenShared::default();
    loop {
        let Some(fs) = crate::serve::local_fs(tag) else { return Ok(ScrubState::Stopped) };
        if job.cancel.get() {
            save(&fs, None)?;
            return Ok(ScrubState::Cancelled);
        }
        if let Err(wait) = pacer.take(STEP_BYTES, reactor_time()) {
            reactor::sleep(wait).await;
            continue;
        }
        if let Some(qos) = crate::serve::local_qos(tag) {
            while let Err(at) = qos.admit_background_read(STEP_BYTES, reactor::now()) {
                reactor::sleep_until(at).await;
            }
        }
        let step = fs.admin().scrub_step(cursor, SCRUB_STEP_BLOCKS_MAX, &mut seen).await?;
        record(job, &step);
        steps += 1;
        match step.next {
            None => {
                save(&fs, None)?;
                return Ok(ScrubState::Done);
            }
            Some(next) => cursor = next,
        }
        let due = steps.is_multiple_of(SAVE_EVERY_STEPS) || reactor_time().saturating_sub(saved_at) >= SAVE_EVERY;
        if due && crate::serve::local_fs(tag).is_some() {
            save(&fs, Some((cursor, bytes_per_sec)))?;
            saved_at = reactor_time();
        }
    }
}

/// Record where the scrub stands in the image. A read-only export scrubs
/// all the same, without a cursor to resume from.
fn save(fs: &Fs, at: Option<(ScrubCursor, u64)>) -> anyhow::Result<()> {
    match fs.admin().scrub_save(at) {
        Err(keelfs_fs::FsError::ReadOnly) => Ok(()),
        other => Ok(other?),
    }
}

fn record(job: &Job, step: &keelfs_fs::ScrubStep) {
    let mut p = job.progress.borrow_mut();
    p.cursor = step.next;
    p.blocks_checked += step.blocks_checked;
    p.errors += step.bad.len() as u64;
    let room = BAD_LISTED_MAX.saturating_sub(p.bad.len());
    p.bad.extend(step.bad.iter().take(room).copied());
}

/// An export's scrub resumes where its image says one stood: called on
/// the export's reactor once it serves (an image not mounted here yet, as
/// a migration's destination has it, resumes nothing).
pub fn resume_if_saved(tag: &str) {
    let Some(fs) = crate::serve::local_fs(tag) else { return };
    if let Some((cursor, bytes_per_sec)) = fs.admin().scrub_saved() {
        tracing::info!("export {tag}: resuming the scrub at {} ({bytes_per_sec} bytes/s)", cursor_json(cursor));
        spawn(tag, cursor, bytes_per_sec);
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StartParams {
    export: String,
    mib_per_sec: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportParams {
    export: String,
}

/// A bad block as `scrub_status` lists it: with its file's inode and
/// offset, or as held by a snapshot.
fn bad_json(b: &BadBlock) -> Value {
    let (ino, offset) = b.file.map_or((None, None), |(ino, offset)| (Some(ino.get()), Some(offset)));
    let snapshot = b.file.is_none();
    json!({"ino": ino, "offset": offset, "snapshot": snapshot, "device_block": b.device_block, "unreadable": b.unreadable})
}

/// Where a scrub stands, as `scrub_status` shows it: a file's inode and
/// offset, or in the walk over the snapshots' blocks, a device block.
fn cursor_json(c: ScrubCursor) -> Value {
    match c.snapshot_block() {
        Some(block) => json!({"snapshots": true, "device_block": block}),
        // Saturating: a crafted image's cursor may name any block.
        None => json!({"ino": c.ino.get(), "offset": c.file_block.saturating_mul(keelfs_fs::BLOCK_BYTES as u64)}),
    }
}

fn status_json(p: &Progress) -> Value {
    let bad: Vec<Value> = p.bad.iter().map(bad_json).collect();
    let elapsed = p.started_at.map(|s| reactor_time().saturating_sub(s).as_nanos() as u64);
    json!({
        "state": p.state.name(),
        "cursor": p.cursor.map(cursor_json),
        "mib_per_sec": p.bytes_per_sec as f64 / (1u64 << 20) as f64,
        "blocks_checked": p.blocks_checked,
        "bytes_checked": p.blocks_checked * keelfs_fs::BLOCK_BYTES as u64,
        "errors": p.errors,
        "bad_blocks": bad,
        "elapsed_ns": elapsed,
        "error": p.error,
    })
}

/// `scrub_start {export, mib_per_sec}`: start a scrub from the first
/// block; CONFLICT while one runs; EOPNOTSUPP (FAILED) on an image
/// without data checksums.
pub fn start(params: Value, control: &Control) -> Result<Value, RpcError> {
    let p: StartParams = parse(params)?;
    if p.mib_per_sec == 0 || p.mib_per_sec > MIB_PER_SEC_MAX {
        let message = format!("mib_per_sec is 1 to {MIB_PER_SEC_MAX}");
        return Err(RpcError { code: code::INVALID_PARAMS, message });
    }
    let tag = p.export.clone();
    let job = crate::settings::on_fs(&tag, move |fs| async move {
        if running(&p.export) {
            return Ok(json!({"conflict": format!("a scrub of {} is running; scrub_cancel it first", p.export)}));
        }
        let bytes_per_sec = p.mib_per_sec << 20;
        save(&fs, Some((ScrubCursor::START, bytes_per_sec)))?;
        spawn(&p.export, ScrubCursor::START, bytes_per_sec);
        Ok(status_json(&JOBS.with(|j| j.borrow()[&p.export].progress.borrow().clone())))
    });
    let answer = control.on_export_reactor(&tag, RPC_TIMEOUT, job)?;
    match answer.get("conflict").and_then(Value::as_str) {
        Some(why) => Err(RpcError { code: code::CONFLICT, message: why.to_string() }),
        None => Ok(answer),
    }
}

/// `scrub_status {export}`: the last scrub's progress (state "none" if
/// there was none since the export was mounted here).
pub fn status(params: Value, control: &Control) -> Result<Value, RpcError> {
    let p: ExportParams = parse(params)?;
    let tag = p.export.clone();
    let job = crate::settings::on_fs(&tag, move |_fs| async move {
        let progress = JOBS.with(|j| j.borrow().get(&p.export).map(|job| job.progress.borrow().clone()));
        Ok(status_json(&progress.unwrap_or_default()))
    });
    Ok(control.on_export_reactor(&tag, RPC_TIMEOUT, job)?)
}

/// `scrub_cancel {export}`: `{"cancelled": true}` if one was running (it
/// stops before its next step, and the image forgets it).
pub fn cancel(params: Value, control: &Control) -> Result<Value, RpcError> {
    let p: ExportParams = parse(params)?;
    let tag = p.export.clone();
    let job = crate::settings::on_fs(&tag, move |_fs| async move {
        let was_running = running(&p.export);
        if was_running {
            JOBS.with(|j| j.borrow()[&p.export].cancel.set(true));
        }
        Ok(json!({"cancelled": was_running}))
    });
    Ok(control.on_export_reactor(&tag, RPC_TIMEOUT, job)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block or a cursor in the walk over the snapshots' blocks has no
    /// file to name: the status says "snapshot" and a device block.
    #[test]
    fn the_status_names_a_snapshots_block_by_device_block() {
        let file =
            bad_json(&BadBlock { file: Some((keelfs_fs::Ino::new(5), 8192)), device_block: 9, unreadable: false });
        assert_eq!(file, json!({"ino": 5, "offset": 8192, "snapshot": false, "device_block": 9, "unreadable": false}));
        let held = bad_json(&BadBlock { file: None, device_block: 9, unreadable: true });
        assert_eq!(held, json!({"ino": null, "offset": null, "snapshot": true, "device_block": 9, "unreadable": true}));
        assert_eq!(cursor_json(ScrubCursor::in_snapshots(7)), json!({"snapshots": true, "device_block": 7}));
        assert_eq!(cursor_json(ScrubCursor::START), json!({"ino": 1, "offset": 0}));
    }

    /// Drive a pacer in virtual time: each granted step takes
    /// `step_time`; a refusal moves the clock by the wait it names.
    /// Returns the bytes granted in `run`.
    fn granted(rate: u64, step_time: Duration, run: Duration) -> u64 {
        let mut now = Duration::ZERO;
        let mut pacer = Pacer::new(rate, STEP_BYTES, now);
        let mut bytes = 0;
        while now < run {
            match pacer.take(STEP_BYTES, now) {
                Ok(()) => {
                    bytes += STEP_BYTES;
                    now += step_time;
                }
                Err(wait) => now += wait,
            }
        }
        bytes
    }

    #[test]
    fn a_scrub_keeps_its_rate_in_virtual_time() {
        let run = Duration::from_secs(100);
        for mib in [1u64, 10, 100, 1000] {
            for step_time in [Duration::ZERO, Duration::from_micros(300), Duration::from_millis(2)] {
                let rate = mib << 20;
                let want = rate * 100;
                let got = granted(rate, step_time, run);
                let step_limited =
                    step_time.as_nanos() > 0 && STEP_BYTES as u128 * NANOS / step_time.as_nanos() < u128::from(rate);
                if step_limited {
                    assert!(got < want, "{mib} MiB/s with {step_time:?} steps: the reads bound it");
                } else {
                    // Within two steps (the credit it starts with, and the
                    // last one taken) and 1%.
                    let diff = got.abs_diff(want);
                    assert!(diff <= 2 * STEP_BYTES + want / 100, "{mib} MiB/s, {step_time:?} steps: {got} of {want}");
                }
            }
        }
    }

    /// Wake-ups that come late by up to half a step's time keep the rate:
    /// the room for a second step absorbs them.
    #[test]
    fn late_wakeups_do_not_lose_rate() {
        let rate = 100u64 << 20;
        let period = Duration::from_nanos(STEP_BYTES * 1_000_000_000 / rate);
        let (mut now, mut pacer, mut bytes, mut s) =
            (Duration::ZERO, Pacer::new(rate, STEP_BYTES, Duration::ZERO), 0, 1u64);
        while now < Duration::from_secs(100) {
            match pacer.take(STEP_BYTES, now) {
                Ok(()) => bytes += STEP_BYTES,
                Err(wait) => {
                    let late = keelfs_base::testing::splitmix64(&mut s) % (period.as_nanos() as u64 / 2);
                    now += wait + Duration::from_nanos(late);
                }
            }
        }
        let want = rate * 100;
        assert!(bytes.abs_diff(want) <= 2 * STEP_BYTES + want / 100, "{bytes} of {want}");
    }

    #[test]
    fn a_pacer_never_bursts_after_a_stall() {
        let mut pacer = Pacer::new(1 << 20, STEP_BYTES, Duration::ZERO);
        assert!(pacer.take(STEP_BYTES, Duration::ZERO).is_ok());
        // An hour away (the reactor busy): two steps at once, not 3600 s worth.
        let later = Duration::from_secs(3600);
        assert!(pacer.take(STEP_BYTES, later).is_ok());
        assert!(pacer.take(STEP_BYTES, later).is_ok());
        let wait = pacer.take(STEP_BYTES, later).unwrap_err();
        assert_eq!(wait, Duration::from_secs(1), "1 MiB at 1 MiB/s");
        assert!(pacer.take(STEP_BYTES, later + wait).is_ok());
    }
}
