//! CPU time of a process from /proc, for the benchmarks' CPU-per-operation
//! figures (the daemon's, or the bench's own).

use anyhow::Context;

/// Descendants counted, at most: a daemon has a handful.
const DESCENDANTS_MAX: usize = 64;

/// utime + stime of one process (all its threads), in nanoseconds.
pub fn own_cpu_ns(pid: u32) -> anyhow::Result<u64> {
    let stat =
        std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("reading /proc/{pid}/stat"))?;
    let rest = &stat[stat.rfind(')').context("malformed stat")? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(ticks * 1_000_000_000 / hz)
}

/// The live children of `pid`, from each of its threads' children lists.
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    let mut out = Vec::new();
    for task in tasks.flatten() {
        if let Ok(list) = std::fs::read_to_string(task.path().join("children")) {
            out.extend(list.split_whitespace().filter_map(|c| c.parse::<u32>().ok()));
        }
    }
    out
}

/// utime + stime of a process and its live descendants, in nanoseconds:
/// a sandboxed keelfsd serves from a child of the process started (its
/// supervisor), which must be charged too.
pub fn tree_cpu_ns(pid: u32) -> anyhow::Result<u64> {
    let mut total = own_cpu_ns(pid)?;
    let mut pending = children(pid);
    let mut seen = 0;
    while let Some(child) = pending.pop() {
        seen += 1;
        if seen > DESCENDANTS_MAX {
            break;
        }
        // A child that exited in between counts nothing.
        total += own_cpu_ns(child).unwrap_or(0);
        pending.extend(children(child));
    }
    Ok(total)
}

/// CPU time the whole machine spent busy (user, nice, system, irq,
/// softirq and steal over all CPUs, from /proc/stat), in nanoseconds:
/// with the daemon's and the load generator's own time subtracted, what
/// is left was spent by kernel workers (a loop device's, io_uring's io-wq
/// threads not charged to the daemon) and anything else running.
pub fn machine_busy_ns() -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let cpu = stat.lines().next().filter(|l| l.starts_with("cpu ")).context("no cpu line in /proc/stat")?;
    let ticks: Vec<u64> = cpu.split_whitespace().skip(1).map(|f| f.parse().unwrap_or(0)).collect();
    anyhow::ensure!(ticks.len() >= 8, "short cpu line in /proc/stat");
    // user nice system idle iowait irq softirq steal: all but idle, iowait.
    let busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7];
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(busy * 1_000_000_000 / hz)
}
