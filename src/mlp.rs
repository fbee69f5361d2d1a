//! A ready-made pre-norm MLP branch, for examples, benchmarks and quick experiments.

use burn::nn::{Dropout, DropoutConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::prelude::*;

use crate::activation::gelu;
use crate::block::Block;
use crate::depth_ln::{DepthLn, DepthLnConfig};
use crate::error::{Result, check_probability, check_size};

/// Configuration of [`MlpBlock`].
#[derive(Config, Debug)]
pub struct MlpBlockConfig {
    /// Feature width `d`.
    pub d_model: usize,
    /// Hidden width of the MLP.
    pub d_hidden: usize,
    /// Use [`DepthLn`] instead of a plain LayerNorm.
    #[config(default = false)]
    pub depth_ln: bool,
    /// Dropout after the activation.
    #[config(default = 0.0)]
    pub dropout: f64,
}

impl MlpBlockConfig {
    /// One block at `depth` (counted from 1; it only matters with DepthLN).
    ///
    /// # Errors
    /// Zero widths or depth, dropout outside `[0, 1)`.
    pub fn init(&self, depth: usize, device: &Device) -> Result<MlpBlock> {
        check_size("MLP width", self.d_model)?;
        check_size("MLP hidden width", self.d_hidden)?;
        check_probability("MLP dropout", self.dropout)?;
        let norm = if self.depth_ln {
            BlockNorm::Depth(DepthLnConfig::new(self.d_model, depth).init(device)?)
        } else {
            check_size("block depth", depth)?;
            BlockNorm::Layer(LayerNormConfig::new(self.d_model).init(device))
        };
        Ok(MlpBlock {
            norm,
            expand: LinearConfig::new(self.d_model, self.d_hidden).init(device),
            dropout: DropoutConfig::new(self.dropout).init(),
            project: LinearConfig::new(self.d_hidden, self.d_model).init(device),
        })
    }

    /// `num_blocks` blocks at depths `1..=num_blocks`.
    ///
    /// # Errors
    /// As [`MlpBlockConfig::init`].
    pub fn init_stack(&self, num_blocks: usize, device: &Device) -> Result<Vec<MlpBlock>> {
        (1..=num_blocks)
            .map(|depth| self.init(depth, device))
            .collect()
    }
}

/// The norm in front of an [`MlpBlock`].
#[derive(Module, Debug)]
pub enum BlockNorm {
    /// A plain LayerNorm.
    Layer(LayerNorm),
    /// A depth-adaptive LayerNorm.
    Depth(DepthLn),
}

impl BlockNorm {
    /// `norm(x)` over the last axis (under autodiff on LibTorch, PyTorch's own LayerNorm).
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        match self {
            Self::Layer(norm) => crate::backend::layer_norm(norm, input),
            Self::Depth(norm) => norm.forward(input),
        }
    }
}

/// Pre-norm MLP branch `f(x) = W₂ · dropout(GELU(W₁ · norm(x) + b₁)) + b₂` (exact GELU,
/// see [`gelu`](crate::gelu)).
///
/// A residual branch: it does not add `x` back; the [`Stack`](crate::Stack)'s connectivity does.
/// Every op acts on the last axis, so on the CPU backends an input `[..., d]` runs as the rows of
/// one `[rows, d]` matrix: each product, and its weights' gradient, is one matrix product.
#[derive(Module, Debug)]
pub struct MlpBlock {
    /// LayerNorm or DepthLN.
    pub norm: BlockNorm,
    /// `d → hidden`.
    pub expand: Linear,
    /// Dropout after the activation.
    pub dropout: Dropout,
    /// `hidden → d`.
    pub project: Linear,
}

impl MlpBlock {
    /// The branch on `input` as it comes: every op over its last axis.
    fn unfolded_branch<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let hidden = gelu(self.expand.forward(self.norm.forward(input)));
        self.project.forward(self.dropout.forward(hidden))
    }
}

impl<const D: usize> Block<D> for MlpBlock {
    type Context = ();

    fn branch(&self, input: Tensor<D>, _context: &()) -> Tensor<D> {
        if !crate::backend::folds_rows(&input.device()) {
            return self.unfolded_branch(input);
        }
        // Every op acts on the last axis, so the leading axes fold into rows: the products are
        // then one `[rows, d] x [d, h]` each, whose weight gradient is one product too. Left
        // batched, burn's matmul backward writes a `[batch, d, h]` gradient per product and
        // sums it (8 MiB a product at `[8, 128, 256]`), and on glibc those short-lived blocks
        // make the heap shrink and grow again within a step.
        crate::backend::on_rows(input, |rows| self.unfolded_branch(rows))
    }

    fn width(&self) -> Option<usize> {
        Some(self.expand.weight.dims()[0])
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Distribution;

    use super::*;
    use crate::error::Error;
    use crate::hacn::HacnConfig;
    use crate::stack::Stack;

    #[test]
    fn depth_ln_blocks_get_increasing_depths() {
        let device = Device::flex();
        let blocks = MlpBlockConfig::new(8, 16)
            .with_depth_ln(true)
            .init_stack(3, &device)
            .unwrap();
        let depths: Vec<usize> = blocks
            .iter()
            .map(|block| match &block.norm {
                BlockNorm::Depth(norm) => norm.depth,
                BlockNorm::Layer(_) => 0,
            })
            .collect();
        assert_eq!(depths, vec![1, 2, 3]);
        let x = Tensor::<2>::random([4, 8], Distribution::Default, &device);
        assert_eq!(blocks[2].branch(x, &()).dims(), [4, 8]);
    }

    #[test]
    fn leading_axes_are_rows_of_one_product() {
        // The branch folds `[B, T, d]` into `[B T, d]` rows: each batch's output, and the
        // weights' gradient (the sum over batches), must be those of the batch on its own.
        let device = Device::flex().autodiff();
        let block = MlpBlockConfig::new(8, 16).init(1, &device).unwrap();
        let input = crate::test_util::fixed_normal([3, 4, 8], 1.0, 7, &device);
        let output = block.branch(input.clone(), &());
        let loss = |output: Tensor<3>| (output.clone() * output).sum();
        let gradients = loss(output.clone()).backward();
        let expand_gradient = block.expand.weight.grad(&gradients).unwrap();

        let mut expand_gradient_by_batch: Option<Tensor<2>> = None;
        for batch in 0..3 {
            let rows = input.clone().slice(batch..batch + 1).reshape([4, 8]);
            let batch_output = block.branch(rows, &());
            crate::test_util::assert_close(
                batch_output.clone(),
                output.clone().slice(batch..batch + 1).reshape([4, 8]),
            );
            let batch_gradients = loss(batch_output.unsqueeze()).backward();
            let batch_gradient = block.expand.weight.grad(&batch_gradients).unwrap();
            expand_gradient_by_batch = Some(match expand_gradient_by_batch {
                Some(sum) => sum + batch_gradient,
                None => batch_gradient,
            });
        }
        crate::test_util::assert_close(expand_gradient, expand_gradient_by_batch.unwrap());
    }

    #[test]
    fn stack_reports_mismatched_input_width() {
        let device = Device::flex();
        let blocks = MlpBlockConfig::new(8, 16).init_stack(2, &device).unwrap();
        let stack = Stack::new(blocks, &HacnConfig::new(), &device).unwrap();
        assert!(
            stack
                .check_input(&Tensor::<3>::zeros([1, 2, 8], &device))
                .is_ok()
        );
        assert!(matches!(
            stack.check_input(&Tensor::<3>::zeros([1, 2, 5], &device)),
            Err(Error::WidthMismatch {
                expected: 8,
                found: 5,
                ..
            })
        ));
    }

    #[test]
    fn invalid_configs_are_errors() {
        let device = Device::flex();
        assert!(MlpBlockConfig::new(0, 4).init(1, &device).is_err());
        assert!(MlpBlockConfig::new(4, 0).init(1, &device).is_err());
        assert!(
            MlpBlockConfig::new(4, 4)
                .with_dropout(1.0)
                .init(1, &device)
                .is_err()
        );
        assert!(
            MlpBlockConfig::new(4, 4)
                .with_depth_ln(true)
                .init(0, &device)
                .is_err()
        );
        assert!(MlpBlockConfig::new(4, 4).init(0, &device).is_err());
    }
}
