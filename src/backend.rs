//! The backend tricks behind the connectivities, knowing no family: which device this is, the
//! fused ops (Flex CPU loops, CubeCL kernels, LibTorch's own kernels) with their hand-written
//! backward passes, and the choice between a fused op and its composed tensor-op form.
//!
//! Families pass their constants in (ε, scales, iteration counts); nothing here imports a family.

use burn::nn::LayerNorm;
use burn::prelude::*;

/// In a fused op's `Backward`: registers each computed gradient with its parent, where the
/// parent is tracked (the parents' node type is private to burn-autodiff, hence a macro; `B` is
/// the op's backend). Defined before the op modules, which use it.
#[cfg(any(feature = "flex", feature = "tch", feature = "cube-kernels"))]
macro_rules! register_tracked {
    ($grads:expr, $parents:expr, $computed:expr) => {
        for (parent, grad) in $parents.into_iter().zip($computed) {
            if let Some(parent) = parent {
                $grads.register::<B>(parent.id, grad);
            }
        }
    };
}

#[cfg(any(feature = "flex", feature = "tch", feature = "cube-kernels"))]
mod autodiff;
mod column_gather;
#[cfg(any(feature = "flex", feature = "cube-kernels"))]
pub(crate) mod column_renorm;
pub(crate) use column_gather::{gather_columns, gathers_columns_apart};
#[cfg(feature = "cube-kernels")]
mod connection_tables;
#[cfg(feature = "cube-kernels")]
pub(crate) use connection_tables::{Gated, Normalised, TableForm};
#[cfg(feature = "cube-kernels")]
mod cube_launch;
#[cfg(feature = "cube-kernels")]
pub(crate) mod depthwise_conv;
#[cfg(all(test, feature = "cube-kernels"))]
pub(crate) use cube_launch::{
    GatedWeights, Knobs, ProductPath, ProjectionPath, TilePadding, with_each_knobs,
};
#[cfg(any(feature = "flex", feature = "cube-kernels"))]
pub(crate) mod fft_conv;
#[cfg(feature = "flex")]
mod flex_kernels;
#[cfg(feature = "flex")]
pub(crate) mod gelu;
#[cfg(feature = "cube-kernels")]
mod gradient_slots;
#[cfg(any(feature = "flex", feature = "cube-kernels"))]
mod history_mix;
#[cfg(feature = "kernel-source")]
pub mod kernel_source;
#[cfg(any(feature = "flex", feature = "tch", feature = "cube-kernels"))]
mod layer_norm;
#[cfg(feature = "flex")]
mod low_rank;
#[cfg(feature = "flex")]
pub(crate) use low_rank::LowRankResidual;
mod masked_softmax;
#[cfg(any(feature = "flex", feature = "cube-kernels"))]
pub(crate) use history_mix::History;
pub(crate) use masked_softmax::{SoftmaxMask, last_axis_softmax, masked_softmax};
#[cfg(feature = "flex")]
pub(crate) mod normed_projection;
#[cfg(feature = "cube-kernels")]
mod scale_entries;
mod scales;
#[cfg(feature = "cube-kernels")]
pub(crate) mod sine_gated;
pub(crate) use scales::{Scales, UsedEntries};
#[cfg(any(feature = "cube-kernels", feature = "flex"))]
pub(crate) mod sinkhorn;
#[cfg(feature = "flex")]
mod softmax_mix;
#[cfg(feature = "flex")]
pub(crate) mod stream_mix;
#[cfg(feature = "flex")]
pub(crate) use softmax_mix::fused_softmax_mix;
mod token_mix;
pub(crate) use token_mix::{token_mix_columns, token_mix_leaving};
#[cfg(feature = "cube-kernels")]
mod unit_kernels;
#[cfg(feature = "flex")]
pub(crate) use stream_mix::UnitsGradient;
mod units;
pub(crate) use units::{
    Gains, LayerOps, MatrixRows, RowScale, UnitOps, rms_projection, rms_projection_writing,
};

/// Bytes that rows of the crate's packed tables are a multiple of: a multiple of every CubeCL
/// runtime's buffer offset alignment (256 on wgpu, 512 on CUDA), so that a row is a view.
#[cfg(any(feature = "flex", feature = "cube-kernels"))]
pub(crate) const ALIGNED_BYTES: usize = 512;

/// An `f64` setting (ε, a scale) as the bits of an `f32`: how the crate's CubeCL kernels take
/// it, as a compile-time constant (a kernel is compiled once per value; a model has one or two
/// of each).
#[cfg(feature = "cube-kernels")]
pub(crate) fn kernel_constant(value: f64) -> u32 {
    (value as f32).to_bits()
}

/// The float type that Sinkhorn-Knopp, the composed row scales and the RMS normalisation's scale
/// run in: f32 for f16 and bf16 tensors, else the tensor's own. In f16 a row's `‖x‖²` passes
/// the largest value (65504) at `‖x‖ > 256`, mHC's row scale `1/ε` is 10⁶ for a zero row, and a
/// division's gradient `−∂y·a/b²` overflows where `b` is Sinkhorn-Knopp's sum of a nearly empty
/// column; in bf16 each of them keeps 8 bits. Only the rows' sums of squares read a full-size
/// cast (which the fusion engine merges with the square on CubeCL); the scales and
/// Sinkhorn-Knopp's logits are small (`[T, 1]`, `[T, n²]`).
pub(crate) fn exact_float(dtype: burn::tensor::DType) -> burn::tensor::FloatDType {
    use burn::tensor::{DType, FloatDType};
    match dtype {
        DType::F16 | DType::BF16 => FloatDType::F32,
        other => other.into(),
    }
}

/// Whether `device` (or the device under its autodiff layer) is a Flex device.
pub(crate) fn is_flex(device: &Device) -> bool {
    #[cfg(feature = "flex")]
    {
        matches!(
            device.clone().without_autodiff().as_dispatch(),
            burn::backend::DispatchDevice::Flex(_)
        )
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = device;
        false
    }
}

/// Whether `device` (or the device under its autodiff layer) runs on CubeCL (wgpu, vulkan,
/// metal, cuda), where Burn's fusion engine merges elementwise operations into kernels.
pub(crate) fn is_cube(device: &Device) -> bool {
    #[cfg(any(
        feature = "wgpu",
        feature = "vulkan",
        feature = "metal",
        feature = "cuda"
    ))]
    {
        matches!(
            device.clone().without_autodiff().as_dispatch(),
            burn::backend::DispatchDevice::Cube(_)
        )
    }
    #[cfg(not(any(
        feature = "wgpu",
        feature = "vulkan",
        feature = "metal",
        feature = "cuda"
    )))]
    {
        let _ = device;
        false
    }
}

/// Whether the crate's CubeCL kernels can index `elements` entries: they index in 32 bits
/// (CubeCL's default address type, where Burn's own kernels pick 32 or 64 bits per launch), so
/// a tensor with more entries goes to the composed form rather than wrap around.
#[cfg_attr(
    not(any(feature = "cube-kernels", feature = "flex", feature = "tch")),
    allow(dead_code)
)]
pub(crate) fn indexes_in_32_bits(elements: usize) -> bool {
    u32::try_from(elements).is_ok()
}

/// Buffers that the crate's widest CubeCL kernel binds besides CubeCL's metadata buffer (the
/// connection tables' backward). The per-token mixtures' backward kernels bind more, and have a
/// one-slot form for devices that bind fewer.
#[cfg(feature = "cube-kernels")]
const WIDEST_KERNEL_BUFFERS: usize = 15;

/// Whether `device` is a CubeCL device that binds as many buffers as each of the crate's kernels
/// (desktop GPUs bind far more; some mobile GPUs' Vulkan drivers fewer).
#[cfg(any(feature = "cube-kernels", feature = "flex"))]
fn binds_every_kernel(device: &Device) -> bool {
    #[cfg(feature = "cube-kernels")]
    if let burn::backend::DispatchDevice::Cube(cube) =
        device.clone().without_autodiff().as_dispatch()
    {
        let bindings = cube.client().properties().hardware.max_bindings as usize;
        return bindings > WIDEST_KERNEL_BUFFERS;
    }
    let _ = device;
    false
}

/// Whether the crate's CubeCL kernels take `tensor`: a CubeCL device that
/// [binds every kernel](binds_every_kernel), a float type, and entries that
/// [`indexes_in_32_bits`].
#[cfg(any(feature = "cube-kernels", feature = "flex"))]
pub(crate) fn cube_kernels_take<const D: usize>(tensor: &Tensor<D>) -> bool {
    let device = tensor.device();
    is_cube(&device)
        && tensor.dtype().is_float()
        && indexes_in_32_bits(tensor.shape().num_elements())
        && binds_every_kernel(&device)
}

/// The largest `n` of the CubeCL Sinkhorn-Knopp kernel: a unit keeps its `n × n` matrix and
/// every step's `n` denominators (for the backward) in its own memory, and unrolls each step's
/// `n²` work. Larger matrices compose.
#[cfg(any(feature = "cube-kernels", feature = "flex"))]
pub(crate) const MAX_CUBE_SINKHORN: usize = 16;

/// Whether `tensor` (`[..., n, n]`) can go through the crate's fused Sinkhorn-Knopp: CubeCL
/// devices for `n` up to [`MAX_CUBE_SINKHORN`], and Flex in f32 or f64.
#[cfg(any(feature = "cube-kernels", feature = "flex"))]
pub(crate) fn has_fused_sinkhorn<const D: usize>(tensor: &Tensor<D>) -> bool {
    let n = tensor.dims()[D - 1];
    (cube_kernels_take(tensor) && n <= MAX_CUBE_SINKHORN) || has_fused_flex_ops(tensor)
}

/// Whether `tensor` can go through the crate's fused CPU ops (`src/backend/`): a Flex device,
/// f32 or f64.
#[cfg(any(feature = "cube-kernels", feature = "flex"))]
pub(crate) fn has_fused_flex_ops<const D: usize>(tensor: &Tensor<D>) -> bool {
    is_flex(&tensor.device())
        && matches!(
            tensor.dtype(),
            burn::tensor::DType::F32 | burn::tensor::DType::F64
        )
}

/// Without Flex there is no fused low-rank residual: no value of this type exists.
#[cfg(not(feature = "flex"))]
#[derive(Clone, Copy, Debug)]
pub(crate) enum LowRankResidual {}

#[cfg(not(feature = "flex"))]
impl LowRankResidual {
    pub(crate) fn for_tensor<const D: usize>(_stream: &Tensor<D>) -> Option<Self> {
        None
    }

    pub(crate) fn apply<const D: usize>(
        self,
        _stream: Tensor<D>,
        _branch: Tensor<D>,
        _down: Tensor<2>,
        _up: Tensor<2>,
    ) -> Tensor<D> {
        match self {}
    }
}

/// Without Flex or CubeCL there is no fused history mix: no value of this type exists.
#[cfg(not(any(feature = "flex", feature = "cube-kernels")))]
#[derive(Clone, Debug)]
pub(crate) enum History {}

#[cfg(not(any(feature = "flex", feature = "cube-kernels")))]
impl History {
    pub(crate) fn forget(&self, _index: usize) {
        match *self {}
    }

    pub(crate) fn mix<const D: usize>(
        &self,
        _terms: Vec<(usize, usize)>,
        _newest_weight: usize,
        _segment: usize,
        _weights: Tensor<1>,
        _newest: Tensor<D>,
    ) -> Tensor<D> {
        match *self {}
    }
}

/// The gradient slot of a state read by one [`rms_projection_writing`] and by mixtures created
/// after it ([`token_mix_leaving`], `fused_softmax_mix`): where the fused Flex ops run under
/// autodiff, the mixtures leave their parts of the state's gradient in it and the projection's
/// backward writes the whole gradient in its one pass over the state (see [`UnitsGradient`]);
/// `None` elsewhere.
pub(crate) fn state_gradient<const D: usize>(state: &Tensor<D>) -> Option<UnitsGradient> {
    #[cfg(feature = "flex")]
    if has_fused_flex_ops(state) && state.device().is_autodiff() {
        return Some(UnitsGradient::default());
    }
    let _ = state;
    None
}

/// The last state's logit made inside the mixture, `s(‖v_t‖) v_t · W[:, c]` with the RMS
/// scale `s(n) = 1 / sqrt(n²/d + ε)`, from a weight matrix `W` `[d, Q]` (`c` the last entry of
/// the columns), for a state that one mixture alone reads (AttnRes's partial sum): made in the
/// mixture's op, where a table of its own would be one more op and pass over the state each way.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "flex"), allow(dead_code))]
pub(crate) struct OwnLogit {
    /// `W` `[d, Q]`.
    pub weights: Tensor<2>,
    /// `ε`.
    pub epsilon: f64,
}

/// Without Flex there is no fused softmax mixture: the caller composes it.
#[cfg(not(feature = "flex"))]
pub(crate) fn fused_softmax_mix<const D: usize>(
    _tables: &[Tensor<D>],
    _columns: &[usize],
    _states: &[Tensor<D>],
    _slots: &[Option<UnitsGradient>],
    _own: Option<&OwnLogit>,
) -> Option<Tensor<D>> {
    None
}

/// Without Flex there is no fused stream mixing: no value of this type exists.
#[cfg(not(feature = "flex"))]
#[derive(Clone, Debug)]
pub(crate) enum UnitsGradient {}

/// The most mixes of a history on a CubeCL device: a backward kernel keeps one partial sum per
/// later mix over its state in registers. Deeper stacks compose.
#[cfg(any(feature = "flex", feature = "cube-kernels"))]
pub(crate) const MAX_CUBE_MIXES: usize = 64;

/// A history of at most `capacity` mixes for the fused weighted sums of ANCRe and DenseFormer
/// over states like `first`, their weights taken from vectors of the lengths `segments`
/// (`src/backend/history_mix.rs`), where the device has them: Flex in f32 or f64, a CubeCL
/// device in any float type with at most [`MAX_CUBE_MIXES`] mixes, whose buffer of every
/// state (`capacity` of them) [`indexes_in_32_bits`].
pub(crate) fn fused_history<const D: usize>(
    first: &Tensor<D>,
    capacity: usize,
    segments: &[usize],
) -> Option<History> {
    #[cfg(any(feature = "flex", feature = "cube-kernels"))]
    {
        let buffer = first.shape().num_elements().checked_mul(capacity);
        let on_cube = cube_kernels_take(first)
            && capacity <= MAX_CUBE_MIXES
            && buffer.is_some_and(indexes_in_32_bits);
        (has_fused_flex_ops(first) || on_cube)
            .then(|| History::new(first.device().is_autodiff(), capacity, segments))
    }
    #[cfg(not(any(feature = "flex", feature = "cube-kernels")))]
    {
        let _ = (first, capacity, segments);
        None
    }
}

/// Whether `device` (or the device under its autodiff layer) is a LibTorch device.
pub(crate) fn is_libtorch(device: &Device) -> bool {
    #[cfg(feature = "tch")]
    {
        matches!(
            device.clone().without_autodiff().as_dispatch(),
            burn::backend::DispatchDevice::LibTorch(_)
        )
    }
    #[cfg(not(feature = "tch"))]
    {
        let _ = device;
        false
    }
}

/// `norm.forward(input)`; on Flex, LibTorch and CubeCL under autodiff as one op forward and one
/// backward (`backend/layer_norm.rs`), where Burn would differentiate ~9 composed ops.
pub(crate) fn layer_norm<const D: usize>(norm: &LayerNorm, input: Tensor<D>) -> Tensor<D> {
    #[cfg(any(feature = "flex", feature = "tch", feature = "cube-kernels"))]
    {
        layer_norm::layer_norm(norm, input)
    }
    #[cfg(not(any(feature = "flex", feature = "tch", feature = "cube-kernels")))]
    {
        norm.forward(input)
    }
}

/// Whether ops over the last axis of `[..., d]` should run on the rows of one `[rows, d]`
/// matrix. Burn's `Linear` keeps a batched product where each batch's rows fill its tiles, and
/// its backward then writes a `[batch, d, h]` weights' gradient and sums it over the batch:
/// folding the rows saves that on Flex, NdArray and LibTorch (the residual's train step 16%
/// faster on Flex, BENCHMARKS.md). Not on CubeCL, where the fusion engine fuses the batched
/// form's bias and residual adds into its kernels and the reshapes around a folded block split
/// them off again (three more kernels a block on lavapipe).
pub(crate) fn folds_rows(device: &Device) -> bool {
    !is_cube(device)
}

/// `f` on the rows of `input` as one `[rows, d]` matrix, the leading axes restored around its
/// `[rows, e]` result: `[..., d] -> [..., e]`. For ops that act on the last axis alone.
pub(crate) fn on_rows<const D: usize>(
    input: Tensor<D>,
    f: impl FnOnce(Tensor<2>) -> Tensor<2>,
) -> Tensor<D> {
    let mut dims = input.dims();
    let width = dims[D - 1];
    let rows = dims[..D - 1].iter().product::<usize>();
    let output = f(input.reshape([rows, width]));
    dims[D - 1] = output.dims()[1];
    output.reshape(dims)
}

/// `tensor.narrow(dim, start, length)`, or `tensor` itself where that covers the whole axis:
/// Burn's narrow is a slice whatever its range, and a slice's backward is a zero fill and a
/// slice-assign (two kernels on CubeCL) even when it keeps everything.
pub(crate) fn narrow_or_whole<const D: usize>(
    tensor: Tensor<D>,
    dim: usize,
    start: usize,
    length: usize,
) -> Tensor<D> {
    if start == 0 && length == tensor.dims()[dim] {
        tensor
    } else {
        tensor.narrow(dim, start, length)
    }
}

/// Whether `device` has native FFT kernels: Flex's and CubeCL's own, PyTorch's on LibTorch.
pub(crate) fn has_native_fft(device: &Device) -> bool {
    is_flex(device) || is_cube(device) || is_libtorch(device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::device;

    #[test]
    fn backends_are_recognised_under_autodiff() {
        assert!(is_flex(&Device::flex().autodiff()));
        assert!(has_native_fft(&Device::flex().autodiff()));
        assert!(!is_cube(&Device::flex().autodiff()));
        #[cfg(feature = "ndarray")]
        {
            let ndarray = device("ndarray").unwrap().autodiff();
            assert!(!is_flex(&ndarray));
            assert!(!has_native_fft(&ndarray));
            assert!(!is_cube(&ndarray));
        }
        #[cfg(feature = "wgpu")]
        assert!(is_cube(&device("wgpu").unwrap().autodiff()));
        #[cfg(feature = "tch")]
        {
            let libtorch = device("tch").unwrap().autodiff();
            assert!(is_libtorch(&libtorch) && has_native_fft(&libtorch));
            assert!(!is_flex(&libtorch) && !is_cube(&libtorch));
        }
        assert!(!is_libtorch(&Device::flex().autodiff()));
        let _ = device;
    }

    /// The history mix takes a CubeCL device up to its limit of mixes, and composes beyond.
    #[cfg(feature = "wgpu")]
    #[test]
    fn histories_on_cubecl_stop_at_their_limit() {
        let wgpu = device("wgpu").unwrap().autodiff();
        let first = Tensor::<3>::zeros([2, 3, 4], &wgpu);
        assert!(fused_history(&first, MAX_CUBE_MIXES, &[1]).is_some());
        assert!(fused_history(&first, MAX_CUBE_MIXES + 1, &[1]).is_none());
        let flex = Tensor::<3>::zeros([2, 3, 4], &Device::flex());
        assert!(fused_history(&flex, MAX_CUBE_MIXES + 1, &[1]).is_some());
        // A buffer of every state past 2³² entries (64 states of 2²⁶ + 1) composes; 63 fit.
        let large = Tensor::<1>::zeros([(1 << 26) + 1], &wgpu);
        assert!(fused_history(&large, 63, &[1]).is_some());
        assert!(fused_history(&large, 64, &[1]).is_none());
    }

    /// The kernels' 32-bit indices reach `u32::MAX` entries and no further.
    #[test]
    fn indices_stop_at_32_bits() {
        assert!(indexes_in_32_bits(u32::MAX as usize));
        #[cfg(target_pointer_width = "64")]
        assert!(!indexes_in_32_bits(u32::MAX as usize + 1));
    }

    /// Sinkhorn-Knopp's kernel takes matrices up to its limit; larger ones compose.
    #[cfg(feature = "wgpu")]
    #[test]
    fn sinkhorn_on_cubecl_stops_at_its_limit() {
        let wgpu = device("wgpu").unwrap();
        let n = MAX_CUBE_SINKHORN;
        assert!(has_fused_sinkhorn(&Tensor::<3>::zeros([2, n, n], &wgpu)));
        assert!(!has_fused_sinkhorn(&Tensor::<3>::zeros(
            [2, n + 1, n + 1],
            &wgpu
        )));
        assert!(has_fused_sinkhorn(&Tensor::<3>::zeros(
            [2, n + 1, n + 1],
            &Device::flex()
        )));
    }
}
