//! Times the benchmark workloads (see `tools/src/workloads.rs`) and prints one JSON object per
//! line on stdout, then the ratios to the plain residual on stderr:
//!
//! ```text
//! {"workload":"stack12.forward","variant":"hacn","ms":12.3,"rounds_ms":[12.1,12.3,12.9],"cpu_ms":23.9,"system_ms":0.4,"minor_faults":0,"host_peak_mb":50.1,"device":"flex"}
//! ```
//!
//! `ms` is the median over `--runs` timed runs (`rounds_ms`) after `--warmup` untimed ones, the
//! variants of a workload timed round-robin (run `r` of each before run `r + 1` of any, in the
//! balanced order of [`round_order`]) so that neither the machine's drifts nor what ran just
//! before (a variant that leaves the allocator with much freed memory) favour one of them;
//! `cpu_ms` the median CPU time of the process's threads during a run (`null` off Unix): on a
//! CPU backend, `cpu_ms / ms` is how many cores the run kept busy, so a variant whose time
//! grows more than its CPU time spends the difference in serial work (op dispatch, autodiff's
//! bookkeeping, small ops on one core); `system_ms` the median of that CPU time spent in the
//! kernel and `minor_faults` the median number of pages the process faulted in during a run
//! (both `null` off Unix; of an even count of runs, the faults' median is the upper of the middle
//! two, the other medians average them): memory the allocator took from the kernel, each page
//! zeroed by it (see `--heap`); `host_peak_mb` the largest growth of heap memory during a run
//! (all tensor memory on CPU backends; host-side bookkeeping only on GPU backends). The ratios
//! on stderr are of the medians, with the median and quartiles of the per-round ratios
//! beside them (their spread is the noise of the comparison), and the ratio of CPU times.
//! While it runs, stderr shows each variant's warm-up time and each round's times (`round 2/5,
//! ms: residual 57.93, mhc 77.86, …`), so that a run cut short by a time limit keeps them.
//!
//! ```text
//! cargo run --release -p burn-connectivity-tools --bin bench_connectivity -- [--device flex] [--runs 5] [--warmup 1] [--only stack|model|encoder|gconv|profile|connectivity] [--model-size full|reduced] [--granularity block|sublayer|layer] [--depths 12,24] [--heap system|retain]
//! ```
//!
//! `--heap retain` (Linux with glibc) keeps the memory a run frees for the next one. By default
//! glibc returns freed memory at the top of its heap to the kernel once it exceeds its trim
//! threshold, and a train step whose peak heap is larger than the previous step left mapped
//! faults it back in, page by page: on Flex, the multi-stream variants' steps (about 50% more
//! peak memory than the residual's at depth 12) fault in 10 to 25 thousand pages each, the
//! residual's none. That cost is the allocator's, and a training process pays it too unless it
//! sets `MALLOC_TRIM_THRESHOLD_` and `MALLOC_MMAP_THRESHOLD_` (or links another allocator), as
//! `--heap retain` does for the bench.
//!
//! `--only model` times the stacks at model scale (12 blocks at GPT-2-small width, d = 768, on
//! `[8, 1024]` tokens, f32; `[1, 32]` tokens with `--model-size reduced`, the default on CPU
//! backends), forward and train step: the workload where a GPU does real work. The PyTorch
//! peer (`tools/peer/hyper_connections_peer.py --workload model`) times the same shapes.
//!
//! `--only encoder` times the same shapes through 12 pre-norm burn-nn encoder layers (12 heads,
//! causal mask), attention included: burn-nn's `TransformerEncoder` as the residual, each
//! variant through the crate's `ConnectedEncoder` with a connectivity block per sublayer
//! (`--granularity sublayer`, the default; `block` wires each layer's attention shortcut,
//! `layer` whole layers). A transformer's step holds attention besides the MLP, so this is the
//! share a connectivity costs in one.
//!
//! `--only profile` times the operation classes of one residual MLP block on their own (forward
//! and backward at the block's shapes) next to the depth-12 residual train step, and prints
//! their share of it: what is the backend's time and what is left for the connectivity.
//!
//! `--only connectivity` times each variant's connectivity alone, train step, its blocks
//! replaced by the stand-in branch `u / 2` (workload `connectivity{depth}.train_step`; the
//! residual's line is its adds), round-robin with the residual's whole stack step, and prints
//! each variant's time over the residual's adds as a share of that step: what the variant's
//! ratio to the residual would be, less one, if the blocks cost the same under it. Its spread is
//! that of a few milliseconds, not of two whole steps, so it shows where a variant's cost lies
//! with less noise than the stack workload's ratios; it leaves out what a variant does to the
//! blocks' own cost (memory traffic, page faults, caches).

use burn_connectivity_tools as common;
use burn_connectivity_tools::workloads;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use burn::prelude::*;
use burn_connectivity::transformer::Granularity;
use clap::Parser;
use common::DeviceArg;
use workloads::{
    ConvMethod, DEPTHS, ENCODER_HEADS, EncoderModel, GCONV_LENGTHS, MODEL, MODEL_REDUCED, Model,
    OpClass, OpProfile, StackShape, Timed, Variant, gconv_inputs, stack_input,
};

/// The system allocator, keeping the current and the peak number of live heap bytes.
struct PeakAllocator;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grow(bytes: usize) {
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: every call forwards to `System` with the caller's arguments; the counters do not
// touch the memory.
unsafe impl GlobalAlloc for PeakAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let pointer = unsafe { System.alloc(layout) };
        if !pointer.is_null() {
            grow(layout.size());
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        unsafe { System.dealloc(pointer, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let moved = unsafe { System.realloc(pointer, layout, new_size) };
        if !moved.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grow(new_size);
        }
        moved
    }
}

#[global_allocator]
static ALLOCATOR: PeakAllocator = PeakAllocator;

/// The workloads `--only` selects.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Workload {
    /// Stacks of pre-LN MLP blocks under every connectivity, forward and train step.
    Stack,
    /// The stacks at model scale: 12 blocks, d = 768, [8, 1024] tokens (see `--model-size`).
    Model,
    /// 12 burn-nn encoder layers (attention and feed-forward) at the model workload's shapes,
    /// causal, wrapped by each variant (see `--granularity`).
    Encoder,
    /// The global HyperZZW convolution, FFT vs direct.
    Gconv,
    /// The residual train step next to each op class of one block.
    Profile,
    /// Each variant's connectivity alone (blocks replaced by `u / 2`), train step, next to the
    /// residual's whole stack step.
    Connectivity,
}

/// Times the benchmark workloads; one JSON object per line, then the ratios to the residual.
#[derive(Parser, Debug)]
#[command(long_about = None)]
struct Flags {
    #[command(flatten)]
    device: DeviceArg,
    /// Timed runs per measurement (the median is reported).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    runs: u64,
    /// Untimed runs before them.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// One workload only (default: every workload but the profile and the connectivity alone).
    #[arg(long, value_enum)]
    only: Option<Workload>,
    /// Stack variants, comma separated (default: all; the residual is always timed).
    #[arg(long, default_value = "")]
    variants: String,
    /// Size of the model workload: full ([8, 1024, 768]) or reduced ([1, 32, 768]); default:
    /// full on the GPU backends, reduced on the CPU ones.
    #[arg(long, value_enum)]
    model_size: Option<ModelSize>,
    /// Encoder workload: what a connectivity block is, a sublayer (attention and feed-forward
    /// apart), a layer's attention shortcut (`block`) or a whole layer (`layer`).
    #[arg(long, value_enum, default_value_t = EncoderGranularity::Sublayer)]
    granularity: EncoderGranularity,
    /// Passes of the stack and model workloads, comma separated (default: both). On a GPU each
    /// pass's warm-up compiles and autotunes its own kernels: one pass costs half the time.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Pass::Forward, Pass::TrainStep])]
    passes: Vec<Pass>,
    /// Depths of the stack workload (`stack{depth}`), comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = DEPTHS.map(|depth| depth as u16), value_parser = clap::value_parser!(u16).range(1..))]
    depths: Vec<u16>,
    /// How the C allocator treats memory a run frees: `system` leaves its defaults, `retain`
    /// keeps it mapped for the next run (glibc only; see the module docs).
    #[arg(long, value_enum, default_value_t = Heap::System)]
    heap: Heap,
    /// Stack and model workloads: time each variant against a residual of its own, one pair
    /// after another with only the pair's two models alive, rather than every variant
    /// round-robin in one set (the process then holds one model besides the residual, as a
    /// training run does; each ratio is to the residual of its pair).
    #[arg(long)]
    pairs: bool,
}

/// [`Granularity`] as `--granularity` names it.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum EncoderGranularity {
    Block,
    Sublayer,
    Layer,
}

impl From<EncoderGranularity> for Granularity {
    fn from(granularity: EncoderGranularity) -> Self {
        match granularity {
            EncoderGranularity::Block => Self::Block,
            EncoderGranularity::Sublayer => Self::Sublayer,
            EncoderGranularity::Layer => Self::Layer,
        }
    }
}

/// The passes a stack workload times.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    /// The stack's forward pass, without autodiff.
    Forward,
    /// Forward and backward of the mean output under autodiff.
    TrainStep,
}

/// What the C allocator does with freed memory.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Heap {
    /// The allocator's defaults.
    System,
    /// glibc keeps freed memory mapped: trim threshold 2 GiB, mmap threshold 32 MiB (the
    /// most glibc's own moving threshold reaches; larger blocks still get mappings of their
    /// own), as `MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_MMAP_THRESHOLD_=33554432` would.
    Retain,
}

impl Heap {
    /// Sets the allocator up; call before the first allocation worth keeping.
    fn apply(self) -> Result<(), String> {
        match self {
            Self::System => Ok(()),
            Self::Retain => retain_freed_memory(),
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn retain_freed_memory() -> Result<(), String> {
    // Setting either threshold stops glibc from moving both as chunks are freed: the trim
    // threshold alone would leave the mmap threshold at its 128 KiB start, every tensor of a
    // MiB or more mapped and faulted in afresh (245 thousand pages a residual step here).
    for (parameter, value, name) in [
        (libc::M_TRIM_THRESHOLD, libc::c_int::MAX, "M_TRIM_THRESHOLD"),
        (libc::M_MMAP_THRESHOLD, 32 << 20, "M_MMAP_THRESHOLD"),
    ] {
        // SAFETY: mallopt takes any parameter and value, returning 0 for those it refuses.
        if unsafe { libc::mallopt(parameter, value) } == 0 {
            return Err(format!("glibc refused mallopt({name}, {value})"));
        }
    }
    Ok(())
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn retain_freed_memory() -> Result<(), String> {
    Err("--heap retain needs glibc (Linux); link another allocator instead".to_string())
}

/// What the kernel did for this process so far (`None` where the platform does not say).
#[derive(Clone, Copy, Debug)]
struct KernelUsage {
    /// Pages faulted in without I/O, each taken from the kernel and zeroed by it.
    minor_faults: u64,
    /// CPU milliseconds of every thread in the kernel (page faults, mostly, on a CPU backend).
    system_ms: f64,
}

impl KernelUsage {
    /// The whole process's.
    fn now() -> Option<Self> {
        #[cfg(unix)]
        return Self::of(libc::RUSAGE_SELF);
        #[cfg(not(unix))]
        None
    }

    /// `who`'s (`RUSAGE_SELF`, or `RUSAGE_THREAD` on Linux).
    #[cfg(unix)]
    fn of(who: libc::c_int) -> Option<Self> {
        // SAFETY: an all-zero rusage is a valid value of the plain C struct, and getrusage
        // writes only into it.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        let status = unsafe { libc::getrusage(who, &mut usage) };
        (status == 0).then(|| Self {
            minor_faults: usage.ru_minflt as u64,
            system_ms: usage.ru_stime.tv_sec as f64 * 1e3 + usage.ru_stime.tv_usec as f64 / 1e3,
        })
    }

    fn since(self, start: Self) -> Self {
        Self {
            minor_faults: self.minor_faults.saturating_sub(start.minor_faults),
            system_ms: self.system_ms - start.system_ms,
        }
    }
}

/// The sizes of the model workload.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ModelSize {
    Full,
    Reduced,
}

/// The CPU time of every thread of this process so far, in milliseconds (`None` where the
/// platform has no such clock).
fn process_cpu_ms() -> Option<f64> {
    #[cfg(unix)]
    {
        let mut time = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `time` is a valid, writable timespec.
        let status = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut time) };
        (status == 0).then(|| time.tv_sec as f64 * 1e3 + time.tv_nsec as f64 / 1e6)
    }
    #[cfg(not(unix))]
    None
}

/// One timed run of `work` (followed by a device sync).
struct Run {
    /// Wall milliseconds.
    ms: f64,
    /// CPU milliseconds of the whole process (every thread; `NaN` where unknown).
    cpu_ms: f64,
    /// What the kernel did for it (`None` where unknown).
    kernel: Option<KernelUsage>,
    /// Peak heap growth in bytes.
    peak: usize,
}

fn run_once<T>(device: &Device, work: &dyn Fn() -> T) -> Run {
    let baseline = LIVE.load(Ordering::Relaxed);
    PEAK.store(baseline, Ordering::Relaxed);
    let kernel_start = KernelUsage::now();
    let cpu_start = process_cpu_ms();
    let start = Instant::now();
    let output = work();
    device.sync().expect("device sync");
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let cpu_ms = match (cpu_start, process_cpu_ms()) {
        (Some(start), Some(end)) => end - start,
        _ => f64::NAN,
    };
    let kernel = match (kernel_start, KernelUsage::now()) {
        (Some(start), Some(end)) => Some(end.since(start)),
        _ => None,
    };
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(baseline);
    drop(output);
    Run {
        ms,
        cpu_ms,
        kernel,
        peak,
    }
}

/// The runs of one work.
#[derive(Clone)]
struct Timing {
    /// Milliseconds of each timed run, in round order.
    rounds_ms: Vec<f64>,
    /// CPU milliseconds of the process (all threads) during each timed run.
    rounds_cpu_ms: Vec<f64>,
    /// What the kernel did during each timed run (empty where unknown).
    rounds_kernel: Vec<KernelUsage>,
    /// The largest peak heap growth of a run.
    peak: usize,
}

impl Timing {
    fn median_ms(&self) -> f64 {
        median(self.rounds_ms.clone())
    }

    fn median_cpu_ms(&self) -> f64 {
        median(self.rounds_cpu_ms.clone())
    }

    /// The medians of the runs' page faults and kernel milliseconds.
    fn median_kernel(&self) -> Option<KernelUsage> {
        if self.rounds_kernel.is_empty() {
            return None;
        }
        let mut faults: Vec<u64> = self.rounds_kernel.iter().map(|k| k.minor_faults).collect();
        faults.sort_unstable();
        Some(KernelUsage {
            minor_faults: faults[faults.len() / 2],
            system_ms: median(self.rounds_kernel.iter().map(|k| k.system_ms).collect()),
        })
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    quantile(&values, 0.5)
}

/// The `q`-quantile of `sorted` (ascending, not empty), interpolated linearly between the order
/// statistics (NumPy's default): the median of an even count is the mean of the middle two.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let at = q * (sorted.len() - 1) as f64;
    let (below, above) = (at.floor() as usize, at.ceil() as usize);
    sorted[below] + (at - below as f64) * (sorted[above] - sorted[below])
}

/// How many runs of each work are timed, after how many untimed ones.
#[derive(Clone, Copy, Debug)]
struct Rounds {
    runs: usize,
    warmup: usize,
}

/// Every work's runs, timed round-robin (run `r` of every work before run `r + 1` of any), so
/// that drifts of the machine's speed spread over all of them rather than favouring whichever
/// ran first; each round in the order [`round_order`] gives it, so that each work follows every
/// other equally often (a rotation of one order, before, kept each work right after the same
/// one in all rounds but one in `n`: LAuReL after the residual, the residual after V4).
///
/// On stderr, as it goes: each work's warm-up time (where a GPU backend compiles and autotunes
/// its kernels) and each round's times, `names` naming the works: a run stopped by a time
/// limit still shows what it measured.
fn measure_interleaved<T>(
    device: &Device,
    Rounds { runs, warmup }: Rounds,
    names: &[&str],
    works: &[&dyn Fn() -> T],
) -> Vec<Timing> {
    assert_eq!(names.len(), works.len(), "a name per work");
    for (name, work) in names.iter().zip(works) {
        let started = Instant::now();
        for _ in 0..warmup {
            run_once(device, *work);
        }
        if warmup > 0 {
            eprintln!("  warm-up {name}: {:.1} s", started.elapsed().as_secs_f64());
        }
    }
    let mut timings = vec![
        Timing {
            rounds_ms: Vec::with_capacity(runs),
            rounds_cpu_ms: Vec::with_capacity(runs),
            rounds_kernel: Vec::with_capacity(runs),
            peak: 0,
        };
        works.len()
    ];
    for round in 0..runs {
        for index in round_order(round, works.len()) {
            let run = run_once(device, works[index]);
            let timing = &mut timings[index];
            timing.rounds_ms.push(run.ms);
            timing.rounds_cpu_ms.push(run.cpu_ms);
            timing.rounds_kernel.extend(run.kernel);
            timing.peak = timing.peak.max(run.peak);
        }
        let times: Vec<String> = (names.iter().zip(&timings))
            .map(|(name, timing)| format!("{name} {:.2}", timing.rounds_ms[round]))
            .collect();
        eprintln!("  round {}/{runs}, ms: {}", round + 1, times.join(", "));
    }
    timings
}

/// The order of `n` works in round `round`: row `round` of a Williams design, a Latin square
/// whose rows are `0, 1, n−1, 2, n−2, …` shifted by the row's number, followed for odd `n` by
/// the same `n` rows reversed. Over every `n` rounds (`2n` for odd `n`) each work runs first,
/// and right after each other work, equally often, so that what a work leaves behind (caches,
/// the allocator's free memory) weighs on every other alike.
fn round_order(round: usize, n: usize) -> Vec<usize> {
    if n == 0 {
        return Vec::new();
    }
    let period = if n.is_multiple_of(2) { n } else { 2 * n };
    let row = round % period;
    let mut order: Vec<usize> = (0..n)
        .map(|j| {
            let first = if j % 2 == 1 { j.div_ceil(2) } else { n - j / 2 };
            (first + row) % n
        })
        .collect();
    if row >= n {
        order.reverse();
    }
    order
}

struct Report {
    device: String,
    results: Vec<(String, String, Timing)>,
}

impl Report {
    fn record(&mut self, workload: String, variant: &str, timing: Timing) {
        let cpu_ms = timing.median_cpu_ms();
        let cpu_ms = if cpu_ms.is_finite() {
            format!("{cpu_ms:.3}")
        } else {
            "null".to_string()
        };
        let (minor_faults, system_ms) =
            timing
                .median_kernel()
                .map_or(("null".to_string(), "null".to_string()), |kernel| {
                    (
                        kernel.minor_faults.to_string(),
                        format!("{:.3}", kernel.system_ms),
                    )
                });
        println!(
            "{{\"workload\":\"{workload}\",\"variant\":\"{variant}\",\"ms\":{:.3},\"rounds_ms\":{:?},\"cpu_ms\":{cpu_ms},\"system_ms\":{system_ms},\"minor_faults\":{minor_faults},\"host_peak_mb\":{:.1},\"device\":\"{}\"}}",
            timing.median_ms(),
            timing
                .rounds_ms
                .iter()
                .map(|ms| (ms * 1e3).round() / 1e3)
                .collect::<Vec<_>>(),
            timing.peak as f64 / 1e6,
            self.device
        );
        self.results.push((workload, variant.to_string(), timing));
    }

    /// Time and peak-memory ratios of every variant to `baseline` within each workload (to the
    /// latest `baseline` recorded before it, which `--pairs` records once per pair): the ratio
    /// of the medians, and the spread of the ratios of runs of the same round (which cancels
    /// drifts of the machine's speed that last longer than a round).
    fn print_ratios(&self, baseline: &str) {
        let mut baselines: HashMap<&str, &Timing> = HashMap::new();
        for (workload, variant, timing) in &self.results {
            if variant == baseline {
                baselines.insert(workload.as_str(), timing);
            } else if let Some(base) = baselines.get(workload.as_str()) {
                let mut paired: Vec<f64> = timing
                    .rounds_ms
                    .iter()
                    .zip(&base.rounds_ms)
                    .map(|(ms, base_ms)| ms / base_ms)
                    .collect();
                paired.sort_by(f64::total_cmp);
                let quartile = |q: usize| quantile(&paired, q as f64 / 4.0);
                eprintln!(
                    "{workload:>18} {variant:>9}: time {:.3}x {baseline} (per round: median {:.3}, quartiles {:.3}-{:.3}), CPU time {:.3}x, host peak {:.3}x{}",
                    timing.median_ms() / base.median_ms(),
                    quartile(2),
                    quartile(1),
                    quartile(3),
                    timing.median_cpu_ms() / base.median_cpu_ms(),
                    timing.peak as f64 / base.peak.max(1) as f64,
                    match (timing.median_kernel(), base.median_kernel()) {
                        (Some(kernel), Some(base)) => format!(
                            ", in the kernel {:.1} ms ({:.1}), pages faulted in {} ({})",
                            kernel.system_ms,
                            base.system_ms,
                            kernel.minor_faults,
                            base.minor_faults
                        ),
                        _ => String::new(),
                    }
                );
            }
        }
    }
}

pub fn main() -> ExitCode {
    common::exit(run(Flags::parse()))
}

fn run(flags: Flags) -> Result<(), String> {
    flags.heap.apply()?;
    let device = flags.device.device()?;
    let rounds = Rounds {
        runs: flags.runs as usize,
        warmup: flags.warmup,
    };
    let only = flags.only;
    let variants = Variant::selected(&flags.variants)?;
    let mut report = Report {
        device: flags.device.device.clone(),
        results: Vec::new(),
    };

    if matches!(only, None | Some(Workload::Stack)) {
        for &depth in &flags.depths {
            let shape = StackShape::stack(depth.into());
            time_stacks(
                &device,
                shape,
                &format!("stack{depth}"),
                &variants,
                rounds,
                &flags.passes,
                flags.pairs,
                &mut report,
                &|variant, device| Box::new(Model::with_shape(variant, shape, device)),
            );
        }
        report.print_ratios(Variant::Residual.name());
    }
    if matches!(only, Some(Workload::Model | Workload::Encoder)) {
        let gpu = !matches!(flags.device.device.as_str(), "flex" | "ndarray" | "tch");
        let size = flags.model_size.unwrap_or(if gpu {
            ModelSize::Full
        } else {
            ModelSize::Reduced
        });
        let shape = match size {
            ModelSize::Full => MODEL,
            ModelSize::Reduced => MODEL_REDUCED,
        };
        let StackShape {
            batch,
            length,
            width,
            depth,
        } = shape;
        let granularity = Granularity::from(flags.granularity);
        let (name, build): (&str, &ModelBuilder<'_>) = if only == Some(Workload::Model) {
            eprintln!(
                "model workload: {depth} pre-LN MLP blocks on [{batch}, {length}, {width}], f32"
            );
            ("model", &|variant, device| {
                Box::new(Model::with_shape(variant, shape, device))
            })
        } else {
            eprintln!(
                "encoder workload: {depth} pre-norm encoder layers ({ENCODER_HEADS} heads, causal) \
                 on [{batch}, {length}, {width}], f32, a connectivity block per {:?}",
                flags.granularity
            );
            ("encoder", &|variant, device| {
                Box::new(EncoderModel::new(variant, shape, granularity, device))
            })
        };
        time_stacks(
            &device,
            shape,
            name,
            &variants,
            rounds,
            &flags.passes,
            flags.pairs,
            &mut report,
            build,
        );
        report.print_ratios(Variant::Residual.name());
    }
    if only == Some(Workload::Profile) {
        profile(&device.clone().autodiff(), rounds, &mut report);
    }
    if only == Some(Workload::Connectivity) {
        for &depth in &flags.depths {
            let shape = StackShape::stack(depth.into());
            time_connectivities(
                &device.clone().autodiff(),
                shape,
                &variants,
                rounds,
                &mut report,
            );
        }
    }
    if matches!(only, None | Some(Workload::Gconv)) {
        for length in GCONV_LENGTHS {
            let (z, kernel) = gconv_inputs(length, &device);
            let works: Vec<Box<dyn Fn() -> Tensor<3>>> = ConvMethod::ALL
                .iter()
                .map(|&method| -> Box<dyn Fn() -> Tensor<3>> {
                    let (z, kernel) = (z.clone(), kernel.clone());
                    Box::new(move || method.apply(z.clone(), kernel.clone()))
                })
                .collect();
            let works: Vec<&dyn Fn() -> Tensor<3>> =
                works.iter().map(|work| work.as_ref()).collect();
            let names = ConvMethod::ALL.map(ConvMethod::name);
            let timings = measure_interleaved(&device, rounds, &names, &works);
            for (method, timing) in ConvMethod::ALL.iter().zip(timings) {
                report.record(format!("gconv{length}"), method.name(), timing);
            }
        }
        report.print_ratios(ConvMethod::Direct.name());
    }
    Ok(())
}

/// A variant's model of one workload on a device.
type ModelBuilder<'a> = dyn Fn(Variant, &Device) -> Box<dyn Timed> + 'a;

/// Times the forward pass and the train step of every variant's model (`build` makes them),
/// the variants round-robin, as the workloads `{name}.forward` and `{name}.train_step`; with
/// `pairs`, each variant after the first (the residual) round-robin with a residual of its own,
/// one pair after another. Their input is a random one of `shape`.
#[allow(clippy::too_many_arguments)]
fn time_stacks(
    device: &Device,
    shape: StackShape,
    name: &str,
    variants: &[Variant],
    rounds: Rounds,
    passes: &[Pass],
    pairs: bool,
    report: &mut Report,
    build: &ModelBuilder<'_>,
) {
    if pairs && variants.len() > 2 {
        let (baseline, others) = variants.split_first().expect("the residual first");
        for &variant in others {
            time_stacks(
                device,
                shape,
                name,
                &[*baseline, variant],
                rounds,
                passes,
                false,
                report,
                build,
            );
        }
        return;
    }
    let training = device.clone().autodiff();
    let modes = [
        (Pass::Forward, "forward", device),
        (Pass::TrainStep, "train_step", &training),
    ];
    for (_, mode, device) in modes.into_iter().filter(|(pass, ..)| passes.contains(pass)) {
        let started = std::time::Instant::now();
        let models: Vec<Box<dyn Timed>> = variants
            .iter()
            .map(|&variant| build(variant, device))
            .collect();
        let input = shape.input(device);
        let works: Vec<Box<dyn Fn() -> Box<dyn std::any::Any>>> = models
            .iter()
            .map(|model| -> Box<dyn Fn() -> Box<dyn std::any::Any>> {
                let input = input.clone();
                if mode == "forward" {
                    Box::new(move || Box::new(model.forward(input.clone())))
                } else {
                    Box::new(move || Box::new(model.train_step(input.clone())))
                }
            })
            .collect();
        let works: Vec<&dyn Fn() -> Box<dyn std::any::Any>> =
            works.iter().map(|work| work.as_ref()).collect();
        let names: Vec<&str> = variants.iter().map(|variant| variant.name()).collect();
        let timings = measure_interleaved(device, rounds, &names, &works);
        for (variant, timing) in variants.iter().zip(timings) {
            report.record(format!("{name}.{mode}"), variant.name(), timing);
        }
        eprintln!(
            "{name}.{mode}: {:.1} s with warm-up",
            started.elapsed().as_secs_f64()
        );
    }
}

/// Each variant's connectivity alone ([`Model::connectivity_train_step`]) at `shape`, round-robin
/// with the residual's whole stack train step, as the workloads `connectivity{depth}.train_step`
/// (the residual's: its adds) and `stack{depth}.train_step` (the residual only); prints each
/// variant's cost over the residual's adds as a share of the residual's whole step, which is
/// what the variant's ratio to the residual would be if its blocks cost what the residual's do.
fn time_connectivities(
    device: &Device,
    shape: StackShape,
    variants: &[Variant],
    rounds: Rounds,
    report: &mut Report,
) {
    let depth = shape.depth;
    let models: Vec<Model> = variants
        .iter()
        .map(|&variant| Model::with_shape(variant, shape, device))
        .collect();
    let input = shape.input(device);
    // `Variant::selected` puts the residual first: its whole step, then every connectivity.
    let mut works: Vec<Box<dyn Fn() -> Box<dyn std::any::Any> + '_>> = vec![Box::new(|| {
        Box::new(models[0].train_step(input.clone())) as Box<dyn std::any::Any>
    })];
    for model in &models {
        let input = input.clone();
        works.push(Box::new(move || {
            Box::new(model.connectivity_train_step(input.clone()))
        }));
    }
    let works: Vec<&dyn Fn() -> Box<dyn std::any::Any>> =
        works.iter().map(|work| work.as_ref()).collect();
    let names: Vec<&str> = std::iter::once("stack")
        .chain(variants.iter().map(|variant| variant.name()))
        .collect();
    let timings = measure_interleaved(device, rounds, &names, &works);
    let step = &timings[0];
    let alone = &timings[1];
    report.record(format!("stack{depth}.train_step"), "residual", step.clone());
    for (variant, timing) in variants.iter().zip(&timings[1..]) {
        report.record(
            format!("connectivity{depth}.train_step"),
            variant.name(),
            timing.clone(),
        );
    }
    eprintln!(
        "connectivity{depth}.train_step: the residual's whole step {:.1} ms, its adds alone {:.2} ms",
        step.median_ms(),
        alone.median_ms()
    );
    for (variant, timing) in variants.iter().zip(&timings[1..]).skip(1) {
        // Per round: the variant's time over the residual's adds, against that round's whole
        // residual step.
        let mut shares: Vec<f64> = timing
            .rounds_ms
            .iter()
            .zip(&alone.rounds_ms)
            .zip(&step.rounds_ms)
            .map(|((ms, adds), step)| (ms - adds) / step)
            .collect();
        shares.sort_by(f64::total_cmp);
        let over_adds = timing.median_ms() - alone.median_ms();
        eprintln!(
            "{:>18} {:>13}: alone {:.2} ms, over the residual's adds {:+.2} ms: {:.1}% of the residual's step (per round: median {:.1}%, quartiles {:.1}-{:.1}%)",
            format!("connectivity{depth}"),
            variant.name(),
            timing.median_ms(),
            over_adds,
            100.0 * over_adds / step.median_ms(),
            100.0 * quantile(&shares, 0.5),
            100.0 * quantile(&shares, 0.25),
            100.0 * quantile(&shares, 0.75),
        );
    }
}

/// The residual train step at depth 12 and each operation class of one block, timed
/// round-robin; a table of their shares on stderr.
fn profile(device: &Device, rounds: Rounds, report: &mut Report) {
    let depth = DEPTHS[0];
    let model = Model::new(Variant::Residual, depth, device);
    let input = stack_input(device);
    let ops = OpProfile::new(device);
    let mut works: Vec<Box<dyn Fn() -> Box<dyn std::any::Any> + '_>> =
        vec![Box::new(|| Box::new(model.train_step(input.clone())))];
    for class in OpClass::ALL {
        let ops = &ops;
        works.push(Box::new(move || Box::new(ops.train_step(class))));
    }
    let works: Vec<&dyn Fn() -> Box<dyn std::any::Any>> =
        works.iter().map(|work| work.as_ref()).collect();
    let names: Vec<&str> = std::iter::once("residual")
        .chain(OpClass::ALL.iter().map(|class| class.name()))
        .collect();
    let timings = measure_interleaved(device, rounds, &names, &works);
    let step_ms = timings[0].median_ms();
    report.record(format!("profile{depth}"), "train_step", timings[0].clone());
    eprintln!("residual train step, depth {depth}: {step_ms:.1} ms");
    eprintln!(
        "{:>13} {:>10} {:>10} {:>7}",
        "op class", "per block", "x depth", "share"
    );
    let mut accounted = 0.0;
    for (class, timing) in OpClass::ALL.iter().zip(&timings[1..]) {
        let per_block = timing.median_ms();
        report.record(format!("profile{depth}"), class.name(), timing.clone());
        let total = per_block * depth as f64;
        accounted += total;
        eprintln!(
            "{:>13} {:>7.2} ms {:>7.1} ms {:>6.1}%",
            class.name(),
            per_block,
            total,
            100.0 * total / step_ms
        );
    }
    eprintln!(
        "{:>13} {:>10} {:>7.1} ms {:>6.1}%",
        "rest",
        "",
        step_ms - accounted,
        100.0 * (step_ms - accounted) / step_ms
    );
}

#[cfg(test)]
mod tests {
    use super::{KernelUsage, median, quantile, round_order};

    /// An even count's median is the mean of the middle two (`tools/round_ratios.py` takes
    /// Python's `statistics.median`, the same); quartiles interpolate.
    #[test]
    fn medians_and_quartiles_interpolate() {
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        let sorted = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(quantile(&sorted, 0.25), 2.0);
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0], 0.25), 1.75);
        assert_eq!(quantile(&[7.0], 0.75), 7.0);
    }

    /// Writing one byte to each page of a fresh anonymous mapping (without huge pages) faults
    /// every page in once (counted for this thread: other tests run beside it).
    #[cfg(target_os = "linux")]
    #[test]
    fn minor_faults_count_the_pages_a_fresh_mapping_touches() {
        const PAGES: usize = 4096;
        let page_size = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap();
        let length = PAGES * page_size;
        // SAFETY: a private anonymous mapping of `length` bytes, written only inside it and
        // unmapped once; madvise and munmap take exactly that range.
        let faults = unsafe {
            let mapping = libc::mmap(
                std::ptr::null_mut(),
                length,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(mapping, libc::MAP_FAILED);
            libc::madvise(mapping, length, libc::MADV_NOHUGEPAGE);
            let before = KernelUsage::of(libc::RUSAGE_THREAD).expect("Linux counts faults");
            for page in 0..PAGES {
                std::ptr::write_volatile(mapping.cast::<u8>().add(page * page_size), 1);
            }
            let faults = KernelUsage::now()
                .expect("Linux counts faults")
                .since(before);
            libc::munmap(mapping, length);
            faults.minor_faults as usize
        };
        assert!(
            (PAGES..PAGES + PAGES / 4).contains(&faults),
            "{faults} faults for {PAGES} pages"
        );
    }

    /// Every round is an order of all works, and over a period each work runs first, and right
    /// after each other work, equally often.
    #[test]
    fn rounds_balance_first_places_and_predecessors() {
        for n in 1..=9usize {
            let period = if n.is_multiple_of(2) { n } else { 2 * n };
            let mut firsts = vec![0; n];
            let mut follows = vec![vec![0; n]; n];
            for round in 0..period {
                let order = round_order(round, n);
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "n={n} round {round}");
                firsts[order[0]] += 1;
                for pair in order.windows(2) {
                    follows[pair[0]][pair[1]] += 1;
                }
            }
            assert!(
                firsts.iter().all(|&count| count == period / n),
                "n={n}: {firsts:?}"
            );
            let each = if n.is_multiple_of(2) { 1 } else { 2 };
            for (a, row) in follows.iter().enumerate() {
                for (b, &count) in row.iter().enumerate() {
                    let expected = if a == b { 0 } else { each };
                    assert_eq!(count, expected, "n={n}: {b} after {a}");
                }
            }
        }
        assert!(round_order(0, 0).is_empty());
    }
}
