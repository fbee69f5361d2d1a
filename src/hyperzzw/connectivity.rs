//! HyperZZW as a connectivity for any stack of token blocks (MATH §3.5).
//!
//! No identity shortcut: block `j`'s output `h_j = f_j(s_{j-1})` and its input `s_{j-1}` are
//! fused by global and local HyperZZW branches and a bottleneck back to width `d`. On
//! `[B, T, d]` streams, with `H = h_jᵀ`, `Z = s_{j-1}ᵀ` (`[B, d, T]`: channels `d`, positions `T`):
//!
//! ```text
//! K̂   = Z ⊙ K_j[.., 0..T]                 K_j: the block's slow-net kernel over max_len positions
//! g   = conv(H, K̂)                        global branch, causal (default) or same crop
//! l_i = Local_{k_i}(Z → H)                 local branches: kernel from the input, applied to the output
//! s_j = ([H; g; l_1; …] W_j + b_j)ᵀ        bottleneck (2 + #locals)·d → d
//! ```
//!
//! `W_j` starts as the identity on `H` plus `N(0, 1/fan_in)` on the other branches, so an
//! untrained stack behaves like an ACN chain perturbed by the HyperZZW branches. The kernel is
//! generated once on `max_len` points and the first `T` are used, so position `t` always meets
//! the same kernel value whatever the sequence length.
//!
//! **Causality**: with the causal crop the global branch only mixes the past. The local branches
//! are not causal (their kernels come from the whole sequence, pooled, and averaged over the
//! batch, and their convolution is centred): use no local branch for autoregressive models.
//!
//! **Connectivity matrix**: `C` holds additive coefficients of branch outputs, and the only
//! additive path here is the chain (block `j` reads the fusion of `h_{j-1}`); the dependence on
//! earlier states through `K̂` is multiplicative and data-dependent. So `C[j-1][j] = 1`, the
//! other entries are 0, and `out = e_L`.

use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::Distribution;

use crate::backend::narrow_or_whole;
use crate::connectivity::{Connectivity, ConnectivityConfig, StreamConnectivity};
use crate::error::{Error, Result, check_depth, check_positive, check_size};
use crate::hyperzzw::fft::FftPath;
use crate::hyperzzw::global::{Crop, fft_conv_1d};
use crate::hyperzzw::local::{LocalHyperZzw, LocalHyperZzwConfig};
use crate::hyperzzw::slow_net::{SlowNet, SlowNetConfig, linear};
use crate::matrix::ConnectivityMatrix;

/// Configuration of [`HyperZzwConnectivity`].
#[derive(Config, Debug)]
pub struct HyperZzwConnectivityConfig {
    /// Model width `d`.
    pub d_model: usize,
    /// Longest sequence the stack accepts (the global kernels have this many points).
    pub max_len: usize,
    /// Kernel sizes of the local branches (odd); empty for a causal stack.
    #[config(default = "vec![3]")]
    pub local_kernel_sizes: Vec<usize>,
    /// Hidden width of the slow nets.
    #[config(default = 32)]
    pub hidden: usize,
    /// Multiplicative layers of the slow nets.
    #[config(default = 2)]
    pub layers: usize,
    /// Frequency scale ω0 of the slow nets.
    #[config(default = 2000.0)]
    pub omega_0: f64,
    /// Crop of the global convolution (causal by default).
    #[config(default = "Crop::Causal")]
    pub crop: Crop,
    /// s-renormalisation in the global kernel generators (Terminator §2.2; see [`SlowNet`]).
    #[config(default = true)]
    pub global_s_renorm: bool,
}

impl ConnectivityConfig for HyperZzwConnectivityConfig {
    type Connectivity = HyperZzwConnectivity;

    fn init(&self, num_blocks: usize, device: &Device) -> Result<HyperZzwConnectivity> {
        if num_blocks == 0 {
            return Err(Error::NoBlocks);
        }
        check_size("HyperZZW width", self.d_model)?;
        check_size("HyperZZW max length", self.max_len)?;
        check_positive("HyperZZW omega_0", self.omega_0)?;
        if let Some(&kernel_size) = self.local_kernel_sizes.iter().find(|&&k| k > self.max_len) {
            return Err(Error::OutOfRange {
                name: "HyperZZW local kernel size",
                value: kernel_size as f64,
                requirement: "at most max_len",
            });
        }
        let d = self.d_model;
        let fusions = (0..num_blocks)
            .map(|_| {
                let global = SlowNetConfig::new(vec![self.max_len], d)
                    .with_hidden(self.hidden)
                    .with_layers(self.layers)
                    .with_omega_0(self.omega_0)
                    .with_s_renorm(self.global_s_renorm)
                    .init(device)?;
                let locals = self
                    .local_kernel_sizes
                    .iter()
                    .map(|&k| {
                        LocalHyperZzwConfig::new(d, k)
                            .with_hidden(self.hidden)
                            .with_layers(self.layers)
                            .with_omega_0(self.omega_0)
                            .init(device)
                    })
                    .collect::<Result<Vec<_>>>()?;
                let fan_in = (2 + locals.len()) * d;
                let others = Tensor::<2>::random(
                    [fan_in - d, d],
                    Distribution::Normal(0.0, (1.0 / fan_in as f64).sqrt()),
                    device,
                );
                let weight = Tensor::cat(vec![Tensor::eye(d, device), others], 0);
                Ok(Fusion {
                    global,
                    locals,
                    bottleneck: linear(weight, Tensor::zeros([d], device)),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(HyperZzwConnectivity {
            fusions,
            crop: self.crop,
        })
    }
}

/// The fusion of one block's output with its input.
#[derive(Module, Debug)]
pub struct Fusion {
    /// The global kernel generator `K_j` over `max_len` points, `d` channels.
    pub global: SlowNet,
    /// The local branches.
    pub locals: Vec<LocalHyperZzw>,
    /// `(2 + #locals)·d → d`.
    pub bottleneck: Linear,
}

impl Fusion {
    /// `s_j` from `branch = h_j` and `input = s_{j-1}`, both `[B, T, d]`.
    fn forward(&self, branch: Tensor<3>, input: Tensor<3>, crop: Crop, path: FftPath) -> Tensor<3> {
        let length = branch.dims()[1];
        let (output, context) = (branch.swap_dims(1, 2), input.swap_dims(1, 2));
        let kernel = narrow_or_whole(self.global.kernel(), 0, 0, length)
            .transpose()
            .unsqueeze_dim(0);
        let global = fft_conv_1d(output.clone(), context.clone() * kernel, crop, path);
        let mut branches = vec![output.clone(), global];
        for local in &self.locals {
            branches.push(
                local
                    .forward(context.clone(), output.clone())
                    .expect("width checked at construction, length by check_input"),
            );
        }
        self.bottleneck
            .forward(Tensor::cat(branches, 1).swap_dims(1, 2))
    }
}

/// HyperZZW fusion instead of identity shortcuts (see the [module docs](self)).
#[derive(Module, Debug)]
pub struct HyperZzwConnectivity {
    /// One fusion per block.
    pub fusions: Vec<Fusion>,
    /// Crop of the global convolutions.
    #[module(skip)]
    pub crop: Crop,
}

/// The running state of [`HyperZzwConnectivity`]: the stream and the FFT path of its device.
#[derive(Debug, Clone)]
pub struct HyperZzwState {
    /// The stream `s_j`.
    pub stream: Tensor<3>,
    path: FftPath,
}

impl HyperZzwConnectivity {
    fn d_model(&self) -> usize {
        self.fusions[0].bottleneck.weight.dims()[1]
    }

    fn max_len(&self) -> usize {
        self.fusions[0].global.grid[0]
    }
}

impl Connectivity for HyperZzwConnectivity {
    fn num_blocks(&self) -> usize {
        self.fusions.len()
    }

    /// The chain: `C[j-1][j] = 1`, `out = e_L` (see the [module docs](self)).
    fn matrix(&self) -> ConnectivityMatrix {
        let size = self.num_blocks() + 1;
        let matrix = (0..size)
            .map(|i| {
                (0..size)
                    .map(|j| if i + 1 == j { 1.0 } else { 0.0 })
                    .collect()
            })
            .collect();
        let output = (0..size)
            .map(|i| if i + 1 == size { 1.0 } else { 0.0 })
            .collect();
        ConnectivityMatrix { matrix, output }
    }

    fn truncated(&self, depth: usize) -> Result<Self> {
        check_depth(depth, 1, self.num_blocks())?;
        Ok(Self {
            fusions: self.fusions[..depth].to_vec(),
            crop: self.crop,
        })
    }

    /// `[B, T, d]` inputs with `T <= max_len` and the configured `d`.
    fn check_input(&self, dims: &[usize]) -> Result<()> {
        let [_, length, width] = dims[..] else {
            return Err(Error::WidthMismatch {
                name: "HyperZZW input rank".into(),
                expected: 3,
                found: dims.len(),
            });
        };
        if width != self.d_model() {
            return Err(Error::WidthMismatch {
                name: "HyperZZW input width".into(),
                expected: self.d_model(),
                found: width,
            });
        }
        let shortest = self.fusions[0]
            .locals
            .iter()
            .map(LocalHyperZzw::kernel_size)
            .max()
            .unwrap_or(1);
        if length < shortest || length > self.max_len() {
            return Err(Error::OutOfRange {
                name: "HyperZZW sequence length",
                value: length as f64,
                requirement: "between the largest local kernel size and max_len",
            });
        }
        Ok(())
    }
}

impl StreamConnectivity<3> for HyperZzwConnectivity {
    type State = HyperZzwState;

    fn start(&self, input: Tensor<3>) -> HyperZzwState {
        let path = FftPath::for_device(&input.device());
        HyperZzwState {
            stream: input,
            path,
        }
    }

    fn block_input(&self, state: &HyperZzwState) -> Tensor<3> {
        state.stream.clone()
    }

    /// # Panics
    /// If the sequence is longer than `max_len` or shorter than a local kernel (check with
    /// [`Stack::check_input`](crate::Stack::check_input)).
    fn step_with_tail(
        &self,
        state: HyperZzwState,
        block: usize,
        branch: Tensor<3>,
        tail: impl FnOnce(Tensor<3>) -> Tensor<3>,
    ) -> HyperZzwState {
        let stream = tail(self.fusions[block].forward(branch, state.stream, self.crop, state.path));
        HyperZzwState {
            stream,
            path: state.path,
        }
    }

    fn output(&self, state: &HyperZzwState) -> Tensor<3> {
        state.stream.clone()
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Tolerance;

    use super::*;
    use crate::mlp::MlpBlockConfig;
    use crate::stack::Stack;

    fn config() -> HyperZzwConnectivityConfig {
        HyperZzwConnectivityConfig::new(8, 16)
            .with_hidden(8)
            .with_omega_0(10.0)
    }

    #[test]
    fn wraps_a_stack_of_blocks_and_keeps_the_stream_shape() {
        let device = Device::flex();
        let blocks = MlpBlockConfig::new(8, 16).init_stack(3, &device).unwrap();
        let stack = Stack::new(blocks, &config(), &device).unwrap();
        let x = Tensor::<3>::random([2, 10, 8], Distribution::Normal(0.0, 1.0), &device);
        assert!(stack.check_input(&x).is_ok());
        assert_eq!(stack.forward(x.clone()).dims(), [2, 10, 8]);
        let readout = stack.readout(x.clone());
        let truncated = stack.truncated(2).unwrap();
        truncated
            .forward(x)
            .into_data()
            .assert_approx_eq::<f32>(&readout[2].clone().into_data(), Tolerance::absolute(1e-5));
        let c = stack.matrix();
        assert_eq!(c.matrix[2][3], 1.0);
        assert_eq!(c.matrix[1][3], 0.0);
        assert_eq!(c.output, vec![0.0, 0.0, 0.0, 1.0]);
    }

    #[test]
    fn without_local_branches_the_stack_is_causal() {
        let device = Device::flex();
        let blocks = MlpBlockConfig::new(8, 16).init_stack(2, &device).unwrap();
        let stack = Stack::new(blocks, &config().with_local_kernel_sizes(vec![]), &device).unwrap();
        let x = Tensor::<3>::random([1, 12, 8], Distribution::Normal(0.0, 1.0), &device);
        let changed = x.clone().slice_assign(
            [0..1, 7..12, 0..8],
            Tensor::random([1, 5, 8], Distribution::Normal(0.0, 1.0), &device),
        );
        let (a, b) = (
            stack.forward(x).narrow(1, 0, 7),
            stack.forward(changed).narrow(1, 0, 7),
        );
        a.into_data()
            .assert_approx_eq::<f32>(&b.into_data(), Tolerance::absolute(1e-5));
    }

    #[test]
    fn inputs_and_configs_are_checked() {
        let device = Device::flex();
        let blocks = MlpBlockConfig::new(8, 16).init_stack(2, &device).unwrap();
        let stack = Stack::new(blocks, &config(), &device).unwrap();
        assert!(
            stack
                .check_input(&Tensor::<3>::zeros([1, 17, 8], &device))
                .is_err()
        );
        assert!(
            stack
                .check_input(&Tensor::<3>::zeros([1, 4, 6], &device))
                .is_err()
        );
        assert!(
            config()
                .with_local_kernel_sizes(vec![2])
                .init(2, &device)
                .is_err()
        );
        assert!(
            HyperZzwConnectivityConfig::new(0, 4)
                .init(2, &device)
                .is_err()
        );
        assert!(
            HyperZzwConnectivityConfig::new(4, 0)
                .init(2, &device)
                .is_err()
        );
        assert!(matches!(config().init(0, &device), Err(Error::NoBlocks)));
    }
}
