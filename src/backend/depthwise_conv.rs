//! A depthwise "same" cross-correlation along the positions of `[B, T, C]` rows, with its own
//! backward, on the CubeCL backends: one kernel forward, three backward (`∂x`, the taps'
//! gradient's partial sums, their sum).
//!
//! For taps `K [k, C]` (`k` odd, `p = (k − 1) / 2`, zero outside `0..T`):
//!
//! ```text
//! y[b, t, c]  = Σ_i K[i, c] x[b, t + i − p, c]
//! ∂x[b, s, c] = Σ_i K[i, c] ∂y[b, s − i + p, c]
//! ∂K[i, c]    = Σ_{b, t} ∂y[b, t, c] x[b, t + i − p, c]
//! ```
//!
//! Burn's `conv1d` takes `[B, C, T]` and runs through its 2D convolution: on CubeCL, packs and
//! copies of the whole input around a direct convolution forward (four launches), a transposed
//! convolution and another direct one backward (eight), each copy a pass over `[B, T, C]`. Here
//! the rows stay where they are (channels last, a swapped view of `[B, C, T]` for the caller):
//! one unit per output entry forward and per input entry for `∂x`, and the taps' gradient as
//! partial sums over runs of rows (one unit per channel, consecutive units reading consecutive
//! channels), summed by one small kernel.
//!
//! [`takes`] decides once per call: CubeCL devices in f32, f16 and bf16 (sums in f32). Flex and
//! the other backends keep Burn's `conv1d`.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};

use super::autodiff::{constant, tracked_op};

#[cfg(feature = "cube-kernels")]
mod cube;

/// The depthwise cross-correlation (see the [module docs](self)).
#[backend_extension(
    Cube: cfg(feature = "cube-kernels"),
    Fusion: cfg(feature = "cube-kernels"),
    Autodiff
)]
pub(crate) trait DepthwiseConvBackend: Backend {
    /// `y [B, T, C]` from `x [B, T, C]` and `taps [k, C]` (`k` odd).
    #[fusion(dtype = x, shape = x)]
    fn depthwise_conv(x: FloatTensor<Self>, taps: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `(∂x, ∂taps)` given the gradient of the output.
    #[fusion(meta = |x, taps, _| (x.clone(), taps.clone()))]
    fn depthwise_conv_backward(
        x: FloatTensor<Self>,
        taps: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// Whether [`depthwise_conv`] takes `x [B, T, C]` with `taps [k, C]`: a CubeCL device, one
/// float type (f32, f16 or bf16) for both, an odd `k` and matching channels.
pub(crate) fn takes(x: &Tensor<3>, taps: &Tensor<2>) -> bool {
    let [_, _, channels] = x.dims();
    let [k, taps_channels] = taps.dims();
    super::cube_kernels_take(x)
        && super::cube_kernels_take(taps)
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && taps.dtype() == x.dtype()
        && k % 2 == 1
        && taps_channels == channels
}

/// The cross-correlation through the op, for tensors that it [`takes`].
pub(crate) fn depthwise_conv(x: Tensor<3>, taps: Tensor<2>) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as DepthwiseConvBackend>::depthwise_conv(
        x.into_dispatch(),
        taps.into_dispatch(),
    ))
}

/// The op under autodiff: parents `[x, taps]`.
#[derive(Debug)]
struct DepthwiseConv;

impl<B: DepthwiseConvBackend> Backward<B, 2> for DepthwiseConv {
    type State = [NodeId; 2];

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let [x, taps] = ops.state.map(|id| checkpointer.retrieve_node_output(id));
        let (grad_x, grad_taps) = B::depthwise_conv_backward(x, taps, grad);
        register_tracked!(grads, ops.parents, [grad_x, grad_taps]);
    }
}

impl<B: DepthwiseConvBackend, C: CheckpointStrategy> DepthwiseConvBackend for Autodiff<B, C> {
    fn depthwise_conv(x: FloatTensor<Self>, taps: FloatTensor<Self>) -> FloatTensor<Self> {
        tracked_op::<B, C, _, _>(
            DepthwiseConv,
            [x, taps],
            |[x, taps]| B::depthwise_conv(x, taps),
            |nodes, _| nodes,
        )
    }

    fn depthwise_conv_backward(
        x: FloatTensor<Self>,
        taps: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // First-order only: the gradients are constants to the graph.
        let (grad_x, grad_taps) = B::depthwise_conv_backward(
            x.into_primitive(),
            taps.into_primitive(),
            grad.into_primitive(),
        );
        (constant::<B, C>(grad_x), constant::<B, C>(grad_taps))
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::prelude::*;
    use burn::tensor::module::conv1d;
    use burn::tensor::ops::ConvOptions;

    use crate::test_util::{assert_tensors_close, standard_normal, wgpu_autodiff};

    /// The composed form: Burn's `conv1d` on the `[B, C, T]` view, taps as `[C, 1, k]`.
    fn burns_conv1d(x: Tensor<3>, taps: Tensor<2>) -> Tensor<3> {
        let [k, channels] = taps.dims();
        let options = ConvOptions::new([1], [(k - 1) / 2], [1], channels);
        let weight = taps.transpose().reshape([channels, 1, k]);
        conv1d(x.swap_dims(1, 2), weight, None, options).swap_dims(1, 2)
    }

    /// `(y, ∂x, ∂taps)` for the loss `Σ y ⊙ w` through the op or [`burns_conv1d`].
    fn results(device: &Device, fused: bool, [x, taps, w]: &[TensorData; 3]) -> Vec<TensorData> {
        let x = Tensor::<3>::from_data(x.clone(), device).require_grad();
        let taps = Tensor::<2>::from_data(taps.clone(), device).require_grad();
        let y = if fused {
            assert!(super::takes(&x, &taps));
            super::depthwise_conv(x.clone(), taps.clone())
        } else {
            burns_conv1d(x.clone(), taps.clone())
        };
        let grads = (y.clone() * Tensor::from_data(w.clone(), device))
            .sum()
            .backward();
        vec![
            y.into_data(),
            x.grad(&grads).expect("tracked").into_data(),
            taps.grad(&grads).expect("tracked").into_data(),
        ]
    }

    /// The op's output and gradients equal Burn's `conv1d` under autodiff on wgpu (lavapipe):
    /// taps 1, 3 and 5 wide, sequences shorter than the taps' reach, channels past one cube,
    /// and enough rows for several runs of partial sums.
    #[test]
    fn depthwise_conv_matches_burns_conv1d() {
        let device = wgpu_autodiff();
        for (case, ([batch, length, channels], k)) in [
            ([2, 7, 5], 3),
            ([1, 2, 3], 5),
            ([3, 4, 2], 1),
            ([4, 300, 260], 3),
        ]
        .into_iter()
        .enumerate()
        {
            let seed = 20 + 3 * case as u64;
            let data = [
                standard_normal([batch, length, channels], seed, &device).into_data(),
                standard_normal([k, channels], seed + 1, &device).into_data(),
                standard_normal([batch, length, channels], seed + 2, &device).into_data(),
            ];
            assert_tensors_close(
                &results(&device, true, &data),
                &results(&device, false, &data),
                1e-5,
                &format!("[{batch}, {length}, {channels}], k = {k}"),
            );
        }
    }

    /// In f16 the kernels sum in f32: the taps' gradient over 2²¹ rows, 4096 products a unit
    /// (one channel, so 512 runs of rows). Kept in f16, a unit's sum of like-signed terms stops
    /// growing once its spacing passes twice a term (2048 terms). The composed reference runs
    /// on Flex: lavapipe stops a shader's loops after 65535 iterations in all, which Burn's
    /// convolution backward over rows this long can reach.
    #[test]
    fn half_precision_kernels_sum_in_f32() {
        use crate::test_util::{assert_half_sums_in_f32, fixed_normal};
        let flex = Device::flex().autodiff();
        let shape = [2, 1 << 20, 1];
        let x = fixed_normal(shape, 0.3, 50, &flex) + 1.0;
        let taps = fixed_normal([3, 1], 0.2, 51, &flex) + 0.5;
        // Small, so that the sums over the rows stay inside f16's range.
        let probe = fixed_normal(shape, 3e-4, 52, &flex) + 1e-3;
        assert_half_sums_in_f32("depthwise convolution", |dtype, fused| {
            let device = if fused { wgpu_autodiff() } else { flex.clone() };
            let on = |data: TensorData| Tensor::<3>::from_data(data, &device).cast(dtype);
            let x = on(x.to_data()).require_grad();
            let taps = Tensor::<2>::from_data(taps.to_data(), &device)
                .cast(dtype)
                .require_grad();
            let y = if fused {
                assert!(super::takes(&x, &taps));
                super::depthwise_conv(x.clone(), taps.clone())
            } else {
                burns_conv1d(x.clone(), taps.clone())
            };
            let probe = on(probe.to_data());
            let grads = (y.clone() * probe).sum().backward();
            vec![
                y.into_data(),
                x.grad(&grads).expect("tracked").into_data(),
                taps.grad(&grads).expect("tracked").into_data(),
            ]
        });
    }
}
