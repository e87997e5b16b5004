//! crc32c (Castagnoli, as the `crc32c` crate computes it) of memory that
//! another agent may write meanwhile, a guest's, read through volatile
//! loads without copying it out first.
//!
//! Checking a 4 KiB block of guest memory used to be a volatile copy into
//! a block of ours and then a crc of the copy; the copy was as costly as
//! the crc. Here the crc takes its words straight from the volatile loads.
//! A 4 KiB block is three lanes of [`LANE`] bytes, each a chain of `crc32`
//! instructions of its own (the instruction's latency is three times its
//! issue rate), joined by shifting the first two lanes' registers past
//! the lanes after them with tables built once from the instruction
//! itself; then the last 16 bytes.
//!
//! What a guest writes during the crc may be seen in part: that is a torn
//! read, and the block then fails its check, never undefined behaviour.

/// Bytes per lane: three lanes and 16 bytes make a 4 KiB block, and a
/// lane is whole words.
#[cfg(target_arch = "x86_64")]
const LANE: usize = 1360;

#[cfg(target_arch = "x86_64")]
const _: () = assert!(LANE.is_multiple_of(8) && 3 * LANE + 16 == 4096);

/// The crc32c of `n` bytes from `p`, appended to `crc` (the crc of the
/// bytes before them; 0 to start), as `crc32c::crc32c_append` computes
/// it.
///
/// # Safety
/// `p` must be valid for `n` bytes of reads for the whole call. Others may
/// write them meanwhile.
pub(crate) unsafe fn crc32c_append_volatile(crc: u32, p: *const u8, n: usize) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("sse4.2") {
        // SAFETY: the CPU has SSE4.2 (checked), and the caller's contract
        // covers the range.
        return unsafe { x86::crc32c_append(crc, p, n) };
    }
    // SAFETY: the caller's contract covers the range.
    unsafe { by_copy(crc, p, n) }
}

/// Without SSE4.2: a chunk at a time copied into a buffer of ours by
/// `io`'s volatile copy, and the crate's crc of each.
///
/// # Safety
/// As [`crc32c_append_volatile`].
unsafe fn by_copy(mut crc: u32, p: *const u8, n: usize) -> u32 {
    let mut chunk = [0u8; 256];
    let mut done = 0;
    while done < n {
        let len = (n - done).min(chunk.len());
        // SAFETY: [done, done+len) is inside the caller's range, and the
        // chunk, ours, holds len bytes; they do not overlap.
        unsafe { crate::io::volatile_copy(p.add(done), chunk.as_mut_ptr(), len) };
        crc = crc32c::crc32c_append(crc, &chunk[..len]);
        done += len;
    }
    crc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::LANE;
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    use std::sync::OnceLock;

    /// A linear map of crc registers, by byte: the register shifted past
    /// some count of zero bytes is the xor of one entry per byte of it.
    type ShiftTable = [[u32; 256]; 4];

    struct Tables {
        /// Past one lane, and past two.
        one: ShiftTable,
        two: ShiftTable,
    }

    fn tables() -> &'static Tables {
        static TABLES: OnceLock<Box<Tables>> = OnceLock::new();
        TABLES.get_or_init(|| {
            // SAFETY: only reached from `crc32c_append`, which runs with
            // SSE4.2 present.
            unsafe { Box::new(Tables { one: shift_table(LANE), two: shift_table(2 * LANE) }) }
        })
    }

    /// The table that shifts a register past `bytes` zero bytes (a
    /// multiple of 8): each entry by the instruction itself, as a word of
    /// zeros shifts a register by 8 bytes, and the map is linear.
    #[target_feature(enable = "sse4.2")]
    unsafe fn shift_table(bytes: usize) -> ShiftTable {
        assert!(bytes.is_multiple_of(8));
        let mut table = [[0u32; 256]; 4];
        for (k, row) in table.iter_mut().enumerate() {
            for (v, entry) in row.iter_mut().enumerate() {
                let mut reg = (v as u64) << (8 * k);
                for _ in 0..bytes / 8 {
                    reg = _mm_crc32_u64(reg, 0);
                }
                *entry = reg as u32;
            }
        }
        table
    }

    fn shift(table: &ShiftTable, reg: u32) -> u32 {
        let b = reg.to_le_bytes();
        table[0][usize::from(b[0])]
            ^ table[1][usize::from(b[1])]
            ^ table[2][usize::from(b[2])]
            ^ table[3][usize::from(b[3])]
    }

    /// # Safety
    /// The CPU has SSE4.2, and `p` is valid for `n` bytes of reads.
    #[target_feature(enable = "sse4.2")]
    pub(super) unsafe fn crc32c_append(crc: u32, mut p: *const u8, mut n: usize) -> u32 {
        let mut reg = u64::from(!crc);
        // Bytes up to a word's alignment: volatile word loads must be
        // aligned.
        while n > 0 && !(p as usize).is_multiple_of(8) {
            // SAFETY: n > 0 bytes remain from p, inside the caller's range.
            reg = u64::from(_mm_crc32_u8(reg as u32, unsafe { std::ptr::read_volatile(p) }));
            // SAFETY: one past at most the range's last byte.
            p = unsafe { p.add(1) };
            n -= 1;
        }
        let word = |p: *const u8, at: usize| {
            // SAFETY: the callers below read words inside the n bytes left
            // from p, which is 8-aligned, as `at` is a multiple of 8.
            unsafe { std::ptr::read_volatile(p.add(at).cast::<u64>()) }
        };
        if n >= 3 * LANE {
            let t = tables();
            while n >= 3 * LANE {
                let (mut a, mut b, mut c) = (reg, 0u64, 0u64);
                for at in (0..LANE).step_by(8) {
                    a = _mm_crc32_u64(a, word(p, at));
                    b = _mm_crc32_u64(b, word(p, LANE + at));
                    c = _mm_crc32_u64(c, word(p, 2 * LANE + at));
                }
                // reg(A‖B‖C) = shift(reg(A), |B|+|C|) ^ shift(reg₀(B), |C|) ^ reg₀(C).
                reg = u64::from(shift(&t.two, a as u32) ^ shift(&t.one, b as u32) ^ c as u32);
                // SAFETY: 3 * LANE <= n bytes remain from p.
                p = unsafe { p.add(3 * LANE) };
                n -= 3 * LANE;
            }
        }
        while n >= 8 {
            reg = _mm_crc32_u64(reg, word(p, 0));
            // SAFETY: 8 <= n bytes remain from p.
            p = unsafe { p.add(8) };
            n -= 8;
        }
        while n > 0 {
            // SAFETY: n > 0 bytes remain from p.
            reg = u64::from(_mm_crc32_u8(reg as u32, unsafe { std::ptr::read_volatile(p) }));
            // SAFETY: one past at most the range's last byte.
            p = unsafe { p.add(1) };
            n -= 1;
        }
        !(reg as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volatile_crc(crc: u32, data: &[u8]) -> u32 {
        // SAFETY: `data` is ours, valid for its length.
        unsafe { crc32c_append_volatile(crc, data.as_ptr(), data.len()) }
    }

    /// Every length around the lanes and words, at every alignment,
    /// appended to a crc or not, is the crate's crc; so is the path
    /// without SSE4.2.
    #[test]
    fn it_is_the_crates_crc_at_every_length_and_alignment() {
        let data: Vec<u8> = (0..8300u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        // Fewer under Miri, which interprets every byte's load.
        let (alignments, lengths): (&[usize], &[usize]) = if cfg!(miri) {
            (&[0, 3], &[0, 9, 4097])
        } else {
            (&[0, 1, 3, 8], &[0, 1, 7, 8, 17, 1359, 4079, 4080, 4095, 4096, 4097, 8192])
        };
        for &at in alignments {
            for &n in lengths {
                let slice = &data[at..at + n];
                for start in [0, 0x1234_5678] {
                    let want = crc32c::crc32c_append(start, slice);
                    assert_eq!(volatile_crc(start, slice), want, "at {at}, {n} bytes");
                    // SAFETY: `slice` is ours.
                    assert_eq!(unsafe { by_copy(start, slice.as_ptr(), n) }, want, "by copy: at {at}, {n} bytes");
                }
            }
        }
    }

    /// A flipped bit anywhere in a block changes its crc.
    #[test]
    fn a_flipped_bit_in_any_lane_changes_it() {
        let mut block = vec![0x5au8; 4096];
        let clean = volatile_crc(0, &block);
        let flips: &[usize] = if cfg!(miri) { &[1360, 4095] } else { &[0, 1359, 1360, 2719, 2720, 4079, 4080, 4095] };
        for &at in flips {
            block[at] ^= 0x10;
            assert_ne!(volatile_crc(0, &block), clean, "byte {at}");
            block[at] ^= 0x10;
        }
    }
}
