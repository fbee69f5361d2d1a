//! Autodiff gradients of the connectivity parameters against central finite differences, in
//! f64 (this test binary sets Flex's default float type to f64 before creating any tensor).

use std::sync::OnceLock;

use burn::prelude::*;
use burn::tensor::{Distribution, FloatDType};
use burn_connectivity::{
    BlockNorm, ConnectivityConfig, GateInit, Hacn, HacnConfig, MlpBlock, MlpBlockConfig, Stack,
};

const STEP: f64 = 1e-6;
/// Relative to `1 + |gradient|`: central differences in f64 reach ~1e-8 here, a wrong
/// gradient is off by O(1).
const TOLERANCE: f64 = 1e-6;

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
            .init_stack(5, &device)
            .unwrap();
        let input = Tensor::random([2, 3, 4], Distribution::Normal(0.0, 1.0), &device);
        let probe = Tensor::random([2, 3, 4], Distribution::Normal(0.0, 1.0), &device);
        Self {
            blocks,
            input,
            probe,
        }
    }

    fn stack(&self, blocks: Vec<MlpBlock>, gates: &[f64]) -> Stack<MlpBlock, Hacn> {
        let config = HacnConfig::new().with_init(GateInit::Values {
            values: gates.to_vec(),
        });
        let connectivity = config.init(blocks.len(), &device()).unwrap();
        Stack::from_parts(blocks, connectivity).unwrap()
    }

    /// `sum(y · probe) + sum(s_L · probe)`: touches both the long sum and the stream.
    fn loss(&self, stack: &Stack<MlpBlock, Hacn>) -> Tensor<1> {
        let state = stack
            .run(self.input.clone(), stack.num_blocks(), &())
            .unwrap();
        (state.sum * self.probe.clone()).sum() + (state.stream * self.probe.clone()).sum()
    }

    fn loss_value(&self, stack: &Stack<MlpBlock, Hacn>) -> f64 {
        self.loss(stack).into_scalar::<f64>()
    }
}

fn values(tensor: Tensor<1>) -> Vec<f64> {
    tensor.into_data().iter::<f64>().collect()
}

#[test]
fn every_gate_gradient_matches_finite_differences() {
    let problem = Problem::new(false);
    let gates = [0.25, 0.9, -0.3, 0.0, 1.0];
    let stack = problem.stack(problem.blocks.clone(), &gates);
    let grads = problem.loss(&stack).backward();
    let autodiff = values(stack.connectivity.gates.val().grad(&grads).unwrap());

    for (j, analytic) in autodiff.iter().enumerate() {
        let shifted = |delta: f64| {
            let mut perturbed = gates;
            perturbed[j] += delta;
            problem.loss_value(&problem.stack(problem.blocks.clone(), &perturbed))
        };
        let numeric = (shifted(STEP) - shifted(-STEP)) / (2.0 * STEP);
        assert!(
            (numeric - analytic).abs() <= TOLERANCE * (1.0 + numeric.abs()),
            "gate {j}: autodiff {analytic}, finite differences {numeric}"
        );
    }
}

#[test]
fn every_depth_ln_strength_gradient_matches_finite_differences() {
    let problem = Problem::new(true);
    let gates = [0.25; 5];
    let stack = problem.stack(problem.blocks.clone(), &gates);
    let grads = problem.loss(&stack).backward();

    for j in 0..problem.blocks.len() {
        let strength = |blocks: &[MlpBlock]| match &blocks[j].norm {
            BlockNorm::Depth(norm) => norm.strength.clone(),
            BlockNorm::Layer(_) => panic!("block {j} has no DepthLN"),
        };
        let analytic = values(strength(&stack.blocks).val().grad(&grads).unwrap())[0];
        let shifted = |delta: f64| {
            let mut blocks = problem.blocks.clone();
            if let BlockNorm::Depth(norm) = &mut blocks[j].norm {
                norm.strength = norm.strength.clone().map(|s| s.add_scalar(delta));
            }
            problem.loss_value(&problem.stack(blocks, &gates))
        };
        let numeric = (shifted(STEP) - shifted(-STEP)) / (2.0 * STEP);
        assert!(
            (numeric - analytic).abs() <= TOLERANCE * (1.0 + numeric.abs()),
            "DepthLN strength {j}: autodiff {analytic}, finite differences {numeric}"
        );
    }
}
