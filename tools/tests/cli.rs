//! The tools: bad flags refused with a message naming the flag and exit code 2, never a panic;
//! the model workload at reduced size; the kernel counts within their targets.

use std::path::Path;
use std::process::Command;
use std::sync::{Mutex, MutexGuard};

use burn_connectivity_tools::assert_refused;

/// Held by every test while its tools run, so they run one at a time: a benchmark's load on both
/// cores would skew the timings by which CubeCL's autotune picks kernels in `kernel_counts`
/// (fused kernel or fallback, some of which tie on lavapipe), and the counts with them.
static ONE_TOOL_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_tool_at_a_time() -> MutexGuard<'static, ()> {
    // A test that failed while holding it leaves it poisoned; the others still run.
    ONE_TOOL_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[test]
fn bad_flags_are_errors_naming_the_flag() {
    let _alone = one_tool_at_a_time();
    let reproduce = Path::new(env!("CARGO_BIN_EXE_reproduce"));
    assert_refused(reproduce, &["--seeds", "0"], "--seeds");
    assert_refused(reproduce, &["--only", "vision"], "--only");
    assert_refused(reproduce, &["--quick", "--scale"], "--scale");
    let bench = Path::new(env!("CARGO_BIN_EXE_bench_connectivity"));
    assert_refused(bench, &["--runs", "0"], "--runs");
    assert_refused(bench, &["--variants", "resnet"], "--variants");
    #[cfg(feature = "wgpu")]
    {
        let counts = Path::new(env!("CARGO_BIN_EXE_kernel_counts"));
        assert_refused(counts, &["--variants", "resnet"], "--variants");
    }
}

#[test]
fn help_lists_every_flag_with_its_default() {
    let _alone = one_tool_at_a_time();
    let output = Command::new(env!("CARGO_BIN_EXE_reproduce"))
        .arg("--help")
        .output()
        .expect("runs");
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for expected in [
        "--seeds",
        "--quick",
        "--scale",
        "--only",
        "--out",
        "--device",
        "[default: flex]",
    ] {
        assert!(help.contains(expected), "--help lacks {expected}: {help}");
    }
}

/// The model-scale workload runs every variant at GPT-2-small width (reduced to `[1, 32]`
/// tokens on Flex) and reports a forward and a train-step line for each.
#[test]
fn model_workload_runs_every_variant_at_reduced_size() {
    let _alone = one_tool_at_a_time();
    let output = Command::new(env!("CARGO_BIN_EXE_bench_connectivity"))
        .args(["--only", "model", "--runs", "1", "--warmup", "0"])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("[1, 32, 768]"), "{stderr}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    for variant in VARIANTS {
        for pass in ["forward", "train_step"] {
            let line = format!(r#""workload":"model.{pass}","variant":"{variant}""#);
            assert!(stdout.contains(&line), "no {line} in {stdout}");
        }
    }
}

/// The encoder workload wires burn-nn's encoder layers through every variant (train step only:
/// it runs the forward too), reduced to `[1, 32]` tokens on Flex.
#[test]
fn encoder_workload_wraps_every_variant_at_reduced_size() {
    let _alone = one_tool_at_a_time();
    let output = Command::new(env!("CARGO_BIN_EXE_bench_connectivity"))
        .args(["--only", "encoder", "--passes", "train-step"])
        .args(["--runs", "1", "--warmup", "0"])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("encoder layers (12 heads, causal) on [1, 32, 768]"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    for variant in VARIANTS {
        let line = format!(r#""workload":"encoder.train_step","variant":"{variant}""#);
        assert!(stdout.contains(&line), "no {line} in {stdout}");
    }
}

/// `--only connectivity` times every variant's connectivity alone next to the residual's whole
/// step, and prints each one's share of that step.
#[test]
fn connectivity_alone_times_every_variant() {
    let _alone = one_tool_at_a_time();
    let output = Command::new(env!("CARGO_BIN_EXE_bench_connectivity"))
        .args([
            "--only",
            "connectivity",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--depths",
            "2",
        ])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains(r#""workload":"stack2.train_step","variant":"residual""#),
        "{stdout}"
    );
    for variant in VARIANTS {
        let line = format!(r#""workload":"connectivity2.train_step","variant":"{variant}""#);
        assert!(stdout.contains(&line), "no {line} in {stdout}");
        if variant != "residual" {
            assert!(
                stderr.contains(&format!(" {variant}: alone ")),
                "no share for {variant} in {stderr}"
            );
        }
    }
}

/// `--pairs` times each variant against a residual of its own: a residual line before each
/// variant's, and one ratio per variant, to its pair's residual.
#[test]
fn pairs_give_each_variant_its_own_residual() {
    let _alone = one_tool_at_a_time();
    let output = Command::new(env!("CARGO_BIN_EXE_bench_connectivity"))
        .args([
            "--only", "stack", "--passes", "forward", "--runs", "1", "--warmup", "0",
        ])
        .args(["--variants", "dwa,hacn", "--pairs"])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = stdout
        .lines()
        .filter(|line| line.contains(r#""workload":"stack12.forward""#))
        .collect();
    let variant = |line: &str| {
        line.split(r#""variant":""#)
            .nth(1)
            .map(|rest| rest[..3].to_string())
    };
    let order: Vec<Option<String>> = lines.iter().map(|line| variant(line)).collect();
    let expected = ["res", "dwa", "res", "hac"].map(|v| Some(v.to_string()));
    assert_eq!(order, expected, "{stdout}");
    // Each round's times as they come (what a run stopped by a time limit keeps): per depth,
    // one line per pair, the residual beside its variant.
    let rounds: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains("round 1/1, ms: residual "))
        .collect();
    for variant in ["dwa", "hacn"] {
        let pairs = rounds
            .iter()
            .filter(|line| line.contains(&format!(", {variant} ")))
            .count();
        assert_eq!(pairs * 2, rounds.len(), "{variant}: {stderr}");
    }
    for variant in ["dwa", "hacn"] {
        let ratios = stderr
            .lines()
            .filter(|line| {
                line.contains("stack12.forward") && line.contains(&format!(" {variant}: time"))
            })
            .count();
        assert_eq!(ratios, 1, "{variant}: {stderr}");
    }
}

/// Every variant as `--variants` names it (`hacn_frozen` aside), the residual first.
const VARIANTS: [&str; 13] = [
    "residual",
    "hacn",
    "ancre",
    "hyperzzw",
    "hc",
    "mhc",
    "dwa",
    "attnres",
    "block_attnres",
    "laurel",
    "mhc_lite",
    "mhc_v4",
    "mudd",
];

/// `kernel_counts` on wgpu (lavapipe in CI): a train step of every counted connectivity within
/// its target of extra kernels per block over the residual's (H-ACN ≤ 2, ANCRe ≤ 3, DWA ≤ 3,
/// HC ≤ 8, mHC ≤ 8) at depth 4, and a JSON line per variant and pass.
///
/// Some of the fusion engine's choices between a fused kernel and its fallback tie on lavapipe
/// and fall either way in a fresh process (see the tool's docs: HC 7.50 or 8.25 extra per block
/// on one commit). A variant that misses is counted again in fresh processes, each deciding
/// anew (`CUBECL_AUTOTUNE_CACHE=0`), and fails after `COUNT_TRIES` misses: a regression of
/// the crate's kernels misses every time.
#[cfg(feature = "wgpu")]
#[test]
fn kernel_counts_meet_the_train_step_targets() {
    let _alone = one_tool_at_a_time();
    const COUNT_TRIES: usize = 4;
    // The variants with a train-step target, as `--variants` names them.
    const TARGETED: [&str; 5] = ["hacn", "ancre", "hc", "mhc", "dwa"];
    let count = |variants: &str| {
        let output = Command::new(env!("CARGO_BIN_EXE_kernel_counts"))
            .args(["--depth", "4", "--variants", variants])
            .env("CUBECL_AUTOTUNE_CACHE", "0")
            .output()
            .expect("runs");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    };
    // The train step's table line of `variant`, e.g. `hc:  106 kernels (…) (target <= 8: met)`.
    let verdict = |stdout: &str, variant: &str| {
        let line = stdout
            .lines()
            .find(|line| {
                line.trim_start().starts_with(&format!("{variant}:")) && line.contains("target")
            })
            .unwrap_or_else(|| panic!("no train step line of {variant} in {stdout}"))
            .to_string();
        (line.ends_with(": met)"), line)
    };
    let stdout = count(&TARGETED.join(","));
    for variant in std::iter::once("residual").chain(TARGETED) {
        for pass in ["forward", "forward_autodiff", "train_step"] {
            let line = format!(r#"{{"variant": "{variant}", "pass": "{pass}", "depth": 4,"#);
            assert!(stdout.contains(&line), "no {line} in {stdout}");
        }
    }
    let mut missed: Vec<(&str, Vec<String>)> = TARGETED
        .into_iter()
        .filter_map(|variant| {
            let (met, line) = verdict(&stdout, variant);
            (!met).then(|| (variant, vec![line]))
        })
        .collect();
    for _ in 1..COUNT_TRIES {
        if missed.is_empty() {
            break;
        }
        let names: Vec<&str> = missed.iter().map(|(variant, _)| *variant).collect();
        let stdout = count(&names.join(","));
        missed.retain_mut(|(variant, lines)| {
            let (met, line) = verdict(&stdout, variant);
            lines.push(line);
            !met
        });
    }
    assert!(missed.is_empty(), "missed in every try: {missed:#?}");
}
