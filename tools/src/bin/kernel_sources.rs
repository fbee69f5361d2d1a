//! Writes the CUDA C++ that CubeCL makes of the crate's heaviest kernels at the model workload
//! (mHC's and HC's connection tables, the weights' gradient; built for an NVIDIA H100, no GPU
//! needed), one `.cu` file each, and `kernels.json` listing them with their launches.
//! `tools/gpu/sass.sh` runs it and then reads the kernels' machine code.
//!
//! ```sh
//! cargo run --release -p burn-connectivity-tools --features kernel-source --bin kernel_sources -- --out target/sass
//! ```

use std::path::PathBuf;

use clap::Parser;

/// Write the CUDA C++ of the crate's heaviest kernels.
#[derive(Parser)]
struct Args {
    /// The folder to write into (made if missing).
    #[arg(long, default_value = "target/sass")]
    out: PathBuf,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.out)?;
    let kernels = burn_connectivity::kernel_source::model_workload_kernels()?;
    let mut listing = Vec::new();
    for kernel in &kernels {
        let file = format!("{}.cu", kernel.entry);
        std::fs::write(args.out.join(&file), &kernel.source)?;
        println!(
            "{:<24} {:<44} {:>4} units × {:>6} cubes  {file}",
            kernel.name, kernel.case, kernel.threads, kernel.cubes
        );
        listing.push(serde_json::json!({
            "name": kernel.name,
            "case": kernel.case,
            "entry": kernel.entry,
            "file": file,
            "threads": kernel.threads,
            "shared_bytes": kernel.shared_bytes,
            "cubes": kernel.cubes,
        }));
    }
    std::fs::write(
        args.out.join("kernels.json"),
        serde_json::to_string_pretty(&listing)?,
    )?;
    Ok(())
}
