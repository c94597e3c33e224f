//! tests/metal.rs on Linux: the Metal kernels executed by the CPU emulator
//! (kernels/metal-emu) through the real host planning code
//! (`kernels::metal::plan`), which is driven here as `device.rs` drives it
//! on macOS: a step cache per device, an allocator and an encoder.
//!
//! Every attention call and write runs twice, with threadgroups and lanes
//! in two different orders, and the two results must be bit-identical: a
//! race between threads shows as a difference. Tensors are built on the
//! CPU and copied into exact-size emulator buffers; a tensor that starts
//! partway into its storage is bound at that offset, behind poisoned bytes.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use candle_core::{DType, Device, Tensor};
use kernels::metal::plan::{
    Access, Allocator, At, AttentionBuffers, CacheWriteBuffers, CacheWritePlan, Encoder, Kernel, StepCache,
};
use kernels::{Attention, CacheWrite, KernelError};
use metal_emu::{Arg, Buffer};

type Buf = Rc<Buffer>;

fn emu_err(e: metal_emu::Error) -> KernelError {
    KernelError::Invalid(e.to_string())
}

/// Allocations the planning code made, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocations {
    pub uploads: usize,
    pub scratch: usize,
}

struct CountingAllocator<'a>(&'a Cell<Allocations>);

impl Allocator for CountingAllocator<'_> {
    type Buffer = Buf;

    fn upload(&mut self, bytes: &[u8]) -> kernels::Result<Buf> {
        self.0.set(Allocations { uploads: self.0.get().uploads + 1, ..self.0.get() });
        Ok(Rc::new(Buffer::from_bytes(bytes).map_err(emu_err)?))
    }

    fn scratch(&mut self, len: usize) -> kernels::Result<Buf> {
        self.0.set(Allocations { scratch: self.0.get().scratch + 1, ..self.0.get() });
        Ok(Rc::new(Buffer::new(len).map_err(emu_err)?))
    }
}

enum Bound {
    Buffer(Buf, usize, bool),
    Bytes(Vec<u8>),
}

/// Runs each dispatch as soon as it is encoded.
struct EmuEncoder {
    kernel: Option<Kernel>,
    args: Vec<Option<Bound>>,
    order: u64,
    error: Option<metal_emu::Error>,
}

impl EmuEncoder {
    fn new(order: u64) -> Self {
        Self { kernel: None, args: Vec::new(), order, error: None }
    }

    fn slot(&mut self, index: usize) -> &mut Option<Bound> {
        if self.args.len() <= index {
            self.args.resize_with(index + 1, || None);
        }
        &mut self.args[index]
    }

    fn finish(self) -> kernels::Result<()> {
        self.error.map_or(Ok(()), |e| Err(emu_err(e)))
    }
}

impl Encoder for EmuEncoder {
    type Buffer = Buf;

    fn set_kernel(&mut self, kernel: &Kernel) {
        self.kernel = Some(kernel.clone());
        self.args.clear();
    }

    fn set_buffer(&mut self, index: usize, buffer: &Buf, offset: usize, access: Access) {
        *self.slot(index) = Some(Bound::Buffer(buffer.clone(), offset, access == Access::Write));
    }

    fn set_bytes(&mut self, index: usize, bytes: &[u8]) {
        *self.slot(index) = Some(Bound::Bytes(bytes.to_vec()));
    }

    fn dispatch(&mut self, threadgroups: [usize; 3], threads: [usize; 3]) {
        if self.error.is_some() {
            return;
        }
        let Some(kernel) = &self.kernel else {
            self.error = Some(metal_emu::Error("dispatch before set_kernel".into()));
            return;
        };
        let args: Vec<Option<Arg>> = self
            .args
            .iter()
            .map(|a| {
                a.as_ref().map(|a| match a {
                    Bound::Buffer(b, offset, writable) => {
                        Arg::Buffer { buffer: b, offset: *offset, writable: *writable }
                    }
                    Bound::Bytes(bytes) => Arg::Bytes(bytes.clone()),
                })
            })
            .collect();
        if let Err(e) = metal_emu::dispatch(&kernel.name, &args, threadgroups, threads, self.order) {
            self.error = Some(e);
        }
    }
}

/// A tensor's elements as little-endian bytes.
pub fn tensor_bytes(t: &Tensor) -> Vec<u8> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t.to_vec1::<f32>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => t.to_vec1::<half::f16>().unwrap().iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        DType::BF16 => t.to_vec1::<half::bf16>().unwrap().iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        other => panic!("no emulated kernel takes {other:?}"),
    }
}

fn tensor_from_bytes(bytes: &[u8], dtype: DType, dims: &[usize]) -> Tensor {
    let pairs = || bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]));
    let t = match dtype {
        DType::F32 => Tensor::new(
            bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<_>>(),
            &Device::Cpu,
        ),
        DType::F16 => Tensor::new(pairs().map(half::f16::from_bits).collect::<Vec<_>>(), &Device::Cpu),
        DType::BF16 => Tensor::new(pairs().map(half::bf16::from_bits).collect::<Vec<_>>(), &Device::Cpu),
        other => panic!("no emulated kernel takes {other:?}"),
    };
    t.unwrap().reshape(dims).unwrap()
}

/// `t` in a buffer of its own, at the offset it has in its storage, behind
/// that many poisoned bytes (a pool that starts partway into its memory).
fn device_copy(t: &Tensor) -> (Buf, usize) {
    let offset = t.layout().start_offset() * t.dtype().size_in_bytes();
    let data = tensor_bytes(t);
    let buffer = Buffer::new(offset + data.len()).unwrap();
    buffer.write(offset, &data);
    (Rc::new(buffer), offset)
}

fn at(b: &(Buf, usize)) -> At<'_, Buf> {
    At { buffer: &b.0, offset: b.1 }
}

/// The emulated GPU of one test: its step cache and allocation counts.
pub struct Gpu {
    steps: RefCell<StepCache<Buf>>,
    allocations: Cell<Allocations>,
    orders: &'static [u64],
}

/// Orders the two runs of every call use: natural, then a random one.
const ORDERS: [u64; 2] = [0, 0x5eed];

impl Gpu {
    pub fn get() -> Option<Self> {
        if !metal_emu::available() {
            super::common::metal_unavailable("the Metal emulator is not built for this target");
            return None;
        }
        Some(Self { steps: RefCell::default(), allocations: Cell::default(), orders: &ORDERS })
    }

    /// Each call once, in the natural order (for tests that repeat calls
    /// many times and check something else than the kernels' results).
    pub fn once(self) -> Self {
        Self { orders: &ORDERS[..1], ..self }
    }

    /// What the planning code has allocated so far.
    pub fn allocations(&self) -> Allocations {
        self.allocations.get()
    }

    /// Paged attention on CPU tensors, run through the emulator; the output
    /// on the CPU.
    pub fn attention(&self, a: &Attention) -> kernels::Result<Tensor> {
        let dims = a.check()?;
        let dtype = a.q.dtype();
        let mut alloc = CountingAllocator(&self.allocations);
        let dtypes = (dtype, a.k_cache.dtype());
        let (plan, meta, scratch) = self.steps.borrow_mut().attention(&mut alloc, a.meta, dims, dtypes, a.scale)?;
        if dims.num_tokens == 0 {
            return Ok(Tensor::zeros((0, dims.num_heads, dims.head_dim), dtype, &Device::Cpu)?);
        }
        let q = device_copy(&a.q.contiguous()?);
        let (k, v) = (device_copy(a.k_cache), device_copy(a.v_cache));
        let sinks = match a.sinks {
            Some(s) => Some(alloc.upload(&s.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())?),
            None => None,
        };
        let mut outs = Vec::new();
        for &order in self.orders {
            let out: Buf = Rc::new(Buffer::new(plan.out_elems() * dtype.size_in_bytes()).map_err(emu_err)?);
            let mut enc = EmuEncoder::new(order);
            let buffers = AttentionBuffers {
                q: at(&q),
                k_cache: at(&k),
                v_cache: at(&v),
                out: At { buffer: &out, offset: 0 },
                meta: &meta,
                scratch: scratch.as_ref(),
                sinks: sinks.as_ref().map(|buffer| At { buffer, offset: 0 }),
            };
            plan.encode(&mut enc, buffers);
            enc.finish()?;
            outs.push(out.read());
        }
        assert!(outs.windows(2).all(|w| w[0] == w[1]), "attention differs between thread orders: a race");
        Ok(tensor_from_bytes(&outs[0], dtype, &[dims.num_tokens, dims.num_heads, dims.head_dim]))
    }

    /// The KV write on CPU tensors, run through the emulator; the caches
    /// after it, on the CPU.
    pub fn write(&self, w: &CacheWrite) -> kernels::Result<(Tensor, Tensor)> {
        let num_slots = w.check()?;
        let (t, kv_heads, head_dim) = w.k.dims3()?;
        let dtype = w.k_cache.dtype();
        let Some(plan) = CacheWritePlan::new(t, kv_heads, head_dim, num_slots, (w.k.dtype(), dtype))? else {
            return Ok((w.k_cache.copy()?, w.v_cache.copy()?));
        };
        let mut alloc = CountingAllocator(&self.allocations);
        let slots = self.steps.borrow_mut().slots(&mut alloc, w.slot_mapping)?;
        let (k, v) = (device_copy(&w.k.contiguous()?), device_copy(&w.v.contiguous()?));
        let mut results = Vec::new();
        for &order in self.orders {
            let (kc, vc) = (device_copy(w.k_cache), device_copy(w.v_cache));
            let mut enc = EmuEncoder::new(order);
            let buffers = CacheWriteBuffers {
                k: at(&k),
                v: at(&v),
                k_cache: at(&kc),
                v_cache: at(&vc),
                slots: At { buffer: &slots, offset: 0 },
            };
            plan.encode(&mut enc, buffers);
            enc.finish()?;
            results.push((kc.0.read()[kc.1..].to_vec(), vc.0.read()[vc.1..].to_vec()));
        }
        assert!(results.windows(2).all(|w| w[0] == w[1]), "cache write differs between thread orders");
        let (kb, vb) = &results[0];
        Ok((tensor_from_bytes(kb, dtype, w.k_cache.dims()), tensor_from_bytes(vb, dtype, w.v_cache.dims())))
    }
}
