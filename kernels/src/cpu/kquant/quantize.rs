//! The k-quant quantizers, following llama.cpp's reference ones (no
//! importance matrix): each group's scale (and Q4_K's min) is fitted by
//! weighted least squares over a small search of candidate code grids
//! (`make_qkx2_quants` for Q4_K, `make_qx_quants` for Q6_K), then the
//! scales themselves are quantized (6-bit for Q4_K, i8 for Q6_K) and the
//! codes recomputed against the scales actually stored.

use half::f16;

use super::{BlockQ4K, BlockQ6K, GROUP, GROUPS, QK_K};

/// Nearest integer, halves away from zero, without a libm call.
fn nearest(v: f32) -> i32 {
    (v + 0.5f32.copysign(v)) as i32
}

/// Fits `x ~ scale * l - min` with `l` in 0..=nmax, `min >= 0`, minimising
/// the `w`-weighted squared error: the plain min/max grid first, then
/// `nstep + 1` grids with the range stretched from `rmin` by `rdelta`
/// each, refitting scale and min by least squares on every grid.
/// Returns `(scale, min)`; `l` holds the codes of the best fit.
fn fit_affine(x: &[f32], w: &[f32], nmax: i32, l: &mut [u8]) -> (f32, f32) {
    let (rmin, rdelta, nstep) = (-1.0f32, 0.1f32, 20);
    let mut lo = x.iter().copied().fold(f32::INFINITY, f32::min).min(0.0);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if hi.is_nan() || hi <= lo {
        l.fill(0);
        return (0.0, -lo);
    }
    let (sum_w, sum_x) = x.iter().zip(w).fold((0f32, 0f32), |(a, b), (&x, &w)| (a + w, b + w * x));
    let codes = |iscale: f32, lo: f32, out: &mut [u8]| {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = nearest(iscale * (v - lo)).clamp(0, nmax) as u8;
        }
    };
    let error = |scale: f32, lo: f32, codes: &[u8]| -> f32 {
        x.iter().zip(w).zip(codes).map(|((&v, &w), &q)| w * (scale * q as f32 + lo - v).powi(2)).sum()
    };
    let mut scale = (hi - lo) / nmax as f32;
    codes(1.0 / scale, lo, l);
    let mut best = error(scale, lo, l);
    let mut trial = vec![0u8; x.len()];
    for step in 0..=nstep {
        let iscale = (rmin + rdelta * step as f32 + nmax as f32) / (hi - lo);
        codes(iscale, lo, &mut trial);
        let (mut sl, mut sl2, mut sxl) = (0f32, 0f32, 0f32);
        for ((&v, &w), &q) in x.iter().zip(w).zip(&trial) {
            let q = q as f32;
            (sl, sl2, sxl) = (sl + w * q, sl2 + w * q * q, sxl + w * q * v);
        }
        let det = sum_w * sl2 - sl * sl;
        if det <= 0.0 {
            continue;
        }
        let (mut s, mut m) = ((sum_w * sxl - sum_x * sl) / det, (sl2 * sum_x - sl * sxl) / det);
        if m > 0.0 {
            // The fitted offset must be a subtraction of a non-negative min.
            (s, m) = (sxl / sl2, 0.0);
        }
        let e = error(s, m, &trial);
        if e < best {
            (best, scale, lo) = (e, s, m);
            l.copy_from_slice(&trial);
        }
    }
    (scale, -lo)
}

/// Fits `x ~ scale * l` with `l` in -nmax..nmax-1, weights `x^2`: the grid
/// through the largest magnitude, then 18 neighbours, each refitted by
/// least squares; keeps the one explaining the most (`sxl^2 / sl2`).
fn fit_symmetric(x: &[f32], nmax: i32) -> f32 {
    let max = x.iter().copied().fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    if max.abs() < 1e-30 {
        return 0.0;
    }
    let (mut best_scale, mut best) = (0f32, 0f32);
    for step in -9..=9 {
        let iscale = -(nmax as f32 + 0.1 * step as f32) / max;
        let (mut sl2, mut sxl) = (0f32, 0f32);
        for &v in x {
            let q = nearest(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            (sl2, sxl) = (sl2 + w * q * q, sxl + w * q * v);
        }
        if sl2 > 0.0 && sxl * sxl / sl2 > best {
            (best, best_scale) = (sxl * sxl / sl2, sxl / sl2);
        }
    }
    best_scale
}

pub(super) fn q4_k(src: &[f32; QK_K]) -> BlockQ4K {
    let av = (src.iter().map(|v| v * v).sum::<f32>() / QK_K as f32).sqrt();
    let mut codes = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    for j in 0..8 {
        let x = &src[32 * j..32 * (j + 1)];
        let w: Vec<f32> = x.iter().map(|v| av + v.abs()).collect();
        (scales[j], mins[j]) = fit_affine(x, &w, 15, &mut codes[32 * j..32 * (j + 1)]);
    }
    let max_scale = scales.iter().copied().fold(0f32, f32::max);
    let max_min = mins.iter().copied().fold(0f32, f32::max);
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut blk = BlockQ4K {
        d: f16::from_f32(max_scale / 63.0),
        dmin: f16::from_f32(max_min / 63.0),
        scales: [0; 12],
        qs: [0; QK_K / 2],
    };
    for j in 0..8 {
        let ls = nearest(inv_scale * scales[j]).clamp(0, 63) as u8;
        let lm = nearest(inv_min * mins[j]).clamp(0, 63) as u8;
        let s = &mut blk.scales;
        if j < 4 {
            s[j] = ls;
            s[j + 4] = lm;
        } else {
            s[j + 4] = (ls & 0x0F) | ((lm & 0x0F) << 4);
            s[j - 4] |= (ls >> 4) << 6;
            s[j] |= (lm >> 4) << 6;
        }
    }
    // Recompute the codes against the stored (rounded) scales and mins.
    for j in 0..8 {
        let (sc, m) = blk.scale_min(j);
        let dl = blk.d.to_f32() * sc as f32;
        let dm = blk.dmin.to_f32() * m as f32;
        for l in 32 * j..32 * (j + 1) {
            codes[l] = if dl != 0.0 { nearest((src[l] + dm) / dl).clamp(0, 15) as u8 } else { 0 };
        }
    }
    for c in 0..4 {
        for l in 0..32 {
            blk.qs[32 * c + l] = codes[64 * c + l] | (codes[64 * c + 32 + l] << 4);
        }
    }
    blk
}

pub(super) fn q6_k(src: &[f32; QK_K]) -> BlockQ6K {
    let scales: [f32; GROUPS] = std::array::from_fn(|g| fit_symmetric(&src[g * GROUP..(g + 1) * GROUP], 32));
    let max = scales.iter().copied().fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    let mut blk = BlockQ6K { ql: [0; QK_K / 2], qh: [0; QK_K / 4], scales: [0; GROUPS], d: f16::ZERO };
    let mut codes = [32u8; QK_K];
    if max.abs() >= 1e-30 {
        let iscale = -128.0 / max;
        blk.d = f16::from_f32(1.0 / iscale);
        for (g, &s) in scales.iter().enumerate() {
            blk.scales[g] = nearest(iscale * s).clamp(-128, 127) as i8;
            let dl = blk.d.to_f32() * blk.scales[g] as f32;
            for l in g * GROUP..(g + 1) * GROUP {
                codes[l] = if dl != 0.0 { (nearest(src[l] / dl).clamp(-32, 31) + 32) as u8 } else { 32 };
            }
        }
    }
    for h in 0..2 {
        for l in 0..32 {
            let q = [0, 32, 64, 96].map(|o| codes[128 * h + o + l]);
            blk.ql[64 * h + l] = (q[0] & 0x0F) | ((q[2] & 0x0F) << 4);
            blk.ql[64 * h + 32 + l] = (q[1] & 0x0F) | ((q[3] & 0x0F) << 4);
            blk.qh[32 * h + l] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
        }
    }
    blk
}
