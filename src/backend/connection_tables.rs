//! The token-dependent connections of a multi-stream layer made in one kernel, as one table per
//! token, together with the block input they make, and their backward in three: for the CubeCL
//! backends (wgpu, vulkan, metal, cuda).
//!
//! A layer of `U` units per token mixes them with a table `[T, V + U + 1, U]` per token `t`:
//! rows `0..V` are `A_inᵀ` (they make the `V` views of the block input), rows `V..V+U` are
//! `A_resᵀ` (they make the next units), the last row is `βᵀ` (the gains of the block output).
//! Composed from tensor ops, the table costs a kernel or more per step of its equations forward
//! (norm, product, activations, scales, the static part, the Sinkhorn-Knopp, the layout), and
//! more backward (each broadcast parameter's gradient is a reduction of its own, each slice a
//! zero fill and a copy). Here it is one kernel forward, which also keeps each row's projection
//! and norm `√(‖x‖² + c)` (`K + 2` or `2n + r + 1` numbers a row, a constant to the graph; the
//! norm rather than its square, which f16 overflows at RMS 4 over 4096 entries), and which makes
//! the block input `A_inᵀ S` from the token's units in a second pass over them, its cube holding
//! the token's view rows (the mixing's kernel would read the units again, and cost a launch);
//! under autodiff the block input is recorded as that mixing, whose backward hands its gradient
//! to this one's ([`gradient_slots`](super::gradient_slots)).
//! Backward, one kernel takes every step back from the saved projection and norm (a pass over
//! the rows only for the block input's products, none for the projection), one makes partial
//! sums of the projection weights' gradient `xᵀ (s δ)` over chunks of rows, and one finishes:
//! it sums those chunks into the weights' gradients and the small parameters' gradients over the
//! tokens, one cube each.
//! (The backward used to project the rows again: for mHC at `n = 4` a `[T, 4C] × [4C, 24]`
//! product read from shared memory, as much work as the forward's.) The gated form's kernels take
//! one token's rows per cube forward (its block input needs them all) and one projected row per
//! cube backward; the normalised form's take several token rows per cube through
//! tiles of `Φ` in shared memory (`cube_launch::RowTiles`: each row would otherwise stream the
//! whole `Φ`, 24 times its own bytes at `n = 4`), one unit per row for the logits and
//! Sinkhorn-Knopp. That per-row work (logits, gates, Sinkhorn-Knopp or mHC-lite's softmax
//! mixture of permutations) runs in the summing type, f32 for f16 and bf16 tensors, from the
//! stored projection: in f16, 20 Sinkhorn-Knopp iterations or a mixture of 24 permutations lost
//! ten times the bits the composed tensor ops do.
//!
//! Two forms, with their constants passed in. The row scale is `s(n) = a / max(√(n² + c) + b, f)`
//! of the row norm `n = ‖x_r‖₂` (as in the normalised projection; `c = 0` in the gated form).
//!
//! **Gated** (rows are units: `R = T·U`, row `r = t·U + q`; `W [w, K]`, `K = V + U`, `v [w]`,
//! gain `γ [w]`, scalars `m_W`, `m_v`, static parts `A [U, K]`, `b [U]`; `act` is `tanh` or the
//! identity):
//!
//! ```text
//! p_r   = s(‖x_r‖) · x_r diag(1 + γ) [W | v]                 ([K + 1] per row)
//! table[t, c, q] = m_W · act(p_rc) + A[q, c]   (c < K)
//! table[t, K, q] = m_v · act(p_rK) + b[q]
//! u[t, v]        = Σ_q table[t, v, q] · x_{tU+q}   (v < V: the block input's views)
//! ```
//!
//! **Normalised** (rows are tokens: `R = T`, `x_t` the `n` units flattened; `Φ [N, 2n + r]`,
//! scalars `α_in`, `α_depth`, `α_res`, bias `c [2n + r]`; constants `ε_in`, `k`; the residual
//! part `H` from the last `r` logits, either Sinkhorn-Knopp (`r = n²`, its iterations and `ε`)
//! or a softmax mixture of `m` given matrices `M [m, n²]` (`r = m`)):
//!
//! ```text
//! z     = α_g · s(‖x_t‖) · x_t Φ + c       (α_g: α_in for the first n entries, α_depth for the
//!                                          next n, α_res for the r after them)
//! H     = SK(z[2n:] as n × n)   or   H = Σ_p softmax(z[2n:])_p M_p   (M_p row-major n × n)
//! table[t, 0, k]     = σ(z_k) + ε_in
//! table[t, 1 + i, k] = H[k][i]
//! table[t, n + 1, i] = k · σ(z_{n+i})
//! u_t                = Σ_k table[t, 0, k] · S_{t,k}   (the block input; S_{t,k} unit k of x_t)
//! ```
//!
//! Backward, with `g` the table's gradient read at each entry's place and `δ = ∂p` (or `∂z`
//! times `α_g`): `∂x_r = s W̃ δ_r + s'(n)/n · (x_r W̃ · δ_r) x_r` (`W̃` the effective projection
//! weights), `H = Σ_r x_rᵀ (s_r δ_r)` (the matrix product), then `∂W = diag(1 + γ) H[:, :K]`,
//! `∂v = (1 + γ) ⊙ H[:, K]`, `∂γ = Σ_c [W | v] ⊙ H` (gated) or `∂Φ = H` (normalised); the
//! scalars' and static parts' gradients are sums over the rows of per-row terms.
//!
//! A measurement knob (`BURN_CONNECTIVITY_TABLE_PROJECTION=matmul`, read once per process:
//! `cube_launch::Knobs`) moves the normalised form's products with `Φ` to Burn's matmul: forward
//! `xΦ` before the kernel, which then passes over the rows only for `‖x‖²`; backward
//! `(s δ) Φᵀ` after the kernel, and one more kernel adds the other terms of `∂x` to it. Same
//! values (the tests run both forms); which is faster on a GPU is what the knob is for.
//!
//! Which passes use the kernels is decided once per forward pass, with the unit ops
//! ([`UnitOps`](super::UnitOps)): the passes of the unit kernels (at most
//! [`MAX_UNITS`](super::unit_kernels::MAX_UNITS) units). Not differentiable twice.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, TensorMetadata, backend_extension};
use burn::tensor::{Shape, Tensor};

use super::RowScale;
use super::autodiff::{constant, tracked_op_saving};
use super::gradient_slots::{Part, take};
use super::unit_kernels::{UnitKernelsBackend, made_mix};

pub(super) mod cube;
#[cfg(feature = "kernel-source")]
pub(crate) use cube::cuda_kernels;

/// The gated form's inputs (see the [module docs](self)).
pub(crate) struct Gated {
    /// The units `S`, `[T, U, w]` (the rows `x` are its `T·U` units).
    pub units: Tensor<3>,
    /// `W`, `[w, K]`.
    pub mixing_weights: Tensor<2>,
    /// `v`, `[w]`.
    pub depth_weights: Tensor<1>,
    /// `γ`, `[w]`.
    pub gain: Tensor<1>,
    /// `m_W`, `[1]`.
    pub mixing_scale: Tensor<1>,
    /// `m_v`, `[1]`.
    pub depth_scale: Tensor<1>,
    /// `A`, `[U, K]`.
    pub mixing_static: Tensor<2>,
    /// `b`, `[U]`.
    pub depth_static: Tensor<1>,
    /// `act = tanh` (else the identity).
    pub tanh: bool,
    pub row_scale: RowScale,
}

/// The normalised form's inputs (see the [module docs](self)).
pub(crate) struct Normalised {
    /// The units `S`, `[T, n, C]` (the row `x_t` is token `t`'s `n` units flattened).
    pub units: Tensor<3>,
    /// `Φ`, `[n·C, 2n + n²]`, any strides (`Fᵀ` of a stored `F` is read without a copy).
    pub weights: Tensor<2>,
    /// `α_in`, `α_depth`, `α_res`, `[1]` each; or the three packed in the first, `[3]`, the
    /// other two then unread (pass them detached: no gradient is registered for them), so that
    /// a `[3]` parameter is read without three slices.
    pub scales: [Tensor<1>; 3],
    /// `c`, `[2n + n²]`.
    pub bias: Tensor<1>,
    /// `n`.
    pub streams: usize,
    /// `ε_in`.
    pub input_offset: f64,
    /// `k`.
    pub depth_factor: f64,
    pub sinkhorn_iterations: usize,
    pub sinkhorn_epsilon: f64,
    /// `M [m, n²]`: `H` is the softmax mixture of these matrices (the last `m` logits) instead
    /// of Sinkhorn-Knopp (whose iterations and `ε` are then unused). Constants: no gradient.
    pub mixture: Option<Tensor<2>>,
    pub row_scale: RowScale,
}

/// A form of the table: what [`LayerOps::table`](super::LayerOps::table) makes.
pub(crate) trait TableForm {
    /// Whether every input has the rows' float type (the kernels read them all as it).
    fn one_float_type(&self) -> bool;

    /// The table (gated: `[T, K + 1, U]`; normalised: `[T, n + 2, n]`) and the block input its
    /// view rows make of the units, `A_inᵀ S` (gated: `[T, V, w]`; normalised: `[T, 1, C]`),
    /// made by the same kernel; `slot`: the layer's gradient slot (see
    /// [`gradient_slots`](super::gradient_slots)), 0 for none.
    fn table(self, slot: u64) -> (Tensor<3>, Tensor<3>);
}

impl TableForm for Gated {
    fn one_float_type(&self) -> bool {
        let dtype = self.units.dtype();
        [
            self.mixing_weights.dtype(),
            self.depth_weights.dtype(),
            self.gain.dtype(),
            self.mixing_scale.dtype(),
            self.depth_scale.dtype(),
            self.mixing_static.dtype(),
            self.depth_static.dtype(),
        ]
        .into_iter()
        .all(|other| other == dtype)
    }

    fn table(self, slot: u64) -> (Tensor<3>, Tensor<3>) {
        let Gated {
            units,
            mixing_weights,
            depth_weights,
            gain,
            mixing_scale,
            depth_scale,
            mixing_static,
            depth_static,
            tanh,
            row_scale,
        } = self;
        // HC's and frac-connections' row scale `a / max(n + b, f)`: the gated kernels take c = 0.
        debug_assert_eq!(
            row_scale.root_offset, 0.0,
            "the gated table kernels take c = 0"
        );
        let (table, _projection, input) = <Dispatch as ConnectionTableBackend>::gated_table(
            units.into_dispatch(),
            mixing_weights.into_dispatch(),
            depth_weights.into_dispatch(),
            gain.into_dispatch(),
            mixing_scale.into_dispatch(),
            depth_scale.into_dispatch(),
            mixing_static.into_dispatch(),
            depth_static.into_dispatch(),
            tanh,
            row_scale.numerator,
            row_scale.offset,
            row_scale.floor,
            slot,
        );
        (Tensor::from_dispatch(table), Tensor::from_dispatch(input))
    }
}

impl TableForm for Normalised {
    fn one_float_type(&self) -> bool {
        let dtype = self.units.dtype();
        let [a, b, c] = &self.scales;
        [
            self.weights.dtype(),
            a.dtype(),
            b.dtype(),
            c.dtype(),
            self.bias.dtype(),
        ]
        .into_iter()
        .chain(self.mixture.as_ref().map(|m| m.dtype()))
        .all(|other| other == dtype)
    }

    fn table(self, slot: u64) -> (Tensor<3>, Tensor<3>) {
        let Normalised {
            units,
            weights,
            scales: [input_scale, depth_scale, residual_scale],
            bias,
            streams,
            input_offset,
            depth_factor,
            sinkhorn_iterations,
            sinkhorn_epsilon,
            mixture,
            row_scale,
        } = self;
        // Sinkhorn-Knopp reads no matrices: the bias stands in for them. Either is detached,
        // as the op registers no gradient for it.
        let mixtures = mixture.as_ref().map_or(0, |m| m.dims()[0]);
        let matrices = mixture.unwrap_or_else(|| bias.clone().unsqueeze()).detach();
        let (table, _projection, input) = <Dispatch as ConnectionTableBackend>::normalised_table(
            units.into_dispatch(),
            weights.into_dispatch(),
            input_scale.into_dispatch(),
            depth_scale.into_dispatch(),
            residual_scale.into_dispatch(),
            bias.into_dispatch(),
            matrices.into_dispatch(),
            streams,
            mixtures,
            // Zero runs one, as in `fused_sinkhorn` and the composed form.
            sinkhorn_iterations.max(1),
            input_offset,
            depth_factor,
            sinkhorn_epsilon,
            row_scale.numerator,
            row_scale.offset,
            row_scale.root_offset,
            slot,
        );
        (Tensor::from_dispatch(table), Tensor::from_dispatch(input))
    }
}

/// The connection tables (see the [module docs](self)).
#[backend_extension(
    Cube: cfg(feature = "cube-kernels"),
    Fusion: cfg(feature = "cube-kernels"),
    Autodiff
)]
pub(crate) trait ConnectionTableBackend: Backend {
    /// The gated form's table `[T, K + 1, U]` for `units [T, U, w]`. Second, the projection
    /// `[p_r | ‖x_r‖]` per row (`[T·U, K + 2]`, before the row scale), which the backward takes
    /// back rather than projecting the rows again (a constant to the graph). Third, the block
    /// input `A_inᵀ S` (`[T, V, w]`, `V = K − U`) that the table's view rows make, recorded
    /// under autodiff as the mixing [`unit_mix`](super::unit_kernels::UnitKernelsBackend::unit_mix)
    /// of those rows would be (its backward is that mixing's).
    #[fusion(meta = |units, mixing_weights, _, _, _, _, mixing_static, _, _, _, _, _, _| (
        TensorSpec::new(
            Shape::new([units.shape[0], mixing_weights.shape[1] + 1, units.shape[1]]),
            units.dtype,
        ),
        TensorSpec::new(
            Shape::new([units.shape[0] * units.shape[1], mixing_weights.shape[1] + 2]),
            units.dtype,
        ),
        TensorSpec::new(
            Shape::new([
                units.shape[0],
                mixing_weights.shape[1] - mixing_static.shape[0],
                units.shape[2],
            ]),
            units.dtype,
        ),
    ))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn gated_table(
        units: FloatTensor<Self>,
        mixing_weights: FloatTensor<Self>,
        depth_weights: FloatTensor<Self>,
        gain: FloatTensor<Self>,
        mixing_scale: FloatTensor<Self>,
        depth_scale: FloatTensor<Self>,
        mixing_static: FloatTensor<Self>,
        depth_static: FloatTensor<Self>,
        tanh: bool,
        numerator: f64,
        offset: f64,
        floor: f64,
        slot: u64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients of the gated form's eight inputs (the units' as `[T, U, w]`), given the
    /// table's and the forward's `projection`; `previous_rows` (read where `with_previous_rows`)
    /// is added to the units'. With `input_views > 0`, `input_grad [T, input_views, w]` is the
    /// gradient of the block input `u = A_in S` that the table's rows `0..input_views` make from
    /// the units: its parts of the table's and the units' gradients are added here, for the
    /// block input's backward.
    #[fusion(meta = |units, mixing_weights, depth_weights, gain, mixing_scale, depth_scale,
        mixing_static, depth_static, _, _, _, _, _, _, _, _, _, _| (
        units.clone(),
        mixing_weights.clone(),
        depth_weights.clone(),
        gain.clone(),
        mixing_scale.clone(),
        depth_scale.clone(),
        mixing_static.clone(),
        depth_static.clone(),
    ))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn gated_table_backward(
        units: FloatTensor<Self>,
        mixing_weights: FloatTensor<Self>,
        depth_weights: FloatTensor<Self>,
        gain: FloatTensor<Self>,
        mixing_scale: FloatTensor<Self>,
        depth_scale: FloatTensor<Self>,
        mixing_static: FloatTensor<Self>,
        depth_static: FloatTensor<Self>,
        projection: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        previous_rows: FloatTensor<Self>,
        with_previous_rows: bool,
        input_grad: FloatTensor<Self>,
        input_views: usize,
        tanh: bool,
        numerator: f64,
        offset: f64,
        floor: f64,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );

    /// The normalised form's table `[T, n + 2, n]` for `units [T, n, C]`; `matrices [m, n²]` the
    /// mixture's where `mixtures = m > 0`, else Sinkhorn-Knopp (and `matrices` unread). Second,
    /// the projection `[x_t Φ | √(‖x_t‖² + c)]` per token (`[T, 2n + r + 1]`), which the backward
    /// takes back rather than projecting the rows again (a constant to the graph). Third, the
    /// block input `Σ_k H_pre[k] S_k` (`[T, 1, C]`), as in
    /// [`gated_table`](Self::gated_table).
    #[fusion(meta = |units, _, _, _, _, _, _, streams, mixtures, _, _, _, _, _, _, _, _| (
        TensorSpec::new(Shape::new([units.shape[0], *streams + 2, *streams]), units.dtype),
        TensorSpec::new(
            Shape::new([units.shape[0], normalised_columns(*streams, *mixtures) + 1]),
            units.dtype,
        ),
        TensorSpec::new(Shape::new([units.shape[0], 1, units.shape[2]]), units.dtype),
    ))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn normalised_table(
        units: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        input_scale: FloatTensor<Self>,
        depth_scale: FloatTensor<Self>,
        residual_scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        matrices: FloatTensor<Self>,
        streams: usize,
        mixtures: usize,
        iterations: usize,
        input_offset: f64,
        depth_factor: f64,
        sinkhorn_epsilon: f64,
        numerator: f64,
        offset: f64,
        root_offset: f64,
        slot: u64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients of the normalised form's six inputs (not the mixture's matrices; the
    /// units' as `[T, n, C]`), given the table's and the forward's `projection` (its last column
    /// each row's `√(‖x‖² + c)`, so `c` is not passed again); `previous_rows`, `input_grad`
    /// (`[T, 1, C]`) and `input_views` (0 or 1) as in
    /// [`gated_table_backward`](Self::gated_table_backward).
    #[fusion(meta = |units, weights, input_scale, depth_scale, residual_scale, bias, _, _, _, _,
        _, _, _, _, _, _, _, _, _, _, _| (
        units.clone(),
        weights.clone(),
        input_scale.clone(),
        depth_scale.clone(),
        residual_scale.clone(),
        bias.clone(),
    ))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn normalised_table_backward(
        units: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        input_scale: FloatTensor<Self>,
        depth_scale: FloatTensor<Self>,
        residual_scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        matrices: FloatTensor<Self>,
        projection: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        previous_rows: FloatTensor<Self>,
        with_previous_rows: bool,
        input_grad: FloatTensor<Self>,
        input_views: usize,
        streams: usize,
        mixtures: usize,
        iterations: usize,
        input_offset: f64,
        depth_factor: f64,
        sinkhorn_epsilon: f64,
        numerator: f64,
        offset: f64,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );
}

/// The normalised form's logits per token: `2n + n²` (Sinkhorn-Knopp) or `2n + m` (a mixture
/// of `m` matrices).
pub(super) fn normalised_columns(streams: usize, mixtures: usize) -> usize {
    2 * streams
        + if mixtures > 0 {
            mixtures
        } else {
            streams * streams
        }
}

/// The block input's gradient and its number of views, where its backward left them in the
/// layer's slot (else a stand-in and 0).
fn take_input<B: ConnectionTableBackend>(
    slot: u64,
    grad: &FloatTensor<B>,
) -> (FloatTensor<B>, usize) {
    take::<(FloatTensor<B>, usize)>(slot, Part::BlockInput).unwrap_or_else(|| (grad.clone(), 0))
}

/// The gated form's constants.
#[derive(Debug, Clone, Copy)]
struct GatedConstants {
    tanh: bool,
    scale: RowScale,
    slot: u64,
}

#[derive(Debug)]
struct GatedTable;

impl<B: ConnectionTableBackend> Backward<B, 8> for GatedTable {
    /// The parents, the constants and the forward's projection.
    type State = ([NodeId; 8], GatedConstants, FloatTensor<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 8>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (nodes, GatedConstants { tanh, scale, slot }, projection) = ops.state;
        let [units, mw, dw, gain, ms, ds, mst, dst] =
            nodes.map(|id| checkpointer.retrieve_node_output(id));
        // The units' gradient the next units' backward left, and the block input's gradient
        // its backward left, added in the kernel.
        let previous = take::<FloatTensor<B>>(slot, Part::Units);
        let with_previous = previous.is_some();
        let (input_grad, input_views) = take_input::<B>(slot, &grad);
        let (a, b, c, d, e, f, g, h) = B::gated_table_backward(
            units,
            mw,
            dw,
            gain,
            ms,
            ds,
            mst,
            dst,
            projection,
            grad.clone(),
            previous.unwrap_or(grad),
            with_previous,
            input_grad,
            input_views,
            tanh,
            scale.numerator,
            scale.offset,
            scale.floor,
        );
        register_tracked!(grads, ops.parents, [a, b, c, d, e, f, g, h]);
    }
}

/// The normalised form's constants.
#[derive(Debug, Clone, Copy)]
struct NormalisedConstants {
    streams: usize,
    mixtures: usize,
    iterations: usize,
    input_offset: f64,
    depth_factor: f64,
    sinkhorn_epsilon: f64,
    numerator: f64,
    offset: f64,
    slot: u64,
}

#[derive(Debug)]
struct NormalisedTable;

impl<B: ConnectionTableBackend> Backward<B, 7> for NormalisedTable {
    /// The parents, the constants and the forward's projection.
    type State = ([NodeId; 7], NormalisedConstants, FloatTensor<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 7>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (nodes, k, projection) = ops.state;
        let [
            units,
            weights,
            input_scale,
            depth_scale,
            residual_scale,
            bias,
            matrices,
        ] = nodes.map(|id| checkpointer.retrieve_node_output(id));
        // As in the gated form's.
        let previous = take::<FloatTensor<B>>(k.slot, Part::Units);
        let with_previous = previous.is_some();
        let (input_grad, input_views) = take_input::<B>(k.slot, &grad);
        let (a, b, c, d, e, f) = B::normalised_table_backward(
            units,
            weights,
            input_scale,
            depth_scale,
            residual_scale,
            bias,
            matrices,
            projection,
            grad.clone(),
            previous.unwrap_or(grad),
            with_previous,
            input_grad,
            input_views,
            k.streams,
            k.mixtures,
            k.iterations,
            k.input_offset,
            k.depth_factor,
            k.sinkhorn_epsilon,
            k.numerator,
            k.offset,
        );
        // The mixture's matrices are constants: no gradient is registered for them.
        let [p0, p1, p2, p3, p4, p5, _] = ops.parents;
        register_tracked!(grads, [p0, p1, p2, p3, p4, p5], [a, b, c, d, e, f]);
    }
}

/// The block input a table's kernel made (`[T, V, w]`), recorded under autodiff as the mixing
/// of the table's view rows with the units, whose backward hands its gradient to the table's.
fn made_block_input<B, C>(
    table: &FloatTensor<Autodiff<B, C>>,
    units: FloatTensor<Autodiff<B, C>>,
    input: FloatTensor<B>,
    slot: u64,
) -> FloatTensor<Autodiff<B, C>>
where
    B: ConnectionTableBackend + UnitKernelsBackend,
    C: CheckpointStrategy,
{
    let views = input.shape()[1];
    made_mix::<B, C>(table.clone(), units, input, [0, views], slot)
}

// The table ops' autodiff takes the unit kernels' too: the block input they make is recorded as
// the unit mixing of their view rows (both extensions come with `cube-kernels`).
impl<B, C> ConnectionTableBackend for Autodiff<B, C>
where
    B: ConnectionTableBackend + UnitKernelsBackend,
    C: CheckpointStrategy,
{
    fn gated_table(
        units: FloatTensor<Self>,
        mixing_weights: FloatTensor<Self>,
        depth_weights: FloatTensor<Self>,
        gain: FloatTensor<Self>,
        mixing_scale: FloatTensor<Self>,
        depth_scale: FloatTensor<Self>,
        mixing_static: FloatTensor<Self>,
        depth_static: FloatTensor<Self>,
        tanh: bool,
        numerator: f64,
        offset: f64,
        floor: f64,
        slot: u64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let constants = GatedConstants {
            tanh,
            scale: RowScale {
                numerator,
                offset,
                floor,
                root_offset: 0.0,
            },
            slot,
        };
        let (table, (projection, input)) = tracked_op_saving::<B, C, _, _, _>(
            GatedTable,
            [
                units.clone(),
                mixing_weights,
                depth_weights,
                gain,
                mixing_scale,
                depth_scale,
                mixing_static,
                depth_static,
            ],
            |[units, mw, dw, gain, ms, ds, mst, dst]| {
                let (table, projection, input) = B::gated_table(
                    units, mw, dw, gain, ms, ds, mst, dst, tanh, numerator, offset, floor, slot,
                );
                (table, (projection, input))
            },
            |nodes, _, (projection, _)| (nodes, constants, projection),
        );
        let input = made_block_input::<B, C>(&table, units, input, slot);
        (table, constant::<B, C>(projection), input)
    }

    fn gated_table_backward(
        units: FloatTensor<Self>,
        mixing_weights: FloatTensor<Self>,
        depth_weights: FloatTensor<Self>,
        gain: FloatTensor<Self>,
        mixing_scale: FloatTensor<Self>,
        depth_scale: FloatTensor<Self>,
        mixing_static: FloatTensor<Self>,
        depth_static: FloatTensor<Self>,
        projection: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        previous_rows: FloatTensor<Self>,
        with_previous_rows: bool,
        input_grad: FloatTensor<Self>,
        input_views: usize,
        tanh: bool,
        numerator: f64,
        offset: f64,
        floor: f64,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        // First-order only: the gradients are constants to the graph.
        let (a, b, c, d, e, f, g, h) = B::gated_table_backward(
            units.into_primitive(),
            mixing_weights.into_primitive(),
            depth_weights.into_primitive(),
            gain.into_primitive(),
            mixing_scale.into_primitive(),
            depth_scale.into_primitive(),
            mixing_static.into_primitive(),
            depth_static.into_primitive(),
            projection.into_primitive(),
            grad.into_primitive(),
            previous_rows.into_primitive(),
            with_previous_rows,
            input_grad.into_primitive(),
            input_views,
            tanh,
            numerator,
            offset,
            floor,
        );
        (
            constant::<B, C>(a),
            constant::<B, C>(b),
            constant::<B, C>(c),
            constant::<B, C>(d),
            constant::<B, C>(e),
            constant::<B, C>(f),
            constant::<B, C>(g),
            constant::<B, C>(h),
        )
    }

    fn normalised_table(
        units: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        input_scale: FloatTensor<Self>,
        depth_scale: FloatTensor<Self>,
        residual_scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        matrices: FloatTensor<Self>,
        streams: usize,
        mixtures: usize,
        iterations: usize,
        input_offset: f64,
        depth_factor: f64,
        sinkhorn_epsilon: f64,
        numerator: f64,
        offset: f64,
        root_offset: f64,
        slot: u64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let constants = NormalisedConstants {
            streams,
            mixtures,
            iterations,
            input_offset,
            depth_factor,
            sinkhorn_epsilon,
            numerator,
            offset,
            slot,
        };
        let (table, (projection, input)) = tracked_op_saving::<B, C, _, _, _>(
            NormalisedTable,
            [
                units.clone(),
                weights,
                input_scale,
                depth_scale,
                residual_scale,
                bias,
                matrices,
            ],
            |[units, weights, a_in, a_depth, a_res, bias, matrices]| {
                let (table, projection, input) = B::normalised_table(
                    units,
                    weights,
                    a_in,
                    a_depth,
                    a_res,
                    bias,
                    matrices,
                    streams,
                    mixtures,
                    iterations,
                    input_offset,
                    depth_factor,
                    sinkhorn_epsilon,
                    numerator,
                    offset,
                    root_offset,
                    slot,
                );
                (table, (projection, input))
            },
            |nodes, _, (projection, _)| (nodes, constants, projection),
        );
        let input = made_block_input::<B, C>(&table, units, input, slot);
        (table, constant::<B, C>(projection), input)
    }

    fn normalised_table_backward(
        units: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        input_scale: FloatTensor<Self>,
        depth_scale: FloatTensor<Self>,
        residual_scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        matrices: FloatTensor<Self>,
        projection: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        previous_rows: FloatTensor<Self>,
        with_previous_rows: bool,
        input_grad: FloatTensor<Self>,
        input_views: usize,
        streams: usize,
        mixtures: usize,
        iterations: usize,
        input_offset: f64,
        depth_factor: f64,
        sinkhorn_epsilon: f64,
        numerator: f64,
        offset: f64,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        // First-order only: the gradients are constants to the graph.
        let (a, b, c, d, e, f) = B::normalised_table_backward(
            units.into_primitive(),
            weights.into_primitive(),
            input_scale.into_primitive(),
            depth_scale.into_primitive(),
            residual_scale.into_primitive(),
            bias.into_primitive(),
            matrices.into_primitive(),
            projection.into_primitive(),
            grad.into_primitive(),
            previous_rows.into_primitive(),
            with_previous_rows,
            input_grad.into_primitive(),
            input_views,
            streams,
            mixtures,
            iterations,
            input_offset,
            depth_factor,
            sinkhorn_epsilon,
            numerator,
            offset,
        );
        (
            constant::<B, C>(a),
            constant::<B, C>(b),
            constant::<B, C>(c),
            constant::<B, C>(d),
            constant::<B, C>(e),
            constant::<B, C>(f),
        )
    }
}
