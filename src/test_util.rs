//! Helpers for the unit tests of the connectivity families.

use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::{Distribution, Tolerance};

use crate::block::Block;

/// Width of the test blocks.
pub const WIDTH: usize = 6;

/// `f(x) = tanh(x W + b)`, the golden vectors' block.
#[derive(Module, Debug)]
pub struct TanhBlock {
    pub linear: Linear,
}

impl<const D: usize> Block<D> for TanhBlock {
    type Context = ();

    fn branch(&self, input: Tensor<D>, _context: &()) -> Tensor<D> {
        self.linear.forward(input).tanh()
    }
}

/// `num_blocks` randomly initialised tanh blocks of width [`WIDTH`].
pub fn blocks(num_blocks: usize, device: &Device) -> Vec<TanhBlock> {
    (0..num_blocks)
        .map(|_| TanhBlock {
            linear: LinearConfig::new(WIDTH, WIDTH).init(device),
        })
        .collect()
}

/// A random `[2, 3, WIDTH]` input.
pub fn input(device: &Device) -> Tensor<3> {
    Tensor::random([2, 3, WIDTH], Distribution::Normal(0.0, 1.0), device)
}

/// The plain residual loop `s_j = s_{j-1} + f_j(s_{j-1})`, written out by hand.
pub fn residual_loop<M: Block<3, Context = ()>>(blocks: &[M], input: Tensor<3>) -> Tensor<3> {
    blocks.iter().fold(input, |stream, block| {
        stream.clone() + block.branch(stream, &())
    })
}

/// Entry-wise equality up to 1e-6.
pub fn assert_close<const D: usize>(actual: Tensor<D>, expected: Tensor<D>) {
    actual
        .into_data()
        .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-6));
}

/// The gradient of `param` in `grads`, read back to the host (panics if it has none).
pub fn gradient<const D: usize>(
    param: &burn::module::Param<Tensor<D>>,
    grads: &burn::tensor::Gradients,
) -> Vec<f64> {
    param
        .val()
        .grad(grads)
        .expect("the parameter has a gradient")
        .into_data()
        .iter()
        .collect()
}

/// Every float parameter copied onto a device, requiring a gradient (for running one model
/// under several autodiff settings).
pub struct OnDevice(pub Device);

impl burn::module::ModuleMapper for OnDevice {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<D>>,
    ) -> burn::module::Param<Tensor<D>> {
        param.map(|tensor| Tensor::from_data(tensor.to_data(), &self.0).require_grad())
    }
}

/// Runs `gradients` (every gradient of a loss, each read back to the host) on an autodiff Flex
/// device with and without Burn's gradient checkpointing, which recomputes memory-bound
/// operations in the backward pass, and asserts that both give the same gradients.
pub fn assert_checkpointing_keeps_gradients(gradients: impl Fn(&Device) -> Vec<Vec<f64>>) {
    let device = Device::flex().autodiff();
    let plain = gradients(&device);
    let checkpointed = gradients(&device.gradient_checkpointing());
    assert_eq!(plain.len(), checkpointed.len());
    for (a, b) in plain.iter().zip(&checkpointed) {
        assert_eq!(a.len(), b.len());
        for (a, b) in a.iter().zip(b) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{a} vs {b}");
        }
    }
}

/// The gradient of `x` in `grads`, read back to the host.
pub fn input_gradient(x: &Tensor<3>, grads: &burn::tensor::Gradients) -> Vec<f64> {
    x.grad(grads)
        .expect("x is used")
        .into_data()
        .iter()
        .collect()
}
