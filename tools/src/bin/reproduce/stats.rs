//! Means, spreads and the verdict of a comparison over seeds.

use serde::Serialize;

/// One number measured once per seed.
#[derive(Clone, Debug, Serialize)]
pub struct Metric {
    /// What it is, e.g. `hacn test accuracy`.
    pub name: String,
    /// One value per seed, in seed order.
    pub values: Vec<f64>,
    pub mean: f64,
    /// Sample standard deviation (0 for a single seed).
    pub std: f64,
}

impl Metric {
    pub fn new(name: impl Into<String>, values: Vec<f64>) -> Self {
        let n = values.len() as f64;
        let mean = values.iter().sum::<f64>() / n;
        let std = if values.len() > 1 {
            (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        Self {
            name: name.into(),
            values,
            mean,
            std,
        }
    }

    /// `mean ± std` with `digits` decimals.
    pub fn display(&self, digits: usize) -> String {
        format!("{:.digits$} ± {:.digits$}", self.mean, self.std)
    }
}

/// Whether a paper's statement held here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// The difference has the paper's sign and |Welch t| >= 2.
    Reproduced,
    /// The difference has the opposite sign and |Welch t| >= 2.
    Contradicted,
    /// |Welch t| < 2 (or a single seed): the seeds do not separate the two.
    Inconclusive,
}

impl Verdict {
    pub fn label(self) -> &'static str {
        match self {
            Self::Reproduced => "reproduced",
            Self::Contradicted => "contradicted",
            Self::Inconclusive => "inconclusive",
        }
    }

    /// All of `verdicts` reproduced: reproduced; any contradicted: contradicted; else
    /// inconclusive.
    pub fn all(verdicts: &[Self]) -> Self {
        if verdicts.iter().all(|v| *v == Self::Reproduced) {
            Self::Reproduced
        } else if verdicts.contains(&Self::Contradicted) {
            Self::Contradicted
        } else {
            Self::Inconclusive
        }
    }
}

/// Welch's t of `a − b`.
pub fn welch_t(a: &Metric, b: &Metric) -> f64 {
    let (na, nb) = (a.values.len() as f64, b.values.len() as f64);
    let error = (a.std.powi(2) / na + b.std.powi(2) / nb).sqrt();
    let difference = a.mean - b.mean;
    if error > 0.0 {
        difference / error
    } else if difference == 0.0 {
        0.0
    } else {
        difference.signum() * f64::INFINITY
    }
}

/// The verdict on "`a` is larger than `b`" (`larger = true`) or smaller.
pub fn compare(a: &Metric, b: &Metric, larger: bool) -> Verdict {
    let t = welch_t(a, b);
    let t = if larger { t } else { -t };
    if a.values.len() < 2 || b.values.len() < 2 || t.abs() < 2.0 {
        Verdict::Inconclusive
    } else if t > 0.0 {
        Verdict::Reproduced
    } else {
        Verdict::Contradicted
    }
}
