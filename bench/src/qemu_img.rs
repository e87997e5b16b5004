//! Running `qemu-img bench` with QEMU's own rbd block driver as the peer
//! of `keelfs-bench bdev --backend rbd`: the same block size, queue depth,
//! direction and offsets (qemu-img bench can only step through the image:
//! each offset is the previous one plus a fixed step, wrapping at its end,
//! which `keelfs-bench bdev --step` reproduces).

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use keelfs_bdev::RbdAddress;

pub struct QemuImgJob<'a> {
    pub image: &'a RbdAddress,
    pub write: bool,
    pub bs: u64,
    pub iodepth: u32,
    pub step: u64,
    pub count: u64,
    /// A process charged to neither client (the OSD), measured around the run.
    pub osd_pid: Option<u32>,
}

/// One run of qemu-img bench.
pub struct QemuImgResult {
    pub ios: u64,
    /// What qemu-img reports: from its first submission to its last
    /// completion.
    pub elapsed: Duration,
    /// qemu-img's user + system time over its whole life (all threads,
    /// librbd's included), from wait4.
    pub cpu: Duration,
    pub osd_cpu: Option<Duration>,
}

/// QEMU's legacy rbd filename: `rbd:POOL/IMAGE[:id=CLIENT][:conf=FILE]`.
pub fn filename(image: &RbdAddress) -> anyhow::Result<String> {
    let mut name = format!("rbd:{}/{}", image.pool, image.image);
    if let Some(client) = &image.client {
        name += &format!(":id={client}");
    }
    if let Some(conf) = &image.conf {
        if conf.contains([':', '\\']) {
            bail!("qemu-img's rbd filename cannot carry a ceph.conf path with ':' or '\\': {conf}");
        }
        name += &format!(":conf={conf}");
    }
    Ok(name)
}

pub fn run(job: &QemuImgJob<'_>) -> anyhow::Result<QemuImgResult> {
    let mut cmd = Command::new("qemu-img");
    // -t none: QEMU's rbd driver then sets rbd_cache=false, as keelfs does.
    cmd.args(["bench", "-f", "raw", "-t", "none"])
        .arg(format!("--depth={}", job.iodepth))
        .arg(format!("--buffer-size={}", job.bs))
        .arg(format!("--step-size={}", job.step))
        .arg(format!("--count={}", job.count));
    if job.write {
        // Not zeros: keelfs-bench writes a non-zero pattern too.
        cmd.args(["-w", "--pattern=90"]);
    }
    cmd.arg(filename(job.image)?).stdout(Stdio::piped()).stderr(Stdio::piped());
    let osd_before = job.osd_pid.map(crate::procstat::own_cpu_ns).transpose()?;
    let mut child = cmd.spawn().context("running qemu-img (apt-get install qemu-utils qemu-block-extra)")?;
    let mut stdout = String::new();
    let mut stderr = String::new();
    child.stdout.take().expect("piped").read_to_string(&mut stdout)?;
    child.stderr.take().expect("piped").read_to_string(&mut stderr)?;
    let (status, cpu) = wait_with_rusage(child.id())?;
    let osd_after = job.osd_pid.map(crate::procstat::own_cpu_ns).transpose()?;
    if status != 0 {
        bail!("qemu-img bench failed (wait status {status}): {}", stderr.trim());
    }
    let elapsed = parse_elapsed(&stdout)?;
    let osd_cpu = osd_before.zip(osd_after).map(|(b, a)| Duration::from_nanos(a.saturating_sub(b)));
    Ok(QemuImgResult { ios: job.count, elapsed, cpu, osd_cpu })
}

/// Reap `pid` (our child) and return its wait status and its CPU time
/// (user + system, every thread) from the kernel's accounting.
fn wait_with_rusage(pid: u32) -> anyhow::Result<(i32, Duration)> {
    let mut status = 0;
    // SAFETY: rusage is plain data; all zeroes is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 writes only to the two live locals it is given; the
    // child is ours and not yet reaped (std's Child never waited on it).
    let rc = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut usage) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error()).context("waiting for qemu-img");
    }
    let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    Ok((status, tv(usage.ru_utime) + tv(usage.ru_stime)))
}

/// "Run completed in 1.140 seconds."
fn parse_elapsed(stdout: &str) -> anyhow::Result<Duration> {
    let secs = stdout
        .lines()
        .find_map(|l| l.strip_prefix("Run completed in ")?.strip_suffix(" seconds."))
        .with_context(|| format!("qemu-img bench printed no 'Run completed in' line: {stdout:?}"))?;
    let secs: f64 = secs.trim().parse().with_context(|| format!("qemu-img bench's time {secs:?}"))?;
    Ok(Duration::from_secs_f64(secs.max(1e-3)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_run_time() {
        let out = "Sending 20000 read requests, 4096 bytes each, 16 in parallel (starting at offset 0, step size \
                   16789504)\nRun completed in 1.140 seconds.\n";
        assert_eq!(parse_elapsed(out).unwrap(), Duration::from_millis(1140));
        assert!(parse_elapsed("Sending 1 read requests\n").is_err());
    }

    #[test]
    fn names_the_image_as_qemu_does() {
        let a = RbdAddress::parse("rbd:keelfs/bench-peer@/etc/ceph/ceph.conf:id=bench").unwrap();
        assert_eq!(filename(&a).unwrap(), "rbd:keelfs/bench-peer:id=bench:conf=/etc/ceph/ceph.conf");
        assert_eq!(filename(&RbdAddress::parse("rbd:p/i").unwrap()).unwrap(), "rbd:p/i");
        assert!(filename(&RbdAddress::parse("rbd:p/i@/a:b.conf").unwrap()).is_err());
    }
}
