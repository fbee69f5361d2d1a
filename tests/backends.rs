//! The same model and weights on Flex and NdArray, and record save→load.

use burn::module::Module;
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn::tensor::{Distribution, Tolerance};
use burn_connectivity::{Hacn, HacnConfig, MlpBlock, MlpBlockConfig, Stack};

fn stack(config: &HacnConfig, device: &Device) -> Stack<MlpBlock, Hacn> {
    let blocks = MlpBlockConfig::new(8, 16)
        .with_depth_ln(true)
        .init_stack(6, device)
        .unwrap();
    Stack::new(blocks, config, device).unwrap()
}

/// Moves the weights of `model` onto a fresh model built on `device`, through a record.
fn copy_to(
    model: &Stack<MlpBlock, Hacn>,
    config: &HacnConfig,
    device: &Device,
) -> Stack<MlpBlock, Hacn> {
    let bytes = model.clone().into_record().into_bytes().unwrap();
    stack(config, device).load_record(ModuleRecord::from_bytes(bytes).unwrap())
}

fn data<const D: usize>(tensor: Tensor<D>) -> TensorData {
    tensor.into_data()
}

/// Values agree to 1e-5, gradients (sums over the batch, through every block) to 1e-4: the
/// conformance tolerances for f32.
fn gradient_tolerance() -> Tolerance<f32> {
    Tolerance::absolute(1e-4)
}

fn configs() -> [HacnConfig; 3] {
    [HacnConfig::new(), HacnConfig::resnet(), HacnConfig::acn()]
}

#[test]
#[allow(deprecated)]
fn flex_and_ndarray_agree_on_outputs_and_gradients() {
    let (flex, ndarray) = (Device::flex().autodiff(), Device::ndarray().autodiff());
    for config in configs() {
        let on_flex = stack(&config, &flex);
        let on_ndarray = copy_to(&on_flex, &config, &ndarray);
        let x = Tensor::<3>::random([2, 5, 8], Distribution::Normal(0.0, 1.0), &flex);
        let x_nd = Tensor::<3>::from_data(x.to_data(), &ndarray);

        let (y, y_nd) = (on_flex.forward(x.clone()), on_ndarray.forward(x_nd.clone()));
        data(y_nd.clone()).assert_approx_eq::<f32>(&data(y.clone()), Tolerance::absolute(1e-5));
        for (k, (r, r_nd)) in on_flex
            .readout(x)
            .into_iter()
            .zip(on_ndarray.readout(x_nd))
            .enumerate()
        {
            assert_eq!(r.dims(), r_nd.dims(), "readout {k}");
            data(r_nd).assert_approx_eq::<f32>(&data(r), Tolerance::absolute(1e-5));
        }

        let (grads, grads_nd) = (
            y.powf_scalar(2.0).sum().backward(),
            y_nd.powf_scalar(2.0).sum().backward(),
        );
        let weight = |model: &Stack<MlpBlock, Hacn>| model.blocks[3].expand.weight.val();
        data(weight(&on_ndarray).grad(&grads_nd).unwrap()).assert_approx_eq::<f32>(
            &data(weight(&on_flex).grad(&grads).unwrap()),
            gradient_tolerance(),
        );
        let gates = |model: &Stack<MlpBlock, Hacn>| model.connectivity.gates.val();
        match (
            gates(&on_flex).grad(&grads),
            gates(&on_ndarray).grad(&grads_nd),
        ) {
            (Some(g), Some(g_nd)) => {
                data(g_nd).assert_approx_eq::<f32>(&data(g), gradient_tolerance())
            }
            (None, None) => assert!(!config.trainable),
            _ => panic!("gate gradients present on one backend only"),
        }
        assert_eq!(on_flex.matrix(), on_ndarray.matrix());
    }
}

#[test]
fn save_then_load_gives_identical_outputs() {
    let device = Device::flex();
    let path = std::env::temp_dir().join(format!("burn-connectivity-{}.bpk", std::process::id()));
    for config in configs() {
        let model = stack(&config, &device);
        model.clone().save_file(&path).unwrap();
        let loaded = stack(&config, &device).load_file(&path);
        let x = Tensor::<3>::random([3, 4, 8], Distribution::Normal(0.0, 1.0), &device);
        assert_eq!(data(loaded.forward(x.clone())), data(model.forward(x)));
        assert_eq!(
            loaded.connectivity.gate_values(),
            model.connectivity.gate_values()
        );
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn loaded_frozen_gates_stay_frozen() {
    let device = Device::flex().autodiff();
    let frozen = HacnConfig::new().with_trainable(false);
    let model = stack(&frozen, &device);
    let loaded = copy_to(&model, &frozen, &device);
    let x = Tensor::<3>::random([1, 2, 8], Distribution::Default, &device);
    let grads = loaded.forward(x).sum().backward();
    assert!(loaded.connectivity.gates.val().grad(&grads).is_none());
}

#[test]
fn a_truncated_model_saves_and_loads_as_a_smaller_model() {
    let device = Device::flex();
    let model = stack(&HacnConfig::new(), &device);
    let truncated = model.truncated(2).unwrap();
    let bytes = truncated.clone().into_record().into_bytes().unwrap();
    let fresh = Stack::new(
        MlpBlockConfig::new(8, 16)
            .with_depth_ln(true)
            .init_stack(2, &device)
            .unwrap(),
        &HacnConfig::new(),
        &device,
    )
    .unwrap();
    let loaded = fresh.load_record(ModuleRecord::from_bytes(bytes).unwrap());
    let x = Tensor::<3>::random([2, 3, 8], Distribution::Normal(0.0, 1.0), &device);
    assert_eq!(
        data(loaded.forward(x.clone())),
        data(model.forward_depth(x, 2).unwrap())
    );
}
