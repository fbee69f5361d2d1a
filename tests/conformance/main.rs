//! The conformance runner: recomputes every golden vector in `tests/golden` (format:
//! `tests/golden/README.md`) and compares, on every backend compiled into this build.
//!
//! ```text
//! cargo test --release --test conformance                        # Flex
//! cargo test --release --features wgpu,ndarray --test conformance # Flex, NdArray and wgpu
//! cargo test --release --features wgpu --test conformance -- --device wgpu [--dir DIR]
//! cargo test --release --test conformance -- --only hc,mhc         # those golden files alone
//! ```
//!
//! Prints one line per check, `name max_abs_err tolerance PASS|FAIL` (a file's lines as soon as
//! its checks are done), then `N passed, M failed`, and exits with status 1 if any check fails
//! (2 on a usage or file error). A test target with its own `main` (`harness = false`): libtest's
//! own flags (`--nocapture`, filters) are ignored.
//! `BURN_CONNECTIVITY_SKIP_WGPU=1` leaves wgpu out of the default list. `--float f64` runs every
//! model and input in f64 on each device (the golden values, stored in f32, are read into f64):
//! on CUDA, where Burn's f32 matrix products run in TF32 (about three decimal digits, so f32
//! runs there miss the f32 tolerances), this checks the crate's kernels without TF32. Flex,
//! NdArray and CUDA only: it is refused on wgpu, Vulkan and Metal, and leaves them out of the
//! default device list (see `tests/golden/README.md`). `--float f16|bf16` runs them in a half
//! type, each check's tolerance at least a few of the type's roundoffs of the reference's scale
//! (`checks::Floors`); a default device without the type is left out (bf16 on wgpu), a named
//! one is an error.

mod checks;

use std::path::PathBuf;
use std::process::ExitCode;

use burn::tensor::FloatDType;
use burn_connectivity::device::{compiled_backends, device};

struct Flags {
    dir: PathBuf,
    devices: Vec<String>,
    /// The golden files to check, by name (`hc`, `mhc`, ...); all where empty.
    only: Vec<String>,
    /// The float type the models and inputs run in (`--float f32|f64|f16|bf16`, default f32).
    float: FloatDType,
    /// Whether `devices` were named (`--device`), not the compiled backends by default.
    named: bool,
}

/// The backends whose f64 results Burn 0.22.1 gets wrong (see `tests/golden/README.md`).
const NO_F64: [&str; 3] = ["wgpu", "vulkan", "metal"];

fn parse(args: impl Iterator<Item = String>) -> Result<Flags, String> {
    let mut dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut devices = Vec::new();
    let mut only = Vec::new();
    let mut float = FloatDType::F32;
    let mut args = args.peekable();
    while let Some(arg) = args.next() {
        let mut value = |flag: &str| args.next().ok_or_else(|| format!("{flag} needs a value"));
        match arg.as_str() {
            "--dir" => dir = PathBuf::from(value("--dir")?),
            "--device" => devices.extend(value("--device")?.split(',').map(str::to_string)),
            "--only" => only.extend(value("--only")?.split(',').map(str::to_string)),
            "--float" => {
                float = match value("--float")?.as_str() {
                    "f32" => FloatDType::F32,
                    "f64" => FloatDType::F64,
                    "f16" => FloatDType::F16,
                    "bf16" => FloatDType::BF16,
                    other => return Err(format!("--float {other}: f32, f64, f16 or bf16")),
                }
            }
            _ => {} // libtest's flags and filters
        }
    }
    // Burn 0.22.1 takes an f64 default there, then computes wrong values (a plain
    // `tanh(x W + b)` on lavapipe): refused rather than run into false failures.
    let without_f64 = |name: &str| float == FloatDType::F64 && NO_F64.contains(&name);
    if let Some(name) = devices.iter().find(|name| without_f64(name.as_str())) {
        return Err(format!(
            "--device {name} --float f64: not on {}",
            NO_F64.join(", ")
        ));
    }
    let named = !devices.is_empty();
    if !named {
        let skip_wgpu = std::env::var_os("BURN_CONNECTIVITY_SKIP_WGPU").is_some();
        devices = compiled_backends()
            .into_iter()
            .filter(|&name| !((skip_wgpu && name == "wgpu") || without_f64(name)))
            .map(str::to_string)
            .collect();
    }
    let known = checks::KNOWN_FILES.map(|(file, _)| checks::golden_name(file));
    if let Some(unknown) = only.iter().find(|name| !known.contains(&name.as_str())) {
        return Err(format!(
            "--only {unknown}: no such golden file (known: {})",
            known.join(", ")
        ));
    }
    Ok(Flags {
        dir,
        devices,
        only,
        float,
        named,
    })
}

pub fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<bool, String> {
    let flags = parse(std::env::args().skip(1))?;
    if checks::run_dir(
        &flags.dir.join("nonexistent"),
        &burn::prelude::Device::flex(),
        &[],
        checks::Floors::default(),
        |_, _| {},
    )
    .is_ok()
    {
        return Err("a missing golden directory was not reported".to_string());
    }
    let known: Vec<&str> = checks::KNOWN_FILES
        .iter()
        .map(|(file, _)| *file)
        .filter(|file| checks::selected(file, &flags.only))
        .collect();
    let (mut total, mut failed) = (0, 0);
    for name in &flags.devices {
        let mut device = device(name).map_err(|err| err.to_string())?;
        if flags.float != FloatDType::F32 {
            // Before any tensor on the device: its default float type locks on first use.
            if let Err(err) = device.configure(flags.float) {
                let message = format!("{name}: --float {:?}: {err}", flags.float);
                if flags.named {
                    return Err(message);
                }
                // A default device without the type (bf16 on wgpu) is left out, and said so.
                println!("== {message}: left out");
                continue;
            }
        }
        println!("== {name} ({:?})", flags.float);
        // Each file's lines as soon as its checks are done: on a GPU the first run of a check
        // compiles its kernels, and a run cut off by a time limit keeps the files it finished.
        let floors = checks::Floors::for_float(flags.float);
        let results = checks::run_dir(&flags.dir, &device, &flags.only, floors, |_, checks| {
            for check in checks {
                println!("{name} {check}");
            }
            let _ = std::io::Write::flush(&mut std::io::stdout());
        })?;
        let files: Vec<&str> = results.iter().map(|(file, _)| file.as_str()).collect();
        if files != known {
            return Err(format!(
                "{}: golden files {files:?}, expected every known file {known:?}",
                flags.dir.display()
            ));
        }
        for (file, checks) in results {
            if checks.is_empty() {
                return Err(format!("{file}: no checks"));
            }
            total += checks.len();
            failed += checks.iter().filter(|check| !check.passed()).count();
        }
    }
    if total == 0 {
        // Every default device left out: a run that checked nothing has not passed.
        return Err(format!("--float {:?}: no device ran a check", flags.float));
    }
    println!("{} passed, {failed} failed", total - failed);
    Ok(failed == 0)
}
