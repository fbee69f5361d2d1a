//! The results: one entry per paper claim, written as `results.json` and `results.md`.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::stats::{Metric, Verdict};

/// A layer-wise curve over seeds: mean and spread at every depth `k = 0..=L`.
#[derive(Clone, Debug, Serialize)]
pub struct Curve {
    pub name: String,
    pub mean: Vec<f64>,
    pub std: Vec<f64>,
}

impl Curve {
    /// From one curve per seed.
    pub fn new(name: impl Into<String>, per_seed: &[Vec<f64>]) -> Self {
        let depths = per_seed.first().map_or(0, Vec::len);
        let (mean, std) = (0..depths)
            .map(|k| {
                let at_k = Metric::new("", per_seed.iter().map(|curve| curve[k]).collect());
                (at_k.mean, at_k.std)
            })
            .unzip();
        Self {
            name: name.into(),
            mean,
            std,
        }
    }
}

/// One claim of a paper, what was run and what came out.
#[derive(Clone, Debug, Serialize)]
pub struct Claim {
    /// Short key, e.g. `depth_efficiency`.
    pub id: &'static str,
    /// Where the paper makes it.
    pub source: &'static str,
    /// The paper's statement, with its numbers where it gives them.
    pub paper: &'static str,
    /// What ran here.
    pub setup: String,
    pub metrics: Vec<Metric>,
    /// The column labels of the curves (`k=0`, … or `σ=0.1`, …).
    pub curve_header: Vec<String>,
    pub curves: Vec<Curve>,
    pub verdict: Verdict,
    /// What the numbers say, in a sentence.
    pub finding: String,
}

/// Everything a run writes.
#[derive(Debug, Serialize)]
pub struct Results {
    pub commit: String,
    pub command: String,
    pub seeds: Vec<u64>,
    pub quick: bool,
    pub device: String,
    pub seconds: f64,
    pub claims: Vec<Claim>,
}

impl Results {
    /// Writes `results.json` and `results.md` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), String> {
        std::fs::create_dir_all(dir).map_err(|err| format!("{}: {err}", dir.display()))?;
        let json = serde_json::to_string_pretty(self).map_err(|err| err.to_string())?;
        let write = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|err| format!("{}: {err}", path.display()))
        };
        write("results.json", json)?;
        write("results.md", self.markdown())
    }

    /// The report as Markdown: a summary table, then every claim's numbers.
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let _ = writeln!(
            md,
            "# Reproduction results\n\n- commit `{}`\n- command `{}`\n- seeds {:?}{}\n- device {}, \
             {:.1} min in all\n- verdicts: *reproduced* / *contradicted* when the difference the \
             paper states has |Welch t| ≥ 2 over the seeds (with / against the paper), else \
             *inconclusive*\n",
            self.commit,
            self.command,
            self.seeds,
            if self.quick { " (quick run)" } else { "" },
            self.device,
            self.seconds / 60.0
        );
        let _ = writeln!(
            md,
            "| claim | source | verdict | finding |\n|---|---|---|---|"
        );
        for claim in &self.claims {
            let _ = writeln!(
                md,
                "| `{}` | {} | **{}** | {} |",
                claim.id,
                claim.source,
                claim.verdict.label(),
                claim.finding
            );
        }
        for claim in &self.claims {
            let _ = writeln!(
                md,
                "\n## `{}` ({})\n\n**Paper:** {}\n\n**Here:** {}\n\n| metric | mean ± std | per seed |\n|---|---|---|",
                claim.id, claim.source, claim.paper, claim.setup
            );
            for metric in &claim.metrics {
                let seeds: Vec<String> = metric.values.iter().map(|v| format!("{v:.4}")).collect();
                let _ = writeln!(
                    md,
                    "| {} | {} | {} |",
                    metric.name,
                    metric.display(4),
                    seeds.join(", ")
                );
            }
            if !claim.curves.is_empty() {
                let header: String = claim
                    .curve_header
                    .iter()
                    .map(|h| format!(" {h} |"))
                    .collect();
                let rule: String = claim.curve_header.iter().map(|_| "---|").collect();
                let _ = writeln!(
                    md,
                    "\nCurves (mean over seeds):\n\n| model |{header}\n|---|{rule}"
                );
                for curve in &claim.curves {
                    let values: String = curve.mean.iter().map(|v| format!(" {v:.3} |")).collect();
                    let _ = writeln!(md, "| {} |{values}", curve.name);
                }
            }
            let _ = writeln!(
                md,
                "\n**Verdict: {}.** {}",
                claim.verdict.label(),
                claim.finding
            );
        }
        md
    }
}
