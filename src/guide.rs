//! Every configuration option, the paper section or equation it implements, and the decisions
//! taken where the papers are vague.
//!
//! Papers: **H-ACN** (Hybrid Auto-Compressing Networks), **ANCRe** (Adaptive Neural Connection
//! Reassignment), **HyperZZW** (Hyper Z·Z·W operator / Terminator, and its withdrawn 2D reference
//! code), **HC** (Hyper-Connections, Zhu et al. 2024) and frac-connections, **mHC** (DeepSeek,
//! arXiv 2512.24880), **DenseFormer** (Pagliardini et al. 2024), **AttnRes** (Attention
//! Residuals, Kimi Team 2026, arXiv 2603.15031), **DeepSeek-V4's mHC** (as Hugging Face
//! `transformers` ships it), **mHC-lite** (arXiv 2601.05732), **LAuReL** (ICML 2025, and Gemma
//! 3n's block) and **MUDD** (MUDDFormer, arXiv 2502.12170). "Decision" marks a choice the papers
//! leave open; `docs/MATH.md` has the equations.
//!
//! # Shared vocabulary
//!
//! | item | meaning | source |
//! |---|---|---|
//! | [`Block`](crate::Block) | a residual branch `h_j = f_j(s_{j-1})`, never adding its input | all papers |
//! | [`Connectivity`](crate::Connectivity) / [`StreamConnectivity`](crate::StreamConnectivity) | maps branch outputs to block inputs `s_j` and the output `y` | all papers |
//! | [`ConnectivityMatrix`](crate::ConnectivityMatrix) | `C[i][j]`: coefficient of `h_i` in `s_{j-1}`; `out[i]`: in `y` | H-ACN eq. 4 |
//! | [`Stack::readout`](crate::Stack::readout), [`Stack::truncated`](crate::Stack::truncated) | `y_k`, the output of the first `k` blocks through the same head | H-ACN §3.1 (layer-wise accuracy) |
//! | [`StreamConnectivity::step_with_tail`](crate::StreamConnectivity::step_with_tail) | a layer that post-processes the combined stream (feed-forward residual, post-norm) | ANCRe §4.2; decision: blocks are credited with `s_j − shortcut` in the long output sum |
//!
//! # H-ACN ([`HacnConfig`](crate::HacnConfig), [`DepthLnConfig`](crate::DepthLnConfig))
//!
//! | option | implements | notes |
//! |---|---|---|
//! | `init: GateInit::Normal { mean, std }` | §3.1, `s_j = h_j + a_j s_{j-1}`, gate init | default `N(0.25, 0.005)` (Table 6's best); the paper writes the std as `N`'s second argument |
//! | `init: GateInit::HalfLayers { first, rest, std }` | init ablation | 0.4 for the first half, 0.15 for the rest |
//! | `init: GateInit::ExpDecay { start, end, std }` | init ablation | mean decays exponentially from 0.25 to 0.1 with depth |
//! | `init: GateInit::Constant`, `trainable: false` | ResNet (`a = 1`) and ACN (`a = 0`) presets: [`HacnConfig::resnet`](crate::HacnConfig::resnet), [`HacnConfig::acn`](crate::HacnConfig::acn) | `y = Σ h_i` is the long output sum in every case |
//! | `init: GateInit::Values` | explicit gates | golden tests |
//! | `trainable` | H-ACN (trained gates) vs frozen | gates are not weight-decayed ([`training`](crate::training)), as in the reference code |
//! | `DepthLnConfig::strength` | App. D eq. 7, `(1 + l·s)·LN(x)` | `s` init 0.05, one per layer; decision: `l` counts blocks from 1, LN keeps its affine parameters |
//! | `MlpBlockConfig::depth_ln` | pre-norm MLP block with DepthLN | not from a paper: a convenient block |
//!
//! # ANCRe ([`AncreConfig`](crate::AncreConfig))
//!
//! | option | implements | notes |
//! |---|---|---|
//! | `temperature` τ | eq. 7–8, `p_ij = softmax_i(c_ij / τ)` | default 0.1 (the paper's LLM runs used 0.01) |
//! | `normalization: Ingoing` | eq. 7–8 (softmax over the sources of each target) | default; mixes block *inputs* `s_i`, accumulated progressively (no stacked history) |
//! | `normalization: Outgoing` | eq. 6 (softmax over the targets of each source) | ablation; a truncated outgoing ANCRe keeps the full logit matrix so `p` does not change |
//! | `init: AncreInit::Uniform` | all logits 0, `p_ij = 1/j` | decision: follows the reference code |
//! | `init: AncreInit::Residual { tolerance }` | starts within `tolerance` of ResNet (`p_{j-1,j} ≥ 1 − tolerance`) | decision: a preset the paper implies |
//! | `init: AncreInit::Values` | explicit logits | golden tests; `p_01 = 1` always (its logit is not trained) |
//! | [`Ancre::tsallis_entropy`](crate::Ancre::tsallis_entropy) | §4.1, sparsity regulariser on every column of `p` | a loss term the user adds |
//! | [`Granularity`](crate::transformer::Granularity) | §4.2: block level (mixture replaces the attention shortcut, feed-forward keeps its residual; default) and module level (`Sublayer`) | `Granularity::Layer`: the public LLaMA code's "additive" variant (`s_j = T(s_{j-1}) + Σ p_ij s_i`, the layer keeping its own residuals) |
//! | `families`, `residual_families`, [`AncreConfig::module_level`](crate::AncreConfig::module_level) | §4.2, Table 1: module level as two families (attention inputs, feed-forward inputs), each with its own softmax; rows MHSA-only, FFN-only, both | `ModuleLevel::Attention` equals block level (tested); `families = 1` at `Sublayer` is a fourth variant: one mixture over all `2L` sublayer inputs |
//! | `mixing: Mixing::{Raw, FixedUniform, Cascade}` | Tables 4–5 ablations: no normalisation (raw coefficients), fixed uniform `1/j`, learnable cascade only | decisions: raw starts at the softmax of the init logits (`1/j`); the cascade keeps only `p_{j-1,j}`, raw and learnable, starting at 1 (the plain residual) |
//!
//! # HyperZZW / SFNE ([`hyperzzw`](crate::hyperzzw))
//!
//! | option | implements | notes |
//! |---|---|---|
//! | `SlowNetConfig { grid, out_channels, hidden, layers, omega_0, s_renorm }` | the slow network (multiplicative filter network, §2.2): `z_i = sin(cA_i + a_i) ⊙ (z_{i-1}B + b) + P` over a `[-1, 1]` grid, optionally s-renormalised after each layer | reference init: `A ∝ 2π ω0 γ`, `γ ~ Gamma(6/(l+1), 1)`, `b = 1`, shared bias map `P`, Chang-scaled output; ω0 default 2000; s-renorm off here, on by default (`global_s_renorm`) in the global generators of SFNE and the HyperZZW connectivity (§2.2), whereas the reference code applies it only in its local generator |
//! | [`global_hyperzzw_1d`](crate::hyperzzw::global_hyperzzw_1d) / `_2d`, [`Crop`](crate::hyperzzw::Crop) | eqs. 5–7, `conv(Z, Z ⊙ K)` | decision: FFT with zero padding to a power of two ≥ `2T − 1`, never circular; explicit causal (1D default) or same (2D default) crop |
//! | [`global_hyperzzw_dot`](crate::hyperzzw::global_hyperzzw_dot) | the 2D reference code's matrix product on square maps | option for parity with the reference |
//! | [`FftPath`](crate::hyperzzw::FftPath) | — | Burn's FFT on Flex and CubeCL, a matmul DFT elsewhere (NdArray) |
//! | `LocalHyperZzwConfig { channels, kernel_size, dims, hidden, layers, omega_0 }` | eqs. 8–9: kernels from a pooled, batch-averaged context, s-renorm, depthwise "same" convolution | decision (MATH §3.3): s-renorm's `a`, `b` learnable and its identity term not detached (the golden gradient agrees); kernel from one tensor may convolve another (MuHKGen) |
//! | `SfneBlockConfig { in_channels, expansion, geometry, local_kernel_sizes, groups, …_hidden, layers, omega_0, dropout, crop, channel_mixer, hyper_channel, si_glu, hyper_interaction, global_s_renorm }` | §2.4, Fig. 3: the multi-branch block without residual, bottleneck λ, G-IBS, GELU | the reference's dense cross-block concatenation of earlier outputs is not implemented; branches can be switched off for ablations |
//! | [`slow_neural_loss`](crate::hyperzzw::slow_neural_loss) | eqs. 11–12 | returned for the user to add |
//! | `TerminatorConfig { classes, block, expansions }` | the Terminator model | reference λ = 4, 3, 2, 2, 2 |
//! | `HyperZzwConnectivityConfig { d_model, max_len, local_kernel_sizes, hidden, layers, omega_0, crop, global_s_renorm }` | decision (MATH §3.5): HyperZZW fusion of `h_j` and `s_{j-1}` in place of the identity shortcut, for `[B, T, d]` stacks | its `C` holds the additive chain only; local branches are not causal |
//!
//! # Hyper-connections and frac-connections ([`HyperConnectionsConfig`](crate::HyperConnectionsConfig))
//!
//! | option | implements | notes |
//! |---|---|---|
//! | `streams` n | HC Alg. 2, expansion rate | default 4; streams start as copies of `x` |
//! | `dynamic`, `tanh` | dynamic HC `A = s_a tanh(N W_a) + A_s`, `B = s_b tanh(N w_b) + b_s`, and static HC | init as the paper and lucidrains/hyper-connections 0.4.11 (golden `hc`): block `j` reads stream `(j−1) mod n`, `A_s[:,1:] = I`, `b_s = 1`, `W_a = w_b = γ = 0`, `s_a = s_b = 0.01` |
//! | `fractions` m | frac-connections (arXiv 2503.14125): the width split into `m` fractions instead of copied | decision: `n·m` units of width `d/m`; view `f` of the block input reads fraction-`f` units, fraction `f` of the output goes to them; norm and dynamic weights per unit |
//! | `reduce` | output `y = Σ_k S_k` (default) or the mean | every readout uses the same reduction |
//! | [`Connectivity::matrix`](crate::Connectivity::matrix) | `C` of the static part (a token whose streams vanish) | exact for static HC; with fractions, averaged over the views |
//!
//! # mHC ([`MhcConfig`](crate::MhcConfig), [`sinkhorn_knopp`](crate::sinkhorn_knopp))
//!
//! | option | implements | notes |
//! |---|---|---|
//! | `streams` n, `width` C | eqs. 14–19 as Megatron-LM computes them: flattened RMS scale, `σ`, `2σ`, Sinkhorn-Knopp | golden `mhc`; `ε = 1e-6` |
//! | `sinkhorn_iterations` | Sinkhorn-Knopp, differentiated through every iteration | default 20 (the config refuses 0; set later, 0 runs as 1 on every path); the public function takes any square batch, the CubeCL kernel up to 16 × 16 (larger ones composed) |
//! | `phi_std`, `alpha_init` | decision (MATH §5.2): `φ ~ N(0, σ = 1e-4)`, `α = 0.01`, `b_pre = −ln(n−1)`, `b_post = 0`, `b_res = 5(I − 1)` | within 1e-2 of ResNet at init (tested); with `n = 1`, `b_pre = 0` gives `H_pre = ½` |
//! | `reduce` | output `y = mean_k S_k` (default) or the sum | |
//! | [`Connectivity::matrix`](crate::Connectivity::matrix) | `C` of the static part (`H~ = b`) | [`Mhc::connections`](crate::Mhc::connections) gives the per-token matrices of a batch |
//!
//! # DenseFormer ([`DenseFormerConfig`](crate::DenseFormerConfig))
//!
//! | option | implements | notes |
//! |---|---|---|
//! | `dilation` δ, `period` | DWA: `Y_i = Σ_{k ≡ i (mod δ), k ≤ i} α_i[k] X_k` after every `period`-th block | golden `dwa` (1×1, 2×1, 1×2); the paper's 4×5 DenseFormer is `dilation = 4, period = 5` |
//! | init | `α_i = e_last`: exactly ResNet | only the states a later average needs are kept |
//!
//! # Attention Residuals ([`AttentionResidualsConfig`](crate::AttentionResidualsConfig))
//!
//! | option | implements | notes |
//! |---|---|---|
//! | `width` d | full AttnRes: `h_l = Σ_{i<l} softmax_i(w_l · k(v_i)) v_i` over `x` and every earlier branch output, `k(v) = v / sqrt(mean(v²) + ε)` without a weight | one pseudo-query `w_l` per block, zero at init (each block reads the mean of its sources); golden `attnres` |
//! | `block_size` k | block AttnRes: the sources are `x`, the sums of the completed groups of `k` blocks and the current group's partial sum | the first block of a group reads the completed sums only (as `attn-res` 0.1.0); `k = 1` is full AttnRes; 0 is a typed error |
//! | `epsilon` ε | the keys' RMS normalisation | default `1e-6` |
//! | `output: Attend` / `Sum` | the output after the last block | decision: `Attend` (default) gives the output a pseudo-query of its own, as the paper treats it like one more layer; `Sum` (`x + Σ f_j`) is what `attn-res` 0.1.0 does |
//! | [`Connectivity::matrix`](crate::Connectivity::matrix) | the mixtures of zero queries (uniform over each block's sources) | the model at init; the trained mixtures depend on the input |
//!
//! # DeepSeek-V4's mHC ([`MhcV4Config`](crate::MhcV4Config))
//!
//! | option | implements | notes |
//! |---|---|---|
//! | `width` C, `streams` n | `transformers`' `DeepseekV4HyperConnection`: `x̂ = rms(vec(S))`, `z = x̂ Fᵀ`, `H_pre = σ(s_pre z + b) + ε`, `H_post = 2σ(…)`, `H_res = SK(…)` applied transposed | golden `mhc_v4`; against mHC: `ε` inside the root of the row scale, the three scales one parameter `[3]` |
//! | head | `DeepseekV4HyperHead`: `y = Σ_k g_k S_k`, `g = σ(s_head · x̂ F_headᵀ + b_head) + ε` | a learned collapse of the streams instead of their mean |
//! | `sinkhorn_iterations` | `hc_sinkhorn_iters` (default 20): row softmax + ε, columns first, additive ε | as mHC's [`sinkhorn_knopp`](crate::sinkhorn_knopp) |
//! | `init_std` | DeepSeek-V4's init: `F`, `F_head ~ N(0, init_std)` (default 0.02), biases 0, scales 1 | so `H_pre ≈ ½`, `H_post ≈ 1`, `H_res ≈` the uniform matrix (not the identity); decision: the connections take the streams' float type (`transformers` computes them in f32) |
//!
//! # mHC-lite ([`MhcLiteConfig`](crate::MhcLiteConfig))
//!
//! | option | implements | notes |
//! |---|---|---|
//! | `streams` n (≤ 6), `width` C | arXiv 2601.05732: `H_res = Σ_k softmax(H~_res)_k P_k` over the `n!` permutations (lexicographic, identity first) | golden `mhc_lite`; exactly doubly stochastic (tested); `n > 6` is a typed error |
//! | `phi_std`, `alpha_init` | decision (MATH §5.6): the official code's `φ = 0`, `α = 0.01`, `b_res = −8` off the identity; `b_pre`, `b_post` as mHC | no learnable gain before the projection (a rescaling of `φ`'s rows) |
//! | `reduce` | output mean (default) or sum | |
//!
//! # LAuReL ([`LaurelConfig`](crate::LaurelConfig))
//!
//! | option | implements | notes |
//! |---|---|---|
//! | `reweight` | LAuReL-RW (§2.1): `α h + β s` | decision (MATH §5.7): `α = 2σ(a)`, `β = 2σ(b)`, logits 0 at init (the residual) |
//! | `rank` r | LAuReL-LR (§2.2, eq. 3): `s + s A B`, `A` `[d, r]`, `B` `[r, d]` | init (§3.3, LLMs): column-orthogonal `A`, `B = 0`; `Some(0)` is a typed error |
//! | `previous` k | LAuReL-PA (§2.3, eq. 4, 6): `Σ_{j<k} γ_j s_{i−j} A_j B_j` | one `A B` per earlier state (Table 4's `2rkD`), `γ = 1` at init; needs a rank |
//! | `form: Gemma3n` | Gemma 3n's `Gemma3nTextLaurelBlock` in its decoder layer: `(s + h + u + rms(u A B) w_out)/√2`, `u = rms(s) w_in` | golden `laurel` (`transformers` 5.24.0); `w_in` is the connectivity's own norm; `A, B ~ N(0, init_std)` |
//! | [`Connectivity::matrix`](crate::Connectivity::matrix) | the scalar part (`α`, `β` or `1/√2`) | the low-rank terms are matrices per token, left out |
//!
//! # MUDD ([`MuddConfig`](crate::MuddConfig))
//!
//! | option | implements | notes |
//! |---|---|---|
//! | `ways: One` | DDC (eqs. 5–6): `A = GELU(rms(X_i) W1) W2 + a`, `s = Σ_j A_j X_j` per token | the plain-stack form; golden `mudd` |
//! | `ways: Qkvr` ([`MuddConfig::multiway`](crate::MuddConfig::multiway)) | MUDD (eqs. 7–8): four mixtures, the query, key and value fed apart to a wrapped encoder's attention ([`StreamConnectivity::way_inputs`](crate::StreamConnectivity::way_inputs)), the residual to its shortcut | one way after the last block; each way through the layer's attention norm (the paper: a norm per way) |
//! | init | §3: `W1 ~ N(0, 1/d)`, `W2 = 0`, `a` one-hot on the newest state: the residual stack | decision: no `round64` / `expand_last` hidden widening |
//!
//! # Transformers and training
//!
//! | option | implements | notes |
//! |---|---|---|
//! | [`ConnectedEncoder`](crate::transformer::ConnectedEncoder) | MATH §4: burn-nn encoder layers rewired from their public parts | pre- and post-norm; masks pass through; record paths of `TransformerEncoder` kept |
//! | `Granularity::Sublayer` with HC / mHC | each attention and feed-forward sublayer is one HC layer (HC paper, Megatron-LM) | |
//! | `Granularity::Block` with HC / mHC / DWA | decision: the whole layer is one block; multi-stream connectivities feed it `M_0` and write its whole update `T(M_0) − M_0` into the streams; DWA averages after each layer | |
//! | [`GroupedAdamConfig`](crate::training::GroupedAdamConfig) | the reference codes' parameter groups | connectivity parameters: no weight decay, own learning rate |
//! | `GroupedAdamConfig::language_model` | the papers' LM recipe: AdamW `β2 = 0.95`, warmup + cosine, clipping at 1 | Burn clips each parameter's gradient norm, not the global norm |
//! | [`ConnectedEncoder::with_depth_ln`](crate::transformer::ConnectedEncoder::with_depth_ln) | H-ACN App. D, Table 7: DepthLN in a wrapped transformer | decision: one strength per layer, shared by its two norms, depth = layer index + 1 |
//! | [`Stack::compress`](crate::Stack::compress) | H-ACN §3.1 auto-compression | smallest depth within a tolerance of the full model on validation scores |
