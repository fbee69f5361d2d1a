//! The slow network: a multiplicative sinusoidal filter network that generates hyper-kernels
//! from a coordinate grid (MATH §3.1).
//!
//! With coordinates `c` (`[points, D]`, `linspace(-1, 1, n)` per axis, 'ij' order, row-major):
//!
//! ```text
//! g_l(c) = sin(c A_l + a_l)                               l = 0..L
//! z_0    = g_0(c)
//! z_i    = g_i(c) ⊙ (z_{i-1} B_{i-1} + b_{i-1}) + P        i = 1..L, P: [points] shared by all channels
//! z_i    = s_renorm(z_i)                                   optional (`s_renorm`)
//! K      = z_L W_o + w_o                                   [points, C_out]
//! s_renorm(z)_j = a_j z_j + b_j z_j / max(‖z_j‖₂, 1e-12)  norm over the grid points; a = 1, b = 0.1, learnable
//! ```
//!
//! s-renormalisation (Terminator §2.2) adds a unit-norm copy of every hidden channel, so the
//! kernel's scale no longer rests on the product of `L` sine layers alone. The crate's global
//! kernel generators turn it on by default (HyperZZW connectivity, SFNE); the plain network of
//! MATH §3.1 (the golden vectors') has it off. As for the local generator, `a`, `b` are learnable
//! and the identity term is not detached (MATH §3.3; the reference code's constants 1 and 0.1 are
//! the init).
//!
//! Init (reference code): `A_l = U(±1/√D) · 2π ω0 γ_l` with `γ_l ~ Gamma(6/(l+1), 1)` drawn once
//! (not trained), `a_l = 0`; `B_i = U(±√(3/h))`, `b_i = 1`; `P = 0`; `W_o = U(±√(3/h)) / √points`
//! (Chang scaling, applied once), `w_o = 0`. The kernel does not depend on the data: compute it
//! once per forward pass.
//!
//! On the CubeCL backends each multiplicative layer `sin(c A_i + a_i) ⊙ (z B + b) + P` is one
//! op with its own backward (one kernel forward, one or two backward, sums in f32 for f16 and
//! bf16);
//! elsewhere, and for layers wider than the kernels take, it runs as tensor ops.

use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::Distribution;

use crate::error::{Error, Result, check_positive, check_size};

/// Configuration of [`SlowNet`].
#[derive(Config, Debug)]
pub struct SlowNetConfig {
    /// Kernel points per axis: `[T]` for a 1D kernel, `[H, W]` for a 2D one.
    pub grid: Vec<usize>,
    /// Output channels `C_out` of the kernel.
    pub out_channels: usize,
    /// Hidden width `h` (reference: 64 global, 32 local, 16–32 channel nets).
    #[config(default = 32)]
    pub hidden: usize,
    /// Number of multiplicative layers `L` (`L + 1` sine filters).
    #[config(default = 2)]
    pub layers: usize,
    /// Frequency scale ω0 (reference 2000; smaller gives smoother kernels).
    #[config(default = 2000.0)]
    pub omega_0: f64,
    /// s-renormalisation after each multiplicative layer.
    #[config(default = false)]
    pub s_renorm: bool,
}

impl SlowNetConfig {
    /// Builds the network.
    ///
    /// # Errors
    /// A grid that is not 1D or 2D or has an empty axis, zero sizes, a non-positive ω0.
    pub fn init(&self, device: &Device) -> Result<SlowNet> {
        if self.grid.is_empty() || self.grid.len() > 2 {
            return Err(Error::OutOfRange {
                name: "slow-net grid rank",
                value: self.grid.len() as f64,
                requirement: "1 or 2",
            });
        }
        for &size in &self.grid {
            check_size("slow-net grid size", size)?;
        }
        check_size("slow-net output channels", self.out_channels)?;
        check_size("slow-net hidden width", self.hidden)?;
        check_positive("slow-net omega_0", self.omega_0)?;

        let dims = self.grid.len();
        let points: usize = self.grid.iter().product();
        let hidden = self.hidden;
        let filters = (0..=self.layers)
            .map(|layer| {
                let bound = 1.0 / (dims as f64).sqrt();
                let uniform = Tensor::<2>::random(
                    [dims, hidden],
                    Distribution::Uniform(-bound, bound),
                    device,
                );
                let gamma = gamma_samples(6.0 / (layer + 1) as f64, dims * hidden, device);
                let gamma = Tensor::<2>::from_data(TensorData::new(gamma, [dims, hidden]), device);
                let weight = uniform * gamma.mul_scalar(2.0 * std::f64::consts::PI * self.omega_0);
                linear(weight, Tensor::zeros([hidden], device))
            })
            .collect();
        let bound = (3.0 / hidden as f64).sqrt();
        let linears = (0..self.layers)
            .map(|_| {
                let weight = Tensor::random(
                    [hidden, hidden],
                    Distribution::Uniform(-bound, bound),
                    device,
                );
                linear(weight, Tensor::ones([hidden], device))
            })
            .collect();
        let output = Tensor::<2>::random(
            [hidden, self.out_channels],
            Distribution::Uniform(-bound, bound),
            device,
        )
        .div_scalar((points as f64).sqrt());
        Ok(SlowNet {
            filters,
            linears,
            shared_bias: Param::from_tensor(Tensor::zeros([points], device)),
            output: linear(output, Tensor::zeros([self.out_channels], device)),
            renorm: self.s_renorm.then(|| SRenorm::new(hidden, device)),
            grid: self.grid.clone(),
        })
    }
}

/// A linear layer with the given `[d_in, d_out]` weight and bias.
pub(crate) fn linear(weight: Tensor<2>, bias: Tensor<1>) -> Linear {
    let [d_in, d_out] = weight.dims();
    let mut layer = LinearConfig::new(d_in, d_out).init(&weight.device());
    layer.weight = Param::from_tensor(weight);
    layer.bias = Some(Param::from_tensor(bias));
    layer
}

/// The slow network (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct SlowNet {
    /// The sine filters `c ↦ c A_l + a_l`, `D → h`, `L + 1` of them.
    pub filters: Vec<Linear>,
    /// The hidden linears `B_i, b_i`, `h → h`, `L` of them.
    pub linears: Vec<Linear>,
    /// The bias map `P`, one value per grid point, shared by all hidden channels.
    pub shared_bias: Param<Tensor<1>>,
    /// The output layer `W_o, w_o`, `h → C_out`.
    pub output: Linear,
    /// The s-renormalisation after each multiplicative layer, if on.
    pub renorm: Option<SRenorm>,
    /// Kernel points per axis.
    pub grid: Vec<usize>,
}

impl SlowNet {
    /// The coordinate grid `[points, D]`: `linspace(-1, 1, n)` per axis, 'ij' order.
    pub fn coordinates(&self, device: &Device) -> Tensor<2> {
        let axis = |n: usize, i: usize| {
            if n == 1 {
                -1.0
            } else {
                -1.0 + 2.0 * i as f64 / (n - 1) as f64
            }
        };
        let points: usize = self.grid.iter().product();
        let values: Vec<f64> = match self.grid.as_slice() {
            [n] => (0..*n).map(|i| axis(*n, i)).collect(),
            [rows, columns] => (0..points)
                .flat_map(|p| [axis(*rows, p / columns), axis(*columns, p % columns)])
                .collect(),
            _ => unreachable!("the config only builds 1D and 2D grids"),
        };
        Tensor::from_data(TensorData::new(values, [points, self.grid.len()]), device)
    }

    /// The hidden features `z_L` (`[points, h]`), with `after_layer(i, z_i)` applied after each
    /// multiplicative layer `i = 0..L-1` (the local kernel generator modulates there).
    pub(crate) fn hidden_with(
        &self,
        mut after_layer: impl FnMut(usize, Tensor<2>) -> Tensor<2>,
    ) -> Tensor<2> {
        let device = self.shared_bias.device();
        // In the parameters' float type (the grid is built in the device's default one).
        let dtype = burn::tensor::FloatDType::from(self.shared_bias.val().dtype());
        let coordinates = self.coordinates(&device).cast(dtype);
        let filter = |layer: &Linear| filter_argument(layer, coordinates.clone()).sin();
        let points = self.shared_bias.dims()[0];
        let shared_bias = self.shared_bias.val().reshape([points, 1]);
        let mut hidden = filter(&self.filters[0]);
        for (index, (sine, linear)) in self.filters[1..].iter().zip(&self.linears).enumerate() {
            hidden = match fused_layer(sine, linear, &coordinates, &hidden, &self.shared_bias) {
                Some(fused) => fused,
                None => filter(sine) * linear.forward(hidden) + shared_bias.clone(),
            };
            hidden = after_layer(index, hidden);
        }
        hidden
    }

    /// The kernel as `[points, C_out]`.
    pub fn kernel(&self) -> Tensor<2> {
        let hidden = self.hidden_with(|_, hidden| match &self.renorm {
            Some(renorm) => renorm.forward(hidden),
            None => hidden,
        });
        self.output.forward(hidden)
    }

    /// Output channels `C_out`.
    pub fn out_channels(&self) -> usize {
        self.output.weight.dims()[1]
    }

    /// A 1D kernel as `[1, C_out, T]`.
    ///
    /// # Errors
    /// [`Error::WidthMismatch`] if the grid is not 1D.
    pub fn kernel_1d(&self) -> Result<Tensor<3>> {
        let [length] = self.grid[..] else {
            return Err(grid_rank_error(1, self.grid.len()));
        };
        Ok(self
            .kernel()
            .transpose()
            .reshape([1, self.out_channels(), length]))
    }

    /// A 2D kernel as `[1, C_out, H, W]`.
    ///
    /// # Errors
    /// [`Error::WidthMismatch`] if the grid is not 2D.
    pub fn kernel_2d(&self) -> Result<Tensor<4>> {
        let [rows, columns] = self.grid[..] else {
            return Err(grid_rank_error(2, self.grid.len()));
        };
        Ok(self
            .kernel()
            .transpose()
            .reshape([1, self.out_channels(), rows, columns]))
    }
}

/// A sine filter's argument `c A + a` (`c: [points, D]`, `A: [D, h]`). For one coordinate axis
/// it is a broadcast product: on CubeCL the fusion engine merges it with the sine and the
/// multiplicative layer after it, where a product of inner size 1 is a matmul kernel of its own
/// (forward, and backward for `∂A`).
fn filter_argument(layer: &Linear, coordinates: Tensor<2>) -> Tensor<2> {
    let weight = layer.weight.val();
    if weight.dims()[0] != 1 {
        return layer.forward(coordinates);
    }
    let product = coordinates * weight;
    match &layer.bias {
        Some(bias) => product + bias.val().unsqueeze_dim(0),
        None => product,
    }
}

/// The multiplicative layer `sin(c A + a) ⊙ (z B + b) + P` as one op with its own backward
/// where the device takes it (on CubeCL one kernel forward and one or two backward, where the
/// composed layer is two forward and about nine backward); else `None`.
#[cfg(feature = "cube-kernels")]
fn fused_layer(
    sine: &Linear,
    linear: &Linear,
    coordinates: &Tensor<2>,
    z: &Tensor<2>,
    shared_bias: &Param<Tensor<1>>,
) -> Option<Tensor<2>> {
    use crate::backend::sine_gated::{SineGatedInputs, sine_gated};
    let (Some(gate_bias), Some(bias)) = (&sine.bias, &linear.bias) else {
        return None;
    };
    let inputs = SineGatedInputs {
        coordinates: coordinates.clone(),
        z: z.clone(),
        gate: sine.weight.val(),
        gate_bias: gate_bias.val(),
        weight: linear.weight.val(),
        bias: bias.val(),
        point_bias: shared_bias.val(),
    };
    inputs.takes().then(|| sine_gated(inputs))
}

/// Without the CubeCL kernels the layer is always composed.
#[cfg(not(feature = "cube-kernels"))]
fn fused_layer(
    _sine: &Linear,
    _linear: &Linear,
    _coordinates: &Tensor<2>,
    _z: &Tensor<2>,
    _shared_bias: &Param<Tensor<1>>,
) -> Option<Tensor<2>> {
    None
}

/// The floor of s-renormalisation's column norms.
const RENORM_EPSILON: f64 = 1e-12;

/// `s_renorm(z)_j = a_j z_j + b_j z_j / max(‖z_j‖₂, 1e-12)`, the norm over the grid points.
#[derive(Module, Debug)]
pub struct SRenorm {
    /// Identity weight `a`, `[h]`, init 1.
    pub a: Param<Tensor<1>>,
    /// Normalised weight `b`, `[h]`, init 0.1.
    pub b: Param<Tensor<1>>,
}

impl SRenorm {
    /// `a = 1`, `b = 0.1` for `hidden` channels (the reference code's values).
    pub fn new(hidden: usize, device: &Device) -> Self {
        Self {
            a: Param::from_tensor(Tensor::ones([hidden], device)),
            b: Param::from_tensor(Tensor::full([hidden], 0.1, device)),
        }
    }

    /// Applies it to `z: [points, h]`.
    pub fn forward(&self, z: Tensor<2>) -> Tensor<2> {
        // One op with a backward of its own where the device takes it (a few fused kernels on
        // CubeCL, where autodiff's backward of the composed form is about 26 small ones).
        #[cfg(any(feature = "flex", feature = "cube-kernels"))]
        if crate::backend::column_renorm::takes(&z) {
            return crate::backend::column_renorm::column_renorm(
                z,
                self.a.val(),
                self.b.val(),
                RENORM_EPSILON,
            );
        }
        self.composed(z)
    }

    /// [`SRenorm::forward`] in tensor ops.
    fn composed(&self, z: Tensor<2>) -> Tensor<2> {
        let hidden = self.a.dims()[0];
        let norm = z
            .clone()
            .powf_scalar(2.0)
            .sum_dim(0)
            .sqrt()
            .clamp_min(RENORM_EPSILON);
        let (a, b) = (
            self.a.val().reshape([1, hidden]),
            self.b.val().reshape([1, hidden]),
        );
        z.clone() * a + z / norm * b
    }
}

fn grid_rank_error(expected: usize, found: usize) -> Error {
    Error::WidthMismatch {
        name: "slow-net grid rank".to_string(),
        expected,
        found,
    }
}

/// `count` draws from `Gamma(shape, rate 1)` (Marsaglia–Tsang), using the device's generator.
fn gamma_samples(shape: f64, count: usize, device: &Device) -> Vec<f64> {
    // Gamma(a) = Gamma(a + 1) · U^(1/a) for a < 1.
    let (boosted, base) = if shape < 1.0 {
        (true, shape + 1.0)
    } else {
        (false, shape)
    };
    let d = base - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    const TRIES: usize = 16;
    let draws = |distribution| -> Vec<f64> {
        Tensor::<1>::random([count * TRIES], distribution, device)
            .into_data()
            .iter::<f64>()
            .collect()
    };
    let (normals, uniforms, boosts) = (
        draws(Distribution::Normal(0.0, 1.0)),
        draws(Distribution::Uniform(0.0, 1.0)),
        draws(Distribution::Uniform(0.0, 1.0)),
    );
    (0..count)
        .map(|sample| {
            let accepted = (0..TRIES).find_map(|attempt| {
                let k = sample * TRIES + attempt;
                let (x, u) = (normals[k], uniforms[k]);
                let v = (1.0 + c * x).powi(3);
                (v > 0.0 && u.max(f64::MIN_POSITIVE).ln() < 0.5 * x * x + d - d * v + d * v.ln())
                    .then_some(d * v)
            });
            // Acceptance is above 95% per try: falling through all tries is practically impossible.
            let value = accepted.unwrap_or(base);
            if boosted {
                // `1 − u` is uniform on (0, 1] (`u` on [0, 1)): never 0, so that no sample is.
                value * (1.0 - boosts[sample]).powf(1.0 / shape)
            } else {
                value
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The filter's argument (a broadcast product for one axis) equals the linear layer's
    /// output, and so do the gradients of its weight and bias: one and two axes, a bias that is
    /// not zero, in f32 on Flex and on wgpu (lavapipe).
    #[test]
    fn filter_argument_is_the_linear_layer() {
        #[cfg_attr(not(feature = "wgpu"), allow(unused_mut))]
        let mut devices = vec![Device::flex().autodiff()];
        #[cfg(feature = "wgpu")]
        devices.push(crate::test_util::wgpu_autodiff());
        for device in devices {
            for grid in [vec![9], vec![3, 4]] {
                let mut net = SlowNetConfig::new(grid.clone(), 2)
                    .with_hidden(5)
                    .with_omega_0(1.0)
                    .init(&device)
                    .unwrap();
                let bias = crate::test_util::standard_normal([5], 3, &device);
                net.filters[0].bias = Some(Param::from_tensor(bias));
                let results = |broadcast: bool| -> Vec<TensorData> {
                    let coordinates = net.coordinates(&device);
                    let filter = &net.filters[0];
                    let output = if broadcast {
                        filter_argument(filter, coordinates)
                    } else {
                        filter.forward(coordinates)
                    };
                    let weights = crate::test_util::standard_normal(output.dims(), 4, &device);
                    let grads = (output.clone() * weights).sum().backward();
                    let bias = filter.bias.as_ref().unwrap();
                    vec![
                        output.into_data(),
                        filter.weight.val().grad(&grads).unwrap().into_data(),
                        bias.val().grad(&grads).unwrap().into_data(),
                    ]
                };
                crate::test_util::assert_tensors_close(
                    &results(true),
                    &results(false),
                    1e-5,
                    &format!("grid {grid:?} on {device:?}"),
                );
            }
        }
    }

    #[test]
    fn coordinates_are_an_ij_grid_over_minus_one_one() {
        let device = Device::flex();
        let net = SlowNetConfig::new(vec![2, 3], 1)
            .with_hidden(4)
            .init(&device)
            .unwrap();
        let values: Vec<f64> = net.coordinates(&device).into_data().iter().collect();
        assert_eq!(
            values,
            vec![
                -1.0, -1.0, -1.0, 0.0, -1.0, 1.0, 1.0, -1.0, 1.0, 0.0, 1.0, 1.0
            ]
        );
    }

    #[test]
    fn kernels_have_the_grid_shape() {
        let device = Device::flex();
        let net1 = SlowNetConfig::new(vec![7], 3)
            .with_hidden(8)
            .init(&device)
            .unwrap();
        assert_eq!(net1.kernel_1d().unwrap().dims(), [1, 3, 7]);
        assert!(net1.kernel_2d().is_err());
        let net2 = SlowNetConfig::new(vec![4, 5], 2)
            .with_hidden(8)
            .init(&device)
            .unwrap();
        assert_eq!(net2.kernel_2d().unwrap().dims(), [1, 2, 4, 5]);
        assert!(net2.kernel_1d().is_err());
    }

    #[test]
    fn initialisation_follows_the_reference() {
        let device = Device::flex();
        let net = SlowNetConfig::new(vec![16], 4)
            .with_hidden(8)
            .init(&device)
            .unwrap();
        let bias = |layer: &Linear| -> Vec<f64> {
            layer
                .bias
                .as_ref()
                .unwrap()
                .val()
                .into_data()
                .iter()
                .collect()
        };
        assert!(
            net.linears
                .iter()
                .all(|layer| bias(layer).iter().all(|&b| b == 1.0))
        );
        assert!(
            net.filters
                .iter()
                .all(|layer| bias(layer).iter().all(|&b| b == 0.0))
        );
        // Chang scaling: |W_o| <= sqrt(3/h) / sqrt(points).
        let bound = (3.0f64 / 8.0).sqrt() / 4.0;
        let output: Vec<f64> = net.output.weight.val().into_data().iter().collect();
        assert!(output.iter().all(|w| w.abs() <= bound + 1e-7));
        // Frequencies are scaled by 2π ω0 γ: far beyond the unscaled U(±1) bound.
        let filter: Vec<f64> = net.filters[0].weight.val().into_data().iter().collect();
        assert!(filter.iter().any(|w| w.abs() > 100.0));
    }

    /// The kernel with s-renormalisation, computed on the host in f64 from the weights:
    /// `z_i = sin(c A_i + a_i) ⊙ (z_{i-1} B + b) + P`, then `a ⊙ z + b ⊙ z / ‖z‖` per channel.
    #[test]
    fn s_renorm_matches_its_closed_form() {
        let device = Device::flex();
        let (points, hidden, out) = (6, 4, 3);
        let mut net = SlowNetConfig::new(vec![points], out)
            .with_hidden(hidden)
            .with_omega_0(3.0)
            .with_s_renorm(true)
            .init(&device)
            .unwrap();
        let renorm = net.renorm.as_mut().unwrap();
        renorm.a = Param::from_data([0.5, 1.0, 1.5, 2.0], &device);
        renorm.b = Param::from_data([0.1, -0.2, 0.3, 0.7], &device);
        net.shared_bias = Param::from_tensor(Tensor::random(
            [points],
            Distribution::Normal(0.0, 0.5),
            &device,
        ));

        let host = |tensor: Tensor<2>| -> Vec<Vec<f64>> {
            let columns = tensor.dims()[1];
            let values: Vec<f64> = tensor.into_data().iter().collect();
            values.chunks(columns).map(<[f64]>::to_vec).collect()
        };
        let vector = |tensor: Tensor<1>| -> Vec<f64> { tensor.into_data().iter().collect() };
        let affine = |x: &[Vec<f64>], layer: &Linear| -> Vec<Vec<f64>> {
            let (weight, bias) = (
                host(layer.weight.val()),
                vector(layer.bias.as_ref().unwrap().val()),
            );
            x.iter()
                .map(|row| {
                    (0..bias.len())
                        .map(|j| {
                            bias[j] + row.iter().zip(&weight).map(|(v, w)| v * w[j]).sum::<f64>()
                        })
                        .collect()
                })
                .collect()
        };
        let coordinates = host(net.coordinates(&device));
        let sine = |layer: &Linear| -> Vec<Vec<f64>> {
            affine(&coordinates, layer)
                .into_iter()
                .map(|row| row.into_iter().map(f64::sin).collect())
                .collect()
        };
        let renorm = net.renorm.as_ref().unwrap();
        let (a, b) = (vector(renorm.a.val()), vector(renorm.b.val()));
        let shared_bias = vector(net.shared_bias.val());
        let mut z = sine(&net.filters[0]);
        for (filter, linear) in net.filters[1..].iter().zip(&net.linears) {
            let (g, mixed) = (sine(filter), affine(&z, linear));
            z = (0..points)
                .map(|p| {
                    (0..hidden)
                        .map(|j| g[p][j] * mixed[p][j] + shared_bias[p])
                        .collect()
                })
                .collect();
            let norms: Vec<f64> = (0..hidden)
                .map(|j| (0..points).map(|p| z[p][j] * z[p][j]).sum::<f64>().sqrt())
                .collect();
            for row in &mut z {
                for j in 0..hidden {
                    row[j] = a[j] * row[j] + b[j] * row[j] / norms[j];
                }
            }
        }
        let expected: Vec<f64> = affine(&z, &net.output).concat();
        let actual: Vec<f64> = net.kernel().into_data().iter().collect();
        for (actual, expected) in actual.iter().zip(&expected) {
            assert!((actual - expected).abs() < 1e-4, "{actual} vs {expected}");
        }
        // Off, the same weights give another kernel: the switch is not a no-op.
        let plain: Vec<f64> = SlowNet {
            renorm: None,
            ..net.clone()
        }
        .kernel()
        .into_data()
        .iter()
        .collect();
        assert!(
            plain
                .iter()
                .zip(&expected)
                .any(|(p, e)| (p - e).abs() > 1e-2)
        );
    }

    #[test]
    fn gamma_samples_have_the_right_mean() {
        let device = Device::flex();
        for shape in [6.0, 2.0, 0.5] {
            let samples = gamma_samples(shape, 4000, &device);
            let mean = samples.iter().sum::<f64>() / samples.len() as f64;
            assert!(samples.iter().all(|&s| s > 0.0));
            // Standard error of the mean: sqrt(shape / 4000).
            assert!(
                (mean - shape).abs() < 5.0 * (shape / 4000.0f64).sqrt(),
                "shape {shape}: mean {mean}"
            );
        }
    }

    #[test]
    fn invalid_configs_are_errors() {
        let device = Device::flex();
        assert!(SlowNetConfig::new(vec![], 1).init(&device).is_err());
        assert!(SlowNetConfig::new(vec![2, 2, 2], 1).init(&device).is_err());
        assert!(SlowNetConfig::new(vec![0], 1).init(&device).is_err());
        assert!(SlowNetConfig::new(vec![4], 0).init(&device).is_err());
        assert!(
            SlowNetConfig::new(vec![4], 1)
                .with_omega_0(0.0)
                .init(&device)
                .is_err()
        );
        assert!(
            SlowNetConfig::new(vec![4], 1)
                .with_hidden(0)
                .init(&device)
                .is_err()
        );
    }
}
