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

use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape, Tensor, TensorData};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::{CubeCount, CubeDim};

use super::ALIGNED_BYTES;
use super::autodiff::{cast_to, constant, tracked_op};
use super::cube_launch::{
    column_sums, empty, empty_partials, float_types, grid_stride, placeholder_spec, row_prefix,
    summing_dtype,
};

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
/// [`ALIGNED_BYTES`] per entry. One kernel; a constant to the graph.
pub(crate) fn table<const D: usize>(values: &Tensor<D>) -> Tensor<2> {
    let count = values.shape().num_elements();
    let width = (ALIGNED_BYTES / values.dtype().size()).max(1);
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
        row_prefix(table, index, 1)
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

/// The scaled streams of one pass whose entries' gradients are summed in one place: for a
/// caller whose every scaled stream leads to the input of every later one (H-ACN's gated
/// stream, `s_{j+1} = h_j + g_j s_j`), so that the first one's backward runs last.
///
/// Each `y = v_k · s` is Burn's fused product with the view of `v_k` forward, and one kernel
/// backward: `∂s = v_k ∂y`, and each cube of it adds its part of `⟨s, ∂y⟩` to its own row of a
/// `[cubes, entries]` table. The first scaled stream's backward sums the table (one small
/// kernel) and registers the whole `∂values` once, where the views' backward pays Burn's
/// product for `∂s`, its product and reduction for `⟨s, ∂y⟩` and an elementwise kernel into
/// `∂values` per scaled stream.
#[derive(Clone)]
pub(crate) struct ScaleChain(Arc<Mutex<ChainRecords>>);

impl std::fmt::Debug for ScaleChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScaleChain")
            .field("scaled", &self.lock().scaled)
            .finish()
    }
}

struct ChainRecords {
    /// Scaled streams recorded so far.
    scaled: usize,
    /// The values' shape and float type.
    shape: Shape,
    dtype: DType,
    /// The values' node, once a backward has seen them tracked.
    node: Option<NodeId>,
    /// `[cubes, entries]` partial inner products, allocated by the first backward.
    partials: Option<CubeTensor>,
}

impl ScaleChain {
    /// A chain over `values` (any shape, row-major entries).
    pub(crate) fn new<const D: usize>(values: &Tensor<D>) -> Self {
        Self(Arc::new(Mutex::new(ChainRecords {
            scaled: 0,
            shape: values.shape(),
            dtype: values.dtype(),
            node: None,
            partials: None,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, ChainRecords> {
        self.0
            .lock()
            .expect("no scaled stream panics while holding the chain")
    }
}

/// Entry `index` of `values` as a `[1]` view of `table` that is a constant to the graph: what
/// [`chained`] multiplies by (taken once per pass, before the blocks, so that no custom op
/// comes between a block's ops).
pub(crate) fn constant_entry<const D: usize>(
    values: &Tensor<D>,
    table: &Tensor<2>,
    index: usize,
) -> Tensor<1> {
    let entry = entry(values.clone().inner(), table.clone().inner(), index);
    if values.is_autodiff() {
        entry.autodiff()
    } else {
        entry
    }
}

/// `value · values[index]` (row-major), `entry` the entry from [`constant_entry`], through
/// `chain`: the gradient reaches `values` once per pass.
pub(crate) fn chained<const D: usize, const E: usize>(
    chain: &ScaleChain,
    values: Tensor<E>,
    entry: Tensor<1>,
    index: usize,
    value: Tensor<D>,
) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as ScaleChainBackend>::chained_scale(
        chain.clone(),
        values.into_dispatch(),
        entry.into_dispatch(),
        value.into_dispatch(),
        index,
    ))
}

/// What a scaled stream's backward computes: its part of `∂values` (where they are tracked),
/// the whole `∂values` (the first scaled stream), the stream's gradient.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChainWanted {
    values: bool,
    hand_over: bool,
    stream: bool,
}

/// The chained scaled streams (see [`ScaleChain`]).
#[backend_extension(
    Cube: cfg(feature = "cube-kernels"),
    Fusion: cfg(feature = "cube-kernels"),
    Autodiff
)]
pub(crate) trait ScaleChainBackend: Backend {
    /// `stream · entry`, `entry` (`[1]`) the value of `values[index]`.
    #[fusion(dtype = stream, shape = stream)]
    fn chained_scale(
        chain: ScaleChain,
        values: FloatTensor<Self>,
        entry: FloatTensor<Self>,
        stream: FloatTensor<Self>,
        index: usize,
    ) -> FloatTensor<Self>;

    /// `(∂values` whole from the first scaled stream, else a `[1]` placeholder; `∂stream` or a
    /// placeholder`)`, given `∂y`.
    #[fusion(meta = |chain, _, stream, _, _, wanted| (
        if wanted.hand_over {
            TensorSpec::new(chain.lock().shape.clone(), stream.dtype)
        } else {
            placeholder_spec(stream)
        },
        if wanted.stream { stream.clone() } else { placeholder_spec(stream) },
    ))]
    fn chained_scale_backward(
        chain: ScaleChain,
        entry: FloatTensor<Self>,
        stream: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        index: usize,
        wanted: ChainWanted,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// `stream · entry`, the `[1]` entry broadcast over the stream's axes.
fn scaled<B: Backend>(entry: FloatTensor<B>, stream: FloatTensor<B>) -> FloatTensor<B> {
    let ones = Shape::from(vec![1usize; stream.shape().num_dims()]);
    B::float_mul(stream, B::float_reshape(entry, ones))
}

impl ScaleChainBackend for CubeBackend {
    fn chained_scale(
        _chain: ScaleChain,
        _values: CubeTensor,
        entry: CubeTensor,
        stream: CubeTensor,
        _index: usize,
    ) -> CubeTensor {
        scaled::<Self>(entry, stream)
    }

    fn chained_scale_backward(
        chain: ScaleChain,
        entry: CubeTensor,
        stream: CubeTensor,
        grad: CubeTensor,
        index: usize,
        wanted: ChainWanted,
    ) -> (CubeTensor, CubeTensor) {
        let entry = into_contiguous(entry);
        let stream = into_contiguous(stream);
        let grad = into_contiguous(grad);
        let len = grad.meta.shape().num_elements();
        let mut records = chain.lock();
        let entries = records.shape.num_elements();
        let (threads, mut cubes) = grid_stride(&grad, len, 1);
        if wanted.values {
            let partials = records.partials.get_or_insert_with(|| {
                Self::float_zeros(
                    Shape::new([cubes, entries]),
                    &grad.device,
                    summing_dtype(grad.dtype).into(),
                )
            });
            // One row per cube: every backward of the chain takes the first one's cube count.
            cubes = partials.meta.shape()[0];
        }
        let placeholder = || empty(&grad, Shape::new([1]));
        let grad_stream = if wanted.stream {
            empty(&grad, grad.meta.shape().clone())
        } else {
            placeholder()
        };
        let partials =
            (records.partials.clone()).unwrap_or_else(|| empty_partials(&grad, Shape::new([1])));
        kernels::chain_backward_kernel::launch(
            &grad.client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(threads as u32),
            entry.into_tensor_arg(),
            stream.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            grad_stream.clone().into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            index,
            wanted.stream,
            wanted.values,
            threads,
            float_types(grad.dtype),
        );
        let grad_values = if wanted.hand_over {
            let sums = column_sums(partials, grad.dtype);
            CubeTensor::new_contiguous(
                sums.client,
                sums.device,
                records.shape.clone(),
                sums.handle,
                sums.dtype,
            )
        } else {
            placeholder()
        };
        (grad_values, grad_stream)
    }
}

#[derive(Debug)]
struct ChainedScale;

impl<B: ScaleChainBackend> Backward<B, 2> for ChainedScale {
    /// The chain, the scaled stream's number in it, the entry's index and value, the stream.
    type State = (ScaleChain, usize, usize, FloatTensor<B>, FloatTensor<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (chain, number, index, entry, stream) = ops.state;
        let [values_parent, stream_parent] = ops.parents;
        if let Some(parent) = &values_parent {
            chain.lock().node = Some(parent.id);
        }
        let wanted = ChainWanted {
            values: values_parent.is_some(),
            hand_over: values_parent.is_some() && number == 0,
            stream: stream_parent.is_some(),
        };
        let (grad_values, grad_stream) =
            B::chained_scale_backward(chain.clone(), entry, stream, grad, index, wanted);
        if wanted.hand_over {
            let (node, dtype) = {
                let records = chain.lock();
                (records.node.expect("set above"), records.dtype)
            };
            grads.register::<B>(node, cast_to::<B>(grad_values, dtype));
        }
        if let Some(parent) = stream_parent {
            grads.register::<B>(parent.id, grad_stream);
        }
    }
}

impl<B: ScaleChainBackend, C: CheckpointStrategy> ScaleChainBackend for Autodiff<B, C> {
    fn chained_scale(
        chain: ScaleChain,
        values: FloatTensor<Self>,
        entry: FloatTensor<Self>,
        stream: FloatTensor<Self>,
        index: usize,
    ) -> FloatTensor<Self> {
        let number = {
            let mut records = chain.lock();
            records.scaled += 1;
            records.scaled - 1
        };
        let entry = entry.into_primitive();
        // Burn's fused product forward; the stream is kept for the backward, as Burn's product
        // would keep it.
        match ChainedScale
            .prepare::<C>([values.node(), stream.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let stream = stream.into_primitive();
                let output = scaled::<B>(entry.clone(), stream.clone());
                prep.finish((chain, number, index, entry, stream), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(scaled::<B>(entry, stream.into_primitive())),
        }
    }

    fn chained_scale_backward(
        chain: ScaleChain,
        entry: FloatTensor<Self>,
        stream: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        index: usize,
        wanted: ChainWanted,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (grad_values, grad_stream) = B::chained_scale_backward(
            chain,
            entry.into_primitive(),
            stream.into_primitive(),
            grad.into_primitive(),
            index,
            wanted,
        );
        (constant::<B, C>(grad_values), constant::<B, C>(grad_stream))
    }
}

mod kernels {
    use cubecl::prelude::*;

    use crate::backend::cube_launch::kernels::cube_total;

    /// `∂s = v ∂y` (`v = entry[0]`, entry `index` of the values) and, per cube,
    /// `partials[cube, index] += ⟨s, ∂y⟩` over the cube's elements. A grid-stride loop.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn chain_backward_kernel<E: Float, A: Float>(
        entry: &Tensor<E>,
        stream: &Tensor<E>,
        grad: &Tensor<E>,
        grad_stream: &mut Tensor<E>,
        partials: &mut Tensor<A>,
        #[comptime] index: usize,
        #[comptime] stream_wanted: bool,
        #[comptime] values_wanted: bool,
        #[comptime] threads: usize,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let len = grad.len();
        let value = entry[0];
        let mut dot = A::new(0.0);
        let stride = CUBE_COUNT * threads;
        let mut i = CUBE_POS * threads + UNIT_POS as usize;
        while i < len {
            let g = grad[i];
            if comptime!(stream_wanted) {
                grad_stream[i] = value * g;
            }
            if comptime!(values_wanted) {
                dot += A::cast_from(stream[i]) * A::cast_from(g);
            }
            i += stride;
        }
        if comptime!(values_wanted) {
            let unit = UNIT_POS as usize;
            let mut shared = Shared::<[A]>::new_slice(threads);
            let total = cube_total::<A>(dot, &mut shared);
            let at = CUBE_POS * partials.shape(1) + index;
            if unit == 0 {
                partials[at] += total;
            }
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::prelude::*;
    use burn::tensor::Tolerance;

    use crate::backend::{Scales, UsedEntries};
    use crate::device::device;
    use crate::test_util::fixed_normal;

    /// Streams scaled by entries of a tracked matrix: the views on wgpu against the selected
    /// entries on Flex, values and the gradients of the matrix and of the streams, at a width
    /// (7) whose rows are not aligned and with the entries right of the diagonal only.
    #[test]
    fn views_match_selected_entries() {
        let flex = Device::flex().autodiff();
        let wgpu = device("wgpu").expect("wgpu compiled in").autodiff();
        let values = fixed_normal([3, 4], 1.0, 1, &flex);
        let streams = fixed_normal([6, 5, 7], 1.0, 2, &flex);
        let probe = fixed_normal([5, 7], 1.0, 3, &flex);
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
