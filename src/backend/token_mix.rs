//! A weighted sum of states with weights per token, as one op forward and one backward on Flex
//! (f32, f64), as a chain of ops of up to eight states each on the CubeCL backends (a kernel
//! each way per eight states, see [`parts`]); the composed tensor-op form elsewhere. AttnRes's
//! and MUDD's mixtures.
//!
//! For weights `W` `[..., K]` and states `x_0 … x_{K−1}` `[..., d]` (rows `t`):
//!
//! ```text
//! m[t] = Σ_k W[t, k] x_k[t]
//!
//! ∂W[t, k] = ⟨∂m[t], x_k[t]⟩          ∂x_k[t] = W[t, k] ∂m[t]
//! ```
//!
//! Composed, every term is a broadcast product and an add forward (two full-size passes), and
//! backward a scaled copy, a product with its row reduction, the narrow's scatter into `∂W`, and
//! autodiff's add of `∂x_k` into the state's gradient so far. Here a mixture reads its states
//! once forward, row by row with the row's sums in registers, and writes the output once.
//! Backward, it takes each state's gradient so far out of autodiff's container and adds
//! `W[:, k] ∂m` to it in the op that computes `∂W`: no add per state and mixture follows. The
//! sum is written into the gradient so far itself where the op holds the only reference to its
//! buffer (typically one an earlier mixture's backward wrote: a state read by `L` mixtures is
//! written fresh once and updated in place `L − 1` times), and into a fresh buffer where the
//! buffer is shared (autodiff hands one gradient to several parents as clones of one buffer),
//! which is then only read.
//!
//! Where a state's whole gradient is written by a later backward that reads the state anyway
//! (AttnRes's sources: their logits' projection, see [`token_mix_leaving`]), the backward leaves
//! `(W[:, k], ∂m)` for it instead, and that pass adds `Σ W[:, k] ∂m` over every mixture that read
//! the state: the state's gradient is written once rather than read and written per mixture.
//!
//! Under autodiff the op's parents are `W` and every state (padded to a fixed count by repeating
//! `W`, which gets no gradient through the padding), so Burn orders its backward like any op's
//! and a state's gradient so far is complete except for consumers that run later, whose parts
//! autodiff adds as usual. The states are taken as they are (no reshape, which would give each
//! mixture a node of its own). At most [`MAX_STATES`] states of one shape; anything else
//! composes. Not differentiable twice.

use burn::prelude::*;

/// The most states one fused mixture takes (its parents, with `W`, fill an array of 64).
#[cfg(feature = "flex")]
pub(crate) const MAX_STATES: usize = 63;

/// `Σ_k weights[..., k] states[k]` for weights `[..., K]` and `K` states `[..., d]` of one
/// shape: one fused op on Flex (f32, f64; at most [`MAX_STATES`] states), tensor ops elsewhere.
pub(crate) fn token_mix<const D: usize>(weights: Tensor<D>, states: Vec<Tensor<D>>) -> Tensor<D> {
    token_mix_leaving(weights, states, Vec::new())
}

/// [`token_mix`] where state `k` may have a gradient slot `gradients[k]` (missing entries:
/// none), claimed by a projection of that state created before this mixture and whose output
/// this mixture's weights are computed from (so autodiff runs its backward after this
/// mixture's). The fused Flex op's backward then leaves `(W[:, k], ∂m)` there instead of
/// adding `W[:, k] ∂m` to the state's gradient so far: the projection writes the state's
/// gradient once for every mixture that read it, where each mixture would read and write it.
/// An unclaimed slot, or one whose projection ran already, is written as usual.
pub(crate) fn token_mix_leaving<const D: usize>(
    weights: Tensor<D>,
    states: Vec<Tensor<D>>,
    gradients: Vec<Option<super::UnitsGradient>>,
) -> Tensor<D> {
    let count = states.len();
    assert!(count > 0, "token mix: no states");
    assert_eq!(
        weights.dims()[D - 1],
        count,
        "token mix: one weight per state"
    );
    #[cfg(any(feature = "flex", feature = "cube-kernels"))]
    {
        let same_shapes = same_shapes(&weights, &states);
        #[cfg(feature = "flex")]
        if count <= MAX_STATES && same_shapes && super::has_fused_flex_ops(&states[0]) {
            return flex::token_mix(weights, states, gradients);
        }
        #[cfg(feature = "cube-kernels")]
        if same_shapes && super::cube_kernels_take(&states[0]) {
            return parts::token_mix(weights, 0, states);
        }
    }
    let _ = gradients;
    composed(weights, states)
}

/// [`token_mix`] with the weights in the columns `first..first + K` of a wider table
/// `[..., C]` (MUDD's ways side by side). The CubeCL kernels read those columns in place and
/// their backward writes the table's gradient whole (zero outside the columns), so no narrow
/// is taken: a narrow's backward is a zero fill and a slice-assign of the table. Elsewhere the
/// columns are narrowed (not where they are the whole table).
pub(crate) fn token_mix_columns<const D: usize>(
    table: Tensor<D>,
    first: usize,
    states: Vec<Tensor<D>>,
) -> Tensor<D> {
    let count = states.len();
    let columns = table.dims()[D - 1];
    assert!(
        count > 0 && first + count <= columns,
        "token mix: columns {first}..{} of {columns}",
        first + count
    );
    #[cfg(feature = "cube-kernels")]
    if same_shapes(&table, &states) && super::cube_kernels_take(&states[0]) {
        return parts::token_mix(table, first, states);
    }
    token_mix(super::narrow_or_whole(table, D - 1, first, count), states)
}

/// Whether the fused forms take these: every state of one shape, the weights over the same
/// leading axes, one float type.
#[cfg(any(feature = "flex", feature = "cube-kernels"))]
fn same_shapes<const D: usize>(weights: &Tensor<D>, states: &[Tensor<D>]) -> bool {
    let shape = states[0].dims();
    states.iter().all(|state| state.dims() == shape)
        && weights.dims()[..D - 1] == shape[..D - 1]
        && weights.dtype() == states[0].dtype()
}

/// [`token_mix`] as tensor ops: a broadcast product per state, summed.
pub(crate) fn composed<const D: usize>(weights: Tensor<D>, states: Vec<Tensor<D>>) -> Tensor<D> {
    states
        .into_iter()
        .enumerate()
        .map(|(k, state)| weights.clone().narrow(D - 1, k, 1) * state)
        .reduce(|sum, term| sum + term)
        .expect("at least one state")
}

#[cfg(feature = "cube-kernels")]
mod cube;
#[cfg(feature = "cube-kernels")]
use parts::{PART, TokenMixPartBackend};

/// The mixture on the CubeCL backends as a chain of parts of up to [`PART`] states, each one op
/// (`m ← m + Σ_{k ∈ part} W[:, k] x_k`) with its own backward, which writes every state's
/// gradient so far plus its term in the pass that computes `∂W` (as on Flex). A part has a
/// fixed number of tensor inputs, as Burn's fusion needs; a mixture of `K` states is
/// `⌈K / 8⌉` kernels forward and as many backward (fewer states a launch where the device
/// binds fewer buffers). `∂W` comes from each part whole, zero outside the part's columns.
#[cfg(feature = "cube-kernels")]
mod parts {
    use burn::backend::autodiff::Autodiff;
    use burn::backend::autodiff::checkpoint::base::Checkpointer;
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
    use burn::backend::fusion::custom::TensorSpec;
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, Dispatch, backend_extension};
    use burn::prelude::*;

    use super::super::autodiff::{constant, eight_slots, register_states, take_so_far};
    use super::super::cube_launch::placeholder_spec;

    /// States per part.
    pub(crate) const PART: usize = 8;

    /// The spec of state `k`'s gradient: its own where wanted, else a placeholder.
    fn state_grad_spec(state: &TensorSpec, wanted: u32, k: usize) -> TensorSpec {
        if wanted >> k & 1 == 1 {
            state.clone()
        } else {
            placeholder_spec(state)
        }
    }

    /// A part of the mixture (see [`parts`](self)).
    #[backend_extension(
        Cube: cfg(feature = "cube-kernels"),
        Fusion: cfg(feature = "cube-kernels"),
        Autodiff
    )]
    pub(crate) trait TokenMixPartBackend: Backend {
        /// `(sum) + Σ_{k < count} W[..., first + k] s_k` for `W [..., K]` and states
        /// `[..., d]`; the slots past `count` are unread (the caller repeats `W` there), and so is
        /// `accumulator` unless `accumulate`.
        #[fusion(meta = |_, _, s0, _, _, _, _, _, _, _, _, _, _| s0.clone())]
        #[allow(clippy::too_many_arguments)]
        fn token_mix_part(
            weights: FloatTensor<Self>,
            accumulator: FloatTensor<Self>,
            s0: FloatTensor<Self>,
            s1: FloatTensor<Self>,
            s2: FloatTensor<Self>,
            s3: FloatTensor<Self>,
            s4: FloatTensor<Self>,
            s5: FloatTensor<Self>,
            s6: FloatTensor<Self>,
            s7: FloatTensor<Self>,
            first: usize,
            count: usize,
            accumulate: bool,
        ) -> FloatTensor<Self>;

        /// `(∂s_0, …, ∂s_7, ∂W)` of a part given `grad = ∂m`: `∂s_k = f_k + W[..., first + k] ∂m`
        /// where bit `k` of `wanted` is set (`f_k`, the gradient so far, only where bit `k` of
        /// `sofar` is set), else a `[1]` placeholder; `∂W[..., first + k] = ⟨∂m, s_k⟩`, zero in
        /// the columns outside the part.
        #[fusion(meta = |weights, _, s0, s1, s2, s3, s4, s5, s6, s7, _, _, _, _, _, _, _, _, _, _,
            _, wanted| (
            state_grad_spec(s0, *wanted, 0),
            state_grad_spec(s1, *wanted, 1),
            state_grad_spec(s2, *wanted, 2),
            state_grad_spec(s3, *wanted, 3),
            state_grad_spec(s4, *wanted, 4),
            state_grad_spec(s5, *wanted, 5),
            state_grad_spec(s6, *wanted, 6),
            state_grad_spec(s7, *wanted, 7),
            weights.clone(),
        ))]
        #[allow(clippy::too_many_arguments, clippy::type_complexity)]
        fn token_mix_part_backward(
            weights: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            s0: FloatTensor<Self>,
            s1: FloatTensor<Self>,
            s2: FloatTensor<Self>,
            s3: FloatTensor<Self>,
            s4: FloatTensor<Self>,
            s5: FloatTensor<Self>,
            s6: FloatTensor<Self>,
            s7: FloatTensor<Self>,
            f0: FloatTensor<Self>,
            f1: FloatTensor<Self>,
            f2: FloatTensor<Self>,
            f3: FloatTensor<Self>,
            f4: FloatTensor<Self>,
            f5: FloatTensor<Self>,
            f6: FloatTensor<Self>,
            f7: FloatTensor<Self>,
            first: usize,
            count: usize,
            sofar: u32,
            wanted: u32,
        ) -> (
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
        );
    }

    /// The mixture as a chain of parts (see [`parts`](self)), its weights in the columns
    /// `first..first + K` of `weights`.
    pub(super) fn token_mix<const D: usize>(
        weights: Tensor<D>,
        first: usize,
        states: Vec<Tensor<D>>,
    ) -> Tensor<D> {
        let mut sum: Option<Tensor<D>> = None;
        for (part, chunk) in states.chunks(PART).enumerate() {
            let slot = |k: usize| chunk.get(k).unwrap_or(&weights).clone().into_dispatch();
            let accumulator = sum.clone().unwrap_or_else(|| weights.clone());
            let mixed = <Dispatch as TokenMixPartBackend>::token_mix_part(
                weights.clone().into_dispatch(),
                accumulator.into_dispatch(),
                slot(0),
                slot(1),
                slot(2),
                slot(3),
                slot(4),
                slot(5),
                slot(6),
                slot(7),
                first + part * PART,
                chunk.len(),
                sum.is_some(),
            );
            sum = Some(Tensor::from_dispatch(mixed));
        }
        sum.expect("at least one state")
    }

    /// A part under autodiff: parents `[W, sum, s_0, …, s_7]` (`W` repeated in the unused).
    #[derive(Debug)]
    struct FusedPart;

    /// What a part's backward keeps: `W` and its states, their autodiff tensors (whose
    /// gradients so far it takes over), where its columns start, whether it adds to a sum.
    #[derive(Debug, Clone)]
    struct Kept<B: Backend> {
        weights: FloatTensor<B>,
        states: Vec<FloatTensor<B>>,
        nodes: Vec<FloatTensor<Autodiff<B>>>,
        first: usize,
        accumulate: bool,
    }

    impl<B: TokenMixPartBackend> Backward<B, 10> for FusedPart {
        type State = Kept<B>;

        fn backward(
            self,
            ops: Ops<Self::State, 10>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let Kept {
                weights,
                states,
                nodes,
                first,
                accumulate,
            } = ops.state;
            let count = states.len();
            let grad = grads.consume::<B>(&ops.node);
            let tracked: Vec<bool> = (0..count).map(|k| ops.parents[2 + k].is_some()).collect();
            // Each tracked state's gradient so far leaves the container and comes back with
            // this part's term added in the same pass (as on Flex).
            let (sofar, sofar_mask, wanted) = take_so_far::<B>(grads, &nodes, &tracked, &grad);
            let [s0, s1, s2, s3, s4, s5, s6, s7] = eight_slots(states, &grad);
            let [f0, f1, f2, f3, f4, f5, f6, f7] = eight_slots(sofar, &grad);
            let (g0, g1, g2, g3, g4, g5, g6, g7, weight_grad) = B::token_mix_part_backward(
                weights,
                grad.clone(),
                s0,
                s1,
                s2,
                s3,
                s4,
                s5,
                s6,
                s7,
                f0,
                f1,
                f2,
                f3,
                f4,
                f5,
                f6,
                f7,
                first,
                count,
                sofar_mask,
                wanted,
            );
            register_states::<B>(grads, &nodes, &tracked, [g0, g1, g2, g3, g4, g5, g6, g7]);
            if let Some(parent) = &ops.parents[0] {
                grads.register::<B>(parent.id, weight_grad);
            }
            if accumulate && let Some(parent) = &ops.parents[1] {
                grads.register::<B>(parent.id, grad);
            }
        }
    }

    impl<B: TokenMixPartBackend, C: CheckpointStrategy> TokenMixPartBackend for Autodiff<B, C> {
        fn token_mix_part(
            weights: FloatTensor<Self>,
            accumulator: FloatTensor<Self>,
            s0: FloatTensor<Self>,
            s1: FloatTensor<Self>,
            s2: FloatTensor<Self>,
            s3: FloatTensor<Self>,
            s4: FloatTensor<Self>,
            s5: FloatTensor<Self>,
            s6: FloatTensor<Self>,
            s7: FloatTensor<Self>,
            first: usize,
            count: usize,
            accumulate: bool,
        ) -> FloatTensor<Self> {
            let parents = [weights, accumulator, s0, s1, s2, s3, s4, s5, s6, s7];
            let nodes = parents.each_ref().map(|parent| parent.node());
            let kept_nodes: Vec<FloatTensor<Self>> = parents[2..2 + count].to_vec();
            let [w, a, s0, s1, s2, s3, s4, s5, s6, s7] =
                parents.map(|parent| parent.into_primitive());
            let mixed = |w, a, s0, s1, s2, s3, s4, s5, s6, s7| {
                B::token_mix_part(
                    w, a, s0, s1, s2, s3, s4, s5, s6, s7, first, count, accumulate,
                )
            };
            match FusedPart.prepare::<C>(nodes).compute_bound().stateful() {
                OpsKind::Tracked(prep) => {
                    let kept = Kept {
                        weights: w.clone(),
                        states: [&s0, &s1, &s2, &s3, &s4, &s5, &s6, &s7][..count]
                            .iter()
                            .map(|state| (*state).clone())
                            .collect(),
                        nodes: kept_nodes,
                        first,
                        accumulate,
                    };
                    prep.finish(kept, mixed(w, a, s0, s1, s2, s3, s4, s5, s6, s7))
                }
                OpsKind::UnTracked(prep) => {
                    prep.finish(mixed(w, a, s0, s1, s2, s3, s4, s5, s6, s7))
                }
            }
        }

        fn token_mix_part_backward(
            weights: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            s0: FloatTensor<Self>,
            s1: FloatTensor<Self>,
            s2: FloatTensor<Self>,
            s3: FloatTensor<Self>,
            s4: FloatTensor<Self>,
            s5: FloatTensor<Self>,
            s6: FloatTensor<Self>,
            s7: FloatTensor<Self>,
            f0: FloatTensor<Self>,
            f1: FloatTensor<Self>,
            f2: FloatTensor<Self>,
            f3: FloatTensor<Self>,
            f4: FloatTensor<Self>,
            f5: FloatTensor<Self>,
            f6: FloatTensor<Self>,
            f7: FloatTensor<Self>,
            first: usize,
            count: usize,
            sofar: u32,
            wanted: u32,
        ) -> (
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
        ) {
            let inner = |tensor: FloatTensor<Self>| tensor.into_primitive();
            // First-order only: the gradients are constants to the graph.
            let (a, b, c, d, e, f, g, h, w) = B::token_mix_part_backward(
                inner(weights),
                inner(grad),
                inner(s0),
                inner(s1),
                inner(s2),
                inner(s3),
                inner(s4),
                inner(s5),
                inner(s6),
                inner(s7),
                inner(f0),
                inner(f1),
                inner(f2),
                inner(f3),
                inner(f4),
                inner(f5),
                inner(f6),
                inner(f7),
                first,
                count,
                sofar,
                wanted,
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
                constant::<B, C>(w),
            )
        }
    }
}

#[cfg(feature = "flex")]
mod flex {
    use std::borrow::Cow;
    use std::mem::MaybeUninit;

    use burn::backend::autodiff::Autodiff;
    use burn::backend::autodiff::checkpoint::base::Checkpointer;
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, Dispatch, backend_extension};
    use burn::prelude::*;
    use burn::tensor::DType;
    use burn_flex::{Flex, FlexTensor};
    use rayon::prelude::*;

    use super::super::UnitsGradient;
    use super::super::autodiff::{Staged, constant};
    use super::super::flex_kernels::{
        Scalar, add_weighted_sum, axpy, contiguous, dots, row_major_from_start, rows_and_width,
        rows_per_task, tensor, token_row, unwritten, values, write_axpy, written, zeroed,
    };
    use super::MAX_STATES;

    /// The mixture as one op forward and one backward (see the [module docs](super)).
    #[backend_extension(Flex: cfg(feature = "flex"), Autodiff)]
    pub(crate) trait TokenMixBackend: Backend {
        /// Adds `state` to `staged`; returns it unchanged.
        fn token_mix_stage(state: FloatTensor<Self>, staged: Staged) -> FloatTensor<Self>;

        /// `m[t] = Σ_k W[t, k] x_k[t]` for `W` `[T, K]` and the `K` staged states `[T, d]`;
        /// under autodiff, the backward may leave state `k`'s term in `gradients[k]`.
        fn token_mix(
            weights: FloatTensor<Self>,
            staged: Staged,
            gradients: Vec<Option<UnitsGradient>>,
        ) -> FloatTensor<Self>;

        /// `[∂x_0, …, ∂x_{K−1}, ∂W]` for the gradient `∂m`. `sofar` stages one
        /// `Option<Option<FloatTensor>>` per state: `None` where `x_k` needs no gradient, else
        /// its gradient so far (if any), which `∂x_k` includes (updated in place where the op
        /// owns it); `∂x_k` is an empty tensor where `x_k` needs none. Each `Some` in `leave`
        /// (`x_k` needs none here) takes `(W[:, k], ∂m)` as a `[T, 1, 1]` and a `[T, 1, d]`
        /// part of `x_k`'s gradient.
        fn token_mix_backward(
            weights: FloatTensor<Self>,
            staged: Staged,
            grad: FloatTensor<Self>,
            sofar: Staged,
            leave: Vec<Option<UnitsGradient>>,
        ) -> Vec<FloatTensor<Self>>;
    }

    /// The fused mixture of `[..., K]` weights and `[..., d]` states, with the states'
    /// gradient slots (see [`token_mix_leaving`](super::token_mix_leaving)).
    pub(super) fn token_mix<const D: usize>(
        weights: Tensor<D>,
        states: Vec<Tensor<D>>,
        gradients: Vec<Option<UnitsGradient>>,
    ) -> Tensor<D> {
        // No reshape here: a state's gradient so far is found by its autodiff node, which a
        // reshape would replace by a new one per mixture. The op reads `[..., d]` as rows.
        let staged = Staged::default();
        for state in states {
            let _ = <Dispatch as TokenMixBackend>::token_mix_stage(
                state.into_dispatch(),
                staged.clone(),
            );
        }
        let mixed =
            <Dispatch as TokenMixBackend>::token_mix(weights.into_dispatch(), staged, gradients);
        Tensor::from_dispatch(mixed)
    }

    fn forward<E: Scalar>(weights: &FlexTensor, states: &[FlexTensor]) -> FlexTensor {
        let (tokens, width) = rows_and_width(&states[0]);
        let shape = states[0].layout().shape().clone();
        let count = states.len();
        let weights = values::<E>(weights);
        let states: Vec<Cow<'_, [E]>> = states.iter().map(values::<E>).collect();
        let rows = rows_per_task(width);
        let mut out = unwritten::<E>(tokens * width);
        out.par_chunks_mut(rows * width)
            .enumerate()
            .for_each(|(task, chunk)| {
                let first = task * rows;
                let mut terms = Vec::with_capacity(count - 1);
                // Row by row, the row's sums held in registers across the states: the output
                // is written once, where state by state it would be read and written per state.
                for (i, out) in chunk.chunks_mut(width).enumerate() {
                    let weights = &weights[(first + i) * count..][..count];
                    let out = write_axpy(
                        out,
                        None,
                        weights[0],
                        token_row(&states[0], first + i, width),
                    );
                    if count == 1 {
                        continue;
                    }
                    terms.clear();
                    terms.extend(
                        weights[1..]
                            .iter()
                            .zip(&states[1..])
                            .map(|(&weight, state)| (weight, token_row(state, first + i, width))),
                    );
                    add_weighted_sum(out, &terms);
                }
            });
        // SAFETY: the chunks partition `out`, and each row of each was written whole.
        tensor(unsafe { written(out) }, [tokens, width]).reshape(shape)
    }

    /// Where one state's gradient goes: the gradient so far itself, updated in place, where
    /// this op holds its only reference (a buffer nothing else can read); else a fresh buffer,
    /// written as the gradient so far (if any) plus this mixture's term, so that no separate
    /// add follows and a shared buffer is only read.
    enum Target<E> {
        InPlace(FlexTensor),
        Fresh {
            sofar: Option<FlexTensor>,
            out: Vec<MaybeUninit<E>>,
        },
    }

    /// A task's rows of one target.
    enum Rows<'a, E> {
        /// The gradient so far's rows, to which the term is added.
        InPlace(&'a mut [E]),
        /// The rows of the gradient so far (if any) and the output's.
        Fresh {
            sofar: Option<&'a [E]>,
            out: &'a mut [MaybeUninit<E>],
        },
    }

    impl<E: Scalar> Target<E> {
        fn new(sofar: Option<FlexTensor>, len: usize) -> Self {
            match sofar {
                Some(sofar) if owned_whole::<E>(&sofar, len) => Self::InPlace(sofar),
                sofar => Self::Fresh {
                    sofar: sofar.map(contiguous),
                    out: unwritten::<E>(len),
                },
            }
        }

        /// The target cut into chunks of `size` elements.
        fn chunks(&mut self, size: usize) -> Vec<Rows<'_, E>> {
            match self {
                Self::InPlace(tensor) => tensor
                    .try_storage_mut::<E>()
                    .expect("an owned buffer")
                    .chunks_mut(size)
                    .map(Rows::InPlace)
                    .collect(),
                Self::Fresh {
                    sofar: Some(sofar),
                    out,
                } => {
                    let sofar = sofar.as_slice::<E>().expect("contiguous");
                    sofar[..out.len()]
                        .chunks(size)
                        .zip(out.chunks_mut(size))
                        .map(|(sofar, out)| Rows::Fresh {
                            sofar: Some(sofar),
                            out,
                        })
                        .collect()
                }
                Self::Fresh { sofar: None, out } => out
                    .chunks_mut(size)
                    .map(|out| Rows::Fresh { sofar: None, out })
                    .collect(),
            }
        }

        fn into_tensor(self, shape: [usize; 2]) -> FlexTensor {
            match self {
                Self::InPlace(tensor) => tensor.reshape(Shape::from(shape)),
                // SAFETY: the tasks' chunks partition the buffer, each written whole.
                Self::Fresh { out, .. } => tensor(unsafe { written(out) }, shape),
            }
        }
    }

    /// Whether `tensor` can take this op's term in place: its buffer held by nothing else
    /// (autodiff hands a gradient it shares between parents to each as a clone of one buffer),
    /// holding exactly its `len` elements of `E` from the first byte, in row-major order.
    fn owned_whole<E: Scalar>(tensor: &FlexTensor, len: usize) -> bool {
        tensor.is_unique()
            && tensor.dtype() == E::dtype()
            && row_major_from_start(tensor)
            && tensor.layout().num_elements() == len
            && tensor.bytes().len() == len * std::mem::size_of::<E>()
    }

    /// One parallel task of the backward pass: its rows of every target (with the state's
    /// index) and of `∂W`.
    type Task<'a, E> = (Vec<(usize, Rows<'a, E>)>, &'a mut [MaybeUninit<E>]);

    /// `∂W` and, for every state `k` with `sofar[k] = Some(g_k)` (its gradient so far, or
    /// none yet), `g_k + W[:, k] ∂m`; `[∂x_0, …, ∂x_{K−1}, ∂W]`, an empty `∂x_k` where
    /// `sofar[k]` is `None`.
    fn backward<E: Scalar>(
        weights: &FlexTensor,
        states: &[FlexTensor],
        grad: &FlexTensor,
        sofar: Vec<Option<Option<FlexTensor>>>,
    ) -> Vec<FlexTensor> {
        let (tokens, width) = rows_and_width(&states[0]);
        let shape = states[0].layout().shape().clone();
        let weight_shape = weights.layout().shape().clone();
        let count = states.len();
        let weights = values::<E>(weights);
        let grad = values::<E>(grad);
        let states: Vec<Cow<'_, [E]>> = states.iter().map(values::<E>).collect();
        let rows = rows_per_task(width);
        let mut targets: Vec<Option<Target<E>>> = sofar
            .into_iter()
            .map(|sofar| sofar.map(|sofar| Target::new(sofar, tokens * width)))
            .collect();
        let mut weight_grad = unwritten::<E>(tokens * count);
        // One task per block of rows: its rows of every target and of `∂W`.
        let mut tasks: Vec<Task<'_, E>> = weight_grad
            .chunks_mut(rows * count)
            .map(|chunk| (Vec::with_capacity(count), chunk))
            .collect();
        for (k, target) in targets.iter_mut().enumerate() {
            if let Some(target) = target {
                for (task, chunk) in tasks.iter_mut().zip(target.chunks(rows * width)) {
                    task.0.push((k, chunk));
                }
            }
        }
        tasks
            .into_par_iter()
            .enumerate()
            .for_each(|(task, (outputs, weight_chunk))| {
                let weight_chunk = zeroed(weight_chunk);
                let first = task * rows;
                // `∂W[t, :]` row by row: `∂m[t]` read once for up to eight states.
                let mut rows_of_states = Vec::with_capacity(count);
                for (i, weight_row) in weight_chunk.chunks_mut(count).enumerate() {
                    rows_of_states.clear();
                    rows_of_states.extend(
                        states
                            .iter()
                            .map(|state| token_row(state, first + i, width)),
                    );
                    dots(
                        token_row(&grad, first + i, width),
                        &rows_of_states,
                        weight_row,
                    );
                }
                // Each target's rows written once: `so far + W[t, k] ∂m[t]`.
                for (k, rows) in outputs {
                    let weight = |i: usize| weights[(first + i) * count + k];
                    match rows {
                        Rows::InPlace(sofar) => {
                            for (i, sofar) in sofar.chunks_mut(width).enumerate() {
                                axpy(sofar, weight(i), token_row(&grad, first + i, width));
                            }
                        }
                        Rows::Fresh { sofar, out } => {
                            for (i, out) in out.chunks_mut(width).enumerate() {
                                let sofar = sofar.map(|sofar| &sofar[i * width..][..width]);
                                write_axpy(
                                    out,
                                    sofar,
                                    weight(i),
                                    token_row(&grad, first + i, width),
                                );
                            }
                        }
                    }
                }
            });
        let mut grads: Vec<FlexTensor> = targets
            .into_iter()
            .map(|target| match target {
                Some(target) => target.into_tensor([tokens, width]).reshape(shape.clone()),
                None => tensor(Vec::<E>::new(), [0]),
            })
            .collect();
        // SAFETY: the tasks' chunks partition `∂W`, each zeroed before it was written.
        grads.push(tensor(unsafe { written(weight_grad) }, [tokens, count]).reshape(weight_shape));
        grads
    }

    /// Leaves `(W[:, k] [T, 1, 1], ∂m [T, 1, d])` in each slot `leave[k]`: state `k`'s part
    /// of its gradient, for the projection that writes it (a column of `T` values copied; `∂m`
    /// shared).
    fn leave_terms<E: Scalar>(
        weights: &FlexTensor,
        grad: &FlexTensor,
        leave: &[Option<UnitsGradient>],
    ) {
        if leave.iter().all(Option::is_none) {
            return;
        }
        let (tokens, width) = rows_and_width(grad);
        let count = rows_and_width(weights).1;
        let grad = contiguous(grad.clone()).reshape(Shape::from([tokens, 1, width]));
        let weights = values::<E>(weights);
        for (k, slot) in leave.iter().enumerate() {
            if let Some(slot) = slot {
                let column: Vec<E> = weights.chunks_exact(count).map(|row| row[k]).collect();
                slot.leave(tensor(column, [tokens, 1, 1]), grad.clone());
            }
        }
    }

    impl TokenMixBackend for Flex {
        fn token_mix_stage(state: FlexTensor, staged: Staged) -> FlexTensor {
            staged.push(state.clone());
            state
        }

        fn token_mix(
            weights: FlexTensor,
            staged: Staged,
            _gradients: Vec<Option<UnitsGradient>>,
        ) -> FlexTensor {
            let states = staged.take::<FlexTensor>();
            match states[0].dtype() {
                DType::F32 => forward::<f32>(&weights, &states),
                DType::F64 => forward::<f64>(&weights, &states),
                other => panic!("token mix: unsupported dtype {other:?}"),
            }
        }

        fn token_mix_backward(
            weights: FlexTensor,
            staged: Staged,
            grad: FlexTensor,
            sofar: Staged,
            leave: Vec<Option<UnitsGradient>>,
        ) -> Vec<FlexTensor> {
            let states = staged.take::<FlexTensor>();
            let sofar = sofar.take::<Option<Option<FlexTensor>>>();
            match states[0].dtype() {
                DType::F32 => {
                    leave_terms::<f32>(&weights, &grad, &leave);
                    backward::<f32>(&weights, &states, &grad, sofar)
                }
                DType::F64 => {
                    leave_terms::<f64>(&weights, &grad, &leave);
                    backward::<f64>(&weights, &states, &grad, sofar)
                }
                other => panic!("token mix: unsupported dtype {other:?}"),
            }
        }
    }

    /// The fused mixture under autodiff: parents `[W, x_0, …, x_{K−1}, W, …]` (`N` of them).
    #[derive(Debug)]
    struct FusedTokenMix;

    /// What the backward pass keeps: the inputs (`W` then the states), the states' autodiff
    /// tensors, whose gradients so far the backward takes over, and their gradient slots.
    #[derive(Debug, Clone)]
    struct Kept<B: Backend> {
        inputs: Vec<FloatTensor<B>>,
        states: Vec<FloatTensor<Autodiff<B>>>,
        gradients: Vec<Option<UnitsGradient>>,
    }

    impl<B: TokenMixBackend, const N: usize> Backward<B, N> for FusedTokenMix {
        type State = Kept<B>;

        fn backward(
            self,
            ops: Ops<Self::State, N>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let Kept {
                mut inputs,
                states: nodes,
                gradients,
            } = ops.state;
            let states = inputs.split_off(1);
            // The states that need a gradient (the padding parents after them are `W` again).
            let tracked: Vec<Option<_>> = nodes
                .into_iter()
                .zip(&ops.parents[1..])
                .map(|(state, parent)| parent.as_ref().map(|_| state))
                .collect();
            // Those whose slot takes this mixture's term: their projection writes their
            // gradient later (see `token_mix_leaving`).
            let leave: Vec<Option<UnitsGradient>> = tracked
                .iter()
                .enumerate()
                .map(|(k, state)| {
                    let slot = gradients.get(k).cloned().flatten();
                    slot.filter(|slot| state.is_some() && slot.accepts())
                })
                .collect();
            let weights = inputs.pop().expect("the weights");
            let grad = grads.consume::<B>(&ops.node);
            // Each other state's gradient so far leaves the container and comes back with this
            // mixture's term added in the same pass: no separate add per state and mixture.
            let sofar = Staged::default();
            for (state, leave) in tracked.iter().zip(&leave) {
                let wanted = state.as_ref().filter(|_| leave.is_none());
                sofar.push(wanted.map(|state| grads.remove::<B>(state)));
            }
            let mut computed =
                B::token_mix_backward(weights, Staged::of(states), grad, sofar, leave.clone());
            let weight_grad = computed.pop().expect("∂W");
            for ((state, leave), state_grad) in tracked.iter().zip(&leave).zip(computed) {
                if let (Some(state), None) = (state, leave) {
                    grads.register::<B>(state.node().id(), state_grad);
                }
            }
            if let Some(parent) = &ops.parents[0] {
                grads.register::<B>(parent.id, weight_grad);
            }
        }
    }

    /// The op with `N` parents (the inputs, then `W` repeated).
    fn tracked<B, C, const N: usize>(
        weights: FloatTensor<Autodiff<B, C>>,
        states: Vec<FloatTensor<Autodiff<B, C>>>,
        gradients: Vec<Option<UnitsGradient>>,
    ) -> FloatTensor<Autodiff<B, C>>
    where
        B: TokenMixBackend,
        C: CheckpointStrategy,
    {
        let kept_states = states.clone();
        let inputs: Vec<_> = std::iter::once(weights).chain(states).collect();
        // The padding repeats `W`, whose gradient the backward registers for the first parent
        // only.
        let nodes: [_; N] =
            std::array::from_fn(|i| inputs[if i < inputs.len() { i } else { 0 }].node());
        let primitives: Vec<FloatTensor<B>> = inputs
            .into_iter()
            .map(|input| input.into_primitive())
            .collect();
        let mixed = |primitives: Vec<FloatTensor<B>>| {
            let mut primitives = primitives;
            let states = primitives.split_off(1);
            let weights = primitives.pop().expect("the weights");
            B::token_mix(weights, Staged::of(states), Vec::new())
        };
        match FusedTokenMix.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let output = mixed(primitives.clone());
                let kept = Kept {
                    inputs: primitives,
                    states: kept_states,
                    gradients,
                };
                prep.finish(kept, output)
            }
            OpsKind::UnTracked(prep) => prep.finish(mixed(primitives)),
        }
    }

    impl<B: TokenMixBackend, C: CheckpointStrategy> TokenMixBackend for Autodiff<B, C> {
        fn token_mix_stage(state: FloatTensor<Self>, staged: Staged) -> FloatTensor<Self> {
            staged.push(state.clone());
            state
        }

        fn token_mix(
            weights: FloatTensor<Self>,
            staged: Staged,
            gradients: Vec<Option<UnitsGradient>>,
        ) -> FloatTensor<Self> {
            let states = staged.take::<FloatTensor<Self>>();
            match states.len() + 1 {
                0..=4 => tracked::<B, C, 4>(weights, states, gradients),
                5..=8 => tracked::<B, C, 8>(weights, states, gradients),
                9..=16 => tracked::<B, C, 16>(weights, states, gradients),
                17..=32 => tracked::<B, C, 32>(weights, states, gradients),
                parents => {
                    assert!(parents <= MAX_STATES + 1, "token mix: too many states");
                    tracked::<B, C, 64>(weights, states, gradients)
                }
            }
        }

        fn token_mix_backward(
            weights: FloatTensor<Self>,
            staged: Staged,
            grad: FloatTensor<Self>,
            sofar: Staged,
            leave: Vec<Option<UnitsGradient>>,
        ) -> Vec<FloatTensor<Self>> {
            let inner = |tensor: FloatTensor<Self>| tensor.into_primitive();
            let states: Vec<FloatTensor<B>> = staged
                .take::<FloatTensor<Self>>()
                .into_iter()
                .map(inner)
                .collect();
            let sofar: Vec<Option<Option<FloatTensor<B>>>> = sofar
                .take::<Option<Option<FloatTensor<Self>>>>()
                .into_iter()
                .map(|sofar| sofar.map(|sofar| sofar.map(inner)))
                .collect();
            // First-order only: the gradients are constants to the graph.
            B::token_mix_backward(
                weights.into_primitive(),
                Staged::of(states),
                grad.into_primitive(),
                Staged::of(sofar),
                leave,
            )
            .into_iter()
            .map(constant::<B, C>)
            .collect()
        }
    }
}

#[cfg(all(test, any(feature = "flex", feature = "cube-kernels")))]
mod tests {
    use burn::prelude::*;
    use burn::tensor::{Distribution, FloatDType, TensorData, Tolerance};

    /// The fused op equals the composed form on `device` (an autodiff device), values and the
    /// gradients of the weights and of every tracked state, for mixtures of `counts` states,
    /// with an untracked state, the same state twice, and weights that are a narrow of a wider
    /// tensor (a non-contiguous input).
    fn fused_equals_composed(device: &Device, dtypes: &[FloatDType], counts: &[usize]) {
        for &dtype in dtypes {
            for &count in counts {
                let normal = Distribution::Normal(0.0, 1.0);
                let leaves: Vec<Tensor<3>> = (0..count)
                    .map(|_| Tensor::<3>::random([2, 9, 20], normal, device).cast(dtype))
                    .collect();
                let wide = Tensor::<3>::random([2, 9, count + 3], normal, device).cast(dtype);
                let probe = Tensor::<3>::random([2, 9, 20], normal, device).cast(dtype);
                let run = |fused: bool| {
                    let wide = wide.clone().require_grad();
                    // State 0 needs no gradient; the last state repeats state 1 where there are
                    // three or more.
                    let states: Vec<Tensor<3>> = leaves
                        .iter()
                        .enumerate()
                        .map(|(k, leaf)| {
                            if k == 0 {
                                leaf.clone()
                            } else {
                                leaf.clone().require_grad()
                            }
                        })
                        .collect();
                    let mut inputs: Vec<Tensor<3>> =
                        states.iter().map(|s| s.clone() * 1.5).collect();
                    if count >= 3 {
                        inputs[count - 1] = inputs[1].clone();
                    }
                    let weights = wide.clone().narrow(2, 2, count);
                    let mixed = if fused {
                        super::token_mix(weights, inputs)
                    } else {
                        super::composed(weights, inputs)
                    };
                    let grads = (mixed.clone() * probe.clone()).sum().backward();
                    let mut out = vec![mixed.into_data(), wide.grad(&grads).unwrap().into_data()];
                    // The last leaf goes unused where state 1 takes its place.
                    let used = if count >= 3 { count - 1 } else { count };
                    out.extend(
                        states[1..used]
                            .iter()
                            .map(|s| s.grad(&grads).unwrap().into_data()),
                    );
                    assert!(states[0].grad(&grads).is_none());
                    out
                };
                assert_runs_agree(run(true), run(false), dtype);
            }
        }
    }

    /// Each tensor of the fused run against the composed run's, to `dtype`'s tolerance.
    fn assert_runs_agree(fused: Vec<TensorData>, composed: Vec<TensorData>, dtype: FloatDType) {
        let tolerance = match dtype {
            FloatDType::F64 => Tolerance::absolute(1e-12).set_relative(1e-12),
            _ => Tolerance::absolute(1e-5).set_relative(1e-5),
        };
        assert_eq!(fused.len(), composed.len());
        for (fused, composed) in fused.into_iter().zip(composed) {
            fused.assert_approx_eq::<f64>(&composed, tolerance);
        }
    }

    /// On Flex, f32 and f64, 1 to 40 states (every parent count class).
    #[cfg(feature = "flex")]
    #[test]
    fn fused_equals_composed_on_flex() {
        fused_equals_composed(
            &Device::flex().autodiff(),
            &[FloatDType::F32, FloatDType::F64],
            &[1, 2, 3, 7, 15, 31, 40],
        );
    }

    /// Mixtures chained as AttnRes's and MUDD's are (a state read by several mixtures, a
    /// mixture's output read by a later one, a state read by an add as well, one state twice in
    /// a mixture), so that a backward finds gradients so far that an earlier backward left (its
    /// own buffer, which it updates in place) and gradients it shares with another parent
    /// (which it only reads): the values and every gradient equal the composed form's.
    fn chained_mixtures_equal_composed(device: &Device, dtype: FloatDType) {
        let normal = Distribution::Normal(0.0, 1.0);
        let random = |last: usize| {
            Tensor::<3>::random([2, 9, last], normal, device)
                .cast(dtype)
                .into_data()
        };
        let leaves: Vec<TensorData> = (0..5).map(|_| random(20)).collect();
        let weights: Vec<TensorData> = [3, 5, 4].into_iter().map(random).collect();
        let probes: Vec<TensorData> = (0..2).map(|_| random(20)).collect();
        let run = |fused: bool| {
            // Each run's tensors are its own.
            let tensor =
                |data: &TensorData| Tensor::<3>::from_data(data.clone(), device).cast(dtype);
            let leaves: Vec<Tensor<3>> = leaves.iter().map(|l| tensor(l).require_grad()).collect();
            let weights: Vec<Tensor<3>> =
                weights.iter().map(|w| tensor(w).require_grad()).collect();
            let probes: Vec<Tensor<3>> = probes.iter().map(tensor).collect();
            let x: Vec<Tensor<3>> = leaves.iter().map(|leaf| leaf.clone() * 1.5).collect();
            let mix = |weights: &Tensor<3>, states: Vec<Tensor<3>>| {
                if fused {
                    super::token_mix(weights.clone(), states)
                } else {
                    super::composed(weights.clone(), states)
                }
            };
            let pick = |picked: &[usize]| picked.iter().map(|&k| x[k].clone()).collect();
            let first = mix(&weights[0], pick(&[0, 1, 2]));
            let mut states: Vec<Tensor<3>> = pick(&[0, 1, 2, 2]);
            states.push(first.clone());
            let second = mix(&weights[1], states);
            let third = mix(&weights[2], pick(&[1, 3, 4, 0])) + x[1].clone();
            let loss = (third.clone() * probes[0].clone()).sum()
                + (second * probes[1].clone()).sum()
                + first.powi_scalar(2).sum();
            let grads = loss.backward();
            let mut out = vec![third.into_data()];
            out.extend(leaves.iter().map(|l| l.grad(&grads).unwrap().into_data()));
            out.extend(weights.iter().map(|w| w.grad(&grads).unwrap().into_data()));
            out
        };
        assert_runs_agree(run(true), run(false), dtype);
    }

    #[cfg(feature = "flex")]
    #[test]
    fn chained_mixtures_equal_composed_on_flex() {
        for dtype in [FloatDType::F32, FloatDType::F64] {
            chained_mixtures_equal_composed(&Device::flex().autodiff(), dtype);
        }
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn chained_mixtures_equal_composed_on_wgpu() {
        chained_mixtures_equal_composed(&crate::test_util::wgpu_autodiff(), FloatDType::F32);
    }

    /// Through the CubeCL kernels on wgpu: one part, a full part, and chains of two and three
    /// parts (the sums so far, `∂W` from each part); then the same through the one-slot backward
    /// kernel that a device binding fewer buffers takes.
    #[cfg(feature = "wgpu")]
    #[test]
    fn kernels_equal_composed_on_wgpu() {
        use std::sync::atomic::Ordering;
        let launches = || super::cube::BACKWARD_LAUNCHES.load(Ordering::Relaxed);
        let device = crate::test_util::wgpu_autodiff();
        let before = launches();
        let counts = [1, 3, 8, 9, 19];
        fused_equals_composed(&device, &[FloatDType::F32], &counts);
        // One backward per part: 1 + 1 + 1 + 2 + 3 (more where other tests run beside).
        assert!(launches() >= before + 8, "the kernels ran");
        super::cube::one_slot_backward(true);
        fused_equals_composed(&device, &[FloatDType::F32], &[3, 9]);
        super::cube::one_slot_backward(false);
    }

    /// Mixtures reading their columns of a wider table in place (MUDD's ways): two ways over
    /// three states and one over nine (two parts), against the composed mixtures of the
    /// narrowed columns: values, the table's gradient (zero outside the columns read) and the
    /// states'.
    #[cfg(feature = "wgpu")]
    #[test]
    fn columns_of_a_table_equal_composed_on_wgpu() {
        let device = crate::test_util::wgpu_autodiff();
        let normal = Distribution::Normal(0.0, 1.0);
        for (count, columns, ways) in [(3, 10, vec![0, 3]), (9, 20, vec![11])] {
            let shape = [2, 5, 6];
            let states: Vec<Tensor<3>> = (0..count)
                .map(|_| Tensor::random(shape, normal, &device))
                .collect();
            let table = Tensor::<3>::random([2, 5, columns], normal, &device);
            let probe = Tensor::<3>::random(shape, normal, &device);
            let run = |in_place: bool| {
                let table = table.clone().require_grad();
                let states: Vec<Tensor<3>> =
                    states.iter().map(|s| s.clone().require_grad()).collect();
                let mixed = ways
                    .iter()
                    .map(|&first| {
                        if in_place {
                            super::token_mix_columns(table.clone(), first, states.clone())
                        } else {
                            let weights = table.clone().narrow(2, first, count);
                            super::composed(weights, states.clone())
                        }
                    })
                    .reduce(|a, b| a * 0.5 + b)
                    .expect("a way");
                let grads = (mixed.clone() * probe.clone()).sum().backward();
                let mut out = vec![mixed.into_data(), table.grad(&grads).unwrap().into_data()];
                out.extend(states.iter().map(|s| s.grad(&grads).unwrap().into_data()));
                out
            };
            assert_runs_agree(run(true), run(false), FloatDType::F32);
        }
    }

    /// More tokens than one launch axis takes (65535 cubes on wgpu): the backward's cubes, one
    /// per token, spread over a second axis, and every value and gradient equals the composed
    /// form's.
    #[cfg(feature = "wgpu")]
    #[test]
    fn more_tokens_than_a_launch_axis_on_wgpu() {
        let device = crate::test_util::wgpu_autodiff();
        let normal = Distribution::Normal(0.0, 1.0);
        let shape = [1, 70_000, 2];
        let states: Vec<Tensor<3>> = (0..2)
            .map(|_| Tensor::random(shape, normal, &device))
            .collect();
        let weights = Tensor::<3>::random(shape, normal, &device);
        let probe = Tensor::<3>::random(shape, normal, &device);
        let run = |fused: bool| {
            let weights = weights.clone().require_grad();
            let states: Vec<Tensor<3>> = states.iter().map(|s| s.clone().require_grad()).collect();
            let mixed = if fused {
                super::token_mix(weights.clone(), states.clone())
            } else {
                super::composed(weights.clone(), states.clone())
            };
            let grads = (mixed.clone() * probe.clone()).sum().backward();
            let mut out = vec![mixed.into_data(), weights.grad(&grads).unwrap().into_data()];
            out.extend(states.iter().map(|s| s.grad(&grads).unwrap().into_data()));
            out
        };
        assert_runs_agree(run(true), run(false), FloatDType::F32);
    }

    /// In f16 the kernels sum in f32: `∂W` over rows of 2²⁰ entries, 4096 products a unit at
    /// 256 units a cube. Kept in f16, a unit's sum of like-signed terms stops growing once its
    /// spacing passes twice a term (2048 terms). The composed reference runs on Flex: lavapipe
    /// stops a shader's loops after 65535 iterations in all, which Burn's reductions over rows
    /// this long can reach.
    #[cfg(feature = "wgpu")]
    #[test]
    fn half_precision_kernels_sum_in_f32() {
        use crate::test_util::fixed_normal;
        let flex = Device::flex().autodiff();
        let shape = [1, 2, 1 << 20];
        let states: Vec<Tensor<3>> = (0..3)
            .map(|k| fixed_normal(shape, 0.3, 40 + k, &flex) + 1.0)
            .collect();
        let weights = fixed_normal([1, 2, 3], 0.2, 43, &flex) + 0.5;
        // Small, so that the sums over a row stay inside f16's range.
        let probe = fixed_normal(shape, 3e-4, 44, &flex) + 1e-3;
        crate::test_util::assert_half_sums_in_f32("token mix", |dtype, fused| {
            let device = if fused {
                crate::test_util::wgpu_autodiff()
            } else {
                flex.clone()
            };
            let on = |x: &Tensor<3>| Tensor::<3>::from_data(x.to_data(), &device).cast(dtype);
            let weights = on(&weights).require_grad();
            let states: Vec<Tensor<3>> = states.iter().map(|s| on(s).require_grad()).collect();
            let mixed = if fused {
                super::token_mix(weights.clone(), states.clone())
            } else {
                super::composed(weights.clone(), states.clone())
            };
            let grads = (mixed.clone() * on(&probe)).sum().backward();
            let mut out = vec![mixed.into_data(), weights.grad(&grads).unwrap().into_data()];
            out.extend(states.iter().map(|s| s.grad(&grads).unwrap().into_data()));
            out
        });
    }

    /// Without autodiff the op runs the forward alone, equal to the composed form.
    #[cfg(feature = "flex")]
    #[test]
    fn forward_without_autodiff() {
        let device = Device::flex();
        let normal = Distribution::Normal(0.0, 1.0);
        let states: Vec<Tensor<2>> = (0..5)
            .map(|_| Tensor::random([33, 17], normal, &device))
            .collect();
        let weights = Tensor::<2>::random([33, 5], normal, &device);
        let fused = super::token_mix(weights.clone(), states.clone());
        let composed = super::composed(weights, states);
        fused
            .into_data()
            .assert_approx_eq::<f32>(&composed.into_data(), Tolerance::absolute(1e-5));
    }
}
