//! A character-level decoder built from burn-nn transformer layers, wrapped with any of the
//! crate's connectivities.
//!
//! ```text
//! cargo run --release --example lm_wrap [-- --device flex --steps 300 --layers 4 --width 64 \
//!     --connectivity residual,hacn,ancre,hc,mhc,dwa --granularity block]
//! ```
//!
//! Token and position embeddings → burn-nn `TransformerEncoder` layers (pre-norm, causal mask)
//! → LayerNorm → linear head, trained on four Shakespeare tragedies (examples/data, public
//! domain). The same initial weights, data order and budget are trained under every
//! connectivity of `--connectivity` (a comma-separated list of `residual` (H-ACN's ResNet preset,
//! exactly burn-nn's wiring), `hacn`, `ancre`, `hc` and `mhc` (4 streams), `dwa` (DenseFormer,
//! dilation 1, period 1) and `hyperzzw`), at `--granularity block` (one connectivity block per
//! layer) or `sublayer` (attention and feed-forward each one block, as the HC paper and mHC wire
//! them); connectivity parameters train in their own group (no weight decay, their own learning
//! rate). It prints the validation loss of each model and its layer-wise validation loss: the
//! readout after `k` layers through the same norm and head.

mod common;

use std::time::Instant;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::TransformerEncoderConfig;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn_connectivity::hyperzzw::HyperZzwConnectivityConfig;
use burn_connectivity::training::{GroupedAdamConfig, connectivity_group};
use burn_connectivity::transformer::{ConnectedEncoder, EncoderMasks, Granularity};
use burn_connectivity::{
    AncreConfig, ConnectivityConfig, DenseFormerConfig, HacnConfig, HyperConnectionsConfig,
    MhcConfig, StreamConnectivity,
};
use common::Args;

const USAGE: &str = "usage: lm_wrap [--device NAME] [--steps N] [--batch N] [--context N] \
                     [--layers N] [--width N] [--heads N] [--lr X] [--seed N] \
                     [--connectivity LIST] [--granularity block|sublayer]\n\
                     LIST: comma-separated, of residual, hacn, ancre, hc, mhc, dwa, hyperzzw \
                     (default residual,hacn,ancre,hc,mhc,dwa)";

/// The connectivities `--connectivity` accepts.
const CONNECTIVITIES: [&str; 7] = ["residual", "hacn", "ancre", "hc", "mhc", "dwa", "hyperzzw"];
/// Streams of the multi-stream connectivities.
const STREAMS: usize = 4;

const TEXT: &str = include_str!("data/shakespeare.txt");

struct Settings {
    steps: usize,
    batch: usize,
    context: usize,
    layers: usize,
    width: usize,
    heads: usize,
    lr: f64,
    seed: u64,
    granularity: Granularity,
}

/// The characters of the text, and the text as their indices.
struct Corpus {
    alphabet: Vec<char>,
    train: Vec<i64>,
    valid: Vec<i64>,
}

impl Corpus {
    /// The last 10% of the text is held out for validation.
    fn new(text: &str) -> Self {
        let mut alphabet: Vec<char> = text.chars().collect();
        alphabet.sort_unstable();
        alphabet.dedup();
        let ids: Vec<i64> = text
            .chars()
            .map(|c| alphabet.binary_search(&c).expect("in the alphabet") as i64)
            .collect();
        let split = ids.len() * 9 / 10;
        Self {
            alphabet,
            valid: ids[split..].to_vec(),
            train: ids[..split].to_vec(),
        }
    }
}

/// `(inputs, targets)`, `[batch, context]` each: windows starting at `starts`, targets shifted
/// by one character.
fn windows(
    ids: &[i64],
    starts: &[usize],
    context: usize,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let take = |offset: usize| -> Tensor<2, Int> {
        let values: Vec<i64> = starts
            .iter()
            .flat_map(|&start| {
                ids[start + offset..start + offset + context]
                    .iter()
                    .copied()
            })
            .collect();
        Tensor::from_data(TensorData::new(values, [starts.len(), context]), device)
    };
    (take(0), take(1))
}

/// Pseudo-random window starts (an LCG: the examples need no RNG crate).
struct Starts(u64);

impl Starts {
    fn next(&mut self, count: usize, limit: usize) -> Vec<usize> {
        (0..count)
            .map(|_| {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (self.0 >> 33) as usize % limit
            })
            .collect()
    }
}

#[derive(Module, Debug)]
struct CharLm<C> {
    token: Embedding,
    position: Embedding,
    encoder: ConnectedEncoder<C>,
    norm: LayerNorm,
    head: Linear,
}

impl<C: StreamConnectivity<3>> CharLm<C> {
    fn new(
        connectivity: &impl ConnectivityConfig<Connectivity = C>,
        vocabulary: usize,
        settings: &Settings,
        device: &Device,
    ) -> Result<Self, String> {
        // Every model draws the same weights: the seed is reset and the connectivity comes last.
        device.seed(settings.seed);
        let width = settings.width;
        let token = EmbeddingConfig::new(vocabulary, width).init(device);
        let position = EmbeddingConfig::new(settings.context, width).init(device);
        let layers =
            TransformerEncoderConfig::new(width, 4 * width, settings.heads, settings.layers)
                .with_norm_first(true)
                .with_dropout(0.0)
                .init(device);
        let norm = LayerNormConfig::new(width).init(device);
        let head = LinearConfig::new(width, vocabulary).init(device);
        let encoder = ConnectedEncoder::new(layers, settings.granularity, connectivity, device)
            .map_err(|err| err.to_string())?;
        Ok(Self {
            token,
            position,
            encoder,
            norm,
            head,
        })
    }

    fn embed(&self, tokens: Tensor<2, Int>) -> (Tensor<3>, EncoderMasks) {
        let [batch, length] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<1, Int>::arange(0..length as i64, &device).reshape([1, length]);
        let x = self.token.forward(tokens) + self.position.forward(positions);
        (x, EncoderMasks::causal(batch, length, &device))
    }

    /// Mean cross-entropy of next-character predictions from a readout.
    fn loss(&self, readout: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        let [batch, length, _] = readout.dims();
        let logits = self.head.forward(self.norm.forward(readout));
        let vocabulary = logits.dims()[2];
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(
                logits.reshape([batch * length, vocabulary]),
                targets.reshape([batch * length]),
            )
    }

    fn forward_loss(&self, tokens: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        let (x, masks) = self.embed(tokens);
        self.loss(self.encoder.forward(x, &masks), targets)
    }

    /// Validation loss of the readout after `0..=L` layers.
    fn layerwise_loss(&self, tokens: Tensor<2, Int>, targets: Tensor<2, Int>) -> Vec<f64> {
        let (x, masks) = self.embed(tokens);
        self.encoder
            .readout(x, &masks)
            .into_iter()
            .map(|readout| self.loss(readout, targets.clone()).into_scalar::<f64>())
            .collect()
    }
}

struct Outcome {
    name: String,
    layerwise: Vec<Vec<f64>>,
    seconds: f64,
    connectivity: String,
}

fn train<C: StreamConnectivity<3>>(
    name: &str,
    connectivity: &impl ConnectivityConfig<Connectivity = C>,
    corpus: &Corpus,
    settings: &Settings,
    device: &Device,
    describe: impl Fn(&C) -> String,
) -> Result<Outcome, String> {
    let training = device.clone().autodiff();
    let mut model = CharLm::new(connectivity, corpus.alphabet.len(), settings, &training)?;
    let group = connectivity_group(&model.encoder.connectivity);
    let config = GroupedAdamConfig::new().with_learning_rate(settings.lr);
    let (mut optimizer, mut learning_rates) =
        config.build(&group).map_err(|err| err.to_string())?;
    let mut starts = Starts(settings.seed);
    let limit = corpus.train.len() - settings.context - 1;

    let clock = Instant::now();
    for step in 1..=settings.steps {
        let (tokens, targets) = windows(
            &corpus.train,
            &starts.next(settings.batch, limit),
            settings.context,
            &training,
        );
        let loss = model.forward_loss(tokens, targets);
        if step % 100 == 0 || step == 1 {
            eprintln!(
                "{name:>8} step {step:>4}: train loss {:.3}",
                loss.clone().into_scalar::<f64>()
            );
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(learning_rates.step(), model, grads);
    }
    let seconds = clock.elapsed().as_secs_f64();

    // A fixed validation set: evenly spaced windows of the held-out text.
    let model = model.valid();
    let count = 4 * settings.batch;
    let stride = (corpus.valid.len() - settings.context - 1) / count;
    let mut layerwise = Vec::new();
    for chunk in (0..count)
        .map(|i| i * stride)
        .collect::<Vec<_>>()
        .chunks(settings.batch)
    {
        let (tokens, targets) = windows(&corpus.valid, chunk, settings.context, device);
        layerwise.push(model.layerwise_loss(tokens, targets));
    }
    Ok(Outcome {
        name: name.to_string(),
        layerwise,
        seconds,
        connectivity: describe(&model.encoder.connectivity),
    })
}

fn format(values: &[f64]) -> String {
    values
        .iter()
        .map(|v| format!("{v:.3}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Trains the connectivity called `name` (one of [`CONNECTIVITIES`]).
fn train_named(
    name: &str,
    corpus: &Corpus,
    settings: &Settings,
    device: &Device,
) -> Result<Outcome, String> {
    let width = settings.width;
    match name {
        "residual" => train(
            name,
            &HacnConfig::resnet(),
            corpus,
            settings,
            device,
            |_| "gates fixed at 1".into(),
        ),
        "hacn" => train(name, &HacnConfig::new(), corpus, settings, device, |hacn| {
            format!("gates [{}]", format(&hacn.gate_values()))
        }),
        "ancre" => train(
            name,
            &AncreConfig::new(),
            corpus,
            settings,
            device,
            |ancre| {
                let p = ancre.coefficient_values();
                let residual: Vec<f64> = (1..p.len()).map(|j| p[j - 1][j]).collect();
                format!("p_(j-1,j) [{}]", format(&residual))
            },
        ),
        "hc" => {
            let config = HyperConnectionsConfig::new(width).with_streams(STREAMS);
            train(name, &config, corpus, settings, device, |hc| {
                let distance = hc.residual_distance_from_identity();
                format!(
                    "static A_s distance from I per block [{}]",
                    format(&distance)
                )
            })
        }
        "mhc" => {
            let config = MhcConfig::new(width).with_streams(STREAMS);
            train(name, &config, corpus, settings, device, |mhc| {
                let health = mhc.residual_health();
                let distance: Vec<f64> = health.iter().map(|h| h.distance_from_identity).collect();
                format!(
                    "static H_res distance from I per block [{}]",
                    format(&distance)
                )
            })
        }
        "dwa" => train(
            name,
            &DenseFormerConfig::new(),
            corpus,
            settings,
            device,
            |dwa| {
                let earlier = dwa.weight_on_earlier_states();
                format!("DWA weight on earlier states [{}]", format(&earlier))
            },
        ),
        "hyperzzw" => {
            let config = HyperZzwConnectivityConfig::new(width, settings.context);
            train(name, &config, corpus, settings, device, |_| {
                "HyperZZW fusion".into()
            })
        }
        other => Err(format!("unknown connectivity `{other}`")),
    }
}

fn main() -> Result<(), String> {
    let args = Args::parse(
        USAGE,
        &[
            "steps",
            "batch",
            "context",
            "layers",
            "width",
            "heads",
            "lr",
            "seed",
            "connectivity",
            "granularity",
        ],
    )?;
    let device = args.device()?;
    let settings = Settings {
        steps: args.get("steps", 300)?,
        batch: args.get("batch", 32)?,
        context: args.get("context", 64)?,
        layers: args.get("layers", 4)?,
        width: args.get("width", 64)?,
        heads: args.get("heads", 4)?,
        lr: args.get("lr", 3e-3)?,
        seed: args.get("seed", 7)?,
        granularity: match args.get("granularity", String::from("block"))?.as_str() {
            "block" => Granularity::Block,
            "sublayer" => Granularity::Sublayer,
            other => return Err(format!("--granularity: unknown `{other}`\n{USAGE}")),
        },
    };
    let list = args.get(
        "connectivity",
        String::from("residual,hacn,ancre,hc,mhc,dwa"),
    )?;
    let names: Vec<&str> = list.split(',').map(str::trim).collect();
    if let Some(unknown) = names.iter().find(|name| !CONNECTIVITIES.contains(name)) {
        return Err(format!("--connectivity: unknown `{unknown}`\n{USAGE}"));
    }
    let corpus = Corpus::new(TEXT);
    println!(
        "{} characters ({} distinct), {} for training; {} layers of width {}, {} steps of {}x{}",
        corpus.train.len() + corpus.valid.len(),
        corpus.alphabet.len(),
        corpus.train.len(),
        settings.layers,
        settings.width,
        settings.steps,
        settings.batch,
        settings.context
    );

    let outcomes = names
        .iter()
        .map(|name| train_named(name, &corpus, &settings, &device))
        .collect::<Result<Vec<_>, String>>()?;

    println!(
        "\nvalidation loss (nats/char) of the readout after k layers, k = 0..{}:",
        settings.layers
    );
    for outcome in &outcomes {
        let batches = outcome.layerwise.len() as f64;
        let mean: Vec<f64> = (0..=settings.layers)
            .map(|k| {
                outcome
                    .layerwise
                    .iter()
                    .map(|losses| losses[k])
                    .sum::<f64>()
                    / batches
            })
            .collect();
        println!(
            "{:>8}: valid loss {:.3} ({:.3} bits/char), {:.1} s training; layer-wise [{}]; {}",
            outcome.name,
            mean[settings.layers],
            mean[settings.layers] / std::f64::consts::LN_2,
            outcome.seconds,
            format(&mean),
            outcome.connectivity
        );
    }
    Ok(())
}
