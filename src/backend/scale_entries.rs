//! Entries of a small differentiable matrix as scalar views, on the CubeCL backends: what
//! [`Scales`](super::Scales) multiplies streams by under autodiff.
//!
//! A stream multiplied by a scalar `v_k` (entry `k` of the row-major `values [rows, columns]`)
//! stays one fused kernel forward when `v_k` is a `[1]` *view*: the table `[E, W]` holds each
//! entry repeated over `W` elements of 512 bytes (the buffer offset alignment of every CubeCL
//! runtime), one kernel per pass, and entry `k` is the view at byte `512 k`. The gradient
//! reaches `values` without the slice's backward (a zero fill and a slice-assign of the table,
//! then an add, per entry):
//!
//! ```text
//! forward:   y = s · v_k                     (Burn's multiplication, fused with the step)
//! backward:  ∂v_k = Σ s ⊙ ∂y                 (Burn's, one reduction)
//!            ∂values += e_k ∂v_k             (here: one elementwise kernel with the add)
//! ```
//!
//! The table is a constant to the graph; the view's op has `values` as its parent.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape, Tensor, TensorData};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use super::autodiff::tracked_op;

/// Bytes of one entry's row in the table: a multiple of every CubeCL runtime's buffer offset
/// alignment (256 on wgpu, 512 on CUDA).
pub(crate) const ENTRY_BYTES: usize = 512;

/// The scalar views (see the [module docs](self)).
#[backend_extension(
    Cube: cfg(feature = "cube-kernels"),
    Fusion: cfg(feature = "cube-kernels"),
    Autodiff
)]
pub(crate) trait ScaleEntryBackend: Backend {
    /// Entry `index` of `values` as a `[1]` view of row `index` of `table` (`[E, W]`, every
    /// row the entry repeated); its gradient goes to `values`.
    #[fusion(meta = |_, table, _| TensorSpec::new(Shape::new([1]), table.dtype))]
    fn scale_entry(
        values: FloatTensor<Self>,
        table: FloatTensor<Self>,
        index: usize,
    ) -> FloatTensor<Self>;
}

/// The table of `values` (any shape, row-major): `[E, W]`, `W` elements of
/// [`ENTRY_BYTES`] per entry. One kernel; a constant to the graph.
pub(crate) fn table<const D: usize>(values: &Tensor<D>) -> Tensor<2> {
    let count = values.shape().num_elements();
    let width = (ENTRY_BYTES / values.dtype().size()).max(1);
    values
        .clone()
        .detach()
        .reshape([count, 1])
        .expand([count, width])
        * 1.0
}

/// Entry `index` of `values` (row-major) as a `[1]` view of `table` (from [`table`]).
pub(crate) fn entry<const D: usize>(
    values: Tensor<D>,
    table: Tensor<2>,
    index: usize,
) -> Tensor<1> {
    Tensor::from_dispatch(<Dispatch as ScaleEntryBackend>::scale_entry(
        values.into_dispatch(),
        table.into_dispatch(),
        index,
    ))
}

impl ScaleEntryBackend for CubeBackend {
    fn scale_entry(_values: CubeTensor, table: CubeTensor, index: usize) -> CubeTensor {
        let table = into_contiguous(table);
        let width = table.meta.shape()[1];
        let offset = (index * width * table.dtype.size()) as u64;
        if offset.is_multiple_of(table.client.properties().memory.alignment) {
            let handle = table.handle.clone().offset_start(offset);
            return CubeTensor::new_contiguous(
                table.client.clone(),
                table.device.clone(),
                Shape::new([1]),
                handle,
                table.dtype,
            );
        }
        // A runtime with a coarser alignment: a copy of the entry (one small kernel), `[1]` as
        // the op's metadata says.
        let entry = burn_cubecl::kernel::slice(table, &[index..index + 1, 0..1]);
        CubeBackend::float_reshape(entry, Shape::new([1]))
    }
}

#[derive(Debug)]
struct ScaleEntry;

impl<B: ScaleEntryBackend> Backward<B, 2> for ScaleEntry {
    /// The shape and float type of `values`, and the entry's index.
    type State = (Shape, DType, usize);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (shape, dtype, index) = ops.state;
        let [values, _] = ops.parents;
        let Some(values) = values else {
            return;
        };
        let mut one_hot = vec![0.0f32; shape.num_elements()];
        one_hot[index] = 1.0;
        let device = grad.device();
        let one_hot = B::float_from_data(
            TensorData::new(one_hot, shape.clone()).convert_dtype(dtype),
            &device,
        );
        let ones = Shape::from(vec![1usize; shape.num_dims()]);
        let grad = B::float_mul(one_hot, B::float_reshape(grad, ones));
        grads.register::<B>(values.id, grad);
    }
}

impl<B: ScaleEntryBackend, C: CheckpointStrategy> ScaleEntryBackend for Autodiff<B, C> {
    fn scale_entry(
        values: FloatTensor<Self>,
        table: FloatTensor<Self>,
        index: usize,
    ) -> FloatTensor<Self> {
        let state = (values.shape(), values.dtype(), index);
        tracked_op::<B, C, _, _>(
            ScaleEntry,
            [values, table],
            |[values, table]| B::scale_entry(values, table, index),
            |_: [NodeId; 2], _| state,
        )
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::prelude::*;
    use burn::tensor::{Distribution, Tolerance};

    use crate::backend::{Scales, UsedEntries};
    use crate::device::device;

    /// Streams scaled by entries of a tracked matrix: the views on wgpu against the selected
    /// entries on Flex, values and the gradients of the matrix and of the streams, at a width
    /// (7) whose rows are not aligned and with the entries right of the diagonal only.
    #[test]
    fn views_match_selected_entries() {
        let flex = Device::flex().autodiff();
        let wgpu = device("wgpu").expect("wgpu compiled in").autodiff();
        let values = Tensor::<2>::random([3, 4], Distribution::Normal(0.0, 1.0), &flex);
        let streams = Tensor::<3>::random([6, 5, 7], Distribution::Normal(0.0, 1.0), &flex);
        let probe = Tensor::<2>::random([5, 7], Distribution::Normal(0.0, 1.0), &flex);
        let run = |device: &Device| {
            let values = values.clone().to_device(device).require_grad();
            let streams = streams.clone().to_device(device).require_grad();
            let scales = Scales::new(values.clone() * 2.0, UsedEntries::AboveDiagonal, true);
            assert_eq!(
                matches!(scales, Scales::Views { .. }),
                crate::backend::is_cube(device),
                "views on CubeCL only"
            );
            let pairs = [(0, 1), (0, 3), (1, 2), (2, 3), (1, 3), (0, 1)];
            let total = pairs
                .iter()
                .enumerate()
                .map(|(k, &(row, column))| {
                    scales.scale(row, column, streams.clone().narrow(0, k, 1).reshape([5, 7]))
                })
                .reduce(|sum, term| sum + term)
                .expect("pairs");
            let grads = (total.clone() * probe.clone().to_device(device))
                .sum()
                .backward();
            [
                total.into_data(),
                values.grad(&grads).expect("tracked").into_data(),
                streams.grad(&grads).expect("tracked").into_data(),
            ]
        };
        for (view, selected) in run(&wgpu).iter().zip(run(&flex)) {
            view.assert_approx_eq::<f32>(&selected, Tolerance::absolute(1e-5));
        }
    }
}
