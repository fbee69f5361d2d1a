//! A small Terminator and a residual MLP on the digits' 64 pixels: shared by
//! `terminator_digits` and `reproduce`.

use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use burn_connectivity::hyperzzw::{Geometry, SfneBlockConfig, Terminator, TerminatorConfig};
use burn_connectivity::{Hacn, HacnConfig, MlpBlock, MlpBlockConfig, Stack};
use indicatif::ProgressBar;

use super::{Digits, accuracy, shuffled};

/// What a model returns for a batch of pixels `[B, 64]`: logits and an extra loss term.
pub trait PixelClassifier: Module {
    fn logits_and_extra_loss(&self, pixels: Tensor<2>) -> (Tensor<2>, Option<Tensor<1>>);
}

/// The Terminator on one view of the pixels.
#[derive(Module, Debug)]
pub struct TerminatorClassifier {
    model: Terminator,
}

impl TerminatorClassifier {
    /// SFNE blocks with λ = 8, 2 on a 64-step sequence or an 8x8 map, slow nets at `omega_0`.
    pub fn new(geometry: Geometry, omega_0: f64, device: &Device) -> Result<Self, String> {
        let block = SfneBlockConfig::new(1, 1, geometry)
            .with_groups(4)
            .with_global_hidden(16)
            .with_local_hidden(16)
            .with_channel_hidden(16)
            .with_local_kernel_sizes(vec![3, 5])
            .with_omega_0(omega_0)
            .with_dropout(0.05);
        let model = TerminatorConfig::new(Digits::CLASSES, block)
            .with_expansions(vec![8, 2])
            .init(device)
            .map_err(|err| err.to_string())?;
        Ok(Self { model })
    }
}

impl PixelClassifier for TerminatorClassifier {
    fn logits_and_extra_loss(&self, pixels: Tensor<2>) -> (Tensor<2>, Option<Tensor<1>>) {
        let batch = pixels.dims()[0];
        // A sequence of 64 steps and a row-major 8x8 map share the [B, 1, 64] layout.
        let out = self
            .model
            .forward(pixels.reshape([batch, 1, 64]))
            .expect("input matches the configured geometry");
        (out.logits, Some(out.slow_loss))
    }
}

/// Plain residual baseline: pixels → linear → residual MLP blocks → LayerNorm → head.
#[derive(Module, Debug)]
pub struct ResidualMlp {
    embed: Linear,
    stack: Stack<MlpBlock, Hacn>,
    norm: LayerNorm,
    head: Linear,
}

impl ResidualMlp {
    pub fn new(width: usize, blocks: usize, device: &Device) -> Result<Self, String> {
        let error = |err: burn_connectivity::Error| err.to_string();
        let blocks = MlpBlockConfig::new(width, 2 * width)
            .init_stack(blocks, device)
            .map_err(error)?;
        Ok(Self {
            embed: LinearConfig::new(64, width).init(device),
            stack: Stack::new(blocks, &HacnConfig::resnet(), device).map_err(error)?,
            norm: LayerNormConfig::new(width).init(device),
            head: LinearConfig::new(width, Digits::CLASSES).init(device),
        })
    }

    /// The width (a multiple of 8) of the widest `blocks`-block MLP within `budget` parameters.
    pub fn width_within(budget: usize, blocks: usize, device: &Device) -> Result<usize, String> {
        let mut width = 8;
        while Self::new(width + 8, blocks, device)?.num_params() <= budget {
            width += 8;
        }
        Ok(width)
    }

    /// Its width.
    pub fn width(&self) -> usize {
        self.embed.weight.dims()[1]
    }
}

impl PixelClassifier for ResidualMlp {
    fn logits_and_extra_loss(&self, pixels: Tensor<2>) -> (Tensor<2>, Option<Tensor<1>>) {
        let features = self.stack.forward(self.embed.forward(pixels));
        (self.head.forward(self.norm.forward(features)), None)
    }
}

/// Adam at `learning_rate`, batches of 64, `epochs` passes; `after_epoch` sees the epoch, its
/// mean loss and the held-out accuracy. Returns the final held-out accuracy.
pub fn train_pixels<M: PixelClassifier>(
    mut model: M,
    (train_set, test_set): (&Digits, &Digits),
    (epochs, learning_rate, seed): (usize, f64, u64),
    device: &Device,
    bar: &ProgressBar,
    mut after_epoch: impl FnMut(usize, f64, f64),
) -> f64 {
    let mut optimizer = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let (test_pixels, test_labels) = test_set.all(&device.clone().without_autodiff());
    let mut test_accuracy = 0.0;
    for epoch in 1..=epochs {
        let order = shuffled(train_set.len(), seed + epoch as u64);
        let (mut loss_sum, mut batches) = (0.0, 0);
        for indices in order.chunks(64) {
            let (pixels, labels) = train_set.batch(indices, device);
            let (logits, extra) = model.logits_and_extra_loss(pixels);
            let loss = loss_fn.forward(logits, labels);
            let loss = match extra {
                Some(extra) => loss + extra,
                None => loss,
            };
            loss_sum += loss.clone().into_scalar::<f64>();
            batches += 1;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(learning_rate, model, grads);
        }
        let (logits, _) = model.valid().logits_and_extra_loss(test_pixels.clone());
        test_accuracy = accuracy(logits, test_labels.clone());
        after_epoch(epoch, loss_sum / batches as f64, test_accuracy);
        bar.inc(1);
    }
    test_accuracy
}
