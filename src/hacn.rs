//! Residual, ACN and H-ACN (Hybrid Auto-Compressing Networks): per-block gates and the long
//! output sum (MATH §1).
//!
//! For blocks `j = 1..L` with gates `a_j`:
//!
//! ```text
//! h_j = f_j(s_{j-1})
//! s_j = h_j + a_j · s_{j-1}
//! y   = Σ_{i=0}^{L} h_i            (h_0 = s_0 = x: the long output sum)
//! ```
//!
//! `a_j = 1` (fixed) is ResNet (then `s_L = y`), `a_j = 0` (fixed) is ACN, trainable gates are
//! H-ACN. Only the running stream and the running sum are kept: O(1) extra tensors whatever
//! the depth. The direct connectivity is `C[i][j] = Π_{l=i+1}^{j-1} a_l` (H-ACN paper eq. 4)
//! and `out[i] = 1`; the total connectivity strength is `Γ = ‖a‖₂ / √L`.
//!
//! A step is one fused kernel on CubeCL backends: a forward pass fetches the gates once, as
//! host scalars when no gradient flows to them (inference, frozen gates) and as scalar views
//! of an aligned table under a gradient (`BENCHMARKS.md`, "Kernels per block on CubeCL"). Under
//! a gradient, since every gated stream leads to the next step's input, a step's backward is
//! one kernel (`∂s_j = a_j ∂c_j` and the partial sums of `⟨s_j, ∂c_j⟩`), and the gates'
//! gradient is summed and handed over once per pass (`src/backend/scale_entries.rs`).

use burn::module::Param;
use burn::prelude::*;
use burn::tensor::Distribution;

use crate::backend::Scales;
use crate::connectivity::{Connectivity, ConnectivityConfig, StreamConnectivity, leading_part};
use crate::error::{Error, Result, check_depth, check_finite, check_non_negative, check_positive};
use crate::matrix::ConnectivityMatrix;

/// How the gates `a_1..a_L` are initialised (H-ACN paper §3.1 and its ablation, Table 6).
///
/// Noisy variants draw `a_j ~ N(mean_j, std)` from the device's random generator (seed it with
/// `device.seed(..)` for reproducible runs).
#[derive(Config, Debug, PartialEq)]
pub enum GateInit {
    /// `a_j ~ N(mean, std)`; the paper's default is `N(0.25, 0.005)` (std second).
    Normal {
        /// Mean of every gate.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
    /// "Half layers": mean `first` for the first `⌊L/2⌋` blocks and `rest` for the others
    /// (paper: 0.4 and 0.15).
    HalfLayers {
        /// Mean of the first half.
        first: f64,
        /// Mean of the second half.
        rest: f64,
        /// Standard deviation.
        std: f64,
    },
    /// "Exp decay": the mean decays exponentially from `start` (block 1) to `end` (block L),
    /// `mean_j = start · (end/start)^((j-1)/(L-1))` (paper: 0.25 to 0.1).
    ExpDecay {
        /// Mean of the first block's gate (> 0).
        start: f64,
        /// Mean of the last block's gate (> 0).
        end: f64,
        /// Standard deviation.
        std: f64,
    },
    /// Every gate exactly `value` (1: ResNet, 0: ACN).
    Constant {
        /// The gate value.
        value: f64,
    },
    /// Explicit gates, one per block.
    Values {
        /// `a_1..a_L`.
        values: Vec<f64>,
    },
}

impl GateInit {
    /// The paper's default, `N(0.25, 0.005)`.
    pub fn paper_default() -> Self {
        Self::Normal {
            mean: 0.25,
            std: 0.005,
        }
    }

    /// The paper's "half layers" ablation: 0.4 then 0.15, std 0.005.
    pub fn half_layers() -> Self {
        Self::HalfLayers {
            first: 0.4,
            rest: 0.15,
            std: 0.005,
        }
    }

    /// The paper's "exp decay" ablation: 0.25 down to 0.1, std 0.005.
    pub fn exp_decay() -> Self {
        Self::ExpDecay {
            start: 0.25,
            end: 0.1,
            std: 0.005,
        }
    }

    /// The gate means for `num_blocks` blocks and the noise std, validated.
    fn means_and_std(&self, num_blocks: usize) -> Result<(Vec<f64>, f64)> {
        match self {
            Self::Normal { mean, std } => {
                check_finite("gate mean", *mean)?;
                check_non_negative("gate std", *std)?;
                Ok((vec![*mean; num_blocks], *std))
            }
            Self::HalfLayers { first, rest, std } => {
                check_finite("first-half gate mean", *first)?;
                check_finite("second-half gate mean", *rest)?;
                check_non_negative("gate std", *std)?;
                let half = num_blocks / 2;
                let means = (0..num_blocks).map(|j| if j < half { *first } else { *rest });
                Ok((means.collect(), *std))
            }
            Self::ExpDecay { start, end, std } => {
                check_positive("exp-decay start", *start)?;
                check_positive("exp-decay end", *end)?;
                check_non_negative("gate std", *std)?;
                let last = num_blocks.saturating_sub(1).max(1) as f64;
                let means = (0..num_blocks).map(|j| start * (end / start).powf(j as f64 / last));
                Ok((means.collect(), *std))
            }
            Self::Constant { value } => {
                check_finite("gate value", *value)?;
                Ok((vec![*value; num_blocks], 0.0))
            }
            Self::Values { values } => {
                if values.len() != num_blocks {
                    return Err(Error::CountMismatch {
                        name: "gate values",
                        expected: num_blocks,
                        found: values.len(),
                    });
                }
                for value in values {
                    check_finite("gate value", *value)?;
                }
                Ok((values.clone(), 0.0))
            }
        }
    }
}

/// Configuration of [`Hacn`]: gate initialisation and whether the gates train.
#[derive(Config, Debug)]
pub struct HacnConfig {
    /// Gate initialisation; default `N(0.25, 0.005)`.
    #[config(default = "GateInit::paper_default()")]
    pub init: GateInit,
    /// Whether the gates are trained (H-ACN) or frozen (ResNet, ACN, or a frozen H-ACN).
    #[config(default = true)]
    pub trainable: bool,
}

impl HacnConfig {
    /// ResNet: every gate fixed to 1.
    pub fn resnet() -> Self {
        Self::new()
            .with_init(GateInit::Constant { value: 1.0 })
            .with_trainable(false)
    }

    /// ACN: every gate fixed to 0.
    pub fn acn() -> Self {
        Self::new()
            .with_init(GateInit::Constant { value: 0.0 })
            .with_trainable(false)
    }
}

impl ConnectivityConfig for HacnConfig {
    type Connectivity = Hacn;

    fn init(&self, num_blocks: usize, device: &Device) -> Result<Hacn> {
        if num_blocks == 0 {
            return Err(Error::NoBlocks);
        }
        let (means, std) = self.init.means_and_std(num_blocks)?;
        // f64 host values: converted to the device's float type, exact on f64 devices.
        let mut gates = Tensor::<1>::from_data(TensorData::new(means, [num_blocks]), device);
        if std > 0.0 {
            gates = gates + Tensor::random([num_blocks], Distribution::Normal(0.0, std), device);
        }
        let gates = Param::from_tensor(gates).set_require_grad(self.trainable);
        Ok(Hacn { gates })
    }
}

/// Gated residual connectivity with the long output sum: ResNet, ACN or H-ACN depending on
/// the gates (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct Hacn {
    /// The gates `a_1..a_L`, shape `[L]`.
    pub gates: Param<Tensor<1>>,
}

/// The running state of [`Hacn`]: the stream `s_j` and the output sum `Σ_{i≤j} h_i`.
#[derive(Debug, Clone)]
pub struct HacnState<const D: usize> {
    /// The stream `s_j`, input of the next block.
    pub stream: Tensor<D>,
    /// The long output sum `y_j = Σ_{i≤j} h_i`.
    pub sum: Tensor<D>,
    /// The gates, fetched once per pass.
    gates: Scales,
}

impl Hacn {
    /// The gate values `a_1..a_L` (read back from the device).
    pub fn gate_values(&self) -> Vec<f64> {
        self.gates.val().into_data().iter::<f64>().collect()
    }

    /// The total connectivity strength `Γ = ‖a‖₂ / √L`: 0 for ACN, 1 for ResNet.
    pub fn total_strength(&self) -> f64 {
        let gates = self.gate_values();
        let squares: f64 = gates.iter().map(|a| a * a).sum();
        (squares / gates.len() as f64).sqrt()
    }
}

impl Connectivity for Hacn {
    fn num_blocks(&self) -> usize {
        self.gates.dims()[0]
    }

    /// Closed form (H-ACN eq. 4): `C[i][j] = Π_{l=i+1}^{j-1} a_l` for `i < j`, `out[i] = 1`.
    fn matrix(&self) -> ConnectivityMatrix {
        let gates = self.gate_values();
        let size = gates.len() + 1;
        // a_l is gates[l-1], so the product over l = i+1..=j-1 is gates[i..j-1].
        let entry = |i: usize, j: usize| {
            if i < j {
                gates[i..j - 1].iter().product()
            } else {
                0.0
            }
        };
        let matrix = (0..size)
            .map(|i| (0..size).map(|j| entry(i, j)).collect())
            .collect();
        ConnectivityMatrix {
            matrix,
            output: vec![1.0; size],
        }
    }

    fn truncated(&self, depth: usize) -> Result<Self> {
        check_depth(depth, 1, self.num_blocks())?;
        Ok(Self {
            gates: leading_part(&self.gates, depth),
        })
    }
}

impl<const D: usize> StreamConnectivity<D> for Hacn {
    type State = HacnState<D>;

    fn start(&self, input: Tensor<D>) -> HacnState<D> {
        let gates = self.gates.val();
        let tracked = gates.is_require_grad();
        HacnState {
            stream: input.clone(),
            sum: input,
            gates: Scales::chained(gates.unsqueeze(), tracked),
        }
    }

    fn block_input(&self, state: &HacnState<D>) -> Tensor<D> {
        state.stream.clone()
    }

    /// Exactly `sum += h`, `s = h + a s` (the tailed version would compute `sum += (h + a s) - a s`).
    fn step(&self, state: HacnState<D>, block: usize, branch: Tensor<D>) -> HacnState<D> {
        HacnState {
            stream: branch.clone() + state.gates.scale(0, block, state.stream),
            sum: state.sum + branch,
            gates: state.gates,
        }
    }

    fn step_with_tail(
        &self,
        state: HacnState<D>,
        block: usize,
        branch: Tensor<D>,
        tail: impl FnOnce(Tensor<D>) -> Tensor<D>,
    ) -> HacnState<D> {
        let carried = state.gates.scale(0, block, state.stream);
        let stream = tail(branch + carried.clone());
        HacnState {
            sum: state.sum + (stream.clone() - carried),
            stream,
            gates: state.gates,
        }
    }

    fn output(&self, state: &HacnState<D>) -> Tensor<D> {
        state.sum.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::Block;
    use crate::connectivity::probe_matrix;
    use crate::stack::Stack;
    use crate::test_util::{assert_close, blocks, input, residual_loop};

    /// The chained gates on wgpu (one backward kernel per step, the gates' gradient summed once
    /// per pass) against Flex, with an input that needs a gradient and one that does not: the
    /// output and the gradients of the gates, of every block and of the input.
    #[cfg(feature = "wgpu")]
    #[test]
    fn chained_gates_on_wgpu_match_flex() {
        use burn::module::Module;

        use crate::test_util::{
            OnDevice, WIDTH, assert_close_in_scale, fixed_blocks, fixed_normal, gradient,
        };

        let wgpu = crate::device::device("wgpu")
            .expect("wgpu compiled in")
            .autodiff();
        let flex = Device::flex().autodiff();
        let config = HacnConfig::new().with_init(GateInit::Values {
            values: vec![1.4, 0.3, 1.0, 1.9, 0.7],
        });
        let reference =
            Stack::new(fixed_blocks(5, &Device::flex()), &config, &Device::flex()).unwrap();
        let x = fixed_normal([2, 3, WIDTH], 1.0, 17, &Device::flex());
        let probe = fixed_normal([2, 3, WIDTH], 1.0, 18, &Device::flex());
        for input_tracked in [true, false] {
            let run = |device: &Device| {
                let stack = reference.clone().map(&mut OnDevice(device.clone()));
                assert!(stack.connectivity.gates.val().is_require_grad());
                let x = Tensor::<3>::from_data(x.to_data(), device);
                let x = if input_tracked { x.require_grad() } else { x };
                let out = stack.forward(x.clone());
                let loss = (out.clone() * Tensor::from_data(probe.to_data(), device)).sum();
                let grads = loss.backward();
                let mut values = vec![out.into_data().iter().collect::<Vec<f64>>()];
                values.push(gradient(&stack.connectivity.gates, &grads));
                values.extend(
                    stack
                        .blocks
                        .iter()
                        .map(|b| gradient(&b.linear.weight, &grads)),
                );
                if input_tracked {
                    let grad = x.grad(&grads).expect("tracked input");
                    values.push(grad.into_data().iter().collect());
                }
                values
            };
            assert_close_in_scale(&run(&wgpu), &run(&flex), 1e-4);
        }
    }

    #[test]
    fn fixed_unit_gates_are_the_plain_residual_loop() {
        let device = Device::flex();
        let stack = Stack::new(blocks(5, &device), &HacnConfig::resnet(), &device).unwrap();
        let x = input(&device);
        let stream = residual_loop(&stack.blocks, x.clone());
        let state = stack.run(x.clone(), 5, &()).unwrap();
        assert_close(state.stream, stream.clone());
        assert_close(stack.forward(x), stream);
        assert_eq!(stack.connectivity.total_strength(), 1.0);
    }

    #[test]
    fn fixed_zero_gates_are_acn() {
        let device = Device::flex();
        let stack = Stack::new(blocks(5, &device), &HacnConfig::acn(), &device).unwrap();
        let x = input(&device);

        let mut stream = x.clone();
        let mut sum = x.clone();
        for block in &stack.blocks {
            stream = block.branch(stream, &());
            sum = sum + stream.clone();
        }
        assert_close(stack.forward(x), sum);
        assert_eq!(stack.connectivity.total_strength(), 0.0);
    }

    #[test]
    fn trainable_gates_follow_the_recursion() {
        let device = Device::flex();
        let gates = vec![0.3, -0.2, 0.9, 0.5];
        let config = HacnConfig::new().with_init(GateInit::Values {
            values: gates.clone(),
        });
        let stack = Stack::new(blocks(4, &device), &config, &device).unwrap();
        let x = input(&device);

        let (mut stream, mut sum) = (x.clone(), x.clone());
        for (block, gate) in stack.blocks.iter().zip(&gates) {
            let branch = block.branch(stream.clone(), &());
            sum = sum + branch.clone();
            stream = branch + stream.mul_scalar(*gate);
        }
        let state = stack.run(x.clone(), 4, &()).unwrap();
        assert_close(state.stream, stream);
        assert_close(state.sum, sum.clone());
        assert_close(stack.forward(x), sum);
    }

    #[test]
    fn closed_form_matrix_equals_the_recursion() {
        let device = Device::flex();
        let config = HacnConfig::new().with_init(GateInit::Normal {
            mean: 0.4,
            std: 0.3,
        });
        let hacn = config.init(7, &device).unwrap();
        let closed = hacn.matrix();
        let probed = probe_matrix(&hacn, &device).unwrap();
        assert!(
            closed.max_abs_diff(&probed) < 1e-6,
            "{closed:?}\n{probed:?}"
        );
        assert_eq!(closed.output, vec![1.0; 8]);
        // Eq. 4 for one entry, by hand: C[1][4] = a_2 · a_3.
        let gates = hacn.gate_values();
        assert!((closed.matrix[1][4] - gates[1] * gates[2]).abs() < 1e-12);
    }

    #[test]
    fn preset_matrices_have_their_closed_forms() {
        let device = Device::flex();
        let resnet = HacnConfig::resnet().init(4, &device).unwrap().matrix();
        let acn = HacnConfig::acn().init(4, &device).unwrap().matrix();
        for j in 1..=4 {
            for i in 0..5 {
                assert_eq!(resnet.matrix[i][j], if i < j { 1.0 } else { 0.0 });
                assert_eq!(acn.matrix[i][j], if i + 1 == j { 1.0 } else { 0.0 });
            }
        }
        assert!(resnet.matrix.iter().all(|row| row[0] == 0.0));
    }

    #[test]
    fn readout_ends_with_the_output_and_truncation_reproduces_it() {
        let device = Device::flex();
        let stack = Stack::new(blocks(4, &device), &HacnConfig::new(), &device).unwrap();
        let x = input(&device);
        let readout = stack.readout(x.clone());
        assert_eq!(readout.len(), 5);
        assert_close(readout[0].clone(), x.clone());
        assert_close(readout[4].clone(), stack.forward(x.clone()));
        for (depth, expected) in readout.iter().enumerate().skip(1) {
            let truncated = stack.truncated(depth).unwrap();
            assert_eq!(truncated.num_blocks(), depth);
            assert_close(truncated.forward(x.clone()), expected.clone());
            assert_close(
                stack.forward_depth(x.clone(), depth).unwrap(),
                expected.clone(),
            );
        }
        assert!(matches!(
            stack.truncated(0),
            Err(Error::DepthOutOfRange { .. })
        ));
        assert!(matches!(
            stack.truncated(5),
            Err(Error::DepthOutOfRange { .. })
        ));
        assert!(matches!(
            stack.forward_depth(x, 5),
            Err(Error::DepthOutOfRange { .. })
        ));
    }

    #[test]
    fn gate_initialisations_have_the_paper_means() {
        let device = Device::flex();
        let gates = |init: GateInit| {
            HacnConfig::new()
                .with_init(init)
                .init(6, &device)
                .unwrap()
                .gate_values()
        };

        let normal = gates(GateInit::paper_default());
        assert!(normal.iter().all(|a| (a - 0.25).abs() < 0.05), "{normal:?}");

        let half = gates(GateInit::HalfLayers {
            first: 0.4,
            rest: 0.15,
            std: 0.0,
        });
        let expected = [0.4, 0.4, 0.4, 0.15, 0.15, 0.15];
        assert!(
            half.iter().zip(expected).all(|(a, e)| (a - e).abs() < 1e-6),
            "{half:?}"
        );

        let decay = gates(GateInit::ExpDecay {
            start: 0.25,
            end: 0.1,
            std: 0.0,
        });
        assert!(
            (decay[0] - 0.25).abs() < 1e-6 && (decay[5] - 0.1).abs() < 1e-6,
            "{decay:?}"
        );
        let ratios: Vec<f64> = decay.windows(2).map(|pair| pair[1] / pair[0]).collect();
        assert!(
            ratios.iter().all(|r| (r - ratios[0]).abs() < 1e-5),
            "not geometric: {decay:?}"
        );

        assert_eq!(gates(GateInit::Constant { value: 0.5 }), vec![0.5; 6]);
    }

    #[test]
    fn frozen_gates_get_no_gradient() {
        let device = Device::flex().autodiff();
        let x = input(&device);
        for (config, trainable) in [
            (HacnConfig::new(), true),
            (HacnConfig::new().with_trainable(false), false),
        ] {
            let stack = Stack::new(blocks(3, &device), &config, &device).unwrap();
            let grads = stack.forward(x.clone()).sum().backward();
            assert_eq!(
                stack.connectivity.gates.val().grad(&grads).is_some(),
                trainable
            );
            assert!(stack.blocks[0].linear.weight.val().grad(&grads).is_some());
        }
    }

    #[test]
    fn invalid_configs_are_errors() {
        let device = Device::flex();
        let init = |init: GateInit| {
            HacnConfig::new()
                .with_init(init)
                .init(3, &device)
                .map(|_| ())
        };
        assert!(matches!(
            HacnConfig::new().init(0, &device),
            Err(Error::NoBlocks)
        ));
        assert!(matches!(
            init(GateInit::Values {
                values: vec![1.0, 1.0]
            }),
            Err(Error::CountMismatch {
                expected: 3,
                found: 2,
                ..
            })
        ));
        assert!(matches!(
            init(GateInit::Normal {
                mean: f64::NAN,
                std: 0.1
            }),
            Err(Error::NonFinite { .. })
        ));
        assert!(matches!(
            init(GateInit::Normal {
                mean: 0.2,
                std: -0.1
            }),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            init(GateInit::Constant {
                value: f64::INFINITY
            }),
            Err(Error::NonFinite { .. })
        ));
        assert!(matches!(
            init(GateInit::ExpDecay {
                start: 0.0,
                end: 0.1,
                std: 0.0
            }),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            init(GateInit::Values {
                values: vec![0.0, f64::NAN, 0.0]
            }),
            Err(Error::NonFinite { .. })
        ));

        let hacn = HacnConfig::new().init(3, &device).unwrap();
        assert!(matches!(
            Stack::from_parts(blocks(2, &device), hacn),
            Err(Error::BlockCountMismatch {
                connectivity: 3,
                blocks: 2
            })
        ));
        assert!(matches!(
            Stack::new(blocks(0, &device), &HacnConfig::new(), &device),
            Err(Error::NoBlocks)
        ));
    }

    #[test]
    fn config_round_trips_through_json() {
        let config = HacnConfig::new().with_init(GateInit::half_layers());
        let json = serde_json::to_string(&config).unwrap();
        let parsed: HacnConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(parsed.init, config.init);
        assert_eq!(parsed.trainable, config.trainable);
    }
}
