//! A character-level decoder built from burn-nn transformer layers, wrapped with any of the
//! crate's connectivities, trained with the papers' language-model recipe.
//!
//! ```text
//! cargo run --release --example lm_wrap [-- --device flex --steps 300 --layers 4 --width 64 \
//!     --connectivity residual,hacn,ancre,hc,mhc,dwa --granularity block]
//! ```
//!
//! Token and position embeddings → burn-nn `TransformerEncoder` layers (pre-norm, causal mask)
//! → LayerNorm → linear head, trained on four Shakespeare tragedies (tools/data, public
//! domain). The same initial weights, data order and budget are trained under every
//! connectivity of `--connectivity`. The recipe is the papers' for language models: AdamW with
//! `β2 = 0.95`, linear warmup then cosine decay, gradient clipping at 1, the connectivity in its
//! own parameter group (no weight decay), ANCRe with `τ = 0.01`, DepthLN in H-ACN's layers. It
//! prints the validation loss of each model and its layer-wise validation loss: the readout
//! after `k` layers through the same norm and head. `--help` lists every flag.

use burn_connectivity_tools as common;

use std::process::ExitCode;

use burn_connectivity::transformer::Granularity;
use burn_connectivity::{AncreConfig, Normalization};
use clap::{Parser, ValueEnum};
use common::lm::{Corpus, LmConnectivity, LmSettings, TEXT, format_values, train_connectivity};
use common::{DeviceArg, progress, recipe};

/// Where the connectivity takes over the encoder layers' shortcuts.
#[derive(ValueEnum, Clone, Copy, Debug)]
enum GranularityArg {
    /// One block per layer: the attention shortcut (ANCRe's block level).
    Block,
    /// Attention and feed-forward each one block (HC, mHC; ANCRe's module level).
    Sublayer,
    /// The whole layer with its own residuals is the branch (the public ANCRe code).
    Layer,
}

/// Character-level language model: burn-nn transformer layers under each connectivity.
#[derive(Parser, Debug)]
#[command(long_about = None)]
struct Flags {
    #[command(flatten)]
    device: DeviceArg,
    /// Optimiser steps per model.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Characters per sequence.
    #[arg(long, default_value_t = 64)]
    context: usize,
    /// Encoder layers.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Peak learning rate of the weights.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Peak learning rate of the connectivity parameters.
    #[arg(long, default_value_t = 1e-2)]
    connectivity_lr: f64,
    /// Adam's β2.
    #[arg(long, default_value_t = 0.95)]
    beta2: f64,
    /// Gradient clipping norm per parameter (0: none).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// Linear warmup steps before the cosine decay (default: a tenth of --steps).
    #[arg(long)]
    warmup: Option<usize>,
    /// ANCRe's softmax temperature τ (the papers' language models: 0.01).
    #[arg(long, default_value_t = 0.01)]
    ancre_tau: f64,
    /// ANCRe's outgoing normalisation instead of ingoing.
    #[arg(long)]
    ancre_outgoing: bool,
    /// DepthLN strength in H-ACN's layers (0: plain LayerNorm).
    #[arg(long, default_value_t = 0.05)]
    depth_ln: f64,
    /// Connectivities to train, comma separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "residual,hacn,ancre,hc,mhc,dwa"
    )]
    connectivity: Vec<LmConnectivity>,
    /// Where the connectivity wires the layers.
    #[arg(long, value_enum, default_value = "block")]
    granularity: GranularityArg,
    /// Seed of the weights and the data order.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

fn run(flags: Flags) -> Result<(), String> {
    let device = flags.device.device()?;
    common::require_counts(&[
        ("--steps", flags.steps),
        ("--batch", flags.batch),
        ("--context", flags.context),
        ("--layers", flags.layers),
        ("--width", flags.width),
        ("--heads", flags.heads),
    ])?;
    if !(flags.ancre_tau.is_finite() && flags.ancre_tau > 0.0) {
        return Err(format!("--ancre-tau must be > 0, got {}", flags.ancre_tau));
    }
    if !(flags.depth_ln.is_finite()) {
        return Err(format!("--depth-ln must be finite, got {}", flags.depth_ln));
    }
    let warmup = flags.warmup.unwrap_or(flags.steps / 10);
    let optimizer = recipe(
        flags.lr,
        flags.connectivity_lr,
        flags.beta2,
        flags.clip,
        warmup,
        flags.steps,
    )?;
    let settings = LmSettings {
        steps: flags.steps,
        batch: flags.batch,
        context: flags.context,
        layers: flags.layers,
        width: flags.width,
        heads: flags.heads,
        seed: flags.seed,
        granularity: match flags.granularity {
            GranularityArg::Block => Granularity::Block,
            GranularityArg::Sublayer => Granularity::Sublayer,
            GranularityArg::Layer => Granularity::Layer,
        },
        depth_ln: None,
        optimizer,
    };
    let ancre = AncreConfig::new()
        .with_temperature(flags.ancre_tau)
        .with_normalization(match flags.ancre_outgoing {
            true => Normalization::Outgoing,
            false => Normalization::Ingoing,
        });
    let corpus = Corpus::new(TEXT);
    if corpus.valid.len() <= 4 * settings.batch + settings.context {
        return Err("--context or --batch too large for the validation text".into());
    }
    println!(
        "{} characters ({} distinct), {} for training; {} layers of width {}, {} steps of {}x{}, \
         AdamW lr {} β2 {}, warmup {warmup} + cosine, clip {}, on {device:?}",
        corpus.train.len() + corpus.valid.len(),
        corpus.alphabet.len(),
        corpus.train.len(),
        settings.layers,
        settings.width,
        settings.steps,
        settings.batch,
        settings.context,
        flags.lr,
        flags.beta2,
        flags.clip,
    );

    let mut outcomes = Vec::new();
    for &which in &flags.connectivity {
        let settings = LmSettings {
            // DepthLN is part of H-ACN's recipe (H-ACN App. D); the others keep plain norms.
            depth_ln: (which == LmConnectivity::Hacn && flags.depth_ln != 0.0)
                .then_some(flags.depth_ln),
            ..settings.clone()
        };
        let bar = progress(settings.steps as u64, which.name());
        let outcome = train_connectivity(which, &ancre, &corpus, &settings, &device, &bar)?;
        bar.finish_with_message(format!("valid loss {:.3}", outcome.loss()));
        outcomes.push((which, outcome));
    }

    println!(
        "\nvalidation loss (nats/char) of the readout after k layers, k = 0..{}:",
        settings.layers
    );
    for (which, outcome) in &outcomes {
        println!(
            "{:>8}: valid loss {:.3} ({:.3} bits/char), {:.1} s training; layer-wise [{}]; {}",
            which.name(),
            outcome.loss(),
            outcome.loss() / std::f64::consts::LN_2,
            outcome.seconds,
            format_values(&outcome.layerwise),
            outcome.connectivity
        );
    }
    Ok(())
}

pub fn main() -> ExitCode {
    common::exit(run(Flags::parse()))
}
