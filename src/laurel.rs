//! LAuReL: learned augmented residual layers (Menghani, Kumar, Kumar; ICML 2025,
//! arXiv 2411.07501), and the form Gemma 3n ships (Hugging Face `transformers`'
//! `Gemma3nTextLaurelBlock`; MATH §5.7).
//!
//! The paper generalises `s_{i+1} = f_i(s_i) + s_i` to `s_{i+1} = α f_i(s_i) + g(s_i, s_{i−1}, …)`
//! with a learned linear `g`. Block `i` (0-based) reads `s_i` and returns `h_i`; `s_0 = x`,
//! `y = s_L`. With `k_i = min(k, i + 1)` earlier states:
//!
//! ```text
//! paper:    s_{i+1} = α_i h_i + β_i (s_i + Σ_{j<k_i} γ_{i,j} · s_{i−j} A_{i,j} B_{i,j})
//! Gemma 3n: u_i = rms(s_i) ⊙ w_in,   s_{i+1} = (s_i + h_i + u_i + rms(u_i A_i B_i) ⊙ w_out) / √2
//! rms(v)  = v / sqrt(mean(v²) + ε)
//! ```
//!
//! | variant | settings | `α, β` | low-rank terms |
//! |---|---|---|---|
//! | RW | `reweight`, no `rank` | `2σ(a), 2σ(b)` | none |
//! | LR | `rank = r` | 1 | `s_i A B` (`γ ≡ 1`) |
//! | RW+LR | `reweight`, `rank` | `2σ(a), 2σ(b)` | `s_i A B` |
//! | PA | `rank`, `previous = k > 1` | 1 | `Σ_j γ_j s_{i−j} A_j B_j` |
//! | RW+LR+PA | all three | `2σ(a), 2σ(b)` | as PA |
//! | Gemma 3n | `form = Gemma3n`, `rank` | — | `rms(u A B)` |
//!
//! `A` (`down`) is `[d, r]`, `B` (`up`) `[r, d]`: `s A B` costs `4rd` flops per token.
//!
//! **Decisions (MATH §5.7).** The paper says only that `α, β` must stay bounded ("softmax or
//! sigmoid helps"); here `α = 2σ(a)`, `β = 2σ(b)`, `a = b = 0` at init: bounded in `(0, 2)` and
//! exactly the residual at init. Its shapes contradict each other (`A, Bᵀ ∈ ℝ^{D×r}` against
//! `BAx` in eq. 3); this crate reads them as down-projection then up-projection, as Gemma 3n's
//! `linear_left`, `linear_right`. PA takes one `A_{i,j}B_{i,j}` per earlier state (eq. 6,
//! Table 4's `2rkD` parameters), `γ = 1` at init. The paper's init for LLMs: `A[p][q] = 1/√(rd)`
//! where `p mod r = q`, `B = 0`, so every paper form starts as the residual. The Gemma 3n form
//! takes its own input norm `w_in` (in Gemma 3n it is the attention's input norm, which a
//! [`Block`](crate::Block) keeps inside) and `transformers`' init (`A, B ~ N(0, init_std)`, norm
//! weights 1); its `/√2` and `rms` keep it from ever being the residual.
//!
//! **Backends.** On Flex (f32, f64) LAuReL-LR's update, `s_i + h_i + s_i A B` (one low-rank
//! term, no RW or PA), is one fused op forward and one backward that keep `s_i A` for the
//! backward, not `h_i`; the other forms, and other backends, run Burn's tensor ops.
//!
//! **The matrix `C`** holds the scalar part of the recursion: `α_i`, `β_i` (or `1/√2`); the
//! low-rank terms (zero at the paper's init) and Gemma's normed input are matrices per token,
//! not scalars, and are left out.
//!
//! # Shapes
//! - input, block inputs and outputs: `[..., d]`
//! - `layers[i].down[j]`: `[d, r]`, `up[j]`: `[r, d]`, `gamma`: `[k_i]`, `alpha`, `beta`: `[1]`,
//!   `input_norm`, `output_norm`: `[d]`
//!
//! # Example
//! ```
//! use burn::prelude::*;
//! use burn_connectivity::{LaurelConfig, MlpBlockConfig, Stack};
//!
//! let device = Device::default();
//! let blocks = MlpBlockConfig::new(16, 32).init_stack(4, &device)?;
//! let stack = Stack::new(blocks, &LaurelConfig::rw_lr(16, 4), &device)?;
//! let y = stack.forward(Tensor::<3>::ones([2, 5, 16], &device));
//! assert_eq!(y.dims(), [2, 5, 16]);
//! # Ok::<(), burn_connectivity::Error>(())
//! ```

use burn::module::Param;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::activation::sigmoid;

use crate::activation::rms_normalised;
use crate::backend::LowRankResidual;
use crate::connectivity::{Connectivity, ConnectivityConfig, StreamConnectivity};
use crate::error::{Error, Result, check_depth, check_non_negative, check_positive, check_size};
use crate::matrix::ConnectivityMatrix;
use crate::multi_stream::check_width;

/// Which LAuReL update the layers make.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum LaurelForm {
    /// The paper's RW / LR / PA and their combinations.
    Paper,
    /// Gemma 3n's block: a normed low-rank term on a normed input, the sum scaled by `1/√2`.
    Gemma3n,
}

/// Configuration of [`Laurel`]; the named constructors give the paper's variants.
#[derive(Config, Debug)]
pub struct LaurelConfig {
    /// The stream width `d`.
    pub width: usize,
    /// LAuReL-RW: learned `α`, `β`.
    #[config(default = false)]
    pub reweight: bool,
    /// LAuReL-LR's rank `r` (`None`: no low-rank term, RW alone).
    #[config(default = "Some(16)")]
    pub rank: Option<usize>,
    /// LAuReL-PA's `k`: the earlier states each update reads (1: LR's `s_i` alone).
    #[config(default = 1)]
    pub previous: usize,
    /// The paper's update or Gemma 3n's.
    #[config(default = "LaurelForm::Paper")]
    pub form: LaurelForm,
    /// `ε` of Gemma 3n's norms.
    #[config(default = 1e-6)]
    pub epsilon: f64,
    /// Standard deviation of Gemma 3n's `A`, `B` at init (`initializer_range`).
    #[config(default = 0.02)]
    pub init_std: f64,
}

impl LaurelConfig {
    /// LAuReL-RW: `s_{i+1} = α h_i + β s_i`.
    pub fn rw(width: usize) -> Self {
        Self::new(width).with_reweight(true).with_rank(None)
    }

    /// LAuReL-LR of rank `rank`: `s_{i+1} = h_i + s_i + s_i A B`.
    pub fn lr(width: usize, rank: usize) -> Self {
        Self::new(width).with_rank(Some(rank))
    }

    /// LAuReL-RW+LR: `s_{i+1} = α h_i + β (s_i + s_i A B)` (the paper's LLM runs).
    pub fn rw_lr(width: usize, rank: usize) -> Self {
        Self::lr(width, rank).with_reweight(true)
    }

    /// LAuReL-PA over `previous` earlier states, rank `rank`.
    pub fn pa(width: usize, rank: usize, previous: usize) -> Self {
        Self::lr(width, rank).with_previous(previous)
    }

    /// LAuReL-RW+LR+PA.
    pub fn rw_lr_pa(width: usize, rank: usize, previous: usize) -> Self {
        Self::pa(width, rank, previous).with_reweight(true)
    }

    /// Gemma 3n's LAuReL block of rank `rank` (Gemma 3n: 64).
    pub fn gemma3n(width: usize, rank: usize) -> Self {
        Self::lr(width, rank).with_form(LaurelForm::Gemma3n)
    }

    fn check(&self) -> Result<()> {
        check_size("LAuReL width", self.width)?;
        if let Some(rank) = self.rank {
            check_size("LAuReL rank", rank)?;
        }
        check_size("LAuReL previous", self.previous)?;
        check_positive("LAuReL epsilon", self.epsilon)?;
        check_non_negative("LAuReL init_std", self.init_std)?;
        let refuse = |name, value: usize, requirement| {
            Err(Error::OutOfRange {
                name,
                value: value as f64,
                requirement,
            })
        };
        if self.rank.is_none() && self.previous > 1 {
            return refuse(
                "LAuReL previous",
                self.previous,
                "1 without a rank (PA's terms are low-rank)",
            );
        }
        if self.form == LaurelForm::Gemma3n {
            if self.rank.is_none() {
                return refuse("LAuReL rank", 0, "set for the Gemma 3n form");
            }
            if self.previous > 1 {
                return refuse("LAuReL previous", self.previous, "1 for the Gemma 3n form");
            }
            if self.reweight {
                return refuse("LAuReL reweight", 1, "off for the Gemma 3n form");
            }
        }
        Ok(())
    }
}

impl ConnectivityConfig for LaurelConfig {
    type Connectivity = Laurel;

    fn init(&self, num_blocks: usize, device: &Device) -> Result<Laurel> {
        if num_blocks == 0 {
            return Err(Error::NoBlocks);
        }
        self.check()?;
        let layers = (0..num_blocks)
            .map(|block| LaurelLayer::new(self, block, device))
            .collect();
        Ok(Laurel {
            layers,
            width: self.width,
            form: self.form,
            epsilon: self.epsilon,
        })
    }
}

/// The parameters of one block's update (absent where the variant has no such term).
#[derive(Module, Debug)]
pub struct LaurelLayer {
    /// `a` (`α = 2σ(a)`), `[1]` (RW).
    pub alpha: Option<Param<Tensor<1>>>,
    /// `b` (`β = 2σ(b)`), `[1]` (RW).
    pub beta: Option<Param<Tensor<1>>>,
    /// `γ_{i,j}`, `[k_i]` (PA).
    pub gamma: Option<Param<Tensor<1>>>,
    /// `A_{i,j}`, `[d, r]`, for `j < k_i`.
    pub down: Vec<Param<Tensor<2>>>,
    /// `B_{i,j}`, `[r, d]`, for `j < k_i`.
    pub up: Vec<Param<Tensor<2>>>,
    /// Gemma 3n's `w_in`, `[d]`.
    pub input_norm: Option<Param<Tensor<1>>>,
    /// Gemma 3n's `w_out` (`post_laurel_norm`), `[d]`.
    pub output_norm: Option<Param<Tensor<1>>>,
}

impl LaurelLayer {
    fn new(config: &LaurelConfig, block: usize, device: &Device) -> Self {
        let width = config.width;
        let terms = match config.rank {
            Some(_) => config.previous.min(block + 1),
            None => 0,
        };
        let rank = config.rank.unwrap_or(0);
        let gemma = config.form == LaurelForm::Gemma3n;
        let scalar = |value: f64| Param::from_tensor(Tensor::full([1], value, device));
        let normal = |shape: [usize; 2]| {
            Param::from_tensor(Tensor::random(
                shape,
                Distribution::Normal(0.0, config.init_std),
                device,
            ))
        };
        // The paper's init for LLMs: column-orthogonal `A`, zero `B`.
        let orthogonal = || {
            let value = 1.0 / ((rank * width) as f64).sqrt();
            let values: Vec<f64> = (0..width * rank)
                .map(|k| {
                    if (k / rank) % rank == k % rank {
                        value
                    } else {
                        0.0
                    }
                })
                .collect();
            Param::from_tensor(Tensor::from_data(
                TensorData::new(values, [width, rank]),
                device,
            ))
        };
        let (down, up) = (0..terms)
            .map(|_| match gemma {
                true => (normal([width, rank]), normal([rank, width])),
                false => (
                    orthogonal(),
                    Param::from_tensor(Tensor::zeros([rank, width], device)),
                ),
            })
            .unzip();
        let ones = || Some(Param::from_tensor(Tensor::ones([width], device)));
        Self {
            alpha: config.reweight.then(|| scalar(0.0)),
            beta: config.reweight.then(|| scalar(0.0)),
            gamma: (config.previous > 1).then(|| Param::from_tensor(Tensor::ones([terms], device))),
            down,
            up,
            input_norm: if gemma { ones() } else { None },
            output_norm: if gemma { ones() } else { None },
        }
    }

    /// `2σ(a)`, `2σ(b)` as `[1]` tensors, or `None` without RW.
    fn gains(&self) -> Option<(Tensor<1>, Tensor<1>)> {
        let gain = |logit: &Param<Tensor<1>>| sigmoid(logit.val()).mul_scalar(2.0);
        Some((gain(self.alpha.as_ref()?), gain(self.beta.as_ref()?)))
    }
}

/// `v A B` over the last axis of `v`.
fn low_rank<const D: usize>(value: &Tensor<D>, down: &Tensor<2>, up: &Tensor<2>) -> Tensor<D> {
    crate::backend::on_rows(value.clone(), |rows| {
        rows.matmul(down.clone()).matmul(up.clone())
    })
}

/// A `[d]` or `[1]` vector broadcast against rank-`D` tensors.
fn broadcast<const D: usize>(vector: Tensor<1>) -> Tensor<D> {
    vector.unsqueeze::<D>()
}

/// LAuReL (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct Laurel {
    /// Every block's update.
    pub layers: Vec<LaurelLayer>,
    /// The stream width `d`.
    pub width: usize,
    /// The paper's update or Gemma 3n's.
    #[module(skip)]
    pub form: LaurelForm,
    /// `ε` of Gemma 3n's norms.
    pub epsilon: f64,
}

/// The running state of [`Laurel`]: the latest states, newest first (as many as an update
/// reads).
#[derive(Debug, Clone)]
pub struct LaurelState<const D: usize> {
    recent: Vec<Tensor<D>>,
    /// The fused LR update, where this pass's tensors take it (chosen once, at the start).
    fused: Option<LowRankResidual>,
}

impl Laurel {
    /// `(α_i, β_i)` per block (`(1, 1)` without RW; `(1/√2, 1/√2)` in the Gemma 3n form), read
    /// back to the host.
    pub fn gains(&self) -> Vec<(f64, f64)> {
        self.layers
            .iter()
            .map(|layer| match (self.form, layer.gains()) {
                (LaurelForm::Gemma3n, _) => (
                    std::f64::consts::FRAC_1_SQRT_2,
                    std::f64::consts::FRAC_1_SQRT_2,
                ),
                (_, Some((alpha, beta))) => (alpha.into_scalar::<f64>(), beta.into_scalar::<f64>()),
                (_, None) => (1.0, 1.0),
            })
            .collect()
    }

    /// The earlier states each update reads (`k`).
    fn previous(&self) -> usize {
        self.layers
            .iter()
            .map(|layer| layer.down.len())
            .max()
            .unwrap_or(0)
            .max(1)
    }

    /// Whether the layers have a width of their own (a low-rank term or norms).
    fn has_width(&self) -> bool {
        self.layers.iter().any(|layer| !layer.down.is_empty())
    }

    /// The paper's update of block `layer` from the recent states and the branch; LR's
    /// through `fused` where given.
    fn paper_update<const D: usize>(
        &self,
        layer: &LaurelLayer,
        recent: &[Tensor<D>],
        branch: Tensor<D>,
        fused: Option<LowRankResidual>,
    ) -> Tensor<D> {
        let plain = layer.gamma.is_none() && (layer.alpha.is_none() || layer.beta.is_none());
        if let (Some(fused), [down], [up], true) = (fused, &layer.down[..], &layer.up[..], plain) {
            return fused.apply(recent[0].clone(), branch, down.val(), up.val());
        }
        let gamma = layer.gamma.as_ref().map(|gamma| gamma.val());
        let augmented = layer
            .down
            .iter()
            .zip(&layer.up)
            .zip(recent)
            .enumerate()
            .map(|(j, ((down, up), state))| {
                let term = low_rank(state, &down.val(), &up.val());
                match &gamma {
                    Some(gamma) => term * broadcast::<D>(gamma.clone().narrow(0, j, 1)),
                    None => term,
                }
            })
            .fold(recent[0].clone(), |sum, term| sum + term);
        match layer.gains() {
            Some((alpha, beta)) => {
                branch * broadcast::<D>(alpha) + augmented * broadcast::<D>(beta)
            }
            None => branch + augmented,
        }
    }

    /// Gemma 3n's update.
    fn gemma_update<const D: usize>(
        &self,
        layer: &LaurelLayer,
        stream: Tensor<D>,
        branch: Tensor<D>,
    ) -> Tensor<D> {
        let weight = |norm: &Option<Param<Tensor<1>>>| {
            broadcast::<D>(norm.as_ref().expect("the Gemma 3n form has norms").val())
        };
        let normed = rms_normalised(stream.clone(), self.epsilon) * weight(&layer.input_norm);
        let term = low_rank(&normed, &layer.down[0].val(), &layer.up[0].val());
        let term = rms_normalised(term, self.epsilon) * weight(&layer.output_norm);
        (stream + branch + normed + term).mul_scalar(std::f64::consts::FRAC_1_SQRT_2)
    }
}

impl Connectivity for Laurel {
    fn num_blocks(&self) -> usize {
        self.layers.len()
    }

    fn matrix(&self) -> ConnectivityMatrix {
        let size = self.layers.len() + 1;
        let mut stream = vec![0.0; size];
        stream[0] = 1.0;
        let mut columns = vec![vec![0.0; size]];
        for (block, (alpha, beta)) in self.gains().into_iter().enumerate() {
            columns.push(stream.clone());
            stream.iter_mut().for_each(|value| *value *= beta);
            stream[block + 1] += alpha;
        }
        ConnectivityMatrix::from_columns(&columns, stream).expect("L+1 columns of L+1 entries")
    }

    fn truncated(&self, depth: usize) -> Result<Self> {
        check_depth(depth, 1, self.layers.len())?;
        Ok(Self {
            layers: self.layers[..depth].to_vec(),
            ..self.clone()
        })
    }

    fn stream_width(&self) -> Option<usize> {
        self.has_width().then_some(self.width)
    }

    fn check_input(&self, dims: &[usize]) -> Result<()> {
        if self.has_width() {
            return check_width("LAuReL", self.width, dims);
        }
        Ok(())
    }
}

impl<const D: usize> StreamConnectivity<D> for Laurel {
    type State = LaurelState<D>;

    fn start(&self, input: Tensor<D>) -> LaurelState<D> {
        let fused = match self.form {
            LaurelForm::Paper => LowRankResidual::for_tensor(&input),
            LaurelForm::Gemma3n => None,
        };
        LaurelState {
            recent: vec![input],
            fused,
        }
    }

    fn block_input(&self, state: &LaurelState<D>) -> Tensor<D> {
        state.recent[0].clone()
    }

    fn step_with_tail(
        &self,
        state: LaurelState<D>,
        block: usize,
        branch: Tensor<D>,
        tail: impl FnOnce(Tensor<D>) -> Tensor<D>,
    ) -> LaurelState<D> {
        let layer = &self.layers[block];
        let LaurelState { mut recent, fused } = state;
        let combined = match self.form {
            LaurelForm::Paper => self.paper_update(layer, &recent, branch, fused),
            LaurelForm::Gemma3n => self.gemma_update(layer, recent[0].clone(), branch),
        };
        recent.insert(0, tail(combined));
        recent.truncate(self.previous());
        LaurelState { recent, fused }
    }

    fn output(&self, state: &LaurelState<D>) -> Tensor<D> {
        state.recent[0].clone()
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Tolerance;

    use super::*;
    use crate::stack::Stack;
    use crate::test_util::{WIDTH, assert_close, blocks, input, refused_setting, residual_loop};
    use crate::{Block, probe_matrix};

    fn randomised(mut laurel: Laurel, device: &Device) -> Laurel {
        let noise = |tensor: Tensor<2>| tensor.random_like(Distribution::Normal(0.0, 0.5));
        for layer in &mut laurel.layers {
            for up in &mut layer.up {
                *up = Param::from_tensor(noise(up.val()));
            }
            for scalar in [&mut layer.alpha, &mut layer.beta].into_iter().flatten() {
                *scalar = Param::from_tensor(Tensor::from_floats([0.7], device));
            }
            if let Some(gamma) = &mut layer.gamma {
                *gamma = Param::from_tensor(gamma.val().mul_scalar(-0.5));
            }
        }
        laurel
    }

    /// Every paper form is exactly the residual at init (`B = 0`, `α = β = 1`).
    #[test]
    fn paper_forms_start_as_the_residual() {
        let device = Device::flex();
        for config in [
            LaurelConfig::rw(WIDTH),
            LaurelConfig::lr(WIDTH, 2),
            LaurelConfig::rw_lr(WIDTH, 2),
            LaurelConfig::pa(WIDTH, 2, 3),
            LaurelConfig::rw_lr_pa(WIDTH, 2, 3),
        ] {
            let stack = Stack::new(blocks(4, &device), &config, &device).unwrap();
            let x = input(&device);
            assert_close(stack.forward(x.clone()), residual_loop(&stack.blocks, x));
            let matrix = stack.matrix();
            for (i, row) in matrix.matrix.iter().enumerate() {
                for (j, value) in row.iter().enumerate() {
                    assert_eq!(*value, f64::from(u8::from(i < j)), "{config:?}");
                }
            }
        }
    }

    /// RW+LR+PA by hand for three blocks.
    #[test]
    fn forward_is_the_update_by_hand() {
        let device = Device::flex();
        let config = LaurelConfig::rw_lr_pa(WIDTH, 2, 2);
        let stack = Stack::new(blocks(3, &device), &config, &device).unwrap();
        let laurel = randomised(stack.connectivity.clone(), &device);
        let stack = Stack::from_parts(stack.blocks, laurel).unwrap();
        let x = input(&device);
        let gain = |logit: &Option<Param<Tensor<1>>>| {
            let a = logit.as_ref().unwrap().val().into_scalar::<f64>();
            2.0 / (1.0 + (-a).exp())
        };
        let mut states = vec![x.clone()];
        for (i, (block, layer)) in stack
            .blocks
            .iter()
            .zip(&stack.connectivity.layers)
            .enumerate()
        {
            let s = states[i].clone();
            let h = block.branch(s.clone(), &());
            let gamma: Vec<f64> = layer
                .gamma
                .as_ref()
                .unwrap()
                .val()
                .into_data()
                .iter::<f64>()
                .collect();
            let mut augmented = s.clone();
            for j in 0..i.min(1) + 1 {
                let product = low_rank(&states[i - j], &layer.down[j].val(), &layer.up[j].val());
                augmented = augmented + product.mul_scalar(gamma[j]);
            }
            states.push(h.mul_scalar(gain(&layer.alpha)) + augmented.mul_scalar(gain(&layer.beta)));
        }
        let close = |actual: Tensor<3>, expected: Tensor<3>| {
            let tolerance = Tolerance::rel_abs(1e-5, 1e-5);
            actual
                .into_data()
                .assert_approx_eq::<f32>(&expected.into_data(), tolerance);
        };
        close(stack.forward(x.clone()), states[3].clone());
        let readout = stack.readout(x);
        for (k, state) in states.into_iter().enumerate() {
            close(readout[k].clone(), state);
        }
    }

    /// The matrix is the probed recursion of RW, and the scalar part of the others.
    #[test]
    fn matrix_is_the_scalar_recursion() {
        let device = Device::flex();
        let rw = LaurelConfig::rw(4).init(3, &device).unwrap();
        let rw = randomised(rw, &device);
        let probed = probe_matrix(&rw, &device).unwrap();
        let matrix = rw.matrix();
        for (row, expected) in matrix.matrix.iter().zip(&probed.matrix) {
            for (value, expected) in row.iter().zip(expected) {
                assert!((value - expected).abs() < 1e-5, "{matrix:?} vs {probed:?}");
            }
        }
        let gemma = LaurelConfig::gemma3n(WIDTH, 2).init(2, &device).unwrap();
        let half = std::f64::consts::FRAC_1_SQRT_2;
        let matrix = gemma.matrix();
        // `s_1 = (x + h_1)/√2`, `y = s_2 = (s_1 + h_2)/√2`.
        assert!((matrix.matrix[0][2] - half).abs() < 1e-12);
        assert!((matrix.output[0] - 0.5).abs() < 1e-12);
        assert!((matrix.output[2] - half).abs() < 1e-12);
    }

    #[test]
    fn truncation_reproduces_the_readout() {
        let device = Device::flex();
        for config in [
            LaurelConfig::rw_lr_pa(WIDTH, 2, 3),
            LaurelConfig::gemma3n(WIDTH, 3),
        ] {
            let stack = Stack::new(blocks(4, &device), &config, &device).unwrap();
            let stack =
                Stack::from_parts(stack.blocks, randomised(stack.connectivity, &device)).unwrap();
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
        let name = |config: LaurelConfig| refused_setting(config, &device);
        assert_eq!(name(LaurelConfig::lr(0, 2)), "LAuReL width");
        assert_eq!(name(LaurelConfig::lr(8, 0)), "LAuReL rank");
        assert_eq!(name(LaurelConfig::pa(8, 2, 0)), "LAuReL previous");
        assert_eq!(
            name(LaurelConfig::rw(8).with_previous(2)),
            "LAuReL previous"
        );
        assert_eq!(
            name(LaurelConfig::gemma3n(8, 2).with_rank(None)),
            "LAuReL rank"
        );
        assert_eq!(
            name(LaurelConfig::gemma3n(8, 2).with_previous(2)),
            "LAuReL previous"
        );
        assert_eq!(
            name(LaurelConfig::gemma3n(8, 2).with_reweight(true)),
            "LAuReL reweight"
        );
        assert_eq!(
            name(LaurelConfig::gemma3n(8, 2).with_epsilon(0.0)),
            "LAuReL epsilon"
        );
        assert!(matches!(
            LaurelConfig::lr(8, 2).init(0, &device),
            Err(Error::NoBlocks)
        ));
        // A width the low-rank terms fix is checked against the stack input.
        let stack =
            Stack::new(blocks(2, &device), &LaurelConfig::lr(WIDTH + 1, 2), &device).unwrap();
        assert!(matches!(
            stack.check_input(&input(&device)),
            Err(Error::WidthMismatch { .. })
        ));
    }
}
