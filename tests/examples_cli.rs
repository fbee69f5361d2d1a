//! The examples refuse bad flags with a message naming the flag and exit code 2, never a panic.
//! `cargo test` builds the examples next to this test's binary (`target/<profile>/examples/`).

use std::path::PathBuf;

/// The built example `name`.
fn example(name: &str) -> PathBuf {
    let test = std::env::current_exe().expect("the test binary's path");
    let profile = test
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps/<test>");
    profile.join("examples").join(name)
}

/// Runs the example `name` with `args`; asserts exit code 2, `flag` in the message and no panic.
fn assert_refused(name: &str, args: &[&str], flag: &str) {
    let path = example(name);
    assert!(path.exists(), "{} not built", path.display());
    burn_connectivity_tools::assert_refused(&path, args, flag);
}

#[test]
fn bad_flags_are_errors_naming_the_flag() {
    assert_refused(
        "lm_wrap",
        &["--connectivity", "resnet,hacn"],
        "--connectivity",
    );
    assert_refused("lm_wrap", &["--steps", "10", "--warmup", "10"], "--warmup");
    assert_refused("lm_wrap", &["--clip", "inf"], "--clip");
    assert_refused("lm_wrap", &["--clip", "NaN"], "--clip");
    assert_refused("lm_wrap", &["--ancre-tau", "0"], "--ancre-tau");
    assert_refused("quickstart", &["--lr=-1"], "--lr");
    assert_refused("quickstart", &["--blocks", "0"], "--blocks");
    assert_refused("quickstart", &["--device", "tpu"], "tpu");
    assert_refused("llama_wrap", &["--heads", "3"], "--heads");
    assert_refused("llama_wrap", &["--steps", "0"], "--steps");
    if cfg!(feature = "train") {
        assert_refused("ddp_wrap", &["--strategy", "ddp"], "--strategy ddp");
    }
}
