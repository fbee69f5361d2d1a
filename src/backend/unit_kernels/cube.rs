//! The unit kernels on the CubeCL backends (see the parent module for the math).

use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;

use super::UnitKernelsBackend;
use crate::backend::cube_launch::{
    Cube, RowTiles, empty, float_types, per_element, per_item, rows_and_width, threads_for,
    weights_product,
};
use crate::backend::kernel_constant;
use kernels::{
    mix_backward_kernel, mix_forward_kernel, projection_backward_kernel, projection_forward_kernel,
};

/// `tensor [..., w]` as contiguous rows `[R, w]`.
fn as_rows(tensor: FloatTensor<Cube>) -> FloatTensor<Cube> {
    let (count, width) = rows_and_width(&tensor);
    Cube::float_reshape(into_contiguous(tensor), Shape::new([count, width]))
}

/// Units per cube of the per-row kernels (at most).
const MOST_THREADS: usize = 64;

/// `W S (+ β h)`, `W` the rows `first..first + rows` of `weights`.
fn mix(
    weights: FloatTensor<Cube>,
    units: FloatTensor<Cube>,
    addend: Option<(BetaAt, FloatTensor<Cube>)>,
    [first, rows]: [usize; 2],
) -> FloatTensor<Cube> {
    let units = into_contiguous(units);
    let [tokens, count, width] = units.meta.shape().dims::<3>();
    let output = empty(&units, Shape::new([tokens, rows, width]));
    let with_addend = addend.is_some();
    let (beta, branch, beta_row) = addend_inputs(&weights, &units, &addend);
    let views = if with_addend {
        branch.meta.shape()[1]
    } else {
        1
    };
    let (count_cubes, dim) = per_element(&units, tokens * width);
    mix_forward_kernel::launch(
        &units.client,
        count_cubes,
        dim,
        weights.into_tensor_arg(),
        units.clone().into_tensor_arg(),
        beta.into_tensor_arg(),
        branch.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        first,
        rows,
        count,
        views,
        with_addend,
        beta_row,
        float_types(units.dtype),
    );
    output
}

/// Gradients of the weights and the units left by a later op of the layer, added to the
/// mixing's own.
#[derive(Default)]
struct Previous {
    weights: Option<FloatTensor<Cube>>,
    units: Option<FloatTensor<Cube>>,
}

/// Where a mixing's `β` is: a tensor of its own `[T | 1, rows, 1]`, or row `r` of the weights'
/// matrices (`β[t, u] = weights[t, r, u]`).
// One per mixing, moved along: the size of a tensor handle is no cost here.
#[allow(clippy::large_enum_variant)]
enum BetaAt {
    Own(FloatTensor<Cube>),
    Row(usize),
}

/// What the mixing kernels read for the addend: `β`'s tensor, the branch (contiguous), and the
/// weights' row holding `β` (`usize::MAX` where `β` has a tensor of its own, or there is no
/// addend). Where the kernel reads no `β` tensor (or no addend), `weights` and `units` stand in.
fn addend_inputs(
    weights: &FloatTensor<Cube>,
    units: &FloatTensor<Cube>,
    addend: &Option<(BetaAt, FloatTensor<Cube>)>,
) -> (FloatTensor<Cube>, FloatTensor<Cube>, usize) {
    match addend {
        Some((BetaAt::Own(beta), branch)) => {
            (beta.clone(), into_contiguous(branch.clone()), usize::MAX)
        }
        Some((BetaAt::Row(row), branch)) => {
            (weights.clone(), into_contiguous(branch.clone()), *row)
        }
        None => (weights.clone(), units.clone(), usize::MAX),
    }
}

/// `(∂W, ∂S, ∂β, ∂h)`; the last two only with an addend. `∂W` has every row of `weights`,
/// zero outside `first..first + rows`.
#[allow(clippy::type_complexity)]
fn mix_backward(
    weights: FloatTensor<Cube>,
    units: FloatTensor<Cube>,
    addend: Option<(BetaAt, FloatTensor<Cube>)>,
    grad: FloatTensor<Cube>,
    previous: Previous,
    [first, rows]: [usize; 2],
) -> (
    FloatTensor<Cube>,
    FloatTensor<Cube>,
    Option<(FloatTensor<Cube>, FloatTensor<Cube>)>,
) {
    let units = into_contiguous(units);
    let grad = into_contiguous(grad);
    let [tokens, count, width] = units.meta.shape().dims::<3>();
    let all_rows = weights.meta.shape()[1];
    let shared_weights = weights.meta.shape()[0] == 1;
    let with_addend = addend.is_some();
    let (beta, branch, beta_row) = addend_inputs(&weights, &units, &addend);
    let own_beta = with_addend && beta_row == usize::MAX;
    let shared_beta = own_beta && beta.meta.shape()[0] == 1;
    let views = if with_addend {
        branch.meta.shape()[1]
    } else {
        1
    };
    let grad_units = empty(&units, Shape::new([tokens, count, width]));
    let grad_weights = empty(&units, Shape::new([tokens, all_rows, count]));
    let (grad_beta, grad_branch) = if with_addend {
        (
            empty(
                &units,
                Shape::new([if own_beta { tokens } else { 1 }, rows, 1]),
            ),
            empty(&units, Shape::new([tokens, views, width])),
        )
    } else {
        (
            empty(&units, Shape::new([1])),
            empty(&units, Shape::new([1])),
        )
    };
    let with_previous = [previous.weights.is_some(), previous.units.is_some()];
    // Without them the kernel reads no previous gradients: `grad` stands in.
    let previous_weights = previous
        .weights
        .map_or_else(|| grad.clone(), into_contiguous);
    let previous_units = previous.units.map_or_else(|| grad.clone(), into_contiguous);
    let slots = rows * count + if with_addend { rows } else { 0 };
    let threads = threads_for(&units, slots, MOST_THREADS);
    let (cubes, dim) = per_item(&units, tokens, threads);
    mix_backward_kernel::launch(
        &units.client,
        cubes,
        dim,
        weights.into_tensor_arg(),
        units.clone().into_tensor_arg(),
        beta.into_tensor_arg(),
        branch.into_tensor_arg(),
        grad.into_tensor_arg(),
        grad_weights.clone().into_tensor_arg(),
        grad_units.clone().into_tensor_arg(),
        grad_beta.clone().into_tensor_arg(),
        grad_branch.clone().into_tensor_arg(),
        previous_weights.into_tensor_arg(),
        previous_units.into_tensor_arg(),
        first,
        rows,
        count,
        views,
        with_addend,
        beta_row,
        with_previous[0],
        with_previous[1],
        threads,
        float_types(units.dtype),
    );
    // Connections shared by every token: their gradient is the sum over the tokens.
    let grad_weights = if shared_weights {
        Cube::float_sum_dim(grad_weights, 0)
    } else {
        grad_weights
    };
    let addend = with_addend.then(|| {
        let grad_beta = if shared_beta {
            Cube::float_sum_dim(grad_beta, 0)
        } else {
            grad_beta
        };
        (grad_beta, grad_branch)
    });
    (grad_weights, grad_units, addend)
}

impl UnitKernelsBackend for CubeBackend {
    fn unit_projection(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        numerator: f64,
        offset: f64,
        floor: f64,
        root_offset: f64,
    ) -> FloatTensor<Self> {
        let rows = as_rows(rows);
        let [count, _] = rows.meta.shape().dims::<2>();
        let columns = weights.meta.shape()[1];
        let output = empty(&rows, Shape::new([count, columns]));
        let tiles = RowTiles::new(&rows, columns, columns + 1, 0);
        let (cubes, dim) = tiles.launch(&rows, count);
        let contiguous_weights = weights.is_contiguous();
        projection_forward_kernel::launch(
            &rows.client,
            cubes,
            dim,
            rows.clone().into_tensor_arg(),
            weights.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            columns,
            tiles,
            contiguous_weights,
            kernel_constant(numerator),
            kernel_constant(offset),
            kernel_constant(floor),
            kernel_constant(root_offset),
            float_types(rows.dtype),
        );
        output
    }

    fn unit_projection_backward(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        projection: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        previous: FloatTensor<Self>,
        with_previous: bool,
        numerator: f64,
        offset: f64,
        floor: f64,
        root_offset: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let shape = rows.meta.shape().clone();
        let rows = as_rows(rows);
        let previous = if with_previous {
            as_rows(previous)
        } else {
            rows.clone()
        };
        let projection = into_contiguous(projection);
        let grad = into_contiguous(grad);
        let [count, width] = rows.meta.shape().dims::<2>();
        let columns = weights.meta.shape()[1];
        let grad_rows = empty(&rows, Shape::new([count, width]));
        let scaled_grad = empty(&rows, Shape::new([count, columns]));
        let tiles = RowTiles::new(&rows, columns, 1, 0);
        let (cubes, dim) = tiles.launch(&rows, count);
        let contiguous_weights = weights.is_contiguous();
        projection_backward_kernel::launch(
            &rows.client,
            cubes,
            dim,
            rows.clone().into_tensor_arg(),
            weights.into_tensor_arg(),
            projection.into_tensor_arg(),
            grad.into_tensor_arg(),
            previous.into_tensor_arg(),
            grad_rows.clone().into_tensor_arg(),
            scaled_grad.clone().into_tensor_arg(),
            columns,
            tiles,
            contiguous_weights,
            with_previous,
            kernel_constant(numerator),
            kernel_constant(offset),
            kernel_constant(floor),
            kernel_constant(root_offset),
            float_types(rows.dtype),
        );
        let grad_weights = weights_product(rows, scaled_grad);
        (Self::float_reshape(grad_rows, shape), grad_weights)
    }

    fn unit_mix(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        first: usize,
        rows: usize,
        _slot: u64,
    ) -> FloatTensor<Self> {
        mix(weights, units, None, [first, rows])
    }

    fn unit_mix_add(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        first: usize,
        rows: usize,
    ) -> FloatTensor<Self> {
        mix(
            weights,
            units,
            Some((BetaAt::Own(beta), branch)),
            [first, rows],
        )
    }

    fn unit_mix_add_inline(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        first: usize,
        rows: usize,
        beta_row: usize,
        _slot: u64,
    ) -> FloatTensor<Self> {
        mix(
            weights,
            units,
            Some((BetaAt::Row(beta_row), branch)),
            [first, rows],
        )
    }

    fn unit_mix_add_inline_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        first: usize,
        rows: usize,
        beta_row: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (grad_weights, grad_units, addend) = mix_backward(
            weights,
            units,
            Some((BetaAt::Row(beta_row), branch)),
            grad,
            Previous::default(),
            [first, rows],
        );
        let (_, grad_branch) = addend.expect("asked with an addend");
        (grad_weights, grad_units, grad_branch)
    }

    fn unit_mix_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        previous_weights: FloatTensor<Self>,
        previous_units: FloatTensor<Self>,
        first: usize,
        rows: usize,
        with_previous_weights: bool,
        with_previous_units: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let previous = Previous {
            weights: with_previous_weights.then_some(previous_weights),
            units: with_previous_units.then_some(previous_units),
        };
        let (grad_weights, grad_units, _) =
            mix_backward(weights, units, None, grad, previous, [first, rows]);
        (grad_weights, grad_units)
    }

    fn unit_mix_add_backward(
        weights: FloatTensor<Self>,
        units: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        first: usize,
        rows: usize,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let (grad_weights, grad_units, addend) = mix_backward(
            weights,
            units,
            Some((BetaAt::Own(beta), branch)),
            grad,
            Previous::default(),
            [first, rows],
        );
        let (grad_beta, grad_branch) = addend.expect("asked with an addend");
        (grad_weights, grad_units, grad_beta, grad_branch)
    }
}

mod kernels {
    use cubecl::prelude::*;

    use crate::backend::cube_launch::RowTiles;
    use crate::backend::cube_launch::kernels::{
        row_root, row_scale, row_slope, row_squares, sum_over_cube, tiled_projection,
        tiled_row_gradient,
    };

    /// One cube per `threads / group` rows (see [`RowTiles`]): `s(‖x‖) · x W`.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn projection_forward_kernel<E: Float, A: Float>(
        rows: &Tensor<E>,
        weights: &Tensor<E>,
        output: &mut Tensor<E>,
        #[comptime] columns: usize,
        #[comptime] tiles: RowTiles,
        #[comptime] contiguous_weights: bool,
        #[comptime] numerator_bits: u32,
        #[comptime] offset_bits: u32,
        #[comptime] floor_bits: u32,
        #[comptime] root_offset_bits: u32,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let rows_per_cube = comptime!(tiles.rows_per_cube());
        let group = comptime!(tiles.group);
        let first = CUBE_POS * rows_per_cube;
        if first >= rows.shape(0) {
            terminate!();
        }
        let unit = UNIT_POS as usize;
        let mut shared = Shared::<[A]>::new_slice(comptime!(tiles.shared));
        tiled_projection::<E, A>(
            rows,
            weights,
            first,
            &mut shared,
            columns,
            tiles,
            contiguous_weights,
        );
        let row = first + unit / group;
        if row < rows.shape(0) {
            let at = (unit / group) * comptime!(group * (columns + 1));
            let root = row_root::<A>(shared[at + columns], root_offset_bits);
            let scale = row_scale::<A>(root, numerator_bits, offset_bits, floor_bits);
            let mut c = unit % group;
            while c < columns {
                output[row * columns + c] = E::cast_from(shared[at + c] * scale);
                c += group;
            }
        }
    }

    /// The forward's cubes: `‖x‖²` per row, then `∂x = s W ∂P + s'(n)/n (x W · ∂P) x` (plus
    /// `previous`, where `with_previous`) in a pass over the weight tiles, and `s ∂P` for the
    /// weights' product.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn projection_backward_kernel<E: Float, A: Float>(
        rows: &Tensor<E>,
        weights: &Tensor<E>,
        projection: &Tensor<E>,
        grad: &Tensor<E>,
        previous: &Tensor<E>,
        grad_rows: &mut Tensor<E>,
        scaled_grad: &mut Tensor<E>,
        #[comptime] columns: usize,
        #[comptime] tiles: RowTiles,
        #[comptime] contiguous_weights: bool,
        #[comptime] with_previous: bool,
        #[comptime] numerator_bits: u32,
        #[comptime] offset_bits: u32,
        #[comptime] floor_bits: u32,
        #[comptime] root_offset_bits: u32,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let rows_per_cube = comptime!(tiles.rows_per_cube());
        let group = comptime!(tiles.group);
        let first = CUBE_POS * rows_per_cube;
        if first >= rows.shape(0) {
            terminate!();
        }
        let unit = UNIT_POS as usize;
        let mut shared = Shared::<[A]>::new_slice(comptime!(tiles.shared));
        let squares = row_squares::<E, A>(rows, first, &mut shared, tiles);
        let row = first + unit / group;
        let live = row < rows.shape(0);
        let root = row_root::<A>(squares, root_offset_bits);
        let scale = row_scale::<A>(root, numerator_bits, offset_bits, floor_bits);
        let slope = row_slope::<A>(root, scale, offset_bits, floor_bits);
        // (x W · ∂P) with x W = P / s.
        let mut upstream = Array::<A>::new(columns);
        let mut dot = A::new(0.0);
        if live {
            #[unroll]
            for c in 0..columns {
                let g = A::cast_from(grad[row * columns + c]);
                upstream[c] = g;
                dot += A::cast_from(projection[row * columns + c]) * g;
            }
        }
        let along = slope * dot / scale;
        let no_gains = Array::<A>::new(1usize);
        tiled_row_gradient::<E, A>(
            rows,
            weights,
            previous,
            rows,
            grad_rows,
            first,
            &mut shared,
            &upstream,
            scale,
            along,
            &no_gains,
            columns,
            0usize,
            with_previous,
            tiles,
            contiguous_weights,
        );
        if live {
            let mut c = unit % group;
            while c < columns {
                scaled_grad[row * columns + c] = E::cast_from(upstream[c] * scale);
                c += group;
            }
        }
    }

    /// The offset of `tensor[a, b, 0]`, the leading axis broadcast where it is 1.
    #[cube]
    fn leading_offset<E: Float>(tensor: &Tensor<E>, a: usize, b: usize) -> usize {
        let mut offset = b * tensor.stride(1);
        if tensor.shape(0) != 1 {
            offset += a * tensor.stride(0);
        }
        offset
    }

    /// `previous[at]`, or 0 without a previous gradient.
    #[cube]
    fn previous_entry<E: Float>(previous: &Tensor<E>, at: usize, #[comptime] with: bool) -> E {
        if comptime!(with) {
            previous[at]
        } else {
            E::new(0.0)
        }
    }

    /// `total + previous[at]` (or `total` without a previous gradient), rounded once to `E`.
    #[cube]
    fn plus_previous<E: Float, A: Float>(
        total: A,
        previous: &Tensor<E>,
        at: usize,
        #[comptime] with: bool,
    ) -> E {
        E::cast_from(total + A::cast_from(previous_entry::<E>(previous, at, with)))
    }

    /// `β[t, r]`: from `beta [T | 1, R, 1]`, or from row `beta_row` of `weights` (unless it is
    /// `usize::MAX`).
    #[cube]
    fn gain_of<E: Float>(
        weights: &Tensor<E>,
        beta: &Tensor<E>,
        t: usize,
        r: usize,
        #[comptime] beta_row: usize,
    ) -> E {
        if comptime!(beta_row == usize::MAX) {
            beta[leading_offset::<E>(beta, t, r)]
        } else {
            weights[leading_offset::<E>(weights, t, beta_row) + r * weights.stride(2)]
        }
    }

    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mix_forward_kernel<E: Float, A: Float>(
        weights: &Tensor<E>,
        units: &Tensor<E>,
        beta: &Tensor<E>,
        branch: &Tensor<E>,
        output: &mut Tensor<E>,
        #[comptime] first: usize,
        #[comptime] rows: usize,
        #[comptime] count: usize,
        #[comptime] views: usize,
        #[comptime] with_addend: bool,
        #[comptime] beta_row: usize,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        // One unit per token and entry `j`, for every output row: each unit reads its `count`
        // inputs (and the branch's views) once, not once per row.
        let position = ABSOLUTE_POS;
        let width = units.shape(2);
        if position >= units.shape(0) * width {
            terminate!();
        }
        let j = position % width;
        let t = position / width;
        let mut values = Array::<E>::new(count);
        #[unroll]
        for u in 0..count {
            values[u] = units[(t * count + u) * width + j];
        }
        let mut branches = Array::<E>::new(views);
        if comptime!(with_addend) {
            #[unroll]
            for f in 0..views {
                branches[f] = branch[(t * views + f) * width + j];
            }
        }
        let across = weights.stride(2);
        #[unroll]
        for r in 0..rows {
            let base = leading_offset::<E>(weights, t, first + r);
            let mut total = A::new(0.0);
            #[unroll]
            for u in 0..count {
                total += A::cast_from(weights[base + u * across]) * A::cast_from(values[u]);
            }
            if comptime!(with_addend) {
                let gain = gain_of::<E>(weights, beta, t, r, beta_row);
                total += A::cast_from(gain) * A::cast_from(branches[r % views]);
            }
            output[(t * rows + r) * width + j] = E::cast_from(total);
        }
    }

    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mix_backward_kernel<E: Float, A: Float>(
        weights: &Tensor<E>,
        units: &Tensor<E>,
        beta: &Tensor<E>,
        branch: &Tensor<E>,
        grad: &Tensor<E>,
        grad_weights: &mut Tensor<E>,
        grad_units: &mut Tensor<E>,
        grad_beta: &mut Tensor<E>,
        grad_branch: &mut Tensor<E>,
        previous_weights: &Tensor<E>,
        previous_units: &Tensor<E>,
        #[comptime] first: usize,
        #[comptime] rows: usize,
        #[comptime] count: usize,
        #[comptime] views: usize,
        #[comptime] with_addend: bool,
        #[comptime] beta_row: usize,
        #[comptime] with_previous_weights: bool,
        #[comptime] with_previous_units: bool,
        #[comptime] threads: usize,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let t = CUBE_POS;
        if t >= units.shape(0) {
            terminate!();
        }
        let width = units.shape(2);
        let unit = UNIT_POS as usize;
        let mixed = comptime!(rows * count);
        let slots = comptime!(if with_addend {
            rows * count + rows
        } else {
            rows * count
        });
        // This token's connections, in registers.
        let mut mixing = Array::<E>::new(mixed);
        for r in 0..rows {
            let base = leading_offset::<E>(weights, t, first + r);
            for u in 0..count {
                mixing[r * count + u] = weights[base + u * weights.stride(2)];
            }
        }
        let mut gains = Array::<E>::new(rows);
        if comptime!(with_addend) {
            for r in 0..rows {
                gains[r] = gain_of::<E>(weights, beta, t, r, beta_row);
            }
        }
        let mut partial = Array::<A>::new(slots);
        for k in 0..slots {
            partial[k] = A::new(0.0);
        }
        let mut upstream = Array::<A>::new(rows);
        let mut j = unit;
        while j < width {
            for r in 0..rows {
                upstream[r] = A::cast_from(grad[(t * rows + r) * width + j]);
            }
            for u in 0..count {
                let at = (t * count + u) * width + j;
                let value = A::cast_from(units[at]);
                let mut total = A::new(0.0);
                for r in 0..rows {
                    total += A::cast_from(mixing[r * count + u]) * upstream[r];
                    partial[r * count + u] += upstream[r] * value;
                }
                if comptime!(with_previous_units) {
                    total += A::cast_from(previous_units[at]);
                }
                grad_units[at] = E::cast_from(total);
            }
            if comptime!(with_addend) {
                for f in 0..views {
                    let at = (t * views + f) * width + j;
                    let value = A::cast_from(branch[at]);
                    let mut total = A::new(0.0);
                    for r in 0..rows {
                        if r % views == f {
                            total += A::cast_from(gains[r]) * upstream[r];
                            partial[mixed + r] += upstream[r] * value;
                        }
                    }
                    grad_branch[at] = E::cast_from(total);
                }
            }
            j += threads;
        }
        let mut shared = Shared::<[A]>::new_slice(comptime!(threads * slots));
        for k in 0..slots {
            shared[unit * slots + k] = partial[k];
        }
        sync_cube();
        sum_over_cube::<A>(&mut shared, slots);
        // ∂W has every row of `weights`: this token's rows other than those read (and `β`'s)
        // get the previous gradient, or zero.
        let all_rows = weights.shape(1);
        let token_base = t * all_rows * count;
        let mut k = unit;
        while k < all_rows * count {
            let row = k / count;
            let mut zero = row < first || row >= first + rows;
            if comptime!(beta_row != usize::MAX) {
                zero = zero && row != beta_row;
            }
            if zero {
                grad_weights[token_base + k] =
                    previous_entry::<E>(previous_weights, token_base + k, with_previous_weights);
            }
            k += threads;
        }
        k = unit;
        while k < slots {
            if k < mixed {
                let at = token_base + first * count + k;
                grad_weights[at] =
                    plus_previous::<E, A>(shared[k], previous_weights, at, with_previous_weights);
            } else if comptime!(beta_row == usize::MAX) {
                grad_beta[t * rows + k - mixed] = E::cast_from(shared[k]);
            } else {
                let at = token_base + beta_row * count + k - mixed;
                grad_weights[at] =
                    plus_previous::<E, A>(shared[k], previous_weights, at, with_previous_weights);
            }
            k += threads;
        }
    }
}
