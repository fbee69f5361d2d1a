//! The token mix on the CubeCL backends, a part of up to [`PART`] states at a time (see the
//! parent module): one kernel forward, one backward.

#[cfg(test)]
use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::tensor::FloatTensor;
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use super::{PART, TokenMixPartBackend};
use crate::backend::cube_launch::{
    empty, float_types, per_element, per_item, rows_and_width, threads_for,
};
use kernels::{part_backward_kernel, part_forward_kernel, single_backward_kernel};

/// Takes the one-slot backward kernel whatever the device binds (for the tests).
#[cfg(test)]
static ONE_SLOT: AtomicBool = AtomicBool::new(false);

/// Whether a test asked for the one-slot backward kernel; never outside the tests.
fn one_slot_forced() -> bool {
    #[cfg(test)]
    return ONE_SLOT.load(Ordering::Relaxed);
    #[cfg(not(test))]
    false
}

/// Backward launches so far (for the tests: that the kernels, not the composed form, ran).
#[cfg(test)]
pub(super) static BACKWARD_LAUNCHES: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// Makes the backward take the one-slot kernel (`true`) or choose by the device (`false`).
#[cfg(test)]
pub(super) fn one_slot_backward(on: bool) {
    ONE_SLOT.store(on, Ordering::Relaxed);
}

/// Units per cube of the backward kernel (at most): one cube per token row.
const MOST_THREADS: usize = 256;

/// Buffers the backward kernel binds: the weights, `∂m`, `∂W` and per slot its state, its
/// gradient so far and its own gradient (placeholders where unused).
const BACKWARD_BINDINGS: usize = 3 + 3 * PART;

impl TokenMixPartBackend for CubeBackend {
    fn token_mix_part(
        weights: FloatTensor<Self>,
        accumulator: FloatTensor<Self>,
        s0: FloatTensor<Self>,
        s1: FloatTensor<Self>,
        s2: FloatTensor<Self>,
        s3: FloatTensor<Self>,
        s4: FloatTensor<Self>,
        s5: FloatTensor<Self>,
        s6: FloatTensor<Self>,
        s7: FloatTensor<Self>,
        first: usize,
        count: usize,
        accumulate: bool,
    ) -> FloatTensor<Self> {
        let states: Vec<CubeTensor> = [s0, s1, s2, s3, s4, s5, s6, s7]
            .into_iter()
            .take(count)
            .map(into_contiguous)
            .collect();
        let weights = into_contiguous(weights);
        let (_, columns) = rows_and_width(&weights);
        let (_, width) = rows_and_width(&states[0]);
        let shape = states[0].meta.shape().clone();
        let len = shape.num_elements();
        let (cubes, dim) = per_element(&states[0], len);
        let output = empty(&states[0], shape);
        // The slots past `count`, and the sum when there is none: placeholders of their own,
        // unread.
        let placeholder = || empty(&states[0], Shape::new([1]));
        let slot = |k: usize| {
            states
                .get(k)
                .cloned()
                .unwrap_or_else(placeholder)
                .into_tensor_arg()
        };
        let previous = if accumulate {
            into_contiguous(accumulator)
        } else {
            placeholder()
        };
        part_forward_kernel::launch(
            &output.client,
            cubes,
            dim,
            weights.into_tensor_arg(),
            previous.into_tensor_arg(),
            slot(0),
            slot(1),
            slot(2),
            slot(3),
            slot(4),
            slot(5),
            slot(6),
            slot(7),
            output.clone().into_tensor_arg(),
            width,
            columns,
            first,
            count,
            accumulate,
            float_types(output.dtype),
        );
        output
    }

    fn token_mix_part_backward(
        weights: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        s0: FloatTensor<Self>,
        s1: FloatTensor<Self>,
        s2: FloatTensor<Self>,
        s3: FloatTensor<Self>,
        s4: FloatTensor<Self>,
        s5: FloatTensor<Self>,
        s6: FloatTensor<Self>,
        s7: FloatTensor<Self>,
        f0: FloatTensor<Self>,
        f1: FloatTensor<Self>,
        f2: FloatTensor<Self>,
        f3: FloatTensor<Self>,
        f4: FloatTensor<Self>,
        f5: FloatTensor<Self>,
        f6: FloatTensor<Self>,
        f7: FloatTensor<Self>,
        first: usize,
        count: usize,
        sofar: u32,
        wanted: u32,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let grad = into_contiguous(grad);
        let weights = into_contiguous(weights);
        let weight_shape = weights.meta.shape().clone();
        let (_, columns) = rows_and_width(&weights);
        let (tokens, width) = rows_and_width(&grad);
        let states: Vec<CubeTensor> = [s0, s1, s2, s3, s4, s5, s6, s7]
            .into_iter()
            .take(count)
            .map(into_contiguous)
            .collect();
        let has = |mask: u32, k: usize| mask >> k & 1 == 1;
        let sofar_mask = sofar;
        let sofar: Vec<CubeTensor> = [f0, f1, f2, f3, f4, f5, f6, f7]
            .into_iter()
            .take(count)
            .enumerate()
            .map(|(k, tensor)| {
                if has(sofar_mask, k) {
                    into_contiguous(tensor)
                } else {
                    // Unread: a buffer of its own rather than a second binding of another.
                    empty(&grad, Shape::new([1]))
                }
            })
            .collect();
        let state_grads: Vec<CubeTensor> = (0..PART)
            .map(|k| {
                if k < count && has(wanted, k) {
                    empty(&grad, grad.meta.shape().clone())
                } else {
                    empty(&grad, Shape::new([1]))
                }
            })
            .collect();
        let weight_grad = empty(&grad, weight_shape);
        #[cfg(test)]
        BACKWARD_LAUNCHES.fetch_add(1, Ordering::Relaxed);
        // One binding more for CubeCL's own metadata buffer.
        let binds_all = grad.client.properties().hardware.max_bindings as usize > BACKWARD_BINDINGS
            && !one_slot_forced();
        if binds_all {
            let threads = threads_for(&grad, count, MOST_THREADS);
            // One cube per token, spread over a second axis past the device's most per axis
            // (65535 on wgpu).
            let (cubes, dim) = per_item(&grad, tokens, threads);
            // The slots past `count`: placeholders of their own, unread.
            let placeholder = || empty(&grad, Shape::new([1]));
            let state = |k: usize| states.get(k).cloned().unwrap_or_else(placeholder);
            let so_far = |k: usize| sofar.get(k).cloned().unwrap_or_else(placeholder);
            let state = |k: usize| state(k).into_tensor_arg();
            let so_far = |k: usize| so_far(k).into_tensor_arg();
            let state_grad = |k: usize| state_grads[k].clone().into_tensor_arg();
            part_backward_kernel::launch(
                &grad.client,
                cubes.clone(),
                dim,
                weights.clone().into_tensor_arg(),
                grad.clone().into_tensor_arg(),
                state(0),
                state(1),
                state(2),
                state(3),
                state(4),
                state(5),
                state(6),
                state(7),
                so_far(0),
                so_far(1),
                so_far(2),
                so_far(3),
                so_far(4),
                so_far(5),
                so_far(6),
                so_far(7),
                state_grad(0),
                state_grad(1),
                state_grad(2),
                state_grad(3),
                state_grad(4),
                state_grad(5),
                state_grad(6),
                state_grad(7),
                weight_grad.clone().into_tensor_arg(),
                width,
                columns,
                first,
                first,
                first + count,
                sofar_mask,
                wanted,
                count,
                true,
                threads,
                float_types(grad.dtype),
            );
        } else {
            let threads = threads_for(&grad, 1, MOST_THREADS);
            let (cubes, dim) = per_item(&grad, tokens, threads);
            for k in 0..count {
                single_backward_kernel::launch(
                    &grad.client,
                    cubes.clone(),
                    dim,
                    weights.clone().into_tensor_arg(),
                    grad.clone().into_tensor_arg(),
                    states[k].clone().into_tensor_arg(),
                    sofar[k].clone().into_tensor_arg(),
                    state_grads[k].clone().into_tensor_arg(),
                    weight_grad.clone().into_tensor_arg(),
                    width,
                    columns,
                    first + k,
                    first,
                    first + count,
                    sofar_mask >> k,
                    wanted >> k,
                    k == 0,
                    threads,
                    float_types(grad.dtype),
                );
            }
        }
        let [g0, g1, g2, g3, g4, g5, g6, g7]: [CubeTensor; PART] =
            state_grads.try_into().expect("one per slot");
        (g0, g1, g2, g3, g4, g5, g6, g7, weight_grad)
    }
}

mod kernels {
    use cubecl::prelude::*;

    use crate::backend::cube_launch::kernels::sum_over_cube;

    /// `m[i] = (sum[i]) + Σ_{k < count} W[t, first + k] s_k[i]` (`t = i / width`), one unit per
    /// entry. (Eight tensor arguments rather than a sequence: CubeCL 0.11 has no sequence of
    /// tensors.)
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn part_forward_kernel<E: Float, A: Float>(
        weights: &Tensor<E>,
        sum: &Tensor<E>,
        s0: &Tensor<E>,
        s1: &Tensor<E>,
        s2: &Tensor<E>,
        s3: &Tensor<E>,
        s4: &Tensor<E>,
        s5: &Tensor<E>,
        s6: &Tensor<E>,
        s7: &Tensor<E>,
        output: &mut Tensor<E>,
        width: usize,
        columns: usize,
        first: usize,
        #[comptime] count: usize,
        #[comptime] with_sum: bool,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let i = ABSOLUTE_POS;
        if i >= output.len() {
            terminate!();
        }
        let row = (i / width) * columns + first;
        let mut total = A::new(0.0);
        if comptime!(with_sum) {
            total = A::cast_from(sum[i]);
        }
        if comptime!(count > 0) {
            total += A::cast_from(weights[row]) * A::cast_from(s0[i]);
        }
        if comptime!(count > 1) {
            total += A::cast_from(weights[row + 1]) * A::cast_from(s1[i]);
        }
        if comptime!(count > 2) {
            total += A::cast_from(weights[row + 2]) * A::cast_from(s2[i]);
        }
        if comptime!(count > 3) {
            total += A::cast_from(weights[row + 3]) * A::cast_from(s3[i]);
        }
        if comptime!(count > 4) {
            total += A::cast_from(weights[row + 4]) * A::cast_from(s4[i]);
        }
        if comptime!(count > 5) {
            total += A::cast_from(weights[row + 5]) * A::cast_from(s5[i]);
        }
        if comptime!(count > 6) {
            total += A::cast_from(weights[row + 6]) * A::cast_from(s6[i]);
        }
        if comptime!(count > 7) {
            total += A::cast_from(weights[row + 7]) * A::cast_from(s7[i]);
        }
        output[i] = E::cast_from(total);
    }

    /// One slot's entry `at` of the backward, `g = ∂m[at]`: writes `(f[at]) + factor · g` to
    /// `state_grad` where `bit` is set in the wanted mask (`f[at]` where it is set in the
    /// so-far mask; `masks = (sofar, wanted)`), and returns `g · state[at]`, the entry's term of
    /// `⟨∂m, x⟩`.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn slot<E: Float, A: Float>(
        g: E,
        at: usize,
        state: &Tensor<E>,
        sofar: &Tensor<E>,
        state_grad: &mut Tensor<E>,
        factor: E,
        #[comptime] bit: u32,
        masks: (u32, u32),
    ) -> A {
        let (sofar_mask, wanted_mask) = masks;
        if (wanted_mask & bit) != 0u32 {
            let mut value = factor * g;
            if (sofar_mask & bit) != 0u32 {
                value += sofar[at];
            }
            state_grad[at] = value;
        }
        A::cast_from(g) * A::cast_from(state[at])
    }

    /// Token row `t`'s `∂W`: the `count` partial inner products of each unit summed over the
    /// cube into columns `first ..`, and 0 in the columns outside `part_first .. part_end`
    /// where `zero_others`.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn weight_grad_row<E: Float, A: Float>(
        partial: &Array<A>,
        weight_grad: &mut Tensor<E>,
        t: usize,
        columns: usize,
        first: usize,
        part: (usize, usize),
        #[comptime] count: usize,
        #[comptime] zero_others: bool,
        #[comptime] threads: usize,
    ) {
        let unit = UNIT_POS as usize;
        let (part_first, part_end) = part;
        let mut shared = Shared::<[A]>::new_slice(comptime!(threads * count));
        #[unroll]
        for k in 0..count {
            shared[unit * count + k] = partial[k];
        }
        sync_cube();
        sum_over_cube::<A>(&mut shared, count);
        let mut c = unit;
        while c < columns {
            if c >= first && c < first + count {
                weight_grad[t * columns + c] = E::cast_from(shared[c - first]);
            } else if comptime!(zero_others) && (c < part_first || c >= part_end) {
                weight_grad[t * columns + c] = E::new(0.0);
            }
            c += threads;
        }
    }

    /// One cube per token row `t`: `∂W[t, first + k] = ⟨∂m[t], s_k[t]⟩` for `k < count` (and 0
    /// in the columns outside the part's `part_first .. part_end` where `zero_others`), and
    /// where bit `k` of `wanted_mask` is set, `g_k[t] = (f_k[t]) + W[t, first + k] ∂m[t]`
    /// (`f_k`, the gradient so far, where bit `k` of `sofar_mask` is set).
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn part_backward_kernel<E: Float, A: Float>(
        weights: &Tensor<E>,
        grad: &Tensor<E>,
        s0: &Tensor<E>,
        s1: &Tensor<E>,
        s2: &Tensor<E>,
        s3: &Tensor<E>,
        s4: &Tensor<E>,
        s5: &Tensor<E>,
        s6: &Tensor<E>,
        s7: &Tensor<E>,
        f0: &Tensor<E>,
        f1: &Tensor<E>,
        f2: &Tensor<E>,
        f3: &Tensor<E>,
        f4: &Tensor<E>,
        f5: &Tensor<E>,
        f6: &Tensor<E>,
        f7: &Tensor<E>,
        g0: &mut Tensor<E>,
        g1: &mut Tensor<E>,
        g2: &mut Tensor<E>,
        g3: &mut Tensor<E>,
        g4: &mut Tensor<E>,
        g5: &mut Tensor<E>,
        g6: &mut Tensor<E>,
        g7: &mut Tensor<E>,
        weight_grad: &mut Tensor<E>,
        width: usize,
        columns: usize,
        first: usize,
        part_first: usize,
        part_end: usize,
        sofar_mask: u32,
        wanted_mask: u32,
        #[comptime] count: usize,
        #[comptime] zero_others: bool,
        #[comptime] threads: usize,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let t = CUBE_POS;
        // A spread launch may have cubes past the last token.
        if t >= weights.len() / columns {
            terminate!();
        }
        let masks = (sofar_mask, wanted_mask);
        let mut partial = Array::<A>::new(count);
        let mut factor = Array::<E>::new(count);
        #[unroll]
        for k in 0..count {
            partial[k] = A::new(0.0);
            factor[k] = weights[t * columns + first + k];
        }
        let mut j = UNIT_POS as usize;
        while j < width {
            let at = t * width + j;
            let g = grad[at];
            if comptime!(count > 0) {
                partial[0] += slot::<E, A>(g, at, s0, f0, g0, factor[0], 1u32, masks);
            }
            if comptime!(count > 1) {
                partial[1] += slot::<E, A>(g, at, s1, f1, g1, factor[1], 2u32, masks);
            }
            if comptime!(count > 2) {
                partial[2] += slot::<E, A>(g, at, s2, f2, g2, factor[2], 4u32, masks);
            }
            if comptime!(count > 3) {
                partial[3] += slot::<E, A>(g, at, s3, f3, g3, factor[3], 8u32, masks);
            }
            if comptime!(count > 4) {
                partial[4] += slot::<E, A>(g, at, s4, f4, g4, factor[4], 16u32, masks);
            }
            if comptime!(count > 5) {
                partial[5] += slot::<E, A>(g, at, s5, f5, g5, factor[5], 32u32, masks);
            }
            if comptime!(count > 6) {
                partial[6] += slot::<E, A>(g, at, s6, f6, g6, factor[6], 64u32, masks);
            }
            if comptime!(count > 7) {
                partial[7] += slot::<E, A>(g, at, s7, f7, g7, factor[7], 128u32, masks);
            }
            j += threads;
        }
        let part = (part_first, part_end);
        weight_grad_row::<E, A>(
            &partial,
            weight_grad,
            t,
            columns,
            first,
            part,
            count,
            zero_others,
            threads,
        );
    }

    /// [`part_backward_kernel`] with one slot (`count = 1`): six bindings, for a device that
    /// binds fewer than the eight slots need.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn single_backward_kernel<E: Float, A: Float>(
        weights: &Tensor<E>,
        grad: &Tensor<E>,
        state: &Tensor<E>,
        sofar: &Tensor<E>,
        state_grad: &mut Tensor<E>,
        weight_grad: &mut Tensor<E>,
        width: usize,
        columns: usize,
        first: usize,
        part_first: usize,
        part_end: usize,
        sofar_mask: u32,
        wanted_mask: u32,
        #[comptime] zero_others: bool,
        #[comptime] threads: usize,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let t = CUBE_POS;
        if t >= weights.len() / columns {
            terminate!();
        }
        let masks = (sofar_mask, wanted_mask);
        let factor = weights[t * columns + first];
        let mut partial = Array::<A>::new(1usize);
        partial[0] = A::new(0.0);
        let mut j = UNIT_POS as usize;
        while j < width {
            let at = t * width + j;
            partial[0] += slot::<E, A>(grad[at], at, state, sofar, state_grad, factor, 1u32, masks);
            j += threads;
        }
        let part = (part_first, part_end);
        weight_grad_row::<E, A>(
            &partial,
            weight_grad,
            t,
            columns,
            first,
            part,
            1usize,
            zero_others,
            threads,
        );
    }
}
