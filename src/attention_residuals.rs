//! Attention Residuals (AttnRes; Kimi Team 2026, "Attention Residuals", arXiv 2603.15031;
//! MATH §5.4).
//!
//! Every block reads a softmax mixture of earlier *sources* instead of the running sum. With
//! `v_0 = x` and `v_j = f_j(h_j)` the branch outputs, RMS-normalised keys without a weight and
//! one learned pseudo-query `w_l ∈ R^d` per block (zero at init, so every mixture starts as the
//! mean of its sources):
//!
//! ```text
//! k_i = v_i / sqrt(mean(v_i²) + ε)
//! h_l = Σ_{i<l} softmax_i(w_l · k_i) v_i            (full AttnRes; h_1 = x)
//! y   = Σ_i softmax_i(w_out · k_i) v_i              (output `Attend`: its own pseudo-query)
//! y   = Σ_i v_i                                     (output `Sum`, as `attn-res` 0.1.0 does)
//! ```
//!
//! **Block AttnRes** (block size `k`): blocks `(n−1)k+1 … nk` make group `n`; the sources are the
//! sums of the completed groups, `b_0 = x`, `b_n = Σ_{j ∈ group n} v_j`, and the partial sum of
//! the current group when it is not empty. Before block `l`, with `n = ⌊(l−1)/k⌋` groups done:
//!
//! ```text
//! sources_l = [b_0, …, b_n] + [p_l]     p_l = Σ_{j = nk+1}^{l−1} v_j   (left out when empty)
//! h_l       = Σ_{s ∈ sources_l} softmax_s(w_l · key(s)) s
//! ```
//!
//! and the output attends over (or sums) the sources after block `L`. With `k = 1` every source
//! is one branch output: full AttnRes. With every `w = 0` and output `Sum`, block `l` reads the
//! mean of its sources and the output is the residual stream `x + Σ f_j`.
//!
//! The mixtures depend on the input, so [`matrix`](Connectivity::matrix) reports the mixtures
//! of zero queries (uniform weights over each block's sources), which is the model at init.
//!
//! Where the paper leaves it open: the final output. `attn-res` 0.1.0 sums the sources (its
//! comment: "or could add another AttnRes"); the paper treats the output like one more layer,
//! so `Attend` (the default) gives it a pseudo-query of its own and `Sum` reproduces the package.
//! The first layer of a group reads the completed groups only (the empty partial sum is no
//! source), as in `attn-res`'s block-boundary handling.
//!
//! A completed source's logits for the queries of every mixture that reads it are one
//! normalised projection (`rms(v) [w_l … w_Q]`, from the first block after the source on; one
//! fused op each way on Flex). On Flex each mixture (the query's column of its sources' logits,
//! the softmax and the weighted sum) is one fused op each way, and under autodiff its backward
//! leaves `(p_{l,i}, ∂h_l, ⟨∂h_l, h_l⟩)` for each source: the backward of the source's logits,
//! which runs after every mixture that read the source (their weights come from the logits),
//! takes `⟨∂h_l, v_i⟩` from each and writes the logits' gradient and
//! `∂v_i = Σ_l p_{l,i} ∂h_l + (its own term)` in its one pass over the source, so that a mixture
//! reads each source once forward and not at all backward. The partial sum, read by one mixture
//! only, gets its logit `w_l · rms(p_l)` and all its gradients inside that mixture's op (a
//! projection of its own where the fused op does not apply: more than 32 sources). On the
//! CubeCL backends every source has logits for every query (the gathering of the query's column
//! takes same-width tables) and the gathering and the weighted sum are a kernel each way per
//! eight sources and the softmax one kernel each way; tensor ops elsewhere.
//!
//! # Shapes
//! - input, block inputs, branches and output: `[..., d]` (any rank, last axis the width `d`)
//! - `queries`: `[L, d]`, `output_query`: `[d]`
//!
//! # Example
//! ```
//! use burn::prelude::*;
//! use burn_connectivity::{AttentionResidualsConfig, MlpBlockConfig, Stack};
//!
//! let device = Device::default();
//! let blocks = MlpBlockConfig::new(16, 32).init_stack(6, &device)?;
//! // Block AttnRes: groups of 2 blocks; `with_block_size(1)` (the default) is full AttnRes.
//! let config = AttentionResidualsConfig::new(16).with_block_size(2);
//! let stack = Stack::new(blocks, &config, &device)?;
//! let y = stack.forward(Tensor::<3>::ones([2, 5, 16], &device));
//! assert_eq!(y.dims(), [2, 5, 16]);
//! # Ok::<(), burn_connectivity::Error>(())
//! ```

use burn::module::Param;
use burn::prelude::*;

use crate::backend::{
    OwnLogit, UnitsGradient, fused_softmax_mix, gather_columns, gathers_columns_apart,
    last_axis_softmax, rms_projection_writing, state_gradient, token_mix_leaving,
};
use crate::connectivity::{Connectivity, ConnectivityConfig, StreamConnectivity, leading_part};
use crate::error::{Error, Result, check_depth, check_positive, check_size};
use crate::matrix::ConnectivityMatrix;
use crate::multi_stream::check_width;

/// How the stack output is made from the sources after the last block.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum AttnResOutput {
    /// Attention over the sources with a pseudo-query of its own (zero at init: their mean).
    Attend,
    /// The plain sum of the sources (`x + Σ f_j`), as the `attn-res` package does.
    Sum,
}

/// Configuration of [`AttentionResiduals`].
#[derive(Config, Debug)]
pub struct AttentionResidualsConfig {
    /// The stream width `d` (the pseudo-queries' length).
    pub width: usize,
    /// Block AttnRes: blocks per group `k` (1: full AttnRes, every branch output a source).
    #[config(default = 1)]
    pub block_size: usize,
    /// `ε` of the keys' RMS normalisation.
    #[config(default = 1e-6)]
    pub epsilon: f64,
    /// How the output is made.
    #[config(default = "AttnResOutput::Attend")]
    pub output: AttnResOutput,
}

impl ConnectivityConfig for AttentionResidualsConfig {
    type Connectivity = AttentionResiduals;

    fn init(&self, num_blocks: usize, device: &Device) -> Result<AttentionResiduals> {
        if num_blocks == 0 {
            return Err(Error::NoBlocks);
        }
        check_size("AttnRes width", self.width)?;
        check_size("AttnRes block_size", self.block_size)?;
        check_positive("AttnRes epsilon", self.epsilon)?;
        let output_query = match self.output {
            AttnResOutput::Attend => Some(Param::from_tensor(Tensor::zeros([self.width], device))),
            AttnResOutput::Sum => None,
        };
        Ok(AttentionResiduals {
            queries: Param::from_tensor(Tensor::zeros([num_blocks, self.width], device)),
            output_query,
            block_size: self.block_size,
            epsilon: self.epsilon,
            num_blocks,
        })
    }
}

/// Attention Residuals, full or block (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct AttentionResiduals {
    /// `w_l` for blocks `1..=L`, row `l − 1`.
    pub queries: Param<Tensor<2>>,
    /// `w_out` (output `Attend`), or `None` (output `Sum`).
    pub output_query: Option<Param<Tensor<1>>>,
    /// Blocks per group `k` (1: full AttnRes).
    pub block_size: usize,
    /// `ε` of the keys.
    pub epsilon: f64,
    /// Number of blocks `L` wired.
    pub num_blocks: usize,
}

/// A completed source with its logits for the queries that may read it.
#[derive(Debug, Clone)]
struct Source<const D: usize> {
    value: Tensor<D>,
    /// `w_c · k(v)` for the query columns `c` from `first_column` on (`[..., Q − first_column]`):
    /// one matrix product when the source is complete, where each block's mixture would
    /// otherwise take a product and a sum per source.
    logits: Tensor<D>,
    /// The query column of `logits`' first column (0 where every source has every column).
    first_column: usize,
    /// Where the fused ops run under autodiff: the slot in which every mixture reading the
    /// source leaves its term of the source's gradient, for the logits' backward to write the
    /// whole gradient once (it runs after them: every mixture's weights come from the logits).
    gradient: Option<UnitsGradient>,
}

/// The running state of [`AttentionResiduals`].
#[derive(Debug, Clone)]
pub struct AttentionResidualsState<const D: usize> {
    /// The completed sources: `x` and the branch outputs (full) or the group sums (block).
    sources: Vec<Source<D>>,
    /// The current group's partial sum, `None` while it is empty (after the last block with
    /// output `Sum`, also the last group, complete: no query reads it).
    partial: Option<Tensor<D>>,
    /// The input of the next block.
    input: Tensor<D>,
    /// `[d, Q]`: block `l`'s query in column `l − 1`, the output's (if any) in column `L`;
    /// fetched once per pass.
    queries: Tensor<2>,
    /// Whether a source made after block `l` has logits for the queries of columns `l` and up
    /// only, those of the mixtures that read it (half the columns over a stack), or for every
    /// query: the CubeCL gather kernel takes one column of same-width tables.
    narrow_logits: bool,
}

impl<const D: usize> AttentionResidualsState<D> {
    /// Number of sources the next mixture reads (completed groups and a non-empty partial sum).
    pub fn source_count(&self) -> usize {
        self.sources.len() + usize::from(self.partial.is_some())
    }
}

impl AttentionResiduals {
    /// The output's mode.
    pub fn output_mode(&self) -> AttnResOutput {
        match self.output_query {
            Some(_) => AttnResOutput::Attend,
            None => AttnResOutput::Sum,
        }
    }

    /// `‖w_l‖₂` for every block (0 at init: uniform mixtures), read back to the host.
    pub fn query_norms(&self) -> Vec<f64> {
        let norms = self.queries.val().square().sum_dim(1).sqrt();
        norms.into_data().iter::<f64>().collect()
    }

    /// The width `d`.
    pub fn width(&self) -> usize {
        self.queries.dims()[1]
    }

    /// Every query side by side, `[d, Q]` (see [`AttentionResidualsState`]).
    fn query_columns(&self) -> Tensor<2> {
        let queries = self.queries.val();
        let all = match &self.output_query {
            Some(query) => Tensor::cat(vec![queries, query.val().unsqueeze::<2>()], 0),
            None => queries,
        };
        all.transpose()
    }

    /// `k(v) · W` for the query columns `W` (`[d, C]`): `[..., C]`; its backward writes `v`'s
    /// gradient with the terms left in `gradient`.
    fn logits<const D: usize>(
        &self,
        value: &Tensor<D>,
        queries: &Tensor<2>,
        gradient: Option<&UnitsGradient>,
    ) -> Tensor<D> {
        rms_projection_writing(value.clone(), queries.clone(), self.epsilon, gradient)
    }

    /// A completed source, made after `done` blocks (`narrow`: see
    /// [`AttentionResidualsState`]).
    fn source<const D: usize>(
        &self,
        value: Tensor<D>,
        queries: &Tensor<2>,
        done: usize,
        narrow: bool,
    ) -> Source<D> {
        let count = queries.dims()[1];
        // Block 1 reads `x` alone: no mixture reads column 0.
        let first_column = if narrow {
            done.max(1).min(count - 1)
        } else {
            0
        };
        let read = match first_column {
            0 => queries.clone(),
            first => queries.clone().narrow(1, first, count - first),
        };
        let gradient = state_gradient(&value);
        let logits = self.logits(&value, &read, gradient.as_ref());
        Source {
            value,
            logits,
            first_column,
            gradient,
        }
    }

    /// `Σ_s softmax_s(w_c · k(s)) s` over the completed sources and the partial sum, with the
    /// query of column `column`.
    fn attend<const D: usize>(
        &self,
        column: usize,
        queries: &Tensor<2>,
        sources: &[Source<D>],
        partial: Option<&Tensor<D>>,
    ) -> Tensor<D> {
        if let ([only], None) = (sources, partial) {
            // softmax over one source is 1, whatever the query.
            return only.value.clone();
        }
        let count = sources.len();
        let tables: Vec<Tensor<D>> = sources.iter().map(|s| s.logits.clone()).collect();
        let mut columns: Vec<usize> = sources.iter().map(|s| column - s.first_column).collect();
        let mut values: Vec<Tensor<D>> = sources.iter().map(|s| s.value.clone()).collect();
        let mut gradients: Vec<Option<UnitsGradient>> =
            sources.iter().map(|s| s.gradient.clone()).collect();
        let Some(partial) = partial else {
            if let Some(mixed) = fused_softmax_mix(&tables, &columns, &values, &gradients, None) {
                return mixed;
            }
            let logits = gather_columns(tables, &columns);
            return token_mix_leaving(last_axis_softmax(logits), values, gradients);
        };
        // The partial sum is read by this mixture only: the fused mixture makes its logit.
        values.push(partial.clone());
        columns.push(column);
        gradients.push(None);
        let own = OwnLogit {
            weights: queries.clone(),
            epsilon: self.epsilon,
        };
        if let Some(mixed) = fused_softmax_mix(&tables, &columns, &values, &gradients, Some(&own)) {
            return mixed;
        }
        // Else its logit for this query alone, after the sources' columns.
        let query = queries.clone().narrow(1, column, 1);
        let gradient = state_gradient(partial);
        let partial_logit = self.logits(partial, &query, gradient.as_ref());
        gradients[count] = gradient;
        let logits = Tensor::cat(
            vec![gather_columns(tables, &columns[..count]), partial_logit],
            D - 1,
        );
        token_mix_leaving(last_axis_softmax(logits), values, gradients)
    }

    /// Takes in block `block`'s (0-based) contribution `value`, then prepares the next input.
    fn advance<const D: usize>(
        &self,
        state: AttentionResidualsState<D>,
        block: usize,
        value: Tensor<D>,
    ) -> AttentionResidualsState<D> {
        let AttentionResidualsState {
            mut sources,
            partial,
            input,
            queries,
            narrow_logits,
        } = state;
        let done = block + 1;
        let partial = match partial {
            Some(sum) => sum + value,
            None => value,
        };
        // A group completed after `done` blocks is read by the queries of columns `done` and
        // up; after the last block with output `Sum` there are none, and the group stays the
        // partial sum, which the output adds like a source, without logits nobody reads.
        let read = done < queries.dims()[1];
        let partial = if done.is_multiple_of(self.block_size) && read {
            sources.push(self.source(partial, &queries, done, narrow_logits));
            None
        } else {
            Some(partial)
        };
        let input = if done < self.num_blocks {
            self.attend(done, &queries, &sources, partial.as_ref())
        } else {
            input
        };
        AttentionResidualsState {
            sources,
            partial,
            input,
            queries,
            narrow_logits,
        }
    }

    /// Coefficients over `[x, h_1, …, h_L]` of the sources before each block and after the
    /// last, with zero queries (see [`matrix`](Connectivity::matrix)).
    fn uniform_columns(&self) -> (Vec<Vec<f64>>, Vec<f64>) {
        let size = self.num_blocks + 1;
        let mut first = vec![0.0; size];
        first[0] = 1.0;
        let mut sources = vec![first];
        let mut partial: Option<Vec<f64>> = None;
        let mixture = |sources: &[Vec<f64>], partial: &Option<Vec<f64>>, mean: bool| {
            let all: Vec<&Vec<f64>> = sources.iter().chain(partial.as_ref()).collect();
            let scale = if mean { 1.0 / all.len() as f64 } else { 1.0 };
            (0..size)
                .map(|i| all.iter().map(|source| source[i]).sum::<f64>() * scale)
                .collect::<Vec<f64>>()
        };
        let mut columns = vec![vec![0.0; size]];
        for block in 0..self.num_blocks {
            columns.push(mixture(&sources, &partial, true));
            let mut sum = partial.take().unwrap_or_else(|| vec![0.0; size]);
            sum[block + 1] += 1.0;
            if (block + 1).is_multiple_of(self.block_size) {
                sources.push(sum);
            } else {
                partial = Some(sum);
            }
        }
        let mean = self.output_query.is_some();
        let output = mixture(&sources, &partial, mean);
        (columns, output)
    }
}

impl Connectivity for AttentionResiduals {
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The mixtures of zero queries: block `l` reads the mean of its sources, the output their
    /// mean (`Attend`) or sum (`Sum`). The learned mixtures depend on the input.
    fn matrix(&self) -> ConnectivityMatrix {
        let (columns, output) = self.uniform_columns();
        ConnectivityMatrix::from_columns(&columns, output).expect("L+1 columns of L+1 entries")
    }

    fn truncated(&self, depth: usize) -> Result<Self> {
        check_depth(depth, 1, self.num_blocks)?;
        let width = self.width();
        Ok(Self {
            queries: self.queries.clone().map(|queries| {
                let trainable = queries.is_require_grad();
                queries
                    .narrow(0, 0, depth)
                    .detach()
                    .set_require_grad(trainable)
            }),
            // A fresh leaf of the same values, as every truncated parameter.
            output_query: self
                .output_query
                .as_ref()
                .map(|query| leading_part(query, width)),
            num_blocks: depth,
            ..self.clone()
        })
    }

    fn stream_width(&self) -> Option<usize> {
        Some(self.width())
    }

    fn check_input(&self, dims: &[usize]) -> Result<()> {
        check_width("AttnRes", self.width(), dims)
    }
}

impl<const D: usize> StreamConnectivity<D> for AttentionResiduals {
    type State = AttentionResidualsState<D>;

    fn start(&self, input: Tensor<D>) -> AttentionResidualsState<D> {
        let queries = self.query_columns();
        let narrow_logits = gathers_columns_apart(&input.device());
        AttentionResidualsState {
            sources: vec![self.source(input.clone(), &queries, 0, narrow_logits)],
            partial: None,
            input,
            queries,
            narrow_logits,
        }
    }

    fn block_input(&self, state: &AttentionResidualsState<D>) -> Tensor<D> {
        state.input.clone()
    }

    fn step(
        &self,
        state: AttentionResidualsState<D>,
        block: usize,
        branch: Tensor<D>,
    ) -> AttentionResidualsState<D> {
        self.advance(state, block, branch)
    }

    /// The block's source is what its layer adds to its input: `tail(h + branch) − h`.
    fn step_with_tail(
        &self,
        state: AttentionResidualsState<D>,
        block: usize,
        branch: Tensor<D>,
        tail: impl FnOnce(Tensor<D>) -> Tensor<D>,
    ) -> AttentionResidualsState<D> {
        let input = state.input.clone();
        let value = tail(input.clone() + branch) - input;
        self.advance(state, block, value)
    }

    fn output(&self, state: &AttentionResidualsState<D>) -> Tensor<D> {
        match &self.output_query {
            Some(_) => self.attend(
                self.num_blocks,
                &state.queries,
                &state.sources,
                state.partial.as_ref(),
            ),
            None => state
                .sources
                .iter()
                .map(|source| source.value.clone())
                .chain(state.partial.clone())
                .reduce(|sum, value| sum + value)
                .expect("x is a source"),
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Distribution;
    use burn::tensor::activation::softmax;

    use super::*;
    use crate::block::Block;
    use crate::connectivity::probe_matrix;
    use crate::test_util::{WIDTH, assert_close, assert_tensors_close, blocks, input};

    const BLOCKS: usize = 5;

    fn attnres(block_size: usize, output: AttnResOutput) -> AttentionResiduals {
        AttentionResidualsConfig::new(WIDTH)
            .with_block_size(block_size)
            .with_output(output)
            .init(BLOCKS, &Device::default())
            .expect("valid config")
    }

    /// With zero queries every mixture is the mean of its sources: the probed matrix is the
    /// closed form, for full and block AttnRes and both outputs.
    #[test]
    fn zero_queries_mix_uniformly() {
        for block_size in [1, 2, 3, 5, 7] {
            for output in [AttnResOutput::Attend, AttnResOutput::Sum] {
                let connectivity = attnres(block_size, output);
                let probed = probe_matrix(&connectivity, &Device::default()).expect("probes");
                let difference = probed.max_abs_diff(&connectivity.matrix());
                assert!(
                    difference < 1e-6,
                    "k = {block_size}, {output:?}: {difference}"
                );
            }
        }
        // Full: block 3 reads (x + h_1 + h_2) / 3; the output attends over all six sources.
        let full = attnres(1, AttnResOutput::Attend).matrix();
        for i in 0..3 {
            assert!((full.matrix[i][3] - 1.0 / 3.0).abs() < 1e-12);
        }
        assert!(full.output.iter().all(|c| (c - 1.0 / 6.0).abs() < 1e-12));
        // Blocks of 2: block 4 reads the mean of x, h_1 + h_2 and the partial sum h_3.
        let grouped = attnres(2, AttnResOutput::Sum).matrix();
        let column: Vec<f64> = (0..=BLOCKS).map(|i| grouped.matrix[i][4]).collect();
        let third = 1.0 / 3.0;
        assert_eq!(column, [third, third, third, third, 0.0, 0.0]);
        assert_eq!(grouped.output, [1.0; BLOCKS + 1]);
    }

    /// Output `Sum` is the residual stream `x + Σ f_j(h_j)`, whatever the queries.
    #[test]
    fn summed_output_is_x_plus_every_branch() {
        let device = Device::default();
        let blocks = blocks(BLOCKS, &device);
        let x = input(&device);
        for block_size in [1, 2, 5] {
            let mut connectivity = attnres(block_size, AttnResOutput::Sum);
            connectivity.queries = Param::from_tensor(Tensor::random(
                [BLOCKS, WIDTH],
                Distribution::Normal(0.0, 1.0),
                &device,
            ));
            let mut state = StreamConnectivity::<3>::start(&connectivity, x.clone());
            let mut total = x.clone();
            for (j, block) in blocks.iter().enumerate() {
                let branch = block.branch(connectivity.block_input(&state), &());
                total = total + branch.clone();
                state = connectivity.step(state, j, branch);
            }
            assert_close(connectivity.output(&state), total);
        }
    }

    /// Block 2 of full AttnRes by hand: `softmax(w_2 · k(x), w_2 · k(v_1))` over `x` and `v_1`.
    #[test]
    fn second_block_reads_the_softmax_mixture() {
        let device = Device::default();
        let blocks = blocks(2, &device);
        let x = input(&device);
        let mut connectivity = AttentionResidualsConfig::new(WIDTH)
            .init(2, &device)
            .expect("valid config");
        let queries = Tensor::random([2, WIDTH], Distribution::Normal(0.0, 1.0), &device);
        connectivity.queries = Param::from_tensor(queries.clone());
        let state = StreamConnectivity::<3>::start(&connectivity, x.clone());
        assert_close(connectivity.block_input(&state), x.clone());
        let v1 = blocks[0].branch(x.clone(), &());
        let state = connectivity.step(state, 0, v1.clone());
        let key = |v: &Tensor<3>| v.clone() / (v.clone().square().mean_dim(2) + 1e-6).sqrt();
        let w2 = queries.narrow(0, 1, 1).reshape([1, 1, WIDTH]);
        let logit = |v: &Tensor<3>| (key(v) * w2.clone()).sum_dim(2);
        let (a, b) = (logit(&x).exp(), logit(&v1).exp());
        let expected = (x * a.clone() + v1 * b.clone()) / (a + b);
        assert_close(connectivity.block_input(&state), expected);
    }

    /// The output by the module docs' equations, as tensor ops: the sources and the partial
    /// sum, `softmax_s(w · rms(s))` over them before each block, the output attending with
    /// `w_out`.
    fn by_the_equations(
        x: Tensor<3>,
        queries: Tensor<2>,
        output_query: Tensor<1>,
        block_size: usize,
        branch: impl Fn(Tensor<3>) -> Tensor<3>,
    ) -> Tensor<3> {
        let depth = queries.dims()[0];
        let mix = |sources: &[Tensor<3>], query: Tensor<1>| {
            let query = query.reshape([1, 1, WIDTH]);
            let logits = sources
                .iter()
                .map(|s| {
                    let key = s.clone() / (s.clone().square().mean_dim(2) + 1e-6).sqrt();
                    (key * query.clone()).sum_dim(2)
                })
                .collect();
            let weights = softmax(Tensor::cat(logits, 2), 2);
            sources
                .iter()
                .enumerate()
                .map(|(i, s)| s.clone() * weights.clone().narrow(2, i, 1))
                .reduce(|sum, term| sum + term)
                .expect("a source")
        };
        let mut sources = vec![x.clone()];
        let mut partial: Option<Tensor<3>> = None;
        let mut input = x;
        for block in 0..depth {
            let value = branch(input.clone());
            let sum = match partial.take() {
                Some(sum) => sum + value,
                None => value,
            };
            if (block + 1) % block_size == 0 {
                sources.push(sum);
            } else {
                partial = Some(sum);
            }
            if block + 1 < depth {
                let all: Vec<Tensor<3>> = sources.iter().cloned().chain(partial.clone()).collect();
                input = mix(
                    &all,
                    queries.clone().narrow(0, block + 1, 1).reshape([WIDTH]),
                );
            }
        }
        let all: Vec<Tensor<3>> = sources.into_iter().chain(partial).collect();
        mix(&all, output_query)
    }

    /// Full and block AttnRes deep enough that their last mixtures read more sources than one
    /// fused mixture takes (33 and up: each source's own columns gathered, the partial sum's
    /// logit a projection of its own), with random queries, against [`by_the_equations`]: the
    /// output and the gradients of the input and of both kinds of query agree.
    #[test]
    fn deep_stacks_follow_the_equations() {
        let device = Device::default().autodiff();
        let branch = |h: Tensor<3>| (h * 0.7).tanh();
        let normal = Distribution::Normal(0.0, 1.0);
        for (block_size, depth) in [(1, 36), (2, 64)] {
            let queries = Tensor::<2>::random([depth, WIDTH], normal, &device);
            let output_query = Tensor::<1>::random([WIDTH], normal, &device);
            let probe = Tensor::<3>::random([2, 3, WIDTH], normal, &device);
            let run = |by_hand: bool| {
                let x = input(&device).require_grad();
                let queries = queries.clone().require_grad();
                let output_query = output_query.clone().require_grad();
                let output = if by_hand {
                    by_the_equations(
                        x.clone(),
                        queries.clone(),
                        output_query.clone(),
                        block_size,
                        branch,
                    )
                } else {
                    let mut connectivity = AttentionResidualsConfig::new(WIDTH)
                        .with_block_size(block_size)
                        .init(depth, &device)
                        .expect("valid config");
                    connectivity.queries = Param::from_tensor(queries.clone());
                    connectivity.output_query = Some(Param::from_tensor(output_query.clone()));
                    let mut state = StreamConnectivity::<3>::start(&connectivity, x.clone());
                    for block in 0..depth {
                        let value = branch(connectivity.block_input(&state));
                        state = connectivity.step(state, block, value);
                    }
                    connectivity.output(&state)
                };
                let grads = (output.clone() * probe.clone()).sum().backward();
                vec![
                    output.into_data(),
                    x.grad(&grads).expect("x is read").into_data(),
                    queries.grad(&grads).expect("queries are read").into_data(),
                    output_query
                        .grad(&grads)
                        .expect("w_out is read")
                        .into_data(),
                ]
            };
            let case = format!("k = {block_size}, {depth} blocks");
            assert_tensors_close(&run(false), &run(true), 1e-4, &case);
        }
    }

    #[test]
    fn bad_settings_are_typed_errors_naming_them() {
        let device = Device::default();
        let named =
            |config: AttentionResidualsConfig, blocks: usize| match config.init(blocks, &device) {
                Err(Error::OutOfRange { name, .. }) => name.to_string(),
                Err(Error::NoBlocks) => "no blocks".to_string(),
                other => panic!("expected an error, got {other:?}"),
            };
        assert_eq!(named(AttentionResidualsConfig::new(0), 3), "AttnRes width");
        assert_eq!(
            named(AttentionResidualsConfig::new(8).with_block_size(0), 3),
            "AttnRes block_size"
        );
        assert_eq!(
            named(AttentionResidualsConfig::new(8).with_epsilon(0.0), 3),
            "AttnRes epsilon"
        );
        assert_eq!(named(AttentionResidualsConfig::new(8), 0), "no blocks");
        assert!(matches!(
            AttentionResidualsConfig::new(8)
                .with_epsilon(f64::NAN)
                .init(3, &device),
            Err(Error::NonFinite { .. })
        ));
        let connectivity = AttentionResidualsConfig::new(8)
            .init(3, &device)
            .expect("valid");
        assert!(matches!(
            connectivity.check_input(&[2, 3, 7]),
            Err(Error::WidthMismatch { .. })
        ));
        assert!(matches!(
            connectivity.truncated(4),
            Err(Error::DepthOutOfRange { .. })
        ));
    }
}
