//! Q4_K and Q6_K weights repacked at load for the integer dot products:
//! output rows in panels of 16, as [`crate::cpu::q8_panel::PanelQ8_0`] does for
//! Q8_0, so one broadcast of 4 activation codes feeds 16 rows at once and
//! no horizontal sum is left anywhere.
//!
//! Layout ([`KPanels`]): per panel and super-block one [`KPanel`] block:
//! * codes as 64-byte vectors whose 32-bit lane r holds row r's 4 bytes at
//!   one place of GGML's block (the bytes are copied, never re-encoded):
//!   Q4_K's `qs` quads, whose low nibbles are sub-block 2c and high
//!   nibbles 2c + 1, so one AND (or a shift and an AND) gives the unsigned
//!   bytes `vpdpbusd` takes; Q6_K's `ql` quads and its `qh` quads, from
//!   which a shift, two ANDs and an OR give the 6-bit codes;
//! * the scales transposed to `[group][row]` bytes, widened to 16 i32 lanes
//!   by one `vpmovzxbd`; Q4_K's mins as `[pair][row][2]` bytes, widened to
//!   i16 pairs for one `vpdpwssd` per two sub-blocks against the
//!   activations' sums (the mins folded through the block sums);
//! * the rows' f16 factors side by side, one conversion per 16 rows.
//!
//! The same bytes per weight as GGML's blocks (Q4_K 148 per 256 against
//! 144: its 12 packed scale bytes become 16 plain ones; Q6_K 212 against
//! 210, the alignment). Rows past `n` in the last panel are zero.
//!
//! The portable path here is the reference for the SIMD ones
//! (`panel_x86`); [`super::matmul_kquant`] on GGML's blocks is the
//! reference for both.

use half::f16;

use super::{BlockQ4K, BlockQ6K, BlockQ8K, GROUP, GROUPS, KBlock, QK_K, quantize_activations};
#[cfg(target_arch = "x86_64")]
use crate::cpu::isa::{self, Simd};
use crate::cpu::quant::QuantError;
use crate::cpu::{OutPtr, WeightBuf, for_each_owned, for_each_span};

/// Output rows per panel: the 16 i32 lanes of a 512-bit vector.
pub const PANEL: usize = 16;

/// One 64-byte vector: lane r holds row r's 4 bytes.
pub type Lanes = [[u8; 4]; PANEL];

/// 16 rows' Q4_K block at one block index (2368 bytes).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Q4KPanel {
    /// Vector 8c + t: each row's `qs[32c + 4t..32c + 4t + 4]`.
    pub qs: [Lanes; 32],
    /// `[sub-block][row]` 6-bit scales.
    pub scales: [[u8; PANEL]; 8],
    /// `[sub-block pair][row][2]` 6-bit mins.
    pub mins: [[[u8; 2]; PANEL]; 4],
    pub d: [f16; PANEL],
    pub dmin: [f16; PANEL],
}

/// 16 rows' Q6_K block at one block index (3392 bytes).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Q6KPanel {
    /// Vector 16h + t: each row's `ql[64h + 4t..64h + 4t + 4]`.
    pub ql: [Lanes; 32],
    /// Vector 8h + t: each row's `qh[32h + 4t..32h + 4t + 4]`.
    pub qh: [Lanes; 16],
    /// `[group of 16][row]` i8 scales.
    pub scales: [[i8; PANEL]; GROUPS],
    pub d: [f16; PANEL],
}

/// A k-quant format with a panel layout: moving one row's block in and out.
pub trait KPanel: KBlock {
    type Panel: Copy + Send + Sync + std::fmt::Debug + PartialEq + 'static;
    const PANEL_ZERO: Self::Panel;
    fn put(panel: &mut Self::Panel, r: usize, blk: &Self);
    fn get(panel: &Self::Panel, r: usize) -> Self;
    /// The panels as Q4_K's, for the kernels that know the layouts.
    fn as_q4k(panels: &[Self::Panel]) -> Option<&[Q4KPanel]>;
    /// The panels as Q6_K's.
    fn as_q6k(panels: &[Self::Panel]) -> Option<&[Q6KPanel]>;
    /// [`matmul_kpanels_with`] for this format: a method, so the kernels
    /// are compiled here with this crate's optimisation level, not in the
    /// caller's (dev builds compile the worker at a lower one).
    fn matmul_panels(
        backend: PanelBackend,
        x: &[f32],
        m: usize,
        w: &KPanels<Self>,
        y: &mut [f32],
    ) -> Result<(), QuantError>;
}

fn put_quads(dst: &mut [Lanes], r: usize, src: &[u8]) {
    for (v, quad) in dst.iter_mut().zip(src.chunks_exact(4)) {
        v[r].copy_from_slice(quad);
    }
}

fn get_quads(src: &[Lanes], r: usize, dst: &mut [u8]) {
    for (v, quad) in src.iter().zip(dst.chunks_exact_mut(4)) {
        quad.copy_from_slice(&v[r]);
    }
}

impl KPanel for BlockQ4K {
    type Panel = Q4KPanel;
    const PANEL_ZERO: Q4KPanel = Q4KPanel {
        qs: [[[0; 4]; PANEL]; 32],
        scales: [[0; PANEL]; 8],
        mins: [[[0; 2]; PANEL]; 4],
        d: [f16::ZERO; PANEL],
        dmin: [f16::ZERO; PANEL],
    };

    fn put(p: &mut Q4KPanel, r: usize, blk: &Self) {
        put_quads(&mut p.qs, r, &blk.qs);
        for j in 0..8 {
            let (s, m) = blk.scale_min(j);
            p.scales[j][r] = s;
            p.mins[j / 2][r][j % 2] = m;
        }
        (p.d[r], p.dmin[r]) = (blk.d, blk.dmin);
    }

    fn as_q4k(panels: &[Q4KPanel]) -> Option<&[Q4KPanel]> {
        Some(panels)
    }

    fn as_q6k(_: &[Q4KPanel]) -> Option<&[Q6KPanel]> {
        None
    }

    #[inline(never)]
    fn matmul_panels(
        backend: PanelBackend,
        x: &[f32],
        m: usize,
        w: &KPanels<Self>,
        y: &mut [f32],
    ) -> Result<(), QuantError> {
        matmul_any(backend, x, m, w, y)
    }

    /// Back to GGML's block (its 12 scale bytes packed again).
    fn get(p: &Q4KPanel, r: usize) -> Self {
        let mut blk = Self { d: p.d[r], dmin: p.dmin[r], ..Self::ZERO };
        get_quads(&p.qs, r, &mut blk.qs);
        let (sc, mn) = (|j: usize| p.scales[j][r], |j: usize| p.mins[j / 2][r][j % 2]);
        for j in 0..4 {
            blk.scales[j] = (sc(j) & 63) | ((sc(j + 4) >> 4) << 6);
            blk.scales[j + 4] = (mn(j) & 63) | ((mn(j + 4) >> 4) << 6);
            blk.scales[j + 8] = (sc(j + 4) & 0x0F) | ((mn(j + 4) & 0x0F) << 4);
        }
        blk
    }
}

impl KPanel for BlockQ6K {
    type Panel = Q6KPanel;
    const PANEL_ZERO: Q6KPanel = Q6KPanel {
        ql: [[[0; 4]; PANEL]; 32],
        qh: [[[0; 4]; PANEL]; 16],
        scales: [[0; PANEL]; GROUPS],
        d: [f16::ZERO; PANEL],
    };

    fn put(p: &mut Q6KPanel, r: usize, blk: &Self) {
        put_quads(&mut p.ql, r, &blk.ql);
        put_quads(&mut p.qh, r, &blk.qh);
        for (g, &s) in blk.scales.iter().enumerate() {
            p.scales[g][r] = s;
        }
        p.d[r] = blk.d;
    }

    fn as_q4k(_: &[Q6KPanel]) -> Option<&[Q4KPanel]> {
        None
    }

    fn as_q6k(panels: &[Q6KPanel]) -> Option<&[Q6KPanel]> {
        Some(panels)
    }

    #[inline(never)]
    fn matmul_panels(
        backend: PanelBackend,
        x: &[f32],
        m: usize,
        w: &KPanels<Self>,
        y: &mut [f32],
    ) -> Result<(), QuantError> {
        matmul_any(backend, x, m, w, y)
    }

    fn get(p: &Q6KPanel, r: usize) -> Self {
        let mut blk = Self { d: p.d[r], ..Self::ZERO };
        get_quads(&p.ql, r, &mut blk.ql);
        get_quads(&p.qh, r, &mut blk.qh);
        for (g, s) in blk.scales.iter_mut().enumerate() {
            *s = p.scales[g][r];
        }
        blk
    }
}

/// k-quant weights `[n, kb super-blocks]` in panels of 16 rows.
#[derive(Clone, Debug, PartialEq)]
pub struct KPanels<B: KPanel> {
    n: usize,
    kb: usize,
    /// `[n / 16 rounded up, kb]`.
    panels: WeightBuf<B::Panel>,
}

impl<B: KPanel> KPanels<B> {
    /// Regroups `n` rows of `kb` blocks (row-major, GGML's order).
    pub fn pack(blocks: &[B], n: usize, kb: usize) -> Result<Self, QuantError> {
        if blocks.len() != n * kb {
            return Err(QuantError::Shape(format!("{} blocks for {n} rows of {kb}", blocks.len())));
        }
        let mut panels = WeightBuf::filled(B::PANEL_ZERO, n.div_ceil(PANEL) * kb);
        for (row, blocks) in blocks.chunks_exact(kb.max(1)).enumerate().take(n) {
            let (p, r) = (row / PANEL, row % PANEL);
            for (b, blk) in blocks.iter().enumerate() {
                B::put(&mut panels[p * kb + b], r, blk);
            }
        }
        Ok(Self { n, kb, panels })
    }

    /// Back to GGML's row-major blocks.
    pub fn unpack(&self) -> Vec<B> {
        let kb = self.kb;
        (0..self.n)
            .flat_map(|row| (0..kb).map(move |b| B::get(&self.panels[row / PANEL * kb + b], row % PANEL)))
            .collect()
    }

    /// `(rows, super-blocks per row)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.kb)
    }

    /// The whole allocation (2 MiB pages on Linux for large weights): the
    /// range to back with huge pages.
    pub fn allocation(&self) -> &[B::Panel] {
        self.panels.allocation()
    }

    /// Bytes of weight read per pass (padding rows included).
    pub fn size_in_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.panels)
    }

    pub(super) fn panel(&self, p: usize) -> &[B::Panel] {
        &self.panels[p * self.kb..(p + 1) * self.kb]
    }
}

/// An activation block with the sums the panel kernels fold the offsets
/// through: Q4_K's mins take the sums of each 32 as i16 pairs, Q6_K's `-32`
/// starts each group's i32 sum at `-32 * sum`. Only the x86 kernels read
/// the sums; the scalar loop (all that aarch64 has yet) reads `q8`.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct XBlock {
    pub q8: BlockQ8K,
    /// Sums of sub-blocks 2p and 2p + 1, as the i16 pair `lo | hi << 16`.
    pub pairs32: [i32; 4],
    /// `-32 *` the sum of each group of 16.
    pub neg32: [i32; GROUPS],
}

impl XBlock {
    fn new(q8: BlockQ8K) -> Self {
        let b = q8.bsums.map(i32::from);
        let s32 = |j: usize| (b[2 * j] + b[2 * j + 1]) as i16 as u16 as i32;
        Self { q8, pairs32: std::array::from_fn(|p| s32(2 * p) | (s32(2 * p + 1) << 16)), neg32: b.map(|s| -32 * s) }
    }
}

/// The code path of a panel matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PanelBackend {
    Scalar,
    /// 8-row halves of a panel on 256-bit vectors (`vpmaddubsw` + `vpmaddwd`).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Whole panels on 512-bit vectors (`vpdpbusd`, `vpdpwssd`).
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
}

/// The best path this CPU has (`TINYVLLM_CPU_ISA` caps it as for Q8_0).
pub fn best_panel_backend() -> PanelBackend {
    #[cfg(target_arch = "x86_64")]
    {
        if isa::vnni() {
            return PanelBackend::Avx512Vnni;
        }
        if isa::simd() == Simd::Avx2 {
            return PanelBackend::Avx2;
        }
    }
    PanelBackend::Scalar
}

/// Every path this CPU can run, for tests that compare them.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
pub fn panel_backends() -> Vec<PanelBackend> {
    let mut all = vec![PanelBackend::Scalar];
    #[cfg(target_arch = "x86_64")]
    {
        if isa::simd() == Simd::Avx2 {
            all.push(PanelBackend::Avx2);
        }
        if isa::vnni() {
            all.push(PanelBackend::Avx512Vnni);
        }
    }
    all
}

/// x rows per pass over the panels: their activation blocks (~1.4 MB at
/// k = 5632) stay in L2 while the weights stream by.
const CHUNK_ROWS: usize = 128;

/// One chunk's operands.
pub(super) struct Operands<'a, B: KPanel> {
    pub(super) x: &'a [XBlock],
    pub(super) w: &'a KPanels<B>,
    pub(super) m: usize,
    y: OutPtr,
}

impl<B: KPanel> Operands<'_, B> {
    /// Writes x row `i`'s 16 sums of panel p to y, dropping padding rows.
    pub(super) fn store(&self, p: usize, i: usize, sums: &[f32; PANEL]) {
        // SAFETY: i < m and p < the panel count, so the row and columns
        // are in y; the task that owns panel p alone writes its columns.
        unsafe { self.y.store_rows(self.w.n, i, p * PANEL, std::slice::from_ref(sums), None) };
    }
}

/// `y[m, n] = x[m, k] @ W^T` on the best path (every element overwritten).
pub fn matmul_kpanels<B: KPanel>(x: &[f32], m: usize, w: &KPanels<B>, y: &mut [f32]) -> Result<(), QuantError> {
    matmul_kpanels_with(best_panel_backend(), x, m, w, y)
}

/// [`matmul_kpanels`] on a chosen path (tests and benchmarks).
pub fn matmul_kpanels_with<B: KPanel>(
    backend: PanelBackend,
    x: &[f32],
    m: usize,
    w: &KPanels<B>,
    y: &mut [f32],
) -> Result<(), QuantError> {
    B::matmul_panels(backend, x, m, w, y)
}

fn matmul_any<B: KPanel>(
    backend: PanelBackend,
    x: &[f32],
    m: usize,
    w: &KPanels<B>,
    y: &mut [f32],
) -> Result<(), QuantError> {
    let (n, kb) = w.dims();
    let k = kb * QK_K;
    if x.len() != m * k || y.len() != m * n {
        return Err(QuantError::Shape(format!("x {} (m {m} k {k}), y {} (n {n})", x.len(), y.len())));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        y.fill(0.0);
        return Ok(());
    }
    for (xc, yc) in x.chunks(CHUNK_ROWS * k).zip(y.chunks_mut(CHUNK_ROWS * n)) {
        let rows = xc.len() / k;
        let xq: Vec<XBlock> = quantize_activations(xc).into_iter().map(XBlock::new).collect();
        let ops = Operands { x: &xq, w, m: rows, y: OutPtr(yc.as_mut_ptr()) };
        let run = |p0: usize, p1: usize| match backend {
            // SAFETY: the path was offered because the CPU has its
            // features; shapes checked above; this task owns panels p0..p1.
            #[cfg(target_arch = "x86_64")]
            PanelBackend::Avx512Vnni => unsafe { super::panel_x86::panels_avx512(&ops, p0, p1) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            PanelBackend::Avx2 => unsafe { super::panel_x86::panels_avx2(&ops, p0, p1) },
            PanelBackend::Scalar => scalar_panels(&ops, p0, p1),
        };
        if rows == 1 {
            let count = n.div_ceil(PANEL);
            for_each_owned(count, w.size_in_bytes() / count, |ps| run(ps.start, ps.end));
        } else {
            for_each_span(n.div_ceil(PANEL), (1, 4), run);
        }
    }
    Ok(())
}

/// Portable path: each row's block decoded to the common form and dotted
/// exactly in i32, scaled per block.
fn scalar_panels<B: KPanel>(ops: &Operands<'_, B>, p0: usize, p1: usize) {
    let kb = ops.w.kb;
    for p in p0..p1 {
        let blocks = ops.w.panel(p);
        for i in 0..ops.m {
            let mut acc = [0f32; PANEL];
            for (b, panel) in blocks.iter().enumerate() {
                let x = &ops.x[i * kb + b].q8;
                for (r, a) in acc.iter_mut().enumerate() {
                    let u = B::get(panel, r).unpack();
                    let (mut isum, mut msum) = (0i32, 0i32);
                    for g in 0..GROUPS {
                        let span = g * GROUP..(g + 1) * GROUP;
                        let s: i32 =
                            u.q[span.clone()].iter().zip(&x.qs[span]).map(|(&q, &v)| q as i32 * v as i32).sum();
                        isum += u.sc[g] as i32 * s;
                        msum += u.mn[g] as i32 * x.bsums[g] as i32;
                    }
                    *a += x.d * (u.d * isum as f32 - u.dm * msum as f32);
                }
            }
            ops.store(p, i, &acc);
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Random bytes: every scale, min and code GGML can store, Q6_K's
    /// scale -128 and 6-bit code 63 included.
    fn random_q4k(rng: &mut StdRng) -> BlockQ4K {
        BlockQ4K {
            d: f16::from_f32(rng.random_range(0.0..0.01)),
            dmin: f16::from_f32(rng.random_range(0.0..0.01)),
            scales: std::array::from_fn(|_| rng.random()),
            qs: std::array::from_fn(|_| rng.random()),
        }
    }

    fn random_q6k(rng: &mut StdRng) -> BlockQ6K {
        BlockQ6K {
            ql: std::array::from_fn(|_| rng.random()),
            qh: std::array::from_fn(|_| rng.random()),
            scales: std::array::from_fn(|_| rng.random()),
            d: f16::from_f32(rng.random_range(-0.001..0.001)),
        }
    }

    /// Every panel path on scattered shapes (n not a multiple of 16, m
    /// across the tile heights and the 128-row chunks) against the f32
    /// product of the dequantized weights and Q8_K activations, within the
    /// float-order error of the sum of |products|; and the row-major
    /// kernel's result, to the same bound.
    fn panels_match_reference<B: KPanel + PartialEq>(make: fn(&mut StdRng) -> B) {
        let mut rng = StdRng::seed_from_u64(7);
        let shapes = [(1, 1, 1), (1, 37, 3), (1, 16, 2), (2, 17, 2), (3, 48, 1), (4, 33, 2), (5, 100, 1)];
        // The last: decode across enough panels that a thread claims several at once.
        let more = [(7, 15, 4), (9, 20, 2), (13, 40, 1), (130, 18, 1), (1, 70, 8), (1, 300, 1)];
        for (m, n, kb) in shapes.into_iter().chain(more) {
            let k = kb * QK_K;
            let w: Vec<B> = (0..n * kb).map(|_| make(&mut rng)).collect();
            let packed = KPanels::pack(&w, n, kb).expect("consistent shape");
            assert_eq!(packed.unpack(), w, "unpack(pack(w)) for [{n}, {kb}] {}", B::NAME);
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let exact = super::super::tests::reference_products(&x, m, k, &w, n);
            let mut row_major = vec![0f32; m * n];
            super::super::matmul_kquant(&x, m, k, &w, n, &mut row_major).expect("shapes");
            for backend in panel_backends() {
                let mut y = vec![f32::NAN; m * n];
                matmul_kpanels_with(backend, &x, m, &packed, &mut y).expect("shapes");
                for (o, ((a, (b, mag)), c)) in y.iter().zip(&exact).zip(&row_major).enumerate() {
                    let tol = 1e-4 * mag + 1e-6;
                    let at = format!("{} {backend:?} m {m} n {n} k {k} at {o}", B::NAME);
                    assert!((a - b).abs() <= tol, "{at}: {a} vs exact {b}");
                    assert!((a - c).abs() <= tol, "{at}: {a} vs row-major {c}");
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512vnni") && std::env::var_os("TINYVLLM_CPU_ISA").is_none() {
            assert_eq!(panel_backends().len(), 3, "VNNI is not tested");
        }
    }

    #[test]
    fn q4_k_panels_match_reference() {
        panels_match_reference(random_q4k);
    }

    #[test]
    fn q6_k_panels_match_reference() {
        panels_match_reference(random_q6k);
    }

    #[test]
    fn panel_sizes_and_shapes() {
        assert_eq!(std::mem::size_of::<Q4KPanel>(), 16 * 148);
        assert_eq!(std::mem::size_of::<Q6KPanel>(), 3392);
        let w = vec![BlockQ4K::ZERO; 4];
        assert!(matches!(KPanels::pack(&w, 3, 2), Err(QuantError::Shape(_))));
        let packed = KPanels::pack(&w, 2, 2).expect("consistent");
        assert_eq!(packed.size_in_bytes(), 2 * std::mem::size_of::<Q4KPanel>(), "one padded panel, 2 blocks");
        let mut y = [0f32; 2];
        assert!(matmul_kpanels(&[0.0; 511], 1, &packed, &mut y).is_err());
        assert!(matmul_kpanels(&[0.0; 512], 1, &packed, &mut y[..1]).is_err());
        assert!(matmul_kpanels(&[0.0; 512], 1, &packed, &mut y).is_ok());
    }
}
