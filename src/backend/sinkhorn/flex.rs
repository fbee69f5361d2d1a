//! Sinkhorn-Knopp on Flex: the same algorithm as the CubeCL kernels, one matrix at a time on the
//! CPU (in f64, for f32 and f64 tensors), matrices in parallel. Composed from tensor ops it is
//! ~`6T` small ops forward and more backward, each costing Flex a dispatch and a fresh buffer.
//! Each normalisation divides once per line and multiplies its `n` entries by the reciprocal
//! (an f64 division costs several multiplications), and the backward reuses one task's scratch
//! buffers for all its matrices.

use burn::tensor::{DType, TensorData};
use burn_flex::{Flex, FlexTensor};
use rayon::prelude::*;

use super::SinkhornBackend;
use crate::backend::flex_kernels;
use crate::mhc::MHC_EPS;

/// Matrices per parallel task.
const MATRICES_PER_TASK: usize = 256;

impl SinkhornBackend for Flex {
    fn sinkhorn(logits: FlexTensor, n: usize, iterations: usize) -> FlexTensor {
        let input = values(&logits);
        let mut output = vec![0.0; input.len()];
        per_matrix(&input, &mut output, n, |logits, output| {
            forward(logits, output, n, iterations);
        });
        tensor(output, &logits)
    }

    fn sinkhorn_backward(
        logits: FlexTensor,
        grad: FlexTensor,
        n: usize,
        iterations: usize,
    ) -> FlexTensor {
        let (input, upstream) = (values(&logits), values(&grad));
        let mut output = vec![0.0; input.len()];
        output
            .par_chunks_mut(MATRICES_PER_TASK * n * n)
            .zip(input.par_chunks(MATRICES_PER_TASK * n * n))
            .zip(upstream.par_chunks(MATRICES_PER_TASK * n * n))
            .for_each(|((output, input), upstream)| {
                let mut scratch = Scratch::new(n, iterations);
                for ((output, input), upstream) in output
                    .chunks_exact_mut(n * n)
                    .zip(input.chunks_exact(n * n))
                    .zip(upstream.chunks_exact(n * n))
                {
                    backward(input, upstream, output, n, &mut scratch);
                }
            });
        tensor(output, &logits)
    }
}

fn per_matrix(
    input: &[f64],
    output: &mut [f64],
    n: usize,
    run: impl Fn(&[f64], &mut [f64]) + Sync,
) {
    output
        .par_chunks_mut(MATRICES_PER_TASK * n * n)
        .zip(input.par_chunks(MATRICES_PER_TASK * n * n))
        .for_each(|(output, input)| {
            for (output, input) in output
                .chunks_exact_mut(n * n)
                .zip(input.chunks_exact(n * n))
            {
                run(input, output);
            }
        });
}

/// The elements of `tensor` as f64.
fn values(tensor: &FlexTensor) -> Vec<f64> {
    match tensor.dtype() {
        DType::F32 => flex_kernels::values::<f32>(tensor)
            .iter()
            .map(|&v| f64::from(v))
            .collect(),
        DType::F64 => flex_kernels::values::<f64>(tensor).into_owned(),
        other => panic!("Sinkhorn-Knopp: unsupported dtype {other:?}"),
    }
}

/// `values` in the dtype and shape of `like`.
fn tensor(values: Vec<f64>, like: &FlexTensor) -> FlexTensor {
    let shape = like.layout().shape().clone();
    let data = match like.dtype() {
        // Rounding to f32 is the point here.
        #[allow(clippy::cast_possible_truncation)]
        DType::F32 => TensorData::new(values.into_iter().map(|v| v as f32).collect(), shape),
        _ => TensorData::new(values, shape),
    };
    FlexTensor::from_data(data)
}

/// `matrix ← softmax_rows(logits) + ε`.
fn softmax_rows(logits: &[f64], matrix: &mut [f64], n: usize) {
    for (row, out) in logits.chunks_exact(n).zip(matrix.chunks_exact_mut(n)) {
        let largest = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut total = 0.0;
        for (o, &value) in out.iter_mut().zip(row) {
            *o = (value - largest).exp();
            total += *o;
        }
        let reciprocal = total.recip();
        for o in out.iter_mut() {
            *o = *o * reciprocal + MHC_EPS;
        }
    }
}

/// Entry `(a, b)` of a line view: rows are `(a, b) = (i, j)`, columns `(j, i)`.
fn at(a: usize, b: usize, n: usize, columns: bool) -> usize {
    if columns { b * n + a } else { a * n + b }
}

fn forward(logits: &[f64], matrix: &mut [f64], n: usize, iterations: usize) {
    softmax_rows(logits, matrix, n);
    let normalise = |matrix: &mut [f64], columns: bool| {
        for a in 0..n {
            let total = MHC_EPS + (0..n).map(|b| matrix[at(a, b, n, columns)]).sum::<f64>();
            let reciprocal = total.recip();
            for b in 0..n {
                matrix[at(a, b, n, columns)] *= reciprocal;
            }
        }
    };
    normalise(matrix, true);
    for _ in 1..iterations {
        normalise(matrix, false);
        normalise(matrix, true);
    }
}

/// The scaling a step divides (`column` for a column step) and the one across it.
fn line_and_across<'a>(
    columns: bool,
    row: &'a mut [f64],
    column: &'a mut [f64],
) -> (&'a mut [f64], &'a [f64]) {
    if columns {
        (column, row)
    } else {
        (row, column)
    }
}

/// The backward's buffers for one matrix, reused across the matrices of a task.
struct Scratch {
    start: Vec<f64>,
    row: Vec<f64>,
    column: Vec<f64>,
    /// `1 / s_k` of every step `k`, `n` per step.
    reciprocals: Vec<f64>,
    grad: Vec<f64>,
}

impl Scratch {
    fn new(n: usize, iterations: usize) -> Self {
        Self {
            start: vec![0.0; n * n],
            row: vec![0.0; n],
            column: vec![0.0; n],
            reciprocals: vec![0.0; (2 * iterations - 1) * n],
            grad: vec![0.0; n * n],
        }
    }
}

/// Every iterate is `diag(row) P diag(column)`: rerun the forward keeping each step's
/// denominators, walk back through them, then through the softmax (see the parent module).
fn backward(logits: &[f64], upstream: &[f64], output: &mut [f64], n: usize, scratch: &mut Scratch) {
    let Scratch {
        start,
        row,
        column,
        reciprocals,
        grad,
    } = scratch;
    softmax_rows(logits, start, n);
    row.fill(1.0);
    column.fill(1.0);
    // Step k normalises columns when k is even, rows when it is odd.
    for (k, reciprocals) in reciprocals.chunks_exact_mut(n).enumerate() {
        let columns = k % 2 == 0;
        let (line, across) = line_and_across(columns, row, column);
        for a in 0..n {
            let total = MHC_EPS
                + (0..n)
                    .map(|b| start[at(a, b, n, columns)] * line[a] * across[b])
                    .sum::<f64>();
            reciprocals[a] = total.recip();
            line[a] *= reciprocals[a];
        }
    }
    grad.copy_from_slice(upstream);
    for (k, reciprocals) in reciprocals.chunks_exact(n).enumerate().rev() {
        let columns = k % 2 == 0;
        let (line, across) = line_and_across(columns, row, column);
        for a in 0..n {
            let dot = (0..n)
                .map(|b| {
                    let index = at(a, b, n, columns);
                    grad[index] * start[index] * line[a] * across[b]
                })
                .sum::<f64>();
            for b in 0..n {
                let index = at(a, b, n, columns);
                grad[index] = (grad[index] - dot) * reciprocals[a];
            }
            line[a] /= reciprocals[a];
        }
    }
    // Softmax backward, with S = start − ε.
    for ((out, grad), start) in output
        .chunks_exact_mut(n)
        .zip(grad.chunks_exact(n))
        .zip(start.chunks_exact(n))
    {
        let dot: f64 = grad.iter().zip(start).map(|(g, s)| g * (s - MHC_EPS)).sum();
        for ((o, g), s) in out.iter_mut().zip(grad).zip(start) {
            *o = (s - MHC_EPS) * (g - dot);
        }
    }
}
