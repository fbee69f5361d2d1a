//! A small Terminator (SFNE blocks, HyperZZW) on real handwritten digits, as 64-step pixel
//! sequences (the paper's pixel-level 1D task in miniature) and as 8x8 maps, against a plain
//! residual baseline with a similar parameter count.
//!
//! ```text
//! cargo run --release --example terminator_digits [-- --epochs 30 --lr 0.01 --device flex]
//! ```
//!
//! Prints progress, test accuracy, parameter counts and time per epoch for each model.

mod common;

use std::time::Instant;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use burn_connectivity::hyperzzw::{Geometry, SfneBlockConfig, Terminator, TerminatorConfig};
use burn_connectivity::{Hacn, HacnConfig, MlpBlock, MlpBlockConfig, Stack};
use common::{Args, Digits, accuracy, shuffled};

const USAGE: &str =
    "usage: terminator_digits [--device NAME] [--epochs N] [--lr X] [--omega0 X] [--seed N]";

/// What a model returns for a batch of pixels `[B, 64]`: logits and an extra loss term.
trait Classifier: Module {
    fn logits_and_extra_loss(&self, pixels: Tensor<2>) -> (Tensor<2>, Option<Tensor<1>>);
}

/// The Terminator on one view of the pixels.
#[derive(Module, Debug)]
struct TerminatorClassifier {
    model: Terminator,
    #[module(skip)]
    geometry: Geometry,
}

impl Classifier for TerminatorClassifier {
    fn logits_and_extra_loss(&self, pixels: Tensor<2>) -> (Tensor<2>, Option<Tensor<1>>) {
        let batch = pixels.dims()[0];
        // A sequence of 64 steps and a row-major 8x8 map share the [B, 1, 64] layout.
        let out = self
            .model
            .forward(pixels.reshape([batch, 1, 64]))
            .expect("input matches the configured geometry");
        (out.logits, Some(out.slow_loss))
    }
}

/// Plain residual baseline: pixels → linear → residual MLP blocks → LayerNorm → head.
#[derive(Module, Debug)]
struct ResidualClassifier {
    embed: Linear,
    stack: Stack<MlpBlock, Hacn>,
    norm: LayerNorm,
    head: Linear,
}

impl ResidualClassifier {
    fn new(width: usize, blocks: usize, device: &Device) -> Result<Self, String> {
        let error = |err: burn_connectivity::Error| err.to_string();
        let blocks = MlpBlockConfig::new(width, 2 * width)
            .init_stack(blocks, device)
            .map_err(error)?;
        Ok(Self {
            embed: LinearConfig::new(64, width).init(device),
            stack: Stack::new(blocks, &HacnConfig::resnet(), device).map_err(error)?,
            norm: LayerNormConfig::new(width).init(device),
            head: LinearConfig::new(width, Digits::CLASSES).init(device),
        })
    }
}

impl Classifier for ResidualClassifier {
    fn logits_and_extra_loss(&self, pixels: Tensor<2>) -> (Tensor<2>, Option<Tensor<1>>) {
        let features = self.stack.forward(self.embed.forward(pixels));
        (self.head.forward(self.norm.forward(features)), None)
    }
}

struct Settings {
    epochs: usize,
    learning_rate: f64,
    seed: u64,
}

struct Report {
    name: String,
    parameters: usize,
    accuracy: f64,
    seconds_per_epoch: f64,
}

fn train<M: Classifier>(
    name: &str,
    mut model: M,
    data: (&Digits, &Digits),
    settings: &Settings,
    device: &Device,
) -> Report {
    let (train_set, test_set) = data;
    let parameters = model.num_params();
    println!("training {name} ({parameters} parameters)");
    let mut optimizer = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let all_test: Vec<usize> = (0..test_set.len()).collect();
    let (test_pixels, test_labels) = test_set.batch(&all_test, &device.clone().without_autodiff());
    let started = Instant::now();
    let mut test_accuracy = 0.0;
    for epoch in 1..=settings.epochs {
        let order = shuffled(train_set.len(), settings.seed + epoch as u64);
        let (mut loss_sum, mut batches) = (0.0, 0);
        for indices in order.chunks(64) {
            let (pixels, labels) = train_set.batch(indices, device);
            let (logits, extra) = model.logits_and_extra_loss(pixels);
            let loss = loss_fn.forward(logits, labels);
            let loss = match extra {
                Some(extra) => loss + extra,
                None => loss,
            };
            loss_sum += loss.clone().into_scalar::<f64>();
            batches += 1;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(settings.learning_rate, model, grads);
        }
        let (logits, _) = model.valid().logits_and_extra_loss(test_pixels.clone());
        test_accuracy = accuracy(logits, test_labels.clone());
        println!(
            "  [{name}] epoch {epoch:>2}/{}  loss {:.4}  test acc {test_accuracy:.3}  ({:.1}s)",
            settings.epochs,
            loss_sum / batches as f64,
            started.elapsed().as_secs_f64()
        );
    }
    Report {
        name: name.to_string(),
        parameters,
        accuracy: test_accuracy,
        seconds_per_epoch: started.elapsed().as_secs_f64() / settings.epochs as f64,
    }
}

fn terminator(
    geometry: Geometry,
    omega_0: f64,
    device: &Device,
) -> Result<TerminatorClassifier, String> {
    let block = SfneBlockConfig::new(1, 1, geometry)
        .with_groups(4)
        .with_global_hidden(16)
        .with_local_hidden(16)
        .with_channel_hidden(16)
        .with_local_kernel_sizes(vec![3, 5])
        .with_omega_0(omega_0)
        .with_dropout(0.05);
    let model = TerminatorConfig::new(Digits::CLASSES, block)
        .with_expansions(vec![8, 2])
        .init(device)
        .map_err(|err| err.to_string())?;
    Ok(TerminatorClassifier { model, geometry })
}

fn run() -> Result<(), String> {
    let args = Args::parse(USAGE, &["epochs", "lr", "omega0", "seed"])?;
    let settings = Settings {
        epochs: args.get("epochs", 30)?,
        learning_rate: args.get("lr", 1e-2)?,
        seed: args.get("seed", 7)?,
    };
    let omega_0: f64 = args.get("omega0", 30.0)?;
    let device = args.device()?.autodiff();
    let (train_set, test_set) = Digits::load()?.split(0.2, settings.seed);
    println!(
        "digits: {} train / {} held-out test images, {} epochs, Adam lr {}, slow nets with ω0 = {omega_0}",
        train_set.len(),
        test_set.len(),
        settings.epochs,
        settings.learning_rate
    );
    let data = (&train_set, &test_set);

    let mut reports = Vec::new();
    device.seed(settings.seed);
    let sequence = terminator(Geometry::Sequence { length: 64 }, omega_0, &device)?;
    let budget = sequence.num_params();
    reports.push(train("terminator-1d", sequence, data, &settings, &device));
    device.seed(settings.seed);
    let map = terminator(
        Geometry::Map {
            rows: 8,
            columns: 8,
        },
        omega_0,
        &device,
    )?;
    reports.push(train("terminator-2d", map, data, &settings, &device));

    // The widest 4-block residual MLP within the Terminator's parameter budget.
    let blocks = 4;
    let mut width = 8;
    while ResidualClassifier::new(width + 8, blocks, &device)?.num_params() <= budget {
        width += 8;
    }
    device.seed(settings.seed);
    let baseline = ResidualClassifier::new(width, blocks, &device)?;
    reports.push(train(
        &format!("residual-mlp-{blocks}x{width}"),
        baseline,
        data,
        &settings,
        &device,
    ));

    println!(
        "\n{:<22} {:>10} {:>9} {:>12}",
        "model", "params", "test acc", "s / epoch"
    );
    for report in &reports {
        println!(
            "{:<22} {:>10} {:>9.3} {:>12.2}",
            report.name, report.parameters, report.accuracy, report.seconds_per_epoch
        );
    }
    Ok(())
}

fn main() {
    if let Err(message) = run() {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}
