//! The same models and weights on Flex and NdArray, and record save→load, for every
//! connectivity.

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn::tensor::{Distribution, Gradients, Tolerance};
use burn_connectivity::hyperzzw::HyperZzwConnectivityConfig;
use burn_connectivity::{
    AncreConfig, ConnectivityConfig, HacnConfig, MlpBlock, MlpBlockConfig, Normalization, Stack,
    StreamConnectivity,
};

const BLOCKS: usize = 6;

fn stack<C: ConnectivityConfig>(
    config: &C,
    blocks: usize,
    device: &Device,
) -> Stack<MlpBlock, C::Connectivity> {
    let blocks = MlpBlockConfig::new(8, 16)
        .with_depth_ln(true)
        .init_stack(blocks, device)
        .unwrap();
    Stack::new(blocks, config, device).unwrap()
}

/// Loads the record of `model` into a fresh model with `blocks` blocks on `device`.
fn reload<C: ConnectivityConfig>(
    model: &Stack<MlpBlock, C::Connectivity>,
    config: &C,
    blocks: usize,
    device: &Device,
) -> Stack<MlpBlock, C::Connectivity> {
    reload_module(model, stack(config, blocks, device))
}

fn gradient_tolerance() -> Tolerance<f32> {
    Tolerance::rel_abs(1e-4, 1e-4)
}

/// The gradient of every parameter that has one, in visiting order.
struct ParameterGradients<'a> {
    grads: &'a Gradients,
    found: Vec<TensorData>,
}

impl ModuleVisitor for ParameterGradients<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(grad) = param.val().grad(self.grads) {
            self.found.push(grad.into_data());
        }
    }
}

fn parameter_gradients(model: &impl Module, grads: &Gradients) -> Vec<TensorData> {
    let mut visitor = ParameterGradients {
        grads,
        found: Vec::new(),
    };
    model.visit(&mut visitor);
    visitor.found
}

/// Values agree to 1e-5; gradients (of a random linear probe of the output: sums over the
/// batch, through every block) to 1e-4, absolute or relative to their size.
#[allow(deprecated)]
fn assert_backends_agree<C>(config: &C)
where
    C: ConnectivityConfig,
    C::Connectivity: StreamConnectivity<3>,
{
    let (flex, ndarray) = (Device::flex().autodiff(), Device::ndarray().autodiff());
    let on_flex = stack(config, BLOCKS, &flex);
    let on_ndarray = reload(&on_flex, config, BLOCKS, &ndarray);
    let x = Tensor::<3>::random([2, 5, 8], Distribution::Normal(0.0, 1.0), &flex);
    let x_nd = Tensor::<3>::from_data(x.to_data(), &ndarray);

    let readouts = on_flex.readout(x).into_iter().zip(on_ndarray.readout(x_nd));
    for (r, r_nd) in readouts {
        r_nd.into_data()
            .assert_approx_eq::<f32>(&r.into_data(), Tolerance::absolute(1e-5));
    }
    let x = Tensor::<3>::random([2, 5, 8], Distribution::Normal(0.0, 1.0), &flex);
    let x_nd = Tensor::<3>::from_data(x.to_data(), &ndarray);
    let (y, y_nd) = (on_flex.forward(x), on_ndarray.forward(x_nd));
    let probe = Tensor::<3>::random(y.dims(), Distribution::Normal(0.0, 1.0), &flex);
    let probe_nd = Tensor::<3>::from_data(probe.to_data(), &ndarray);
    let grads = (y * probe).sum().backward();
    let grads_nd = (y_nd * probe_nd).sum().backward();
    let (expected, actual) = (
        parameter_gradients(&on_flex, &grads),
        parameter_gradients(&on_ndarray, &grads_nd),
    );
    assert_eq!(expected.len(), actual.len(), "parameters with a gradient");
    assert!(!expected.is_empty());
    for (g, g_nd) in expected.iter().zip(&actual) {
        g_nd.assert_approx_eq::<f32>(g, gradient_tolerance());
    }
    let difference = on_flex.matrix().max_abs_diff(&on_ndarray.matrix());
    assert!(
        difference < 1e-6,
        "connectivity matrices differ by {difference}"
    );
}

fn assert_save_load_is_exact<C>(config: &C)
where
    C: ConnectivityConfig,
    C::Connectivity: StreamConnectivity<3>,
{
    let device = Device::flex();
    let path = std::env::temp_dir().join(format!(
        "burn-connectivity-{}-{:?}.bpk",
        std::process::id(),
        std::thread::current().id()
    ));
    let model = stack(config, BLOCKS, &device);
    model.clone().save_file(&path).unwrap();
    // Burn reads the parameters lazily from the file: keep it until they are used.
    let loaded = stack(config, BLOCKS, &device).load_file(&path);
    let x = Tensor::<3>::random([3, 4, 8], Distribution::Normal(0.0, 1.0), &device);
    assert_eq!(
        loaded.forward(x.clone()).into_data(),
        model.forward(x).into_data()
    );
    assert_eq!(loaded.matrix(), model.matrix());
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn hacn_family_agrees_across_backends() {
    for config in [HacnConfig::new(), HacnConfig::resnet(), HacnConfig::acn()] {
        assert_backends_agree(&config);
    }
}

#[test]
fn ancre_agrees_across_backends() {
    assert_backends_agree(&AncreConfig::new());
    assert_backends_agree(&AncreConfig::residual(1e-3).with_normalization(Normalization::Outgoing));
}

fn hyperzzw() -> HyperZzwConnectivityConfig {
    HyperZzwConnectivityConfig::new(8, 8)
        .with_hidden(8)
        .with_omega_0(10.0)
}

#[test]
fn hyperzzw_connectivity_agrees_across_backends() {
    assert_backends_agree(&hyperzzw());
}

#[test]
fn save_then_load_gives_identical_outputs() {
    assert_save_load_is_exact(&hyperzzw());
    for config in [HacnConfig::new(), HacnConfig::resnet(), HacnConfig::acn()] {
        assert_save_load_is_exact(&config);
    }
    assert_save_load_is_exact(&AncreConfig::new());
    assert_save_load_is_exact(&AncreConfig::new().with_normalization(Normalization::Outgoing));
}

#[test]
fn loaded_frozen_gates_stay_frozen() {
    let device = Device::flex().autodiff();
    let frozen = HacnConfig::new().with_trainable(false);
    let loaded = reload(&stack(&frozen, BLOCKS, &device), &frozen, BLOCKS, &device);
    let x = Tensor::<3>::random([1, 2, 8], Distribution::Default, &device);
    let grads = loaded.forward(x).sum().backward();
    assert!(loaded.connectivity.gates.val().grad(&grads).is_none());
}

#[test]
fn truncated_models_save_and_load_as_smaller_models() {
    let device = Device::flex();
    let x = Tensor::<3>::random([2, 3, 8], Distribution::Normal(0.0, 1.0), &device);

    let hacn = stack(&HacnConfig::new(), BLOCKS, &device);
    let loaded = reload(&hacn.truncated(2).unwrap(), &HacnConfig::new(), 2, &device);
    assert_eq!(
        loaded.forward(x.clone()).into_data(),
        hacn.forward_depth(x.clone(), 2).unwrap().into_data()
    );

    let ancre = stack(&AncreConfig::new(), BLOCKS, &device);
    let loaded = reload(
        &ancre.truncated(3).unwrap(),
        &AncreConfig::new(),
        3,
        &device,
    );
    assert_eq!(
        loaded.forward(x.clone()).into_data(),
        ancre.forward_depth(x, 3).unwrap().into_data()
    );
}

/// Global (FFT on Flex, matmul DFT on NdArray) and local HyperZZW: outputs and input gradients.
#[test]
#[allow(deprecated)]
fn hyperzzw_operators_agree_across_backends() {
    use burn_connectivity::hyperzzw::{
        Crop, LocalHyperZzwConfig, SlowNetConfig, global_hyperzzw_1d, global_hyperzzw_2d,
    };
    let (flex, ndarray) = (Device::flex().autodiff(), Device::ndarray().autodiff());
    let on =
        |x: &Tensor<3>, device: &Device| Tensor::<3>::from_data(x.to_data(), device).require_grad();
    let x = Tensor::<3>::random([2, 4, 19], Distribution::Normal(0.0, 1.0), &flex);
    let target = Tensor::<3>::random([2, 4, 19], Distribution::Normal(0.0, 1.0), &flex);

    let slow = SlowNetConfig::new(vec![19], 4)
        .with_hidden(8)
        .with_omega_0(5.0)
        .init(&flex)
        .unwrap();
    let local = LocalHyperZzwConfig::new(4, 5)
        .with_hidden(8)
        .with_omega_0(5.0)
        .init(&flex)
        .unwrap();
    let slow_nd = reload_module(
        &slow,
        SlowNetConfig::new(vec![19], 4)
            .with_hidden(8)
            .init(&ndarray)
            .unwrap(),
    );
    let local_nd = reload_module(
        &local,
        LocalHyperZzwConfig::new(4, 5)
            .with_hidden(8)
            .init(&ndarray)
            .unwrap(),
    );

    let run = |device: &Device,
               slow: &burn_connectivity::hyperzzw::SlowNet,
               local: &burn_connectivity::hyperzzw::LocalHyperZzw| {
        let (x, target) = (on(&x, device), on(&target, device));
        let global =
            global_hyperzzw_1d(x.clone(), slow.kernel_1d().unwrap(), Crop::Causal).unwrap();
        let map = x.clone().reshape([2, 4, 1, 19]);
        let kernel_2d = slow.kernel_1d().unwrap().reshape([1, 4, 1, 19]);
        let global_2d = global_hyperzzw_2d(map, kernel_2d, Crop::Same)
            .unwrap()
            .reshape([2, 4, 19]);
        let local = local.forward(x.clone(), target.clone()).unwrap();
        let outputs = [global.clone(), global_2d.clone(), local.clone()];
        let loss = (global + global_2d + local) * target;
        let grads = loss.sum().backward();
        (
            outputs.map(|y| y.into_data()),
            x.grad(&grads).unwrap().into_data(),
        )
    };
    let (outputs, grad) = run(&flex, &slow, &local);
    let (outputs_nd, grad_nd) = run(&ndarray, &slow_nd, &local_nd);
    for (y, y_nd) in outputs.iter().zip(&outputs_nd) {
        y_nd.assert_approx_eq::<f32>(y, Tolerance::absolute(1e-4));
    }
    grad_nd.assert_approx_eq::<f32>(&grad, gradient_tolerance());
}

/// Copies the parameters of `source` into `fresh` (same architecture, any device).
fn reload_module<M: Module>(source: &M, fresh: M) -> M {
    let bytes = source.clone().into_record().into_bytes().unwrap();
    fresh.load_record(ModuleRecord::from_bytes(bytes).unwrap())
}
