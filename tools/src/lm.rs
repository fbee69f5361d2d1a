//! A character-level decoder of burn-nn transformer layers wrapped by a connectivity, its data
//! (the bundled Shakespeare) and its training loop: shared by `lm_wrap` and `reproduce`.

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
    AncreConfig, AttentionResidualsConfig, ConnectivityConfig, DenseFormerConfig, HacnConfig,
    HyperConnectionsConfig, MhcConfig, MuddConfig, StreamConnectivity,
};
use indicatif::ProgressBar;

/// Four Shakespeare tragedies (public domain; tools/data).
pub const TEXT: &str = include_str!("../data/shakespeare.txt");

/// The model and its training run.
#[derive(Clone, Debug)]
pub struct LmSettings {
    pub steps: usize,
    pub batch: usize,
    pub context: usize,
    pub layers: usize,
    pub width: usize,
    pub heads: usize,
    pub seed: u64,
    pub granularity: Granularity,
    /// DepthLN strength for the wrapped layers' norms, if any.
    pub depth_ln: Option<f64>,
    /// Built for the run: its schedule must know `steps`.
    pub optimizer: GroupedAdamConfig,
}

/// The characters of the text, and the text as their indices.
pub struct Corpus {
    pub alphabet: Vec<char>,
    pub train: Vec<i64>,
    pub valid: Vec<i64>,
}

impl Corpus {
    /// The last 10% of the text is held out for validation.
    pub fn new(text: &str) -> Self {
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

/// Token and position embeddings → wrapped encoder (pre-norm, causal) → LayerNorm → head.
#[derive(Module, Debug)]
pub struct CharLm<C> {
    token: Embedding,
    position: Embedding,
    pub encoder: ConnectedEncoder<C>,
    norm: LayerNorm,
    head: Linear,
}

impl<C: StreamConnectivity<3>> CharLm<C> {
    fn new(
        connectivity: &impl ConnectivityConfig<Connectivity = C>,
        vocabulary: usize,
        settings: &LmSettings,
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
        for module in [&token, &position] {
            crate::draw_now(module);
        }
        crate::draw_now(&layers);
        crate::draw_now(&head);
        let error = |err: burn_connectivity::Error| err.to_string();
        let mut encoder = ConnectedEncoder::new(layers, settings.granularity, connectivity, device)
            .map_err(error)?;
        if let Some(strength) = settings.depth_ln {
            encoder = encoder.with_depth_ln(strength).map_err(error)?;
        }
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

/// What a training run leaves.
pub struct LmOutcome {
    /// Mean validation loss (nats/char) of the readout after `k = 0..=L` layers; the last is
    /// the model's.
    pub layerwise: Vec<f64>,
    /// Training time.
    pub seconds: f64,
    /// What `describe` said of the trained connectivity.
    pub connectivity: String,
}

impl LmOutcome {
    /// The model's validation loss.
    pub fn loss(&self) -> f64 {
        *self
            .layerwise
            .last()
            .expect("at least the embedding's readout")
    }
}

/// Trains the model under `connectivity` for `settings.steps` steps (the bar advances once per
/// step) and scores every readout on a fixed validation set: evenly spaced windows of the
/// held-out text.
pub fn train_lm<C: StreamConnectivity<3>>(
    connectivity: &impl ConnectivityConfig<Connectivity = C>,
    corpus: &Corpus,
    settings: &LmSettings,
    device: &Device,
    bar: &ProgressBar,
    describe: impl Fn(&C) -> String,
) -> Result<LmOutcome, String> {
    let training = device.clone().autodiff();
    let mut model = CharLm::new(connectivity, corpus.alphabet.len(), settings, &training)?;
    let group = connectivity_group(&(
        model.encoder.connectivity.clone(),
        model.encoder.depth_ln.clone(),
    ));
    let (mut optimizer, mut learning_rates) = settings
        .optimizer
        .build(&group)
        .map_err(|err| err.to_string())?;
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
        if step % 25 == 0 || step == 1 {
            bar.set_message(format!(
                "train loss {:.3}",
                loss.clone().into_scalar::<f64>()
            ));
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(learning_rates.step(), model, grads);
        bar.inc(1);
    }
    let seconds = clock.elapsed().as_secs_f64();

    let model = model.valid();
    let count = 4 * settings.batch;
    let stride = (corpus.valid.len() - settings.context - 1) / count;
    let mut sums = vec![0.0; settings.layers + 1];
    let mut batches = 0;
    for chunk in (0..count)
        .map(|i| i * stride)
        .collect::<Vec<_>>()
        .chunks(settings.batch)
    {
        let (tokens, targets) = windows(&corpus.valid, chunk, settings.context, device);
        for (sum, loss) in sums.iter_mut().zip(model.layerwise_loss(tokens, targets)) {
            *sum += loss;
        }
        batches += 1;
    }
    Ok(LmOutcome {
        layerwise: sums.iter().map(|sum| sum / batches as f64).collect(),
        seconds,
        connectivity: describe(&model.encoder.connectivity),
    })
}

/// The connectivities the language-model examples wrap the layers with.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LmConnectivity {
    /// H-ACN's ResNet preset: exactly burn-nn's wiring.
    Residual,
    /// H-ACN, trainable gates.
    Hacn,
    /// ANCRe (its settings from the caller's `AncreConfig`).
    Ancre,
    /// Hyper-connections, 4 streams, dynamic.
    Hc,
    /// mHC, 4 streams.
    Mhc,
    /// DenseFormer DWA, dilation 1, period 1.
    Dwa,
    /// HyperZZW fusion.
    Hyperzzw,
    /// Full Attention Residuals.
    Attnres,
    /// Block Attention Residuals, groups of [`LM_ATTNRES_BLOCK_SIZE`] layers.
    #[value(name = "block_attnres")]
    BlockAttnres,
    /// MUDD, four ways (query, key, value, residual).
    Mudd,
}

/// The block AttnRes group size of the language-model runs.
pub const LM_ATTNRES_BLOCK_SIZE: usize = 2;

impl LmConnectivity {
    /// Every connectivity, in the order tables list them.
    pub const ALL: [Self; 10] = [
        Self::Residual,
        Self::Hacn,
        Self::Ancre,
        Self::Hc,
        Self::Mhc,
        Self::Dwa,
        Self::Hyperzzw,
        Self::Attnres,
        Self::BlockAttnres,
        Self::Mudd,
    ];

    /// The flag value and table name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Residual => "residual",
            Self::Hacn => "hacn",
            Self::Ancre => "ancre",
            Self::Hc => "hc",
            Self::Mhc => "mhc",
            Self::Dwa => "dwa",
            Self::Hyperzzw => "hyperzzw",
            Self::Attnres => "attnres",
            Self::BlockAttnres => "block_attnres",
            Self::Mudd => "mudd",
        }
    }
}

/// Streams of the multi-stream connectivities.
pub const STREAMS: usize = 4;

/// `v1, v2, …` with three decimals.
pub fn format_values(values: &[f64]) -> String {
    values
        .iter()
        .map(|v| format!("{v:.3}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Trains under `which` (ANCRe with `ancre`'s settings).
pub fn train_connectivity(
    which: LmConnectivity,
    ancre: &AncreConfig,
    corpus: &Corpus,
    settings: &LmSettings,
    device: &Device,
    bar: &ProgressBar,
) -> Result<LmOutcome, String> {
    let width = settings.width;
    match which {
        LmConnectivity::Residual => {
            train_lm(&HacnConfig::resnet(), corpus, settings, device, bar, |_| {
                "gates fixed at 1".into()
            })
        }
        LmConnectivity::Hacn => {
            train_lm(&HacnConfig::new(), corpus, settings, device, bar, |hacn| {
                format!("gates [{}]", format_values(&hacn.gate_values()))
            })
        }
        LmConnectivity::Ancre => train_lm(ancre, corpus, settings, device, bar, |ancre| {
            let p = ancre.coefficient_values();
            let residual: Vec<f64> = (1..p.len()).map(|j| p[j - 1][j]).collect();
            format!("p_(j-1,j) [{}]", format_values(&residual))
        }),
        LmConnectivity::Hc => {
            let config = HyperConnectionsConfig::new(width).with_streams(STREAMS);
            train_lm(&config, corpus, settings, device, bar, |hc| {
                let distance = hc.residual_distance_from_identity();
                format!(
                    "static A_s distance from I per block [{}]",
                    format_values(&distance)
                )
            })
        }
        LmConnectivity::Mhc => {
            let config = MhcConfig::new(width).with_streams(STREAMS);
            train_lm(&config, corpus, settings, device, bar, |mhc| {
                let health = mhc.residual_health();
                let distance: Vec<f64> = health.iter().map(|h| h.distance_from_identity).collect();
                format!(
                    "static H_res distance from I per block [{}]",
                    format_values(&distance)
                )
            })
        }
        LmConnectivity::Dwa => train_lm(
            &DenseFormerConfig::new(),
            corpus,
            settings,
            device,
            bar,
            |dwa| {
                let earlier = dwa.weight_on_earlier_states();
                format!("DWA weight on earlier states [{}]", format_values(&earlier))
            },
        ),
        LmConnectivity::Hyperzzw => {
            let config = HyperZzwConnectivityConfig::new(width, settings.context);
            train_lm(&config, corpus, settings, device, bar, |_| {
                "HyperZZW fusion".into()
            })
        }
        LmConnectivity::Attnres | LmConnectivity::BlockAttnres => {
            let block_size = match which {
                LmConnectivity::Attnres => 1,
                _ => LM_ATTNRES_BLOCK_SIZE,
            };
            let config = AttentionResidualsConfig::new(width).with_block_size(block_size);
            train_lm(&config, corpus, settings, device, bar, |attnres| {
                format!(
                    "pseudo-query norms per block [{}]",
                    format_values(&attnres.query_norms())
                )
            })
        }
        LmConnectivity::Mudd => train_lm(
            &MuddConfig::multiway(width),
            corpus,
            settings,
            device,
            bar,
            |mudd| {
                format!(
                    "static weight of the residual way on the newest state [{}]",
                    format_values(&mudd.newest_weights())
                )
            },
        ),
    }
}
