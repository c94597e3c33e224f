//! The CPU emulator of our Metal kernels (kernels/metal-emu) as a [`Gpu`]:
//! what `--device metal-emulated` runs (cargo feature `metal-emulated`).
//! Every dispatch of a step executes the kernel sources a Mac compiles,
//! bound by the plan code a Mac runs ([`super::step`]), so a Linux test of
//! a worker on this device tests the Mac's step but for Apple's compiler
//! and hardware.
//!
//! It counts what the plan does (allocations, command buffers, dispatches)
//! so tests can hold the plan to "no allocation per step, one command
//! buffer".

use super::plan::{Access, Allocator, Encoder, Kernel};
use super::step::Gpu;
use crate::{KernelError, Result};

/// Read-only bindings up to this size are compared before and after each
/// dispatch (a kernel writing its input is an error); bigger ones (weights,
/// KV pools) are not copied twice per dispatch.
const CHECK_READ_ONLY_UP_TO: usize = 1 << 20;

fn emu_err(e: metal_emu::Error) -> KernelError {
    KernelError::Invalid(e.to_string())
}

/// A buffer of an [`EmulatedGpu`]: an index into its buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmuBuffer(usize);

/// What the plan has done on this device so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub allocations: usize,
    pub allocated_bytes: usize,
    pub command_buffers: usize,
    pub dispatches: usize,
    /// Bytes of device memory the dispatches touched, each byte once per
    /// dispatch (while [`EmulatedGpu::count_traffic`] is on).
    pub traffic_bytes: u64,
}

/// The emulator as a GPU.
#[derive(Debug)]
pub struct EmulatedGpu {
    buffers: Vec<metal_emu::Buffer>,
    /// The kernels prepared (as a Mac compiles them before the first step):
    /// dispatching another is an error there, so it is one here.
    prepared: std::collections::HashSet<String>,
    counters: Counters,
    /// The order seed of every dispatch (threadgroups and lanes shuffled).
    order: u64,
    count_traffic: bool,
}

impl EmulatedGpu {
    /// Fails when the emulator was not built for this target.
    pub fn new() -> Result<Self> {
        if !metal_emu::available() {
            return Err(KernelError::Invalid(
                "the Metal emulator is not built for this target (it needs Linux and a C++ compiler)".into(),
            ));
        }
        Ok(Self {
            buffers: Vec::new(),
            prepared: Default::default(),
            counters: Counters::default(),
            order: 2,
            count_traffic: false,
        })
    }

    /// Marks `kernels` as compiled: a step may dispatch only these.
    pub fn prepare<'k>(&mut self, kernels: impl IntoIterator<Item = &'k Kernel>) -> Result<()> {
        self.prepared.extend(kernels.into_iter().map(|k| k.name.clone()));
        Ok(())
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    fn buffer(&self, b: EmuBuffer) -> &metal_emu::Buffer {
        &self.buffers[b.0]
    }

    fn add(&mut self, buffer: metal_emu::Buffer) -> EmuBuffer {
        self.counters.allocations += 1;
        self.counters.allocated_bytes += buffer.len();
        self.buffers.push(buffer);
        EmuBuffer(self.buffers.len() - 1)
    }
}

impl Allocator for EmulatedGpu {
    type Buffer = EmuBuffer;

    fn upload(&mut self, bytes: &[u8]) -> Result<EmuBuffer> {
        let buffer = metal_emu::Buffer::from_bytes(bytes).map_err(emu_err)?;
        Ok(self.add(buffer))
    }

    fn scratch(&mut self, len: usize) -> Result<EmuBuffer> {
        let buffer = metal_emu::Buffer::new(len).map_err(emu_err)?;
        Ok(self.add(buffer))
    }
}

/// An error unless `len` bytes from `offset` lie inside `b`.
fn in_range(b: &metal_emu::Buffer, offset: usize, len: usize, what: &str) -> Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > b.len()) {
        return Err(KernelError::Invalid(format!("a {what} of {len} bytes at {offset} past a buffer of {}", b.len())));
    }
    Ok(())
}

enum Bound {
    Buffer(EmuBuffer, usize, Access),
    Bytes(Vec<u8>),
}

struct Dispatch {
    kernel: String,
    args: Vec<Option<Bound>>,
    groups: [usize; 3],
    threads: [usize; 3],
}

/// One command buffer: dispatches recorded in order, run at commit.
#[derive(Default)]
pub struct Commands {
    dispatches: Vec<Dispatch>,
    kernel: Option<String>,
    args: Vec<Option<Bound>>,
    error: Option<String>,
}

impl Commands {
    fn slot(&mut self, index: usize) -> &mut Option<Bound> {
        if self.args.len() <= index {
            self.args.resize_with(index + 1, || None);
        }
        &mut self.args[index]
    }
}

impl Encoder for Commands {
    type Buffer = EmuBuffer;

    fn set_kernel(&mut self, kernel: &Kernel) {
        self.kernel = Some(kernel.name.clone());
        self.args.clear();
    }

    fn set_buffer(&mut self, index: usize, buffer: &EmuBuffer, offset: usize, access: Access) {
        *self.slot(index) = Some(Bound::Buffer(*buffer, offset, access));
    }

    fn set_bytes(&mut self, index: usize, bytes: &[u8]) {
        *self.slot(index) = Some(Bound::Bytes(bytes.to_vec()));
    }

    fn dispatch(&mut self, groups: [usize; 3], threads: [usize; 3]) {
        let Some(kernel) = self.kernel.clone() else {
            self.error.get_or_insert_with(|| "dispatch before set_kernel".into());
            return;
        };
        let args = self
            .args
            .iter()
            .map(|a| {
                a.as_ref().map(|a| match a {
                    Bound::Buffer(b, offset, access) => Bound::Buffer(*b, *offset, *access),
                    Bound::Bytes(bytes) => Bound::Bytes(bytes.clone()),
                })
            })
            .collect();
        self.dispatches.push(Dispatch { kernel, args, groups, threads });
    }
}

impl Gpu for EmulatedGpu {
    type Commands = Commands;

    fn write(&mut self, buffer: &EmuBuffer, offset: usize, bytes: &[u8]) -> Result<()> {
        let b = self.buffer(*buffer);
        in_range(b, offset, bytes.len(), "write")?;
        b.write(offset, bytes);
        Ok(())
    }

    fn read(&mut self, buffer: &EmuBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        let b = self.buffer(*buffer);
        in_range(b, offset, out.len(), "read")?;
        b.read_at(offset, out);
        Ok(())
    }

    fn count_traffic(&mut self, on: bool) -> bool {
        self.count_traffic = on;
        true
    }

    fn traffic_bytes(&self) -> Option<u64> {
        Some(self.counters.traffic_bytes)
    }

    fn begin(&mut self) -> Commands {
        Commands::default()
    }

    fn commit_and_wait(&mut self, commands: Commands) -> Result<()> {
        self.counters.command_buffers += 1;
        if let Some(e) = commands.error {
            return Err(KernelError::Invalid(e));
        }
        if let Some(d) = commands.dispatches.iter().find(|d| !self.prepared.contains(&d.kernel)) {
            return Err(KernelError::Invalid(format!("kernel {} was not prepared before the step", d.kernel)));
        }
        for d in &commands.dispatches {
            self.counters.dispatches += 1;
            let args: Vec<Option<metal_emu::Arg>> = d
                .args
                .iter()
                .map(|a| {
                    a.as_ref().map(|a| match a {
                        Bound::Buffer(b, offset, access) => metal_emu::Arg::Buffer {
                            buffer: self.buffer(*b),
                            offset: *offset,
                            writable: *access == Access::Write,
                        },
                        Bound::Bytes(bytes) => metal_emu::Arg::Bytes(bytes.clone()),
                    })
                })
                .collect();
            let options =
                metal_emu::Options { check_read_only_up_to: CHECK_READ_ONLY_UP_TO, count_traffic: self.count_traffic };
            let traffic = metal_emu::dispatch_with(&d.kernel, &args, d.groups, d.threads, self.order, options)
                .map_err(emu_err)?;
            self.counters.traffic_bytes += traffic;
        }
        Ok(())
    }
}
