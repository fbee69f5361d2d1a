//! LayerNorm on LibTorch under autodiff as PyTorch's own LayerNorm, forward and backward.
//!
//! ```text
//! y = (x − μ) r γ + β,    μ = mean(x),  r = 1/√(var(x) + ε)   (over the last axis)
//! ∂β = Σ_rows ∂y,    ∂γ = Σ_rows ∂y ⊙ x̂,    ∂x = r (g − mean(g) − x̂ mean(g ⊙ x̂)),  g = ∂y ⊙ γ
//! ```
//!
//! Burn 0.22.1's autodiff has no LayerNorm op of its own: it differentiates the composed default
//! of `ModuleOps::layer_norm` (mean, centre, square, mean, add, sqrt, divide, scale, shift), ~9
//! full-size tensor ops forward and about twice that backward, each a LibTorch call, where
//! PyTorch runs one LayerNorm kernel each way. Here the forward is LibTorch's `layer_norm` (what
//! burn-tch runs without autodiff) and the backward PyTorch's own: tch exposes no
//! `native_layer_norm_backward`, so it recomputes the (cheap, fused) forward on detached leaves
//! and lets PyTorch's autograd differentiate `⟨y, ∂y⟩` with respect to `x`, `γ` and `β`: four
//! kernels (norm, dot, scale, norm backward) rather than ~18.

// burn-tch is deprecated upstream (to be removed in a later Burn); this module goes with it.
#![allow(deprecated)]

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, Dispatch, backend_extension};
use burn::nn::LayerNorm;
use burn::tensor::{DType, Tensor};
use burn_tch::{LibTorch, TchTensor};

use super::is_libtorch;

/// LayerNorm as one op forward and one backward (see the [module docs](self)).
#[backend_extension(LibTorch: cfg(feature = "tch"), Autodiff)]
pub(crate) trait LayerNormBackend: Backend {
    /// `(x − μ) r γ + β` over the last axis.
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self>;

    /// `(∂x, ∂γ, ∂β)` for the output gradient `grad`.
    fn fused_layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// `norm.forward(input)`; on LibTorch under autodiff (f32 or f64, with a bias) through the fused
/// op, elsewhere Burn's.
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

/// `γ`, `β` and `ε` of `norm` where [`layer_norm`] runs the fused op: LibTorch under autodiff,
/// a bias, input and parameters of one float type, f32 or f64, of matching width.
fn fused_parts<const D: usize>(
    norm: &LayerNorm,
    input: &Tensor<D>,
) -> Option<(Tensor<1>, Tensor<1>, f64)> {
    let device = input.device();
    if !device.is_autodiff() || !is_libtorch(&device) {
        return None;
    }
    let dtype = input.dtype();
    let (gamma, beta) = (norm.gamma.val(), norm.beta.as_ref()?.val());
    let fusable = matches!(dtype, DType::F32 | DType::F64)
        && gamma.dtype() == dtype
        && beta.dtype() == dtype
        && input.dims()[D - 1] == gamma.dims()[0];
    if !fusable {
        return None;
    }
    Some((gamma, beta, epsilon(norm)?))
}

fn normalized_width(x: &tch::Tensor) -> i64 {
    *x.size().last().expect("LayerNorm of a tensor of rank ≥ 1")
}

impl LayerNormBackend for LibTorch {
    fn fused_layer_norm(
        x: TchTensor,
        gamma: TchTensor,
        beta: TchTensor,
        epsilon: f64,
    ) -> TchTensor {
        let width = normalized_width(&x.tensor);
        TchTensor::new(x.tensor.layer_norm(
            [width],
            Some(&gamma.tensor),
            Some(&beta.tensor),
            epsilon,
            true,
        ))
    }

    fn fused_layer_norm_backward(
        x: TchTensor,
        gamma: TchTensor,
        beta: TchTensor,
        epsilon: f64,
        grad: TchTensor,
    ) -> (TchTensor, TchTensor, TchTensor) {
        let width = normalized_width(&x.tensor);
        // Fresh leaves: PyTorch's autograd records only this recomputation (with gradients on
        // even where the caller turned PyTorch's off for its thread).
        let leaf = |tensor: &tch::Tensor| tensor.detach().set_requires_grad(true);
        let (x, gamma, beta) = (leaf(&x.tensor), leaf(&gamma.tensor), leaf(&beta.tensor));
        let gradients = tch::with_grad(|| {
            let y = x.layer_norm([width], Some(&gamma), Some(&beta), epsilon, true);
            let objective = y.reshape([-1]).dot(&grad.tensor.reshape([-1]));
            tch::Tensor::run_backward(&[objective], &[&x, &gamma, &beta], false, false)
        });
        let [grad_x, grad_gamma, grad_beta]: [tch::Tensor; 3] =
            gradients.try_into().expect("one gradient per input");
        (
            TchTensor::new(grad_x),
            TchTensor::new(grad_gamma),
            TchTensor::new(grad_beta),
        )
    }
}

/// The fused LayerNorm under autodiff: parents `[x, γ, β]`.
#[derive(Debug)]
struct FusedLayerNorm;

impl<B: LayerNormBackend> Backward<B, 3> for FusedLayerNorm {
    /// `x`, `γ`, `β` and `ε`.
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, f64);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, gamma, beta, epsilon) = ops.state;
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
            OpsKind::Tracked(prep) => {
                let (x, gamma, beta) = (
                    x.into_primitive(),
                    gamma.into_primitive(),
                    beta.into_primitive(),
                );
                let output = B::fused_layer_norm(x.clone(), gamma.clone(), beta.clone(), epsilon);
                prep.finish((x, gamma, beta, epsilon), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_layer_norm(
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
            Self::from_inner(grad_x),
            Self::from_inner(grad_gamma),
            Self::from_inner(grad_beta),
        )
    }
}

#[cfg(test)]
mod tests {
    use burn::module::Param;
    use burn::nn::LayerNormConfig;
    use burn::prelude::*;
    use burn::tensor::{Distribution, Tolerance};

    use super::{epsilon, fused_parts, layer_norm};

    /// `ε` read back exactly, for the widths and values models use.
    #[test]
    fn epsilon_is_read_from_the_display() {
        let device = Device::libtorch();
        for value in [1e-5, 1e-6, 1e-12, 0.1, 2.5] {
            let norm = LayerNormConfig::new(8).with_epsilon(value).init(&device);
            assert_eq!(epsilon(&norm), Some(value));
        }
    }

    /// The fused op against Burn's composed LayerNorm on LibTorch: forward and the gradients of
    /// `x`, `γ` and `β`, with non-trivial `γ`, `β`, `ε` and a transposed (non-contiguous) input.
    #[test]
    fn fused_layer_norm_matches_burns() {
        let device = Device::libtorch().autodiff();
        let mut norm = LayerNormConfig::new(24).with_epsilon(1e-3).init(&device);
        let uniform = |low, high| {
            Param::from_tensor(Tensor::random(
                [24],
                Distribution::Uniform(low, high),
                &device,
            ))
        };
        norm.gamma = uniform(0.5, 1.5);
        norm.beta = Some(uniform(-0.5, 0.5));
        let x = Tensor::<3>::random([24, 5, 3], Distribution::Normal(1.0, 2.0), &device)
            .swap_dims(0, 2)
            .require_grad();
        assert!(fused_parts(&norm, &x).is_some());
        let weights = Tensor::<3>::random([3, 5, 24], Distribution::Normal(0.0, 1.0), &device);
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
        // The fused run with PyTorch's gradients off for the thread, as a caller may have them.
        let fused = tch::no_grad(|| run(true));
        for (fused, composed) in fused.into_iter().zip(run(false)) {
            fused.assert_approx_eq::<f32>(&composed, Tolerance::absolute(1e-5));
        }
    }
}
