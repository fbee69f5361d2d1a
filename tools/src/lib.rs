//! Support shared by burn-connectivity's examples and developer tools: the `--device` flag,
//! progress bars, the digits data set and its classifier, the character-level language model
//! ([`lm`]), the Terminator models ([`terminator`]) and the benchmark workloads ([`workloads`]).
//!
//! The tools are binaries of this package (`cargo run --release -p burn-connectivity-tools --bin
//! NAME`): `bench_connectivity`, `kernel_counts` (`--features wgpu`) and `reproduce`.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn::module::ParamGroup;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn_connectivity::training::{GroupedAdamConfig, LrSchedule, connectivity_group};
use burn_connectivity::{ConnectivityConfig, MlpBlock, MlpBlockConfig, Stack, StreamConnectivity};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle, TermLike};

pub mod lm;
pub mod terminator;
pub mod workloads;

/// Draws every parameter of `module` now. burn-nn's layers draw their initial values when first
/// used, so without this a connectivity that draws its own random parameters at construction
/// (H-ACN's noisy gates, mHC's `φ`, HyperZZW) would move the generator before the blocks draw
/// theirs, and the variants of a comparison would not start from the same weights.
pub fn draw_now<M: Module>(module: &M) {
    struct DrawNow;

    impl burn::module::ModuleVisitor for DrawNow {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            let _ = param.val();
        }
    }

    module.visit(&mut DrawNow);
}

/// For the command-line tests: runs `program` with `args` and asserts exit code 2, `flag` in the
/// message on standard error, and no panic.
pub fn assert_refused(program: &std::path::Path, args: &[&str], flag: &str) {
    let output = std::process::Command::new(program)
        .args(args)
        .output()
        .expect("runs");
    let name = program.display();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{name} {args:?}: {stderr}");
    assert!(
        stderr.contains(flag),
        "{name} {args:?} does not name {flag}: {stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "{name} {args:?} panicked: {stderr}"
    );
}

/// The `--device` flag every example takes.
#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArg {
    /// Backend to run on: flex, ndarray, wgpu, vulkan, metal, cuda or tch (those compiled in;
    /// `--features NAME` adds one).
    #[arg(long, default_value = "flex")]
    pub device: String,
}

impl DeviceArg {
    /// The device; an error names the compiled backends.
    pub fn device(&self) -> Result<Device, String> {
        burn_connectivity::device::device(&self.device).map_err(|err| err.to_string())
    }
}

/// The process exit code of an example's `run`: 0, or 2 with the message on standard error.
pub fn exit(result: Result<(), String>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}

/// An error naming the first flag whose count is 0.
pub fn require_counts(counts: &[(&str, usize)]) -> Result<(), String> {
    match counts.iter().find(|(_, value)| *value == 0) {
        Some((flag, _)) => Err(format!("{flag} must be at least 1")),
        None => Ok(()),
    }
}

/// The flags of a digits classifier run (quickstart, compress_digits).
#[derive(clap::Args, Debug, Clone)]
pub struct DigitsArgs {
    /// Training epochs per model.
    #[arg(long, default_value_t = 30)]
    pub epochs: usize,
    /// MLP blocks.
    #[arg(long, default_value_t = 16)]
    pub blocks: usize,
    /// Block width.
    #[arg(long, default_value_t = 32)]
    pub width: usize,
    /// Peak learning rate of the weights.
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    /// Seed of the weights, the splits and the data order.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}

impl DigitsArgs {
    /// Rejects zero counts and a learning rate outside `(0, 1]`.
    pub fn check(&self) -> Result<(), String> {
        require_counts(&[
            ("--epochs", self.epochs),
            ("--blocks", self.blocks),
            ("--width", self.width),
        ])?;
        if !(self.lr.is_finite() && self.lr > 0.0 && self.lr <= 1.0) {
            return Err(format!(
                "--lr must be a finite number in (0, 1], got {}",
                self.lr
            ));
        }
        Ok(())
    }
}

/// A progress bar on standard error, `prefix` in front; where standard error is not a terminal,
/// a plain line every [`LOG_EVERY`] instead ([`LineLog`]).
pub fn progress(len: u64, prefix: impl Into<String>) -> ProgressBar {
    let bar = ProgressBar::new(len);
    if !std::io::stderr().is_terminal() {
        bar.set_draw_target(ProgressDrawTarget::term_like(Box::new(LineLog::default())));
    }
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix:>12} [{bar:30.cyan/blue}] {pos}/{len} {msg} ({elapsed}, eta {eta})",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_prefix(prefix.into());
    bar.enable_steady_tick(Duration::from_millis(500));
    bar
}

/// How often a progress bar writes a line where standard error is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// A progress bar's target where standard error is not a terminal (a log file, CI, a GPU
/// machine's run): indicatif draws nothing there, so a long run's log would not show its pace.
/// This writes the bar as one plain line at most every `every` ([`LOG_EVERY`]).
#[derive(Debug)]
struct LineLog {
    every: Duration,
    /// When the last line was written, and the line being drawn.
    state: Mutex<(Instant, String)>,
}

impl Default for LineLog {
    fn default() -> Self {
        Self {
            every: LOG_EVERY,
            state: Mutex::new((Instant::now(), String::new())),
        }
    }
}

impl LineLog {
    /// The drawn line, if one is due; starts the next.
    fn take_line(&self) -> Option<String> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let (last, line) = &mut *state;
        let due = last.elapsed() >= self.every && !line.trim().is_empty();
        let taken = due.then(|| line.trim_end().to_string());
        if due {
            *last = Instant::now();
        }
        line.clear();
        taken
    }
}

impl TermLike for LineLog {
    fn width(&self) -> u16 {
        100
    }
    fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn write_line(&self, line: &str) -> std::io::Result<()> {
        self.write_str(line)
    }
    fn write_str(&self, text: &str) -> std::io::Result<()> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        state.1.push_str(text.trim_start_matches('\r'));
        Ok(())
    }
    fn clear_line(&self) -> std::io::Result<()> {
        Ok(())
    }
    /// indicatif flushes once per redraw: the line is complete here.
    fn flush(&self) -> std::io::Result<()> {
        if let Some(line) = self.take_line() {
            eprintln!("{line}");
        }
        Ok(())
    }
}

/// The UCI handwritten digits (8x8 images, pixels 0..16, labels 0..9; CC BY 4.0, see
/// tools/data/README.md), shipped in the repository so the examples run offline.
pub struct Digits {
    /// One row of 64 pixels per image, scaled to `[0, 1]`.
    pub pixels: Vec<[f32; 64]>,
    /// The digit shown.
    pub labels: Vec<usize>,
}

impl Digits {
    /// Number of classes.
    pub const CLASSES: usize = 10;

    /// Parses the bundled CSV.
    pub fn load() -> Result<Self, String> {
        let mut digits = Self {
            pixels: Vec::new(),
            labels: Vec::new(),
        };
        for (line_number, line) in include_str!("../data/digits.csv").lines().enumerate() {
            let values: Vec<u8> = line
                .split(',')
                .map(|value| value.trim().parse())
                .collect::<Result<_, _>>()
                .map_err(|err| format!("digits.csv line {}: {err}", line_number + 1))?;
            let (label, pixels) = values.split_last().ok_or("digits.csv: empty line")?;
            let pixels: [u8; 64] = pixels
                .try_into()
                .map_err(|_| format!("digits.csv line {}: expected 64 pixels", line_number + 1))?;
            digits
                .pixels
                .push(pixels.map(|pixel| f32::from(pixel) / 16.0));
            digits.labels.push(usize::from(*label));
        }
        Ok(digits)
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there is no image.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// A shuffled split into (train, held-out test), deterministic for a given `seed`.
    pub fn split(self, test_fraction: f64, seed: u64) -> (Self, Self) {
        let order = shuffled(self.len(), seed);
        let test_len = (self.len() as f64 * test_fraction).round() as usize;
        let pick = |indices: &[usize]| Self {
            pixels: indices.iter().map(|&i| self.pixels[i]).collect(),
            labels: indices.iter().map(|&i| self.labels[i]).collect(),
        };
        (pick(&order[test_len..]), pick(&order[..test_len]))
    }

    /// The images of the listed classes only, relabelled `0..classes.len()` in that order.
    pub fn only_classes(&self, classes: &[usize]) -> Self {
        let kept: Vec<(usize, usize)> = self
            .labels
            .iter()
            .enumerate()
            .filter_map(|(index, label)| {
                classes
                    .iter()
                    .position(|class| class == label)
                    .map(|new| (index, new))
            })
            .collect();
        Self {
            pixels: kept.iter().map(|&(index, _)| self.pixels[index]).collect(),
            labels: kept.iter().map(|&(_, new)| new).collect(),
        }
    }

    /// The same images with their 64 pixels reordered by `permutation` (pixel `k` of an output
    /// image is pixel `permutation[k]` of the input).
    pub fn permuted(&self, permutation: &[usize]) -> Self {
        Self {
            pixels: self
                .pixels
                .iter()
                .map(|image| std::array::from_fn(|k| image[permutation[k]]))
                .collect(),
            labels: self.labels.clone(),
        }
    }

    /// Every image at once, `[n, 64]` and `[n]`.
    pub fn all(&self, device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
        self.batch(&(0..self.len()).collect::<Vec<_>>(), device)
    }

    /// The images at `indices` as `[n, 64]` features and `[n]` labels.
    pub fn batch(&self, indices: &[usize], device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
        let pixels: Vec<f32> = indices.iter().flat_map(|&i| self.pixels[i]).collect();
        let labels: Vec<i64> = indices.iter().map(|&i| self.labels[i] as i64).collect();
        (
            Tensor::from_data(TensorData::new(pixels, [indices.len(), 64]), device),
            Tensor::from_data(TensorData::new(labels, [indices.len()]), device),
        )
    }
}

/// `0..len` in a pseudo-random order (a small LCG: the examples need no RNG crate).
pub fn shuffled(len: usize, seed: u64) -> Vec<usize> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut order: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        order.swap(i, (state >> 33) as usize % (i + 1));
    }
    order
}

/// Fraction of rows of `logits` whose arg-max is the label.
pub fn accuracy(logits: Tensor<2>, labels: Tensor<1, Int>) -> f64 {
    let total = labels.dims()[0];
    let predictions = logits.argmax(1).flatten::<1>(0, 1);
    let correct = predictions.equal(labels).int().sum().into_scalar::<i64>();
    correct as f64 / total as f64
}

/// Pixels → embedding → connected stack of MLP blocks → LayerNorm → linear head.
#[derive(Module, Debug)]
pub struct Classifier<C> {
    pub embed: Linear,
    pub stack: Stack<MlpBlock, C>,
    pub norm: LayerNorm,
    pub head: Linear,
}

impl<C: StreamConnectivity<2>> Classifier<C> {
    /// `blocks` MLP blocks of width `width` wired by `connectivity`, for `classes` classes.
    pub fn new(
        connectivity: &impl ConnectivityConfig<Connectivity = C>,
        blocks: usize,
        width: usize,
        classes: usize,
        device: &Device,
    ) -> Result<Self, String> {
        // Blocks and head are drawn before the connectivity so every variant starts from the
        // same weights; only connectivities with random parameters draw after them.
        let embed = LinearConfig::new(64, width).init(device);
        let blocks = MlpBlockConfig::new(width, 2 * width)
            .init_stack(blocks, device)
            .map_err(|err| err.to_string())?;
        let norm = LayerNormConfig::new(width).init(device);
        let head = LinearConfig::new(width, classes).init(device);
        draw_now(&embed);
        draw_now(&blocks);
        draw_now(&head);
        let stack = Stack::new(blocks, connectivity, device).map_err(|err| err.to_string())?;
        Ok(Self {
            embed,
            stack,
            norm,
            head,
        })
    }

    pub fn classify(&self, readout: Tensor<2>) -> Tensor<2> {
        self.head.forward(self.norm.forward(readout))
    }

    pub fn forward(&self, pixels: Tensor<2>) -> Tensor<2> {
        self.classify(self.stack.forward(self.embed.forward(pixels)))
    }

    /// Logits of every readout `y_0..y_L` through the shared head.
    pub fn layerwise(&self, pixels: Tensor<2>) -> Vec<Tensor<2>> {
        let readout = self.stack.readout(self.embed.forward(pixels));
        readout.into_iter().map(|y| self.classify(y)).collect()
    }
}

/// How a digits classifier trains: mini-batches of `batch_size` in a seeded order, one
/// optimiser step each, `epochs` passes.
pub struct DigitsTraining {
    pub epochs: usize,
    pub batch_size: usize,
    pub seed: u64,
    /// Built for the whole run: its schedule must know `epochs · batches` steps.
    pub optimizer: GroupedAdamConfig,
}

impl DigitsTraining {
    /// Batches of 64 on `train_len` images; AdamW at `lr` (β2 0.999, no clipping) with the
    /// connectivity at `connectivity_lr`, one epoch of warmup, cosine decay over the run.
    pub fn warmup_cosine(
        (epochs, seed): (usize, u64),
        (lr, connectivity_lr): (f64, f64),
        train_len: usize,
    ) -> Result<Self, String> {
        let batch_size = 64;
        let steps_per_epoch = train_len.div_ceil(batch_size);
        let optimizer = recipe(
            lr,
            connectivity_lr,
            0.999,
            0.0,
            steps_per_epoch,
            epochs * steps_per_epoch,
        )?;
        Ok(Self {
            epochs,
            batch_size,
            seed,
            optimizer,
        })
    }
}

/// Trains `model` on `train`, the connectivity in its own parameter group; `after_epoch` sees
/// the epoch, its mean training loss and the model. `bar` advances once per epoch.
pub fn fit_digits<C: StreamConnectivity<2>>(
    mut model: Classifier<C>,
    train: &Digits,
    training: &DigitsTraining,
    bar: &ProgressBar,
    mut after_epoch: impl FnMut(usize, f64, &Classifier<C>),
) -> Result<Classifier<C>, String> {
    let device = model.embed.weight.device();
    let group = connectivity_group(&model.stack.connectivity);
    let (mut optimizer, mut learning_rates) = training
        .optimizer
        .build(&group)
        .map_err(|err| err.to_string())?;
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    for epoch in 1..=training.epochs {
        let order = shuffled(train.len(), training.seed + epoch as u64);
        let (mut loss_sum, mut batches) = (0.0, 0);
        for indices in order.chunks(training.batch_size) {
            let (pixels, labels) = train.batch(indices, &device);
            let loss = loss_fn.forward(model.forward(pixels), labels);
            loss_sum += loss.clone().into_scalar::<f64>();
            batches += 1;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(learning_rates.step(), model, grads);
        }
        after_epoch(epoch, loss_sum / batches as f64, &model);
        bar.inc(1);
    }
    Ok(model)
}

/// The training recipe from the flags of the same names, every bad value an error naming its
/// flag: AdamW (`--lr`, `--beta2`) with the connectivity in its own group
/// (`--connectivity-lr`, no weight decay), clipping at `--clip` (0: none), `--warmup` steps of
/// linear warmup then cosine decay to 10% over `total_steps`.
pub fn recipe(
    lr: f64,
    connectivity_lr: f64,
    beta2: f64,
    clip: f64,
    warmup: usize,
    total_steps: usize,
) -> Result<GroupedAdamConfig, String> {
    let positive = |flag: &str, value: f64| {
        if value.is_finite() && value > 0.0 && value <= 1.0 {
            Ok(())
        } else {
            Err(format!(
                "{flag} must be a finite number in (0, 1], got {value}"
            ))
        }
    };
    positive("--lr", lr)?;
    positive("--connectivity-lr", connectivity_lr)?;
    if !(beta2.is_finite() && (0.0..1.0).contains(&beta2)) {
        return Err(format!("--beta2 must be in [0, 1), got {beta2}"));
    }
    if !(clip.is_finite() && clip >= 0.0) {
        return Err(format!(
            "--clip must be a finite norm >= 0 (0: no clipping), got {clip}"
        ));
    }
    if total_steps == 0 {
        return Err("the run has no optimiser steps (--steps / --epochs is 0)".into());
    }
    if warmup >= total_steps {
        return Err(format!(
            "--warmup ({warmup} steps) must be shorter than training ({total_steps} steps)"
        ));
    }
    let config = GroupedAdamConfig::new()
        .with_learning_rate(lr)
        .with_connectivity_learning_rate(connectivity_lr)
        .with_beta_2(beta2)
        .with_gradient_clip_norm((clip > 0.0).then_some(clip))
        .with_schedule(LrSchedule::WarmupCosine {
            warmup_steps: warmup,
            total_steps,
            final_fraction: 0.1,
        });
    config
        .build(&ParamGroup::all())
        .map_err(|err| err.to_string())?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A redraw as indicatif writes it (a carriage return, the bar, the filler up to the width)
    /// becomes one plain line, written only once `every` has passed since the last.
    #[test]
    fn line_log_writes_a_redraw_as_one_line_when_due() {
        let due = LineLog {
            every: Duration::ZERO,
            ..LineLog::default()
        };
        due.write_str("\r").unwrap();
        due.write_str("    residual [==>  ] 3/10").unwrap();
        due.write_str("      ").unwrap();
        assert_eq!(
            due.take_line().as_deref(),
            Some("    residual [==>  ] 3/10")
        );
        assert_eq!(due.take_line(), None, "nothing drawn since");

        let not_due = LineLog::default();
        not_due.write_str("residual 4/10").unwrap();
        assert_eq!(
            not_due.take_line(),
            None,
            "within LOG_EVERY of its creation"
        );
        not_due.write_str("residual 5/10").unwrap();
        let mut state = not_due.state.lock().unwrap();
        assert_eq!(
            state.1, "residual 5/10",
            "the last redraw replaced the one not written"
        );
        state.0 -= LOG_EVERY;
        drop(state);
        assert_eq!(not_due.take_line().as_deref(), Some("residual 5/10"));
    }
}
