//! Optimising the connectivity parameters in their own parameter group, with the papers'
//! training recipe.
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
//!
//! **The papers' recipe** (their language-model runs): AdamW with `β2 = 0.95`, linear warmup
//! then cosine decay, gradient clipping at norm 1 ([`GroupedAdamConfig::language_model`]). Every
//! piece is burn-optim's: its `Linear`/`CosineAnnealing` schedulers chained by its
//! `Sequential` scheduler, its `GradientClipping::Norm`. One difference with PyTorch's
//! `clip_grad_norm_`: Burn clips **each parameter tensor's** gradient to the norm, not the norm
//! of all gradients together, so no tensor's step is shrunk by another's large gradient.
//!
//! With peak rate `η`, `w` warmup steps, `T` steps in all and final fraction `f`, step
//! `t = 1, 2, …` uses
//!
//! ```text
//! η_t = η · t / w                                           t <= w
//! η_t = η · (f + (1 − f) · ½ (1 + cos(π (t − w − 1) / (T − w))))   t > w
//! ```
//!
//! and both parameter groups follow it, each from its own peak rate.

use burn::grad_clipping::GradientClippingConfig;
use burn::module::{Module, ParamGroup};
use burn::optim::lr_scheduler::LrSchedulerConfig;
use burn::optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::lr_scheduler::module_lr_scheduler::{ModuleLrScheduler, ModuleLrSchedulerConfig};
use burn::optim::lr_scheduler::sequential::SequentialLrSchedulerConfig;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer};
use burn::prelude::*;

use crate::error::{Error, Result, check_non_negative, check_positive, check_probability};

/// The parameters of `connectivity` (any module: a connectivity, or several parts of a model
/// gathered in a tuple), matched by parameter id: the group survives optimiser steps, moves
/// between devices and the model's own field names.
pub fn connectivity_group(connectivity: &impl Module) -> ParamGroup {
    ParamGroup::ids_from_module(connectivity.clone())
}

/// How the learning rates move over training (see the [module docs](self) for the formula).
#[derive(Config, Debug, PartialEq)]
pub enum LrSchedule {
    /// The peak rates throughout.
    Constant,
    /// Linear warmup over `warmup_steps` (0: none), then cosine decay to
    /// `final_fraction · peak` at `total_steps`.
    WarmupCosine {
        /// Steps of linear warmup, `< total_steps`.
        warmup_steps: usize,
        /// Optimiser steps of the whole run.
        total_steps: usize,
        /// The last rate as a fraction of the peak, in `[0, 1]`.
        final_fraction: f64,
    },
}

impl LrSchedule {
    /// Burn's scheduler for peak rate `peak`.
    fn scheduler(&self, name: &'static str, peak: f64) -> Result<LrSchedulerConfig> {
        let Self::WarmupCosine {
            warmup_steps,
            total_steps,
            final_fraction,
        } = *self
        else {
            return Ok(LrSchedulerConfig::Constant(peak));
        };
        // Burn's linear and cosine schedulers take rates in (0, 1].
        check_positive(name, peak)?;
        if peak > 1.0 {
            return Err(Error::OutOfRange {
                name,
                value: peak,
                requirement: "in (0, 1] with a warmup-cosine schedule",
            });
        }
        check_non_negative("final learning-rate fraction", final_fraction)?;
        if final_fraction > 1.0 {
            return Err(Error::OutOfRange {
                name: "final learning-rate fraction",
                value: final_fraction,
                requirement: "in [0, 1]",
            });
        }
        if warmup_steps >= total_steps {
            return Err(Error::OutOfRange {
                name: "warmup steps",
                value: warmup_steps as f64,
                requirement: "fewer than the total steps",
            });
        }
        let cosine = CosineAnnealingLrSchedulerConfig::new(peak, total_steps - warmup_steps)
            .with_min_lr(final_fraction * peak);
        if warmup_steps == 0 {
            return Ok(cosine.into());
        }
        // Step t of the warmup gives peak · t / w: from peak / w at t = 1 to peak at t = w.
        let warmup = LinearLrSchedulerConfig::new(
            peak / warmup_steps as f64,
            peak,
            (warmup_steps - 1).max(1),
        );
        Ok(
            SequentialLrSchedulerConfig::new(
                vec![warmup.into(), cosine.into()],
                vec![warmup_steps],
            )
            .into(),
        )
    }
}

/// AdamW for the model's weights, Adam without weight decay and with its own learning rate for
/// the connectivity group; both under the same schedule and gradient clipping.
#[derive(Config, Debug)]
pub struct GroupedAdamConfig {
    /// Peak learning rate of the weights.
    #[config(default = 1e-3)]
    pub learning_rate: f64,
    /// Decoupled weight decay of the weights.
    #[config(default = 0.01)]
    pub weight_decay: f64,
    /// Peak learning rate of the connectivity parameters (never decayed).
    #[config(default = 1e-2)]
    pub connectivity_learning_rate: f64,
    /// Adam's `β1`, both groups.
    #[config(default = 0.9)]
    pub beta_1: f64,
    /// Adam's `β2`, both groups (the papers' language models: 0.95).
    #[config(default = 0.999)]
    pub beta_2: f64,
    /// Clip each parameter's gradient to this L2 norm (Burn's `GradientClipping::Norm`).
    #[config(default = "None")]
    pub gradient_clip_norm: Option<f64>,
    /// The learning-rate schedule, both groups.
    #[config(default = "LrSchedule::Constant")]
    pub schedule: LrSchedule,
}

impl GroupedAdamConfig {
    /// The papers' language-model recipe over `total_steps`: `β2 = 0.95`, gradient clipping at
    /// norm 1, warmup over the first `warmup_steps`, cosine decay to 10% of the peak.
    pub fn language_model(warmup_steps: usize, total_steps: usize) -> Self {
        Self::new()
            .with_beta_2(0.95)
            .with_gradient_clip_norm(Some(1.0))
            .with_schedule(LrSchedule::WarmupCosine {
                warmup_steps,
                total_steps,
                final_fraction: 0.1,
            })
    }

    /// The optimiser (AdamW for every parameter, overridden by Adam without decay on `group`)
    /// and the learning rates (`learning_rate`, `connectivity_learning_rate` on `group`, both
    /// under `schedule`).
    ///
    /// # Errors
    /// [`Error::NonFinite`] or [`Error::OutOfRange`] naming the setting: a learning rate or
    /// weight decay that is not a finite non-negative number (a scheduled rate must lie in
    /// `(0, 1]`), `β` outside `[0, 1)`, a clip norm that is not finite and positive, warmup not
    /// shorter than the run, a final fraction outside `[0, 1]`.
    pub fn build(&self, group: &ParamGroup) -> Result<(ModuleOptimizer, ModuleLrScheduler)> {
        check_non_negative("learning rate", self.learning_rate)?;
        check_non_negative("weight decay", self.weight_decay)?;
        check_non_negative(
            "connectivity learning rate",
            self.connectivity_learning_rate,
        )?;
        check_probability("Adam beta_1", self.beta_1)?;
        check_probability("Adam beta_2", self.beta_2)?;
        let clipping = match self.gradient_clip_norm {
            Some(norm) => {
                check_positive("gradient clip norm", norm)?;
                Some(GradientClippingConfig::Norm(norm as f32))
            }
            None => None,
        };
        let weights = self
            .schedule
            .scheduler("learning rate", self.learning_rate)?;
        let connectivity = self.schedule.scheduler(
            "connectivity learning rate",
            self.connectivity_learning_rate,
        )?;
        let (beta_1, beta_2) = (self.beta_1 as f32, self.beta_2 as f32);
        let adam = AdamConfig::new()
            .with_beta_1(beta_1)
            .with_beta_2(beta_2)
            .with_grad_clipping(clipping.clone())
            .build();
        let optimizer = AdamWConfig::new()
            .with_beta_1(beta_1)
            .with_beta_2(beta_2)
            .with_weight_decay(self.weight_decay as f32)
            .with_grad_clipping(clipping)
            .init()
            .with_group(group.clone(), adam, None);
        let learning_rates = ModuleLrSchedulerConfig::new(weights)
            .with_group(group.clone(), connectivity)
            .init()
            .map_err(Error::Schedule)?;
        Ok((optimizer, learning_rates))
    }
}

#[cfg(test)]
mod tests {
    use std::f64::consts::PI;

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

    /// The rates of both groups over a whole warmup-cosine run equal the closed form of the
    /// module docs.
    #[test]
    fn warmup_cosine_follows_its_closed_form() {
        let (warmup, total, fraction) = (4, 12, 0.1);
        let config = GroupedAdamConfig::new()
            .with_learning_rate(0.5)
            .with_connectivity_learning_rate(0.02)
            .with_schedule(LrSchedule::WarmupCosine {
                warmup_steps: warmup,
                total_steps: total,
                final_fraction: fraction,
            });
        let device = Device::flex();
        let model = Model {
            weights: Param::from_tensor(Tensor::ones([3], &device)),
            connectivity: HacnConfig::new().init(3, &device).unwrap(),
        };
        let group = connectivity_group(&model.connectivity);
        let (weight_id, gate_id) = (model.weights.id, model.connectivity.gates.id);
        let (_, mut learning_rates) = config.build(&group).unwrap();
        let expected = |peak: f64, t: usize| {
            if t <= warmup {
                peak * t as f64 / warmup as f64
            } else {
                let progress = (t - warmup - 1) as f64 / (total - warmup) as f64;
                peak * (fraction + (1.0 - fraction) * 0.5 * (1.0 + (PI * progress).cos()))
            }
        };
        for t in 1..=total {
            let rates = learning_rates.step();
            let (weights, gates) = (
                rates.lr_from_param(weight_id, None),
                rates.lr_from_param(gate_id, None),
            );
            assert!(
                (weights - expected(0.5, t)).abs() < 1e-12,
                "step {t}: {weights}"
            );
            assert!(
                (gates - expected(0.02, t)).abs() < 1e-12,
                "step {t}: {gates}"
            );
        }
    }

    /// Adam's first step ignores the gradient's scale, its second does not: a gradient of norm
    /// 200 clipped to norm 1 followed by one of norm 1 must move the weights exactly as two
    /// gradients of norm 1, and differently from the unclipped pair.
    #[test]
    fn gradients_are_clipped_to_the_norm() {
        let run = |clip: Option<f64>, slopes: [f32; 2]| -> Vec<f32> {
            let device = Device::flex().autodiff();
            let config = GroupedAdamConfig::new()
                .with_learning_rate(0.1)
                .with_weight_decay(0.0)
                .with_gradient_clip_norm(clip);
            let mut model = Model {
                weights: Param::from_tensor(Tensor::zeros([4], &device)),
                connectivity: HacnConfig::new().init(3, &device).unwrap(),
            };
            let group = connectivity_group(&model.connectivity);
            let (mut optimizer, mut learning_rates) = config.build(&group).unwrap();
            for slope in slopes {
                // Gradient slope · (1, 1, 1, 1): norm 2 · slope.
                let loss = model.weights.val().sum() * slope;
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optimizer.step(learning_rates.step(), model, grads);
            }
            values(&model.weights)
        };
        // Clipped to norm 1, a gradient of norm 200 is the gradient of norm 1 (slope 0.5).
        let clipped = run(Some(1.0), [100.0, 0.5]);
        let small = run(None, [0.5, 0.5]);
        let unclipped = run(None, [100.0, 0.5]);
        for (c, s) in clipped.iter().zip(&small) {
            assert!((c - s).abs() < 1e-6, "{clipped:?} vs {small:?}");
        }
        assert!(
            clipped
                .iter()
                .zip(&unclipped)
                .all(|(c, u)| (c - u).abs() > 1e-3)
        );
    }

    #[test]
    fn bad_recipes_are_errors() {
        let group = ParamGroup::all();
        let schedule = |warmup_steps, total_steps, final_fraction| LrSchedule::WarmupCosine {
            warmup_steps,
            total_steps,
            final_fraction,
        };
        let cases = [
            GroupedAdamConfig::new().with_schedule(schedule(10, 10, 0.1)),
            GroupedAdamConfig::new().with_schedule(schedule(0, 0, 0.1)),
            GroupedAdamConfig::new().with_schedule(schedule(1, 10, 1.5)),
            GroupedAdamConfig::new()
                .with_learning_rate(2.0)
                .with_schedule(schedule(1, 10, 0.1)),
            GroupedAdamConfig::new().with_beta_2(1.0),
            GroupedAdamConfig::new().with_gradient_clip_norm(Some(0.0)),
        ];
        for config in cases {
            assert!(
                matches!(config.build(&group), Err(crate::Error::OutOfRange { .. })),
                "{config:?}"
            );
        }
        let nan_clip = GroupedAdamConfig::new().with_gradient_clip_norm(Some(f64::INFINITY));
        assert!(matches!(
            nan_clip.build(&group),
            Err(crate::Error::NonFinite { .. })
        ));
        // Warmup of one step and no warmup are valid.
        for warmup in [0, 1] {
            assert!(
                GroupedAdamConfig::language_model(warmup, 5)
                    .build(&group)
                    .is_ok()
            );
        }
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
