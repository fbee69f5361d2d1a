//! Recomputes every golden vector it knows in a directory and compares.
//!
//! ```text
//! cargo run --release --example conformance -- tests/golden [--device flex|ndarray|wgpu|…]
//! ```
//!
//! Prints one line per check, `name max_abs_err tolerance PASS|FAIL`, and exits with status 1
//! if any check fails (2 on a usage or file error).

mod checks;
#[path = "../common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Recomputes the golden reference vectors in a directory and compares.
#[derive(Parser, Debug)]
#[command(long_about = None)]
struct Flags {
    /// Directory of `*.safetensors` golden files (the crate's: tests/golden).
    dir: PathBuf,
    #[command(flatten)]
    device: common::DeviceArg,
}

fn main() -> ExitCode {
    match run(Flags::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}

fn run(flags: Flags) -> Result<bool, String> {
    let dir = flags.dir;
    let device = flags.device.device()?;

    let mut failed = 0;
    let mut total = 0;
    for (_, checks) in checks::run_dir(&dir, &device)? {
        for check in checks {
            println!("{check}");
            total += 1;
            failed += usize::from(!check.passed());
        }
    }
    println!("{} passed, {failed} failed", total - failed);
    Ok(failed == 0)
}
