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
    /// widths or a connectivity built for another stream width.
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
        if let Some(expected) = connectivity.stream_width()
            && expected != width
        {
            return Err(Error::WidthMismatch {
                name: "the connectivity's stream width (its config's `width`) against the \
                       encoder's d_model"
                    .into(),
                expected,
                found: width,
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
        // The attention's query, key and value apart where the connectivity makes them (MUDD).
        let ways = wiring.way_inputs(&state);
        let norm_1 = |x| self.norm(&layer.norm_1, index, x);
        let norm_2 = |x| self.norm(&layer.norm_2, index, x);
        match (self.granularity, layer.norm_first) {
            (Granularity::Block, true) => {
                let branch = attention(layer, attention_input(input, ways, norm_2), masks);
                wiring.step_with_tail(state, index, branch, |mixed| {
                    mixed.clone() + feed_forward(layer, norm_1(mixed))
                })
            }
            (Granularity::Block, false) => {
                let branch = attention(layer, attention_input(input, ways, |x| x), masks);
                wiring.step_with_tail(state, index, branch, |mixed| {
                    let mixed = norm_1(mixed);
                    norm_2(mixed.clone() + feed_forward(layer, mixed))
                })
            }
            (Granularity::Sublayer, true) => {
                let branch = attention(layer, attention_input(input, ways, norm_2), masks);
                let state = wiring.step(state, 2 * index, branch);
                let input = wiring.block_input(&state);
                let branch = feed_forward(layer, norm_1(input));
                wiring.step(state, 2 * index + 1, branch)
            }
            (Granularity::Sublayer, false) => {
                let branch = attention(layer, attention_input(input, ways, |x| x), masks);
                let state = wiring.step_with_tail(state, 2 * index, branch, norm_1);
                let branch = feed_forward(layer, wiring.block_input(&state));
                wiring.step_with_tail(state, 2 * index + 1, branch, norm_2)
            }
            (Granularity::Layer, true) => {
                let mixed =
                    input.clone() + attention(layer, attention_input(input, ways, norm_2), masks);
                let branch = mixed.clone() + feed_forward(layer, norm_1(mixed));
                wiring.step(state, index, branch)
            }
            (Granularity::Layer, false) => {
                let mixed = norm_1(
                    input.clone()
                        + attention(layer, attention_input(input.clone(), ways, |x| x), masks),
                );
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

/// The attention's input: the block input in every role, or the connectivity's query, key and
/// value ways; each through `norm`.
fn attention_input(
    input: Tensor<3>,
    ways: Option<[Tensor<3>; 3]>,
    norm: impl Fn(Tensor<3>) -> Tensor<3>,
) -> MhaInput {
    match ways {
        Some([query, key, value]) => MhaInput::new(norm(query), norm(key), norm(value)),
        None => MhaInput::self_attn(norm(input)),
    }
}

/// `Dropout(MHA(input))` with the masks.
fn attention(layer: &TransformerEncoderLayer, input: MhaInput, masks: &EncoderMasks) -> Tensor<3> {
    let mut query = input;
    if let Some(pad) = &masks.pad {
        query = query.mask_pad(pad.clone());
    }
    if let Some(attention) = &masks.attention {
        query = query.mask_attn(attention.clone());
    }
    layer.dropout.forward(layer.mha.forward(query).context)
}

/// `Dropout(FFN(input))`, on the CPU backends on the tokens as rows of one `[B T, d]` matrix: the
/// feed-forward acts on the last axis alone, and burn's `Linear` on `[B, T, d]` would write a
/// `[B, d, d_ff]` weight gradient per product and sum it (see `backend::folds_rows`).
fn feed_forward(layer: &TransformerEncoderLayer, input: Tensor<3>) -> Tensor<3> {
    if !crate::backend::folds_rows(&input.device()) {
        return layer.dropout.forward(layer.pwff.forward(input));
    }
    crate::backend::on_rows(input, |rows| {
        layer.dropout.forward(layer.pwff.forward(rows))
    })
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
