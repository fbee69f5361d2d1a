//! The tools refuse bad flags with a message naming the flag and exit code 2, never a panic.

use std::process::Command;

/// Runs the tool at `path` with `args`; asserts exit code 2, `flag` in the message and no panic.
fn assert_refused(path: &str, args: &[&str], flag: &str) {
    let output = Command::new(path).args(args).output().expect("runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{path} {args:?}: {stderr}");
    assert!(
        stderr.contains(flag),
        "{path} {args:?} does not name {flag}: {stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "{path} {args:?} panicked: {stderr}"
    );
}

#[test]
fn bad_flags_are_errors_naming_the_flag() {
    let reproduce = env!("CARGO_BIN_EXE_reproduce");
    assert_refused(reproduce, &["--seeds", "0"], "--seeds");
    assert_refused(reproduce, &["--only", "vision"], "--only");
    assert_refused(
        env!("CARGO_BIN_EXE_bench_connectivity"),
        &["--runs", "0"],
        "--runs",
    );
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
