//! The connection tables on the CubeCL backends (see the parent module for the math).

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use cubecl::ir::HardwareProperties;

use super::{ConnectionTableBackend, normalised_columns};
use crate::backend::cube_launch::{
    Cube, GatedWeights, Knobs, ProjectionPath, RowTiles, empty, float_types, knobs, per_element,
    per_item, threads_on, weights_product_partials,
};
use crate::backend::kernel_constant;
use kernels::{
    gated_backward_kernel, gated_finish_kernel, gated_forward_kernel, normalised_backward_kernel,
    normalised_finish_kernel, normalised_forward_kernel, normalised_row_gradient_kernel,
};

/// Units per cube of the per-row kernels (at most).
const MOST_THREADS: usize = 64;

/// Units per cube of the kernels that sum over the tokens.
const SUM_THREADS: usize = 256;

/// Whether the normalised form's three scales come packed in one `[3]` tensor (the first),
/// rather than as three `[1]` tensors.
fn packed(input_scale: &FloatTensor<CubeBackend>) -> bool {
    input_scale.meta.shape().num_elements() == 3
}

/// The units `[T, U, w]`, contiguous, as the kernels' rows `[T·U, w]` (a view), with their
/// shape.
fn unit_rows(units: FloatTensor<CubeBackend>) -> (FloatTensor<CubeBackend>, [usize; 3]) {
    let units = into_contiguous(units);
    let shape = units.meta.shape().dims::<3>();
    let [tokens, count, width] = shape;
    (
        Cube::float_reshape(units, Shape::new([tokens * count, width])),
        shape,
    )
}

/// Tokens per cube (whole tokens, as many as fit the gated rows knob; one at least) and units
/// per cube of the gated forward kernel for `count` units a token and `columns` mixing columns.
fn gated_forward_shape(
    hardware: &HardwareProperties,
    element_bytes: usize,
    count: usize,
    columns: usize,
    gated_rows: usize,
) -> (usize, usize) {
    let views = columns - count;
    let tokens_per_cube = (gated_rows / count).max(1);
    // Per unit, the cube's rows' partial sums; the rows' view weights (`views` a row, for the
    // block input) counted per unit too, which over-counts them but keeps the sum within the
    // budget at every cube size.
    let slots = tokens_per_cube * count * (columns + 2 + views);
    let threads = threads_on(hardware, element_bytes, slots, MOST_THREADS);
    (tokens_per_cube, threads)
}

/// Units per cube of the gated backward kernel. Shared memory: the block input's products,
/// `gated_rows · input_views` a unit, and with staged weights `columns | 1` more.
fn gated_backward_threads(
    hardware: &HardwareProperties,
    element_bytes: usize,
    columns: usize,
    input_views: usize,
    gated_rows: usize,
) -> usize {
    let slots = gated_rows * input_views.max(1) + (columns | 1);
    threads_on(hardware, element_bytes, slots, MOST_THREADS)
}

/// The normalised forward's tiles: `columns + 1` sums a unit, the rows' `H_pre` (`streams`
/// entries a row) kept for the block input.
fn normalised_forward_tiles(
    hardware: &HardwareProperties,
    element_bytes: usize,
    columns: usize,
    streams: usize,
) -> RowTiles {
    RowTiles::on(hardware, element_bytes, columns, columns + 1, streams)
}

/// The normalised backward's tiles: the block input's `streams` products a unit, `columns + 2 +
/// streams` entries a row for the steps of `∂x`.
fn normalised_backward_tiles(
    hardware: &HardwareProperties,
    element_bytes: usize,
    columns: usize,
    streams: usize,
) -> RowTiles {
    RowTiles::on(
        hardware,
        element_bytes,
        columns,
        streams,
        columns + 2 + streams,
    )
}

impl ConnectionTableBackend for CubeBackend {
    fn gated_table(
        units: FloatTensor<Self>,
        mixing_weights: FloatTensor<Self>,
        depth_weights: FloatTensor<Self>,
        gain: FloatTensor<Self>,
        mixing_scale: FloatTensor<Self>,
        depth_scale: FloatTensor<Self>,
        mixing_static: FloatTensor<Self>,
        depth_static: FloatTensor<Self>,
        tanh: bool,
        numerator: f64,
        offset: f64,
        floor: f64,
        _slot: u64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (rows, [tokens, count, width]) = unit_rows(units);
        let columns = mixing_weights.meta.shape()[1];
        let views = columns - count;
        let table = empty(&rows, Shape::new([tokens, columns + 1, count]));
        let projection = empty(&rows, Shape::new([tokens * count, columns + 2]));
        let input = empty(&rows, Shape::new([tokens, views, width]));
        let Knobs {
            gated_weights,
            gated_rows,
            ..
        } = knobs();
        let hardware = &rows.client.properties().hardware;
        let (tokens_per_cube, threads) =
            gated_forward_shape(hardware, rows.dtype.size(), count, columns, gated_rows);
        let (launch_cubes, dim) = per_item(&rows, tokens.div_ceil(tokens_per_cube), threads);
        gated_forward_kernel::launch(
            &rows.client,
            launch_cubes,
            dim,
            rows.clone().into_tensor_arg(),
            into_contiguous(mixing_weights).into_tensor_arg(),
            into_contiguous(depth_weights).into_tensor_arg(),
            into_contiguous(gain).into_tensor_arg(),
            mixing_scale.into_tensor_arg(),
            depth_scale.into_tensor_arg(),
            into_contiguous(mixing_static).into_tensor_arg(),
            into_contiguous(depth_static).into_tensor_arg(),
            table.clone().into_tensor_arg(),
            projection.clone().into_tensor_arg(),
            input.clone().into_tensor_arg(),
            columns,
            count,
            threads,
            tokens_per_cube,
            tanh,
            gated_weights == GatedWeights::Staged,
            kernel_constant(numerator),
            kernel_constant(offset),
            kernel_constant(floor),
            float_types(rows.dtype),
        );
        (table, projection, input)
    }

    fn gated_table_backward(
        units: FloatTensor<Self>,
        mixing_weights: FloatTensor<Self>,
        depth_weights: FloatTensor<Self>,
        gain: FloatTensor<Self>,
        mixing_scale: FloatTensor<Self>,
        depth_scale: FloatTensor<Self>,
        mixing_static: FloatTensor<Self>,
        _depth_static: FloatTensor<Self>,
        projection: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        previous_rows: FloatTensor<Self>,
        with_previous_rows: bool,
        input_grad: FloatTensor<Self>,
        input_views: usize,
        tanh: bool,
        numerator: f64,
        offset: f64,
        floor: f64,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let (rows, unit_shape) = unit_rows(units);
        let mixing_weights = into_contiguous(mixing_weights);
        let depth_weights = into_contiguous(depth_weights);
        let gain = into_contiguous(gain);
        let grad = into_contiguous(grad);
        let [count, width] = rows.meta.shape().dims::<2>();
        let columns = mixing_weights.meta.shape()[1];
        let units = mixing_static.meta.shape()[0];
        let grad_rows = empty(&rows, Shape::new([count, width]));
        let scaled_grad = empty(&rows, Shape::new([count, columns + 1]));
        let partials = empty(&rows, Shape::new([count, 2]));
        let view_grad = empty(
            &rows,
            Shape::new([count / units, input_views.max(1), units]),
        );
        let Knobs {
            gated_weights,
            gated_rows,
            ..
        } = knobs();
        let hardware = &rows.client.properties().hardware;
        let threads = gated_backward_threads(
            hardware,
            rows.dtype.size(),
            columns,
            input_views,
            gated_rows,
        );
        let (launch_cubes, dim) = per_item(&rows, count.div_ceil(gated_rows), threads);
        gated_backward_kernel::launch(
            &rows.client,
            launch_cubes,
            dim,
            rows.clone().into_tensor_arg(),
            mixing_weights.clone().into_tensor_arg(),
            depth_weights.clone().into_tensor_arg(),
            gain.clone().into_tensor_arg(),
            mixing_scale.clone().into_tensor_arg(),
            depth_scale.clone().into_tensor_arg(),
            into_contiguous(mixing_static.clone()).into_tensor_arg(),
            into_contiguous(projection).into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            into_contiguous(previous_rows).into_tensor_arg(),
            into_contiguous(input_grad).into_tensor_arg(),
            grad_rows.clone().into_tensor_arg(),
            scaled_grad.clone().into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            view_grad.clone().into_tensor_arg(),
            columns,
            units,
            threads,
            gated_rows,
            tanh,
            with_previous_rows,
            input_views,
            gated_weights == GatedWeights::Staged,
            kernel_constant(numerator),
            kernel_constant(offset),
            kernel_constant(floor),
            float_types(rows.dtype),
        );
        let product_parts = weights_product_partials(rows.clone(), scaled_grad);
        let grad_mixing_weights = empty(&rows, Shape::new([width, columns]));
        let grad_depth_weights = empty(&rows, Shape::new([width]));
        let grad_gain = empty(&rows, Shape::new([width]));
        let grad_mixing_scale = empty(&rows, Shape::new([1]));
        let grad_depth_scale = empty(&rows, Shape::new([1]));
        let grad_mixing_static = empty(&rows, Shape::new([units, columns]));
        let grad_depth_static = empty(&rows, Shape::new([units]));
        // Whole rows of `H = xᵀ (s δ)` (`columns + 1` entries each) per cube, then the sums
        // over the tokens; spread over the grid's dimensions as the normalised form's (the
        // kernel takes the cube's linear position; cubes past the last sum do nothing).
        // (Fewer units where the tests lower `most_summing_units`, never fewer than a row's
        // `columns + 1` entries.)
        let sum_threads = SUM_THREADS
            .min(knobs().most_summing_units)
            .max((columns + 1).next_power_of_two());
        let row_cubes = width.div_ceil(sum_threads / (columns + 1));
        let (launch_cubes, dim) =
            per_item(&rows, row_cubes + (columns + 1) * units + 2, sum_threads);
        gated_finish_kernel::launch(
            &rows.client,
            launch_cubes,
            dim,
            product_parts.into_tensor_arg(),
            mixing_weights.into_tensor_arg(),
            depth_weights.into_tensor_arg(),
            gain.into_tensor_arg(),
            grad.into_tensor_arg(),
            partials.into_tensor_arg(),
            view_grad.into_tensor_arg(),
            grad_mixing_weights.clone().into_tensor_arg(),
            grad_depth_weights.clone().into_tensor_arg(),
            grad_gain.clone().into_tensor_arg(),
            grad_mixing_scale.clone().into_tensor_arg(),
            grad_depth_scale.clone().into_tensor_arg(),
            grad_mixing_static.clone().into_tensor_arg(),
            grad_depth_static.clone().into_tensor_arg(),
            columns,
            units,
            input_views,
            row_cubes,
            sum_threads,
            float_types(rows.dtype),
        );
        (
            Cube::float_reshape(grad_rows, Shape::new(unit_shape)),
            grad_mixing_weights,
            grad_depth_weights,
            grad_gain,
            grad_mixing_scale,
            grad_depth_scale,
            grad_mixing_static,
            grad_depth_static,
        )
    }

    fn normalised_table(
        units: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        input_scale: FloatTensor<Self>,
        depth_scale: FloatTensor<Self>,
        residual_scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        matrices: FloatTensor<Self>,
        streams: usize,
        mixtures: usize,
        iterations: usize,
        input_offset: f64,
        depth_factor: f64,
        sinkhorn_epsilon: f64,
        numerator: f64,
        offset: f64,
        root_offset: f64,
        _slot: u64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (units, [tokens, _, unit_width]) = unit_rows(units);
        // The kernels' rows are the tokens, each its `n` units flattened.
        let rows = Cube::float_reshape(units, Shape::new([tokens, streams * unit_width]));
        let columns = normalised_columns(streams, mixtures);
        let table = empty(&rows, Shape::new([tokens, streams + 2, streams]));
        let projection = empty(&rows, Shape::new([tokens, columns + 1]));
        let input = empty(&rows, Shape::new([tokens, 1, unit_width]));
        // (`streams` more entries a row: the rows' `H_pre`, kept for the block input)
        let tiles = normalised_forward_tiles(
            &rows.client.properties().hardware,
            rows.dtype.size(),
            columns,
            streams,
        );
        let (launch_cubes, dim) = tiles.launch(&rows, tokens);
        let packed_scales = packed(&input_scale);
        let contiguous_weights = weights.is_contiguous();
        // With the matmul's `xΦ` the kernel reads `given [T, columns]` and passes over the rows
        // only for `‖x‖²` (else `given` is a placeholder it never reads).
        let given = match knobs().table_projection {
            ProjectionPath::Matmul => Some(into_contiguous(Cube::float_matmul(
                rows.clone(),
                weights.clone(),
            ))),
            ProjectionPath::Tiles => None,
        };
        let given_projection = given.is_some();
        normalised_forward_kernel::launch(
            &rows.client,
            launch_cubes,
            dim,
            rows.clone().into_tensor_arg(),
            given.unwrap_or_else(|| rows.clone()).into_tensor_arg(),
            weights.into_tensor_arg(),
            input_scale.into_tensor_arg(),
            depth_scale.into_tensor_arg(),
            residual_scale.into_tensor_arg(),
            into_contiguous(bias).into_tensor_arg(),
            into_contiguous(matrices).into_tensor_arg(),
            table.clone().into_tensor_arg(),
            projection.clone().into_tensor_arg(),
            input.clone().into_tensor_arg(),
            streams,
            mixtures,
            iterations,
            packed_scales,
            tiles,
            contiguous_weights,
            given_projection,
            kernel_constant(input_offset),
            kernel_constant(depth_factor),
            kernel_constant(sinkhorn_epsilon),
            kernel_constant(numerator),
            kernel_constant(offset),
            kernel_constant(root_offset),
            float_types(rows.dtype),
        );
        (table, projection, input)
    }

    fn normalised_table_backward(
        units: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        input_scale: FloatTensor<Self>,
        depth_scale: FloatTensor<Self>,
        residual_scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        matrices: FloatTensor<Self>,
        projection: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        previous_rows: FloatTensor<Self>,
        with_previous_rows: bool,
        input_grad: FloatTensor<Self>,
        input_views: usize,
        streams: usize,
        mixtures: usize,
        iterations: usize,
        input_offset: f64,
        depth_factor: f64,
        sinkhorn_epsilon: f64,
        numerator: f64,
        offset: f64,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let (units, unit_shape) = unit_rows(units);
        let [tokens, _, unit_width] = unit_shape;
        let width = streams * unit_width;
        let rows = Cube::float_reshape(units, Shape::new([tokens, width]));
        let columns = normalised_columns(streams, mixtures);
        let scaled_grad = empty(&rows, Shape::new([tokens, columns]));
        let partials = empty(&rows, Shape::new([tokens, columns + 3]));
        let tiles = normalised_backward_tiles(
            &rows.client.properties().hardware,
            rows.dtype.size(),
            columns,
            streams,
        );
        let (launch_cubes, dim) = tiles.launch(&rows, tokens);
        let packed_scales = packed(&input_scale);
        let scale_shapes =
            [&input_scale, &depth_scale, &residual_scale].map(|s| s.meta.shape().clone());
        let contiguous_weights = weights.is_contiguous();
        // With Burn's matmul for `(s δ) Φᵀ`, the kernel leaves each row's other terms of `∂x`
        // in `row_terms` (`s'(n)/n (xΦ · δ)`, then `H_pre + ε_in` per unit) and a second pass
        // adds them to the product.
        let given_product = knobs().table_projection == ProjectionPath::Matmul;
        let placeholder = || empty(&rows, Shape::new([1]));
        let (grad_rows, row_terms) = if given_product {
            (
                placeholder(),
                empty(&rows, Shape::new([tokens, streams + 1])),
            )
        } else {
            (empty(&rows, Shape::new([tokens, width])), placeholder())
        };
        let previous_rows = into_contiguous(previous_rows);
        let input_grad = into_contiguous(input_grad);
        let weights_transposed =
            given_product.then(|| Cube::float_swap_dims(weights.clone(), 0, 1));
        normalised_backward_kernel::launch(
            &rows.client,
            launch_cubes,
            dim,
            rows.clone().into_tensor_arg(),
            weights.into_tensor_arg(),
            input_scale.into_tensor_arg(),
            depth_scale.into_tensor_arg(),
            residual_scale.into_tensor_arg(),
            into_contiguous(bias).into_tensor_arg(),
            into_contiguous(matrices).into_tensor_arg(),
            into_contiguous(projection).into_tensor_arg(),
            into_contiguous(grad).into_tensor_arg(),
            previous_rows.clone().into_tensor_arg(),
            input_grad.clone().into_tensor_arg(),
            grad_rows.clone().into_tensor_arg(),
            scaled_grad.clone().into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            row_terms.clone().into_tensor_arg(),
            streams,
            mixtures,
            iterations,
            packed_scales,
            tiles,
            contiguous_weights,
            with_previous_rows,
            input_views > 0,
            given_product,
            kernel_constant(input_offset),
            kernel_constant(depth_factor),
            kernel_constant(sinkhorn_epsilon),
            kernel_constant(numerator),
            kernel_constant(offset),
            float_types(rows.dtype),
        );
        let grad_rows = if let Some(weights_transposed) = weights_transposed {
            let product =
                into_contiguous(Cube::float_matmul(scaled_grad.clone(), weights_transposed));
            let (launch_cubes, dim) = per_element(&product, tokens * width);
            normalised_row_gradient_kernel::launch(
                &rows.client,
                launch_cubes,
                dim,
                rows.clone().into_tensor_arg(),
                row_terms.into_tensor_arg(),
                previous_rows.into_tensor_arg(),
                input_grad.into_tensor_arg(),
                product.clone().into_tensor_arg(),
                streams,
                with_previous_rows,
                input_views > 0,
                dtype_to_storage_type(rows.dtype),
            );
            product
        } else {
            grad_rows
        };
        let product_parts = weights_product_partials(rows.clone(), scaled_grad);
        let grad_weights = empty(&rows, Shape::new([width, columns]));
        // Shaped as the scales: `[3]` each where packed (the last two then unwritten: their
        // inputs are detached, so no gradient of theirs is registered).
        let [grad_input_scale, grad_depth_scale, grad_residual_scale] =
            scale_shapes.map(|shape| empty(&rows, shape));
        let grad_bias = empty(&rows, Shape::new([columns]));
        // After the sums over the tokens, one unit per entry of `∂Φ`: past 65535 cubes at
        // wide rows, so spread over the grid's dimensions (the kernel takes the cube's linear
        // position; cubes past the last entry write nothing).
        let (launch_cubes, dim) = per_item(
            &rows,
            columns + 3 + (width * columns).div_ceil(SUM_THREADS),
            SUM_THREADS,
        );
        normalised_finish_kernel::launch(
            &rows.client,
            launch_cubes,
            dim,
            partials.into_tensor_arg(),
            product_parts.into_tensor_arg(),
            grad_weights.clone().into_tensor_arg(),
            grad_input_scale.clone().into_tensor_arg(),
            grad_depth_scale.clone().into_tensor_arg(),
            grad_residual_scale.clone().into_tensor_arg(),
            grad_bias.clone().into_tensor_arg(),
            columns,
            packed_scales,
            SUM_THREADS,
            float_types(rows.dtype),
        );
        (
            Cube::float_reshape(grad_rows, Shape::new(unit_shape)),
            grad_weights,
            grad_input_scale,
            grad_depth_scale,
            grad_residual_scale,
            grad_bias,
        )
    }
}

mod kernels {
    use cubecl::prelude::*;

    use crate::backend::cube_launch::RowTiles;
    use crate::backend::cube_launch::kernels::{
        constant, cube_total, load_weight_tile, row_root, row_scale, row_slope, row_squares,
        row_view_products, sum_over_cube, tiled_projection, tiled_row_gradient, weight_at,
    };
    use crate::backend::sinkhorn::cube::kernels::{sinkhorn_backward, sinkhorn_forward};

    #[cube]
    fn sigmoid<E: Float>(z: E) -> E {
        E::new(1.0) / (E::new(1.0) + (E::new(0.0) - z).exp())
    }

    /// With `staged`, the step's block of `W` from entry `start` on into `tile`, `columns | 1`
    /// apart (every unit takes part; see `GatedWeights`).
    #[cube]
    fn stage_weights<E: Float, A: Float>(
        mixing_weights: &Tensor<E>,
        start: usize,
        tile: &mut Shared<[A]>,
        #[comptime] columns: usize,
        #[comptime] threads: usize,
        #[comptime] staged: bool,
    ) {
        if comptime!(staged) {
            let padded = comptime!(columns | 1);
            load_weight_tile::<E, A>(
                mixing_weights,
                start,
                tile,
                columns,
                threads,
                threads,
                padded,
                true,
            );
            sync_cube();
        }
    }

    /// Entry `j`'s weights: `W[j, ·]` into `weights` (from the step's block in `tile`, entry
    /// `unit`, with `staged`; else from global memory), then `(1 + γ_j, v_j)`.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn entry_weights<E: Float, A: Float>(
        mixing_weights: &Tensor<E>,
        depth_weights: &Tensor<E>,
        gain: &Tensor<E>,
        tile: &Shared<[A]>,
        j: usize,
        unit: usize,
        weights: &mut Array<A>,
        #[comptime] columns: usize,
        #[comptime] staged: bool,
    ) -> (A, A) {
        let padded = comptime!(columns | 1);
        #[unroll]
        for c in 0..columns {
            if comptime!(staged) {
                weights[c] = tile[unit * padded + c];
            } else {
                weights[c] = A::cast_from(weight_at::<E>(mixing_weights, j, c, columns, true));
            }
        }
        (
            A::new(1.0) + A::cast_from(gain[j]),
            A::cast_from(depth_weights[j]),
        )
    }

    /// The `x W̃` of the cube's rows `first .. first + rows_per_cube` for the gated form's
    /// `columns + 1` projections, then their sums of squares, summed over the cube: row `r`'s
    /// `columns + 2` totals end at `shared[r · (columns + 2)]`. Each step reads an entry's
    /// weights once for all of the cube's rows; with `staged`, the step's block of `W` passes
    /// through `shared` first (see `GatedWeights`).
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn gated_projection<E: Float, A: Float>(
        rows: &Tensor<E>,
        mixing_weights: &Tensor<E>,
        depth_weights: &Tensor<E>,
        gain: &Tensor<E>,
        first: usize,
        shared: &mut Shared<[A]>,
        #[comptime] columns: usize,
        #[comptime] threads: usize,
        #[comptime] rows_per_cube: usize,
        #[comptime] staged: bool,
    ) {
        let count = rows.shape(0);
        let width = rows.shape(1);
        let unit = UNIT_POS as usize;
        let slots = comptime!(columns + 2);
        let per_unit = comptime!(rows_per_cube * (columns + 2));
        let mut partial = Array::<A>::new(per_unit);
        #[unroll]
        for k in 0..per_unit {
            partial[k] = A::new(0.0);
        }
        let mut weights = Array::<A>::new(columns);
        // The same bound in every unit: each takes part in every sync.
        let mut start = 0usize;
        while start < width {
            stage_weights::<E, A>(mixing_weights, start, shared, columns, threads, staged);
            let j = start + unit;
            if j < width {
                let (gained, depth) = entry_weights::<E, A>(
                    mixing_weights,
                    depth_weights,
                    gain,
                    &*shared,
                    j,
                    unit,
                    &mut weights,
                    columns,
                    staged,
                );
                #[unroll]
                for r in 0..rows_per_cube {
                    if first + r < count {
                        let x = A::cast_from(rows[(first + r) * width + j]);
                        let scaled = x * gained;
                        #[unroll]
                        for c in 0..columns {
                            partial[r * slots + c] += scaled * weights[c];
                        }
                        partial[r * slots + columns] += scaled * depth;
                        partial[r * slots + columns + 1] += x * x;
                    }
                }
            }
            if comptime!(staged) {
                sync_cube();
            }
            start += threads;
        }
        #[unroll]
        for k in 0..per_unit {
            shared[unit * per_unit + k] = partial[k];
        }
        sync_cube();
        sum_over_cube::<A>(shared, per_unit);
    }

    /// `act(p)`: `tanh` or the identity.
    #[cube]
    fn activation<E: Float>(p: E, #[comptime] tanh: bool) -> E {
        let mut value = p;
        if comptime!(tanh) {
            value = p.tanh();
        }
        value
    }

    /// `act'(p)` from `act(p)`.
    #[cube]
    fn activation_slope<E: Float>(value: E, #[comptime] tanh: bool) -> E {
        let mut slope = E::new(1.0);
        if comptime!(tanh) {
            slope = E::new(1.0) - value * value;
        }
        slope
    }

    /// One cube per `tokens_per_cube` consecutive tokens, their `U` rows each (see
    /// `gated_projection`); then per row its projection and norm kept for the backward and its
    /// entries of the table; then the tokens' block input `u[t, v] = Σ_q A_in[q, v] x_{tU+q}`
    /// from their view rows (kept in shared memory, as stored) in a second pass over their rows.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gated_forward_kernel<E: Float, A: Float>(
        rows: &Tensor<E>,
        mixing_weights: &Tensor<E>,
        depth_weights: &Tensor<E>,
        gain: &Tensor<E>,
        mixing_scale: &Tensor<E>,
        depth_scale: &Tensor<E>,
        mixing_static: &Tensor<E>,
        depth_static: &Tensor<E>,
        table: &mut Tensor<E>,
        projection: &mut Tensor<E>,
        input: &mut Tensor<E>,
        #[comptime] columns: usize,
        #[comptime] units: usize,
        #[comptime] threads: usize,
        #[comptime] tokens_per_cube: usize,
        #[comptime] tanh: bool,
        #[comptime] staged: bool,
        #[comptime] numerator_bits: u32,
        #[comptime] offset_bits: u32,
        #[comptime] floor_bits: u32,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let count = rows.shape(0);
        let rows_per_cube = comptime!(tokens_per_cube * units);
        let first = CUBE_POS * rows_per_cube;
        if first >= count {
            terminate!();
        }
        let slots = comptime!(columns + 2);
        let views = comptime!(columns - units);
        // The partial sums, and with `staged` first the weights' blocks (`columns | 1` apart).
        let mut shared =
            Shared::<[A]>::new_slice(comptime!(threads * rows_per_cube * (columns + 2)));
        gated_projection::<E, A>(
            rows,
            mixing_weights,
            depth_weights,
            gain,
            first,
            &mut shared,
            columns,
            threads,
            rows_per_cube,
            staged,
        );
        // `A_in[q, v]` of the cube's tokens, at `(k · V + v) · U + q` for its token `k`.
        let mut view_weights = Shared::<[A]>::new_slice(comptime!(rows_per_cube * views));
        for r in 0..rows_per_cube {
            let row = first + r;
            if row < count {
                let at = r * slots;
                let norm = shared[at + columns + 1].sqrt();
                // In the summing type, as the norm: f16 rounds the floor (1e-12) to 0.
                let scale = E::cast_from(row_scale::<A>(
                    norm,
                    numerator_bits,
                    offset_bits,
                    floor_bits,
                ));
                // `p` and `‖x‖`, kept for the backward, which then projects nothing again (the
                // norm, not its square: in f16 a row of 4096 entries of RMS 4 has ‖x‖² past
                // f16's largest).
                let mut c = UNIT_POS as usize;
                while c < slots {
                    let mut value = shared[at + c];
                    if c == comptime!(columns + 1) {
                        value = norm;
                    }
                    projection[row * slots + c] = E::cast_from(value);
                    c += threads;
                }
                let t = row / units;
                let q = row % units;
                let mut c = UNIT_POS as usize;
                while c <= columns {
                    let value = activation::<E>(E::cast_from(shared[at + c]) * scale, tanh);
                    let entry = if c < columns {
                        mixing_scale[0] * value + mixing_static[q * columns + c]
                    } else {
                        depth_scale[0] * value + depth_static[q]
                    };
                    table[(t * comptime!(columns + 1) + c) * units + q] = entry;
                    if c < views {
                        view_weights[((r / units) * views + c) * units + q] = A::cast_from(entry);
                    }
                    c += threads;
                }
            }
        }
        sync_cube();
        let width = rows.shape(1);
        let first_token = CUBE_POS * tokens_per_cube;
        let mut x = Array::<A>::new(units);
        for k in 0..tokens_per_cube {
            let t = first_token + k;
            if t * units < count {
                let mut j = UNIT_POS as usize;
                while j < width {
                    #[unroll]
                    for q in 0..units {
                        x[q] = A::cast_from(rows[(t * units + q) * width + j]);
                    }
                    #[unroll]
                    for v in 0..views {
                        let mut total = A::new(0.0);
                        #[unroll]
                        for q in 0..units {
                            total += view_weights[(k * views + v) * units + q] * x[q];
                        }
                        input[(t * views + v) * width + j] = E::cast_from(total);
                    }
                    j += threads;
                }
            }
        }
    }

    /// `⟨∂u[t, v], x_r⟩` for the `views` views of the block input and each of the cube's rows
    /// `r` (gated rows: one unit of token `t` each), summed over the cube: row `r`'s end at
    /// `inner[r · views]`.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn view_products<E: Float, A: Float>(
        rows: &Tensor<E>,
        input_grad: &Tensor<E>,
        first: usize,
        inner: &mut Shared<[A]>,
        #[comptime] units: usize,
        #[comptime] views: usize,
        #[comptime] threads: usize,
        #[comptime] rows_per_cube: usize,
    ) {
        let count = rows.shape(0);
        let width = rows.shape(1);
        let unit = UNIT_POS as usize;
        let per_unit = comptime!(rows_per_cube * views);
        let mut partial = Array::<A>::new(per_unit);
        #[unroll]
        for k in 0..per_unit {
            partial[k] = A::new(0.0);
        }
        let mut j = unit;
        while j < width {
            #[unroll]
            for r in 0..rows_per_cube {
                let row = first + r;
                if row < count {
                    let t = row / units;
                    let x = A::cast_from(rows[row * width + j]);
                    #[unroll]
                    for v in 0..views {
                        partial[r * views + v] +=
                            x * A::cast_from(input_grad[(t * views + v) * width + j]);
                    }
                }
            }
            j += threads;
        }
        #[unroll]
        for k in 0..per_unit {
            inner[unit * per_unit + k] = partial[k];
        }
        sync_cube();
        sum_over_cube::<A>(inner, per_unit);
    }

    /// The forward's cubes (see `gated_forward_kernel`): the block input's products, then per
    /// row `δ` and the sums the finishing kernel adds up, then `∂x` of the cube's rows in one
    /// pass that reads each entry's weights once for all of them.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gated_backward_kernel<E: Float, A: Float>(
        rows: &Tensor<E>,
        mixing_weights: &Tensor<E>,
        depth_weights: &Tensor<E>,
        gain: &Tensor<E>,
        mixing_scale: &Tensor<E>,
        depth_scale: &Tensor<E>,
        mixing_static: &Tensor<E>,
        projection: &Tensor<E>,
        grad: &Tensor<E>,
        previous_rows: &Tensor<E>,
        input_grad: &Tensor<E>,
        grad_rows: &mut Tensor<E>,
        scaled_grad: &mut Tensor<E>,
        partials: &mut Tensor<E>,
        view_grad: &mut Tensor<E>,
        #[comptime] columns: usize,
        #[comptime] units: usize,
        #[comptime] threads: usize,
        #[comptime] rows_per_cube: usize,
        #[comptime] tanh: bool,
        #[comptime] with_previous_rows: bool,
        #[comptime] views: usize,
        #[comptime] staged: bool,
        #[comptime] numerator_bits: u32,
        #[comptime] offset_bits: u32,
        #[comptime] floor_bits: u32,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let count = rows.shape(0);
        let first = CUBE_POS * rows_per_cube;
        if first >= count {
            terminate!();
        }
        let width = rows.shape(1);
        let unit = UNIT_POS as usize;
        let slots = comptime!(columns + 2);
        let steps = comptime!(columns + 1);
        let kept_views = comptime!(views.max(1));
        // The block input's part of the table's gradient, ⟨∂u_v, x_r⟩ (see `views`).
        let mut inner = Shared::<[A]>::new_slice(comptime!(threads * rows_per_cube * views.max(1)));
        if comptime!(views > 0) {
            view_products::<E, A>(
                rows,
                input_grad,
                first,
                &mut inner,
                units,
                views,
                threads,
                rows_per_cube,
            );
        }
        // Per row: δ_c = g_c · m · act'(p_c), the views' weights, the scale and
        // `along = s'(‖x‖)/‖x‖ (p · δ)`, for the pass over the rows below.
        // (Written at run-time indices here, then copied at fixed ones, so that the pass can
        // keep its copies in registers.)
        let mut step_at = Array::<A>::new(comptime!(rows_per_cube * (columns + 1)));
        let mut view_weights_at = Array::<A>::new(comptime!(rows_per_cube * views.max(1)));
        let mut scales_at = Array::<A>::new(rows_per_cube);
        let mut alongs_at = Array::<A>::new(rows_per_cube);
        for r in 0..rows_per_cube {
            let live = first + r < count;
            // A row past the last reads the cube's first and writes nothing.
            let mut row = first;
            if live {
                row = first + r;
            }
            // The forward's `p` and `‖x‖`.
            let mut projected = Array::<E>::new(slots);
            #[unroll]
            for c in 0..slots {
                projected[c] = projection[row * slots + c];
            }
            // The scale and its slope in the summing type, as in the forward.
            let norm = A::cast_from(projected[comptime!(columns + 1)]);
            let scale = row_scale::<A>(norm, numerator_bits, offset_bits, floor_bits);
            let slope = E::cast_from(row_slope::<A>(norm, scale, offset_bits, floor_bits));
            scales_at[r] = scale;
            let scale = E::cast_from(scale);
            let t = row / units;
            let q = row % units;
            // The scalars' partial sums of g · act(p).
            let mut along = E::new(0.0);
            let mut mixing_sum = E::new(0.0);
            let mut depth_sum = E::new(0.0);
            for v in 0..kept_views {
                view_weights_at[r * kept_views + v] = A::new(0.0);
            }
            for c in 0..steps {
                let value = activation::<E>(projected[c] * scale, tanh);
                let derivative = activation_slope::<E>(value, tanh);
                let mut g = grad[(t * steps + c) * units + q];
                // (no view rows where `views` is 0)
                if c < views {
                    g += E::cast_from(inner[r * views + c]);
                    view_weights_at[r * kept_views + c] =
                        A::cast_from(mixing_scale[0] * value + mixing_static[q * columns + c]);
                    if live && unit == 0 {
                        view_grad[(t * views + c) * units + q] = g;
                    }
                }
                let mut factor = mixing_scale[0];
                if c < columns {
                    mixing_sum += g * value;
                } else {
                    factor = depth_scale[0];
                    depth_sum += g * value;
                }
                let d = g * factor * derivative;
                step_at[r * steps + c] = A::cast_from(d);
                along += projected[c] * d;
                if live && unit == 0 {
                    scaled_grad[row * steps + c] = d * scale;
                }
            }
            alongs_at[r] = A::cast_from(along * slope);
            if live && unit == 0 {
                partials[row * 2] = mixing_sum;
                partials[row * 2 + 1] = depth_sum;
            }
        }
        let mut step = Array::<A>::new(comptime!(rows_per_cube * (columns + 1)));
        #[unroll]
        for k in 0..comptime!(rows_per_cube * (columns + 1)) {
            step[k] = step_at[k];
        }
        let mut view_weights = Array::<A>::new(comptime!(rows_per_cube * views.max(1)));
        #[unroll]
        for k in 0..comptime!(rows_per_cube * views.max(1)) {
            view_weights[k] = view_weights_at[k];
        }
        let mut scales = Array::<A>::new(rows_per_cube);
        let mut alongs = Array::<A>::new(rows_per_cube);
        #[unroll]
        for r in 0..rows_per_cube {
            scales[r] = scales_at[r];
            alongs[r] = alongs_at[r];
        }
        // ∂x[r, j] = s (1 + γ_j) (W̃ δ)_j + along · x[r, j], plus the earlier gradient and the
        // views' `Σ_v A_in[v] ∂u_v[j]`. The same bound in every unit: each takes part in every
        // sync.
        let padded = comptime!(columns | 1);
        let mut tile =
            Shared::<[A]>::new_slice(comptime!(if staged { threads * padded } else { 1 }));
        let mut weights = Array::<A>::new(columns);
        let mut start = 0usize;
        while start < width {
            stage_weights::<E, A>(mixing_weights, start, &mut tile, columns, threads, staged);
            let j = start + unit;
            if j < width {
                let (gained, depth) = entry_weights::<E, A>(
                    mixing_weights,
                    depth_weights,
                    gain,
                    &tile,
                    j,
                    unit,
                    &mut weights,
                    columns,
                    staged,
                );
                #[unroll]
                for r in 0..rows_per_cube {
                    let row = first + r;
                    if row < count {
                        let mut total = depth * step[r * steps + columns];
                        #[unroll]
                        for c in 0..columns {
                            total += weights[c] * step[r * steps + c];
                        }
                        let at = row * width + j;
                        let mut value =
                            scales[r] * gained * total + alongs[r] * A::cast_from(rows[at]);
                        if comptime!(with_previous_rows) {
                            value += A::cast_from(previous_rows[at]);
                        }
                        if comptime!(views > 0) {
                            let t = row / units;
                            #[unroll]
                            for v in 0..views {
                                value += view_weights[r * kept_views + v]
                                    * A::cast_from(input_grad[(t * views + v) * width + j]);
                            }
                        }
                        grad_rows[at] = E::cast_from(value);
                    }
                }
            }
            if comptime!(staged) {
                sync_cube();
            }
            start += threads;
        }
    }

    /// This unit's part of `Σ_i tensor[start + i · stride]` for `i < count`.
    #[cube]
    fn strided_part<E: Float, A: Float>(
        tensor: &Tensor<E>,
        start: usize,
        stride: usize,
        count: usize,
        #[comptime] threads: usize,
    ) -> A {
        let mut total = A::new(0.0);
        let mut i = UNIT_POS as usize;
        while i < count {
            total += A::cast_from(tensor[start + i * stride]);
            i += threads;
        }
        total
    }

    /// Cubes `0..row_cubes`: `∂W`, `∂v`, `∂γ` from `H = xᵀ (s δ)`, whole rows of `H` a cube
    /// (`threads / (columns + 1)` of them): one unit per entry of `H` sums its partial sums over
    /// the chunks of `product_parts [chunks, w · (columns + 1)]` (in the summing type `A`), then
    /// one unit per row takes `∂γ`'s sum over the row; then one cube per entry of `A` and `b`
    /// (sums of the table's gradient over the tokens) and one per scalar (sums of the per-row
    /// partials).
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gated_finish_kernel<E: Float, A: Float>(
        product_parts: &Tensor<A>,
        mixing_weights: &Tensor<E>,
        depth_weights: &Tensor<E>,
        gain: &Tensor<E>,
        grad: &Tensor<E>,
        partials: &Tensor<E>,
        view_grad: &Tensor<E>,
        grad_mixing_weights: &mut Tensor<E>,
        grad_depth_weights: &mut Tensor<E>,
        grad_gain: &mut Tensor<E>,
        grad_mixing_scale: &mut Tensor<E>,
        grad_depth_scale: &mut Tensor<E>,
        grad_mixing_static: &mut Tensor<E>,
        grad_depth_static: &mut Tensor<E>,
        #[comptime] columns: usize,
        #[comptime] units: usize,
        #[comptime] views: usize,
        #[comptime] row_cubes: usize,
        #[comptime] threads: usize,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let cube = CUBE_POS;
        let unit = UNIT_POS as usize;
        let entries = grad.shape(1) * grad.shape(2);
        // A grid spread over its dimensions rounds the cubes up: the extra ones (a whole cube
        // each, so before any `sync_cube`) would sum past `partials`' two columns.
        if cube >= row_cubes + entries + 2 {
            terminate!();
        }
        let mut shared = Shared::<[A]>::new_slice(threads);
        if cube < row_cubes {
            let steps = comptime!(columns + 1);
            let rows_per_cube = comptime!(threads / (columns + 1));
            let width = gain.len();
            let first = cube * rows_per_cube;
            // Entry `unit` of the cube's rows: consecutive units read consecutive partial sums.
            let j = first + unit / steps;
            let c = unit % steps;
            if unit < comptime!(rows_per_cube * (columns + 1)) && j < width {
                let stride = width * steps;
                let mut h = A::new(0.0);
                for chunk in 0..product_parts.shape(0) {
                    h += product_parts[chunk * stride + j * steps + c];
                }
                shared[unit] = h;
                let g = E::new(1.0) + gain[j];
                if c < columns {
                    grad_mixing_weights[j * columns + c] = g * E::cast_from(h);
                } else {
                    grad_depth_weights[j] = g * E::cast_from(h);
                }
            }
            sync_cube();
            let j = first + unit;
            if unit < rows_per_cube && j < width {
                let at = unit * steps;
                let mut total = A::cast_from(depth_weights[j]) * shared[at + columns];
                for c in 0..columns {
                    total += A::cast_from(mixing_weights[j * columns + c]) * shared[at + c];
                }
                grad_gain[j] = E::cast_from(total);
            }
            sync_cube();
        }
        // The sums (a cube of `W`'s rows takes part with nothing): entry k = c · U + q of the
        // table's gradient over the tokens, or a scalar's column of the per-row partials.
        let mut k = 0usize;
        let mut part = A::new(0.0);
        if cube >= row_cubes {
            k = cube - row_cubes;
            let viewed = comptime!(views * units);
            if k < viewed {
                // The view rows' gradient, the block input's part added (see `views`).
                part = strided_part::<E, A>(view_grad, k, viewed, view_grad.shape(0), threads);
            } else if k < entries {
                part = strided_part::<E, A>(grad, k, entries, grad.shape(0), threads);
            } else {
                part =
                    strided_part::<E, A>(partials, k - entries, 2usize, partials.shape(0), threads);
            }
        }
        let total = E::cast_from(cube_total::<A>(part, &mut shared));
        if cube >= row_cubes && unit == 0 {
            if k < entries {
                let c = k / units;
                let q = k % units;
                if c < columns {
                    grad_mixing_static[q * columns + c] = total;
                } else {
                    grad_depth_static[q] = total;
                }
            } else if k == entries {
                grad_mixing_scale[0] = total;
            } else {
                grad_depth_scale[0] = total;
            }
        }
    }

    /// `z = α_g · s · xΦ + c` (`columns` entries) from the row's projection `xΦ`, in the
    /// summing type `A`.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn logits<E: Float, A: Float>(
        projected: &Array<A>,
        scale: A,
        input_scale: A,
        depth_scale: A,
        residual_scale: A,
        bias: &Tensor<E>,
        #[comptime] n: usize,
        #[comptime] columns: usize,
    ) -> Array<A> {
        let mut z = Array::<A>::new(columns);
        for c in 0..columns {
            let mut factor = residual_scale;
            if c < n {
                factor = input_scale;
            } else if c < 2 * n {
                factor = depth_scale;
            }
            z[c] = factor * scale * projected[c] + A::cast_from(bias[c]);
        }
        z
    }

    /// `w = softmax(z[2n : 2n + m])` into `weights` (`m` entries), in `z`'s type.
    #[cube]
    fn mixture_weights<E: Float>(
        z: &Array<E>,
        weights: &mut Array<E>,
        #[comptime] n: usize,
        #[comptime] m: usize,
    ) {
        let first = comptime!(2 * n);
        let mut largest = z[first];
        for p in 1..m {
            if z[first + p] > largest {
                largest = z[first + p];
            }
        }
        let mut total = E::new(0.0);
        for p in 0..m {
            let e = (z[first + p] - largest).exp();
            weights[p] = e;
            total += e;
        }
        for p in 0..m {
            weights[p] /= total;
        }
    }

    /// Scale `index` of the normalised form: entry `index` of `first` where the three are packed
    /// in one `[3]` tensor, else `own[0]`.
    #[cube]
    fn scale_entry<E: Float, A: Float>(
        first: &Tensor<E>,
        own: &Tensor<E>,
        #[comptime] index: usize,
        #[comptime] packed: bool,
    ) -> A {
        let mut value = first[index];
        if comptime!(!packed) {
            value = own[0];
        }
        A::cast_from(value)
    }

    /// One cube per `threads / group` token rows (see [`RowTiles`]): their projections
    /// through shared weight tiles (or, with `given_projection`, read from `given` and only
    /// their sums of squares made here), then one unit per row for the small per-row work,
    /// then the rows' block input `u_t = Σ_k H_pre[k] S_k` (`H_pre` kept in shared memory, as
    /// stored) in a second pass over the rows.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn normalised_forward_kernel<E: Float, A: Float>(
        rows: &Tensor<E>,
        given: &Tensor<E>,
        weights: &Tensor<E>,
        input_scale: &Tensor<E>,
        depth_scale: &Tensor<E>,
        residual_scale: &Tensor<E>,
        bias: &Tensor<E>,
        matrices: &Tensor<E>,
        table: &mut Tensor<E>,
        projection: &mut Tensor<E>,
        input: &mut Tensor<E>,
        #[comptime] n: usize,
        #[comptime] mixtures: usize,
        #[comptime] iterations: usize,
        #[comptime] packed_scales: bool,
        #[comptime] tiles: RowTiles,
        #[comptime] contiguous_weights: bool,
        #[comptime] given_projection: bool,
        #[comptime] input_offset_bits: u32,
        #[comptime] depth_factor_bits: u32,
        #[comptime] epsilon_bits: u32,
        #[comptime] numerator_bits: u32,
        #[comptime] offset_bits: u32,
        #[comptime] root_offset_bits: u32,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let rows_per_cube = comptime!(tiles.rows_per_cube());
        let group = comptime!(tiles.group);
        let first = CUBE_POS * rows_per_cube;
        if first >= rows.shape(0) {
            terminate!();
        }
        let columns = comptime!(2 * n + if mixtures > 0 { mixtures } else { n * n });
        let slots = comptime!(columns + 1);
        let mut shared = Shared::<[A]>::new_slice(comptime!(tiles.shared));
        if comptime!(given_projection) {
            // Each row group leaves its row's `xΦ` and `‖x‖²` where `tiled_projection` leaves
            // its totals.
            let squares = row_squares::<E, A>(rows, first, &mut shared, tiles);
            let unit = UNIT_POS as usize;
            let in_group = unit % group;
            let row = first + unit / group;
            let at = (unit / group) * comptime!(group * slots);
            if row < rows.shape(0) {
                if in_group == 0 {
                    shared[at + columns] = squares;
                }
                let mut c = in_group;
                while c < columns {
                    shared[at + c] = A::cast_from(given[row * columns + c]);
                    c += group;
                }
            }
            sync_cube();
        } else {
            tiled_projection::<E, A>(
                rows,
                weights,
                first,
                &mut shared,
                columns,
                tiles,
                contiguous_weights,
            );
        }
        let unit = UNIT_POS as usize;
        let row = first + unit;
        // `H_pre` of the cube's rows, `n` a row.
        let mut input_weights = Shared::<[A]>::new_slice(comptime!(rows_per_cube * n));
        if unit < rows_per_cube && row < rows.shape(0) {
            let at = unit * comptime!(group * slots);
            // `xΦ` and `ρ = √(‖x‖² + c)`, kept for the backward, which then projects nothing
            // again (the root, not the sum of squares: in f16 a token of 4 × 768 entries of
            // RMS 5 has ‖x‖² past f16's largest).
            // The row's small work (logits, gates, the softmax mixture or Sinkhorn-Knopp) runs
            // in the summing type from the stored (rounded) projection, as the backward's does:
            // in f16 a mixture of 24 permutations or 20 Sinkhorn-Knopp iterations lose bits.
            let mut projected = Array::<A>::new(slots);
            #[unroll]
            for c in 0..columns {
                let value = E::cast_from(shared[at + c]);
                projected[c] = A::cast_from(value);
                projection[row * slots + c] = value;
            }
            let root = E::cast_from(row_root::<A>(shared[at + columns], root_offset_bits));
            projected[columns] = A::cast_from(root);
            projection[row * slots + columns] = root;
            let scale = row_scale::<A>(projected[columns], numerator_bits, offset_bits, 0u32);
            let z = logits::<E, A>(
                &projected,
                scale,
                A::cast_from(input_scale[0]),
                scale_entry::<E, A>(input_scale, depth_scale, 1usize, packed_scales),
                scale_entry::<E, A>(input_scale, residual_scale, 2usize, packed_scales),
                bias,
                n,
                columns,
            );
            let base = row * comptime!((n + 2) * n);
            for k in 0..n {
                let pre = E::cast_from(sigmoid::<A>(z[k]) + constant::<A>(input_offset_bits));
                table[base + k] = pre;
                input_weights[unit * n + k] = A::cast_from(pre);
                table[base + comptime!((n + 1) * n) + k] =
                    E::cast_from(constant::<A>(depth_factor_bits) * sigmoid::<A>(z[n + k]));
            }
            let mut matrix = Array::<A>::new(comptime!(n * n));
            if comptime!(mixtures > 0) {
                let mut mix = Array::<A>::new(comptime!(mixtures.max(1)));
                mixture_weights::<A>(&z, &mut mix, n, mixtures);
                for e in 0..comptime!(n * n) {
                    let mut total = A::new(0.0);
                    for p in 0..mixtures {
                        total += mix[p] * A::cast_from(matrices[p * comptime!(n * n) + e]);
                    }
                    matrix[e] = total;
                }
            } else {
                let mut residual = Array::<A>::new(comptime!(n * n));
                for k in 0..comptime!(n * n) {
                    residual[k] = z[comptime!(2 * n) + k];
                }
                sinkhorn_forward::<A>(
                    &residual,
                    &mut matrix,
                    n,
                    iterations,
                    constant::<A>(epsilon_bits),
                );
            }
            // Row 1 + i holds column i of H_res (the weights that make unit i).
            for k in 0..n {
                for i in 0..n {
                    table[base + (1 + i) * n + k] = E::cast_from(matrix[k * n + i]);
                }
            }
        }
        sync_cube();
        let unit_width = rows.shape(1) / n;
        for r in 0..rows_per_cube {
            let row = first + r;
            if row < rows.shape(0) {
                let mut j = unit;
                while j < unit_width {
                    let mut total = A::new(0.0);
                    #[unroll]
                    for k in 0..n {
                        total += input_weights[r * n + k]
                            * A::cast_from(rows[(row * n + k) * unit_width + j]);
                    }
                    input[row * unit_width + j] = E::cast_from(total);
                    j += comptime!(tiles.threads);
                }
            }
        }
    }

    /// The forward's cubes (see [`normalised_forward_kernel`]): the products of the rows with
    /// the block input's gradient (the projections come saved from the forward), one unit per
    /// row for `δ`, then `∂x` in a pass over the weight tiles.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn normalised_backward_kernel<E: Float, A: Float>(
        rows: &Tensor<E>,
        weights: &Tensor<E>,
        input_scale: &Tensor<E>,
        depth_scale: &Tensor<E>,
        residual_scale: &Tensor<E>,
        bias: &Tensor<E>,
        matrices: &Tensor<E>,
        projection: &Tensor<E>,
        grad: &Tensor<E>,
        previous_rows: &Tensor<E>,
        input_grad: &Tensor<E>,
        grad_rows: &mut Tensor<E>,
        scaled_grad: &mut Tensor<E>,
        partials: &mut Tensor<E>,
        row_terms: &mut Tensor<E>,
        #[comptime] n: usize,
        #[comptime] mixtures: usize,
        #[comptime] iterations: usize,
        #[comptime] packed_scales: bool,
        #[comptime] tiles: RowTiles,
        #[comptime] contiguous_weights: bool,
        #[comptime] with_previous_rows: bool,
        #[comptime] with_input: bool,
        #[comptime] given_product: bool,
        #[comptime] input_offset_bits: u32,
        #[comptime] depth_factor_bits: u32,
        #[comptime] epsilon_bits: u32,
        #[comptime] numerator_bits: u32,
        #[comptime] offset_bits: u32,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let tokens = rows.shape(0);
        let rows_per_cube = comptime!(tiles.rows_per_cube());
        let group = comptime!(tiles.group);
        let first = CUBE_POS * rows_per_cube;
        if first >= tokens {
            terminate!();
        }
        let unit = UNIT_POS as usize;
        let columns = comptime!(2 * n + if mixtures > 0 { mixtures } else { n * n });
        // The block input's part of the table's gradient, ⟨∂u, x_t[k]⟩ (see `with_input`),
        // after the projection and the sum of squares.
        let views = comptime!(if with_input { n } else { 0 });
        let slots = comptime!(columns + 1);
        // Per row: δ·α_g (columns), s'(n)/n · (xΦ · δ), H_pre + ε_in (n), s.
        let per_row = comptime!(columns + 2 + n);
        // With `given_product` no weight tile: only the block input's products use the buffer.
        let shared_len = comptime!(if given_product {
            (tiles.threads * n).max(1)
        } else {
            tiles.shared
        });
        let mut shared = Shared::<[A]>::new_slice(shared_len);
        let mut steps = Shared::<[A]>::new_slice(comptime!(rows_per_cube * per_row));
        // The forward's `xΦ` and `ρ` come saved; only the products with the block input's
        // gradient, `⟨∂u, x_t[k]⟩`, need a pass over the rows first.
        let mut products = Array::<A>::new(n);
        #[unroll]
        for k in 0..n {
            products[k] = A::new(0.0);
        }
        if comptime!(with_input) {
            row_view_products::<E, A>(
                rows,
                input_grad,
                first,
                &mut shared,
                &mut products,
                n,
                tiles,
            );
        }
        let row = first + unit;
        if unit < rows_per_cube && row < tokens {
            // In the summing type, as the forward's (see `normalised_forward_kernel`).
            let mut projected = Array::<A>::new(slots);
            #[unroll]
            for c in 0..slots {
                projected[c] = A::cast_from(projection[row * slots + c]);
            }
            let step_at = unit * per_row;
            let root = projected[columns];
            let scale = row_scale::<A>(root, numerator_bits, offset_bits, 0u32);
            let a_in = A::cast_from(input_scale[0]);
            let a_depth = scale_entry::<E, A>(input_scale, depth_scale, 1usize, packed_scales);
            let a_res = scale_entry::<E, A>(input_scale, residual_scale, 2usize, packed_scales);
            let z = logits::<E, A>(&projected, scale, a_in, a_depth, a_res, bias, n, columns);
            let base = row * comptime!((n + 2) * n);
            let out = row * comptime!(columns + 3);
            let mut dz = Array::<A>::new(columns);
            for k in 0..n {
                let pre = sigmoid::<A>(z[k]);
                let mut g = A::cast_from(grad[base + k]);
                if comptime!(with_input) {
                    g += products[k];
                    steps[step_at + comptime!(columns + 1) + k] =
                        pre + constant::<A>(input_offset_bits);
                }
                dz[k] = g * pre * (A::new(1.0) - pre);
                let post = sigmoid::<A>(z[n + k]);
                dz[n + k] = A::cast_from(grad[base + comptime!((n + 1) * n) + k])
                    * constant::<A>(depth_factor_bits)
                    * post
                    * (A::new(1.0) - post);
            }
            let mut upstream = Array::<A>::new(comptime!(n * n));
            for k in 0..n {
                for i in 0..n {
                    upstream[k * n + i] = A::cast_from(grad[base + (1 + i) * n + k]);
                }
            }
            if comptime!(mixtures > 0) {
                // ∂w_p = ⟨∂H, M_p⟩, then the softmax's ∂z_p = w_p (∂w_p − Σ_q w_q ∂w_q).
                let mut mix = Array::<A>::new(comptime!(mixtures.max(1)));
                mixture_weights::<A>(&z, &mut mix, n, mixtures);
                let mut dmix = Array::<A>::new(comptime!(mixtures.max(1)));
                let mut mean = A::new(0.0);
                for p in 0..mixtures {
                    let mut total = A::new(0.0);
                    for e in 0..comptime!(n * n) {
                        total += upstream[e] * A::cast_from(matrices[p * comptime!(n * n) + e]);
                    }
                    dmix[p] = total;
                    mean += mix[p] * total;
                }
                for p in 0..mixtures {
                    dz[comptime!(2 * n) + p] = mix[p] * (dmix[p] - mean);
                }
            } else {
                let mut residual = Array::<A>::new(comptime!(n * n));
                for k in 0..comptime!(n * n) {
                    residual[k] = z[comptime!(2 * n) + k];
                }
                let mut dres = Array::<A>::new(comptime!(n * n));
                sinkhorn_backward::<A>(
                    &residual,
                    &upstream,
                    &mut dres,
                    n,
                    iterations,
                    constant::<A>(epsilon_bits),
                );
                for k in 0..comptime!(n * n) {
                    dz[comptime!(2 * n) + k] = dres[k];
                }
            }
            let mut sums = Array::<A>::new(3usize);
            for g in 0..3usize {
                sums[g] = A::new(0.0);
            }
            let mut along = A::new(0.0);
            for c in 0..columns {
                // Which of the three scales α_g multiplies column c.
                let mut scalar = 2usize;
                let mut factor = a_res;
                if c < n {
                    scalar = 0usize;
                    factor = a_in;
                } else if c < 2 * n {
                    scalar = 1usize;
                    factor = a_depth;
                }
                sums[scalar] += dz[c] * scale * projected[c];
                partials[out + c] = E::cast_from(dz[c]);
                let d = dz[c] * factor;
                steps[step_at + c] = d;
                scaled_grad[row * columns + c] = E::cast_from(d * scale);
                along += projected[c] * d;
            }
            for g in 0..3usize {
                partials[out + columns + g] = E::cast_from(sums[g]);
            }
            let along = along * row_slope::<A>(root, scale, offset_bits, 0u32);
            steps[step_at + columns] = along;
            steps[step_at + comptime!(columns + 1 + n)] = scale;
            if comptime!(given_product) {
                let terms = row * comptime!(n + 1);
                row_terms[terms] = E::cast_from(along);
                if comptime!(with_input) {
                    for k in 0..n {
                        row_terms[terms + 1 + k] =
                            E::cast_from(steps[step_at + comptime!(columns + 1) + k]);
                    }
                }
            }
        }
        // ∂x_t = s Φ δ + s'(n)/n (xΦ · δ) x_t (+ the earlier gradient, + H_pre ∂u per unit);
        // with `given_product`, Burn's matmul and `normalised_row_gradient_kernel` make it.
        if comptime!(!given_product) {
            sync_cube();
            let step_at = (unit / group) * per_row;
            let mut step = Array::<A>::new(columns);
            #[unroll]
            for c in 0..columns {
                step[c] = A::cast_from(steps[step_at + c]);
            }
            let along = A::cast_from(steps[step_at + columns]);
            let scale = A::cast_from(steps[step_at + comptime!(columns + 1 + n)]);
            let mut gains = Array::<A>::new(n);
            #[unroll]
            for k in 0..n {
                gains[k] = A::cast_from(steps[step_at + comptime!(columns + 1) + k]);
            }
            tiled_row_gradient::<E, A>(
                rows,
                weights,
                previous_rows,
                input_grad,
                grad_rows,
                first,
                &mut shared,
                &step,
                scale,
                along,
                &gains,
                columns,
                views,
                with_previous_rows,
                tiles,
                contiguous_weights,
            );
        }
    }

    /// `∂x` of [`normalised_backward_kernel`] from `product = (s δ) Φᵀ` (Burn's matmul), in
    /// place, one unit per entry: `+ s'(n)/n (xΦ · δ) x_t`, `+` the earlier gradient with
    /// `with_previous_rows`, `+ (H_pre + ε_in)_k ∂u` on unit `k`'s part with `with_input`
    /// (`row_terms [T, n + 1]` holds the row's factors).
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn normalised_row_gradient_kernel<E: Float>(
        rows: &Tensor<E>,
        row_terms: &Tensor<E>,
        previous_rows: &Tensor<E>,
        input_grad: &Tensor<E>,
        product: &mut Tensor<E>,
        #[comptime] n: usize,
        #[comptime] with_previous_rows: bool,
        #[comptime] with_input: bool,
        #[define(E)] _dtype: ElemType,
    ) {
        let at = ABSOLUTE_POS;
        if at >= product.len() {
            terminate!();
        }
        let width = rows.shape(1);
        let row = at / width;
        let terms = row * comptime!(n + 1);
        let mut value = product[at] + row_terms[terms] * rows[at];
        if comptime!(with_previous_rows) {
            value += previous_rows[at];
        }
        if comptime!(with_input) {
            let view_width = width / n;
            let j = at % width;
            value += row_terms[terms + 1 + j / view_width]
                * input_grad[row * view_width + j % view_width];
        }
        product[at] = value;
    }

    /// One cube per column of `partials [T, columns + 3]`: its sum over the tokens, to `∂c`
    /// or to one of the three scalars (all three into the first where they are packed). Then
    /// one unit per entry of `∂Φ`: its partial sums over the chunks of
    /// `product_parts [chunks, N · columns]` (in the summing type `A`).
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn normalised_finish_kernel<E: Float, A: Float>(
        partials: &Tensor<E>,
        product_parts: &Tensor<A>,
        grad_weights: &mut Tensor<E>,
        grad_input_scale: &mut Tensor<E>,
        grad_depth_scale: &mut Tensor<E>,
        grad_residual_scale: &mut Tensor<E>,
        grad_bias: &mut Tensor<E>,
        #[comptime] columns: usize,
        #[comptime] packed_scales: bool,
        #[comptime] threads: usize,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let k = CUBE_POS;
        if k >= comptime!(columns + 3) {
            let entry = (k - comptime!(columns + 3)) * threads + UNIT_POS as usize;
            let entries = grad_weights.len();
            if entry < entries {
                let mut total = A::new(0.0);
                for chunk in 0..product_parts.shape(0) {
                    total += product_parts[chunk * entries + entry];
                }
                grad_weights[entry] = E::cast_from(total);
            }
            terminate!();
        }
        let mut shared = Shared::<[A]>::new_slice(threads);
        let part = strided_part::<E, A>(partials, k, partials.shape(1), partials.shape(0), threads);
        let total = E::cast_from(cube_total::<A>(part, &mut shared));
        if UNIT_POS == 0 {
            if k < columns {
                grad_bias[k] = total;
            } else if comptime!(packed_scales) {
                grad_input_scale[k - columns] = total;
            } else if k == columns {
                grad_input_scale[0] = total;
            } else if k == columns + 1 {
                grad_depth_scale[0] = total;
            } else {
                grad_residual_scale[0] = total;
            }
        }
    }
}

/// The table kernels of mHC (normalised, Sinkhorn-Knopp, `n` streams) and HC (gated, `tanh`)
/// at `tokens` tokens of `n` units of `width`, f32, as their launches above build them with
/// the default knobs (the backward with the streams' gradient so far and the block input's).
/// Constants (ε, the row scales) are mHC's and HC's; they change literals only.
#[cfg(feature = "kernel-source")]
pub(crate) fn cuda_kernels(
    target: &crate::backend::kernel_source::Target,
    tokens: usize,
    n: usize,
    width: usize,
) -> Result<Vec<crate::backend::kernel_source::CudaKernel>, String> {
    use crate::backend::kernel_source::{F32, tensor};
    use kernels::gated_backward_kernel::GatedBackwardKernel;
    use kernels::gated_forward_kernel::GatedForwardKernel;
    use kernels::normalised_backward_kernel::NormalisedBackwardKernel;
    use kernels::normalised_forward_kernel::NormalisedForwardKernel;
    // Each kernel's tensors on one line: only their compilation arguments matter here.
    let t = tensor;
    let hardware = target.hardware();
    let Knobs {
        gated_weights,
        gated_rows,
        ..
    } = knobs();
    let mut out = Vec::new();

    // mHC: rows of `n · width`, `2n + n²` columns, 20 Sinkhorn-Knopp iterations.
    let (mixtures, iterations) = (0, 20);
    let columns = normalised_columns(n, mixtures);
    let case = format!("mHC, {tokens} tokens of {n} × {width}, f32");
    let root = ((n * width) as f64).sqrt();
    let [epsilon, numerator, offset] = [1e-6, root, 1e-6 * root].map(kernel_constant);
    let tiles = normalised_forward_tiles(hardware, 4, columns, n);
    let cubes = tokens.div_ceil(tiles.rows_per_cube());
    #[rustfmt::skip]
    let forward = NormalisedForwardKernel::new(
        target.settings(tiles.threads), target.device(), target.runtime(),
        t(), t(), t(), t(), t(), t(), t(), t(), t(), t(), t(),
        n, mixtures, iterations, /* packed scales */ true, tiles, /* contiguous Φ */ true,
        /* given projection */ false,
        /* ε_in, depth factor, Sinkhorn-Knopp's ε */ epsilon, kernel_constant(2.0), epsilon,
        /* the row scale */ numerator, offset, kernel_constant(0.0),
        F32,
    );
    out.push(target.compile("normalised_forward", &case, forward, tiles.threads, cubes)?);
    let tiles = normalised_backward_tiles(hardware, 4, columns, n);
    let cubes = tokens.div_ceil(tiles.rows_per_cube());
    #[rustfmt::skip]
    let backward = NormalisedBackwardKernel::new(
        target.settings(tiles.threads), target.device(), target.runtime(),
        t(), t(), t(), t(), t(), t(), t(), t(), t(), t(), t(), t(), t(), t(), t(),
        n, mixtures, iterations, /* packed scales */ true, tiles, /* contiguous Φ */ true,
        /* the streams' gradient so far, the block input's */ true, true,
        /* given product */ false,
        /* ε_in, depth factor, Sinkhorn-Knopp's ε */ epsilon, kernel_constant(2.0), epsilon,
        /* the row scale */ numerator, offset,
        F32,
    );
    out.push(target.compile("normalised_backward", &case, backward, tiles.threads, cubes)?);

    // HC: rows of `width`, `n` mixing columns and one view column, `tanh`.
    let columns = n + 1;
    let views = columns - n;
    let case = format!("HC, {tokens} tokens of {n} × {width}, f32");
    let [numerator, offset, floor] = [(width as f64).sqrt(), 0.0, 1e-12].map(kernel_constant);
    let (tokens_per_cube, threads) = gated_forward_shape(hardware, 4, n, columns, gated_rows);
    #[rustfmt::skip]
    let forward = GatedForwardKernel::new(
        target.settings(threads), target.device(), target.runtime(),
        t(), t(), t(), t(), t(), t(), t(), t(), t(), t(), t(),
        columns, n, threads, tokens_per_cube, /* tanh */ true,
        gated_weights == GatedWeights::Staged,
        /* the row scale */ numerator, offset, floor,
        F32,
    );
    let cubes = tokens.div_ceil(tokens_per_cube);
    out.push(target.compile("gated_forward", &case, forward, threads, cubes)?);
    let threads = gated_backward_threads(hardware, 4, columns, views, gated_rows);
    #[rustfmt::skip]
    let backward = GatedBackwardKernel::new(
        target.settings(threads), target.device(), target.runtime(),
        t(), t(), t(), t(), t(), t(), t(), t(), t(), t(), t(), t(), t(), t(), t(),
        columns, n, threads, gated_rows, /* tanh */ true,
        /* the streams' gradient so far */ true, /* the block input's views */ views,
        gated_weights == GatedWeights::Staged,
        /* the row scale */ numerator, offset, floor,
        F32,
    );
    let cubes = (tokens * n).div_ceil(gated_rows);
    out.push(target.compile("gated_backward", &case, backward, threads, cubes)?);
    Ok(out)
}
