//! The Apple GPU as a [`Gpu`] for the step plan (macOS): its own command
//! queue on candle's Metal device, shared-storage buffers the host writes
//! inputs into and reads results from, and one command buffer per step,
//! committed and waited on once. The kernels are the same sources the Linux
//! emulator executes (`emulated.rs`), compiled here by Apple's compiler.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::MetalDevice;
use candle_metal_kernels::metal::{Buffer, CommandBuffer, CommandQueue, ComputeCommandEncoder, ComputePipeline};
use objc2_metal::{MTLCommandQueue, MTLResourceOptions};

use super::plan::{Access, Allocator, Encoder, Kernel};
use super::step::Gpu;
use crate::{KernelError, Result};

/// candle's device with a command queue of the plan's own: a step's one
/// command buffer is not interleaved with candle's.
pub struct MetalGpu {
    device: MetalDevice,
    queue: CommandQueue,
    pipelines: Arc<HashMap<String, ComputePipeline>>,
}

// SAFETY: Metal devices, queues, buffers and pipeline states are
// thread-safe objects (Apple's documentation: they may be used from any
// thread); the plan uses one MetalGpu from one thread at a time (&mut self).
unsafe impl Send for MetalGpu {}

fn failed(what: &str) -> KernelError {
    KernelError::Invalid(format!("Metal: {what}"))
}

impl MetalGpu {
    pub fn new(device: MetalDevice) -> Result<Self> {
        let queue = device.metal_device().new_command_queue().map_err(|e| failed(&format!("no command queue: {e}")))?;
        Ok(Self { device, queue, pipelines: Arc::default() })
    }

    /// Compiles `kernels` (once per GPU), each checked to run its threads
    /// per threadgroup; a step may dispatch only these.
    pub fn prepare<'k>(&mut self, kernels: impl IntoIterator<Item = &'k Kernel>) -> Result<()> {
        let compiled = super::device::pipelines(&self.device, kernels)?;
        let mut all = (*self.pipelines).clone();
        all.extend(compiled);
        self.pipelines = Arc::new(all);
        Ok(())
    }

    fn buffer(&self, len: usize) -> Result<Arc<Buffer>> {
        let buffer = self
            .device
            .metal_device()
            .new_buffer(len.max(1), MTLResourceOptions::StorageModeShared)
            .map_err(|e| failed(&format!("a buffer of {len} bytes: {e}")))?;
        Ok(Arc::new(buffer))
    }
}

impl Allocator for MetalGpu {
    type Buffer = Arc<Buffer>;

    fn upload(&mut self, bytes: &[u8]) -> Result<Arc<Buffer>> {
        let buffer = self.buffer(bytes.len())?;
        // SAFETY: a new shared buffer of at least bytes.len() bytes that no
        // GPU work references yet.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buffer.contents(), bytes.len()) };
        Ok(buffer)
    }

    fn scratch(&mut self, len: usize) -> Result<Arc<Buffer>> {
        self.buffer(len)
    }
}

/// One step's command buffer and its compute encoder.
pub struct MetalCommands {
    buffer: CommandBuffer,
    encoder: ComputeCommandEncoder,
    pipelines: Arc<HashMap<String, ComputePipeline>>,
    missing: Option<String>,
}

impl Encoder for MetalCommands {
    type Buffer = Arc<Buffer>;

    fn set_kernel(&mut self, kernel: &Kernel) {
        match self.pipelines.get(&kernel.name) {
            Some(p) => self.encoder.set_compute_pipeline_state(p),
            None => {
                self.missing.get_or_insert_with(|| kernel.name.clone());
            }
        }
    }

    fn set_buffer(&mut self, index: usize, buffer: &Arc<Buffer>, offset: usize, access: Access) {
        super::device::set_buffer(&self.encoder, index, buffer, offset, access);
    }

    fn set_bytes(&mut self, index: usize, bytes: &[u8]) {
        self.encoder.set_bytes_directly(index, bytes.len(), bytes.as_ptr().cast());
    }

    fn dispatch(&mut self, threadgroups: [usize; 3], threads: [usize; 3]) {
        if self.missing.is_some() {
            return;
        }
        super::device::dispatch(&self.encoder, threadgroups, threads);
    }
}

impl Gpu for MetalGpu {
    type Commands = MetalCommands;

    fn write(&mut self, buffer: &Arc<Buffer>, offset: usize, bytes: &[u8]) -> Result<()> {
        if offset.checked_add(bytes.len()).is_none_or(|end| end > buffer.length()) {
            return Err(failed("a write past a buffer's end"));
        }
        // SAFETY: in range (checked); the plan writes only between a step's
        // wait and the next commit, so no GPU work reads it meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buffer.contents().add(offset), bytes.len()) };
        Ok(())
    }

    fn read(&mut self, buffer: &Arc<Buffer>, offset: usize, out: &mut [u8]) -> Result<()> {
        if offset.checked_add(out.len()).is_none_or(|end| end > buffer.length()) {
            return Err(failed("a read past a buffer's end"));
        }
        // SAFETY: in range (checked), and read after the step's wait.
        unsafe { std::ptr::copy_nonoverlapping(buffer.contents().add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn begin(&mut self) -> MetalCommands {
        // A queue hands out a command buffer unless the system is out of
        // resources, which no step could survive anyway.
        let raw = self.queue.commandBuffer().expect("Metal: the command queue gave no command buffer");
        let buffer = CommandBuffer::new(raw);
        let encoder = buffer.compute_command_encoder_no_fence();
        MetalCommands { buffer, encoder, pipelines: self.pipelines.clone(), missing: None }
    }

    fn commit_and_wait(&mut self, commands: MetalCommands) -> Result<()> {
        commands.encoder.end_encoding();
        if let Some(name) = commands.missing {
            return Err(failed(&format!("kernel {name} was not compiled before the step")));
        }
        commands.buffer.commit();
        commands.buffer.wait_until_completed();
        match commands.buffer.error() {
            Some(e) => Err(failed(&format!("the step's command buffer failed: {e}"))),
            None => Ok(()),
        }
    }
}
