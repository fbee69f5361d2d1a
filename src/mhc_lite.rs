//! mHC-lite: manifold-constrained hyper-connections whose residual mixing is an exact convex
//! mix of permutation matrices (arXiv 2601.05732, as its code FFTYYY/mhc-lite computes it;
//! MATH §5.6).
//!
//! As [`Mhc`](crate::Mhc) (MATH §5.2), with `H_res` made from `n!` logits instead of
//! Sinkhorn-Knopp. Block `j` has `φ` (`nC × (2n + n!)`), scalars `α_pre, α_post, α_res` and a
//! bias `b`; `ε = 1e-6`; `P_1 … P_{n!}` are the permutation matrices of `n` streams in
//! lexicographic order (`P_1 = I`), `P_k[i][π_k(i)] = 1`:
//!
//! ```text
//! r      = 1 / (‖x‖₂ / √(nC) + ε)
//! H~     = r · (x φ) ⊙ [α_pre (n times), α_post (n times), α_res (n! times)] + b
//! H_pre  = σ(H~[0:n]) + ε          H_post = 2 σ(H~[n:2n])
//! a      = softmax(H~[2n:])         H_res = Σ_k a_k P_k
//! u      = Σ_k H_pre[k] S_k,   h = f_j(u)
//! S'_i   = Σ_k H_res[k][i] S_k + H_post[i] h
//! y      = (1/n) Σ_k S_k            (option: the sum)
//! ```
//!
//! `H_res` is doubly stochastic exactly (Birkhoff: a convex mix of permutations), where
//! Sinkhorn-Knopp's 20 iterations only approach it; the price is `n!` logits per token, so `n`
//! is at most [`MAX_STREAMS`] (720 permutations).
//!
//! **Decisions (MATH §5.6).** The official code normalises `x` with an RMSNorm of learnable
//! gain before the projection; a gain on the entries of `x` is a rescaling of the rows of `φ`,
//! so this crate keeps mHC's row scale without one (the same functions, one parameter vector
//! fewer) and shares mHC's fused projection and mixing. Init: `φ = 0` and `α_* = 0.01` as the
//! official code, `b_res = −8` except `0` for the identity (the official code's: `H_res` puts
//! 0.992 on the identity for `n = 4`), and `b_pre`, `b_post` as this crate's mHC (`H_pre = 1/n`,
//! `H_post = 1`) where the official code inherits hyper-connections' random-stream init.
//!
//! **The matrix `C`** is that of a token whose streams vanish (`H~ = b`), as for mHC.
//!
//! **Backends.** On Flex, mHC's fused projection and stream mixing; on CubeCL devices, mHC's
//! connection table with `H_res` the softmax mixture of the permutation matrices inside its
//! kernel (one kernel forward, three backward) and mHC's mixing kernels; tensor ops elsewhere.
//!
//! # Shapes
//! - input, block inputs and outputs: `[..., C]`; units `[T, n, C]`
//! - `layers[j].phi`: `[nC, 2n + n!]`, `bias`: `[2n + n!]`, `alpha_*`: `[1]`
//!
//! # Example
//! ```
//! use burn::prelude::*;
//! use burn_connectivity::{MhcLiteConfig, MlpBlockConfig, Stack};
//!
//! let device = Device::default();
//! let blocks = MlpBlockConfig::new(16, 32).init_stack(4, &device)?;
//! let stack = Stack::new(blocks, &MhcLiteConfig::new(16), &device)?;
//! let y = stack.forward(Tensor::<3>::ones([2, 5, 16], &device));
//! assert_eq!(y.dims(), [2, 5, 16]);
//! # Ok::<(), burn_connectivity::Error>(())
//! ```

use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::activation::softmax;

use crate::backend::LayerOps;
use crate::connectivity::ConnectivityConfig;
use crate::error::{Error, Result, check_depth, check_finite, check_non_negative, check_size};
use crate::mhc::{MhcConnections, MhcLayer, ResidualMixingHealth, mixing};
use crate::multi_stream::{
    Layout, Mixing, MixingLayer, MultiStream, MultiStreamState, StreamReduce,
};

/// The most streams mHC-lite enumerates the permutations of (`6! = 720`).
pub const MAX_STREAMS: usize = 6;

/// The static logit of every permutation but the identity (the official code's).
const OTHER_PERMUTATIONS: f64 = -8.0;

/// Configuration of [`MhcLite`].
#[derive(Config, Debug)]
pub struct MhcLiteConfig {
    /// The width `C` of the stack's streams (the last axis).
    pub width: usize,
    /// Number of streams `n` (at most [`MAX_STREAMS`]).
    #[config(default = 4)]
    pub streams: usize,
    /// Standard deviation of the initial `φ` (the official code: 0).
    #[config(default = 0.0)]
    pub phi_std: f64,
    /// Initial `α_pre`, `α_post`, `α_res`.
    #[config(default = 0.01)]
    pub alpha_init: f64,
    /// How the streams make the output: their mean (default) or their sum.
    #[config(default = "StreamReduce::Mean")]
    pub reduce: StreamReduce,
}

/// The permutations of `0..n` in lexicographic order (`itertools.permutations(range(n))`).
pub fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![Vec::new()];
    }
    (0..n)
        .flat_map(|first| {
            permutations(n - 1).into_iter().map(move |rest| {
                let mut permutation = vec![first];
                permutation.extend(rest.into_iter().map(|k| k + usize::from(k >= first)));
                permutation
            })
        })
        .collect()
}

/// `[n!, n²]` in the float type of `like`, on its device: row `k` is `P_k` flattened row-major
/// (`P_k[i][π_k(i)] = 1`).
fn permutation_matrices(n: usize, like: &Tensor<3>) -> Tensor<2> {
    let all = permutations(n);
    let mut values = vec![0.0f32; all.len() * n * n];
    for (k, permutation) in all.iter().enumerate() {
        for (i, &target) in permutation.iter().enumerate() {
            values[k * n * n + i * n + target] = 1.0;
        }
    }
    let values = TensorData::new(values, [all.len(), n * n]);
    Tensor::from_data(values, (&like.device(), like.dtype()))
}

impl ConnectivityConfig for MhcLiteConfig {
    type Connectivity = MhcLite;

    fn init(&self, num_blocks: usize, device: &Device) -> Result<MhcLite> {
        if num_blocks == 0 {
            return Err(Error::NoBlocks);
        }
        check_size("mHC-lite streams", self.streams)?;
        if self.streams > MAX_STREAMS {
            return Err(Error::OutOfRange {
                name: "mHC-lite streams",
                value: self.streams as f64,
                requirement: "<= 6 (n! permutations are enumerated: 720 at n = 6)",
            });
        }
        check_size("mHC-lite width", self.width)?;
        check_non_negative("mHC-lite phi_std", self.phi_std)?;
        check_finite("mHC-lite alpha_init", self.alpha_init)?;
        let layers = (0..num_blocks).map(|_| new_layer(self, device)).collect();
        Ok(MhcLite {
            layers,
            width: self.width,
            streams: self.streams,
            reduce: self.reduce,
        })
    }
}

/// A layer of mHC-lite: mHC's parameters (record names as in the golden file) with `n!`
/// residual logits, `φ` `[nC, 2n + n!]`.
fn new_layer(config: &MhcLiteConfig, device: &Device) -> MhcLayer {
    let n = config.streams;
    let count = permutations(n).len();
    let shape = [n * config.width, 2 * n + count];
    let phi = if config.phi_std > 0.0 {
        Tensor::random(shape, Distribution::Normal(0.0, config.phi_std), device)
    } else {
        Tensor::zeros(shape, device)
    };
    let residual = (0..count).map(|k| if k == 0 { 0.0 } else { OTHER_PERMUTATIONS });
    MhcLayer::from_parts(phi, config.alpha_init, n, residual, device)
}

/// `H_pre`, `H_post` and `H_res = Σ_k softmax(H~_res)_k P_k` of `layer` for the streams
/// `[tokens, n, C]`.
fn connections(layer: &MhcLayer, streams: &Tensor<3>, ops: &LayerOps) -> MhcConnections {
    let [tokens, n, _] = streams.dims();
    let (pre, post, logits) = layer.gates(streams, ops);
    let res = softmax(logits, 1)
        .matmul(permutation_matrices(n, streams))
        .reshape([tokens, n, n]);
    MhcConnections { pre, post, res }
}

/// The mixing of one mHC-lite layer.
#[doc(hidden)]
pub struct MhcLiteMixing<'a> {
    layer: &'a MhcLayer,
}

impl MixingLayer for MhcLiteMixing<'_> {
    fn mixing(&self, units: &Tensor<3>, ops: &LayerOps) -> Mixing {
        // On CubeCL devices: mHC's connection table, `H_res` the softmax mixture of the
        // permutation matrices inside its kernel.
        #[cfg(feature = "cube-kernels")]
        if let Some(mixing) = self.layer.table_mixing(units, ops, 0, || {
            let [_, n, _] = units.dims();
            Some(permutation_matrices(n, units))
        }) {
            return mixing;
        }
        let [tokens, n, _] = units.dims();
        let MhcConnections { pre, post, res } = connections(self.layer, units, ops);
        mixing(pre, post, res, tokens, n)
    }
}

/// mHC-lite (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct MhcLite {
    /// The parameters of every block (mHC's, with `n!` residual logits).
    pub layers: Vec<MhcLayer>,
    /// The stream width `C`.
    pub width: usize,
    /// The number of streams `n`.
    pub streams: usize,
    /// How the streams make the output.
    #[module(skip)]
    pub reduce: StreamReduce,
}

impl MhcLite {
    /// Block `block`'s connections for the streams of `state` (taken before that block).
    ///
    /// # Errors
    /// [`Error::DepthOutOfRange`] unless `block < num_blocks()`.
    pub fn connections<const D: usize>(
        &self,
        block: usize,
        state: &MultiStreamState<D>,
    ) -> Result<MhcConnections> {
        check_depth(block + 1, 1, self.layers.len())?;
        let units = &state.units;
        Ok(connections(
            &self.layers[block],
            units,
            &LayerOps::standalone(units),
        ))
    }

    /// The static part of every block's connections: those of a token whose streams vanish.
    pub fn static_connections(&self) -> Vec<MhcConnections> {
        let bias = self.layers[0].bias.val();
        let zero = Tensor::zeros(
            [1, self.streams, self.width],
            (&bias.device(), bias.dtype()),
        );
        self.layers
            .iter()
            .map(|layer| connections(layer, &zero, &LayerOps::standalone(&zero)))
            .collect()
    }

    /// Per block, the health of the static residual mixing (doubly stochastic up to rounding).
    pub fn residual_health(&self) -> Vec<ResidualMixingHealth> {
        self.static_connections()
            .into_iter()
            .map(|connections| ResidualMixingHealth::of(connections.res))
            .collect()
    }
}

impl MultiStream for MhcLite {
    const NAME: &'static str = "mHC-lite";

    type Layer<'a> = MhcLiteMixing<'a>;

    fn stream_width(&self) -> usize {
        self.width
    }

    fn layout(&self) -> Layout {
        Layout {
            streams: self.streams,
            fractions: 1,
        }
    }

    fn reduce(&self) -> StreamReduce {
        self.reduce
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn mixing(&self, block: usize) -> Option<MhcLiteMixing<'_>> {
        self.layers.get(block).map(|layer| MhcLiteMixing { layer })
    }

    fn first_layers(&self, depth: usize) -> Self {
        Self {
            layers: self.layers[..depth].to_vec(),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::module::Param;
    use burn::tensor::Tolerance;

    use super::*;
    use crate::mhc::MHC_EPS;
    use crate::stack::Stack;
    use crate::test_util::{WIDTH, assert_close, blocks, input, refused_setting, residual_loop};

    #[test]
    fn permutations_are_lexicographic_and_complete() {
        let three = permutations(3);
        assert_eq!(
            three,
            [
                [0, 1, 2],
                [0, 2, 1],
                [1, 0, 2],
                [1, 2, 0],
                [2, 0, 1],
                [2, 1, 0]
            ]
        );
        for n in 1..=MAX_STREAMS {
            let all = permutations(n);
            let count: usize = (1..=n).product();
            assert_eq!(all.len(), count);
            let mut sorted = all.clone();
            sorted.dedup();
            assert_eq!(sorted.len(), count, "distinct");
            assert_eq!(all[0], (0..n).collect::<Vec<_>>(), "the identity first");
        }
    }

    /// Rows and columns sum to 1 to rounding for any logits, and the connections are those of
    /// the equations: `H_res[k][i] = Σ_p a_p [π_p(k) = i]`.
    #[test]
    fn residual_mixing_is_exactly_doubly_stochastic() {
        let device = Device::flex();
        let config = MhcLiteConfig::new(WIDTH)
            .with_streams(3)
            .with_phi_std(0.5)
            .with_alpha_init(1.0);
        let mut stack = Stack::new(blocks(3, &device), &config, &device).unwrap();
        // Zero biases: the logits are the tokens' alone, far from the identity's −8 margin.
        for layer in &mut stack.connectivity.layers {
            layer.bias = Param::from_tensor(layer.bias.val().zeros_like());
        }
        let state = stack.run(input(&device), 2, &()).unwrap();
        let connections = stack.connectivity.connections(2, &state).unwrap();
        let health = ResidualMixingHealth::of(connections.res.clone());
        assert!(health.distance_from_doubly_stochastic < 1e-6, "{health:?}");
        assert!(health.distance_from_identity > 0.05, "the logits matter");
        // By hand for the first token.
        let layer = &stack.connectivity.layers[2];
        let [tokens, n, width] = state.units.dims();
        let flat: Vec<f64> = state.units.clone().into_data().iter::<f64>().collect();
        let row = &flat[..n * width];
        let norm = row.iter().map(|v| v * v).sum::<f64>().sqrt();
        let r = 1.0 / (norm / ((n * width) as f64).sqrt() + MHC_EPS);
        let phi: Vec<f64> = layer.phi.val().into_data().iter::<f64>().collect();
        let bias: Vec<f64> = layer.bias.val().into_data().iter::<f64>().collect();
        let alpha = layer.alpha_res.val().into_scalar::<f64>();
        let outputs = bias.len();
        let logits: Vec<f64> = (2 * n..outputs)
            .map(|c| {
                let product: f64 = (0..n * width).map(|e| row[e] * phi[e * outputs + c]).sum();
                r * product * alpha + bias[c]
            })
            .collect();
        let top = logits.iter().cloned().fold(f64::MIN, f64::max);
        let total: f64 = logits.iter().map(|l| (l - top).exp()).sum();
        let mut expected = vec![0.0; n * n];
        for (p, permutation) in permutations(n).iter().enumerate() {
            let a = (logits[p] - top).exp() / total;
            for (k, &i) in permutation.iter().enumerate() {
                expected[k * n + i] += a;
            }
        }
        let got: Vec<f64> = connections
            .res
            .narrow(0, 0, 1)
            .into_data()
            .iter::<f64>()
            .collect();
        assert!(tokens > 1);
        for (g, e) in got.iter().zip(&expected) {
            assert!((g - e).abs() < 1e-5, "{got:?} vs {expected:?}");
        }
    }

    #[test]
    fn init_is_within_a_hundredth_of_resnet() {
        let device = Device::flex();
        let stack = Stack::new(blocks(6, &device), &MhcLiteConfig::new(WIDTH), &device).unwrap();
        let x = input(&device);
        let expected = residual_loop(&stack.blocks, x.clone());
        stack
            .forward(x)
            .into_data()
            .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-2));
        for health in stack.connectivity.residual_health() {
            // 23 permutations at e⁻⁸ each: 0.994 on the diagonal, 0.002 off it.
            assert!(health.distance_from_identity < 0.01, "{health:?}");
            assert!(health.distance_from_doubly_stochastic < 1e-6, "{health:?}");
        }
    }

    #[test]
    fn truncation_reproduces_the_readout() {
        let device = Device::flex();
        let config = MhcLiteConfig::new(WIDTH)
            .with_phi_std(0.5)
            .with_alpha_init(1.0)
            .with_streams(3);
        let stack = Stack::new(blocks(4, &device), &config, &device).unwrap();
        let x = input(&device);
        let readout = stack.readout(x.clone());
        for (depth, expected) in readout.iter().enumerate().skip(1) {
            assert_close(
                stack.truncated(depth).unwrap().forward(x.clone()),
                expected.clone(),
            );
        }
    }

    /// mHC's connection-table kernels with `H_res` the softmax mixture of the permutation
    /// matrices against mHC-lite's composed connections on wgpu, values and every parameter's
    /// gradient: 2, 3 and 4 streams (2, 6 and 24 permutations), widths below and above the
    /// cube's units.
    #[cfg(feature = "wgpu")]
    #[test]
    fn connection_table_kernels_match_the_composed_connections() {
        use crate::test_util::{Perturbed, assert_table_kernels_match_composed, wgpu_autodiff};
        let device = wgpu_autodiff();
        for (streams, tokens, width) in [(4, 37, 24), (3, 5, 300), (2, 9, 8)] {
            // Zero init plus a fixed draw: the same weights in every run.
            let lite = MhcLiteConfig::new(width)
                .with_streams(streams)
                .with_phi_std(0.0)
                .init(1, &device)
                .expect("valid config")
                .map(&mut Perturbed::new(1.0));
            let layer = &lite.layers[0];
            assert_table_kernels_match_composed(
                &lite,
                [tokens, streams, width],
                1.0,
                |grads| layer.gradient_data(grads),
                &format!("mHC-lite n={streams} tokens={tokens} C={width}"),
            );
        }
    }

    #[test]
    fn bad_settings_are_typed_errors_naming_them() {
        let device = Device::flex();
        let name = |config: MhcLiteConfig| refused_setting(config, &device);
        assert_eq!(name(MhcLiteConfig::new(0)), "mHC-lite width");
        assert_eq!(
            name(MhcLiteConfig::new(8).with_streams(0)),
            "mHC-lite streams"
        );
        assert_eq!(
            name(MhcLiteConfig::new(8).with_streams(7)),
            "mHC-lite streams"
        );
        assert_eq!(
            name(MhcLiteConfig::new(8).with_phi_std(-1.0)),
            "mHC-lite phi_std"
        );
        assert_eq!(
            name(MhcLiteConfig::new(8).with_alpha_init(f64::NAN)),
            "mHC-lite alpha_init"
        );
        assert!(
            MhcLiteConfig::new(8)
                .with_streams(6)
                .init(1, &device)
                .is_ok()
        );
        assert!(matches!(
            MhcLiteConfig::new(8).init(0, &device),
            Err(Error::NoBlocks)
        ));
    }
}
