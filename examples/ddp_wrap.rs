//! A wrapped burn-nn encoder (mHC at sublayer granularity) trained with burn-train's `Learner`,
//! on one device or with its distributed data-parallel strategy over several CUDA devices.
//!
//! ```text
//! cargo run --release --features train --example ddp_wrap [-- --device flex --epochs 3]
//! cargo run --release --features train,cuda --example ddp_wrap -- --device cuda --strategy ddp --devices 2
//! ```
//!
//! The digits are read as sequences of 8 rows of 8 pixels, embedded to width 32, through a
//! 2-layer pre-norm encoder whose residual connections are mHC's (4 streams, each attention and
//! feed-forward sublayer one mHC layer), mean-pooled into a linear head. With `--strategy ddp`
//! every device holds a copy of the model, takes its own batches, and the gradients are
//! all-reduced (mean) after each step. Burn 0.22.1 all-reduces only over NCCL, so DDP needs
//! `--device cuda` (a build with `--features cuda`, one process, `--devices N` GPUs); on other
//! backends the example says so and exits.

use burn_connectivity_tools as common;

use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::TransformerEncoderConfig;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::distributed::{DistributedConfig, ReduceOperation};
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::{AccuracyMetric, LossMetric, MetricDefinition};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};
use burn::train::{
    ClassificationOutput, ExecutionStrategy, InferenceStep, Learner, SupervisedTraining,
    TrainOutput, TrainStep,
};
use burn_connectivity::training::{GroupedAdamConfig, connectivity_group};
use burn_connectivity::transformer::{ConnectedEncoder, EncoderMasks, Granularity};
use burn_connectivity::{Mhc, MhcConfig};
use clap::Parser;
use common::{DeviceArg, Digits, accuracy};

/// How training is spread over devices.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    /// One device.
    Single,
    /// burn-train's DDP over `--devices` CUDA devices (gradients all-reduced over NCCL).
    Ddp,
}

/// An mHC-wrapped burn-nn encoder on the digits, trained with burn-train's Learner on one
/// device or with DDP.
#[derive(Parser, Debug)]
#[command(long_about = None)]
struct Flags {
    #[command(flatten)]
    device: DeviceArg,
    /// One device, or DDP (CUDA only).
    #[arg(long, value_enum, default_value = "single")]
    strategy: Strategy,
    /// Devices to train on.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    devices: u64,
    /// Training epochs.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    epochs: u64,
    /// Seed of the weights, the split and the data order.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

const ROWS: usize = 8;
const WIDTH: usize = 32;

/// Images as `[n, 8, 8]` row sequences and their labels.
#[derive(Clone, Debug)]
struct Batch {
    rows: Tensor<3>,
    labels: Tensor<1, Int>,
}

#[derive(Clone, Debug)]
struct Image {
    pixels: [f32; 64],
    label: usize,
}

struct ImageBatcher;

impl Batcher<Image, Batch> for ImageBatcher {
    fn batch(&self, images: Vec<Image>, device: &Device) -> Batch {
        let count = images.len();
        let pixels: Vec<f32> = images.iter().flat_map(|image| image.pixels).collect();
        let labels: Vec<i64> = images.iter().map(|image| image.label as i64).collect();
        Batch {
            rows: Tensor::from_data(TensorData::new(pixels, [count, ROWS, 64 / ROWS]), device),
            labels: Tensor::from_data(TensorData::new(labels, [count]), device),
        }
    }
}

fn images(digits: &Digits) -> Vec<Image> {
    digits
        .pixels
        .iter()
        .zip(&digits.labels)
        .map(|(&pixels, &label)| Image { pixels, label })
        .collect()
}

fn loader(images: Vec<Image>, shuffle: Option<u64>) -> Arc<dyn DataLoader<Batch>> {
    let builder = DataLoaderBuilder::new(ImageBatcher).batch_size(32);
    let builder = match shuffle {
        Some(seed) => builder.shuffle(seed),
        None => builder,
    };
    builder.build(InMemDataset::new(images))
}

/// Row embedding, the mHC-wrapped encoder, mean pooling, linear head.
#[derive(Module, Debug)]
struct Classifier {
    embed: Linear,
    encoder: ConnectedEncoder<Mhc>,
    head: Linear,
}

impl Classifier {
    fn new(device: &Device) -> Result<Self, String> {
        let encoder = TransformerEncoderConfig::new(WIDTH, 2 * WIDTH, 4, 2)
            .with_norm_first(true)
            .with_dropout(0.0)
            .init(device);
        let connectivity = MhcConfig::new(WIDTH);
        Ok(Self {
            embed: LinearConfig::new(64 / ROWS, WIDTH).init(device),
            encoder: ConnectedEncoder::new(encoder, Granularity::Sublayer, &connectivity, device)
                .map_err(|err| err.to_string())?,
            head: LinearConfig::new(WIDTH, Digits::CLASSES).init(device),
        })
    }

    fn logits(&self, rows: Tensor<3>) -> Tensor<2> {
        let hidden = self
            .encoder
            .forward(self.embed.forward(rows), &EncoderMasks::default());
        self.head.forward(hidden.mean_dim(1).squeeze_dim::<2>(1))
    }

    fn classify(&self, batch: Batch) -> ClassificationOutput {
        let logits = self.logits(batch.rows);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.labels.clone());
        ClassificationOutput::new(loss, logits, batch.labels)
    }
}

impl TrainStep for Classifier {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        let output = self.classify(batch);
        TrainOutput::new(self, output.loss.backward(), output)
    }
}

impl InferenceStep for Classifier {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> ClassificationOutput {
        self.classify(batch)
    }
}

/// One line per finished split (burn-train's plain renderer prints every batch).
#[derive(Default)]
struct EpochLines {
    epoch: usize,
    epochs: usize,
    split: String,
    items: usize,
    started: Option<std::time::Instant>,
}

impl TrainingProgressLogger for EpochLines {
    fn start(&mut self, epochs: usize, first: usize, _: Option<usize>, _: Option<&str>) {
        // `first` counts from 1; the training split of each epoch advances it.
        (self.epochs, self.epoch) = (epochs, first.saturating_sub(1));
    }

    fn update_epoch(&mut self, _: usize) {}

    fn start_split(&mut self, split: &str, total_items: usize) {
        // Every epoch starts with its training split.
        if split == "train" {
            self.epoch += 1;
        }
        (self.split, self.items) = (split.to_string(), total_items);
        self.started = Some(std::time::Instant::now());
    }

    fn update_split(&mut self, _: usize) {}

    fn end_split(&mut self) {
        let seconds = self
            .started
            .map_or(0.0, |started| started.elapsed().as_secs_f64());
        println!(
            "epoch {}/{}: {} split, {} images, {seconds:.1} s",
            self.epoch, self.epochs, self.split, self.items
        );
    }

    fn end(&mut self) {}

    fn log_event_training(&mut self, _: String) {}
}

impl EvaluationProgressLogger for EpochLines {
    fn start_global_progress(&mut self, _: usize) {}
    fn start_test(&mut self, _: &str, _: usize) {}
    fn update_test_progress(&mut self, _: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _: String) {}
}

impl MetricsRendererTraining for EpochLines {
    fn update_train(&mut self, _: MetricState) {}
    fn update_valid(&mut self, _: MetricState) {}
}

impl MetricsRendererEvaluation for EpochLines {
    fn update_test(&mut self, _: EvaluationName, _: MetricState) {}
}

impl MetricsRenderer for EpochLines {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _: MetricDefinition) {}
}

/// Where training runs, from the flags.
fn strategy(flags: &Flags) -> Result<ExecutionStrategy, String> {
    let name = flags.device.device.clone();
    let count = flags.devices as usize;
    let devices = burn_connectivity::device::devices(&name, count)
        .map_err(|err| format!("--device {name} --devices {count}: {err}"))?;
    let devices: Vec<Device> = devices.into_iter().map(Device::autodiff).collect();
    match flags.strategy {
        Strategy::Single if devices.len() == 1 => Ok(ExecutionStrategy::single(devices[0].clone())),
        Strategy::Single => Err("--strategy single takes --devices 1".into()),
        Strategy::Ddp if name == "cuda" => Ok(ExecutionStrategy::ddp(
            devices,
            DistributedConfig {
                all_reduce_op: ReduceOperation::Mean,
            },
        )),
        Strategy::Ddp => Err(format!(
            "--strategy ddp needs --device cuda (got {name}): Burn 0.22.1 all-reduces gradients \
             only over NCCL"
        )),
    }
}

fn run(flags: Flags) -> Result<(), String> {
    let epochs = flags.epochs as usize;
    let seed = flags.seed;
    let strategy = strategy(&flags)?;
    let device = strategy.main_device().clone();
    device.seed(seed);

    let (train_set, test_set) = Digits::load()?.split(0.2, seed);
    println!(
        "digits: {} train / {} held-out images; mHC (4 streams) around each sublayer of a \
         2-layer encoder, width {WIDTH}",
        train_set.len(),
        test_set.len()
    );
    let model = Classifier::new(&device)?;
    let config = GroupedAdamConfig::new()
        .with_learning_rate(3e-3)
        .with_connectivity_learning_rate(3e-3);
    let group = connectivity_group(&model.encoder.connectivity);
    let (optimizer, learning_rates) = config.build(&group).map_err(|err| err.to_string())?;
    let learner = Learner::new(model, optimizer, learning_rates);

    let directory = std::env::temp_dir().join(format!("ddp-wrap-{}", std::process::id()));
    let started = std::time::Instant::now();
    let result = SupervisedTraining::new(
        &directory,
        loader(images(&train_set), Some(seed)),
        loader(images(&test_set), None),
    )
    .metric_train_numeric(LossMetric::new())
    .metric_valid_numeric(LossMetric::new())
    .metric_valid_numeric(AccuracyMetric::new())
    .with_application_logger(None)
    .renderer(Box::new(EpochLines::default()))
    .num_epochs(epochs)
    .with_training_strategy(strategy.into())
    .launch(learner);
    std::fs::remove_dir_all(&directory).ok();
    if let Some(error) = result.error {
        return Err(format!("training failed: {error:?}"));
    }

    let (pixels, labels) = test_set.all(&device.clone().without_autodiff());
    let model = result.model.valid();
    let logits = model.logits(pixels.reshape([test_set.len(), ROWS, 64 / ROWS]));
    println!(
        "held-out accuracy after {epochs} epochs: {:.3} ({:.1} s)",
        accuracy(logits, labels),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::exit(run(Flags::parse()))
}
