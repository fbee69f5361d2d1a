//! `attnres` 0.1.1's Attention Residuals operator timed on pre-LN MLP stacks (see README.md).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use attnres::{AttnResConfig, AttnResOp};
use burn::backend::{Autodiff, NdArray};
use burn::nn::{Gelu, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::Distribution;

type B = Autodiff<NdArray>;

const BATCH: usize = 8;
const LENGTH: usize = 128;
const WIDTH: usize = 256;
const DEPTHS: [usize; 2] = [12, 24];
/// Blocks per group of the block variant, as `bench_connectivity`'s `block_attnres`.
const BLOCK_SIZE: usize = 3;

struct PeakAllocator;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grow(bytes: usize) {
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: forwards to `System`; the counters do not touch the memory.
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

/// `Linear(GELU(Linear(LN(x))))`, as the crate's `MlpBlock`.
struct Mlp {
    norm: LayerNorm<B>,
    expand: Linear<B>,
    project: Linear<B>,
}

impl Mlp {
    fn new(device: &<B as Backend>::Device) -> Self {
        Self {
            norm: LayerNormConfig::new(WIDTH).init(device),
            expand: LinearConfig::new(WIDTH, 4 * WIDTH).init(device),
            project: LinearConfig::new(4 * WIDTH, WIDTH).init(device),
        }
    }

    fn branch(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.project
            .forward(Gelu::new().forward(self.expand.forward(self.norm.forward(x))))
    }
}

#[derive(Clone, Copy)]
enum Variant {
    Residual,
    AttnRes,
    BlockAttnRes,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Residual => "residual",
            Self::AttnRes => "attnres",
            Self::BlockAttnRes => "block_attnres",
        }
    }
}

struct Model {
    variant: Variant,
    blocks: Vec<Mlp>,
    /// One per block and one for the output.
    ops: Vec<AttnResOp<B>>,
}

impl Model {
    fn new(variant: Variant, depth: usize, device: &<B as Backend>::Device) -> Self {
        let config = AttnResConfig::new(WIDTH, 2 * depth, depth);
        Self {
            variant,
            blocks: (0..depth).map(|_| Mlp::new(device)).collect(),
            ops: (0..=depth).map(|_| config.init_op(device)).collect(),
        }
    }

    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match self.variant {
            Variant::Residual => self
                .blocks
                .iter()
                .fold(x, |stream, block| stream.clone() + block.branch(stream)),
            Variant::AttnRes | Variant::BlockAttnRes => {
                let group = match self.variant {
                    Variant::AttnRes => 1,
                    _ => BLOCK_SIZE,
                };
                let mut sources = vec![x];
                let mut partial: Option<Tensor<B, 3>> = None;
                for (l, block) in self.blocks.iter().enumerate() {
                    let h = self.ops[l].forward_optional_partial(&sources, partial.as_ref());
                    let v = block.branch(h);
                    let sum = match partial.take() {
                        Some(sum) => sum + v,
                        None => v,
                    };
                    if (l + 1) % group == 0 {
                        sources.push(sum);
                    } else {
                        partial = Some(sum);
                    }
                }
                self.ops[self.blocks.len()].forward_optional_partial(&sources, partial.as_ref())
            }
        }
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut runs, mut warmup) = (7usize, 2usize);
    while let Some(flag) = args.next() {
        let value = args.next().and_then(|v| v.parse().ok());
        match (flag.as_str(), value) {
            ("--runs", Some(v)) if v > 0 => runs = v,
            ("--warmup", Some(v)) => warmup = v,
            _ => {
                eprintln!("usage: attnres-peer [--runs N] [--warmup N]");
                std::process::exit(2);
            }
        }
    }
    let device = Default::default();
    let variants = [Variant::Residual, Variant::AttnRes, Variant::BlockAttnRes];
    let mut ratios = Vec::new();
    for depth in DEPTHS {
        let input = Tensor::<B, 3>::random(
            [BATCH, LENGTH, WIDTH],
            Distribution::Normal(0.0, 1.0),
            &device,
        );
        let models: Vec<Model> = variants
            .iter()
            .map(|&v| Model::new(v, depth, &device))
            .collect();
        for pass in ["forward", "train_step"] {
            let run = |model: &Model| {
                let output = model.forward(input.clone());
                if pass == "train_step" {
                    let _ = output.mean().backward();
                } else {
                    let _ = output.into_data();
                }
            };
            for model in &models {
                for _ in 0..warmup {
                    run(model);
                }
            }
            // Round-robin, as bench_connectivity times its variants.
            let mut times = vec![Vec::new(); models.len()];
            let mut peaks = vec![0usize; models.len()];
            for _ in 0..runs {
                for (k, model) in models.iter().enumerate() {
                    let before = LIVE.load(Ordering::Relaxed);
                    PEAK.store(before, Ordering::Relaxed);
                    let start = Instant::now();
                    run(model);
                    times[k].push(start.elapsed().as_secs_f64());
                    peaks[k] = peaks[k].max(PEAK.load(Ordering::Relaxed) - before);
                }
            }
            let base = median(times[0].clone());
            for (k, model) in models.iter().enumerate() {
                let time = median(times[k].clone());
                println!(
                    r#"{{"peer": "attnres-0.1.1", "backend": "ndarray", "workload": "stack{depth}", "pass": "{pass}", "variant": "{}", "median_s": {time:.5}, "host_peak_bytes": {}}}"#,
                    model.variant.name(),
                    peaks[k]
                );
                if k > 0 {
                    ratios.push(format!(
                        "stack{depth}.{pass} {}: time {:.3}x residual, host peak {:.3}x",
                        model.variant.name(),
                        time / base,
                        peaks[k] as f64 / peaks[0] as f64
                    ));
                }
            }
        }
    }
    for line in ratios {
        println!("{line}");
    }
}
