//! Which device the engine runs on (`--device auto|cpu|metal`), and how we
//! describe it in logs and the coordinator's `/v1/workers`.
//!
//! Metal support is compiled only on macOS (candle's `metal` feature is a
//! macOS-only dependency), so Linux builds never need anything Apple. `auto`
//! takes the Apple GPU when this is a macOS build on Apple Silicon and the
//! GPU opens; if it does not, the worker says so and runs on the CPU.

use candle_core::Device;

use crate::error::{Result, WorkerError};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Auto,
    Cpu,
    Metal,
}

/// The device and its description ("cpu (avx512+vnni, 2 threads)", "metal
/// (Apple GPU 0)", "cpu (metal unavailable: ...)").
#[derive(Clone, Debug)]
pub struct SelectedDevice {
    pub device: Device,
    pub description: String,
}

pub fn select(choice: DeviceChoice) -> Result<SelectedDevice> {
    let cpu = |note: Option<String>| SelectedDevice {
        device: Device::Cpu,
        description: match note {
            Some(note) => format!("{} ({note})", cpu_description()),
            None => cpu_description(),
        },
    };
    match choice {
        DeviceChoice::Cpu => Ok(cpu(None)),
        DeviceChoice::Metal => open_metal().map_err(WorkerError::Unsupported),
        DeviceChoice::Auto if cfg!(all(target_os = "macos", target_arch = "aarch64")) => match open_metal() {
            Ok(metal) => Ok(metal),
            Err(why) => {
                common::log!("warning: --device auto: {why}; running on the CPU");
                Ok(cpu(Some(format!("metal unavailable: {why}"))))
            }
        },
        DeviceChoice::Auto => Ok(cpu(None)),
    }
}

/// The device tests run on: the CPU, or Metal with `TINYVLLM_TEST_DEVICE=metal`
/// (the macOS CI job). Panics if Metal is asked for and cannot be opened.
pub fn test_device() -> Device {
    match std::env::var("TINYVLLM_TEST_DEVICE").as_deref() {
        Ok("metal") => match open_metal() {
            Ok(d) => d.device,
            Err(why) => panic!("TINYVLLM_TEST_DEVICE=metal: {why}"),
        },
        _ => Device::Cpu,
    }
}

#[cfg(target_os = "macos")]
fn open_metal() -> std::result::Result<SelectedDevice, String> {
    // candle panics instead of failing on some machines without a GPU.
    match std::panic::catch_unwind(|| Device::new_metal(0)) {
        Ok(Ok(device)) => Ok(SelectedDevice { device, description: "metal (Apple GPU 0)".into() }),
        Ok(Err(e)) => Err(format!("no Metal device: {e}")),
        Err(_) => Err("no Metal device (candle panicked opening it)".into()),
    }
}

#[cfg(not(target_os = "macos"))]
fn open_metal() -> std::result::Result<SelectedDevice, String> {
    Err("this build has no Metal support (Metal workers need a macOS build on Apple Silicon)".into())
}

fn cpu_description() -> String {
    let threads = rayon::current_num_threads();
    let simd = kernels::cpu::isa::describe();
    format!("cpu ({simd}, {threads} threads)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_always_there_and_metal_is_refused_off_macos() {
        let cpu = select(DeviceChoice::Cpu).unwrap();
        assert!(cpu.device.is_cpu() && cpu.description.starts_with("cpu ("), "{}", cpu.description);
        if !cfg!(target_os = "macos") {
            let err = select(DeviceChoice::Metal).unwrap_err().to_string();
            assert!(err.contains("no Metal support"), "{err}");
            assert!(select(DeviceChoice::Auto).unwrap().device.is_cpu());
        }
    }
}
