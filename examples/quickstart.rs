//! Quickstart: ResNet vs ACN vs H-ACN on real handwritten digits.
//!
//! ```text
//! cargo run --release --example quickstart [-- --device flex --epochs 30 --blocks 16 --width 32]
//! ```
//!
//! The same MLP blocks, head, data order and budget are trained three ways; only the
//! connectivity differs. For each model it prints the held-out accuracy, the layer-wise accuracy
//! curve (the readout `y_k` after `k` blocks through the shared head: how much of the model a
//! truncated copy keeps), the learned gates and Γ.

mod common;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use burn_connectivity::HacnConfig;
use common::{Args, Classifier, Digits, accuracy, shuffled};

const USAGE: &str =
    "usage: quickstart [--device NAME] [--epochs N] [--blocks N] [--width N] [--lr X] [--seed N]";

struct Settings {
    epochs: usize,
    blocks: usize,
    width: usize,
    learning_rate: f64,
    batch_size: usize,
    seed: u64,
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
    settings: &Settings,
    device: &Device,
) -> Result<Report, String> {
    let started = std::time::Instant::now();
    device.seed(settings.seed);
    let mut model = Classifier::new(connectivity, settings.blocks, settings.width, device)?;
    let mut optimizer = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let all_test: Vec<usize> = (0..test_set.len()).collect();
    let (test_pixels, test_labels) = test_set.batch(&all_test, &device.clone().without_autodiff());

    for epoch in 1..=settings.epochs {
        let order = shuffled(train_set.len(), settings.seed + epoch as u64);
        let mut loss_sum = 0.0;
        let batches = order.chunks(settings.batch_size);
        let batch_count = batches.len();
        for indices in batches {
            let (pixels, labels) = train_set.batch(indices, device);
            let loss = loss_fn.forward(model.forward(pixels), labels);
            loss_sum += loss.clone().into_scalar::<f64>();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(settings.learning_rate, model, grads);
        }
        if epoch == 1 || epoch % 5 == 0 || epoch == settings.epochs {
            let test_accuracy = accuracy(
                model.valid().forward(test_pixels.clone()),
                test_labels.clone(),
            );
            println!(
                "  [{name:>6}] epoch {epoch:>3}/{}  train loss {:.4}  test acc {:.3}  Γ {:.3}  ({:.1}s)",
                settings.epochs,
                loss_sum / batch_count as f64,
                test_accuracy,
                model.stack.connectivity.total_strength(),
                started.elapsed().as_secs_f64()
            );
        }
    }

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

fn run() -> Result<(), String> {
    let args = Args::parse(USAGE, &["epochs", "blocks", "width", "lr", "seed"])?;
    let settings = Settings {
        epochs: args.get("epochs", 30)?,
        blocks: args.get("blocks", 16)?,
        width: args.get("width", 32)?,
        learning_rate: args.get("lr", 2e-3)?,
        batch_size: 64,
        seed: args.get("seed", 7)?,
    };
    let device = args.device()?.autodiff();
    let (train_set, test_set) = Digits::load()?.split(0.2, settings.seed);
    println!(
        "digits: {} train / {} held-out test images; {} MLP blocks of width {}, {} epochs, Adam lr {}, on {:?}",
        train_set.len(),
        test_set.len(),
        settings.blocks,
        settings.width,
        settings.epochs,
        settings.learning_rate,
        device
    );

    let variants = [
        ("resnet", HacnConfig::resnet()),
        ("acn", HacnConfig::acn()),
        ("hacn", HacnConfig::new()),
    ];
    let mut reports = Vec::new();
    for (name, config) in &variants {
        println!("training {name}");
        reports.push(train(
            name,
            config,
            (&train_set, &test_set),
            &settings,
            &device,
        )?);
    }

    println!("\nheld-out accuracy and layer-wise accuracy (readout y_k through the shared head)");
    let header: String = (0..=settings.blocks)
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

fn main() {
    if let Err(message) = run() {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}
