//! Compiles the Metal kernels (kernels/src/metal/*.metal, or the directory
//! in TINYVLLM_METAL_SRC, which tools/metal_mutants.sh points at planted-bug
//! copies) as C++ for the emulator, with cpp/msl.h standing in for Metal's
//! standard library and cpp/runtime.cpp as the execution model.
//!
//! The sources go through one mechanical rewrite, kept on the same line so
//! error lines match the original: a kernel-scope `threadgroup T name[N];`
//! becomes `static T name[N]; tvm::threadgroup_memory(name, sizeof(name));`
//! (see msl.h for why). Nothing else changes.
//!
//! Linux only, and only where a C++ compiler for the target exists (the
//! aarch64 cross build of tools/test_aarch64.sh has none): elsewhere the
//! crate builds without the emulator and `available()` says so.

use std::path::{Path, PathBuf};
use std::{env, fs};

const SOURCES: [&str; 5] =
    ["cache.metal", "paged_attention.metal", "prefill_attention.metal", "model.metal", "sample.metal"];

fn main() {
    println!("cargo:rustc-check-cfg=cfg(metal_emu)");
    println!("cargo:rerun-if-env-changed=TINYVLLM_METAL_SRC");
    println!("cargo:rerun-if-env-changed=TINYVLLM_METAL_EMU_ASAN");
    println!("cargo:rerun-if-changed=cpp");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let src = env::var("TINYVLLM_METAL_SRC").map(PathBuf::from).unwrap_or_else(|_| manifest.join("../src/metal"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("metal");
    fs::create_dir_all(&out).expect("create OUT_DIR/metal");
    for name in SOURCES {
        let path = src.join(name);
        println!("cargo:rerun-if-changed={}", path.display());
        let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        fs::write(out.join(name), prepare(&text, &path)).expect("write the prepared source");
    }

    if env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    let cpp = manifest.join("cpp");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .warnings(false)
        .include(&cpp)
        .include(&out)
        // Metal's `char` is signed, as the Q8_0 kernels assume.
        .flag_if_supported("-fsigned-char")
        .flag_if_supported("-Wno-attributes")
        .flag_if_supported("-Wno-unknown-attributes")
        .flag_if_supported("-Wno-ignored-attributes");
    if env::var("TINYVLLM_METAL_EMU_ASAN").is_ok_and(|v| v == "1") {
        build.flag("-fsanitize=address").flag("-fno-omit-frame-pointer");
        println!("cargo:rustc-link-lib=dylib=asan");
    }
    for file in [
        "runtime.cpp",
        "kernel_cache.cpp",
        "kernel_decode.cpp",
        "kernel_prefill.cpp",
        "kernel_model.cpp",
        "kernel_sample.cpp",
    ] {
        build.file(cpp.join(file));
    }
    match build.try_compile("tinyvllm_metal_emu") {
        Ok(()) => println!("cargo:rustc-cfg=metal_emu"),
        Err(e) => println!("cargo:warning=the Metal emulator is not built (no C++ compiler for this target?): {e}"),
    }
}

/// The source with each kernel-scope threadgroup array made a shared,
/// poisoned static, under a `#line` that names the original file.
fn prepare(text: &str, path: &Path) -> String {
    let mut out = format!("#line 1 \"{}\"\n", path.display());
    for line in text.lines() {
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        match trimmed.strip_prefix("threadgroup ").filter(|rest| rest.trim_end().ends_with("];")) {
            Some(rest) => {
                let decl = rest.trim_end();
                let name = decl[..decl.find('[').unwrap_or(0)].split_whitespace().last().unwrap_or("");
                out += &format!("{indent}static {decl} tvm::threadgroup_memory({name}, sizeof({name}));\n");
            }
            None => {
                out += line;
                out.push('\n');
            }
        }
    }
    out
}
