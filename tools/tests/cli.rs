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

/// `kernel_counts` on wgpu (lavapipe in CI), train step at depth 4: a JSON line per variant and
/// pass, and for each connectivity with a target (H-ACN ≤ 2, ANCRe ≤ 3, DWA ≤ 3, HC ≤ 8,
/// mHC ≤ 8 extra kernels per block over the residual's):
///
/// - **its own kernels** (the crate's, which no autotune chooses; they repeat exactly between
///   processes) within the crate's plan: one per block more launches one kernel too many;
/// - **Burn's kernels** at most `MOST_BURN_EXTRA` per block over the residual's: a fall back
///   to composed tensor ops costs tens of them;
/// - **the whole count within its target**.
///
/// The whole count varies between processes: CubeCL's autotune picks, once per process and by
/// timing, between the fused kernel of each block's LayerNorm forward (with the ops around it)
/// and its fallback; these tie on lavapipe, and a connectivity's norms (after one of the crate's
/// kernels) share their key with the residual's first norm only. Burn's part of HC's count then
/// moves by −1.00 to +1.25 per block on one commit (see BENCHMARKS.md, "HC and mHC over their
/// kernel target in some processes"); HC's and mHC's own 6.50 keep them within 8 either way.
/// Whole counts that miss are counted again in fresh processes, each deciding anew
/// (`CUBECL_AUTOTUNE_CACHE=0`); the test fails after `COUNT_TRIES` misses in a row.
#[cfg(feature = "wgpu")]
#[test]
fn train_step_kernel_counts_keep_the_crates_plan_and_meet_the_targets() {
    let _alone = one_tool_at_a_time();
    const COUNT_TRIES: usize = 4;
    // The variants with a train-step target, as `--variants` names them, with their target and
    // the extra kernels per block of their own that the crate's plan launches (depth 4).
    const TARGETED: [(&str, f64, f64); 5] = [
        ("hacn", 2.0, 1.0),
        ("ancre", 3.0, 2.75),
        ("hc", 8.0, 6.5),
        ("mhc", 8.0, 6.5),
        ("dwa", 3.0, 2.5),
    ];
    // Burn's kernels per block over the residual's: its autotune moves them by -1.0 to +1.25
    // (HC, seen); the composed forms cost tens.
    const MOST_BURN_EXTRA: f64 = 2.0;
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
    // The train step's JSON line of `variant`, as (whole, own) extra kernels per block.
    let train_step = |stdout: &str, variant: &str| {
        let line = stdout
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .find(|row| row["variant"] == variant && row["pass"] == "train_step")
            .unwrap_or_else(|| panic!("no train step line of {variant} in {stdout}"));
        let number = |key: &str| {
            line[key]
                .as_f64()
                .unwrap_or_else(|| panic!("no {key} in {line}"))
        };
        (number("extra_per_block"), number("own_extra_per_block"))
    };
    let names: Vec<&str> = TARGETED.iter().map(|(variant, ..)| *variant).collect();
    let stdout = count(&names.join(","));
    for variant in std::iter::once("residual").chain(names.iter().copied()) {
        for pass in ["forward", "forward_autodiff", "train_step"] {
            let line = format!(r#"{{"variant": "{variant}", "pass": "{pass}", "depth": 4,"#);
            assert!(stdout.contains(&line), "no {line} in {stdout}");
        }
    }
    for (variant, _, plan) in TARGETED {
        let (whole, own) = train_step(&stdout, variant);
        assert!(
            own <= plan,
            "{variant}: {own:+.2} kernels of the crate's own per block, the plan has {plan:+.2}"
        );
        assert!(
            whole - own <= MOST_BURN_EXTRA,
            "{variant}: {:+.2} of Burn's kernels per block over the residual's (of {whole:+.2})",
            whole - own
        );
    }
    let within = |stdout: &str, variant: &str| {
        let (whole, _) = train_step(stdout, variant);
        let (_, target, _) = TARGETED.iter().find(|(name, ..)| *name == variant).unwrap();
        (whole <= *target, whole)
    };
    let mut missed: Vec<(&str, Vec<f64>)> = names
        .iter()
        .filter_map(|&variant| {
            let (met, whole) = within(&stdout, variant);
            (!met).then(|| (variant, vec![whole]))
        })
        .collect();
    for _ in 1..COUNT_TRIES {
        if missed.is_empty() {
            break;
        }
        let names: Vec<&str> = missed.iter().map(|(variant, _)| *variant).collect();
        let stdout = count(&names.join(","));
        missed.retain_mut(|(variant, counts)| {
            let (met, whole) = within(&stdout, variant);
            counts.push(whole);
            !met
        });
    }
    assert!(
        missed.is_empty(),
        "extra kernels per block over the target in every try: {missed:?}"
    );
}
