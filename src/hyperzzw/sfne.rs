//! The SFNE block (slow-fast neural encoding, MATH §3.4) and the slow neural loss.
//!
//! A multi-branch block with **no additive residual**. For an input `x: [B, C, P]` (`P`
//! positions of a sequence or a flattened map, see [`Geometry`]) and the block's global
//! hyper-kernel `K_g` (a [`SlowNet`] on the position grid):
//!
//! ```text
//! Ŵ      = x ⊙ K_g                                 context-dependent global kernel
//! fast   = IS(RGU₂(Ŵ) + RGU₁(x))                   RGU(x) = W_Y (GELU(IS(W_K x ⊙ W_Q W_V x)) + P)
//! mixer  = IS(W_m x)                                channel mixer
//! hci    = IS(x ⊙ σ(k_c ⊙ z_c ⊙ z_c))               hyper-channel interaction, z_c = mean over positions
//! out    = conv(fast, Ŵ),  out_x = conv(mixer, Ŵ),  out_hci = conv(hci, Ŵ)     global branches
//! glu    = σ(out) ⊙ out                             Si-GLU
//! hyper  = x ⊙ σ((k_s ⊙ z_s ⊙ z_s) ⊙ (k_c' ⊙ z_c' ⊙ z_c'))   hyper interaction, from `out`
//! l_i    = GELU(BS(W_i · Local_{k_i}(src_i → tgt_i))) + b_i                   local branches
//! y      = Dropout(GELU(G-IBS(W_b [out, fast, out_x, glu, out_hci, hyper, l_1..]) ) + b)
//! ```
//!
//! `IS` standardises over positions per (sample, channel), `BS` over batch and positions per
//! channel, both without affine parameters or running statistics (batch statistics at inference
//! too, as in the reference), eps 1e-5, biased variance. G-IBS splits the `λ·C` output channels
//! into groups, BS on even and IS on odd groups. The local branches pair their sources and
//! targets as the reference's MuHKGen does, cycling through `(x → hci), (hci → x), (mixer → x),
//! (x → mixer)`.
//!
//! **Matches the reference** (2D Terminator code) with the defaults: local kernel sizes
//! `[3, 9, 5, 7]`, 12 G-IBS groups, global slow net `h = 64`, local and channel nets `h = 32`,
//! hyper-interaction channel net `h = 16`, ω0 = 2000, every optional branch on; dropout zeroes
//! whole channels as the reference's `Dropout2d`. **Differs**: the global branches are the
//! paper's FFT convolution (MATH §3.2), not the reference's square-map matrix product (that is
//! [`global_hyperzzw_dot`](crate::hyperzzw::global_hyperzzw_dot)); the branch order in the
//! concatenation is the one above; the reference's dense cross-block concatenation of earlier
//! block outputs is not implemented.

use burn::module::Param;
use burn::nn::{Dropout, DropoutConfig, Linear};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::activation::sigmoid;

use crate::activation::gelu;
use crate::error::{Error, Result, check_positive, check_probability, check_size};
use crate::hyperzzw::fft::FftPath;
use crate::hyperzzw::global::{Crop, Geometry, SpectralConv};
use crate::hyperzzw::local::{LocalHyperZzw, LocalHyperZzwConfig};
use crate::hyperzzw::slow_net::{SlowNet, SlowNetConfig, linear};

const EPSILON: f64 = 1e-5;

/// `(x − E[x]) / √(Var[x] + eps)` over `axes` (biased variance).
fn standardize(x: Tensor<3>, axes: &[usize]) -> Tensor<3> {
    let mean = axes.iter().fold(x.clone(), |m, &axis| m.mean_dim(axis));
    let centered = x - mean;
    let variance = axes
        .iter()
        .fold(centered.clone().powf_scalar(2.0), |v, &axis| {
            v.mean_dim(axis)
        });
    centered / variance.add_scalar(EPSILON).sqrt()
}

/// Instance standardisation: over positions, per (sample, channel).
pub fn instance_standardize(x: Tensor<3>) -> Tensor<3> {
    standardize(x, &[2])
}

/// Batch standardisation: over batch and positions, per channel.
pub fn batch_standardize(x: Tensor<3>) -> Tensor<3> {
    standardize(x, &[0, 2])
}

/// G-IBS: channels split into `groups` contiguous groups, batch standardisation on even groups
/// and instance standardisation on odd ones.
pub fn group_ibs(x: Tensor<3>, groups: usize) -> Tensor<3> {
    let parts = x.chunk(groups, 1).into_iter().enumerate();
    let parts = parts.map(|(index, part)| {
        if index % 2 == 0 {
            batch_standardize(part)
        } else {
            instance_standardize(part)
        }
    });
    Tensor::cat(parts.collect(), 1)
}

/// A linear map over the channel axis of `[B, C, P]` (a 1x1 convolution).
fn channel_linear(layer: &Linear, x: Tensor<3>) -> Tensor<3> {
    layer.forward(x.swap_dims(1, 2)).swap_dims(1, 2)
}

/// `N(0, 2/fan_in)` weights, zero bias (kaiming normal, as the reference's mixers).
fn kaiming_linear(d_in: usize, d_out: usize, device: &Device) -> Linear {
    let std = (2.0 / d_in as f64).sqrt();
    linear(
        Tensor::random([d_in, d_out], Distribution::Normal(0.0, std), device),
        Tensor::zeros([d_out], device),
    )
}

/// `U(±√(3/C))` weights, zero bias (the RGU's linears).
fn uniform_linear(channels: usize, device: &Device) -> Linear {
    let bound = (3.0 / channels as f64).sqrt();
    let weight = Tensor::random(
        [channels, channels],
        Distribution::Uniform(-bound, bound),
        device,
    );
    linear(weight, Tensor::zeros([channels], device))
}

fn scalar_bias(device: &Device) -> Param<Tensor<1>> {
    Param::from_tensor(Tensor::zeros([1], device))
}

/// Recursive Gated Unit: `W_Y (GELU(IS(W_K x ⊙ W_Q W_V x)) + P)`, `P` one value per position.
#[derive(Module, Debug)]
pub struct Rgu {
    /// `W_K`.
    pub key: Linear,
    /// `W_V`.
    pub value: Linear,
    /// `W_Q`.
    pub query: Linear,
    /// `W_Y`.
    pub output: Linear,
    /// `P`, shared by all channels.
    pub position_bias: Param<Tensor<1>>,
}

impl Rgu {
    fn new(channels: usize, positions: usize, device: &Device) -> Self {
        Self {
            key: uniform_linear(channels, device),
            value: uniform_linear(channels, device),
            query: uniform_linear(channels, device),
            output: uniform_linear(channels, device),
            position_bias: Param::from_tensor(Tensor::zeros([positions], device)),
        }
    }

    /// Applies the unit to `x: [B, C, P]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let key = channel_linear(&self.key, x.clone());
        let value = channel_linear(&self.value, x);
        let gated = instance_standardize(key * channel_linear(&self.query, value));
        let positions = self.position_bias.dims()[0];
        channel_linear(
            &self.output,
            gelu(gated) + self.position_bias.val().reshape([1, 1, positions]),
        )
    }
}

/// `k ⊙ z ⊙ z` with `k` a slow-net kernel over the channel axis and `z: [B, C]`.
fn channel_scores(net: &SlowNet, z: Tensor<2>) -> Tensor<2> {
    let channels = z.dims()[1];
    net.kernel().reshape([1, channels]) * z.clone() * z
}

/// Hyper-channel interaction: `x ⊙ σ(k_c ⊙ z_c ⊙ z_c)`, `z_c` the per-channel mean.
#[derive(Module, Debug)]
pub struct HyperChannel {
    /// The channel kernel `k_c` (a 1D slow net over `C` points).
    pub slow_net: SlowNet,
}

impl HyperChannel {
    /// Applies it to `x: [B, C, P]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [batch, channels, _] = x.dims();
        let z = x.clone().mean_dim(2).reshape([batch, channels]);
        x * sigmoid(channel_scores(&self.slow_net, z)).unsqueeze_dim(2)
    }
}

/// Hyper interaction: channel and spatial scores from the global output gate the block input.
#[derive(Module, Debug)]
pub struct HyperInteraction {
    /// Channel kernel `k_c'` (1D slow net over `C` points).
    pub channel: SlowNet,
    /// Spatial kernel `k_s` (slow net over the position grid).
    pub spatial: SlowNet,
}

impl HyperInteraction {
    /// `x ⊙ σ(s_s ⊙ s_c)` with the scores computed from `out`; both `[B, C, P]`.
    pub fn forward(&self, out: Tensor<3>, x: Tensor<3>) -> Tensor<3> {
        let [batch, channels, positions] = out.dims();
        let channel = channel_scores(
            &self.channel,
            out.clone().mean_dim(2).reshape([batch, channels]),
        );
        let z_s = out.mean_dim(1).reshape([batch, positions]);
        let spatial = self.spatial.kernel().reshape([1, positions]) * z_s.clone() * z_s;
        x * sigmoid(spatial.unsqueeze_dim::<3>(1) * channel.unsqueeze_dim::<3>(2))
    }
}

/// Which tensor feeds a local branch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LocalTensor {
    Input,
    HyperChannel,
    Mixer,
}

/// The reference's MuHKGen pairing (kernel source, convolved target), cycled.
const PAIRINGS: [(LocalTensor, LocalTensor); 4] = [
    (LocalTensor::Input, LocalTensor::HyperChannel),
    (LocalTensor::HyperChannel, LocalTensor::Input),
    (LocalTensor::Mixer, LocalTensor::Input),
    (LocalTensor::Input, LocalTensor::Mixer),
];

/// A local branch of the block: `GELU(BS(W · Local_k(source → target))) + b`.
#[derive(Module, Debug)]
pub struct LocalBranch {
    /// Kernel generation and depthwise convolution.
    pub hyper: LocalHyperZzw,
    /// The 1x1 channel mixer after the convolution.
    pub mixer: Linear,
    /// Scalar bias, init 0.
    pub bias: Param<Tensor<1>>,
}

impl LocalBranch {
    fn forward(
        &self,
        source: Tensor<3>,
        target: Tensor<3>,
        geometry: Geometry,
    ) -> Result<Tensor<3>> {
        let convolved = match geometry {
            Geometry::Sequence { .. } => self.hyper.forward(source, target)?,
            Geometry::Map { rows, columns } => {
                let [batch, channels, positions] = target.dims();
                let map = |x: Tensor<3>| x.reshape([batch, channels, rows, columns]);
                self.hyper
                    .forward_2d(map(source), map(target))?
                    .reshape([batch, channels, positions])
            }
        };
        let mixed = batch_standardize(channel_linear(&self.mixer, convolved));
        Ok(gelu(mixed) + self.bias.val().reshape([1, 1, 1]))
    }
}

/// Configuration of [`SfneBlock`].
#[derive(Config, Debug)]
pub struct SfneBlockConfig {
    /// Input channels `C`.
    pub in_channels: usize,
    /// Bottleneck factor λ: the block outputs `λ·C` channels.
    pub expansion: usize,
    /// The positions the block works on (fixed, like the reference's 32x32).
    pub geometry: Geometry,
    /// Local branch kernel sizes (odd), in the reference's order `[3, 9, 5, 7]`.
    #[config(default = "vec![3, 9, 5, 7]")]
    pub local_kernel_sizes: Vec<usize>,
    /// G-IBS groups; `λ·C` must be divisible by it (reference 12).
    #[config(default = 12)]
    pub groups: usize,
    /// Hidden width of the global slow net (reference 64).
    #[config(default = 64)]
    pub global_hidden: usize,
    /// Hidden width of the local kernel generators (reference 32).
    #[config(default = 32)]
    pub local_hidden: usize,
    /// Hidden width of the channel slow nets (reference 32, 16 in hyper interaction).
    #[config(default = 32)]
    pub channel_hidden: usize,
    /// Multiplicative layers of every slow net (reference 2; 3 in the first block).
    #[config(default = 2)]
    pub layers: usize,
    /// Frequency scale ω0 of every slow net (reference 2000).
    #[config(default = 2000.0)]
    pub omega_0: f64,
    /// Channel dropout probability after the block.
    #[config(default = 0.0)]
    pub dropout: f64,
    /// Crop of the global convolutions; `None` uses the geometry's default (causal for
    /// sequences, same for maps).
    #[config(default = "None")]
    pub crop: Option<Crop>,
    /// The plain channel mixer branch (and its global branch).
    #[config(default = true)]
    pub channel_mixer: bool,
    /// The hyper-channel interaction branch (and its global branch).
    #[config(default = true)]
    pub hyper_channel: bool,
    /// The Si-GLU branch.
    #[config(default = true)]
    pub si_glu: bool,
    /// The hyper interaction branch.
    #[config(default = true)]
    pub hyper_interaction: bool,
    /// s-renormalisation in the global kernel generator `K_g` (Terminator §2.2; see
    /// [`SlowNet`]).
    #[config(default = true)]
    pub global_s_renorm: bool,
}

impl SfneBlockConfig {
    /// Builds the block.
    ///
    /// # Errors
    /// Zero sizes, `λ·C` not divisible by the group count, even or zero local kernel sizes, a
    /// non-positive ω0, dropout outside `[0, 1)`.
    pub fn init(&self, device: &Device) -> Result<SfneBlock> {
        check_size("SFNE input channels", self.in_channels)?;
        check_size("SFNE expansion", self.expansion)?;
        check_size("G-IBS groups", self.groups)?;
        self.geometry.check()?;
        check_positive("SFNE omega_0", self.omega_0)?;
        check_probability("SFNE dropout", self.dropout)?;
        let channels = self.in_channels;
        let out_channels = self.expansion * channels;
        if !out_channels.is_multiple_of(self.groups) {
            return Err(Error::WidthMismatch {
                name: format!(
                    "G-IBS: λ·C = {out_channels} channels in {} groups",
                    self.groups
                ),
                expected: out_channels.div_ceil(self.groups) * self.groups,
                found: out_channels,
            });
        }
        let grid = self.geometry.grid();
        let smallest_side = grid.iter().copied().min().unwrap_or(0);
        if let Some(&kernel_size) = self.local_kernel_sizes.iter().find(|&&k| k > smallest_side) {
            return Err(Error::OutOfRange {
                name: "SFNE local kernel size",
                value: kernel_size as f64,
                requirement: "at most the smallest side of the geometry",
            });
        }
        let slow_net_config = |grid: Vec<usize>, out: usize, hidden: usize| {
            SlowNetConfig::new(grid, out)
                .with_hidden(hidden)
                .with_layers(self.layers)
                .with_omega_0(self.omega_0)
        };
        let slow_net = |grid: Vec<usize>, out: usize, hidden: usize| {
            slow_net_config(grid, out, hidden).init(device)
        };
        let locals = self
            .local_kernel_sizes
            .iter()
            .map(|&kernel_size| {
                let hyper = LocalHyperZzwConfig::new(channels, kernel_size)
                    .with_dims(grid.len())
                    .with_hidden(self.local_hidden)
                    .with_layers(self.layers)
                    .with_omega_0(self.omega_0)
                    .init(device)?;
                Ok(LocalBranch {
                    hyper,
                    mixer: kaiming_linear(channels, channels, device),
                    bias: scalar_bias(device),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let hyper_channel = match self.hyper_channel {
            true => Some(HyperChannel {
                slow_net: slow_net(vec![channels], 1, self.channel_hidden)?,
            }),
            false => None,
        };
        let hyper_interaction = match self.hyper_interaction {
            true => Some(HyperInteraction {
                channel: slow_net(vec![channels], 1, self.channel_hidden.div_ceil(2))?,
                spatial: slow_net(grid.clone(), 1, self.global_hidden)?,
            }),
            false => None,
        };
        let branches = 2
            + usize::from(self.channel_mixer)
            + usize::from(self.hyper_channel)
            + usize::from(self.si_glu)
            + usize::from(self.hyper_interaction)
            + locals.len();
        let positions = self.geometry.positions();
        let global = slow_net_config(grid, channels, self.global_hidden)
            .with_s_renorm(self.global_s_renorm)
            .init(device)?;
        Ok(SfneBlock {
            global,
            rgu_context: Rgu::new(channels, positions, device),
            rgu_input: Rgu::new(channels, positions, device),
            mixer: self
                .channel_mixer
                .then(|| kaiming_linear(channels, channels, device)),
            hyper_channel,
            hyper_interaction,
            locals,
            bottleneck: kaiming_linear(branches * channels, out_channels, device),
            bias: scalar_bias(device),
            dropout: DropoutConfig::new(self.dropout).init(),
            geometry: self.geometry,
            crop: self.crop.unwrap_or(self.geometry.default_crop()),
            groups: self.groups,
            si_glu: self.si_glu,
        })
    }
}

/// The SFNE block (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct SfneBlock {
    /// The global hyper-kernel generator `K_g`.
    pub global: SlowNet,
    /// RGU₂, on the context-dependent kernel `Ŵ`.
    pub rgu_context: Rgu,
    /// RGU₁, on the input.
    pub rgu_input: Rgu,
    /// The plain channel mixer.
    pub mixer: Option<Linear>,
    /// Hyper-channel interaction.
    pub hyper_channel: Option<HyperChannel>,
    /// Hyper interaction.
    pub hyper_interaction: Option<HyperInteraction>,
    /// The local branches.
    pub locals: Vec<LocalBranch>,
    /// `branches·C → λ·C`.
    pub bottleneck: Linear,
    /// Scalar bias before the dropout, init 0.
    pub bias: Param<Tensor<1>>,
    /// Channel dropout.
    pub dropout: Dropout,
    /// The positions.
    #[module(skip)]
    pub geometry: Geometry,
    /// Crop of the global convolutions.
    #[module(skip)]
    pub crop: Crop,
    /// G-IBS groups.
    pub groups: usize,
    /// Whether the Si-GLU branch is on.
    pub si_glu: bool,
}

/// What an [`SfneBlock`] returns.
#[derive(Debug, Clone)]
pub struct SfneOutput {
    /// `[B, λ·C, P]`.
    pub output: Tensor<3>,
    /// The block's global hyper-kernel `K_g` as `[C, P]`, for the slow neural loss.
    pub global_kernel: Tensor<2>,
}

impl SfneBlock {
    /// Input channels `C`.
    pub fn in_channels(&self) -> usize {
        self.global.out_channels()
    }

    /// Output channels `λ·C`.
    pub fn out_channels(&self) -> usize {
        self.bottleneck.weight.dims()[1]
    }

    /// Runs the block on `x: [B, C, P]`.
    ///
    /// # Errors
    /// [`Error::WidthMismatch`] if `x` does not have `C` channels and `P` positions.
    pub fn forward(&self, x: Tensor<3>) -> Result<SfneOutput> {
        let [_, channels, positions] = x.dims();
        if channels != self.in_channels() {
            return Err(Error::WidthMismatch {
                name: "SFNE input channels".into(),
                expected: self.in_channels(),
                found: channels,
            });
        }
        if positions != self.geometry.positions() {
            let expected = self.geometry.positions();
            return Err(Error::WidthMismatch {
                name: "SFNE input positions".into(),
                expected,
                found: positions,
            });
        }
        let global_kernel = self.global.kernel().transpose();
        let context_kernel = x.clone() * global_kernel.clone().unsqueeze_dim(0);
        let path = FftPath::for_device(&x.device());
        let spectral = SpectralConv::new(context_kernel.clone(), self.geometry, self.crop, path);
        let global = |values: Tensor<3>| spectral.apply(values);

        let fast = instance_standardize(
            self.rgu_context.forward(context_kernel.clone()) + self.rgu_input.forward(x.clone()),
        );
        let mixer = self
            .mixer
            .as_ref()
            .map(|mixer| instance_standardize(channel_linear(mixer, x.clone())));
        let hci = self
            .hyper_channel
            .as_ref()
            .map(|hci| instance_standardize(hci.forward(x.clone())));
        let out = global(fast.clone());

        let mut branches = vec![out.clone(), fast];
        branches.extend(mixer.clone().map(&global));
        branches.extend(self.si_glu.then(|| sigmoid(out.clone()) * out.clone()));
        branches.extend(hci.clone().map(&global));
        branches.extend(
            self.hyper_interaction
                .as_ref()
                .map(|hi| hi.forward(out, x.clone())),
        );
        let pick = |which: LocalTensor| match which {
            LocalTensor::Input => x.clone(),
            LocalTensor::HyperChannel => hci.clone().unwrap_or_else(|| x.clone()),
            LocalTensor::Mixer => mixer.clone().unwrap_or_else(|| x.clone()),
        };
        for (local, (source, target)) in self.locals.iter().zip(PAIRINGS.iter().cycle()) {
            branches.push(local.forward(pick(*source), pick(*target), self.geometry)?);
        }

        let compressed = channel_linear(&self.bottleneck, Tensor::cat(branches, 1));
        let activated =
            gelu(group_ibs(compressed, self.groups)) + self.bias.val().reshape([1, 1, 1]);
        let [batch, out_channels, _] = activated.dims();
        let channel_mask = self.dropout.forward(Tensor::<3>::ones(
            [batch, out_channels, 1],
            (&activated.device(), activated.dtype()),
        ));
        Ok(SfneOutput {
            output: activated * channel_mask,
            global_kernel,
        })
    }
}

/// The slow neural loss (paper eqs. 11–12): `Σ_j Σ_{t<j} mean((E(K^t) − K^j)²)` over the global
/// kernels `[C_j, P]` of successive blocks, `E` tiling the channels of the earlier kernel to the
/// later kernel's count. Add it to the task loss. Zero for fewer than two kernels.
///
/// # Errors
/// [`Error::WidthMismatch`] if the kernels cover different numbers of positions.
pub fn slow_neural_loss(kernels: &[Tensor<2>]) -> Result<Tensor<1>> {
    let Some(first) = kernels.first() else {
        return Err(Error::NoBlocks);
    };
    let positions = first.dims()[1];
    let mut loss = Tensor::<1>::zeros([1], (&first.device(), first.dtype()));
    for (j, later) in kernels.iter().enumerate() {
        let [channels, found] = later.dims();
        if found != positions {
            return Err(Error::WidthMismatch {
                name: format!("global kernel {j} positions"),
                expected: positions,
                found,
            });
        }
        for earlier in &kernels[..j] {
            let repeats = channels.div_ceil(earlier.dims()[0]);
            let tiled = earlier
                .clone()
                .repeat_dim(0, repeats)
                .narrow(0, 0, channels);
            loss = loss + (tiled - later.clone()).powf_scalar(2.0).mean();
        }
    }
    Ok(loss)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(shape: [usize; 3], device: &Device) -> Tensor<3> {
        Tensor::random(shape, Distribution::Normal(1.0, 2.0), device)
    }

    fn moments(x: Tensor<3>, axes: &[usize]) -> (Vec<f64>, Vec<f64>) {
        let mean = axes.iter().fold(x.clone(), |m, &axis| m.mean_dim(axis));
        let variance = axes
            .iter()
            .fold((x - mean.clone()).powf_scalar(2.0), |v, &axis| {
                v.mean_dim(axis)
            });
        (
            mean.into_data().iter().collect(),
            variance.into_data().iter().collect(),
        )
    }

    #[test]
    fn standardisations_centre_and_scale_their_axes() {
        let device = Device::flex();
        let x = random([3, 4, 10], &device);
        for (standardized, axes) in [
            (instance_standardize(x.clone()), vec![2]),
            (batch_standardize(x.clone()), vec![0, 2]),
        ] {
            let (mean, variance) = moments(standardized, &axes);
            assert!(mean.iter().all(|m| m.abs() < 1e-5), "{mean:?}");
            assert!(
                variance.iter().all(|v| (v - 1.0).abs() < 1e-3),
                "{variance:?}"
            );
        }
    }

    #[test]
    fn group_ibs_alternates_batch_and_instance_standardisation() {
        let device = Device::flex();
        let x = random([3, 8, 10], &device);
        let y = group_ibs(x.clone(), 4);
        let group = |t: Tensor<3>, g: usize| t.narrow(1, 2 * g, 2);
        for g in 0..4 {
            let expected = if g % 2 == 0 {
                batch_standardize(group(x.clone(), g))
            } else {
                instance_standardize(group(x.clone(), g))
            };
            group(y.clone(), g).into_data().assert_approx_eq::<f32>(
                &expected.into_data(),
                burn::tensor::Tolerance::rel_abs(1e-5, 1e-6),
            );
        }
    }

    fn small_config(geometry: Geometry) -> SfneBlockConfig {
        SfneBlockConfig::new(4, 2, geometry)
            .with_groups(4)
            .with_global_hidden(8)
            .with_local_hidden(8)
            .with_channel_hidden(8)
            .with_omega_0(10.0)
            .with_local_kernel_sizes(vec![3, 5])
    }

    #[test]
    fn blocks_expand_channels_on_sequences_and_maps() {
        let device = Device::flex();
        for geometry in [
            Geometry::Sequence { length: 30 },
            Geometry::Map {
                rows: 5,
                columns: 6,
            },
        ] {
            let block = small_config(geometry).init(&device).unwrap();
            let out = block.forward(random([2, 4, 30], &device)).unwrap();
            assert_eq!(out.output.dims(), [2, 8, 30]);
            assert_eq!(out.global_kernel.dims(), [4, 30]);
            // 2 + mixer + hci + glu + hyper + 2 locals = 8 branches of C = 4.
            assert_eq!(block.bottleneck.weight.dims(), [32, 8]);
        }
        let minimal = small_config(Geometry::Sequence { length: 12 })
            .with_channel_mixer(false)
            .with_hyper_channel(false)
            .with_si_glu(false)
            .with_hyper_interaction(false)
            .with_local_kernel_sizes(vec![])
            .init(&device)
            .unwrap();
        assert_eq!(minimal.bottleneck.weight.dims(), [8, 8]);
        assert_eq!(
            minimal
                .forward(random([2, 4, 12], &device))
                .unwrap()
                .output
                .dims(),
            [2, 8, 12]
        );
    }

    #[test]
    fn the_block_trains_end_to_end() {
        let device = Device::flex().autodiff();
        let block = small_config(Geometry::Sequence { length: 12 })
            .init(&device)
            .unwrap();
        let out = block.forward(random([2, 4, 12], &device)).unwrap();
        let grads = (out.output.sum()
            + slow_neural_loss(&[out.global_kernel.clone(), out.global_kernel]).unwrap())
        .backward();
        assert!(block.bottleneck.weight.val().grad(&grads).is_some());
        assert!(block.global.output.weight.val().grad(&grads).is_some());
        assert!(
            block.locals[1]
                .hyper
                .reduce
                .weight
                .val()
                .grad(&grads)
                .is_some()
        );
        assert!(block.rgu_context.query.weight.val().grad(&grads).is_some());
    }

    #[test]
    fn slow_loss_tiles_earlier_kernels() {
        let device = Device::flex();
        let earlier = Tensor::<2>::random([2, 5], Distribution::Normal(0.0, 1.0), &device);
        let later = earlier.clone().repeat_dim(0, 3);
        let zero = slow_neural_loss(&[earlier.clone(), later.clone()])
            .unwrap()
            .into_scalar::<f64>();
        assert!(zero.abs() < 1e-12);
        let shifted = slow_neural_loss(&[earlier.clone(), later.add_scalar(0.5)])
            .unwrap()
            .into_scalar::<f64>();
        assert!((shifted - 0.25).abs() < 1e-6, "{shifted}");
        assert_eq!(
            slow_neural_loss(std::slice::from_ref(&earlier))
                .unwrap()
                .into_scalar::<f64>(),
            0.0
        );
        assert!(slow_neural_loss(&[]).is_err());
        assert!(slow_neural_loss(&[earlier, Tensor::zeros([2, 4], &device)]).is_err());
    }

    #[test]
    fn invalid_configs_and_inputs_are_errors() {
        let device = Device::flex();
        let geometry = Geometry::Sequence { length: 12 };
        assert!(
            small_config(geometry).with_groups(3).init(&device).is_err(),
            "8 channels in 3 groups"
        );
        assert!(
            small_config(geometry)
                .with_local_kernel_sizes(vec![4])
                .init(&device)
                .is_err()
        );
        assert!(
            small_config(Geometry::Sequence { length: 0 })
                .init(&device)
                .is_err()
        );
        assert!(
            small_config(geometry)
                .with_dropout(1.5)
                .init(&device)
                .is_err()
        );
        let block = small_config(geometry).init(&device).unwrap();
        assert!(matches!(
            block.forward(random([2, 3, 12], &device)),
            Err(Error::WidthMismatch { .. })
        ));
        assert!(matches!(
            block.forward(random([2, 4, 11], &device)),
            Err(Error::WidthMismatch { .. })
        ));
    }
}
