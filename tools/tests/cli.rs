//! The tools refuse bad flags with a message naming the flag and exit code 2, never a panic.

use std::path::Path;
use std::process::Command;

use burn_connectivity_tools::assert_refused;

#[test]
fn bad_flags_are_errors_naming_the_flag() {
    let reproduce = Path::new(env!("CARGO_BIN_EXE_reproduce"));
    assert_refused(reproduce, &["--seeds", "0"], "--seeds");
    assert_refused(reproduce, &["--only", "vision"], "--only");
    let bench = Path::new(env!("CARGO_BIN_EXE_bench_connectivity"));
    assert_refused(bench, &["--runs", "0"], "--runs");
}

#[test]
fn help_lists_every_flag_with_its_default() {
    let output = Command::new(env!("CARGO_BIN_EXE_reproduce"))
        .arg("--help")
        .output()
        .expect("runs");
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for expected in [
        "--seeds",
        "--quick",
        "--only",
        "--out",
        "--device",
        "[default: flex]",
    ] {
        assert!(help.contains(expected), "--help lacks {expected}: {help}");
    }
}
