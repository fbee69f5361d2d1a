//! Sinkhorn-Knopp as one op per pass, with its own backward: a CubeCL kernel ([`cube`]) and a
//! CPU loop on Flex ([`flex`]).
//!
//! Composed from tensor ops, `T` iterations of Sinkhorn-Knopp cost two launches each on CubeCL
//! (a small product for the sums, a fused division), ~`2T` launches forward and as many backward,
//! and on Flex ~`6T` small ops, each with its dispatch and fresh buffer. Here one thread owns one
//! `n × n` matrix and runs every iteration in registers:
//!
//! - forward: `P = softmax_rows(L) + ε`, then `M ← M / (colsum(M) + ε)` once and
//!   `(M ← M / (rowsum(M) + ε), M ← M / (colsum(M) + ε))` `T − 1` times (exactly
//!   [`crate::mhc::sinkhorn_knopp`]).
//! - backward: every iterate is a diagonal scaling of `P`, `M_k = diag(r) P diag(c)`; the kernel
//!   reruns the forward keeping only the `2T − 1` denominator vectors `s_k`, then walks back:
//!   for a row step `∂M_ij = (∂M'_ij − Σ_l ∂M'_il M'_il) / s_i` and `r ← r ⊙ s` (columns
//!   alike), and ends with the softmax's `∂L_ij = S_ij (∂P_ij − Σ_l ∂P_il S_il)`.
//!
//! The CubeCL backends get the kernels through the `cube-kernels` feature (on with `wgpu`,
//! `vulkan`, `metal`, `cuda`), Flex through `flex` (f32 and f64); other backends use the
//! composed form. Not differentiable twice.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::Tensor;

#[cfg(feature = "cube-kernels")]
mod cube;
#[cfg(feature = "flex")]
mod flex;

/// Sinkhorn-Knopp over the last axis of `[batch, n²]` logits (row-major `n × n` matrices).
#[backend_extension(
    Cube: cfg(feature = "cube-kernels"),
    Fusion: cfg(feature = "cube-kernels"),
    Flex: cfg(feature = "flex"),
    Autodiff
)]
pub(crate) trait SinkhornBackend: Backend {
    /// `T` iterations of Sinkhorn-Knopp on each matrix.
    #[fusion(dtype = logits, shape = logits)]
    fn sinkhorn(logits: FloatTensor<Self>, n: usize, iterations: usize) -> FloatTensor<Self>;

    /// The gradient with respect to the logits, given the gradient of the output.
    #[fusion(dtype = logits, shape = logits)]
    fn sinkhorn_backward(
        logits: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        n: usize,
        iterations: usize,
    ) -> FloatTensor<Self>;
}

/// Sinkhorn-Knopp through the fused op (CubeCL or Flex devices): `logits` is `[batch, n²]`.
pub(crate) fn fused_sinkhorn(logits: Tensor<2>, n: usize, iterations: usize) -> Tensor<2> {
    let output = <Dispatch as SinkhornBackend>::sinkhorn(logits.into_dispatch(), n, iterations);
    Tensor::from_dispatch(output)
}

impl<B: SinkhornBackend, C: CheckpointStrategy> SinkhornBackend for Autodiff<B, C> {
    fn sinkhorn(logits: FloatTensor<Self>, n: usize, iterations: usize) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct SinkhornKnopp;

        impl<B: SinkhornBackend> Backward<B, 1> for SinkhornKnopp {
            type State = (NodeId, usize, usize);

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                checkpointer: &mut Checkpointer,
            ) {
                let [parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (logits, n, iterations) = ops.state;
                let logits = checkpointer.retrieve_node_output(logits);
                if let Some(parent) = parent {
                    grads.register::<B>(
                        parent.id,
                        B::sinkhorn_backward(logits, grad, n, iterations),
                    );
                }
            }
        }

        match SinkhornKnopp
            .prepare::<C>([logits.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&logits), n, iterations);
                prep.finish(state, B::sinkhorn(logits.into_primitive(), n, iterations))
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::sinkhorn(logits.into_primitive(), n, iterations))
            }
        }
    }

    fn sinkhorn_backward(
        logits: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        n: usize,
        iterations: usize,
    ) -> FloatTensor<Self> {
        // First-order only: the result is a constant to the graph.
        let output = B::sinkhorn_backward(
            logits.into_primitive(),
            grad.into_primitive(),
            n,
            iterations,
        );
        <Self as burn::backend::AutodiffBackend>::from_inner(output)
    }
}

#[cfg(test)]
mod tests {
    use burn::prelude::*;
    use burn::tensor::{Distribution, Tolerance};

    use super::fused_sinkhorn;
    use crate::mhc::{MHC_EPS, sinkhorn_composed};

    /// The fused op against the composed operations on the same device, forward and gradient,
    /// for several sizes, iteration counts and logit scales.
    fn fused_matches_composed(device: &Device) {
        assert_eq!(MHC_EPS, 1e-6);
        let device = device.clone().autodiff();
        for (n, iterations, batch, scale) in [(4, 20, 37, 1.0), (3, 1, 5, 3.0), (2, 7, 300, 0.1)] {
            let logits =
                Tensor::<2>::random([batch, n * n], Distribution::Normal(0.0, scale), &device);
            let weights =
                Tensor::<2>::random([batch, n * n], Distribution::Normal(0.0, 1.0), &device);
            let run = |fused: bool| {
                let leaf = logits.clone().detach().require_grad();
                let output = if fused {
                    fused_sinkhorn(leaf.clone(), n, iterations)
                } else {
                    sinkhorn_composed(leaf.clone().reshape([batch, n, n]), iterations)
                        .reshape([batch, n * n])
                };
                let grads = (output.clone() * weights.clone()).sum().backward();
                (output, leaf.grad(&grads).unwrap())
            };
            let (fused, fused_grad) = run(true);
            let (composed, composed_grad) = run(false);
            let tolerance = Tolerance::absolute(2e-5).set_relative(1e-4);
            fused
                .into_data()
                .assert_approx_eq::<f32>(&composed.into_data(), tolerance);
            fused_grad
                .into_data()
                .assert_approx_eq::<f32>(&composed_grad.into_data(), tolerance);
        }
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn kernels_match_the_composed_operations() {
        fused_matches_composed(&crate::backend::device("wgpu").unwrap());
    }

    #[cfg(feature = "flex")]
    #[test]
    fn flex_op_matches_the_composed_operations() {
        fused_matches_composed(&Device::flex());
    }
}
