//! The unit ops of the multi-stream connectivities (hyper-connections, frac-connections, mHC) as
//! CubeCL kernels with their own backward, for the GPU backends (wgpu, vulkan, metal, cuda).
//!
//! For rows `x_r` (`[R, w]`), a small weight matrix `W` (`[w, C]`) and a row scale
//! `s(n) = a / max(n + b, f)` of the row norm `n_r = ‖x_r‖₂`, the normalised projection:
//!
//! ```text
//! P_r  = s(n_r) · x_r W                                   one kernel, rows in tiles
//! ∂x_r = s(n_r) W ∂P_rᵀ + s'(n_r) / n_r · (x_r W · ∂P_r) x_r   one kernel, rows in tiles
//! ∂W   = xᵀ (s ⊙ ∂P)                                      two kernels (the product, its sum)
//! ```
//!
//! and per token `t`, with `R` output rows, `U` units of width `w` and `V` views of the branch,
//! the mixing (the `β h` term optional; `W`, `β` with a leading axis of `T` or 1):
//!
//! ```text
//! out[t, r] = Σ_u W[t, r, u] S[t, u] + β[t, r] h[t, r mod V]           one kernel, one thread per output
//!
//! ∂S[t, u]  = Σ_r W[t, r, u] ∂out[t, r]          ∂W[t, r, u] = ⟨∂out[t, r], S[t, u]⟩
//! ∂h[t, f]  = Σ_{r mod V = f} β[t, r] ∂out[t, r]   ∂β[t, r] = ⟨∂out[t, r], h[t, r mod V]⟩
//!                                                one kernel, one cube per token
//! ```
//!
//! (plus a sum over tokens for a `W` or `β` shared by every token). Where a layer's connections
//! are one table `[A_inᵀ; A_resᵀ; βᵀ]` (see [`connection_tables`](super::connection_tables)),
//! `β` is read from its row of the same matrices and `∂β` written there; the block input's
//! backward then adds the gradients that the next units' backward left in the layer's gradient
//! slot (see [`gradient_slots`](super::gradient_slots)) to its own inside its kernel, and leaves
//! `∂S` for the table's backward, instead of autodiff adding full-size tensors. Composed from tensor ops,
//! the fusion engine merges the mixing's forward into one kernel but not its backward, whose
//! `R · U` inner products and `U` accumulations are kernels of their own, nor the projection's
//! norm, product and scale. In the projection's kernels a cube takes several rows, eight units
//! striding each along `w`, and reads `W` in tiles through shared memory that all its rows share
//! (`cube_launch::RowTiles`), so every row is read once, coalesced, and `W` once per cube; the
//! mixing's backward sums its units' partial inner products in shared memory.
//!
//! Which units the kernels take is decided once per forward pass ([`supports`]): at most
//! [`MAX_UNITS`] units per token, float tensors on a CubeCL device; other passes compose.
//! Not differentiable twice.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{Shape, Tensor};

use super::autodiff::{constant, take_so_far, tracked_op};
use super::gradient_slots::{Part, leave, take};
use super::{Gains, MatrixRows, RowScale};

mod cube;

/// The most units per token the kernels take (their per-unit sums live in registers).
pub(crate) const MAX_UNITS: usize = 8;

/// The most columns of the projection kernels: a cube's tile of the weights (`threads × C`
/// entries, `C` padded) lives in shared memory ([`RowTiles`](super::cube_launch::RowTiles),
/// 24 kB), and past this even two units' tile of f64 weights could outgrow it. Wider projections
/// (AttnRes past 1024 blocks, MUDD past 255) compose.
pub(crate) const MAX_PROJECTION_COLUMNS: usize = 1024;

/// Whether the projection kernel takes `weights [w, C]` for `rows [..., w]`: the rows' float type (the
/// kernel reads every input as the rows' type) and `C` at most [`MAX_PROJECTION_COLUMNS`] (the
/// device and the rows are checked by [`supports`]). Otherwise the composed form runs, whose
/// Burn ops report mixed types.
pub(crate) fn projects<const D: usize>(rows: &Tensor<D>, weights: &Tensor<2>) -> bool {
    weights.dtype() == rows.dtype() && weights.dims()[1] <= MAX_PROJECTION_COLUMNS
}

/// Whether the mix kernels take `matrices` and `units` (and the addend's `β`, `h`): one float
/// type for all, as the kernels read every input as the units' type.
pub(crate) fn mixes(
    matrices: &Tensor<3>,
    units: &Tensor<3>,
    addend: Option<&(Gains, Tensor<3>)>,
) -> bool {
    let dtype = units.dtype();
    let addend_dtypes = addend.is_none_or(|(gains, branch)| {
        branch.dtype() == dtype
            && match gains {
                Gains::Own(beta) => beta.dtype() == dtype,
                Gains::Row(_) => true,
            }
    });
    matrices.dtype() == dtype && addend_dtypes
}

/// Whether the kernels take `units [tokens, U, w]`: [`cube_kernels_take`](super::cube_kernels_take)
/// them, and `U` at most [`MAX_UNITS`].
pub(crate) fn supports(units: &Tensor<3>) -> bool {
    let [_, count, _] = units.dims();
    super::cube_kernels_take(units) && count <= MAX_UNITS
}

/// The unit kernels (see the [module docs](self)).
#[backend_extension(
    Cube: cfg(feature = "cube-kernels"),
    Fusion: cfg(feature = "cube-kernels"),
    Autodiff
)]
pub(crate) trait UnitKernelsBackend: Backend {
    /// `P = s(‖x_r‖) x_r W` for `rows [..., w]` (read as `[R, w]`), `weights [w, C]`; `[R, C]`.
    #[fusion(meta = |rows, weights, _, _, _, _| TensorSpec::new(
        Shape::new([
            rows.shape.num_elements() / rows.shape[rows.shape.num_dims() - 1].max(1),
            weights.shape[1],
        ]),
        rows.dtype,
    ))]
    fn unit_projection(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        numerator: f64,
        offset: f64,
        floor: f64,
        root_offset: f64,
    ) -> FloatTensor<Self>;

    /// The gradients of `rows` (shaped like `rows`) and `weights`, given the output
    /// `projection` and its gradient. `previous` (shaped like `rows`, read where
    /// `with_previous`) is added to the rows' gradient: the rows' gradient so far.
    #[fusion(meta = |rows, weights, _, _, _, _, _, _, _, _| (rows.clone(), weights.clone()))]
    #[allow(clippy::too_many_arguments)]
    fn unit_projection_backward(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        projection: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        previous: FloatTensor<Self>,
        with_previous: bool,
        numerator: f64,
        offset: f64,
        floor: f64,
        root_offset: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `out = W S`, `W` the rows `first..first + rows` of `weights [T | 1, R', U]`, `units
    /// [T, U, w]`; `[T, rows, w]`.
    /// `slot`: the layer's gradient slot (0: none; see
    /// [`gradient_slots`](super::gradient_slots)).
    #[fusion(meta = |_, units, _, rows, _| TensorSpec::new(
        Shape::new([units.shape[0], *rows, units.shape[2]]),
        units.dtype,
    ))]
    fn unit_mix(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        first: usize,
        rows: usize,
        slot: u64,
    ) -> FloatTensor<Self>;

    /// `out = W S + β h`, with `beta [T | 1, rows, 1]` and `branch [T, V, w]` (`V` divides
    /// `rows`).
    #[fusion(meta = |_, units, _, _, _, rows| TensorSpec::new(
        Shape::new([units.shape[0], *rows, units.shape[2]]),
        units.dtype,
    ))]
    fn unit_mix_add(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        first: usize,
        rows: usize,
    ) -> FloatTensor<Self>;

    /// `out = W S + β h` with `β[t, r] = weights[t, beta_row, r]` (row `beta_row` of the same
    /// matrices) and `branch [T, V, w]`.
    #[fusion(meta = |_, units, _, _, rows, _, _| TensorSpec::new(
        Shape::new([units.shape[0], *rows, units.shape[2]]),
        units.dtype,
    ))]
    fn unit_mix_add_inline(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        first: usize,
        rows: usize,
        beta_row: usize,
        slot: u64,
    ) -> FloatTensor<Self>;

    /// The gradients of `weights` (`β`'s row included), `units` and `branch` of
    /// [`unit_mix_add_inline`](Self::unit_mix_add_inline).
    #[fusion(meta = |weights, units, branch, _, _, _, _| (
        weights.clone(),
        units.clone(),
        branch.clone(),
    ))]
    #[allow(clippy::type_complexity)]
    fn unit_mix_add_inline_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        first: usize,
        rows: usize,
        beta_row: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients of `weights` (all its rows, zero outside those read) and `units` of
    /// [`unit_mix`](Self::unit_mix), given the gradient of the output.
    /// `previous_weights` and `previous_units` (read where `with_previous_*`) are added to
    /// them: gradients left by a later op of the layer.
    #[fusion(meta = |weights, units, _, _, _, _, _, _, _| (weights.clone(), units.clone()))]
    #[allow(clippy::too_many_arguments)]
    fn unit_mix_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        previous_weights: FloatTensor<Self>,
        previous_units: FloatTensor<Self>,
        first: usize,
        rows: usize,
        with_previous_weights: bool,
        with_previous_units: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients of `weights`, `units`, `beta` and `branch` of
    /// [`unit_mix_add`](Self::unit_mix_add), each shaped like its input.
    #[fusion(meta = |weights, units, beta, branch, _, _, _| (
        weights.clone(),
        units.clone(),
        beta.clone(),
        branch.clone(),
    ))]
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn unit_mix_add_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        first: usize,
        rows: usize,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );
}

/// `P_r = s(‖x_r‖₂) · x_r W` through the kernels: `rows [R, w]`, `weights [w, C]`.
pub(crate) fn projection(rows: Tensor<2>, weights: Tensor<2>, scale: RowScale) -> Tensor<2> {
    state_projection(rows, weights, scale)
}

/// [`projection`] of a state's rows, `state [..., w]`, `[..., C]`. The op reads the state
/// itself (no reshape node in between), so its backward finds the state's gradient so far and
/// adds its own term to it inside its kernel, where autodiff would add the two with a kernel of
/// its own.
pub(crate) fn state_projection<const D: usize>(
    state: Tensor<D>,
    weights: Tensor<2>,
    scale: RowScale,
) -> Tensor<D> {
    let mut shape = state.dims();
    shape[D - 1] = weights.dims()[1];
    let projected: Tensor<2> =
        Tensor::from_dispatch(<Dispatch as UnitKernelsBackend>::unit_projection(
            state.into_dispatch(),
            weights.into_dispatch(),
            scale.numerator,
            scale.offset,
            scale.floor,
            scale.root_offset,
        ));
    projected.reshape(shape)
}

/// `Aᵀ S (+ β h)` through the kernels (shapes as in [`LayerOps::mix`](super::LayerOps::mix)),
/// the rows of `Aᵀ` read in place.
/// `slot`: the layer's gradient slot, 0 for none (see [`gradient_slots`](super::gradient_slots);
/// only with a table's `β`).
pub(crate) fn mix(
    weights: MatrixRows,
    units: Tensor<3>,
    addend: Option<(Gains, Tensor<3>)>,
    slot: u64,
) -> Tensor<3> {
    let MatrixRows {
        matrices,
        first,
        count,
    } = weights;
    let output = match addend {
        None => <Dispatch as UnitKernelsBackend>::unit_mix(
            matrices.into_dispatch(),
            units.into_dispatch(),
            first,
            count,
            slot,
        ),
        Some((Gains::Row(beta_row), branch)) => {
            <Dispatch as UnitKernelsBackend>::unit_mix_add_inline(
                matrices.into_dispatch(),
                units.into_dispatch(),
                branch.into_dispatch(),
                first,
                count,
                beta_row,
                slot,
            )
        }
        Some((Gains::Own(beta), branch)) => <Dispatch as UnitKernelsBackend>::unit_mix_add(
            matrices.into_dispatch(),
            units.into_dispatch(),
            beta.into_dispatch(),
            branch.into_dispatch(),
            first,
            count,
        ),
    };
    Tensor::from_dispatch(output)
}

/// `output`, the mixing `W S` of the rows `first..first + rows` of `weights` with `units` that
/// another op's kernel made (a connection table's block input), recorded under autodiff as
/// [`unit_mix`](UnitKernelsBackend::unit_mix) would record it: its backward is that mixing's.
pub(super) fn made_mix<B: UnitKernelsBackend, C: CheckpointStrategy>(
    weights: FloatTensor<Autodiff<B, C>>,
    units: FloatTensor<Autodiff<B, C>>,
    output: FloatTensor<B>,
    [first, rows]: [usize; 2],
    slot: u64,
) -> FloatTensor<Autodiff<B, C>> {
    tracked_op::<B, C, _, _>(
        Mix,
        [weights, units],
        |_| output,
        |nodes, _| (nodes, [first, rows], slot),
    )
}

#[derive(Debug)]
struct Projection;

impl<B: UnitKernelsBackend> Backward<B, 2> for Projection {
    /// The parents' nodes, the output, the row scale, and the rows as a tracked tensor (whose
    /// gradient so far the backward takes over).
    type State = (
        [NodeId; 2],
        FloatTensor<B>,
        RowScale,
        FloatTensor<Autodiff<B>>,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (nodes, projection, scale, tracked_rows) = ops.state;
        let [rows, weights] = nodes.map(|id| checkpointer.retrieve_node_output(id));
        let tracked = [ops.parents[0].is_some()];
        let (mut previous, with_previous, _) =
            take_so_far::<B>(grads, &[tracked_rows], &tracked, &rows);
        let (grad_rows, grad_weights) = B::unit_projection_backward(
            rows,
            weights,
            projection,
            grad,
            previous.remove(0),
            with_previous != 0,
            scale.numerator,
            scale.offset,
            scale.floor,
            scale.root_offset,
        );
        register_tracked!(grads, ops.parents, [grad_rows, grad_weights]);
    }
}

#[derive(Debug)]
struct Mix;

impl<B: UnitKernelsBackend> Backward<B, 2> for Mix {
    type State = ([NodeId; 2], [usize; 2], u64);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (nodes, [first, rows], slot) = ops.state;
        let [weights_parent, units_parent] = ops.parents;
        // What the next units' backward left (a table's layer), added in the kernel.
        let previous_weights = take::<FloatTensor<B>>(slot, Part::Table);
        // In a table's layer whose next units' backward ran, the table's backward (sure to run:
        // the table is tracked) reads the units' rows anyway: it takes this op's parts of ∂M
        // and ∂S from ∂u itself, and this op launches nothing.
        let (previous_weights, grad) = match (previous_weights, &weights_parent) {
            (Some(table_grad), Some(parent)) if first == 0 => {
                match leave(slot, Part::BlockInput, (grad, rows)) {
                    Ok(()) => {
                        grads.register::<B>(parent.id, table_grad);
                        return;
                    }
                    Err((grad, _)) => (Some(table_grad), grad),
                }
            }
            (previous_weights, _) => (previous_weights, grad),
        };
        let [weights, units] = nodes.map(|id| checkpointer.retrieve_node_output(id));
        let previous_units = take::<FloatTensor<B>>(slot, Part::Units);
        let (with_weights, with_units) = (previous_weights.is_some(), previous_units.is_some());
        let (grad_weights, grad_units) = B::unit_mix_backward(
            weights,
            units,
            grad.clone(),
            previous_weights.unwrap_or_else(|| grad.clone()),
            previous_units.unwrap_or(grad),
            first,
            rows,
            with_weights,
            with_units,
        );
        register_tracked!(grads, [weights_parent], [grad_weights]);
        // The table's backward, sure to run (the units are its input), adds its part of ∂S.
        if let Some(parent) = units_parent {
            let left = if slot != 0 {
                leave(slot, Part::Units, grad_units)
            } else {
                Err(grad_units)
            };
            if let Err(grad_units) = left {
                grads.register::<B>(parent.id, grad_units);
            }
        }
    }
}

#[derive(Debug)]
struct MixAdd;

impl<B: UnitKernelsBackend> Backward<B, 4> for MixAdd {
    type State = ([NodeId; 4], [usize; 2]);

    fn backward(
        self,
        ops: Ops<Self::State, 4>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (nodes, [first, rows]) = ops.state;
        let [weights, units, beta, branch] = nodes.map(|id| checkpointer.retrieve_node_output(id));
        let (grad_weights, grad_units, grad_beta, grad_branch) =
            B::unit_mix_add_backward(weights, units, beta, branch, grad, first, rows);
        register_tracked!(
            grads,
            ops.parents,
            [grad_weights, grad_units, grad_beta, grad_branch]
        );
    }
}

#[derive(Debug)]
struct MixAddInline;

impl<B: UnitKernelsBackend> Backward<B, 3> for MixAddInline {
    type State = ([NodeId; 3], [usize; 3], u64);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (nodes, [first, rows, beta_row], slot) = ops.state;
        let [weights, units, branch] = nodes.map(|id| checkpointer.retrieve_node_output(id));
        let (grad_weights, grad_units, grad_branch) =
            B::unit_mix_add_inline_backward(weights, units, branch, grad, first, rows, beta_row);
        let [weights_parent, units_parent, branch_parent] = ops.parents;
        register_tracked!(grads, [branch_parent], [grad_branch]);
        // The block input's backward, sure to run (the table and the units are its inputs),
        // adds its parts to these.
        for (parent, part, gradient) in [
            (weights_parent, Part::Table, grad_weights),
            (units_parent, Part::Units, grad_units),
        ] {
            let Some(parent) = parent else {
                continue;
            };
            let left = if slot != 0 {
                leave(slot, part, gradient)
            } else {
                Err(gradient)
            };
            if let Err(gradient) = left {
                grads.register::<B>(parent.id, gradient);
            }
        }
    }
}

impl<B: UnitKernelsBackend, C: CheckpointStrategy> UnitKernelsBackend for Autodiff<B, C> {
    fn unit_mix_add_inline(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        first: usize,
        rows: usize,
        beta_row: usize,
        slot: u64,
    ) -> FloatTensor<Self> {
        tracked_op::<B, C, _, _>(
            MixAddInline,
            [weights, units, branch],
            |[weights, units, branch]| {
                B::unit_mix_add_inline(weights, units, branch, first, rows, beta_row, slot)
            },
            |nodes, _| (nodes, [first, rows, beta_row], slot),
        )
    }

    fn unit_mix_add_inline_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        first: usize,
        rows: usize,
        beta_row: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (grad_weights, grad_units, grad_branch) = B::unit_mix_add_inline_backward(
            weights.into_primitive(),
            units.into_primitive(),
            branch.into_primitive(),
            grad.into_primitive(),
            first,
            rows,
            beta_row,
        );
        (
            constant::<B, C>(grad_weights),
            constant::<B, C>(grad_units),
            constant::<B, C>(grad_branch),
        )
    }

    fn unit_projection(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        numerator: f64,
        offset: f64,
        floor: f64,
        root_offset: f64,
    ) -> FloatTensor<Self> {
        let scale = RowScale {
            numerator,
            offset,
            floor,
            root_offset,
        };
        let tracked_rows = rows.clone();
        tracked_op::<B, C, _, _>(
            Projection,
            [rows, weights],
            |[rows, weights]| {
                B::unit_projection(rows, weights, numerator, offset, floor, root_offset)
            },
            |nodes, output| (nodes, output.clone(), scale, tracked_rows),
        )
    }

    fn unit_projection_backward(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        projection: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        previous: FloatTensor<Self>,
        with_previous: bool,
        numerator: f64,
        offset: f64,
        floor: f64,
        root_offset: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // First-order only: the gradients are constants to the graph.
        let (grad_rows, grad_weights) = B::unit_projection_backward(
            rows.into_primitive(),
            weights.into_primitive(),
            projection.into_primitive(),
            grad.into_primitive(),
            previous.into_primitive(),
            with_previous,
            numerator,
            offset,
            floor,
            root_offset,
        );
        (constant::<B, C>(grad_rows), constant::<B, C>(grad_weights))
    }

    fn unit_mix(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        first: usize,
        rows: usize,
        slot: u64,
    ) -> FloatTensor<Self> {
        tracked_op::<B, C, _, _>(
            Mix,
            [weights, units],
            |[weights, units]| B::unit_mix(weights, units, first, rows, slot),
            |nodes, _| (nodes, [first, rows], slot),
        )
    }

    fn unit_mix_add(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        first: usize,
        rows: usize,
    ) -> FloatTensor<Self> {
        tracked_op::<B, C, _, _>(
            MixAdd,
            [weights, units, beta, branch],
            |[weights, units, beta, branch]| {
                B::unit_mix_add(weights, units, beta, branch, first, rows)
            },
            |nodes, _| (nodes, [first, rows]),
        )
    }

    fn unit_mix_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        previous_weights: FloatTensor<Self>,
        previous_units: FloatTensor<Self>,
        first: usize,
        rows: usize,
        with_previous_weights: bool,
        with_previous_units: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (grad_weights, grad_units) = B::unit_mix_backward(
            weights.into_primitive(),
            units.into_primitive(),
            grad.into_primitive(),
            previous_weights.into_primitive(),
            previous_units.into_primitive(),
            first,
            rows,
            with_previous_weights,
            with_previous_units,
        );
        (constant::<B, C>(grad_weights), constant::<B, C>(grad_units))
    }

    fn unit_mix_add_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        first: usize,
        rows: usize,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let (grad_weights, grad_units, grad_beta, grad_branch) = B::unit_mix_add_backward(
            weights.into_primitive(),
            units.into_primitive(),
            beta.into_primitive(),
            branch.into_primitive(),
            grad.into_primitive(),
            first,
            rows,
        );
        (
            constant::<B, C>(grad_weights),
            constant::<B, C>(grad_units),
            constant::<B, C>(grad_beta),
            constant::<B, C>(grad_branch),
        )
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::prelude::*;

    use super::{MAX_UNITS, mix, projection};
    use crate::backend::units::{composed_mix, composed_normed_projection};
    use crate::backend::{Gains, MatrixRows, RowScale, UnitOps};
    use crate::device::device;
    use crate::test_util::standard_normal as random;

    fn wgpu() -> Device {
        device("wgpu").expect("wgpu compiled in").autodiff()
    }

    /// Runs `op` on leaves made from `inputs` and returns its output and the gradients of every
    /// input for the loss `Σ output ⊙ probe`.
    fn values_and_gradients<const D: usize, const O: usize>(
        inputs: &[Tensor<D>],
        probe: &Tensor<O>,
        op: impl Fn(Vec<Tensor<D>>) -> Tensor<O>,
    ) -> Vec<TensorData> {
        let leaves: Vec<_> = inputs.iter().map(|x| x.clone().require_grad()).collect();
        let output = op(leaves.clone());
        let grads = (output.clone() * probe.clone()).sum().backward();
        std::iter::once(output.into_data())
            .chain(leaves.iter().map(|x| x.grad(&grads).unwrap().into_data()))
            .collect()
    }

    /// Entries agree to 1e-3 relative, or to 1e-4 of the tensor's largest entry (at least 1).
    fn assert_all_close(kernel: &[TensorData], composed: &[TensorData], case: &str) {
        crate::test_util::assert_tensors_close(kernel, composed, 1e-3, case);
    }

    /// Projections up to the kernels' column limit take them; wider ones, and weights of
    /// another float type, compose; so does a mix whose matrices are of another type.
    #[test]
    fn projections_past_the_column_limit_compose() {
        let device = wgpu();
        let rows = Tensor::<2>::zeros([3, 4], &device);
        let weights = |columns: usize| Tensor::<2>::zeros([4, columns], &device);
        let most = super::MAX_PROJECTION_COLUMNS;
        assert!(super::projects(&rows, &weights(most)));
        assert!(!super::projects(&rows, &weights(most + 1)));
        // The kernels read every input as the rows' type: other weights would be misread.
        let f64_weights = weights(8).cast(burn::tensor::FloatDType::F64);
        assert!(!super::projects(&rows, &f64_weights));
        let units = Tensor::<3>::zeros([3, 2, 4], &device);
        let matrices = Tensor::<3>::zeros([3, 2, 2], &device);
        assert!(super::mixes(&matrices, &units, None));
        let f64_matrices = matrices.cast(burn::tensor::FloatDType::F64);
        assert!(!super::mixes(&f64_matrices, &units, None));
    }

    /// The projection kernels against the composed tensor ops on wgpu, forward and both
    /// gradients: the three row scales (HC's floor, mHC's offset, the RMS scale's `ε` inside
    /// the root), widths below and above the cube's units, more columns than units, rows of
    /// norms from 1e-2 to 1e2, transposed rows, transposed weights (read through their
    /// strides), a zero row; in cubes of up to 256 units (the
    /// default), where a tile of 128 entries is loaded by twice as many units (for 1 and 3
    /// columns the last load of a unit passes the tile), and of 128.
    #[test]
    fn projection_kernels_match_the_composed_operations() {
        use crate::backend::{Knobs, with_each_knobs};
        let narrow = Knobs {
            tile_units: 128,
            ..Knobs::default()
        };
        let mut cases = ["cubes of up to 256 units", "cubes of 128 units"].into_iter();
        with_each_knobs([Knobs::default(), narrow], || {
            projection_kernels_match(cases.next().unwrap_or_default());
        });
    }

    fn projection_kernels_match(case: &str) {
        let device = wgpu();
        let hc = |width: usize| RowScale {
            numerator: (width as f64).sqrt(),
            offset: 0.0,
            floor: 1e-12,
            root_offset: 0.0,
        };
        let mhc = |width: usize| RowScale {
            numerator: (width as f64).sqrt(),
            offset: 1e-6 * (width as f64).sqrt(),
            floor: 0.0,
            root_offset: 0.0,
        };
        // A large ε (0.3) so that the root's offset matters at these norms.
        let rms = |width: usize| RowScale::rms(width, 0.3);
        // (rows, width, columns, rows transposed, scale, weights transposed)
        for (count, width, columns, transposed, scale, transposed_weights) in [
            (70, 24, 6, false, hc(24), false),
            (9, 300, 6, false, hc(300), false),
            (33, 1024, 24, false, mhc(1024), false),
            (5, 8, 1, true, hc(8), false),
            (40, 10, 80, true, mhc(10), false),
            (33, 1024, 24, false, rms(1024), false),
            (12, 10, 3, true, rms(10), false),
            (6, 200, 1, false, hc(200), true),
            (12, 300, 3, false, rms(300), true),
        ] {
            let magnitudes: Vec<f32> = (0..count)
                .map(|r| {
                    if r == 3 {
                        0.0
                    } else {
                        10f32.powi((r % 5) as i32 - 2)
                    }
                })
                .collect();
            let magnitudes = Tensor::<1>::from_data(TensorData::new(magnitudes, [count]), &device)
                .reshape([count, 1]);
            let rows = if transposed {
                random([width, count], 1, &device).transpose()
            } else {
                random([count, width], 2, &device)
            } * magnitudes;
            let weights = if transposed_weights {
                random([columns, width], 3, &device).transpose()
            } else {
                random([width, columns], 3, &device)
            };
            let probe = random([count, columns], 4, &device);
            // ∂rows in the rows' own scale (∂x ∝ s(‖x‖)): the zero row's (s up to 1e12) would
            // otherwise set the tolerance of every other row's.
            let inverse_scales = crate::test_util::inverse_row_scales(&rows, scale).into_data();
            let inputs = [rows, weights];
            let mut kernel = values_and_gradients(&inputs, &probe, |x| {
                projection(x[0].clone(), x[1].clone(), scale)
            });
            let mut composed = values_and_gradients(&inputs, &probe, |x| {
                composed_normed_projection(x[0].clone(), x[1].clone(), scale)
            });
            for gradients in [&mut kernel, &mut composed] {
                let inverse_scales = Tensor::<2>::from_data(inverse_scales.clone(), &device);
                let grad_rows = Tensor::<2>::from_data(gradients[1].clone(), &device);
                gradients[1] = (grad_rows * inverse_scales).into_data();
            }
            assert_all_close(
                &kernel,
                &composed,
                &format!("{case}: R={count} w={width} C={columns}"),
            );
        }
    }

    /// A state's projection (`[2, 7, w]`, read as its rows) with two other consumers of the
    /// state, one created before it (its gradient arrives after the projection's backward) and
    /// one after (its gradient is the so-far that the kernel adds to): the state's gradient
    /// and the weights' equal the composed projection's.
    #[test]
    fn state_projection_adds_the_gradient_so_far() {
        let device = wgpu();
        let (width, columns) = (40, 5);
        let scale = RowScale::rms(width, 1e-6);
        let state = random([2 * 7, width], 1, &device).reshape([2, 7, width]);
        let weights = random([width, columns], 2, &device).reshape([1, width, columns]);
        let probe = random([2 * 7, columns], 3, &device).reshape([2, 7, columns]);
        let earlier = random([2 * 7, width], 4, &device).reshape([2, 7, width]);
        let later = random([2 * 7, width], 5, &device).reshape([2, 7, width]);
        let run = |kernel: bool| {
            values_and_gradients(&[state.clone(), weights.clone()], &probe, |x| {
                let state = x[0].clone();
                let weights: Tensor<2> = x[1].clone().reshape([width, columns]);
                let before = (state.clone() * earlier.clone()).sum();
                let projected = if kernel {
                    assert!(super::projects(&state, &weights));
                    super::state_projection(state.clone(), weights, scale)
                } else {
                    crate::backend::on_rows(state.clone(), |rows| {
                        composed_normed_projection(rows, weights, scale)
                    })
                };
                let after = (state * later.clone()).sum();
                projected + (before + after).reshape([1, 1, 1])
            })
        };
        assert_all_close(&run(true), &run(false), "state projection");
    }

    /// The projection in f16 sums in f32: its value and both gradients over rows of 3072
    /// entries (sums of squares and `x W`) and 128 rows (`∂W`).
    #[test]
    fn half_precision_projections_sum_in_f32() {
        let device = wgpu();
        let (count, width, columns) = (128, 3072, 24);
        let scale = RowScale {
            numerator: (width as f64).sqrt(),
            offset: 1e-6,
            floor: 0.0,
            root_offset: 0.0,
        };
        // Offset entries, so that the sums grow large against each term.
        let rows = random([count, width], 2, &device) + 1.0;
        let weights = random([width, columns], 3, &device) + 0.5;
        let probe = random([count, columns], 4, &device) + 0.5;
        crate::test_util::assert_half_sums_in_f32("projection", |dtype, kernels| {
            let inputs = [rows.clone().cast(dtype), weights.clone().cast(dtype)];
            let probe = probe.clone().cast(dtype);
            values_and_gradients(&inputs, &probe, |x| {
                if kernels {
                    projection(x[0].clone(), x[1].clone(), scale)
                } else {
                    composed_normed_projection(x[0].clone(), x[1].clone(), scale)
                }
            })
        });
    }

    /// The mixing kernels against the composed tensor ops on wgpu, forward and every gradient:
    /// with and without `β h`, connections per token and shared by every token (whose
    /// gradients sum over the tokens), connections read as rows of transposed matrices (as the
    /// multi-stream connectivities hand them over; the rows not read get a zero gradient),
    /// several views (frac-connections), widths below and above the cube's units.
    #[test]
    fn mix_kernels_match_the_composed_operations() {
        let device = wgpu();
        for (tokens, rows, count, width, views, per_token, with_addend) in [
            (37, 4, 4, 100, 1, true, true),
            (37, 1, 4, 100, 1, true, false),
            (5, 4, 4, 3, 1, false, true),
            (16, 8, 8, 70, 2, true, true),
            (9, 2, 8, 33, 2, false, false),
            (3, 4, 4, 256, 4, true, true),
        ] {
            let leading = if per_token { tokens } else { 1 };
            // Stored as the connectivities store it, `[T | 1, U, ·]`, viewed transposed; the
            // `R` rows mixed lie between one row before and one after, which get no gradient.
            let weights = random([leading, count, rows + 2], 5, &device).swap_dims(1, 2);
            let units = random([tokens, count, width], 6, &device);
            let beta = random([leading, rows, 1], 7, &device);
            let branch = random([tokens, views, width], 8, &device);
            let probe = random([tokens, rows, width], 9, &device);
            let case =
                format!("T={tokens} R={rows} U={count} w={width} V={views} β h: {with_addend}");
            let run = |kernels: bool| {
                let op = |x: Vec<Tensor<3>>| {
                    let addend = with_addend.then(|| (x[2].clone(), x[3].clone()));
                    let read = MatrixRows {
                        matrices: x[0].clone(),
                        first: 1,
                        count: rows,
                    };
                    if kernels {
                        let addend = addend.map(|(beta, branch)| (Gains::Own(beta), branch));
                        mix(read, x[1].clone(), addend, 0)
                    } else {
                        composed_mix(read.taken(), x[1].clone(), addend)
                    }
                };
                if with_addend {
                    let inputs = [weights.clone(), units.clone(), beta.clone(), branch.clone()];
                    values_and_gradients(&inputs, &probe, op)
                } else {
                    values_and_gradients(&[weights.clone(), units.clone()], &probe, op)
                }
            };
            assert_all_close(&run(true), &run(false), &case);
        }
    }

    /// The mixes in f16 sum in f32: `∂A` and `∂β` over a width of 2¹⁸, 4096 products a unit
    /// at 64 units a cube. Kept in f16, a unit's sum of like-signed terms stops growing once
    /// its spacing passes twice a term (2048 terms). The composed reference runs on Flex:
    /// lavapipe stops a shader's loops after 65535 iterations in all, which Burn's reductions
    /// over rows this long can reach.
    #[test]
    fn half_precision_mixes_sum_in_f32() {
        use crate::test_util::fixed_normal;
        let (tokens, rows, count, width) = (2, 4, 4, 1 << 18);
        let flex = Device::flex().autodiff();
        let draw = |shape: [usize; 3], mean: f64, std: f64, seed: u64| {
            fixed_normal(shape, std, seed, &flex) + mean
        };
        let weights = draw([tokens, count, rows], 0.5, 0.2, 5).swap_dims(1, 2);
        let units = draw([tokens, count, width], 1.0, 0.3, 6);
        let beta = draw([tokens, rows, 1], 0.5, 0.2, 7);
        let branch = draw([tokens, 1, width], 1.0, 0.3, 8);
        // Small, so that the sums over the width stay inside f16's range.
        let probe = draw([tokens, rows, width], 1e-3, 3e-4, 9);
        crate::test_util::assert_half_sums_in_f32("stream mix", |dtype, kernels| {
            let device = if kernels { wgpu() } else { flex.clone() };
            let on = |x: &Tensor<3>| Tensor::<3>::from_data(x.to_data(), &device).cast(dtype);
            let inputs = [&weights, &units, &beta, &branch].map(on);
            values_and_gradients(&inputs, &on(&probe), |x| {
                let read = MatrixRows {
                    matrices: x[0].clone(),
                    first: 0,
                    count: rows,
                };
                if kernels {
                    let addend = (Gains::Own(x[2].clone()), x[3].clone());
                    mix(read, x[1].clone(), Some(addend), 0)
                } else {
                    let addend = (x[2].clone(), x[3].clone());
                    composed_mix(read.taken(), x[1].clone(), Some(addend))
                }
            })
        });
    }

    /// `β` read as the last row of the mixing's matrices (a layer's connections made as one
    /// table `[T, V + U + 1, U]`), against the composed ops on that row taken out: values and
    /// the gradients of the table (`β`'s row included), the units and the branch.
    #[test]
    fn gains_read_from_the_table_match_the_composed_operations() {
        let device = wgpu();
        for (tokens, count, width, views) in [(37, 4, 100, 1), (6, 8, 33, 2), (3, 1, 256, 1)] {
            let table = random([tokens, views + count + 1, count], 10, &device);
            let units = random([tokens, count, width], 11, &device);
            let branch = random([tokens, views, width], 12, &device);
            let probe = random([tokens, count, width], 13, &device);
            let run = |kernels: bool| {
                values_and_gradients(
                    &[table.clone(), units.clone(), branch.clone()],
                    &probe,
                    |x| {
                        let read = MatrixRows {
                            matrices: x[0].clone(),
                            first: views,
                            count,
                        };
                        if kernels {
                            let addend = (Gains::Row(views + count), x[2].clone());
                            mix(read, x[1].clone(), Some(addend), 0)
                        } else {
                            let beta = x[0].clone().narrow(1, views + count, 1).swap_dims(1, 2);
                            composed_mix(read.taken(), x[1].clone(), Some((beta, x[2].clone())))
                        }
                    },
                )
            };
            let case = format!("T={tokens} U={count} w={width} V={views}");
            assert_all_close(&run(true), &run(false), &case);
        }
    }

    /// A pass over more units than the kernels take is composed, chosen once for the pass; so is
    /// a pass on a CPU backend.
    #[test]
    fn passes_the_kernels_cannot_take_are_composed() {
        let device = wgpu();
        let units = |count: usize, device: &Device| Tensor::<3>::zeros([2, count, 4], device);
        assert_eq!(
            UnitOps::for_units(&units(MAX_UNITS, &device)),
            UnitOps::Kernels
        );
        assert_eq!(
            UnitOps::for_units(&units(MAX_UNITS + 1, &device)),
            UnitOps::Composed
        );
        #[cfg(feature = "ndarray")]
        {
            let ndarray = device_named("ndarray");
            assert_eq!(UnitOps::for_units(&units(4, &ndarray)), UnitOps::Composed);
        }
    }

    #[cfg(feature = "ndarray")]
    fn device_named(name: &str) -> Device {
        device(name).expect("compiled in")
    }
}
