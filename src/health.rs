//! Connectivity health: serialisable snapshots of what a connectivity has learned, and a
//! recorder that writes them as JSON lines during training (H-ACN paper Fig. 9: gates over
//! training).
//!
//! * H-ACN: the gates `a_j` and `Γ = ‖a‖₂/√L`.
//! * ANCRe: the coefficients `p`, the entropy of every target's column, the mean distances to
//!   the residual and to the uniform topology.
//! * HyperZZW: the energy `mean(K_j²)` of every block's global kernel.
//! * Hyper-connections: per block, the distance of the static width connections from the
//!   identity, and the static depth connections `b_s`.
//! * mHC: per block, the distance of the static residual mixing `SK(b_res)` from the identity and
//!   from doubly stochastic.
//! * DenseFormer: per average, the weight on states other than the latest.
//!
//! The spread between the streams of hyper-connections and mHC depends on the data: it is
//! [`MultiStreamState::stream_spread`](crate::MultiStreamState::stream_spread) of a batch's
//! state.
//! * Every connectivity: the drift `‖θ − θ₀‖₂` of its parameters from a reference (usually their
//!   initial values).
//!
//! ```
//! use burn::prelude::*;
//! use burn_connectivity::health::HealthRecorder;
//! use burn_connectivity::{ConnectivityConfig, HacnConfig};
//!
//! let device = Device::flex();
//! let hacn = HacnConfig::new().init(4, &device)?;
//! let path = std::env::temp_dir().join("health-doc.jsonl");
//! let mut recorder = HealthRecorder::create(&path, 100, &hacn)?;
//! for step in 0..=200 {
//!     // … a training step updating `hacn` …
//!     recorder.record(step, &hacn)?; // writes steps 0, 100 and 200
//! }
//! # std::fs::remove_file(path)?;
//! # Ok::<(), burn_connectivity::Error>(())
//! ```

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::ancre::Ancre;
use crate::denseformer::DenseFormer;
use crate::error::{Error, Result};
use crate::hacn::Hacn;
use crate::hyper_connections::HyperConnections;
use crate::hyperzzw::HyperZzwConnectivity;
use crate::mhc::Mhc;

/// What a connectivity family reports about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "family", rename_all = "snake_case")]
pub enum FamilyHealth {
    /// H-ACN (ResNet, ACN).
    Hacn {
        /// The gates `a_1..a_L`.
        gates: Vec<f64>,
        /// `Γ = ‖a‖₂/√L`: 0 for ACN, 1 for ResNet.
        total_strength: f64,
    },
    /// ANCRe.
    Ancre {
        /// `p[i][j]`, row = source, column = target.
        coefficients: Vec<Vec<f64>>,
        /// Entropy (nats) of every target's coefficients, targets `1..=K`.
        entropy: Vec<f64>,
        /// Mean absolute distance of `p` to the residual topology.
        distance_to_residual: f64,
        /// Mean absolute distance of `p` to the uniform topology.
        distance_to_uniform: f64,
    },
    /// The HyperZZW connectivity.
    HyperZzw {
        /// `mean(K_j²)` of every block's global kernel.
        kernel_energy: Vec<f64>,
    },
    /// Hyper-connections (and frac-connections).
    HyperConnections {
        /// Per block, the largest `|A_s[u][V+t] − δ_ut|`.
        distance_from_identity: Vec<f64>,
        /// Per block, the static depth connections `b_s`.
        static_beta: Vec<Vec<f64>>,
    },
    /// mHC (static part, `H~ = b`).
    Mhc {
        /// Per block, the largest `|SK(b_res)[k][i] − δ_ki|`.
        distance_from_identity: Vec<f64>,
        /// Per block, the largest deviation of a row or column sum of `SK(b_res)` from 1.
        distance_from_doubly_stochastic: Vec<f64>,
    },
    /// DenseFormer DWA.
    DenseFormer {
        /// Per average, `Σ_{t<last} |α_i[t]|` (0: the plain residual).
        weight_on_earlier_states: Vec<f64>,
    },
}

/// A snapshot of a connectivity's health.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthReport {
    /// The family-specific metrics.
    #[serde(flatten)]
    pub family: FamilyHealth,
    /// `‖θ − θ₀‖₂` over every float parameter, against the reference the report was taken
    /// with.
    pub drift: f64,
}

/// Connectivities that report their health.
pub trait Health: Module {
    /// The family-specific metrics (reads parameters back from the device).
    ///
    /// # Errors
    /// Whatever computing the metrics can fail with (a HyperZZW kernel, say).
    fn family_health(&self) -> Result<FamilyHealth>;

    /// The full report, with the drift from `reference` (same architecture).
    ///
    /// # Errors
    /// As [`family_health`](Self::family_health), or [`Error::CountMismatch`] if `reference`
    /// has other parameter sizes.
    fn health(&self, reference: &Self) -> Result<HealthReport>
    where
        Self: Sized,
    {
        Ok(HealthReport {
            family: self.family_health()?,
            drift: drift(self, reference)?,
        })
    }
}

impl Health for Hacn {
    fn family_health(&self) -> Result<FamilyHealth> {
        Ok(FamilyHealth::Hacn {
            gates: self.gate_values(),
            total_strength: self.total_strength(),
        })
    }
}

impl Health for Ancre {
    fn family_health(&self) -> Result<FamilyHealth> {
        Ok(FamilyHealth::Ancre {
            coefficients: self.coefficient_values(),
            entropy: self.entropy(),
            distance_to_residual: self.distance_to_residual(),
            distance_to_uniform: self.distance_to_uniform(),
        })
    }
}

impl Health for HyperZzwConnectivity {
    fn family_health(&self) -> Result<FamilyHealth> {
        let kernel_energy = self
            .fusions
            .iter()
            .map(|fusion| {
                let kernel = fusion.global.kernel_1d()?;
                Ok(kernel.powi_scalar(2).mean().into_scalar::<f64>())
            })
            .collect::<Result<_>>()?;
        Ok(FamilyHealth::HyperZzw { kernel_energy })
    }
}

impl Health for HyperConnections {
    fn family_health(&self) -> Result<FamilyHealth> {
        Ok(FamilyHealth::HyperConnections {
            distance_from_identity: self.residual_distance_from_identity(),
            static_beta: self
                .static_values()
                .into_iter()
                .map(|(_, beta)| beta)
                .collect(),
        })
    }
}

impl Health for Mhc {
    fn family_health(&self) -> Result<FamilyHealth> {
        let health = self.residual_health();
        Ok(FamilyHealth::Mhc {
            distance_from_identity: health.iter().map(|h| h.distance_from_identity).collect(),
            distance_from_doubly_stochastic: health
                .iter()
                .map(|h| h.distance_from_doubly_stochastic)
                .collect(),
        })
    }
}

impl Health for DenseFormer {
    fn family_health(&self) -> Result<FamilyHealth> {
        Ok(FamilyHealth::DenseFormer {
            weight_on_earlier_states: self.weight_on_earlier_states(),
        })
    }
}

/// Every float parameter of `module`, flattened in visiting order.
fn parameter_values(module: &impl Module) -> Vec<f64> {
    struct Collector(Vec<f64>);
    impl ModuleVisitor for Collector {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.extend(param.val().into_data().iter::<f64>());
        }
    }
    let mut collector = Collector(Vec::new());
    module.visit(&mut collector);
    collector.0
}

/// `‖θ − θ₀‖₂` between the float parameters of two modules of one architecture.
fn drift(module: &impl Module, reference: &impl Module) -> Result<f64> {
    let (values, initial) = (parameter_values(module), parameter_values(reference));
    if values.len() != initial.len() {
        return Err(Error::CountMismatch {
            name: "reference parameters",
            expected: values.len(),
            found: initial.len(),
        });
    }
    let squares: f64 = values
        .iter()
        .zip(&initial)
        .map(|(a, b)| (a - b).powi(2))
        .sum();
    Ok(squares.sqrt())
}

/// One line of a health log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthRecord {
    /// The training step.
    pub step: usize,
    /// The report at that step.
    #[serde(flatten)]
    pub report: HealthReport,
}

/// Writes a [`HealthRecord`] as one JSON line every `every` steps, with the drift measured from
/// the connectivity it was created with.
pub struct HealthRecorder<C> {
    writer: Box<dyn Write + Send>,
    every: usize,
    reference: C,
}

impl<C: Health> HealthRecorder<C> {
    /// Writes to a new file at `path`, taking `initial` as the reference for the drift.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] if `every` is 0, [`Error::Io`] if the file cannot be created.
    pub fn create(path: impl AsRef<Path>, every: usize, initial: &C) -> Result<Self> {
        let file = BufWriter::new(File::create(path)?);
        Self::new(Box::new(file), every, initial)
    }

    /// Writes to any writer.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] if `every` is 0.
    pub fn new(writer: Box<dyn Write + Send>, every: usize, initial: &C) -> Result<Self> {
        if every == 0 {
            return Err(Error::OutOfRange {
                name: "health recording interval",
                value: 0.0,
                requirement: ">= 1 step",
            });
        }
        Ok(Self {
            writer,
            every,
            reference: initial.clone(),
        })
    }

    /// Records `connectivity` if `step` is a multiple of the interval; returns whether it did.
    /// Each line is flushed, so the log can be read while training runs.
    ///
    /// # Errors
    /// What [`Health::health`] or writing fails with.
    pub fn record(&mut self, step: usize, connectivity: &C) -> Result<bool> {
        if !step.is_multiple_of(self.every) {
            return Ok(false);
        }
        let record = HealthRecord {
            step,
            report: connectivity.health(&self.reference)?,
        };
        serde_json::to_writer(&mut self.writer, &record)?;
        self.writer.write_all(b"\n")?;
        self.writer.flush()?;
        Ok(true)
    }
}

/// Reads a health log written by [`HealthRecorder`].
///
/// # Errors
/// [`Error::Io`] or [`Error::Json`] for unreadable files or lines.
pub fn read_health_log(path: impl AsRef<Path>) -> Result<Vec<HealthRecord>> {
    std::fs::read_to_string(path)?
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| Ok(serde_json::from_str(line)?))
        .collect()
}

#[cfg(test)]
mod tests {
    use burn::module::Param;

    use super::*;
    use crate::ConnectivityConfig;
    use crate::hacn::{GateInit, HacnConfig};
    use crate::hyperzzw::HyperZzwConnectivityConfig;
    use crate::{AncreConfig, AncreInit};

    fn hacn(values: Vec<f64>) -> Hacn {
        HacnConfig::new()
            .with_init(GateInit::Values { values })
            .init(3, &Device::flex())
            .unwrap()
    }

    #[test]
    fn hacn_reports_gates_strength_and_drift() {
        let initial = hacn(vec![1.0, 1.0, 1.0]);
        let moved = hacn(vec![1.0, 0.0, 1.0]);
        let report = moved.health(&initial).unwrap();
        let FamilyHealth::Hacn {
            gates,
            total_strength,
        } = &report.family
        else {
            panic!("{report:?}");
        };
        assert_eq!(gates, &vec![1.0, 0.0, 1.0]);
        assert!((total_strength - (2.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert_eq!(report.drift, 1.0);
        assert_eq!(initial.health(&initial).unwrap().drift, 0.0);
    }

    #[test]
    fn ancre_reports_its_topology() {
        let device = Device::flex();
        let uniform = AncreConfig::new().init(3, &device).unwrap();
        let report = uniform.health(&uniform).unwrap();
        let FamilyHealth::Ancre {
            entropy,
            distance_to_uniform,
            coefficients,
            ..
        } = report.family
        else {
            panic!("not ANCRe");
        };
        assert!(distance_to_uniform.abs() < 1e-6);
        // Uniform over j sources: entropy ln j.
        for (j, h) in (1..=3).zip(entropy) {
            assert!((h - (j as f64).ln()).abs() < 1e-5, "target {j}: {h}");
        }
        assert!((coefficients[0][2] - 0.5).abs() < 1e-6);
        let residual = AncreConfig::new()
            .with_init(AncreInit::Residual { tolerance: 1e-4 })
            .init(3, &device)
            .unwrap();
        let FamilyHealth::Ancre {
            distance_to_residual,
            ..
        } = residual.family_health().unwrap()
        else {
            panic!("not ANCRe");
        };
        assert!(distance_to_residual < 1e-4);
    }

    #[test]
    fn hyperzzw_reports_one_kernel_energy_per_block() {
        let device = Device::flex();
        let connectivity = HyperZzwConnectivityConfig::new(4, 8)
            .with_hidden(8)
            .init(3, &device)
            .unwrap();
        let FamilyHealth::HyperZzw { kernel_energy } = connectivity.family_health().unwrap() else {
            panic!("not HyperZZW");
        };
        assert_eq!(kernel_energy.len(), 3);
        assert!(kernel_energy.iter().all(|&e| e > 0.0 && e.is_finite()));
    }

    #[test]
    fn multi_stream_and_dense_families_report_their_distance_from_resnet() {
        let device = Device::flex();
        let hc = crate::HyperConnectionsConfig::new(4)
            .init(3, &device)
            .unwrap();
        let FamilyHealth::HyperConnections {
            distance_from_identity,
            static_beta,
        } = hc.family_health().unwrap()
        else {
            panic!("not HC");
        };
        assert_eq!(distance_from_identity, vec![0.0; 3]);
        assert_eq!(static_beta, vec![vec![1.0; 4]; 3]);

        let mhc = crate::MhcConfig::new(4).init(2, &device).unwrap();
        let FamilyHealth::Mhc {
            distance_from_identity,
            distance_from_doubly_stochastic,
        } = mhc.family_health().unwrap()
        else {
            panic!("not mHC");
        };
        // Row softmax of 5 (I − 1) over 4 streams: 1 / (1 + 3 e⁻⁵) on the diagonal.
        let diagonal = 1.0 / (1.0 + 3.0 * (-5.0_f64).exp());
        assert!(
            distance_from_identity
                .iter()
                .all(|d| (d - (1.0 - diagonal)).abs() < 1e-4)
        );
        assert!(distance_from_doubly_stochastic.iter().all(|d| *d < 1e-4));

        let dwa = crate::DenseFormerConfig::new().init(3, &device).unwrap();
        let report = dwa.health(&dwa).unwrap();
        assert_eq!(
            report.family,
            FamilyHealth::DenseFormer {
                weight_on_earlier_states: vec![0.0; 3]
            }
        );
        assert_eq!(report.drift, 0.0);
    }

    #[test]
    fn the_recorder_writes_json_lines_at_its_interval() {
        let path = std::env::temp_dir().join(format!(
            "burn-connectivity-health-{}-{:?}.jsonl",
            std::process::id(),
            std::thread::current().id()
        ));
        let mut connectivity = hacn(vec![0.25, 0.25, 0.25]);
        let mut recorder = HealthRecorder::create(&path, 2, &connectivity).unwrap();
        for step in 0..5 {
            let written = recorder.record(step, &connectivity).unwrap();
            assert_eq!(written, step.is_multiple_of(2));
            connectivity.gates = Param::from_tensor(connectivity.gates.val() + 0.5);
        }
        drop(recorder);
        let records = read_health_log(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            records.iter().map(|r| r.step).collect::<Vec<_>>(),
            [0, 2, 4]
        );
        assert!(
            text.lines()
                .next()
                .unwrap()
                .starts_with("{\"step\":0,\"family\":\"hacn\"")
        );
        let drift = |record: &HealthRecord| record.report.drift;
        assert_eq!(drift(&records[0]), 0.0);
        // Two steps of +0.5 on three gates: ‖(1, 1, 1)‖ = √3.
        assert!((drift(&records[1]) - 3f64.sqrt()).abs() < 1e-6);
        assert!(matches!(
            HealthRecorder::create(&path, 0, &connectivity),
            Err(Error::OutOfRange { .. })
        ));
    }
}
