//! Sinkhorn-Knopp on the CubeCL backends: one thread per `n × n` matrix, every iteration in
//! registers, one launch forward and one backward.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use cubecl::{CubeCount, CubeDim};

use super::SinkhornBackend;
use crate::backend::cube_launch::per_element;
use crate::backend::kernel_constant;
use kernels::{sinkhorn_backward_kernel, sinkhorn_forward_kernel};

impl SinkhornBackend for CubeBackend {
    fn sinkhorn(
        logits: FloatTensor<Self>,
        n: usize,
        iterations: usize,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        let launch = PerMatrix::new(&logits, n);
        sinkhorn_forward_kernel::launch(
            &launch.client,
            launch.count,
            launch.dim,
            into_contiguous(logits).into_tensor_arg(),
            launch.output.clone().into_tensor_arg(),
            n,
            iterations,
            kernel_constant(epsilon),
            launch.dtype,
        );
        launch.output
    }

    fn sinkhorn_backward(
        logits: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        n: usize,
        iterations: usize,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        let launch = PerMatrix::new(&logits, n);
        sinkhorn_backward_kernel::launch(
            &launch.client,
            launch.count,
            launch.dim,
            into_contiguous(logits).into_tensor_arg(),
            into_contiguous(grad).into_tensor_arg(),
            launch.output.clone().into_tensor_arg(),
            n,
            iterations,
            kernel_constant(epsilon),
            launch.dtype,
        );
        launch.output
    }
}

/// A launch with one thread per `n × n` matrix, and its contiguous output shaped like the input.
struct PerMatrix {
    client: cubecl::client::Client,
    count: CubeCount,
    dim: CubeDim,
    dtype: cubecl::ir::ElemType,
    output: FloatTensor<CubeBackend>,
}

impl PerMatrix {
    fn new(input: &FloatTensor<CubeBackend>, n: usize) -> Self {
        let shape = input.meta.shape().clone();
        let matrices = shape.num_elements() / (n * n);
        let (count, dim) = per_element(input, matrices);
        Self {
            client: input.client.clone(),
            count,
            dim,
            dtype: dtype_to_storage_type(input.dtype),
            output: empty_device_contiguous_dtype(
                input.client.clone(),
                input.device.clone(),
                shape,
                input.dtype,
            ),
        }
    }
}

pub(crate) mod kernels {
    use cubecl::prelude::*;

    // A line of a row-major `n × n` matrix: entry `b` of line `a` is at `a·outer + b·inner`;
    // rows are `(outer, inner) = (n, 1)`, columns `(1, n)`.

    /// `matrix ← softmax_rows(logits) + ε`.
    #[cube]
    fn softmax_rows<E: Float>(
        logits: &Array<E>,
        matrix: &mut Array<E>,
        #[comptime] n: usize,
        epsilon: E,
    ) {
        #[unroll]
        for i in 0..n {
            let mut largest = logits[i * n];
            for j in 1..n {
                largest = largest.max(logits[i * n + j]);
            }
            let mut total = E::new(0.0);
            #[unroll]
            for j in 0..n {
                let value = (logits[i * n + j] - largest).exp();
                matrix[i * n + j] = value;
                total += value;
            }
            #[unroll]
            for j in 0..n {
                matrix[i * n + j] = matrix[i * n + j] / total + epsilon;
            }
        }
    }

    /// Every line divided by its sum plus ε: times the sum's reciprocal, one division a line
    /// (on CUDA each IEEE division is a reciprocal, its refinement and a check for a slow
    /// path; 20 iterations of `n = 4` made 640 of them a matrix, in one unit).
    #[cube]
    fn normalise_lines<E: Float>(
        matrix: &mut Array<E>,
        #[comptime] outer: usize,
        #[comptime] inner: usize,
        #[comptime] n: usize,
        epsilon: E,
    ) {
        #[unroll]
        for a in 0..n {
            let mut total = epsilon;
            #[unroll]
            for b in 0..n {
                total += matrix[a * outer + b * inner];
            }
            let scale = E::new(1.0) / total;
            #[unroll]
            for b in 0..n {
                matrix[a * outer + b * inner] *= scale;
            }
        }
    }

    /// One normalisation of `M = diag(line) · start · diag(across)` (transposed for columns):
    /// each line's denominator goes to `sums[offset + a]` and divides `line[a]`.
    #[cube]
    fn scale_lines<E: Float>(
        start: &Array<E>,
        line: &mut Array<E>,
        across: &Array<E>,
        sums: &mut Array<E>,
        offset: usize,
        #[comptime] outer: usize,
        #[comptime] inner: usize,
        #[comptime] n: usize,
        epsilon: E,
    ) {
        #[unroll]
        for a in 0..n {
            let mut total = epsilon;
            #[unroll]
            for b in 0..n {
                total += start[a * outer + b * inner] * line[a] * across[b];
            }
            sums[offset + a] = total;
            line[a] /= total;
        }
    }

    /// The backward of [`scale_lines`]: `∂M_ab = (∂M'_ab − Σ_c ∂M'_ac M'_ac) / s_a`, with `M'`
    /// the step's output (the current scalings); then undoes the step's scaling.
    #[cube]
    fn unscale_lines<E: Float>(
        upstream: &mut Array<E>,
        start: &Array<E>,
        line: &mut Array<E>,
        across: &Array<E>,
        sums: &Array<E>,
        offset: usize,
        #[comptime] outer: usize,
        #[comptime] inner: usize,
        #[comptime] n: usize,
    ) {
        #[unroll]
        for a in 0..n {
            let mut dot = E::new(0.0);
            #[unroll]
            for b in 0..n {
                let at = a * outer + b * inner;
                dot += upstream[at] * start[at] * line[a] * across[b];
            }
            let total = sums[offset + a];
            let scale = E::new(1.0) / total;
            #[unroll]
            for b in 0..n {
                let at = a * outer + b * inner;
                upstream[at] = (upstream[at] - dot) * scale;
            }
            line[a] *= total;
        }
    }

    /// `matrix ← SK(logits)`, every iteration in registers (one `n × n` matrix).
    #[cube]
    pub(crate) fn sinkhorn_forward<E: Float>(
        logits: &Array<E>,
        matrix: &mut Array<E>,
        #[comptime] n: usize,
        #[comptime] iterations: usize,
        epsilon: E,
    ) {
        softmax_rows::<E>(logits, matrix, n, epsilon);
        normalise_lines::<E>(matrix, 1usize, n, n, epsilon);
        for _ in 1..iterations {
            normalise_lines::<E>(matrix, n, 1usize, n, epsilon);
            normalise_lines::<E>(matrix, 1usize, n, n, epsilon);
        }
    }

    /// The `n × n` matrix at `base` of `tensor` in registers.
    #[cube]
    fn load<E: Float>(tensor: &Tensor<E>, base: usize, #[comptime] n: usize) -> Array<E> {
        let mut values = Array::<E>::new(n * n);
        for k in 0..n * n {
            values[k] = tensor[base + k];
        }
        values
    }

    #[cube(launch)]
    pub(super) fn sinkhorn_forward_kernel<E: Float>(
        logits: &Tensor<E>,
        output: &mut Tensor<E>,
        #[comptime] n: usize,
        #[comptime] iterations: usize,
        #[comptime] epsilon_bits: u32,
        #[define(E)] _dtype: ElemType,
    ) {
        let epsilon = E::new(comptime!(f32::from_bits(epsilon_bits)));
        let base = ABSOLUTE_POS * n * n;
        if base >= output.len() {
            terminate!();
        }
        let values = load::<E>(logits, base, n);
        let mut matrix = Array::<E>::new(n * n);
        sinkhorn_forward::<E>(&values, &mut matrix, n, iterations, epsilon);
        for k in 0..n * n {
            output[base + k] = matrix[k];
        }
    }

    /// `output ← ∂L` of `SK(logits)` given `grad = ∂SK`, one `n × n` matrix in registers.
    #[cube]
    pub(crate) fn sinkhorn_backward<E: Float>(
        logits: &Array<E>,
        grad: &Array<E>,
        output: &mut Array<E>,
        #[comptime] n: usize,
        #[comptime] iterations: usize,
        epsilon: E,
    ) {
        let steps = 2 * iterations - 1;
        let mut start = Array::<E>::new(n * n);
        softmax_rows::<E>(logits, &mut start, n, epsilon);

        // Forward again as scalings `M_k = diag(row) · start · diag(column)`, keeping each
        // step's denominators; step k normalises columns when k is even, rows when it is odd.
        let mut row = Array::<E>::new(n);
        let mut column = Array::<E>::new(n);
        #[unroll]
        for i in 0..n {
            row[i] = E::new(1.0);
            column[i] = E::new(1.0);
        }
        let mut sums = Array::<E>::new(steps * n);
        for k in 0..steps {
            if k % 2 == 1 {
                scale_lines::<E>(
                    &start,
                    &mut row,
                    &column,
                    &mut sums,
                    k * n,
                    n,
                    1usize,
                    n,
                    epsilon,
                );
            } else {
                scale_lines::<E>(
                    &start,
                    &mut column,
                    &row,
                    &mut sums,
                    k * n,
                    1usize,
                    n,
                    n,
                    epsilon,
                );
            }
        }

        let mut upstream = Array::<E>::new(n * n);
        for k in 0..n * n {
            upstream[k] = grad[k];
        }
        for back in 0..steps {
            let k = steps - 1 - back;
            if k % 2 == 1 {
                unscale_lines::<E>(
                    &mut upstream,
                    &start,
                    &mut row,
                    &column,
                    &sums,
                    k * n,
                    n,
                    1usize,
                    n,
                );
            } else {
                unscale_lines::<E>(
                    &mut upstream,
                    &start,
                    &mut column,
                    &row,
                    &sums,
                    k * n,
                    1usize,
                    n,
                    n,
                );
            }
        }

        // Softmax backward, with S = start − ε.
        #[unroll]
        for i in 0..n {
            let mut dot = E::new(0.0);
            #[unroll]
            for j in 0..n {
                dot += upstream[i * n + j] * (start[i * n + j] - epsilon);
            }
            #[unroll]
            for j in 0..n {
                output[i * n + j] = (start[i * n + j] - epsilon) * (upstream[i * n + j] - dot);
            }
        }
    }

    #[cube(launch)]
    pub(super) fn sinkhorn_backward_kernel<E: Float>(
        logits: &Tensor<E>,
        grad: &Tensor<E>,
        output: &mut Tensor<E>,
        #[comptime] n: usize,
        #[comptime] iterations: usize,
        #[comptime] epsilon_bits: u32,
        #[define(E)] _dtype: ElemType,
    ) {
        let epsilon = E::new(comptime!(f32::from_bits(epsilon_bits)));
        let base = ABSOLUTE_POS * n * n;
        if base >= output.len() {
            terminate!();
        }
        let values = load::<E>(logits, base, n);
        let upstream = load::<E>(grad, base, n);
        let mut result = Array::<E>::new(n * n);
        sinkhorn_backward::<E>(&values, &upstream, &mut result, n, iterations, epsilon);
        for k in 0..n * n {
            output[base + k] = result[k];
        }
    }
}
