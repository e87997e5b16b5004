//! The machine's CPU load, for the idle policy: the run queue from
//! /proc/loadavg and the CPU pressure stall from /proc/pressure/cpu.
//!
//! The files are opened once, before a sandbox takes /proc away, and read
//! with pread at offset 0: each read regenerates them. Neither depends on
//! the reader's pid namespace.
//! - loadavg's fourth field is "RUNNING/TOTAL", RUNNING counting every
//!   thread running or runnable on the machine, the reader included.
//! - pressure's "some" line ends in "total=MICROSECONDS": the time during
//!   which at least one runnable thread waited for a CPU (PSI). A kernel
//!   without PSI has no such file, and the policy does without it.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

#[derive(Debug)]
pub struct CpuLoadProbe {
    loadavg: File,
    pressure: Option<File>,
}

/// What the probe read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuLoad {
    /// Threads running or runnable on the machine now.
    pub runnable: Option<u32>,
    /// Time, so far, that some thread waited for a CPU.
    pub stalled: Option<Duration>,
}

/// Both files are under 200 bytes; this bounds a read of anything else.
const PROC_FILE_BYTES_MAX: usize = 512;

impl CpuLoadProbe {
    pub fn open() -> io::Result<Self> {
        Self::open_paths(Path::new("/proc/loadavg"), Path::new("/proc/pressure/cpu"))
    }

    /// `loadavg` must be there and read as one; `pressure` is optional.
    pub fn open_paths(loadavg: &Path, pressure: &Path) -> io::Result<Self> {
        let mut probe = Self { loadavg: File::open(loadavg)?, pressure: File::open(pressure).ok() };
        let first = probe.read();
        // Fail at open, not at every window, on a file that is not loadavg.
        if first.runnable.is_none() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{} is not loadavg", loadavg.display())));
        }
        if first.stalled.is_none() {
            probe.pressure = None;
        }
        Ok(probe)
    }

    pub fn has_pressure(&self) -> bool {
        self.pressure.is_some()
    }

    pub fn read(&self) -> CpuLoad {
        CpuLoad {
            runnable: read_whole(&self.loadavg, parse_runnable),
            stalled: self.pressure.as_ref().and_then(|file| read_whole(file, parse_some_total)),
        }
    }
}

/// Read `file` from its start into a buffer on the stack (no allocation
/// on the reactor's loop), and parse it.
fn read_whole<T>(file: &File, parse: fn(&[u8]) -> Option<T>) -> Option<T> {
    let mut buf = [0u8; PROC_FILE_BYTES_MAX];
    let len = file.read_at(&mut buf, 0).ok()?;
    parse(&buf[..len])
}

fn parse_runnable(text: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(text).ok()?;
    let field = text.split_ascii_whitespace().nth(3)?;
    let (running, _total) = field.split_once('/')?;
    running.parse().ok()
}

fn parse_some_total(text: &[u8]) -> Option<Duration> {
    let text = std::str::from_utf8(text).ok()?;
    let some = text.lines().find(|l| l.starts_with("some "))?;
    let total = some.split_ascii_whitespace().find_map(|f| f.strip_prefix("total="))?;
    total.parse().ok().map(Duration::from_micros)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_running_count() {
        assert_eq!(parse_runnable(b"0.93 1.68 2.00 3/345 12345\n"), Some(3));
        assert_eq!(parse_runnable(b"0.93 1.68 2.00 345 12345\n"), None);
        assert_eq!(parse_runnable(b"0.93 1.68"), None);
        assert_eq!(parse_runnable(b"0 0 0 x/1 1"), None);
        assert_eq!(parse_runnable(&[0xff, b' ', b'1']), None);
    }

    #[test]
    fn parses_the_stall_total() {
        let psi = b"some avg10=51.60 avg60=69.46 avg300=50.67 total=5942858205\n\
                    full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(parse_some_total(psi), Some(Duration::from_micros(5_942_858_205)));
        assert_eq!(parse_some_total(b"full avg10=0.00 total=9\n"), None);
        assert_eq!(parse_some_total(b"some avg10=0.00 total=x\n"), None);
    }

    #[test]
    fn reads_this_machine() {
        let probe = CpuLoadProbe::open().expect("/proc/loadavg");
        let load = probe.read();
        assert!(load.runnable.unwrap() >= 1, "the reading thread itself runs");
        assert_eq!(load.stalled.is_some(), probe.has_pressure());
    }

    #[test]
    fn a_file_that_is_not_loadavg_is_refused() {
        let not = CpuLoadProbe::open_paths(Path::new("/proc/self/stat"), Path::new("/nonexistent"));
        assert_eq!(not.unwrap_err().kind(), io::ErrorKind::InvalidData);
        let probe = CpuLoadProbe::open_paths(Path::new("/proc/loadavg"), Path::new("/proc/loadavg")).unwrap();
        assert!(!probe.has_pressure(), "a pressure file that does not parse is dropped");
    }
}
