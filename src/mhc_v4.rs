//! DeepSeek-V4's mHC: manifold-constrained hyper-connections as DeepSeek-V4 ships them, with the
//! head that collapses the streams (Hugging Face `transformers`' `DeepseekV4HyperConnection`
//! and `DeepseekV4HyperHead`; MATH §5.5).
//!
//! `n` streams of width `C` per token, `S` (`n × C`), flattened stream-major into `x = vec(S)`
//! (`N = nC` entries). Block `j` has `F` (`[(2+n)n, N]`, `transformers`' `fn`), a bias `b`
//! (`base`) and three scales `s = [s_pre, s_post, s_res]`; `ε = 1e-6` (`hc_eps` and
//! `rms_norm_eps`):
//!
//! ```text
//! x̂      = x / sqrt(mean(x²) + ε)                  (RMS norm without a weight)
//! z      = x̂ Fᵀ                                   ([(2+n)n]: pre, post, res)
//! H_pre  = σ(s_pre z_pre + b_pre) + ε             H_post = 2 σ(s_post z_post + b_post)
//! H_res  = SK(s_res z_res + b_res as n × n)       (softmax over each row + ε, then columns
//!                                                   first, additive ε: [`sinkhorn_knopp`])
//! u      = Σ_k H_pre[k] S_k,   h = f_j(u)
//! S'_i   = Σ_k H_res[k][i] S_k + H_post[i] h      (`comb` applied transposed)
//! y      = Σ_k g_k S_k,   g = σ(s_head · x̂ F_headᵀ + b_head) + ε     (the head: F_head [n, N])
//! ```
//!
//! Against the paper's mHC as this crate computes it ([`Mhc`](crate::Mhc), MATH §5.2), which
//! already takes the softmax before Sinkhorn-Knopp, the additive `ε`, columns first and `H_res`
//! transposed: the row scale is `1/sqrt(mean(x²) + ε)` (`ε` inside the root, where mHC has
//! `1/(‖x‖/√N + ε)`), the three scales are one parameter `[3]`, the streams are collapsed by a
//! learned head instead of their mean, and the init is DeepSeek-V4's: `F` and `F_head` from
//! `N(0, init_std)`, biases 0, scales 1, so `H_pre ≈ ½`, `H_post ≈ 1` and `H_res ≈` the uniform
//! `1/n` matrix (not the identity). The streams start as copies of `x`. `transformers` computes
//! the connections in float32 whatever the streams' type; here they take the streams' type.
//!
//! The row scale and projection are the normalised projection mHC uses (one fused op on Flex,
//! with the RMS scale); on CubeCL a layer's connections are mHC's connection table with the RMS
//! row scale and `Φ = Fᵀ` (one kernel forward, Sinkhorn-Knopp inside, three backward) and the
//! head's projection is the unit projection kernel. The stream mixing is mHC's (fused on Flex,
//! kernels on CubeCL).
//!
//! # Shapes
//! - input, block inputs and outputs: `[..., C]`; units `[T, n, C]`
//! - `layers[j].weights`: `[(2+n)n, nC]`, `base`: `[(2+n)n]`, `scale`: `[3]`
//! - `head.weights`: `[n, nC]`, `head.base`: `[n]`, `head.scale`: `[1]`
//!
//! # Example
//! ```
//! use burn::prelude::*;
//! use burn_connectivity::{MhcV4Config, MlpBlockConfig, Stack};
//!
//! let device = Device::default();
//! let blocks = MlpBlockConfig::new(16, 32).init_stack(4, &device)?;
//! let stack = Stack::new(blocks, &MhcV4Config::new(16), &device)?;
//! let y = stack.forward(Tensor::<3>::ones([2, 5, 16], &device));
//! assert_eq!(y.dims(), [2, 5, 16]);
//! # Ok::<(), burn_connectivity::Error>(())
//! ```

use burn::module::Param;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::activation::sigmoid;

use crate::backend::{LayerOps, RowScale};
use crate::connectivity::ConnectivityConfig;
use crate::error::{Error, Result, check_non_negative, check_size};
use crate::mhc::{MHC_EPS, mixing, sinkhorn_unchecked};
use crate::multi_stream::{Layout, Mixing, MixingLayer, MultiStream, StreamReduce};

/// Configuration of [`MhcV4`].
#[derive(Config, Debug)]
pub struct MhcV4Config {
    /// The stream width `C`.
    pub width: usize,
    /// The number of streams `n` (`hc_mult`).
    #[config(default = 4)]
    pub streams: usize,
    /// Sinkhorn-Knopp iterations (`hc_sinkhorn_iters`).
    #[config(default = 20)]
    pub sinkhorn_iterations: usize,
    /// Standard deviation of the projections' init (`initializer_range`).
    #[config(default = 0.02)]
    pub init_std: f64,
}

impl ConnectivityConfig for MhcV4Config {
    type Connectivity = MhcV4;

    fn init(&self, num_blocks: usize, device: &Device) -> Result<MhcV4> {
        if num_blocks == 0 {
            return Err(Error::NoBlocks);
        }
        check_size("mHC (DeepSeek-V4) width", self.width)?;
        check_size("mHC (DeepSeek-V4) streams", self.streams)?;
        check_size(
            "mHC (DeepSeek-V4) sinkhorn_iterations",
            self.sinkhorn_iterations,
        )?;
        check_non_negative("mHC (DeepSeek-V4) init_std", self.init_std)?;
        let (n, entries) = (self.streams, self.streams * self.width);
        // `init_std = 0` is exactly zero (no draw) on every backend.
        let projection = |rows: usize| {
            Param::from_tensor(if self.init_std > 0.0 {
                Tensor::random(
                    [rows, entries],
                    Distribution::Normal(0.0, self.init_std),
                    device,
                )
            } else {
                Tensor::zeros([rows, entries], device)
            })
        };
        let layers = (0..num_blocks)
            .map(|_| MhcV4Layer {
                weights: projection((2 + n) * n),
                base: Param::from_tensor(Tensor::zeros([(2 + n) * n], device)),
                scale: Param::from_tensor(Tensor::ones([3], device)),
            })
            .collect();
        let head = MhcV4Head {
            weights: projection(n),
            base: Param::from_tensor(Tensor::zeros([n], device)),
            scale: Param::from_tensor(Tensor::ones([1], device)),
        };
        Ok(MhcV4 {
            layers,
            head,
            width: self.width,
            streams: n,
            sinkhorn_iterations: self.sinkhorn_iterations,
        })
    }
}

/// The parameters of one block (names as in `transformers`).
#[derive(Module, Debug)]
pub struct MhcV4Layer {
    /// `F` (`fn`), `[(2+n)n, nC]`.
    pub weights: Param<Tensor<2>>,
    /// `b` (`base`), `[(2+n)n]`.
    pub base: Param<Tensor<1>>,
    /// `[s_pre, s_post, s_res]` (`scale`).
    pub scale: Param<Tensor<1>>,
}

/// The head that collapses the streams into the output (`hc_head`).
#[derive(Module, Debug)]
pub struct MhcV4Head {
    /// `F_head` (`hc_fn`), `[n, nC]`.
    pub weights: Param<Tensor<2>>,
    /// `b_head` (`hc_base`), `[n]`.
    pub base: Param<Tensor<1>>,
    /// `s_head` (`hc_scale`), `[1]`.
    pub scale: Param<Tensor<1>>,
}

/// `x̂ Wᵀ` for the rows `x̂ = x / sqrt(mean(x²) + ε)` of the units flattened (`[T, nC]`) and
/// `weights [C', nC]`: the pass's normalised projection (fused on Flex) with the RMS scale
/// `√N / sqrt(‖x‖² + Nε)`.
fn normalised_projection(units: &Tensor<3>, weights: Tensor<2>, ops: &LayerOps) -> Tensor<2> {
    let [tokens, n, width] = units.dims();
    let scale = RowScale::rms(n * width, MHC_EPS);
    ops.normed_projection(
        units.clone().reshape([tokens, n * width]),
        weights.transpose(),
        scale,
    )
}

/// `s_g · z_g + b_g` for the entries `start..start + count` of `z` (group `g` of the scales).
fn affine(
    z: &Tensor<2>,
    layer: &MhcV4Layer,
    group: usize,
    start: usize,
    count: usize,
) -> Tensor<2> {
    let scale = layer.scale.val().narrow(0, group, 1).unsqueeze::<2>();
    let base = layer.base.val().narrow(0, start, count).unsqueeze::<2>();
    z.clone().narrow(1, start, count) * scale + base
}

/// The mixing of one [`MhcV4Layer`], with the connectivity's iteration count.
#[doc(hidden)]
pub struct MhcV4Mixing<'a> {
    layer: &'a MhcV4Layer,
    iterations: usize,
}

impl MixingLayer for MhcV4Mixing<'_> {
    fn mixing(&self, units: &Tensor<3>, ops: &LayerOps) -> Mixing {
        // On CubeCL devices: mHC's table `[H_pre; H_resᵀ; H_post]` with the RMS row scale and
        // `Φ = Fᵀ`, made by one kernel.
        #[cfg(feature = "cube-kernels")]
        {
            let layer = self.layer;
            let table = ops.table(|| {
                let [_, n, width] = units.dims();
                // The `[3]` scale packed (read as it is), `Fᵀ` as a view.
                let scale = layer.scale.val();
                crate::backend::Normalised {
                    units: units.clone(),
                    weights: layer.weights.val().transpose(),
                    scales: [scale.clone(), scale.clone().detach(), scale.detach()],
                    bias: layer.base.val(),
                    streams: n,
                    input_offset: MHC_EPS,
                    depth_factor: 2.0,
                    sinkhorn_iterations: self.iterations,
                    sinkhorn_epsilon: MHC_EPS,
                    mixture: None,
                    row_scale: RowScale::rms(n * width, MHC_EPS),
                }
            });
            if let Some((table, input, slot)) = table {
                return Mixing::table(table, input, 1, slot);
            }
        }
        let [tokens, n, _] = units.dims();
        let z = normalised_projection(units, self.layer.weights.val(), ops);
        let pre = sigmoid(affine(&z, self.layer, 0, 0, n)).add_scalar(MHC_EPS);
        let post = sigmoid(affine(&z, self.layer, 1, n, n)).mul_scalar(2.0);
        let res = sinkhorn_unchecked(
            affine(&z, self.layer, 2, 2 * n, n * n).reshape([tokens, n, n]),
            self.iterations,
        );
        mixing(pre, post, res, tokens, n)
    }
}

/// DeepSeek-V4's manifold-constrained hyper-connections (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct MhcV4 {
    /// The parameters of every block.
    pub layers: Vec<MhcV4Layer>,
    /// The head that makes the output.
    pub head: MhcV4Head,
    /// The stream width `C`.
    pub width: usize,
    /// The number of streams `n`.
    pub streams: usize,
    /// Sinkhorn-Knopp iterations.
    pub sinkhorn_iterations: usize,
}

impl MultiStream for MhcV4 {
    const NAME: &'static str = "mHC (DeepSeek-V4)";

    type Layer<'a> = MhcV4Mixing<'a>;

    fn stream_width(&self) -> usize {
        self.width
    }

    fn layout(&self) -> Layout {
        Layout {
            streams: self.streams,
            fractions: 1,
        }
    }

    /// Unused: the head makes the output.
    fn reduce(&self) -> StreamReduce {
        StreamReduce::Sum
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn mixing(&self, block: usize) -> Option<MhcV4Mixing<'_>> {
        self.layers.get(block).map(|layer| MhcV4Mixing {
            layer,
            iterations: self.sinkhorn_iterations,
        })
    }

    fn first_layers(&self, depth: usize) -> Self {
        Self {
            layers: self.layers[..depth].to_vec(),
            ..self.clone()
        }
    }

    fn head_weights(&self, units: &Tensor<3>) -> Option<Tensor<2>> {
        let head = &self.head;
        let mixes = normalised_projection(units, head.weights.val(), &LayerOps::standalone(units));
        let gains = mixes * head.scale.val().unsqueeze::<2>() + head.base.val().unsqueeze::<2>();
        Some(sigmoid(gains).add_scalar(MHC_EPS))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Connectivity;
    use crate::StreamConnectivity;
    use crate::test_util::{WIDTH, assert_close, input};

    fn v4(blocks: usize) -> MhcV4 {
        MhcV4Config::new(WIDTH)
            .init(blocks, &Device::default())
            .expect("valid config")
    }

    /// With zero projections: `H_pre = ½ + ε`, `H_post = 1`, `H_res` the uniform matrix (up to
    /// Sinkhorn-Knopp's ε), and the head `½ + ε` per stream: the static matrix says so.
    #[test]
    fn zero_projections_give_the_closed_form_matrix() {
        let mut connectivity = v4(2);
        for layer in &mut connectivity.layers {
            layer.weights = Param::from_tensor(layer.weights.val().zeros_like());
        }
        let half = 0.5 + MHC_EPS;
        let matrix = connectivity.matrix();
        // Block 1 reads Σ_k H_pre[k] x = 4 · half · x; block 2 reads it again (H_res keeps the
        // equal streams equal) plus Σ_k H_pre[k] H_post[k] h_1 = 4 · half · h_1.
        assert!((matrix.matrix[0][1] - 4.0 * half).abs() < 1e-5);
        assert!((matrix.matrix[0][2] - 4.0 * half).abs() < 1e-4);
        assert!((matrix.matrix[1][2] - 4.0 * half).abs() < 1e-4);
        // The head weighs each stream by σ(0) + ε.
        assert!((matrix.output[2] - 4.0 * half).abs() < 1e-4);
    }

    /// The output is the head's weighted sum of the final streams, in the state's own terms.
    #[test]
    fn the_head_collapses_the_streams() {
        let device = Device::default();
        let connectivity = v4(3);
        let x = input(&device);
        let mut state = StreamConnectivity::<3>::start(&connectivity, x.clone());
        for block in 0..3 {
            let branch = connectivity.block_input(&state).tanh();
            state = connectivity.step(state, block, branch);
        }
        let weights = connectivity.head_weights(&state.units).expect("a head");
        let [tokens, n, width] = state.units.dims();
        let expected = (state.units.clone() * weights.reshape([tokens, n, 1]))
            .sum_dim(1)
            .reshape(x.dims());
        assert_eq!(width, WIDTH);
        assert_close(connectivity.output(&state), expected);
    }

    /// mHC's connection-table kernels with the RMS row scale (`ε` inside the root) and
    /// `Φ = Fᵀ` against V4's composed connections on wgpu, values and every parameter's
    /// gradient (the `[3]` scale read packed, `F` through its transposed view): two stream
    /// counts, widths below and above the cube's units.
    #[cfg(feature = "wgpu")]
    #[test]
    fn connection_table_kernels_match_the_composed_connections() {
        use crate::test_util::{
            Perturbed, assert_table_kernels_match_composed, gradient_data, wgpu_autodiff,
        };
        let device = wgpu_autodiff();
        for (streams, iterations, tokens, width) in [(4, 20, 37, 24), (2, 5, 6, 300)] {
            let v4 = MhcV4Config::new(width)
                .with_streams(streams)
                .with_sinkhorn_iterations(iterations)
                .with_init_std(0.0)
                .init(1, &device)
                .expect("valid config")
                // A fixed draw on the zero init: the same weights in every run.
                .map(&mut Perturbed::new(0.4));
            let layer = &v4.layers[0];
            // Small units (std 1e-3), so that the RMS scale's ε matters next to their mean square.
            assert_table_kernels_match_composed(
                &v4,
                [tokens, streams, width],
                1e-3,
                |grads| {
                    vec![
                        gradient_data(&layer.weights, grads),
                        gradient_data(&layer.base, grads),
                        gradient_data(&layer.scale, grads),
                    ]
                },
                &format!("V4 n={streams} T={iterations} tokens={tokens} C={width}"),
            );
        }
    }

    #[test]
    fn bad_settings_are_typed_errors_naming_them() {
        let device = Device::default();
        let name = |config: MhcV4Config| match config.init(2, &device) {
            Err(Error::OutOfRange { name, .. }) => name,
            other => panic!("expected an error, got {other:?}"),
        };
        assert_eq!(name(MhcV4Config::new(0)), "mHC (DeepSeek-V4) width");
        assert_eq!(
            name(MhcV4Config::new(8).with_streams(0)),
            "mHC (DeepSeek-V4) streams"
        );
        assert_eq!(
            name(MhcV4Config::new(8).with_sinkhorn_iterations(0)),
            "mHC (DeepSeek-V4) sinkhorn_iterations"
        );
        assert_eq!(
            name(MhcV4Config::new(8).with_init_std(-1.0)),
            "mHC (DeepSeek-V4) init_std"
        );
        assert!(matches!(
            MhcV4Config::new(8).init(0, &device),
            Err(Error::NoBlocks)
        ));
    }
}
