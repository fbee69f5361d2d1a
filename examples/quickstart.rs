//! Quickstart: ResNet vs ACN vs H-ACN on real handwritten digits.
//!
//! ```text
//! cargo run --release --example quickstart [-- --device flex --epochs 30 --blocks 16 --width 32]
//! ```
//!
//! The same MLP blocks, head, data order and budget are trained three ways; only the
//! connectivity differs. The recipe: AdamW with one epoch of warmup and cosine decay, the
//! gates in their own parameter group (no weight decay, their own learning rate). For each model it prints the held-out accuracy, the layer-wise accuracy
//! curve (the readout `y_k` after `k` blocks through the shared head: how much of the model a
//! truncated copy keeps), the learned gates and Γ.

use burn_connectivity_tools as common;

use std::process::ExitCode;

use burn::prelude::*;
use burn_connectivity::{Hacn, HacnConfig};
use clap::Parser;
use common::{
    Classifier, DeviceArg, Digits, DigitsArgs, DigitsTraining, accuracy, fit_digits, progress,
};

/// ResNet vs ACN vs H-ACN on the bundled handwritten digits.
#[derive(Parser, Debug)]
#[command(long_about = None)]
struct Flags {
    #[command(flatten)]
    device: DeviceArg,
    #[command(flatten)]
    digits: DigitsArgs,
    /// Peak learning rate of the gates (no weight decay).
    #[arg(long, default_value_t = 1e-2)]
    connectivity_lr: f64,
}

struct Report {
    name: &'static str,
    accuracy: f64,
    layerwise: Vec<f64>,
    gates: Vec<f64>,
    strength: f64,
    seconds: f64,
}

fn train(
    name: &'static str,
    connectivity: &HacnConfig,
    (train_set, test_set): (&Digits, &Digits),
    flags: &Flags,
    device: &Device,
) -> Result<Report, String> {
    let started = std::time::Instant::now();
    device.seed(flags.digits.seed);
    let model: Classifier<Hacn> = Classifier::new(
        connectivity,
        flags.digits.blocks,
        flags.digits.width,
        Digits::CLASSES,
        device,
    )?;
    let training = DigitsTraining::warmup_cosine(
        (flags.digits.epochs, flags.digits.seed),
        (flags.digits.lr, flags.connectivity_lr),
        train_set.len(),
    )?;
    let (test_pixels, test_labels) = test_set.all(&device.clone().without_autodiff());
    let bar = progress(flags.digits.epochs as u64, name);
    let model = fit_digits(model, train_set, &training, &bar, |epoch, loss, model| {
        if epoch == 1 || epoch % 5 == 0 || epoch == flags.digits.epochs {
            let test_accuracy = accuracy(
                model.valid().forward(test_pixels.clone()),
                test_labels.clone(),
            );
            bar.suspend(|| {
                println!(
                    "  [{name:>6}] epoch {epoch:>3}/{}  train loss {loss:.4}  test acc {test_accuracy:.3}  Γ {:.3}  ({:.1}s)",
                    flags.digits.epochs,
                    model.stack.connectivity.total_strength(),
                    started.elapsed().as_secs_f64()
                )
            });
        }
    })?;
    bar.finish_and_clear();

    let evaluated = model.valid();
    let layerwise = evaluated
        .layerwise(test_pixels.clone())
        .into_iter()
        .map(|logits| accuracy(logits, test_labels.clone()))
        .collect();
    Ok(Report {
        name,
        accuracy: accuracy(evaluated.forward(test_pixels), test_labels),
        layerwise,
        gates: evaluated.stack.connectivity.gate_values(),
        strength: evaluated.stack.connectivity.total_strength(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn run(flags: Flags) -> Result<(), String> {
    flags.digits.check()?;
    let device = flags.device.device()?.autodiff();
    let (train_set, test_set) = Digits::load()?.split(0.2, flags.digits.seed);
    println!(
        "digits: {} train / {} held-out test images; {} MLP blocks of width {}, {} epochs, AdamW lr {} \
         (warmup + cosine), gates lr {}, on {:?}",
        train_set.len(),
        test_set.len(),
        flags.digits.blocks,
        flags.digits.width,
        flags.digits.epochs,
        flags.digits.lr,
        flags.connectivity_lr,
        device
    );

    let variants = [
        ("resnet", HacnConfig::resnet()),
        ("acn", HacnConfig::acn()),
        ("hacn", HacnConfig::new()),
    ];
    let mut reports = Vec::new();
    for (name, config) in &variants {
        reports.push(train(
            name,
            config,
            (&train_set, &test_set),
            &flags,
            &device,
        )?);
    }

    println!("\nheld-out accuracy and layer-wise accuracy (readout y_k through the shared head)");
    let header: String = (0..=flags.digits.blocks)
        .map(|k| format!(" k={k:<3}"))
        .collect();
    println!("{:>8} {:>7} {:>6} |{header}", "model", "acc", "Γ");
    for report in &reports {
        let curve: String = report
            .layerwise
            .iter()
            .map(|acc| format!(" {acc:.3}"))
            .collect();
        println!(
            "{:>8} {:>7.3} {:>6.3} |{curve}",
            report.name, report.accuracy, report.strength
        );
    }
    println!("\nlearned gates a_1..a_L");
    for report in &reports {
        let gates: Vec<String> = report
            .gates
            .iter()
            .map(|gate| format!("{gate:.3}"))
            .collect();
        println!(
            "{:>8}: [{}]  ({:.1}s)",
            report.name,
            gates.join(", "),
            report.seconds
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    common::exit(run(Flags::parse()))
}
