//! ANCRe (Adaptive Neural Connection Reassignment): learned softmax shortcuts over all earlier
//! block inputs (MATH §2).
//!
//! Every shortcut `i:j` (`0 <= i < j <= K`) has a logit `c_ij`. With the default **ingoing**
//! normalisation (paper eqs. 7–8):
//!
//! ```text
//! p_ij = exp(c_ij/τ) / Σ_{k<j} exp(c_kj/τ)        (softmax over the sources of target j)
//! s_j  = f_j(s_{j-1}) + Σ_{i<j} p_ij s_i
//! ```
//!
//! so every column of `p` sums to 1 and `p_{j-1,j} = 1` is the plain residual. The mixture is
//! over **stream states** (block inputs `s_i`), not branch outputs; the output is `s_K`. Target
//! `j = 1` has the single source `s_0`, so `p_01 = 1` and its logit gets no gradient (the
//! reference code freezes it). **Outgoing** normalisation (paper eq. 6, an ablation) takes the
//! softmax over the targets `j > i` of each source instead.
//!
//! On Flex (f32, f64) and on the CubeCL backends (wgpu, vulkan, metal, cuda) each target's
//! mixture is one fused op over the states so far, with its own backward
//! (`src/backend/history_mix.rs`): one pass per target forward and one backward, a kernel each
//! on a GPU however many sources it reads, and `p` is one masked-softmax kernel each way
//! (`src/backend/masked_softmax.rs`). Elsewhere the mixture is accumulated progressively: as
//! soon as `s_i` exists, `p_ij s_i` is added to the pending sum of every later target `j`; no
//! `[j, batch, …]` history is ever stacked (`BENCHMARKS.md`, "Train steps on CubeCL").
//!
//! In branch outputs, `coef(s_j) = e_j + Σ_{i<j} p_ij coef(s_i)`, so `C[:, j] = coef(s_{j-1})`
//! and `out = coef(s_K)`.
//!
//! **Families** (paper §4.2, "module level"; MATH §4): with `families = F`, block `j` belongs
//! to family `(j − 1) mod F` and mixes only the inputs of its own family's blocks up to itself:
//! sources `i < j` with `(j − 1 − i) mod F = 0`, one softmax per family. In a transformer wired
//! at [`Granularity::Sublayer`](crate::transformer::Granularity) (attention, feed-forward,
//! attention, …) `F = 2` gives the paper's two families,
//!
//! ```text
//! m_j     = MHSA_j(LN(a_j)) + Σ_{i<=j} pA_ij a_i
//! a_{j+1} = FFN_j(LN(m_j))  + Σ_{i<=j} pF_ij m_i
//! ```
//!
//! and `residual_families` keeps some families on the plain residual (`p_{j-1,j} = 1`):
//! [`AncreConfig::module_level`] builds the paper's rows (MHSA-only, FFN-only, both).
//!
//! **Ablations** ([`Mixing`], the paper's Tables 4–5): raw coefficients without normalisation,
//! fixed uniform `1/j` (not trained), and a learnable cascade (only `p_{j-1,j}` kept, learned).

use burn::module::Param;
use burn::prelude::*;

use crate::backend::{History, fused_history};
use crate::backend::{Scales, SoftmaxMask, UsedEntries, masked_softmax};
use crate::connectivity::{Connectivity, ConnectivityConfig, StreamConnectivity, leading_part};
use crate::error::{Error, Result, check_depth, check_finite, check_positive, check_size};
use crate::matrix::ConnectivityMatrix;

/// Which softmax turns the logits into coefficients.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Normalization {
    /// Softmax over the sources `i < j` of each target `j` (the paper's choice, eq. 7).
    Ingoing,
    /// Softmax over the targets `j > i` of each source `i` (the ablation, eq. 6).
    Outgoing,
}

/// How the coefficients `p` come from the parameters (the paper's ablations; MATH §2).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Mixing {
    /// `p = softmax(c / τ)` under the [`Normalization`] (the method).
    Softmax,
    /// No normalisation: the parameters are the coefficients themselves, `p_ij = c_ij`,
    /// starting at the softmax of the initial logits (uniform `1/j` by default).
    Raw,
    /// Fixed uniform coefficients `p_ij = 1/j` over each target's sources, not trained.
    FixedUniform,
    /// Learnable cascade only: the single shortcut `p_{j-1,j}` per target, a raw learnable
    /// coefficient starting at 1 (the plain residual); every other shortcut is cut.
    Cascade,
}

/// How the logits `c_ij` start.
#[derive(Config, Debug, PartialEq)]
pub enum AncreInit {
    /// All logits 0: uniform coefficients `p_ij = 1/j` (the reference code's default).
    Uniform,
    /// The shortcut `j-1:j` of every target gets a logit high enough that every coefficient is
    /// within `tolerance` of the plain residual (`p_{j-1,j} >= 1 - tolerance`).
    Residual {
        /// Largest allowed distance to the residual coefficients, in `(0, 1)`.
        tolerance: f64,
    },
    /// Explicit logits: a `(K+1) x (K+1)` matrix whose entry `[i][j]` is `c_ij` for `i < j`
    /// (other entries are unused).
    Values {
        /// The logit matrix.
        logits: Vec<Vec<f64>>,
    },
}

/// Configuration of [`Ancre`].
#[derive(Config, Debug)]
pub struct AncreConfig {
    /// Softmax temperature τ > 0 (paper default 0.1; its LLM runs used 0.01).
    #[config(default = 0.1)]
    pub temperature: f64,
    /// Ingoing (default) or outgoing normalisation.
    #[config(default = "Normalization::Ingoing")]
    pub normalization: Normalization,
    /// Logit initialisation; default uniform.
    #[config(default = "AncreInit::Uniform")]
    pub init: AncreInit,
    /// How coefficients come from the parameters; default the softmax.
    #[config(default = "Mixing::Softmax")]
    pub mixing: Mixing,
    /// Interleaved families of blocks, each mixing only its own blocks' inputs (module docs).
    #[config(default = 1)]
    pub families: usize,
    /// Families whose blocks keep the plain residual `p_{j-1,j} = 1` (indices `< families`).
    #[config(default = "Vec::new()")]
    pub residual_families: Vec<usize>,
}

/// Which sublayers of a transformer learn their shortcuts at ANCRe's module level (use with
/// [`Granularity::Sublayer`](crate::transformer::Granularity), attention then feed-forward).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum ModuleLevel {
    /// MHSA-only: the attention family learns, the feed-forward keeps its residual (the same
    /// model as block level).
    Attention,
    /// FFN-only: the feed-forward family learns, attention keeps its residual.
    FeedForward,
    /// Both families learn, each with its own softmax.
    Both,
}

impl AncreConfig {
    /// Starts as a plain ResNet, every coefficient within `tolerance` of it.
    pub fn residual(tolerance: f64) -> Self {
        Self::new().with_init(AncreInit::Residual { tolerance })
    }

    /// ANCRe at module level (paper §4.2): two families, attention and feed-forward sublayers,
    /// of which `level` says which learn.
    pub fn module_level(level: ModuleLevel) -> Self {
        let residual_families = match level {
            ModuleLevel::Attention => vec![1],
            ModuleLevel::FeedForward => vec![0],
            ModuleLevel::Both => vec![],
        };
        Self::new()
            .with_families(2)
            .with_residual_families(residual_families)
    }

    fn initial_logits(&self, num_blocks: usize) -> Result<Vec<Vec<f64>>> {
        let size = num_blocks + 1;
        match &self.init {
            AncreInit::Uniform => Ok(vec![vec![0.0; size]; size]),
            AncreInit::Residual { tolerance } => {
                check_finite("ANCRe residual tolerance", *tolerance)?;
                if *tolerance <= 0.0 || *tolerance >= 1.0 {
                    return Err(Error::OutOfRange {
                        name: "ANCRe residual tolerance",
                        value: *tolerance,
                        requirement: "in (0, 1)",
                    });
                }
                // Against at most K-1 competitors at logit 0 (a column of target j has j-1,
                // a row of source i has K-i-1): p >= 1 - tol once exp(c/τ) >= n (1-tol)/tol.
                let competitors = num_blocks.saturating_sub(1).max(1) as f64;
                let logit = self.temperature * (competitors * (1.0 - tolerance) / tolerance).ln();
                let mut logits = vec![vec![0.0; size]; size];
                for j in 1..size {
                    logits[j - 1][j] = logit.max(0.0);
                }
                Ok(logits)
            }
            AncreInit::Values { logits } => {
                let rows = logits.len();
                if rows != size || logits.iter().any(|row| row.len() != size) {
                    let columns = logits.first().map_or(0, Vec::len);
                    return Err(Error::InvalidMatrix(format!(
                        "ANCRe logits must be {size} x {size} for {num_blocks} blocks, got {rows} x {columns}"
                    )));
                }
                for value in logits.iter().flatten() {
                    check_finite("ANCRe logit", *value)?;
                }
                Ok(logits.clone())
            }
        }
    }
}

impl AncreConfig {
    /// The connectivity with these settings and parameters.
    fn connectivity(&self, num_blocks: usize, logits: Tensor<2>) -> Ancre {
        Ancre {
            logits: Param::from_tensor(logits),
            temperature: self.temperature,
            normalization: self.normalization,
            num_blocks,
            mixing: self.mixing,
            families: self.families,
            residual_families: self.residual_families.clone(),
        }
    }
}

impl ConnectivityConfig for AncreConfig {
    type Connectivity = Ancre;

    fn init(&self, num_blocks: usize, device: &Device) -> Result<Ancre> {
        if num_blocks == 0 {
            return Err(Error::NoBlocks);
        }
        check_positive("ANCRe temperature", self.temperature)?;
        check_size("ANCRe families", self.families)?;
        if let Some(&family) = self.residual_families.iter().find(|&&f| f >= self.families) {
            return Err(Error::OutOfRange {
                name: "ANCRe residual family",
                value: family as f64,
                requirement: "< families",
            });
        }
        let size = num_blocks + 1;
        let logits = self.initial_logits(num_blocks)?;
        let parameters: Vec<f64> = match self.mixing {
            Mixing::Softmax | Mixing::FixedUniform => logits.concat(),
            // The raw coefficients start where the softmax of the initial logits is.
            Mixing::Raw => {
                let logits =
                    Tensor::from_data(TensorData::new(logits.concat(), [size, size]), device);
                let softmax = Ancre {
                    mixing: Mixing::Softmax,
                    ..self.connectivity(num_blocks, logits)
                };
                softmax.coefficients().into_data().iter::<f64>().collect()
            }
            Mixing::Cascade => (0..size * size)
                .map(|k| f64::from(k / size + 1 == k % size))
                .collect(),
        };
        let tensor = Tensor::<2>::from_data(TensorData::new(parameters, [size, size]), device);
        Ok(self.connectivity(num_blocks, tensor))
    }
}

/// Learned softmax shortcuts over all earlier block inputs (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct Ancre {
    /// The logits `c_ij`, `[K'+1, K'+1]` with `K' >= K` (entries `i < j` are used); the raw
    /// coefficients themselves under [`Mixing::Raw`] and [`Mixing::Cascade`].
    pub logits: Param<Tensor<2>>,
    /// The softmax temperature τ.
    pub temperature: f64,
    /// Ingoing or outgoing normalisation.
    #[module(skip)]
    pub normalization: Normalization,
    /// Number of blocks `K` wired. Smaller than the logit matrix only for a truncated outgoing
    /// ANCRe, whose coefficients depend on every target of a source.
    pub num_blocks: usize,
    /// How coefficients come from the parameters.
    #[module(skip)]
    pub mixing: Mixing,
    /// Interleaved families of blocks.
    pub families: usize,
    /// Families kept on the plain residual.
    pub residual_families: Vec<usize>,
}

/// The running state of [`Ancre`].
#[derive(Debug, Clone)]
pub struct AncreState<const D: usize> {
    /// The stream `s_j`, input of the next block.
    pub stream: Tensor<D>,
    mixtures: Mixtures<D>,
}

/// How the mixtures are formed.
#[derive(Debug, Clone)]
enum Mixtures<const D: usize> {
    /// From tensor ops, accumulated progressively.
    Pending {
        /// `Σ_{i<=j} p_it s_i` for the targets `t = j+1..=K`, in order (`None` while no source
        /// of the target has been seen).
        pending: Vec<Option<Tensor<D>>>,
        /// The coefficients `p` (row = source, column = target), computed once per forward pass.
        coefficients: Scales,
    },
    /// One fused op per target over the states so far (Flex, `src/backend/history_mix.rs`).
    Fused {
        /// The states `s_0..s_j`, state `i` at index `i`.
        history: History,
        /// The differentiable coefficients `p` over every row and column of the logits
        /// (`[S, S]`) flattened row by row, computed once per forward pass: `p_it` at `i S + t`.
        coefficients: Tensor<1>,
    },
}

impl Ancre {
    /// The coefficients `p` as a differentiable `[K+1, K+1]` tensor (row = source `i`,
    /// column = target `j`; zero where `i >= j`).
    pub fn coefficients(&self) -> Tensor<2> {
        let kept = self.num_blocks + 1;
        self.all_coefficients()
            .narrow(0, 0, kept)
            .narrow(1, 0, kept)
    }

    /// The coefficients over every row and column of the logits (`[S, S]`, `S >= K + 1` where
    /// the connectivity was truncated): [`coefficients`](Self::coefficients) without the narrow,
    /// whose copy and backward (a zero fill and a slice-assign per axis) the fused mixtures
    /// have no use for.
    fn all_coefficients(&self) -> Tensor<2> {
        let size = self.logits.dims()[0];
        let device = self.logits.device();
        let shortcut: Vec<bool> = (0..size * size)
            .map(|k| self.shortcut(k / size, k % size))
            .collect();
        // Residual families' own shortcuts are 1 whatever the normalisation.
        let residual: Vec<bool> = (0..size * size)
            .map(|k| k / size + 1 == k % size && self.residual_target(k % size))
            .collect();
        if matches!(self.mixing, Mixing::Raw | Mixing::Cascade) {
            let bools = |values: Vec<bool>| {
                Tensor::<2, Bool>::from_data(TensorData::new(values, [size, size]), &device)
            };
            let no_shortcut = bools(shortcut.iter().map(|&kept| !kept).collect());
            return (self.logits.val())
                .mask_fill(no_shortcut, 0.0)
                .mask_fill(bools(residual), 1.0);
        }
        let logits = match self.mixing {
            // Zero logits give 1/j; detached, so nothing trains them.
            Mixing::FixedUniform => self.logits.val().zeros_like().detach(),
            _ => self.logits.val(),
        };
        let axis = match self.normalization {
            Normalization::Ingoing => 0,
            Normalization::Outgoing => 1,
        };
        let mask = SoftmaxMask {
            shape: [size, size],
            kept: shortcut,
            ones: residual,
        };
        masked_softmax(logits, &mask, axis, self.temperature)
    }

    /// Whether target `j` mixes source `i` (see the [module docs](self)): `i < j`, same family,
    /// and only `i = j − 1` for a residual target or under [`Mixing::Cascade`].
    pub fn shortcut(&self, source: usize, target: usize) -> bool {
        if source >= target || !(target - 1 - source).is_multiple_of(self.families) {
            return false;
        }
        let single = self.mixing == Mixing::Cascade || self.residual_target(target);
        !single || source + 1 == target
    }

    /// Whether target `j >= 1` belongs to a family kept on the plain residual.
    fn residual_target(&self, target: usize) -> bool {
        self.residual_families
            .contains(&((target - 1) % self.families))
    }

    /// Whether a gradient reaches the coefficients.
    fn trained(&self) -> bool {
        self.mixing != Mixing::FixedUniform && self.logits.val().is_require_grad()
    }

    /// The coefficients `p` read back to the host, `p[i][j]`.
    pub fn coefficient_values(&self) -> Vec<Vec<f64>> {
        let size = self.num_blocks + 1;
        let values: Vec<f64> = self.coefficients().into_data().iter::<f64>().collect();
        values.chunks(size).map(<[f64]>::to_vec).collect()
    }

    /// Per target `j = 1..=K`, the coefficients over its sources as a distribution (the column
    /// itself for ingoing normalisation, the normalised column for outgoing).
    fn source_distributions(&self) -> Vec<Vec<f64>> {
        let p = self.coefficient_values();
        (1..=self.num_blocks)
            .map(|j| {
                let column: Vec<f64> = (0..j).map(|i| p[i][j]).collect();
                let total: f64 = column.iter().sum();
                column.iter().map(|value| value / total).collect()
            })
            .collect()
    }

    /// Shannon entropy (nats) of each target's source distribution, targets `1..=K`: 0 for a
    /// single shortcut, `ln j` for uniform.
    pub fn entropy(&self) -> Vec<f64> {
        let entropy = |q: &Vec<f64>| -> f64 {
            -q.iter()
                .filter(|&&v| v > 0.0)
                .map(|v| v * v.ln())
                .sum::<f64>()
        };
        self.source_distributions().iter().map(entropy).collect()
    }

    /// Mean over targets of the total-variation distance `½ Σ_i |q_ij - r_ij|` between each
    /// target's source distribution and the plain residual's (`r_ij = [i = j-1]`). In `[0, 1]`.
    pub fn distance_to_residual(&self) -> f64 {
        self.mean_distance(|i, j| if i + 1 == j { 1.0 } else { 0.0 })
    }

    /// As [`Ancre::distance_to_residual`], to uniform coefficients `1/j`.
    pub fn distance_to_uniform(&self) -> f64 {
        self.mean_distance(|_, j| 1.0 / j as f64)
    }

    fn mean_distance(&self, reference: impl Fn(usize, usize) -> f64) -> f64 {
        let distributions = self.source_distributions();
        let total: f64 = distributions
            .iter()
            .enumerate()
            .map(|(index, q)| {
                let j = index + 1;
                0.5 * q
                    .iter()
                    .enumerate()
                    .map(|(i, v)| (v - reference(i, j)).abs())
                    .sum::<f64>()
            })
            .sum();
        total / distributions.len() as f64
    }

    /// Tsallis entropy `S_q(p) = (1 - Σ p^q) / (q - 1)` summed over every normalised
    /// distribution (columns for ingoing, rows for outgoing normalisation; paper §4.1).
    /// Add `λ · S_q` to the loss to push the connectivity towards few shortcuts; `q = 2` is the
    /// usual choice. Differentiable.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] unless `q > 0`, `q != 1` and finite.
    pub fn tsallis_entropy(&self, q: f64) -> Result<Tensor<1>> {
        check_positive("Tsallis q", q)?;
        if q == 1.0 {
            return Err(Error::OutOfRange {
                name: "Tsallis q",
                value: q,
                requirement: "!= 1 (use entropy() for Shannon)",
            });
        }
        let k = self.num_blocks;
        let powers = self.coefficients().powf_scalar(q);
        let sums = match self.normalization {
            Normalization::Ingoing => powers.sum_dim(0).narrow(1, 1, k),
            Normalization::Outgoing => powers.sum_dim(1).narrow(0, 0, k).transpose(),
        };
        Ok(sums.neg().add_scalar(1.0).div_scalar(q - 1.0).sum())
    }
}

impl Connectivity for Ancre {
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// From the recursion `coef(s_j) = e_j + Σ_{i<j} p_ij coef(s_i)`.
    fn matrix(&self) -> ConnectivityMatrix {
        ConnectivityMatrix::from_stream_mixture(&self.coefficient_values())
            .expect("p is (K+1) x (K+1) by construction")
    }

    fn truncated(&self, depth: usize) -> Result<Self> {
        check_depth(depth, 1, self.num_blocks)?;
        let logits = match self.normalization {
            // Column j only depends on the logits of target j: keep the first depth targets.
            Normalization::Ingoing => leading_part(&self.logits, depth + 1),
            // Row i is normalised over every target: keep them all so p does not change.
            Normalization::Outgoing => self.logits.clone(),
        };
        Ok(Self {
            logits,
            num_blocks: depth,
            ..self.clone()
        })
    }
}

impl<const D: usize> StreamConnectivity<D> for Ancre {
    type State = AncreState<D>;

    fn start(&self, input: Tensor<D>) -> AncreState<D> {
        // One mix per target.
        let size = self.logits.dims()[0];
        if let Some(history) = fused_history(&input, self.num_blocks, &[size * size]) {
            let coefficients = self.all_coefficients();
            let count = coefficients.shape().num_elements();
            let mixtures = Mixtures::Fused {
                history,
                coefficients: coefficients.reshape([count]),
            };
            return AncreState {
                stream: input,
                mixtures,
            };
        }
        let coefficients = Scales::new(
            self.coefficients(),
            UsedEntries::AboveDiagonal,
            self.trained(),
        );
        let pending = (1..=self.num_blocks)
            .map(|target| {
                self.shortcut(0, target)
                    .then(|| coefficients.scale(0, target, input.clone()))
            })
            .collect();
        AncreState {
            stream: input,
            mixtures: Mixtures::Pending {
                pending,
                coefficients,
            },
        }
    }

    fn block_input(&self, state: &AncreState<D>) -> Tensor<D> {
        state.stream.clone()
    }

    fn step_with_tail(
        &self,
        state: AncreState<D>,
        block: usize,
        branch: Tensor<D>,
        tail: impl FnOnce(Tensor<D>) -> Tensor<D>,
    ) -> AncreState<D> {
        let target = block + 1;
        let AncreState { stream, mixtures } = state;
        let (stream, mixtures) = match mixtures {
            Mixtures::Fused {
                history,
                coefficients,
            } => {
                // The newest state, s_{target-1}, is a source of every target.
                let size = self.logits.dims()[0];
                let terms = (0..target - 1)
                    .filter(|&source| self.shortcut(source, target))
                    .map(|source| (source, source * size + target))
                    .collect();
                let newest = (target - 1) * size + target;
                let mixture = history.mix(terms, newest, 0, coefficients.clone(), stream);
                for source in 0..target {
                    let last_target =
                        (target + 1..=self.num_blocks).all(|later| !self.shortcut(source, later));
                    if last_target {
                        history.forget(source);
                    }
                }
                let mixtures = Mixtures::Fused {
                    history,
                    coefficients,
                };
                (tail(branch + mixture), mixtures)
            }
            Mixtures::Pending {
                pending,
                coefficients,
            } => {
                let mut pending = pending.into_iter();
                let mixture = pending
                    .next()
                    .flatten()
                    .expect("every target mixes at least its own input");
                let stream = tail(branch + mixture);
                let pending = pending
                    .enumerate()
                    .map(|(offset, sum)| {
                        let later = target + 1 + offset;
                        if !self.shortcut(target, later) {
                            return sum;
                        }
                        let term = coefficients.scale(target, later, stream.clone());
                        Some(match sum {
                            Some(sum) => sum + term,
                            None => term,
                        })
                    })
                    .collect();
                let mixtures = Mixtures::Pending {
                    pending,
                    coefficients,
                };
                (stream, mixtures)
            }
        };
        AncreState { stream, mixtures }
    }

    fn output(&self, state: &AncreState<D>) -> Tensor<D> {
        state.stream.clone()
    }
}

#[cfg(test)]
mod tests {
    use burn::module::Param;
    use burn::tensor::Tolerance;

    use super::*;
    use crate::block::Block;
    use crate::connectivity::probe_matrix;
    use crate::stack::Stack;
    use crate::test_util::{TanhBlock, assert_close, blocks, gradient, input, residual_loop};

    fn random_logits(num_blocks: usize) -> AncreInit {
        let size = num_blocks + 1;
        let logits = (0..size)
            .map(|i| {
                (0..size)
                    .map(|j| ((3 * i + 7 * j) % 5) as f64 * 0.1 - 0.2)
                    .collect()
            })
            .collect();
        AncreInit::Values { logits }
    }

    fn random_stack(normalization: Normalization, device: &Device) -> Stack<TanhBlock, Ancre> {
        let config = AncreConfig::new()
            .with_init(random_logits(5))
            .with_normalization(normalization);
        Stack::new(blocks(5, device), &config, device).unwrap()
    }

    fn ancre(config: &AncreConfig, num_blocks: usize) -> Ancre {
        config.init(num_blocks, &Device::flex()).unwrap()
    }

    /// `s_j = h_j + Σ_{i<j} p_ij s_i` with the whole history kept, `p` from the host.
    fn history_loop(stack: &Stack<TanhBlock, Ancre>, x: Tensor<3>) -> Tensor<3> {
        let p = stack.connectivity.coefficient_values();
        let mut states = vec![x];
        for (index, block) in stack.blocks.iter().enumerate() {
            let j = index + 1;
            let mut next = block.branch(states[index].clone(), &());
            for (i, state) in states.iter().enumerate() {
                next = next + state.clone().mul_scalar(p[i][j]);
            }
            states.push(next);
        }
        states.pop().unwrap()
    }

    #[test]
    fn ingoing_columns_and_outgoing_rows_sum_to_one() {
        for normalization in [Normalization::Ingoing, Normalization::Outgoing] {
            let config = AncreConfig::new()
                .with_init(random_logits(5))
                .with_normalization(normalization);
            let p = ancre(&config, 5).coefficient_values();
            for (k, row) in p.iter().enumerate() {
                let column: f64 = p.iter().map(|source| source[k]).sum();
                let row_sum: f64 = row.iter().sum();
                match normalization {
                    Normalization::Ingoing if k >= 1 => {
                        assert!((column - 1.0).abs() < 1e-6, "column {k}: {column}")
                    }
                    Normalization::Outgoing if k < 5 => {
                        assert!((row_sum - 1.0).abs() < 1e-6, "row {k}: {row_sum}")
                    }
                    _ => {}
                }
                assert!(
                    row[..=k].iter().all(|&value| value == 0.0),
                    "no shortcut from {k} to an earlier block"
                );
            }
        }
    }

    #[test]
    fn uniform_init_gives_one_over_j() {
        let p = ancre(&AncreConfig::new(), 4).coefficient_values();
        for (i, row) in p.iter().enumerate() {
            for (j, value) in row.iter().enumerate() {
                let expected = if i < j { 1.0 / j as f64 } else { 0.0 };
                assert!((value - expected).abs() < 1e-6, "p[{i}][{j}] = {value}");
            }
        }
    }

    #[test]
    fn forward_is_the_mixture_over_earlier_states() {
        let device = Device::flex();
        for normalization in [Normalization::Ingoing, Normalization::Outgoing] {
            let stack = random_stack(normalization, &device);
            let x = input(&device);
            assert_close(stack.forward(x.clone()), history_loop(&stack, x));
        }
    }

    #[test]
    fn exact_residual_coefficients_are_the_plain_residual_loop() {
        let device = Device::flex();
        let size = 6;
        let logits = (0..size)
            .map(|i| {
                (0..size)
                    .map(|j| if i + 1 == j { 100.0 } else { 0.0 })
                    .collect()
            })
            .collect();
        let config = AncreConfig::new().with_init(AncreInit::Values { logits });
        let stack = Stack::new(blocks(5, &device), &config, &device).unwrap();
        let x = input(&device);
        assert_close(stack.forward(x.clone()), residual_loop(&stack.blocks, x));
    }

    #[test]
    fn residual_preset_is_residual_within_its_tolerance() {
        let device = Device::flex();
        for normalization in [Normalization::Ingoing, Normalization::Outgoing] {
            let config = AncreConfig::residual(1e-4).with_normalization(normalization);
            let stack = Stack::new(blocks(6, &device), &config, &device).unwrap();
            let p = stack.connectivity.coefficient_values();
            for j in 1..=6 {
                assert!(
                    p[j - 1][j] >= 1.0 - 1e-4 - 1e-6,
                    "p[{}][{j}] = {}",
                    j - 1,
                    p[j - 1][j]
                );
            }
            assert!(stack.connectivity.distance_to_residual() <= 1e-4 + 1e-6);
            let x = input(&device);
            let stream = residual_loop(&stack.blocks, x.clone());
            stack
                .forward(x)
                .into_data()
                .assert_approx_eq::<f32>(&stream.into_data(), Tolerance::absolute(1e-2));
        }
    }

    #[test]
    fn matrix_recursion_equals_probing_the_forward_pass() {
        for normalization in [Normalization::Ingoing, Normalization::Outgoing] {
            let config = AncreConfig::new()
                .with_init(random_logits(6))
                .with_normalization(normalization);
            let ancre = ancre(&config, 6);
            let closed = ancre.matrix();
            let probed = probe_matrix(&ancre, &Device::flex()).unwrap();
            assert!(
                closed.max_abs_diff(&probed) < 1e-5,
                "{closed:?}\n{probed:?}"
            );
            assert!(closed.matrix.iter().all(|row| row[0] == 0.0));
            assert_eq!(closed.matrix[0][1], 1.0);
        }
    }

    #[test]
    fn truncation_reproduces_the_readout_for_both_normalisations() {
        let device = Device::flex();
        for normalization in [Normalization::Ingoing, Normalization::Outgoing] {
            let stack = random_stack(normalization, &device);
            let x = input(&device);
            let readout = stack.readout(x.clone());
            assert_close(readout[5].clone(), stack.forward(x.clone()));
            for (depth, expected) in readout.iter().enumerate().skip(1) {
                let truncated = stack.truncated(depth).unwrap();
                assert_close(truncated.forward(x.clone()), expected.clone());
                assert_eq!(truncated.matrix().num_blocks(), depth);
            }
            assert!(matches!(
                stack.truncated(6),
                Err(Error::DepthOutOfRange { .. })
            ));
        }
    }

    #[test]
    fn the_single_source_logit_gets_no_gradient() {
        let device = Device::flex().autodiff();
        let config = AncreConfig::new().with_init(random_logits(4));
        let stack = Stack::new(blocks(4, &device), &config, &device).unwrap();
        let grads = stack.forward(input(&device)).sum().backward();
        let grad = gradient(&stack.connectivity.logits, &grads);
        assert_eq!(grad[1], 0.0, "c_01 under ingoing normalisation");
        assert!(grad[2] != 0.0 && grad[5 + 2] != 0.0, "c_02 and c_12 train");
    }

    #[test]
    fn entropy_and_distances_of_the_presets() {
        let uniform = ancre(&AncreConfig::new(), 4);
        let entropy = uniform.entropy();
        for (index, value) in entropy.iter().enumerate() {
            assert!((value - ((index + 1) as f64).ln()).abs() < 1e-6);
        }
        assert!(uniform.distance_to_uniform() < 1e-6);
        // Target j has distance 1 - 1/j from the residual: mean over j = 1..4.
        let expected = (0.0 + 0.5 + 2.0 / 3.0 + 0.75) / 4.0;
        assert!((uniform.distance_to_residual() - expected).abs() < 1e-6);

        let residual = ancre(&AncreConfig::residual(1e-5), 4);
        assert!(residual.entropy().iter().all(|value| *value < 1e-3));
        assert!(residual.distance_to_uniform() > 0.4);
    }

    #[test]
    fn tsallis_entropy_of_the_presets() {
        let uniform = ancre(&AncreConfig::new(), 4);
        // q = 2: Σ_j (1 - Σ_i (1/j)^2) = Σ_j (1 - 1/j).
        let expected: f64 = (1..=4).map(|j| 1.0 - 1.0 / j as f64).sum();
        let value = uniform.tsallis_entropy(2.0).unwrap().into_scalar::<f64>();
        assert!((value - expected).abs() < 1e-5, "{value} vs {expected}");
        let residual = ancre(&AncreConfig::residual(1e-5), 4);
        assert!(residual.tsallis_entropy(2.0).unwrap().into_scalar::<f64>() < 1e-3);
        let outgoing = ancre(
            &AncreConfig::new().with_normalization(Normalization::Outgoing),
            4,
        );
        // Row i is uniform over its K - i targets.
        let expected: f64 = (0..4).map(|i| 1.0 - 1.0 / (4 - i) as f64).sum();
        let value = outgoing.tsallis_entropy(2.0).unwrap().into_scalar::<f64>();
        assert!((value - expected).abs() < 1e-5, "{value} vs {expected}");
        for q in [1.0, 0.0, -1.0, f64::NAN] {
            assert!(uniform.tsallis_entropy(q).is_err(), "q = {q}");
        }
    }

    /// Two families: target `j` mixes only `s_i` with `i ≡ j − 1 (mod 2)`, each column a
    /// distribution over those sources; residual families have `p_{j-1,j} = 1`; the forward pass
    /// is the history mixture with these coefficients, and the matrix its probe.
    #[test]
    fn families_mix_only_their_own_inputs() {
        let device = Device::flex();
        let blocks_count = 6;
        for residual_families in [vec![], vec![0], vec![1]] {
            let config = AncreConfig::new()
                .with_init(random_logits(blocks_count))
                .with_families(2)
                .with_residual_families(residual_families.clone());
            let stack = Stack::new(blocks(blocks_count, &device), &config, &device).unwrap();
            let p = stack.connectivity.coefficient_values();
            for j in 1..=blocks_count {
                let family = (j - 1) % 2;
                let residual = residual_families.contains(&family);
                let mut total = 0.0;
                for (i, row) in p.iter().enumerate() {
                    let own = i < j && (j - 1 - i) % 2 == 0 && (!residual || i + 1 == j);
                    if own {
                        assert!(row[j] > 0.0, "p[{i}][{j}] = {}", row[j]);
                    } else {
                        assert_eq!(row[j], 0.0, "p[{i}][{j}] outside the family");
                    }
                    total += row[j];
                }
                assert!((total - 1.0).abs() < 1e-6, "column {j}: {total}");
                if residual {
                    assert_eq!(p[j - 1][j], 1.0);
                }
            }
            let x = input(&device);
            assert_close(stack.forward(x.clone()), history_loop(&stack, x));
            let connectivity = &stack.connectivity;
            let probed = probe_matrix(connectivity, &device).unwrap();
            assert!(connectivity.matrix().max_abs_diff(&probed) < 1e-5);
        }
        // Outgoing normalisation keeps residual families residual too.
        let outgoing = AncreConfig::module_level(ModuleLevel::FeedForward)
            .with_normalization(Normalization::Outgoing);
        let p = ancre(&outgoing, 6).coefficient_values();
        for j in [1, 3, 5] {
            assert_eq!(p[j - 1][j], 1.0);
        }
    }

    /// Raw: the parameters are the coefficients (no normalisation), starting at `1/j`; fixed
    /// uniform: `1/j` and no gradient; cascade: only `p_{j-1,j}`, starting as the plain residual.
    #[test]
    fn ablations_follow_their_definitions() {
        let device = Device::flex().autodiff();
        let count = 4;
        let raw = AncreConfig::new().with_mixing(Mixing::Raw);
        let mut model = Stack::new(blocks(count, &device), &raw, &device).unwrap();
        let p = model.connectivity.coefficient_values();
        for (i, row) in p.iter().enumerate() {
            for (j, value) in row.iter().enumerate() {
                let expected = if i < j { 1.0 / j as f64 } else { 0.0 };
                assert!((value - expected).abs() < 1e-6, "p[{i}][{j}] = {value}");
            }
        }
        let values: Vec<f64> = (0..25).map(|k| 0.1 * k as f64 - 0.7).collect();
        model.connectivity.logits = Param::from_tensor(
            Tensor::<1>::from_data(TensorData::new(values.clone(), [25]), &device).reshape([5, 5]),
        );
        let p = model.connectivity.coefficient_values();
        for (i, row) in p.iter().enumerate() {
            for (j, value) in row.iter().enumerate() {
                let expected = if i < j { values[5 * i + j] } else { 0.0 };
                assert!((value - expected).abs() < 1e-6, "raw p[{i}][{j}] = {value}");
            }
        }
        let x = input(&device);
        assert_close(model.forward(x.clone()), history_loop(&model, x.clone()));
        let grads = model.forward(x.clone()).sum().backward();
        let grad = gradient(&model.connectivity.logits, &grads);
        assert!(grad[1] != 0.0, "without a softmax, p_01 trains");

        let fixed = AncreConfig::new()
            .with_mixing(Mixing::FixedUniform)
            .with_init(random_logits(count));
        let model = Stack::new(blocks(count, &device), &fixed, &device).unwrap();
        let p = model.connectivity.coefficient_values();
        for j in 1..=count {
            for row in p.iter().take(j) {
                assert!((row[j] - 1.0 / j as f64).abs() < 1e-6);
            }
        }
        let grads = model.forward(x.clone()).sum().backward();
        assert!(model.connectivity.logits.val().grad(&grads).is_none());

        let cascade = AncreConfig::new().with_mixing(Mixing::Cascade);
        let model = Stack::new(blocks(count, &device), &cascade, &device).unwrap();
        assert_close(
            model.forward(x.clone()),
            residual_loop(&model.blocks, x.clone()),
        );
        let p = model.connectivity.coefficient_values();
        for (i, row) in p.iter().enumerate() {
            for (j, value) in row.iter().enumerate() {
                assert_eq!(*value, f64::from(i + 1 == j), "cascade p[{i}][{j}]");
            }
        }
        let grads = model.forward(x).sum().backward();
        let grad = gradient(&model.connectivity.logits, &grads);
        for (k, &g) in grad.iter().enumerate() {
            let (i, j) = (k / 5, k % 5);
            if i + 1 == j {
                assert!(g != 0.0, "cascade gate {j} trains");
            } else {
                assert_eq!(g, 0.0, "cut shortcut {i}:{j}");
            }
        }
    }

    #[test]
    fn invalid_configs_are_errors() {
        let device = Device::flex();
        let init = |config: AncreConfig| config.init(3, &device).map(|_| ());
        assert!(matches!(
            AncreConfig::new().init(0, &device),
            Err(Error::NoBlocks)
        ));
        assert!(matches!(
            init(AncreConfig::new().with_temperature(0.0)),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            init(AncreConfig::new().with_temperature(-1.0)),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            init(AncreConfig::new().with_temperature(f64::NAN)),
            Err(Error::NonFinite { .. })
        ));
        assert!(matches!(
            init(AncreConfig::residual(0.0)),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            init(AncreConfig::residual(1.0)),
            Err(Error::OutOfRange { .. })
        ));
        let wrong_shape = AncreInit::Values {
            logits: vec![vec![0.0; 4]; 3],
        };
        assert!(matches!(
            init(AncreConfig::new().with_init(wrong_shape)),
            Err(Error::InvalidMatrix(_))
        ));
        let not_finite = AncreInit::Values {
            logits: vec![vec![f64::INFINITY; 4]; 4],
        };
        assert!(matches!(
            init(AncreConfig::new().with_init(not_finite)),
            Err(Error::NonFinite { .. })
        ));
        assert!(matches!(
            init(AncreConfig::new().with_families(0)),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            init(AncreConfig::new().with_residual_families(vec![1])),
            Err(Error::OutOfRange { .. })
        ));
    }

    /// Whole ANCRe and DWA stacks (every mix through the fused history op on Flex) give the
    /// same gradients under Burn's gradient checkpointing as without it.
    #[test]
    fn gradient_checkpointing_gives_the_same_gradients() {
        use crate::DenseFormerConfig;
        use crate::test_util::{OnDevice, assert_checkpointing_keeps_gradients, input_gradient};

        let flex = Device::flex();
        let x = input(&flex);
        let ancre = Stack::new(blocks(5, &flex), &AncreConfig::new(), &flex).unwrap();
        let dwa = DenseFormerConfig::new().with_dilation(2);
        let dwa = Stack::new(blocks(5, &flex), &dwa, &flex).unwrap();
        assert_checkpointing_keeps_gradients(|device| {
            let x = Tensor::<3>::from_data(x.to_data(), device).require_grad();
            let ancre = ancre.clone().map(&mut OnDevice(device.clone()));
            let dwa = dwa.clone().map(&mut OnDevice(device.clone()));
            let loss =
                ancre.forward(x.clone()).powi_scalar(2).sum() + dwa.forward(x.clone()).tanh().sum();
            let grads = loss.backward();
            let mut all = vec![input_gradient(&x, &grads)];
            all.push(gradient(&ancre.connectivity.logits, &grads));
            all.extend(dwa.connectivity.alphas.iter().map(|a| gradient(a, &grads)));
            let blocks = ancre.blocks.iter().chain(&dwa.blocks);
            all.extend(blocks.map(|block| gradient(&block.linear.weight, &grads)));
            all
        });
    }
}
