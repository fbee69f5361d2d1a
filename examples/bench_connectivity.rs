//! Times the benchmark workloads (see `benches/workloads/mod.rs`) and prints one JSON object per
//! line on stdout, then the ratios to the plain residual on stderr:
//!
//! ```text
//! {"workload":"stack12.forward","variant":"hacn","ms":12.3,"host_peak_mb":50.1,"device":"flex"}
//! ```
//!
//! `ms` is the median over `--runs` timed runs after `--warmup` untimed ones; `host_peak_mb` the
//! largest growth of heap memory during a run (all tensor memory on CPU backends; host-side
//! bookkeeping only on GPU backends).
//!
//! ```text
//! cargo run --release --example bench_connectivity -- [--device flex] [--runs 5] [--warmup 1] [--only stack|gconv]
//! ```

mod common;
#[path = "../benches/workloads/mod.rs"]
mod workloads;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use burn::prelude::*;
use common::Args;
use workloads::{ConvMethod, DEPTHS, GCONV_LENGTHS, Model, Variant, gconv_inputs, stack_input};

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

const USAGE: &str =
    "usage: bench_connectivity [--device NAME] [--runs N] [--warmup N] [--only stack|gconv]";

/// Median milliseconds and peak heap growth in bytes of `work` (followed by a device sync).
fn measure<T>(device: &Device, runs: usize, warmup: usize, work: impl Fn() -> T) -> (f64, usize) {
    let finish = |output: T| {
        device.sync().expect("device sync");
        drop(output);
    };
    for _ in 0..warmup {
        finish(work());
    }
    let mut times = Vec::with_capacity(runs);
    let mut peak = 0;
    for _ in 0..runs {
        let baseline = LIVE.load(Ordering::Relaxed);
        PEAK.store(baseline, Ordering::Relaxed);
        let start = Instant::now();
        let output = work();
        device.sync().expect("device sync");
        times.push(start.elapsed().as_secs_f64() * 1e3);
        peak = peak.max(PEAK.load(Ordering::Relaxed).saturating_sub(baseline));
        drop(output);
    }
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], peak)
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

fn main() -> Result<(), String> {
    let args = Args::parse(USAGE, &["runs", "warmup", "only"])?;
    let device = args.device()?;
    let runs = args.get("runs", 5usize)?.max(1);
    let warmup = args.get("warmup", 1usize)?;
    let only = args.get("only", String::new())?;
    let mut report = Report {
        device: args.get("device", String::from("flex"))?,
        results: Vec::new(),
    };

    if only.is_empty() || only == "stack" {
        let training = device.clone().autodiff();
        for depth in DEPTHS {
            for variant in Variant::ALL {
                let model = Model::new(variant, depth, &device);
                let input = stack_input(&device);
                let timing = measure(&device, runs, warmup, || model.forward(input.clone()));
                report.record(format!("stack{depth}.forward"), variant.name(), timing);

                let model = Model::new(variant, depth, &training);
                let input = stack_input(&training);
                let timing = measure(&training, runs, warmup, || model.train_step(input.clone()));
                report.record(format!("stack{depth}.train_step"), variant.name(), timing);
            }
        }
        report.print_ratios(Variant::Residual.name());
    }
    if only.is_empty() || only == "gconv" {
        for length in GCONV_LENGTHS {
            let (z, kernel) = gconv_inputs(length, &device);
            for method in ConvMethod::ALL {
                let timing = measure(&device, runs, warmup, || {
                    method.apply(z.clone(), kernel.clone())
                });
                report.record(format!("gconv{length}"), method.name(), timing);
            }
        }
        report.print_ratios(ConvMethod::Direct.name());
    }
    Ok(())
}
