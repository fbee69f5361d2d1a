//! Conformance checks against the golden vectors (format: tests/golden/README.md).
//!
//! Run by the conformance runner (`main.rs` beside this file). Every size (blocks, widths,
//! depths) is read from the files.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use burn::module::Param;
use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::FloatDType;
use burn_connectivity::hyperzzw::{
    Crop, LocalHyperZzw, SRenorm, SlowNet, direct_conv_1d, global_hyperzzw_1d, global_hyperzzw_2d,
};
use burn_connectivity::mhc::{MhcConnections, MhcLayer};
use burn_connectivity::{
    AncreConfig, AncreInit, AttentionResidualsConfig, AttnResOutput, Block, Connectivity,
    ConnectivityConfig, DenseFormerConfig, DepthLnConfig, GateInit, HacnConfig,
    HyperConnectionsConfig, LaurelConfig, MhcConfig, MhcLiteConfig, MhcV4Config, MuddConfig,
    MuddWays, Stack, StreamConnectivity, StreamReduce, sinkhorn_knopp,
};

/// Absolute tolerance for forward values (f32).
pub const VALUE_TOLERANCE: f64 = 1e-5;
/// Absolute tolerance for gradients (f32).
pub const GRADIENT_TOLERANCE: f64 = 1e-4;

/// One recomputed quantity compared with its golden value.
pub struct Check {
    /// `file.quantity`, e.g. `hacn.out.stream`.
    pub name: String,
    /// Largest absolute difference (infinite when the shapes differ).
    pub max_abs_err: f64,
    /// The tolerance it must stay within.
    pub tolerance: f64,
}

impl Check {
    /// Within tolerance (NaN fails).
    pub fn passed(&self) -> bool {
        self.max_abs_err <= self.tolerance
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.passed() { "PASS" } else { "FAIL" };
        write!(
            f,
            "{} {:.3e} {:.2e} {verdict}",
            self.name, self.max_abs_err, self.tolerance
        )
    }
}

/// A golden file: named f32 tensors and the header metadata.
pub struct Golden {
    name: String,
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    metadata: HashMap<String, String>,
    /// The least tolerance of each check, relative to the reference's scale
    /// (`max(1, max|reference|)`): none in f32 and f64 ([`Floors::for_float`]).
    floors: Floors,
}

/// The least tolerances of a run in a half-precision type, relative to each reference's scale,
/// in the type's unit roundoffs `u` (`2⁻¹¹` for f16, `2⁻⁸` for bf16): forward values `32 u`,
/// gradients `128 u`. On Flex (2026-12-05) the forward values landed within `11 u` of their
/// scale in both types, the gradients within `77 u` in f16 and `91 u` in bf16 (a parameter's
/// gradient sums many tokens' terms that cancel, each rounded to the type). In bf16 the
/// gradients' floor (half their scale) is a sanity bound that catches NaN, zeros, a wrong sign
/// or a garbled kernel, not a rounding slip; the tight half-precision checks of the crate's
/// kernels are the f16 kernel tests against f32 in `cargo test` on wgpu.
#[derive(Clone, Copy, Debug, Default)]
pub struct Floors {
    /// For forward values.
    pub values: f64,
    /// For gradients (keys `grad.…`, `….grad.…` or `….grad`).
    pub gradients: f64,
}

impl Floors {
    /// The floors of a run in `float`: [`Floors::default`] (none) for f32 and f64.
    pub fn for_float(float: FloatDType) -> Self {
        let roundoff = match float {
            FloatDType::F16 => 2f64.powi(-11),
            FloatDType::BF16 => 2f64.powi(-8),
            _ => return Self::default(),
        };
        Self {
            values: 32.0 * roundoff,
            gradients: 128.0 * roundoff,
        }
    }

    /// Whether `key` names a gradient (`grad.…`, `….grad.…` or `….grad`).
    fn is_gradient(key: &str) -> bool {
        key.split('.').any(|part| part == "grad")
    }

    /// The floor of the check of `key`.
    fn of(&self, key: &str) -> f64 {
        if Self::is_gradient(key) {
            self.gradients
        } else {
            self.values
        }
    }
}

type Checker = fn(&Golden, &Device) -> Result<Vec<Check>, String>;

/// The golden files this runner knows, and the checks of each.
pub const KNOWN_FILES: [(&str, Checker); 12] = [
    ("hacn.safetensors", check_hacn),
    ("depth_ln.safetensors", check_depth_ln),
    ("ancre.safetensors", check_ancre),
    ("hyperzzw.safetensors", check_hyperzzw),
    ("hc.safetensors", check_hc),
    ("mhc.safetensors", check_mhc),
    ("dwa.safetensors", check_dwa),
    ("attnres.safetensors", check_attnres),
    ("mhc_v4.safetensors", check_mhc_v4),
    ("mhc_lite.safetensors", check_mhc_lite),
    ("laurel.safetensors", check_laurel),
    ("mudd.safetensors", check_mudd),
];

/// The name `--only` knows a golden file by: `NAME` of `NAME.safetensors`.
pub fn golden_name(file: &str) -> &str {
    file.strip_suffix(".safetensors").unwrap_or(file)
}

/// Whether `file` (`NAME.safetensors`) is among `only`'s names (every file where `only` is
/// empty).
pub fn selected(file: &str, only: &[String]) -> bool {
    only.is_empty() || only.iter().any(|name| golden_name(file) == name)
}

/// Runs the checks of every known golden file present in `dir` (those named in `only`, if
/// any), handing each file's checks to `on_file` as soon as they are done (a run stopped by a
/// time limit keeps what it printed).
///
/// Returns the checks per file found; an error if none is found or a file is malformed.
pub fn run_dir(
    dir: &Path,
    device: &Device,
    only: &[String],
    floors: Floors,
    mut on_file: impl FnMut(&str, &[Check]),
) -> Result<Vec<(String, Vec<Check>)>, String> {
    let mut results = Vec::new();
    for (file, checker) in KNOWN_FILES
        .into_iter()
        .filter(|(file, _)| selected(file, only))
    {
        let path = dir.join(file);
        if path.exists() {
            let golden = Golden {
                floors,
                ..Golden::load(&path)?
            };
            let checks = checker(&golden, device)?;
            on_file(file, &checks);
            results.push((file.to_string(), checks));
        }
    }
    if results.is_empty() {
        let known: Vec<&str> = KNOWN_FILES.iter().map(|(file, _)| *file).collect();
        return Err(format!(
            "no known golden file in {} (known: {})",
            dir.display(),
            known.join(", ")
        ));
    }
    Ok(results)
}

impl Golden {
    /// Reads every f32 tensor and the metadata of a safetensors file.
    pub fn load(path: &Path) -> Result<Self, String> {
        let bytes = std::fs::read(path).map_err(|err| format!("{}: {err}", path.display()))?;
        let parsed = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|err| format!("{}: {err}", path.display()))?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|err| format!("{}: {err}", path.display()))?;
        let mut tensors = HashMap::new();
        for (key, view) in parsed.tensors() {
            if view.dtype() != safetensors::Dtype::F32 {
                return Err(format!(
                    "{}: {key} is {:?}, expected F32",
                    path.display(),
                    view.dtype()
                ));
            }
            let values = view
                .data()
                .chunks_exact(4)
                .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
                .collect();
            tensors.insert(key, (view.shape().to_vec(), values));
        }
        let name = path
            .file_stem()
            .map(|stem| stem.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(Self {
            name,
            tensors,
            metadata: header.metadata().clone().unwrap_or_default(),
            floors: Floors::default(),
        })
    }

    fn entry(&self, key: &str) -> Result<&(Vec<usize>, Vec<f32>), String> {
        self.tensors
            .get(key)
            .ok_or_else(|| format!("{}: missing tensor `{key}`", self.name))
    }

    fn has(&self, key: &str) -> bool {
        self.tensors.contains_key(key)
    }

    /// The tensor `key` as a rank-`D` tensor on `device`.
    pub fn tensor<const D: usize>(&self, key: &str, device: &Device) -> Result<Tensor<D>, String> {
        let (shape, values) = self.entry(key)?;
        if shape.len() != D {
            return Err(format!(
                "{}: `{key}` has rank {}, expected {D}",
                self.name,
                shape.len()
            ));
        }
        Ok(Tensor::from_data(
            TensorData::new(values.clone(), shape.clone()),
            device,
        ))
    }

    /// The tensor `key` as f64 values.
    pub fn values(&self, key: &str) -> Result<Vec<f64>, String> {
        Ok(self
            .entry(key)?
            .1
            .iter()
            .map(|&value| f64::from(value))
            .collect())
    }

    /// A numeric metadata entry.
    pub fn meta_number(&self, key: &str) -> Result<f64, String> {
        let text = self
            .metadata
            .get(key)
            .ok_or_else(|| format!("{}: missing metadata `{key}`", self.name))?;
        text.parse()
            .map_err(|err| format!("{}: metadata `{key}` = {text:?}: {err}", self.name))
    }

    /// Compares `actual` with the golden tensor `key`.
    fn compare(
        &self,
        key: &str,
        actual: Vec<f64>,
        actual_shape: &[usize],
        tolerance: f64,
    ) -> Result<Check, String> {
        let (shape, expected) = self.entry(key)?;
        let expected: Vec<f64> = expected.iter().map(|&value| f64::from(value)).collect();
        let max_abs_err = if shape.as_slice() == actual_shape {
            max_abs_err(&expected, &actual)
        } else {
            f64::INFINITY
        };
        Ok(Check {
            name: format!("{}.{key}", self.name),
            max_abs_err,
            tolerance: tolerance.max(self.floor(key, &expected)),
        })
    }

    /// The least tolerance of the check of `key` against `expected` ([`Floors`]), in the
    /// reference's scale `max(1, max|expected|)`; for a gradient the reference has at zero
    /// (`max|expected| < 1e-6`: zero by symmetry, a sum of terms that cancel exactly; in the
    /// goldens `∂α_res` of the first and last blocks of mHC and mHC-lite, the first mixing
    /// identical copies, the last's mix averaged away by the mean), in the file's largest
    /// gradient's scale, since each of the terms is rounded to the type before they cancel.
    /// That bound is loose (17.7 in bf16 for mHC-lite): a sanity check, not a rounding check.
    fn floor(&self, key: &str, expected: &[f64]) -> f64 {
        let floor = self.floors.of(key);
        if floor == 0.0 {
            return 0.0;
        }
        let largest = expected.iter().fold(0.0_f64, |max, v| max.max(v.abs()));
        let scale = if largest < 1e-6 && Floors::is_gradient(key) {
            self.tensors
                .iter()
                .filter(|(name, _)| Floors::is_gradient(name))
                .flat_map(|(_, (_, values))| values)
                .fold(1.0_f64, |max, v| max.max(f64::from(v.abs())))
        } else {
            largest.max(1.0)
        };
        floor * scale
    }

    fn compare_tensor<const D: usize>(
        &self,
        key: &str,
        actual: Tensor<D>,
        tolerance: f64,
    ) -> Result<Check, String> {
        let shape = actual.dims();
        self.compare(
            key,
            actual.into_data().iter::<f64>().collect(),
            &shape,
            tolerance,
        )
    }
}

/// Largest entry-wise difference; infinite when the lengths differ.
fn max_abs_err(expected: &[f64], actual: &[f64]) -> f64 {
    if expected.len() != actual.len() {
        return f64::INFINITY;
    }
    expected
        .iter()
        .zip(actual)
        .map(|(e, a)| (e - a).abs())
        .fold(0.0, f64::max)
}

/// The golden block `f(x) = tanh(x W + b)`.
#[derive(Module, Debug)]
pub struct TanhBlock {
    /// `W: [d_in, d_out]`, `b: [d_out]`.
    pub linear: Linear,
}

impl<const D: usize> Block<D> for TanhBlock {
    type Context = ();

    fn branch(&self, input: Tensor<D>, _context: &()) -> Tensor<D> {
        self.linear.forward(input).tanh()
    }
}

/// Loads `prefix.{j}.weight` / `prefix.{j}.bias` for every `j` present.
/// The linear layer `{prefix}.weight` (`[d_in, d_out]`), `{prefix}.bias`.
fn golden_linear(golden: &Golden, prefix: &str, device: &Device) -> Result<Linear, String> {
    Ok(Linear {
        weight: Param::from_tensor(golden.tensor::<2>(&format!("{prefix}.weight"), device)?),
        bias: Some(Param::from_tensor(
            golden.tensor::<1>(&format!("{prefix}.bias"), device)?,
        )),
    })
}

/// The linear layers `{prefix}.{j}` for every `j` present.
fn golden_linears(golden: &Golden, prefix: &str, device: &Device) -> Result<Vec<Linear>, String> {
    let mut layers = Vec::new();
    while golden.has(&format!("{prefix}.{}.weight", layers.len())) {
        layers.push(golden_linear(
            golden,
            &format!("{prefix}.{}", layers.len()),
            device,
        )?);
    }
    Ok(layers)
}

fn tanh_blocks(golden: &Golden, prefix: &str, device: &Device) -> Result<Vec<TanhBlock>, String> {
    let layers = golden_linears(golden, prefix, device)?;
    Ok(layers
        .into_iter()
        .map(|linear| TanhBlock { linear })
        .collect())
}

/// The golden blocks wired by the connectivity `config` builds; checks the block count against
/// the file's `layers` metadata.
fn golden_stack<C: ConnectivityConfig>(
    golden: &Golden,
    config: &C,
    device: &Device,
) -> Result<Stack<TanhBlock, C::Connectivity>, String> {
    let blocks = tanh_blocks(golden, "blocks", device)?;
    let layers = golden.meta_number("layers")?;
    if blocks.len() as f64 != layers {
        return Err(format!(
            "{}: {} blocks for {layers} layers",
            golden.name,
            blocks.len()
        ));
    }
    let connectivity = config
        .init(blocks.len(), device)
        .map_err(|err| err.to_string())?;
    Stack::from_parts(blocks, connectivity).map_err(|err| err.to_string())
}

/// Compares C and the output column of `connectivity` with `out.matrix` / `out.output_column`.
fn compare_matrix(golden: &Golden, connectivity: &impl Connectivity) -> Result<[Check; 2], String> {
    let matrix = connectivity.matrix();
    let size = matrix.output.len();
    let flat: Vec<f64> = matrix.matrix.iter().flatten().copied().collect();
    Ok([
        golden.compare("out.matrix", flat, &[size, size], VALUE_TOLERANCE)?,
        golden.compare("out.output_column", matrix.output, &[size], VALUE_TOLERANCE)?,
    ])
}

/// H-ACN over the golden blocks: stream, long sum, readout, C, output column, Γ, the ResNet
/// and ACN presets, and the gradients of the gates and block weights.
pub fn check_hacn(golden: &Golden, device: &Device) -> Result<Vec<Check>, String> {
    let device = device.clone().autodiff();
    let gates = golden.values("alpha")?;
    let input = golden.tensor::<3>("input", &device)?;
    let probe = golden.tensor::<3>("probe", &device)?;
    let mut checks = Vec::new();

    let config = HacnConfig::new().with_init(GateInit::Values {
        values: gates.clone(),
    });
    let stack = golden_stack(golden, &config, &device)?;
    let state = stack
        .run(input.clone(), stack.num_blocks(), &())
        .map_err(|err| err.to_string())?;
    let loss = (state.sum.clone() * probe.clone()).sum() + (state.stream.clone() * probe).sum();
    let grads = loss.backward();

    checks.push(golden.compare_tensor("out.stream", state.stream, VALUE_TOLERANCE)?);
    checks.push(golden.compare_tensor("out.sum", state.sum, VALUE_TOLERANCE)?);
    let readout: Tensor<4> = Tensor::stack(stack.readout(input.clone()), 0);
    checks.push(golden.compare_tensor("out.readout", readout, VALUE_TOLERANCE)?);

    checks.extend(compare_matrix(golden, &stack.connectivity)?);
    let gamma = stack.connectivity.total_strength();
    checks.push(golden.compare("out.gamma", vec![gamma], &[1], VALUE_TOLERANCE)?);

    let gate_grad = stack
        .connectivity
        .gates
        .val()
        .grad(&grads)
        .ok_or("hacn: the gates got no gradient")?;
    checks.push(golden.compare_tensor("grad.alpha", gate_grad, GRADIENT_TOLERANCE)?);
    for (j, block) in stack.blocks.iter().enumerate() {
        let key = format!("grad.blocks.{j}.weight");
        let grad = block
            .linear
            .weight
            .val()
            .grad(&grads)
            .ok_or_else(|| format!("hacn: block {j} got no gradient"))?;
        checks.push(golden.compare_tensor(&key, grad, GRADIENT_TOLERANCE)?);
    }

    for (preset, config) in [("resnet", HacnConfig::resnet()), ("acn", HacnConfig::acn())] {
        let stack = golden_stack(golden, &config, &device)?;
        let state = stack
            .run(input.clone(), stack.num_blocks(), &())
            .map_err(|err| err.to_string())?;
        checks.push(golden.compare_tensor(
            &format!("{preset}.stream"),
            state.stream,
            VALUE_TOLERANCE,
        )?);
        checks.push(golden.compare_tensor(&format!("{preset}.sum"), state.sum, VALUE_TOLERANCE)?);
    }
    Ok(checks)
}

/// ANCRe over the golden blocks: `s_K`, `p`, C, the output column, the uniform preset, and
/// the gradient of the logits where they are used (`i < j`).
pub fn check_ancre(golden: &Golden, device: &Device) -> Result<Vec<Check>, String> {
    let device = device.clone().autodiff();
    let temperature = golden
        .values("tau")?
        .first()
        .copied()
        .ok_or("ancre: empty `tau`")?;
    let size = golden.entry("logits")?.0[0];
    let logits: Vec<Vec<f64>> = golden
        .values("logits")?
        .chunks(size)
        .map(<[f64]>::to_vec)
        .collect();
    let input = golden.tensor::<3>("input", &device)?;
    let probe = golden.tensor::<3>("probe", &device)?;
    let mut checks = Vec::new();

    let config = AncreConfig::new()
        .with_temperature(temperature)
        .with_init(AncreInit::Values { logits });
    let stack = golden_stack(golden, &config, &device)?;
    let stream = stack.forward(input.clone());
    let grads = (stream.clone() * probe).sum().backward();
    checks.push(golden.compare_tensor("out.stream", stream, VALUE_TOLERANCE)?);
    checks.push(golden.compare_tensor(
        "out.p",
        stack.connectivity.coefficients(),
        VALUE_TOLERANCE,
    )?);
    checks.extend(compare_matrix(golden, &stack.connectivity)?);

    let logit_grad = stack
        .connectivity
        .logits
        .val()
        .grad(&grads)
        .ok_or("ancre: the logits got no gradient")?;
    let shortcuts = |values: Vec<f64>| -> Vec<f64> {
        (0..size * size)
            .filter(|k| k / size < k % size)
            .map(|k| values[k])
            .collect()
    };
    let expected = shortcuts(golden.values("grad.logits")?);
    let actual = shortcuts(logit_grad.into_data().iter::<f64>().collect());
    checks.push(Check {
        name: format!("{}.grad.logits", golden.name),
        max_abs_err: max_abs_err(&expected, &actual),
        tolerance: GRADIENT_TOLERANCE.max(golden.floor("grad.logits", &expected)),
    });

    let uniform = golden_stack(
        golden,
        &AncreConfig::new().with_temperature(temperature),
        &device,
    )?;
    checks.push(golden.compare_tensor(
        "uniform.stream",
        uniform.forward(input),
        VALUE_TOLERANCE,
    )?);
    checks.push(golden.compare_tensor(
        "uniform.p",
        uniform.connectivity.coefficients(),
        VALUE_TOLERANCE,
    )?);
    Ok(checks)
}

/// A slow network stored under `prefix` whose kernel has `grid` points per axis.
fn golden_slow_net(
    golden: &Golden,
    prefix: &str,
    grid: Vec<usize>,
    device: &Device,
) -> Result<SlowNet, String> {
    Ok(SlowNet {
        filters: golden_linears(golden, &format!("{prefix}.filters"), device)?,
        linears: golden_linears(golden, &format!("{prefix}.linears"), device)?,
        shared_bias: Param::from_tensor(
            golden.tensor::<1>(&format!("{prefix}.shared_bias"), device)?,
        ),
        output: golden_linear(golden, &format!("{prefix}.output"), device)?,
        // The golden vectors are the plain network of MATH §3.1.
        renorm: None,
        grid,
    })
}

/// HyperZZW: the 1D and 2D slow-net kernels and coordinates, global HyperZZW (causal and same
/// in 1D, same in 2D) and the direct convolution, and the local branch (kernel, output and the
/// gradient with respect to its source).
pub fn check_hyperzzw(golden: &Golden, device: &Device) -> Result<Vec<Check>, String> {
    let device = device.clone().autodiff();
    let error = |err: burn_connectivity::Error| err.to_string();
    let mut checks = Vec::new();

    let input = golden.tensor::<3>("input1d", &device)?.require_grad();
    let length = golden.entry("out.kernel1d")?.0[2];
    let slow = golden_slow_net(golden, "slow", vec![length], &device)?;
    checks.push(golden.compare_tensor(
        "slow.coords",
        slow.coordinates(&device),
        VALUE_TOLERANCE,
    )?);
    let kernel = slow.kernel_1d().map_err(error)?;
    checks.push(golden.compare_tensor("out.kernel1d", kernel.clone(), VALUE_TOLERANCE)?);
    for (key, crop) in [
        ("out.global1d.causal", Crop::Causal),
        ("out.global1d.same", Crop::Same),
    ] {
        let output = global_hyperzzw_1d(input.clone(), kernel.clone(), crop).map_err(error)?;
        checks.push(golden.compare_tensor(key, output, VALUE_TOLERANCE)?);
    }
    let direct = direct_conv_1d(input.clone(), input.clone() * kernel, Crop::Causal);
    checks.push(golden.compare_tensor("check.direct1d.causal", direct, VALUE_TOLERANCE)?);

    let grid = golden.entry("out.kernel2d")?.0[2..].to_vec();
    let slow2d = golden_slow_net(golden, "slow2d", grid, &device)?;
    checks.push(golden.compare_tensor(
        "slow2d.coords",
        slow2d.coordinates(&device),
        VALUE_TOLERANCE,
    )?);
    let kernel2d = slow2d.kernel_2d().map_err(error)?;
    checks.push(golden.compare_tensor("out.kernel2d", kernel2d.clone(), VALUE_TOLERANCE)?);
    let input2d = golden.tensor::<4>("input2d", &device)?;
    let output2d = global_hyperzzw_2d(input2d, kernel2d, Crop::Same).map_err(error)?;
    checks.push(golden.compare_tensor("out.global2d.same", output2d, VALUE_TOLERANCE)?);

    let kernel_size = golden.entry("local.shared_bias")?.0[0];
    let local = LocalHyperZzw {
        reduce: golden_linear(golden, "local.reduce", &device)?,
        context: golden_linear(golden, "local.context", &device)?,
        slow_net: golden_slow_net(golden, "local", vec![kernel_size], &device)?,
        modulators: golden_linears(golden, "local.modulators", &device)?,
        renorm: SRenorm {
            a: Param::from_tensor(golden.tensor::<1>("local.renorm.a", &device)?),
            b: Param::from_tensor(golden.tensor::<1>("local.renorm.b", &device)?),
        },
    };
    let target = golden.tensor::<3>("local.target", &device)?;
    checks.push(golden.compare_tensor(
        "out.local_kernel",
        local.kernel(input.clone()).map_err(error)?,
        VALUE_TOLERANCE,
    )?);
    let output = local
        .forward(input.clone(), target.clone())
        .map_err(error)?;
    let grads = (output.clone() * target).sum().backward();
    checks.push(golden.compare_tensor("out.local1d", output, VALUE_TOLERANCE)?);
    let input_grad = input
        .grad(&grads)
        .ok_or("hyperzzw: the input got no gradient")?;
    checks.push(golden.compare_tensor("grad.local.input", input_grad, GRADIENT_TOLERANCE)?);
    Ok(checks)
}

/// DepthLN at every depth the file holds (`out.depth{l}`), with the file's γ, β, s and eps.
pub fn check_depth_ln(golden: &Golden, device: &Device) -> Result<Vec<Check>, String> {
    let strength = golden.meta_number("strength")?;
    let epsilon = golden.meta_number("eps")?;
    let input = golden.tensor::<3>("input", device)?;
    let gamma = golden.tensor::<1>("gamma", device)?;
    let beta = golden.tensor::<1>("beta", device)?;
    let width = gamma.dims()[0];

    let mut depths: Vec<(usize, String)> = golden
        .tensors
        .keys()
        .filter_map(|key| Some((key.strip_prefix("out.depth")?.parse().ok()?, key.clone())))
        .collect();
    depths.sort();
    if depths.is_empty() {
        return Err("depth_ln: no `out.depth{l}` tensor".to_string());
    }
    let mut checks = Vec::new();
    for (depth, key) in depths {
        let config = DepthLnConfig::new(width, depth)
            .with_strength(strength)
            .with_epsilon(epsilon);
        let mut norm = config.init(device).map_err(|err| err.to_string())?;
        norm.norm.gamma = Param::from_tensor(gamma.clone());
        norm.norm.beta = Some(Param::from_tensor(beta.clone()));
        checks.push(golden.compare_tensor(&key, norm.forward(input.clone()), VALUE_TOLERANCE)?);
    }
    Ok(checks)
}

/// The multi-stream and dense files' tolerances are relative to the reference's scale
/// (tests/golden/README.md): `base · max(1, max|reference|)`.
fn relative_tolerance(golden: &Golden, key: &str, base: f64) -> Result<f64, String> {
    let largest = golden
        .values(key)?
        .iter()
        .fold(1.0_f64, |max, v| max.max(v.abs()));
    Ok(base * largest)
}

impl Golden {
    /// Compares `actual` (whatever its rank, with the golden tensor's element count) with the
    /// golden tensor `key`, within `base` relative to the reference's scale.
    fn compare_relative<const D: usize>(
        &self,
        key: &str,
        actual: Tensor<D>,
        base: f64,
    ) -> Result<Check, String> {
        let shape = self.entry(key)?.0.clone();
        let values: Vec<f64> = actual.into_data().iter::<f64>().collect();
        let shape_of_actual = if values.len() == shape.iter().product::<usize>() {
            shape.clone()
        } else {
            vec![values.len()]
        };
        let tolerance = relative_tolerance(self, key, base)?;
        self.compare(key, values, &shape_of_actual, tolerance)
    }

    /// The parameter `key` (whatever its stored rank, `[]` included) as a rank-`D` tensor of
    /// `shape`.
    fn param<const D: usize>(
        &self,
        key: &str,
        shape: [usize; D],
        device: &Device,
    ) -> Result<Param<Tensor<D>>, String> {
        let values = self.entry(key)?.1.clone();
        if values.len() != shape.iter().product::<usize>() {
            return Err(format!(
                "{}: `{key}` does not hold {shape:?} values",
                self.name
            ));
        }
        Ok(Param::from_tensor(Tensor::from_data(
            TensorData::new(values, shape),
            device,
        )))
    }

    fn meta_text(&self, key: &str) -> Result<&str, String> {
        self.metadata
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| format!("{}: missing metadata `{key}`", self.name))
    }

    /// The stream reduction the file was made with.
    fn reduce(&self) -> Result<StreamReduce, String> {
        match self.meta_text("reduce")? {
            "sum" => Ok(StreamReduce::Sum),
            "mean" => Ok(StreamReduce::Mean),
            other => Err(format!("{}: unknown reduce `{other}`", self.name)),
        }
    }

    /// The golden blocks under `{prefix}blocks`, as many as the `blocks` metadata says.
    fn blocks(&self, prefix: &str, device: &Device) -> Result<Vec<TanhBlock>, String> {
        let blocks = tanh_blocks(self, &format!("{prefix}blocks"), device)?;
        let expected = self.meta_number("blocks")?;
        if blocks.len() as f64 != expected {
            return Err(format!(
                "{}: {} blocks for {expected}",
                self.name,
                blocks.len()
            ));
        }
        Ok(blocks)
    }
}

/// The gradients of every block weight and of the input.
fn block_and_input_grads(
    golden: &Golden,
    prefix: &str,
    blocks: &[TanhBlock],
    input: &Tensor<3>,
    grads: &burn::tensor::Gradients,
) -> Result<Vec<Check>, String> {
    let mut checks = Vec::new();
    let grad = input.grad(grads).ok_or("the input got no gradient")?;
    let key = format!("{prefix}grad.input");
    checks.push(golden.compare_relative(&key, grad, GRADIENT_TOLERANCE)?);
    for (j, block) in blocks.iter().enumerate() {
        let key = format!("{prefix}grad.blocks.{j}.weight");
        let grad = block
            .linear
            .weight
            .val()
            .grad(grads)
            .ok_or_else(|| format!("block {j} got no gradient"))?;
        checks.push(golden.compare_relative(&key, grad, GRADIENT_TOLERANCE)?);
    }
    Ok(checks)
}

/// The gradient of a parameter, flattened.
fn flat_grad<const D: usize>(
    param: &Param<Tensor<D>>,
    grads: &burn::tensor::Gradients,
) -> Option<Tensor<1>> {
    param.val().grad(grads).map(|grad| grad.reshape([-1]))
}

/// The gradients of block `j`'s connectivity parameters against `grad.layers.{j}.{name}`.
fn compare_layer_grads<const N: usize>(
    golden: &Golden,
    j: usize,
    params: [(&str, Option<Tensor<1>>); N],
) -> Result<Vec<Check>, String> {
    params
        .into_iter()
        .map(|(name, grad)| {
            let grad =
                grad.ok_or_else(|| format!("{}: layer {j} {name} got no gradient", golden.name))?;
            golden.compare_relative(&format!("grad.layers.{j}.{name}"), grad, GRADIENT_TOLERANCE)
        })
        .collect()
}

/// Output, streams and readout of a multi-stream stack, and the gradients of the input and the
/// blocks for the loss `sum(y · probe)` (returned for the connectivity's own parameters).
fn multi_stream_outputs<
    C: StreamConnectivity<3, State = burn_connectivity::MultiStreamState<3>>,
>(
    golden: &Golden,
    stack: &Stack<TanhBlock, C>,
    input: &Tensor<3>,
    probe: Tensor<3>,
) -> Result<(Vec<Check>, burn::tensor::Gradients), String> {
    let state = stack
        .run(input.clone(), stack.num_blocks(), &())
        .map_err(|err| err.to_string())?;
    let y = stack.connectivity.output(&state);
    let grads = (y.clone() * probe).sum().backward();
    let readout: Tensor<4> = Tensor::stack(stack.readout(input.clone()), 0);
    let mut checks = vec![
        golden.compare_relative("out.y", y, VALUE_TOLERANCE)?,
        golden.compare_relative("out.streams", state.units, VALUE_TOLERANCE)?,
        golden.compare_relative("out.readout", readout, VALUE_TOLERANCE)?,
    ];
    checks.extend(block_and_input_grads(
        golden,
        "",
        &stack.blocks,
        input,
        &grads,
    )?);
    Ok((checks, grads))
}

/// What every multi-stream file holds: its stream count, the input (tracked), the probe of the
/// loss, the width and the blocks.
struct MultiStreamProblem {
    streams: usize,
    input: Tensor<3>,
    probe: Tensor<3>,
    width: usize,
    blocks: Vec<TanhBlock>,
}

impl MultiStreamProblem {
    fn load(golden: &Golden, device: &Device) -> Result<Self, String> {
        if golden.meta_text("expand")? != "copy" {
            return Err(format!("{}: only `expand = copy` is known", golden.name));
        }
        let input = golden.tensor::<3>("input", device)?.require_grad();
        Ok(Self {
            streams: golden.meta_number("streams")? as usize,
            probe: golden.tensor::<3>("probe", device)?,
            width: input.dims()[2],
            input,
            blocks: golden.blocks("", device)?,
        })
    }
}

/// Hyper-connections (lucidrains' package): output, streams, readout and the gradients of the
/// input, the blocks and every connection parameter.
pub fn check_hc(golden: &Golden, device: &Device) -> Result<Vec<Check>, String> {
    let device = device.clone().autodiff();
    let MultiStreamProblem {
        streams,
        input,
        probe,
        width,
        blocks,
    } = MultiStreamProblem::load(golden, &device)?;
    let config = HyperConnectionsConfig::new(width)
        .with_streams(streams)
        .with_reduce(golden.reduce()?);
    let mut hc = config
        .init(blocks.len(), &device)
        .map_err(|err| err.to_string())?;
    let columns = streams + 1;
    for (j, layer) in hc.layers.iter_mut().enumerate() {
        let key = |name: &str| format!("layers.{j}.{name}");
        layer.static_alpha = golden.param(&key("static_alpha"), [streams, columns], &device)?;
        layer.static_beta = golden.param(&key("static_beta"), [streams], &device)?;
        let dynamic = layer.dynamic.as_mut().ok_or("hc: a dynamic layer")?;
        dynamic.dynamic_alpha_fn =
            golden.param(&key("dynamic_alpha_fn"), [width, columns], &device)?;
        dynamic.dynamic_alpha_scale = golden.param(&key("dynamic_alpha_scale"), [1], &device)?;
        dynamic.dynamic_beta_fn = golden.param(&key("dynamic_beta_fn"), [width], &device)?;
        dynamic.dynamic_beta_scale = golden.param(&key("dynamic_beta_scale"), [1], &device)?;
        dynamic.norm_gamma = golden.param(&key("norm.gamma"), [width], &device)?;
    }
    let stack = Stack::from_parts(blocks, hc).map_err(|err| err.to_string())?;
    let (mut checks, grads) = multi_stream_outputs(golden, &stack, &input, probe)?;
    for (j, layer) in stack.connectivity.layers.iter().enumerate() {
        let dynamic = layer.dynamic.as_ref().ok_or("hc: a dynamic layer")?;
        let params = [
            ("static_alpha", flat_grad(&layer.static_alpha, &grads)),
            ("static_beta", flat_grad(&layer.static_beta, &grads)),
            (
                "dynamic_alpha_fn",
                flat_grad(&dynamic.dynamic_alpha_fn, &grads),
            ),
            (
                "dynamic_alpha_scale",
                flat_grad(&dynamic.dynamic_alpha_scale, &grads),
            ),
            (
                "dynamic_beta_fn",
                flat_grad(&dynamic.dynamic_beta_fn, &grads),
            ),
            (
                "dynamic_beta_scale",
                flat_grad(&dynamic.dynamic_beta_scale, &grads),
            ),
            ("norm.gamma", flat_grad(&dynamic.norm_gamma, &grads)),
        ];
        checks.extend(compare_layer_grads(golden, j, params)?);
    }
    Ok(checks)
}

/// Every mHC layer's parameters (mHC's and mHC-lite's) from `layers.{j}.*`, in the shapes the
/// config made.
fn load_mhc_layers(
    golden: &Golden,
    layers: &mut [MhcLayer],
    device: &Device,
) -> Result<(), String> {
    for (j, layer) in layers.iter_mut().enumerate() {
        let key = |name: &str| format!("layers.{j}.{name}");
        layer.phi = golden.param(&key("phi"), layer.phi.dims(), device)?;
        layer.alpha_pre = golden.param(&key("alpha_pre"), [1], device)?;
        layer.alpha_post = golden.param(&key("alpha_post"), [1], device)?;
        layer.alpha_res = golden.param(&key("alpha_res"), [1], device)?;
        layer.bias = golden.param(&key("bias"), layer.bias.dims(), device)?;
    }
    Ok(())
}

/// The gradients of every mHC layer's parameters against `grad.layers.{j}.*`.
fn mhc_layer_grads(
    golden: &Golden,
    layers: &[MhcLayer],
    grads: &burn::tensor::Gradients,
) -> Result<Vec<Check>, String> {
    let mut checks = Vec::new();
    for (j, layer) in layers.iter().enumerate() {
        let params = [
            ("phi", flat_grad(&layer.phi, grads)),
            ("alpha_pre", flat_grad(&layer.alpha_pre, grads)),
            ("alpha_post", flat_grad(&layer.alpha_post, grads)),
            ("alpha_res", flat_grad(&layer.alpha_res, grads)),
            ("bias", flat_grad(&layer.bias, grads)),
        ];
        checks.extend(compare_layer_grads(golden, j, params)?);
    }
    Ok(checks)
}

/// The last block's `H_pre`, `H_post`, `H_res` against `out.last.*`.
fn last_connections(golden: &Golden, connections: MhcConnections) -> Result<Vec<Check>, String> {
    Ok(vec![
        golden.compare_relative("out.last.h_pre", connections.pre, VALUE_TOLERANCE)?,
        golden.compare_relative("out.last.h_post", connections.post, VALUE_TOLERANCE)?,
        golden.compare_relative("out.last.h_res", connections.res, VALUE_TOLERANCE)?,
    ])
}

/// mHC: output, streams, readout, the last block's `H_pre`, `H_post`, `H_res`, the gradients,
/// and Sinkhorn-Knopp alone with its gradient.
pub fn check_mhc(golden: &Golden, device: &Device) -> Result<Vec<Check>, String> {
    let device = device.clone().autodiff();
    let MultiStreamProblem {
        streams,
        input,
        probe,
        width,
        blocks,
    } = MultiStreamProblem::load(golden, &device)?;
    check_mhc_eps(golden, "eps")?;
    let iterations = golden.meta_number("sinkhorn_iters")? as usize;
    let config = MhcConfig::new(width)
        .with_streams(streams)
        .with_sinkhorn_iterations(iterations)
        .with_reduce(golden.reduce()?);
    let mut mhc = config
        .init(blocks.len(), &device)
        .map_err(|err| err.to_string())?;
    load_mhc_layers(golden, &mut mhc.layers, &device)?;
    let stack = Stack::from_parts(blocks, mhc).map_err(|err| err.to_string())?;
    let (mut checks, grads) = multi_stream_outputs(golden, &stack, &input, probe)?;
    checks.extend(mhc_layer_grads(golden, &stack.connectivity.layers, &grads)?);
    let last = stack.num_blocks() - 1;
    let before_last = stack
        .run(input.clone(), last, &())
        .map_err(|err| err.to_string())?;
    let connections = stack
        .connectivity
        .connections(last, &before_last)
        .map_err(|err| err.to_string())?;
    checks.extend(last_connections(golden, connections)?);

    let logits = golden
        .tensor::<3>("sinkhorn.logits", &device)?
        .require_grad();
    let sinkhorn = sinkhorn_knopp(logits.clone(), iterations).map_err(|err| err.to_string())?;
    let grads = (sinkhorn.clone() * golden.tensor::<3>("sinkhorn.probe", &device)?)
        .sum()
        .backward();
    checks.push(golden.compare_relative("sinkhorn.out", sinkhorn, VALUE_TOLERANCE)?);
    let grad = logits
        .grad(&grads)
        .ok_or("mhc: the Sinkhorn logits got no gradient")?;
    checks.push(golden.compare_relative("sinkhorn.grad", grad, GRADIENT_TOLERANCE)?);
    Ok(checks)
}

/// mHC-lite (the equations of arXiv 2601.05732): output, streams, readout, the last block's
/// connections and the gradients of the input, the blocks and every layer's parameters.
pub fn check_mhc_lite(golden: &Golden, device: &Device) -> Result<Vec<Check>, String> {
    let device = device.clone().autodiff();
    let MultiStreamProblem {
        streams,
        input,
        probe,
        width,
        blocks,
    } = MultiStreamProblem::load(golden, &device)?;
    check_mhc_eps(golden, "epsilon")?;
    let config = MhcLiteConfig::new(width)
        .with_streams(streams)
        .with_reduce(golden.reduce()?);
    let mut lite = config
        .init(blocks.len(), &device)
        .map_err(|err| err.to_string())?;
    load_mhc_layers(golden, &mut lite.layers, &device)?;
    let stack = Stack::from_parts(blocks, lite).map_err(|err| err.to_string())?;
    let (mut checks, grads) = multi_stream_outputs(golden, &stack, &input, probe)?;
    checks.extend(mhc_layer_grads(golden, &stack.connectivity.layers, &grads)?);
    let last = stack.num_blocks() - 1;
    let before_last = stack.run(input, last, &()).map_err(|err| err.to_string())?;
    let connections = stack
        .connectivity
        .connections(last, &before_last)
        .map_err(|err| err.to_string())?;
    checks.extend(last_connections(golden, connections)?);
    Ok(checks)
}

/// `{prefix}out.y` and `{prefix}out.readout` of `stack` on `input`, and the gradients of the
/// input and the blocks for the loss `sum(y · probe)` (returned for the connectivity's own
/// parameters).
fn stack_outputs<C: StreamConnectivity<3>>(
    golden: &Golden,
    prefix: &str,
    stack: &Stack<TanhBlock, C>,
    input: &Tensor<3>,
    probe: Tensor<3>,
) -> Result<(Vec<Check>, burn::tensor::Gradients), String> {
    let y = stack.forward(input.clone());
    let grads = (y.clone() * probe).sum().backward();
    let readout: Tensor<4> = Tensor::stack(stack.readout(input.clone()), 0);
    let mut checks = vec![
        golden.compare_relative(&format!("{prefix}out.y"), y, VALUE_TOLERANCE)?,
        golden.compare_relative(&format!("{prefix}out.readout"), readout, VALUE_TOLERANCE)?,
    ];
    checks.extend(block_and_input_grads(
        golden,
        prefix,
        &stack.blocks,
        input,
        &grads,
    )?);
    Ok((checks, grads))
}

/// `dense` is dilation 1, period 1; `d{δ}p{p}` is dilation δ, period p.
fn dwa_variant(prefix: &str) -> Option<(usize, usize)> {
    if prefix == "dense" {
        return Some((1, 1));
    }
    let (dilation, period) = prefix.strip_prefix('d')?.split_once('p')?;
    Some((dilation.parse().ok()?, period.parse().ok()?))
}

/// DenseFormer DWA, every variant in the file: output, readout and the gradients of the input,
/// the blocks and every weight vector.
pub fn check_dwa(golden: &Golden, device: &Device) -> Result<Vec<Check>, String> {
    let device = device.clone().autodiff();
    let mut prefixes: Vec<String> = golden
        .tensors
        .keys()
        .filter_map(|key| key.strip_suffix(".out.y").map(str::to_string))
        .collect();
    prefixes.sort();
    if prefixes.is_empty() {
        return Err("dwa: no `{prefix}.out.y`".into());
    }
    let mut checks = Vec::new();
    for name in prefixes {
        let (dilation, period) =
            dwa_variant(&name).ok_or_else(|| format!("dwa: unknown variant `{name}`"))?;
        let prefix = format!("{name}.");
        let input = golden
            .tensor::<3>(&format!("{prefix}input"), &device)?
            .require_grad();
        let probe = golden.tensor::<3>(&format!("{prefix}probe"), &device)?;
        let blocks = golden.blocks(&prefix, &device)?;
        let config = DenseFormerConfig::new()
            .with_dilation(dilation)
            .with_period(period);
        let mut dwa = config
            .init(blocks.len(), &device)
            .map_err(|err| err.to_string())?;
        let averaged: Vec<usize> = dwa.weight_values().into_iter().map(|(i, _)| i).collect();
        for (alpha, i) in dwa.alphas.iter_mut().zip(&averaged) {
            *alpha = golden.param(&format!("{prefix}alphas.{i}"), alpha.dims(), &device)?;
        }
        let stack = Stack::from_parts(blocks, dwa).map_err(|err| err.to_string())?;
        let (outputs, grads) = stack_outputs(golden, &prefix, &stack, &input, probe)?;
        checks.extend(outputs);
        for (alpha, i) in stack.connectivity.alphas.iter().zip(&averaged) {
            let grad = alpha
                .val()
                .grad(&grads)
                .ok_or_else(|| format!("dwa: alphas.{i} got no gradient"))?;
            checks.push(golden.compare_relative(
                &format!("{prefix}grad.alphas.{i}"),
                grad,
                GRADIENT_TOLERANCE,
            )?);
        }
        let golden_averages = golden
            .tensors
            .keys()
            .filter(|key| key.starts_with(&format!("{prefix}alphas.")))
            .count();
        if golden_averages != averaged.len() {
            return Err(format!(
                "dwa: `{name}` has {golden_averages} weight vectors, dilation {dilation} and period {period} give {}",
                averaged.len()
            ));
        }
    }
    Ok(checks)
}

/// `name:k=K:attend|sum`, one entry per variant of the `variants` metadata.
fn attnres_variants(golden: &Golden) -> Result<Vec<(String, usize, AttnResOutput)>, String> {
    golden
        .meta_text("variants")?
        .split(',')
        .map(|entry| {
            let parts: Vec<&str> = entry.split(':').collect();
            let [name, size, output] = parts.as_slice() else {
                return Err(format!("attnres: malformed variant `{entry}`"));
            };
            let block_size = size
                .strip_prefix("k=")
                .and_then(|k| k.parse().ok())
                .ok_or_else(|| format!("attnres: malformed block size in `{entry}`"))?;
            let output = match *output {
                "attend" => AttnResOutput::Attend,
                "sum" => AttnResOutput::Sum,
                other => return Err(format!("attnres: unknown output `{other}`")),
            };
            Ok((name.to_string(), block_size, output))
        })
        .collect()
}

/// Attention Residuals (full and block; `attn-res`'s operator): output, readout, block inputs
/// and the gradients of the input, the blocks and the pseudo-queries, every variant in the file.
pub fn check_attnres(golden: &Golden, device: &Device) -> Result<Vec<Check>, String> {
    let device = device.clone().autodiff();
    let probe = golden.tensor::<3>("probe", &device)?;
    let epsilon = golden.meta_number("epsilon")?;
    let mut checks = Vec::new();
    for (name, block_size, output) in attnres_variants(golden)? {
        let prefix = format!("{name}.");
        let input = golden.tensor::<3>("input", &device)?.require_grad();
        let width = input.dims()[2];
        let blocks = golden.blocks("", &device)?;
        let config = AttentionResidualsConfig::new(width)
            .with_block_size(block_size)
            .with_epsilon(epsilon)
            .with_output(output);
        let mut attnres = config
            .init(blocks.len(), &device)
            .map_err(|err| err.to_string())?;
        attnres.queries =
            golden.param(&format!("{prefix}queries"), [blocks.len(), width], &device)?;
        if let Some(query) = attnres.output_query.as_mut() {
            *query = golden.param(&format!("{prefix}output_query"), [width], &device)?;
        }
        let stack = Stack::from_parts(blocks, attnres).map_err(|err| err.to_string())?;
        let (outputs, grads) = stack_outputs(golden, &prefix, &stack, &input, probe.clone())?;
        checks.extend(outputs);
        // Every block's input, from the connectivity's own recursion.
        let mut state = stack.connectivity.start(input.clone());
        let mut inputs = Vec::new();
        for (j, block) in stack.blocks.iter().enumerate() {
            let block_input = stack.connectivity.block_input(&state);
            let branch = block.branch(block_input.clone(), &());
            inputs.push(block_input);
            state = stack.connectivity.step(state, j, branch);
        }
        let inputs: Tensor<4> = Tensor::stack(inputs, 0);
        checks.push(golden.compare_relative(
            &format!("{prefix}out.inputs"),
            inputs,
            VALUE_TOLERANCE,
        )?);
        let queries = flat_grad(&stack.connectivity.queries, &grads)
            .ok_or("attnres: the queries got no gradient")?;
        checks.push(golden.compare_relative(
            &format!("{prefix}grad.queries"),
            queries,
            GRADIENT_TOLERANCE,
        )?);
        if let Some(query) = &stack.connectivity.output_query {
            let grad =
                flat_grad(query, &grads).ok_or("attnres: the output query got no gradient")?;
            checks.push(golden.compare_relative(
                &format!("{prefix}grad.output_query"),
                grad,
                GRADIENT_TOLERANCE,
            )?);
        }
    }
    Ok(checks)
}

/// The file's ε (metadata `key`) against the crate's fixed `MHC_EPS`.
fn check_mhc_eps(golden: &Golden, key: &str) -> Result<(), String> {
    let eps = golden.meta_number(key)?;
    let crate_eps = burn_connectivity::mhc::MHC_EPS;
    if (eps - crate_eps).abs() > 1e-12 {
        return Err(format!(
            "{}: {key} {eps}, the crate uses {crate_eps}",
            golden.name
        ));
    }
    Ok(())
}

/// DeepSeek-V4's mHC (`transformers`' hyper-connection and head): output, streams, readout and
/// the gradients of the input, the blocks, every layer's parameters and the head's.
pub fn check_mhc_v4(golden: &Golden, device: &Device) -> Result<Vec<Check>, String> {
    let device = device.clone().autodiff();
    let MultiStreamProblem {
        streams,
        input,
        probe,
        width,
        blocks,
    } = MultiStreamProblem::load(golden, &device)?;
    check_mhc_eps(golden, "epsilon")?;
    let config = MhcV4Config::new(width)
        .with_streams(streams)
        .with_sinkhorn_iterations(golden.meta_number("sinkhorn_iters")? as usize);
    let mut v4 = config
        .init(blocks.len(), &device)
        .map_err(|err| err.to_string())?;
    let (outputs, entries) = ((2 + streams) * streams, streams * width);
    for (j, layer) in v4.layers.iter_mut().enumerate() {
        let key = |name: &str| format!("layers.{j}.{name}");
        layer.weights = golden.param(&key("weights"), [outputs, entries], &device)?;
        layer.base = golden.param(&key("base"), [outputs], &device)?;
        layer.scale = golden.param(&key("scale"), [3], &device)?;
    }
    v4.head.weights = golden.param("head.weights", [streams, entries], &device)?;
    v4.head.base = golden.param("head.base", [streams], &device)?;
    v4.head.scale = golden.param("head.scale", [1], &device)?;
    let stack = Stack::from_parts(blocks, v4).map_err(|err| err.to_string())?;
    let (mut checks, grads) = multi_stream_outputs(golden, &stack, &input, probe)?;
    for (j, layer) in stack.connectivity.layers.iter().enumerate() {
        let params = [
            ("weights", flat_grad(&layer.weights, &grads)),
            ("base", flat_grad(&layer.base, &grads)),
            ("scale", flat_grad(&layer.scale, &grads)),
        ];
        checks.extend(compare_layer_grads(golden, j, params)?);
    }
    let head = &stack.connectivity.head;
    for (name, grad) in [
        ("weights", flat_grad(&head.weights, &grads)),
        ("base", flat_grad(&head.base, &grads)),
        ("scale", flat_grad(&head.scale, &grads)),
    ] {
        let grad = grad.ok_or_else(|| format!("mhc_v4: head {name} got no gradient"))?;
        checks.push(golden.compare_relative(
            &format!("grad.head.{name}"),
            grad,
            GRADIENT_TOLERANCE,
        )?);
    }
    Ok(checks)
}

/// LAuReL's variants from the metadata `name:form:rw=0|1:lr=0|1:k=K:gamma=0|1`: the config of
/// each, for width `width` and the file's rank and ε.
fn laurel_variants(golden: &Golden, width: usize) -> Result<Vec<(String, LaurelConfig)>, String> {
    let rank = golden.meta_number("rank")? as usize;
    let epsilon = golden.meta_number("epsilon")?;
    golden
        .meta_text("variants")?
        .split(',')
        .map(|entry| {
            let parts: Vec<&str> = entry.split(':').collect();
            let [name, form, rw, lr, k, _gamma] = parts.as_slice() else {
                return Err(format!("laurel: malformed variant `{entry}`"));
            };
            let flag = |text: &str, key: &str| -> Result<usize, String> {
                text.strip_prefix(key)
                    .and_then(|value| value.parse().ok())
                    .ok_or_else(|| format!("laurel: malformed `{key}` in `{entry}`"))
            };
            let config = match *form {
                "paper" => LaurelConfig::new(width)
                    .with_reweight(flag(rw, "rw=")? == 1)
                    .with_rank((flag(lr, "lr=")? == 1).then_some(rank))
                    .with_previous(flag(k, "k=")?),
                "gemma3n" => LaurelConfig::gemma3n(width, rank),
                other => return Err(format!("laurel: unknown form `{other}`")),
            };
            Ok((name.to_string(), config.with_epsilon(epsilon)))
        })
        .collect()
}

/// LAuReL (the paper's variants and Gemma 3n's block): output, readout and the gradients of the
/// input, the blocks and every parameter, every variant in the file.
pub fn check_laurel(golden: &Golden, device: &Device) -> Result<Vec<Check>, String> {
    let device = device.clone().autodiff();
    let probe = golden.tensor::<3>("probe", &device)?;
    let width = golden.tensor::<3>("input", &device)?.dims()[2];
    let mut checks = Vec::new();
    for (name, config) in laurel_variants(golden, width)? {
        let prefix = format!("{name}.");
        let input = golden.tensor::<3>("input", &device)?.require_grad();
        let blocks = golden.blocks("", &device)?;
        let mut laurel = config
            .init(blocks.len(), &device)
            .map_err(|err| err.to_string())?;
        for (i, layer) in laurel.layers.iter_mut().enumerate() {
            let key = |param: &str| format!("{prefix}layers.{i}.{param}");
            for (param, value) in [("alpha", &mut layer.alpha), ("beta", &mut layer.beta)] {
                if let Some(value) = value {
                    *value = golden.param(&key(param), [1], &device)?;
                }
            }
            if let Some(gamma) = &mut layer.gamma {
                *gamma = golden.param(&key("gamma"), gamma.dims(), &device)?;
            }
            for (j, (down, up)) in layer.down.iter_mut().zip(&mut layer.up).enumerate() {
                *down = golden.param(&key(&format!("down.{j}")), down.dims(), &device)?;
                *up = golden.param(&key(&format!("up.{j}")), up.dims(), &device)?;
            }
            for (param, value) in [
                ("input_norm", &mut layer.input_norm),
                ("output_norm", &mut layer.output_norm),
            ] {
                if let Some(value) = value {
                    *value = golden.param(&key(param), [width], &device)?;
                }
            }
        }
        let stack = Stack::from_parts(blocks, laurel).map_err(|err| err.to_string())?;
        let (outputs, grads) = stack_outputs(golden, &prefix, &stack, &input, probe.clone())?;
        checks.extend(outputs);
        for (i, layer) in stack.connectivity.layers.iter().enumerate() {
            let mut params: Vec<(String, Option<Tensor<1>>)> = Vec::new();
            for (param, value) in [
                ("alpha", &layer.alpha),
                ("beta", &layer.beta),
                ("gamma", &layer.gamma),
                ("input_norm", &layer.input_norm),
                ("output_norm", &layer.output_norm),
            ] {
                if let Some(value) = value {
                    params.push((param.to_string(), flat_grad(value, &grads)));
                }
            }
            for (j, (down, up)) in layer.down.iter().zip(&layer.up).enumerate() {
                params.push((format!("down.{j}"), flat_grad(down, &grads)));
                params.push((format!("up.{j}"), flat_grad(up, &grads)));
            }
            for (param, grad) in params {
                let key = format!("{prefix}grad.layers.{i}.{param}");
                let grad = grad.ok_or_else(|| format!("laurel: {key} got no gradient"))?;
                checks.push(golden.compare_relative(&key, grad, GRADIENT_TOLERANCE)?);
            }
        }
    }
    Ok(checks)
}

/// MUDD (one way and four): output, readout, the query/key/value inputs (four ways) and the
/// gradients of the input, the blocks and every layer's weights, every variant in the file.
pub fn check_mudd(golden: &Golden, device: &Device) -> Result<Vec<Check>, String> {
    let device = device.clone().autodiff();
    let probe = golden.tensor::<3>("probe", &device)?;
    let epsilon = golden.meta_number("epsilon")?;
    let mut checks = Vec::new();
    for (name, ways) in [("one", MuddWays::One), ("qkvr", MuddWays::Qkvr)] {
        let key = format!("ways.{name}");
        if golden.meta_text(&key).is_err() {
            continue;
        }
        let prefix = format!("{name}.");
        let input = golden.tensor::<3>("input", &device)?.require_grad();
        let width = input.dims()[2];
        let blocks = golden.blocks("", &device)?;
        let config = MuddConfig::new(width).with_ways(ways).with_epsilon(epsilon);
        let mut mudd = config
            .init(blocks.len(), &device)
            .map_err(|err| err.to_string())?;
        for (i, layer) in mudd.layers.iter_mut().enumerate() {
            let key = |param: &str| format!("{prefix}layers.{i}.{param}");
            layer.w1 = golden.param(&key("w1"), layer.w1.dims(), &device)?;
            layer.w2 = golden.param(&key("w2"), layer.w2.dims(), &device)?;
            layer.static_weights =
                golden.param(&key("static"), layer.static_weights.dims(), &device)?;
        }
        let stack = Stack::from_parts(blocks, mudd).map_err(|err| err.to_string())?;
        // The query, key and value inputs of every block, from the connectivity's recursion.
        let mut state = stack.connectivity.start(input.clone());
        let mut apart = Vec::new();
        for (j, block) in stack.blocks.iter().enumerate() {
            if let Some(ways) = stack.connectivity.way_inputs(&state) {
                apart.push(Tensor::stack::<4>(ways.to_vec(), 0));
            }
            let branch = block.branch(stack.connectivity.block_input(&state), &());
            state = stack.connectivity.step(state, j, branch);
        }
        let y = stack.connectivity.output(&state);
        let mut loss = (y.clone() * probe.clone()).sum();
        if ways == MuddWays::Qkvr {
            let apart: Tensor<5> = Tensor::stack(apart, 0);
            let probe_ways = golden.tensor::<5>(&format!("{prefix}probe_ways"), &device)?;
            loss = loss + (apart.clone() * probe_ways).sum();
            checks.push(golden.compare_relative(
                &format!("{prefix}out.ways"),
                apart,
                VALUE_TOLERANCE,
            )?);
        } else if !apart.is_empty() {
            return Err("mudd: one way made query/key/value inputs".into());
        }
        let grads = loss.backward();
        let readout: Tensor<4> = Tensor::stack(stack.readout(input.clone()), 0);
        checks.push(golden.compare_relative(&format!("{prefix}out.y"), y, VALUE_TOLERANCE)?);
        checks.push(golden.compare_relative(
            &format!("{prefix}out.readout"),
            readout,
            VALUE_TOLERANCE,
        )?);
        checks.extend(block_and_input_grads(
            golden,
            &prefix,
            &stack.blocks,
            &input,
            &grads,
        )?);
        for (i, layer) in stack.connectivity.layers.iter().enumerate() {
            for (param, value) in [
                ("w1", flat_grad(&layer.w1, &grads)),
                ("w2", flat_grad(&layer.w2, &grads)),
                ("static", flat_grad(&layer.static_weights, &grads)),
            ] {
                let key = format!("{prefix}grad.layers.{i}.{param}");
                let grad = value.ok_or_else(|| format!("mudd: {key} got no gradient"))?;
                checks.push(golden.compare_relative(&key, grad, GRADIENT_TOLERANCE)?);
            }
        }
    }
    Ok(checks)
}
