//! A sine-gated linear layer over fixed points, with its own backward, on the CubeCL backends:
//! one kernel forward, one backward (two past 32 points: the partial sums' sum).
//!
//! For `N` points with fixed coordinates `c [N, D]`, an input `z [N, m]` and parameters
//! `A [D, h]`, `a [h]`, `B [m, h]`, `b [h]`, `p [N]`:
//!
//! ```text
//! θ[n, j]   = Σ_d c[n, d] A[d, j] + a[j]                 (the gate's argument)
//! u[n, j]   = Σ_k z[n, k] B[k, j] + b[j]
//! y[n, j]   = sin θ[n, j] · u[n, j] + p[n]
//!
//! ∂u        = ∂y ⊙ sin θ            ∂θ = ∂y ⊙ u ⊙ cos θ
//! ∂z[n, k]  = Σ_j ∂u[n, j] B[k, j]   ∂p[n] = Σ_j ∂y[n, j]
//! ∂A[d, j]  = Σ_n c[n, d] ∂θ[n, j]   ∂a[j] = Σ_n ∂θ[n, j]
//! ∂B[k, j]  = Σ_n z[n, k] ∂u[n, j]   ∂b[j] = Σ_n ∂u[n, j]
//! ```
//!
//! `c` is a constant: it gets no gradient. Composed, a layer is a matrix product and an
//! element-wise kernel forward, and backward two products, five reductions and the adds that
//! accumulate them, each a launch on a GPU for tensors of a few thousand entries. Here the
//! backward recomputes `θ` and `u` (`D + m` products an entry) rather than keeping them, in one
//! launch of two kinds of cubes that read nothing the other writes: one unit per column of the
//! parameters sums over a run of points (`D + m + 2` sums a unit, so `D` and `m` are
//! compile-time and bounded, [`MOST_INPUT_WIDTH`]), straight into the gradients where one run
//! takes every point, else as partial sums that a second kernel adds up; and one unit per entry
//! of `z` makes `∂z` (and the first of each point `∂p`).
//!
//! [`SineGatedInputs::takes`] decides once per call: CubeCL devices in f32, f16 and bf16 (sums,
//! sines and cosines in f32); other backends and wider layers keep the composed form.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::{Autodiff, NodeId};
#[cfg(feature = "cube-kernels")]
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
#[cfg(feature = "cube-kernels")]
use burn::tensor::Shape;
use burn::tensor::{DType, Tensor};

use super::autodiff::{constant, tracked_op_keeping};

#[cfg(feature = "cube-kernels")]
mod cube;

/// The widest input `m` (and the most coordinates `D`) the kernels take: a unit of the
/// parameters' gradient keeps `D + m + 2` sums.
pub(crate) const MOST_INPUT_WIDTH: usize = 128;

/// The most coordinates per point `D` the kernels take.
pub(crate) const MOST_COORDINATES: usize = 3;

/// The sine-gated layer (see the [module docs](self)).
#[backend_extension(
    Cube: cfg(feature = "cube-kernels"),
    Fusion: cfg(feature = "cube-kernels"),
    Autodiff
)]
pub(crate) trait SineGatedBackend: Backend {
    /// `y [N, h]` from `c [N, D]`, `z [N, m]`, `A [D, h]`, `a [h]`, `B [m, h]`, `b [h]`,
    /// `p [N]`.
    #[fusion(meta = |_, z, gate, _, _, _, _| TensorSpec::new(
        Shape::new([z.shape[0], gate.shape[1]]),
        z.dtype,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn sine_gated(
        coordinates: FloatTensor<Self>,
        z: FloatTensor<Self>,
        gate: FloatTensor<Self>,
        gate_bias: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        point_bias: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// `(∂z, ∂A, ∂a, ∂B, ∂b, ∂p)` given the gradient of the output.
    #[fusion(meta = |_, z, gate, gate_bias, weight, bias, _| (
        z.clone(),
        gate.clone(),
        gate_bias.clone(),
        weight.clone(),
        bias.clone(),
        TensorSpec::new(Shape::new([z.shape[0]]), z.dtype),
    ))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn sine_gated_backward(
        coordinates: FloatTensor<Self>,
        z: FloatTensor<Self>,
        gate: FloatTensor<Self>,
        gate_bias: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );
}

/// The layer's tensors: `c [N, D]`, `z [N, m]`, `A [D, h]`, `a [h]`, `B [m, h]`, `b [h]`,
/// `p [N]`.
#[derive(Clone, Debug)]
pub(crate) struct SineGatedInputs {
    pub coordinates: Tensor<2>,
    pub z: Tensor<2>,
    pub gate: Tensor<2>,
    pub gate_bias: Tensor<1>,
    pub weight: Tensor<2>,
    pub bias: Tensor<1>,
    pub point_bias: Tensor<1>,
}

impl SineGatedInputs {
    /// The layer in tensor ops: the reference of the kernels' tests.
    #[cfg(test)]
    fn composed(self) -> Tensor<2> {
        let argument = self.coordinates.matmul(self.gate) + self.gate_bias.unsqueeze_dim(0);
        let inner = self.z.matmul(self.weight) + self.bias.unsqueeze_dim(0);
        argument.sin() * inner + self.point_bias.unsqueeze_dim(1)
    }

    /// Whether [`sine_gated`] takes these: a CubeCL device, one float type (f32, f16 or bf16)
    /// for all, `D ≤` [`MOST_COORDINATES`], `m ≤` [`MOST_INPUT_WIDTH`], matching shapes.
    pub(crate) fn takes(&self) -> bool {
        let [points, coordinates] = self.coordinates.dims();
        let [z_points, width] = self.z.dims();
        let [gate_rows, columns] = self.gate.dims();
        let dtype = self.z.dtype();
        let same_type = [
            self.coordinates.dtype(),
            self.gate.dtype(),
            self.gate_bias.dtype(),
            self.weight.dtype(),
            self.bias.dtype(),
            self.point_bias.dtype(),
        ]
        .iter()
        .all(|other| *other == dtype);
        super::cube_kernels_take(&self.z)
            && super::cube_kernels_take(&self.weight)
            && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
            && same_type
            && z_points == points
            && gate_rows == coordinates
            && (1..=MOST_COORDINATES).contains(&coordinates)
            && (1..=MOST_INPUT_WIDTH).contains(&width)
            && self.weight.dims() == [width, columns]
            && self.gate_bias.dims() == [columns]
            && self.bias.dims() == [columns]
            && self.point_bias.dims() == [points]
    }
}

/// The layer through the op, for inputs that it [`takes`](SineGatedInputs::takes).
pub(crate) fn sine_gated(inputs: SineGatedInputs) -> Tensor<2> {
    let SineGatedInputs {
        coordinates,
        z,
        gate,
        gate_bias,
        weight,
        bias,
        point_bias,
    } = inputs;
    Tensor::from_dispatch(<Dispatch as SineGatedBackend>::sine_gated(
        coordinates.into_dispatch(),
        z.into_dispatch(),
        gate.into_dispatch(),
        gate_bias.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
        point_bias.into_dispatch(),
    ))
}

/// The op under autodiff: parents `[z, A, a, B, b, p]`; the state keeps the first five and the
/// constant coordinates.
#[derive(Debug)]
struct SineGated;

impl<B: SineGatedBackend> Backward<B, 6> for SineGated {
    type State = ([NodeId; 5], FloatTensor<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 6>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (kept, coordinates) = ops.state;
        let [z, gate, gate_bias, weight, bias] =
            kept.map(|id| checkpointer.retrieve_node_output(id));
        // `p` is not kept: its gradient is `∂y`'s row sums.
        let computed = B::sine_gated_backward(coordinates, z, gate, gate_bias, weight, bias, grad);
        let (grad_z, grad_gate, grad_gate_bias, grad_weight, grad_bias, grad_point_bias) = computed;
        register_tracked!(
            grads,
            ops.parents,
            [
                grad_z,
                grad_gate,
                grad_gate_bias,
                grad_weight,
                grad_bias,
                grad_point_bias
            ]
        );
    }
}

impl<B: SineGatedBackend, C: CheckpointStrategy> SineGatedBackend for Autodiff<B, C> {
    fn sine_gated(
        coordinates: FloatTensor<Self>,
        z: FloatTensor<Self>,
        gate: FloatTensor<Self>,
        gate_bias: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        point_bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let coordinates = coordinates.into_primitive();
        let kept = coordinates.clone();
        tracked_op_keeping::<B, C, _, _, 6, 5>(
            SineGated,
            [z, gate, gate_bias, weight, bias, point_bias],
            [0, 1, 2, 3, 4],
            |[z, gate, gate_bias, weight, bias, point_bias]| {
                let y = B::sine_gated(coordinates, z, gate, gate_bias, weight, bias, point_bias);
                (y, ())
            },
            |nodes, _, ()| (nodes, kept),
        )
        .0
    }

    fn sine_gated_backward(
        coordinates: FloatTensor<Self>,
        z: FloatTensor<Self>,
        gate: FloatTensor<Self>,
        gate_bias: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        // First-order only: the gradients are constants to the graph.
        let (grad_z, grad_gate, grad_gate_bias, grad_weight, grad_bias, grad_point_bias) =
            B::sine_gated_backward(
                coordinates.into_primitive(),
                z.into_primitive(),
                gate.into_primitive(),
                gate_bias.into_primitive(),
                weight.into_primitive(),
                bias.into_primitive(),
                grad.into_primitive(),
            );
        (
            constant::<B, C>(grad_z),
            constant::<B, C>(grad_gate),
            constant::<B, C>(grad_gate_bias),
            constant::<B, C>(grad_weight),
            constant::<B, C>(grad_bias),
            constant::<B, C>(grad_point_bias),
        )
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::prelude::*;
    use burn::tensor::FloatDType;

    use super::SineGatedInputs;
    use crate::test_util::{assert_tensors_close, standard_normal, wgpu_autodiff};

    /// `(y, ∂z, ∂A, ∂a, ∂B, ∂b, ∂p)` for the loss `Σ y ⊙ w`, through the op or composed.
    fn results(
        device: &Device,
        dtype: FloatDType,
        fused: bool,
        data: &[TensorData; 8],
    ) -> Vec<TensorData> {
        let on2 = |index: usize| Tensor::<2>::from_data(data[index].clone(), device).cast(dtype);
        let on1 = |index: usize| Tensor::<1>::from_data(data[index].clone(), device).cast(dtype);
        let inputs = SineGatedInputs {
            coordinates: on2(0),
            z: on2(1).require_grad(),
            gate: on2(2).require_grad(),
            gate_bias: on1(3).require_grad(),
            weight: on2(4).require_grad(),
            bias: on1(5).require_grad(),
            point_bias: on1(6).require_grad(),
        };
        let parents = inputs.clone();
        let y = if fused {
            assert!(inputs.takes());
            super::sine_gated(inputs)
        } else {
            inputs.composed()
        };
        let grads = (y.clone() * on2(7)).sum().backward();
        let grad2 = |tensor: &Tensor<2>| tensor.grad(&grads).expect("tracked").into_data();
        let grad1 = |tensor: &Tensor<1>| tensor.grad(&grads).expect("tracked").into_data();
        vec![
            y.into_data(),
            grad2(&parents.z),
            grad2(&parents.gate),
            grad1(&parents.gate_bias),
            grad2(&parents.weight),
            grad1(&parents.bias),
            grad1(&parents.point_bias),
        ]
    }

    /// In f16 the kernels sum in f32: the parameters' gradients over 2²⁰ points, 2048 a unit,
    /// every term of each sum of one sign (in f16 a unit's sum of like-signed terms stops
    /// growing once its spacing passes twice a term). The composed reference runs on Flex.
    #[test]
    fn half_precision_kernels_sum_in_f32() {
        use crate::test_util::{assert_half_sums_in_f32, fixed_normal};
        let flex = Device::flex().autodiff();
        let points = 1 << 20;
        // Positive coordinates, inputs and gates near 1, a small positive probe: the sums stay
        // within f16's range and none of them cancels.
        let data = [
            (fixed_normal([points, 1], 0.05, 60, &flex) + 0.5).into_data(),
            (fixed_normal([points, 1], 0.05, 61, &flex) + 1.0).into_data(),
            (fixed_normal([1, 1], 0.01, 62, &flex) + 0.1).into_data(),
            (fixed_normal([1], 0.01, 63, &flex) + 1.0).into_data(),
            (fixed_normal([1, 1], 0.01, 64, &flex) + 0.5).into_data(),
            (fixed_normal([1], 0.01, 65, &flex) + 0.5).into_data(),
            fixed_normal([points], 0.1, 66, &flex).into_data(),
            (fixed_normal([points, 1], 2e-4, 67, &flex) + 1e-3).into_data(),
        ];
        assert_half_sums_in_f32("sine-gated layer", |dtype, fused| {
            let device = if fused { wgpu_autodiff() } else { flex.clone() };
            results(&device, dtype, fused, &data)
        });
    }

    /// The op's output and gradients equal the composed layer's under autodiff on wgpu
    /// (lavapipe): one and two coordinates, columns past one cube, enough points for several
    /// runs of partial sums, the slow nets' default width (32), and the widest input and most
    /// coordinates the kernels take (`m = 128`, `D = 3`).
    #[test]
    fn sine_gated_matches_the_composed_layer() {
        let device = wgpu_autodiff();
        for (case, [points, coordinates, width, columns]) in [
            [9, 1, 5, 5],
            [12, 2, 5, 7],
            [3, 1, 1, 4],
            [70, 2, 3, 260],
            [1100, 1, 8, 16],
            [40, 1, 32, 32],
            [40, 3, super::MOST_INPUT_WIDTH, 12],
        ]
        .into_iter()
        .enumerate()
        {
            let seed = 40 + 8 * case as u64;
            let normal2 = |shape: [usize; 2], offset: u64| {
                standard_normal(shape, seed + offset, &device).into_data()
            };
            let normal1 = |shape: [usize; 1], offset: u64| {
                standard_normal(shape, seed + offset, &device).into_data()
            };
            let data = [
                normal2([points, coordinates], 0),
                normal2([points, width], 1),
                normal2([coordinates, columns], 2),
                normal1([columns], 3),
                normal2([width, columns], 4),
                normal1([columns], 5),
                normal1([points], 6),
                normal2([points, columns], 7),
            ];
            assert_tensors_close(
                &results(&device, FloatDType::F32, true, &data),
                &results(&device, FloatDType::F32, false, &data),
                1e-4,
                &format!("N = {points}, D = {coordinates}, m = {width}, h = {columns}"),
            );
        }
    }

    /// Past the widest input or the most coordinates the op refuses the layer (the caller then
    /// composes it), and takes it at the limits.
    #[test]
    fn sine_gated_refuses_what_its_units_cannot_hold() {
        let device = wgpu_autodiff();
        let inputs = |coordinates: usize, width: usize| {
            let points = 4;
            let columns = 3;
            SineGatedInputs {
                coordinates: Tensor::zeros([points, coordinates], &device),
                z: Tensor::zeros([points, width], &device),
                gate: Tensor::zeros([coordinates, columns], &device),
                gate_bias: Tensor::zeros([columns], &device),
                weight: Tensor::zeros([width, columns], &device),
                bias: Tensor::zeros([columns], &device),
                point_bias: Tensor::zeros([points], &device),
            }
        };
        let widest = super::MOST_INPUT_WIDTH;
        let most = super::MOST_COORDINATES;
        assert!(inputs(most, widest).takes());
        assert!(!inputs(most, widest + 1).takes());
        assert!(!inputs(most + 1, widest).takes());
    }
}
