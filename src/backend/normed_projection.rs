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
//! and one more accumulation into the units' gradient. Here the forward reads the rows once,
//! and the backward reads them once and writes their gradient once, `∂W` summed on the way.
//! Where the rows are a layer's units and the layer's mixes left their parts of the units'
//! gradient in a [`UnitsGradient`] (see there), the backward adds those in the same pass, so
//! the units' gradient is written once for all three ops. Flex only (f32 and f64).

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
    Scalar, axpy, dims, dot, from_f64, tensor, to_f64, unwritten, values, written, zeroed,
};
use super::stream_mix::{DeferredTerms, UnitsGradient};

/// Rows per parallel task.
const ROWS_PER_TASK: usize = 32;

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

/// `Wᵀ` (`[C, w]`, contiguous), so that each column of `W` is a contiguous row.
fn transposed<E: Scalar>(weights: &FlexTensor) -> (Vec<E>, usize) {
    let [width, columns] = dims::<2>(weights);
    let w = values::<E>(weights);
    let mut wt = vec![E::zero(); columns * width];
    for (k, row) in w.chunks_exact(columns).enumerate() {
        for (c, &value) in row.iter().enumerate() {
            wt[c * width + k] = value;
        }
    }
    (wt, columns)
}

/// The forward of one task's rows `x` (`[r, w]`) into `out` (`[r, C]`), portable.
fn forward_rows<E: Scalar>(x: &[E], wt: &[E], width: usize, scale: RowScale, out: &mut [E]) {
    let columns = wt.len() / width;
    for (out, x) in out.chunks_exact_mut(columns).zip(x.chunks_exact(width)) {
        let s = from_f64::<E>(scale.at(to_f64(dot(x, x)).sqrt()).0);
        for (out, row) in out.iter_mut().zip(wt.chunks_exact(width)) {
            *out = s * dot(x, row);
        }
    }
}

/// The backward of one task's rows, portable: `∂x` added to `grad_x` (`[r, w]`), `∂Wᵀ` added to
/// `grad_wt` (`[C, w]`); `scaled` is scratch space for `s_r ∂P_r` (`[r, C]`).
#[allow(clippy::too_many_arguments)]
fn backward_rows<E: Scalar>(
    x: &[E],
    wt: &[E],
    width: usize,
    (p, g): (&[E], &[E]),
    scale: RowScale,
    grad_x: &mut [E],
    grad_wt: &mut [E],
    scaled: &mut [E],
) {
    let columns = wt.len() / width;
    let rows = grad_x
        .chunks_exact_mut(width)
        .zip(x.chunks_exact(width))
        .zip(p.chunks_exact(columns).zip(g.chunks_exact(columns)))
        .zip(scaled.chunks_exact_mut(columns));
    for (((grad_x, x), (p, g)), scaled) in rows {
        let (s, slope) = scale.at(to_f64(dot(x, x)).sqrt());
        // x W · ∂P = (P · ∂P) / s.
        let coefficient = from_f64::<E>(slope * to_f64(dot(p, g)) / s);
        let s = from_f64::<E>(s);
        axpy(grad_x, coefficient, x);
        for ((scaled, &g), (row, grad_row)) in scaled
            .iter_mut()
            .zip(g)
            .zip(wt.chunks_exact(width).zip(grad_wt.chunks_exact_mut(width)))
        {
            *scaled = s * g;
            axpy(grad_x, *scaled, row);
            axpy(grad_row, *scaled, x);
        }
    }
}

/// The row loops of one task, for each float type: the portable loops above, and for f32 on
/// x86-64 CPUs with AVX2 and FMA hand-vectorised ones ([`avx2`]).
trait RowKernels: Scalar {
    fn forward_rows(x: &[Self], wt: &[Self], width: usize, scale: RowScale, out: &mut [Self]) {
        forward_rows(x, wt, width, scale, out);
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_rows(
        x: &[Self],
        wt: &[Self],
        width: usize,
        pg: (&[Self], &[Self]),
        scale: RowScale,
        grad_x: &mut [Self],
        grad_wt: &mut [Self],
        scaled: &mut [Self],
    ) {
        backward_rows(x, wt, width, pg, scale, grad_x, grad_wt, scaled);
    }
}

impl RowKernels for f64 {}

impl RowKernels for f32 {
    fn forward_rows(x: &[f32], wt: &[f32], width: usize, scale: RowScale, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if crate::backend::flex_kernels::avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { avx2::forward_rows(x, wt, width, scale, out) };
            return;
        }
        forward_rows(x, wt, width, scale, out);
    }

    fn backward_rows(
        x: &[f32],
        wt: &[f32],
        width: usize,
        pg: (&[f32], &[f32]),
        scale: RowScale,
        grad_x: &mut [f32],
        grad_wt: &mut [f32],
        scaled: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if crate::backend::flex_kernels::avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { avx2::backward_rows(x, wt, width, pg, scale, grad_x, grad_wt, scaled) };
            return;
        }
        backward_rows(x, wt, width, pg, scale, grad_x, grad_wt, scaled);
    }
}

/// The f32 row loops with AVX2 and FMA intrinsics (see [`flex_kernels::avx2`]). Rows go in
/// blocks of [`BLOCK`], so that each chunk of `Wᵀ` is loaded once per block rather than once
/// per row: with mHC's `W` (`[nC, n² + 2n]`, 96 kB at n = 4, C = 256) the loads of `Wᵀ` from L2
/// are what a row-at-a-time loop waits on. The backward packs `Wᵀ` in panels of eight entries
/// and takes the panels outermost (see [`backward_rows`]).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::RowScale;
    use crate::backend::flex_kernels::avx2::{dot, load, store, total};

    /// Rows per block (each with its own chain of FMAs).
    const BLOCK: usize = 4;

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn forward_rows(
        x: &[f32],
        wt: &[f32],
        width: usize,
        scale: RowScale,
        out: &mut [f32],
    ) {
        let columns = wt.len() / width;
        let row_count = x.len() / width;
        let mut first = 0;
        while first + BLOCK <= row_count {
            forward_block::<BLOCK>(x, wt, width, scale, out, first);
            first += BLOCK;
        }
        for row in first..row_count {
            forward_block::<1>(x, wt, width, scale, out, row);
        }
        debug_assert_eq!(out.len(), row_count * columns);
    }

    /// Rows `first..first + N` of the forward.
    #[target_feature(enable = "avx2,fma")]
    fn forward_block<const N: usize>(
        x: &[f32],
        wt: &[f32],
        width: usize,
        scale: RowScale,
        out: &mut [f32],
        first: usize,
    ) {
        let columns = wt.len() / width;
        let split = width / 8 * 8;
        let rows: [&[f32]; N] = std::array::from_fn(|i| &x[(first + i) * width..][..width]);
        let scales = rows.map(|row| scale.at(f64::from(dot(row, row)).sqrt()).0 as f32);
        for (c, column) in wt.chunks_exact(width).enumerate() {
            let mut sums = [_mm256_setzero_ps(); N];
            for k in (0..split).step_by(8) {
                let w = load(column, k);
                for (sum, row) in sums.iter_mut().zip(rows) {
                    *sum = _mm256_fmadd_ps(load(row, k), w, *sum);
                }
            }
            for (i, (sum, row)) in sums.into_iter().zip(rows).enumerate() {
                let tail: f32 = (split..width).map(|k| row[k] * column[k]).sum();
                out[(first + i) * columns + c] = scales[i] * (total(sum) + tail);
            }
        }
    }

    /// The backward of one task's rows (the portable [`super::backward_rows`]'s contract).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn backward_rows(
        x: &[f32],
        wt: &[f32],
        width: usize,
        (p, g): (&[f32], &[f32]),
        scale: RowScale,
        grad_x: &mut [f32],
        grad_wt: &mut [f32],
        scaled: &mut [f32],
    ) {
        let columns = wt.len() / width;
        let row_count = x.len() / width;
        // Per row: s ∂P (into `scaled`) and the coefficient of x in ∂x.
        let coefficients: Vec<f32> = (0..row_count)
            .map(|r| {
                let row = &x[r * width..][..width];
                let (p, g) = (&p[r * columns..][..columns], &g[r * columns..][..columns]);
                let (s, slope) = scale.at(f64::from(dot(row, row)).sqrt());
                for (scaled, &g) in scaled[r * columns..][..columns].iter_mut().zip(g) {
                    *scaled = s as f32 * g;
                }
                // x W · ∂P = (P · ∂P) / s.
                let along: f64 = p.iter().zip(g).map(|(&p, &g)| f64::from(p * g)).sum();
                (slope * along / s) as f32
            })
            .collect();
        // `Wᵀ` and `∂Wᵀ` packed in panels of eight entries: panel `q` holds entries
        // `8q..8q + 8` of every column, so that a pass over the columns at fixed entries reads
        // contiguous memory (over `Wᵀ` itself it strides by the width, which maps every column
        // to the same L1 set when a row is 4 kB).
        let split = width / 8 * 8;
        let panels = split / 8;
        let mut packed = vec![0.0; panels * columns * 8];
        for (q, panel) in packed.chunks_exact_mut(columns * 8).enumerate() {
            for (c, lanes) in panel.chunks_exact_mut(8).enumerate() {
                lanes.copy_from_slice(&wt[c * width + 8 * q..][..8]);
            }
        }
        let mut grad_packed = vec![0.0; packed.len()];
        // Panel by panel, every row of the task: each panel of `Wᵀ` and `∂Wᵀ` (2 kB at mHC's
        // 32 columns) is read from L2 once per task, not once per block of rows.
        for (q, (panel, grad_panel)) in packed
            .chunks_exact(columns * 8)
            .zip(grad_packed.chunks_exact_mut(columns * 8))
            .enumerate()
        {
            let mut first = 0;
            while first + BLOCK <= row_count {
                panel_block::<BLOCK>(
                    x,
                    (panel, grad_panel),
                    (width, 8 * q),
                    (&coefficients, scaled),
                    grad_x,
                    first,
                );
                first += BLOCK;
            }
            for row in first..row_count {
                panel_block::<1>(
                    x,
                    (panel, grad_panel),
                    (width, 8 * q),
                    (&coefficients, scaled),
                    grad_x,
                    row,
                );
            }
        }
        for (q, panel) in grad_packed.chunks_exact(columns * 8).enumerate() {
            for (c, lanes) in panel.chunks_exact(8).enumerate() {
                let at = c * width + 8 * q;
                store(
                    grad_wt,
                    at,
                    _mm256_add_ps(load(grad_wt, at), load(lanes, 0)),
                );
            }
        }
        // The entries past the panels.
        for r in 0..row_count {
            let gains = &scaled[r * columns..][..columns];
            for k in split..width {
                let value = x[r * width + k];
                let mut sum = grad_x[r * width + k] + coefficients[r] * value;
                for (c, &gain) in gains.iter().enumerate() {
                    sum += gain * wt[c * width + k];
                    grad_wt[c * width + k] += gain * value;
                }
                grad_x[r * width + k] = sum;
            }
        }
    }

    /// Entries `k..k + 8` of `∂x_r += coefficient_r x_r + Σ_c (s_r ∂P_rc) Wᵀ_c` for rows
    /// `first..first + N`, and those rows' terms of `∂Wᵀ_c += Σ_r (s_r ∂P_rc) x_r` added to the
    /// panel `grad_panel`: the rows' sums in registers, each column's lanes loaded, updated by
    /// every row, stored.
    #[target_feature(enable = "avx2,fma")]
    fn panel_block<const N: usize>(
        x: &[f32],
        (panel, grad_panel): (&[f32], &mut [f32]),
        (width, k): (usize, usize),
        (coefficients, scaled): (&[f32], &[f32]),
        grad_x: &mut [f32],
        first: usize,
    ) {
        let columns = panel.len() / 8;
        let gains = &scaled[first * columns..(first + N) * columns];
        let rows: [__m256; N] = std::array::from_fn(|i| load(x, (first + i) * width + k));
        let mut sums: [__m256; N] = std::array::from_fn(|i| {
            let start = _mm256_set1_ps(coefficients[first + i]);
            _mm256_fmadd_ps(start, rows[i], load(grad_x, (first + i) * width + k))
        });
        for c in 0..columns {
            let w = load(panel, 8 * c);
            let mut grad_w = load(grad_panel, 8 * c);
            for (i, (sum, row)) in sums.iter_mut().zip(rows).enumerate() {
                let gain = _mm256_set1_ps(gains[i * columns + c]);
                *sum = _mm256_fmadd_ps(gain, w, *sum);
                grad_w = _mm256_fmadd_ps(gain, row, grad_w);
            }
            store(grad_panel, 8 * c, grad_w);
        }
        for (i, sum) in sums.into_iter().enumerate() {
            store(grad_x, (first + i) * width + k, sum);
        }
    }
}

fn forward<E: RowKernels>(rows: &FlexTensor, weights: &FlexTensor, scale: RowScale) -> FlexTensor {
    let [count, width] = dims::<2>(rows);
    assert_eq!(
        dims::<2>(weights)[0],
        width,
        "normed projection: weights and rows disagree"
    );
    let (wt, columns) = transposed::<E>(weights);
    let x = values::<E>(rows);
    let mut out = vec![E::zero(); count * columns];
    if columns > 0 && width > 0 {
        out.par_chunks_mut(ROWS_PER_TASK * columns)
            .zip(x.par_chunks(ROWS_PER_TASK * width))
            .for_each(|(out, x)| {
                E::forward_rows(x, &wt, width, scale, out);
            });
    }
    tensor(out, [count, columns])
}

/// The gradients of the rows (plus the parts of the units' gradient in `deferred`) and of `W`.
fn backward<E: RowKernels>(
    rows: &FlexTensor,
    weights: &FlexTensor,
    projection: &FlexTensor,
    grad: &FlexTensor,
    scale: RowScale,
    deferred: &DeferredTerms<'_, E>,
) -> (FlexTensor, FlexTensor) {
    let [count, width] = dims::<2>(rows);
    let (wt, columns) = transposed::<E>(weights);
    let (x, p, g) = (
        values::<E>(rows),
        values::<E>(projection),
        values::<E>(grad),
    );
    // Tasks take whole tokens of the units (HC's rows are units, `U` per token; mHC's are
    // tokens), so that each adds the deferred parts of its own tokens.
    let token_len = deferred.token_len();
    let rows_per_task = if deferred.is_empty() || width == 0 {
        ROWS_PER_TASK
    } else {
        assert!(
            token_len.is_multiple_of(width) && (count * width).is_multiple_of(token_len),
            "normed projection: rows of {width} are not whole tokens of {token_len}"
        );
        ROWS_PER_TASK.next_multiple_of(token_len / width)
    };
    let first_token = |task: usize| task * rows_per_task * width / token_len.max(1);
    let mut grad_rows = unwritten::<E>(count * width);
    let grad_wt = if columns == 0 || width == 0 {
        // No projection: the rows get no gradient of their own.
        deferred.add_to(0, zeroed(&mut grad_rows));
        vec![E::zero(); columns * width]
    } else {
        grad_rows
            .par_chunks_mut(rows_per_task * width)
            .zip(x.par_chunks(rows_per_task * width))
            .zip(p.par_chunks(rows_per_task * columns))
            .zip(g.par_chunks(rows_per_task * columns))
            .enumerate()
            .fold(
                || vec![E::zero(); columns * width],
                |mut grad_wt, (task, (((grad_x, x), p), g))| {
                    let grad_x = zeroed(grad_x);
                    deferred.add_to(first_token(task), grad_x);
                    let mut scaled = vec![E::zero(); p.len()];
                    E::backward_rows(
                        x,
                        &wt,
                        width,
                        (p, g),
                        scale,
                        grad_x,
                        &mut grad_wt,
                        &mut scaled,
                    );
                    grad_wt
                },
            )
            .reduce(
                || vec![E::zero(); columns * width],
                |mut total, part| {
                    total.iter_mut().zip(&part).for_each(|(t, &v)| *t += v);
                    total
                },
            )
    };
    // SAFETY: the tasks' chunks partition `grad_rows` (or it was zeroed whole), each zeroed.
    let grad_rows = unsafe { written(grad_rows) };
    let mut grad_weights = vec![E::zero(); width * columns];
    for (c, row) in grad_wt.chunks_exact(width.max(1)).enumerate() {
        for (k, &value) in row.iter().enumerate() {
            grad_weights[k * columns + c] = value;
        }
    }
    (
        tensor(grad_rows, [count, width]),
        tensor(grad_weights, [width, columns]),
    )
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
        let terms = deferred.map(|deferred| deferred.take()).unwrap_or_default();
        match rows.dtype() {
            DType::F32 => {
                let deferred = DeferredTerms::<f32>::new(&terms);
                backward(&rows, &weights, &projection, &grad, scale, &deferred)
            }
            DType::F64 => {
                let deferred = DeferredTerms::<f64>::new(&terms);
                backward(&rows, &weights, &projection, &grad, scale, &deferred)
            }
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
    use burn::tensor::{Distribution, FloatDType, Tolerance};

    use super::fused_normed_projection;
    use crate::backend::RowScale;
    use crate::backend::units::composed_normed_projection;

    /// The fused op against the composed tensor ops on Flex, forward and both gradients, in f32
    /// and f64: both row scales (HC's floor, mHC's offset), column counts around the blocks of
    /// four, widths that do not fill the lanes, row counts that do not fill the last task, rows
    /// of very different norms, and rows handed over transposed (not contiguous).
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
            ] {
                let random = |shape: [usize; 2]| {
                    Tensor::<2>::random(shape, Distribution::Normal(0.0, 1.0), &device).cast(dtype)
                };
                // Row r scaled by 10^(r mod 5 − 2): norms from 1e-2 to 1e2 of the typical one.
                let magnitudes: Vec<f64> =
                    (0..count).map(|r| 10f64.powi((r % 5) as i32 - 2)).collect();
                let magnitudes =
                    Tensor::<1>::from_data(TensorData::new(magnitudes, [count]), &device)
                        .cast(dtype)
                        .reshape([count, 1]);
                let rows = if transposed {
                    random([width, count]).transpose()
                } else {
                    random([count, width])
                } * magnitudes;
                let weights = random([width, columns]);
                let probe = random([count, columns]);
                let run = |fused: bool| {
                    let (x, w) = (rows.clone().require_grad(), weights.clone().require_grad());
                    let output = if fused {
                        fused_normed_projection(x.clone(), w.clone(), scale, None)
                    } else {
                        composed_normed_projection(x.clone(), w.clone(), scale)
                    };
                    let grads = (output.clone() * probe.clone()).sum().backward();
                    [
                        output.into_data(),
                        x.grad(&grads).unwrap().into_data(),
                        w.grad(&grads).unwrap().into_data(),
                    ]
                };
                let (fused, composed) = (run(true), run(false));
                let tolerance = match dtype {
                    FloatDType::F64 => Tolerance::absolute(1e-10).set_relative(1e-9),
                    _ => Tolerance::absolute(1e-4).set_relative(1e-3),
                };
                for (name, (fused, composed)) in ["output", "∂rows", "∂weights"]
                    .iter()
                    .zip(fused.iter().zip(&composed))
                {
                    assert_eq!(
                        fused.shape(),
                        composed.shape(),
                        "{name} R={count} w={width}"
                    );
                    fused.assert_approx_eq::<f64>(composed, tolerance);
                }
            }
        }
    }
}

#[cfg(test)]
mod kernel_tests {
    use super::{RowKernels, RowScale, backward_rows, forward_rows};
    use crate::backend::flex_kernels::tests::sequence;

    /// The f32 row loops the CPU runs (AVX2 where it has it) against the portable ones, for
    /// widths around the lanes' multiples and column counts around the blocks of four.
    #[test]
    fn f32_row_loops_match_the_portable_ones() {
        let scale = RowScale {
            numerator: 4.0,
            offset: 1e-3,
            floor: 0.0,
            root_offset: 0.0,
        };
        let close = |a: &[f32], b: &[f32], what: &str| {
            for (a, b) in a.iter().zip(b) {
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "{what}: {a} against {b}"
                );
            }
        };
        // (Rows past the blocks of four, widths of several panels with entries past the last.)
        for (rows, width, columns) in [
            (5, 17, 6),
            (3, 8, 4),
            (4, 33, 9),
            (2, 5, 1),
            (3, 75, 5),
            (19, 40, 7),
            (9, 300, 3),
        ] {
            let x = sequence(rows * width, 3);
            let wt = sequence(columns * width, 4);
            let g = sequence(rows * columns, 5);
            let (mut fast, mut portable) = (vec![0.0; rows * columns], vec![0.0; rows * columns]);
            <f32 as RowKernels>::forward_rows(&x, &wt, width, scale, &mut fast);
            forward_rows(&x, &wt, width, scale, &mut portable);
            close(&fast, &portable, "forward");
            let backward = |fast: bool| {
                let mut grads = (vec![0.0; rows * width], vec![0.5; columns * width]);
                let mut scaled = vec![0.0; rows * columns];
                let run = if fast {
                    <f32 as RowKernels>::backward_rows
                } else {
                    backward_rows::<f32>
                };
                let (grad_x, grad_wt) = (&mut grads.0, &mut grads.1);
                run(
                    &x,
                    &wt,
                    width,
                    (&portable, &g),
                    scale,
                    grad_x,
                    grad_wt,
                    &mut scaled,
                );
                grads
            };
            let (fast, portable) = (backward(true), backward(false));
            close(&fast.0, &portable.0, "∂x");
            close(&fast.1, &portable.1, "∂Wᵀ");
        }
    }
}
