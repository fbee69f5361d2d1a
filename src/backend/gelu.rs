//! GELU on Flex in f32 as one vectorisable CPU op forward and one backward.
//!
//! ```text
//! GELU(x) = x Φ(x),    GELU'(x) = Φ(x) + x φ(x),    φ(x) = e^{−x²/2} / √(2π)
//! Φ(x) = ½ erfc(|x|/√2) for x < 0,  1 − ½ erfc(|x|/√2) otherwise
//! erfc(z) ≈ t (a₁ + t (a₂ + t (a₃ + t (a₄ + t a₅)))) e^{−z²},  t = 1 / (1 + p z)
//! ```
//!
//! (Abramowitz & Stegun 7.1.26, absolute error ≤ 1.5e-7; `e^{−z²}` at `z = x/√2` is the
//! `e^{−x²/2}` of `φ`, computed once.) Flex's own GELU calls libm's `erff` one element at a time
//! (~27 ms forward and backward on `[8, 128, 1024]` here); these loops are branch-free, with an
//! `exp` from a range reduction and a polynomial, so the compiler vectorises them. Taking the lower
//! tail directly (rather than `1 − ½ erfc` for every `x`) keeps `Φ` accurate for negative `x`.
//! Other dtypes and backends keep Burn's GELU.

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

use super::autodiff::{constant, tracked_op};
use super::flex_kernels::values;

/// Elements per parallel task.
const ELEMENTS_PER_TASK: usize = 16 * 1024;

/// GELU as one op forward and one backward (see the [module docs](self)).
#[backend_extension(Flex: cfg(feature = "flex"), Autodiff)]
pub(crate) trait GeluBackend: Backend {
    /// `x Φ(x)`, elementwise.
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `∂out (Φ(x) + x φ(x))`, elementwise.
    fn fused_gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// GELU through the fused op: Flex devices, f32 only.
pub(crate) fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as GeluBackend>::fused_gelu(x.into_dispatch()))
}

/// Whether [`gelu`] takes tensors of this dtype.
pub(crate) fn supports(dtype: DType) -> bool {
    dtype == DType::F32
}

/// `e^x` for `x ≤ 0` down to the smallest normal result: `x = n ln 2 + r`, `|r| ≤ ln 2 / 2`,
/// `e^r` by its Taylor polynomial to `r⁷` (relative error < 1e-8), `2ⁿ` built in the exponent
/// bits. Branch-free.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and subtracting 1.5 · 2²³ rounds to the nearest integer without a libm call.
    const ROUND: f32 = 12_582_912.0;
    let x = x.max(-87.0);
    let n = (x * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let poly = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r / 5040.0))))));
    // n ∈ [-126, 0]: a normal power of two.
    #[allow(clippy::cast_possible_truncation)]
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    poly * scale
}

/// `(Φ(x), φ(x))`.
#[inline(always)]
fn cdf_pdf(x: f32) -> (f32, f32) {
    const P: f32 = 0.327_591_1;
    const A: [f32; 5] = [
        0.254_829_6,
        -0.284_496_72,
        1.421_413_8,
        -1.453_152_1,
        1.061_405_4,
    ];
    let e = exp_nonpositive(-0.5 * x * x);
    let t = 1.0 / (1.0 + P * x.abs() * std::f32::consts::FRAC_1_SQRT_2);
    let poly = t * (A[0] + t * (A[1] + t * (A[2] + t * (A[3] + t * A[4]))));
    let lower_tail = 0.5 * poly * e;
    let cdf = if x < 0.0 {
        lower_tail
    } else {
        1.0 - lower_tail
    };
    (
        cdf,
        e * (0.5 * std::f32::consts::FRAC_2_SQRT_PI * std::f32::consts::FRAC_1_SQRT_2),
    )
}

fn forward(x: &FlexTensor) -> FlexTensor {
    let shape = x.layout().shape().clone();
    let input = values::<f32>(x);
    let mut out = vec![0.0f32; input.len()];
    out.par_chunks_mut(ELEMENTS_PER_TASK)
        .zip(input.par_chunks(ELEMENTS_PER_TASK))
        .for_each(|(out, input)| {
            for (o, &x) in out.iter_mut().zip(input) {
                *o = x * cdf_pdf(x).0;
            }
        });
    super::flex_kernels::tensor(out, [input.len()]).reshape(shape)
}

fn backward(x: &FlexTensor, grad: &FlexTensor) -> FlexTensor {
    let shape = x.layout().shape().clone();
    let (input, upstream) = (values::<f32>(x), values::<f32>(grad));
    let mut out = vec![0.0f32; input.len()];
    out.par_chunks_mut(ELEMENTS_PER_TASK)
        .zip(input.par_chunks(ELEMENTS_PER_TASK))
        .zip(upstream.par_chunks(ELEMENTS_PER_TASK))
        .for_each(|((out, input), upstream)| {
            for ((o, &x), &g) in out.iter_mut().zip(input).zip(upstream) {
                let (cdf, pdf) = cdf_pdf(x);
                *o = g * (cdf + x * pdf);
            }
        });
    super::flex_kernels::tensor(out, [input.len()]).reshape(shape)
}

impl GeluBackend for Flex {
    fn fused_gelu(x: FlexTensor) -> FlexTensor {
        assert!(supports(x.dtype()), "fused GELU: f32 only");
        forward(&x)
    }

    fn fused_gelu_backward(x: FlexTensor, grad: FlexTensor) -> FlexTensor {
        assert!(supports(x.dtype()), "fused GELU: f32 only");
        backward(&x, &grad)
    }
}

/// The fused GELU under autodiff: parent `[x]`.
#[derive(Debug)]
struct FusedGelu;

impl<B: GeluBackend> Backward<B, 1> for FusedGelu {
    type State = NodeId;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let x = checkpointer.retrieve_node_output(ops.state);
        if let Some(parent) = parent {
            grads.register::<B>(parent.id, B::fused_gelu_backward(x, grad));
        }
    }
}

impl<B: GeluBackend, C: CheckpointStrategy> GeluBackend for Autodiff<B, C> {
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        tracked_op::<B, C, _, _>(FusedGelu, [x], |[x]| B::fused_gelu(x), |[x], _| x)
    }

    fn fused_gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        // First-order only: the gradient is a constant to the graph.
        constant::<B, C>(B::fused_gelu_backward(
            x.into_primitive(),
            grad.into_primitive(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use burn::prelude::*;
    use burn::tensor::{Distribution, Tolerance};

    /// The fused op against Burn's GELU on Flex (libm's erf), forward and gradient, from the far
    /// lower tail (where `Φ` is tiny) to large inputs, on a transposed (non-contiguous) input.
    #[test]
    fn fused_op_matches_burns_gelu() {
        let device = Device::flex().autodiff();
        let wide = Tensor::<2>::random([300, 70], Distribution::Uniform(-12.0, 12.0), &device);
        let near = Tensor::<2>::random([300, 70], Distribution::Normal(0.0, 1.0), &device);
        for x in [wide, near] {
            let probe = Tensor::<2>::random([70, 300], Distribution::Normal(0.0, 1.0), &device);
            let run = |fused: bool| {
                let leaf = x.clone().require_grad();
                let input = leaf.clone().transpose();
                let output = if fused {
                    super::gelu(input)
                } else {
                    burn::tensor::activation::gelu(input)
                };
                let grads = (output.clone() * probe.clone()).sum().backward();
                (output.into_data(), leaf.grad(&grads).unwrap().into_data())
            };
            let ((fused, fused_grad), (burn, burn_grad)) = (run(true), run(false));
            let tolerance = Tolerance::absolute(1e-6).set_relative(1e-6);
            fused.assert_approx_eq::<f32>(&burn, tolerance);
            fused_grad.assert_approx_eq::<f32>(&burn_grad, tolerance);
        }
    }

    /// The lower tail keeps its relative accuracy (no `1 − (1 − ε)` cancellation in f32):
    /// against `x Φ(x)` from f64 reference values of `Φ`, within 2% down to `x = −8` (a
    /// cancelling form gives 0 there, or ±f32 rounding at `x = −5`).
    #[test]
    fn lower_tail_is_accurate() {
        let device = Device::flex();
        let cases = [
            (-3.0, 1.349_898_031_630_094_6e-3),
            (-5.0, 2.866_515_718_791_939e-7),
            (-8.0, 6.220_960_574_271_78e-16),
        ];
        let x = Tensor::<1>::from_floats(cases.map(|(x, _)| x as f32), &device);
        let fused: Vec<f32> = super::gelu(x).into_data().iter().collect();
        for (value, (x, cdf)) in fused.iter().zip(cases) {
            let exact = x * cdf;
            let error = (f64::from(*value) - exact).abs() / exact.abs();
            assert!(error < 2e-2, "GELU({x}) = {value}, exact {exact}");
        }
    }
}
