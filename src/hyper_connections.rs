//! Hyper-connections (Zhu et al. 2024, "Hyper-Connections", Alg. 2) and frac-connections
//! (arXiv 2503.14125) as an option of the same module (MATH §5.1).
//!
//! `n` residual streams `S = [S_1..S_n]` per token, each of width `d`, start as copies of `x`.
//! Block `j` reads a mixture of the streams and writes its output back into every stream:
//!
//! ```text
//! N_k  = S_k / max(‖S_k‖₂, 1e-12) · √d · (1 + γ)        (RMSNorm of each stream)
//! A    = s_a · tanh(N W_a) + A_s                         (n × (1+n); dynamic part optional)
//! B    = s_b · tanh(N w_b) + b_s                         (n)
//! M_t  = Σ_k A[k][t] S_k,  t = 0..n                      (M_0 is the block input)
//! h_j  = f_j(M_0)
//! S'_k = B_k h_j + M_k
//! y    = Σ_k S_k                                          (option: the mean)
//! ```
//!
//! Init (the paper, lucidrains/hyper-connections): `A_s[:,0] = e_{(j-1) mod n}` (block `j` reads
//! one stream), `A_s[:,1:] = I`, `W_a = 0`, `s_a = 0.01`, `b_s = 1`, `w_b = 0`, `s_b = 0.01`,
//! `γ = 0`. With `n = 1` and no dynamic part this is exactly ResNet. `tanh` can be switched off,
//! and the dynamic part too (static HC).
//!
//! **Frac-connections** (`fractions = m > 1`) split the width into `m` fractions of `d/m` instead
//! of copying: every stream holds `m` units of width `d/m` (`n·m` units), the block input is `m`
//! views, one per fraction, concatenated back to width `d`, and fraction `f` of the block output
//! goes to the units holding fraction `f`. `A` is `n·m × (m + n·m)`, `B` has `n·m` entries, the
//! norm and `W_a`, `w_b` act on units of width `d/m`. Init: view `f` reads fraction `f` of stream
//! `(j-1) mod n`. With `n = 1` and no dynamic part this is again exactly ResNet.
//!
//! **The matrix `C`.** With the dynamic part, the connections depend on the tokens. [`matrix`]
//! reports the static part (`A_s`, `b_s`: the connections of a token whose dynamic terms vanish,
//! exact for static HC), run through the recursion of the streams; with fractions, `C[i][j]` is
//! the coefficient of `h_i`'s fraction `f` in view `f` of block `j`'s input, averaged over `f`.
//!
//! [`matrix`]: crate::Connectivity::matrix

use burn::module::Param;
use burn::prelude::*;

use crate::backend::{LayerOps, RowScale};
use crate::connectivity::ConnectivityConfig;
use crate::error::{Error, Result, check_size};
use crate::multi_stream::{Layout, Mixing, MixingLayer, MultiStream, StreamReduce};

/// Configuration of [`HyperConnections`].
#[derive(Config, Debug)]
pub struct HyperConnectionsConfig {
    /// The width `d` of the stack's streams (the last axis).
    pub width: usize,
    /// Number of residual streams `n` (the paper's expansion rate).
    #[config(default = 4)]
    pub streams: usize,
    /// Frac-connections: the number of fractions `m` each stream is split into (1: plain HC).
    #[config(default = 1)]
    pub fractions: usize,
    /// Whether the connections depend on the tokens (dynamic HC); static HC otherwise.
    #[config(default = true)]
    pub dynamic: bool,
    /// Whether the dynamic terms go through `tanh`.
    #[config(default = true)]
    pub tanh: bool,
    /// How the streams make the output: their sum (default) or their mean.
    #[config(default = "StreamReduce::Sum")]
    pub reduce: StreamReduce,
}

impl HyperConnectionsConfig {
    fn layout(&self) -> Layout {
        Layout {
            streams: self.streams,
            fractions: self.fractions,
        }
    }
}

impl ConnectivityConfig for HyperConnectionsConfig {
    type Connectivity = HyperConnections;

    fn init(&self, num_blocks: usize, device: &Device) -> Result<HyperConnections> {
        if num_blocks == 0 {
            return Err(Error::NoBlocks);
        }
        check_size("hyper-connection streams", self.streams)?;
        check_size("frac-connection fractions", self.fractions)?;
        let layout = self.layout();
        let unit_width = layout.unit_width(self.width)?;
        let layers = (0..num_blocks)
            .map(|block| HcLayer::new(block, layout, unit_width, self.dynamic, device))
            .collect();
        Ok(HyperConnections {
            layers,
            width: self.width,
            streams: self.streams,
            fractions: self.fractions,
            tanh: self.tanh,
            reduce: self.reduce,
        })
    }
}

/// The connections of one block (record names as in lucidrains/hyper-connections).
#[derive(Module, Debug)]
pub struct HcLayer {
    /// `A_s`, `[U, V + U]` (units × (views + units); `U = V = n` without fractions).
    pub static_alpha: Param<Tensor<2>>,
    /// `b_s`, `[U]`.
    pub static_beta: Param<Tensor<1>>,
    /// The dynamic part, absent for static HC.
    pub dynamic: Option<HcDynamic>,
}

/// The token-dependent part of an [`HcLayer`].
#[derive(Module, Debug)]
pub struct HcDynamic {
    /// `W_a`, `[w, V + U]`.
    pub dynamic_alpha_fn: Param<Tensor<2>>,
    /// `s_a`, `[1]`.
    pub dynamic_alpha_scale: Param<Tensor<1>>,
    /// `w_b`, `[w]`.
    pub dynamic_beta_fn: Param<Tensor<1>>,
    /// `s_b`, `[1]`.
    pub dynamic_beta_scale: Param<Tensor<1>>,
    /// The RMSNorm gain `γ`, `[w]` (applied as `1 + γ`).
    pub norm_gamma: Param<Tensor<1>>,
}

impl HcLayer {
    /// The gradients of `A`, `b`, the dynamic weights and scales (`W`, `m_W`, `v`, `m_v`) and
    /// the norm's `γ`, in that order (for tests; the layer must be dynamic).
    #[cfg(all(test, feature = "wgpu"))]
    pub(crate) fn gradient_data(
        &self,
        grads: &burn::tensor::Gradients,
    ) -> Vec<burn::tensor::TensorData> {
        use crate::test_util::gradient_data;
        let dynamic = self.dynamic.as_ref().expect("a dynamic layer");
        vec![
            gradient_data(&self.static_alpha, grads),
            gradient_data(&self.static_beta, grads),
            gradient_data(&dynamic.dynamic_alpha_fn, grads),
            gradient_data(&dynamic.dynamic_alpha_scale, grads),
            gradient_data(&dynamic.dynamic_beta_fn, grads),
            gradient_data(&dynamic.dynamic_beta_scale, grads),
            gradient_data(&dynamic.norm_gamma, grads),
        ]
    }

    fn new(
        block: usize,
        layout: Layout,
        unit_width: usize,
        dynamic: bool,
        device: &Device,
    ) -> Self {
        let (views, units) = (layout.fractions, layout.units());
        let read = block % layout.streams;
        let mut alpha = vec![0.0; units * (views + units)];
        for f in 0..views {
            alpha[(read * views + f) * (views + units) + f] = 1.0;
        }
        for u in 0..units {
            alpha[u * (views + units) + views + u] = 1.0;
        }
        let static_alpha =
            Tensor::from_data(TensorData::new(alpha, [units, views + units]), device);
        let dynamic = dynamic.then(|| HcDynamic {
            dynamic_alpha_fn: Param::from_tensor(Tensor::zeros(
                [unit_width, views + units],
                device,
            )),
            dynamic_alpha_scale: Param::from_tensor(Tensor::full([1], 0.01, device)),
            dynamic_beta_fn: Param::from_tensor(Tensor::zeros([unit_width], device)),
            dynamic_beta_scale: Param::from_tensor(Tensor::full([1], 0.01, device)),
            norm_gamma: Param::from_tensor(Tensor::zeros([unit_width], device)),
        });
        Self {
            static_alpha: Param::from_tensor(static_alpha),
            static_beta: Param::from_tensor(Tensor::ones([units], device)),
            dynamic,
        }
    }

    /// Units and views of this layer (from its parameter shapes).
    fn units_and_views(&self) -> (usize, usize) {
        let [units, columns] = self.static_alpha.dims();
        (units, columns - units)
    }

    /// `A` (`[1 | tokens, U, V+U]`) and `B` (`[1 | tokens, U, 1]`).
    fn connections(&self, units: &Tensor<3>, tanh: bool, ops: &LayerOps) -> (Tensor<3>, Tensor<3>) {
        let (count, views) = self.units_and_views();
        let alpha = self.static_alpha.val().unsqueeze::<3>();
        let beta = self.static_beta.val().reshape([1, count, 1]);
        let Some(dynamic) = &self.dynamic else {
            return (alpha, beta);
        };
        let [tokens, _, width] = units.dims();
        // N W = (S ⊙ (1 + γ)) W · √w / ‖S‖ = S (diag(1 + γ) W) · √w / ‖S‖: the gain goes into
        // the small weight matrix, and one product serves both: [w, V+U] and [w, 1] side by side.
        let rows = units.clone().reshape([tokens * count, width]);
        let gain = dynamic.norm_gamma.val().add_scalar(1.0).reshape([width, 1]);
        let weights = Tensor::cat(
            vec![
                dynamic.dynamic_alpha_fn.val(),
                dynamic.dynamic_beta_fn.val().reshape([width, 1]),
            ],
            1,
        ) * gain;
        let mut projected = ops.normed_projection(rows, weights, norm_scale(width));
        if tanh {
            projected = projected.tanh();
        }
        let columns = views + count;
        let dynamic_alpha = projected
            .clone()
            .narrow(1, 0, columns)
            .mul(dynamic.dynamic_alpha_scale.val().reshape([1, 1]))
            .reshape([tokens, count, columns]);
        let dynamic_beta = projected
            .narrow(1, columns, 1)
            .mul(dynamic.dynamic_beta_scale.val().reshape([1, 1]))
            .reshape([tokens, count, 1]);
        (dynamic_alpha + alpha, dynamic_beta + beta)
    }
}

/// The RMSNorm's row scale `√w / max(‖x‖, 1e-12)`.
fn norm_scale(width: usize) -> RowScale {
    RowScale {
        numerator: (width as f64).sqrt(),
        offset: 0.0,
        floor: 1e-12,
        root_offset: 0.0,
    }
}

/// The mixing of one [`HcLayer`], with the connectivity's tanh switch.
#[doc(hidden)]
pub struct HcMixing<'a> {
    layer: &'a HcLayer,
    tanh: bool,
}

impl MixingLayer for HcMixing<'_> {
    fn mixing(&self, units: &Tensor<3>, ops: &LayerOps) -> Mixing {
        // On CubeCL devices: `[A | B]ᵀ` as one table, made by one kernel.
        #[cfg(feature = "cube-kernels")]
        if let Some(dynamic) = &self.layer.dynamic {
            let (_, views) = self.layer.units_and_views();
            let table = ops.table(|| {
                let width = units.dims()[2];
                crate::backend::Gated {
                    units: units.clone(),
                    mixing_weights: dynamic.dynamic_alpha_fn.val(),
                    depth_weights: dynamic.dynamic_beta_fn.val(),
                    gain: dynamic.norm_gamma.val(),
                    mixing_scale: dynamic.dynamic_alpha_scale.val(),
                    depth_scale: dynamic.dynamic_beta_scale.val(),
                    mixing_static: self.layer.static_alpha.val(),
                    depth_static: self.layer.static_beta.val(),
                    tanh: self.tanh,
                    row_scale: norm_scale(width),
                }
            });
            if let Some((table, input, slot)) = table {
                return Mixing::table(table, input, views, slot);
            }
        }
        let (alpha, beta) = self.layer.connections(units, self.tanh, ops);
        Mixing::stacked(alpha.swap_dims(1, 2), beta)
    }
}

/// Hyper-connections (and frac-connections): `n` residual streams mixed by learned, optionally
/// token-dependent connections (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct HyperConnections {
    /// The connections of every block.
    pub layers: Vec<HcLayer>,
    /// The stream width `d`.
    pub width: usize,
    /// The number of streams `n`.
    pub streams: usize,
    /// The number of fractions `m` of each stream.
    pub fractions: usize,
    /// Whether the dynamic terms go through `tanh`.
    pub tanh: bool,
    /// How the streams make the output.
    #[module(skip)]
    pub reduce: StreamReduce,
}

impl HyperConnections {
    fn layout(&self) -> Layout {
        Layout {
            streams: self.streams,
            fractions: self.fractions,
        }
    }

    fn mixing(&self, block: usize) -> Option<HcMixing<'_>> {
        self.layers.get(block).map(|layer| HcMixing {
            layer,
            tanh: self.tanh,
        })
    }

    /// The static connections of every layer read back to the host: `A_s` (`[U][V+U]`) and
    /// `b_s`.
    pub fn static_values(&self) -> Vec<(Vec<Vec<f64>>, Vec<f64>)> {
        self.layers
            .iter()
            .map(|layer| {
                let [_, columns] = layer.static_alpha.dims();
                let alpha: Vec<f64> = layer.static_alpha.val().into_data().iter::<f64>().collect();
                let beta = layer.static_beta.val().into_data().iter::<f64>().collect();
                (alpha.chunks(columns).map(<[f64]>::to_vec).collect(), beta)
            })
            .collect()
    }

    /// Per block, the largest distance of the static width connections `A_s[:, V:]` from the
    /// identity (0 at init: each stream carries itself forward).
    pub fn residual_distance_from_identity(&self) -> Vec<f64> {
        let views = self.fractions;
        self.static_values()
            .iter()
            .map(|(alpha, _)| {
                alpha
                    .iter()
                    .enumerate()
                    .flat_map(|(u, row)| {
                        row[views..]
                            .iter()
                            .enumerate()
                            .map(move |(t, value)| (value - f64::from(u8::from(u == t))).abs())
                    })
                    .fold(0.0, f64::max)
            })
            .collect()
    }
}

impl MultiStream for HyperConnections {
    const NAME: &'static str = "hyper-connections";

    type Layer<'a> = HcMixing<'a>;

    fn stream_width(&self) -> usize {
        self.width
    }

    fn layout(&self) -> Layout {
        HyperConnections::layout(self)
    }

    fn reduce(&self) -> StreamReduce {
        self.reduce
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn mixing(&self, block: usize) -> Option<HcMixing<'_>> {
        HyperConnections::mixing(self, block)
    }

    fn first_layers(&self, depth: usize) -> Self {
        Self {
            layers: self.layers[..depth].to_vec(),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Distribution;

    use super::*;
    use crate::block::Block;
    use crate::connectivity::probe_matrix;
    use crate::stack::Stack;
    use crate::test_util::{TanhBlock, WIDTH, assert_close, blocks, input, residual_loop};
    use crate::{Connectivity, Error, StreamConnectivity};

    fn random(shape: impl Into<burn::tensor::Shape>, device: &Device) -> Tensor<2> {
        Tensor::random(shape, Distribution::Normal(0.0, 0.5), device)
    }

    /// Every parameter moved away from its init, so that every term matters.
    fn randomised(mut hc: HyperConnections, device: &Device) -> HyperConnections {
        for layer in &mut hc.layers {
            let [units, columns] = layer.static_alpha.dims();
            layer.static_alpha =
                Param::from_tensor(layer.static_alpha.val() + random([units, columns], device));
            layer.static_beta = Param::from_tensor(
                layer.static_beta.val() + random([1, units], device).reshape([units]),
            );
            if let Some(dynamic) = &mut layer.dynamic {
                let [width, columns] = dynamic.dynamic_alpha_fn.dims();
                dynamic.dynamic_alpha_fn = Param::from_tensor(random([width, columns], device));
                dynamic.dynamic_beta_fn =
                    Param::from_tensor(random([1, width], device).reshape([width]));
                dynamic.norm_gamma =
                    Param::from_tensor(random([1, width], device).reshape([width]));
                dynamic.dynamic_alpha_scale = Param::from_tensor(Tensor::full([1], 0.7, device));
                dynamic.dynamic_beta_scale = Param::from_tensor(Tensor::full([1], -0.4, device));
            }
        }
        hc
    }

    fn stack(
        config: &HyperConnectionsConfig,
        device: &Device,
    ) -> Stack<TanhBlock, HyperConnections> {
        Stack::new(blocks(5, device), config, device).unwrap()
    }

    /// MATH §5.1 written per stream and per fraction with host loops over `k` and `t`.
    fn closed_form(stack: &Stack<TanhBlock, HyperConnections>, x: Tensor<3>) -> Tensor<3> {
        let hc = &stack.connectivity;
        let (n, m) = (hc.streams, hc.fractions);
        let w = hc.width / m;
        let fraction = |tensor: &Tensor<3>, f: usize| tensor.clone().narrow(2, f * w, w);
        // units[k * m + f]: fraction f of stream k, [2, 3, w].
        let mut units: Vec<Tensor<3>> = (0..n * m).map(|u| fraction(&x, u % m)).collect();
        for (layer, block) in hc.layers.iter().zip(&stack.blocks) {
            let (alpha, beta) = {
                let (count, views) = layer.units_and_views();
                let mut alpha = Vec::new();
                let mut beta = Vec::new();
                for unit in &units {
                    let mut row = layer.static_alpha.val().narrow(0, alpha.len(), 1).reshape([
                        1,
                        1,
                        views + count,
                    ]);
                    let mut b = layer
                        .static_beta
                        .val()
                        .narrow(0, beta.len(), 1)
                        .reshape([1, 1, 1]);
                    if let Some(dynamic) = &layer.dynamic {
                        let norm = unit.clone().square().sum_dim(2).sqrt().clamp_min(1e-12);
                        let gain = dynamic.norm_gamma.val().add_scalar(1.0).reshape([1, 1, w]);
                        let normed = unit.clone() / norm * gain * (w as f64).sqrt();
                        let a = normed
                            .clone()
                            .matmul(dynamic.dynamic_alpha_fn.val().unsqueeze());
                        let c =
                            (normed * dynamic.dynamic_beta_fn.val().reshape([1, 1, w])).sum_dim(2);
                        let (a, c) = if hc.tanh {
                            (a.tanh(), c.tanh())
                        } else {
                            (a, c)
                        };
                        row = row + a * dynamic.dynamic_alpha_scale.val().reshape([1, 1, 1]);
                        b = b + c * dynamic.dynamic_beta_scale.val().reshape([1, 1, 1]);
                    }
                    alpha.push(row);
                    beta.push(b);
                }
                (alpha, beta)
            };
            let mix = |column: usize| {
                units
                    .iter()
                    .zip(&alpha)
                    .map(|(unit, a)| unit.clone() * a.clone().narrow(2, column, 1))
                    .reduce(|sum, term| sum + term)
                    .unwrap()
            };
            let views: Vec<Tensor<3>> = (0..m).map(mix).collect();
            let h = block.branch(Tensor::cat(views, 2), &());
            units = (0..n * m)
                .map(|u| mix(m + u) + beta[u].clone() * fraction(&h, u % m))
                .collect();
        }
        let streams: Vec<Tensor<3>> = (0..n)
            .map(|k| Tensor::cat(units[k * m..(k + 1) * m].to_vec(), 2))
            .collect();
        let total = streams.into_iter().reduce(|sum, s| sum + s).unwrap();
        match hc.reduce {
            StreamReduce::Sum => total,
            StreamReduce::Mean => total / n as f64,
        }
    }

    /// The connection-table kernel (one kernel forward, three backward) against the composed
    /// connections on wgpu, values and every gradient: with and without `tanh`, one and several
    /// streams, frac-connections, widths below and above the kernel's cube.
    #[cfg(feature = "wgpu")]
    #[test]
    fn connection_table_kernels_match_the_composed_connections() {
        use crate::test_util::{Perturbed, assert_table_kernels_match_composed, wgpu_autodiff};
        let device = wgpu_autodiff();
        for (streams, fractions, tanh, tokens, width) in [
            (4, 1, true, 37, 24),
            (4, 1, false, 5, 300),
            (2, 2, true, 9, 16),
            (1, 1, true, 3, 8),
        ] {
            let hc = HyperConnectionsConfig::new(width)
                .with_streams(streams)
                .with_fractions(fractions)
                .with_tanh(tanh)
                .init(1, &device)
                .expect("valid config")
                .map(&mut Perturbed::new(0.5));
            let layer = &hc.layers[0];
            assert_table_kernels_match_composed(
                &hc,
                [tokens, streams * fractions, width / fractions],
                1.0,
                |grads| layer.gradient_data(grads),
                &format!("n={streams} m={fractions} tanh={tanh} T={tokens} d={width}"),
            );
        }
    }

    /// Past one launch axis (65535 cubes on wgpu): 70000 tokens, a cube per token in the
    /// gated table's forward and the stream mixes' backward and a cube per row in the table's
    /// backward, spread over a second axis; then a width of 70000 with one unit per cube in
    /// the weights' product (a cube per entry of a row) and in the finishing kernel's sums over
    /// `W` (a cube per row of `W`), also past one axis. Every value and gradient equals the
    /// composed form's (on Flex).
    #[cfg(feature = "wgpu")]
    #[test]
    fn connection_table_kernels_past_one_launch_axis() {
        use crate::backend::Knobs;
        use crate::test_util::{Perturbed, assert_table_kernels_match_flex};
        let streams = 2;
        let one_unit_sums = Knobs {
            most_summing_units: 1,
            ..Knobs::default()
        };
        for (tokens, width, knobs) in [(70_000, 8, Knobs::default()), (2, 70_000, one_unit_sums)] {
            let hc = HyperConnectionsConfig::new(width)
                .with_streams(streams)
                .init(1, &Device::flex().autodiff())
                .expect("valid config")
                .map(&mut Perturbed::new(0.5));
            assert_table_kernels_match_flex(
                &hc,
                [tokens, streams, width],
                1.0,
                knobs,
                |hc, grads| hc.layers[0].gradient_data(grads),
                &format!("n={streams} T={tokens} d={width}"),
                1e-4,
            );
        }
    }

    /// In f16 the gated table's kernels sum in f32: the rows' norms and projections over a
    /// width of 2¹⁸ (4096 products a unit at 64 units a cube), the table and every gradient of
    /// [`table_part_results`](crate::test_util::table_part_results). Kept in f16, a unit's sum
    /// of like-signed terms stops growing once its spacing passes twice a term (2048 terms).
    /// The weights over the width are drawn small and positive on average, so that the sums
    /// grow and stay inside f16's range. (The whole layer is left out: at this width its
    /// gradients of `m_W` pass f16's largest.) The composed reference runs on Flex: lavapipe
    /// stops a shader's loops after 65535 iterations in all, which Burn's reductions over rows
    /// this long can reach.
    #[cfg(feature = "wgpu")]
    #[test]
    fn half_precision_table_kernels_sum_in_f32() {
        use crate::backend::{GatedWeights, Knobs, UnitOps};
        use crate::test_util::{
            OnDeviceAs, assert_half_sums_in_f32_in_forms, fixed_normal, table_part_results,
            wgpu_autodiff,
        };
        /// Fixed draws: `1e-4 ± 1e-4` for the parameters over the width, `0.5 ± 0.2` for the
        /// others.
        struct Redrawn {
            width: usize,
            seed: u64,
        }
        impl burn::module::ModuleMapper for Redrawn {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                self.seed += 1;
                let (width, seed) = (self.width, self.seed);
                param.map(|tensor| {
                    let (mean, std) = if tensor.dims()[0] == width {
                        (1e-4, 1e-4)
                    } else {
                        (0.5, 0.2)
                    };
                    (fixed_normal(tensor.dims(), std, seed, &tensor.device()) + mean).require_grad()
                })
            }
        }
        let (streams, tokens, width) = (4, 2, 1 << 18);
        let flex = Device::flex().autodiff();
        let hc = HyperConnectionsConfig::new(width)
            .with_streams(streams)
            .with_tanh(false)
            .init(1, &flex)
            .expect("valid config")
            .map(&mut Redrawn { width, seed: 0 });
        let units = fixed_normal([tokens, streams, width], 0.1, 7, &flex) + 0.1;
        // The kernels as the fifth lease measured them, then with the weights staged in
        // shared memory for 4 rows per cube.
        let staged = Knobs {
            gated_weights: GatedWeights::Staged,
            gated_rows: 4,
            ..Knobs::default()
        };
        let forms = [Knobs::default(), staged];
        assert_half_sums_in_f32_in_forms("gated table", &forms, |dtype, kernels| {
            let device = if kernels {
                wgpu_autodiff()
            } else {
                flex.clone()
            };
            let hc = hc.clone().map(&mut OnDeviceAs(device.clone(), dtype));
            let units = Tensor::<3>::from_data(units.to_data(), &device).cast(dtype);
            let ops = if kernels {
                UnitOps::Kernels.layer()
            } else {
                LayerOps::composed()
            };
            let layer = &hc.layers[0];
            table_part_results(&hc, &units, ops, |grads| layer.gradient_data(grads))
        });
    }

    #[test]
    fn one_static_stream_is_exactly_resnet() {
        let device = Device::flex();
        for fractions in [1, 2, 3] {
            let config = HyperConnectionsConfig::new(WIDTH)
                .with_streams(1)
                .with_fractions(fractions)
                .with_dynamic(false);
            let stack = stack(&config, &device);
            let x = input(&device);
            let expected = residual_loop(&stack.blocks, x.clone());
            assert_eq!(
                stack
                    .forward(x)
                    .into_data()
                    .iter::<f32>()
                    .collect::<Vec<_>>(),
                expected.into_data().iter::<f32>().collect::<Vec<_>>(),
                "{fractions} fractions"
            );
        }
    }

    #[test]
    fn at_init_every_stream_is_the_residual_stream() {
        let device = Device::flex();
        for reduce in [StreamReduce::Sum, StreamReduce::Mean] {
            let config = HyperConnectionsConfig::new(WIDTH).with_reduce(reduce);
            let stack = stack(&config, &device);
            let x = input(&device);
            let expected = residual_loop(&stack.blocks, x.clone());
            let scale = if reduce == StreamReduce::Sum {
                4.0
            } else {
                1.0
            };
            assert_close(stack.forward(x), expected * scale);
        }
    }

    #[test]
    fn forward_is_the_closed_form_for_every_variant() {
        let device = Device::flex();
        let variants = [
            (3, 1, true, true),
            (2, 1, true, false),
            (2, 3, false, true),
            (2, 2, true, true),
        ];
        for (streams, fractions, dynamic, tanh) in variants {
            let config = HyperConnectionsConfig::new(WIDTH)
                .with_streams(streams)
                .with_fractions(fractions)
                .with_dynamic(dynamic)
                .with_tanh(tanh)
                .with_reduce(StreamReduce::Mean);
            let mut stack = stack(&config, &device);
            stack.connectivity = randomised(stack.connectivity, &device);
            let x = input(&device);
            let expected = closed_form(&stack, x.clone());
            // f32 rounding relative to the streams' scale (they reach ~100 with these weights),
            // as the golden files' tolerance.
            let scale = expected.clone().abs().max().into_scalar::<f64>().max(1.0);
            stack.forward(x).into_data().assert_approx_eq::<f32>(
                &expected.into_data(),
                burn::tensor::Tolerance::absolute(1e-5 * scale),
            );
        }
    }

    #[test]
    fn static_matrix_equals_probing_the_forward_pass() {
        let device = Device::flex();
        // probe_matrix feeds basis vectors of width L+1 = 6.
        let config = HyperConnectionsConfig::new(6)
            .with_streams(3)
            .with_dynamic(false);
        let hc = randomised(config.init(5, &device).unwrap(), &device);
        let closed = hc.matrix();
        let probed = probe_matrix(&hc, &device).unwrap();
        assert!(
            closed.max_abs_diff(&probed) < 1e-5,
            "{closed:?}\n{probed:?}"
        );

        let resnet = HyperConnectionsConfig::new(6)
            .with_streams(1)
            .init(5, &device)
            .unwrap();
        let matrix = resnet.matrix();
        for (i, row) in matrix.matrix.iter().enumerate() {
            for (j, value) in row.iter().enumerate() {
                assert_eq!(*value, f64::from(u8::from(i < j)), "C[{i}][{j}]");
            }
        }
        assert_eq!(matrix.output, vec![1.0; 6]);
    }

    #[test]
    fn truncation_reproduces_the_readout() {
        let device = Device::flex();
        let config = HyperConnectionsConfig::new(WIDTH)
            .with_streams(3)
            .with_fractions(2);
        let mut stack = stack(&config, &device);
        stack.connectivity = randomised(stack.connectivity, &device);
        let x = input(&device);
        let readout = stack.readout(x.clone());
        assert_close(readout[0].clone(), x.clone() * 3.0);
        for (depth, expected) in readout.iter().enumerate().skip(1) {
            assert_close(
                stack.truncated(depth).unwrap().forward(x.clone()),
                expected.clone(),
            );
        }
        assert!(matches!(
            stack.truncated(6),
            Err(Error::DepthOutOfRange { .. })
        ));
    }

    #[test]
    fn streams_start_equal_and_spread_apart() {
        let device = Device::flex();
        let config = HyperConnectionsConfig::new(WIDTH).with_streams(3);
        let mut stack = stack(&config, &device);
        let start = stack.connectivity.start(input(&device));
        assert_eq!(
            StreamConnectivity::<3>::block_input(&stack.connectivity, &start).dims(),
            [2, 3, WIDTH]
        );
        assert!(start.stream_spread() < 1e-7, "copies of x");
        stack.connectivity = randomised(stack.connectivity, &device);
        let state = stack.run(input(&device), 5, &()).unwrap();
        let spread = state.stream_spread();
        assert!(spread > 0.01 && spread.is_finite(), "{spread}");
    }

    #[test]
    fn invalid_configs_and_inputs_are_errors() {
        let device = Device::flex();
        let init = |config: HyperConnectionsConfig| config.init(3, &device).map(|_| ());
        assert!(matches!(
            init(HyperConnectionsConfig::new(WIDTH).with_streams(0)),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            init(HyperConnectionsConfig::new(WIDTH).with_fractions(0)),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            init(HyperConnectionsConfig::new(WIDTH).with_fractions(4)),
            Err(Error::WidthMismatch { .. })
        ));
        assert!(matches!(
            init(HyperConnectionsConfig::new(0)),
            Err(Error::WidthMismatch { .. })
        ));
        assert!(matches!(
            HyperConnectionsConfig::new(WIDTH).init(0, &device),
            Err(Error::NoBlocks)
        ));
        let hc = HyperConnectionsConfig::new(WIDTH).init(2, &device).unwrap();
        assert!(hc.check_input(&[2, 3, WIDTH]).is_ok());
        assert!(matches!(
            hc.check_input(&[2, 3, WIDTH + 1]),
            Err(Error::WidthMismatch { .. })
        ));
        assert_eq!(hc.residual_distance_from_identity(), vec![0.0, 0.0]);
    }

    fn mismatched() -> (Stack<crate::MlpBlock, HyperConnections>, Tensor<3>) {
        let device = Device::flex();
        let blocks = crate::MlpBlockConfig::new(8, 16)
            .init_stack(2, &device)
            .unwrap();
        // The width given twice, differently: 9 to the connectivity, 8 to the blocks.
        let stack = Stack::new(blocks, &HyperConnectionsConfig::new(9), &device).unwrap();
        (stack, Tensor::zeros([2, 3, 8], &device))
    }

    #[test]
    fn a_width_mismatch_is_an_error_naming_both_widths() {
        let (stack, input) = mismatched();
        let err = stack.check_input(&input).unwrap_err();
        assert!(matches!(
            err,
            Error::WidthMismatch {
                expected: 9,
                found: 8,
                ..
            }
        ));
        assert!(err.to_string().contains("`width`"), "{err}");
    }

    #[test]
    #[should_panic(expected = "expected width 9, found 8")]
    fn forward_refuses_a_width_mismatch_before_the_first_block() {
        let (stack, input) = mismatched();
        let _ = stack.forward(input);
    }

    /// Wrapping an encoder, the layers tell their width: a mismatch is refused when the wrapper
    /// is built.
    #[test]
    fn an_encoder_of_another_width_is_refused_at_construction() {
        use burn::nn::transformer::TransformerEncoderConfig;

        use crate::transformer::{ConnectedEncoder, Granularity};

        let device = Device::flex();
        let encoder = TransformerEncoderConfig::new(8, 16, 2, 2).init(&device);
        let config = HyperConnectionsConfig::new(9);
        let err = ConnectedEncoder::new(encoder, Granularity::Block, &config, &device).unwrap_err();
        assert!(matches!(
            err,
            Error::WidthMismatch {
                expected: 9,
                found: 8,
                ..
            }
        ));
    }
}
