//! The Terminator model (MATH §3.4): a stack of SFNE blocks with growing channels, global
//! average pooling and a linear head, for sequences `[B, C, T]` and maps `[B, C, H, W]`.
//!
//! ```text
//! h_0 = x;  h_j, K_g^j = SFNE_j(h_{j-1})   (C_j = λ_j · C_{j-1});  logits = W mean_positions(h_L) + b
//! loss = task_loss(logits) + slow_neural_loss(K_g^1..K_g^L)
//! ```
//!
//! The reference 2D model grows 3 → 12 → 36 → 72 → 144 → 288 channels (λ = 4, 3, 2, 2, 2) on
//! 32x32 maps, without dropout in the first block and 0.05 channel dropout in the others; this
//! builder follows that pattern (the block template's dropout applies from the second block on).

use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;

use crate::error::{Error, Result, check_size};
use crate::hyperzzw::global::Geometry;
use crate::hyperzzw::sfne::{SfneBlock, SfneBlockConfig, slow_neural_loss};

/// Configuration of [`Terminator`].
#[derive(Config, Debug)]
pub struct TerminatorConfig {
    /// Output classes.
    pub classes: usize,
    /// Template for every block: its `in_channels` is the model's input channels and its
    /// geometry the input's; its `expansion` is replaced by [`TerminatorConfig::expansions`].
    pub block: SfneBlockConfig,
    /// The bottleneck factor λ of each block, in order (reference `[4, 3, 2, 2, 2]`).
    #[config(default = "vec![4, 3, 2, 2, 2]")]
    pub expansions: Vec<usize>,
}

impl TerminatorConfig {
    /// The reference 2D configuration for `in_channels` x 32 x 32 images.
    pub fn reference(in_channels: usize, classes: usize) -> Self {
        let block = SfneBlockConfig::new(
            in_channels,
            1,
            Geometry::Map {
                rows: 32,
                columns: 32,
            },
        )
        .with_dropout(0.05);
        Self::new(classes, block)
    }

    /// Builds the model.
    ///
    /// # Errors
    /// No blocks, zero classes, or whatever a block's config rejects (e.g. `λ·C` not divisible
    /// by the G-IBS groups).
    pub fn init(&self, device: &Device) -> Result<Terminator> {
        if self.expansions.is_empty() {
            return Err(Error::NoBlocks);
        }
        check_size("Terminator classes", self.classes)?;
        let mut channels = self.block.in_channels;
        let mut blocks = Vec::with_capacity(self.expansions.len());
        for (index, &expansion) in self.expansions.iter().enumerate() {
            let dropout = if index == 0 { 0.0 } else { self.block.dropout };
            let config = SfneBlockConfig {
                in_channels: channels,
                expansion,
                dropout,
                ..self.block.clone()
            };
            let block = config.init(device)?;
            channels = block.out_channels();
            blocks.push(block);
        }
        Ok(Terminator {
            blocks,
            head: LinearConfig::new(channels, self.classes).init(device),
        })
    }
}

/// A stack of SFNE blocks and a linear head (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct Terminator {
    /// The SFNE blocks.
    pub blocks: Vec<SfneBlock>,
    /// `C_L → classes`.
    pub head: Linear,
}

/// What [`Terminator`] returns.
#[derive(Debug, Clone)]
pub struct TerminatorOutput {
    /// `[B, classes]`.
    pub logits: Tensor<2>,
    /// The slow neural loss of the blocks' global kernels, to add to the task loss.
    pub slow_loss: Tensor<1>,
}

impl Terminator {
    /// Classifies `x: [B, C, P]` (a sequence, or a map flattened row-major).
    ///
    /// # Errors
    /// [`Error::WidthMismatch`] if `x` does not fit the first block.
    pub fn forward(&self, x: Tensor<3>) -> Result<TerminatorOutput> {
        let mut hidden = x;
        let mut kernels = Vec::with_capacity(self.blocks.len());
        for block in &self.blocks {
            let out = block.forward(hidden)?;
            kernels.push(out.global_kernel);
            hidden = out.output;
        }
        let [batch, channels, _] = hidden.dims();
        let pooled = hidden.mean_dim(2).reshape([batch, channels]);
        Ok(TerminatorOutput {
            logits: self.head.forward(pooled),
            slow_loss: slow_neural_loss(&kernels)?,
        })
    }

    /// Classifies maps `x: [B, C, H, W]`.
    ///
    /// # Errors
    /// As [`Terminator::forward`].
    pub fn forward_map(&self, x: Tensor<4>) -> Result<TerminatorOutput> {
        let [batch, channels, rows, columns] = x.dims();
        self.forward(x.reshape([batch, channels, rows * columns]))
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Distribution;

    use super::*;

    fn small(geometry: Geometry) -> TerminatorConfig {
        let block = SfneBlockConfig::new(1, 1, geometry)
            .with_groups(4)
            .with_global_hidden(8)
            .with_local_hidden(8)
            .with_channel_hidden(8)
            .with_omega_0(10.0)
            .with_local_kernel_sizes(vec![3]);
        TerminatorConfig::new(10, block).with_expansions(vec![4, 2])
    }

    #[test]
    fn classifies_sequences_and_maps() {
        let device = Device::flex();
        let model = small(Geometry::Sequence { length: 16 })
            .init(&device)
            .unwrap();
        assert_eq!(model.blocks[1].out_channels(), 8);
        let x = Tensor::<3>::random([3, 1, 16], Distribution::Default, &device);
        let out = model.forward(x).unwrap();
        assert_eq!(out.logits.dims(), [3, 10]);
        assert!(out.slow_loss.into_scalar::<f64>() >= 0.0);

        let model = small(Geometry::Map {
            rows: 4,
            columns: 4,
        })
        .init(&device)
        .unwrap();
        let x = Tensor::<4>::random([2, 1, 4, 4], Distribution::Default, &device);
        assert_eq!(model.forward_map(x).unwrap().logits.dims(), [2, 10]);
    }

    #[test]
    fn invalid_configs_and_inputs_are_errors() {
        let device = Device::flex();
        let geometry = Geometry::Sequence { length: 16 };
        assert!(matches!(
            small(geometry).with_expansions(vec![]).init(&device),
            Err(Error::NoBlocks)
        ));
        assert!(
            small(geometry)
                .with_expansions(vec![3])
                .init(&device)
                .is_err(),
            "3 channels in 4 groups"
        );
        let model = small(geometry).init(&device).unwrap();
        assert!(model.forward(Tensor::zeros([1, 2, 16], &device)).is_err());
        assert!(model.forward(Tensor::zeros([1, 1, 15], &device)).is_err());
    }
}
