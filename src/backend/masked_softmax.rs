//! A softmax over the entries of a small matrix that a mask keeps, as one op forward and one
//! backward on the CubeCL backends (a CubeCL kernel each, with its own backward); composed from
//! tensor ops elsewhere. What ANCRe's coefficients are made of, and, unmasked along the last
//! axis ([`last_axis_softmax`]), AttnRes's weights over its sources.
//!
//! Per line `ℓ` (a column for `axis = 0`, a row for `axis = 1`) of `L` (`[R, C]`), with kept
//! entries `K_ℓ` and temperature `τ`:
//!
//! ```text
//! s_k = exp(L_k / τ − max_{K_ℓ} L / τ) / Σ_{K_ℓ} exp(L / τ − max_{K_ℓ} L / τ)   (k ∈ K_ℓ)
//! P_k = s_k on kept entries, 0 on the others, and 1 on the entries marked `ones` (kept too:
//!       they take part in their line's normalisation, and their value is fixed)
//!
//! ∂L_k = s_k (g_k − Σ_{K_ℓ} s g) / τ     g = ∂P on kept entries not fixed to 1, else 0
//! ```
//!
//! Composed from tensor ops this is a division, two mask fills, the softmax's two reductions and
//! two elementwise passes forward and about as many backward, a kernel each on a GPU, for a
//! matrix of a few hundred entries. A kernel's unit here owns one line.

use burn::prelude::*;
use burn::tensor::activation::softmax;

/// Which entries of a `[R, C]` matrix take part in the softmax and which are fixed to 1,
/// row-major.
pub(crate) struct SoftmaxMask {
    pub(crate) shape: [usize; 2],
    pub(crate) kept: Vec<bool>,
    pub(crate) ones: Vec<bool>,
}

/// `P` of the [module docs](self) for `logits [R, C]` along `axis` (0 or 1): one kernel forward
/// and one backward on a CubeCL device, tensor ops elsewhere.
pub(crate) fn masked_softmax(
    logits: Tensor<2>,
    mask: &SoftmaxMask,
    axis: usize,
    temperature: f64,
) -> Tensor<2> {
    let device = logits.device();
    #[cfg(feature = "cube-kernels")]
    if super::cube_kernels_take(&logits) {
        // 0: dropped, 1: kept, 2: kept and fixed to 1.
        let codes: Vec<f32> = (mask.kept.iter().zip(&mask.ones))
            .map(|(&kept, &one)| f32::from(u8::from(kept) + u8::from(one)))
            .collect();
        // In the logits' type: `from_data` alone gives the device's default float type, and
        // the kernel reads both as one type.
        let codes = Tensor::<2>::from_data(
            TensorData::new(codes, mask.shape),
            (&device, logits.dtype()),
        );
        return Tensor::from_dispatch(
            <burn::backend::Dispatch as op::MaskedSoftmaxBackend>::masked_softmax(
                logits.into_dispatch(),
                codes.into_dispatch(),
                axis,
                temperature,
                true,
            ),
        );
    }
    let bools = |values: Vec<bool>| {
        Tensor::<2, Bool>::from_data(TensorData::new(values, mask.shape), &device)
    };
    let dropped = bools(mask.kept.iter().map(|&kept| !kept).collect());
    let ones = bools(mask.ones.clone());
    // A large finite fill (not -inf) keeps a line with no kept entry free of NaN.
    let scaled = logits
        .div_scalar(temperature)
        .mask_fill(dropped.clone(), -1e30);
    softmax(scaled, axis)
        .mask_fill(dropped, 0.0)
        .mask_fill(ones, 1.0)
}

/// `softmax(L)` along the last axis, every entry kept: one kernel forward and one backward on a
/// CubeCL device (a unit per line, the lines the entries before the last axis), Burn's
/// `softmax` elsewhere. AttnRes's weights over its sources.
pub(crate) fn last_axis_softmax<const D: usize>(logits: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "cube-kernels")]
    if super::cube_kernels_take(&logits) {
        let dims = logits.dims();
        let length = dims[D - 1];
        let lines = logits.shape().num_elements() / length.max(1);
        let lines_first = logits.reshape([lines, length]);
        // Unmasked: the codes are unread, the logits stand in for them.
        let weights = <burn::backend::Dispatch as op::MaskedSoftmaxBackend>::masked_softmax(
            lines_first.clone().into_dispatch(),
            lines_first.into_dispatch(),
            1,
            1.0,
            false,
        );
        return Tensor::<2>::from_dispatch(weights).reshape(dims);
    }
    softmax(logits, D - 1)
}

/// The op and its kernels (CubeCL backends).
#[cfg(feature = "cube-kernels")]
mod op {
    use burn::backend::autodiff::checkpoint::base::Checkpointer;
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{Backward, Ops};
    use burn::backend::autodiff::{Autodiff, NodeId};
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, backend_extension};

    use crate::backend::autodiff::{constant, tracked_op};

    /// The masked softmax as an op of its own (see the [module docs](self)).
    #[backend_extension(
        Cube: cfg(feature = "cube-kernels"),
        Fusion: cfg(feature = "cube-kernels"),
        Autodiff
    )]
    pub(crate) trait MaskedSoftmaxBackend: Backend {
        /// `P` for `logits [R, C]` and `codes` (0 dropped, 1 kept, 2 kept and fixed to 1);
        /// without `masked`, every entry is kept and `codes` is unread.
        #[fusion(dtype = logits, shape = logits)]
        fn masked_softmax(
            logits: FloatTensor<Self>,
            codes: FloatTensor<Self>,
            axis: usize,
            temperature: f64,
            masked: bool,
        ) -> FloatTensor<Self>;

        /// `∂L` given `∂P`.
        #[fusion(dtype = logits, shape = logits)]
        fn masked_softmax_backward(
            logits: FloatTensor<Self>,
            codes: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            axis: usize,
            temperature: f64,
            masked: bool,
        ) -> FloatTensor<Self>;
    }

    #[derive(Debug)]
    struct MaskedSoftmax;

    impl<B: MaskedSoftmaxBackend> Backward<B, 2> for MaskedSoftmax {
        /// The checkpointed logits and codes, the axis, the temperature and whether masked.
        type State = (NodeId, NodeId, usize, f64, bool);

        fn backward(
            self,
            ops: Ops<Self::State, 2>,
            grads: &mut Gradients,
            checkpointer: &mut Checkpointer,
        ) {
            let grad = grads.consume::<B>(&ops.node);
            let (logits, codes, axis, temperature, masked) = ops.state;
            if let [Some(parent), _] = ops.parents {
                let logits = checkpointer.retrieve_node_output(logits);
                let codes = checkpointer.retrieve_node_output(codes);
                let grad =
                    B::masked_softmax_backward(logits, codes, grad, axis, temperature, masked);
                grads.register::<B>(parent.id, grad);
            }
        }
    }

    impl<B: MaskedSoftmaxBackend, C: CheckpointStrategy> MaskedSoftmaxBackend for Autodiff<B, C> {
        fn masked_softmax(
            logits: FloatTensor<Self>,
            codes: FloatTensor<Self>,
            axis: usize,
            temperature: f64,
            masked: bool,
        ) -> FloatTensor<Self> {
            tracked_op::<B, C, _, _>(
                MaskedSoftmax,
                [logits, codes],
                |[logits, codes]| B::masked_softmax(logits, codes, axis, temperature, masked),
                |[logits, codes], _| (logits, codes, axis, temperature, masked),
            )
        }

        fn masked_softmax_backward(
            logits: FloatTensor<Self>,
            codes: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            axis: usize,
            temperature: f64,
            masked: bool,
        ) -> FloatTensor<Self> {
            constant::<B, C>(B::masked_softmax_backward(
                logits.into_primitive(),
                codes.into_primitive(),
                grad.into_primitive(),
                axis,
                temperature,
                masked,
            ))
        }
    }

    mod cube {
        use burn::backend::cubecl::dtype_to_storage_type;
        use burn::tensor::Shape;
        use burn_cubecl::kernel::into_contiguous;
        use burn_cubecl::tensor::CubeTensor;
        use cubecl::CubeDim;

        use super::MaskedSoftmaxBackend;
        use crate::backend::cube_launch::{Cube, empty, per_element};
        use crate::backend::kernel_constant;
        use kernels::softmax_kernel;

        /// One unit per line.
        fn launch_shape(logits: &CubeTensor, axis: usize) -> (cubecl::CubeCount, CubeDim) {
            per_element(logits, logits.meta.shape()[1 - axis])
        }

        /// `P`, or `∂L` where `grad` (`∂P`) is given: one kernel.
        fn launch(
            logits: CubeTensor,
            codes: CubeTensor,
            grad: Option<CubeTensor>,
            axis: usize,
            temperature: f64,
            masked: bool,
        ) -> CubeTensor {
            let logits = into_contiguous(logits);
            let codes = if masked {
                into_contiguous(codes)
            } else {
                // Unread: a buffer of its own rather than a second binding of the logits.
                empty(&logits, Shape::new([1]))
            };
            let backward = grad.is_some();
            // The forward reads no gradient: the logits stand in.
            let grad = grad.map_or_else(|| logits.clone(), into_contiguous);
            let output = empty(&logits, logits.meta.shape().clone());
            let (cubes, dim) = launch_shape(&logits, axis);
            softmax_kernel::launch(
                &logits.client,
                cubes,
                dim,
                logits.clone().into_tensor_arg(),
                codes.into_tensor_arg(),
                grad.into_tensor_arg(),
                output.clone().into_tensor_arg(),
                axis,
                kernel_constant(temperature),
                backward,
                masked,
                dtype_to_storage_type(logits.dtype),
            );
            output
        }

        impl MaskedSoftmaxBackend for Cube {
            fn masked_softmax(
                logits: CubeTensor,
                codes: CubeTensor,
                axis: usize,
                temperature: f64,
                masked: bool,
            ) -> CubeTensor {
                launch(logits, codes, None, axis, temperature, masked)
            }

            fn masked_softmax_backward(
                logits: CubeTensor,
                codes: CubeTensor,
                grad: CubeTensor,
                axis: usize,
                temperature: f64,
                masked: bool,
            ) -> CubeTensor {
                launch(logits, codes, Some(grad), axis, temperature, masked)
            }
        }

        mod kernels {
            use cubecl::prelude::*;

            /// Entry `at`'s code: from `codes` where `masked`, else 1 (kept).
            #[cube]
            fn code_at<E: Float>(codes: &Tensor<E>, at: usize, #[comptime] masked: bool) -> E {
                let mut code = E::new(1.0);
                if comptime!(masked) {
                    code = codes[at];
                }
                code
            }

            /// The largest kept `L / τ` of the line of `length` entries from `base`, `step` apart.
            #[cube]
            fn line_max<E: Float>(
                logits: &Tensor<E>,
                codes: &Tensor<E>,
                base: usize,
                length: usize,
                step: usize,
                temperature: E,
                #[comptime] masked: bool,
            ) -> E {
                let mut top = E::new(0.0);
                let mut any = false;
                for k in 0..length {
                    let at = base + k * step;
                    let value = logits[at] / temperature;
                    if code_at::<E>(codes, at, masked) > E::new(0.5) && (!any || value > top) {
                        top = value;
                        any = true;
                    }
                }
                top
            }

            /// `Σ exp(L / τ − top)` over the line's kept entries.
            #[cube]
            fn line_total<E: Float>(
                logits: &Tensor<E>,
                codes: &Tensor<E>,
                base: usize,
                length: usize,
                step: usize,
                temperature: E,
                top: E,
                #[comptime] masked: bool,
            ) -> E {
                let mut total = E::new(0.0);
                for k in 0..length {
                    let at = base + k * step;
                    if code_at::<E>(codes, at, masked) > E::new(0.5) {
                        total += (logits[at] / temperature - top).exp();
                    }
                }
                total
            }

            /// Forward (`P`) or, with `backward`, `∂L` given `grad = ∂P`; one unit per line.
            #[cube(launch)]
            #[allow(clippy::too_many_arguments)]
            pub(super) fn softmax_kernel<E: Float>(
                logits: &Tensor<E>,
                codes: &Tensor<E>,
                grad: &Tensor<E>,
                output: &mut Tensor<E>,
                #[comptime] axis: usize,
                #[comptime] temperature_bits: u32,
                #[comptime] backward: bool,
                #[comptime] masked: bool,
                #[define(E)] _dtype: ElemType,
            ) {
                let temperature = E::new(comptime!(f32::from_bits(temperature_bits)));
                let rows = logits.shape(0);
                let columns = logits.shape(1);
                let line = ABSOLUTE_POS;
                // A column (axis 0) or a row (axis 1).
                let mut lines = rows;
                let mut base = line * columns;
                let mut length = columns;
                let mut step = 1usize;
                if comptime!(axis == 0) {
                    lines = columns;
                    base = line;
                    length = rows;
                    step = columns;
                }
                if line >= lines {
                    terminate!();
                }
                let top = line_max::<E>(logits, codes, base, length, step, temperature, masked);
                let total =
                    line_total::<E>(logits, codes, base, length, step, temperature, top, masked);
                // Backward: Σ s g over the kept entries not fixed to 1.
                let mut dot = E::new(0.0);
                if comptime!(backward) {
                    for k in 0..length {
                        let at = base + k * step;
                        let code = code_at::<E>(codes, at, masked);
                        if code > E::new(0.5) && code < E::new(1.5) {
                            dot += (logits[at] / temperature - top).exp() / total * grad[at];
                        }
                    }
                }
                for k in 0..length {
                    let at = base + k * step;
                    let code = code_at::<E>(codes, at, masked);
                    let mut value = E::new(0.0);
                    if code > E::new(0.5) {
                        let share = (logits[at] / temperature - top).exp() / total;
                        if comptime!(backward) {
                            let mut upstream = E::new(0.0);
                            if code < E::new(1.5) {
                                upstream = grad[at];
                            }
                            value = share * (upstream - dot) / temperature;
                        } else if code > E::new(1.5) {
                            value = E::new(1.0);
                        } else {
                            value = share;
                        }
                    }
                    output[at] = value;
                }
            }
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::prelude::*;
    use burn::tensor::Tolerance;

    use super::{SoftmaxMask, last_axis_softmax, masked_softmax};
    use crate::device::device;
    use crate::test_util::fixed_normal;

    /// `softmax(L)`'s values and `∂L` (of `Σ softmax(L) · probe`) on wgpu's kernels and on Flex's
    /// composed form agree, for `logits` and `probe` on Flex.
    fn kernels_agree_with_flex<const D: usize>(
        logits: &Tensor<D>,
        probe: &Tensor<D>,
        softmax: impl Fn(Tensor<D>) -> Tensor<D>,
    ) {
        let run = |device: &Device| {
            let logits = logits.clone().to_device(device).require_grad();
            let weights = softmax(logits.clone() * 1.0);
            let grads = (weights.clone() * probe.clone().to_device(device))
                .sum()
                .backward();
            [
                weights.into_data(),
                logits.grad(&grads).expect("tracked").into_data(),
            ]
        };
        let wgpu = device("wgpu").expect("wgpu compiled in").autodiff();
        for (kernel, composed) in run(&wgpu).iter().zip(run(&logits.device())) {
            kernel.assert_approx_eq::<f32>(&composed, Tolerance::absolute(1e-5));
        }
    }

    /// The kernels along both axes: a strictly upper-triangular mask (a first column and a last
    /// row with nothing kept), two entries fixed to 1 (one alone in its column, one sharing its
    /// row), temperature 0.7.
    #[test]
    fn kernels_match_the_composed_softmax() {
        let size = 5;
        let kept: Vec<bool> = (0..size * size).map(|k| k / size < k % size).collect();
        let mut ones = vec![false; size * size];
        ones[1] = true; // (0, 1): alone in column 1
        ones[size + 3] = true; // (1, 3): in row 1 with (1, 2) and (1, 4)
        let mask = SoftmaxMask {
            shape: [size, size],
            kept,
            ones,
        };
        let flex = Device::flex().autodiff();
        let logits = fixed_normal([size, size], 1.0, 1, &flex);
        let probe = fixed_normal([size, size], 1.0, 2, &flex);
        for axis in [0, 1] {
            kernels_agree_with_flex(&logits, &probe, |logits| {
                masked_softmax(logits, &mask, axis, 0.7)
            });
        }
    }

    /// The unmasked kernels along the last axis of a rank-3 tensor (7 lines of 5 entries, 13
    /// of 1) against Burn's softmax.
    #[test]
    fn last_axis_kernels_match_the_softmax() {
        let flex = Device::flex().autodiff();
        for shape in [[1, 7, 5], [13, 1, 1]] {
            let logits = fixed_normal(shape, 2.0, 3, &flex);
            let probe = fixed_normal(shape, 1.0, 4, &flex);
            kernels_agree_with_flex(&logits, &probe, last_axis_softmax);
        }
    }
}
