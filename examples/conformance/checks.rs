//! Conformance checks against the golden vectors (format: tests/golden/README.md).
//!
//! Shared by the `conformance` example and `tests/conformance.rs`. Every size (blocks, widths,
//! depths) is read from the files.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use burn::module::Param;
use burn::nn::Linear;
use burn::prelude::*;
use burn_connectivity::hyperzzw::{
    Crop, LocalHyperZzw, SRenorm, SlowNet, direct_conv_1d, global_hyperzzw_1d, global_hyperzzw_2d,
};
use burn_connectivity::{
    AncreConfig, AncreInit, Block, Connectivity, ConnectivityConfig, DepthLnConfig, GateInit,
    HacnConfig, Stack,
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
            "{} {:.3e} {:.0e} {verdict}",
            self.name, self.max_abs_err, self.tolerance
        )
    }
}

/// A golden file: named f32 tensors and the header metadata.
pub struct Golden {
    name: String,
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    metadata: HashMap<String, String>,
}

type Checker = fn(&Golden, &Device) -> Result<Vec<Check>, String>;

/// The golden files this runner knows, and the checks of each.
pub const KNOWN_FILES: [(&str, Checker); 4] = [
    ("hacn.safetensors", check_hacn),
    ("depth_ln.safetensors", check_depth_ln),
    ("ancre.safetensors", check_ancre),
    ("hyperzzw.safetensors", check_hyperzzw),
];

/// Runs the checks of every known golden file present in `dir`.
///
/// Returns the checks per file found; an error if none is found or a file is malformed.
pub fn run_dir(dir: &Path, device: &Device) -> Result<Vec<(String, Vec<Check>)>, String> {
    let mut results = Vec::new();
    for (file, checker) in KNOWN_FILES {
        let path = dir.join(file);
        if path.exists() {
            let golden = Golden::load(&path)?;
            results.push((file.to_string(), checker(&golden, device)?));
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
        let max_abs_err = if shape.as_slice() == actual_shape {
            let expected: Vec<f64> = expected.iter().map(|&value| f64::from(value)).collect();
            max_abs_err(&expected, &actual)
        } else {
            f64::INFINITY
        };
        Ok(Check {
            name: format!("{}.{key}", self.name),
            max_abs_err,
            tolerance,
        })
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
        tolerance: GRADIENT_TOLERANCE,
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
