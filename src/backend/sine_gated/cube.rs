//! The sine-gated layer's kernels on the CubeCL backends (see the [parent](super)): sums,
//! sines and cosines in f32 for f16 and bf16 tensors ([`float_types`]).

use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use super::SineGatedBackend;
use crate::backend::cube_launch::{
    MOST_SUMMING_UNITS, RowRuns, empty, empty_partials, float_types, per_element, per_item,
};
use kernels::{sine_gated_backward_kernel, sine_gated_kernel, sine_gated_parameter_sums_kernel};

/// The fewest units a cube of the backward takes.
const ENTRY_UNITS: usize = 32;

/// `(D, m, h)` of the layer's tensors, each made contiguous.
fn layer_sizes(coordinates: &CubeTensor, z: &CubeTensor, gate: &CubeTensor) -> [usize; 3] {
    [
        coordinates.meta.shape()[1],
        z.meta.shape()[1],
        gate.meta.shape()[1],
    ]
}

impl SineGatedBackend for CubeBackend {
    fn sine_gated(
        coordinates: CubeTensor,
        z: CubeTensor,
        gate: CubeTensor,
        gate_bias: CubeTensor,
        weight: CubeTensor,
        bias: CubeTensor,
        point_bias: CubeTensor,
    ) -> CubeTensor {
        let [coordinates, z, gate, gate_bias, weight, bias, point_bias] =
            [coordinates, z, gate, gate_bias, weight, bias, point_bias].map(into_contiguous);
        let [dims, width, columns] = layer_sizes(&coordinates, &z, &gate);
        let points = z.meta.shape()[0];
        let output = empty(&z, Shape::new([points, columns]));
        let (count, dim) = per_element(&z, points * columns);
        sine_gated_kernel::launch(
            &z.client,
            count,
            dim,
            coordinates.into_tensor_arg(),
            z.clone().into_tensor_arg(),
            gate.into_tensor_arg(),
            gate_bias.into_tensor_arg(),
            weight.into_tensor_arg(),
            bias.into_tensor_arg(),
            point_bias.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            dims,
            width,
            float_types(z.dtype),
        );
        output
    }

    fn sine_gated_backward(
        coordinates: CubeTensor,
        z: CubeTensor,
        gate: CubeTensor,
        gate_bias: CubeTensor,
        weight: CubeTensor,
        bias: CubeTensor,
        grad: CubeTensor,
    ) -> (
        CubeTensor,
        CubeTensor,
        CubeTensor,
        CubeTensor,
        CubeTensor,
        CubeTensor,
    ) {
        let [coordinates, z, gate, gate_bias, weight, bias, grad] =
            [coordinates, z, gate, gate_bias, weight, bias, grad].map(into_contiguous);
        let dtype = z.dtype;
        let [dims, width, columns] = layer_sizes(&coordinates, &z, &gate);
        let points = z.meta.shape()[0];
        let sums = dims + width + 2;
        let grad_z = empty(&z, z.meta.shape().clone());
        let grad_point_bias = empty(&z, Shape::new([points]));
        let grad_gate = empty(&z, gate.meta.shape().clone());
        let grad_gate_bias = empty(&z, gate_bias.meta.shape().clone());
        let grad_weight = empty(&z, weight.meta.shape().clone());
        let grad_bias = empty(&z, bias.meta.shape().clone());

        // One launch, two kinds of cubes: the first `parameter_cubes` sum the parameters'
        // gradients over runs of points (one unit per column), the rest make `∂z` and `∂p` (one
        // unit per entry of `z`). With one run of points the sums go straight into the
        // gradients, else into partial sums that a second kernel adds up.
        let runs = RowRuns::new(&z, points, columns, MOST_SUMMING_UNITS);
        // At least a warp's units a cube, for the entries' cubes where `h` is small.
        let threads = runs.threads.max(ENTRY_UNITS);
        let column_cubes = columns.div_ceil(threads);
        let direct = runs.chunks == 1;
        let partials = empty_partials(
            &z,
            Shape::new(if direct {
                [1, 1]
            } else {
                [runs.chunks, sums * columns]
            }),
        );
        let parameter_cubes = column_cubes * runs.chunks;
        let entry_cubes = (points * width).div_ceil(threads);
        let (count, dim) = per_item(&z, parameter_cubes + entry_cubes, threads);
        sine_gated_backward_kernel::launch(
            &z.client,
            count,
            dim,
            coordinates.into_tensor_arg(),
            z.clone().into_tensor_arg(),
            gate.into_tensor_arg(),
            gate_bias.into_tensor_arg(),
            weight.into_tensor_arg(),
            bias.into_tensor_arg(),
            grad.into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            grad_gate.clone().into_tensor_arg(),
            grad_gate_bias.clone().into_tensor_arg(),
            grad_weight.clone().into_tensor_arg(),
            grad_bias.clone().into_tensor_arg(),
            grad_z.clone().into_tensor_arg(),
            grad_point_bias.clone().into_tensor_arg(),
            runs.chunk_rows,
            parameter_cubes,
            column_cubes,
            dims,
            width,
            direct,
            float_types(dtype),
        );
        if !direct {
            let (count, dim) = per_element(&z, sums * columns);
            sine_gated_parameter_sums_kernel::launch(
                &z.client,
                count,
                dim,
                partials.into_tensor_arg(),
                grad_gate.clone().into_tensor_arg(),
                grad_gate_bias.clone().into_tensor_arg(),
                grad_weight.clone().into_tensor_arg(),
                grad_bias.clone().into_tensor_arg(),
                dims,
                width,
                float_types(dtype),
            );
        }
        (
            grad_z,
            grad_gate,
            grad_gate_bias,
            grad_weight,
            grad_bias,
            grad_point_bias,
        )
    }
}

mod kernels {
    use cubecl::prelude::*;

    /// `θ[n, j]` in the summing type: `D` products.
    #[cube]
    fn gate_argument<E: Float, A: Float>(
        coordinates: &Tensor<E>,
        gate: &Tensor<E>,
        gate_bias: &Tensor<E>,
        n: usize,
        j: usize,
        #[comptime] dims: usize,
    ) -> A {
        let columns = gate.shape(1);
        let mut argument = A::cast_from(gate_bias[j]);
        #[unroll]
        for d in 0..dims {
            argument +=
                A::cast_from(coordinates[n * dims + d]) * A::cast_from(gate[d * columns + j]);
        }
        argument
    }

    /// `θ[n, j]` and `u[n, j]` in the summing type: `D` and `m` products.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn argument_and_inner<E: Float, A: Float>(
        coordinates: &Tensor<E>,
        z: &Tensor<E>,
        gate: &Tensor<E>,
        gate_bias: &Tensor<E>,
        weight: &Tensor<E>,
        bias: &Tensor<E>,
        n: usize,
        j: usize,
        #[comptime] dims: usize,
        #[comptime] width: usize,
    ) -> (A, A) {
        let columns = gate.shape(1);
        let argument = gate_argument::<E, A>(coordinates, gate, gate_bias, n, j, dims);
        let mut inner = A::cast_from(bias[j]);
        for k in 0..width {
            inner += A::cast_from(z[n * width + k]) * A::cast_from(weight[k * columns + j]);
        }
        (argument, inner)
    }

    /// Entry `index = n · h + j` of `y [N, h]`: `sin θ[n, j] · u[n, j] + p[n]`.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sine_gated_kernel<E: Float, A: Float>(
        coordinates: &Tensor<E>,
        z: &Tensor<E>,
        gate: &Tensor<E>,
        gate_bias: &Tensor<E>,
        weight: &Tensor<E>,
        bias: &Tensor<E>,
        point_bias: &Tensor<E>,
        output: &mut Tensor<E>,
        #[comptime] dims: usize,
        #[comptime] width: usize,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let index = ABSOLUTE_POS;
        if index >= output.len() {
            terminate!();
        }
        let columns = gate.shape(1);
        let (n, j) = (index / columns, index % columns);
        let (argument, inner) = argument_and_inner::<E, A>(
            coordinates,
            z,
            gate,
            gate_bias,
            weight,
            bias,
            n,
            j,
            dims,
            width,
        );
        output[index] = E::cast_from(argument.sin() * inner + A::cast_from(point_bias[n]));
    }

    /// Where `row` of the sums of column `j` goes: `∂A [D, h]`, `∂a [h]`, `∂B [m, h]`, `∂b [h]`
    /// in turn.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn store_sum<E: Float>(
        value: E,
        row: usize,
        j: usize,
        grad_gate: &mut Tensor<E>,
        grad_gate_bias: &mut Tensor<E>,
        grad_weight: &mut Tensor<E>,
        grad_bias: &mut Tensor<E>,
        #[comptime] dims: usize,
        #[comptime] width: usize,
    ) {
        let columns = grad_bias.len();
        if row < dims {
            grad_gate[row * columns + j] = value;
        } else if row == dims {
            grad_gate_bias[j] = value;
        } else if row < comptime!(dims + 1 + width) {
            grad_weight[(row - comptime!(dims + 1)) * columns + j] = value;
        } else {
            grad_bias[j] = value;
        }
    }

    /// The backward, two kinds of cubes in one launch.
    ///
    /// Cubes below `parameter_cubes` (a [`RowRuns`](crate::backend::cube_launch::RowRuns)
    /// launch, one unit per column `j`) sum `∂A[d, j]`, `∂a[j]`, `∂B[k, j]`, `∂b[j]` over a run
    /// of `chunk_rows` points: with one run (`direct`) into the gradients, else as row `chunk`
    /// of `partials [chunks, (D + 1 + m + 1) · h]`. The cubes after them take one entry
    /// `(n, k)` of `z` a unit: `∂z[n, k] = Σ_j ∂y[n, j] sin θ[n, j] B[k, j]` (`θ` recomputed,
    /// so that no unit reads what another wrote), and for `k = 0` `∂p[n] = Σ_j ∂y[n, j]`.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sine_gated_backward_kernel<E: Float, A: Float>(
        coordinates: &Tensor<E>,
        z: &Tensor<E>,
        gate: &Tensor<E>,
        gate_bias: &Tensor<E>,
        weight: &Tensor<E>,
        bias: &Tensor<E>,
        grad: &Tensor<E>,
        partials: &mut Tensor<A>,
        grad_gate: &mut Tensor<E>,
        grad_gate_bias: &mut Tensor<E>,
        grad_weight: &mut Tensor<E>,
        grad_bias: &mut Tensor<E>,
        grad_z: &mut Tensor<E>,
        grad_point_bias: &mut Tensor<E>,
        chunk_rows: usize,
        parameter_cubes: usize,
        #[comptime] column_cubes: usize,
        #[comptime] dims: usize,
        #[comptime] width: usize,
        #[comptime] direct: bool,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let cube = CUBE_POS;
        let columns = gate.shape(1);
        let points = z.shape(0);
        if cube >= parameter_cubes {
            let index = (cube - parameter_cubes) * (CUBE_DIM as usize) + UNIT_POS as usize;
            if index >= grad_z.len() {
                terminate!();
            }
            let (n, k) = (index / width, index % width);
            let mut total = A::new(0.0);
            let mut row = A::new(0.0);
            for j in 0..columns {
                let argument = gate_argument::<E, A>(coordinates, gate, gate_bias, n, j, dims);
                let g = A::cast_from(grad[n * columns + j]);
                total += g * argument.sin() * A::cast_from(weight[k * columns + j]);
                row += g;
            }
            grad_z[index] = E::cast_from(total);
            if k == 0 {
                grad_point_bias[n] = E::cast_from(row);
            }
            terminate!();
        }
        let chunk = cube / column_cubes;
        let j = (cube % column_cubes) * (CUBE_DIM as usize) + UNIT_POS as usize;
        let chunks = points.div_ceil(chunk_rows);
        if j >= columns || chunk >= chunks {
            terminate!();
        }
        let sums_per_column = comptime!(dims + width + 2);
        let mut sums = Array::<A>::new(sums_per_column);
        #[unroll]
        for r in 0..sums_per_column {
            sums[r] = A::new(0.0);
        }
        let first = chunk * chunk_rows;
        let mut last = first + chunk_rows;
        if last > points {
            last = points;
        }
        for n in first..last {
            let (argument, inner) = argument_and_inner::<E, A>(
                coordinates,
                z,
                gate,
                gate_bias,
                weight,
                bias,
                n,
                j,
                dims,
                width,
            );
            let g = A::cast_from(grad[n * columns + j]);
            let grad_inner = g * argument.sin();
            let grad_argument = g * inner * argument.cos();
            #[unroll]
            for d in 0..dims {
                sums[d] += A::cast_from(coordinates[n * dims + d]) * grad_argument;
            }
            sums[dims] += grad_argument;
            #[unroll]
            for k in 0..width {
                sums[dims + 1 + k] += A::cast_from(z[n * width + k]) * grad_inner;
            }
            sums[dims + 1 + width] += grad_inner;
        }
        if direct {
            #[unroll]
            for r in 0..sums_per_column {
                store_sum::<E>(
                    E::cast_from(sums[r]),
                    r,
                    j,
                    grad_gate,
                    grad_gate_bias,
                    grad_weight,
                    grad_bias,
                    dims,
                    width,
                );
            }
        } else {
            let base = chunk * sums_per_column * columns + j;
            #[unroll]
            for r in 0..sums_per_column {
                partials[base + r * columns] = sums[r];
            }
        }
    }

    /// Column `index` of `partials [chunks, (D + 1 + m + 1) · h]` summed over the chunks and
    /// stored in its parameter's gradient: `∂A [D, h]`, `∂a [h]`, `∂B [m, h]`, `∂b [h]` in turn.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sine_gated_parameter_sums_kernel<E: Float, A: Float>(
        partials: &Tensor<A>,
        grad_gate: &mut Tensor<E>,
        grad_gate_bias: &mut Tensor<E>,
        grad_weight: &mut Tensor<E>,
        grad_bias: &mut Tensor<E>,
        #[comptime] dims: usize,
        #[comptime] width: usize,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let index = ABSOLUTE_POS;
        let total_columns = partials.shape(1);
        if index >= total_columns {
            terminate!();
        }
        let columns = grad_bias.len();
        let mut total = A::new(0.0);
        for chunk in 0..partials.shape(0) {
            total += partials[chunk * total_columns + index];
        }
        store_sum::<E>(
            E::cast_from(total),
            index / columns,
            index % columns,
            grad_gate,
            grad_gate_bias,
            grad_weight,
            grad_bias,
            dims,
            width,
        );
    }
}
