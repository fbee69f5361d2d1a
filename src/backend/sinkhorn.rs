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
//!   mHC's `sinkhorn_knopp`; ε is the caller's).
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
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::Tensor;

use super::autodiff::{constant, tracked_op};

#[cfg(feature = "cube-kernels")]
pub(super) mod cube;
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
    /// `T` iterations of Sinkhorn-Knopp on each matrix, with `ε = epsilon`.
    #[fusion(dtype = logits, shape = logits)]
    fn sinkhorn(
        logits: FloatTensor<Self>,
        n: usize,
        iterations: usize,
        epsilon: f64,
    ) -> FloatTensor<Self>;

    /// The gradient with respect to the logits, given the gradient of the output.
    #[fusion(dtype = logits, shape = logits)]
    fn sinkhorn_backward(
        logits: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        n: usize,
        iterations: usize,
        epsilon: f64,
    ) -> FloatTensor<Self>;
}

/// Sinkhorn-Knopp through the fused op (CubeCL or Flex devices): `logits` is `[batch, n²]`.
/// Zero iterations run one, as the composed form does (its first column normalisation comes
/// before the loop); the backward's step count `2T − 1` needs `T ≥ 1`.
pub(crate) fn fused_sinkhorn(
    logits: Tensor<2>,
    n: usize,
    iterations: usize,
    epsilon: f64,
) -> Tensor<2> {
    let iterations = iterations.max(1);
    let output =
        <Dispatch as SinkhornBackend>::sinkhorn(logits.into_dispatch(), n, iterations, epsilon);
    Tensor::from_dispatch(output)
}

impl<B: SinkhornBackend, C: CheckpointStrategy> SinkhornBackend for Autodiff<B, C> {
    fn sinkhorn(
        logits: FloatTensor<Self>,
        n: usize,
        iterations: usize,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct SinkhornKnopp;

        impl<B: SinkhornBackend> Backward<B, 1> for SinkhornKnopp {
            type State = (NodeId, usize, usize, f64);

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                checkpointer: &mut Checkpointer,
            ) {
                let [parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (logits, n, iterations, epsilon) = ops.state;
                let logits = checkpointer.retrieve_node_output(logits);
                if let Some(parent) = parent {
                    grads.register::<B>(
                        parent.id,
                        B::sinkhorn_backward(logits, grad, n, iterations, epsilon),
                    );
                }
            }
        }

        tracked_op::<B, C, _, _>(
            SinkhornKnopp,
            [logits],
            |[logits]| B::sinkhorn(logits, n, iterations, epsilon),
            |[logits], _| (logits, n, iterations, epsilon),
        )
    }

    fn sinkhorn_backward(
        logits: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        n: usize,
        iterations: usize,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        // First-order only: the result is a constant to the graph.
        let output = B::sinkhorn_backward(
            logits.into_primitive(),
            grad.into_primitive(),
            n,
            iterations,
            epsilon,
        );
        constant::<B, C>(output)
    }
}
