//! Runs our Metal kernels on the CPU, so Linux tests can execute them
//! through the real host planning code (kernels::metal::plan). The kernel
//! sources are compiled unmodified as C++ against an emulation of Metal's
//! execution model (cpp/runtime.cpp: threadgroups one at a time in a
//! shuffled order, fibers per thread, barriers and SIMD functions as
//! synchronisation points over SIMD groups of 32, NaN-poisoned threadgroup
//! memory); see README.md for what it catches and what it cannot.
//!
//! Device buffers are exact-size allocations that end at an inaccessible
//! page, filled with 0xff bytes (NaN in f32, f16 and bf16) until written.
//! Buffers bound read-only are compared before and after each dispatch.

use std::ffi::{CStr, CString, c_void};
#[cfg(metal_emu)]
use std::ffi::{c_char, c_int};
use std::fmt;
use std::ptr::NonNull;

/// What went wrong in a dispatch: an error the kernel or its bindings
/// caused, in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(pub String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "metal emulator: {}", self.0)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Whether the emulator was built for this target (Linux with a C++
/// compiler); without it every dispatch is an error.
pub fn available() -> bool {
    cfg!(metal_emu)
}

/// One parameter's Metal attribute, as `cpp/invoke.h` numbers them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ArgSpec {
    kind: u32,
    index: u32,
}

#[repr(C)]
struct RawBinding {
    ptr: *mut c_void,
    len: usize,
}

#[cfg(metal_emu)]
unsafe extern "C" {
    fn tvm_kernel_function(host_name: *const c_char) -> *const c_char;
    fn tvm_buffer_alloc(len: usize) -> *mut c_void;
    fn tvm_buffer_free(p: *mut c_void, len: usize);
    fn tvm_dispatch(
        host_name: *const c_char,
        specs: *const ArgSpec,
        num_specs: usize,
        bindings: *const RawBinding,
        num_bindings: usize,
        groups: *const u32,
        threads: *const u32,
        order_seed: u64,
        is_device: *const u8,
        traffic: *mut u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// A device buffer: `len` bytes ending at a guard page. Its bytes are only
/// reached through copies (`read`, `write`), never through references,
/// since kernels write them through pointers.
#[derive(Debug)]
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a Buffer owns its mapping exclusively (nothing else holds the
// pointer), so moving it to another thread moves that ownership; it is not
// Sync, as `write` through a shared reference would race.
unsafe impl Send for Buffer {}

impl Buffer {
    /// `len` bytes of 0xff.
    pub fn new(len: usize) -> Result<Self> {
        #[cfg(metal_emu)]
        {
            // SAFETY: tvm_buffer_alloc has no preconditions; it returns null
            // or a mapping of at least `len` readable, writable bytes.
            let p = unsafe { tvm_buffer_alloc(len) };
            NonNull::new(p.cast::<u8>())
                .map(|ptr| Self { ptr, len })
                .ok_or_else(|| Error(format!("cannot map a buffer of {len} bytes")))
        }
        #[cfg(not(metal_emu))]
        {
            Err(Error(format!("not built for this target (a buffer of {len} bytes)")))
        }
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let b = Self::new(bytes.len())?;
        b.write(0, bytes);
        Ok(b)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A copy of the bytes.
    pub fn read(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        // SAFETY: the mapping holds `len` bytes for as long as self lives,
        // and no dispatch runs during this call (dispatches borrow the
        // buffer only while they run, on this thread or under their lock).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), v.as_mut_ptr(), self.len) };
        v
    }

    /// A copy of `out.len()` bytes from byte `offset`.
    ///
    /// Panics when they are not all inside: the caller's own mistake.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        assert!(offset.checked_add(out.len()).is_some_and(|end| end <= self.len), "read past the buffer");
        // SAFETY: the range is inside the mapping (checked above), and no
        // dispatch runs during this call (as for `read`).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), out.as_mut_ptr(), out.len()) };
    }

    /// Copies `bytes` in at byte `offset`.
    ///
    /// Panics when they do not fit: a test's own mistake.
    pub fn write(&self, offset: usize, bytes: &[u8]) {
        assert!(offset.checked_add(bytes.len()).is_some_and(|end| end <= self.len), "write past the buffer");
        // SAFETY: the range is inside the mapping (checked above), which
        // nothing else accesses during this call.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.as_ptr().add(offset), bytes.len()) };
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        #[cfg(metal_emu)]
        // SAFETY: ptr and len are what tvm_buffer_alloc returned and was
        // given, and the buffer is freed once.
        unsafe {
            tvm_buffer_free(self.ptr.as_ptr().cast(), self.len)
        };
    }
}

/// One argument the host binds at a buffer index.
pub enum Arg<'a> {
    /// A buffer from `offset` on; `writable` unless the host bound it as an
    /// input (a kernel that writes it anyway is an error).
    Buffer { buffer: &'a Buffer, offset: usize, writable: bool },
    /// `set_bytes` data.
    Bytes(Vec<u8>),
}

/// Runs kernel `name` (its host name, e.g. `paged_attention_decode_f32_hd64`)
/// over `groups` threadgroups of `threads` threads, with `args` by buffer
/// index. `order` picks the order of threadgroups and of threads within
/// each (0: natural, 1: reversed, others: random); a correct kernel gives
/// bit-identical results under every order.
pub fn dispatch(name: &str, args: &[Option<Arg>], groups: [usize; 3], threads: [usize; 3], order: u64) -> Result<()> {
    dispatch_with(name, args, groups, threads, order, Options::default()).map(|_| ())
}

/// How [`dispatch_with`] watches a dispatch.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Read-only buffers of at most this many bytes are compared before
    /// and after (a model's weights and KV pools are too big to copy twice
    /// per dispatch).
    pub check_read_only_up_to: usize,
    /// Count the bytes of device buffers the dispatch touches, each once
    /// (page granularity; see runtime.cpp).
    pub count_traffic: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self { check_read_only_up_to: usize::MAX, count_traffic: false }
    }
}

/// [`dispatch`] under `options`; the bytes of device memory it touched
/// when counting (0 otherwise).
pub fn dispatch_with(
    name: &str,
    args: &[Option<Arg>],
    groups: [usize; 3],
    threads: [usize; 3],
    order: u64,
    options: Options,
) -> Result<u64> {
    let check_up_to = options.check_read_only_up_to;
    if !available() {
        return Err(Error("not built for this target".into()));
    }
    let c_name = CString::new(name).map_err(|_| Error(format!("bad kernel name {name:?}")))?;
    let function = kernel_function(&c_name).ok_or_else(|| Error(format!("no kernel named {name}")))?;
    let specs = signature(&function)?;
    let mut bytes_args: Vec<Vec<u8>> = Vec::new();
    let mut bindings = Vec::with_capacity(args.len());
    let mut read_only = Vec::new();
    for (index, arg) in args.iter().enumerate() {
        bindings.push(match arg {
            None => RawBinding { ptr: std::ptr::null_mut(), len: 0 },
            Some(Arg::Buffer { buffer, offset, writable }) => {
                if *offset > buffer.len {
                    return Err(Error(format!(
                        "buffer {index} bound at offset {offset} past its {} bytes",
                        buffer.len
                    )));
                }
                if !writable && buffer.len <= check_up_to {
                    read_only.push((index, *buffer, buffer.read()));
                }
                // SAFETY: offset <= len, so the pointer stays inside the
                // mapping (or one past its end for an empty tail).
                RawBinding { ptr: unsafe { buffer.ptr.as_ptr().add(*offset) }.cast(), len: buffer.len - offset }
            }
            Some(Arg::Bytes(data)) => {
                bytes_args.push(data.clone());
                let last = bytes_args.last_mut().expect("just pushed");
                RawBinding { ptr: last.as_mut_ptr().cast(), len: last.len() }
            }
        });
    }
    let to_u32 = |x: usize, what: &str| u32::try_from(x).map_err(|_| Error(format!("{what} {x} past 32 bits")));
    let g = [to_u32(groups[0], "grid")?, to_u32(groups[1], "grid")?, to_u32(groups[2], "grid")?];
    let t = [to_u32(threads[0], "threads")?, to_u32(threads[1], "threads")?, to_u32(threads[2], "threads")?];
    let is_device: Vec<u8> = args.iter().map(|a| u8::from(matches!(a, Some(Arg::Buffer { .. })))).collect();
    let traffic = run(&c_name, &specs, &bindings, (g, t), order, options.count_traffic.then_some(&is_device))?;
    for (index, buffer, before) in read_only {
        if buffer.read() != before {
            return Err(Error(format!("{name} wrote into buffer {index}, which the host bound read-only")));
        }
    }
    // The set_bytes copies lived until here, as the bindings point into them.
    drop(bytes_args);
    Ok(traffic)
}

#[cfg(metal_emu)]
fn run(
    name: &CStr,
    specs: &[ArgSpec],
    bindings: &[RawBinding],
    (g, t): ([u32; 3], [u32; 3]),
    order: u64,
    is_device: Option<&Vec<u8>>,
) -> Result<u64> {
    let mut err = vec![0u8; 1024];
    let mut traffic = 0u64;
    let (flags, traffic_out) = match is_device {
        // One flag per binding (is_device has args.len() entries).
        Some(flags) => (flags.as_ptr(), &mut traffic as *mut u64),
        None => (std::ptr::null(), std::ptr::null_mut()),
    };
    // SAFETY: every pointer is valid for the length passed with it: specs
    // and bindings are live slices, each binding points into a live buffer
    // mapping or set_bytes vector with `len` bytes from there, g and t hold
    // three u32s, flags is null or holds one byte per binding, traffic_out
    // is null or points to a live u64, err holds err.len() bytes. The
    // runtime serialises dispatches and reads nothing after returning.
    let rc = unsafe {
        tvm_dispatch(
            name.as_ptr(),
            specs.as_ptr(),
            specs.len(),
            bindings.as_ptr(),
            bindings.len(),
            g.as_ptr(),
            t.as_ptr(),
            order,
            flags,
            traffic_out,
            err.as_mut_ptr().cast(),
            err.len(),
        )
    };
    if rc == 0 {
        return Ok(traffic);
    }
    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
    Err(Error(format!("{}: {}", name.to_string_lossy(), String::from_utf8_lossy(&err[..end]))))
}

#[cfg(not(metal_emu))]
fn run(_: &CStr, _: &[ArgSpec], _: &[RawBinding], _: ([u32; 3], [u32; 3]), _: u64, _: Option<&Vec<u8>>) -> Result<u64> {
    Err(Error("not built for this target".into()))
}

#[cfg(metal_emu)]
fn kernel_function(name: &CStr) -> Option<String> {
    // SAFETY: name is NUL-terminated; the result is null or points to a
    // NUL-terminated string owned by the registry for the process's life.
    let p = unsafe { tvm_kernel_function(name.as_ptr()) };
    // SAFETY: non-null results are valid C strings (above).
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

#[cfg(not(metal_emu))]
fn kernel_function(_: &CStr) -> Option<String> {
    None
}

/// The sources as compiled (build.rs), searched for kernel signatures.
const SOURCES: [&str; 5] = [
    include_str!(concat!(env!("OUT_DIR"), "/metal/cache.metal")),
    include_str!(concat!(env!("OUT_DIR"), "/metal/model.metal")),
    include_str!(concat!(env!("OUT_DIR"), "/metal/paged_attention.metal")),
    include_str!(concat!(env!("OUT_DIR"), "/metal/prefill_attention.metal")),
    include_str!(concat!(env!("OUT_DIR"), "/metal/sample.metal")),
];

/// The attribute of every parameter of kernel template `function`, in
/// order, read from its `[[kernel]] void function(...)` in the source.
fn signature(function: &str) -> Result<Vec<ArgSpec>> {
    let head = format!("void {function}(");
    let (src, at) = SOURCES
        .iter()
        .find_map(|s| s.find(&head).map(|i| (*s, i + head.len())))
        .ok_or_else(|| Error(format!("no `{head}` in the sources")))?;
    let mut params = Vec::new();
    let (mut depth, mut start) = (0i32, at);
    for (i, c) in src[at..].char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ']' => depth -= 1,
            ')' if depth == 0 => {
                params.push(&src[start..at + i]);
                break;
            }
            ')' => depth -= 1,
            ',' if depth == 0 => {
                params.push(&src[start..at + i]);
                start = at + i + 1;
            }
            _ => {}
        }
    }
    params.iter().map(|p| parse_param(p).ok_or_else(|| Error(format!("{function}: no attribute on `{p}`")))).collect()
}

fn parse_param(param: &str) -> Option<ArgSpec> {
    let attr = param.split("[[").nth(1)?.split("]]").next()?.trim();
    if let Some(n) = attr.strip_prefix("buffer(").and_then(|r| r.strip_suffix(')')) {
        return Some(ArgSpec { kind: 0, index: n.trim().parse().ok()? });
    }
    let kind = match attr {
        "threadgroup_position_in_grid" => 1,
        "thread_index_in_threadgroup" | "thread_position_in_threadgroup" => 2,
        "thread_index_in_simdgroup" => 3,
        "simdgroup_index_in_threadgroup" => 4,
        "threads_per_threadgroup" => 5,
        "thread_position_in_grid" => 6,
        _ => return None,
    };
    Some(ArgSpec { kind, index: 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_come_from_the_source() {
        let s = signature("reshape_and_cache").unwrap();
        let kinds: Vec<(u32, u32)> = s.iter().map(|a| (a.kind, a.index)).collect();
        assert_eq!(kinds, [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 0), (2, 0), (5, 0)]);
        // 13 buffers (the attention sinks the last) and 4 thread attributes.
        assert_eq!(signature("paged_attention_decode").unwrap().len(), 17);
    }

    #[test]
    fn a_buffer_reads_back_what_was_written_and_starts_as_nan() {
        if !available() {
            eprintln!("skipping: the emulator is not built for this target");
            return;
        }
        let b = Buffer::new(6).unwrap();
        assert_eq!(b.read(), [0xff; 6]);
        b.write(2, &[1, 2, 3, 4]);
        assert_eq!(b.read(), [0xff, 0xff, 1, 2, 3, 4]);
    }
}
