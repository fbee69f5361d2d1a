//! The autodiff side that the fused ops share: the tracked-or-untracked forward with every
//! parent checkpointed, and the first-order backward ops as constants to the graph.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
#[cfg(feature = "cube-kernels")]
use burn::backend::autodiff::grads::Gradients;
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
    let every = std::array::from_fn(|index| index);
    tracked_op_keeping::<B, C, Op, X, N, N>(op, parents, every, forward, state)
}

/// [`tracked_op_saving`] checkpointing only the parents at `kept` (`state` gets their node ids
/// in that order): a parent the backward never reads is not kept alive until it runs.
pub(super) fn tracked_op_keeping<B, C, Op, X, const N: usize, const K: usize>(
    op: Op,
    parents: [FloatTensor<Autodiff<B, C>>; N],
    kept: [usize; K],
    forward: impl FnOnce([FloatTensor<B>; N]) -> (FloatTensor<B>, X),
    state: impl FnOnce([NodeId; K], &FloatTensor<B>, X) -> Op::State,
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
            let checkpoints = kept.map(|index| prep.checkpoint(&parents[index]));
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

/// For an op over up to 32 states whose backward writes each state's gradient as *its gradient
/// so far plus the op's term* (no add per state follows): takes the gradient so far of each
/// state with `tracked[k]` out of `grads`. Returns one tensor per state (`fill` where there is
/// none), the mask of states that had one, and the mask of the tracked states.
#[cfg(feature = "cube-kernels")]
pub(super) fn take_so_far<B: Backend>(
    grads: &mut Gradients,
    states: &[FloatTensor<Autodiff<B>>],
    tracked: &[bool],
    fill: &FloatTensor<B>,
) -> (Vec<FloatTensor<B>>, u32, u32) {
    let mut so_far_mask = 0u32;
    let mut tracked_mask = 0u32;
    let so_far = states
        .iter()
        .zip(tracked)
        .enumerate()
        .map(|(k, (state, &tracked))| {
            let taken = if tracked {
                tracked_mask |= 1 << k;
                grads.remove::<B>(state)
            } else {
                None
            };
            if taken.is_some() {
                so_far_mask |= 1 << k;
            }
            taken.unwrap_or_else(|| fill.clone())
        })
        .collect();
    (so_far, so_far_mask, tracked_mask)
}

/// Registers each computed state gradient with its state where `tracked` (the other side of
/// [`take_so_far`]).
#[cfg(feature = "cube-kernels")]
pub(super) fn register_states<B: Backend>(
    grads: &mut Gradients,
    states: &[FloatTensor<Autodiff<B>>],
    tracked: &[bool],
    computed: impl IntoIterator<Item = FloatTensor<B>>,
) {
    for ((state, &tracked), grad) in states.iter().zip(tracked).zip(computed) {
        if tracked {
            grads.register::<B>(state.node().id(), grad);
        }
    }
}

/// `values` padded to eight with `fill`: the slots of an op over up to eight states.
#[cfg(feature = "cube-kernels")]
pub(super) fn eight_slots<T: Clone>(mut values: Vec<T>, fill: &T) -> [T; 8] {
    values.resize(8, fill.clone());
    match values.try_into() {
        Ok(slots) => slots,
        Err(_) => unreachable!("resized to eight"),
    }
}

/// The inputs of one fused op over any number of tensors on their way to it: a backend
/// extension takes a fixed number of tensors, so each goes in through a `*_stage` op of the
/// extension (as the backend's own tensor, autodiff node included) and the op takes them all.
#[cfg(feature = "flex")]
#[derive(Clone, Default)]
pub(crate) struct Staged(std::sync::Arc<std::sync::Mutex<Vec<Box<dyn std::any::Any + Send>>>>);

#[cfg(feature = "flex")]
impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let count = self.0.lock().map_or(0, |states| states.len());
        f.debug_struct("Staged").field("states", &count).finish()
    }
}

#[cfg(feature = "flex")]
impl Staged {
    pub(super) fn of<T: std::any::Any + Send>(states: Vec<T>) -> Self {
        let staged = Self::default();
        for state in states {
            staged.push(state);
        }
        staged
    }

    pub(super) fn push<T: std::any::Any + Send>(&self, state: T) {
        self.0.lock().expect("staged states").push(Box::new(state));
    }

    /// The states, in the order staged, as the backend's tensors.
    pub(super) fn take<T: std::any::Any>(&self) -> Vec<T> {
        std::mem::take(&mut *self.0.lock().expect("staged states"))
            .into_iter()
            .map(|state| {
                *state
                    .downcast::<T>()
                    .expect("states of the mixture's backend")
            })
            .collect()
    }
}
