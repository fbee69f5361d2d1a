//! Helpers for the unit tests of the connectivity families.

use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::Tolerance;

use crate::block::Block;
use crate::connectivity::ConnectivityConfig;
use crate::error::Error;

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

/// A `[2, 3, WIDTH]` standard normal input, the same fixed draw in every run
/// ([`fixed_normal`]): a comparison that fails on it fails again.
pub fn input(device: &Device) -> Tensor<3> {
    fixed_normal([2, 3, WIDTH], 1.0, 1000, device)
}

/// The plain residual loop `s_j = s_{j-1} + f_j(s_{j-1})`, written out by hand.
pub fn residual_loop<M: Block<3, Context = ()>>(blocks: &[M], input: Tensor<3>) -> Tensor<3> {
    blocks.iter().fold(input, |stream, block| {
        stream.clone() + block.branch(stream, &())
    })
}

/// Entry-wise equality up to `max(1e-5 |a + e|, 1e-6)`.
///
/// The relative part allows for a different summation order: a fused path that scales after
/// the product (`s (x W)` rather than `(s x) W`), or another microkernel of the matrix product
/// on another CPU, moves an f32 value of order one by some units in the sixth decimal. A wrong
/// term in the math moves it by far more.
pub fn assert_close<const D: usize>(actual: Tensor<D>, expected: Tensor<D>) {
    actual
        .into_data()
        .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::rel_abs(1e-5, 1e-6));
}

/// Each tensor of `actual` against the same one of `expected`, entry by entry: to `relative`
/// of the entry, or to `relative / 10` of the tensor's largest finite entry (at least 1). An
/// entry that cancels between large terms (a gradient summed over rows of norm 1e2) keeps the
/// absolute rounding of those terms, not its own relative precision; a wrong term in the math
/// moves entries by a fraction of the scale, far more. A non-finite entry must be the same on
/// both sides (NaN against NaN, or the same infinity). `case` names the comparison.
pub fn assert_tensors_close(
    actual: &[TensorData],
    expected: &[TensorData],
    relative: f64,
    case: &str,
) {
    assert_eq!(actual.len(), expected.len(), "{case}");
    for (index, (actual, expected)) in actual.iter().zip(expected).enumerate() {
        assert_eq!(actual.shape(), expected.shape(), "tensor {index} of {case}");
        let largest = expected
            .iter::<f64>()
            .filter(|value| value.is_finite())
            .fold(1.0f64, |largest, value| largest.max(value.abs()));
        for (entry, (a, b)) in actual.iter::<f64>().zip(expected.iter::<f64>()).enumerate() {
            let allowed = (relative * b.abs()).max(relative / 10.0 * largest);
            let agree = if b.is_finite() {
                (a - b).abs() <= allowed
            } else {
                a == b || (a.is_nan() && b.is_nan())
            };
            assert!(
                agree,
                "{case}, tensor {index}, entry {entry}: {a} vs {b} (allowed {allowed:.3e})"
            );
        }
    }
}

/// `1 / s(n_r)` for every row `r` of `rows` (`[R, w]`), as `[R, 1]`: a row's gradient through a
/// normed projection is proportional to its scale `s` (see `RowScale`), so that gradient times
/// this is of one size for rows of any norm, and one tolerance fits them all.
pub fn inverse_row_scales(rows: &Tensor<2>, scale: crate::backend::RowScale) -> Tensor<2> {
    let norms = rows.clone().square().sum_dim(1);
    (norms.add_scalar(scale.root_offset).sqrt() + scale.offset)
        .clamp_min(scale.floor)
        .div_scalar(scale.numerator)
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

/// Every float parameter copied onto a device and cast to a float type, requiring a gradient
/// (for running one model in several precisions).
#[cfg(feature = "wgpu")]
pub struct OnDeviceAs(pub Device, pub burn::tensor::FloatDType);

#[cfg(feature = "wgpu")]
impl burn::module::ModuleMapper for OnDeviceAs {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<D>>,
    ) -> burn::module::Param<Tensor<D>> {
        param.map(|tensor| {
            Tensor::<D>::from_data(tensor.to_data(), &self.0)
                .cast(self.1)
                .require_grad()
        })
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

/// Uniform draws in `(0, 1]` (never 0: a logarithm may take them) from a fixed linear
/// congruential sequence started from `seed`: the same in every run and on every machine.
pub fn fixed_uniform(seed: u64) -> impl FnMut() -> f64 {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        // 53 high bits.
        ((state >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
}

/// Entries of standard deviation `std` drawn from a fixed sequence (a linear congruential
/// generator from `seed`, then Box–Muller): the same draw in every run, so that a comparison
/// of two paths that fails on it fails again.
pub fn fixed_normal<const D: usize>(
    shape: [usize; D],
    std: f64,
    seed: u64,
    device: &Device,
) -> Tensor<D> {
    let count: usize = shape.iter().product();
    let mut uniform = fixed_uniform(seed);
    let values: Vec<f32> = (0..count)
        .map(|_| {
            let (u, v) = (uniform(), uniform());
            (std * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// A standard normal [`fixed_normal`] draw per `seed`: a failing case fails again.
pub fn standard_normal<const D: usize>(shape: [usize; D], seed: u64, device: &Device) -> Tensor<D> {
    fixed_normal(shape, 1.0, seed, device)
}

/// `num_blocks` tanh blocks of width [`WIDTH`] whose weights and biases are fixed draws
/// ([`fixed_normal`] of deviation `1/√WIDTH`, the scale of Burn's initialisation): the same
/// blocks in every run, so that a comparison that fails on them fails again.
pub fn fixed_blocks(num_blocks: usize, device: &Device) -> Vec<TanhBlock> {
    use burn::module::Module;
    struct Redrawn(u64);
    impl burn::module::ModuleMapper for Redrawn {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<D>>,
        ) -> burn::module::Param<Tensor<D>> {
            self.0 += 1;
            let (std, seed) = (1.0 / (WIDTH as f64).sqrt(), self.0);
            param.map(|tensor| fixed_normal(tensor.dims(), std, seed, &tensor.device()))
        }
    }
    let mut redrawn = Redrawn(2000);
    blocks(num_blocks, device)
        .into_iter()
        .map(|block| block.map(&mut redrawn))
        .collect()
}

/// Each vector of `actual` against the same one of `expected`, entry by entry, up to
/// `relative · (1 + max |expected|)`. Two f32 paths that sum in another order differ by a
/// fraction of the vector's scale: an entry that cancels to near zero (a gradient summed over
/// many terms) keeps the rounding of its terms, not a fraction of its own size.
#[cfg(feature = "wgpu")]
pub fn assert_close_in_scale(actual: &[Vec<f64>], expected: &[Vec<f64>], relative: f64) {
    assert_eq!(actual.len(), expected.len());
    for (index, (actual, expected)) in actual.iter().zip(expected).enumerate() {
        assert_eq!(actual.len(), expected.len(), "vector {index}");
        let scale = expected
            .iter()
            .fold(0.0f64, |largest, b| largest.max(b.abs()));
        for (a, b) in actual.iter().zip(expected) {
            assert!(
                (a - b).abs() <= relative * (1.0 + scale),
                "vector {index}: {a} vs {b} (scale {scale})"
            );
        }
    }
}

/// Every float parameter plus noise of standard deviation `std` ([`fixed_normal`], a seed per
/// parameter in the order visited), requiring a gradient: a layer away from its initialisation
/// (where zero weights hide terms from the gradients).
#[cfg(feature = "wgpu")]
pub struct Perturbed {
    std: f64,
    visited: u64,
}

#[cfg(feature = "wgpu")]
impl Perturbed {
    pub fn new(std: f64) -> Self {
        Self { std, visited: 0 }
    }
}

#[cfg(feature = "wgpu")]
impl burn::module::ModuleMapper for Perturbed {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<D>>,
    ) -> burn::module::Param<Tensor<D>> {
        let (std, seed) = (self.std, self.visited);
        self.visited += 1;
        param.map(|tensor| {
            let noise = fixed_normal(tensor.dims(), std, 1000 + seed, &tensor.device());
            (tensor.detach() + noise).detach().require_grad()
        })
    }
}

/// The wgpu device under autodiff, for the kernel tests.
#[cfg(feature = "wgpu")]
pub fn wgpu_autodiff() -> Device {
    crate::device::device("wgpu")
        .expect("compiled in")
        .autodiff()
}

/// [`table_results`] for the first layer of `connectivity` through the CubeCL connection-table
/// kernels, in each of the knobs' forms, against the composed tensor ops, on its (wgpu) device,
/// for units of `shape` (entries of deviation `std`, a fixed draw).
#[cfg(feature = "wgpu")]
pub fn assert_table_kernels_match_composed<M: crate::multi_stream::MultiStream>(
    connectivity: &M,
    shape: [usize; 3],
    std: f64,
    parameters: impl Fn(&burn::tensor::Gradients) -> Vec<TensorData>,
    case: &str,
) {
    use crate::backend::{
        GatedWeights, Knobs, LayerOps, ProductPath, ProjectionPath, TilePadding, UnitOps,
        with_each_knobs,
    };
    let device = connectivity
        .devices()
        .into_iter()
        .next()
        .expect("a parameter");
    let units = &fixed_normal(shape, std, 7, &device);
    let run = |ops: fn() -> LayerOps| table_results(connectivity, units, ops, &parameters);
    let composed = run(LayerOps::composed);
    // The kernels' default forms, then the other forms a GPU measurement may pick
    // (`cube_launch::Knobs`): 16 units per row in cubes of 128 units (a tile's entries; the
    // default cubes have twice as many) with one row per step of the weights' product and one
    // entry at a time in the row gradient's pass over tiles of odd padding, and the
    // gated table's weights staged in shared memory for 4 rows per cube; then Burn's matmul for
    // every product with the weights, and the gated weights read directly for 2 rows per cube. (Two units per row unroll 64 entries per unit: lavapipe took 20 minutes
    // to compile those kernels for these tests.)
    let tiled = Knobs {
        row_group: 16,
        row_gradient_batch: 1,
        tile_units: 128,
        tile_padding: TilePadding::Odd,
        weights_product: ProductPath::Kernel { rows_per_step: 1 },
        gated_weights: GatedWeights::Staged,
        gated_rows: 4,
        ..Knobs::default()
    };
    let matmul = Knobs {
        weights_product: ProductPath::Matmul,
        table_projection: ProjectionPath::Matmul,
        gated_rows: 2,
        ..Knobs::default()
    };
    let each = [Knobs::default(), tiled, matmul];
    let runs = with_each_knobs(each, || run(|| UnitOps::Kernels.layer()));
    for (knobs, kernels) in each.iter().zip(runs) {
        assert_kernels_match(&kernels, &composed, &format!("{case}, {knobs:?}"));
    }
}

/// [`table_results`] for the first layer of `connectivity` (on autodiff Flex) through the
/// CubeCL connection-table kernels on wgpu in the knobs `knobs`, against the composed tensor
/// ops on Flex, for units of `shape` (entries of deviation `std`, a fixed draw): for launches
/// past one grid axis (65535 cubes), at sizes where the composed form on lavapipe would be
/// wrong (its loops stop after 65535 iterations in all, which Burn's reductions over as many
/// rows reach). `parameters` reads the gradients of the copy it is given.
#[cfg(feature = "wgpu")]
pub fn assert_table_kernels_match_flex<M: crate::multi_stream::MultiStream>(
    connectivity: &M,
    shape: [usize; 3],
    std: f64,
    knobs: crate::backend::Knobs,
    parameters: impl Fn(&M, &burn::tensor::Gradients) -> Vec<TensorData>,
    case: &str,
    bound: f32,
) {
    use crate::backend::{LayerOps, UnitOps, with_each_knobs};
    let flex = Device::flex().autodiff();
    let units = fixed_normal(shape, std, 7, &flex);
    let composed = table_results(connectivity, &units, LayerOps::composed, |grads| {
        parameters(connectivity, grads)
    });
    let wgpu = wgpu_autodiff();
    let on_wgpu = connectivity
        .clone()
        .map(&mut OnDeviceAs(wgpu.clone(), burn::tensor::FloatDType::F32));
    let units = Tensor::<3>::from_data(units.to_data(), &wgpu);
    let [kernels] = with_each_knobs([knobs], || {
        table_results(
            &on_wgpu,
            &units,
            || UnitOps::Kernels.layer(),
            |grads| parameters(&on_wgpu, grads),
        )
    });
    assert_kernels_match_within(&kernels, &composed, &format!("{case}, {knobs:?}"), bound);
}

/// The first layer's connections of `connectivity` for `units`, through the ops `ops` makes
/// (one fresh set per pass): [`table_part_results`], then [`layer_results`].
#[cfg(feature = "wgpu")]
pub fn table_results<M: crate::multi_stream::MultiStream>(
    connectivity: &M,
    units: &Tensor<3>,
    ops: impl Fn() -> crate::backend::LayerOps,
    parameters: impl Fn(&burn::tensor::Gradients) -> Vec<TensorData>,
) -> Vec<TensorData> {
    let mut results = table_part_results(connectivity, units, ops(), &parameters);
    results.extend(layer_results(connectivity, units, ops(), &parameters));
    results
}

/// A leaf of `units` and the first layer's mixing of `connectivity` for it through `ops`.
#[cfg(feature = "wgpu")]
fn first_layer_mixing<M: crate::multi_stream::MultiStream>(
    connectivity: &M,
    units: &Tensor<3>,
    ops: &crate::backend::LayerOps,
) -> (Tensor<3>, crate::multi_stream::Mixing) {
    use crate::multi_stream::MixingLayer;
    let units = units.clone().detach().require_grad();
    let mixing = connectivity
        .mixing(0)
        .expect("one block")
        .mixing(&units, ops);
    (units, mixing)
}

/// A fixed probe of the shape, device and float type of `like`, entry `i` (row-major) being
/// `value(i)`: a smooth function of the position, so that every run sees the same.
#[cfg(feature = "wgpu")]
fn probe_like(like: &Tensor<3>, value: impl Fn(usize) -> f32) -> Tensor<3> {
    let count = like.shape().num_elements();
    let values: Vec<f32> = (0..count).map(value).collect();
    Tensor::<1>::from_data(TensorData::new(values, [count]), &like.device())
        .reshape(like.dims())
        .cast(burn::tensor::FloatDType::from(like.dtype()))
}

/// The view rows, residual rows and `β` of the first layer of `connectivity` for `units`
/// through `ops`, then the gradients of the units and of every parameter (`parameters`, read
/// from the gradients) for the loss `Σ_k ⟨probe_k, part_k⟩`, with fixed probes between 0.5
/// and 1.5 (positive, so that a parameter's gradient summed over the parts does not cancel).
#[cfg(feature = "wgpu")]
pub fn table_part_results<M: crate::multi_stream::MultiStream>(
    connectivity: &M,
    units: &Tensor<3>,
    ops: crate::backend::LayerOps,
    parameters: impl Fn(&burn::tensor::Gradients) -> Vec<TensorData>,
) -> Vec<TensorData> {
    let (units, mixing) = first_layer_mixing(connectivity, units, &ops);
    let beta = mixing.beta.tensor(&mixing.residual.matrices);
    let parts = [mixing.input.taken(), mixing.residual.taken(), beta];
    let loss = parts
        .iter()
        .enumerate()
        .map(|(k, part)| {
            let probe = probe_like(part, |i| 1.0 + 0.5 * ((i * 7 + k * 3) as f32 * 0.37).sin());
            (part.clone() * probe).sum()
        })
        .reduce(|a, b| a + b)
        .expect("three parts");
    let grads = loss.backward();
    let mut results: Vec<TensorData> = parts.into_iter().map(Tensor::into_data).collect();
    results.push(units.grad(&grads).expect("the units are used").into_data());
    results.extend(parameters(&grads));
    results
}

/// The whole first layer of `connectivity` for `units` through `ops`: the block input
/// `u = A_in S`, a block `h = tanh(u)`, the next units `A_res S + β h`, through the mixes that
/// hand their gradients on in the layer's slot. Block input, next units, then the gradients of
/// the units and of every parameter (`parameters`) for a fixed probe of the next units.
#[cfg(feature = "wgpu")]
pub fn layer_results<M: crate::multi_stream::MultiStream>(
    connectivity: &M,
    units: &Tensor<3>,
    ops: crate::backend::LayerOps,
    parameters: impl Fn(&burn::tensor::Gradients) -> Vec<TensorData>,
) -> Vec<TensorData> {
    let (units, mixing) = first_layer_mixing(connectivity, units, &ops);
    let crate::multi_stream::Mixing {
        input,
        made_input,
        residual,
        beta,
        slot,
    } = mixing;
    let block_input = made_input.unwrap_or_else(|| ops.mix(input, units.clone(), None, slot));
    let branch = block_input.clone().tanh();
    let next = ops.mix(residual, units.clone(), Some((beta, branch)), slot);
    let probe = probe_like(&next, |i| (i as f32 * 0.53).cos());
    let grads = (next.clone() * probe).sum().backward();
    let mut results = vec![block_input.into_data(), next.into_data()];
    results.push(units.grad(&grads).expect("the units are used").into_data());
    results.extend(parameters(&grads));
    results
}

/// Each of `kernels` equal to the same entry of `composed` within a tolerance scaled to the
/// entry's largest magnitude; a failure names `case` and the entry.
#[cfg(feature = "wgpu")]
fn assert_kernels_match(kernels: &[TensorData], composed: &[TensorData], case: &str) {
    assert_kernels_match_within(kernels, composed, case, 1e-4);
}

/// [`assert_kernels_match`] with the absolute bound `bound` of each result's largest magnitude.
#[cfg(feature = "wgpu")]
fn assert_kernels_match_within(
    kernels: &[TensorData],
    composed: &[TensorData],
    case: &str,
    bound: f32,
) {
    assert_eq!(kernels.len(), composed.len());
    for (index, (kernel, composed)) in kernels.iter().zip(composed).enumerate() {
        let largest = composed
            .iter::<f32>()
            .fold(1.0f32, |largest, value| largest.max(value.abs()));
        assert_eq!(kernel.shape(), composed.shape(), "{case}: result {index}");
        let tolerance = Tolerance::absolute(bound * largest).set_relative(1e-3);
        // The failure names the case and the result, not just a position in a flat tensor.
        let compared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            kernel.assert_approx_eq::<f32>(composed, tolerance);
        }));
        if let Err(panic) = compared {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|text| text.to_string()))
                .unwrap_or_default();
            panic!("{case}: result {index} (largest |value| {largest}): {message}");
        }
    }
}

/// How far an f16 result may be from its f32 value, relative to the result's largest entry:
/// four of f16's unit roundoffs (`2⁻¹¹` each), for the rounding of the inputs and the one of
/// each sum where it is stored. Sums of a thousand and more terms kept in f16 land past it.
#[cfg(feature = "wgpu")]
pub const HALF_SUMS_BOUND: f32 = 4.0 / 2048.0;

/// `op`'s output and the gradients of its inputs for the loss `Σ output ⊙ probe`, computed on
/// leaves made from `inputs`' data in `dtype` (on their device), each as [`scaled_errors`]
/// from the same in f32.
pub fn errors_in_float_type<const D: usize, const O: usize>(
    dtype: burn::tensor::DType,
    inputs: &[Tensor<D>],
    probe: &Tensor<O>,
    op: impl Fn(Vec<Tensor<D>>) -> Tensor<O>,
    case: &str,
) -> Vec<f32> {
    let run = |dtype: burn::tensor::DType| {
        // Leaves made from data: a cast under autodiff is not a leaf.
        let leaves: Vec<Tensor<D>> = inputs
            .iter()
            .map(|x| Tensor::from_data(x.to_data(), (&x.device(), dtype)).require_grad())
            .collect();
        let output = op(leaves.clone());
        assert_eq!(output.dtype(), dtype, "{case}");
        let grads = (output.clone() * probe.clone().cast(dtype))
            .sum()
            .backward();
        std::iter::once(output.into_data())
            .chain(
                leaves
                    .iter()
                    .map(|x| x.grad(&grads).expect("a gradient").into_data()),
            )
            .collect::<Vec<_>>()
    };
    scaled_errors(&run(dtype), &run(burn::tensor::DType::F32), case)
}

/// Each of `results` against the same one of `exact`: its largest difference over the largest
/// magnitude of `exact`'s, infinite where an entry of `results` is not finite (a maximum would
/// pass over a NaN). `case` names the op in a failure.
pub fn scaled_errors(results: &[TensorData], exact: &[TensorData], case: &str) -> Vec<f32> {
    assert_eq!(results.len(), exact.len(), "{case}: one result each");
    results
        .iter()
        .zip(exact)
        .map(|(got, want)| {
            let want: Vec<f32> = want.iter::<f32>().collect();
            let largest = want.iter().fold(0.0f32, |top, v| top.max(v.abs()));
            let worst = got.iter::<f32>().zip(&want).fold(0.0f32, |top, (g, w)| {
                let error = if g.is_finite() {
                    (g - w).abs()
                } else {
                    f32::INFINITY
                };
                top.max(error)
            });
            worst / largest
        })
        .collect()
}

/// A fused op's sums in f16: `run(dtype, kernels)` gives its results (values and gradients,
/// read back as f32) for inputs in `dtype`, through the CubeCL kernels or the composed tensor
/// ops. Through the kernels in f16 each result is within [`HALF_SUMS_BOUND`] of the composed
/// f32 one (relative to its largest entry; the composed f16 one is printed beside it), and
/// with the kernels summing in f16 (the knob `half_sums_in_f32` off: the mutation) at least
/// one is past it, so that the check tells the two apart. `case` names the op.
#[cfg(feature = "wgpu")]
pub fn assert_half_sums_in_f32(
    case: &str,
    run: impl Fn(burn::tensor::FloatDType, bool) -> Vec<TensorData>,
) {
    assert_half_sums_in_f32_in_forms(case, &[crate::backend::Knobs::default()], run);
}

/// [`assert_half_sums_in_f32`] with the kernels in each of the knobs' `forms` (each within the
/// bound), the mutation in the first.
#[cfg(feature = "wgpu")]
pub fn assert_half_sums_in_f32_in_forms(
    case: &str,
    forms: &[crate::backend::Knobs],
    run: impl Fn(burn::tensor::FloatDType, bool) -> Vec<TensorData>,
) {
    use crate::backend::{Knobs, with_each_knobs};
    use burn::tensor::FloatDType;
    let exact = run(FloatDType::F32, false);
    let errors = |results: Vec<TensorData>| scaled_errors(&results, &exact, case);
    let composed = errors(run(FloatDType::F16, false));
    let own_type = Knobs {
        half_sums_in_f32: false,
        ..forms[0]
    };
    let [own_type] = with_each_knobs([own_type], || errors(run(FloatDType::F16, true)));
    for knobs in forms {
        let [kernels] = with_each_knobs([*knobs], || errors(run(FloatDType::F16, true)));
        eprintln!(
            "{case}, {knobs:?}: f16 errors {kernels:?}, composed {composed:?}, own-type sums \
             {own_type:?}"
        );
        for (index, error) in kernels.iter().enumerate() {
            assert!(
                *error <= HALF_SUMS_BOUND,
                "{case}, {knobs:?}: result {index} in f16 is {error:e} of its scale from f32 \
                 (composed: {:e}), past {HALF_SUMS_BOUND:e}",
                composed[index]
            );
        }
    }
    assert!(
        own_type.iter().any(|error| *error > HALF_SUMS_BOUND),
        "{case}: summed in f16 every result is still within {HALF_SUMS_BOUND:e} \
         ({own_type:?}): the check cannot tell"
    );
}

/// The gradient of `param` in `grads` as data (panics if it has none).
#[cfg(feature = "wgpu")]
pub fn gradient_data<const D: usize>(
    param: &burn::module::Param<Tensor<D>>,
    grads: &burn::tensor::Gradients,
) -> TensorData {
    param
        .val()
        .grad(grads)
        .unwrap_or_else(|| panic!("the parameter of shape {:?} has a gradient", param.dims()))
        .into_data()
}

/// The setting an invalid `config` names in its error (out of range or not finite) when built
/// for two blocks; panics on any other outcome.
pub fn refused_setting<C: ConnectivityConfig>(config: C, device: &Device) -> &'static str
where
    C::Connectivity: std::fmt::Debug,
{
    match config.init(2, device) {
        Err(Error::OutOfRange { name, .. } | Error::NonFinite { name, .. }) => name,
        other => panic!("expected an error, got {other:?}"),
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;

    /// The fixed draw has the asked deviation, about zero mean, and differs between seeds.
    #[test]
    fn fixed_normal_has_the_deviation_and_depends_on_the_seed() {
        let device = Device::flex();
        let values: Vec<f64> = fixed_normal([100, 100], 0.5, 3, &device)
            .into_data()
            .iter()
            .collect();
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / values.len() as f64;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!(
            (variance.sqrt() - 0.5).abs() < 0.02,
            "deviation {}",
            variance.sqrt()
        );
        let again: Vec<f64> = fixed_normal([100, 100], 0.5, 3, &device)
            .into_data()
            .iter()
            .collect();
        assert_eq!(values, again);
        let other: Vec<f64> = fixed_normal([100, 100], 0.5, 4, &device)
            .into_data()
            .iter()
            .collect();
        assert_ne!(values, other);
    }
}
