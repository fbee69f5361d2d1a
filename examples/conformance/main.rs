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

const USAGE: &str = "usage: conformance DIR [--device flex|ndarray|wgpu|vulkan|metal|cuda]";

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("error: {message}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<bool, String> {
    let args = common::Args::parse(USAGE, &[])?;
    let [dir] = args.positional.as_slice() else {
        return Err("expected exactly one DIR".to_string());
    };
    let dir = PathBuf::from(dir);
    let device = args.device()?;

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
