//! The depthwise cross-correlation's kernels on the CubeCL backends (see the
//! [parent](super)): sums in f32 for f16 and bf16 tensors ([`float_types`]).

use burn::backend::ops::FloatTensorOps;
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use super::DepthwiseConvBackend;
use crate::backend::cube_launch::{
    MOST_SUMMING_UNITS, RowRuns, column_sums, empty, empty_partials, float_types, per_element,
};
use kernels::{depthwise_conv_kernel, depthwise_taps_grad_kernel};

/// `y` (or, `transposed`, `∂x` from `∂y`): one unit per entry.
fn correlate(x: CubeTensor, taps: CubeTensor, transposed: bool) -> CubeTensor {
    let x = into_contiguous(x);
    let taps = into_contiguous(taps);
    let k = taps.meta.shape()[0];
    let output = empty(&x, x.meta.shape().clone());
    let (count, dim) = per_element(&x, x.meta.shape().num_elements());
    depthwise_conv_kernel::launch(
        &x.client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        taps.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        k,
        transposed,
        float_types(x.dtype),
    );
    output
}

impl DepthwiseConvBackend for CubeBackend {
    fn depthwise_conv(x: CubeTensor, taps: CubeTensor) -> CubeTensor {
        correlate(x, taps, false)
    }

    fn depthwise_conv_backward(
        x: CubeTensor,
        taps: CubeTensor,
        grad: CubeTensor,
    ) -> (CubeTensor, CubeTensor) {
        let dtype = x.dtype;
        let k = taps.meta.shape()[0];
        let grad = into_contiguous(grad);
        let grad_x = correlate(grad.clone(), taps, true);
        let x = into_contiguous(x);
        let [batch, length, channels] = x.meta.shape().dims::<3>();
        let runs = RowRuns::new(&x, batch * length, channels, MOST_SUMMING_UNITS);
        let partials = empty_partials(&x, Shape::new([runs.chunks, k * channels]));
        let (count, dim) = runs.launch(&x);
        depthwise_taps_grad_kernel::launch(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            grad.into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            runs.chunk_rows,
            k,
            runs.column_cubes,
            float_types(dtype),
        );
        let grad_taps =
            Self::float_reshape(column_sums(partials, dtype), Shape::new([k, channels]));
        (grad_x, grad_taps)
    }
}

mod kernels {
    use cubecl::prelude::*;

    /// Entry `index` of `output [B, T, C]`: `Σ_i K[i, c] x[b, t + i − p, c]`, or (`transposed`)
    /// `Σ_i K[i, c] x[b, t − i + p, c]`, zero outside the row's `T` positions.
    #[cube(launch)]
    pub(super) fn depthwise_conv_kernel<E: Float, A: Float>(
        x: &Tensor<E>,
        taps: &Tensor<E>,
        output: &mut Tensor<E>,
        #[comptime] k: usize,
        #[comptime] transposed: bool,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let index = ABSOLUTE_POS;
        if index >= output.len() {
            terminate!();
        }
        let channels = x.shape(2);
        let length = x.shape(1);
        let c = index % channels;
        let t = (index / channels) % length;
        let reach = comptime!((k - 1) / 2);
        let mut total = A::new(0.0);
        #[unroll]
        for i in 0..k {
            // The source position `t + i − p` (or `t − i + p`), shifted by `p` to stay unsigned.
            let mut shifted = t + i;
            if transposed {
                shifted = t + comptime!(2 * reach) - i;
            }
            if shifted >= reach && shifted - reach < length {
                let source = index + shifted * channels - (t + reach) * channels;
                total += A::cast_from(taps[i * channels + c]) * A::cast_from(x[source]);
            }
        }
        output[index] = E::cast_from(total);
    }

    /// Partial sums of `∂K[i, c] = Σ ∂y[r, c] x[r + i − p, c]` over a run of `chunk_rows` rows
    /// `r = (b, t)` ([`RowRuns`](crate::backend::cube_launch::RowRuns)): cube
    /// `chunk · column_cubes + j` takes channels `j · CUBE_DIM ..`, one unit per channel, and
    /// writes row `chunk` of `partials [chunks, k · C]`.
    #[cube(launch)]
    pub(super) fn depthwise_taps_grad_kernel<E: Float, A: Float>(
        x: &Tensor<E>,
        grad: &Tensor<E>,
        partials: &mut Tensor<A>,
        chunk_rows: usize,
        #[comptime] k: usize,
        #[comptime] column_cubes: usize,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let cube = CUBE_POS;
        let chunk = cube / column_cubes;
        let c = (cube % column_cubes) * (CUBE_DIM as usize) + UNIT_POS as usize;
        let channels = x.shape(2);
        let length = x.shape(1);
        let rows = x.shape(0) * length;
        if c >= channels || chunk >= partials.shape(0) {
            terminate!();
        }
        let reach = comptime!((k - 1) / 2);
        let mut sums = Array::<A>::new(k);
        #[unroll]
        for i in 0..k {
            sums[i] = A::new(0.0);
        }
        let first = chunk * chunk_rows;
        let mut last = first + chunk_rows;
        if last > rows {
            last = rows;
        }
        for r in first..last {
            let t = r % length;
            let g = A::cast_from(grad[r * channels + c]);
            #[unroll]
            for i in 0..k {
                if t + i >= reach && t + i - reach < length {
                    sums[i] += g * A::cast_from(x[(r + i - reach) * channels + c]);
                }
            }
        }
        let base = chunk * comptime!(k) * channels + c;
        #[unroll]
        for i in 0..k {
            partials[base + i * channels] = sums[i];
        }
    }
}
