//! tests/metal.rs on macOS: the Metal kernels on `Device::new_metal(0)`.
//! Cases are built on the CPU and moved whole (layouts, strides and start
//! offsets come along); results come back to the CPU.

use candle_core::{Device, Tensor};
use kernels::{Attention, CacheWrite, metal};

pub struct Gpu {
    pub device: Device,
}

impl Gpu {
    /// The Metal device, or None (with a note, or a failure where a Metal
    /// run is required) where there is none. candle
    /// panics rather than erring when no GPU is listed, hence the catch.
    pub fn get() -> Option<Self> {
        match std::panic::catch_unwind(|| Device::new_metal(0)) {
            Ok(Ok(device)) => Some(Self { device }),
            Ok(Err(e)) => {
                super::common::metal_unavailable(&format!("no Metal device ({e})"));
                None
            }
            Err(_) => {
                super::common::metal_unavailable("no Metal device (candle panicked opening it)");
                None
            }
        }
    }

    fn on(&self, t: &Tensor) -> Tensor {
        t.to_device(&self.device).unwrap()
    }

    /// Paged attention of CPU tensors on the GPU; the output on the CPU.
    pub fn attention(&self, a: &Attention) -> kernels::Result<Tensor> {
        let (q, k, v) = (self.on(a.q), self.on(a.k_cache), self.on(a.v_cache));
        let got = metal::paged_attention(&Attention { q: &q, k_cache: &k, v_cache: &v, ..*a })?;
        assert!(got.device().is_metal(), "output left the GPU");
        Ok(got.to_device(&Device::Cpu)?)
    }

    /// The KV write of CPU tensors on the GPU; the caches after it, on the CPU.
    pub fn write(&self, w: &CacheWrite) -> kernels::Result<(Tensor, Tensor)> {
        let (k, v, kc, vc) = (self.on(w.k), self.on(w.v), self.on(w.k_cache), self.on(w.v_cache));
        metal::reshape_and_cache(&CacheWrite { k: &k, v: &v, k_cache: &kc, v_cache: &vc, ..*w })?;
        Ok((kc.to_device(&Device::Cpu)?, vc.to_device(&Device::Cpu)?))
    }
}
