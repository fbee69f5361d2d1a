//! Autodiff gradients of the connectivity parameters against central finite differences, in
//! f64 (this test binary sets Flex's default float type to f64 before creating any tensor).
//!
//! Every test draws its problem from Flex's generator under a fixed seed, one test at a time
//! ([`seeded`]), so that a failure reproduces.

mod common;

use std::sync::{MutexGuard, OnceLock};

use burn::module::{ModuleMapper, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::{Distribution, FloatDType, Gradients};
use burn_connectivity::{
    AncreConfig, AncreInit, AttentionResidualsConfig, AttnResOutput, BlockNorm, ConnectivityConfig,
    DenseFormerConfig, GateInit, HacnConfig, HyperConnectionsConfig, LaurelConfig, MhcConfig,
    MhcLiteConfig, MhcV4Config, MlpBlock, MlpBlockConfig, MuddConfig, Normalization, Stack,
    StreamConnectivity,
};

/// The step of the fourth-order central difference ([`Problem::numeric`]). Its truncation error
/// is `O(STEP⁴)` and its rounding error `O(ε |loss| / STEP)`: the second-order difference
/// needed `1e-6` against the curvature (a layer norm over 4 entries can be very curved), and at
/// that step the rounding error of MUDD's loss reached the tolerance (CI failed on a draw where
/// it did). At `1e-5` this difference stays below 4% of the tolerance over 25 draws of every
/// test.
const STEP: f64 = 1e-5;
/// Relative to `1 + |gradient|`: a wrong gradient is off by O(1).
const TOLERANCE: f64 = 1e-6;
const BLOCKS: usize = 5;

fn device() -> Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            let mut device = Device::flex();
            device
                .configure(FloatDType::F64)
                .expect("f64 before any tensor exists");
            device.autodiff()
        })
        .clone()
}

/// One test at a time, Flex's generator seeded ([`common::seeded`]).
fn seeded(seed: u64) -> MutexGuard<'static, ()> {
    common::seeded(&device(), seed)
}

struct Problem {
    blocks: Vec<MlpBlock>,
    input: Tensor<3>,
    probe: Tensor<3>,
}

impl Problem {
    fn new(depth_ln: bool) -> Self {
        let device = device();
        let blocks = MlpBlockConfig::new(4, 8)
            .with_depth_ln(depth_ln)
            .init_stack(BLOCKS, &device)
            .unwrap();
        let input = Tensor::random([2, 3, 4], Distribution::Normal(0.0, 1.0), &device);
        let probe = Tensor::random([2, 3, 4], Distribution::Normal(0.0, 1.0), &device);
        Self {
            blocks,
            input,
            probe,
        }
    }

    fn stack<C: ConnectivityConfig>(
        &self,
        blocks: Vec<MlpBlock>,
        config: &C,
    ) -> Stack<MlpBlock, C::Connectivity> {
        Stack::new(blocks, config, &device()).unwrap()
    }

    /// `sum(y · probe) + sum(s_L · probe)`: touches both the output and the stream.
    fn loss<C: StreamConnectivity<3>>(&self, stack: &Stack<MlpBlock, C>) -> Tensor<1> {
        let state = stack
            .run(self.input.clone(), stack.num_blocks(), &())
            .unwrap();
        let output = stack.connectivity.output(&state);
        let stream = stack.connectivity.block_input(&state);
        (output * self.probe.clone()).sum() + (stream * self.probe.clone()).sum()
    }

    /// Fourth-order central difference of the loss along one parameter,
    /// `(8 (L(h) − L(−h)) − (L(2h) − L(−2h))) / 12h`, rebuilding the model with the parameter
    /// shifted by `±h` and `±2h` (`h` = [`STEP`]).
    fn numeric<C: StreamConnectivity<3>>(
        &self,
        shifted: impl Fn(f64) -> Stack<MlpBlock, C>,
    ) -> f64 {
        let loss = |delta: f64| self.loss(&shifted(delta)).into_scalar::<f64>();
        let near = loss(STEP) - loss(-STEP);
        let far = loss(2.0 * STEP) - loss(-2.0 * STEP);
        (8.0 * near - far) / (12.0 * STEP)
    }
}

fn values<const D: usize>(tensor: Tensor<D>) -> Vec<f64> {
    tensor.into_data().iter::<f64>().collect()
}

fn assert_matches(what: &str, analytic: f64, numeric: f64) {
    assert!(
        (numeric - analytic).abs() <= TOLERANCE * (1.0 + numeric.abs()),
        "{what}: autodiff {analytic}, finite differences {numeric}"
    );
}

#[test]
fn every_gate_gradient_matches_finite_differences() {
    let _draws = seeded(1);
    let problem = Problem::new(false);
    let gates = vec![0.25, 0.9, -0.3, 0.0, 1.0];
    let config = |gates: Vec<f64>| HacnConfig::new().with_init(GateInit::Values { values: gates });
    let stack = problem.stack(problem.blocks.clone(), &config(gates.clone()));
    let grads = problem.loss(&stack).backward();
    let autodiff = values(stack.connectivity.gates.val().grad(&grads).unwrap());

    for (j, analytic) in autodiff.iter().enumerate() {
        let numeric = problem.numeric(|delta| {
            let mut shifted = gates.clone();
            shifted[j] += delta;
            problem.stack(problem.blocks.clone(), &config(shifted))
        });
        assert_matches(&format!("gate {j}"), *analytic, numeric);
    }
}

#[test]
fn every_used_ancre_logit_gradient_matches_finite_differences() {
    let _draws = seeded(2);
    let problem = Problem::new(false);
    let size = BLOCKS + 1;
    let logits: Vec<Vec<f64>> = (0..size)
        .map(|i| {
            (0..size)
                .map(|j| ((2 * i + 5 * j) % 7) as f64 * 0.03)
                .collect()
        })
        .collect();
    for normalization in [Normalization::Ingoing, Normalization::Outgoing] {
        let config = |logits: Vec<Vec<f64>>| {
            AncreConfig::new()
                .with_normalization(normalization)
                .with_init(AncreInit::Values { logits })
        };
        let stack = problem.stack(problem.blocks.clone(), &config(logits.clone()));
        let grads = problem.loss(&stack).backward();
        let autodiff = values(stack.connectivity.logits.val().grad(&grads).unwrap());

        for j in 1..size {
            for i in 0..j {
                let numeric = problem.numeric(|delta| {
                    let mut shifted = logits.clone();
                    shifted[i][j] += delta;
                    problem.stack(problem.blocks.clone(), &config(shifted))
                });
                let what = format!("{normalization:?} logit c_{i}{j}");
                assert_matches(&what, autodiff[i * size + j], numeric);
            }
        }
    }
}

#[test]
fn every_depth_ln_strength_gradient_matches_finite_differences() {
    let _draws = seeded(3);
    let problem = Problem::new(true);
    let config = HacnConfig::new().with_init(GateInit::Constant { value: 0.25 });
    let stack = problem.stack(problem.blocks.clone(), &config);
    let grads = problem.loss(&stack).backward();

    for j in 0..BLOCKS {
        let BlockNorm::Depth(norm) = &stack.blocks[j].norm else {
            panic!("block {j} has no DepthLN");
        };
        let analytic = values(norm.strength.val().grad(&grads).unwrap())[0];
        let numeric = problem.numeric(|delta| {
            let mut blocks = problem.blocks.clone();
            if let BlockNorm::Depth(norm) = &mut blocks[j].norm {
                norm.strength = norm.strength.clone().map(|s| s.add_scalar(delta));
            }
            problem.stack(blocks, &config)
        });
        assert_matches(&format!("DepthLN strength {j}"), analytic, numeric);
    }
}

#[test]
fn the_tsallis_regulariser_gradient_matches_finite_differences() {
    let _draws = seeded(4);
    let size = BLOCKS + 1;
    let logits: Vec<Vec<f64>> = (0..size)
        .map(|i| (0..size).map(|j| ((i + 3 * j) % 4) as f64 * 0.05).collect())
        .collect();
    let regulariser = |logits: Vec<Vec<f64>>| {
        let config = AncreConfig::new().with_init(AncreInit::Values { logits });
        config.init(BLOCKS, &device()).unwrap()
    };
    let ancre = regulariser(logits.clone());
    let grads = ancre.tsallis_entropy(2.0).unwrap().backward();
    let autodiff = values(ancre.logits.val().grad(&grads).unwrap());
    for j in 2..size {
        for i in 0..j {
            let value = |delta: f64| {
                let mut shifted = logits.clone();
                shifted[i][j] += delta;
                regulariser(shifted)
                    .tsallis_entropy(2.0)
                    .unwrap()
                    .into_scalar::<f64>()
            };
            let numeric = (value(STEP) - value(-STEP)) / (2.0 * STEP);
            assert_matches(
                &format!("Tsallis c_{i}{j}"),
                autodiff[i * size + j],
                numeric,
            );
        }
    }
}

/// Moves every float parameter by a fixed pseudo-random amount, so that no term sits at its
/// initial value (zeros, identities) where some gradients vanish.
struct Perturb;

impl ModuleMapper for Perturb {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|tensor| {
            let trainable = tensor.is_require_grad();
            let noise = Tensor::random(tensor.shape(), Distribution::Normal(0.0, 0.3), &device());
            (tensor + noise).detach().set_require_grad(trainable)
        })
    }
}

/// Shifts one entry, counted over every float parameter in visiting order, by `delta`.
struct Shift {
    index: usize,
    delta: f64,
    seen: usize,
}

impl ModuleMapper for Shift {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let count = param.shape().num_elements();
        let local = self
            .index
            .checked_sub(self.seen)
            .filter(|&local| local < count);
        self.seen += count;
        let Some(local) = local else {
            return param;
        };
        let delta = self.delta;
        param.map(|tensor| {
            let trainable = tensor.is_require_grad();
            let mut shift = vec![0.0; count];
            shift[local] = delta;
            let shift = Tensor::<1>::from_data(TensorData::new(shift, [count]), &device());
            (tensor.clone() + shift.reshape(tensor.shape()))
                .detach()
                .set_require_grad(trainable)
        })
    }
}

/// The gradient of every float parameter, flattened in visiting order (zeros where none).
fn parameter_grads(module: &impl Module, grads: &Gradients) -> Vec<f64> {
    struct Collector<'a>(&'a Gradients, Vec<f64>);
    impl ModuleVisitor for Collector<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            match param.val().grad(self.0) {
                Some(grad) => self.1.extend(values(grad)),
                None => self
                    .1
                    .extend(std::iter::repeat_n(0.0, param.shape().num_elements())),
            }
        }
    }
    let mut collector = Collector(grads, Vec::new());
    module.visit(&mut collector);
    collector.1
}

/// Every parameter of a (perturbed) connectivity against central differences.
fn every_parameter_matches<C: StreamConnectivity<3>>(name: &str, connectivity: C) {
    let problem = Problem::new(false);
    let connectivity = connectivity.map(&mut Perturb);
    let stack = |connectivity: C| Stack::from_parts(problem.blocks.clone(), connectivity).unwrap();
    let grads = problem.loss(&stack(connectivity.clone())).backward();
    let autodiff = parameter_grads(&connectivity, &grads);
    assert!(
        autodiff.iter().any(|g| *g != 0.0),
        "{name}: no gradient at all"
    );
    for (index, analytic) in autodiff.iter().enumerate() {
        let numeric = problem.numeric(|delta| {
            stack(connectivity.clone().map(&mut Shift {
                index,
                delta,
                seen: 0,
            }))
        });
        assert_matches(
            &format!("{name} parameter entry {index}"),
            *analytic,
            numeric,
        );
    }
}

#[test]
fn every_hyper_connection_gradient_matches_finite_differences() {
    let _draws = seeded(5);
    for (streams, fractions, dynamic) in [(2, 1, true), (3, 1, false), (2, 2, true)] {
        let config = HyperConnectionsConfig::new(4)
            .with_streams(streams)
            .with_fractions(fractions)
            .with_dynamic(dynamic);
        let name = format!("HC n={streams} m={fractions} dynamic={dynamic}");
        every_parameter_matches(&name, config.init(BLOCKS, &device()).unwrap());
    }
}

#[test]
fn every_mhc_gradient_matches_finite_differences() {
    let _draws = seeded(6);
    let config = MhcConfig::new(4)
        .with_streams(3)
        .with_sinkhorn_iterations(5);
    every_parameter_matches("mHC", config.init(BLOCKS, &device()).unwrap());
}

#[test]
fn every_dwa_weight_gradient_matches_finite_differences() {
    let _draws = seeded(7);
    for (dilation, period) in [(1, 1), (2, 1), (1, 2)] {
        let config = DenseFormerConfig::new()
            .with_dilation(dilation)
            .with_period(period);
        let name = format!("DWA dilation {dilation} period {period}");
        every_parameter_matches(&name, config.init(BLOCKS, &device()).unwrap());
    }
}

#[test]
fn every_attention_residuals_gradient_matches_finite_differences() {
    let _draws = seeded(8);
    for (block_size, output) in [(1, AttnResOutput::Attend), (2, AttnResOutput::Sum)] {
        let config = AttentionResidualsConfig::new(4)
            .with_block_size(block_size)
            .with_output(output);
        let name = format!("AttnRes k={block_size} {output:?}");
        every_parameter_matches(&name, config.init(BLOCKS, &device()).unwrap());
    }
}

#[test]
fn every_deepseek_v4_mhc_gradient_matches_finite_differences() {
    let _draws = seeded(9);
    let config = MhcV4Config::new(4)
        .with_streams(3)
        .with_sinkhorn_iterations(5);
    every_parameter_matches("mHC (DeepSeek-V4)", config.init(BLOCKS, &device()).unwrap());
}

#[test]
fn every_mhc_lite_gradient_matches_finite_differences() {
    let _draws = seeded(10);
    let config = MhcLiteConfig::new(4)
        .with_streams(3)
        .with_phi_std(0.5)
        .with_alpha_init(1.0);
    every_parameter_matches("mHC-lite", config.init(BLOCKS, &device()).unwrap());
}

/// Random `B`s (zero at the paper's init, which would leave every `A` without a gradient).
#[test]
fn every_laurel_gradient_matches_finite_differences() {
    let _draws = seeded(11);
    for (name, config) in [
        ("LAuReL RW", LaurelConfig::rw(4)),
        ("LAuReL RW+LR+PA", LaurelConfig::rw_lr_pa(4, 2, 2)),
        (
            "LAuReL Gemma 3n",
            LaurelConfig::gemma3n(4, 2).with_init_std(0.5),
        ),
    ] {
        let mut laurel = config.init(BLOCKS, &device()).unwrap();
        for layer in &mut laurel.layers {
            for up in &mut layer.up {
                *up = Param::from_tensor(up.val().random_like(Distribution::Normal(0.0, 0.5)));
            }
        }
        every_parameter_matches(name, laurel);
    }
}

/// Random `W2`s (zero at init, which would leave every `W1` without a gradient).
#[test]
fn every_mudd_gradient_matches_finite_differences() {
    let _draws = seeded(12);
    for (name, config) in [
        ("MUDD one way", MuddConfig::new(4)),
        ("MUDD four ways", MuddConfig::multiway(4)),
    ] {
        let mut mudd = config.init(BLOCKS, &device()).unwrap();
        for layer in &mut mudd.layers {
            layer.w2 =
                Param::from_tensor(layer.w2.val().random_like(Distribution::Normal(0.0, 0.5)));
        }
        every_parameter_matches(name, mudd);
    }
}
