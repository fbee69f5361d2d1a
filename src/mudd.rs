//! MUDD: multiway dynamic dense connections (MUDDFormer; Xiao et al., ICML 2025,
//! arXiv 2502.12170, eqs. 5–8, as Caiyun-AI/MUDDFormer computes them; MATH §5.8).
//!
//! DenseFormer's depth-weighted average made dynamic (weights per token, from the newest state)
//! and multiway (one mixture per input of the next block: its attention's query, key, value and
//! its residual). Block `i` (0-based) reads `s_i` (the residual way `R`); `X_0 = x`:
//!
//! ```text
//! X_{i+1}  = s_i + f_i(s_i)                              (block i's own residual)
//! A_i      = GELU(rms(X_{i+1}) W1_i) W2_i + a_i          (per token; C_i ways × (i+2) states)
//! s^c_{i+1} = Σ_{j ≤ i+1} A_i[c, j] X_j                  c ∈ {Q, K, V, R}
//! y        = s^R_L
//! rms(v)   = v / sqrt(mean(v²) + ε)                      (no weight, as the official code)
//! ```
//!
//! `W1_i` is `[d, K_i]`, `W2_i` `[K_i, C_i (i+2)]` (entry `c (i+2) + j`: way `c`'s weight of
//! `X_j`), `a_i` `[C_i, i+2]`, `K_i = C_i (i+2)`. With [`MuddWays::Qkvr`], `C_i = 4` except
//! after the last block (`C = 1`: only the output); with [`MuddWays::One`], `C_i = 1`: the
//! plain-stack form, every way the residual's.
//!
//! On a [`ConnectedEncoder`](crate::transformer::ConnectedEncoder) the `Q`, `K`, `V` ways feed
//! burn-nn's multi-head attention apart ([`MhaInput::new`](burn::nn::attention::MhaInput::new),
//! through [`StreamConnectivity::way_inputs`]), each through the layer's attention norm (the
//! paper gives each way a norm of its own; a burn-nn layer has one); on other stacks the blocks
//! read `R`.
//!
//! **Init (the paper's, §3):** `W1 ~ N(0, 1/d)`, `W2 = 0`, `a_i` one-hot on the newest state:
//! exactly the residual stack. **Decisions (MATH §5.8):** the official code rounds `K_i` up to a
//! multiple of 64 and widens the last layer's 4× (`round64`, `expand_last`); both only widen
//! the weights' hidden layer and are left out.
//!
//! **The matrix `C`** is the static part (`A_i = a_i`, the residual way): the connections of a
//! token whose dynamic term vanishes.
//!
//! The weights' first layer `rms(X) W1` is the normalised projection op, and each way's mixture
//! `Σ_j A[c, j] X_j` is the per-token mixture op (one fused op each way on Flex, for both; a
//! kernel each way per eight states on the CubeCL backends, which read the way's columns of the
//! weights in place); the rest are tensor ops.
//!
//! # Shapes
//! - input, block inputs and outputs: `[..., d]`
//! - `layers[i].w1`: `[d, K_i]`, `w2`: `[K_i, C_i (i+2)]`, `static_weights`: `[C_i, i+2]`
//!
//! # Example
//! ```
//! use burn::prelude::*;
//! use burn_connectivity::{MlpBlockConfig, MuddConfig, Stack};
//!
//! let device = Device::default();
//! let blocks = MlpBlockConfig::new(16, 32).init_stack(4, &device)?;
//! let stack = Stack::new(blocks, &MuddConfig::new(16), &device)?;
//! let y = stack.forward(Tensor::<3>::ones([2, 5, 16], &device));
//! assert_eq!(y.dims(), [2, 5, 16]);
//! # Ok::<(), burn_connectivity::Error>(())
//! ```

use burn::module::Param;
use burn::prelude::*;
use burn::tensor::Distribution;

use crate::activation::gelu;
use crate::backend::{rms_projection, token_mix_columns};
use crate::connectivity::{Connectivity, ConnectivityConfig, StreamConnectivity};
use crate::error::{Error, Result, check_depth, check_positive, check_size};
use crate::matrix::ConnectivityMatrix;
use crate::multi_stream::check_width;

/// Which mixtures each connection makes.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum MuddWays {
    /// One mixture, the next block's input (plain stacks).
    One,
    /// The query, key, value and residual of the next block apart (MUDDFormer).
    Qkvr,
}

impl MuddWays {
    fn count(self) -> usize {
        match self {
            Self::One => 1,
            Self::Qkvr => 4,
        }
    }
}

/// Configuration of [`Mudd`].
#[derive(Config, Debug)]
pub struct MuddConfig {
    /// The stream width `d`.
    pub width: usize,
    /// One mixture per connection, or four (query, key, value, residual).
    #[config(default = "MuddWays::One")]
    pub ways: MuddWays,
    /// `ε` of the norm before the weights' MLP.
    #[config(default = 1e-6)]
    pub epsilon: f64,
}

impl MuddConfig {
    /// MUDDFormer's four ways, for a wrapped transformer.
    pub fn multiway(width: usize) -> Self {
        Self::new(width).with_ways(MuddWays::Qkvr)
    }
}

impl ConnectivityConfig for MuddConfig {
    type Connectivity = Mudd;

    fn init(&self, num_blocks: usize, device: &Device) -> Result<Mudd> {
        if num_blocks == 0 {
            return Err(Error::NoBlocks);
        }
        check_size("MUDD width", self.width)?;
        check_positive("MUDD epsilon", self.epsilon)?;
        let layers = (0..num_blocks)
            .map(|block| {
                let ways = if block + 1 == num_blocks {
                    1
                } else {
                    self.ways.count()
                };
                MuddLayer::new(self.width, ways, block + 2, device)
            })
            .collect();
        Ok(Mudd {
            layers,
            width: self.width,
            ways: self.ways,
            epsilon: self.epsilon,
        })
    }
}

/// The weights of the connection after one block.
#[derive(Module, Debug)]
pub struct MuddLayer {
    /// `W1`, `[d, K]`.
    pub w1: Param<Tensor<2>>,
    /// `W2`, `[K, C·n]` for `n` states.
    pub w2: Param<Tensor<2>>,
    /// `a`, `[C, n]` (`static` in the golden file).
    pub static_weights: Param<Tensor<2>>,
}

impl MuddLayer {
    fn new(width: usize, ways: usize, states: usize, device: &Device) -> Self {
        let hidden = ways * states;
        let std = 1.0 / (width as f64).sqrt();
        let mut newest = vec![0.0; hidden];
        for way in 0..ways {
            newest[way * states + states - 1] = 1.0;
        }
        Self {
            w1: Param::from_tensor(Tensor::random(
                [width, hidden],
                Distribution::Normal(0.0, std),
                device,
            )),
            w2: Param::from_tensor(Tensor::zeros([hidden, hidden], device)),
            static_weights: Param::from_tensor(Tensor::from_data(
                TensorData::new(newest, [ways, states]),
                device,
            )),
        }
    }

    /// `[C, n]`.
    fn shape(&self) -> [usize; 2] {
        self.static_weights.dims()
    }
}

/// Multiway dynamic dense connections (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct Mudd {
    /// The connection after every block.
    pub layers: Vec<MuddLayer>,
    /// The stream width `d`.
    pub width: usize,
    /// One way or four.
    #[module(skip)]
    pub ways: MuddWays,
    /// `ε` of the norm before the weights' MLP.
    pub epsilon: f64,
}

/// The running state of [`Mudd`].
#[derive(Debug, Clone)]
pub struct MuddState<const D: usize> {
    /// `X_0 … X_i`.
    states: Vec<Tensor<D>>,
    /// The last connection's weights per token, `[..., C·n]`, and its way count `C`; `None`
    /// before the first block.
    weights: Option<(Tensor<D>, usize)>,
    /// `s^R_i`: the next block's input, the output so far.
    input: Tensor<D>,
}

impl<const D: usize> MuddState<D> {
    /// Way `c`'s mixture (the input before the first block).
    fn way(&self, way: usize) -> Tensor<D> {
        match &self.weights {
            Some((weights, _)) => mix(&self.states, weights, way),
            None => self.input.clone(),
        }
    }
}

/// `Σ_j A[c, j] X_j` for the weights `[..., C·n]` of `n` states (the per-token mixture op,
/// reading way `c`'s columns of the table in place where it can).
fn mix<const D: usize>(states: &[Tensor<D>], weights: &Tensor<D>, way: usize) -> Tensor<D> {
    token_mix_columns(weights.clone(), way * states.len(), states.to_vec())
}

impl Mudd {
    /// Per layer, the static weight `a_i[R, i+1]` of the residual way on the newest state (1 at
    /// init), read back to the host.
    pub fn newest_weights(&self) -> Vec<f64> {
        self.layers
            .iter()
            .map(|layer| {
                let [ways, states] = layer.shape();
                let weights = layer.static_weights.val().narrow(0, ways - 1, 1);
                weights.narrow(1, states - 1, 1).into_scalar::<f64>()
            })
            .collect()
    }

    /// `GELU(rms(X) W1) W2 + a`, `[..., C·n]`.
    fn weights<const D: usize>(&self, layer: &MuddLayer, newest: &Tensor<D>) -> Tensor<D> {
        let [ways, states] = layer.shape();
        let hidden = rms_projection(newest.clone(), layer.w1.val(), self.epsilon);
        crate::backend::on_rows(hidden, |hidden| {
            gelu(hidden).matmul(layer.w2.val())
                + layer.static_weights.val().reshape([1, ways * states])
        })
    }
}

impl Connectivity for Mudd {
    fn num_blocks(&self) -> usize {
        self.layers.len()
    }

    fn matrix(&self) -> ConnectivityMatrix {
        let size = self.layers.len() + 1;
        let mut first = vec![0.0; size];
        first[0] = 1.0;
        let mut states = vec![first.clone()];
        let mut input = first;
        let mut columns = vec![vec![0.0; size]];
        for (block, layer) in self.layers.iter().enumerate() {
            columns.push(input.clone());
            let mut newest = input;
            newest[block + 1] += 1.0;
            states.push(newest);
            let [ways, count] = layer.shape();
            let weights: Vec<f64> = layer
                .static_weights
                .val()
                .into_data()
                .iter::<f64>()
                .collect();
            let residual = &weights[(ways - 1) * count..];
            input = (0..size)
                .map(|i| states.iter().zip(residual).map(|(s, w)| w * s[i]).sum())
                .collect();
        }
        ConnectivityMatrix::from_columns(&columns, input).expect("L+1 columns of L+1 entries")
    }

    fn truncated(&self, depth: usize) -> Result<Self> {
        check_depth(depth, 1, self.layers.len())?;
        Ok(Self {
            layers: self.layers[..depth].to_vec(),
            ..self.clone()
        })
    }

    fn stream_width(&self) -> Option<usize> {
        Some(self.width)
    }

    fn check_input(&self, dims: &[usize]) -> Result<()> {
        check_width("MUDD", self.width, dims)
    }
}

impl<const D: usize> StreamConnectivity<D> for Mudd {
    type State = MuddState<D>;

    fn start(&self, input: Tensor<D>) -> MuddState<D> {
        MuddState {
            states: vec![input.clone()],
            weights: None,
            input,
        }
    }

    fn block_input(&self, state: &MuddState<D>) -> Tensor<D> {
        state.input.clone()
    }

    /// The `Q`, `K`, `V` mixtures with [`MuddWays::Qkvr`] (all `x` before the first block).
    fn way_inputs(&self, state: &MuddState<D>) -> Option<[Tensor<D>; 3]> {
        if self.ways != MuddWays::Qkvr {
            return None;
        }
        match &state.weights {
            Some((_, ways)) if *ways < 4 => None,
            _ => Some([state.way(0), state.way(1), state.way(2)]),
        }
    }

    fn step_with_tail(
        &self,
        state: MuddState<D>,
        block: usize,
        branch: Tensor<D>,
        tail: impl FnOnce(Tensor<D>) -> Tensor<D>,
    ) -> MuddState<D> {
        let layer = &self.layers[block];
        let MuddState {
            mut states, input, ..
        } = state;
        let newest = tail(input + branch);
        let weights = self.weights(layer, &newest);
        states.push(newest);
        let ways = layer.shape()[0];
        MuddState {
            input: mix(&states, &weights, ways - 1),
            states,
            weights: Some((weights, ways)),
        }
    }

    fn output(&self, state: &MuddState<D>) -> Tensor<D> {
        state.input.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stack::Stack;
    use crate::test_util::{WIDTH, assert_close, blocks, input, refused_setting, residual_loop};
    use crate::{Block, probe_matrix};

    fn randomised(mut mudd: Mudd) -> Mudd {
        for layer in &mut mudd.layers {
            let noise = |tensor: Tensor<2>, std| {
                tensor.clone() + tensor.random_like(Distribution::Normal(0.0, std))
            };
            layer.w2 = Param::from_tensor(noise(layer.w2.val(), 0.3));
            layer.static_weights = Param::from_tensor(noise(layer.static_weights.val(), 0.3));
        }
        mudd
    }

    #[test]
    fn init_is_exactly_the_residual_stack() {
        let device = Device::flex();
        for config in [MuddConfig::new(WIDTH), MuddConfig::multiway(WIDTH)] {
            let stack = Stack::new(blocks(4, &device), &config, &device).unwrap();
            let x = input(&device);
            assert_close(stack.forward(x.clone()), residual_loop(&stack.blocks, x));
            let matrix = stack.matrix();
            for (i, row) in matrix.matrix.iter().enumerate() {
                for (j, value) in row.iter().enumerate() {
                    assert_eq!(*value, f64::from(u8::from(i < j)));
                }
            }
        }
    }

    /// Two blocks by hand, every way.
    #[test]
    fn ways_are_the_dynamic_mixtures_by_hand() {
        let device = Device::flex();
        let stack = Stack::new(blocks(3, &device), &MuddConfig::multiway(WIDTH), &device).unwrap();
        let mudd = randomised(stack.connectivity);
        let x = input(&device);
        let mut state = StreamConnectivity::<3>::start(&mudd, x.clone());
        let first = mudd.way_inputs(&state).expect("four ways");
        for way in first {
            assert_close(way, x.clone());
        }
        let h = stack.blocks[0].branch(x.clone(), &());
        state = mudd.step(state, 0, h.clone());
        let newest = x.clone() + h;
        let layer = &mudd.layers[0];
        let [tokens_a, tokens_b, _] = x.dims();
        let normed = crate::activation::rms_normalised(newest.clone(), mudd.epsilon);
        let z = gelu(
            normed
                .reshape([tokens_a * tokens_b, WIDTH])
                .matmul(layer.w1.val()),
        )
        .matmul(layer.w2.val())
            + layer.static_weights.val().reshape([1, 8]);
        let z = z.reshape([tokens_a, tokens_b, 8]);
        let mix = |c: usize| {
            z.clone().narrow(2, 2 * c, 1) * x.clone()
                + z.clone().narrow(2, 2 * c + 1, 1) * newest.clone()
        };
        let [q, k, v] = mudd.way_inputs(&state).expect("four ways");
        assert_close(q, mix(0));
        assert_close(k, mix(1));
        assert_close(v, mix(2));
        assert_close(mudd.block_input(&state), mix(3));
        // After the last block only the output way exists.
        for block in 1..3 {
            let h = h_of(&stack.blocks[block], &mudd, &state);
            state = mudd.step(state, block, h);
        }
        assert!(mudd.way_inputs(&state).is_none());
    }

    fn h_of(block: &crate::test_util::TanhBlock, mudd: &Mudd, state: &MuddState<3>) -> Tensor<3> {
        block.branch(mudd.block_input(state), &())
    }

    /// The static part's matrix is the probed recursion where the dynamic term vanishes.
    #[test]
    fn matrix_is_the_static_recursion() {
        let device = Device::flex();
        // Width L + 1 for the probe's basis vectors.
        let mut mudd = randomised(MuddConfig::new(4).init(3, &device).unwrap());
        for layer in &mut mudd.layers {
            layer.w2 = Param::from_tensor(layer.w2.val().zeros_like());
        }
        let probed = probe_matrix(&mudd, &device).unwrap();
        let matrix = mudd.matrix();
        for (row, expected) in matrix.matrix.iter().zip(&probed.matrix) {
            for (value, expected) in row.iter().zip(expected) {
                assert!((value - expected).abs() < 1e-5, "{matrix:?} vs {probed:?}");
            }
        }
        for (value, expected) in matrix.output.iter().zip(&probed.output) {
            assert!((value - expected).abs() < 1e-5);
        }
    }

    #[test]
    fn truncation_reproduces_the_readout() {
        let device = Device::flex();
        for config in [MuddConfig::new(WIDTH), MuddConfig::multiway(WIDTH)] {
            let stack = Stack::new(blocks(4, &device), &config, &device).unwrap();
            let stack = Stack::from_parts(stack.blocks, randomised(stack.connectivity)).unwrap();
            let x = input(&device);
            let readout = stack.readout(x.clone());
            for (depth, expected) in readout.iter().enumerate().skip(1) {
                assert_close(
                    stack.truncated(depth).unwrap().forward(x.clone()),
                    expected.clone(),
                );
            }
        }
    }

    #[test]
    fn bad_settings_are_typed_errors_naming_them() {
        let device = Device::flex();
        let name = |config: MuddConfig| refused_setting(config, &device);
        assert_eq!(name(MuddConfig::new(0)), "MUDD width");
        assert_eq!(name(MuddConfig::new(8).with_epsilon(0.0)), "MUDD epsilon");
        assert!(matches!(
            MuddConfig::new(8).init(0, &device),
            Err(Error::NoBlocks)
        ));
        let stack = Stack::new(blocks(2, &device), &MuddConfig::new(WIDTH + 1), &device).unwrap();
        assert!(matches!(
            stack.check_input(&input(&device)),
            Err(Error::WidthMismatch { .. })
        ));
    }
}
