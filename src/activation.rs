//! GELU with an exact gradient on every backend, and the RMS normalisation without a weight
//! ([`rms_normalised`]).
//!
//! Burn 0.22.1's forward GELU is the exact `x·Φ(x)` everywhere, but its default
//! `gelu_backward` (used by NdArray and the CubeCL backends) differentiates the *tanh
//! approximation*, off by up to ~1e-3; Flex and LibTorch override it with the exact derivative
//! (LibTorch's is PyTorch's own `gelu_backward`, one kernel). Where that matters (training on
//! another backend) the erf form is composed from tensor ops, whose autodiff derivative
//! `Φ(x) + x·φ(x)` is exact. On Flex in f32 the crate's own op runs
//! instead ([`crate::backend::gelu`]: erf to 1.5e-7, vectorised, several times faster than
//! Flex's); in f64 Flex's own.

use burn::prelude::*;

use crate::backend::{is_flex, is_libtorch};

/// `GELU(x) = x · Φ(x) = ½ x (1 + erf(x/√2))`, with the exact derivative on every backend.
pub fn gelu<const D: usize>(input: Tensor<D>) -> Tensor<D> {
    let device = input.device();
    // Flex in f32: one vectorised op forward and one backward (Flex's own calls libm's erf).
    #[cfg(feature = "flex")]
    if is_flex(&device) && crate::backend::gelu::supports(input.dtype()) {
        return crate::backend::gelu::gelu(input);
    }
    // Composing erf on LibTorch would be ~10 kernels over the input where PyTorch runs one.
    if !device.is_autodiff() || is_flex(&device) || is_libtorch(&device) {
        return burn::tensor::activation::gelu(input);
    }
    let cdf = input
        .clone()
        .div_scalar(std::f64::consts::SQRT_2)
        .erf()
        .add_scalar(1.0)
        .mul_scalar(0.5);
    input * cdf
}

/// `x / sqrt(mean(x²) + ε)` over the last axis: the RMS normalisation without a weight
/// (LAuReL's Gemma 3n norms; AttnRes's keys and MUDD's weights take it inside the normalised
/// projection op). The scale is taken in f32 for f16 and bf16, as burn-nn's `RmsNorm` takes
/// it: in f16 an entry past 256 squares to infinity.
pub(crate) fn rms_normalised<const D: usize>(input: Tensor<D>, epsilon: f64) -> Tensor<D> {
    let dtype = input.dtype();
    let wide = input.clone().cast(crate::backend::exact_float(dtype));
    let mean_square = wide.square().mean_dim(D - 1);
    input * mean_square.add_scalar(epsilon).sqrt().recip().cast(dtype)
}

#[cfg(test)]
mod tests {
    use burn::tensor::Distribution;

    use super::*;

    /// In f16 the RMS scale is taken in f32: rows with entries past 256 (RMS 300, whose squares
    /// f16 cannot hold) normalise to within 4 of f16's unit roundoffs of the f32 result, value
    /// and gradient (relative to each one's largest entry). With the squares in f16 the scale
    /// was 0, and so were the result and its gradient.
    #[test]
    fn rms_normalised_in_f16_takes_entries_whose_squares_f16_overflows() {
        use crate::test_util::errors_in_float_type;
        use burn::tensor::DType;
        let device = Device::flex().autodiff();
        let x = Tensor::<2>::random([8, 64], Distribution::Normal(0.0, 300.0), &device);
        let probe = Tensor::<2>::random([8, 64], Distribution::Normal(0.0, 1.0), &device);
        let case = "rms_normalised in f16";
        let normed = |x: Vec<Tensor<2>>| rms_normalised(x[0].clone(), 1e-6);
        let errors = errors_in_float_type(DType::F16, &[x], &probe, normed, case);
        for (name, error) in ["value", "∂x"].iter().zip(errors) {
            assert!(
                error <= 4.0 / 2048.0,
                "{case}, {name}: {error:e} of its scale"
            );
        }
    }

    fn exact_derivative(x: f64) -> f64 {
        let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
        let cdf = 0.5 * (1.0 + libm_erf(x / std::f64::consts::SQRT_2));
        cdf + x * pdf
    }

    /// erf by its Maclaurin series, accurate to ~1e-15 for |x| < 3.
    fn libm_erf(x: f64) -> f64 {
        let (mut term, mut sum) = (x, x);
        for n in 1..80 {
            term *= -x * x / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    fn assert_exact_gradient(device: &Device) {
        let x = Tensor::<1>::random([64], Distribution::Uniform(-3.0, 3.0), device).require_grad();
        let grads = gelu(x.clone()).sum().backward();
        let inputs: Vec<f64> = x.to_data().iter().collect();
        let gradient: Vec<f64> = x.grad(&grads).unwrap().into_data().iter().collect();
        for (input, grad) in inputs.iter().zip(gradient) {
            let expected = exact_derivative(*input);
            assert!(
                (grad - expected).abs() < 2e-6,
                "x = {input}: {grad} vs {expected}"
            );
        }
    }

    #[test]
    fn gradient_is_exact_on_flex() {
        assert_exact_gradient(&Device::flex().autodiff());
    }

    #[cfg(feature = "ndarray")]
    #[test]
    #[allow(deprecated)]
    fn gradient_is_exact_on_ndarray() {
        assert_exact_gradient(&Device::ndarray().autodiff());
    }

    #[cfg(feature = "tch")]
    #[test]
    #[allow(deprecated)]
    fn gradient_is_exact_on_libtorch() {
        assert_exact_gradient(&Device::libtorch().autodiff());
    }
}
