//! Auto-compression: the smallest depth whose layer-wise readout is as good as the full model,
//! up to a tolerance (H-ACN paper §3.1: layer-wise accuracy, truncation at inference).
//!
//! Score every readout `y_0..y_L` on validation data with your own head and metric (one pass:
//! [`Stack::readout`] or [`ConnectedEncoder::readout`]),
//! then [`Stack::compress`] (or [`ConnectedEncoder::compress`]) picks the depth and returns the
//! truncated model: fewer blocks to run, saved and loaded as a model of that depth.
//!
//! ```
//! use burn::{prelude::*, tensor::Distribution};
//! use burn_connectivity::compression::Objective;
//! use burn_connectivity::{HacnConfig, MlpBlockConfig, Stack};
//!
//! let device = Device::flex();
//! let blocks = MlpBlockConfig::new(8, 16).init_stack(6, &device)?;
//! let model = Stack::new(blocks, &HacnConfig::acn(), &device)?;
//! let x = Tensor::<3>::random([4, 3, 8], Distribution::Default, &device);
//! let target = model.forward(x.clone());
//! // Here the score is the distance to the full model's output; usually a validation accuracy.
//! let scores: Vec<f64> = model
//!     .readout(x)
//!     .into_iter()
//!     .map(|y| (y - target.clone()).abs().max().into_scalar::<f64>())
//!     .collect();
//! let (choice, compressed) = model.compress(&scores, 1e-3, Objective::Minimize)?;
//! assert_eq!(compressed.num_blocks(), choice.depth);
//! # Ok::<(), burn_connectivity::Error>(())
//! ```

use burn::module::{Module, ModuleDisplay};
use serde::{Deserialize, Serialize};

use crate::connectivity::Connectivity;
use crate::error::{Error, Result, check_finite, check_non_negative};
use crate::stack::Stack;
use crate::transformer::ConnectedEncoder;

/// Which way a validation score improves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Objective {
    /// Accuracy-like scores.
    Maximize,
    /// Loss-like scores.
    Minimize,
}

/// The depth chosen for a tolerance, with the scores it was chosen from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DepthChoice {
    /// The smallest depth `k >= 1` whose score is within the tolerance of the full model's.
    pub depth: usize,
    /// The scores of the readouts `y_0..y_L`.
    pub scores: Vec<f64>,
    /// The allowed loss of score relative to the full model.
    pub tolerance: f64,
    /// Which way the scores improve.
    pub objective: Objective,
}

impl DepthChoice {
    /// Picks the smallest depth `k >= 1` with `scores[k]` at most `tolerance` worse than
    /// `scores[L]` (the full model; `scores[0]` is the input's readout).
    ///
    /// # Errors
    /// [`Error::NoBlocks`] for fewer than two scores, [`Error::NonFinite`] for a score that is
    /// not finite, [`Error::OutOfRange`] for a negative tolerance.
    pub fn new(scores: &[f64], tolerance: f64, objective: Objective) -> Result<Self> {
        check_non_negative("compression tolerance", tolerance)?;
        let Some(&full) = scores.last() else {
            return Err(Error::NoBlocks);
        };
        if scores.len() < 2 {
            return Err(Error::NoBlocks);
        }
        for &score in scores {
            check_finite("readout score", score)?;
        }
        let within = |score: f64| match objective {
            Objective::Maximize => score >= full - tolerance,
            Objective::Minimize => score <= full + tolerance,
        };
        let depth = (1..scores.len())
            .find(|&k| within(scores[k]))
            .unwrap_or(scores.len() - 1);
        Ok(Self {
            depth,
            scores: scores.to_vec(),
            tolerance,
            objective,
        })
    }
}

impl<M: Module + ModuleDisplay, C: Connectivity> Stack<M, C> {
    /// The smallest model whose readout score (`scores[k]` for `y_k`, `k = 0..=L`) is within
    /// `tolerance` of the full model's, and the choice.
    ///
    /// # Errors
    /// As [`DepthChoice::new`], or [`Error::CountMismatch`] unless there are `L + 1` scores.
    pub fn compress(
        &self,
        scores: &[f64],
        tolerance: f64,
        objective: Objective,
    ) -> Result<(DepthChoice, Self)> {
        let choice = choose(scores, self.num_blocks(), tolerance, objective)?;
        Ok((choice.clone(), self.truncated(choice.depth)?))
    }
}

impl<C: Connectivity> ConnectedEncoder<C> {
    /// The smallest encoder whose readout score (`scores[k]` after `k` layers, `k = 0..=L`)
    /// is within `tolerance` of the full encoder's, and the choice.
    ///
    /// # Errors
    /// As [`DepthChoice::new`], or [`Error::CountMismatch`] unless there are `L + 1` scores.
    pub fn compress(
        &self,
        scores: &[f64],
        tolerance: f64,
        objective: Objective,
    ) -> Result<(DepthChoice, Self)> {
        let choice = choose(scores, self.num_layers(), tolerance, objective)?;
        Ok((choice.clone(), self.truncated(choice.depth)?))
    }
}

/// [`DepthChoice::new`] for a model of `depth` blocks, which has `depth + 1` readouts.
fn choose(
    scores: &[f64],
    depth: usize,
    tolerance: f64,
    objective: Objective,
) -> Result<DepthChoice> {
    if scores.len() != depth + 1 {
        return Err(Error::CountMismatch {
            name: "readout scores (one per depth 0..=L)",
            expected: depth + 1,
            found: scores.len(),
        });
    }
    DepthChoice::new(scores, tolerance, objective)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_smallest_depth_within_tolerance() {
        let accuracy = [0.1, 0.5, 0.93, 0.95, 0.94, 0.96];
        let choice = DepthChoice::new(&accuracy, 0.02, Objective::Maximize).unwrap();
        assert_eq!(choice.depth, 3);
        assert_eq!(
            DepthChoice::new(&accuracy, 0.0, Objective::Maximize)
                .unwrap()
                .depth,
            5
        );
        assert_eq!(
            DepthChoice::new(&accuracy, 1.0, Objective::Maximize)
                .unwrap()
                .depth,
            1
        );
        let loss = [3.0, 2.0, 1.05, 1.2, 1.0];
        let choice = DepthChoice::new(&loss, 0.1, Objective::Minimize).unwrap();
        assert_eq!(choice.depth, 2);
    }

    #[test]
    fn the_compressed_stack_computes_the_chosen_readout() {
        use burn::prelude::*;

        use crate::hacn::HacnConfig;
        use crate::test_util::{assert_close, blocks, input};

        let device = Device::flex();
        let model = Stack::new(blocks(5, &device), &HacnConfig::new(), &device).unwrap();
        let x = input(&device);
        let readout = model.readout(x.clone());
        let scores = [0.2, 0.6, 0.9, 0.91, 0.92, 0.92];
        let (choice, compressed) = model.compress(&scores, 0.015, Objective::Maximize).unwrap();
        assert_eq!(choice.depth, 3);
        assert_eq!(compressed.num_blocks(), 3);
        assert_close(compressed.forward(x), readout[3].clone());
        assert!(matches!(
            model.compress(&scores[..5], 0.01, Objective::Maximize),
            Err(Error::CountMismatch { .. })
        ));
    }

    #[test]
    fn the_compressed_encoder_computes_the_chosen_readout() {
        use burn::nn::transformer::TransformerEncoderConfig;
        use burn::prelude::*;
        use burn::tensor::Distribution;

        use crate::hacn::HacnConfig;
        use crate::transformer::{EncoderMasks, Granularity};

        let device = Device::flex();
        let layers = TransformerEncoderConfig::new(8, 16, 2, 4)
            .with_norm_first(true)
            .init(&device);
        let model =
            ConnectedEncoder::new(layers, Granularity::Sublayer, &HacnConfig::new(), &device)
                .unwrap();
        let x = Tensor::<3>::random([2, 3, 8], Distribution::Default, &device);
        let masks = EncoderMasks::causal(2, 3, &device);
        let readout = model.readout(x.clone(), &masks);
        let (choice, compressed) = model
            .compress(&[3.0, 1.5, 1.2, 1.0, 1.0], 0.25, Objective::Minimize)
            .unwrap();
        assert_eq!((choice.depth, compressed.num_layers()), (2, 2));
        compressed
            .forward(x, &masks)
            .into_data()
            .assert_eq(&readout[2].clone().into_data(), true);
    }

    #[test]
    fn bad_scores_and_tolerances_are_errors() {
        assert!(matches!(
            DepthChoice::new(&[0.5], 0.1, Objective::Maximize),
            Err(Error::NoBlocks)
        ));
        assert!(matches!(
            DepthChoice::new(&[0.5, f64::NAN], 0.1, Objective::Maximize),
            Err(Error::NonFinite { .. })
        ));
        assert!(matches!(
            DepthChoice::new(&[0.5, 0.6], -0.1, Objective::Maximize),
            Err(Error::OutOfRange { .. })
        ));
    }
}
