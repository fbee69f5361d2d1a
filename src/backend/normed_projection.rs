//! The token-dependent connections' first step in hyper-connections and mHC, a projection of
//! row-normalised units, as one fused CPU op on Flex with its own backward.
//!
//! For rows `x_r` (`[R, w]`), a small weight matrix `W` (`[w, C]`) and a row scale
//! `s(n) = a / max(√(n² + c) + b, f)` of the row norm `n_r = ‖x_r‖₂`:
//!
//! ```text
//! P_r  = s(n_r) · x_r W                                             ([R, C])
//! ∂W   = Σ_r s(n_r) x_rᵀ ∂P_r
//! ∂x_r = s(n_r) W ∂P_rᵀ + s'(n_r) / n_r · (x_r W · ∂P_r) x_r        (s'(n)/n = −s / (ρ + b) / ρ, ρ = √(n² + c), where ρ + b > f, else 0)
//! ```
//!
//! Hyper-connections' RMSNorm is `a = √w, b = 0, f = 1e-12`; mHC's `1 / (‖x‖/√N + ε)` is
//! `a = √N, b = ε√N, f = 0`; an RMS norm `1/sqrt(‖x‖²/N + ε)` (DeepSeek-V4's) is
//! `a = √N, c = Nε`. Composed from tensor ops this is a full-size square, a sum, and a
//! skinny matrix product (`C` ≤ 24 columns) whose input gradient is a full-size product of
//! inner dimension `C`, each a pass over the units, plus a full-size gradient for the square
//! and one more accumulation into the units' gradient. Here the forward is one matrix product
//! (`gemm`, as Flex's own) and a pass for the row norms; the backward starts the rows' gradient
//! with the `x_r` term and, where the rows are a layer's units whose mixes left their parts of
//! the units' gradient in a [`UnitsGradient`] (see there), those parts, in one pass, then adds
//! `(s ∂P) Wᵀ` in an accumulating product, so that the units' gradient is written once for all
//! three ops; `∂W = xᵀ (s ∂P)` is one more product. Onto at most 16 columns (AttnRes's logits)
//! each way is one pass over the rows instead, every row's norm, products and gradients taken
//! while it is in cache, with the terms the token mixes over the rows left (AttnRes's sources,
//! see `token_mix_leaving`) added to each row's gradient in the same pass. The softmax mixtures
//! over the rows (see `softmax_mix`) leave `(p, ∂h, ⟨∂h, h⟩, c)` each: the pass adds
//! `p (⟨∂h, x_r⟩ − ⟨∂h, h⟩)` to column `c` of `∂P_r` before using it, and `p ∂h` to `∂x_r`;
//! those always take the one pass. Flex only (f32 and f64).

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

use super::RowScale;
use super::autodiff::{constant, tracked_op};
use super::flex_kernels::{
    Scalar, Strided, add_weighted_sum, axpy, dims, dot, dots, from_f64, new_product, product,
    tensor, to_f64, unwritten, values, write_axpy, written, zeroed,
};
use super::stream_mix::{DeferredTerms, LogitTerm, UnitsGradient};

/// Rows per parallel task.
const ROWS_PER_TASK: usize = 32;

/// The most columns projected in one pass over the rows each way ([`forward_in_one_pass`],
/// [`backward_in_one_pass`]); more (HC's and mHC's 24 and up) go through gemm, whose blocked
/// products make up for the extra passes.
const ROW_PASS_COLUMNS: usize = 16;

/// Whether a projection of rows of `width` onto `columns` goes through the one-pass ops.
fn takes_one_pass(width: usize, columns: usize) -> bool {
    width > 0 && (1..=ROW_PASS_COLUMNS).contains(&columns)
}

/// Rows per band of the general path: a band (512 kB of mHC's `[T, 4·256]` units) stays in a
/// core's cache through its product, its scales and, backward, its part of `∂W`.
const ROWS_PER_BAND: usize = 128;

/// Rows per task of [`backward_in_one_pass`], each with its own part of `∂W`.
const ROWS_PER_WEIGHT_PART: usize = 128;

impl RowScale {
    /// `s(n)` and `s'(n) / n` (0 where `s` is flat, and for a zero row, whose term vanishes).
    fn at(self, norm: f64) -> (f64, f64) {
        // `ρ = √(n² + c)`, `s = a / (ρ + b)`, `s'(n) / n = −s / (ρ + b) / ρ`.
        let root = if self.root_offset == 0.0 {
            norm
        } else {
            (norm * norm + self.root_offset).sqrt()
        };
        let denominator = root + self.offset;
        if denominator > self.floor {
            let scale = self.numerator / denominator;
            let slope = if norm > 0.0 {
                -scale / denominator / root
            } else {
                0.0
            };
            (scale, slope)
        } else {
            (self.numerator / self.floor, 0.0)
        }
    }

    /// [`at`](Self::at) the norm of `row`, in the row's precision.
    pub(super) fn of_row<E: Scalar>(self, row: &[E]) -> (E, E) {
        let (scale, slope) = self.at(to_f64(dot(row, row)).sqrt());
        (from_f64(scale), from_f64(slope))
    }
}

/// The fused normalised projection (see the [module docs](self)).
#[backend_extension(Flex: cfg(feature = "flex"), Autodiff)]
pub(crate) trait NormedProjectionBackend: Backend {
    /// `P = s(‖x_r‖) x_r W` for `rows [R, w]`, `weights [w, C]`; `[R, C]`. Under autodiff it
    /// claims `deferred`: its backward writes the whole gradient of the units the rows are.
    fn normed_projection(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        scale: RowScale,
        deferred: Option<UnitsGradient>,
    ) -> FloatTensor<Self>;

    /// The gradients of `rows` (plus what was left in `deferred`) and `weights`, given the
    /// output `projection` and its gradient.
    fn normed_projection_backward(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        projection: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: RowScale,
        deferred: Option<UnitsGradient>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// `s(‖x_r‖) x_r W` through the fused op; only for Flex devices in f32 or f64. `deferred`: the
/// gradient slot of the units whose reshape `rows` is.
pub(crate) fn fused_normed_projection(
    rows: Tensor<2>,
    weights: Tensor<2>,
    scale: RowScale,
    deferred: Option<&UnitsGradient>,
) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as NormedProjectionBackend>::normed_projection(
        rows.into_dispatch(),
        weights.into_dispatch(),
        scale,
        deferred.cloned(),
    ))
}

fn forward<E: Scalar>(rows: &FlexTensor, weights: &FlexTensor, scale: RowScale) -> FlexTensor {
    let [count, width] = dims::<2>(rows);
    let [weight_rows, columns] = dims::<2>(weights);
    assert_eq!(
        weight_rows, width,
        "normed projection: weights and rows disagree"
    );
    let (x, w) = (values::<E>(rows), values::<E>(weights));
    if takes_one_pass(width, columns) {
        return forward_in_one_pass(&x, &w, (width, columns), scale);
    }
    if width == 0 || columns == 0 {
        return tensor(vec![E::zero(); count * columns], [count, columns]);
    }
    // Bands of rows in parallel, each its product and its rows' scales while it is in cache:
    // one read of `x`, and both cores on a product too skinny for gemm to split well.
    let mut out = unwritten::<E>(count * columns);
    out.par_chunks_mut(ROWS_PER_BAND * columns)
        .zip(x.par_chunks(ROWS_PER_BAND * width))
        .for_each(|(out, x)| {
            let band = x.len() / width;
            let out = zeroed(out);
            product(
                out,
                false,
                (band, columns, width),
                Strided::row_major(x, width),
                Strided::row_major(&w, columns),
            );
            for (out, x) in out.chunks_exact_mut(columns).zip(x.chunks_exact(width)) {
                let (s, _) = scale.of_row(x);
                out.iter_mut().for_each(|value| *value = *value * s);
            }
        });
    // SAFETY: the bands partition `out`, each zeroed.
    tensor(unsafe { written(out) }, [count, columns])
}

/// The transpose of the row-major `[rows, columns]` `matrix`: `W`'s columns as rows for the
/// one-pass ops, and their `∂Wᵀ` back.
fn transpose<E: Scalar>(matrix: &[E], (rows, columns): (usize, usize)) -> Vec<E> {
    (0..columns * rows)
        .map(|i| matrix[(i % rows) * columns + i / rows])
        .collect()
}

/// `s(‖x_r‖) x_r W` onto at most [`ROW_PASS_COLUMNS`] columns in one pass over the rows: each
/// row's norm and its products with the columns of `W` while it is in cache, where the general
/// path reads `x` once in gemm and once more for the norms.
fn forward_in_one_pass<E: Scalar>(
    x: &[E],
    w: &[E],
    (width, columns): (usize, usize),
    scale: RowScale,
) -> FlexTensor {
    let count = x.len() / width;
    let transposed = transpose(w, (width, columns));
    let columns_of_w: Vec<&[E]> = transposed.chunks_exact(width).collect();
    let mut out = vec![E::zero(); count * columns];
    out.par_chunks_mut(ROWS_PER_TASK * columns)
        .zip(x.par_chunks(ROWS_PER_TASK * width))
        .for_each(|(out, x)| {
            for (out, x) in out.chunks_exact_mut(columns).zip(x.chunks_exact(width)) {
                let (s, _) = scale.of_row(x);
                dots(x, &columns_of_w, out);
                out.iter_mut().for_each(|value| *value = *value * s);
            }
        });
    tensor(out, [count, columns])
}

/// The gradients of the rows (plus the parts of the units' gradient in `deferred`) and of `W`:
/// `∂x` starts as the deferred parts and the `x_r` term, then takes `(s ∂P) Wᵀ` in one
/// accumulating product; `∂W = xᵀ (s ∂P)`.
fn backward<E: Scalar>(
    rows: &FlexTensor,
    weights: &FlexTensor,
    projection: &FlexTensor,
    grad: &FlexTensor,
    scale: RowScale,
    deferred: &DeferredTerms<'_, E>,
    logit_terms: &[LogitTermValues<'_, E>],
) -> (FlexTensor, FlexTensor) {
    let [count, width] = dims::<2>(rows);
    let columns = dims::<2>(weights)[1];
    let (x, w, p, g) = (
        values::<E>(rows),
        values::<E>(weights),
        values::<E>(projection),
        values::<E>(grad),
    );
    // One pass also where each row is the one unit of a token of the deferred parts (AttnRes's
    // sources), and always for the softmax mixtures' parts, which only it takes.
    if width > 0
        && columns > 0
        && deferred.one_unit_rows(width)
        && (takes_one_pass(width, columns) || !logit_terms.is_empty())
    {
        let inputs = [&x[..], &w[..], &p[..], &g[..]];
        return backward_in_one_pass(inputs, (width, columns), scale, deferred, logit_terms);
    }
    assert!(
        logit_terms.is_empty() || width == 0 || columns == 0,
        "normed projection: softmax mixtures' parts over rows that are not their tokens"
    );
    if width == 0 || columns == 0 {
        // No projection: the units' gradient is what the mixes left.
        let mut grad_rows = vec![E::zero(); count * width];
        if width > 0 {
            deferred.add_to(0, &mut grad_rows);
        }
        return (
            tensor(grad_rows, [count, width]),
            tensor(vec![E::zero(); width * columns], [width, columns]),
        );
    }
    // Bands take whole tokens of the units (HC's rows are units, `U` per token; mHC's are
    // tokens), so that each adds the deferred parts of its own tokens.
    let token_len = deferred.token_len();
    let band_rows = if deferred.is_empty() {
        ROWS_PER_BAND
    } else {
        assert!(
            token_len.is_multiple_of(width) && (count * width).is_multiple_of(token_len),
            "normed projection: rows of {width} are not whole tokens of {token_len}"
        );
        ROWS_PER_BAND.next_multiple_of(token_len / width)
    };
    let mut grad_rows = unwritten::<E>(count * width);
    // Per band, while its rows are in cache: `s_r ∂P_r` and the coefficient of `x_r` in `∂x_r`,
    // `s'/n · x_r W · ∂P_r` where `x_r W · ∂P_r = (P_r · ∂P_r) / s_r`; the band's `∂x` from the
    // deferred parts, the `x_r` term and `(s ∂P) Wᵀ`; and its part of `∂W = xᵀ (s ∂P)`. The
    // parts are summed in the bands' order after, the same sum on every run.
    let parts: Vec<Vec<E>> = grad_rows
        .par_chunks_mut(band_rows * width)
        .zip(x.par_chunks(band_rows * width))
        .zip(p.par_chunks(band_rows * columns))
        .zip(g.par_chunks(band_rows * columns))
        .enumerate()
        .map(|(index, (((grad_x, x), p), g))| {
            let band = x.len() / width;
            let mut scaled = vec![E::zero(); band * columns];
            let grad_x = zeroed(grad_x);
            deferred.add_to(index * band_rows * width / token_len.max(1), grad_x);
            for ((((scaled, grad_x), x), p), g) in scaled
                .chunks_exact_mut(columns)
                .zip(grad_x.chunks_exact_mut(width))
                .zip(x.chunks_exact(width))
                .zip(p.chunks_exact(columns))
                .zip(g.chunks_exact(columns))
            {
                let (s, slope) = scale.of_row(x);
                scaled.iter_mut().zip(g).for_each(|(out, &g)| *out = s * g);
                axpy(grad_x, slope * dot(p, g) / s, x);
            }
            product(
                grad_x,
                true,
                (band, width, columns),
                Strided::row_major(&scaled, columns),
                Strided::transposed(&w, columns),
            );
            new_product(
                (width, columns, band),
                Strided::transposed(x, width),
                Strided::row_major(&scaled, columns),
            )
        })
        .collect();
    let mut grad_weights = vec![E::zero(); width * columns];
    for part in &parts {
        axpy(&mut grad_weights, E::one(), part);
    }
    // SAFETY: the bands partition `grad_rows`, each zeroed.
    let grad_rows = unsafe { written(grad_rows) };
    (
        tensor(grad_rows, [count, width]),
        tensor(grad_weights, [width, columns]),
    )
}

/// `∂x` and `∂W` of a projection onto at most [`ROW_PASS_COLUMNS`] columns (AttnRes's logits:
/// one column per query; any number where softmax mixtures left parts), in one pass over the
/// rows: each row's scale from its norm, its `∂P_r` with the softmax mixtures' parts added, its
/// row of `∂x` written once, as `c_r x_r + Σ_q (s ∂P)[r, q] Wᵀ[q]` plus the row's deferred
/// parts (each row one unit of a token) and the mixtures' `p ∂h`, and its `x_r ⊗ (s ∂P)_r`
/// added to its task's part of `∂Wᵀ`, the parts summed at the end. The general path reads `x` three times (norms, the `x_r`
/// term, `∂W`'s product) and writes `∂x` three times (zeroed, the `x_r` term, the accumulating
/// product), and a product this small runs on one thread in gemm.
fn backward_in_one_pass<E: Scalar>(
    [x, w, p, g]: [&[E]; 4],
    (width, columns): (usize, usize),
    scale: RowScale,
    deferred: &DeferredTerms<'_, E>,
    logit_terms: &[LogitTermValues<'_, E>],
) -> (FlexTensor, FlexTensor) {
    let count = x.len() / width;
    assert!(
        deferred.one_unit_rows(width),
        "normed projection: one pass takes deferred parts of one unit a row"
    );
    for term in logit_terms {
        assert!(
            term.column < columns && term.grad.len() == count * width,
            "normed projection: a softmax mixture's part of another shape"
        );
    }
    let transposed = transpose(w, (width, columns));
    let mut grad_rows = unwritten::<E>(count * width);
    // One part of `∂Wᵀ` per task, summed in the tasks' order: the same sum on every run.
    let parts: Vec<Vec<E>> = grad_rows
        .par_chunks_mut(ROWS_PER_WEIGHT_PART * width)
        .zip(x.par_chunks(ROWS_PER_WEIGHT_PART * width))
        .zip(p.par_chunks(ROWS_PER_WEIGHT_PART * columns))
        .zip(g.par_chunks(ROWS_PER_WEIGHT_PART * columns))
        .enumerate()
        .map(|(task, (((grad_x, x), p), g))| {
            let mut part = vec![E::zero(); columns * width];
            let mut scaled = vec![E::zero(); columns];
            let mut grad_p = vec![E::zero(); columns];
            let mut terms = Vec::with_capacity(columns);
            for (i, (((grad_x, x), p), g)) in grad_x
                .chunks_exact_mut(width)
                .zip(x.chunks_exact(width))
                .zip(p.chunks_exact(columns))
                .zip(g.chunks_exact(columns))
                .enumerate()
            {
                let t = task * ROWS_PER_WEIGHT_PART + i;
                // `∂P_r`, with each softmax mixture's `p (⟨∂h, x_r⟩ − ⟨∂h, h⟩)` in its column.
                grad_p.copy_from_slice(g);
                for term in logit_terms {
                    let dh = term.row(t);
                    grad_p[term.column] += term.weights[t] * (dot(dh, x) - term.centre[t]);
                }
                // As the general path: `s ∂P_r`, and `s'/n · (P_r · ∂P_r) / s` for `x_r`.
                let (s, slope) = scale.of_row(x);
                scaled
                    .iter_mut()
                    .zip(&grad_p)
                    .for_each(|(out, &g)| *out = s * g);
                let grad_x = write_axpy(grad_x, None, slope * dot(p, &grad_p) / s, x);
                terms.clear();
                terms.extend(scaled.iter().copied().zip(transposed.chunks_exact(width)));
                deferred.push_terms(t, 0, &mut terms);
                // Each softmax mixture's `p ∂h`, its `∂h` row still in cache from the dot.
                terms.extend(
                    logit_terms
                        .iter()
                        .map(|term| (term.weights[t], term.row(t))),
                );
                add_weighted_sum(grad_x, &terms);
                for (&scaled, part) in scaled.iter().zip(part.chunks_exact_mut(width)) {
                    axpy(part, scaled, x);
                }
            }
            part
        })
        .collect();
    let mut grad_transposed = vec![E::zero(); columns * width];
    for part in &parts {
        axpy(&mut grad_transposed, E::one(), part);
    }
    // SAFETY: the tasks' chunks partition `grad_rows`, and `write_axpy` wrote each row whole.
    let grad_rows = unsafe { written(grad_rows) };
    (
        tensor(grad_rows, [count, width]),
        tensor(
            transpose(&grad_transposed, (columns, width)),
            [width, columns],
        ),
    )
}

/// [`backward`] with the parts left in the slot (`terms`, `logit_terms`) read as `E`.
fn backward_with<E: Scalar>(
    [rows, weights, projection, grad]: [&FlexTensor; 4],
    scale: RowScale,
    terms: &[(FlexTensor, FlexTensor)],
    logit_terms: &[LogitTerm],
) -> (FlexTensor, FlexTensor) {
    let deferred = DeferredTerms::<E>::new(terms);
    let logit_terms = LogitTermValues::<E>::all(logit_terms);
    backward(
        rows,
        weights,
        projection,
        grad,
        scale,
        &deferred,
        &logit_terms,
    )
}

/// A softmax mixture's part ([`LogitTerm`]) as values.
struct LogitTermValues<'a, E: Scalar> {
    weights: std::borrow::Cow<'a, [E]>,
    grad: std::borrow::Cow<'a, [E]>,
    centre: std::borrow::Cow<'a, [E]>,
    column: usize,
    width: usize,
}

impl<'a, E: Scalar> LogitTermValues<'a, E> {
    fn all(terms: &'a [LogitTerm]) -> Vec<Self> {
        terms
            .iter()
            .map(|term| {
                let [_, width] = dims::<2>(&term.grad);
                Self {
                    weights: values::<E>(&term.weights),
                    grad: values::<E>(&term.grad),
                    centre: values::<E>(&term.centre),
                    column: term.column,
                    width,
                }
            })
            .collect()
    }

    /// `∂h` of token `t`.
    fn row(&self, t: usize) -> &[E] {
        &self.grad[t * self.width..][..self.width]
    }
}

impl NormedProjectionBackend for Flex {
    fn normed_projection(
        rows: FlexTensor,
        weights: FlexTensor,
        scale: RowScale,
        _deferred: Option<UnitsGradient>,
    ) -> FlexTensor {
        match rows.dtype() {
            DType::F32 => forward::<f32>(&rows, &weights, scale),
            DType::F64 => forward::<f64>(&rows, &weights, scale),
            other => panic!("normed projection: unsupported dtype {other:?}"),
        }
    }

    fn normed_projection_backward(
        rows: FlexTensor,
        weights: FlexTensor,
        projection: FlexTensor,
        grad: FlexTensor,
        scale: RowScale,
        deferred: Option<UnitsGradient>,
    ) -> (FlexTensor, FlexTensor) {
        let (terms, logit_terms) = deferred.map(|deferred| deferred.take()).unwrap_or_default();
        let inputs = [&rows, &weights, &projection, &grad];
        match rows.dtype() {
            DType::F32 => backward_with::<f32>(inputs, scale, &terms, &logit_terms),
            DType::F64 => backward_with::<f64>(inputs, scale, &terms, &logit_terms),
            other => panic!("normed projection: unsupported dtype {other:?}"),
        }
    }
}

/// `s(‖x_r‖) x_r W`: parents `[x, W]`; the state keeps both, the (small) output and the units'
/// gradient slot it claimed.
#[derive(Debug)]
struct NormedProjection;

impl<B: NormedProjectionBackend> Backward<B, 2> for NormedProjection {
    type State = ([NodeId; 2], FloatTensor<B>, RowScale, Option<UnitsGradient>);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (nodes, projection, scale, deferred) = ops.state;
        let [rows, weights] = nodes.map(|id| checkpointer.retrieve_node_output(id));
        let (grad_rows, grad_weights) =
            B::normed_projection_backward(rows, weights, projection, grad, scale, deferred);
        register_tracked!(grads, ops.parents, [grad_rows, grad_weights]);
    }
}

impl<B: NormedProjectionBackend, C: CheckpointStrategy> NormedProjectionBackend for Autodiff<B, C> {
    fn normed_projection(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        scale: RowScale,
        deferred: Option<UnitsGradient>,
    ) -> FloatTensor<Self> {
        tracked_op::<B, C, _, _>(
            NormedProjection,
            [rows, weights],
            |[rows, weights]| B::normed_projection(rows, weights, scale, None),
            |nodes, output| {
                // This projection writes the units' gradient (see `UnitsGradient`).
                if let Some(deferred) = &deferred {
                    deferred.claim();
                }
                (nodes, output.clone(), scale, deferred)
            },
        )
    }

    fn normed_projection_backward(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        projection: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: RowScale,
        deferred: Option<UnitsGradient>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // First-order only: the gradients are constants to the graph.
        let (grad_rows, grad_weights) = B::normed_projection_backward(
            rows.into_primitive(),
            weights.into_primitive(),
            projection.into_primitive(),
            grad.into_primitive(),
            scale,
            deferred,
        );
        (constant::<B, C>(grad_rows), constant::<B, C>(grad_weights))
    }
}

#[cfg(test)]
mod tests {
    use burn::prelude::*;
    use burn::tensor::FloatDType;

    use super::fused_normed_projection;
    use crate::backend::RowScale;
    use crate::backend::units::composed_normed_projection;

    /// The fused op against the composed tensor ops on Flex, forward and both gradients, in f32
    /// and f64: both row scales (HC's floor, mHC's offset), column counts around the blocks of
    /// four and on both sides of the one-pass backward's limit, widths that do not fill the
    /// lanes, row counts that do not fill the last task, rows of very different norms, and rows
    /// handed over transposed (not contiguous).
    #[test]
    fn fused_op_matches_the_composed_operations() {
        let device = Device::flex().autodiff();
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
        // DeepSeek-V4's RMS scale, `ε` made large enough to matter.
        let rms = |width: usize| RowScale {
            numerator: (width as f64).sqrt(),
            offset: 0.0,
            floor: 0.0,
            root_offset: 0.3 * width as f64,
        };
        for dtype in [FloatDType::F32, FloatDType::F64] {
            for (count, width, columns, transposed, scale) in [
                (70, 24, 6, false, hc(24)),
                (35, 32, 24, false, rms(32)),
                (6, 12, 5, true, rms(12)),
                (9, 100, 6, false, hc(100)),
                (33, 37, 24, false, mhc(37)),
                (5, 8, 1, true, hc(8)),
                (40, 10, 7, true, mhc(10)),
                (1, 3, 4, false, hc(3)),
                // Past one part of the one-pass backward's `∂W` (128 rows), the last part short.
                (300, 37, 13, false, rms(37)),
                (260, 16, 16, true, mhc(16)),
                // Past one band of the general path (128 rows), the last band short.
                (300, 20, 24, false, mhc(20)),
            ] {
                // Fixed draws: a case that fails fails again, on every machine.
                let random = |shape: [usize; 2], seed: u64| {
                    crate::test_util::fixed_normal(shape, 1.0, seed, &device).cast(dtype)
                };
                // Row r scaled by 10^(r mod 5 − 2): norms from 1e-2 to 1e2 of the typical one.
                let magnitudes: Vec<f64> =
                    (0..count).map(|r| 10f64.powi((r % 5) as i32 - 2)).collect();
                let magnitudes =
                    Tensor::<1>::from_data(TensorData::new(magnitudes, [count]), &device)
                        .cast(dtype)
                        .reshape([count, 1]);
                let rows = if transposed {
                    random([width, count], 1).transpose()
                } else {
                    random([count, width], 2)
                } * magnitudes;
                let inverse_scales = crate::test_util::inverse_row_scales(&rows, scale);
                let weights = random([width, columns], 3);
                let probe = random([count, columns], 4);
                let run = |fused: bool| {
                    let (x, w) = (rows.clone().require_grad(), weights.clone().require_grad());
                    let output = if fused {
                        fused_normed_projection(x.clone(), w.clone(), scale, None)
                    } else {
                        composed_normed_projection(x.clone(), w.clone(), scale)
                    };
                    let grads = (output.clone() * probe.clone()).sum().backward();
                    // ∂rows in the rows' own scale (∂x ∝ s(‖x‖)): a row of norm 1e-2 would
                    // otherwise set the tolerance of a row of norm 1e2.
                    [
                        output.into_data(),
                        (x.grad(&grads).unwrap() * inverse_scales.clone()).into_data(),
                        w.grad(&grads).unwrap().into_data(),
                    ]
                };
                let (fused, composed) = (run(true), run(false));
                // f32: to 1e-4 of an entry or 1e-5 of its tensor's scale (entries that cancel
                // keep the rounding of their terms, see `assert_tensors_close`). The paths'
                // worst f32 difference on these draws is about 1% of that; scaling one term
                // of ∂x by 1.003 fails.
                let relative = match dtype {
                    FloatDType::F64 => 1e-9,
                    _ => 1e-4,
                };
                let case = format!("{dtype:?} R={count} w={width} c={columns}");
                crate::test_util::assert_tensors_close(&fused, &composed, relative, &case);
            }
        }
    }
}
