//! Helpers shared by the crate's fused CPU ops on Flex: typed views of Flex tensors and the two
//! inner loops they are made of.

use std::borrow::Cow;

use burn::tensor::TensorData;
use burn_flex::FlexTensor;

/// The scalar types the CPU ops run on (f32 and f64).
pub(crate) trait Scalar:
    burn::tensor::Element + bytemuck::Pod + num_traits::Float + std::ops::AddAssign + Send + Sync
{
}

impl Scalar for f32 {}
impl Scalar for f64 {}

/// The shape of a Flex tensor of rank `D`.
pub(crate) fn dims<const D: usize>(tensor: &FlexTensor) -> [usize; D] {
    tensor.layout().shape().dims::<D>()
}

/// The elements of `tensor` in row-major order (borrowed when it is contiguous).
pub(crate) fn values<E: Scalar>(tensor: &FlexTensor) -> Cow<'_, [E]> {
    match tensor.as_slice::<E>() {
        Some(slice) => Cow::Borrowed(slice),
        None => Cow::Owned(
            tensor
                .to_contiguous()
                .as_slice::<E>()
                .expect("contiguous after the copy")
                .to_vec(),
        ),
    }
}

/// A contiguous Flex tensor.
pub(crate) fn tensor<E: Scalar, const D: usize>(values: Vec<E>, shape: [usize; D]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// `Σ_k a_k b_k` with eight independent sums, so the compiler can vectorise it.
pub(crate) fn dot<E: Scalar>(a: &[E], b: &[E]) -> E {
    let mut lanes = [E::zero(); 8];
    let (a_chunks, b_chunks) = (a.chunks_exact(8), b.chunks_exact(8));
    let (a_rest, b_rest) = (a_chunks.remainder(), b_chunks.remainder());
    for (x, y) in a_chunks.zip(b_chunks) {
        for lane in 0..8 {
            lanes[lane] += x[lane] * y[lane];
        }
    }
    let mut total = lanes.into_iter().fold(E::zero(), |sum, lane| sum + lane);
    for (&x, &y) in a_rest.iter().zip(b_rest) {
        total += x * y;
    }
    total
}

/// `out += c x`.
pub(crate) fn axpy<E: Scalar>(out: &mut [E], c: E, x: &[E]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o += c * v;
    }
}
