//! burn-nn's [`TransformerEncoder`] driven by any connectivity (MATH §4, ANCRe paper §4.2).
//!
//! A [`TransformerEncoderLayer`] adds its own two residuals. [`ConnectedEncoder`] rewires the
//! layer from its public parts so that the connectivity owns the shortcuts, running every
//! sublayer exactly once. With `A(x) = Dropout(MHA(x))`, `F(x) = Dropout(FFN(x))`, the layer's own
//! norms (burn-nn applies `norm_2` before attention in pre-norm layers), and `h ⊕ s` the
//! connectivity's combination of a branch `h` with its shortcut (H-ACN `h + a_j s_{j-1}`, ANCRe
//! `h + Σ_i p_ij s_i`, HyperZZW its fusion):
//!
//! | granularity | pre-norm layer (`norm_first`) | post-norm layer |
//! |---|---|---|
//! | [`Granularity::Block`] (one connectivity block per layer) | `a = A(norm_2(s)) ⊕ s`, `s' = a + F(norm_1(a))` | `a = norm_1(A(s) ⊕ s)`, `s' = norm_2(a + F(a))` |
//! | [`Granularity::Sublayer`] (two blocks per layer) | `m = A(norm_2(s)) ⊕ s`, `s' = F(norm_1(m)) ⊕ m` | `m = norm_1(A(s) ⊕ s)`, `s' = norm_2(F(m) ⊕ m)` |
//! | [`Granularity::Layer`] (the layer, residuals and all) | `a = s + A(norm_2(s))`, `s' = (a + F(norm_1(a))) ⊕ s` | `a = norm_1(s + A(s))`, `s' = norm_2(a + F(a)) ⊕ s` |
//!
//! At block level the connectivity replaces the attention shortcut and the feed-forward keeps
//! its residual, as in the ANCRe paper; H-ACN then has one gate per layer, and its long output
//! sum credits layer `j` with `s_j − a_j s_{j-1}` (`= A + F` in a pre-norm layer; see
//! [`StreamConnectivity::step_with_tail`]). At sublayer level attention and feed-forward are
//! separate targets. With H-ACN's ResNet preset every variant computes the plain encoder.
//!
//! **DepthLN** (H-ACN App. D, MATH §4; [`ConnectedEncoder::with_depth_ln`]): every norm of layer
//! `l` (counted from 1) becomes `DepthLN(x) = (1 + l·s_l)·LN(x)`, the layer's own LayerNorm
//! (loaded weights kept) scaled by one learnable strength `s_l` per layer (init 0.05), shared by
//! the layer's two norms. The strengths live under `depth_ln.…`; train them with the
//! connectivity's parameter group (no weight decay).
//!
//! The layers keep the record paths of a `TransformerEncoder` (`layers.{i}.mha.query.weight`…),
//! so a saved encoder loads into the wrapper ([`ConnectedEncoder::load_encoder_record`]); the
//! connectivity's parameters live under `connectivity.…`.
//!
//! ```
//! use burn::nn::transformer::TransformerEncoderConfig;
//! use burn::{prelude::*, tensor::Distribution};
//! use burn_connectivity::transformer::{ConnectedEncoder, EncoderMasks, Granularity};
//! use burn_connectivity::AncreConfig;
//!
//! let device = Device::flex();
//! let encoder = TransformerEncoderConfig::new(16, 32, 2, 3).with_norm_first(true).init(&device);
//! let model = ConnectedEncoder::new(encoder, Granularity::Block, &AncreConfig::new(), &device)?;
//!
//! let x = Tensor::<3>::random([2, 5, 16], Distribution::Default, &device);
//! let masks = EncoderMasks::causal(2, 5, &device);
//! model.check_input(&x, &masks)?;
//! let y = model.forward(x, &masks);
//! assert_eq!(y.dims(), [2, 5, 16]);
//! # Ok::<(), burn_connectivity::Error>(())
//! ```

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::LayerNorm;
use burn::nn::attention::{MhaInput, generate_autoregressive_mask};
use burn::nn::transformer::{TransformerEncoder, TransformerEncoderLayer};
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn::tensor::Bool;

use crate::connectivity::{Connectivity, ConnectivityConfig, StreamConnectivity};
use crate::depth_ln::depth_scaled;
use crate::error::{Error, Result, check_depth, check_finite};
use crate::matrix::ConnectivityMatrix;

/// Where the connectivity takes over the shortcuts of each encoder layer.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// One connectivity block per layer: it replaces the attention shortcut, the feed-forward
    /// keeps its residual (ANCRe's default "block level").
    Block,
    /// Attention and feed-forward are separate connectivity blocks (ANCRe's "module level";
    /// with [`AncreConfig::module_level`](crate::AncreConfig::module_level) each sublayer
    /// family has its own softmax, as in the paper).
    Sublayer,
    /// The whole layer, its own two residuals included, is the branch: `s' = T(s) ⊕ s` (the
    /// "additive" variant of the public ANCRe code, `s_j = T(s_{j-1}) + Σ_i p_ij s_i`).
    Layer,
}

impl Granularity {
    /// Connectivity blocks per encoder layer.
    pub fn blocks_per_layer(self) -> usize {
        match self {
            Self::Block | Self::Layer => 1,
            Self::Sublayer => 2,
        }
    }
}

/// The masks passed to every attention sublayer, as in burn-nn's `TransformerEncoderInput`.
#[derive(Clone, Debug, Default)]
pub struct EncoderMasks {
    /// Padding mask `[batch, length]`, `true` at padded positions.
    pub pad: Option<Tensor<2, Bool>>,
    /// Attention mask `[batch, length, length]`, `true` where a query must not attend.
    pub attention: Option<Tensor<3, Bool>>,
}

impl EncoderMasks {
    /// The causal mask of a decoder-only model: position `t` attends to positions `<= t`.
    pub fn causal(batch: usize, length: usize, device: &Device) -> Self {
        Self {
            pad: None,
            attention: Some(generate_autoregressive_mask(batch, length, device)),
        }
    }

    /// Adds a padding mask.
    pub fn with_pad(mut self, pad: Tensor<2, Bool>) -> Self {
        self.pad = Some(pad);
        self
    }

    /// Adds an attention mask.
    pub fn with_attention(mut self, attention: Tensor<3, Bool>) -> Self {
        self.attention = Some(attention);
        self
    }
}

/// burn-nn encoder layers wired by a connectivity (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct ConnectedEncoder<C> {
    /// The encoder layers, under the record paths of a `TransformerEncoder`.
    pub layers: Vec<TransformerEncoderLayer>,
    /// How the layers (or their sublayers) are wired.
    pub connectivity: C,
    /// Whether the connectivity wires layers or sublayers.
    #[module(skip)]
    pub granularity: Granularity,
    /// The DepthLN strengths `s_l`, one per layer (`[L]`), if the norms are DepthLN.
    pub depth_ln: Option<Param<Tensor<1>>>,
}

impl<C: Connectivity> ConnectedEncoder<C> {
    /// Wraps the layers of `encoder` with the connectivity `config` builds for them.
    ///
    /// # Errors
    /// As [`from_layers`](Self::from_layers).
    pub fn new(
        encoder: TransformerEncoder,
        granularity: Granularity,
        config: &impl ConnectivityConfig<Connectivity = C>,
        device: &Device,
    ) -> Result<Self> {
        Self::from_layers(encoder.layers, granularity, config, device)
    }

    /// Wraps `layers` with the connectivity `config` builds for them (one block per layer, or
    /// two at [`Granularity::Sublayer`]).
    ///
    /// # Errors
    /// [`Error::NoBlocks`] without layers, [`Error::WidthMismatch`] if the layers have different
    /// widths, or whatever `config` rejects.
    pub fn from_layers(
        layers: Vec<TransformerEncoderLayer>,
        granularity: Granularity,
        config: &impl ConnectivityConfig<Connectivity = C>,
        device: &Device,
    ) -> Result<Self> {
        let blocks = layers.len() * granularity.blocks_per_layer();
        if blocks == 0 {
            return Err(Error::NoBlocks);
        }
        let connectivity = config.init(blocks, device)?;
        Self::from_parts(layers, connectivity, granularity)
    }

    /// Wraps `layers` with an existing connectivity.
    ///
    /// # Errors
    /// [`Error::NoBlocks`] without layers, [`Error::BlockCountMismatch`] if the connectivity was
    /// built for another number of blocks, [`Error::WidthMismatch`] for layers of different
    /// widths.
    pub fn from_parts(
        layers: Vec<TransformerEncoderLayer>,
        connectivity: C,
        granularity: Granularity,
    ) -> Result<Self> {
        let Some(first) = layers.first() else {
            return Err(Error::NoBlocks);
        };
        let width = first.mha.d_model;
        if let Some((index, layer)) = layers
            .iter()
            .enumerate()
            .find(|(_, layer)| layer.mha.d_model != width)
        {
            return Err(Error::WidthMismatch {
                name: format!("width of encoder layer {index}"),
                expected: width,
                found: layer.mha.d_model,
            });
        }
        let blocks = layers.len() * granularity.blocks_per_layer();
        if connectivity.num_blocks() != blocks {
            return Err(Error::BlockCountMismatch {
                connectivity: connectivity.num_blocks(),
                blocks,
            });
        }
        Ok(Self {
            layers,
            connectivity,
            granularity,
            depth_ln: None,
        })
    }

    /// Turns every layer norm into DepthLN at its layer's depth, all strengths starting at
    /// `strength` (paper: 0.05). The LayerNorms keep their weights, so a loaded encoder stays
    /// loaded; with `strength = 0` the model is unchanged until the strengths train.
    ///
    /// # Errors
    /// [`Error::NonFinite`] for a non-finite strength.
    pub fn with_depth_ln(self, strength: f64) -> Result<Self> {
        check_finite("DepthLN strength", strength)?;
        let device = self.layers[0].mha.query.weight.device();
        let strengths = Tensor::full([self.num_layers()], strength, &device);
        Ok(Self {
            depth_ln: Some(Param::from_tensor(strengths)),
            ..self
        })
    }

    /// Number of encoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Model width `d_model`.
    pub fn d_model(&self) -> usize {
        self.layers[0].mha.d_model
    }

    /// The connectivity matrix over the connectivity's blocks (layers, or sublayers in the
    /// order attention, feed-forward).
    pub fn matrix(&self) -> ConnectivityMatrix {
        self.connectivity.matrix()
    }

    /// The first `layers` layers, whose output is this model's readout after that many layers.
    ///
    /// # Errors
    /// [`Error::DepthOutOfRange`] unless `1 <= layers <= num_layers()`.
    pub fn truncated(&self, layers: usize) -> Result<Self> {
        check_depth(layers, 1, self.num_layers())?;
        let blocks = layers * self.granularity.blocks_per_layer();
        Ok(Self {
            layers: self.layers[..layers].to_vec(),
            connectivity: self.connectivity.truncated(blocks)?,
            granularity: self.granularity,
            depth_ln: self
                .depth_ln
                .as_ref()
                .map(|strengths| Param::from_tensor(strengths.val().narrow(0, 0, layers))),
        })
    }

    /// Loads the weights of a saved `TransformerEncoder` with as many layers (its
    /// [`Module::into_record`], or a burnpack file read with [`ModuleRecord::load`]). The
    /// connectivity keeps its parameters.
    ///
    /// # Errors
    /// [`Error::Record`] unless the record holds exactly the layers' tensors, under their paths
    /// and with their shapes.
    pub fn load_encoder_record(self, record: ModuleRecord) -> Result<Self> {
        let expected = count_float_tensors(&self.layers);
        if record.len() != expected {
            return Err(Error::Record(format!(
                "the record holds {} tensors, the {} encoder layers have {expected}",
                record.len(),
                self.num_layers()
            )));
        }
        self.try_load_record(record.allow_partial(true))
            .map_err(|error| Error::Record(error.to_string()))
    }

    /// Checks the input `[batch, length, d_model]` and the masks' shapes, and asks the
    /// connectivity whether it accepts the input.
    ///
    /// # Errors
    /// [`Error::WidthMismatch`] or [`Error::ShapeMismatch`] naming what does not fit, or the
    /// connectivity's error.
    pub fn check_input(&self, input: &Tensor<3>, masks: &EncoderMasks) -> Result<()> {
        let [batch, length, width] = input.dims();
        if width != self.d_model() {
            return Err(Error::WidthMismatch {
                name: "encoder input".into(),
                expected: self.d_model(),
                found: width,
            });
        }
        let check = |name: &str, expected: Vec<usize>, found: Vec<usize>| {
            if expected == found {
                Ok(())
            } else {
                Err(Error::ShapeMismatch {
                    name: name.into(),
                    expected,
                    found,
                })
            }
        };
        if let Some(pad) = &masks.pad {
            check("padding mask", vec![batch, length], pad.dims().to_vec())?;
        }
        if let Some(attention) = &masks.attention {
            check(
                "attention mask",
                vec![batch, length, length],
                attention.dims().to_vec(),
            )?;
        }
        self.connectivity.check_input(&input.dims())
    }
}

impl<C: StreamConnectivity<3>> ConnectedEncoder<C> {
    /// The encoder output.
    pub fn forward(&self, input: Tensor<3>, masks: &EncoderMasks) -> Tensor<3> {
        let state = self.run_layers(input, self.num_layers(), masks, |_| {});
        self.connectivity.output(&state)
    }

    /// The readouts after `0, 1, …, L` layers (what [`truncated`](Self::truncated) models
    /// compute), from one pass.
    pub fn readout(&self, input: Tensor<3>, masks: &EncoderMasks) -> Vec<Tensor<3>> {
        let mut readouts = Vec::with_capacity(self.num_layers() + 1);
        let state = self.run_layers(input, self.num_layers(), masks, |state| {
            readouts.push(self.connectivity.output(state));
        });
        readouts.push(self.connectivity.output(&state));
        readouts
    }

    /// The connectivity state after the first `layers` layers.
    ///
    /// # Errors
    /// [`Error::DepthOutOfRange`] unless `layers <= num_layers()`.
    pub fn run(&self, input: Tensor<3>, layers: usize, masks: &EncoderMasks) -> Result<C::State> {
        check_depth(layers, 0, self.num_layers())?;
        Ok(self.run_layers(input, layers, masks, |_| {}))
    }

    /// Runs the first `layers` layers, calling `before_layer` with the state before each.
    fn run_layers(
        &self,
        input: Tensor<3>,
        layers: usize,
        masks: &EncoderMasks,
        mut before_layer: impl FnMut(&C::State),
    ) -> C::State {
        let mut state = self.connectivity.start(input);
        for index in 0..layers {
            before_layer(&state);
            state = self.layer(state, index, masks);
        }
        state
    }

    /// Steps the connectivity through layer `index` (see the table in the module docs).
    fn layer(&self, state: C::State, index: usize, masks: &EncoderMasks) -> C::State {
        let layer = &self.layers[index];
        let wiring = &self.connectivity;
        let input = wiring.block_input(&state);
        let norm_1 = |x| self.norm(&layer.norm_1, index, x);
        let norm_2 = |x| self.norm(&layer.norm_2, index, x);
        match (self.granularity, layer.norm_first) {
            (Granularity::Block, true) => {
                let branch = attention(layer, norm_2(input), masks);
                wiring.step_with_tail(state, index, branch, |mixed| {
                    mixed.clone() + feed_forward(layer, norm_1(mixed))
                })
            }
            (Granularity::Block, false) => {
                let branch = attention(layer, input, masks);
                wiring.step_with_tail(state, index, branch, |mixed| {
                    let mixed = norm_1(mixed);
                    norm_2(mixed.clone() + feed_forward(layer, mixed))
                })
            }
            (Granularity::Sublayer, true) => {
                let branch = attention(layer, norm_2(input), masks);
                let state = wiring.step(state, 2 * index, branch);
                let input = wiring.block_input(&state);
                let branch = feed_forward(layer, norm_1(input));
                wiring.step(state, 2 * index + 1, branch)
            }
            (Granularity::Sublayer, false) => {
                let branch = attention(layer, input, masks);
                let state = wiring.step_with_tail(state, 2 * index, branch, norm_1);
                let branch = feed_forward(layer, wiring.block_input(&state));
                wiring.step_with_tail(state, 2 * index + 1, branch, norm_2)
            }
            (Granularity::Layer, true) => {
                let mixed = input.clone() + attention(layer, norm_2(input), masks);
                let branch = mixed.clone() + feed_forward(layer, norm_1(mixed));
                wiring.step(state, index, branch)
            }
            (Granularity::Layer, false) => {
                let mixed = norm_1(input.clone() + attention(layer, input, masks));
                let branch = norm_2(mixed.clone() + feed_forward(layer, mixed));
                wiring.step(state, index, branch)
            }
        }
    }

    /// `LN(x)`, or `(1 + l·s_l)·LN(x)` with DepthLN, for a norm of layer `index` (`l = index + 1`).
    fn norm(&self, norm: &LayerNorm, index: usize, input: Tensor<3>) -> Tensor<3> {
        let normed = crate::backend::layer_norm(norm, input);
        match &self.depth_ln {
            Some(strengths) => depth_scaled(normed, strengths.val().narrow(0, index, 1), index + 1),
            None => normed,
        }
    }
}

/// `Dropout(MHA(input))` with the masks.
fn attention(layer: &TransformerEncoderLayer, input: Tensor<3>, masks: &EncoderMasks) -> Tensor<3> {
    let mut query = MhaInput::self_attn(input);
    if let Some(pad) = &masks.pad {
        query = query.mask_pad(pad.clone());
    }
    if let Some(attention) = &masks.attention {
        query = query.mask_attn(attention.clone());
    }
    layer.dropout.forward(layer.mha.forward(query).context)
}

/// `Dropout(FFN(input))`.
fn feed_forward(layer: &TransformerEncoderLayer, input: Tensor<3>) -> Tensor<3> {
    layer.dropout.forward(layer.pwff.forward(input))
}

/// Float tensors a record of `module` holds.
fn count_float_tensors(module: &impl Module) -> usize {
    struct Counter(usize);
    impl ModuleVisitor for Counter {
        fn visit_float<const D: usize>(&mut self, _param: &Param<Tensor<D>>) {
            self.0 += 1;
        }
    }
    let mut counter = Counter(0);
    module.visit(&mut counter);
    counter.0
}

#[cfg(test)]
mod tests {
    use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderInput};
    use burn::tensor::{Distribution, Tolerance};

    use super::*;
    use crate::hacn::{GateInit, HacnConfig};
    use crate::hyperzzw::HyperZzwConnectivityConfig;
    use crate::{AncreConfig, Normalization};

    const WIDTH: usize = 8;
    const LAYERS: usize = 3;
    const GATES: [f64; 6] = [0.3, 0.7, 0.5, 0.2, 0.9, 0.4];

    fn encoder(norm_first: bool, device: &Device) -> TransformerEncoder {
        TransformerEncoderConfig::new(WIDTH, 16, 2, LAYERS)
            .with_norm_first(norm_first)
            .with_dropout(0.0)
            .init(device)
    }

    fn input(device: &Device) -> Tensor<3> {
        Tensor::random([2, 5, WIDTH], Distribution::Normal(0.0, 1.0), device)
    }

    /// Causal attention, and the last two positions of the second sequence padded.
    fn masks(device: &Device) -> EncoderMasks {
        let pad = Tensor::<1, Int>::arange(0..5, device)
            .reshape([1, 5])
            .repeat_dim(0, 2)
            .greater_equal(Tensor::<2, Int>::from_data([[5], [3]], device));
        EncoderMasks::causal(2, 5, device).with_pad(pad)
    }

    fn plain(encoder: &TransformerEncoder, input: Tensor<3>, masks: &EncoderMasks) -> Tensor<3> {
        let masks = masks.clone();
        encoder.forward(
            TransformerEncoderInput::new(input)
                .mask_pad(masks.pad.unwrap())
                .mask_attn(masks.attention.unwrap()),
        )
    }

    fn assert_close(actual: Tensor<3>, expected: Tensor<3>) {
        actual
            .into_data()
            .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-5));
    }

    fn gates(blocks: usize) -> HacnConfig {
        HacnConfig::new().with_init(GateInit::Values {
            values: GATES[..blocks].to_vec(),
        })
    }

    const VARIANTS: [(bool, Granularity); 4] = [
        (true, Granularity::Block),
        (true, Granularity::Sublayer),
        (false, Granularity::Block),
        (false, Granularity::Sublayer),
    ];

    #[test]
    fn resnet_preset_is_the_plain_encoder_with_masks() {
        let device = Device::flex();
        let (x, masks) = (input(&device), masks(&device));
        for (norm_first, granularity) in VARIANTS {
            let encoder = encoder(norm_first, &device);
            let expected = plain(&encoder, x.clone(), &masks);
            let model = ConnectedEncoder::new(encoder, granularity, &HacnConfig::resnet(), &device)
                .unwrap();
            assert_close(model.forward(x.clone(), &masks), expected);
        }
    }

    /// One static stream of hyper-connections and DWA at init are exactly the plain encoder at
    /// either granularity (a whole layer's update `tail(M_0 + h) − M_0` at block level), mHC
    /// is within its init tolerance.
    #[test]
    fn multi_stream_and_dense_presets_are_the_plain_encoder() {
        use crate::{DenseFormerConfig, HyperConnectionsConfig, MhcConfig};
        let device = Device::flex();
        let (x, masks) = (input(&device), masks(&device));
        let one_stream = HyperConnectionsConfig::new(WIDTH)
            .with_streams(1)
            .with_dynamic(false);
        for (norm_first, granularity) in VARIANTS {
            let encoder = encoder(norm_first, &device);
            let expected = plain(&encoder, x.clone(), &masks).into_data();
            let check = |model: Result<Tensor<3>>, tolerance: f64| {
                model
                    .unwrap()
                    .into_data()
                    .assert_approx_eq::<f32>(&expected, Tolerance::absolute(tolerance));
            };
            let layers = || encoder.layers.clone();
            check(
                ConnectedEncoder::from_layers(layers(), granularity, &one_stream, &device)
                    .map(|model| model.forward(x.clone(), &masks)),
                1e-5,
            );
            let dwa = DenseFormerConfig::new();
            check(
                ConnectedEncoder::from_layers(layers(), granularity, &dwa, &device)
                    .map(|model| model.forward(x.clone(), &masks)),
                1e-6,
            );
            let mhc = MhcConfig::new(WIDTH);
            check(
                ConnectedEncoder::from_layers(layers(), granularity, &mhc, &device)
                    .map(|model| model.forward(x.clone(), &masks)),
                1e-2,
            );
        }
    }

    #[test]
    fn ancre_residual_preset_is_near_the_plain_encoder() {
        let device = Device::flex();
        let (x, masks) = (input(&device), masks(&device));
        for (norm_first, granularity) in VARIANTS {
            let encoder = encoder(norm_first, &device);
            let expected = plain(&encoder, x.clone(), &masks);
            let config = AncreConfig::residual(1e-6);
            let model = ConnectedEncoder::new(encoder, granularity, &config, &device).unwrap();
            model
                .forward(x.clone(), &masks)
                .into_data()
                .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-4));
        }
    }

    /// Block level, pre-norm: `a = A(norm_2(s)) + g s`, `s' = a + F(norm_1(a))`,
    /// `y = s_0 + Σ_j (s_j − g_j s_{j-1})`, written out by hand.
    #[test]
    fn hacn_block_level_pre_norm_matches_its_closed_form() {
        let device = Device::flex();
        let (x, masks) = (input(&device), masks(&device));
        let encoder = encoder(true, &device);
        let model =
            ConnectedEncoder::new(encoder, Granularity::Block, &gates(LAYERS), &device).unwrap();

        let (mut stream, mut sum) = (x.clone(), x.clone());
        for (layer, gate) in model.layers.iter().zip(GATES) {
            let carried = stream.clone() * gate;
            let mixed = attention(layer, layer.norm_2.forward(stream), &masks) + carried.clone();
            stream = mixed.clone() + feed_forward(layer, layer.norm_1.forward(mixed));
            sum = sum + stream.clone() - carried;
        }
        assert_close(model.forward(x, &masks), sum);
    }

    /// Sublayer level, post-norm: `m = norm_1(A(s) + g s)`, `s' = norm_2(F(m) + g' m)`, and the
    /// output credits each sublayer with its stream minus the carried part.
    #[test]
    fn hacn_sublayer_level_post_norm_matches_its_closed_form() {
        let device = Device::flex();
        let (x, masks) = (input(&device), masks(&device));
        let encoder = encoder(false, &device);
        let config = gates(2 * LAYERS);
        let model =
            ConnectedEncoder::new(encoder, Granularity::Sublayer, &config, &device).unwrap();

        let (mut stream, mut sum) = (x.clone(), x.clone());
        for (layer, pair) in model.layers.iter().zip(GATES.chunks(2)) {
            let carried = stream.clone() * pair[0];
            let mixed = layer
                .norm_1
                .forward(attention(layer, stream, &masks) + carried.clone());
            sum = sum + mixed.clone() - carried;
            let carried = mixed.clone() * pair[1];
            stream = layer
                .norm_2
                .forward(feed_forward(layer, mixed) + carried.clone());
            sum = sum + stream.clone() - carried;
        }
        assert_close(model.forward(x, &masks), sum);
    }

    /// Sublayer level, pre-norm, is an ordinary connectivity over `2L` branches: ANCRe's
    /// progressive mixture must equal `s_j = h_j + Σ_i p_ij s_i` with every state kept.
    #[test]
    fn ancre_sublayer_level_pre_norm_mixes_every_earlier_state() {
        let device = Device::flex();
        let (x, masks) = (input(&device), masks(&device));
        let config = AncreConfig::new()
            .with_temperature(1.0)
            .with_normalization(Normalization::Ingoing);
        let model = ConnectedEncoder::new(
            encoder(true, &device),
            Granularity::Sublayer,
            &config,
            &device,
        )
        .unwrap();
        let p = model.connectivity.coefficient_values();

        let mut states = vec![x.clone()];
        for (block, layer) in (0..2 * LAYERS).map(|b| (b, &model.layers[b / 2])) {
            let input = states[block].clone();
            let branch = if block % 2 == 0 {
                attention(layer, layer.norm_2.forward(input), &masks)
            } else {
                feed_forward(layer, layer.norm_1.forward(input))
            };
            let mixture = states
                .iter()
                .enumerate()
                .map(|(i, s)| s.clone() * p[i][block + 1])
                .reduce(|a, b| a + b)
                .unwrap();
            states.push(branch + mixture);
        }
        assert_close(model.forward(x, &masks), states.pop().unwrap());
    }

    /// DepthLN keeps the loaded norms and scales each by `(1 + l·s_l)`: the wrapper equals a
    /// hand-written pre-norm block-level H-ACN whose norms are `DepthLn` modules holding the
    /// layer's own LayerNorm, at every granularity the scale reaches every norm, and truncation
    /// keeps the leading strengths.
    #[test]
    fn depth_ln_scales_the_loaded_norms_by_depth() {
        use crate::depth_ln::DepthLn;
        let device = Device::flex();
        let (x, masks) = (input(&device), masks(&device));
        let strengths = [0.05, -0.3, 0.2];
        let model = ConnectedEncoder::new(
            encoder(true, &device),
            Granularity::Block,
            &gates(LAYERS),
            &device,
        )
        .unwrap()
        .with_depth_ln(0.05)
        .unwrap();
        let model = ConnectedEncoder {
            depth_ln: Some(Param::from_data(strengths, &device)),
            ..model
        };
        let depth_ln = |norm: &LayerNorm, depth: usize| DepthLn {
            norm: norm.clone(),
            strength: Param::from_data([strengths[depth - 1]], &device),
            depth,
        };

        let (mut stream, mut sum) = (x.clone(), x.clone());
        for (index, (layer, gate)) in model.layers.iter().zip(GATES).enumerate() {
            let (norm_1, norm_2) = (
                depth_ln(&layer.norm_1, index + 1),
                depth_ln(&layer.norm_2, index + 1),
            );
            let carried = stream.clone() * gate;
            let mixed = attention(layer, norm_2.forward(stream), &masks) + carried.clone();
            stream = mixed.clone() + feed_forward(layer, norm_1.forward(mixed));
            sum = sum + stream.clone() - carried;
        }
        assert_close(model.forward(x.clone(), &masks), sum);

        // Strength 0 is the plain wrapper; any other changes every variant's output.
        for (norm_first, granularity) in VARIANTS {
            let config = gates(LAYERS * granularity.blocks_per_layer());
            let plain =
                ConnectedEncoder::new(encoder(norm_first, &device), granularity, &config, &device)
                    .unwrap();
            let expected = plain.forward(x.clone(), &masks);
            let zero = plain.clone().with_depth_ln(0.0).unwrap();
            assert_close(zero.forward(x.clone(), &masks), expected.clone());
            let scaled = plain.with_depth_ln(0.05).unwrap();
            let difference = (scaled.forward(x.clone(), &masks) - expected)
                .abs()
                .max()
                .into_scalar::<f32>();
            assert!(
                difference > 1e-3,
                "{norm_first} {granularity:?}: {difference}"
            );
            let truncated = scaled.truncated(2).unwrap();
            assert_eq!(truncated.depth_ln.unwrap().dims(), [2]);
        }
        assert!(matches!(
            model.with_depth_ln(f64::NAN),
            Err(Error::NonFinite { .. })
        ));
    }

    #[test]
    fn depth_ln_strengths_train() {
        let device = Device::flex().autodiff();
        let model = ConnectedEncoder::new(
            encoder(true, &device),
            Granularity::Sublayer,
            &gates(2 * LAYERS),
            &device,
        )
        .unwrap()
        .with_depth_ln(0.05)
        .unwrap();
        let grads = model
            .forward(input(&device), &EncoderMasks::default())
            .powf_scalar(2.0)
            .sum()
            .backward();
        let strengths = model.depth_ln.as_ref().unwrap();
        let gradient = crate::test_util::gradient(strengths, &grads);
        assert_eq!(gradient.len(), LAYERS);
        assert!(
            gradient.iter().all(|g| g.is_finite() && *g != 0.0),
            "{gradient:?}"
        );
    }

    /// Module level, pre-norm, for each of the paper's rows: the wrapper equals
    /// `m_j = MHSA_j(LN(a_j)) + Σ_i pA_ij a_i`, `a_{j+1} = FFN_j(LN(m_j)) + Σ_i pF_ij m_i`
    /// written out with separate attention and feed-forward histories, and the learning
    /// families' coefficients are distributions over their own sublayer inputs.
    #[test]
    fn ancre_module_level_has_two_families() {
        use crate::ModuleLevel;
        let device = Device::flex();
        let (x, masks) = (input(&device), masks(&device));
        let size = 2 * LAYERS + 1;
        let logits: Vec<Vec<f64>> = (0..size)
            .map(|i| {
                (0..size)
                    .map(|j| ((5 * i + 3 * j) % 7) as f64 * 0.1)
                    .collect()
            })
            .collect();
        for level in [
            ModuleLevel::Attention,
            ModuleLevel::FeedForward,
            ModuleLevel::Both,
        ] {
            let config = AncreConfig::module_level(level)
                .with_temperature(1.0)
                .with_init(crate::AncreInit::Values {
                    logits: logits.clone(),
                });
            let model = ConnectedEncoder::new(
                encoder(true, &device),
                Granularity::Sublayer,
                &config,
                &device,
            )
            .unwrap();
            let p = model.connectivity.coefficient_values();
            // Block 2j+1 is layer j's attention (input a_j = s_{2j}), block 2j+2 its
            // feed-forward (input m_j = s_{2j+1}).
            let (mut attention_inputs, mut feed_forward_inputs) = (vec![x.clone()], vec![]);
            for (j, layer) in model.layers.iter().enumerate() {
                let a = attention_inputs[j].clone();
                let mut m = attention(layer, layer.norm_2.forward(a.clone()), &masks);
                for (i, source) in attention_inputs.iter().enumerate() {
                    m = m + source.clone() * p[2 * i][2 * j + 1];
                }
                feed_forward_inputs.push(m.clone());
                let mut next = feed_forward(layer, layer.norm_1.forward(m));
                for (i, source) in feed_forward_inputs.iter().enumerate() {
                    next = next + source.clone() * p[2 * i + 1][2 * j + 2];
                }
                attention_inputs.push(next);
            }
            assert_close(
                model.forward(x.clone(), &masks),
                attention_inputs.pop().unwrap(),
            );
            for target in 1..size {
                let family = (target - 1) % 2;
                let learns = match level {
                    ModuleLevel::Attention => family == 0,
                    ModuleLevel::FeedForward => family == 1,
                    ModuleLevel::Both => true,
                };
                let column: Vec<f64> = p.iter().map(|row| row[target]).collect();
                let total: f64 = column.iter().sum();
                assert!((total - 1.0).abs() < 1e-6, "{level:?} column {target}");
                let sources = column.iter().filter(|&&value| value > 0.0).count();
                let expected = if learns { target.div_ceil(2) } else { 1 };
                assert_eq!(sources, expected, "{level:?} column {target}: {column:?}");
            }
        }
    }

    /// MHSA-only at module level is block level: the same model when the attention family's
    /// logits are block level's.
    #[test]
    fn ancre_mhsa_only_module_level_is_block_level() {
        use crate::{AncreInit, ModuleLevel};
        let device = Device::flex();
        let (x, masks) = (input(&device), masks(&device));
        let block_logits: Vec<Vec<f64>> = (0..=LAYERS)
            .map(|i| {
                (0..=LAYERS)
                    .map(|j| (i as f64 - 0.3 * j as f64).sin())
                    .collect()
            })
            .collect();
        let size = 2 * LAYERS + 1;
        let mut module_logits = vec![vec![0.0; size]; size];
        for (i, row) in block_logits.iter().enumerate() {
            for (j, &logit) in row.iter().enumerate().skip(1) {
                module_logits[2 * i][2 * j - 1] = logit;
            }
        }
        let encoder = encoder(true, &device);
        let block = ConnectedEncoder::new(
            encoder.clone(),
            Granularity::Block,
            &AncreConfig::new().with_init(AncreInit::Values {
                logits: block_logits,
            }),
            &device,
        )
        .unwrap();
        let module = ConnectedEncoder::new(
            encoder,
            Granularity::Sublayer,
            &AncreConfig::module_level(ModuleLevel::Attention).with_init(AncreInit::Values {
                logits: module_logits,
            }),
            &device,
        )
        .unwrap();
        assert_close(module.forward(x.clone(), &masks), block.forward(x, &masks));
    }

    /// The additive variant: `s_j = T(s_{j-1}) + Σ_i p_ij s_i` with `T` the plain layer
    /// (burn-nn's own forward), both norm placements.
    #[test]
    fn layer_granularity_adds_the_mixture_to_the_whole_layer() {
        let device = Device::flex();
        let x = input(&device);
        let config = AncreConfig::new().with_temperature(1.0);
        for norm_first in [true, false] {
            let encoder = encoder(norm_first, &device);
            let model =
                ConnectedEncoder::new(encoder.clone(), Granularity::Layer, &config, &device)
                    .unwrap();
            let p = model.connectivity.coefficient_values();
            let mut states = vec![x.clone()];
            for (j, layer) in encoder.layers.iter().enumerate() {
                let mut next = layer.forward(states[j].clone(), None, None);
                for (i, state) in states.iter().enumerate() {
                    next = next + state.clone() * p[i][j + 1];
                }
                states.push(next);
            }
            assert_close(
                model.forward(x.clone(), &EncoderMasks::default()),
                states.pop().unwrap(),
            );
        }
    }

    #[test]
    fn readout_and_truncation_agree() {
        let device = Device::flex();
        let (x, masks) = (input(&device), masks(&device));
        for (norm_first, granularity) in VARIANTS {
            let config = gates(LAYERS * granularity.blocks_per_layer());
            let model =
                ConnectedEncoder::new(encoder(norm_first, &device), granularity, &config, &device)
                    .unwrap();
            let readout = model.readout(x.clone(), &masks);
            assert_eq!(readout.len(), LAYERS + 1);
            assert_close(readout[0].clone(), x.clone());
            for (layers, expected) in readout.iter().enumerate().skip(1) {
                let truncated = model.truncated(layers).unwrap();
                assert_eq!(truncated.num_layers(), layers);
                assert_close(truncated.forward(x.clone(), &masks), expected.clone());
            }
            assert_close(model.forward(x.clone(), &masks), readout[LAYERS].clone());
            assert!(model.truncated(0).is_err());
            assert!(model.truncated(LAYERS + 1).is_err());
        }
    }

    #[test]
    fn hyperzzw_connectivity_wraps_an_encoder() {
        let device = Device::flex();
        let x = input(&device);
        let masks = EncoderMasks::causal(2, 5, &device);
        let config = HyperZzwConnectivityConfig::new(WIDTH, 8)
            .with_local_kernel_sizes(vec![])
            .with_hidden(8);
        for granularity in [Granularity::Block, Granularity::Sublayer] {
            let model =
                ConnectedEncoder::new(encoder(true, &device), granularity, &config, &device)
                    .unwrap();
            assert_eq!(
                model.connectivity.num_blocks(),
                LAYERS * granularity.blocks_per_layer()
            );
            model.check_input(&x, &masks).unwrap();
            let y = model.forward(x.clone(), &masks);
            assert_eq!(y.dims(), [2, 5, WIDTH]);
            assert!(y.into_data().iter::<f32>().all(f32::is_finite));
            let too_long = Tensor::<3>::zeros([1, 9, WIDTH], &device);
            assert!(
                model
                    .check_input(&too_long, &EncoderMasks::default())
                    .is_err()
            );
        }
    }

    #[test]
    fn a_saved_encoder_loads_into_the_wrapper() {
        let device = Device::flex();
        let (x, masks) = (input(&device), masks(&device));
        let trained = encoder(true, &device);
        let expected = plain(&trained, x.clone(), &masks);
        let record = trained.into_record();

        let fresh = ConnectedEncoder::new(
            encoder(true, &device),
            Granularity::Sublayer,
            &HacnConfig::resnet(),
            &device,
        )
        .unwrap();
        let loaded = fresh.load_encoder_record(record).unwrap();
        assert_close(loaded.forward(x, &masks), expected);

        let deeper = TransformerEncoderConfig::new(WIDTH, 16, 2, LAYERS + 1).init(&device);
        let fresh = ConnectedEncoder::new(
            encoder(true, &device),
            Granularity::Block,
            &gates(3),
            &device,
        )
        .unwrap();
        let err = fresh.load_encoder_record(deeper.into_record()).unwrap_err();
        assert!(matches!(err, Error::Record(_)), "{err}");
    }

    #[test]
    fn bad_shapes_and_configs_are_errors() {
        let device = Device::flex();
        let model = ConnectedEncoder::new(
            encoder(true, &device),
            Granularity::Block,
            &gates(3),
            &device,
        )
        .unwrap();
        let x = input(&device);
        let wide = Tensor::<3>::zeros([2, 5, WIDTH + 1], &device);
        let err = model
            .check_input(&wide, &EncoderMasks::default())
            .unwrap_err();
        assert!(matches!(err, Error::WidthMismatch { .. }), "{err}");
        let short_mask = EncoderMasks::causal(2, 4, &device);
        let err = model.check_input(&x, &short_mask).unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");

        let wrong_count = ConnectedEncoder::new(
            encoder(true, &device),
            Granularity::Sublayer,
            &gates(3),
            &device,
        );
        assert!(matches!(wrong_count, Err(Error::CountMismatch { .. })));
        let empty = ConnectedEncoder::from_layers(vec![], Granularity::Block, &gates(3), &device);
        assert!(matches!(empty, Err(Error::NoBlocks)));
        let mut layers = encoder(true, &device).layers;
        layers.push(
            TransformerEncoderConfig::new(WIDTH * 2, 16, 2, 1)
                .init(&device)
                .layers
                .remove(0),
        );
        let mixed =
            ConnectedEncoder::from_layers(layers, Granularity::Block, &HacnConfig::new(), &device);
        assert!(matches!(mixed, Err(Error::WidthMismatch { .. })));
    }
}
