//! Running fio as the peer, with the same parameters, and reading its JSON.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context};

pub struct FioJob<'a> {
    pub path: &'a Path,
    pub rw: &'a str,
    pub bs: u64,
    pub iodepth: u32,
    pub size: u64,
    pub seconds: u64,
}

pub struct FioResult {
    pub iops: f64,
    pub lat_us_p50: f64,
    pub lat_us_p99: f64,
}

pub fn run_io_uring(job: &FioJob<'_>) -> anyhow::Result<FioResult> {
    let output = Command::new("fio")
        .args([
            "--name=keelfs-peer",
            "--ioengine=io_uring",
            "--direct=1",
            "--norandommap=1",
            "--randrepeat=0",
            "--time_based=1",
            "--group_reporting=1",
            "--output-format=json",
        ])
        .arg(format!("--filename={}", job.path.display()))
        .arg(format!("--rw={}", job.rw))
        .arg(format!("--bs={}", job.bs))
        .arg(format!("--iodepth={}", job.iodepth))
        .arg(format!("--size={}", job.size))
        .arg(format!("--runtime={}", job.seconds))
        .output()
        .context("running fio (is it installed? apt-get install fio)")?;
    if !output.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&output.stderr).trim());
    }
    parse(&output.stdout)
}

fn parse(json: &[u8]) -> anyhow::Result<FioResult> {
    // fio may print warnings before the JSON document.
    let start = json.iter().position(|&b| b == b'{').context("fio printed no JSON")?;
    let doc: serde_json::Value = serde_json::from_slice(&json[start..]).context("parsing fio's JSON")?;
    let job = &doc["jobs"][0];
    let mut iops = 0.0;
    let (mut p50, mut p99) = (0.0f64, 0.0f64);
    for dir in ["read", "write"] {
        let d = &job[dir];
        let dir_iops = d["iops"].as_f64().unwrap_or(0.0);
        if dir_iops > 0.0 {
            iops += dir_iops;
            let pct = &d["clat_ns"]["percentile"];
            p50 = p50.max(pct["50.000000"].as_f64().unwrap_or(0.0) / 1000.0);
            p99 = p99.max(pct["99.000000"].as_f64().unwrap_or(0.0) / 1000.0);
        }
    }
    if iops == 0.0 {
        bail!("fio reported no I/O");
    }
    Ok(FioResult { iops, lat_us_p50: p50, lat_us_p99: p99 })
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_fio_json_after_noise() {
        let text = br#"note: both iodepth >= 1 and synchronous I/O engine are selected
{"jobs":[{"read":{"iops":1000.5,"clat_ns":{"percentile":{"50.000000":2000,"99.000000":9000}}},"write":{"iops":0}}]}"#;
        let r = super::parse(text).unwrap();
        assert_eq!(r.iops, 1000.5);
        assert_eq!(r.lat_us_p50, 2.0);
        assert_eq!(r.lat_us_p99, 9.0);
        assert!(super::parse(br#"{"jobs":[{"read":{"iops":0},"write":{"iops":0}}]}"#).is_err());
    }
}
