//! LayerNorm under autodiff as one op forward and one backward, on Flex, LibTorch and CubeCL.
//!
//! ```text
//! y = (x − μ) r γ + β,    μ = mean(x),  r = 1/√(var(x) + ε)   (over the last axis)
//! ∂β = Σ_rows ∂y,    ∂γ = Σ_rows ∂y ⊙ x̂,    ∂x = r (g − mean(g) − x̂ mean(g ⊙ x̂)),  g = ∂y ⊙ γ
//! ```
//!
//! Burn 0.22.1's autodiff has no LayerNorm op of its own: it differentiates the composed default
//! of `ModuleOps::layer_norm` (mean, centre, square, mean, add, sqrt, divide, scale, shift), ~9
//! full-size tensor ops forward and about twice that backward, and keeps the centred input and
//! `x̂` for them: two full-size tensors per norm. The fused op keeps only `x`, which is the stream
//! the norm reads; a connectivity that mixes earlier states (ANCRe, H-ACN's gates) keeps that
//! same buffer, so the states it needs cost no memory beyond the norm's.
//!
//! - Flex ([`flex`]): Flex's own fused forward, and a backward that recomputes `μ`, `r`, `x̂` row
//!   by row and writes `∂x` in one pass, summing `∂γ`, `∂β` on the way.
//! - LibTorch ([`libtorch`]): PyTorch's LayerNorm forward and backward.
//! - CubeCL ([`cube`], f32, f16 and bf16, summing in f32): Burn's composed forward (for f16 in
//!   f32, as burn-nn's `LayerNorm` takes it), which the fusion engine merges with the ops
//!   around it (a kernel of its own would stop the elementwise ops before it from joining the
//!   norm's reductions); backward one kernel over the rows and one reduction of its partial
//!   sums of `∂γ`, `∂β`. Composed, the backward launched about 20 full-size kernels per norm
//!   (CubeCL's backward passes do not fuse).

// burn-tch (named in the op's dispatch) is deprecated upstream, to be removed in a later Burn.
#![cfg_attr(feature = "tch", allow(deprecated))]

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::nn::LayerNorm;
use burn::tensor::{DType, Tensor};

use super::autodiff::constant;
use super::{is_cube, is_flex, is_libtorch};

#[cfg(feature = "cube-kernels")]
mod cube;
#[cfg(feature = "flex")]
mod flex;
#[cfg(feature = "tch")]
mod libtorch;

/// LayerNorm as one op forward and one backward (see the [module docs](self)).
#[backend_extension(
    Cube: cfg(feature = "cube-kernels"),
    Fusion: cfg(feature = "cube-kernels"),
    Flex: cfg(feature = "flex"),
    LibTorch: cfg(feature = "tch"),
    Autodiff
)]
pub(crate) trait LayerNormBackend: Backend {
    /// `(x − μ) r γ + β` over the last axis. Under autodiff the forward is the inner backend's
    /// own `ModuleOps::layer_norm` (Flex's and LibTorch's kernels; on CubeCL Burn's composed ops,
    /// which the fusion engine fuses with the ops around them), and the backward is
    /// [`fused_layer_norm_backward`](Self::fused_layer_norm_backward); the backends' own
    /// `fused_layer_norm` is that same `layer_norm`.
    #[fusion(dtype = x, shape = x)]
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self>;

    /// `(∂x, ∂γ, ∂β)` for the output gradient `grad`.
    #[fusion(meta = |x, gamma, beta, _, _| (x.clone(), gamma.clone(), beta.clone()))]
    fn fused_layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// `norm.forward(input)`; under autodiff with a bias, on Flex and LibTorch (f32 or f64) and on
/// CubeCL (f32, f16 or bf16), through the fused op, elsewhere Burn's.
pub(crate) fn layer_norm<const D: usize>(norm: &LayerNorm, input: Tensor<D>) -> Tensor<D> {
    match fused_parts(norm, &input) {
        Some((gamma, beta, epsilon)) => {
            Tensor::from_dispatch(<Dispatch as LayerNormBackend>::fused_layer_norm(
                input.into_dispatch(),
                gamma.into_dispatch(),
                beta.into_dispatch(),
                epsilon,
            ))
        }
        None => norm.forward(input),
    }
}

/// The `ε` of `norm`, read from its display (`LayerNorm {d_model: 8, epsilon: 0.00001, …}`):
/// burn-nn 0.22.1 keeps the field private and out of the record. `None` if the display changes.
fn epsilon(norm: &LayerNorm) -> Option<f64> {
    let shown = norm.to_string();
    let (_, after) = shown.split_once("epsilon: ")?;
    let end = after.find([',', '}', ' ', '\n']).unwrap_or(after.len());
    after[..end].parse().ok()
}

/// `γ`, `β` and `ε` of `norm` where [`layer_norm`] runs the fused op: Flex, LibTorch or CubeCL
/// under autodiff, a bias, input and parameters of one float type (f32 or f64; on CubeCL f32,
/// f16 or bf16, whose kernel sums half types in f32), of matching width; on CubeCL an input whose entries
/// [`indexes_in_32_bits`](super::indexes_in_32_bits).
fn fused_parts<const D: usize>(
    norm: &LayerNorm,
    input: &Tensor<D>,
) -> Option<(Tensor<1>, Tensor<1>, f64)> {
    let device = input.device();
    let cube = is_cube(&device);
    // The CubeCL kernels index in 32 bits.
    let on_cube = cube && super::indexes_in_32_bits(input.shape().num_elements());
    if !device.is_autodiff() || !(is_flex(&device) || is_libtorch(&device) || on_cube) {
        return None;
    }
    let dtype = input.dtype();
    let (gamma, beta) = (norm.gamma.val(), norm.beta.as_ref()?.val());
    let float_type = if cube {
        matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
    } else {
        matches!(dtype, DType::F32 | DType::F64)
    };
    let fusable = float_type
        && gamma.dtype() == dtype
        && beta.dtype() == dtype
        && input.dims()[D - 1] == gamma.dims()[0];
    if !fusable {
        return None;
    }
    Some((gamma, beta, epsilon(norm)?))
}

/// The inner backend's `layer_norm`, in f32 for f16 as burn-nn's `LayerNorm` computes it: in f16
/// the centred squares' sum passes f16's largest value (65504) once a row's deviations reach an
/// RMS of `√(65504 / width)` (23 at width 128) and the output is `β`. On CubeCL the casts are
/// elementwise ops that the fusion engine merges with the norm's own; bf16 has f32's range and
/// is left as it is, as burn-nn leaves it.
fn forward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    epsilon: f64,
) -> FloatTensor<B> {
    use burn::backend::TensorMetadata;
    use burn::tensor::FloatDType;
    if x.dtype() != DType::F16 {
        return B::layer_norm(x, gamma, Some(beta), epsilon);
    }
    let wide = |tensor| B::float_cast(tensor, FloatDType::F32);
    let output = B::layer_norm(wide(x), wide(gamma), Some(wide(beta)), epsilon);
    B::float_cast(output, FloatDType::F16)
}

/// The fused LayerNorm under autodiff: parents `[x, γ, β]`.
#[derive(Debug)]
struct FusedLayerNorm;

impl<B: LayerNormBackend> Backward<B, 3> for FusedLayerNorm {
    /// `x` (checkpointed: under autodiff it is the very buffer of the stream), `γ`, `β`, `ε`.
    type State = (NodeId, FloatTensor<B>, FloatTensor<B>, f64);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, gamma, beta, epsilon) = ops.state;
        let x = checkpointer.retrieve_node_output(x);
        let (grad_x, grad_gamma, grad_beta) =
            B::fused_layer_norm_backward(x, gamma, beta, epsilon, grad);
        register_tracked!(grads, ops.parents, [grad_x, grad_gamma, grad_beta]);
    }
}

impl<B: LayerNormBackend, C: CheckpointStrategy> LayerNormBackend for Autodiff<B, C> {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        match FusedLayerNorm
            .prepare::<C>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let x_state = prep.checkpoint(&x);
                let (x, gamma, beta) = (
                    x.into_primitive(),
                    gamma.into_primitive(),
                    beta.into_primitive(),
                );
                let output = forward::<B>(x, gamma.clone(), beta.clone(), epsilon);
                prep.finish((x_state, gamma, beta, epsilon), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward::<B>(
                x.into_primitive(),
                gamma.into_primitive(),
                beta.into_primitive(),
                epsilon,
            )),
        }
    }

    // First-order only: the gradients are constants to the graph.
    fn fused_layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (grad_x, grad_gamma, grad_beta) = B::fused_layer_norm_backward(
            x.into_primitive(),
            gamma.into_primitive(),
            beta.into_primitive(),
            epsilon,
            grad.into_primitive(),
        );
        (
            constant::<B, C>(grad_x),
            constant::<B, C>(grad_gamma),
            constant::<B, C>(grad_beta),
        )
    }
}

#[cfg(test)]
mod tests {
    use burn::module::Param;
    use burn::nn::{LayerNorm, LayerNormConfig};
    use burn::prelude::*;
    use burn::tensor::{DType, Distribution, Tolerance};

    use super::{epsilon, fused_parts, layer_norm};

    /// `ε` read back exactly, for the widths and values models use.
    #[test]
    fn epsilon_is_read_from_the_display() {
        let device = Device::flex();
        for value in [1e-5, 1e-6, 1e-12, 0.1, 2.5] {
            let norm = LayerNormConfig::new(8).with_epsilon(value).init(&device);
            assert_eq!(epsilon(&norm), Some(value));
        }
    }

    /// A norm of width `width` with random `γ`, `β`, `ε` = 1e-3.
    fn norm_with_random_affine(device: &Device, dtype: DType, width: usize) -> LayerNorm {
        let mut norm = LayerNormConfig::new(width).with_epsilon(1e-3).init(device);
        let uniform = |low, high| {
            let values = Tensor::<1>::random([width], Distribution::Uniform(low, high), device);
            Param::from_tensor(values.cast(dtype))
        };
        norm.gamma = uniform(0.5, 1.5);
        norm.beta = Some(uniform(-0.5, 0.5));
        norm
    }

    /// The fused op against Burn's composed LayerNorm on the same device: forward and the
    /// gradients of `x`, `γ` and `β`, on a transposed (non-contiguous) `[3, rows, width]` input;
    /// `fused_run` wraps the fused pass (LibTorch: PyTorch's gradients off).
    fn fused_matches_burns(
        device: &Device,
        dtype: DType,
        [rows, width]: [usize; 2],
        tolerance: f64,
        fused_run: impl FnOnce(&dyn Fn() -> [TensorData; 4]) -> [TensorData; 4],
    ) {
        let device = device.clone().autodiff();
        let norm = norm_with_random_affine(&device, dtype, width);
        let x = Tensor::<3>::random([width, rows, 3], Distribution::Normal(1.0, 2.0), &device)
            .cast(dtype)
            .swap_dims(0, 2)
            .require_grad();
        assert!(fused_parts(&norm, &x).is_some());
        let weights =
            Tensor::<3>::random([3, rows, width], Distribution::Normal(0.0, 1.0), &device)
                .cast(dtype);
        let run = |fused: bool| {
            let y = if fused {
                layer_norm(&norm, x.clone())
            } else {
                norm.forward(x.clone())
            };
            let grads = (y.clone() * weights.clone()).sum().backward();
            let beta = norm.beta.as_ref().expect("a bias");
            [
                y.inner().into_data(),
                x.grad(&grads).expect("∂x").into_data(),
                norm.gamma.grad(&grads).expect("∂γ").into_data(),
                beta.grad(&grads).expect("∂β").into_data(),
            ]
        };
        let fused = fused_run(&|| run(true));
        for (fused, composed) in fused.into_iter().zip(run(false)) {
            assert_eq!(fused.dtype(), dtype);
            let tolerance = Tolerance::absolute(tolerance).set_relative(tolerance);
            fused.assert_approx_eq::<f64>(&composed, tolerance);
        }
    }

    #[cfg(feature = "flex")]
    #[test]
    fn flex_matches_burns_composed_layer_norm() {
        // f32: ∂γ and ∂β sum 210 rows of terms of order 1, in another order than Burn's: 1e-5
        // failed about once in a few hundred random draws (1.4e-5), 3e-5 leaves room for that.
        // Width 27: three full lanes of eight and a rest; 210 rows: several parallel tasks.
        fused_matches_burns(&Device::flex(), DType::F32, [70, 27], 3e-5, |run| run());
        fused_matches_burns(&Device::flex(), DType::F64, [70, 27], 1e-12, |run| run());
    }

    /// The kernels on wgpu: a row narrower than a cube (27 of 32 units), one of several elements
    /// per unit with a rest (300: two per unit of 256, the second partly) and more rows than
    /// backward cubes (1650 rows: several rows per cube, the last cube's run cut short).
    #[cfg(feature = "wgpu")]
    #[test]
    fn kernels_match_burns_composed_layer_norm() {
        let wgpu = crate::device::device("wgpu").unwrap();
        for shape in [[70, 27], [40, 300], [550, 96]] {
            fused_matches_burns(&wgpu, DType::F32, shape, 1e-4, |run| run());
        }
    }

    /// In f16 on wgpu the kernel sums in f32 and rounds each result once: `y`, `∂x`, `∂γ` and
    /// `∂β` are within 16 of f16's unit roundoffs of the f32 op's (relative to each tensor's
    /// largest entry), on 1650 rows whose `∂γ` and `∂β` sums cancel (random weights), with
    /// deviations of 2 and of 64 (a row's centred squares then sum to 4·10⁵, past f16's
    /// largest value: a forward that sums them in f16 gives `y = β`, off by about 1). A kernel
    /// that read a half tensor as f32, or summed the wrong rows, is off by far more.
    #[cfg(feature = "wgpu")]
    #[test]
    fn kernels_in_f16_are_as_close_to_f32_as_f16_allows() {
        let device = crate::device::device("wgpu").unwrap().autodiff();
        let [rows, width] = [550, 96];
        let norm = norm_with_random_affine(&device, DType::F32, width);
        let weights =
            Tensor::<3>::random([3, rows, width], Distribution::Normal(0.0, 1.0), &device);
        for deviation in [2.0, 64.0] {
            let x = Tensor::<3>::random(
                [3, rows, width],
                Distribution::Normal(1.0, deviation),
                &device,
            );
            let run = |dtype: DType| {
                // Leaves in `dtype`, made from data: a cast under autodiff is not a leaf.
                let cast = |param: &Param<Tensor<1>>| {
                    Param::from_tensor(Tensor::from_data(param.val().to_data(), (&device, dtype)))
                };
                let mut norm = norm.clone();
                norm.gamma = cast(&norm.gamma);
                norm.beta = norm.beta.as_ref().map(cast);
                let x = Tensor::<3>::from_data(x.to_data(), (&device, dtype)).require_grad();
                assert_eq!(x.dtype(), dtype);
                assert!(fused_parts(&norm, &x).is_some(), "{dtype:?}");
                let y = layer_norm(&norm, x.clone());
                let grads = (y.clone() * weights.clone().cast(dtype)).sum().backward();
                let beta = norm.beta.as_ref().expect("a bias");
                [
                    y.detach(),
                    x.grad(&grads).expect("∂x"),
                    norm.gamma.grad(&grads).expect("∂γ").unsqueeze(),
                    beta.grad(&grads).expect("∂β").unsqueeze(),
                ]
                .map(|tensor| tensor.into_data())
            };
            let case = format!("LayerNorm in f16, deviation {deviation}");
            let errors = crate::test_util::scaled_errors(&run(DType::F16), &run(DType::F32), &case);
            for (name, error) in ["y", "∂x", "∂γ", "∂β"].iter().zip(errors) {
                assert!(
                    error <= 16.0 / 2048.0,
                    "{case}, {name}: {error:e} of its scale"
                );
            }
        }
    }

    #[cfg(feature = "tch")]
    #[test]
    fn libtorch_matches_burns_composed_layer_norm() {
        let run_without_pytorch_grads = |run: &dyn Fn() -> [TensorData; 4]| tch::no_grad(run);
        fused_matches_burns(
            &Device::libtorch(),
            DType::F32,
            [70, 27],
            1e-5,
            run_without_pytorch_grads,
        );
    }

    /// Elsewhere (no autodiff, or a backend without the op) it is Burn's LayerNorm.
    #[test]
    fn fused_only_under_autodiff_on_flex_libtorch_or_cubecl() {
        let device = Device::flex();
        let norm = norm_with_random_affine(&device, DType::F32, 27);
        let x = Tensor::<2>::random([4, 27], Distribution::Normal(0.0, 1.0), &device);
        assert!(fused_parts(&norm, &x).is_none());
        assert!(fused_parts(&norm, &x.clone().cast(DType::F16)).is_none());
        let autodiff = device.autodiff();
        let x = Tensor::<2>::from_data(x.to_data(), &autodiff);
        let autodiff = norm_with_random_affine(&autodiff, DType::F32, 27);
        assert!(fused_parts(&autodiff, &x).is_some());
        let mut without_bias = autodiff;
        without_bias.beta = None;
        assert!(fused_parts(&without_bias, &x).is_none());
        #[cfg(feature = "ndarray")]
        {
            let ndarray = crate::device::device("ndarray").unwrap().autodiff();
            let norm = norm_with_random_affine(&ndarray, DType::F32, 27);
            assert!(fused_parts(&norm, &x.clone().to_device(&ndarray)).is_none());
        }
        #[cfg(feature = "wgpu")]
        {
            for wgpu in [false, true].map(|tracked| {
                let wgpu = crate::device::device("wgpu").unwrap();
                if tracked { wgpu.autodiff() } else { wgpu }
            }) {
                let norm = norm_with_random_affine(&wgpu, DType::F32, 27);
                let x = Tensor::<2>::from_data(x.to_data(), &wgpu);
                assert_eq!(fused_parts(&norm, &x).is_some(), wgpu.is_autodiff());
            }
        }
    }

    /// Under Burn's gradient checkpointing (which may recompute the norm's input rather than
    /// keep it) the gradients are those of the plain autodiff.
    #[cfg(feature = "flex")]
    #[test]
    fn gradient_checkpointing_gives_the_same_gradients() {
        let flex = Device::flex();
        let template = norm_with_random_affine(&flex, DType::F32, 27);
        let x = Tensor::<2>::random([90, 27], Distribution::Normal(0.0, 1.0), &flex);
        let run = |device: Device| {
            let copy = |tensor: Tensor<1>| {
                Param::from_tensor(Tensor::from_data(tensor.to_data(), &device).require_grad())
            };
            let mut norm = LayerNormConfig::new(27).with_epsilon(1e-3).init(&device);
            norm.gamma = copy(template.gamma.val());
            norm.beta = template.beta.as_ref().map(|beta| copy(beta.val()));
            let x = Tensor::<2>::from_data(x.to_data(), &device).require_grad();
            // A memory-bound op between the leaf and the norm, which checkpointing recomputes.
            let y = layer_norm(&norm, x.clone().exp() + 1.0);
            let grads = (y.clone() * y).sum().backward();
            [
                x.grad(&grads).expect("∂x").into_data(),
                norm.gamma.grad(&grads).expect("∂γ").into_data(),
            ]
        };
        let plain = run(flex.clone().autodiff());
        let checkpointed = run(flex.autodiff().gradient_checkpointing());
        for (plain, checkpointed) in plain.iter().zip(&checkpointed) {
            plain.assert_eq(checkpointed, true);
        }
    }
}
