//! LayerNorm's backward on the CubeCL backends: one kernel over the rows plus Burn's reduction
//! of the per-cube partial sums of `∂γ`, `∂β`. The forward is Burn's composed LayerNorm, which
//! the fusion engine merges with the elementwise ops before it (a kernel of its own would be a
//! kernel fewer per norm in a plain residual stack, but the updates of H-ACN's and ANCRe's
//! streams, which join the norm's first reduction, would each become a kernel of their own).
//!
//! Each cube takes a run of rows. Per row it sums the row over the cube twice (the mean, then
//! the squares of the centred values: the two-pass variance of Burn's forward) for `μ` and `r`,
//! sums `g = ∂y γ` and `g x̂`, writes `∂x = r (g − mean(g) − x̂ mean(g x̂))`, and adds `∂y x̂` and
//! `∂y` into per-unit registers for the columns it owns. The cube's registers end as one row of
//! a `[cubes, 2 d]` table, which `column_sums` reduces to `[∂γ | ∂β]`. Every sum is in the
//! summing type (f32 for half types), the table too, so each of `∂γ`, `∂β` rounds once. Composed, Burn's
//! autodiff launches about 20 full-size kernels for a LayerNorm's backward on CubeCL (its
//! backward passes do not fuse).

use burn::backend::ops::{FloatTensorOps, ModuleOps};
use burn::backend::tensor::FloatTensor;
use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;

use super::LayerNormBackend;
use crate::backend::cube_launch::{
    Cube, column_sums, empty, empty_partials, float_types, per_item, row_prefix, threads_for,
};
use crate::backend::kernel_constant;
use kernels::layer_norm_backward_kernel;

/// Units per cube (at most): a row of GPT-2's 768 columns is three elements per unit.
const MOST_THREADS: usize = 256;

/// Cubes of the backward (at most): each writes a row of partial sums, `2 d` values.
const MOST_BACKWARD_CUBES: usize = 512;

/// `x` as the contiguous `[rows, d]` the kernels read, and `d`.
fn as_rows(x: FloatTensor<Cube>) -> (FloatTensor<Cube>, usize) {
    let x = into_contiguous(x);
    let shape = x.meta.shape().clone();
    let width = match shape.num_dims() {
        0 => 1,
        rank => shape[rank - 1].max(1),
    };
    let rows = shape.num_elements() / width;
    (Cube::float_reshape(x, Shape::new([rows, width])), width)
}

/// Units per cube for a row of `width` with `slots` sums per unit: a power of two, no more than
/// the row needs.
fn threads(like: &FloatTensor<Cube>, width: usize, slots: usize) -> usize {
    threads_for(like, slots, MOST_THREADS).min(width.next_power_of_two())
}

impl LayerNormBackend for Cube {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        <Cube as ModuleOps<Cube>>::layer_norm(x, gamma, Some(beta), epsilon)
    }

    fn fused_layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        _beta: FloatTensor<Self>,
        epsilon: f64,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let shape = x.meta.shape().clone();
        let (x, width) = as_rows(x);
        let (grad, _) = as_rows(grad);
        let rows = x.meta.shape()[0];
        let threads = threads(&x, width, 2);
        let rows_per_cube = rows.div_ceil(MOST_BACKWARD_CUBES).max(1);
        let cube_count = rows.div_ceil(rows_per_cube).max(1);
        let grad_x = empty(&x, Shape::new([rows, width]));
        let partials = empty_partials(&x, Shape::new([cube_count, 2 * width]));
        let (cubes, dim) = per_item(&x, cube_count, threads);
        layer_norm_backward_kernel::launch(
            &x.client,
            cubes,
            dim,
            x.clone().into_tensor_arg(),
            into_contiguous(gamma).into_tensor_arg(),
            grad.into_tensor_arg(),
            grad_x.clone().into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            rows_per_cube,
            width,
            threads,
            width.div_ceil(threads),
            kernel_constant(epsilon),
            kernel_constant(1.0 / width as f64),
            float_types(x.dtype),
        );
        // `[∂γ | ∂β]` as the two rows of a `[2, d]` table; each row a view where aligned.
        let sums = Cube::float_reshape(column_sums(partials, x.dtype), Shape::new([2, width]));
        let grad_gamma = row_prefix(sums.clone(), 0, width);
        let grad_beta = row_prefix(sums, 1, width);
        (Cube::float_reshape(grad_x, shape), grad_gamma, grad_beta)
    }
}

mod kernels {
    use cubecl::prelude::*;

    use crate::backend::cube_launch::kernels::{constant, cube_total, cube_totals};

    /// `(μ, r)` of row `row` of `x [R, d]`, `r = 1/√(var + ε)`, summed in `A` over the cube in
    /// `shared` (at least `threads` entries; free again on return).
    #[cube]
    fn row_moments<E: Float, A: Float>(
        x: &Tensor<E>,
        row: usize,
        shared: &mut Shared<[A]>,
        #[comptime] width: usize,
        #[comptime] threads: usize,
        #[comptime] epsilon_bits: u32,
        #[comptime] inverse_width_bits: u32,
    ) -> (A, A) {
        let unit = UNIT_POS as usize;
        let base = row * width;
        let inverse_width = constant::<A>(inverse_width_bits);
        let mut sum = A::new(0.0);
        let mut j = unit;
        while j < width {
            sum += A::cast_from(x[base + j]);
            j += threads;
        }
        let mean = cube_total::<A>(sum, shared) * inverse_width;
        let mut squares = A::new(0.0);
        let mut j = unit;
        while j < width {
            let centred = A::cast_from(x[base + j]) - mean;
            squares += centred * centred;
            j += threads;
        }
        let variance = cube_total::<A>(squares, shared) * inverse_width;
        let inverse_deviation = A::new(1.0) / (variance + constant::<A>(epsilon_bits)).sqrt();
        (mean, inverse_deviation)
    }

    /// `∂x` of rows `c·k .. (c + 1)·k` of `x [R, d]` for cube `c` (`k = rows_per_cube`), and the
    /// cube's sums of `∂y x̂` and `∂y` over those rows as row `c` of `partials [cubes, 2 d]`, in
    /// the summing type `A` like every sum here.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_norm_backward_kernel<E: Float, A: Float>(
        x: &Tensor<E>,
        gamma: &Tensor<E>,
        grad: &Tensor<E>,
        grad_x: &mut Tensor<E>,
        partials: &mut Tensor<A>,
        rows_per_cube: usize,
        #[comptime] width: usize,
        #[comptime] threads: usize,
        #[comptime] per_unit: usize,
        #[comptime] epsilon_bits: u32,
        #[comptime] inverse_width_bits: u32,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let cube = CUBE_POS;
        if cube >= partials.shape(0) {
            terminate!();
        }
        let rows = x.shape(0);
        let unit = UNIT_POS as usize;
        let inverse_width = constant::<A>(inverse_width_bits);
        let mut shared = Shared::<[A]>::new_slice(comptime!(2 * threads));
        // The columns `unit + k·threads` are this unit's: their `Σ ∂y x̂` and `Σ ∂y`.
        let mut sum_gamma = Array::<A>::new(per_unit);
        let mut sum_beta = Array::<A>::new(per_unit);
        for k in 0..per_unit {
            sum_gamma[k] = A::new(0.0);
            sum_beta[k] = A::new(0.0);
        }
        let first = cube * rows_per_cube;
        let mut last = first + rows_per_cube;
        if last > rows {
            last = rows;
        }
        for row in first..last {
            let (mean, inverse_deviation) = row_moments::<E, A>(
                x,
                row,
                &mut shared,
                width,
                threads,
                epsilon_bits,
                inverse_width_bits,
            );
            let base = row * width;
            let mut sum_g = A::new(0.0);
            let mut sum_g_normed = A::new(0.0);
            for k in 0..per_unit {
                let j = unit + k * threads;
                if j < width {
                    let normed = (A::cast_from(x[base + j]) - mean) * inverse_deviation;
                    let upstream = A::cast_from(grad[base + j]);
                    let g = upstream * A::cast_from(gamma[j]);
                    sum_g += g;
                    sum_g_normed += g * normed;
                    sum_gamma[k] += upstream * normed;
                    sum_beta[k] += upstream;
                }
            }
            let (total_g, total_g_normed) = cube_totals::<A>(sum_g, sum_g_normed, &mut shared);
            let mean_g = total_g * inverse_width;
            let mean_g_normed = total_g_normed * inverse_width;
            for k in 0..per_unit {
                let j = unit + k * threads;
                if j < width {
                    let normed = (A::cast_from(x[base + j]) - mean) * inverse_deviation;
                    let g = A::cast_from(grad[base + j]) * A::cast_from(gamma[j]);
                    let slope = inverse_deviation * (g - mean_g - normed * mean_g_normed);
                    grad_x[base + j] = E::cast_from(slope);
                }
            }
        }
        let partial = cube * 2 * width;
        for k in 0..per_unit {
            let j = unit + k * threads;
            if j < width {
                partials[partial + j] = sum_gamma[k];
                partials[partial + width + j] = sum_beta[k];
            }
        }
    }
}
