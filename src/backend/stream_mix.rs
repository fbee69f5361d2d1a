//! The stream mixing of the multi-stream connectivities as one fused CPU op on Flex, with its own
//! backward.
//!
//! Per token `t`, with `R` output rows, `U` units of width `w` and `V` views of the branch:
//!
//! ```text
//! out[t, r] = Σ_u W[t, r, u] S[t, u] + β[t, r] h[t, r mod V]          (the β h term optional)
//!
//! ∂S[t, u]  = Σ_r W[t, r, u] ∂out[t, r]        ∂W[t, r, u] = ⟨∂out[t, r], S[t, u]⟩
//! ∂h[t, f]  = Σ_{r mod V = f} β[t, r] ∂out[t, r]   ∂β[t, r] = ⟨∂out[t, r], h[t, r mod V]⟩
//! ```
//!
//! `W` and `β` may have a leading axis of 1 (the same connections for every token; their
//! gradients are then summed over the tokens). Composed from tensor ops, the mixing is `U`
//! broadcast products and `U − 1` sums of full-size tensors, and its backward two full-size
//! temporaries per unit; here the forward reads `S` and `h` once and writes `out` once, and the
//! backward reads `∂out`, `S`, `h` once and writes `∂S`, `∂h` once. Flex only (f32 and f64):
//! Burn's fusion already merges the composed form into one kernel on the CubeCL backends.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};
use burn_flex::{Flex, FlexTensor};
use rayon::prelude::*;

use std::mem::MaybeUninit;

use super::flex_kernels::{Scalar, axpy, dims, dot, tensor, unwritten, values, written, zeroed};

/// Tokens per parallel task: enough work (tens of kB) to amortise the task.
const TOKENS_PER_TASK: usize = 32;

/// The fused stream mixing (see the [module docs](self)).
#[backend_extension(Flex: cfg(feature = "flex"), Autodiff)]
pub(crate) trait StreamMixBackend: Backend {
    /// `out = W S`: `weights [T | 1, R, U]`, `units [T, U, w]`; `out [T, R, w]`.
    fn stream_mix(weights: FloatTensor<Self>, units: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `out = W S + β h`, with `beta [T | 1, R, 1]` and `branch [T, V, w]` (`V` divides `R`).
    fn stream_mix_add(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// The gradients of `weights` and `units` of [`stream_mix`](Self::stream_mix), given the
    /// gradient of the output.
    fn stream_mix_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients of `weights`, `units`, `beta` and `branch` of
    /// [`stream_mix_add`](Self::stream_mix_add), each shaped like its input.
    #[allow(clippy::type_complexity)]
    fn stream_mix_add_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );
}

/// `W S (+ β h)` through the fused op; only for Flex devices in f32 or f64.
pub(crate) fn fused_stream_mix(
    weights: Tensor<3>,
    units: Tensor<3>,
    addend: Option<(Tensor<3>, Tensor<3>)>,
) -> Tensor<3> {
    let (weights, units) = (weights.into_dispatch(), units.into_dispatch());
    let output = match addend {
        Some((beta, branch)) => <Dispatch as StreamMixBackend>::stream_mix_add(
            weights,
            units,
            beta.into_dispatch(),
            branch.into_dispatch(),
        ),
        None => <Dispatch as StreamMixBackend>::stream_mix(weights, units),
    };
    Tensor::from_dispatch(output)
}

/// The shapes of one mixing, checked against each other.
#[derive(Debug, Clone, Copy)]
struct Dims {
    tokens: usize,
    rows: usize,
    units: usize,
    width: usize,
    views: usize,
    /// Whether `W` (and `β`) hold one matrix per token (otherwise one for all).
    weights_per_token: bool,
    beta_per_token: bool,
}

impl Dims {
    fn new(
        weights: &FlexTensor,
        units: &FlexTensor,
        addend: Option<(&FlexTensor, &FlexTensor)>,
    ) -> Self {
        let [weight_tokens, rows, unit_count] = dims::<3>(weights);
        let [tokens, units_again, width] = dims::<3>(units);
        assert_eq!(
            unit_count, units_again,
            "stream mix: weights and units disagree"
        );
        assert!(
            weight_tokens == tokens || weight_tokens == 1,
            "stream mix: weight tokens"
        );
        let (views, beta_per_token) = addend.map_or((1, false), |(beta, branch)| {
            let [beta_tokens, beta_rows, _] = dims::<3>(beta);
            let [branch_tokens, views, branch_width] = dims::<3>(branch);
            assert_eq!(beta_rows, rows, "stream mix: β rows");
            assert!(
                beta_tokens == tokens || beta_tokens == 1,
                "stream mix: β tokens"
            );
            assert_eq!(
                (branch_tokens, branch_width),
                (tokens, width),
                "stream mix: branch"
            );
            assert!(views > 0 && rows.is_multiple_of(views), "stream mix: views");
            (views, beta_tokens == tokens && tokens > 1)
        });
        Self {
            tokens,
            rows,
            units: unit_count,
            width,
            views,
            weights_per_token: weight_tokens == tokens && tokens > 1,
            beta_per_token,
        }
    }

    fn weights_of(&self, token: usize) -> usize {
        if self.weights_per_token {
            token * self.rows * self.units
        } else {
            0
        }
    }

    fn beta_of(&self, token: usize) -> usize {
        if self.beta_per_token {
            token * self.rows
        } else {
            0
        }
    }
}

fn forward<E: Scalar>(
    weights: &FlexTensor,
    units: &FlexTensor,
    addend: Option<(&FlexTensor, &FlexTensor)>,
) -> FlexTensor {
    let dims = Dims::new(weights, units, addend);
    let Dims {
        tokens,
        rows,
        units: count,
        width,
        views,
        ..
    } = dims;
    let (w, s) = (values::<E>(weights), values::<E>(units));
    let addend = addend.map(|(beta, branch)| (values::<E>(beta), values::<E>(branch)));
    let mut out = unwritten::<E>(tokens * rows * width);
    out.par_chunks_mut(TOKENS_PER_TASK * rows * width)
        .enumerate()
        .for_each(|(task, out)| {
            let out = zeroed(out);
            for (offset, out) in out.chunks_exact_mut(rows * width).enumerate() {
                let t = task * TOKENS_PER_TASK + offset;
                let s = &s[t * count * width..][..count * width];
                let w = &w[dims.weights_of(t)..][..rows * count];
                for (r, row) in out.chunks_exact_mut(width).enumerate() {
                    if let Some((beta, branch)) = &addend {
                        let h = &branch[(t * views + r % views) * width..][..width];
                        axpy(row, beta[dims.beta_of(t) + r], h);
                    }
                    for (u, unit) in s.chunks_exact(width).enumerate() {
                        axpy(row, w[r * count + u], unit);
                    }
                }
            }
        });
    // SAFETY: the tasks' chunks partition `out`, and each was zeroed.
    let out = unsafe { written(out) };
    tensor(out, [tokens, rows, width])
}

/// Sums `[tokens, k]` per-token values over the tokens unless they were per token.
fn reduce_tokens<E: Scalar>(per_token: Vec<E>, k: usize, keep: bool, tokens: usize) -> FlexTensor {
    if keep {
        return tensor(per_token, [tokens, k, 1]);
    }
    let mut total = vec![E::zero(); k];
    for chunk in per_token.chunks_exact(k) {
        for (sum, &value) in total.iter_mut().zip(chunk) {
            *sum += value;
        }
    }
    tensor(total, [1, k, 1])
}

#[allow(clippy::type_complexity)]
fn backward<E: Scalar>(
    weights: &FlexTensor,
    units: &FlexTensor,
    addend: Option<(&FlexTensor, &FlexTensor)>,
    grad: &FlexTensor,
) -> (
    FlexTensor,
    FlexTensor,
    Option<FlexTensor>,
    Option<FlexTensor>,
) {
    let dims = Dims::new(weights, units, addend);
    let Dims {
        tokens,
        rows,
        units: count,
        width,
        views,
        ..
    } = dims;
    let (w, s, g) = (values::<E>(weights), values::<E>(units), values::<E>(grad));
    let addend = addend.map(|(beta, branch)| (values::<E>(beta), values::<E>(branch)));
    let with_addend = addend.is_some();
    let mut grad_units = unwritten::<E>(tokens * count * width);
    let mut grad_weights = vec![E::zero(); tokens * rows * count];
    // Without the addend its gradients are empty: every task gets an empty slice of them.
    let (beta_len, branch_len) = if with_addend {
        (tokens * rows, tokens * views * width)
    } else {
        (0, 0)
    };
    let mut grad_beta = vec![E::zero(); beta_len];
    let mut grad_branch = unwritten::<E>(branch_len);
    let mut beta_tasks: Vec<&mut [E]> = grad_beta.chunks_mut(TOKENS_PER_TASK * rows).collect();
    let mut branch_tasks: Vec<&mut [MaybeUninit<E>]> = grad_branch
        .chunks_mut(TOKENS_PER_TASK * views * width)
        .collect();
    let task_count = tokens.div_ceil(TOKENS_PER_TASK);
    beta_tasks.resize_with(task_count, || &mut []);
    branch_tasks.resize_with(task_count, || &mut []);
    grad_units
        .par_chunks_mut(TOKENS_PER_TASK * count * width)
        .zip(grad_weights.par_chunks_mut(TOKENS_PER_TASK * rows * count))
        .zip(beta_tasks.into_par_iter())
        .zip(branch_tasks.into_par_iter())
        .enumerate()
        .for_each(
            |(task, (((grad_units, grad_weights), grad_beta), grad_branch))| {
                let (grad_units, grad_branch) = (zeroed(grad_units), zeroed(grad_branch));
                let first = task * TOKENS_PER_TASK;
                let task_tokens = grad_units.len() / (count * width);
                for offset in 0..task_tokens {
                    let t = first + offset;
                    let s = &s[t * count * width..][..count * width];
                    let w = &w[dims.weights_of(t)..][..rows * count];
                    let g = &g[t * rows * width..][..rows * width];
                    let grad_s = &mut grad_units[offset * count * width..][..count * width];
                    let grad_w = &mut grad_weights[offset * rows * count..][..rows * count];
                    for (r, g_row) in g.chunks_exact(width).enumerate() {
                        for (u, (unit, grad_unit)) in s
                            .chunks_exact(width)
                            .zip(grad_s.chunks_exact_mut(width))
                            .enumerate()
                        {
                            axpy(grad_unit, w[r * count + u], g_row);
                            grad_w[r * count + u] = dot(g_row, unit);
                        }
                        if let Some((beta, branch)) = &addend {
                            let f = r % views;
                            let h = &branch[(t * views + f) * width..][..width];
                            grad_beta[offset * rows + r] = dot(g_row, h);
                            let grad_h = &mut grad_branch[(offset * views + f) * width..][..width];
                            axpy(grad_h, beta[dims.beta_of(t) + r], g_row);
                        }
                    }
                }
            },
        );
    // SAFETY: the tasks' chunks partition both buffers, and each was zeroed.
    let (grad_units, grad_branch) = unsafe { (written(grad_units), written(grad_branch)) };
    let grad_weights = reduce_tokens(grad_weights, rows * count, dims.weights_per_token, tokens)
        .reshape([if dims.weights_per_token { tokens } else { 1 }, rows, count].into());
    let addend = with_addend.then(|| {
        (
            reduce_tokens(grad_beta, rows, dims.beta_per_token, tokens),
            tensor(grad_branch, [tokens, views, width]),
        )
    });
    let (grad_beta, grad_branch) = addend.unzip();
    (
        grad_weights,
        tensor(grad_units, [tokens, count, width]),
        grad_beta,
        grad_branch,
    )
}

fn forward_any(
    weights: &FlexTensor,
    units: &FlexTensor,
    addend: Option<(&FlexTensor, &FlexTensor)>,
) -> FlexTensor {
    match units.dtype() {
        DType::F32 => forward::<f32>(weights, units, addend),
        DType::F64 => forward::<f64>(weights, units, addend),
        other => panic!("stream mix: unsupported dtype {other:?}"),
    }
}

#[allow(clippy::type_complexity)]
fn backward_any(
    weights: &FlexTensor,
    units: &FlexTensor,
    addend: Option<(&FlexTensor, &FlexTensor)>,
    grad: &FlexTensor,
) -> (
    FlexTensor,
    FlexTensor,
    Option<FlexTensor>,
    Option<FlexTensor>,
) {
    match units.dtype() {
        DType::F32 => backward::<f32>(weights, units, addend, grad),
        DType::F64 => backward::<f64>(weights, units, addend, grad),
        other => panic!("stream mix: unsupported dtype {other:?}"),
    }
}

impl StreamMixBackend for Flex {
    fn stream_mix(weights: FlexTensor, units: FlexTensor) -> FlexTensor {
        forward_any(&weights, &units, None)
    }

    fn stream_mix_add(
        weights: FlexTensor,
        units: FlexTensor,
        beta: FlexTensor,
        branch: FlexTensor,
    ) -> FlexTensor {
        forward_any(&weights, &units, Some((&beta, &branch)))
    }

    fn stream_mix_backward(
        weights: FlexTensor,
        units: FlexTensor,
        grad: FlexTensor,
    ) -> (FlexTensor, FlexTensor) {
        let (grad_weights, grad_units, _, _) = backward_any(&weights, &units, None, &grad);
        (grad_weights, grad_units)
    }

    fn stream_mix_add_backward(
        weights: FlexTensor,
        units: FlexTensor,
        beta: FlexTensor,
        branch: FlexTensor,
        grad: FlexTensor,
    ) -> (FlexTensor, FlexTensor, FlexTensor, FlexTensor) {
        let (grad_weights, grad_units, grad_beta, grad_branch) =
            backward_any(&weights, &units, Some((&beta, &branch)), &grad);
        (
            grad_weights,
            grad_units,
            grad_beta.expect("computed with the addend"),
            grad_branch.expect("computed with the addend"),
        )
    }
}

/// `W S`: parents `[W, S]`.
#[derive(Debug)]
struct Mix;

/// `W S + β h`: parents `[W, S, β, h]`.
#[derive(Debug)]
struct MixAdd;

impl<B: StreamMixBackend> Backward<B, 2> for Mix {
    type State = [NodeId; 2];

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let [weights, units] = ops.state.map(|id| checkpointer.retrieve_node_output(id));
        let (grad_weights, grad_units) = B::stream_mix_backward(weights, units, grad);
        register_tracked!(grads, ops.parents, [grad_weights, grad_units]);
    }
}

impl<B: StreamMixBackend> Backward<B, 4> for MixAdd {
    type State = [NodeId; 4];

    fn backward(
        self,
        ops: Ops<Self::State, 4>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let [weights, units, beta, branch] =
            ops.state.map(|id| checkpointer.retrieve_node_output(id));
        let (grad_weights, grad_units, grad_beta, grad_branch) =
            B::stream_mix_add_backward(weights, units, beta, branch, grad);
        register_tracked!(
            grads,
            ops.parents,
            [grad_weights, grad_units, grad_beta, grad_branch]
        );
    }
}

impl<B: StreamMixBackend, C: CheckpointStrategy> StreamMixBackend for Autodiff<B, C> {
    fn stream_mix(weights: FloatTensor<Self>, units: FloatTensor<Self>) -> FloatTensor<Self> {
        match Mix
            .prepare::<C>([weights.node(), units.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = [prep.checkpoint(&weights), prep.checkpoint(&units)];
                let output = B::stream_mix(weights.into_primitive(), units.into_primitive());
                prep.finish(state, output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::stream_mix(
                weights.into_primitive(),
                units.into_primitive(),
            )),
        }
    }

    fn stream_mix_add(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let nodes = [weights.node(), units.node(), beta.node(), branch.node()];
        match MixAdd.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(mut prep) => {
                let state = [
                    prep.checkpoint(&weights),
                    prep.checkpoint(&units),
                    prep.checkpoint(&beta),
                    prep.checkpoint(&branch),
                ];
                let output = B::stream_mix_add(
                    weights.into_primitive(),
                    units.into_primitive(),
                    beta.into_primitive(),
                    branch.into_primitive(),
                );
                prep.finish(state, output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::stream_mix_add(
                weights.into_primitive(),
                units.into_primitive(),
                beta.into_primitive(),
                branch.into_primitive(),
            )),
        }
    }

    // First-order only: the gradients are constants to the graph.

    fn stream_mix_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (grad_weights, grad_units) = B::stream_mix_backward(
            weights.into_primitive(),
            units.into_primitive(),
            grad.into_primitive(),
        );
        (constant::<B, C>(grad_weights), constant::<B, C>(grad_units))
    }

    fn stream_mix_add_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let (grad_weights, grad_units, grad_beta, grad_branch) = B::stream_mix_add_backward(
            weights.into_primitive(),
            units.into_primitive(),
            beta.into_primitive(),
            branch.into_primitive(),
            grad.into_primitive(),
        );
        (
            constant::<B, C>(grad_weights),
            constant::<B, C>(grad_units),
            constant::<B, C>(grad_beta),
            constant::<B, C>(grad_branch),
        )
    }
}

fn constant<B: StreamMixBackend, C: CheckpointStrategy>(
    tensor: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    <Autodiff<B, C> as burn::backend::AutodiffBackend>::from_inner(tensor)
}

#[cfg(test)]
mod tests {
    use burn::prelude::*;
    use burn::tensor::{Distribution, Tolerance};

    use super::fused_stream_mix;
    use crate::multi_stream::composed_mix;

    fn random<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
    }

    /// The fused op against the composed tensor ops on Flex, forward and every gradient: weights
    /// per token and shared (leading axis 1), with and without the addend, one and two views,
    /// transposed (non-contiguous) weights, and token counts that do not fill the last task.
    #[test]
    fn fused_op_matches_the_composed_operations() {
        let device = Device::flex().autodiff();
        for (tokens, rows, units, width, views, per_token, addend) in [
            (37, 4, 4, 24, 1, true, true),
            (70, 4, 4, 16, 1, false, true),
            (33, 6, 6, 10, 2, true, true),
            (5, 6, 6, 8, 2, false, true),
            (40, 1, 4, 12, 1, true, false),
            (3, 2, 3, 9, 1, false, false),
        ] {
            let weight_tokens = if per_token { tokens } else { 1 };
            // Stored as [T, U, R] and transposed, as the connectivities hand them over.
            let weights = random([weight_tokens, units, rows], &device);
            let units_in = random([tokens, units, width], &device);
            let beta = random([weight_tokens, rows, 1], &device);
            let branch = random([tokens, views, width], &device);
            let probe = random([tokens, rows, width], &device);
            let run = |fused: bool| {
                let leaves = [&weights, &units_in, &beta, &branch]
                    .map(|tensor| tensor.clone().detach().require_grad());
                let [w, s, b, h] = leaves.clone();
                let with = addend.then_some((b, h));
                let w = w.swap_dims(1, 2);
                let output = if fused {
                    fused_stream_mix(w, s, with)
                } else {
                    composed_mix(w, s, with)
                };
                let grads = (output.clone() * probe.clone()).sum().backward();
                let count = if addend { 4 } else { 2 };
                let gradients: Vec<_> = leaves[..count]
                    .iter()
                    .map(|leaf| leaf.grad(&grads).expect("every input is used").into_data())
                    .collect();
                (output.into_data(), gradients)
            };
            let (fused, fused_grads) = run(true);
            let (composed, composed_grads) = run(false);
            let tolerance = Tolerance::absolute(1e-5).set_relative(1e-4);
            let case = format!("T={tokens} R={rows} U={units} w={width} V={views} {per_token}");
            assert_eq!(fused.shape(), composed.shape(), "{case}");
            fused.assert_approx_eq::<f32>(&composed, tolerance);
            for (fused, composed) in fused_grads.iter().zip(&composed_grads) {
                assert_eq!(fused.shape(), composed.shape(), "{case}");
                fused.assert_approx_eq::<f32>(composed, tolerance);
            }
        }
    }
}
