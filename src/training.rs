//! Optimising the connectivity parameters in their own parameter group.
//!
//! The reference codes train the connectivity's few parameters (H-ACN gates, ANCRe logits,
//! HyperZZW slow nets) apart from the weights: no weight decay, which would pull gates towards
//! ACN and logits towards uniform for no reason, and their own learning rate. Burn 0.22 supports
//! this through parameter groups; [`GroupedAdamConfig`] builds the pair Burn's `Learner` takes:
//!
//! ```
//! use burn::prelude::*;
//! use burn_connectivity::training::{GroupedAdamConfig, connectivity_group};
//! use burn_connectivity::{HacnConfig, MlpBlockConfig, Stack};
//!
//! let device = Device::flex().autodiff();
//! let blocks = MlpBlockConfig::new(16, 32).init_stack(4, &device)?;
//! let model = Stack::new(blocks, &HacnConfig::new(), &device)?;
//!
//! let group = connectivity_group(&model.connectivity);
//! let config = GroupedAdamConfig::new();
//! let (optimizer, learning_rates) = config.build(&group)?;
//! // burn::train::Learner::new(model, optimizer, learning_rates), or by hand:
//! // model = optimizer.step(learning_rates.step(), model, grads);
//! # Ok::<(), burn_connectivity::Error>(())
//! ```

use burn::module::{Module, ParamGroup};
use burn::optim::lr_scheduler::constant::ConstantLr;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer};
use burn::prelude::*;

use crate::error::{Result, check_non_negative};

/// The parameters of `connectivity` (any module: a connectivity, or several parts of a model
/// gathered in a tuple), matched by parameter id: the group survives optimiser steps, moves
/// between devices and the model's own field names.
pub fn connectivity_group(connectivity: &impl Module) -> ParamGroup {
    ParamGroup::ids_from_module(connectivity.clone())
}

/// AdamW for the model's weights, Adam without weight decay and with its own learning rate for
/// the connectivity group.
#[derive(Config, Debug)]
pub struct GroupedAdamConfig {
    /// Learning rate of the weights.
    #[config(default = 1e-3)]
    pub learning_rate: f64,
    /// Decoupled weight decay of the weights.
    #[config(default = 0.01)]
    pub weight_decay: f64,
    /// Learning rate of the connectivity parameters (never decayed).
    #[config(default = 1e-2)]
    pub connectivity_learning_rate: f64,
}

impl GroupedAdamConfig {
    /// The optimiser (AdamW for every parameter, overridden by Adam without decay on `group`)
    /// and constant learning rates (`learning_rate`, `connectivity_learning_rate` on `group`).
    /// Wrap your own schedulers with [`ModuleLrScheduler::with_group`] the same way.
    ///
    /// # Errors
    /// [`Error::NonFinite`](crate::Error::NonFinite) or
    /// [`Error::OutOfRange`](crate::Error::OutOfRange) for a learning rate or weight decay that
    /// is not a finite non-negative number.
    pub fn build(&self, group: &ParamGroup) -> Result<(ModuleOptimizer, ModuleLrScheduler)> {
        check_non_negative("learning rate", self.learning_rate)?;
        check_non_negative("weight decay", self.weight_decay)?;
        check_non_negative(
            "connectivity learning rate",
            self.connectivity_learning_rate,
        )?;
        let optimizer = AdamWConfig::new()
            .with_weight_decay(self.weight_decay as f32)
            .init()
            .with_group(group.clone(), AdamConfig::new().build(), None);
        let learning_rates = ModuleLrScheduler::new(ConstantLr::new(self.learning_rate))
            .with_group(
                group.clone(),
                ConstantLr::new(self.connectivity_learning_rate),
            );
        Ok((optimizer, learning_rates))
    }
}

#[cfg(test)]
mod tests {
    use burn::module::Param;
    use burn::optim::GradientsParams;

    use super::*;
    use crate::connectivity::ConnectivityConfig;
    use crate::hacn::{GateInit, Hacn, HacnConfig};

    #[derive(Module, Debug)]
    struct Model {
        weights: Param<Tensor<1>>,
        connectivity: Hacn,
    }

    fn values(param: &Param<Tensor<1>>) -> Vec<f32> {
        param.val().into_data().iter::<f32>().collect()
    }

    /// One step with gradient `slope · (1, 1, 1)` on both parameter sets.
    fn step(config: &GroupedAdamConfig, slope: f32) -> (Vec<f32>, Vec<f32>) {
        let device = Device::flex().autodiff();
        let model = Model {
            weights: Param::from_tensor(Tensor::ones([3], &device)),
            connectivity: HacnConfig::new()
                .with_init(GateInit::Constant { value: 1.0 })
                .init(3, &device)
                .unwrap(),
        };
        let loss = (model.weights.val().sum() + model.connectivity.gates.val().sum()) * slope;
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let group = connectivity_group(&model.connectivity);
        let (mut optimizer, mut learning_rates) = config.build(&group).unwrap();
        let model = optimizer.step(learning_rates.step(), model, grads);
        (values(&model.weights), values(&model.connectivity.gates))
    }

    #[test]
    fn the_connectivity_group_is_not_decayed() {
        let config = GroupedAdamConfig::new()
            .with_learning_rate(0.1)
            .with_weight_decay(0.5);
        let (weights, gates) = step(&config, 0.0);
        for w in weights {
            assert!((w - (1.0 - 0.1 * 0.5)).abs() < 1e-6, "decayed weight {w}");
        }
        assert_eq!(gates, vec![1.0; 3]);
    }

    #[test]
    fn invalid_settings_are_errors() {
        let group = ParamGroup::all();
        let negative = GroupedAdamConfig::new().with_learning_rate(-1.0);
        assert!(matches!(
            negative.build(&group),
            Err(crate::Error::OutOfRange { .. })
        ));
        let nan = GroupedAdamConfig::new().with_connectivity_learning_rate(f64::NAN);
        assert!(matches!(
            nan.build(&group),
            Err(crate::Error::NonFinite { .. })
        ));
    }

    #[test]
    fn the_connectivity_group_has_its_own_learning_rate() {
        // Adam's first step moves every parameter by its learning rate against the gradient.
        let config = GroupedAdamConfig::new()
            .with_learning_rate(0.01)
            .with_weight_decay(0.0)
            .with_connectivity_learning_rate(0.2);
        let (weights, gates) = step(&config, 1.0);
        for w in weights {
            assert!((w - 0.99).abs() < 1e-4, "weight {w}");
        }
        for a in gates {
            assert!((a - 0.8).abs() < 1e-4, "gate {a}");
        }
    }
}
