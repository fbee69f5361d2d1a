//! The global HyperZZW convolution along sequences as one fused op per pass, with its own
//! backward: every row's transforms, spectral product and crop in one kernel on the CubeCL
//! backends ([`cube`]: one cube per row, its transforms in shared memory) and one CPU pass on
//! Flex ([`flex`]: RustFFT's plans through `realfft`).
//!
//! For rows `x = signal[b, c]` and `k = kernel[b or 0, c]` of length `T`, FFT length
//! `n = next_pow2(2T − 1)` (so the circular products below never wrap) and crop start `s₀`:
//!
//! ```text
//! out[t]  = full[s₀ + t],   full = irfft(rfft(x, n) · rfft(k, n), n)      t = 0..T
//! ∂x[s]   = irfft(G · conj(rfft(k, n)), n)[s]                           s = 0..T
//! ∂k[τ]   = irfft(G · conj(rfft(x, n)), n)[τ]                           τ = 0..T
//! G       = rfft(∂full, n),  ∂full[s₀ + t] = ∂out[t], 0 elsewhere
//! ```
//!
//! (`∂k` summed over the batch when the kernel has batch 1.) Composed from `burn::signal`, the
//! forward is two transforms, six full-size elementwise ops on the half spectra, an inverse
//! transform and a crop, each writing a fresh `[B, C, n/2 + 1]` or `[B, C, n]` tensor, and on
//! CubeCL each transform is several launches; here each row stays in a cube's shared memory (a
//! thread's scratch buffers on Flex) from its input to its output.
//!
//! [`takes`] decides once per call which tensors the fused op takes: Flex in f32 and f64; the
//! CubeCL backends in f32, f16 and bf16 (transforms in f32) where a row's `n` complex values fit
//! a cube's shared memory. Everything else composes.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::Tensor;

use super::autodiff::{constant, tracked_op};

#[cfg(feature = "cube-kernels")]
mod cube;
#[cfg(feature = "flex")]
mod flex;

/// The fused FFT convolution (see the [module docs](self)).
#[backend_extension(
    Cube: cfg(feature = "cube-kernels"),
    Fusion: cfg(feature = "cube-kernels"),
    Flex: cfg(feature = "flex"),
    Autodiff
)]
pub(crate) trait FftConvBackend: Backend {
    /// `signal [B, C, T]` convolved with `kernel [B | 1, C, T]`, keeping `full[start..start + T]`.
    #[fusion(dtype = signal, shape = signal)]
    fn fft_conv_1d(
        signal: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        start: usize,
    ) -> FloatTensor<Self>;

    /// The gradients of `signal` and `kernel` (each shaped like its input), given the gradient
    /// of the output.
    #[fusion(meta = |signal, kernel, _, _| (signal.clone(), kernel.clone()))]
    fn fft_conv_1d_backward(
        signal: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        start: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// Whether [`fft_conv_1d`] takes `signal [B, C, T]` and `kernel [B | 1, C, T]`: one float type
/// for both, and a Flex device in f32 or f64, or a CubeCL device in f32, f16 or bf16 whose
/// cubes hold a row's transform (`8n` bytes of shared memory, `n = next_pow2(2T − 1)`).
pub(crate) fn takes(signal: &Tensor<3>, kernel: &Tensor<3>) -> bool {
    if kernel.dtype() != signal.dtype() {
        return false;
    }
    #[cfg(feature = "flex")]
    if super::has_fused_flex_ops(signal) {
        return true;
    }
    #[cfg(feature = "cube-kernels")]
    if cube::takes(signal, kernel) {
        return true;
    }
    false
}

/// The convolution through the fused op, for tensors that it [`takes`].
pub(crate) fn fft_conv_1d(signal: Tensor<3>, kernel: Tensor<3>, start: usize) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as FftConvBackend>::fft_conv_1d(
        signal.into_dispatch(),
        kernel.into_dispatch(),
        start,
    ))
}

/// The FFT length of a linear convolution of two length-`length` rows.
fn fft_length(length: usize) -> usize {
    (2 * length - 1).next_power_of_two().max(2)
}

/// The fused convolution under autodiff: parents `[signal, kernel]`.
#[derive(Debug)]
struct FftConv;

impl<B: FftConvBackend> Backward<B, 2> for FftConv {
    type State = ([NodeId; 2], usize);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (nodes, start) = ops.state;
        let [signal, kernel] = nodes.map(|id| checkpointer.retrieve_node_output(id));
        let (grad_signal, grad_kernel) = B::fft_conv_1d_backward(signal, kernel, grad, start);
        register_tracked!(grads, ops.parents, [grad_signal, grad_kernel]);
    }
}

impl<B: FftConvBackend, C: CheckpointStrategy> FftConvBackend for Autodiff<B, C> {
    fn fft_conv_1d(
        signal: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        start: usize,
    ) -> FloatTensor<Self> {
        tracked_op::<B, C, _, _>(
            FftConv,
            [signal, kernel],
            |[signal, kernel]| B::fft_conv_1d(signal, kernel, start),
            |nodes, _| (nodes, start),
        )
    }

    fn fft_conv_1d_backward(
        signal: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        start: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // First-order only: the gradients are constants to the graph.
        let (grad_signal, grad_kernel) = B::fft_conv_1d_backward(
            signal.into_primitive(),
            kernel.into_primitive(),
            grad.into_primitive(),
            start,
        );
        (constant::<B, C>(grad_signal), constant::<B, C>(grad_kernel))
    }
}
