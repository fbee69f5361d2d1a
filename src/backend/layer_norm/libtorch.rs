//! LayerNorm on LibTorch: PyTorch's own kernels forward and backward.
//!
//! The forward is LibTorch's `layer_norm` (what burn-tch runs without autodiff). tch exposes no
//! `native_layer_norm_backward`, so the backward recomputes the (cheap, fused) forward on
//! detached leaves and lets PyTorch's autograd differentiate `⟨y, ∂y⟩` with respect to `x`, `γ`
//! and `β`: four kernels (norm, dot, scale, norm backward) rather than ~18.

// burn-tch is deprecated upstream (to be removed in a later Burn); this module goes with it.
#![allow(deprecated)]

use burn_tch::{LibTorch, TchTensor};

use super::LayerNormBackend;

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
