//! The history mix on the CubeCL backends: one kernel per mix forward and one backward, whatever
//! the number of states, because every state lives in one buffer (see the parent module).

use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::{CubeCount, CubeDim};

use super::{History, HistoryMixBackend, Records, Wanted};
use crate::backend::autodiff::cast_to;
use crate::backend::cube_launch::{
    Cube, column_sums, empty, empty_partials, float_types, grid_stride, per_element, row_prefix,
    summing_dtype,
};
use kernels::{backward_kernel, forward_kernel};

/// What the CubeCL ops keep of a history: buffers of its capacity, allocated by its first mix.
pub(super) struct Storage {
    /// State `n` in row `n` of `[capacity, len]`, written by the mix that pushes it.
    states: CubeTensor,
    /// The weights, packed (`W_g` in row `g` of `[segments, row]`), written by the mixes that
    /// take them: what the backward reads the later mixes' weights from.
    weights: CubeTensor,
    /// `∂m_t` in row `t`, written by mix `t`'s backward where an earlier state's backward reads
    /// it (its mix has earlier states).
    grads: Option<CubeTensor>,
    /// Which rows of `grads` hold a gradient of this backward pass.
    stored: Vec<bool>,
    /// `[cubes, segments · row]` partial inner products `⟨x_s, ∂m_t⟩` at their weights'
    /// packed positions, zero elsewhere.
    partials: Option<CubeTensor>,
}

fn upload(like: &CubeTensor, values: &[u32]) -> CubeTensor {
    let handle = like.client.create_from_slice(bytemuck::cast_slice(values));
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::new([values.len()]),
        handle,
        DType::U32,
    )
}

/// `weights` in `dtype` (the states'), where a model keeps its parameters in another.
fn weights_as(weights: CubeTensor, dtype: DType) -> CubeTensor {
    cast_to::<Cube>(into_contiguous(weights), dtype)
}

fn forward(
    records: &mut Records,
    mix: usize,
    weights: CubeTensor,
    newest: CubeTensor,
) -> CubeTensor {
    let newest = into_contiguous(newest);
    let len = newest.meta.shape().num_elements();
    let capacity = records.capacity;
    let [segments, row] = records.packed_layout(newest.dtype);
    let storage = records.cube.get_or_insert_with(|| Storage {
        states: empty(&newest, Shape::new([capacity, len])),
        weights: empty(&newest, Shape::new([segments * row])),
        grads: None,
        stored: vec![false; capacity],
        partials: None,
    });
    assert_eq!(
        storage.states.meta.shape()[1],
        len,
        "history mix: state shapes"
    );
    let plan = &records.mixes[mix];
    // [slot and position of every earlier state…, the newest's position, the row of W_g]
    let mut table: Vec<u32> = Vec::with_capacity(2 * plan.states.len() + 1);
    let earlier = plan.states.len() - 1;
    for (&state, &position) in plan.states[..earlier].iter().zip(&plan.positions) {
        table.extend([state as u32, position as u32]);
    }
    table.push(plan.positions[earlier] as u32);
    table.push((plan.segment * row) as u32);
    let table = upload(&newest, &table);
    let weights = weights_as(weights, newest.dtype);
    let output = empty(&newest, newest.meta.shape().clone());
    // Enough units for the copy of W_g too.
    let units = len.max(weights.meta.shape().num_elements());
    let (cubes, dim) = per_element(&newest, units);
    forward_kernel::launch(
        &newest.client,
        cubes,
        dim,
        storage.states.clone().into_tensor_arg(),
        storage.weights.clone().into_tensor_arg(),
        newest.clone().into_tensor_arg(),
        weights.into_tensor_arg(),
        table.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        mix,
        earlier,
        float_types(newest.dtype),
    );
    output
}

fn backward(
    records: &mut Records,
    mix: usize,
    grad: CubeTensor,
    wanted: Wanted,
) -> (CubeTensor, CubeTensor) {
    let (weights_wanted, newest_wanted) = (wanted.weights, wanted.newest);
    let grad = into_contiguous(grad);
    let len = grad.meta.shape().num_elements();
    let capacity = records.capacity;
    let [segments, row] = records.packed_layout(grad.dtype);
    let weight_count = segments * row;
    // Packed positions: [own, then slot and position of each later mix over this one's newest
    // state, then of each orphan state of this mix]
    let packed = |t: usize, position: usize| records.packed_position(t, position, row) as u32;
    let own = *records.mixes[mix]
        .positions
        .last()
        .expect("a mix has a state");
    let mut table = vec![packed(mix, own)];
    let stored = &records
        .cube
        .as_ref()
        .expect("the forward allocated the history")
        .stored;
    let later_mixes = records.mixes.iter().enumerate().skip(mix + 1);
    for (t, plan) in later_mixes.filter(|&(t, _)| stored[t]) {
        if let Some(term) = plan.states.iter().position(|&s| s == mix) {
            table.extend([t as u32, packed(t, plan.positions[term])]);
        }
    }
    let later = (table.len() - 1) / 2;
    let orphans = if weights_wanted {
        let before = table.len();
        for (state, position) in records.mixes[mix].orphans(&records.mixes) {
            table.extend([state as u32, packed(mix, position)]);
        }
        (table.len() - before) / 2
    } else {
        0
    };
    let Records { mixes, cube, .. } = records;
    let storage = cube.as_mut().expect("the forward allocated the history");
    let table = upload(&grad, &table);
    // An earlier state's backward reads this ∂m.
    let store = mixes[mix].states.len() > 1;
    if store && storage.grads.is_none() {
        storage.grads = Some(empty(&grad, Shape::new([capacity, len])));
    }
    storage.stored[mix] = store;
    let (threads, cubes) = grid_stride(&grad, len, 1 + later + orphans);
    if weights_wanted && storage.partials.is_none() {
        let shape = Shape::new([cubes, weight_count]);
        let dtype = summing_dtype(grad.dtype).into();
        storage.partials = Some(Cube::float_zeros(shape, &grad.device, dtype));
    }
    let placeholder = || empty(&grad, Shape::new([1]));
    let grad_newest = if newest_wanted {
        empty(&grad, grad.meta.shape().clone())
    } else {
        placeholder()
    };
    let grads = storage.grads.clone().unwrap_or_else(placeholder);
    let partials =
        (storage.partials.clone()).unwrap_or_else(|| empty_partials(&grad, Shape::new([1])));
    backward_kernel::launch(
        &grad.client,
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(threads as u32),
        storage.states.clone().into_tensor_arg(),
        grads.into_tensor_arg(),
        grad.clone().into_tensor_arg(),
        storage.weights.clone().into_tensor_arg(),
        table.into_tensor_arg(),
        grad_newest.clone().into_tensor_arg(),
        partials.clone().into_tensor_arg(),
        mix,
        later,
        orphans,
        store,
        newest_wanted,
        weights_wanted,
        threads,
        float_types(grad.dtype),
    );
    // The first tracked mix's backward is the last to run: the partial sums are complete.
    let grad_weights = if wanted.hand_over {
        let sums = column_sums(partials, grad.dtype);
        CubeTensor::new_contiguous(
            sums.client,
            sums.device,
            Shape::new([segments, row]),
            sums.handle,
            sums.dtype,
        )
    } else {
        empty(&grad, Shape::new([1]))
    };
    (grad_weights, grad_newest)
}

impl HistoryMixBackend for Cube {
    fn history_mix(
        history: History,
        mix: usize,
        weights: CubeTensor,
        newest: CubeTensor,
    ) -> CubeTensor {
        forward(&mut history.lock(), mix, weights, newest)
    }

    fn history_mix_backward(
        history: History,
        mix: usize,
        grad: CubeTensor,
        wanted: Wanted,
    ) -> (CubeTensor, CubeTensor) {
        backward(&mut history.lock(), mix, grad, wanted)
    }

    fn history_weight_segment(history: History, packed: CubeTensor, segment: usize) -> CubeTensor {
        let length = history.lock().segments[segment].length;
        row_prefix(packed, segment, length)
    }
}

mod kernels {
    use cubecl::prelude::*;

    use crate::backend::cube_launch::kernels::sum_over_cube;

    /// `m = Σ_j W[k_j] states[s_j] + W[k_n] x_n`, `states[slot] = x_n` and `W` copied to its
    /// packed row; one unit per element (and per weight). `table`: `[s_0, k_0, s_1, k_1, …,
    /// k_n, packed row offset]`.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_kernel<E: Float, A: Float>(
        states: &mut Tensor<E>,
        packed: &mut Tensor<E>,
        newest: &Tensor<E>,
        weights: &Tensor<E>,
        table: &Tensor<u32>,
        output: &mut Tensor<E>,
        #[comptime] slot: usize,
        #[comptime] earlier: usize,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let i = ABSOLUTE_POS;
        let len = newest.len();
        if i < weights.len() {
            packed[table[comptime!(2 * earlier + 1)] as usize + i] = weights[i];
        }
        if i >= len {
            terminate!();
        }
        let x = newest[i];
        let mut total =
            A::cast_from(weights[table[comptime!(2 * earlier)] as usize]) * A::cast_from(x);
        for j in 0..earlier {
            let state = table[2 * j] as usize;
            total += A::cast_from(weights[table[2 * j + 1] as usize])
                * A::cast_from(states[state * len + i]);
        }
        states[slot * len + i] = x;
        output[i] = E::cast_from(total);
    }

    /// For the newest state `x_n` of mix `t = slot` and the mixes `t'` over it (`∂m_t` in
    /// `grad`, the later ones in rows of `grads`): `∂x_n = Σ W[k(t', n)] ∂m_t'` and, per cube,
    /// `partials[cube, k(t', n)] += ⟨x_n, ∂m_t'⟩` over the cube's elements; `grads[slot] = ∂m_t`
    /// where `store`; and for each orphan state `x_o` of the mix, `⟨x_o, ∂m_t⟩` likewise.
    /// `table`: `[k(t, n), t'_1, k(t'_1, n), …, o_1, k(t, o_1), …]`. A grid-stride loop.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward_kernel<E: Float, A: Float>(
        states: &Tensor<E>,
        grads: &mut Tensor<E>,
        grad: &Tensor<E>,
        weights: &Tensor<E>,
        table: &Tensor<u32>,
        grad_newest: &mut Tensor<E>,
        partials: &mut Tensor<A>,
        #[comptime] slot: usize,
        #[comptime] later: usize,
        #[comptime] orphans: usize,
        #[comptime] store: bool,
        #[comptime] newest_wanted: bool,
        #[comptime] weights_wanted: bool,
        #[comptime] threads: usize,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let len = grad.len();
        let terms = comptime!(later + 1);
        let slots = comptime!(later + 1 + orphans);
        let mut gains = Array::<A>::new(terms);
        gains[0] = A::cast_from(weights[table[0] as usize]);
        for j in 0..later {
            gains[j + 1] = A::cast_from(weights[table[2 * j + 2] as usize]);
        }
        let mut dots = Array::<A>::new(slots);
        for j in 0..slots {
            dots[j] = A::new(0.0);
        }
        let stride = CUBE_COUNT * threads;
        let mut i = CUBE_POS * threads + UNIT_POS as usize;
        while i < len {
            let stored = grad[i];
            if comptime!(store) {
                grads[slot * len + i] = stored;
            }
            let own = A::cast_from(stored);
            let mut x = A::new(0.0);
            if comptime!(weights_wanted) {
                x = A::cast_from(states[slot * len + i]);
                dots[0] += x * own;
            }
            let mut total = gains[0] * own;
            for j in 0..later {
                let g = A::cast_from(grads[(table[2 * j + 1] as usize) * len + i]);
                total += gains[j + 1] * g;
                if comptime!(weights_wanted) {
                    dots[j + 1] += x * g;
                }
            }
            if comptime!(newest_wanted) {
                grad_newest[i] = E::cast_from(total);
            }
            for j in 0..orphans {
                let orphan = table[comptime!(2 * later + 1) + 2 * j] as usize;
                dots[terms + j] += A::cast_from(states[orphan * len + i]) * own;
            }
            i += stride;
        }
        if comptime!(weights_wanted) {
            let unit = UNIT_POS as usize;
            let mut shared = Shared::<[A]>::new_slice(comptime!(threads * slots));
            for j in 0..slots {
                shared[unit * slots + j] = dots[j];
            }
            sync_cube();
            sum_over_cube::<A>(&mut shared, slots);
            // One unit adds them: two terms may share a position. The cubes' sums stay in `A`
            // (`summing_dtype`) for `column_sums`, which rounds each total once.
            if unit == 0 {
                let row = CUBE_POS * partials.shape(1);
                partials[row + table[0] as usize] += shared[0];
                for j in 0..comptime!(later + orphans) {
                    partials[row + table[2 * j + 2] as usize] += shared[j + 1];
                }
            }
        }
    }
}
