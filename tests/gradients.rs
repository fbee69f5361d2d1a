//! Autodiff gradients of the connectivity parameters against central finite differences, in
//! f64 (this test binary sets Flex's default float type to f64 before creating any tensor).

use std::sync::OnceLock;

use burn::prelude::*;
use burn::tensor::{Distribution, FloatDType};
use burn_connectivity::{
    AncreConfig, AncreInit, BlockNorm, ConnectivityConfig, GateInit, HacnConfig, MlpBlock,
    MlpBlockConfig, Normalization, Stack, StreamConnectivity,
};

const STEP: f64 = 1e-6;
/// Relative to `1 + |gradient|`: central differences in f64 reach ~1e-8 here, a wrong
/// gradient is off by O(1).
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

    /// Central difference of the loss along one parameter, rebuilding the model with the
    /// parameter shifted by ±STEP.
    fn numeric<C: StreamConnectivity<3>>(
        &self,
        shifted: impl Fn(f64) -> Stack<MlpBlock, C>,
    ) -> f64 {
        let loss = |delta: f64| self.loss(&shifted(delta)).into_scalar::<f64>();
        (loss(STEP) - loss(-STEP)) / (2.0 * STEP)
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
