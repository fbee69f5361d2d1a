//! The column gather on the CubeCL backends, a part of up to [`PART`] tables at a time (see the
//! parent module): one kernel forward, one backward.

#[cfg(test)]
use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use super::parts::{ColumnGatherBackend, PART};
use crate::backend::cube_launch::{empty, per_element, rows_and_width};
use kernels::{part_backward_kernel, part_forward_kernel, single_backward_kernel};

/// Buffers the backward kernel binds: `∂out`, and per slot a gradient so far and a gradient.
const BACKWARD_BINDINGS: usize = 1 + 2 * PART;

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

/// Makes the backward take the one-slot kernel (`true`) or choose by the device (`false`).
#[cfg(test)]
pub(super) fn one_slot_backward(on: bool) {
    ONE_SLOT.store(on, Ordering::Relaxed);
}

/// Backward launches so far (for the tests: that the kernels, not the composed form, ran).
#[cfg(test)]
pub(super) static BACKWARD_LAUNCHES: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

impl ColumnGatherBackend for CubeBackend {
    fn gather_part(
        previous: FloatTensor<Self>,
        t0: FloatTensor<Self>,
        t1: FloatTensor<Self>,
        t2: FloatTensor<Self>,
        t3: FloatTensor<Self>,
        t4: FloatTensor<Self>,
        t5: FloatTensor<Self>,
        t6: FloatTensor<Self>,
        t7: FloatTensor<Self>,
        column: usize,
        first: usize,
        count: usize,
        total: usize,
        with_previous: bool,
    ) -> FloatTensor<Self> {
        let tables: Vec<CubeTensor> = [t0, t1, t2, t3, t4, t5, t6, t7]
            .into_iter()
            .take(count)
            .map(into_contiguous)
            .collect();
        let like = &tables[0];
        let (_, width) = rows_and_width(like);
        let mut shape = like.meta.shape().clone();
        let last = shape.num_dims() - 1;
        shape.as_mut_slice()[last] = total;
        let output = empty(like, shape);
        let previous = if with_previous {
            into_contiguous(previous)
        } else {
            // Unread: a buffer of its own rather than a second binding of another.
            empty(like, Shape::new([1]))
        };
        let slot = |k: usize| {
            tables
                .get(k)
                .cloned()
                .unwrap_or_else(|| empty(like, Shape::new([1])))
                .into_tensor_arg()
        };
        let len = output.meta.shape().num_elements();
        let (cubes, dim) = per_element(like, len);
        part_forward_kernel::launch(
            &like.client,
            cubes,
            dim,
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
            column,
            first,
            total,
            count,
            with_previous,
            dtype_to_storage_type(like.dtype),
        );
        output
    }

    fn gather_part_backward(
        grad: FloatTensor<Self>,
        t0: FloatTensor<Self>,
        _t1: FloatTensor<Self>,
        _t2: FloatTensor<Self>,
        _t3: FloatTensor<Self>,
        _t4: FloatTensor<Self>,
        _t5: FloatTensor<Self>,
        _t6: FloatTensor<Self>,
        _t7: FloatTensor<Self>,
        f0: FloatTensor<Self>,
        f1: FloatTensor<Self>,
        f2: FloatTensor<Self>,
        f3: FloatTensor<Self>,
        f4: FloatTensor<Self>,
        f5: FloatTensor<Self>,
        f6: FloatTensor<Self>,
        f7: FloatTensor<Self>,
        column: usize,
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
    ) {
        let grad = into_contiguous(grad);
        let (_, total) = rows_and_width(&grad);
        // Every table has `t0`'s shape.
        let (_, width) = rows_and_width(&t0);
        let shape = t0.meta.shape().clone();
        let len = shape.num_elements();
        let has = |mask: u32, k: usize| mask >> k & 1 == 1;
        let so_far: Vec<CubeTensor> = [f0, f1, f2, f3, f4, f5, f6, f7]
            .into_iter()
            .enumerate()
            .map(|(k, tensor)| {
                if k < count && has(sofar, k) {
                    into_contiguous(tensor)
                } else {
                    // Unread: a buffer of its own rather than a second binding of another.
                    empty(&grad, Shape::new([1]))
                }
            })
            .collect();
        let table_grads: Vec<CubeTensor> = (0..PART)
            .map(|k| {
                if k < count && has(wanted, k) {
                    empty(&grad, shape.clone())
                } else {
                    empty(&grad, Shape::new([1]))
                }
            })
            .collect();
        #[cfg(test)]
        BACKWARD_LAUNCHES.fetch_add(1, Ordering::Relaxed);
        let (cubes, dim) = per_element(&grad, len);
        // One binding more for CubeCL's own metadata buffer.
        let binds_all = grad.client.properties().hardware.max_bindings as usize > BACKWARD_BINDINGS
            && !one_slot_forced();
        if binds_all {
            let so_far = |k: usize| so_far[k].clone().into_tensor_arg();
            let table_grad = |k: usize| table_grads[k].clone().into_tensor_arg();
            part_backward_kernel::launch(
                &grad.client,
                cubes,
                dim,
                grad.clone().into_tensor_arg(),
                so_far(0),
                so_far(1),
                so_far(2),
                so_far(3),
                so_far(4),
                so_far(5),
                so_far(6),
                so_far(7),
                table_grad(0),
                table_grad(1),
                table_grad(2),
                table_grad(3),
                table_grad(4),
                table_grad(5),
                table_grad(6),
                table_grad(7),
                width,
                column,
                first,
                total,
                sofar,
                wanted,
                count,
                dtype_to_storage_type(grad.dtype),
            );
        } else {
            for k in (0..count).filter(|&k| has(wanted, k)) {
                single_backward_kernel::launch(
                    &grad.client,
                    cubes.clone(),
                    dim,
                    grad.clone().into_tensor_arg(),
                    so_far[k].clone().into_tensor_arg(),
                    table_grads[k].clone().into_tensor_arg(),
                    width,
                    column,
                    first + k,
                    total,
                    sofar >> k,
                    1,
                    dtype_to_storage_type(grad.dtype),
                );
            }
        }
        let [g0, g1, g2, g3, g4, g5, g6, g7]: [CubeTensor; PART] =
            table_grads.try_into().expect("one per slot");
        (g0, g1, g2, g3, g4, g5, g6, g7)
    }
}

mod kernels {
    use cubecl::prelude::*;

    /// `out[t, c]` of `[T, total]`: `L_{c − first}[t, column]` for the part's columns,
    /// `previous[t, c]` before them where `with_previous`, 0 after them. One unit per entry.
    /// (Eight tensor arguments: CubeCL 0.11 has no sequence of tensors.)
    #[cube(launch)]
    // A comptime condition cannot join a runtime one in one `if`.
    #[allow(clippy::too_many_arguments, clippy::collapsible_if)]
    pub(super) fn part_forward_kernel<E: Float>(
        previous: &Tensor<E>,
        t0: &Tensor<E>,
        t1: &Tensor<E>,
        t2: &Tensor<E>,
        t3: &Tensor<E>,
        t4: &Tensor<E>,
        t5: &Tensor<E>,
        t6: &Tensor<E>,
        t7: &Tensor<E>,
        output: &mut Tensor<E>,
        width: usize,
        column: usize,
        first: usize,
        total: usize,
        #[comptime] count: usize,
        #[comptime] with_previous: bool,
        #[define(E)] _dtype: ElemType,
    ) {
        let i = ABSOLUTE_POS;
        if i >= output.len() {
            terminate!();
        }
        let c = i % total;
        let at = (i / total) * width + column;
        let mut value = E::new(0.0);
        if comptime!(with_previous) {
            if c < first {
                value = previous[i];
            }
        }
        if comptime!(count > 0) {
            if c == first {
                value = t0[at];
            }
        }
        if comptime!(count > 1) {
            if c == first + 1 {
                value = t1[at];
            }
        }
        if comptime!(count > 2) {
            if c == first + 2 {
                value = t2[at];
            }
        }
        if comptime!(count > 3) {
            if c == first + 3 {
                value = t3[at];
            }
        }
        if comptime!(count > 4) {
            if c == first + 4 {
                value = t4[at];
            }
        }
        if comptime!(count > 5) {
            if c == first + 5 {
                value = t5[at];
            }
        }
        if comptime!(count > 6) {
            if c == first + 6 {
                value = t6[at];
            }
        }
        if comptime!(count > 7) {
            if c == first + 7 {
                value = t7[at];
            }
        }
        output[i] = value;
    }

    /// One slot's entry `i` of the backward (`row` the slot's entry of `∂out` on this token):
    /// where `bit` is set in the wanted mask, writes `(f[i]) + [on the column] ∂out[row]` to
    /// `table_grad` (`f[i]` where it is set in the so-far mask; `masks = (sofar, wanted)`).
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn slot<E: Float>(
        grad: &Tensor<E>,
        i: usize,
        row: usize,
        on_column: bool,
        sofar: &Tensor<E>,
        table_grad: &mut Tensor<E>,
        #[comptime] bit: u32,
        masks: (u32, u32),
    ) {
        let (sofar_mask, wanted_mask) = masks;
        if (wanted_mask & bit) != 0u32 {
            let mut value = E::new(0.0);
            if on_column {
                value = grad[row];
            }
            if (sofar_mask & bit) != 0u32 {
                value += sofar[i];
            }
            table_grad[i] = value;
        }
    }

    /// One unit per entry `i = (t, q)` of a table `[T, width]`: for each slot `k < count`
    /// whose bit is set in `wanted_mask`, `g_k[i] = (f_k[i]) + [q = column] ∂out[t, first + k]`
    /// (`f_k[i]` where its bit is set in `sofar_mask`).
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn part_backward_kernel<E: Float>(
        grad: &Tensor<E>,
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
        width: usize,
        column: usize,
        first: usize,
        total: usize,
        sofar_mask: u32,
        wanted_mask: u32,
        #[comptime] count: usize,
        #[define(E)] _dtype: ElemType,
    ) {
        let i = ABSOLUTE_POS;
        if i >= grad.len() / total * width {
            terminate!();
        }
        let on_column = i % width == column;
        let row = (i / width) * total + first;
        let masks = (sofar_mask, wanted_mask);
        if comptime!(count > 0) {
            slot::<E>(grad, i, row, on_column, f0, g0, 1u32, masks);
        }
        if comptime!(count > 1) {
            slot::<E>(grad, i, row + 1, on_column, f1, g1, 2u32, masks);
        }
        if comptime!(count > 2) {
            slot::<E>(grad, i, row + 2, on_column, f2, g2, 4u32, masks);
        }
        if comptime!(count > 3) {
            slot::<E>(grad, i, row + 3, on_column, f3, g3, 8u32, masks);
        }
        if comptime!(count > 4) {
            slot::<E>(grad, i, row + 4, on_column, f4, g4, 16u32, masks);
        }
        if comptime!(count > 5) {
            slot::<E>(grad, i, row + 5, on_column, f5, g5, 32u32, masks);
        }
        if comptime!(count > 6) {
            slot::<E>(grad, i, row + 6, on_column, f6, g6, 64u32, masks);
        }
        if comptime!(count > 7) {
            slot::<E>(grad, i, row + 7, on_column, f7, g7, 128u32, masks);
        }
    }

    /// [`part_backward_kernel`] with one slot: three bindings, for a device that binds fewer
    /// than the eight slots need.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn single_backward_kernel<E: Float>(
        grad: &Tensor<E>,
        sofar: &Tensor<E>,
        table_grad: &mut Tensor<E>,
        width: usize,
        column: usize,
        first: usize,
        total: usize,
        sofar_mask: u32,
        wanted_mask: u32,
        #[define(E)] _dtype: ElemType,
    ) {
        let i = ABSOLUTE_POS;
        if i >= grad.len() / total * width {
            terminate!();
        }
        let on_column = i % width == column;
        let row = (i / width) * total + first;
        let masks = (sofar_mask, wanted_mask);
        slot::<E>(grad, i, row, on_column, sofar, table_grad, 1u32, masks);
    }
}
