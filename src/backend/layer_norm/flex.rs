//! LayerNorm on Flex: Flex's own fused forward, and the backward as one pass over each row.
//!
//! The backward keeps nothing but `x` from the forward (the same buffer as the stream it
//! normalises, which connectivities that mix earlier states also keep) and recomputes `μ`, `r`
//! and `x̂` row by row in cache. Burn's composed LayerNorm keeps the centred input and `x̂`
//! instead: two full-size tensors of its own per norm.

use burn::backend::ops::ModuleOps;
use burn::tensor::DType;
use burn_flex::{Flex, FlexTensor};
use rayon::prelude::*;

use super::LayerNormBackend;
use crate::backend::flex_kernels::{self, Scalar, values};

/// Rows per parallel task.
const ROWS_PER_TASK: usize = 64;

impl LayerNormBackend for Flex {
    fn fused_layer_norm(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        epsilon: f64,
    ) -> FlexTensor {
        <Flex as ModuleOps<Flex>>::layer_norm(x, gamma, Some(beta), epsilon)
    }

    fn fused_layer_norm_backward(
        x: FlexTensor,
        gamma: FlexTensor,
        _beta: FlexTensor,
        epsilon: f64,
        grad: FlexTensor,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        match x.dtype() {
            DType::F32 => backward::<f32>(&x, &gamma, epsilon, &grad),
            DType::F64 => backward::<f64>(&x, &gamma, epsilon, &grad),
            dtype => panic!("fused LayerNorm on Flex: f32 or f64, not {dtype:?}"),
        }
    }
}

/// `(∂x, ∂γ, ∂β)`: rows in parallel, each task summing its own `∂γ`, `∂β`.
fn backward<E: Scalar>(
    x: &FlexTensor,
    gamma: &FlexTensor,
    epsilon: f64,
    grad: &FlexTensor,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let shape = x.layout().shape().clone();
    let width = *shape.last().expect("LayerNorm of a tensor of rank ≥ 1");
    let (input, upstream, gamma) = (values::<E>(x), values::<E>(grad), values::<E>(gamma));
    let epsilon = flex_kernels::from_f64::<E>(epsilon);
    let mut grad_x = flex_kernels::unwritten::<E>(input.len());
    let chunk = ROWS_PER_TASK * width.max(1);
    let partials: Vec<(Vec<E>, Vec<E>)> = grad_x
        .par_chunks_mut(chunk)
        .zip(input.par_chunks(chunk))
        .zip(upstream.par_chunks(chunk))
        .map(|((out, input), upstream)| {
            let out = flex_kernels::zeroed(out);
            let mut sums = (vec![E::zero(); width], vec![E::zero(); width]);
            for ((out, x), dy) in out
                .chunks_exact_mut(width)
                .zip(input.chunks_exact(width))
                .zip(upstream.chunks_exact(width))
            {
                row_backward(x, dy, &gamma, epsilon, out, &mut sums);
            }
            sums
        })
        .collect();
    let mut grad_gamma = vec![E::zero(); width];
    let mut grad_beta = vec![E::zero(); width];
    for (partial_gamma, partial_beta) in partials {
        flex_kernels::axpy(&mut grad_gamma, E::one(), &partial_gamma);
        flex_kernels::axpy(&mut grad_beta, E::one(), &partial_beta);
    }
    // SAFETY: the chunks partition the buffer and each went through `zeroed`.
    let grad_x = unsafe { flex_kernels::written(grad_x) };
    (
        flex_kernels::tensor(grad_x, [input.len()]).reshape(shape),
        flex_kernels::tensor(grad_gamma, [width]),
        flex_kernels::tensor(grad_beta, [width]),
    )
}

/// One row: `∂x = r (g − mean(g) − x̂ mean(g ⊙ x̂))` with `g = ∂y ⊙ γ`, and `∂y ⊙ x̂`, `∂y`
/// added to the task's `(∂γ, ∂β)`.
fn row_backward<E: Scalar>(
    x: &[E],
    dy: &[E],
    gamma: &[E],
    epsilon: E,
    out: &mut [E],
    (grad_gamma, grad_beta): &mut (Vec<E>, Vec<E>),
) {
    let width = E::from(x.len()).expect("a row length");
    let mean = lane_sum(x.len(), |k| x[k]) / width;
    let variance = lane_sum(x.len(), |k| (x[k] - mean) * (x[k] - mean)) / width;
    let r = (variance + epsilon).sqrt().recip();
    let normalized = |k: usize| (x[k] - mean) * r;
    let mean_g = lane_sum(x.len(), |k| dy[k] * gamma[k]) / width;
    let mean_g_normalized = lane_sum(x.len(), |k| dy[k] * gamma[k] * normalized(k)) / width;
    for k in 0..x.len() {
        let normalized = normalized(k);
        grad_gamma[k] += dy[k] * normalized;
        grad_beta[k] += dy[k];
        out[k] = r * (dy[k] * gamma[k] - mean_g - normalized * mean_g_normalized);
    }
}

/// `Σ_{k < len} term(k)` in eight independent sums, so that the compiler can vectorise it.
#[inline(always)]
fn lane_sum<E: Scalar>(len: usize, term: impl Fn(usize) -> E) -> E {
    let mut lanes = [E::zero(); 8];
    let full = len - len % 8;
    for base in (0..full).step_by(8) {
        for (lane, sum) in lanes.iter_mut().enumerate() {
            *sum += term(base + lane);
        }
    }
    let rest = (full..len).fold(E::zero(), |sum, k| sum + term(k));
    lanes.into_iter().fold(rest, |sum, lane| sum + lane)
}
