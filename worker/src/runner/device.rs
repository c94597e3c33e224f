//! Which device the engine runs on (`--device auto|cpu|metal|metal-emulated`),
//! and how we describe it in logs and the coordinator's `/v1/workers`.
//!
//! `metal-emulated` runs the Metal step plan (`kernels::metal::step`) in the
//! CPU emulator of our Metal kernels (cargo feature `metal-emulated`, on by
//! default; the emulator builds on Linux): the code a Mac runs, executed on
//! Linux, for tests. It is slow by design.
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
    MetalEmulated,
}

/// A step that runs as one plan of our own kernels rather than candle ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanTarget {
    /// The Metal step plan on the Apple GPU (`--device metal`).
    Metal,
    /// The Metal step plan in the CPU emulator (`--device metal-emulated`).
    MetalEmulated,
}

/// The device and its description ("cpu (avx512+vnni, 2 threads)", "metal
/// (Apple GPU 0)", "cpu (metal unavailable: ...)").
#[derive(Clone, Debug)]
pub struct SelectedDevice {
    /// candle's device: where the model's candle tensors live.
    pub device: Device,
    pub description: String,
    /// Where the step runs when it is a plan of our kernels.
    pub plan: Option<PlanTarget>,
}

pub fn select(choice: DeviceChoice) -> Result<SelectedDevice> {
    let cpu = |note: Option<String>| SelectedDevice {
        device: Device::Cpu,
        description: match note {
            Some(note) => format!("{} ({note})", cpu_description()),
            None => cpu_description(),
        },
        plan: None,
    };
    match choice {
        DeviceChoice::Cpu => Ok(cpu(None)),
        DeviceChoice::MetalEmulated => {
            metal_emulated_available().map_err(WorkerError::Unsupported)?;
            Ok(SelectedDevice {
                device: Device::Cpu,
                description: "metal-emulated (the Metal step plan in the CPU emulator)".into(),
                plan: Some(PlanTarget::MetalEmulated),
            })
        }
        DeviceChoice::Metal => open_metal().map_err(WorkerError::Unsupported),
        DeviceChoice::Auto if cfg!(all(target_os = "macos", target_arch = "aarch64")) => match open_metal() {
            Ok(metal) => Ok(metal),
            Err(why) => {
                tracing::warn!("--device auto: {why}; running on the CPU");
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

/// Where tests run the Metal step plan, and the device it runs on: the
/// GPU with `TINYVLLM_TEST_DEVICE=metal` (the macOS CI job), the CPU
/// emulator of our kernels elsewhere.
pub fn test_plan() -> (PlanTarget, Device) {
    match std::env::var("TINYVLLM_TEST_DEVICE").as_deref() {
        Ok("metal") => (PlanTarget::Metal, test_device()),
        _ => (PlanTarget::MetalEmulated, Device::Cpu),
    }
}

/// The oldest macOS on which candle 0.11's Metal device opens: it creates an
/// `MTLResidencySet` (macOS 15 API) unconditionally, which aborts the
/// process on macOS 14 rather than returning an error.
pub const METAL_MIN_MACOS: u32 = 15;

/// The major version in a `SystemVersion.plist` (`<key>ProductVersion</key>`
/// then `<string>15.1.1</string>`).
#[cfg(any(target_os = "macos", test))]
fn macos_major_version(plist: &str) -> Option<u32> {
    let after_key = &plist[plist.find("<key>ProductVersion</key>")? + "<key>ProductVersion</key>".len()..];
    let value = after_key.trim_start().strip_prefix("<string>")?;
    let value = &value[..value.find("</string>")?];
    value.trim().split('.').next()?.parse().ok()
}

/// Why candle's Metal device cannot be opened on the macOS of `plist`, if
/// it cannot; an unreadable version is left to candle to judge.
#[cfg(any(target_os = "macos", test))]
fn macos_too_old(plist: Option<&str>) -> Option<String> {
    let major = macos_major_version(plist?)?;
    (major < METAL_MIN_MACOS).then(|| {
        format!(
            "Metal workers need macOS {METAL_MIN_MACOS} (Sequoia) or newer, this is macOS {major}: \
             the Metal backend (candle 0.11) uses residency sets, which macOS {major} lacks"
        )
    })
}

#[cfg(target_os = "macos")]
fn open_metal() -> std::result::Result<SelectedDevice, String> {
    let plist = std::fs::read_to_string("/System/Library/CoreServices/SystemVersion.plist").ok();
    if let Some(why) = macos_too_old(plist.as_deref()) {
        return Err(why);
    }
    // candle panics instead of failing on some machines without a GPU.
    match std::panic::catch_unwind(|| Device::new_metal(0)) {
        // The step runs as one plan of our kernels (kernels::metal::step);
        // TINYVLLM_METAL_PLAN=0 keeps candle's composed ops instead.
        Ok(Ok(device)) => {
            let plan = (std::env::var("TINYVLLM_METAL_PLAN").as_deref() != Ok("0")).then_some(PlanTarget::Metal);
            Ok(SelectedDevice { device, description: "metal (Apple GPU 0)".into(), plan })
        }
        Ok(Err(e)) => Err(format!("no Metal device: {e}")),
        Err(_) => Err("no Metal device (candle panicked opening it)".into()),
    }
}

#[cfg(not(target_os = "macos"))]
fn open_metal() -> std::result::Result<SelectedDevice, String> {
    Err("this build has no Metal support (Metal workers need a macOS build on Apple Silicon)".into())
}

/// Why `--device metal-emulated` cannot run in this build, if it cannot.
fn metal_emulated_available() -> std::result::Result<(), String> {
    #[cfg(feature = "metal-emulated")]
    {
        kernels::metal::emulated::EmulatedGpu::new().map(|_| ()).map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "metal-emulated"))]
    {
        Err("this build has no metal-emulated device (build the worker with the cargo feature metal-emulated)".into())
    }
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
    fn macos_before_15_is_named_as_too_old_for_metal() {
        let plist = |v: &str| {
            format!(
                "<?xml version=\"1.0\"?>\n<plist version=\"1.0\">\n<dict>\n\t<key>ProductName</key>\n\t\
                 <string>macOS</string>\n\t<key>ProductVersion</key>\n\t<string>{v}</string>\n</dict>\n</plist>\n"
            )
        };
        assert_eq!(macos_major_version(&plist("15.1.1")), Some(15));
        assert_eq!(macos_major_version(&plist("26.0")), Some(26));
        let why = macos_too_old(Some(&plist("14.6.1"))).unwrap();
        assert!(why.contains("macOS 15") && why.contains("this is macOS 14"), "{why}");
        assert_eq!(macos_too_old(Some(&plist("15.0"))), None);
        // Unreadable: candle decides.
        assert_eq!(macos_too_old(None), None);
        assert_eq!(macos_too_old(Some("<plist></plist>")), None);
        assert_eq!(macos_too_old(Some("<key>ProductVersion</key><string>x</string>")), None);
    }

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
