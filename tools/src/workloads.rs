//! The benchmark workloads, shared by `tools/benches/connectivity.rs` (divan), the
//! `bench_connectivity` tool (JSON lines) and `kernel_counts`.
//!
//! * `stack{12,24}`: pre-LN MLP blocks `LN → Linear(d, 4d) → GELU → Linear(4d, d)` on
//!   `[B, T, d] = [8, 128, 256]`, wired as a plain residual loop (`x += f(x)`, written by hand:
//!   the baseline), H-ACN (also with frozen gates), ANCRe, the HyperZZW connectivity,
//!   hyper-connections (`hc`, n = 4, dynamic), mHC (n = 4, 20 Sinkhorn iterations) or DenseFormer's
//!   DWA (`dwa`, dilation 1 and period 1: an average after every block). `forward` runs the stack;
//!   `train_step` runs forward and backward of the mean output (gradients of every parameter,
//!   no optimiser update, which costs the same for every variant).
//! * `model.{forward,train_step}`: the same stacks at model scale, 12 blocks at GPT-2-small
//!   width: `[B, T, d] = [8, 1024, 768]` ([`MODEL`], for GPUs), or `[1, 32, 768]`
//!   ([`MODEL_REDUCED`], a check on CPUs that the workload runs). MLP blocks only, no attention:
//!   the connectivity's share of a step is larger than in a transformer of the same width, so
//!   the ratios are upper bounds for one.
//! * `encoder.{forward,train_step}`: a GPT-2-small-like model at the model workload's shapes:
//!   12 pre-norm burn-nn [`TransformerEncoder`] layers (12 heads, feed-forward `4d`, GELU, no
//!   dropout) under a causal mask; the residual is burn-nn's encoder as it comes, every variant
//!   wraps the same layers through [`ConnectedEncoder`] (by default one connectivity block per
//!   sublayer, attention and feed-forward apart, as hyper-connections and mHC wire a
//!   transformer). Attention is in every step here, so this is the ratio a transformer pays.
//! * `gconv{64,128,256,1024,4096}`: global HyperZZW `conv(Z, Z ⊙ K)` on `[B, C, T] = [8, 64, T]`, by FFT
//!   or by direct `O(T²)` convolution.

use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::prelude::*;
use burn::tensor::{Distribution, Gradients};
use burn_connectivity::hyperzzw::{
    Crop, HyperZzwConnectivityConfig, direct_conv_1d, global_hyperzzw_1d,
};
use burn_connectivity::transformer::{ConnectedEncoder, EncoderMasks, Granularity};
use burn_connectivity::{
    AncreConfig, AttentionResidualsConfig, Block, ConnectivityConfig, DenseFormerConfig,
    HacnConfig, HyperConnectionsConfig, LaurelConfig, MhcConfig, MhcLiteConfig, MhcV4Config,
    MlpBlock, MlpBlockConfig, MuddConfig, Stack, StreamConnectivity,
};

pub const BATCH: usize = 8;
pub const LENGTH: usize = 128;
pub const WIDTH: usize = 256;
pub const DEPTHS: [usize; 2] = [12, 24];
pub const CHANNELS: usize = 64;
pub const GCONV_LENGTHS: [usize; 5] = [64, 128, 256, 1024, 4096];

/// The sizes of a stack workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackShape {
    pub batch: usize,
    pub length: usize,
    pub width: usize,
    pub depth: usize,
}

impl StackShape {
    /// The `stack{depth}` workloads' shape.
    pub const fn stack(depth: usize) -> Self {
        Self {
            batch: BATCH,
            length: LENGTH,
            width: WIDTH,
            depth,
        }
    }

    /// A random `[B, T, d]` stack input.
    pub fn input(self, device: &Device) -> Tensor<3> {
        Tensor::random(
            [self.batch, self.length, self.width],
            Distribution::Normal(0.0, 1.0),
            device,
        )
    }
}

/// The model-scale workload: 12 blocks at GPT-2-small width on `[8, 1024, 768]`.
pub const MODEL: StackShape = StackShape {
    batch: 8,
    length: 1024,
    width: 768,
    depth: 12,
};

/// [`MODEL`] at the size a CPU runs in seconds: `[1, 32, 768]`.
pub const MODEL_REDUCED: StackShape = StackShape {
    batch: 1,
    length: 32,
    ..MODEL
};

/// How the blocks of a stack are wired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Residual,
    Hacn,
    /// H-ACN with frozen gates: isolates what the gates' gradients cost.
    HacnFrozen,
    Ancre,
    HyperZzw,
    Hc,
    Mhc,
    Dwa,
    /// Full Attention Residuals.
    AttnRes,
    /// Block Attention Residuals, groups of [`ATTNRES_BLOCK_SIZE`] blocks.
    BlockAttnRes,
    /// DeepSeek-V4's mHC, 4 streams.
    MhcV4,
    /// LAuReL-LR of rank [`LAUREL_RANK`].
    Laurel,
    /// mHC-lite, 4 streams (24 permutations).
    MhcLite,
    /// MUDD, one way (the plain-stack form).
    Mudd,
}

/// The LAuReL variant's rank.
pub const LAUREL_RANK: usize = 16;

/// The block AttnRes variant's group size (4 groups in a 12-block stack).
pub const ATTNRES_BLOCK_SIZE: usize = 3;

impl Variant {
    pub const ALL: [Variant; 14] = [
        Self::Residual,
        Self::Hacn,
        Self::HacnFrozen,
        Self::Ancre,
        Self::HyperZzw,
        Self::Hc,
        Self::Mhc,
        Self::Dwa,
        Self::AttnRes,
        Self::BlockAttnRes,
        Self::MhcV4,
        Self::Laurel,
        Self::MhcLite,
        Self::Mudd,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Residual => "residual",
            Self::Hacn => "hacn",
            Self::HacnFrozen => "hacn_frozen",
            Self::Ancre => "ancre",
            Self::HyperZzw => "hyperzzw",
            Self::Hc => "hc",
            Self::Mhc => "mhc",
            Self::Dwa => "dwa",
            Self::AttnRes => "attnres",
            Self::BlockAttnRes => "block_attnres",
            Self::MhcV4 => "mhc_v4",
            Self::Laurel => "laurel",
            Self::MhcLite => "mhc_lite",
            Self::Mudd => "mudd",
        }
    }

    /// The variants named in a comma-separated `--variants` list (all when empty), the
    /// residual first and always: the baseline every ratio or count is taken against.
    pub fn selected(list: &str) -> Result<Vec<Variant>, String> {
        if list.is_empty() {
            return Ok(Self::ALL.to_vec());
        }
        let mut chosen = vec![Self::Residual];
        for name in list.split(',').map(str::trim) {
            let variant = Self::ALL
                .into_iter()
                .find(|variant| variant.name() == name)
                .ok_or_else(|| {
                    let known: Vec<&str> = Self::ALL.iter().map(|v| v.name()).collect();
                    format!(
                        "--variants: unknown variant {name:?}, expected any of {}",
                        known.join(",")
                    )
                })?;
            if !chosen.contains(&variant) {
                chosen.push(variant);
            }
        }
        Ok(chosen)
    }
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Builds a model from a variant's connectivity config: [`Variant::wire`] calls one of its
/// methods, so that each variant's config is written once for every kind of model.
pub trait Wiring {
    /// The model built.
    type Wired;
    /// The plain residual: the baseline.
    fn residual(self) -> Self::Wired;
    /// The blocks wired by the connectivity `config` builds.
    fn connected<C>(self, config: &C) -> Self::Wired
    where
        C: ConnectivityConfig,
        C::Connectivity: StreamConnectivity<3> + Send + Sync + 'static;
}

impl Variant {
    /// `wiring` applied to this variant's connectivity at stream width `width` (and sequence
    /// length `length`, which HyperZZW's kernels are sized for).
    pub fn wire<W: Wiring>(self, width: usize, length: usize, wiring: W) -> W::Wired {
        match self {
            Self::Residual => wiring.residual(),
            Self::Hacn => wiring.connected(&HacnConfig::new()),
            Self::HacnFrozen => wiring.connected(&HacnConfig::new().with_trainable(false)),
            Self::Ancre => wiring.connected(&AncreConfig::new()),
            Self::HyperZzw => wiring.connected(&HyperZzwConnectivityConfig::new(width, length)),
            Self::Hc => wiring.connected(&HyperConnectionsConfig::new(width).with_streams(4)),
            Self::Mhc => wiring.connected(&MhcConfig::new(width).with_streams(4)),
            Self::Dwa => wiring.connected(&DenseFormerConfig::new()),
            Self::AttnRes => wiring.connected(&AttentionResidualsConfig::new(width)),
            Self::BlockAttnRes => wiring.connected(
                &AttentionResidualsConfig::new(width).with_block_size(ATTNRES_BLOCK_SIZE),
            ),
            Self::MhcV4 => wiring.connected(&MhcV4Config::new(width).with_streams(4)),
            Self::Laurel => wiring.connected(&LaurelConfig::lr(width, LAUREL_RANK)),
            Self::MhcLite => wiring.connected(&MhcLiteConfig::new(width).with_streams(4)),
            Self::Mudd => wiring.connected(&MuddConfig::new(width)),
        }
    }
}

/// What the stack, model and encoder workloads time: a model of `[B, T, d]` inputs.
pub trait Timed {
    fn forward(&self, input: Tensor<3>) -> Tensor<3>;

    /// Forward and backward of the mean output.
    fn train_step(&self, input: Tensor<3>) -> Gradients {
        self.forward(input).mean().backward()
    }
}

/// A stack of `depth` MLP blocks under one of the variants.
pub struct Model(Box<dyn Stacked + Send + Sync>);

/// The MLP blocks as a plain residual loop or in a [`Stack`].
trait Stacked {
    fn forward(&self, input: Tensor<3>) -> Tensor<3>;
    /// See [`Model::connectivity_forward`].
    fn connectivity_forward(&self, input: Tensor<3>) -> Tensor<3>;
}

impl Stacked for Vec<MlpBlock> {
    fn forward(&self, input: Tensor<3>) -> Tensor<3> {
        self.iter().fold(input, |stream, block| {
            block.branch(stream.clone(), &()) + stream
        })
    }

    fn connectivity_forward(&self, input: Tensor<3>) -> Tensor<3> {
        self.iter()
            .fold(input, |stream, _| stand_in_branch(stream.clone()) + stream)
    }
}

impl<C: StreamConnectivity<3>> Stacked for Stack<MlpBlock, C> {
    fn forward(&self, input: Tensor<3>) -> Tensor<3> {
        Stack::forward(self, input)
    }

    fn connectivity_forward(&self, input: Tensor<3>) -> Tensor<3> {
        connectivity_alone(self, input)
    }
}

/// [`Wiring`] of MLP blocks into a [`Model`].
struct StackWiring<'a> {
    blocks: Vec<MlpBlock>,
    device: &'a Device,
}

impl Wiring for StackWiring<'_> {
    type Wired = Model;

    fn residual(self) -> Model {
        Model(Box::new(self.blocks))
    }

    fn connected<C>(self, config: &C) -> Model
    where
        C: ConnectivityConfig,
        C::Connectivity: StreamConnectivity<3> + Send + Sync + 'static,
    {
        let stack = Stack::new(self.blocks, config, self.device).expect(WIRED);
        Model(Box::new(stack))
    }
}

/// The workloads' configs are valid: a failure is a bug of this file.
const WIRED: &str = "valid connectivity config";

impl Model {
    /// A `stack{depth}` workload's model.
    pub fn new(variant: Variant, depth: usize, device: &Device) -> Self {
        Self::with_shape(variant, StackShape::stack(depth), device)
    }

    pub fn with_shape(variant: Variant, shape: StackShape, device: &Device) -> Self {
        let StackShape {
            width,
            length,
            depth,
            ..
        } = shape;
        let blocks = MlpBlockConfig::new(width, 4 * width)
            .init_stack(depth, device)
            .expect("valid block config");
        variant.wire(width, length, StackWiring { blocks, device })
    }

    pub fn forward(&self, input: Tensor<3>) -> Tensor<3> {
        self.0.forward(input)
    }

    /// Forward and backward of the mean output.
    pub fn train_step(&self, input: Tensor<3>) -> Gradients {
        Timed::train_step(self, input)
    }

    /// The model's connectivity alone, its blocks replaced by the stand-in branch
    /// `f_j(u) = u / 2` (one elementwise op, the same for every variant): what the
    /// connectivity's own ops cost in the stack, without the blocks' (the residual: its adds).
    pub fn connectivity_forward(&self, input: Tensor<3>) -> Tensor<3> {
        self.0.connectivity_forward(input)
    }

    /// Forward and backward of [`connectivity_forward`](Self::connectivity_forward)'s mean,
    /// with the input tracked (so the residual's adds, which have no parameters, are in the
    /// graph as they are between real blocks).
    pub fn connectivity_train_step(&self, input: Tensor<3>) -> Gradients {
        self.connectivity_forward(input.require_grad())
            .mean()
            .backward()
    }
}

impl Timed for Model {
    fn forward(&self, input: Tensor<3>) -> Tensor<3> {
        Model::forward(self, input)
    }
}

/// Heads of the encoder workload's attention (GPT-2 small's).
pub const ENCODER_HEADS: usize = 12;

/// The encoder workload's model: `depth` pre-norm burn-nn [`TransformerEncoder`] layers at
/// `width` ([`ENCODER_HEADS`] heads, feed-forward width `4 width`, GELU, no dropout) under a
/// causal mask, as burn-nn runs them (the residual) or wired by a variant through
/// [`ConnectedEncoder`] at `granularity`.
pub struct EncoderModel(Box<dyn Fn(Tensor<3>) -> Tensor<3> + Send + Sync>);

/// [`Wiring`] of encoder layers into an [`EncoderModel`].
struct EncoderWiring<'a> {
    encoder: TransformerEncoder,
    granularity: Granularity,
    shape: StackShape,
    device: &'a Device,
}

impl Wiring for EncoderWiring<'_> {
    type Wired = EncoderModel;

    fn residual(self) -> EncoderModel {
        let StackShape { batch, length, .. } = self.shape;
        let mask = generate_autoregressive_mask(batch, length, self.device);
        let encoder = self.encoder;
        EncoderModel(Box::new(move |input| {
            encoder.forward(TransformerEncoderInput::new(input).mask_attn(mask.clone()))
        }))
    }

    fn connected<C>(self, config: &C) -> EncoderModel
    where
        C: ConnectivityConfig,
        C::Connectivity: StreamConnectivity<3> + Send + Sync + 'static,
    {
        let StackShape { batch, length, .. } = self.shape;
        let masks = EncoderMasks::causal(batch, length, self.device);
        let model = ConnectedEncoder::new(self.encoder, self.granularity, config, self.device)
            .expect(WIRED);
        EncoderModel(Box::new(move |input| model.forward(input, &masks)))
    }
}

impl EncoderModel {
    pub fn new(
        variant: Variant,
        shape: StackShape,
        granularity: Granularity,
        device: &Device,
    ) -> Self {
        let StackShape {
            width,
            length,
            depth,
            ..
        } = shape;
        let encoder = TransformerEncoderConfig::new(width, 4 * width, ENCODER_HEADS, depth)
            .with_norm_first(true)
            .with_dropout(0.0)
            .init(device);
        let wiring = EncoderWiring {
            encoder,
            granularity,
            shape,
            device,
        };
        variant.wire(width, length, wiring)
    }
}

impl Timed for EncoderModel {
    fn forward(&self, input: Tensor<3>) -> Tensor<3> {
        (self.0)(input)
    }
}

/// The stand-in for a block in [`Model::connectivity_forward`].
fn stand_in_branch(block_input: Tensor<3>) -> Tensor<3> {
    block_input.mul_scalar(0.5)
}

/// `stack`'s connectivity over its number of blocks of [`stand_in_branch`]es.
fn connectivity_alone<C: StreamConnectivity<3>>(
    stack: &Stack<MlpBlock, C>,
    input: Tensor<3>,
) -> Tensor<3> {
    let connectivity = &stack.connectivity;
    let mut state = connectivity.start(input);
    for block in 0..stack.num_blocks() {
        let branch = stand_in_branch(connectivity.block_input(&state));
        state = connectivity.step(state, block, branch);
    }
    connectivity.output(&state)
}

/// A random `[B, T, d]` input of the `stack{depth}` workloads.
pub fn stack_input(device: &Device) -> Tensor<3> {
    StackShape::stack(0).input(device)
}

/// How the global convolution is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvMethod {
    Fft,
    Direct,
}

impl ConvMethod {
    pub const ALL: [ConvMethod; 2] = [Self::Fft, Self::Direct];

    pub fn name(self) -> &'static str {
        match self {
            Self::Fft => "fft",
            Self::Direct => "direct",
        }
    }

    /// Causal `conv(Z, Z ⊙ K)`.
    pub fn apply(self, z: Tensor<3>, kernel: Tensor<3>) -> Tensor<3> {
        match self {
            Self::Fft => global_hyperzzw_1d(z, kernel, Crop::Causal).expect("matching shapes"),
            Self::Direct => direct_conv_1d(z.clone(), z * kernel, Crop::Causal),
        }
    }
}

impl std::fmt::Display for ConvMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `Z: [B, C, T]` and a slow-net-like kernel `K: [1, C, T]`.
pub fn gconv_inputs(length: usize, device: &Device) -> (Tensor<3>, Tensor<3>) {
    let z = Tensor::random(
        [BATCH, CHANNELS, length],
        Distribution::Normal(0.0, 1.0),
        device,
    );
    let kernel = Tensor::random(
        [1, CHANNELS, length],
        Distribution::Normal(0.0, 1.0 / length as f64),
        device,
    );
    (z, kernel)
}

/// The operation classes of a residual MLP block (`x + Linear(GELU(Linear(LN(x))))`), each timed
/// on its own at the block's shapes: where a Flex train step spends its time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpClass {
    /// The LayerNorm on `[B, T, d]`.
    LayerNorm,
    /// Both linear layers (`d → 4d` and `4d → d`, with biases).
    Matmul,
    /// GELU on `[B, T, 4d]`.
    Gelu,
    /// The residual addition on `[B, T, d]`.
    ResidualAdd,
}

impl OpClass {
    pub const ALL: [OpClass; 4] = [Self::LayerNorm, Self::Matmul, Self::Gelu, Self::ResidualAdd];

    pub fn name(self) -> &'static str {
        match self {
            Self::LayerNorm => "layer_norm",
            Self::Matmul => "matmul",
            Self::Gelu => "gelu",
            Self::ResidualAdd => "residual_add",
        }
    }
}

/// One block's layers and tracked inputs of the block's shapes, for [`OpClass`] timings.
pub struct OpProfile {
    /// Its norm is the LayerNorm class, its two linear layers the matmul class.
    block: MlpBlock,
    /// `[B, T, d]`.
    stream: Tensor<3>,
    /// `[B, T, 4d]`.
    hidden: Tensor<3>,
}

impl OpProfile {
    /// On an autodiff device.
    pub fn new(device: &Device) -> Self {
        let block = MlpBlockConfig::new(WIDTH, 4 * WIDTH)
            .init(1, device)
            .expect("valid block config");
        let hidden = Tensor::random(
            [BATCH, LENGTH, 4 * WIDTH],
            Distribution::Normal(0.0, 1.0),
            device,
        );
        Self {
            block,
            stream: stack_input(device).require_grad(),
            hidden: hidden.require_grad(),
        }
    }

    /// Forward and backward of the mean of one op class's output (gradients of its inputs and
    /// weights).
    pub fn train_step(&self, class: OpClass) -> Gradients {
        let (stream, hidden) = (self.stream.clone(), self.hidden.clone());
        let output = match class {
            OpClass::LayerNorm => self.block.norm.forward(stream).mean(),
            OpClass::Matmul => {
                self.block.expand.forward(stream).mean() + self.block.project.forward(hidden).mean()
            }
            OpClass::Gelu => burn_connectivity::gelu(hidden).mean(),
            OpClass::ResidualAdd => (stream.clone() + stream.mul_scalar(0.5)).mean(),
        };
        output.backward()
    }
}
