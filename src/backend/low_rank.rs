//! A residual update with a low-rank term, `y = s + h + (s A) B`, as one fused CPU op on Flex
//! with its own backward.
//!
//! For rows `s`, `h` (`[R, d]`), `A` (`[d, r]`) and `B` (`[r, d]`), with `t = s A` (`[R, r]`)
//! and the output's gradient `g`:
//!
//! ```text
//! y  = s + h + t B
//! ∂s = g + (g Bᵀ) Aᵀ      ∂h = g      ∂A = sᵀ (g Bᵀ)      ∂B = tᵀ g
//! ```
//!
//! Composed from tensor ops the forward writes `t B` and two sums, and the backward writes
//! `(g Bᵀ) Aᵀ` and adds it to `g`, under autodiff nodes of their own. Here both run on bands of
//! rows in parallel, each band through every step while it is in cache: forward a product
//! into the band's `t`, one pass for `s + h` and an accumulating product into it; backward the
//! band's `u = g Bᵀ`, a copy of `g` with `u Aᵀ` accumulated into it, and the band's shares of
//! `∂A` and `∂B`, summed over the bands after. At LAuReL's sizes (`r = 16`, `d = 256`) a single
//! product over all rows is too small for gemm to split across threads, and ran on one core.
//! `t` (`r` values per row) is kept for the backward; `h` is not. Flex only (f32 and f64,
//! every operand alike).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};
use burn_flex::{Flex, FlexTensor};
use rayon::prelude::*;

use super::autodiff::{constant, tracked_op_keeping};
use super::flex_kernels::{
    Scalar, Strided, axpy, dims, new_product, product, rows_per_task, tensor, unwritten, values,
    write_axpy, written, zeroed,
};

/// The fused update (see the [module docs](self)).
#[backend_extension(Flex: cfg(feature = "flex"), Autodiff)]
pub(crate) trait LowRankBackend: Backend {
    /// `(s + h + (s A) B, s A)` for `s`, `h` `[R, d]`, `A` `[d, r]`, `B` `[r, d]`.
    fn low_rank_residual(
        stream: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        down: FloatTensor<Self>,
        up: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `(∂s, ∂A, ∂B)` (`∂h` is `g` itself) from `s`, `A`, `B`, `t = s A` and `g`.
    fn low_rank_residual_backward(
        stream: FloatTensor<Self>,
        down: FloatTensor<Self>,
        up: FloatTensor<Self>,
        projected: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// The fused op, for the tensors of one forward pass: made where they can take it, so that the
/// choice is made once per pass rather than at every block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LowRankResidual(());

impl LowRankResidual {
    /// The fused op for tensors like `stream`: Flex, f32 or f64.
    pub(crate) fn for_tensor<const D: usize>(stream: &Tensor<D>) -> Option<Self> {
        super::has_fused_flex_ops(stream).then_some(Self(()))
    }

    /// `stream + branch + (stream down) up` over the last axis (`down` `[d, r]`, `up` `[r, d]`);
    /// Burn's tensor ops where the operands' dtypes differ or are neither f32 nor f64.
    pub(crate) fn apply<const D: usize>(
        self,
        stream: Tensor<D>,
        branch: Tensor<D>,
        down: Tensor<2>,
        up: Tensor<2>,
    ) -> Tensor<D> {
        let dims = stream.dims();
        let width = dims[D - 1];
        let rows = stream.shape().num_elements() / width.max(1);
        let flat = |tensor: Tensor<D>| tensor.reshape([rows, width]);
        let (stream, branch) = (flat(stream), flat(branch));
        // The pass's first tensor chose the op; a later one (a tail that casts) may not take it.
        let dtype = stream.dtype();
        let takes = matches!(dtype, DType::F32 | DType::F64)
            && [branch.dtype(), down.dtype(), up.dtype()] == [dtype; 3]
            && width > 0
            && down.dims()[1] > 0;
        if !takes {
            return (stream.clone() + branch + stream.matmul(down).matmul(up)).reshape(dims);
        }
        let (output, _projected) = <Dispatch as LowRankBackend>::low_rank_residual(
            stream.into_dispatch(),
            branch.into_dispatch(),
            down.into_dispatch(),
            up.into_dispatch(),
        );
        Tensor::<2>::from_dispatch(output).reshape(dims)
    }
}

fn forward<E: Scalar>(
    stream: &FlexTensor,
    branch: &FlexTensor,
    down: &FlexTensor,
    up: &FlexTensor,
) -> (FlexTensor, FlexTensor) {
    let [rows, width] = dims::<2>(stream);
    let [down_rows, rank] = dims::<2>(down);
    assert!(
        dims::<2>(branch) == [rows, width]
            && down_rows == width
            && dims::<2>(up) == [rank, width]
            && width > 0
            && rank > 0,
        "low-rank residual: shapes disagree"
    );
    let (s, h) = (values::<E>(stream), values::<E>(branch));
    let (a, b) = (values::<E>(down), values::<E>(up));
    let task = rows_per_task(width);
    let mut projected = unwritten::<E>(rows * rank);
    let mut output = unwritten::<E>(rows * width);
    // Each task takes a band of rows through all three steps while the band is in its cache;
    // the bands run in parallel (one product over all rows is too small for gemm to split).
    output
        .par_chunks_mut(task * width)
        .zip(projected.par_chunks_mut(task * rank))
        .zip(s.par_chunks(task * width))
        .zip(h.par_chunks(task * width))
        .for_each(|(((out, t), s), h)| {
            let band = s.len() / width;
            let t = zeroed(t);
            product(
                t,
                false,
                (band, rank, width),
                Strided::row_major(s, width),
                Strided::row_major(&a, rank),
            );
            let out = write_axpy(out, Some(s), E::one(), h);
            product(
                out,
                true,
                (band, width, rank),
                Strided::row_major(t, rank),
                Strided::row_major(&b, width),
            );
        });
    // SAFETY: the bands partition both buffers, and each task wrote its bands whole.
    let (output, projected) = unsafe { (written(output), written(projected)) };
    (
        tensor(output, [rows, width]),
        tensor(projected, [rows, rank]),
    )
}

fn backward<E: Scalar>(
    stream: &FlexTensor,
    down: &FlexTensor,
    up: &FlexTensor,
    projected: &FlexTensor,
    grad: &FlexTensor,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let [rows, width] = dims::<2>(stream);
    let [_, rank] = dims::<2>(down);
    let (s, a, b) = (values::<E>(stream), values::<E>(down), values::<E>(up));
    let (t, g) = (values::<E>(projected), values::<E>(grad));
    let task = rows_per_task(width);
    let mut grad_stream = unwritten::<E>(rows * width);
    // Per band of rows: `u = g Bᵀ` (the gradient of `t`), `∂s = g + u Aᵀ`, and the band's part
    // of `∂A = sᵀ u` and `∂B = tᵀ g`; the parts summed in the bands' order after, the same
    // sum on every run.
    let parts: Vec<(Vec<E>, Vec<E>)> = grad_stream
        .par_chunks_mut(task * width)
        .zip(g.par_chunks(task * width))
        .zip(s.par_chunks(task * width))
        .zip(t.par_chunks(task * rank))
        .map(|(((out, g), s), t)| {
            let band = g.len() / width;
            let u = new_product(
                (band, rank, width),
                Strided::row_major(g, width),
                Strided::transposed(&b, width),
            );
            let out = write_axpy(out, None, E::one(), g);
            product(
                out,
                true,
                (band, width, rank),
                Strided::row_major(&u, rank),
                Strided::transposed(&a, rank),
            );
            let grad_down = new_product(
                (width, rank, band),
                Strided::transposed(s, width),
                Strided::row_major(&u, rank),
            );
            let grad_up = new_product(
                (rank, width, band),
                Strided::transposed(t, rank),
                Strided::row_major(g, width),
            );
            (grad_down, grad_up)
        })
        .collect();
    let (mut grad_down, mut grad_up) =
        (vec![E::zero(); width * rank], vec![E::zero(); rank * width]);
    for (down, up) in &parts {
        axpy(&mut grad_down, E::one(), down);
        axpy(&mut grad_up, E::one(), up);
    }
    // SAFETY: the bands partition the buffer, and each task wrote its band whole.
    let grad_stream = unsafe { written(grad_stream) };
    (
        tensor(grad_stream, [rows, width]),
        tensor(grad_down, [width, rank]),
        tensor(grad_up, [rank, width]),
    )
}

impl LowRankBackend for Flex {
    fn low_rank_residual(
        stream: FlexTensor,
        branch: FlexTensor,
        down: FlexTensor,
        up: FlexTensor,
    ) -> (FlexTensor, FlexTensor) {
        match stream.dtype() {
            DType::F32 => forward::<f32>(&stream, &branch, &down, &up),
            DType::F64 => forward::<f64>(&stream, &branch, &down, &up),
            other => panic!("low-rank residual: unsupported dtype {other:?}"),
        }
    }

    fn low_rank_residual_backward(
        stream: FlexTensor,
        down: FlexTensor,
        up: FlexTensor,
        projected: FlexTensor,
        grad: FlexTensor,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        match stream.dtype() {
            DType::F32 => backward::<f32>(&stream, &down, &up, &projected, &grad),
            DType::F64 => backward::<f64>(&stream, &down, &up, &projected, &grad),
            other => panic!("low-rank residual: unsupported dtype {other:?}"),
        }
    }
}

/// `s + h + (s A) B`: parents `[s, h, A, B]`; the state keeps `s`, `A`, `B` (checkpointed)
/// and `t = s A`, not `h`.
#[derive(Debug)]
struct FusedLowRankResidual;

impl<B: LowRankBackend> Backward<B, 4> for FusedLowRankResidual {
    type State = ([NodeId; 3], FloatTensor<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 4>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (nodes, projected) = ops.state;
        let [stream, down, up] = nodes.map(|id| checkpointer.retrieve_node_output(id));
        let [stream_parent, branch_parent, down_parent, up_parent] = ops.parents;
        if let Some(parent) = branch_parent {
            grads.register::<B>(parent.id, grad.clone());
        }
        if stream_parent.is_none() && down_parent.is_none() && up_parent.is_none() {
            return;
        }
        let (grad_stream, grad_down, grad_up) =
            B::low_rank_residual_backward(stream, down, up, projected, grad);
        register_tracked!(
            grads,
            [stream_parent, down_parent, up_parent],
            [grad_stream, grad_down, grad_up]
        );
    }
}

impl<B: LowRankBackend, C: CheckpointStrategy> LowRankBackend for Autodiff<B, C> {
    fn low_rank_residual(
        stream: FloatTensor<Self>,
        branch: FloatTensor<Self>,
        down: FloatTensor<Self>,
        up: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // `h` is not checkpointed: the backward does not read it.
        let (output, projected) = tracked_op_keeping::<B, C, _, _, 4, 3>(
            FusedLowRankResidual,
            [stream, branch, down, up],
            [0, 2, 3],
            |[stream, branch, down, up]| B::low_rank_residual(stream, branch, down, up),
            |kept, _, projected| (kept, projected),
        );
        (output, constant::<B, C>(projected))
    }

    fn low_rank_residual_backward(
        stream: FloatTensor<Self>,
        down: FloatTensor<Self>,
        up: FloatTensor<Self>,
        projected: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        // First-order only: the gradients are constants to the graph.
        let (grad_stream, grad_down, grad_up) = B::low_rank_residual_backward(
            stream.into_primitive(),
            down.into_primitive(),
            up.into_primitive(),
            projected.into_primitive(),
            grad.into_primitive(),
        );
        (
            constant::<B, C>(grad_stream),
            constant::<B, C>(grad_down),
            constant::<B, C>(grad_up),
        )
    }
}

#[cfg(test)]
mod tests {
    use burn::prelude::*;
    use burn::tensor::{FloatDType, Tolerance};

    use super::LowRankResidual;

    /// The fused op against the composed tensor ops on Flex, the output and every operand's
    /// gradient, in f32 and f64: ranks 1 and 16, a row count that fills no parallel task
    /// evenly, a stream handed over transposed (not contiguous), and the update read through a
    /// random probe so that every output element's gradient differs.
    #[test]
    fn fused_op_matches_the_composed_operations() {
        let device = Device::flex().autodiff();
        for (dtype, tolerance) in [
            (
                FloatDType::F32,
                Tolerance::absolute(1e-4).set_relative(1e-4),
            ),
            (
                FloatDType::F64,
                Tolerance::absolute(1e-10).set_relative(1e-10),
            ),
        ] {
            for (rows, width, rank) in [(37, 24, 1), (300, 70, 16)] {
                // Fixed draws: a case that fails fails again.
                let random = |shape: [usize; 2], std: f64, seed: u64| {
                    crate::test_util::fixed_normal(shape, std, seed, &device).cast(dtype)
                };
                let stream = random([width, rows], 1.0, 1);
                let branch = random([rows, width], 1.0, 2);
                let down = random([width, rank], 0.3, 3);
                let up = random([rank, width], 0.3, 4);
                let probe = random([rows, width], 1.0, 5);
                let run = |fused: bool| {
                    let leaves = [&stream, &branch, &down, &up].map(|t| t.clone().require_grad());
                    let [s, h, a, b] = leaves.clone();
                    let s = s.transpose();
                    let output = if fused {
                        let op = LowRankResidual::for_tensor(&s).expect("Flex takes it");
                        op.apply(s, h, a, b)
                    } else {
                        s.clone() + h + s.matmul(a).matmul(b)
                    };
                    let grads = (output.clone() * probe.clone()).sum().backward();
                    let gradients = leaves.map(|leaf| leaf.grad(&grads).unwrap().into_data());
                    (output.into_data(), gradients)
                };
                let ((fused, fused_grads), (composed, composed_grads)) = (run(true), run(false));
                fused.assert_approx_eq::<f64>(&composed, tolerance);
                for (fused, composed) in fused_grads.iter().zip(&composed_grads) {
                    fused.assert_approx_eq::<f64>(composed, tolerance);
                }
            }
        }
    }

    /// Without autodiff the op is the same update, on a rank-3 stream.
    #[test]
    fn untracked_op_is_the_update() {
        let device = Device::flex();
        let random =
            |shape: [usize; 3], seed| crate::test_util::fixed_normal(shape, 1.0, seed, &device);
        let (stream, branch) = (random([2, 9, 12], 1), random([2, 9, 12], 2));
        let down = crate::test_util::fixed_normal([12, 3], 0.5, 3, &device);
        let up = crate::test_util::fixed_normal([3, 12], 0.5, 4, &device);
        let expected = stream.clone()
            + branch.clone()
            + stream
                .clone()
                .reshape([18, 12])
                .matmul(down.clone())
                .matmul(up.clone())
                .reshape([2, 9, 12]);
        let op = LowRankResidual::for_tensor(&stream).expect("Flex takes it");
        op.apply(stream, branch, down, up)
            .into_data()
            .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-5));
    }
}
