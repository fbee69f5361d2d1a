//! DepthLN, the depth-adaptive LayerNorm of the H-ACN paper (App. D, eq. 7).

use burn::module::Param;
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::prelude::*;

use crate::error::{Error, Result, check_finite, check_positive, check_size};

/// Configuration of [`DepthLn`].
#[derive(Config, Debug)]
pub struct DepthLnConfig {
    /// Feature width `d`.
    pub d_model: usize,
    /// Depth `l` of the norm, counting blocks from 1.
    pub depth: usize,
    /// Initial strength `s` (paper: 0.05).
    #[config(default = 0.05)]
    pub strength: f64,
    /// LayerNorm epsilon.
    #[config(default = 1e-5)]
    pub epsilon: f64,
}

impl DepthLnConfig {
    /// Builds the norm.
    ///
    /// # Errors
    /// Zero width or depth, non-finite strength, non-positive epsilon.
    pub fn init(&self, device: &Device) -> Result<DepthLn> {
        check_size("DepthLN width", self.d_model)?;
        if self.depth == 0 {
            return Err(Error::OutOfRange {
                name: "DepthLN depth",
                value: 0.0,
                requirement: ">= 1 (depths count blocks from 1)",
            });
        }
        check_finite("DepthLN strength", self.strength)?;
        check_positive("DepthLN epsilon", self.epsilon)?;
        let strength = Tensor::<1>::from_data(TensorData::new(vec![self.strength], [1]), device);
        Ok(DepthLn {
            norm: LayerNormConfig::new(self.d_model)
                .with_epsilon(self.epsilon)
                .init(device),
            strength: Param::from_tensor(strength),
            depth: self.depth,
        })
    }
}

/// Depth-adaptive LayerNorm: `DepthLN(x) = (1 + l·s) · LN(x)`.
///
/// `l` is the depth of the norm (blocks counted from 1), `s` a learnable scalar (one per norm,
/// init 0.05), and `LN` keeps its usual affine parameters γ, β. Like the H-ACN gates, `s` is
/// usually excluded from weight decay.
#[derive(Module, Debug)]
pub struct DepthLn {
    /// The LayerNorm, with its affine γ and β.
    pub norm: LayerNorm,
    /// The strength `s`, shape `[1]`.
    pub strength: Param<Tensor<1>>,
    /// The depth `l`.
    pub depth: usize,
}

impl DepthLn {
    /// `(1 + l·s) · LN(x)` over the last axis.
    ///
    /// # Panics
    /// If the last axis of `input` is not the configured width (as [`LayerNorm`]).
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        depth_scaled(
            crate::backend::layer_norm(&self.norm, input),
            self.strength.val(),
            self.depth,
        )
    }

    /// The feature width this norm accepts.
    pub fn width(&self) -> usize {
        self.norm.gamma.dims()[0]
    }
}

/// `(1 + depth·s)·normed`, `strength = [s]` (shared with the DepthLN of wrapped encoders).
pub(crate) fn depth_scaled<const D: usize>(
    normed: Tensor<D>,
    strength: Tensor<1>,
    depth: usize,
) -> Tensor<D> {
    let scale = strength.mul_scalar(depth as f64).add_scalar(1.0);
    normed * scale.reshape([1usize; D])
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Distribution, Tolerance};

    use super::*;

    #[test]
    fn scales_layer_norm_by_one_plus_depth_times_strength() {
        let device = Device::flex();
        let x = Tensor::<3>::random([2, 4, 8], Distribution::Normal(1.0, 3.0), &device);
        for depth in [1, 4, 12] {
            let norm = DepthLnConfig::new(8, depth)
                .with_strength(0.1)
                .init(&device)
                .unwrap();
            let expected = norm
                .norm
                .forward(x.clone())
                .mul_scalar(1.0 + depth as f64 * 0.1);
            norm.forward(x.clone())
                .into_data()
                .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::rel_abs(1e-5, 1e-6));
        }
    }

    #[test]
    fn strength_is_trainable() {
        let device = Device::flex().autodiff();
        let norm = DepthLnConfig::new(8, 3).init(&device).unwrap();
        let x = Tensor::<2>::random([4, 8], Distribution::Normal(0.0, 1.0), &device);
        let grads = norm.forward(x).powf_scalar(2.0).sum().backward();
        assert!(norm.strength.val().grad(&grads).is_some());
        assert_eq!(norm.width(), 8);
    }

    #[test]
    fn invalid_configs_are_errors() {
        let device = Device::flex();
        assert!(matches!(
            DepthLnConfig::new(0, 1).init(&device),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            DepthLnConfig::new(8, 0).init(&device),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            DepthLnConfig::new(8, 1)
                .with_strength(f64::NAN)
                .init(&device),
            Err(Error::NonFinite { .. })
        ));
        assert!(matches!(
            DepthLnConfig::new(8, 1).with_epsilon(0.0).init(&device),
            Err(Error::OutOfRange { .. })
        ));
    }
}
