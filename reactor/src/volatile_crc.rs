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
//! Where the CPU has AVX-512 and VPCLMULQDQ, long runs instead fold 256
//! bytes at a time with carry-less multiplies ([`x86::fold`]): four
//! 512-bit registers, each of four 128-bit lanes, are multiplied forward
//! past the 256 bytes that follow them and xored into those. The 64 bytes
//! left have the same crc as everything folded into them, and the `crc32`
//! instruction takes them from there. A 4 KiB block costs about half the
//! three lanes' time on the machine bench/RESULTS.md reports.
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

/// How [`crc32c_append_volatile`] takes a crc on this CPU, for
/// keelfs-bench to set its ways side by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrcWay {
    /// A copy into a buffer of ours, then the `crc32c` crate's crc.
    ByCopy,
    /// Three lanes of the `crc32` instruction (SSE4.2).
    ThreeLanes,
    /// Carry-less folds for long runs (AVX-512 and VPCLMULQDQ).
    Folds,
}

impl CrcWay {
    /// The ways this CPU has, the one the daemon takes last.
    pub fn available() -> Vec<CrcWay> {
        [CrcWay::ByCopy, CrcWay::ThreeLanes, CrcWay::Folds].into_iter().filter(|w| w.is_available()).collect()
    }

    /// Whether this CPU has this way: no allocation, as a timed loop calls
    /// it per block.
    pub fn is_available(self) -> bool {
        match self {
            CrcWay::ByCopy => true,
            #[cfg(target_arch = "x86_64")]
            CrcWay::ThreeLanes => std::arch::is_x86_feature_detected!("sse4.2"),
            #[cfg(target_arch = "x86_64")]
            CrcWay::Folds => std::arch::is_x86_feature_detected!("sse4.2") && x86::can_fold(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CrcWay::ByCopy => "by_copy",
            CrcWay::ThreeLanes => "three_lanes",
            CrcWay::Folds => "folds",
        }
    }

    /// The crc32c of `data` this way, appended to `crc`. Panics on a way
    /// [`CrcWay::available`] does not list.
    pub fn crc32c_append(self, crc: u32, data: &[u8]) -> u32 {
        assert!(self.is_available(), "{self:?} is not available on this CPU");
        let (p, n) = (data.as_ptr(), data.len());
        match self {
            // SAFETY: `data` is valid for its length, for the whole call.
            CrcWay::ByCopy => unsafe { by_copy(crc, p, n) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, and the CPU has SSE4.2 (available).
            CrcWay::ThreeLanes => unsafe { x86::append_with(crc, p, n, false) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, and the CPU can fold (available).
            CrcWay::Folds => unsafe { x86::append_with(crc, p, n, true) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("only x86 has other ways"),
        }
    }
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
    use std::arch::x86_64::{
        __m512i, _mm512_broadcast_i32x4, _mm512_clmulepi64_epi128, _mm512_storeu_si512, _mm512_ternarylogic_epi64,
        _mm512_xor_si512, _mm512_zextsi128_si512, _mm_crc32_u64, _mm_crc32_u8, _mm_cvtsi32_si128, _mm_set_epi64x,
    };
    use std::sync::OnceLock;

    /// Bytes one step of [`fold`] takes: four registers of 64.
    pub(super) const FOLD_STRIDE: usize = 256;
    /// The shortest run worth folding: the setup and the 64 bytes left
    /// at the end cost about as much as 256 bytes of `crc32` lanes.
    pub(super) const FOLD_MIN: usize = 1024;

    /// The constants that move a 128-bit lane of the message forward past
    /// `8 * D` bits, for the two 64-bit halves of each lane: with the
    /// message's bit order reflected (the first byte's lowest bit is its
    /// highest power), the low half L stands for L·x⁶⁴ and the high half H
    /// for H, so the lane moved is L·x^(D+64) + H·x^D mod P. A carry-less
    /// product of two reflected 64-bit values comes out one power short,
    /// hence x^(D+63) and x^(D-1): reflected into a 64-bit word (x^k at bit
    /// 63-k), each below x³² lies in the word's high half. Checked by a
    /// test that computes them.
    pub(super) const PAST_256_BYTES: (u64, u64) = (0xe9a5_d8be_0000_0000, 0x1426_a815_0000_0000);
    pub(super) const PAST_64_BYTES: (u64, u64) = (0x1c19_243b_0000_0000, 0x75bb_a45b_0000_0000);

    /// Each 128-bit lane of `x` moved forward by `k` (one of the pairs
    /// above, in every lane) and xored into `y`.
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    fn fold_into(x: __m512i, k: __m512i, y: __m512i) -> __m512i {
        let low = _mm512_clmulepi64_epi128::<0x00>(x, k);
        let high = _mm512_clmulepi64_epi128::<0x11>(x, k);
        // 0x96: a ^ b ^ c.
        _mm512_ternarylogic_epi64::<0x96>(low, high, y)
    }

    #[target_feature(enable = "avx512f")]
    fn in_every_lane((low, high): (u64, u64)) -> __m512i {
        _mm512_broadcast_i32x4(_mm_set_epi64x(high as i64, low as i64))
    }

    /// The `crc32` register after `n` bytes from `p` (a multiple of
    /// [`FOLD_STRIDE`], at least one), starting from register `reg`.
    ///
    /// # Safety
    /// The CPU has AVX-512F, VPCLMULQDQ and SSE4.2; `p` is 64-aligned and
    /// valid for `n` bytes of reads.
    #[target_feature(enable = "avx512f,vpclmulqdq,sse4.2")]
    pub(super) unsafe fn fold(reg: u32, p: *const u8, n: usize) -> u32 {
        assert!(n >= FOLD_STRIDE && n.is_multiple_of(FOLD_STRIDE), "{n} bytes to fold");
        debug_assert!((p as usize).is_multiple_of(64));
        let load = |at: usize| {
            // SAFETY: the callers below load 64 bytes at `at`, a multiple
            // of 64 below n: inside the caller's range, and aligned.
            unsafe { std::ptr::read_volatile(p.add(at).cast::<__m512i>()) }
        };
        let (past_256, past_64) = (in_every_lane(PAST_256_BYTES), in_every_lane(PAST_64_BYTES));
        // The register so far joins the message as the xor of its first
        // four bytes: the crc of the rest then starts from zero.
        let start = _mm512_zextsi128_si512(_mm_cvtsi32_si128(reg as i32));
        let mut x = [_mm512_xor_si512(load(0), start), load(64), load(128), load(192)];
        for at in (FOLD_STRIDE..n).step_by(FOLD_STRIDE) {
            for (i, lane) in x.iter_mut().enumerate() {
                *lane = fold_into(*lane, past_256, load(at + 64 * i));
            }
        }
        let last = fold_into(fold_into(fold_into(x[0], past_64, x[1]), past_64, x[2]), past_64, x[3]);
        let mut words = [0u64; 8];
        // SAFETY: `words` is ours, 64 bytes.
        unsafe { _mm512_storeu_si512(words.as_mut_ptr().cast(), last) };
        words.iter().fold(0, |r, &w| _mm_crc32_u64(r, w)) as u32
    }

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

    /// Whether the CPU can [`fold`].
    pub(super) fn can_fold() -> bool {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("vpclmulqdq")
    }

    /// # Safety
    /// The CPU has SSE4.2, and `p` is valid for `n` bytes of reads.
    #[target_feature(enable = "sse4.2")]
    pub(super) unsafe fn crc32c_append(crc: u32, p: *const u8, n: usize) -> u32 {
        // SAFETY: the caller's contract.
        unsafe { append_with(crc, p, n, can_fold()) }
    }

    /// [`crc32c_append`], folding long runs if `folds` (a CPU that can).
    ///
    /// # Safety
    /// As [`crc32c_append`], and the CPU can [`fold`] if `folds`.
    #[target_feature(enable = "sse4.2")]
    pub(super) unsafe fn append_with(crc: u32, mut p: *const u8, mut n: usize, folds: bool) -> u32 {
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
        if folds && n >= FOLD_MIN {
            // Words up to a 64-byte boundary: the folds' loads are
            // aligned. Fewer than 64 bytes, of n >= FOLD_MIN.
            while !(p as usize).is_multiple_of(64) {
                reg = _mm_crc32_u64(reg, word(p, 0));
                // SAFETY: 8 < n bytes remain from p.
                p = unsafe { p.add(8) };
                n -= 8;
            }
            let folded = n - n % FOLD_STRIDE;
            // SAFETY: the CPU can fold (the caller's contract); p is
            // 64-aligned, and folded <= n bytes from it are readable.
            reg = u64::from(unsafe { fold(reg as u32, p, folded) });
            // SAFETY: folded <= n.
            p = unsafe { p.add(folded) };
            n -= folded;
        }
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

    /// The crc of `data` appended to `crc` by each way this CPU has, and
    /// as dispatched; named.
    fn by_every_way(crc: u32, data: &[u8]) -> Vec<(&'static str, u32)> {
        let mut ways: Vec<_> =
            CrcWay::available().into_iter().map(|w| (w.name(), w.crc32c_append(crc, data))).collect();
        ways.push(("as dispatched", volatile_crc(crc, data)));
        ways
    }

    /// Test data from a 64-byte boundary, so that an offset into it sets
    /// the alignment.
    #[repr(C, align(64))]
    struct Aligned([u8; 8448]);

    /// Every length around the lanes, the folds and words, at every
    /// alignment to a word and to the folds' 64 bytes, appended to a crc
    /// or not, is the crate's crc, by every way the CPU has.
    #[test]
    fn it_is_the_crates_crc_at_every_length_and_alignment() {
        let mut data = Box::new(Aligned([0; 8448]));
        for (i, b) in data.0.iter_mut().enumerate() {
            *b = ((i as u32).wrapping_mul(2_654_435_761) >> 13) as u8;
        }
        // Fewer under Miri, which interprets every byte's load.
        let (alignments, lengths): (&[usize], &[usize]) = if cfg!(miri) {
            (&[0, 3], &[0, 9, 4097])
        } else {
            (
                &[0, 1, 3, 8, 40, 63],
                &[0, 1, 7, 8, 17, 1023, 1024, 1025, 1279, 1280, 1359, 4079, 4080, 4095, 4096, 4097, 8192],
            )
        };
        for &at in alignments {
            for &n in lengths {
                let slice = &data.0[at..at + n];
                for start in [0, 0x1234_5678] {
                    let want = crc32c::crc32c_append(start, slice);
                    for (way, got) in by_every_way(start, slice) {
                        assert_eq!(got, want, "{way}: at {at}, {n} bytes, from {start:#x}");
                    }
                }
            }
        }
    }

    /// x^e mod P for crc32c's P, as a polynomial of degree below 32 (x^k
    /// at bit k).
    #[cfg(target_arch = "x86_64")]
    fn x_to_the_mod_p(e: u32) -> u64 {
        const P: u64 = 0x1_1edc_6f41;
        (0..e).fold(1u64, |r, _| if (r << 1) & (1 << 32) != 0 { (r << 1) ^ P } else { r << 1 })
    }

    /// The folds' constants are what their comment says they are.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_fold_constants_are_powers_of_x() {
        let reflected = |v: u64| v.reverse_bits();
        let pair = |bytes: u32| (reflected(x_to_the_mod_p(8 * bytes + 63)), reflected(x_to_the_mod_p(8 * bytes - 1)));
        assert_eq!(pair(256), x86::PAST_256_BYTES);
        assert_eq!(pair(64), x86::PAST_64_BYTES);
    }

    /// A flipped bit anywhere in a block changes its crc.
    #[test]
    fn a_flipped_bit_in_any_lane_changes_it() {
        let mut block = vec![0x5au8; 4096];
        let clean = volatile_crc(0, &block);
        let flips: &[usize] = if cfg!(miri) {
            &[1360, 4095]
        } else {
            &[0, 255, 256, 1359, 1360, 2719, 2720, 4031, 4032, 4079, 4080, 4095]
        };
        for &at in flips {
            block[at] ^= 0x10;
            for (way, got) in by_every_way(0, &block) {
                assert_ne!(got, clean, "{way}: byte {at}");
            }
            block[at] ^= 0x10;
        }
    }
}
