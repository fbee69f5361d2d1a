//! A small Terminator (SFNE blocks, HyperZZW) on real handwritten digits, as 64-step pixel
//! sequences (the paper's pixel-level 1D task in miniature) and as 8x8 maps, against a plain
//! residual baseline with a similar parameter count.
//!
//! ```text
//! cargo run --release --example terminator_digits [-- --epochs 30 --lr 0.01 --device flex]
//! ```
//!
//! Prints progress, test accuracy, parameter counts and time per epoch for each model.
//! `--help` lists every flag.

use burn_connectivity_tools as common;

use std::process::ExitCode;
use std::time::Instant;

use burn::prelude::*;
use burn_connectivity::hyperzzw::Geometry;
use clap::Parser;
use common::terminator::{PixelClassifier, ResidualMlp, TerminatorClassifier, train_pixels};
use common::{DeviceArg, Digits, progress};

/// A small Terminator on the digits as sequences and maps, against a residual MLP.
#[derive(Parser, Debug)]
#[command(long_about = None)]
struct Flags {
    #[command(flatten)]
    device: DeviceArg,
    /// Training epochs per model.
    #[arg(long, default_value_t = 30)]
    epochs: usize,
    /// Adam's learning rate.
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// Frequency scale ω0 of the slow nets.
    #[arg(long, default_value_t = 30.0)]
    omega0: f64,
    /// Seed of the weights, the split and the data order.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

struct Report {
    name: String,
    parameters: usize,
    accuracy: f64,
    seconds_per_epoch: f64,
}

fn train<M: PixelClassifier>(
    name: &str,
    model: M,
    data: (&Digits, &Digits),
    flags: &Flags,
    device: &Device,
) -> Report {
    let parameters = model.num_params();
    let bar = progress(flags.epochs as u64, name);
    let started = Instant::now();
    let accuracy = train_pixels(
        model,
        data,
        (flags.epochs, flags.lr, flags.seed),
        device,
        &bar,
        |epoch, loss, accuracy| {
            bar.suspend(|| {
                println!(
                    "  [{name}] epoch {epoch:>2}/{}  loss {loss:.4}  test acc {accuracy:.3}  ({:.1}s)",
                    flags.epochs,
                    started.elapsed().as_secs_f64()
                )
            })
        },
    );
    bar.finish_with_message(format!("test acc {accuracy:.3}"));
    Report {
        name: name.to_string(),
        parameters,
        accuracy,
        seconds_per_epoch: started.elapsed().as_secs_f64() / flags.epochs as f64,
    }
}

fn run(flags: Flags) -> Result<(), String> {
    if flags.epochs == 0 {
        return Err("--epochs must be at least 1".into());
    }
    if !(flags.lr.is_finite() && flags.lr > 0.0) {
        return Err(format!(
            "--lr must be a finite number > 0, got {}",
            flags.lr
        ));
    }
    if !(flags.omega0.is_finite() && flags.omega0 > 0.0) {
        return Err(format!("--omega0 must be > 0, got {}", flags.omega0));
    }
    let device = flags.device.device()?.autodiff();
    let (train_set, test_set) = Digits::load()?.split(0.2, flags.seed);
    println!(
        "digits: {} train / {} held-out test images, {} epochs, Adam lr {}, slow nets with ω0 = {}",
        train_set.len(),
        test_set.len(),
        flags.epochs,
        flags.lr,
        flags.omega0
    );
    let data = (&train_set, &test_set);

    let mut reports = Vec::new();
    device.seed(flags.seed);
    let sequence =
        TerminatorClassifier::new(Geometry::Sequence { length: 64 }, flags.omega0, &device)?;
    let budget = sequence.num_params();
    reports.push(train("terminator-1d", sequence, data, &flags, &device));
    device.seed(flags.seed);
    let map = TerminatorClassifier::new(
        Geometry::Map {
            rows: 8,
            columns: 8,
        },
        flags.omega0,
        &device,
    )?;
    reports.push(train("terminator-2d", map, data, &flags, &device));

    // The widest 4-block residual MLP within the Terminator's parameter budget.
    let width = ResidualMlp::width_within(budget, 4, &device)?;
    device.seed(flags.seed);
    let baseline = ResidualMlp::new(width, 4, &device)?;
    let name = format!("residual-mlp-4x{width}");
    reports.push(train(&name, baseline, data, &flags, &device));

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

fn main() -> ExitCode {
    common::exit(run(Flags::parse()))
}
