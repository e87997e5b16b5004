//! `keelfs-bench crc`: what a crc32c of a 4 KiB block costs one core, the
//! figure issue 38's data checksums spend per block written and read
//! (docs/plans/data-checksums.md, section 6). The `crc32c` crate, which
//! the metadata checksums use, takes SSE4.2's `crc32` instruction when the
//! CPU has it. Two peers run in the same rounds, interleaved:
//! - a copy of the same block (`memcpy`), the unit the rest of the data
//!   path is measured in;
//! - a byte-at-a-time table crc32c, the software answer, which must also
//!   agree with the crate on every block;
//! - each way the daemon's own crc of a guest's block (in place, through
//!   volatile loads: `keelfs_reactor::CrcWay`) has on this CPU: the three
//!   lanes of `crc32`, and the carry-less folds where the CPU has AVX-512
//!   and VPCLMULQDQ. The daemon takes the last; `in_place_*` report it,
//!   and `ways` each.
//!
//! Time is the measuring thread's own CPU time (CLOCK_THREAD_CPUTIME_ID,
//! through keelfs-reactor), so the figures are per core, whatever else
//! the machine runs.

use anyhow::{ensure, Context};
use clap::Args;
use serde_json::json;

const BLOCK: usize = 4096;

#[derive(Args, Debug)]
pub struct CrcArgs {
    /// The buffer each round goes over, in MiB: larger than the caches
    /// measures the crc at memory speed, smaller in cache.
    #[arg(long, default_value_t = 64)]
    mib: u64,
    /// Rounds; each runs the crate's crc, the in-place ways, the copy and
    /// the table crc in turn, and the medians are reported.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    #[arg(long, default_value = "")]
    label: String,
    #[arg(long)]
    json: bool,
}

/// The reflected Castagnoli polynomial, one byte at a time.
fn table() -> [u32; 256] {
    let mut table = [0u32; 256];
    for (i, entry) in table.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0x82f6_3b78 ^ (c >> 1) } else { c >> 1 };
        }
        *entry = c;
    }
    table
}

fn table_crc32c(table: &[u32; 256], bytes: &[u8]) -> u32 {
    !bytes.iter().fold(!0u32, |c, &b| table[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8))
}

/// CPU nanoseconds `work` takes over every block of `data`, and the fold
/// of what it returned (so that the compiler keeps the work).
fn timed(data: &[u8], mut work: impl FnMut(&[u8]) -> u32) -> anyhow::Result<(f64, u32)> {
    let start = keelfs_reactor::thread_cpu_time();
    let folded = data.chunks_exact(BLOCK).fold(0u32, |acc, block| acc.rotate_left(1) ^ work(block));
    let spent = keelfs_reactor::thread_cpu_time().saturating_sub(start);
    Ok((spent.as_nanos().max(1) as f64, std::hint::black_box(folded)))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

pub fn run(args: &CrcArgs) -> anyhow::Result<()> {
    ensure!((1..=4096).contains(&args.mib), "--mib must be 1 to 4096");
    ensure!((1..=100).contains(&args.rounds), "--rounds must be 1 to 100");
    let bytes = usize::try_from(args.mib << 20).context("--mib")?;
    // Not zeros: a pattern that differs per block.
    let data: Vec<u8> = (0..bytes).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3]).collect();
    let table = table();
    let ways = keelfs_reactor::CrcWay::available();
    for block in data.chunks_exact(BLOCK).step_by(97) {
        let want = crc32c::crc32c(block);
        ensure!(want == table_crc32c(&table, block), "the crate and the table crc32c disagree");
        for way in &ways {
            ensure!(way.crc32c_append(0, block) == want, "the crate and the in-place crc ({}) disagree", way.name());
        }
    }
    let mut copy_to = vec![0u8; BLOCK];
    let (mut crate_ns, mut copy_ns, mut table_ns) = (Vec::new(), Vec::new(), Vec::new());
    let mut way_ns: Vec<Vec<f64>> = vec![Vec::new(); ways.len()];
    for _ in 0..args.rounds {
        crate_ns.push(timed(&data, crc32c::crc32c)?.0);
        for (way, ns) in ways.iter().zip(&mut way_ns) {
            ns.push(timed(&data, |block| way.crc32c_append(0, block))?.0);
        }
        let copy = |block: &[u8]| {
            copy_to.copy_from_slice(block);
            u32::from(std::hint::black_box(&copy_to)[0])
        };
        copy_ns.push(timed(&data, copy)?.0);
        table_ns.push(timed(&data, |block| table_crc32c(&table, block))?.0);
    }
    let (crc, copy, soft) = (median(crate_ns), median(copy_ns), median(table_ns));
    let blocks = (bytes / BLOCK) as f64;
    let way_ns: Vec<f64> = way_ns.into_iter().map(median).collect();
    let in_place = *way_ns.last().expect("copying is always a way");
    let ways_json: serde_json::Map<String, serde_json::Value> =
        ways.iter().zip(&way_ns).map(|(w, ns)| (w.name().to_string(), json!(round2(ns / blocks)))).collect();
    let gib_per_cpu_s = |ns: f64| bytes as f64 / ns; // bytes per ns = GB/s
    let line = json!({
        "bench": "crc",
        "label": args.label,
        "sse42": sse42(),
        "mib": args.mib,
        "rounds": args.rounds,
        "block_bytes": BLOCK,
        "crc_ns_per_block": round2(crc / blocks),
        "crc_gb_per_cpu_s": round2(gib_per_cpu_s(crc)),
        "copy_ns_per_block": round2(copy / blocks),
        "table_crc_ns_per_block": round2(soft / blocks),
        "crc_over_copy": round2(crc / copy),
        "table_over_crc": round2(soft / crc),
        "in_place_way": ways.last().expect("copying is always a way").name(),
        "in_place_ns_per_block": round2(in_place / blocks),
        "in_place_gb_per_cpu_s": round2(gib_per_cpu_s(in_place)),
        "in_place_over_crate": round2(in_place / crc),
        "ways_ns_per_block": ways_json,
    });
    if args.json {
        println!("{line}");
    } else {
        println!("{}", serde_json::to_string_pretty(&line)?);
    }
    Ok(())
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

#[cfg(target_arch = "x86_64")]
fn sse42() -> bool {
    std::arch::is_x86_feature_detected!("sse4.2")
}

#[cfg(not(target_arch = "x86_64"))]
fn sse42() -> bool {
    false
}
