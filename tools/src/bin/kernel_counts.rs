//! Counts the GPU kernels the connectivity adds to a forward pass and to a train step on a
//! CubeCL backend (wgpu by default; Mesa's lavapipe where there is no GPU).
//!
//! ```text
//! cargo run --release -p burn-connectivity-tools --features wgpu --bin kernel_counts [-- --device wgpu --depth 4 --variants hc,mhc]
//! ```
//!
//! Every launch is counted through CubeCL's launch observer, with the queued work flushed before
//! and after, once the count has settled: passes repeat until two in a row launch as many
//! kernels (a pass that meets an operation the autotuner has not seen yet also launches the
//! benchmarks of its candidates: 13 extra matrix products in one forward pass, seen here), so a
//! count is what one pass launches.
//!
//! Which kernels a pass launches also depends on CubeCL's autotune, which picks between the
//! fusion engine's fused kernels and their fallbacks (more, smaller kernels) by timing, once per
//! process (and keeps its picks for later processes, unless `CUBECL_AUTOTUNE_CACHE=0`). On
//! lavapipe some of them tie: the blocks' LayerNorm forward fused with the ops around it took
//! 6.25 ms fused and 6.44 ms through its fallback in one process (the fallback won, on its best
//! sample), 6.91 and 7.65 ms in the next. Four fresh processes on one commit counted the
//! residual's train step at 77, 76, 76 and 71 kernels and HC's at 110, 106, 106 and 110
//! (depth 4). `--no-broadcast-reduce-fusion` leaves out the fusion whose ties these were
//! (Burn's `ReduceBroadcasted`): the counts then repeat exactly, but they are not what a user
//! gets, and the residual's norm still fuses with its add there while a connectivity's, read
//! from one of the crate's kernels, does not. What repeats exactly whatever the autotune picks
//! is the count of the crate's own kernels (named under `burn_connectivity::`), which the
//! crate's plan launches: each count is printed with it.
//!
//! It reports, for a stack of pre-LN MLP blocks on `[8, 128, 256]`:
//! the kernels of a forward pass (without and under autodiff) and of a train step (forward and
//! backward of the mean output) per variant, with the difference to the plain residual loop per
//! block, the same for the crate's own kernels, and, for the train step, the crate's targets;
//! then one JSON line per variant and pass,
//!
//! ```text
//! {"variant": "mhc", "pass": "train_step", "depth": 4, "kernels": 98, "extra_per_block": 5.50, "own_kernels": 34, "own_extra_per_block": 6.50, "device": "wgpu", "trained_input": false}
//! ```
//!
//! (`pass`: `forward`, `forward_autodiff` or `train_step`); and the kernels of one connectivity
//! step on its own, for the crate's formulation and for the alternatives it was compared with.
//!
//! The train step's stack input is a constant by default, so the residual stack never
//! differentiates its first block's input; a connectivity with parameters before the first block
//! (HC's and mHC's first mixing) must (once per pass; about 20 kernels while LayerNorm's
//! backward was composed, one since). `--trained-input` makes the input require a gradient, as
//! under a trained embedding, where every variant pays them.

use burn_connectivity_tools as common;
use burn_connectivity_tools::workloads;

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::prelude::*;
use burn::tensor::Distribution;
use burn_connectivity::{
    AncreConfig, ConnectivityConfig, HacnConfig, MhcConfig, StreamConnectivity, sinkhorn_knopp,
};
use clap::Parser;
use cubecl_runtime::logging::{LaunchObservation, LaunchObserver};
use workloads::{LENGTH, Model, Variant, WIDTH, stack_input};

/// Counts the kernels a forward pass launches on a CubeCL backend, per connectivity.
#[derive(Parser, Debug)]
#[command(long_about = None)]
struct Flags {
    /// CubeCL backend: wgpu, vulkan, metal or cuda (those compiled in).
    #[arg(long, default_value = "wgpu")]
    device: String,
    /// Blocks in the stack.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    depth: u64,
    /// Variants, comma separated (default: all counted; the residual is always counted).
    #[arg(long, default_value = "")]
    variants: String,
    /// The stack input of the train step requires a gradient, as under a trained embedding
    /// (by default it is a constant: the residual then never differentiates block 1's input,
    /// which a connectivity with parameters before block 1 must).
    #[arg(long)]
    trained_input: bool,
    /// Leave out Burn's broadcast-reduction fusion, whose autotune's choice between its fused
    /// kernel and its fallback makes the counts vary between processes on lavapipe.
    #[arg(long)]
    no_broadcast_reduce_fusion: bool,
}

#[derive(Default)]
struct Counter {
    launches: AtomicUsize,
    names: std::sync::Mutex<Vec<&'static str>>,
}

impl LaunchObserver for Counter {
    fn launched(&self, kernel: &'static str) {
        self.launches.fetch_add(1, Ordering::Relaxed);
        self.names.lock().unwrap().push(kernel);
    }
}

/// Passes counted at most before a count must have settled.
const MAX_PASSES: usize = 8;

/// The kernels one run of some work launched.
#[derive(Clone, Copy, Debug)]
struct Launches {
    /// Every kernel.
    total: usize,
    /// This crate's own kernels (named under `burn_connectivity::`). Which of them a pass
    /// launches is the crate's plan and no autotune's: these repeat exactly between processes.
    own: usize,
}

/// The kernels of this crate are named after their module path.
const OWN_KERNEL_PREFIX: &str = "burn_connectivity::";

/// Kernels launched by one run of `work`, all queued work flushed, once two runs in a row
/// launched as many (after one run for compilation).
fn count<T>(device: &Device, work: impl Fn() -> T) -> usize {
    count_launches(device, work).total
}

/// [`count`], with this crate's own kernels counted apart.
fn count_launches<T>(device: &Device, work: impl Fn() -> T) -> Launches {
    let sync = || device.sync().expect("device sync");
    drop(work());
    sync();
    let observed = || {
        let counter = Arc::new(Counter::default());
        let observation = LaunchObservation::new(counter.clone());
        let output = work();
        sync();
        drop(observation);
        drop(output);
        counter
    };
    let launches = |counter: &Counter| counter.launches.load(Ordering::Relaxed);
    let mut last = observed();
    let mut settled = false;
    for _ in 1..MAX_PASSES {
        let counter = observed();
        settled = launches(&counter) == launches(&last);
        last = counter;
        if settled {
            break;
        }
    }
    if !settled {
        eprintln!("warning: the count had not settled after {MAX_PASSES} passes");
    }
    let names = last.names.lock().unwrap();
    if std::env::var_os("KERNEL_NAMES").is_some() {
        for name in names.iter() {
            eprintln!("    {name}");
        }
    }
    Launches {
        total: launches(&last),
        own: names
            .iter()
            .filter(|name| name.starts_with(OWN_KERNEL_PREFIX))
            .count(),
    }
}

/// The fusion optimization `--no-broadcast-reduce-fusion` leaves out.
const BROADCAST_REDUCE_FUSION: &str = "ReduceBroadcasted";

/// Leaves Burn's broadcast-reduction fusion out; before the first tensor operation.
fn without_broadcast_reduce_fusion() -> Result<(), String> {
    use burn_cubecl::fusion::{BUILTIN_NAMES, remove};
    // `remove` takes an unknown name silently: a renamed optimization must not go unnoticed.
    if !BUILTIN_NAMES.contains(&BROADCAST_REDUCE_FUSION) {
        return Err(format!(
            "Burn has no fusion optimization named {BROADCAST_REDUCE_FUSION} any more (it has {BUILTIN_NAMES:?})"
        ));
    }
    remove(BROADCAST_REDUCE_FUSION).map_err(|err| err.to_string())
}

/// The variants counted, the residual first (the baseline).
const COUNTED: [Variant; 13] = [
    Variant::Residual,
    Variant::Hacn,
    Variant::Ancre,
    Variant::HyperZzw,
    Variant::Hc,
    Variant::Mhc,
    Variant::Dwa,
    Variant::AttnRes,
    Variant::BlockAttnRes,
    Variant::MhcV4,
    Variant::Laurel,
    Variant::MhcLite,
    Variant::Mudd,
];

/// The most extra kernels per block over the residual's that a train step may launch.
fn target(variant: Variant) -> Option<f64> {
    match variant {
        Variant::Hacn => Some(2.0),
        Variant::Ancre | Variant::Dwa => Some(3.0),
        Variant::Hc | Variant::Mhc => Some(8.0),
        _ => None,
    }
}

/// What one count runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    /// A forward pass without autodiff.
    Forward,
    /// A forward pass on the autodiff device (what it records costs kernels too).
    ForwardAutodiff,
    /// Forward and backward of the mean output (the gradients of every parameter).
    TrainStep,
}

impl Pass {
    const ALL: [Pass; 3] = [Self::Forward, Self::ForwardAutodiff, Self::TrainStep];

    /// As in the JSON lines.
    fn name(self) -> &'static str {
        match self {
            Self::Forward => "forward",
            Self::ForwardAutodiff => "forward_autodiff",
            Self::TrainStep => "train_step",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Self::Forward => "forward pass (inference)",
            Self::ForwardAutodiff => "forward pass under autodiff",
            Self::TrainStep => "train step (forward and backward of the mean output)",
        }
    }
}

fn stream(device: &Device) -> Tensor<3> {
    Tensor::random([8, LENGTH, WIDTH], Distribution::Normal(0.0, 1.0), device)
}

pub fn main() -> ExitCode {
    common::exit(run(Flags::parse()))
}

fn run(flags: Flags) -> Result<(), String> {
    let counted: Vec<Variant> = Variant::selected(&flags.variants)?
        .into_iter()
        .filter(|variant| COUNTED.contains(variant))
        .collect();
    if flags.no_broadcast_reduce_fusion {
        without_broadcast_reduce_fusion()?;
    }
    let name = flags.device;
    let device = burn_connectivity::device::device(&name).map_err(|err| err.to_string())?;
    let depth = flags.depth as usize;
    let tracked = device.clone().autodiff();

    let input = stack_input(&device);
    let tracked_input = if flags.trained_input {
        stack_input(&tracked).require_grad()
    } else {
        stack_input(&tracked)
    };
    let mut rows = Vec::new();
    for pass in Pass::ALL {
        println!(
            "{} of {depth} pre-LN MLP blocks on [8, {LENGTH}, {WIDTH}] ({name}):",
            pass.title()
        );
        let mut baseline = None;
        for &variant in &counted {
            let launches = match pass {
                Pass::Forward => {
                    let model = Model::new(variant, depth, &device);
                    count_launches(&device, || model.forward(input.clone()))
                }
                Pass::ForwardAutodiff => {
                    let model = Model::new(variant, depth, &tracked);
                    count_launches(&tracked, || model.forward(tracked_input.clone()))
                }
                Pass::TrainStep => {
                    let model = Model::new(variant, depth, &tracked);
                    count_launches(&tracked, || model.train_step(tracked_input.clone()))
                }
            };
            let base = *baseline.get_or_insert(launches);
            let per_block = |count: usize, base: usize| (count as f64 - base as f64) / depth as f64;
            let (kernels, own) = (launches.total, launches.own);
            let extra = per_block(kernels, base.total);
            let own_extra = per_block(own, base.own);
            let verdict = match (pass, target(variant)) {
                (Pass::TrainStep, Some(limit)) if extra <= limit => {
                    format!(" (target <= {limit}: met)")
                }
                (Pass::TrainStep, Some(limit)) => format!(" (target <= {limit}: NOT met)"),
                _ => String::new(),
            };
            println!(
                "  {:>9}: {kernels:>4} kernels ({extra:+.2} per block vs residual; the crate's own {own:>3}, {own_extra:+.2}){verdict}",
                variant.name(),
            );
            rows.push(format!(
                r#"{{"variant": "{}", "pass": "{}", "depth": {depth}, "kernels": {kernels}, "extra_per_block": {extra:.2}, "own_kernels": {own}, "own_extra_per_block": {own_extra:.2}, "device": "{name}", "trained_input": {}}}"#,
                variant.name(),
                pass.name(),
                flags.trained_input,
            ));
        }
    }
    for row in &rows {
        println!("{row}");
    }
    // A chosen few variants: their counts only, not the single steps below.
    if !flags.variants.is_empty() {
        return Ok(());
    }

    println!("one connectivity step on its own (block 2 of {depth}):");
    for (mode, device) in [("inference", &device), ("under autodiff", &tracked)] {
        let (branch, previous) = (stream(device), stream(device));
        let hacn = HacnConfig::new()
            .init(depth, device)
            .map_err(|err| err.to_string())?;
        let state = hacn.start(previous.clone());
        let kernels = count(device, || {
            let next = hacn.step(state.clone(), 1, branch.clone());
            (next.stream, next.sum)
        });
        println!("  H-ACN step (acc += h; s = h + a s), {mode}: {kernels} kernel(s)");
        let ancre = AncreConfig::new()
            .init(depth, device)
            .map_err(|err| err.to_string())?;
        let start = ancre.start(previous.clone());
        let kernels = count(device, || ancre.step(start.clone(), 0, branch.clone()));
        println!(
            "  ANCRe step (s_1 = h_1 + mixture, then {} pending mixtures += p s_1), {mode}: {kernels} kernel(s)",
            depth - 1
        );
        let mhc = MhcConfig::new(WIDTH)
            .init(depth, device)
            .map_err(|err| err.to_string())?;
        let start = mhc.start(previous);
        let kernels = count(device, || mhc.step(start.clone(), 0, branch.clone()).units);
        println!(
            "  mHC step (S' = H_res^T S + H_post h, then the next block's H_pre, H_post, H_res with 20 Sinkhorn iterations and its input), {mode}: {kernels} kernel(s)"
        );
        let logits = Tensor::<3>::random([8 * LENGTH, 4, 4], Distribution::Default, device);
        let kernels = count(device, || {
            sinkhorn_knopp(logits.clone(), 20).expect("square")
        });
        println!(
            "  Sinkhorn-Knopp alone, 20 iterations on [{}, 4, 4], {mode}: {kernels} kernel(s)",
            8 * LENGTH
        );
    }
    let logits = Tensor::<3>::random([8 * LENGTH, 4, 4], Distribution::Default, &tracked);
    let weights = Tensor::<3>::random([8 * LENGTH, 4, 4], Distribution::Default, &tracked);
    let kernels = count(&tracked, || {
        let leaf = logits.clone().require_grad();
        let output = sinkhorn_knopp(leaf.clone(), 20).expect("square");
        let grads = (output * weights.clone()).sum().backward();
        leaf.grad(&grads)
    });
    println!(
        "  Sinkhorn-Knopp forward and backward (gradient of a weighted sum, whose product and sum count too), 20 iterations: {kernels} kernel(s)"
    );

    println!("formulations of a scaled add s + p_i h with p_i an entry of a parameter tensor:");
    let (sum, branch) = (stream(&device), stream(&device));
    let weights = Tensor::<1>::random([depth], Distribution::Default, &device);
    let position = || Tensor::<1, Int>::from_data([1], &device);
    let kernels = count(&device, || {
        sum.clone() + branch.clone() * weights.clone().narrow(0, 1, 1).reshape([1, 1, 1])
    });
    println!("  slice: {kernels} kernel(s)");
    let kernels = count(&device, || {
        sum.clone() + branch.clone() * weights.clone().select(0, position()).reshape([1, 1, 1])
    });
    println!("  select (the crate's formulation under autodiff off CubeCL): {kernels} kernel(s)");
    let width = branch.dims()[2];
    let rows = (weights.clone().reshape([depth, 1]).expand([depth, width]) * 1.0).chunk(depth, 0);
    let kernels = count(&device, || {
        sum.clone() + branch.clone() * rows[1].clone().reshape([1, 1, width])
    });
    println!(
        "  row of an aligned [{depth}, {width}] table, taken beforehand (the crate's formulation under autodiff before its scalar views, which need no aligned width; the H-ACN and ANCRe steps above use them): {kernels} kernel(s)"
    );
    let gathered = |sum: Tensor<3>, branch: Tensor<3>, weights: Tensor<1>| {
        let position =
            Tensor::<3, Int>::from_data(TensorData::new(vec![1i64], [1, 1, 1]), &weights.device());
        sum + branch * weights.reshape([depth, 1, 1]).gather(0, position)
    };
    let kernels = count(&device, || {
        gathered(sum.clone(), branch.clone(), weights.clone())
    });
    let flex = Device::flex();
    let reference = gathered(
        sum.clone().to_device(&flex),
        branch.clone().to_device(&flex),
        weights.clone().to_device(&flex),
    );
    let error = (gathered(sum.clone(), branch.clone(), weights.clone())
        - reference.to_device(&device))
    .abs()
    .max()
    .into_scalar::<f32>();
    println!(
        "  gather: {kernels} kernel(s), but max |error| vs Flex = {error:.3} (fusion reads the gathered tensor at the output's coordinates)"
    );
    let kernels = count(&device, || sum.clone() + branch.clone() * 0.5);
    println!("  host scalar (the crate's formulation without a gradient): {kernels} kernel(s)");
    Ok(())
}
