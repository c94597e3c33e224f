//! The panel k-quant kernels on x86 ([`super::panel`]'s layout): one body
//! per format, written once over [`Lanes`], which is either a whole panel
//! on 512-bit vectors with AVX-512 VNNI (`vpdpbusd` for 4 byte products
//! into each row's i32, `vpdpwssd` for the mins) or the panel as two 8-row
//! halves on 256-bit AVX2 vectors (`vpmaddubsw` + `vpmaddwd`).
//!
//! Per super-block and tile of R activation rows: each code vector is
//! loaded once and turned into unsigned bytes by one or two ANDs (Q4_K) or
//! a few shifts, ANDs and an OR (Q6_K), then dotted with the R rows' 4
//! activation codes broadcast; each group's i32 sums are scaled by one
//! `vpmulld` with the 16 rows' scales. Exact in i32 (bounds at each step).
//! Then per row one conversion and one or two FMAs with the rows' f16
//! factors times the activation scale.

use std::arch::x86_64::*;

use super::panel::{KPanel, Operands, PANEL, Q4KPanel, Q6KPanel, XBlock};

/// Integer and float vectors of `LANES` rows, and the operations the
/// kernels need. All methods need the implementation's target features.
trait Lanes {
    type I: Copy;
    type F: Copy;
    /// Rows per vector; a panel is `PANEL / LANES` of them.
    const LANES: usize;
    /// Most activation rows per tile (accumulators must fit the registers).
    const TILE_Q4K: usize;
    const TILE_Q6K: usize;
    /// Whether Q4_K's high nibbles are dotted in place (16x, no shift):
    /// `vpdpbusd` takes 240 * 127 * 4, `vpmaddubsw`'s i16 pairs would not.
    const HIGH_IN_PLACE: bool;
    /// Whether Q4_K's sub-block sums are kept in i16 pairs ([`Self::dot_i16`])
    /// and scaled by one `vpmaddwd` a sub-block ([`Self::madd_scaled`]):
    /// AVX2's `vpmaddubsw` then leaves no widening per 4 weights (VNNI's
    /// `vpdpbusd` widens for free).
    const PAIR_SUMS: bool;

    unsafe fn load(p: *const u8) -> Self::I;
    unsafe fn splat8(v: u8) -> Self::I;
    unsafe fn splat32(v: i32) -> Self::I;
    /// Four bytes at p in every i32 lane.
    unsafe fn bcast4(p: *const i8) -> Self::I;
    unsafe fn and(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn add(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn mullo(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn srai4(a: Self::I) -> Self::I;
    /// Shifts of 16-bit lanes (the kernels mask the bits that cross bytes).
    unsafe fn srl16_2(a: Self::I) -> Self::I;
    unsafe fn srl16_4(a: Self::I) -> Self::I;
    unsafe fn sll16_2(a: Self::I) -> Self::I;
    unsafe fn sll16_4(a: Self::I) -> Self::I;
    /// `acc + ` sums of 4 products of unsigned `w` and signed `x` bytes.
    unsafe fn dot(acc: Self::I, w: Self::I, x: Self::I) -> Self::I;
    /// `acc + ` sums of 2 products of i16.
    unsafe fn dot16(acc: Self::I, a: Self::I, b: Self::I) -> Self::I;
    /// `acc + ` sums of 2 products of unsigned `w` and signed `x` bytes, in
    /// i16 lanes (the caller bounds the sums).
    unsafe fn dot_i16(acc: Self::I, w: Self::I, x: Self::I) -> Self::I;
    /// Each i32 lane's low 16 bits copied into its high 16 (a scale for
    /// both i16 halves of a lane).
    unsafe fn pairs(a: Self::I) -> Self::I;
    /// `LANES` bytes widened to i32 lanes.
    unsafe fn u8_to_i32(p: *const u8) -> Self::I;
    unsafe fn i8_to_i32(p: *const i8) -> Self::I;
    /// `2 * LANES` bytes widened to i16 (pairs per i32 lane).
    unsafe fn u8_to_i16(p: *const u8) -> Self::I;
    unsafe fn f16s(p: *const half::f16) -> Self::F;
    unsafe fn cvt(a: Self::I) -> Self::F;
    unsafe fn splat_ps(v: f32) -> Self::F;
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// `*p += a * b` over `LANES` floats.
    unsafe fn fma_into(p: *mut f32, a: Self::F, b: Self::F);
}

struct Avx512;
// Each method is one intrinsic; the SAFETY note inside covers them all.
#[allow(clippy::undocumented_unsafe_blocks)]
impl Lanes for Avx512 {
    type I = __m512i;
    type F = __m512;
    const LANES: usize = 16;
    const TILE_Q4K: usize = 4;
    const TILE_Q6K: usize = 3;
    const PAIR_SUMS: bool = false;
    const HIGH_IN_PLACE: bool = true;

    // SAFETY (every method): AVX-512 F, BW and VNNI per the callers; the
    // loads read the bytes their doc comments name.
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512i {
        unsafe { _mm512_load_si512(p.cast()) }
    }
    #[inline(always)]
    unsafe fn splat8(v: u8) -> __m512i {
        unsafe { _mm512_set1_epi8(v as i8) }
    }
    #[inline(always)]
    unsafe fn splat32(v: i32) -> __m512i {
        unsafe { _mm512_set1_epi32(v) }
    }
    #[inline(always)]
    unsafe fn bcast4(p: *const i8) -> __m512i {
        unsafe { _mm512_set1_epi32(p.cast::<i32>().read_unaligned()) }
    }
    #[inline(always)]
    unsafe fn and(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_and_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn or(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_or_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn mullo(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_mullo_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn srai4(a: __m512i) -> __m512i {
        unsafe { _mm512_srai_epi32::<4>(a) }
    }
    #[inline(always)]
    unsafe fn srl16_2(a: __m512i) -> __m512i {
        unsafe { _mm512_srli_epi16::<2>(a) }
    }
    #[inline(always)]
    unsafe fn srl16_4(a: __m512i) -> __m512i {
        unsafe { _mm512_srli_epi16::<4>(a) }
    }
    #[inline(always)]
    unsafe fn sll16_2(a: __m512i) -> __m512i {
        unsafe { _mm512_slli_epi16::<2>(a) }
    }
    #[inline(always)]
    unsafe fn sll16_4(a: __m512i) -> __m512i {
        unsafe { _mm512_slli_epi16::<4>(a) }
    }
    #[inline(always)]
    unsafe fn dot(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
        unsafe { _mm512_dpbusd_epi32(acc, w, x) }
    }
    #[inline(always)]
    unsafe fn dot16(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_dpwssd_epi32(acc, a, b) }
    }
    #[inline(always)]
    unsafe fn dot_i16(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
        unsafe { _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x)) }
    }
    #[inline(always)]
    unsafe fn pairs(a: __m512i) -> __m512i {
        unsafe { _mm512_or_si512(a, _mm512_slli_epi32::<16>(a)) }
    }
    #[inline(always)]
    unsafe fn u8_to_i32(p: *const u8) -> __m512i {
        unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn i8_to_i32(p: *const i8) -> __m512i {
        unsafe { _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn u8_to_i16(p: *const u8) -> __m512i {
        unsafe { _mm512_cvtepu8_epi16(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn f16s(p: *const half::f16) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn cvt(a: __m512i) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(a) }
    }
    #[inline(always)]
    unsafe fn splat_ps(v: f32) -> __m512 {
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma_into(p: *mut f32, a: __m512, b: __m512) {
        unsafe { _mm512_storeu_ps(p, _mm512_fmadd_ps(a, b, _mm512_loadu_ps(p))) }
    }
}

struct Avx2;
#[allow(clippy::undocumented_unsafe_blocks)]
impl Lanes for Avx2 {
    type I = __m256i;
    type F = __m256;
    const LANES: usize = 8;
    // 3 with the sub-block sums in i16 pairs (PAIR_SUMS): their registers
    // fit 3 rows' sums beside the codes.
    const TILE_Q4K: usize = 3;
    const PAIR_SUMS: bool = true;
    // 3, not 1: at 2-8 rows (experts at a batched decode step) Q6_K's
    // codes are assembled once for 3 rows; 1.3-1.7x per call at m = 2-8
    // on the Qwen3-30B-A3B expert shapes, m = 1 the same (docs/perf-log.md).
    const TILE_Q6K: usize = 3;
    const HIGH_IN_PLACE: bool = false;

    // SAFETY (every method): AVX2, FMA and F16C per the callers; the loads
    // read the bytes their doc comments name.
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256i {
        unsafe { _mm256_load_si256(p.cast()) }
    }
    #[inline(always)]
    unsafe fn splat8(v: u8) -> __m256i {
        unsafe { _mm256_set1_epi8(v as i8) }
    }
    #[inline(always)]
    unsafe fn splat32(v: i32) -> __m256i {
        unsafe { _mm256_set1_epi32(v) }
    }
    #[inline(always)]
    unsafe fn bcast4(p: *const i8) -> __m256i {
        unsafe { _mm256_set1_epi32(p.cast::<i32>().read_unaligned()) }
    }
    #[inline(always)]
    unsafe fn and(a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_and_si256(a, b) }
    }
    #[inline(always)]
    unsafe fn or(a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_or_si256(a, b) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_add_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn mullo(a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_mullo_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn srai4(a: __m256i) -> __m256i {
        unsafe { _mm256_srai_epi32::<4>(a) }
    }
    #[inline(always)]
    unsafe fn srl16_2(a: __m256i) -> __m256i {
        unsafe { _mm256_srli_epi16::<2>(a) }
    }
    #[inline(always)]
    unsafe fn srl16_4(a: __m256i) -> __m256i {
        unsafe { _mm256_srli_epi16::<4>(a) }
    }
    #[inline(always)]
    unsafe fn sll16_2(a: __m256i) -> __m256i {
        unsafe { _mm256_slli_epi16::<2>(a) }
    }
    #[inline(always)]
    unsafe fn sll16_4(a: __m256i) -> __m256i {
        unsafe { _mm256_slli_epi16::<4>(a) }
    }
    #[inline(always)]
    unsafe fn dot(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
        // Pairs fit i16: codes <= 63 here (Q4_K's high nibbles shifted).
        unsafe { _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))) }
    }
    #[inline(always)]
    unsafe fn dot16(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)) }
    }
    #[inline(always)]
    unsafe fn dot_i16(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
        unsafe { _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)) }
    }
    #[inline(always)]
    unsafe fn pairs(a: __m256i) -> __m256i {
        unsafe { _mm256_or_si256(a, _mm256_slli_epi32::<16>(a)) }
    }
    #[inline(always)]
    unsafe fn u8_to_i32(p: *const u8) -> __m256i {
        unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())) }
    }
    #[inline(always)]
    unsafe fn i8_to_i32(p: *const i8) -> __m256i {
        unsafe { _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())) }
    }
    #[inline(always)]
    unsafe fn u8_to_i16(p: *const u8) -> __m256i {
        unsafe { _mm256_cvtepu8_epi16(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn f16s(p: *const half::f16) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn cvt(a: __m256i) -> __m256 {
        unsafe { _mm256_cvtepi32_ps(a) }
    }
    #[inline(always)]
    unsafe fn splat_ps(v: f32) -> __m256 {
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma_into(p: *mut f32, a: __m256, b: __m256) {
        unsafe { _mm256_storeu_ps(p, _mm256_fmadd_ps(a, b, _mm256_loadu_ps(p))) }
    }
}

/// How far ahead of its loads the first row group prefetches a panel's blocks (decode: the vendor's
/// `StreamPrefetch`), by format (Zen 5, GB/s against a 90 GB/s probe): Q4_K 8 KiB (3.6 blocks; 16 KiB
/// 5-8% slower), Q6_K 16 KiB (4.9 blocks; 52-55 at 4 KiB, 67-72 at 8, 73-81 at 16).
const PF_Q4K: usize = 8 << 10;
const PF_Q6K: usize = 16 << 10;

/// Prefetches the lines of a block `ahead` bytes on, one at a time, spread
/// over the block's loads (a burst would wait for free miss buffers).
struct Prefetcher {
    at: *const u8,
    end: *const u8,
    left: usize,
    hint: Option<i32>,
}

impl Prefetcher {
    #[inline(always)]
    fn new<T>(block: *const T, ahead: usize, end: *const u8, hint: Option<i32>) -> Self {
        let lines = std::mem::size_of::<T>() / 64;
        Self { at: block.cast::<u8>().wrapping_add(ahead), end, left: lines, hint }
    }

    #[inline(always)]
    fn next(&mut self) {
        let Some(hint) = self.hint else { return };
        if self.left == 0 || self.at >= self.end {
            return;
        }
        // SAFETY: SSE is baseline on x86-64; a prefetch does not access memory.
        unsafe {
            if hint == _MM_HINT_T1 {
                _mm_prefetch::<_MM_HINT_T1>(self.at.cast());
            } else if hint == _MM_HINT_NTA {
                _mm_prefetch::<_MM_HINT_NTA>(self.at.cast());
            } else {
                _mm_prefetch::<_MM_HINT_T0>(self.at.cast());
            }
        }
        self.at = self.at.wrapping_add(64);
        self.left -= 1;
    }

    #[inline(always)]
    fn rest(&mut self) {
        while self.left > 0 && self.hint.is_some() {
            self.next();
            if self.at >= self.end {
                break;
            }
        }
    }
}

/// One panel's sums with R activation rows: `out[r][row]`, accumulated.
struct Tile<'a> {
    x: &'a [XBlock],
    kb: usize,
    i0: usize,
    hint: Option<i32>,
    end: *const u8,
}

impl Tile<'_> {
    /// Row `i0 + r`'s activation block b.
    ///
    /// # Safety
    /// `(i0 + r) * kb + b` is inside x.
    #[inline(always)]
    unsafe fn x(&self, r: usize, b: usize) -> &XBlock {
        // SAFETY: per the contract.
        unsafe { self.x.get_unchecked((self.i0 + r) * self.kb + b) }
    }
}

/// Q4_K: per sub-block pair c, 8 code vectors; low nibbles are sub-block
/// 2c (weights 64c + 4t..), high nibbles 2c + 1 (64c + 32 + 4t..).
/// Bounds: a sub-block's dot <= 15 * 127 * 32 (x16 in place), times a
/// scale <= 63, 8 of them: < 2^31.
///
/// # Safety
/// `L`'s features; rows `i0..i0 + R` and every block of the panel in x.
// `r` indexes several per-row arrays in step.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn q4k_tile<L: Lanes, const R: usize>(t: &Tile<'_>, panels: &[Q4KPanel], out: &mut [[f32; PANEL]; 4]) {
    // SAFETY: every pointer below is inside the panel block or the x rows
    // per the contract; the features per the contract.
    unsafe {
        let (low, high) = (L::splat8(0x0F), L::splat8(0xF0));
        for (b, blk) in panels.iter().enumerate() {
            let mut pf = Prefetcher::new(blk, PF_Q4K, t.end, t.hint);
            for half in 0..PANEL / L::LANES {
                let row0 = half * L::LANES;
                let mut isum = [L::splat32(0); R];
                for c in 0..4 {
                    let (mut lo, mut hi) = ([L::splat32(0); R], [L::splat32(0); R]);
                    for v in 0..8 {
                        if half == 0 {
                            pf.next();
                        }
                        let w = L::load(blk.qs[8 * c + v].as_ptr().cast::<u8>().add(4 * row0));
                        let wl = L::and(w, low);
                        let wh = if L::HIGH_IN_PLACE { L::and(w, high) } else { L::and(L::srl16_4(w), low) };
                        for r in 0..R {
                            let xq = t.x(r, b).q8.qs.as_ptr().add(64 * c + 4 * v);
                            if L::PAIR_SUMS {
                                // i16 pairs: 8 vectors of 2 products of
                                // 15 * 128 stay under 2^15.
                                lo[r] = L::dot_i16(lo[r], wl, L::bcast4(xq));
                                hi[r] = L::dot_i16(hi[r], wh, L::bcast4(xq.add(32)));
                            } else {
                                lo[r] = L::dot(lo[r], wl, L::bcast4(xq));
                                hi[r] = L::dot(hi[r], wh, L::bcast4(xq.add(32)));
                            }
                        }
                    }
                    let sl = L::u8_to_i32(blk.scales[2 * c].as_ptr().add(row0));
                    let sh = L::u8_to_i32(blk.scales[2 * c + 1].as_ptr().add(row0));
                    if L::PAIR_SUMS {
                        let (sl, sh) = (L::pairs(sl), L::pairs(sh));
                        for r in 0..R {
                            isum[r] = L::dot16(L::dot16(isum[r], lo[r], sl), hi[r], sh);
                        }
                        continue;
                    }
                    for r in 0..R {
                        let h = L::mullo(hi[r], sh);
                        let h = if L::HIGH_IN_PLACE { L::srai4(h) } else { h };
                        isum[r] = L::add(isum[r], L::add(L::mullo(lo[r], sl), h));
                    }
                }
                let mut msum = [L::splat32(0); R];
                for (p, mins) in blk.mins.iter().enumerate() {
                    let mv = L::u8_to_i16(mins.as_ptr().cast::<u8>().add(2 * row0));
                    for (r, m) in msum.iter_mut().enumerate() {
                        *m = L::dot16(*m, mv, L::splat32(t.x(r, b).pairs32[p]));
                    }
                }
                let d = L::f16s(blk.d.as_ptr().add(row0));
                let dm = L::f16s(blk.dmin.as_ptr().add(row0));
                for r in 0..R {
                    let xd = L::splat_ps(t.x(r, b).q8.d);
                    let o = out[r].as_mut_ptr().add(row0);
                    L::fma_into(o, L::cvt(isum[r]), L::mul(d, xd));
                    L::fma_into(o, L::cvt(msum[r]), L::mul(dm, L::splat_ps(-t.x(r, b).q8.d)));
                }
            }
            pf.rest();
        }
    }
}

/// Q6_K: per half h (128 weights) and quarter q, code vectors 4q..4q + 4
/// of `qh` give the 2 high bits of 4 groups (weights 128h + 32s + 4v..,
/// s = 0..4), whose low 4 bits are in `ql` vectors v and v + 8. Each
/// group's sum starts at `-32 * bsum` (the codes' offset). Bounds: a
/// group's sum <= 32 * 127 * 16, times |scale| <= 128, 16 of them: < 2^31.
///
/// # Safety
/// As [`q4k_tile`].
// `r` indexes several per-row arrays in step.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn q6k_tile<L: Lanes, const R: usize>(t: &Tile<'_>, panels: &[Q6KPanel], out: &mut [[f32; PANEL]; 4]) {
    // SAFETY: as in q4k_tile.
    unsafe {
        let (low, bits45) = (L::splat8(0x0F), L::splat8(0x30));
        for (b, blk) in panels.iter().enumerate() {
            let mut pf = Prefetcher::new(blk, PF_Q6K, t.end, t.hint);
            for half in 0..PANEL / L::LANES {
                let row0 = half * L::LANES;
                let mut isum = [L::splat32(0); R];
                for h in 0..2 {
                    for q in 0..2 {
                        let groups = [8 * h + q, 8 * h + 2 + q, 8 * h + 4 + q, 8 * h + 6 + q];
                        let mut acc: [[L::I; R]; 4] =
                            std::array::from_fn(|s| std::array::from_fn(|r| L::splat32(t.x(r, b).neg32[groups[s]])));
                        for v in 4 * q..4 * q + 4 {
                            // 48 of the block's 53 lines, spread (not one burst).
                            if half == 0 {
                                pf.next();
                                pf.next();
                                pf.next();
                            }
                            let qh = L::load(blk.qh[8 * h + v].as_ptr().cast::<u8>().add(4 * row0));
                            let qa = L::load(blk.ql[16 * h + v].as_ptr().cast::<u8>().add(4 * row0));
                            let qb = L::load(blk.ql[16 * h + 8 + v].as_ptr().cast::<u8>().add(4 * row0));
                            let codes = [
                                L::or(L::and(qa, low), L::and(L::sll16_4(qh), bits45)),
                                L::or(L::and(qb, low), L::and(L::sll16_2(qh), bits45)),
                                L::or(L::and(L::srl16_4(qa), low), L::and(qh, bits45)),
                                L::or(L::and(L::srl16_4(qb), low), L::and(L::srl16_2(qh), bits45)),
                            ];
                            for r in 0..R {
                                let xq = t.x(r, b).q8.qs.as_ptr().add(128 * h + 4 * v);
                                for (s, code) in codes.iter().enumerate() {
                                    acc[s][r] = L::dot(acc[s][r], *code, L::bcast4(xq.add(32 * s)));
                                }
                            }
                        }
                        for (s, &g) in groups.iter().enumerate() {
                            let sc = L::i8_to_i32(blk.scales[g].as_ptr().add(row0));
                            for r in 0..R {
                                isum[r] = L::add(isum[r], L::mullo(acc[s][r], sc));
                            }
                        }
                    }
                }
                let d = L::f16s(blk.d.as_ptr().add(row0));
                for r in 0..R {
                    let o = out[r].as_mut_ptr().add(row0);
                    L::fma_into(o, L::cvt(isum[r]), L::mul(d, L::splat_ps(t.x(r, b).q8.d)));
                }
            }
            pf.rest();
        }
    }
}

/// y[.., columns of panels p0..p1], x rows in groups of equal height.
///
/// # Safety
/// `L`'s features; the operands' shapes checked; no other thread writes
/// these columns.
#[inline(always)]
unsafe fn panels<L: Lanes, B: KPanel>(ops: &Operands<'_, B>, p0: usize, p1: usize) {
    let (m, kb) = (ops.m, ops.w.dims().1);
    let tile = if B::as_q4k(&[]).is_some() { L::TILE_Q4K } else { L::TILE_Q6K };
    let groups = m.div_ceil(tile);
    let height = m.div_ceil(groups);
    let all = ops.w.panel(0).as_ptr_range().start;
    let end = all.cast::<u8>().wrapping_add(ops.w.size_in_bytes());
    let decode = crate::cpu::isa::stream_prefetch().hint();
    for p in p0..p1 {
        let w = ops.w.panel(p);
        for g in 0..groups {
            let i0 = g * height;
            let rows = (m - i0).min(height);
            let hint = match (g, m) {
                (0, 1) => Some(decode),
                (0, _) => Some(_MM_HINT_T0),
                _ => None,
            };
            let t = Tile { x: ops.x, kb, i0, hint, end };
            let mut out = [[0f32; PANEL]; 4];
            // SAFETY: rows i0..i0 + rows < m, each with kb blocks in x.
            unsafe {
                if let Some(w) = B::as_q4k(w) {
                    match rows {
                        4 => q4k_tile::<L, 4>(&t, w, &mut out),
                        3 => q4k_tile::<L, 3>(&t, w, &mut out),
                        2 => q4k_tile::<L, 2>(&t, w, &mut out),
                        _ => q4k_tile::<L, 1>(&t, w, &mut out),
                    }
                } else if let Some(w) = B::as_q6k(w) {
                    match rows {
                        3 => q6k_tile::<L, 3>(&t, w, &mut out),
                        2 => q6k_tile::<L, 2>(&t, w, &mut out),
                        _ => q6k_tile::<L, 1>(&t, w, &mut out),
                    }
                }
            }
            for (r, sums) in out.iter().enumerate().take(rows) {
                ops.store(p, i0 + r, sums);
            }
        }
    }
}

/// See [`panels`].
///
/// # Safety
/// AVX-512 F, BW and VNNI (and AVX2, FMA, F16C) must be available; as [`panels`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn panels_avx512<B: KPanel>(ops: &Operands<'_, B>, p0: usize, p1: usize) {
    // SAFETY: forwarded.
    unsafe { panels::<Avx512, B>(ops, p0, p1) }
}

/// See [`panels`].
///
/// # Safety
/// AVX2, FMA and F16C must be available; as [`panels`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panels_avx2<B: KPanel>(ops: &Operands<'_, B>, p0: usize, p1: usize) {
    // SAFETY: forwarded.
    unsafe { panels::<Avx2, B>(ops, p0, p1) }
}
