//! Times the benchmark workloads (see `benches/workloads/mod.rs`) and prints one JSON object per
//! line on stdout, then the ratios to the plain residual on stderr:
//!
//! ```text
//! {"workload":"stack12.forward","variant":"hacn","ms":12.3,"host_peak_mb":50.1,"device":"flex"}
//! ```
//!
//! `ms` is the median over `--runs` timed runs after `--warmup` untimed ones, the variants of a
//! workload timed round-robin (run `r` of each before run `r + 1` of any) so that the machine's
//! drifts do not favour one of them; `host_peak_mb` the largest growth of heap memory during a run (all tensor memory on CPU backends; host-side
//! bookkeeping only on GPU backends).
//!
//! ```text
//! cargo run --release --example bench_connectivity -- [--device flex] [--runs 5] [--warmup 1] [--only stack|gconv|profile]
//! ```
//!
//! `--only profile` times the operation classes of one residual MLP block on their own (forward
//! and backward at the block's shapes) next to the depth-12 residual train step, and prints
//! their share of it: what is the backend's time and what is left for the connectivity.

mod common;
#[path = "../benches/workloads/mod.rs"]
mod workloads;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use burn::prelude::*;
use clap::Parser;
use common::DeviceArg;
use workloads::{
    ConvMethod, DEPTHS, GCONV_LENGTHS, Model, OpClass, OpProfile, Variant, gconv_inputs,
    stack_input,
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
    /// The global HyperZZW convolution, FFT vs direct.
    Gconv,
    /// The residual train step next to each op class of one block.
    Profile,
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
    /// One workload only (default: every workload but the profile).
    #[arg(long, value_enum)]
    only: Option<Workload>,
    /// Stack variants, comma separated (default: all; the residual is always timed).
    #[arg(long, default_value = "")]
    variants: String,
}

/// One timed run of `work` (followed by a device sync): milliseconds and peak heap growth.
fn run_once<T>(device: &Device, work: &dyn Fn() -> T) -> (f64, usize) {
    let baseline = LIVE.load(Ordering::Relaxed);
    PEAK.store(baseline, Ordering::Relaxed);
    let start = Instant::now();
    let output = work();
    device.sync().expect("device sync");
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(baseline);
    drop(output);
    (ms, peak)
}

/// Median milliseconds and peak heap growth of every work, timed round-robin (run `r` of every
/// work before run `r + 1` of any), so that drifts of the machine's speed spread over all of
/// them rather than favouring whichever ran first.
fn measure_interleaved<T>(
    device: &Device,
    runs: usize,
    warmup: usize,
    works: &[&dyn Fn() -> T],
) -> Vec<(f64, usize)> {
    for work in works {
        for _ in 0..warmup {
            run_once(device, *work);
        }
    }
    let mut times = vec![Vec::with_capacity(runs); works.len()];
    let mut peaks = vec![0; works.len()];
    for _ in 0..runs {
        for (index, work) in works.iter().enumerate() {
            let (ms, peak) = run_once(device, *work);
            times[index].push(ms);
            peaks[index] = peaks[index].max(peak);
        }
    }
    times
        .into_iter()
        .zip(peaks)
        .map(|(mut times, peak)| {
            times.sort_by(f64::total_cmp);
            (times[times.len() / 2], peak)
        })
        .collect()
}

struct Report {
    device: String,
    results: Vec<(String, String, f64, usize)>,
}

impl Report {
    fn record(&mut self, workload: String, variant: &str, (ms, peak): (f64, usize)) {
        println!(
            "{{\"workload\":\"{workload}\",\"variant\":\"{variant}\",\"ms\":{ms:.3},\"host_peak_mb\":{:.1},\"device\":\"{}\"}}",
            peak as f64 / 1e6,
            self.device
        );
        self.results.push((workload, variant.to_string(), ms, peak));
    }

    /// Time and peak-memory ratios of every variant to `baseline` within each workload.
    fn print_ratios(&self, baseline: &str) {
        let baselines: HashMap<&str, (f64, usize)> = self
            .results
            .iter()
            .filter(|(_, variant, ..)| variant == baseline)
            .map(|(workload, _, ms, peak)| (workload.as_str(), (*ms, *peak)))
            .collect();
        for (workload, variant, ms, peak) in &self.results {
            if let Some((base_ms, base_peak)) = baselines.get(workload.as_str())
                && variant != baseline
            {
                eprintln!(
                    "{workload:>18} {variant:>9}: time {:.3}x {baseline}, host peak {:.3}x",
                    ms / base_ms,
                    *peak as f64 / (*base_peak).max(1) as f64
                );
            }
        }
    }
}

/// The stack variants named in `--variants` (all when empty); the residual is always timed.
fn selected_variants(list: &str) -> Result<Vec<Variant>, String> {
    if list.is_empty() {
        return Ok(Variant::ALL.to_vec());
    }
    let mut chosen = vec![Variant::Residual];
    for name in list.split(',').map(str::trim) {
        let variant = Variant::ALL
            .into_iter()
            .find(|variant| variant.name() == name)
            .ok_or_else(|| {
                let known: Vec<&str> = Variant::ALL.iter().map(|v| v.name()).collect();
                format!(
                    "--variants: unknown variant {name:?}, expected any of {}",
                    known.join(",")
                )
            })?;
        if !chosen.contains(&variant) {
            chosen.push(variant);
        }
    }
    Ok(chosen)
}

fn main() -> ExitCode {
    common::exit(run(Flags::parse()))
}

fn run(flags: Flags) -> Result<(), String> {
    let device = flags.device.device()?;
    let runs = flags.runs as usize;
    let warmup = flags.warmup;
    let only = flags.only;
    let variants = selected_variants(&flags.variants)?;
    let mut report = Report {
        device: flags.device.device.clone(),
        results: Vec::new(),
    };

    if matches!(only, None | Some(Workload::Stack)) {
        let training = device.clone().autodiff();
        for depth in DEPTHS {
            for (mode, device) in [("forward", &device), ("train_step", &training)] {
                let started = std::time::Instant::now();
                let models: Vec<Model> = variants
                    .iter()
                    .map(|&variant| Model::new(variant, depth, device))
                    .collect();
                let input = stack_input(device);
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
                let timings = measure_interleaved(device, runs, warmup, &works);
                for (variant, timing) in variants.iter().zip(timings) {
                    report.record(format!("stack{depth}.{mode}"), variant.name(), timing);
                }
                eprintln!(
                    "stack{depth}.{mode}: {:.1} s with warm-up",
                    started.elapsed().as_secs_f64()
                );
            }
        }
        report.print_ratios(Variant::Residual.name());
    }
    if only == Some(Workload::Profile) {
        profile(&device.clone().autodiff(), runs, warmup, &mut report);
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
            let timings = measure_interleaved(&device, runs, warmup, &works);
            for (method, timing) in ConvMethod::ALL.iter().zip(timings) {
                report.record(format!("gconv{length}"), method.name(), timing);
            }
        }
        report.print_ratios(ConvMethod::Direct.name());
    }
    Ok(())
}

/// The residual train step at depth 12 and each operation class of one block, timed
/// round-robin; a table of their shares on stderr.
fn profile(device: &Device, runs: usize, warmup: usize, report: &mut Report) {
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
    let timings = measure_interleaved(device, runs, warmup, &works);
    let step_ms = timings[0].0;
    report.record(format!("profile{depth}"), "train_step", timings[0]);
    eprintln!("residual train step, depth {depth}: {step_ms:.1} ms");
    eprintln!(
        "{:>13} {:>10} {:>10} {:>7}",
        "op class", "per block", "x depth", "share"
    );
    let mut accounted = 0.0;
    for (class, timing) in OpClass::ALL.iter().zip(&timings[1..]) {
        report.record(format!("profile{depth}"), class.name(), *timing);
        let total = timing.0 * depth as f64;
        accounted += total;
        eprintln!(
            "{:>13} {:>7.2} ms {:>7.1} ms {:>6.1}%",
            class.name(),
            timing.0,
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
