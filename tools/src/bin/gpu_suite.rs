//! One binary for a GPU machine that has no Rust toolchain: `bench_connectivity`,
//! `kernel_counts`, the `lm_wrap` example and the conformance runner behind one `main`, so that
//! they share their code (one CubeCL build of Burn instead of four, what the device tool can carry).
//! Built and used by `tools/gpu/build.sh` and `tools/gpu/measure.sh`.
//!
//! ```text
//! ln -s gpu_suite bench_connectivity && ./bench_connectivity --device cuda --only model
//! ```

#[path = "bench_connectivity.rs"]
mod bench;
#[path = "../../../tests/conformance/main.rs"]
mod conformance;
#[path = "kernel_counts.rs"]
mod counts;
#[path = "../../../examples/lm_wrap.rs"]
mod lm;

use std::process::ExitCode;

/// Runs the program the binary was called as (`argv[0]`'s file name: a link named after it), so
/// that each program reads its own flags from `std::env::args()` unchanged.
fn main() -> ExitCode {
    let called = std::env::args().next().unwrap_or_default();
    let name = std::path::Path::new(&called)
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    match name.as_str() {
        "bench_connectivity" => bench::main(),
        "kernel_counts" => counts::main(),
        "lm_wrap" => lm::main(),
        "conformance" => conformance::main(),
        _ => {
            eprintln!(
                "gpu_suite runs as a link named bench_connectivity, kernel_counts, lm_wrap or \
                 conformance (called as {called})"
            );
            ExitCode::from(2)
        }
    }
}
