//! A blend of each column of a matrix with its unit-norm copy, with a hand-written backward:
//!
//! ```text
//! y      = a ⊙ z + b ⊙ z / n          z: [R, C],  a, b: [C] (broadcast over the rows)
//! n_j    = max(‖z_{·j}‖₂, ε)          the norm over the rows of column j
//! S_j    = Σ_r ∂y_rj z_rj
//! ∂a_j   = S_j
//! ∂b_j   = S_j / n_j
//! ∂z_rj  = ∂y_rj (a_j + b_j / n_j) − z_rj b_j S_j / n_j³     (the last term 0 where ‖z_{·j}‖ < ε)
//! ```
//!
//! Both passes are composed of the backend's own tensor ops (the trait's default bodies), so on
//! CubeCL the fusion engine merges them: the forward into a reduction and an elementwise kernel,
//! the backward into two reductions (`‖z‖²`, `S`) and the elementwise kernels of `∂z` and `∂b`.
//! What Burn's autodiff records for the same forward (a square, a sum, a root, a clamp, two
//! products, a quotient and a sum, with broadcasts) costs about 26 small kernels backward on
//! CubeCL, where its backward passes do not fuse. Flex takes the same composed passes (fewer,
//! larger CPU ops); other backends compose through autodiff.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Backend, Dispatch, TensorMetadata, backend_extension, get_or_init_device_settings,
};
use burn::tensor::{Shape, Tensor};

use super::autodiff::{constant, tracked_op};

/// The column blend (see the [module docs](self)).
#[backend_extension(
    Cube: cfg(feature = "cube-kernels"),
    Fusion: cfg(feature = "cube-kernels"),
    Flex: cfg(feature = "flex"),
    Autodiff
)]
pub(crate) trait ColumnRenormBackend: Backend {
    /// `a ⊙ z + b ⊙ z / max(‖z_{·j}‖, ε)` for `z [R, C]`, `a`, `b` `[C]`.
    #[fusion(default)]
    fn column_renorm(
        z: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        let [a, b] = [a, b].map(|weights| as_row::<Self>(weights));
        let norm = Self::float_clamp_min(column_norms::<Self>(z.clone()), epsilon.into());
        let normalised = Self::float_div(z.clone(), norm);
        Self::float_add(Self::float_mul(z, a), Self::float_mul(normalised, b))
    }

    /// `(∂z, ∂a, ∂b)` given the gradient of the output.
    #[fusion(default)]
    fn column_renorm_backward(
        z: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let columns = a.shape().num_elements();
        let [a, b] = [a, b].map(|weights| as_row::<Self>(weights));
        let length = column_norms::<Self>(z.clone());
        let norm = Self::float_clamp_min(length.clone(), epsilon.into());
        let sums = Self::float_sum_dim(Self::float_mul(grad.clone(), z.clone()), 0);
        let grad_b = Self::float_div(sums.clone(), norm.clone());
        // `b S / n³`, and 0 where the norm is clamped (there `n = ε` is a constant).
        let cube = Self::float_mul(Self::float_mul(norm.clone(), norm.clone()), norm.clone());
        let through_norm = Self::float_div(Self::float_mul(b.clone(), sums.clone()), cube);
        let bool_dtype = get_or_init_device_settings::<Self>(&z.device()).bool_dtype;
        let clamped = Self::float_lower_elem(length, epsilon.into(), bool_dtype);
        let through_norm = Self::float_mask_fill(through_norm, clamped, 0.0.into());
        let direct = Self::float_add(a, Self::float_div(b, norm));
        let grad_z = Self::float_sub(
            Self::float_mul(grad, direct),
            Self::float_mul(z, through_norm),
        );
        let flat = |row| Self::float_reshape(row, Shape::new([columns]));
        (grad_z, flat(sums), flat(grad_b))
    }
}

/// `[C]` as a `[1, C]` row.
fn as_row<B: Backend>(weights: FloatTensor<B>) -> FloatTensor<B> {
    let columns = weights.shape().num_elements();
    B::float_reshape(weights, Shape::new([1, columns]))
}

/// `‖z_{·j}‖₂` as a `[1, C]` row.
fn column_norms<B: Backend>(z: FloatTensor<B>) -> FloatTensor<B> {
    B::float_sqrt(B::float_sum_dim(B::float_mul(z.clone(), z), 0))
}

/// Whether [`column_renorm`] takes `z`: Flex and CubeCL devices (the others compose through
/// autodiff).
pub(crate) fn takes(z: &Tensor<2>) -> bool {
    let device = z.device();
    super::is_flex(&device) || super::is_cube(&device)
}

/// The blend through the op, for a `z` that it [`takes`].
pub(crate) fn column_renorm(z: Tensor<2>, a: Tensor<1>, b: Tensor<1>, epsilon: f64) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as ColumnRenormBackend>::column_renorm(
        z.into_dispatch(),
        a.into_dispatch(),
        b.into_dispatch(),
        epsilon,
    ))
}

#[cfg(feature = "cube-kernels")]
impl ColumnRenormBackend for super::cube_launch::Cube {}

#[cfg(feature = "flex")]
impl ColumnRenormBackend for burn_flex::Flex {}

/// The blend under autodiff: parents `[z, a, b]`.
#[derive(Debug)]
struct ColumnRenorm;

impl<B: ColumnRenormBackend> Backward<B, 3> for ColumnRenorm {
    type State = ([NodeId; 3], f64);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (nodes, epsilon) = ops.state;
        let [z, a, b] = nodes.map(|id| checkpointer.retrieve_node_output(id));
        let (grad_z, grad_a, grad_b) = B::column_renorm_backward(z, a, b, grad, epsilon);
        register_tracked!(grads, ops.parents, [grad_z, grad_a, grad_b]);
    }
}

impl<B: ColumnRenormBackend, C: CheckpointStrategy> ColumnRenormBackend for Autodiff<B, C> {
    fn column_renorm(
        z: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        tracked_op::<B, C, _, _>(
            ColumnRenorm,
            [z, a, b],
            |[z, a, b]| B::column_renorm(z, a, b, epsilon),
            |nodes, _| (nodes, epsilon),
        )
    }

    fn column_renorm_backward(
        z: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        // First-order only: the gradients are constants to the graph.
        let (grad_z, grad_a, grad_b) = B::column_renorm_backward(
            z.into_primitive(),
            a.into_primitive(),
            b.into_primitive(),
            grad.into_primitive(),
            epsilon,
        );
        (
            constant::<B, C>(grad_z),
            constant::<B, C>(grad_a),
            constant::<B, C>(grad_b),
        )
    }
}

#[cfg(test)]
mod tests {
    use burn::prelude::*;
    use burn::tensor::DType;

    use crate::test_util::{assert_tensors_close, standard_normal};

    const EPSILON: f64 = 1e-12;

    /// `(y, ∂z, ∂a, ∂b)` for the loss `Σ y ⊙ w`, through the op or composed (with Burn's
    /// autodiff), in `float` on `device`.
    fn results(
        device: &Device,
        float: DType,
        fused: bool,
        [z, a, b, w]: &[TensorData; 4],
    ) -> Vec<TensorData> {
        let matrix = |data: &TensorData| Tensor::<2>::from_data(data.clone(), device).cast(float);
        let (z, w) = (matrix(z).require_grad(), matrix(w).require_grad());
        let vector = |data: &TensorData| matrix(data).reshape::<1, _>([-1]).require_grad();
        let (a, b) = (vector(a), vector(b));
        let y = if fused {
            assert!(super::takes(&z));
            super::column_renorm(z.clone(), a.clone(), b.clone(), EPSILON)
        } else {
            let columns = a.dims()[0];
            let norm = z.clone().square().sum_dim(0).sqrt().clamp_min(EPSILON);
            let row = |weights: Tensor<1>| weights.reshape([1, columns]);
            z.clone() * row(a.clone()) + z.clone() / norm * row(b.clone())
        };
        let grads = (y.clone() * w).sum().backward();
        let grad = |x: Tensor<2>| x.grad(&grads).expect("tracked").into_data();
        vec![
            y.into_data(),
            grad(z),
            a.grad(&grads).expect("tracked").into_data(),
            b.grad(&grads).expect("tracked").into_data(),
        ]
    }

    fn inputs(rows: usize, columns: usize, seed: u64, device: &Device) -> [TensorData; 4] {
        let draw = |shape: [usize; 2], offset| {
            standard_normal(shape, seed * 4 + offset, device).into_data()
        };
        [
            draw([rows, columns], 0),
            draw([1, columns], 1),
            draw([1, columns], 2),
            draw([rows, columns], 3),
        ]
    }

    /// The op's value and gradients equal the composed form's under Burn's autodiff, in f64 on
    /// Flex and in f32 on wgpu (lavapipe): a grid of 1, 3 and 1024 points.
    #[test]
    fn column_renorm_matches_the_composed_form() {
        #[cfg_attr(not(feature = "wgpu"), allow(unused_mut))]
        let mut devices = vec![(Device::flex().autodiff(), DType::F64, 1e-10)];
        #[cfg(feature = "wgpu")]
        devices.push((crate::test_util::wgpu_autodiff(), DType::F32, 2e-4));
        for (device, float, relative) in devices {
            for (case, (rows, columns)) in [(1, 3), (3, 5), (1024, 32)].into_iter().enumerate() {
                let data = inputs(rows, columns, 11 + case as u64, &device);
                let fused = results(&device, float, true, &data);
                let composed = results(&device, float, false, &data);
                assert_tensors_close(
                    &fused,
                    &composed,
                    relative,
                    &format!("{rows} x {columns} in {float:?} on {device:?}"),
                );
            }
        }
    }

    /// A zero column is clamped to the norm ε: its output is 0 and its gradients are the closed
    /// form `∂z = ∂y (a + b / ε)`, `∂a = ∂b = 0`, where Burn's composed form gives NaN (the
    /// root's derivative at 0 times the clamp's 0); the other columns are unaffected.
    #[test]
    fn a_zero_column_has_finite_gradients() {
        let device = Device::flex().autodiff();
        let [z, a, b, w] = inputs(4, 2, 5, &device);
        let zeroed = Tensor::<2>::from_data(z, &device)
            .slice_assign([0..4, 1..2], Tensor::zeros([4, 1], &device))
            .into_data();
        let data = [zeroed, a.clone(), b.clone(), w.clone()];
        let fused = results(&device, DType::F64, true, &data);
        let (a, b) = (column(&a, 1)[0], column(&b, 1)[0]);
        assert!(column(&fused[0], 1).iter().all(|&y| y == 0.0));
        let expected: Vec<f64> = column(&w, 1)
            .iter()
            .map(|g| g * (a + b / EPSILON))
            .collect();
        let relative = |x: f64, y: f64| (x - y).abs() <= 1e-12 * y.abs();
        assert!(
            column(&fused[1], 1)
                .iter()
                .zip(&expected)
                .all(|(&x, &y)| relative(x, y)),
            "{:?} vs {expected:?}",
            column(&fused[1], 1)
        );
        for weights in &fused[2..] {
            assert_eq!(weights.iter::<f64>().nth(1), Some(0.0));
        }
        let composed = results(&device, DType::F64, false, &data);
        let first = |data: &TensorData| TensorData::new(column(data, 0), [data.shape()[0]]);
        assert_tensors_close(
            &[first(&fused[1])],
            &[first(&composed[1])],
            1e-10,
            "the other column's ∂z",
        );
    }

    /// Burn's gradient checkpointing (which recomputes the op's input `z = sin(x)` in the
    /// backward pass) leaves the gradients of `x`, `a` and `b` as they are.
    #[test]
    fn checkpointing_keeps_the_gradients() {
        crate::test_util::assert_checkpointing_keeps_gradients(|device| {
            let [x, a, b, w] = inputs(16, 4, 3, device);
            let leaf = |data: &TensorData| Tensor::<2>::from_data(data.clone(), device);
            let x = leaf(&x).require_grad();
            let [a, b] = [a, b].map(|data| leaf(&data).reshape::<1, _>([-1]).require_grad());
            let y = super::column_renorm(x.clone().sin(), a.clone(), b.clone(), EPSILON);
            let grads = (y * leaf(&w)).sum().backward();
            let host = |data: TensorData| data.iter::<f64>().collect::<Vec<_>>();
            vec![
                host(x.grad(&grads).expect("tracked").into_data()),
                host(a.grad(&grads).expect("tracked").into_data()),
                host(b.grad(&grads).expect("tracked").into_data()),
            ]
        });
    }

    /// Column `column` of a `[R, C]` matrix's data.
    fn column(data: &TensorData, column: usize) -> Vec<f64> {
        let width = data.shape()[1];
        data.iter::<f64>().skip(column).step_by(width).collect()
    }
}
