//! Local HyperZZW (paper eqs. 8–9, MATH §3.3): kernels of size `k` generated from the context of
//! a source tensor, applied as a depthwise "same" convolution to a target tensor.
//!
//! ```text
//! u   = GELU( mean_batch( pool_k(X_src) R + r ) U + v )           [k, h]   (pool: adaptive average)
//! z_0 = sin(c A_0 + a_0)                                          c: the k-point grid
//! z_i = sin(c A_i + a_i) ⊙ (z_{i-1} B_{i-1} + b_{i-1}) + P
//! z_i = s_renorm(z_i) ⊙ (u F_{i-1} + f_{i-1})                     F init U(±√(3/h)), f = 1
//! K   = z_L W_o + w_o                                             [k, C] → depthwise [C, 1, k]
//! Y   = depthwise_conv(X_tgt, K)                                  zero padding (k−1)/2, cross-correlation
//! s_renorm(z)_j = a_j z_j + b_j z_j / max(‖z_j‖₂, 1e-12)         norm over the grid; a = 1, b = 0.1, learnable
//! ```
//!
//! The pooling and the batch mean are one product with a fixed averaging matrix (`mean_batch`
//! and `pool_k` are linear, so `R` applies after them, to `k` rows rather than `B·k`). On the
//! CubeCL backends the depthwise convolution of a 1D branch is one kernel forward and three
//! backward on the channels-last rows (`backend::depthwise_conv`); elsewhere Burn's `conv1d`.
//!
//! The source and target may differ (MuHKGen: a kernel made from one branch convolves another).
//! The batch mean makes the output depend on the batch's composition, as in the paper.
//! **Decision** (MATH): `a`, `b` are learnable and the identity term is not detached, unlike
//! the reference code (where they are unregistered constants 1 and 0.1).

use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::module::{conv1d, conv2d};
use burn::tensor::ops::ConvOptions;

use crate::activation::gelu;
use crate::error::{Error, Result, check_size};
use crate::hyperzzw::slow_net::{SRenorm, SlowNet, SlowNetConfig, linear};

/// Configuration of [`LocalHyperZzw`].
#[derive(Config, Debug)]
pub struct LocalHyperZzwConfig {
    /// Channels `C` of the source and target.
    pub channels: usize,
    /// Kernel size `k` per axis (odd; the reference uses 3, 5, 7, 9).
    pub kernel_size: usize,
    /// 1 for sequences (`k`-tap kernels), 2 for maps (`k x k` kernels).
    #[config(default = 1)]
    pub dims: usize,
    /// Hidden width `h` of the kernel generator (reference 32).
    #[config(default = 32)]
    pub hidden: usize,
    /// Multiplicative layers `L` (reference 2).
    #[config(default = 2)]
    pub layers: usize,
    /// Frequency scale ω0 of the sine filters.
    #[config(default = 2000.0)]
    pub omega_0: f64,
}

impl LocalHyperZzwConfig {
    /// Builds the branch.
    ///
    /// # Errors
    /// Zero sizes, an even kernel size, a non-positive ω0.
    pub fn init(&self, device: &Device) -> Result<LocalHyperZzw> {
        check_size("local HyperZZW channels", self.channels)?;
        check_size("local HyperZZW kernel size", self.kernel_size)?;
        if self.kernel_size.is_multiple_of(2) {
            return Err(Error::OutOfRange {
                name: "local HyperZZW kernel size",
                value: self.kernel_size as f64,
                requirement: "odd (a 'same' convolution)",
            });
        }
        if self.dims == 0 || self.dims > 2 {
            return Err(Error::OutOfRange {
                name: "local HyperZZW dims",
                value: self.dims as f64,
                requirement: "1 or 2",
            });
        }
        let slow_net = SlowNetConfig::new(vec![self.kernel_size; self.dims], self.channels)
            .with_hidden(self.hidden)
            .with_layers(self.layers)
            .with_omega_0(self.omega_0)
            .init(device)?;
        let hidden = self.hidden;
        // PyTorch's default 1x1-conv init, U(±1/√fan_in) for weight and bias (reference code).
        let default_linear = |d_in: usize, d_out: usize| {
            let uniform =
                Distribution::Uniform(-1.0 / (d_in as f64).sqrt(), 1.0 / (d_in as f64).sqrt());
            linear(
                Tensor::random([d_in, d_out], uniform, device),
                Tensor::random([d_out], uniform, device),
            )
        };
        let bound = (3.0 / hidden as f64).sqrt();
        let modulators = (0..self.layers)
            .map(|_| {
                linear(
                    Tensor::random(
                        [hidden, hidden],
                        Distribution::Uniform(-bound, bound),
                        device,
                    ),
                    Tensor::ones([hidden], device),
                )
            })
            .collect();
        Ok(LocalHyperZzw {
            reduce: default_linear(self.channels, hidden),
            context: default_linear(hidden, hidden),
            slow_net,
            modulators,
            renorm: SRenorm::new(hidden, device),
        })
    }
}

/// A local HyperZZW branch (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct LocalHyperZzw {
    /// `C → h` on the pooled source.
    pub reduce: Linear,
    /// `h → h` before the GELU.
    pub context: Linear,
    /// The kernel generator on the `k`-point grid.
    pub slow_net: SlowNet,
    /// `F_i, f_i`: the context modulation after each multiplicative layer.
    pub modulators: Vec<Linear>,
    /// The s-renormalisation.
    pub renorm: SRenorm,
}

impl LocalHyperZzw {
    /// Kernel size `k`.
    pub fn kernel_size(&self) -> usize {
        self.slow_net.grid[0]
    }

    /// Channels `C`.
    pub fn channels(&self) -> usize {
        self.slow_net.out_channels()
    }

    /// The kernel from the batch mean of the pooled source, `[points, C]`, as `[points, C]`.
    ///
    /// `mean_batch(pool(X) R + r) = mean_batch(pool(X)) R + r`: the linear `R` after the mean,
    /// on `points` rows rather than `B · points`.
    fn kernel_from_pooled(&self, pooled_mean: Tensor<2>) -> Tensor<2> {
        let reduced = self.reduce.forward(pooled_mean);
        let context = gelu(self.context.forward(reduced));
        let features = self.slow_net.hidden_with(|layer, z| {
            self.renorm.forward(z) * self.modulators[layer].forward(context.clone())
        });
        self.slow_net.output.forward(features)
    }

    /// The context-dependent kernel of `source: [B, C, T]`, as `[1, C, k]`.
    ///
    /// # Errors
    /// [`Error::WidthMismatch`] if `source` does not have `C` channels or the branch is 2D,
    /// [`Error::OutOfRange`] if it is empty.
    pub fn kernel(&self, source: Tensor<3>) -> Result<Tensor<3>> {
        Ok(self.taps(source)?.transpose().unsqueeze_dim(0))
    }

    /// [`LocalHyperZzw::kernel`] as `[k, C]` (taps-major).
    fn taps(&self, source: Tensor<3>) -> Result<Tensor<2>> {
        self.check_dims(1)?;
        self.check(&source.dims(), "local HyperZZW source channels")?;
        let pooled = batch_mean_pool_1d(source, self.kernel_size());
        Ok(self.kernel_from_pooled(pooled))
    }

    /// `depthwise_conv(target, kernel(source))`, both `[B, C, T]`.
    ///
    /// # Errors
    /// As [`LocalHyperZzw::kernel`], for either tensor.
    pub fn forward(&self, source: Tensor<3>, target: Tensor<3>) -> Result<Tensor<3>> {
        self.check(&target.dims(), "local HyperZZW target channels")?;
        let taps = self.taps(source)?;
        // On CubeCL, one kernel on the channels-last rows (a swapped view of the connectivity's
        // streams) in place of Burn's conv1d and its copies.
        #[cfg(feature = "cube-kernels")]
        {
            let rows = target.clone().swap_dims(1, 2);
            if crate::backend::depthwise_conv::takes(&rows, &taps) {
                let output = crate::backend::depthwise_conv::depthwise_conv(rows, taps);
                return Ok(output.swap_dims(1, 2));
            }
        }
        let (channels, k) = (self.channels(), self.kernel_size());
        let options = ConvOptions::new([1], [(k - 1) / 2], [1], channels);
        let weight = taps.transpose().reshape([channels, 1, k]);
        Ok(conv1d(target, weight, None, options))
    }

    /// The `k x k` kernel of `source: [B, C, H, W]`, as `[1, C, k, k]`.
    ///
    /// # Errors
    /// As [`LocalHyperZzw::kernel`], for a 2D branch.
    pub fn kernel_2d(&self, source: Tensor<4>) -> Result<Tensor<4>> {
        self.check_dims(2)?;
        let channels = source.dims()[1];
        self.check(&source.dims(), "local HyperZZW source channels")?;
        let k = self.kernel_size();
        Ok(self
            .kernel_from_pooled(batch_mean_pool_2d(source, k))
            .transpose()
            .reshape([1, channels, k, k]))
    }

    /// `depthwise_conv2d(target, kernel_2d(source))`, both `[B, C, H, W]`.
    ///
    /// # Errors
    /// As [`LocalHyperZzw::kernel_2d`], for either tensor.
    pub fn forward_2d(&self, source: Tensor<4>, target: Tensor<4>) -> Result<Tensor<4>> {
        self.check(&target.dims(), "local HyperZZW target channels")?;
        let kernel = self.kernel_2d(source)?;
        let k = self.kernel_size();
        let padding = (k - 1) / 2;
        let options = ConvOptions::new([1, 1], [padding, padding], [1, 1], self.channels());
        Ok(conv2d(
            target,
            kernel.reshape([self.channels(), 1, k, k]),
            None,
            options,
        ))
    }

    fn check_dims(&self, expected: usize) -> Result<()> {
        let found = self.slow_net.grid.len();
        if found != expected {
            return Err(Error::WidthMismatch {
                name: "local HyperZZW dimensionality".into(),
                expected,
                found,
            });
        }
        Ok(())
    }

    /// Checks an input of shape `dims` (`[B, C, T]` or `[B, C, H, W]`).
    fn check(&self, dims: &[usize], name: &str) -> Result<()> {
        if dims.contains(&0) {
            return Err(Error::OutOfRange {
                name: "local HyperZZW input size",
                value: 0.0,
                requirement: ">= 1 on every axis",
            });
        }
        if dims[1] != self.channels() {
            return Err(Error::WidthMismatch {
                name: name.to_string(),
                expected: self.channels(),
                found: dims[1],
            });
        }
        let smallest_side = dims[2..].iter().copied().min().unwrap_or(0);
        if smallest_side < self.kernel_size() {
            return Err(Error::OutOfRange {
                name: "local HyperZZW input side",
                value: smallest_side as f64,
                requirement: "at least the kernel size",
            });
        }
        Ok(())
    }
}

/// `mean_batch(adaptive_avg_pool1d(source, k))` of `source [B, C, T]`, as `[k, C]`.
///
/// `Q [k, B·T]` times the positions-major rows `[B·T, C]`: the pooling and the batch mean as
/// one product, with no copy where `source` is a swapped `[B, T, C]` (as the connectivity's
/// streams are). Burn's pooling took four kernels forward and three backward on CubeCL (packs
/// and copies around its 2D pooling), the batch mean one more each way.
fn batch_mean_pool_1d(source: Tensor<3>, k: usize) -> Tensor<2> {
    let [batch, channels, length] = source.dims();
    let mut means = vec![0.0; k * batch * length];
    for (bin, range) in pooling_bins(length, k).into_iter().enumerate() {
        let weight = 1.0 / (batch * range.len()) as f64;
        for position in (0..batch).flat_map(|b| range.clone().map(move |t| b * length + t)) {
            means[bin * batch * length + position] = weight;
        }
    }
    let means = averaging(means, [k, batch * length], &source);
    means.matmul(source.swap_dims(1, 2).reshape([batch * length, channels]))
}

/// `mean_batch(adaptive_avg_pool2d(source, [k, k]))` of `source [B, C, H, W]`, as `[k², C]`
/// (the `k × k` bins row-major): the maps `[B·C, H·W]` times `P [H·W, k²]` (no copy for a
/// contiguous `source`), then the batch mean.
fn batch_mean_pool_2d(source: Tensor<4>, k: usize) -> Tensor<2> {
    let [batch, channels, height, width] = source.dims();
    let mut means = vec![0.0; height * width * k * k];
    for (i, rows) in pooling_bins(height, k).into_iter().enumerate() {
        for (j, columns) in pooling_bins(width, k).into_iter().enumerate() {
            let weight = 1.0 / (rows.len() * columns.len()) as f64;
            for (y, x) in rows
                .clone()
                .flat_map(|y| columns.clone().map(move |x| (y, x)))
            {
                means[(y * width + x) * k * k + i * k + j] = weight;
            }
        }
    }
    let means = averaging(means, [height * width, k * k], &source);
    source
        .reshape([batch * channels, height * width])
        .matmul(means)
        .reshape([batch, channels, k * k])
        .mean_dim(0)
        .reshape([channels, k * k])
        .transpose()
}

/// The positions of adaptive average pooling's `bins` bins over `size` positions (as PyTorch's
/// and Burn's): bin `i` spans `⌊i·size/bins⌋ .. ⌈(i+1)·size/bins⌉`.
fn pooling_bins(size: usize, bins: usize) -> Vec<std::ops::Range<usize>> {
    (0..bins)
        .map(|i| i * size / bins..((i + 1) * size).div_ceil(bins))
        .collect()
}

/// The averaging matrix `values` (row-major, `shape`) on `like`'s device, in its float type.
fn averaging<const D: usize>(values: Vec<f64>, shape: [usize; 2], like: &Tensor<D>) -> Tensor<2> {
    let dtype = like.dtype();
    Tensor::from_data(
        TensorData::new(values, shape).convert_dtype(dtype),
        (&like.device(), dtype),
    )
}

#[cfg(test)]
mod tests {
    use burn::tensor::Tolerance;

    use burn::module::Param;

    use super::*;

    #[test]
    fn output_keeps_the_target_shape_and_kernel_is_depthwise() {
        let device = Device::flex();
        let branch = LocalHyperZzwConfig::new(4, 5)
            .with_hidden(8)
            .with_omega_0(10.0)
            .init(&device)
            .unwrap();
        let source = Tensor::<3>::random([2, 4, 12], Distribution::Normal(0.0, 1.0), &device);
        let target = Tensor::<3>::random([2, 4, 12], Distribution::Normal(0.0, 1.0), &device);
        assert_eq!(branch.kernel(source.clone()).unwrap().dims(), [1, 4, 5]);
        assert_eq!(branch.forward(source, target).unwrap().dims(), [2, 4, 12]);
    }

    #[test]
    fn convolution_is_a_zero_padded_cross_correlation() {
        let device = Device::flex();
        let branch = LocalHyperZzwConfig::new(1, 3)
            .with_hidden(4)
            .init(&device)
            .unwrap();
        let source = Tensor::<3>::random([1, 1, 6], Distribution::Normal(0.0, 1.0), &device);
        let target = Tensor::<3>::random([1, 1, 6], Distribution::Normal(0.0, 1.0), &device);
        let kernel: Vec<f64> = branch
            .kernel(source.clone())
            .unwrap()
            .into_data()
            .iter()
            .collect();
        let x: Vec<f64> = target.to_data().iter().collect();
        let expected: Vec<f64> = (0usize..6)
            .map(|t| {
                (0..3)
                    .filter_map(|j| {
                        (t + j)
                            .checked_sub(1)
                            .filter(|&s| s < 6)
                            .map(|s| x[s] * kernel[j])
                    })
                    .sum()
            })
            .collect();
        branch
            .forward(source, target)
            .unwrap()
            .into_data()
            .convert::<f64>()
            .assert_approx_eq::<f64>(
                &TensorData::new(expected, [1, 1, 6]),
                Tolerance::absolute(1e-5),
            );
    }

    #[test]
    fn s_renorm_adds_a_unit_norm_term() {
        let device = Device::flex();
        let renorm = SRenorm {
            a: Param::from_tensor(Tensor::ones([2], &device)),
            b: Param::from_tensor(Tensor::full([2], 0.1, &device)),
        };
        let z = Tensor::<2>::from_floats([[3.0, 0.0], [4.0, 0.0]], &device);
        let values: Vec<f64> = renorm.forward(z).into_data().iter().collect();
        let expected = [3.0 + 0.1 * 0.6, 0.0, 4.0 + 0.1 * 0.8, 0.0];
        assert!(
            values
                .iter()
                .zip(expected)
                .all(|(v, e)| (v - e).abs() < 1e-6),
            "{values:?}"
        );
    }

    #[test]
    fn two_dimensional_branches_convolve_maps() {
        let device = Device::flex();
        let branch = LocalHyperZzwConfig::new(3, 3)
            .with_dims(2)
            .with_hidden(8)
            .with_omega_0(10.0)
            .init(&device)
            .unwrap();
        let source = Tensor::<4>::random([2, 3, 5, 6], Distribution::Normal(0.0, 1.0), &device);
        let target = Tensor::<4>::random([2, 3, 5, 6], Distribution::Normal(0.0, 1.0), &device);
        assert_eq!(
            branch.kernel_2d(source.clone()).unwrap().dims(),
            [1, 3, 3, 3]
        );
        assert_eq!(
            branch.forward_2d(source, target).unwrap().dims(),
            [2, 3, 5, 6]
        );
        assert!(
            branch.kernel(Tensor::zeros([1, 3, 8], &device)).is_err(),
            "a 2D branch refuses sequences"
        );
    }

    #[test]
    fn invalid_configs_and_inputs_are_errors() {
        let device = Device::flex();
        assert!(LocalHyperZzwConfig::new(4, 4).init(&device).is_err());
        assert!(LocalHyperZzwConfig::new(0, 3).init(&device).is_err());
        assert!(LocalHyperZzwConfig::new(4, 0).init(&device).is_err());
        assert!(
            LocalHyperZzwConfig::new(4, 3)
                .with_dims(3)
                .init(&device)
                .is_err()
        );
        let branch = LocalHyperZzwConfig::new(4, 3)
            .with_hidden(4)
            .init(&device)
            .unwrap();
        let wrong = Tensor::<3>::zeros([1, 3, 8], &device);
        let right = Tensor::<3>::zeros([1, 4, 8], &device);
        assert!(matches!(
            branch.forward(wrong.clone(), right.clone()),
            Err(Error::WidthMismatch { .. })
        ));
        assert!(matches!(
            branch.forward(right, wrong),
            Err(Error::WidthMismatch { .. })
        ));
        let short = Tensor::<3>::zeros([1, 4, 2], &device);
        assert!(
            matches!(
                branch.forward(short.clone(), short),
                Err(Error::OutOfRange { .. })
            ),
            "T < k"
        );
        let map = LocalHyperZzwConfig::new(4, 3)
            .with_dims(2)
            .with_hidden(4)
            .init(&device)
            .unwrap();
        let thin = Tensor::<4>::zeros([1, 4, 2, 8], &device);
        assert!(map.forward_2d(thin.clone(), thin).is_err(), "H < k");
    }

    /// The pooling and batch mean as products equal Burn's adaptive average pooling then the
    /// mean over the batch, values and the source's gradient, at sizes that the bins do not
    /// divide (bins of unequal lengths that overlap), in 1D and 2D, in f64 on Flex and in f32 on
    /// wgpu (lavapipe).
    #[test]
    fn pooling_as_products_matches_adaptive_average_pooling() {
        use burn::tensor::DType;
        use burn::tensor::module::{adaptive_avg_pool1d, adaptive_avg_pool2d};

        use crate::test_util::{assert_tensors_close, standard_normal};

        #[cfg_attr(not(feature = "wgpu"), allow(unused_mut))]
        let mut devices = vec![(Device::flex().autodiff(), DType::F64, 1e-12, 4)];
        // On lavapipe, one case of each (each shape's kernels compile anew: seconds a shape).
        #[cfg(feature = "wgpu")]
        devices.push((crate::test_util::wgpu_autodiff(), DType::F32, 1e-5, 1));
        for (device, float, relative, cases) in devices {
            // `(y, ∂source)` for the loss `Σ y ⊙ w`.
            let results = |source: &TensorData, pool: &dyn Fn(Tensor<3>) -> Tensor<2>| {
                let source = Tensor::<3>::from_data(source.clone(), &device)
                    .cast(float)
                    .require_grad();
                let pooled = pool(source.clone());
                let probe = standard_normal(pooled.dims(), 9, &device).cast(float);
                let grads = (pooled.clone() * probe).sum().backward();
                let grad = source.grad(&grads).expect("tracked");
                vec![pooled.into_data(), grad.into_data()]
            };
            let shapes = [
                ([3, 4, 10], 3),
                ([2, 3, 5], 5),
                ([1, 2, 7], 3),
                ([2, 2, 4], 3),
            ];
            for (shape, k) in shapes.into_iter().take(cases) {
                let source = standard_normal(shape, 3, &device).into_data();
                let [_, channels, _] = shape;
                assert_tensors_close(
                    &results(&source, &|x| batch_mean_pool_1d(x, k)),
                    &results(&source, &|x| {
                        adaptive_avg_pool1d(x, k)
                            .mean_dim(0)
                            .reshape([channels, k])
                            .transpose()
                    }),
                    relative,
                    &format!("1D {shape:?}, k = {k}, {float:?} on {device:?}"),
                );
            }
            // 2D through a `[B, C, H·W]` view of `[B, C, H, W]`.
            let maps = [([2, 3, 7, 5], 3), ([1, 2, 3, 4], 3)];
            for ([batch, channels, height, width], k) in maps.into_iter().take(cases) {
                let shape = [batch, channels, height * width];
                let source = standard_normal(shape, 4, &device).into_data();
                let map = |x: Tensor<3>| x.reshape([batch, channels, height, width]);
                assert_tensors_close(
                    &results(&source, &|x| batch_mean_pool_2d(map(x), k)),
                    &results(&source, &|x| {
                        adaptive_avg_pool2d(map(x), [k, k])
                            .mean_dim(0)
                            .reshape([channels, k * k])
                            .transpose()
                    }),
                    relative,
                    &format!("2D {height} x {width}, k = {k}, {float:?} on {device:?}"),
                );
            }
        }
    }
}
