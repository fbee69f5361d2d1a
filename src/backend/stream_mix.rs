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
//!
//! A layer's units feed three ops: the normalised projection that makes its token-dependent
//! connections, the mix into the block input and the residual mix. With a [`UnitsGradient`]
//! claimed by the projection, the mixes' backward passes leave `(W, ∂out)` there rather than
//! writing `∂S` each, and the projection's backward writes the whole `∂S` in its own pass over
//! the units (see [`UnitsGradient`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};
use burn_flex::{Flex, FlexTensor};
use rayon::prelude::*;

use std::borrow::Cow;
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, MutexGuard};

use super::autodiff::{constant, tracked_op};
use super::flex_kernels::{
    Scalar, add_weighted_sum, dims, dots, tensor, unwritten, values, write_weighted_sum, written,
};

/// Tokens per parallel task: enough work (tens of kB) to amortise the task.
const TOKENS_PER_TASK: usize = 32;

/// The fused stream mixing (see the [module docs](self)).
#[backend_extension(Flex: cfg(feature = "flex"), Autodiff)]
pub(crate) trait StreamMixBackend: Backend {
    /// `out = W S`: `weights [T | 1, R, U]`, `units [T, U, w]`; `out [T, R, w]`. Under autodiff
    /// the backward leaves its part of `∂S` in `deferred` when that is claimed.
    fn stream_mix(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        deferred: Option<UnitsGradient>,
    ) -> FloatTensor<Self>;

    /// `out = W S + β h`, with `beta [T | 1, R, 1]` and `branch [T, V, w]` (`V` divides `R`).
    fn stream_mix_add(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        deferred: Option<UnitsGradient>,
    ) -> FloatTensor<Self>;

    /// The gradients of `weights` and `units` of [`stream_mix`](Self::stream_mix), given the
    /// gradient of the output; `None` for `units` where it was left in `deferred`.
    fn stream_mix_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        deferred: Option<UnitsGradient>,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>);

    /// The gradients of `weights`, `units`, `beta` and `branch` of
    /// [`stream_mix_add`](Self::stream_mix_add), each shaped like its input; `None` for `units`
    /// where it was left in `deferred`.
    #[allow(clippy::type_complexity)]
    fn stream_mix_add_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        deferred: Option<UnitsGradient>,
    ) -> (
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );
}

/// The gradient of one layer's units `S`, written in one pass by the op that reads them first.
///
/// The units of a layer with token-dependent connections feed three ops: the normalised
/// projection that makes the connections (created first), the mix into the block input, and
/// the residual mix (created last, once the block's output exists). Both mixes' weights are
/// computed from the projection, so whenever the autodiff graph runs a mix's backward it also
/// runs the projection's, and later (it is deeper in the graph). The projection claims the slot
/// in its forward pass; a mix whose backward finds it claimed leaves `(W, ∂out)` here instead of
/// writing `∂S = Wᵀ ∂out`, and the projection's backward writes `∂S` once: its own term plus
/// every `Wᵀ ∂out` left, token by token in cache. Otherwise each of the three wrote a full-size
/// `∂S` and autodiff added them up, two more full-size passes. A mix that runs after the
/// projection's backward (no such order is known, but it would be a silent error) writes its own.
///
/// The token mixes use the same slot for a state with one unit (`U = 1`, `R = 1`): AttnRes's
/// sources, whose logits' projection claims it (see `token_mix_leaving`).
#[derive(Clone, Default)]
pub(crate) struct UnitsGradient(Arc<Mutex<Deferred>>);

#[derive(Default)]
struct Deferred {
    /// Claimed by the projection, whose backward writes `∂S`.
    claimed: bool,
    /// The projection's backward has run.
    taken: bool,
    /// `(W [T | 1, R, U], ∂out [T, R, w])` of each mix that left its part.
    terms: Vec<(FlexTensor, FlexTensor)>,
    /// The parts that softmax mixtures left (see [`LogitTerm`]).
    logit_terms: Vec<LogitTerm>,
}

/// What a softmax mixture over a state (`U = 1`) leaves for the projection whose output holds
/// the state's logits (see `softmax_mix`): the state's weights `p [T]`, the mixture's output
/// gradient `∂h [T, w]`, `⟨∂h, h⟩ [T]` and the logits' column. The projection adds
/// `p (⟨∂h, v⟩ − ⟨∂h, h⟩)` to that column of its output's gradient and `p ∂h` to the state's.
#[derive(Clone)]
pub(crate) struct LogitTerm {
    pub(crate) weights: FlexTensor,
    pub(crate) grad: FlexTensor,
    pub(crate) centre: FlexTensor,
    pub(crate) column: usize,
}

impl std::fmt::Debug for UnitsGradient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let deferred = self.lock();
        f.debug_struct("UnitsGradient")
            .field("claimed", &deferred.claimed)
            .field("taken", &deferred.taken)
            .field("terms", &deferred.terms.len())
            .field("logit_terms", &deferred.logit_terms.len())
            .finish()
    }
}

impl UnitsGradient {
    fn lock(&self) -> MutexGuard<'_, Deferred> {
        self.0
            .lock()
            .expect("no op panics while holding the units' gradient")
    }

    /// Called by the projection's forward under autodiff: its backward will write `∂S`.
    pub(crate) fn claim(&self) {
        self.lock().claimed = true;
    }

    /// Whether a mix's backward may leave its part here.
    pub(crate) fn accepts(&self) -> bool {
        let deferred = self.lock();
        deferred.claimed && !deferred.taken
    }

    /// Leaves one mix's part, `W [T | 1, R, U]` and `∂out [T, R, w]`.
    pub(crate) fn leave(&self, weights: FlexTensor, grad: FlexTensor) {
        self.lock().terms.push((weights, grad));
    }

    /// Leaves one softmax mixture's part.
    pub(crate) fn leave_logit(&self, term: LogitTerm) {
        self.lock().logit_terms.push(term);
    }

    /// The parts left so far (the mixes', the softmax mixtures'), for the projection's
    /// backward; later mixes write their own.
    pub(crate) fn take(&self) -> (Vec<(FlexTensor, FlexTensor)>, Vec<LogitTerm>) {
        let mut deferred = self.lock();
        deferred.taken = true;
        (
            std::mem::take(&mut deferred.terms),
            std::mem::take(&mut deferred.logit_terms),
        )
    }
}

/// The parts of `∂S` left in a [`UnitsGradient`], as values: `Σ_terms Wᵀ ∂out` per token.
pub(crate) struct DeferredTerms<'a, E: Scalar> {
    terms: Vec<DeferredTerm<'a, E>>,
    units: usize,
    width: usize,
}

/// One mix's part: `W` (`[T | 1, R, U]`) and `∂out` (`[T, R, w]`).
struct DeferredTerm<'a, E: Scalar> {
    weights: Cow<'a, [E]>,
    per_token: bool,
    rows: usize,
    grad: Cow<'a, [E]>,
}

impl<'a, E: Scalar> DeferredTerms<'a, E> {
    pub(crate) fn new(terms: &'a [(FlexTensor, FlexTensor)]) -> Self {
        let (mut units, mut width) = (0, 0);
        let terms = terms
            .iter()
            .map(|(weights, grad)| {
                let [weight_tokens, rows, count] = dims::<3>(weights);
                let [tokens, grad_rows, grad_width] = dims::<3>(grad);
                assert_eq!(rows, grad_rows, "deferred units gradient: rows");
                assert!(
                    (units, width) == (0, 0) || (units, width) == (count, grad_width),
                    "deferred units gradient: every term over the same units"
                );
                (units, width) = (count, grad_width);
                let per_token = weight_tokens == tokens && tokens > 1;
                DeferredTerm {
                    weights: values::<E>(weights),
                    per_token,
                    rows,
                    grad: values::<E>(grad),
                }
            })
            .collect();
        Self {
            terms,
            units,
            width,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.terms.is_empty()
    }

    /// Elements per token (`U w`); 0 without terms.
    pub(crate) fn token_len(&self) -> usize {
        self.units * self.width
    }

    /// Whether rows of `width` are each the one unit of a token (`U = 1`, `w = width`; AttnRes's
    /// sources), as [`push_terms`](Self::push_terms) of unit 0 covers them; true without terms.
    pub(crate) fn one_unit_rows(&self, width: usize) -> bool {
        self.is_empty() || (self.units == 1 && self.width == width)
    }

    /// Adds `Σ_terms Σ_r W[t, r, u] ∂out[t, r]` to `out`, the units `[.., U, w]` of the tokens
    /// from `first`.
    pub(crate) fn add_to(&self, first: usize, out: &mut [E]) {
        let (count, width) = (self.units, self.width);
        if self.is_empty() || count * width == 0 {
            return;
        }
        let mut sum: Vec<(E, &[E])> = Vec::new();
        for (offset, out) in out.chunks_exact_mut(count * width).enumerate() {
            for (u, unit) in out.chunks_exact_mut(width).enumerate() {
                sum.clear();
                self.push_terms(first + offset, u, &mut sum);
                add_weighted_sum(unit, &sum);
            }
        }
    }

    /// Pushes the terms of unit `u` of token `t` onto `sum`: `(W[t, r, u], ∂out[t, r])` for
    /// every part and row, for an op that adds them to its own terms in one pass.
    pub(crate) fn push_terms<'s>(&'s self, t: usize, u: usize, sum: &mut Vec<(E, &'s [E])>) {
        let (count, width) = (self.units, self.width);
        for term in &self.terms {
            let rows = term.rows;
            let first_weight = if term.per_token { t * rows * count } else { 0 };
            let w = &term.weights[first_weight..][..rows * count];
            let g = &term.grad[t * rows * width..][..rows * width];
            let g_rows = g.chunks_exact(width).enumerate();
            sum.extend(g_rows.map(|(r, g_row)| (w[r * count + u], g_row)));
        }
    }
}

/// `W S (+ β h)` through the fused op; only for Flex devices in f32 or f64.
pub(crate) fn fused_stream_mix(
    weights: Tensor<3>,
    units: Tensor<3>,
    addend: Option<(Tensor<3>, Tensor<3>)>,
    deferred: Option<&UnitsGradient>,
) -> Tensor<3> {
    let (weights, units) = (weights.into_dispatch(), units.into_dispatch());
    let deferred = deferred.cloned();
    let output = match addend {
        Some((beta, branch)) => <Dispatch as StreamMixBackend>::stream_mix_add(
            weights,
            units,
            beta.into_dispatch(),
            branch.into_dispatch(),
            deferred,
        ),
        None => <Dispatch as StreamMixBackend>::stream_mix(weights, units, deferred),
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
            let mut sum: Vec<(E, &[E])> = Vec::with_capacity(count + 1);
            for (offset, out) in out.chunks_exact_mut(rows * width).enumerate() {
                let t = task * TOKENS_PER_TASK + offset;
                let s = &s[t * count * width..][..count * width];
                let w = &w[dims.weights_of(t)..][..rows * count];
                for (r, row) in out.chunks_exact_mut(width).enumerate() {
                    sum.clear();
                    if let Some((beta, branch)) = &addend {
                        let h = &branch[(t * views + r % views) * width..][..width];
                        sum.push((beta[dims.beta_of(t) + r], h));
                    }
                    let units = s.chunks_exact(width).enumerate();
                    sum.extend(units.map(|(u, unit)| (w[r * count + u], unit)));
                    write_weighted_sum(row, &sum);
                }
            }
        });
    // SAFETY: the tasks' chunks partition `out`, and each of their rows was written.
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

/// The gradients of `W`, `S` (unless `with_units` is off), `β` and `h` (with the addend).
#[allow(clippy::type_complexity)]
fn backward<E: Scalar>(
    weights: &FlexTensor,
    units: &FlexTensor,
    addend: Option<(&FlexTensor, &FlexTensor)>,
    grad: &FlexTensor,
    with_units: bool,
) -> (
    FlexTensor,
    Option<FlexTensor>,
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
    let mut grad_weights = vec![E::zero(); tokens * rows * count];
    // The gradients not asked for are empty: every task gets an empty slice of them.
    let units_len = if with_units {
        tokens * count * width
    } else {
        0
    };
    let (beta_len, branch_len) = if with_addend {
        (tokens * rows, tokens * views * width)
    } else {
        (0, 0)
    };
    let mut grad_units = unwritten::<E>(units_len);
    let mut grad_beta = vec![E::zero(); beta_len];
    let mut grad_branch = unwritten::<E>(branch_len);
    let task_count = tokens.div_ceil(TOKENS_PER_TASK);
    let mut units_tasks: Vec<&mut [MaybeUninit<E>]> = grad_units
        .chunks_mut(TOKENS_PER_TASK * count * width)
        .collect();
    let mut beta_tasks: Vec<&mut [E]> = grad_beta.chunks_mut(TOKENS_PER_TASK * rows).collect();
    let mut branch_tasks: Vec<&mut [MaybeUninit<E>]> = grad_branch
        .chunks_mut(TOKENS_PER_TASK * views * width)
        .collect();
    units_tasks.resize_with(task_count, || &mut []);
    beta_tasks.resize_with(task_count, || &mut []);
    branch_tasks.resize_with(task_count, || &mut []);
    grad_weights
        .par_chunks_mut(TOKENS_PER_TASK * rows * count)
        .zip(units_tasks.into_par_iter())
        .zip(beta_tasks.into_par_iter())
        .zip(branch_tasks.into_par_iter())
        .enumerate()
        .for_each(
            |(task, (((grad_weights, grad_units), grad_beta), grad_branch))| {
                let first = task * TOKENS_PER_TASK;
                let task_tokens = grad_weights.len() / (rows * count);
                // Scratch: the vectors a row of ∂out is dotted with, the products, and the
                // terms of one weighted sum.
                let mut vectors: Vec<&[E]> = Vec::with_capacity(count + 1);
                let mut products = vec![E::zero(); count + 1];
                let mut sum: Vec<(E, &[E])> = Vec::with_capacity(rows);
                for offset in 0..task_tokens {
                    let t = first + offset;
                    let s = &s[t * count * width..][..count * width];
                    let w = &w[dims.weights_of(t)..][..rows * count];
                    let g = &g[t * rows * width..][..rows * width];
                    let grad_w = &mut grad_weights[offset * rows * count..][..rows * count];
                    // ∂W[r, u] = ⟨∂out_r, S_u⟩ and ∂β_r = ⟨∂out_r, h_{r mod V}⟩, row by row.
                    for (r, g_row) in g.chunks_exact(width).enumerate() {
                        vectors.clear();
                        vectors.extend(s.chunks_exact(width));
                        if let Some((_, branch)) = &addend {
                            vectors.push(&branch[(t * views + r % views) * width..][..width]);
                        }
                        let products = &mut products[..vectors.len()];
                        dots(g_row, &vectors, products);
                        grad_w[r * count..][..count].copy_from_slice(&products[..count]);
                        if addend.is_some() {
                            grad_beta[offset * rows + r] = products[count];
                        }
                    }
                    // ∂S_u = Σ_r W[r, u] ∂out_r, unit by unit.
                    if with_units {
                        let grad_s = &mut grad_units[offset * count * width..][..count * width];
                        for (u, grad_unit) in grad_s.chunks_exact_mut(width).enumerate() {
                            sum.clear();
                            let g_rows = g.chunks_exact(width).enumerate();
                            sum.extend(g_rows.map(|(r, g_row)| (w[r * count + u], g_row)));
                            write_weighted_sum(grad_unit, &sum);
                        }
                    }
                    // ∂h_f = Σ_{r mod V = f} β_r ∂out_r, view by view.
                    if let Some((beta, _)) = &addend {
                        let grad_h = &mut grad_branch[offset * views * width..][..views * width];
                        for (f, grad_h) in grad_h.chunks_exact_mut(width).enumerate() {
                            sum.clear();
                            let g_rows = g.chunks_exact(width).enumerate().skip(f).step_by(views);
                            let beta = &beta[dims.beta_of(t)..];
                            sum.extend(g_rows.map(|(r, g_row)| (beta[r], g_row)));
                            write_weighted_sum(grad_h, &sum);
                        }
                    }
                }
            },
        );
    // SAFETY: the tasks' chunks partition the buffers, and each of their units and views was
    // written.
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
        with_units.then(|| tensor(grad_units, [tokens, count, width])),
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

/// [`backward`] for the tensor's float type. With a claimed `deferred`, `(W, ∂out)` go there
/// and `∂S` is not computed.
#[allow(clippy::type_complexity)]
fn backward_any(
    weights: FlexTensor,
    units: &FlexTensor,
    addend: Option<(&FlexTensor, &FlexTensor)>,
    grad: FlexTensor,
    deferred: Option<UnitsGradient>,
) -> (
    FlexTensor,
    Option<FlexTensor>,
    Option<FlexTensor>,
    Option<FlexTensor>,
) {
    let deferred = deferred.filter(UnitsGradient::accepts);
    let with_units = deferred.is_none();
    let gradients = match units.dtype() {
        DType::F32 => backward::<f32>(&weights, units, addend, &grad, with_units),
        DType::F64 => backward::<f64>(&weights, units, addend, &grad, with_units),
        other => panic!("stream mix: unsupported dtype {other:?}"),
    };
    if let Some(deferred) = deferred {
        deferred.leave(weights, grad);
    }
    gradients
}

impl StreamMixBackend for Flex {
    fn stream_mix(
        weights: FlexTensor,
        units: FlexTensor,
        _deferred: Option<UnitsGradient>,
    ) -> FlexTensor {
        forward_any(&weights, &units, None)
    }

    fn stream_mix_add(
        weights: FlexTensor,
        units: FlexTensor,
        beta: FlexTensor,
        branch: FlexTensor,
        _deferred: Option<UnitsGradient>,
    ) -> FlexTensor {
        forward_any(&weights, &units, Some((&beta, &branch)))
    }

    fn stream_mix_backward(
        weights: FlexTensor,
        units: FlexTensor,
        grad: FlexTensor,
        deferred: Option<UnitsGradient>,
    ) -> (FlexTensor, Option<FlexTensor>) {
        let (grad_weights, grad_units, _, _) = backward_any(weights, &units, None, grad, deferred);
        (grad_weights, grad_units)
    }

    fn stream_mix_add_backward(
        weights: FlexTensor,
        units: FlexTensor,
        beta: FlexTensor,
        branch: FlexTensor,
        grad: FlexTensor,
        deferred: Option<UnitsGradient>,
    ) -> (FlexTensor, Option<FlexTensor>, FlexTensor, FlexTensor) {
        let (grad_weights, grad_units, grad_beta, grad_branch) =
            backward_any(weights, &units, Some((&beta, &branch)), grad, deferred);
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
    type State = ([NodeId; 2], Option<UnitsGradient>);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (nodes, deferred) = ops.state;
        let [weights, units] = nodes.map(|id| checkpointer.retrieve_node_output(id));
        let (grad_weights, grad_units) = B::stream_mix_backward(weights, units, grad, deferred);
        let [weights_parent, units_parent] = ops.parents;
        register_tracked!(grads, [weights_parent], [grad_weights]);
        // `∂S` where it was computed, not left in the units' gradient slot.
        register_tracked!(grads, [units_parent], grad_units);
    }
}

impl<B: StreamMixBackend> Backward<B, 4> for MixAdd {
    type State = ([NodeId; 4], Option<UnitsGradient>);

    fn backward(
        self,
        ops: Ops<Self::State, 4>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (nodes, deferred) = ops.state;
        let [weights, units, beta, branch] = nodes.map(|id| checkpointer.retrieve_node_output(id));
        let (grad_weights, grad_units, grad_beta, grad_branch) =
            B::stream_mix_add_backward(weights, units, beta, branch, grad, deferred);
        let [weights_parent, units_parent, beta_parent, branch_parent] = ops.parents;
        register_tracked!(
            grads,
            [weights_parent, beta_parent, branch_parent],
            [grad_weights, grad_beta, grad_branch]
        );
        // `∂S` where it was computed, not left in the units' gradient slot.
        register_tracked!(grads, [units_parent], grad_units);
    }
}

impl<B: StreamMixBackend, C: CheckpointStrategy> StreamMixBackend for Autodiff<B, C> {
    fn stream_mix(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        deferred: Option<UnitsGradient>,
    ) -> FloatTensor<Self> {
        tracked_op::<B, C, _, _>(
            Mix,
            [weights, units],
            |[weights, units]| B::stream_mix(weights, units, None),
            |nodes, _| (nodes, deferred),
        )
    }

    fn stream_mix_add(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        deferred: Option<UnitsGradient>,
    ) -> FloatTensor<Self> {
        tracked_op::<B, C, _, _>(
            MixAdd,
            [weights, units, beta, branch],
            |[weights, units, beta, branch]| B::stream_mix_add(weights, units, beta, branch, None),
            |nodes, _| (nodes, deferred),
        )
    }

    // First-order only: the gradients are constants to the graph.

    fn stream_mix_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        deferred: Option<UnitsGradient>,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let (grad_weights, grad_units) = B::stream_mix_backward(
            weights.into_primitive(),
            units.into_primitive(),
            grad.into_primitive(),
            deferred,
        );
        (
            constant::<B, C>(grad_weights),
            grad_units.map(constant::<B, C>),
        )
    }

    fn stream_mix_add_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        deferred: Option<UnitsGradient>,
    ) -> (
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let (grad_weights, grad_units, grad_beta, grad_branch) = B::stream_mix_add_backward(
            weights.into_primitive(),
            units.into_primitive(),
            beta.into_primitive(),
            branch.into_primitive(),
            grad.into_primitive(),
            deferred,
        );
        (
            constant::<B, C>(grad_weights),
            grad_units.map(constant::<B, C>),
            constant::<B, C>(grad_beta),
            constant::<B, C>(grad_branch),
        )
    }
}

#[cfg(test)]
mod tests {
    use burn::prelude::*;
    use burn::tensor::Tolerance;

    use super::{UnitsGradient, fused_stream_mix};
    use crate::backend::RowScale;
    use crate::backend::normed_projection::fused_normed_projection;
    use crate::backend::units::composed_mix;
    use crate::test_util::standard_normal as random;

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
            let weights = random([weight_tokens, units, rows], 1, &device);
            let units_in = random([tokens, units, width], 2, &device);
            let beta = random([weight_tokens, rows, 1], 3, &device);
            let branch = random([tokens, views, width], 4, &device);
            let probe = random([tokens, rows, width], 5, &device);
            let run = |fused: bool| {
                let leaves = [&weights, &units_in, &beta, &branch]
                    .map(|tensor| tensor.clone().detach().require_grad());
                let [w, s, b, h] = leaves.clone();
                let with = addend.then_some((b, h));
                let w = w.swap_dims(1, 2);
                let output = if fused {
                    fused_stream_mix(w, s, with, None)
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
            // Shared weights' gradients sum over every token in another order: entries that
            // cancel keep the rounding of their terms (see `assert_tensors_close`).
            let case = format!("T={tokens} R={rows} U={units} w={width} V={views} {per_token}");
            crate::test_util::assert_tensors_close(
                &[vec![fused], fused_grads].concat(),
                &[vec![composed], composed_grads].concat(),
                1e-4,
                &case,
            );
        }
    }

    /// One layer's three readers of its units (the normalised projection, the input mix, the
    /// residual mix, weights made from the projection as in HC) with the units' gradient slot,
    /// against the same ops without it: every gradient equal, also when the block ignores its
    /// input (the input mix off the loss's path) or the residual mix is off it.
    #[test]
    fn deferred_units_gradient_matches_separate_gradients() {
        let device = Device::flex().autodiff();
        let (tokens, count, width) = (37, 4, 24);
        let columns = 1 + count + 1;
        let units_in = random([tokens, count, width], 6, &device);
        let phi_in = random([width, columns], 7, &device);
        let constant_in = random([tokens, 1, width], 8, &device);
        let probes = [
            random([tokens, 1, width], 9, &device),
            random([tokens, count, width], 10, &device),
        ];
        let scale = RowScale {
            numerator: (width as f64).sqrt(),
            offset: 0.0,
            floor: 1e-12,
            root_offset: 0.0,
        };
        for (uses_input, input_in_loss, residual_in_loss) in [
            (true, false, true),
            (true, true, true),
            (false, false, true),
            (true, true, false),
        ] {
            let run = |slot: bool| {
                let [units, constant] =
                    [&units_in, &constant_in].map(|tensor| tensor.clone().detach().require_grad());
                let phi = phi_in.clone().detach().require_grad();
                let slot = slot.then(UnitsGradient::default);
                let rows = units.clone().reshape([tokens * count, width]);
                let projected = fused_normed_projection(rows, phi.clone(), scale, slot.as_ref())
                    .tanh()
                    .reshape([tokens, count, columns]);
                let w_in = projected.clone().narrow(2, 0, 1).swap_dims(1, 2);
                let w_res = projected.clone().narrow(2, 1, count).swap_dims(1, 2);
                let beta = projected.narrow(2, 1 + count, 1);
                let input = fused_stream_mix(w_in, units.clone(), None, slot.as_ref());
                let branch = if uses_input {
                    input.clone().sin()
                } else {
                    constant.clone()
                };
                let next =
                    fused_stream_mix(w_res, units.clone(), Some((beta, branch)), slot.as_ref());
                let terms = [
                    input_in_loss.then(|| (input * probes[0].clone()).sum()),
                    residual_in_loss.then(|| (next * probes[1].clone()).sum()),
                ];
                let loss = terms
                    .into_iter()
                    .flatten()
                    .reduce(|a, b| a + b)
                    .expect("a loss");
                let grads = loss.backward();
                [
                    units.grad(&grads).map(|grad| grad.into_data()),
                    phi.grad(&grads).map(|grad| grad.into_data()),
                    constant.grad(&grads).map(|grad| grad.into_data()),
                ]
            };
            let (deferred, separate) = (run(true), run(false));
            for (deferred, separate) in deferred.iter().zip(&separate) {
                match (deferred, separate) {
                    (Some(deferred), Some(separate)) => deferred.assert_approx_eq::<f32>(
                        separate,
                        Tolerance::absolute(1e-5).set_relative(1e-4),
                    ),
                    (None, None) => {}
                    _ => panic!("a gradient in one run only"),
                }
            }
        }
    }
}
