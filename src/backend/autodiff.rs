//! The autodiff side that the fused ops share: the tracked-or-untracked forward with every
//! parent checkpointed, and the first-order backward ops as constants to the graph.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::ops::{Backward, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend};

/// A fused op under autodiff: `forward` on the inner backend's `parents`; where a parent needs a
/// gradient, `op` is recorded with the state that `state` makes from the checkpointed parents
/// and the output.
pub(super) fn tracked_op<B, C, Op, const N: usize>(
    op: Op,
    parents: [FloatTensor<Autodiff<B, C>>; N],
    forward: impl FnOnce([FloatTensor<B>; N]) -> FloatTensor<B>,
    state: impl FnOnce([NodeId; N], &FloatTensor<B>) -> Op::State,
) -> FloatTensor<Autodiff<B, C>>
where
    B: Backend,
    C: CheckpointStrategy,
    Op: Backward<B, N>,
{
    let forward = |parents| (forward(parents), ());
    tracked_op_saving::<B, C, Op, (), N>(op, parents, forward, |nodes, output, ()| {
        state(nodes, output)
    })
    .0
}

/// [`tracked_op`] for a forward that also makes something its backward takes back (`saved`,
/// handed to `state` where tracked): `(output, saved)`, the saved part untracked.
pub(super) fn tracked_op_saving<B, C, Op, X, const N: usize>(
    op: Op,
    parents: [FloatTensor<Autodiff<B, C>>; N],
    forward: impl FnOnce([FloatTensor<B>; N]) -> (FloatTensor<B>, X),
    state: impl FnOnce([NodeId; N], &FloatTensor<B>, X) -> Op::State,
) -> (FloatTensor<Autodiff<B, C>>, X)
where
    B: Backend,
    C: CheckpointStrategy,
    Op: Backward<B, N>,
    X: Clone,
{
    let nodes = parents.each_ref().map(|parent| parent.node());
    match op.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(mut prep) => {
            let checkpoints = parents.each_ref().map(|parent| prep.checkpoint(parent));
            let (output, saved) = forward(parents.map(|parent| parent.into_primitive()));
            let state = state(checkpoints, &output, saved.clone());
            (prep.finish(state, output), saved)
        }
        OpsKind::UnTracked(prep) => {
            let (output, saved) = forward(parents.map(|p| p.into_primitive()));
            (prep.finish(output), saved)
        }
    }
}

/// A tensor computed on the inner backend as a constant to the graph: what the first-order
/// `*_backward` ops return (the fused ops are not differentiable twice).
pub(super) fn constant<B: Backend, C: CheckpointStrategy>(
    tensor: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    <Autodiff<B, C> as AutodiffBackend>::from_inner(tensor)
}

/// `tensor` in `dtype`: a cast kernel only where the float types differ (a gradient computed in
/// the streams' type, for parameters kept in another).
pub(super) fn cast_to<B: Backend>(
    tensor: FloatTensor<B>,
    dtype: burn::tensor::DType,
) -> FloatTensor<B> {
    use burn::backend::TensorMetadata;
    if tensor.dtype() == dtype {
        tensor
    } else {
        B::float_cast(tensor, dtype.into())
    }
}
