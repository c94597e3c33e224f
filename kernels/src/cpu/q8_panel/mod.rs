//! Q8_0 weights in panels of 16 rows: `y = x @ W^T` with W in GGML's Q8_0
//! blocks, regrouped so that one broadcast of 4 activation codes meets 16
//! rows' codes at once: `vpdpbusd` on AVX-512 VNNI, `vpmaddubsw` on 8-row
//! halves on AVX2 ([`avx2`]; 1.4-1.8x the 4-row tiles of
//! [`super::quant::PackedQ8_0`] at m >= 8 on Zen 3, the same at decode).
//! Machines with neither keep `PackedQ8_0` ([`panels_pay`]).
//!
//! Layout ([`PanelQ8_0`]): output rows in panels of 16 (the last padded with
//! zero rows); per panel and block index, the 16 rows' 32 codes as 8 groups
//! of 4 k's, each group one 64-byte vector whose lane r holds row r's 4
//! codes ([`PanelBlock`]), and the 16 scales together in a second array.
//! The same 34 bytes per 32 weights as GGML's blocks.
//!
//! Why: one `vpdpbusd` multiplies 64 byte pairs and adds each lane's 4
//! products to that lane's i32: with 4 activation codes broadcast to every
//! lane, it advances 16 output rows by 4 k's, with no horizontal sum
//! anywhere, so a block of 16 rows is 8 instructions, against ~4 per row
//! and block for AVX2's `vpmaddubsw`/`vpmaddwd`/`vphaddd` with the sign
//! moved onto w. `vpdpbusd` takes unsigned times signed bytes, so the
//! weight codes are stored offset by 128 (`w + 128` in 0..=255, the bits
//! of w with the top one flipped) and the activations go in signed;
//! `128 * sum(x)` over the block, one integer per x row and block computed
//! with the activations, comes off before the block's i32 sums are
//! scaled: exact. (Offsetting the activations instead would put the
//! correction on the weights: one more `vpdpbusd` per weight vector, which
//! at m = 1 is half the kernel's instructions, and left decode
//! compute-bound where memory reads 60 GB/s.)
//!
//! Tiles: up to 12 x rows at once (12 i32 and 12 f32 accumulators), so
//! each weight vector loaded serves 12 rows; m = 1 (decode) streams each
//! panel once, prefetched ahead. Rows past 256 run in chunks of 256 whose
//! quantized activations (1.4 MB at k = 5632) stay in L2 while the panels
//! pass.
//!
//! Activations are quantized to Q8_0 once per call, as for every Q8_0 path
//! here and in llama.cpp; the results equal [`super::quant`]'s up to the
//! order of the float additions.

use half::f16;

use super::quant::{BlockQ8_0, QK, QuantError, check_xy, quantize_activations_q8_0, quantize_activations_q8_0_into};
use super::{OutPtr, WeightBuf, for_each_owned, for_each_span, placement};

/// Output rows per panel: the 16 i32 lanes of a vector.
pub const PANEL: usize = 16;

/// x rows per call of the tiles: their quantized activations stay in L2.
const CHUNK_ROWS: usize = 256;

/// One panel's codes at one block index: `[k / 4][row][4]`, 512 bytes, each
/// group of 4 k's one aligned vector; each code is `w ^ 0x80`, i.e. `w + 128`
/// read as an unsigned byte.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PanelBlock(pub [[[i8; 4]; PANEL]; QK / 4]);

/// Zero weights (padding rows), offset by 128.
const ZERO_BLOCK: PanelBlock = PanelBlock([[[i8::MIN; 4]; PANEL]; QK / 4]);

/// A code as stored: `w + 128` as an unsigned byte, in an i8's bits; its
/// own inverse.
fn offset(q: i8) -> i8 {
    q ^ i8::MIN
}

/// Q8_0 weights `[n, kb blocks]` in panels of 16 rows for `vpdpbusd`.
#[derive(Clone, Debug, PartialEq)]
pub struct PanelQ8_0 {
    n: usize,
    kb: usize,
    /// `[n / 16 rounded up, kb]`.
    codes: WeightBuf<PanelBlock>,
    /// `[n / 16 rounded up, kb]`, row r of the panel in lane r.
    scales: WeightBuf<[f16; PANEL]>,
}

/// The kernel a call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    /// The portable loop.
    Scalar,
    /// 256-bit `vpmaddubsw`/`vpmaddwd` on 8-row halves ([`avx2`]).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// 512-bit `vpdpbusd` on whole panels ([`avx512`]).
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
}

impl Backend {
    /// The best this CPU runs (`TINYVLLM_CPU_ISA` caps it, as everywhere).
    fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if vnni_available() {
                return Self::Avx512Vnni;
            }
            if super::isa::simd() == super::isa::Simd::Avx2 {
                return Self::Avx2;
            }
        }
        Self::Scalar
    }

    /// Every kernel this CPU runs, the best last (for tests).
    #[cfg(test)]
    fn available() -> Vec<Self> {
        #[cfg(target_arch = "x86_64")]
        let simd = [
            (super::isa::simd() == super::isa::Simd::Avx2).then_some(Self::Avx2),
            vnni_available().then_some(Self::Avx512Vnni),
        ];
        #[cfg(not(target_arch = "x86_64"))]
        let simd: [Option<Self>; 0] = [];
        std::iter::once(Self::Scalar).chain(simd.into_iter().flatten()).collect()
    }
}

/// Whether this CPU runs the panels' own SIMD kernel (VNNI or AVX2):
/// where it does not, the 4-row layout of [`super::quant::PackedQ8_0`]
/// serves better (NEON).
pub fn panels_pay() -> bool {
    Backend::best() != Backend::Scalar
}

/// Whether this CPU runs the VNNI kernel (AVX-512 F, BW and VNNI, with the
/// AVX2 set for the activation quantizer, and `TINYVLLM_CPU_ISA` not
/// capping it below AVX-512); detected once ([`super::isa`]).
pub fn vnni_available() -> bool {
    super::isa::vnni()
}

impl PanelQ8_0 {
    /// Regroups `n` rows of `kb` blocks (row-major, GGML's order).
    pub fn pack(blocks: &[BlockQ8_0], n: usize, kb: usize) -> Result<Self, QuantError> {
        if blocks.len() != n * kb {
            return Err(QuantError::Shape(format!("{} blocks for {n} rows of {kb}", blocks.len())));
        }
        let panels = n.div_ceil(PANEL);
        let mut codes = WeightBuf::filled(ZERO_BLOCK, panels * kb);
        let mut scales = WeightBuf::filled([f16::ZERO; PANEL], panels * kb);
        for (row, blocks) in blocks.chunks_exact(kb.max(1)).enumerate().take(n) {
            let (p, r) = (row / PANEL, row % PANEL);
            for (b, blk) in blocks.iter().enumerate() {
                let dst = &mut codes[p * kb + b].0;
                for (t, quad) in blk.qs.chunks_exact(4).enumerate() {
                    // -128 (never written by GGML's quantizer) becomes
                    // -127, as the GGUF loader makes it: the AVX2 kernel
                    // negates codes.
                    dst[t][r] = std::array::from_fn(|j| offset(quad[j].max(-127)));
                }
                scales[p * kb + b][r] = blk.d;
            }
        }
        Ok(Self { n, kb, codes, scales })
    }

    /// Back to GGML's row-major blocks.
    pub fn unpack(&self) -> Vec<BlockQ8_0> {
        (0..self.n).flat_map(|row| (0..self.kb).map(move |b| self.block(row, b))).collect()
    }

    /// Row `row`'s block `b` in GGML's form.
    fn block(&self, row: usize, b: usize) -> BlockQ8_0 {
        let (p, r) = (row / PANEL, row % PANEL);
        let src = &self.codes[p * self.kb + b].0;
        let mut qs = [0i8; QK];
        for (t, quad) in qs.chunks_exact_mut(4).enumerate() {
            quad.iter_mut().zip(&src[t][r]).for_each(|(q, &c)| *q = offset(c));
        }
        BlockQ8_0 { d: self.scales[p * self.kb + b][r], qs }
    }

    /// `(rows, blocks per row)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.kb)
    }

    /// The two arrays, for placing them in memory (huge pages).
    pub fn arrays(&self) -> (&[PanelBlock], &[[f16; PANEL]]) {
        (&self.codes, &self.scales)
    }

    /// The whole allocations behind the two arrays (2 MiB pages on Linux
    /// for large weights): the ranges to back with huge pages.
    pub fn allocations(&self) -> (&[PanelBlock], &[[f16; PANEL]]) {
        (self.codes.allocation(), self.scales.allocation())
    }

    /// Bytes of weight read per pass (padding rows included).
    pub fn size_in_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.codes) + std::mem::size_of_val(&*self.scales)
    }
}

/// `y = x @ W^T` (x `[m, k]`, y `[m, n]`, every element overwritten), on the
/// VNNI kernel where the CPU has it, else on the portable loop.
pub fn matmul_panel_q8_0(x: &[f32], m: usize, w: &PanelQ8_0, y: &mut [f32]) -> Result<(), QuantError> {
    matmul_with(Backend::best(), x, m, w, y)
}

/// [`matmul_panel_q8_0`] on the portable loop (for tests).
pub fn matmul_panel_q8_0_scalar(x: &[f32], m: usize, w: &PanelQ8_0, y: &mut [f32]) -> Result<(), QuantError> {
    matmul_with(Backend::Scalar, x, m, w, y)
}

/// One chunk's operands: activations quantized, their scales, and `128 *
/// sum(q)` of each block (the weights' offset times them); the weights; y.
struct Operands<'a> {
    xq: &'a [BlockQ8_0],
    xd: &'a [f32],
    xcorr: &'a [i32],
    w: &'a PanelQ8_0,
    m: usize,
    y: OutPtr,
}

fn matmul_with(backend: Backend, x: &[f32], m: usize, w: &PanelQ8_0, y: &mut [f32]) -> Result<(), QuantError> {
    matmul_placed(backend, placement::threads_far_apart(), x, m, w, y)
}

/// [`matmul_with`] as if the pool's threads were `far` apart or not.
fn matmul_placed(
    backend: Backend,
    far: bool,
    x: &[f32],
    m: usize,
    w: &PanelQ8_0,
    y: &mut [f32],
) -> Result<(), QuantError> {
    let (n, kb) = (w.n, w.kb);
    if !check_xy(x, m, kb, y, n)? {
        return Ok(());
    }
    let k = kb * QK;
    if k == 0 {
        y.fill(0.0);
        return Ok(());
    }
    if m == 1 {
        decode(backend, far, x, w, y);
        return Ok(());
    }
    for (xc, yc) in x.chunks(CHUNK_ROWS * k).zip(y.chunks_mut(CHUNK_ROWS * n)) {
        let rows = xc.len() / k;
        let (xq, xd) = quantize_activations_q8_0(xc, rows * kb);
        let xcorr: Vec<i32> = xq.iter().map(correction).collect();
        let ops = Operands { xq: &xq, xd: &xd, xcorr: &xcorr, w, m: rows, y: OutPtr(yc.as_mut_ptr()) };
        // 1-4 panels (16-64 rows) per task, about 8 tasks per thread.
        for_each_span(n.div_ceil(PANEL), (1, 4), |p0, p1| panels(backend, &ops, p0, p1));
    }
    Ok(())
}

/// `128 * sum(q)` of an activation block: what the weights' offset adds
/// to its dot products.
fn correction(block: &BlockQ8_0) -> i32 {
    128 * block.qs.iter().map(|&q| i32::from(q)).sum::<i32>()
}

/// A decode call's quantized activations, kept by the calling thread from
/// one call to the next (a step makes ~90 such calls): the same lines each
/// time, which [`decode`] hands back to memory where the threads sit far
/// apart. Fresh buffers cost as much there, an allocation and a zero fill
/// of lines the other thread last read (docs/perf-log.md, "Zen 4, eighth
/// session").
#[derive(Default)]
struct DecodeInput {
    xq: Vec<BlockQ8_0>,
    xd: Vec<f32>,
    xcorr: Vec<i32>,
}

thread_local! {
    static DECODE_INPUT: std::cell::RefCell<DecodeInput> = std::cell::RefCell::default();
}

impl DecodeInput {
    /// Quantizes `x` (`kb` blocks) into the buffers, asking for them
    /// writable first where the threads sit `far` apart.
    fn quantize(&mut self, x: &[f32], kb: usize, far: bool) {
        self.xq.resize(kb, BlockQ8_0 { d: f16::ZERO, qs: [0; QK] });
        self.xd.resize(kb, 0.0);
        self.xcorr.resize(kb, 0);
        if far {
            placement::prefetch_for_write(&self.xq);
            placement::prefetch_for_write(&self.xd);
            placement::prefetch_for_write(&self.xcorr);
        }
        quantize_activations_q8_0_into(x, &mut self.xq, &mut self.xd);
        for (c, b) in self.xcorr.iter_mut().zip(&self.xq) {
            *c = correction(b);
        }
    }

    /// Hands the buffers back to memory, so that the next call's writes do
    /// not wait for the other core complex's copies.
    fn flush(&self) {
        placement::flush_lines(&self.xq);
        placement::flush_lines(&self.xd);
        placement::flush_lines(&self.xcorr);
    }
}

/// `y = x @ W^T` for one x row, the panels split between the pool's
/// threads by weight bytes. With the threads `far` apart, the activations
/// are asked for writable before they are quantized and handed back to
/// memory after the call, as both threads read them ([`placement`]).
fn decode(backend: Backend, far: bool, x: &[f32], w: &PanelQ8_0, y: &mut [f32]) {
    let (n, kb) = (w.n, w.kb);
    // A nested call on this thread (none today) would find it empty and
    // fill its own.
    let mut input = DECODE_INPUT.take();
    input.quantize(x, kb, far);
    let ops = Operands { xq: &input.xq, xd: &input.xd, xcorr: &input.xcorr, w, m: 1, y: OutPtr(y.as_mut_ptr()) };
    let count = n.div_ceil(PANEL);
    for_each_owned(count, w.size_in_bytes() / count, |ps| panels(backend, &ops, ps.start, ps.end));
    if far {
        input.flush();
    }
    DECODE_INPUT.set(input);
}

/// y[.., columns of panels p0..p1].
fn panels(backend: Backend, ops: &Operands<'_>, p0: usize, p1: usize) {
    match backend {
        // SAFETY: `Backend::best` only picks Avx512Vnni where
        // `vnni_available` detected the features; the caller checked the
        // shapes; this task alone writes the columns of panels p0..p1.
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512Vnni => unsafe { avx512::panels(ops, p0, p1) },
        // SAFETY: as above, Avx2 only after detecting AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => unsafe { avx2::panels(ops, p0, p1) },
        Backend::Scalar => scalar_panels(ops, p0, p1),
    }
}

/// Writes row `i`'s sums of panel p to y, dropping padding rows.
fn store(ops: &Operands<'_>, p: usize, i: usize, sums: &[f32; PANEL]) {
    // SAFETY: i < m and panel p < n / 16 rounded up, so the row and the
    // columns are within y; this task alone writes panel p's columns.
    unsafe { ops.y.store_rows(ops.w.n, i, p * PANEL, std::slice::from_ref(sums), None) };
}

/// Portable path: exact i32 block sums, scaled as the VNNI kernel does.
fn scalar_panels(ops: &Operands<'_>, p0: usize, p1: usize) {
    let kb = ops.w.kb;
    for p in p0..p1 {
        for i in 0..ops.m {
            let mut acc = [0f32; PANEL];
            for b in 0..kb {
                let blk = &ops.w.codes[p * kb + b].0;
                let x = &ops.xq[i * kb + b].qs;
                for (r, a) in acc.iter_mut().enumerate() {
                    // As the kernel: (w + 128) . x, less 128 * sum(x).
                    let mut s = -ops.xcorr[i * kb + b];
                    for (t, quad) in blk.iter().enumerate() {
                        for (j, &wq) in quad[r].iter().enumerate() {
                            s += i32::from(x[4 * t + j]) * i32::from(wq as u8);
                        }
                    }
                    *a += s as f32 * (ops.w.scales[p * kb + b][r].to_f32() * ops.xd[i * kb + b]);
                }
            }
            store(ops, p, i, &acc);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{BlockQ8_0, Operands, PANEL, PanelBlock, QK, store};

    /// Most x rows per tile: 12 i32 and 12 f32 accumulators, the weight
    /// vector, the broadcast codes and the scales take 27 of
    /// the 32 vector registers.
    const TILE_ROWS: usize = 12;

    /// How far ahead the first row group prefetches a panel's codes.
    const PF_BYTES: usize = 4 << 10;

    /// Where a tile prefetches a panel's weights ahead of its loads.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Prefetch {
        /// Not at all: an earlier row group of the call brought them in.
        No,
        /// Into L1, for the first row group of several (prefill, batches),
        /// where L2 left the tiles waiting.
        L1,
        /// Into L2, for decode (one x row) on Intel: the loads right behind
        /// find the lines in L2 and the line-fill buffers stay free for
        /// them; 4 or 8 KiB ahead read the same.
        L2,
        /// Non-temporal, for decode on AMD ([`crate::cpu::isa::StreamPrefetch`]).
        NonTemporal,
    }

    /// Prefetches the line at `at` as `how` says, unless it lies past `end`.
    #[inline(always)]
    fn prefetch(how: Prefetch, at: *const u8, end: *const u8) {
        if (at as usize) >= end as usize {
            return;
        }
        match how {
            Prefetch::No => {}
            // SAFETY: SSE is baseline on x86-64; a prefetch does not access
            // memory.
            Prefetch::L1 => unsafe { _mm_prefetch::<_MM_HINT_T0>(at.cast()) },
            // SAFETY: as above.
            Prefetch::L2 => unsafe { _mm_prefetch::<_MM_HINT_T1>(at.cast()) },
            // SAFETY: as above.
            Prefetch::NonTemporal => unsafe { _mm_prefetch::<_MM_HINT_NTA>(at.cast()) },
        }
    }

    /// y[.., columns of panels p0..p1].
    ///
    /// # Safety
    /// AVX-512 F, BW and VNNI (and AVX2, FMA, F16C) must be available; the
    /// operands' shapes must have been checked; no other thread may write
    /// these columns of y.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn panels(ops: &Operands<'_>, p0: usize, p1: usize) {
        let m = ops.m;
        let decode = match crate::cpu::isa::stream_prefetch() {
            crate::cpu::isa::StreamPrefetch::L2 => Prefetch::L2,
            crate::cpu::isa::StreamPrefetch::NonTemporal => Prefetch::NonTemporal,
        };
        // Groups of equal height: 16 rows run as 8 + 8, not 12 + 4.
        let groups = m.div_ceil(TILE_ROWS);
        let height = m.div_ceil(groups);
        for p in p0..p1 {
            for g in 0..groups {
                let i0 = g * height;
                let rows = (m - i0).min(height);
                let how = match (g, m) {
                    (0, 1) => decode,
                    (0, _) => Prefetch::L1,
                    _ => Prefetch::No,
                };
                let mut sums = [[0f32; PANEL]; TILE_ROWS];
                // SAFETY: rows i0..i0 + rows < m; panel p < panels.
                unsafe {
                    match rows {
                        12 => tile::<12>(ops, p, i0, how, &mut sums),
                        11 => tile::<11>(ops, p, i0, how, &mut sums),
                        10 => tile::<10>(ops, p, i0, how, &mut sums),
                        9 => tile::<9>(ops, p, i0, how, &mut sums),
                        8 => tile::<8>(ops, p, i0, how, &mut sums),
                        7 => tile::<7>(ops, p, i0, how, &mut sums),
                        6 => tile::<6>(ops, p, i0, how, &mut sums),
                        5 => tile::<5>(ops, p, i0, how, &mut sums),
                        4 => tile::<4>(ops, p, i0, how, &mut sums),
                        3 => tile::<3>(ops, p, i0, how, &mut sums),
                        2 => tile::<2>(ops, p, i0, how, &mut sums),
                        _ => tile::<1>(ops, p, i0, how, &mut sums),
                    }
                }
                for (r, s) in sums.iter().enumerate().take(rows) {
                    store(ops, p, i0 + r, s);
                }
            }
        }
    }

    /// Panel p's 16 dot products with x rows i0..i0 + R, into `sums[..R]`.
    /// Per block: 8 weight vectors, each fed to R `vpdpbusd` with 4 of a
    /// row's activation codes broadcast; then per row one subtraction of
    /// the row's block correction, conversion and FMA with the 16 weight
    /// scales times the row's activation scale.
    ///
    /// # Safety
    /// As [`panels`]; rows i0..i0 + R < m, p < the panel count.
    #[inline(always)]
    unsafe fn tile<const R: usize>(
        ops: &Operands<'_>,
        p: usize,
        i0: usize,
        how: Prefetch,
        sums: &mut [[f32; PANEL]; TILE_ROWS],
    ) {
        let kb = ops.w.kb;
        // SAFETY: every block index is < kb in panel p's span of the codes
        // and scales, and every activation index is in rows i0..i0 + R;
        // prefetches are hints and stay within the codes array.
        unsafe {
            let codes = ops.w.codes.as_ptr().add(p * kb);
            let scales = ops.w.scales.as_ptr().add(p * kb);
            let end = ops.w.codes.as_ptr_range().end.cast::<u8>();
            let scales_end = ops.w.scales.as_ptr_range().end.cast::<u8>();
            let xq: [*const BlockQ8_0; R] = std::array::from_fn(|r| ops.xq.as_ptr().add((i0 + r) * kb));
            let xd: [*const f32; R] = std::array::from_fn(|r| ops.xd.as_ptr().add((i0 + r) * kb));
            let xcorr: [*const i32; R] = std::array::from_fn(|r| ops.xcorr.as_ptr().add((i0 + r) * kb));
            let mut acc = [_mm512_setzero_ps(); R];
            for b in 0..kb {
                let blk: *const PanelBlock = codes.add(b);
                if how != Prefetch::No && b % 2 == 0 {
                    // The scales: 32 bytes a block, as far ahead as the codes.
                    prefetch(how, scales.add(b).cast::<u8>().wrapping_add(PF_BYTES / 16), scales_end);
                }
                // Each row's dot products start at minus its correction.
                let mut dots: [__m512i; R] = std::array::from_fn(|r| _mm512_set1_epi32(-*xcorr[r].add(b)));
                if R == 1 {
                    // One row: 4 independent chains, or the 8 dependent
                    // `vpdpbusd` of a block pace the loads at one per
                    // instruction latency (capped ~60 GB/s on Zen 4).
                    let x = (*xq[0].add(b)).qs.as_ptr();
                    let mut chains = [dots[0], _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()];
                    for t in 0..QK / 4 {
                        // One line ahead per line read: a burst of 8 would
                        // wait for free miss buffers.
                        prefetch(how, blk.cast::<u8>().wrapping_add(PF_BYTES + 64 * t), end);
                        let wv = _mm512_load_si512((*blk).0[t].as_ptr().cast());
                        let xv = _mm512_set1_epi32(x.add(4 * t).cast::<i32>().read_unaligned());
                        chains[t % 4] = _mm512_dpbusd_epi32(chains[t % 4], wv, xv);
                    }
                    let (a, b) = (_mm512_add_epi32(chains[0], chains[1]), _mm512_add_epi32(chains[2], chains[3]));
                    dots[0] = _mm512_add_epi32(a, b);
                } else {
                    for t in 0..QK / 4 {
                        prefetch(how, blk.cast::<u8>().wrapping_add(PF_BYTES + 64 * t), end);
                        let wv = _mm512_load_si512((*blk).0[t].as_ptr().cast());
                        for (d, x) in dots.iter_mut().zip(&xq) {
                            let quad = (*x.add(b)).qs.as_ptr().add(4 * t);
                            let xv = _mm512_set1_epi32(quad.cast::<i32>().read_unaligned());
                            *d = _mm512_dpbusd_epi32(*d, wv, xv);
                        }
                    }
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(scales.add(b).cast()));
                for ((a, d), x) in acc.iter_mut().zip(&dots).zip(&xd) {
                    let s = _mm512_cvtepi32_ps(*d);
                    *a = _mm512_fmadd_ps(s, _mm512_mul_ps(dw, _mm512_set1_ps(*x.add(b))), *a);
                }
            }
            for (a, s) in acc.iter().zip(sums.iter_mut()) {
                _mm512_storeu_ps(s.as_mut_ptr(), *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::quant::{matmul_q8_0_scalar, quantize_matrix_q8_0};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn random(rng: &mut StdRng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// Odd row counts (padding rows), every tile height, one and several
    /// row groups, a chunk boundary (257 rows), decode over many panels:
    /// the kernel and the portable loop against GGML-layout Q8_0, which
    /// quantizes activations the same.
    #[test]
    fn matches_the_row_major_q8_0_kernel() {
        let mut rng = StdRng::seed_from_u64(11);
        let shapes = [(1, 32, 1), (1, 64, 16), (1, 96, 37), (2, 64, 17), (3, 128, 31), (5, 32, 48), (7, 64, 15)];
        let more = [(11, 96, 33), (12, 64, 16), (13, 32, 20), (16, 160, 40), (25, 64, 18), (40, 96, 50), (257, 64, 17)];
        // Decode over 19 panels: a thread claims several at once.
        let more = more.into_iter().chain([(1, 64, 300)]);
        for (m, k, n) in shapes.into_iter().chain(more) {
            let x = random(&mut rng, m * k);
            let blocks = quantize_matrix_q8_0(&random(&mut rng, n * k), n, k).expect("k is a multiple of 32");
            let packed = PanelQ8_0::pack(&blocks, n, k / QK).expect("consistent shape");
            assert_eq!(packed.unpack(), blocks, "unpack(pack(w)) for [{n}, {k}]");
            let mut want = vec![0f32; m * n];
            matmul_q8_0_scalar(&x, m, k, &blocks, n, &mut want).expect("consistent shapes");
            for backend in Backend::available() {
                let mut got = vec![f32::NAN; m * n];
                matmul_with(backend, &x, m, &packed, &mut got).expect("consistent shapes");
                for (j, (g, r)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - r).abs() <= 1e-4 * (1.0 + r.abs()),
                        "{backend:?} m={m} k={k} n={n} at {j}: {g} vs {r}"
                    );
                }
            }
        }
    }

    /// Decode keeps its quantized activations across calls and, with the
    /// threads far apart, prefetches and flushes them: the same bits either
    /// way, call after call, as k grows and shrinks between calls.
    #[test]
    fn decode_gives_the_same_bits_wherever_the_threads_sit() {
        let mut rng = StdRng::seed_from_u64(12);
        for (k, n) in [(2048, 100), (64, 17), (5632, 40), (32, 300), (2048, 16)] {
            let x = random(&mut rng, k);
            let blocks = quantize_matrix_q8_0(&random(&mut rng, n * k), n, k).expect("k is a multiple of 32");
            let packed = PanelQ8_0::pack(&blocks, n, k / QK).expect("consistent shape");
            let mut want = vec![0f32; n];
            matmul_q8_0_scalar(&x, 1, k, &blocks, n, &mut want).expect("consistent shapes");
            for backend in Backend::available() {
                let mut near = vec![f32::NAN; n];
                matmul_placed(backend, false, &x, 1, &packed, &mut near).expect("consistent shapes");
                for (j, (g, r)) in near.iter().zip(&want).enumerate() {
                    assert!((g - r).abs() <= 1e-4 * (1.0 + r.abs()), "{backend:?} k={k} n={n} at {j}: {g} vs {r}");
                }
                for _ in 0..2 {
                    let mut far = vec![f32::NAN; n];
                    matmul_placed(backend, true, &x, 1, &packed, &mut far).expect("consistent shapes");
                    assert_eq!(
                        far.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        near.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{backend:?} k={k} n={n}"
                    );
                }
            }
        }
    }

    #[test]
    fn extreme_codes_are_exact() {
        // Codes of +-127 on both sides, and -128 in the weights (a file
        // may hold it; packing makes it -127): the 128 offset and its
        // correction must cancel exactly (a sum of 32 * 255 * 127 fits
        // i32 easily), and AVX2's pairs must not saturate.
        let n = 3;
        let code = |i: usize, j: usize| match (i + j) % 5 {
            0 => -128,
            1 | 3 => -127,
            _ => 127,
        };
        let blocks: Vec<BlockQ8_0> =
            (0..n * 2).map(|i| BlockQ8_0 { d: f16::ONE, qs: std::array::from_fn(|j| code(i, j)) }).collect();
        let packed = PanelQ8_0::pack(&blocks, n, 2).expect("consistent");
        let clamped: Vec<BlockQ8_0> =
            blocks.iter().map(|b| BlockQ8_0 { d: b.d, qs: b.qs.map(|q| q.max(-127)) }).collect();
        assert_eq!(packed.unpack(), clamped);
        for m in [1, 2, 3] {
            let x: Vec<f32> = (0..64 * m).map(|j| if (j + j / 64) % 2 == 0 { 1.0 } else { -1.0 }).collect();
            let mut want = vec![0f32; m * n];
            matmul_q8_0_scalar(&x, m, 64, &clamped, n, &mut want).expect("shapes");
            for backend in Backend::available() {
                let mut got = vec![0f32; m * n];
                matmul_with(backend, &x, m, &packed, &mut got).expect("shapes");
                assert_eq!(got, want, "{backend:?} m={m}");
            }
        }
    }

    #[test]
    fn shapes_are_checked() {
        let blocks = vec![BlockQ8_0 { d: f16::ONE, qs: [1; QK] }; 4];
        assert!(matches!(PanelQ8_0::pack(&blocks, 3, 2), Err(QuantError::Shape(_))));
        let packed = PanelQ8_0::pack(&blocks, 2, 2).expect("consistent");
        assert_eq!(packed.size_in_bytes(), 2 * (512 + 32), "one padded panel, 2 blocks");
        let mut y = [0f32; 2];
        assert!(matmul_panel_q8_0(&[0.0; 63], 1, &packed, &mut y).is_err());
        assert!(matmul_panel_q8_0(&[0.0; 64], 1, &packed, &mut y[..1]).is_err());
        assert!(matmul_panel_q8_0(&[0.0; 64], 1, &packed, &mut y).is_ok());
    }
}
