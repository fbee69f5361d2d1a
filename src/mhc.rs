//! mHC: manifold-constrained hyper-connections (DeepSeek, arXiv 2512.24880, eqs. 14–19, as
//! NVIDIA Megatron-LM computes them; MATH §5.2).
//!
//! `n` streams of width `C` per token, `S` (`n × C`), flattened stream-major into `x = vec(S)`.
//! Block `j` has `φ` (`nC × (n²+2n)`), scalars `α_pre, α_post, α_res` and a bias `b`; `ε = 1e-6`:
//!
//! ```text
//! r      = 1 / (‖x‖₂ / √(nC) + ε)
//! H~     = r · (x φ) ⊙ [α_pre (n times), α_post (n times), α_res (n² times)] + b
//! H_pre  = σ(H~[0:n]) + ε          H_post = 2 σ(H~[n:2n])
//! H_res  = SK(H~[2n:] as n × n)     (row-major: H_res[i][k] = H~[2n + i·n + k])
//! u      = Σ_k H_pre[k] S_k,   h = f_j(u)
//! S'_i   = Σ_k H_res[k][i] S_k + H_post[i] h
//! y      = (1/n) Σ_k S_k            (option: the sum)
//! ```
//!
//! `SK` is Sinkhorn-Knopp ([`sinkhorn_knopp`]): a row softmax, then alternating column and row
//! normalisations, differentiated through; `H_res` is (close to) doubly stochastic, so the
//! residual mixing neither amplifies nor attenuates the streams on average.
//!
//! **Decision (init, MATH §5.2)**: `φ ~ N(0, σ = 1e-4)` ([`MhcConfig::phi_std`]), `α_* = 0.01`,
//! `b_pre = −ln(n−1)` (`H_pre = 1/n`; 0 when `n = 1`, i.e. `H_pre = ½`), `b_post = 0`
//! (`H_post = 1`), `b_res = 5 (I − 1)` (`H_res ≈ I`): the stack starts within ~1e-2 of ResNet.
//!
//! The streams start as copies of `x`, and a doubly stochastic `H_res` maps equal streams to
//! themselves: at init `b_res` gets almost no gradient (~1e-9 against ~1 for `b_post` in a
//! 3-block stack) until `H_post` and the token-dependent terms make the streams differ.
//!
//! **The matrix `C`.** The connections depend on the tokens. [`matrix`] reports the connections
//! of a token whose streams vanish (`x = 0`: `H~ = b`), the static part, through the recursion
//! of the streams; [`Mhc::connections`] gives the exact per-token connections of a batch.
//!
//! [`matrix`]: crate::Connectivity::matrix

use burn::module::Param;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::activation::{sigmoid, softmax};

use crate::backend::{Gains, LayerOps, MatrixRows, RowScale};
use crate::connectivity::ConnectivityConfig;
use crate::error::{Error, Result, check_depth, check_non_negative, check_size};
use crate::multi_stream::{
    Layout, Mixing, MixingLayer, MultiStream, MultiStreamState, StreamReduce,
};

/// The `ε` of mHC and of its Sinkhorn-Knopp normalisation.
pub const MHC_EPS: f64 = 1e-6;

/// Sinkhorn-Knopp over the last two axes of `logits` (any leading axes are a batch), as mHC
/// computes it:
///
/// ```text
/// M = softmax over each row of Z + ε
/// M = M / (column sums + ε)
/// iterations − 1 times:  M = M / (row sums + ε);  M = M / (column sums + ε)
/// ```
///
/// The result is a (nearly) doubly stochastic matrix: exactly column-stochastic up to `ε`, rows
/// closer to 1 with every iteration. Differentiable (the gradient flows through every
/// iteration). f16 and bf16 logits are normalised in f32 and the result rounded once to their
/// type (in f16 the divisions' gradients overflow where a column is nearly empty).
///
/// # Errors
/// [`Error::OutOfRange`] for zero iterations, [`Error::ShapeMismatch`] unless `D >= 2` and the
/// last two axes are square.
pub fn sinkhorn_knopp<const D: usize>(logits: Tensor<D>, iterations: usize) -> Result<Tensor<D>> {
    check_size("Sinkhorn-Knopp iterations", iterations)?;
    let dims = logits.dims();
    if D < 2 || dims[D - 1] != dims[D - 2] {
        let found = dims.to_vec();
        let mut expected = found.clone();
        if let Some(last) = expected.last_mut() {
            *last = dims[D.saturating_sub(2)];
        }
        return Err(Error::ShapeMismatch {
            name: "Sinkhorn-Knopp logits (square in the last two axes)".into(),
            expected,
            found,
        });
    }
    Ok(sinkhorn_unchecked(logits, iterations))
}

pub(crate) fn sinkhorn_unchecked<const D: usize>(
    logits: Tensor<D>,
    iterations: usize,
) -> Tensor<D> {
    // In f32 for half types, the fused op's too: in f16 the divisions' gradients overflow where
    // a column is nearly empty (see `exact_float`).
    let dtype = logits.dtype();
    let exact = crate::backend::exact_float(dtype);
    if exact != dtype.into() {
        return sinkhorn_unchecked(logits.cast(exact), iterations).cast(dtype);
    }
    // CubeCL and Flex devices: every iteration in one op (and one for the backward).
    #[cfg(any(feature = "cube-kernels", feature = "flex"))]
    if crate::backend::has_fused_sinkhorn(&logits) {
        let dims = logits.dims();
        let n = dims[D - 1];
        let flat = logits.reshape([dims.iter().product::<usize>() / (n * n), n * n]);
        return crate::backend::sinkhorn::fused_sinkhorn(flat, n, iterations, MHC_EPS)
            .reshape(dims);
    }
    sinkhorn_composed(logits, iterations)
}

/// Sinkhorn-Knopp from tensor operations (what autodiff differentiates on non-CubeCL backends).
pub(crate) fn sinkhorn_composed<const D: usize>(logits: Tensor<D>, iterations: usize) -> Tensor<D> {
    let dims = logits.dims();
    let n = dims[D - 1];
    let batch = logits.shape().num_elements() / (n * n);
    let device = logits.device();
    // Row and column sums, each repeated over its row or column, as one small product of the
    // flattened matrices `[batch, n²] @ [n², n²]`: no broadcast division (a slow strided path on
    // CPU backends, ~10× an elementwise op at mHC's sizes) and a single op per sum.
    let sums = |same: fn(usize, usize, usize) -> bool| {
        let values: Vec<f32> = (0..n * n * n * n)
            .map(|k| f32::from(u8::from(same(k / (n * n), k % (n * n), n))))
            .collect();
        Tensor::<2>::from_data(
            TensorData::new(values, [n * n, n * n]),
            (&device, logits.dtype()),
        )
    };
    let row_sums = sums(|a, b, n| a / n == b / n);
    let column_sums = sums(|a, b, n| a % n == b % n);
    let normalise = |matrix: Tensor<2>, sums: &Tensor<2>| {
        matrix.clone() / matrix.matmul(sums.clone()).add_scalar(MHC_EPS)
    };
    let rows = softmax(logits.reshape([batch, n, n]), 2)
        .add_scalar(MHC_EPS)
        .reshape([batch, n * n]);
    let mut matrix = normalise(rows, &column_sums);
    for _ in 1..iterations {
        matrix = normalise(normalise(matrix, &row_sums), &column_sums);
    }
    matrix.reshape(dims)
}

/// Configuration of [`Mhc`].
#[derive(Config, Debug)]
pub struct MhcConfig {
    /// The width `C` of the stack's streams (the last axis).
    pub width: usize,
    /// Number of streams `n`.
    #[config(default = 4)]
    pub streams: usize,
    /// Sinkhorn-Knopp iterations (Megatron-LM's default: 20).
    #[config(default = 20)]
    pub sinkhorn_iterations: usize,
    /// Standard deviation of the initial `φ`.
    #[config(default = 1e-4)]
    pub phi_std: f64,
    /// Initial `α_pre`, `α_post`, `α_res`.
    #[config(default = 0.01)]
    pub alpha_init: f64,
    /// How the streams make the output: their mean (default) or their sum.
    #[config(default = "StreamReduce::Mean")]
    pub reduce: StreamReduce,
}

impl ConnectivityConfig for MhcConfig {
    type Connectivity = Mhc;

    fn init(&self, num_blocks: usize, device: &Device) -> Result<Mhc> {
        if num_blocks == 0 {
            return Err(Error::NoBlocks);
        }
        check_size("mHC streams", self.streams)?;
        check_size("mHC width", self.width)?;
        check_size("Sinkhorn-Knopp iterations", self.sinkhorn_iterations)?;
        check_non_negative("mHC phi std", self.phi_std)?;
        crate::error::check_finite("mHC alpha init", self.alpha_init)?;
        let layers = (0..num_blocks)
            .map(|_| MhcLayer::new(self, device))
            .collect();
        Ok(Mhc {
            layers,
            width: self.width,
            streams: self.streams,
            sinkhorn_iterations: self.sinkhorn_iterations,
            reduce: self.reduce,
        })
    }
}

/// The parameters of one mHC block (record names as in the golden file).
#[derive(Module, Debug)]
pub struct MhcLayer {
    /// `φ`, `[nC, n² + 2n]`.
    pub phi: Param<Tensor<2>>,
    /// `α_pre`, `[1]`.
    pub alpha_pre: Param<Tensor<1>>,
    /// `α_post`, `[1]`.
    pub alpha_post: Param<Tensor<1>>,
    /// `α_res`, `[1]`.
    pub alpha_res: Param<Tensor<1>>,
    /// `b = [b_pre, b_post, b_res]`, `[n² + 2n]`.
    pub bias: Param<Tensor<1>>,
}

/// The connections of one mHC block for a batch of tokens.
#[derive(Debug, Clone)]
pub struct MhcConnections {
    /// `H_pre`, `[tokens, n]`.
    pub pre: Tensor<2>,
    /// `H_post`, `[tokens, n]`.
    pub post: Tensor<2>,
    /// `H_res`, `[tokens, n, n]` (entry `[k][i]`: weight of stream `k` in the new stream `i`).
    pub res: Tensor<3>,
}

impl MhcLayer {
    fn new(config: &MhcConfig, device: &Device) -> Self {
        let n = config.streams;
        let phi = Tensor::random(
            [n * config.width, n * n + 2 * n],
            Distribution::Normal(0.0, config.phi_std),
            device,
        );
        let residual = (0..n * n).map(|k| if k / n == k % n { 0.0 } else { -5.0 });
        Self::from_parts(phi, config.alpha_init, n, residual, device)
    }

    /// A layer with `φ` (`[nC, 2n + R]`), every `α` at `alpha_init`, and the bias
    /// `[b_pre, b_post, residual]` with the gates at mHC's init (`b_pre = −ln(n−1)`, i.e.
    /// `H_pre = 1/n`, 0 when `n = 1`; `b_post = 0`, i.e. `H_post = 1`) and `R` residual logits.
    pub(crate) fn from_parts(
        phi: Tensor<2>,
        alpha_init: f64,
        streams: usize,
        residual: impl Iterator<Item = f64>,
        device: &Device,
    ) -> Self {
        let n = streams;
        let pre = if n > 1 { -((n - 1) as f64).ln() } else { 0.0 };
        let mut bias = vec![pre; n];
        bias.extend(std::iter::repeat_n(0.0, n));
        bias.extend(residual);
        let outputs = bias.len();
        let alpha = || Param::from_tensor(Tensor::full([1], alpha_init, device));
        Self {
            phi: Param::from_tensor(phi),
            alpha_pre: alpha(),
            alpha_post: alpha(),
            alpha_res: alpha(),
            bias: Param::from_tensor(Tensor::from_data(TensorData::new(bias, [outputs]), device)),
        }
    }

    /// `H_pre`, `H_post` and the residual logits `H~[2n:]` (`[tokens, R]`) for the streams
    /// `[tokens, n, C]`, the projection taken with the pass's `ops`.
    pub(crate) fn gates(
        &self,
        streams: &Tensor<3>,
        ops: &LayerOps,
    ) -> (Tensor<2>, Tensor<2>, Tensor<2>) {
        let [tokens, n, width] = streams.dims();
        let residual = self.bias.dims()[0] - 2 * n;
        let flat = streams.clone().reshape([tokens, n * width]);
        let scale = Tensor::cat(
            vec![
                self.alpha_pre.val().expand([n]),
                self.alpha_post.val().expand([n]),
                self.alpha_res.val().expand([residual]),
            ],
            0,
        )
        .unsqueeze::<2>();
        let mixed = ops.normed_projection(flat, self.phi.val(), norm_scale(n * width)) * scale
            + self.bias.val().unsqueeze::<2>();
        let pre = sigmoid(mixed.clone().narrow(1, 0, n)).add_scalar(MHC_EPS);
        let post = sigmoid(mixed.clone().narrow(1, n, n)).mul_scalar(2.0);
        (pre, post, mixed.narrow(1, 2 * n, residual))
    }

    /// On CubeCL devices, the layer's `[H_pre; H_resᵀ; H_post]` as one connection table made by
    /// one kernel (`None` where the pass composes them): `H_res` by Sinkhorn-Knopp
    /// (`iterations`), or the softmax mixture of the matrices `mixture` gives (`[m, n²]`,
    /// mHC-lite's permutations).
    #[cfg(feature = "cube-kernels")]
    pub(crate) fn table_mixing(
        &self,
        units: &Tensor<3>,
        ops: &LayerOps,
        iterations: usize,
        mixture: impl FnOnce() -> Option<Tensor<2>>,
    ) -> Option<Mixing> {
        let (table, input, slot) = ops.table(|| {
            let [_, n, width] = units.dims();
            crate::backend::Normalised {
                units: units.clone(),
                weights: self.phi.val(),
                scales: [
                    self.alpha_pre.val(),
                    self.alpha_post.val(),
                    self.alpha_res.val(),
                ],
                bias: self.bias.val(),
                streams: n,
                input_offset: MHC_EPS,
                depth_factor: 2.0,
                sinkhorn_iterations: iterations,
                sinkhorn_epsilon: MHC_EPS,
                mixture: mixture(),
                row_scale: norm_scale(n * width),
            }
        })?;
        Some(Mixing::table(table, input, 1, slot))
    }

    /// The gradients of `φ`, the three `α` and `b`, in that order (for tests).
    #[cfg(all(test, feature = "wgpu"))]
    pub(crate) fn gradient_data(
        &self,
        grads: &burn::tensor::Gradients,
    ) -> Vec<burn::tensor::TensorData> {
        use crate::test_util::gradient_data;
        vec![
            gradient_data(&self.phi, grads),
            gradient_data(&self.alpha_pre, grads),
            gradient_data(&self.alpha_post, grads),
            gradient_data(&self.alpha_res, grads),
            gradient_data(&self.bias, grads),
        ]
    }

    /// `H_pre`, `H_post`, `H_res` for the streams `[tokens, n, C]`.
    pub fn connections(&self, streams: &Tensor<3>, iterations: usize) -> MhcConnections {
        self.connections_with(streams, iterations, &LayerOps::standalone(streams))
    }

    /// [`connections`](Self::connections), with the streams' gradient slot for the projection.
    fn connections_with(
        &self,
        streams: &Tensor<3>,
        iterations: usize,
        ops: &LayerOps,
    ) -> MhcConnections {
        let [tokens, n, _] = streams.dims();
        let (pre, post, logits) = self.gates(streams, ops);
        let res = sinkhorn_unchecked(logits.reshape([tokens, n, n]), iterations);
        MhcConnections { pre, post, res }
    }
}

/// `1 / (‖x‖/√N + ε) = √N / (‖x‖ + ε√N)` for rows of `N` entries.
fn norm_scale(entries: usize) -> RowScale {
    let root = (entries as f64).sqrt();
    RowScale {
        numerator: root,
        offset: MHC_EPS * root,
        floor: 0.0,
        root_offset: 0.0,
    }
}

/// `H_pre` as the view row, `H_resᵀ` as the residual rows, `H_post` as `β`.
pub(crate) fn mixing(
    pre: Tensor<2>,
    post: Tensor<2>,
    res: Tensor<3>,
    tokens: usize,
    n: usize,
) -> Mixing {
    Mixing {
        input: MatrixRows::all(pre.reshape([tokens, 1, n])),
        made_input: None,
        residual: MatrixRows::all(res.swap_dims(1, 2)),
        beta: Gains::Own(post.reshape([tokens, n, 1])),
        slot: 0,
    }
}

/// The mixing of one [`MhcLayer`], with the connectivity's iteration count.
#[doc(hidden)]
pub struct MhcMixing<'a> {
    layer: &'a MhcLayer,
    iterations: usize,
}

impl MixingLayer for MhcMixing<'_> {
    fn mixing(&self, units: &Tensor<3>, ops: &LayerOps) -> Mixing {
        #[cfg(feature = "cube-kernels")]
        if let Some(mixing) = self
            .layer
            .table_mixing(units, ops, self.iterations, || None)
        {
            return mixing;
        }
        let [tokens, n, _] = units.dims();
        let MhcConnections { pre, post, res } =
            self.layer.connections_with(units, self.iterations, ops);
        mixing(pre, post, res, tokens, n)
    }
}

/// Manifold-constrained hyper-connections (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct Mhc {
    /// The parameters of every block.
    pub layers: Vec<MhcLayer>,
    /// The stream width `C`.
    pub width: usize,
    /// The number of streams `n`.
    pub streams: usize,
    /// Sinkhorn-Knopp iterations.
    pub sinkhorn_iterations: usize,
    /// How the streams make the output.
    #[module(skip)]
    pub reduce: StreamReduce,
}

/// How far residual mixing matrices are from the identity and from doubly stochastic.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResidualMixingHealth {
    /// Largest `|H_res[k][i] − δ_ki|`.
    pub distance_from_identity: f64,
    /// Largest `|Σ_k H_res[k][i] − 1|` or `|Σ_i H_res[k][i] − 1|`.
    pub distance_from_doubly_stochastic: f64,
}

impl ResidualMixingHealth {
    /// Over a batch of matrices `[tokens, n, n]` (the largest distance of any of them).
    pub fn of(res: Tensor<3>) -> Self {
        let [_, n, _] = res.dims();
        let device = res.device();
        let identity = Tensor::<2>::eye(n, &device).unsqueeze::<3>();
        let largest = |tensor: Tensor<3>| tensor.abs().max().into_scalar::<f64>();
        let rows = res.clone().sum_dim(2).sub_scalar(1.0);
        let columns = res.clone().sum_dim(1).sub_scalar(1.0);
        Self {
            distance_from_identity: largest(res - identity),
            distance_from_doubly_stochastic: largest(rows).max(largest(columns)),
        }
    }
}

impl Mhc {
    fn layout(&self) -> Layout {
        Layout {
            streams: self.streams,
            fractions: 1,
        }
    }

    fn mixing(&self, block: usize) -> Option<MhcMixing<'_>> {
        self.layers.get(block).map(|layer| MhcMixing {
            layer,
            iterations: self.sinkhorn_iterations,
        })
    }

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
        Ok(self.layers[block].connections(&state.units, self.sinkhorn_iterations))
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
            .map(|layer| layer.connections(&zero, self.sinkhorn_iterations))
            .collect()
    }

    /// Per block, the health of the static residual mixing `SK(b_res)`.
    pub fn residual_health(&self) -> Vec<ResidualMixingHealth> {
        self.static_connections()
            .into_iter()
            .map(|connections| ResidualMixingHealth::of(connections.res))
            .collect()
    }
}

impl MultiStream for Mhc {
    const NAME: &'static str = "mHC";

    type Layer<'a> = MhcMixing<'a>;

    fn stream_width(&self) -> usize {
        self.width
    }

    fn layout(&self) -> Layout {
        Mhc::layout(self)
    }

    fn reduce(&self) -> StreamReduce {
        self.reduce
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn mixing(&self, block: usize) -> Option<MhcMixing<'_>> {
        Mhc::mixing(self, block)
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
    use burn::tensor::{Distribution, Tolerance};

    use super::*;
    use crate::Connectivity;
    use crate::stack::Stack;
    use crate::test_util::{
        OnDevice, WIDTH, assert_checkpointing_keeps_gradients, assert_close, blocks, gradient,
        input, input_gradient, residual_loop,
    };

    /// Sinkhorn-Knopp in f16 and bf16 runs in f32 (on Flex the fused op): for peaked logits
    /// (std 8: most rows of the softmax nearly one-hot, so that some columns are nearly empty)
    /// its values and gradients come within 16 of the type's unit roundoffs of the f32 ones
    /// (relative to each result's largest entry). In f16 itself (the composed form on Flex)
    /// the divisions' gradients (`−∂y·a/b²`, `b` a column's sum near ε) overflowed, and
    /// DeepSeek-V4's every gradient before its last block was infinite.
    #[test]
    fn sinkhorn_in_half_precision_runs_in_f32() {
        use crate::test_util::errors_in_float_type;
        use burn::tensor::DType;
        let device = Device::flex().autodiff();
        let (batch, n) = (64, 4);
        let logits = Tensor::<3>::random([batch, n, n], Distribution::Normal(0.0, 8.0), &device);
        let weights = Tensor::<3>::random([batch, n, n], Distribution::Normal(0.0, 1.0), &device);
        let normalised = |x: Vec<Tensor<3>>| sinkhorn_unchecked(x[0].clone(), 20);
        for (dtype, roundoff) in [(DType::F16, 2f32.powi(-11)), (DType::BF16, 2f32.powi(-8))] {
            let case = format!("Sinkhorn-Knopp in {dtype:?}");
            let inputs = [logits.clone()];
            let errors = errors_in_float_type(dtype, &inputs, &weights, normalised, &case);
            for (name, error) in ["M", "∂L"].iter().zip(errors) {
                assert!(
                    error <= 16.0 * roundoff,
                    "{case}, {name}: {error:e} of its scale"
                );
            }
        }
    }

    /// The connection-table kernel (one kernel forward with Sinkhorn-Knopp inside, three
    /// backward) against the composed connections on wgpu, values and every gradient: several
    /// stream counts, iteration counts and widths.
    #[cfg(feature = "wgpu")]
    #[test]
    fn connection_table_kernels_match_the_composed_connections() {
        use crate::test_util::{Perturbed, assert_table_kernels_match_composed, wgpu_autodiff};
        let device = wgpu_autodiff();
        for (streams, iterations, tokens, width) in
            [(4, 20, 37, 24), (2, 3, 5, 300), (1, 1, 9, 8), (8, 7, 4, 16)]
        {
            let mhc = MhcConfig::new(width)
                .with_streams(streams)
                .with_sinkhorn_iterations(iterations)
                .init(1, &device)
                .expect("valid config")
                .map(&mut Perturbed::new(0.3));
            let layer = &mhc.layers[0];
            assert_table_kernels_match_composed(
                &mhc,
                [tokens, streams, width],
                1.0,
                |grads| layer.gradient_data(grads),
                &format!("n={streams} T={iterations} tokens={tokens} C={width}"),
            );
        }
    }

    /// Past one launch axis (65535 cubes on wgpu), every value and gradient equal to the
    /// composed form's (on Flex): 270000 tokens at 32 units a row, 4 rows a cube of the row
    /// kernels (67500 cubes); and rows of 786432 entries, whose `∂Φ` (24 columns) the finishing
    /// kernel writes one entry a unit (73728 cubes of 256). Those rows too at 32 units a row:
    /// at 8 a unit's loops over a row run 98304 times, past lavapipe's 65535 iterations of an
    /// invocation in all, and it leaves the rest of the row's `∂x` unwritten, silently.
    #[cfg(feature = "wgpu")]
    #[test]
    fn connection_table_kernels_past_one_launch_axis() {
        use crate::backend::Knobs;
        use crate::test_util::{Perturbed, assert_table_kernels_match_flex};
        let many_rows = Knobs {
            row_group: 32,
            ..Knobs::default()
        };
        // Rows of 786432 entries: their sums' f32 rounding reached 1.1e-4 of a result's largest
        // entry in one process (the bound elsewhere); an unwritten entry is off by O(1).
        for (streams, tokens, width, bound) in [(2, 270_000, 4, 1e-4), (4, 2, 196_608, 1e-3)] {
            let mhc = MhcConfig::new(width)
                .with_streams(streams)
                .init(1, &Device::flex().autodiff())
                .expect("valid config")
                .map(&mut Perturbed::new(0.3));
            assert_table_kernels_match_flex(
                &mhc,
                [tokens, streams, width],
                1.0,
                many_rows,
                |mhc, grads| mhc.layers[0].gradient_data(grads),
                &format!("n={streams} tokens={tokens} C={width}"),
                bound,
            );
        }
    }

    /// In f16 the table's kernels keep each token's norm, not its sum of squares: for tokens of
    /// 4 × 1024 entries of RMS 5 (`‖x‖² ≈ 1.0e5`, past f16's largest, 65504) the table, the
    /// layer and every gradient come within 5e-2 of the f32 composed form's, relative to each
    /// result's largest entry (most within 2e-3; the scalars' gradients, sums over three tokens
    /// that cancel, to 1.4e-2). With `‖x‖²` cast to f16 before its root, as the kernels did,
    /// the norm was infinite, the scale 0, and the errors 0.24 to 1.
    #[cfg(feature = "wgpu")]
    #[test]
    fn half_precision_tables_keep_norms_whose_squares_f16_overflows() {
        use crate::backend::UnitOps;
        use crate::test_util::{
            OnDeviceAs, Perturbed, fixed_normal, scaled_errors, table_results, wgpu_autodiff,
        };
        use burn::tensor::FloatDType;
        let (streams, tokens, width) = (4, 3, 1024);
        let flex = Device::flex().autodiff();
        let mhc = MhcConfig::new(width)
            .with_streams(streams)
            .init(1, &flex)
            .expect("valid config")
            .map(&mut Perturbed::new(0.3));
        let units = fixed_normal([tokens, streams, width], 5.0, 7, &flex);
        let exact = table_results(&mhc, &units, LayerOps::composed, |grads| {
            mhc.layers[0].gradient_data(grads)
        });
        let wgpu = wgpu_autodiff();
        let half = mhc.map(&mut OnDeviceAs(wgpu.clone(), FloatDType::F16));
        let units = Tensor::<3>::from_data(units.to_data(), &wgpu).cast(FloatDType::F16);
        let results = table_results(
            &half,
            &units,
            || UnitOps::Kernels.layer(),
            |grads| half.layers[0].gradient_data(grads),
        );
        let errors = scaled_errors(&results, &exact, "mHC table in f16");
        eprintln!("mHC table in f16, RMS 5: errors {errors:?}");
        for (index, error) in errors.iter().enumerate() {
            assert!(*error <= 5e-2, "result {index}: {error:e} of its scale");
        }
    }

    /// The fused op against the composed operations on the same device, forward and gradient,
    /// for several sizes, iteration counts and logit scales; zero iterations (which the configs
    /// refuse, but a public field or `MhcLayer::connections` can pass) run one in both.
    #[cfg(any(feature = "cube-kernels", feature = "flex"))]
    fn fused_matches_composed(device: &Device) {
        assert_eq!(MHC_EPS, 1e-6);
        let device = device.clone().autodiff();
        let cases = [
            (4, 20, 37, 1.0),
            (3, 1, 5, 3.0),
            (2, 7, 300, 0.1),
            (3, 0, 4, 1.0),
        ];
        for (n, iterations, batch, scale) in cases {
            let logits =
                Tensor::<2>::random([batch, n * n], Distribution::Normal(0.0, scale), &device);
            let weights =
                Tensor::<2>::random([batch, n * n], Distribution::Normal(0.0, 1.0), &device);
            let run = |fused: bool| {
                let leaf = logits.clone().detach().require_grad();
                let output = if fused {
                    crate::backend::sinkhorn::fused_sinkhorn(leaf.clone(), n, iterations, MHC_EPS)
                } else {
                    sinkhorn_composed(leaf.clone().reshape([batch, n, n]), iterations)
                        .reshape([batch, n * n])
                };
                let grads = (output.clone() * weights.clone()).sum().backward();
                (output, leaf.grad(&grads).unwrap())
            };
            let (fused, fused_grad) = run(true);
            let (composed, composed_grad) = run(false);
            let tolerance = burn::tensor::Tolerance::absolute(2e-5).set_relative(1e-4);
            fused
                .into_data()
                .assert_approx_eq::<f32>(&composed.into_data(), tolerance);
            fused_grad
                .into_data()
                .assert_approx_eq::<f32>(&composed_grad.into_data(), tolerance);
        }
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn fused_sinkhorn_kernel_matches_the_composed_operations() {
        fused_matches_composed(&crate::device::device("wgpu").unwrap());
    }

    #[cfg(feature = "flex")]
    #[test]
    fn fused_sinkhorn_flex_op_matches_the_composed_operations() {
        fused_matches_composed(&Device::flex());
    }

    #[test]
    fn sinkhorn_knopp_converges_to_doubly_stochastic() {
        let device = Device::flex();
        // A fixed draw: about one draw in 400 of this spread holds a matrix too ill-conditioned
        // to converge in 200 iterations, or a column too light to be normalised to 1e-4 in one.
        let logits = crate::test_util::fixed_normal([5, 4, 4], 2.0, 7, &device);
        let health = |iterations| {
            ResidualMixingHealth::of(sinkhorn_knopp(logits.clone(), iterations).unwrap())
        };
        let (one, twenty, many) = (health(1), health(20), health(200));
        assert!(many.distance_from_doubly_stochastic < 1e-4, "{many:?}");
        assert!(twenty.distance_from_doubly_stochastic < one.distance_from_doubly_stochastic);
        // Columns are normalised last: exact up to ε after any number of iterations.
        let columns = sinkhorn_knopp(logits.clone(), 1)
            .unwrap()
            .sum_dim(1)
            .sub_scalar(1.0)
            .abs()
            .max();
        assert!(columns.into_scalar::<f64>() < 1e-4);
        // A row softmax of a diagonal-dominant matrix is close to the identity.
        let identity = Tensor::<2>::eye(3, &device).mul_scalar(30.0);
        let near = ResidualMixingHealth::of(sinkhorn_knopp(identity.unsqueeze(), 20).unwrap());
        assert!(near.distance_from_identity < 1e-5, "{near:?}");
    }

    #[test]
    fn sinkhorn_knopp_rejects_bad_input() {
        let device = Device::flex();
        let square = Tensor::<2>::zeros([3, 3], &device);
        assert!(matches!(
            sinkhorn_knopp(square, 0),
            Err(Error::OutOfRange { .. })
        ));
        let wide = Tensor::<2>::zeros([3, 4], &device);
        assert!(matches!(
            sinkhorn_knopp(wide, 5),
            Err(Error::ShapeMismatch { .. })
        ));
        let vector = Tensor::<1>::zeros([3], &device);
        assert!(matches!(
            sinkhorn_knopp(vector, 5),
            Err(Error::ShapeMismatch { .. })
        ));
    }

    #[test]
    fn init_is_within_a_hundredth_of_resnet() {
        let device = Device::flex();
        let stack = Stack::new(blocks(6, &device), &MhcConfig::new(WIDTH), &device).unwrap();
        let x = input(&device);
        let expected = residual_loop(&stack.blocks, x.clone());
        stack
            .forward(x)
            .into_data()
            .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-2));
        let matrix = stack.matrix();
        for (i, row) in matrix.matrix.iter().enumerate() {
            for (j, value) in row.iter().enumerate() {
                let resnet = f64::from(u8::from(i < j));
                assert!((value - resnet).abs() < 1e-2, "C[{i}][{j}] = {value}");
            }
        }
        for health in stack.connectivity.residual_health() {
            assert!(health.distance_from_identity < 0.05, "{health:?}");
            assert!(health.distance_from_doubly_stochastic < 1e-3, "{health:?}");
        }
    }

    #[test]
    fn connections_are_positive_and_doubly_stochastic() {
        let device = Device::flex();
        let config = MhcConfig::new(WIDTH).with_phi_std(0.5).with_alpha_init(1.0);
        let stack = Stack::new(blocks(3, &device), &config, &device).unwrap();
        let state = stack.run(input(&device), 2, &()).unwrap();
        let connections = stack.connectivity.connections(2, &state).unwrap();
        assert_eq!(connections.res.dims(), [6, 4, 4]);
        assert!(connections.pre.clone().min().into_scalar::<f64>() > 0.0);
        let post = connections.post.clone();
        assert!(
            post.clone().min().into_scalar::<f64>() > 0.0 && post.max().into_scalar::<f64>() < 2.0
        );
        // Columns are exact; rows are within what 20 iterations reach from logits this large.
        let columns = connections
            .res
            .clone()
            .sum_dim(1)
            .sub_scalar(1.0)
            .abs()
            .max();
        assert!(columns.into_scalar::<f64>() < 1e-4);
        let health = ResidualMixingHealth::of(connections.res);
        assert!(health.distance_from_doubly_stochastic < 0.1, "{health:?}");
        assert!(stack.connectivity.connections(3, &state).is_err());
    }

    #[test]
    fn truncation_reproduces_the_readout() {
        let device = Device::flex();
        let config = MhcConfig::new(WIDTH)
            .with_phi_std(0.5)
            .with_alpha_init(1.0)
            .with_streams(3);
        let stack = Stack::new(blocks(4, &device), &config, &device).unwrap();
        let x = input(&device);
        let readout = stack.readout(x.clone());
        assert_close(readout[0].clone(), x.clone());
        for (depth, expected) in readout.iter().enumerate().skip(1) {
            assert_close(
                stack.truncated(depth).unwrap().forward(x.clone()),
                expected.clone(),
            );
        }
    }

    #[test]
    fn invalid_configs_are_errors() {
        let device = Device::flex();
        let init = |config: MhcConfig| config.init(3, &device).map(|_| ());
        assert!(matches!(
            init(MhcConfig::new(WIDTH).with_streams(0)),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            init(MhcConfig::new(0)),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            init(MhcConfig::new(WIDTH).with_sinkhorn_iterations(0)),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            init(MhcConfig::new(WIDTH).with_phi_std(f64::NAN)),
            Err(Error::NonFinite { .. })
        ));
        assert!(matches!(
            init(MhcConfig::new(WIDTH).with_alpha_init(f64::INFINITY)),
            Err(Error::NonFinite { .. })
        ));
        assert!(matches!(
            MhcConfig::new(WIDTH).init(0, &device),
            Err(Error::NoBlocks)
        ));
        let mhc = MhcConfig::new(WIDTH).init(2, &device).unwrap();
        assert!(matches!(
            mhc.check_input(&[1, WIDTH - 1]),
            Err(Error::WidthMismatch { .. })
        ));
    }

    /// Whole HC and mHC stacks (their streams' gradients through the shared slot on Flex) give
    /// the same gradients under Burn's gradient checkpointing as without it.
    #[test]
    fn gradient_checkpointing_gives_the_same_gradients() {
        use crate::HyperConnectionsConfig;

        let flex = Device::flex();
        let x = input(&flex);
        let hc = Stack::new(blocks(4, &flex), &HyperConnectionsConfig::new(WIDTH), &flex).unwrap();
        let mhc = MhcConfig::new(WIDTH).with_phi_std(0.1).with_alpha_init(0.5);
        let mhc = Stack::new(blocks(4, &flex), &mhc, &flex).unwrap();
        assert_checkpointing_keeps_gradients(|device| {
            let x = Tensor::<3>::from_data(x.to_data(), device).require_grad();
            let hc = hc.clone().map(&mut OnDevice(device.clone()));
            let mhc = mhc.clone().map(&mut OnDevice(device.clone()));
            let loss =
                hc.forward(x.clone()).powi_scalar(2).sum() + mhc.forward(x.clone()).tanh().sum();
            let grads = loss.backward();
            let mut all = vec![input_gradient(&x, &grads)];
            let hc_layers = hc.connectivity.layers.iter();
            all.extend(hc_layers.map(|layer| gradient(&layer.static_alpha, &grads)));
            let mhc_layers = mhc.connectivity.layers.iter();
            all.extend(mhc_layers.map(|layer| gradient(&layer.phi, &grads)));
            let blocks = hc.blocks.iter().chain(&mhc.blocks);
            all.extend(blocks.map(|block| gradient(&block.linear.weight, &grads)));
            all
        });
    }
}
