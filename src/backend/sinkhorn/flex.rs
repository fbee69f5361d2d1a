//! Sinkhorn-Knopp on Flex: the same algorithm as the CubeCL kernels on the CPU (in f64, for f32
//! and f64 tensors), matrices in parallel. Composed from tensor ops it is ~`6T` small ops forward
//! and more backward, each costing Flex a dispatch and a fresh buffer.
//!
//! Every matrix goes through the same sequence of operations, so the loops run on [`LANES`]
//! matrices at once: entry `e` of four matrices side by side ([`Lanes`]), whose arithmetic the
//! compiler vectorises and whose four independent chains hide the latency of each step (one
//! matrix at a time, each normalisation waits on the sum before it). The matrices left over run
//! one at a time through the same generic code. Each normalisation divides once per line and
//! multiplies its `n` entries by the reciprocal.

use std::ops::{Add, Div, Mul, Sub};

use burn::tensor::{DType, TensorData};
use burn_flex::{Flex, FlexTensor};
use rayon::prelude::*;

use super::SinkhornBackend;
use crate::backend::flex_kernels;

/// Matrices per parallel task.
const MATRICES_PER_TASK: usize = 256;

/// Matrices run side by side.
const LANES: usize = 4;

impl SinkhornBackend for Flex {
    fn sinkhorn(logits: FlexTensor, n: usize, iterations: usize, epsilon: f64) -> FlexTensor {
        let input = values(&logits);
        let mut output = vec![0.0; input.len()];
        per_task(
            &input,
            None,
            &mut output,
            n,
            &Forward {
                n,
                iterations,
                epsilon,
            },
        );
        tensor(output, &logits)
    }

    fn sinkhorn_backward(
        logits: FlexTensor,
        grad: FlexTensor,
        n: usize,
        iterations: usize,
        epsilon: f64,
    ) -> FlexTensor {
        let (input, upstream) = (values(&logits), values(&grad));
        let mut output = vec![0.0; input.len()];
        per_task(
            &input,
            Some(&upstream),
            &mut output,
            n,
            &Backward {
                n,
                iterations,
                epsilon,
            },
        );
        tensor(output, &logits)
    }
}

/// The values the algorithm runs on: one matrix's entries (`f64`), or the same entry of
/// [`LANES`] matrices ([`Lanes`]).
trait Value:
    Copy + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> + Div<Output = Self> + Send
{
    fn splat(value: f64) -> Self;
    fn exp(self) -> Self;
    fn max(self, other: Self) -> Self;
}

impl Value for f64 {
    fn splat(value: f64) -> Self {
        value
    }

    fn exp(self) -> Self {
        f64::exp(self)
    }

    fn max(self, other: Self) -> Self {
        f64::max(self, other)
    }
}

/// Entry `e` of [`LANES`] matrices.
#[derive(Clone, Copy, Debug)]
struct Lanes([f64; LANES]);

impl Lanes {
    fn zip(self, other: Self, op: impl Fn(f64, f64) -> f64) -> Self {
        Self(std::array::from_fn(|lane| op(self.0[lane], other.0[lane])))
    }
}

impl Add for Lanes {
    type Output = Self;
    fn add(self, other: Self) -> Self {
        self.zip(other, |a, b| a + b)
    }
}

impl Sub for Lanes {
    type Output = Self;
    fn sub(self, other: Self) -> Self {
        self.zip(other, |a, b| a - b)
    }
}

impl Mul for Lanes {
    type Output = Self;
    fn mul(self, other: Self) -> Self {
        self.zip(other, |a, b| a * b)
    }
}

impl Div for Lanes {
    type Output = Self;
    fn div(self, other: Self) -> Self {
        self.zip(other, |a, b| a / b)
    }
}

impl Value for Lanes {
    fn splat(value: f64) -> Self {
        Self([value; LANES])
    }

    fn exp(self) -> Self {
        Self(self.0.map(f64::exp))
    }

    fn max(self, other: Self) -> Self {
        self.zip(other, f64::max)
    }
}

/// What runs on each matrix (or group of [`LANES`] matrices).
trait Job: Sync {
    /// `output` from `logits` (and, backward, the output's gradient `upstream`), `n × n` each.
    fn run<T: Value>(&self, logits: &[T], upstream: Option<&[T]>, output: &mut [T]);
}

struct Forward {
    n: usize,
    iterations: usize,
    epsilon: f64,
}

impl Job for Forward {
    fn run<T: Value>(&self, logits: &[T], _upstream: Option<&[T]>, output: &mut [T]) {
        forward(logits, output, self.n, self.iterations, self.epsilon);
    }
}

struct Backward {
    n: usize,
    iterations: usize,
    epsilon: f64,
}

impl Job for Backward {
    fn run<T: Value>(&self, logits: &[T], upstream: Option<&[T]>, output: &mut [T]) {
        let upstream = upstream.expect("the backward has the output's gradient");
        backward(
            logits,
            upstream,
            output,
            self.n,
            self.iterations,
            self.epsilon,
        );
    }
}

/// `job` on the matrices of `input` (and `upstream`) in parallel tasks; within a task on
/// [`LANES`] matrices at a time, interleaved entry by entry, and on the rest one at a time.
fn per_task(input: &[f64], upstream: Option<&[f64]>, output: &mut [f64], n: usize, job: &impl Job) {
    let size = n * n;
    if size == 0 {
        return;
    }
    let task = MATRICES_PER_TASK * size;
    let upstream_tasks: Vec<Option<&[f64]>> = match upstream {
        Some(upstream) => upstream.chunks(task).map(Some).collect(),
        None => vec![None; input.len().div_ceil(task)],
    };
    output
        .par_chunks_mut(task)
        .zip(input.par_chunks(task))
        .zip(upstream_tasks.into_par_iter())
        .for_each(|((output, input), upstream)| {
            let grouped = input.len() / (LANES * size) * (LANES * size);
            let zero = Lanes::splat(0.0);
            let (mut lanes_in, mut lanes_up, mut lanes_out) =
                (vec![zero; size], vec![zero; size], vec![zero; size]);
            for start in (0..grouped).step_by(LANES * size) {
                interleave(&input[start..][..LANES * size], &mut lanes_in);
                if let Some(upstream) = upstream {
                    interleave(&upstream[start..][..LANES * size], &mut lanes_up);
                }
                job.run(&lanes_in, upstream.map(|_| &lanes_up[..]), &mut lanes_out);
                for (e, value) in lanes_out.iter().enumerate() {
                    for (lane, &v) in value.0.iter().enumerate() {
                        output[start + lane * size + e] = v;
                    }
                }
            }
            for start in (grouped..input.len()).step_by(size) {
                let upstream = upstream.map(|upstream| &upstream[start..][..size]);
                job.run(
                    &input[start..][..size],
                    upstream,
                    &mut output[start..][..size],
                );
            }
        });
}

/// Entry `e` of the [`LANES`] matrices of `matrices` into `lanes[e]`.
fn interleave(matrices: &[f64], lanes: &mut [Lanes]) {
    let size = lanes.len();
    for (e, value) in lanes.iter_mut().enumerate() {
        *value = Lanes(std::array::from_fn(|lane| matrices[lane * size + e]));
    }
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

/// `Σ_b term(b)` for `b < n`.
fn sum<T: Value>(n: usize, term: impl Fn(usize) -> T) -> T {
    (1..n).fold(term(0), |total, b| total + term(b))
}

/// `matrix ← softmax_rows(logits) + ε`.
fn softmax_rows<T: Value>(logits: &[T], matrix: &mut [T], n: usize, epsilon: f64) {
    for (row, out) in logits.chunks_exact(n).zip(matrix.chunks_exact_mut(n)) {
        let largest = row[1..]
            .iter()
            .fold(row[0], |largest, &value| largest.max(value));
        for (o, &value) in out.iter_mut().zip(row) {
            *o = (value - largest).exp();
        }
        let reciprocal = T::splat(1.0) / sum(n, |b| out[b]);
        for o in out.iter_mut() {
            *o = *o * reciprocal + T::splat(epsilon);
        }
    }
}

/// Entry `(a, b)` of a line view: rows are `(a, b) = (i, j)`, columns `(j, i)`.
fn at(a: usize, b: usize, n: usize, columns: bool) -> usize {
    if columns { b * n + a } else { a * n + b }
}

fn forward<T: Value>(logits: &[T], matrix: &mut [T], n: usize, iterations: usize, epsilon: f64) {
    softmax_rows(logits, matrix, n, epsilon);
    let normalise = |matrix: &mut [T], columns: bool| {
        for a in 0..n {
            let total = T::splat(epsilon) + sum(n, |b| matrix[at(a, b, n, columns)]);
            let reciprocal = T::splat(1.0) / total;
            for b in 0..n {
                let index = at(a, b, n, columns);
                matrix[index] = matrix[index] * reciprocal;
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
fn line_and_across<'a, T>(
    columns: bool,
    row: &'a mut [T],
    column: &'a mut [T],
) -> (&'a mut [T], &'a [T]) {
    if columns {
        (column, row)
    } else {
        (row, column)
    }
}

/// Every iterate is `diag(row) P diag(column)`: rerun the forward keeping each step's
/// denominators (as reciprocals), walk back through them, then through the softmax (see the
/// parent module).
fn backward<T: Value>(
    logits: &[T],
    upstream: &[T],
    output: &mut [T],
    n: usize,
    iterations: usize,
    epsilon: f64,
) {
    let (zero, one) = (T::splat(0.0), T::splat(1.0));
    let mut start = vec![zero; n * n];
    softmax_rows(logits, &mut start, n, epsilon);
    let (mut row, mut column) = (vec![one; n], vec![one; n]);
    let mut reciprocals = vec![zero; (2 * iterations - 1) * n];
    // Step k normalises columns when k is even, rows when it is odd.
    for (k, reciprocals) in reciprocals.chunks_exact_mut(n).enumerate() {
        let columns = k % 2 == 0;
        let (line, across) = line_and_across(columns, &mut row, &mut column);
        for a in 0..n {
            let total =
                T::splat(epsilon) + sum(n, |b| start[at(a, b, n, columns)] * line[a] * across[b]);
            reciprocals[a] = one / total;
            line[a] = line[a] * reciprocals[a];
        }
    }
    let mut grad = upstream.to_vec();
    for (k, reciprocals) in reciprocals.chunks_exact(n).enumerate().rev() {
        let columns = k % 2 == 0;
        let (line, across) = line_and_across(columns, &mut row, &mut column);
        for a in 0..n {
            let dot = sum(n, |b| {
                let index = at(a, b, n, columns);
                grad[index] * start[index] * line[a] * across[b]
            });
            for b in 0..n {
                let index = at(a, b, n, columns);
                grad[index] = (grad[index] - dot) * reciprocals[a];
            }
            line[a] = line[a] / reciprocals[a];
        }
    }
    // Softmax backward, with S = start − ε.
    let epsilon = T::splat(epsilon);
    for ((out, grad), start) in output
        .chunks_exact_mut(n)
        .zip(grad.chunks_exact(n))
        .zip(start.chunks_exact(n))
    {
        let dot = sum(n, |b| grad[b] * (start[b] - epsilon));
        for ((o, &g), &s) in out.iter_mut().zip(grad).zip(start) {
            *o = (s - epsilon) * (g - dot);
        }
    }
}
