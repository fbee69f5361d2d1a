//! The block abstraction: one residual branch of a deep network.

use burn::module::ModuleDisplay;
use burn::prelude::*;

/// A residual branch `h = f(x)` that maps a rank-`D` tensor to a tensor of the same shape.
///
/// A block never adds its own input back: how block outputs and earlier states are combined
/// is the [`Connectivity`](crate::Connectivity)'s job (MATH §0). A pre-norm MLP block is
/// `f(x) = W₂ GELU(W₁ LN(x))`, not `x + W₂ GELU(W₁ LN(x))`.
///
/// Implement it for your own modules (the orphan rule allows it for foreign Burn modules too,
/// since the trait is local to this crate):
///
/// ```
/// use burn::prelude::*;
/// use burn::nn::{Linear, LinearConfig};
/// use burn_connectivity::Block;
///
/// #[derive(Module, Debug)]
/// struct TanhBlock {
///     linear: Linear,
/// }
///
/// impl<const D: usize> Block<D> for TanhBlock {
///     type Context = ();
///
///     fn branch(&self, input: Tensor<D>, _context: &()) -> Tensor<D> {
///         self.linear.forward(input).tanh()
///     }
/// }
/// # let block = TanhBlock { linear: LinearConfig::new(4, 4).init(&Device::flex()) };
/// # let h = block.branch(Tensor::<2>::zeros([2, 4], &Device::flex()), &());
/// # assert_eq!(h.dims(), [2, 4]);
/// ```
pub trait Block<const D: usize>: Module + ModuleDisplay {
    /// Per-call data the branch needs besides its input (attention masks, for instance).
    /// Use `()` when there is none.
    type Context;

    /// The branch output `f(input)`, with the same shape as `input`.
    fn branch(&self, input: Tensor<D>, context: &Self::Context) -> Tensor<D>;

    /// The feature width (size of the last axis) this block accepts, if it knows it.
    ///
    /// [`Stack::check_input`](crate::Stack::check_input) uses it to report mismatched widths
    /// as an error before running the stack.
    fn width(&self) -> Option<usize> {
        None
    }
}
