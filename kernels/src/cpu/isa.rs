//! The CPU's instruction sets, detected once per process, and the kernels
//! each family runs on them. Every kernel and the worker ask here, so one
//! machine always makes one choice.
//!
//! `TINYVLLM_CPU_ISA=avx2` (or `scalar`) caps the packed kernels, and with
//! them the VNNI Q8_0 kernel, so that one machine can compare them; the
//! row-major matmuls and the elementwise passes keep their SIMD path.

use std::sync::OnceLock;

/// The CPU features the kernels use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuFeatures {
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vnni: bool,
    pub neon: bool,
    /// An AMD CPU ("AuthenticAMD"): decides [`StreamPrefetch`].
    pub amd: bool,
    /// `clflushopt` and `prefetchw`: hand a buffer that two core complexes
    /// share back to memory, and ask for it writable
    /// ([`super::placement`]).
    pub clflushopt: bool,
    pub prefetchw: bool,
}

impl CpuFeatures {
    fn detect() -> Self {
        #[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(unused_mut))]
        let mut f = Self::default();
        #[cfg(target_arch = "x86_64")]
        {
            f.avx2 = is_x86_feature_detected!("avx2");
            f.fma = is_x86_feature_detected!("fma");
            f.f16c = is_x86_feature_detected!("f16c");
            f.avx512f = is_x86_feature_detected!("avx512f");
            f.avx512bw = is_x86_feature_detected!("avx512bw");
            f.avx512vnni = is_x86_feature_detected!("avx512vnni");
            // SAFETY: CPUID leaf 0 exists on every x86-64 CPU.
            #[allow(unused_unsafe)]
            let id = unsafe { std::arch::x86_64::__cpuid(0) };
            f.amd = [id.ebx, id.edx, id.ecx] == [0x6874_7541, 0x6974_6e65, 0x444d_4163];
            // SAFETY: leaf 7 exists where leaf 0 says so; leaf 0x8000_0001
            // where leaf 0x8000_0000 says so (both checked first).
            #[allow(unused_unsafe)]
            unsafe {
                use std::arch::x86_64::__cpuid_count;
                f.clflushopt = id.eax >= 7 && __cpuid_count(7, 0).ebx & (1 << 23) != 0;
                let ext = __cpuid_count(0x8000_0000, 0).eax;
                f.prefetchw = ext >= 0x8000_0001 && __cpuid_count(0x8000_0001, 0).ecx & (1 << 8) != 0;
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            f.neon = std::arch::is_aarch64_feature_detected!("neon");
        }
        f
    }

    /// AVX2 and FMA: the attention and elementwise loops.
    pub fn avx2_fma(&self) -> bool {
        self.avx2 && self.fma
    }

    /// AVX2, FMA and F16C: the matmuls (F16C widens f16 weights).
    pub fn avx2_fma_f16c(&self) -> bool {
        self.avx2_fma() && self.f16c
    }
}

/// The SIMD family of the row-major kernels (dense and quantized matmuls).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Simd {
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "aarch64")]
    Neon,
    Scalar,
}

/// The instruction set the packed kernels run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F: a panel is one vector; tiles take 4 panels (or a pair).
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// AVX2 + FMA + F16C: a panel is two vectors.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// The portable loop.
    Scalar,
}

impl Isa {
    /// Whether this is AVX-512 (false on every other architecture).
    pub fn is_avx512(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        return self == Isa::Avx512;
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = self;
            false
        }
    }
}

/// Where the decode GEMVs (one x row: every weight streamed from DRAM
/// once) prefetch their weights, 4 KiB ahead of their loads.
///
/// Measured side by side (`decode_step` bench, docs/kernel-notes.md): on
/// the 2-vCPU Xeon, L2 beat L1; on a 2-vCPU AMD EPYC with AVX-512, L2
/// capped f16 and Q8_0 at ~34 GB/s while the probe read 60-67 GB/s, and
/// non-temporal prefetches read 55-57 GB/s there (and 98-102% of the
/// probe in its slow phases, against 83-91% for L2).
/// `TINYVLLM_DECODE_PREFETCH=l2|nta` overrides the choice by vendor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamPrefetch {
    /// `prefetcht1`: Intel's choice.
    L2,
    /// `prefetchnta`: AMD's choice.
    NonTemporal,
}

#[cfg(target_arch = "x86_64")]
impl StreamPrefetch {
    /// The `_mm_prefetch` hint.
    pub(crate) const fn hint(self) -> i32 {
        use std::arch::x86_64::{_MM_HINT_NTA, _MM_HINT_T1};
        match self {
            Self::L2 => _MM_HINT_T1,
            Self::NonTemporal => _MM_HINT_NTA,
        }
    }
}

/// Everything decided at the first question.
struct Choice {
    features: CpuFeatures,
    simd: Simd,
    /// Best first, the portable loop last.
    packed_isas: Vec<Isa>,
    /// The best of `packed_isas` under `TINYVLLM_CPU_ISA`.
    packed: Isa,
    vnni: bool,
    stream_prefetch: StreamPrefetch,
}

fn choice() -> &'static Choice {
    static CHOICE: OnceLock<Choice> = OnceLock::new();
    CHOICE.get_or_init(|| {
        let cap = std::env::var("TINYVLLM_CPU_ISA").unwrap_or_default();
        let mut choice = Choice::new(CpuFeatures::detect(), &cap);
        match std::env::var("TINYVLLM_DECODE_PREFETCH").unwrap_or_default().to_ascii_lowercase().as_str() {
            "l2" => choice.stream_prefetch = StreamPrefetch::L2,
            "nta" => choice.stream_prefetch = StreamPrefetch::NonTemporal,
            _ => {}
        }
        choice
    })
}

impl Choice {
    fn new(features: CpuFeatures, cap: &str) -> Self {
        let f = features;
        #[allow(clippy::needless_late_init)]
        let simd;
        #[cfg(target_arch = "x86_64")]
        {
            simd = if f.avx2_fma_f16c() { Simd::Avx2 } else { Simd::Scalar };
        }
        #[cfg(target_arch = "aarch64")]
        {
            simd = if f.neon { Simd::Neon } else { Simd::Scalar };
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            simd = Simd::Scalar;
        }
        // Best first: each better one goes in front.
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut packed_isas = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        if simd == Simd::Avx2 {
            packed_isas.insert(0, Isa::Avx2);
            if f.avx512f {
                packed_isas.insert(0, Isa::Avx512);
            }
        }
        let capped = match cap.to_ascii_lowercase().as_str() {
            #[cfg(target_arch = "x86_64")]
            "avx2" => packed_isas.iter().copied().find(|&isa| isa != Isa::Avx512),
            "scalar" => Some(Isa::Scalar),
            _ => None,
        };
        let packed = capped.unwrap_or(packed_isas[0]);
        // The VNNI kernel quantizes activations with the AVX2 set.
        #[cfg(target_arch = "x86_64")]
        let vnni = packed == Isa::Avx512 && f.avx512bw && f.avx512vnni && f.avx2_fma_f16c();
        #[cfg(not(target_arch = "x86_64"))]
        let vnni = false;
        let stream_prefetch = if f.amd { StreamPrefetch::NonTemporal } else { StreamPrefetch::L2 };
        Self { features, simd, packed_isas, packed, vnni, stream_prefetch }
    }
}

/// This CPU's features.
pub fn features() -> CpuFeatures {
    choice().features
}

/// Whether the AVX2 + FMA loops of attention and the elementwise passes run.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2_fma() -> bool {
    choice().features.avx2_fma()
}

/// The row-major matmuls' SIMD family.
pub(crate) fn simd() -> Simd {
    choice().simd
}

/// Where the decode GEMVs prefetch (see [`StreamPrefetch`]).
pub fn stream_prefetch() -> StreamPrefetch {
    choice().stream_prefetch
}

/// Every instruction set this machine runs the packed kernels on, best
/// first (tests check each against the reference).
pub fn supported_isas() -> Vec<Isa> {
    choice().packed_isas.clone()
}

/// The packed kernels' instruction set: the best this machine runs, under
/// the cap of `TINYVLLM_CPU_ISA`.
pub fn packed_isa() -> Isa {
    choice().packed
}

/// Whether the VNNI Q8_0 kernel runs: AVX-512 F, BW and VNNI, the AVX2 set
/// for the activation quantizer, and no cap below AVX-512.
pub fn vnni() -> bool {
    choice().vnni
}

/// The SIMD the CPU kernels use, in words, for logs.
pub fn describe() -> &'static str {
    if cfg!(target_arch = "aarch64") {
        "neon"
    } else if vnni() {
        "avx512+vnni"
    } else if packed_isa().is_avx512() {
        "avx512"
    } else if features().avx2_fma() {
        "avx2+fma"
    } else {
        "portable"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_portable_loop_is_always_listed_last() {
        let isas = supported_isas();
        assert_eq!(isas.last(), Some(&Isa::Scalar));
        assert!(isas.contains(&packed_isa()));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_cap_keeps_avx512_out_and_scalar_caps_everything() {
        let all = CpuFeatures {
            avx2: true,
            fma: true,
            f16c: true,
            avx512f: true,
            avx512bw: true,
            avx512vnni: true,
            neon: false,
            amd: false,
            clflushopt: true,
            prefetchw: true,
        };
        let best = Choice::new(all, "");
        assert_eq!((best.simd, best.packed, best.vnni), (Simd::Avx2, Isa::Avx512, true));
        assert_eq!(best.packed_isas, [Isa::Avx512, Isa::Avx2, Isa::Scalar]);
        let avx2 = Choice::new(all, "AVX2");
        assert_eq!((avx2.simd, avx2.packed, avx2.vnni), (Simd::Avx2, Isa::Avx2, false));
        let scalar = Choice::new(all, "scalar");
        assert_eq!((scalar.simd, scalar.packed, scalar.vnni), (Simd::Avx2, Isa::Scalar, false));
        let no_f16c = Choice::new(CpuFeatures { f16c: false, ..all }, "");
        assert_eq!((no_f16c.simd, no_f16c.packed, no_f16c.vnni), (Simd::Scalar, Isa::Scalar, false));
        assert_eq!(best.stream_prefetch, StreamPrefetch::L2);
        assert_eq!(Choice::new(CpuFeatures { amd: true, ..all }, "").stream_prefetch, StreamPrefetch::NonTemporal);
    }
}
