//! DenseFormer's depth-weighted average (DWA; Pagliardini et al. 2024, epfml/DenseFormer;
//! MATH §5.3).
//!
//! The blocks keep their own residual; after block `i`, every `period` blocks, the stream is
//! replaced by a learned weighted average of the states of its dilation group:
//!
//! ```text
//! X_0 = Y_0 = x
//! X_i = Y_{i-1} + f_i(Y_{i-1})
//! Y_i = Σ_{k ∈ {i mod δ, i mod δ + δ, …, i}} α_i[k] X_k     if i % period == 0
//! Y_i = X_i                                                   otherwise
//! y   = Y_L,   readout y_k = Y_k
//! ```
//!
//! Init `α_i = e_last` (`Y_i = X_i`): exactly ResNet. `δ = dilation`, `period` as in the paper
//! (its 4×5 DenseFormer is `dilation = 4, period = 5`).
//!
//! With `period = 1`, on Flex (f32, f64) and on the CubeCL backends, each average is one fused
//! op with its own backward (`src/backend/history_mix.rs`): a kernel forward and one backward on
//! a GPU, however many states it reads, each `α_i` handed to it as it is (no concatenation).
//! Otherwise the average is a chain of scaled additions with the weights fetched once per
//! forward pass (host scalars at inference, scalar views under a gradient on CubeCL backends),
//! and only the states a later average still needs are kept (`X_k` is dropped after the last
//! `i ≥ k` that averages over it); under a gradient, autodiff keeps what the backward pass needs
//! anyway.
//!
//! `C` and the output column follow exactly from the linear recursion:
//! `coef(X_i) = coef(Y_{i-1}) + e_i`, `C[:, i] = coef(Y_{i-1})`, `out = coef(Y_L)`.

use burn::module::Param;
use burn::prelude::*;

use crate::backend::{History, Scales, UsedEntries, fused_history};
use crate::connectivity::{Connectivity, ConnectivityConfig, StreamConnectivity};
use crate::error::{Error, Result, check_depth, check_size};
use crate::matrix::ConnectivityMatrix;

/// Configuration of [`DenseFormer`].
#[derive(Config, Debug)]
pub struct DenseFormerConfig {
    /// `δ`: an average after block `i` mixes the states `X_k` with `k ≡ i (mod δ)`.
    #[config(default = 1)]
    pub dilation: usize,
    /// An average is taken after every `period`-th block.
    #[config(default = 1)]
    pub period: usize,
}

impl ConnectivityConfig for DenseFormerConfig {
    type Connectivity = DenseFormer;

    fn init(&self, num_blocks: usize, device: &Device) -> Result<DenseFormer> {
        if num_blocks == 0 {
            return Err(Error::NoBlocks);
        }
        check_size("DWA dilation", self.dilation)?;
        check_size("DWA period", self.period)?;
        let alphas = (1..=num_blocks)
            .filter(|i| i % self.period == 0)
            .map(|i| {
                let count = i / self.dilation + 1;
                let mut weights = vec![0.0; count];
                weights[count - 1] = 1.0;
                Param::from_tensor(Tensor::from_data(TensorData::new(weights, [count]), device))
            })
            .collect();
        Ok(DenseFormer {
            alphas,
            dilation: self.dilation,
            period: self.period,
            num_blocks,
        })
    }
}

/// Depth-weighted averages over earlier states (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct DenseFormer {
    /// `α_i` for every block `i` after which an average is taken (`i = period, 2·period, …`),
    /// in order; `α_i[t]` weighs `X_{i mod δ + t·δ}`.
    pub alphas: Vec<Param<Tensor<1>>>,
    /// `δ`.
    pub dilation: usize,
    /// The averaging period.
    pub period: usize,
    /// Number of blocks `L` wired.
    pub num_blocks: usize,
}

/// The running state of [`DenseFormer`].
#[derive(Debug, Clone)]
pub struct DenseFormerState<const D: usize> {
    /// The stream `Y_j`, input of the next block.
    pub stream: Tensor<D>,
    averages: Averages<D>,
}

/// How the averages are formed.
#[derive(Debug, Clone)]
enum Averages<const D: usize> {
    /// From tensor ops.
    Kept {
        /// `X_k` for every `k` a later average still needs.
        kept: Vec<Option<Tensor<D>>>,
        /// Every `α` side by side (`[1, Σ |α_i|]`), fetched once per pass.
        weights: Scales,
    },
    /// One fused op per average over the states `X_k`, state `k` at index `k` (Flex, with an
    /// average after every block: `src/backend/history_mix.rs`).
    Fused {
        history: History,
        /// `α_1, α_2, …`, fetched once per pass: average `i`'s weights are segment `i` of the
        /// history (segment 0 is the 1 of `Y_0 = X_0`).
        alphas: Vec<Tensor<1>>,
    },
}

impl DenseFormer {
    /// Whether an average is taken after block `i` (1-based).
    fn averages_after(&self, i: usize) -> bool {
        i.is_multiple_of(self.period)
    }

    /// Whether an average after a block `i' > after` (up to `L`) uses `X_k`.
    fn needed_later(&self, k: usize, after: usize) -> bool {
        (after + 1..=self.num_blocks)
            .any(|i| i % self.dilation == k % self.dilation && self.averages_after(i))
    }

    /// Position of `α_i[0]` in the side-by-side weights.
    fn offset(&self, i: usize) -> usize {
        (1..i)
            .filter(|&earlier| self.averages_after(earlier))
            .map(|earlier| earlier / self.dilation + 1)
            .sum()
    }

    /// The weights `α_i` read back to the host, with the block `i` they follow.
    pub fn weight_values(&self) -> Vec<(usize, Vec<f64>)> {
        (1..=self.num_blocks)
            .filter(|&i| self.averages_after(i))
            .zip(&self.alphas)
            .map(|(i, alpha)| (i, alpha.val().into_data().iter::<f64>().collect()))
            .collect()
    }

    /// Per average, the weight it puts on states other than the latest one, `Σ_{t<last} |α_i[t]|`
    /// (0 at init: plain ResNet).
    pub fn weight_on_earlier_states(&self) -> Vec<f64> {
        self.weight_values()
            .into_iter()
            .map(|(_, weights)| weights[..weights.len() - 1].iter().map(|w| w.abs()).sum())
            .collect()
    }
}

impl Connectivity for DenseFormer {
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Exact, from the linear recursion (see the [module docs](self)).
    fn matrix(&self) -> ConnectivityMatrix {
        let size = self.num_blocks + 1;
        let unit = |i: usize| {
            let mut vector = vec![0.0; size];
            vector[i] = 1.0;
            vector
        };
        let weights: std::collections::HashMap<usize, Vec<f64>> =
            self.weight_values().into_iter().collect();
        let mut states = vec![unit(0)]; // coef(X_k)
        let mut stream = unit(0); // coef(Y_{i-1})
        let mut columns = vec![vec![0.0; size]];
        for i in 1..size {
            columns.push(stream.clone());
            let mut state = stream;
            state[i] += 1.0;
            states.push(state.clone());
            stream = match weights.get(&i) {
                Some(alpha) => {
                    let mut average = vec![0.0; size];
                    for (t, weight) in alpha.iter().enumerate() {
                        let k = i % self.dilation + t * self.dilation;
                        for (sum, value) in average.iter_mut().zip(&states[k]) {
                            *sum += weight * value;
                        }
                    }
                    average
                }
                None => state,
            };
        }
        ConnectivityMatrix::from_columns(&columns, stream).expect("L+1 columns of L+1 entries")
    }

    fn truncated(&self, depth: usize) -> Result<Self> {
        check_depth(depth, 1, self.num_blocks)?;
        let averages = (1..=depth).filter(|&i| self.averages_after(i)).count();
        Ok(Self {
            alphas: self.alphas[..averages].to_vec(),
            num_blocks: depth,
            ..self.clone()
        })
    }
}

impl<const D: usize> StreamConnectivity<D> for DenseFormer {
    type State = DenseFormerState<D>;

    fn start(&self, input: Tensor<D>) -> DenseFormerState<D> {
        // The fused op pushes each state as the newest of the first average over it: every
        // block's own average does so for its `X_i`; `X_0` gets an average of its own, `Y_0 = X_0`.
        let segments: Vec<usize> = [1]
            .into_iter()
            .chain(self.alphas.iter().map(|alpha| alpha.dims()[0]))
            .collect();
        if self.period == 1
            && let Some(history) = fused_history(&input, self.num_blocks + 1, &segments)
        {
            // `Y_0 = 1 · X_0`, the 1 a constant: where `X_0` needs no gradient, neither does
            // `Y_0` (block 1 does not differentiate its input), and the later averages'
            // backward covers `X_0`.
            let one = TensorData::new(vec![1.0f32], [1]);
            let one = Tensor::<1>::from_data(one, (&input.device(), input.dtype()));
            let stream = history.mix(Vec::new(), 0, 0, one, input);
            if !self.needed_later(0, 0) {
                history.forget(0);
            }
            let alphas = self.alphas.iter().map(Param::val).collect();
            return DenseFormerState {
                stream,
                averages: Averages::Fused { history, alphas },
            };
        }
        let tracked = self
            .alphas
            .iter()
            .any(|alpha| alpha.val().is_require_grad());
        let weights = if self.alphas.is_empty() {
            Tensor::zeros([1, 1], &input.device())
        } else {
            Tensor::cat(self.alphas.iter().map(Param::val).collect(), 0).unsqueeze::<2>()
        };
        let weights = Scales::new(weights, UsedEntries::All, tracked);
        let kept = vec![self.needed_later(0, 0).then(|| input.clone())];
        DenseFormerState {
            stream: input,
            averages: Averages::Kept { kept, weights },
        }
    }

    fn block_input(&self, state: &DenseFormerState<D>) -> Tensor<D> {
        state.stream.clone()
    }

    fn step_with_tail(
        &self,
        state: DenseFormerState<D>,
        block: usize,
        branch: Tensor<D>,
        tail: impl FnOnce(Tensor<D>) -> Tensor<D>,
    ) -> DenseFormerState<D> {
        let i = block + 1;
        let latest = tail(state.stream + branch);
        let first = i % self.dilation;
        let (stream, averages) = match state.averages {
            Averages::Fused { history, alphas } => {
                // α_i[t] weighs X_{first + tδ}.
                let earlier = (first..i).step_by(self.dilation).enumerate();
                let terms = earlier.map(|(t, k)| (k, t)).collect();
                let newest = i / self.dilation;
                let stream = history.mix(terms, newest, i, alphas[i - 1].clone(), latest);
                for k in (first..=i).step_by(self.dilation) {
                    if !self.needed_later(k, i) {
                        history.forget(k);
                    }
                }
                (stream, Averages::Fused { history, alphas })
            }
            Averages::Kept { mut kept, weights } => {
                let stream = if self.averages_after(i) {
                    let offset = self.offset(i);
                    let earlier = (first..i).step_by(self.dilation).enumerate().map(|(t, k)| {
                        let state = kept[k].clone().expect("kept for this average");
                        weights.scale(0, offset + t, state)
                    });
                    let last = weights.scale(0, offset + i / self.dilation, latest.clone());
                    earlier.fold(last, |sum, term| sum + term)
                } else {
                    latest.clone()
                };
                // Forget what no later average needs.
                for (k, state) in kept.iter_mut().enumerate() {
                    if state.is_some() && !self.needed_later(k, i) {
                        *state = None;
                    }
                }
                kept.push(self.needed_later(i, i).then_some(latest));
                (stream, Averages::Kept { kept, weights })
            }
        };
        DenseFormerState { stream, averages }
    }

    fn output(&self, state: &DenseFormerState<D>) -> Tensor<D> {
        state.stream.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::Block;
    use crate::connectivity::probe_matrix;
    use crate::stack::Stack;
    use crate::test_util::{
        TanhBlock, assert_close, blocks, fixed_blocks, fixed_normal, input, residual_loop,
    };

    /// Averages of states of magnitude ~10 summed in another order: f32 rounding of the terms,
    /// which can cancel to much smaller sums.
    fn assert_relatively_close(actual: Tensor<3>, expected: Tensor<3>) {
        let tolerance = burn::tensor::Tolerance::rel_abs(1e-5, 1e-5);
        actual
            .into_data()
            .assert_approx_eq::<f32>(&expected.into_data(), tolerance);
    }

    const VARIANTS: [(usize, usize); 5] = [(1, 1), (2, 1), (1, 2), (2, 3), (4, 5)];

    /// Every `α_i` moved off its ResNet initialisation by a fixed draw.
    fn randomised(mut dwa: DenseFormer, device: &Device) -> DenseFormer {
        for (index, alpha) in dwa.alphas.iter_mut().enumerate() {
            let noise = fixed_normal(alpha.dims(), 0.5, 300 + index as u64, device);
            *alpha = Param::from_tensor(alpha.val() + noise);
        }
        dwa
    }

    /// Seven fixed tanh blocks under a DWA with randomised weights: the same in every run.
    fn stack(dilation: usize, period: usize, device: &Device) -> Stack<TanhBlock, DenseFormer> {
        let config = DenseFormerConfig::new()
            .with_dilation(dilation)
            .with_period(period);
        let mut stack = Stack::new(fixed_blocks(7, device), &config, device).unwrap();
        stack.connectivity = randomised(stack.connectivity, device);
        stack
    }

    /// MATH §5.3 with every state kept.
    fn history_loop(stack: &Stack<TanhBlock, DenseFormer>, x: Tensor<3>) -> Tensor<3> {
        let weights: std::collections::HashMap<usize, Vec<f64>> =
            stack.connectivity.weight_values().into_iter().collect();
        let dilation = stack.connectivity.dilation;
        let mut states = vec![x.clone()];
        let mut stream = x;
        for (index, block) in stack.blocks.iter().enumerate() {
            let i = index + 1;
            states.push(stream.clone() + block.branch(stream, &()));
            stream = match weights.get(&i) {
                Some(alpha) => (i % dilation..=i)
                    .step_by(dilation)
                    .zip(alpha)
                    .map(|(k, weight)| states[k].clone() * *weight)
                    .reduce(|sum, term| sum + term)
                    .unwrap(),
                None => states[i].clone(),
            };
        }
        stream
    }

    /// The fused averages on wgpu (one kernel per average forward and backward, each `α_i` a
    /// weight segment of its own) against Flex's, with an input that needs no gradient, so that
    /// `Y_0 = X_0` has no backward and the later averages' backward covers `X_0`: the output,
    /// every `α_i`'s gradient and every block's.
    #[cfg(feature = "wgpu")]
    #[test]
    fn kernels_match_flex_for_an_input_without_gradient() {
        use burn::module::Module;

        use crate::test_util::{OnDevice, WIDTH, assert_close_in_scale, gradient};

        let wgpu = crate::device::device("wgpu")
            .expect("wgpu compiled in")
            .autodiff();
        let flex = Device::flex().autodiff();
        for dilation in [1, 2] {
            let reference = stack(dilation, 1, &Device::flex());
            let x = fixed_normal([2, 3, WIDTH], 1.0, 17, &Device::flex());
            let run = |device: &Device| {
                let stack = reference.clone().map(&mut OnDevice(device.clone()));
                let x = Tensor::<3>::from_data(x.to_data(), device);
                let out = stack.forward(x);
                let grads = (out.clone() * out.clone()).sum().backward();
                let mut values = vec![out.into_data().iter().collect::<Vec<f64>>()];
                values.extend(
                    stack
                        .connectivity
                        .alphas
                        .iter()
                        .map(|a| gradient(a, &grads)),
                );
                values.extend(
                    stack
                        .blocks
                        .iter()
                        .map(|b| gradient(&b.linear.weight, &grads)),
                );
                values
            };
            assert_close_in_scale(&run(&wgpu), &run(&flex), 1e-4);
        }
    }

    #[test]
    fn init_is_exactly_resnet() {
        let device = Device::flex();
        for (dilation, period) in VARIANTS {
            let config = DenseFormerConfig::new()
                .with_dilation(dilation)
                .with_period(period);
            let stack = Stack::new(blocks(7, &device), &config, &device).unwrap();
            let x = input(&device);
            assert_close(stack.forward(x.clone()), residual_loop(&stack.blocks, x));
            assert!(
                stack
                    .connectivity
                    .weight_on_earlier_states()
                    .iter()
                    .all(|w| *w == 0.0)
            );
        }
    }

    #[test]
    fn forward_is_the_average_over_kept_states() {
        let device = Device::flex();
        for (dilation, period) in VARIANTS {
            let stack = stack(dilation, period, &device);
            let x = input(&device);
            assert_relatively_close(stack.forward(x.clone()), history_loop(&stack, x));
        }
    }

    #[test]
    fn matrix_recursion_equals_probing_the_forward_pass() {
        let device = Device::flex();
        for (dilation, period) in VARIANTS {
            let dwa = stack(dilation, period, &device).connectivity;
            let closed = dwa.matrix();
            let probed = probe_matrix(&dwa, &device).unwrap();
            assert!(
                closed.max_abs_diff(&probed) < 1e-5,
                "{closed:?}\n{probed:?}"
            );
        }
    }

    #[test]
    fn truncation_reproduces_the_readout() {
        let device = Device::flex();
        for (dilation, period) in VARIANTS {
            let stack = stack(dilation, period, &device);
            let x = input(&device);
            let readout = stack.readout(x.clone());
            for (depth, expected) in readout.iter().enumerate().skip(1) {
                assert_relatively_close(
                    stack.truncated(depth).unwrap().forward(x.clone()),
                    expected.clone(),
                );
            }
        }
    }

    /// The indices `k` of the states `X_k` a state holds.
    fn kept(state: &DenseFormerState<3>) -> Vec<usize> {
        match &state.averages {
            Averages::Kept { kept, .. } => (0..kept.len()).filter(|&k| kept[k].is_some()).collect(),
            Averages::Fused { history, .. } => history.kept_states(),
        }
    }

    #[test]
    fn only_states_a_later_average_needs_are_kept() {
        let device = Device::flex();
        // δ = 2, period 3 (tensor ops): after block 4 of 7 only the average after block 6 is
        // left, over X_0, X_2, X_4 (X_6 does not exist yet). Period 1 (the fused op on Flex):
        // the averages after blocks 5, 6 and 7 need X_0..X_4.
        for (period, after_four) in [(3, vec![0, 2, 4]), (1, vec![0, 1, 2, 3, 4])] {
            let stack = stack(2, period, &device);
            let state = stack.run(input(&device), 7, &()).unwrap();
            assert!(
                kept(&state).is_empty(),
                "nothing is needed after the last block"
            );
            let state = stack.run(input(&device), 4, &()).unwrap();
            assert_eq!(kept(&state), after_four, "period {period}");
        }
    }

    #[test]
    fn invalid_configs_are_errors() {
        let device = Device::flex();
        assert!(matches!(
            DenseFormerConfig::new().with_dilation(0).init(3, &device),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            DenseFormerConfig::new().with_period(0).init(3, &device),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            DenseFormerConfig::new().init(0, &device),
            Err(Error::NoBlocks)
        ));
    }
}
