//! Auto-compression on real handwritten digits: ResNet vs H-ACN.
//!
//! ```text
//! cargo run --release --features plot --example compress_digits [-- --tolerance 0.01 --epochs 30 --blocks 16]
//! ```
//!
//! Both models start from the same weights and see the same data. H-ACN's connectivity health
//! is recorded every 10 steps (JSON lines). After training, every readout depth is scored on a
//! validation split, the smallest depth within `--tolerance` of the full model's validation
//! accuracy is kept, and the truncated model is saved, reloaded as a model of that depth and
//! scored on the held-out test split. Pictures and logs go to `target/example-output/`:
//! `compress_layerwise.png` (validation accuracy vs depth), `compress_hacn_c.png` (H-ACN's
//! connectivity matrix, log scale), `compress_hacn_gates.png` (gates during training, from
//! `compress_hacn_health.jsonl`).

use burn_connectivity_tools as common;

use std::path::{Path, PathBuf};

use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams};
use std::process::ExitCode;

use burn::prelude::*;
use burn_connectivity::compression::{DepthChoice, Objective};
use burn_connectivity::health::{FamilyHealth, HealthRecorder, read_health_log};
use burn_connectivity::plot::{Heatmap, LineChart, Series};
use burn_connectivity::{Hacn, HacnConfig};
use clap::Parser;
use common::{Classifier, DeviceArg, Digits, DigitsArgs, accuracy, progress, shuffled};

/// Auto-compression on the bundled digits: ResNet vs H-ACN, truncated to the smallest depth
/// within a tolerance of the full model.
#[derive(Parser, Debug)]
#[command(long_about = None)]
struct Flags {
    #[command(flatten)]
    device: DeviceArg,
    /// Largest validation-accuracy loss the truncated model may have.
    #[arg(long, default_value_t = 0.01)]
    tolerance: f64,
    #[command(flatten)]
    digits: DigitsArgs,
}

struct Settings {
    epochs: usize,
    blocks: usize,
    width: usize,
    learning_rate: f64,
    seed: u64,
    tolerance: f64,
}

struct Splits {
    train: Digits,
    valid: Digits,
    test: Digits,
}

struct Outcome {
    name: &'static str,
    choice: DepthChoice,
    full_test: f64,
    compressed_test: f64,
    saved: PathBuf,
}

fn train(
    name: &'static str,
    config: &HacnConfig,
    splits: &Splits,
    settings: &Settings,
    device: &Device,
    output: &Path,
) -> Result<(Outcome, Classifier<Hacn>), String> {
    let error = |err: burn_connectivity::Error| err.to_string();
    device.seed(settings.seed);
    let mut model = Classifier::new(
        config,
        settings.blocks,
        settings.width,
        Digits::CLASSES,
        device,
    )?;
    let mut recorder = match config.trainable {
        true => Some(
            HealthRecorder::create(
                output.join(format!("compress_{name}_health.jsonl")),
                10,
                &model.stack.connectivity,
            )
            .map_err(error)?,
        ),
        false => None,
    };
    let mut optimizer = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let mut step = 0;
    let bar = progress(settings.epochs as u64, name);
    for epoch in 1..=settings.epochs {
        let order = shuffled(splits.train.len(), settings.seed + epoch as u64);
        for indices in order.chunks(64) {
            if let Some(recorder) = recorder.as_mut() {
                recorder
                    .record(step, &model.stack.connectivity)
                    .map_err(error)?;
            }
            let (pixels, labels) = splits.train.batch(indices, device);
            let loss = loss_fn.forward(model.forward(pixels), labels);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(settings.learning_rate, model, grads);
            step += 1;
        }
        bar.inc(1);
    }
    bar.finish_and_clear();

    let model = model.valid();
    let inference = device.clone().without_autodiff();
    let (valid_pixels, valid_labels) = splits.valid.all(&inference);
    let scores: Vec<f64> = model
        .layerwise(valid_pixels)
        .into_iter()
        .map(|logits| accuracy(logits, valid_labels.clone()))
        .collect();
    let (choice, stack) = model
        .stack
        .compress(&scores, settings.tolerance, Objective::Maximize)
        .map_err(error)?;
    let compressed = Classifier {
        stack,
        ..model.clone()
    };

    // A real smaller model: saved, then loaded into a freshly built model of that depth.
    let saved = output.join(format!("compress_{name}_depth{}.bpk", choice.depth));
    compressed
        .save_file(&saved)
        .map_err(|err| format!("saving {}: {err}", saved.display()))?;
    let reloaded = Classifier::new(
        config,
        choice.depth,
        settings.width,
        Digits::CLASSES,
        &inference,
    )?
    .try_load_file(&saved)
    .map_err(|err| format!("loading {}: {err}", saved.display()))?;
    let (test_pixels, test_labels) = splits.test.all(&inference);
    let full_test = accuracy(model.forward(test_pixels.clone()), test_labels.clone());
    let compressed_test = accuracy(reloaded.forward(test_pixels), test_labels);
    let outcome = Outcome {
        name,
        choice,
        full_test,
        compressed_test,
        saved,
    };
    Ok((outcome, model))
}

fn main() -> ExitCode {
    common::exit(run(Flags::parse()))
}

fn run(flags: Flags) -> Result<(), String> {
    flags.digits.check()?;
    if !(flags.tolerance.is_finite() && flags.tolerance >= 0.0) {
        return Err(format!(
            "--tolerance must be a finite number >= 0, got {}",
            flags.tolerance
        ));
    }
    let settings = Settings {
        epochs: flags.digits.epochs,
        blocks: flags.digits.blocks,
        width: flags.digits.width,
        learning_rate: flags.digits.lr,
        seed: flags.digits.seed,
        tolerance: flags.tolerance,
    };
    let device = flags.device.device()?.autodiff();
    let (rest, test) = Digits::load()?.split(0.2, settings.seed);
    let (train_set, valid) = rest.split(0.2, settings.seed + 1);
    let splits = Splits {
        train: train_set,
        valid,
        test,
    };
    let output = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/example-output");
    std::fs::create_dir_all(&output).map_err(|err| err.to_string())?;
    println!(
        "digits: {} train / {} validation / {} test images; {} MLP blocks of width {}, {} epochs; tolerance {}",
        splits.train.len(),
        splits.valid.len(),
        splits.test.len(),
        settings.blocks,
        settings.width,
        settings.epochs,
        settings.tolerance
    );

    let (resnet, _) = train(
        "resnet",
        &HacnConfig::resnet(),
        &splits,
        &settings,
        &device,
        &output,
    )?;
    let (hacn, hacn_model) = train(
        "hacn",
        &HacnConfig::new(),
        &splits,
        &settings,
        &device,
        &output,
    )?;

    println!("\nvalidation accuracy of the readout after k blocks, the depth kept, test accuracy:");
    for outcome in [&resnet, &hacn] {
        let scores: Vec<String> = outcome
            .choice
            .scores
            .iter()
            .map(|s| format!("{s:.3}"))
            .collect();
        println!(
            "{:>7}: keeps {:>2} of {} blocks; test accuracy full {:.3}, compressed {:.3} (saved to {})\n         layer-wise [{}]",
            outcome.name,
            outcome.choice.depth,
            settings.blocks,
            outcome.full_test,
            outcome.compressed_test,
            outcome.saved.display(),
            scores.join(", ")
        );
    }

    let curve = |outcome: &Outcome| {
        let points = outcome
            .choice
            .scores
            .iter()
            .enumerate()
            .map(|(k, &score)| (k as f64, score))
            .collect();
        Series::new(
            format!("{} (keeps {})", outcome.name, outcome.choice.depth),
            points,
        )
    };
    let pictures = [
        output.join("compress_layerwise.png"),
        output.join("compress_hacn_c.png"),
        output.join("compress_hacn_gates.png"),
    ];
    let error = |err: burn_connectivity::Error| err.to_string();
    LineChart::new("Validation accuracy of the readout after k blocks")
        .with_labels("blocks kept k", "validation accuracy")
        .with_series(curve(&resnet))
        .with_series(curve(&hacn))
        .write_png(&pictures[0])
        .map_err(error)?;
    Heatmap::from_matrix(
        "H-ACN connectivity matrix C (log scale)",
        &hacn_model.stack.matrix(),
    )
    .with_log_scale(true)
    .write_png(&pictures[1])
    .map_err(error)?;
    let log = read_health_log(output.join("compress_hacn_health.jsonl")).map_err(error)?;
    let mut gates_chart =
        LineChart::new("H-ACN gates during training").with_labels("training step", "gate a_j");
    for block in 0..settings.blocks {
        let points = log
            .iter()
            .filter_map(|record| match &record.report.family {
                FamilyHealth::Hacn { gates, .. } => Some((record.step as f64, gates[block])),
                _ => None,
            })
            .collect();
        gates_chart = gates_chart.with_series(Series::new(format!("a_{}", block + 1), points));
    }
    gates_chart.write_png(&pictures[2]).map_err(error)?;
    for picture in &pictures {
        println!("wrote {}", picture.display());
    }
    Ok(())
}
