//! Picking a Burn device by backend name, for command-line tools and examples.
//!
//! Each backend is a cargo feature of this crate forwarding to Burn's feature of the same name:
//! `flex` (default, pure-Rust CPU), `ndarray` (deprecated upstream), `wgpu`, `vulkan`, `metal`,
//! `cuda` and `tch` (LibTorch's CPU device; PyTorch's kernels, see the README for the setup).

use burn::nn::LayerNorm;
use burn::prelude::*;

use crate::error::{Error, Result};

/// In a fused op's `Backward`: registers each computed gradient with its parent, where the
/// parent is tracked (the parents' node type is private to burn-autodiff, hence a macro; `B` is
/// the op's backend). Defined before the op modules, which use it.
#[cfg(any(feature = "flex", feature = "tch"))]
macro_rules! register_tracked {
    ($grads:expr, $parents:expr, $computed:expr) => {
        for (parent, grad) in $parents.into_iter().zip($computed) {
            if let Some(parent) = parent {
                $grads.register::<B>(parent.id, grad);
            }
        }
    };
}

#[cfg(feature = "flex")]
pub(crate) mod fft_conv;
#[cfg(feature = "flex")]
mod flex_kernels;
#[cfg(feature = "flex")]
pub(crate) mod gelu;
#[cfg(feature = "flex")]
mod history_mix;
#[cfg(any(feature = "flex", feature = "tch"))]
mod layer_norm;
#[cfg(feature = "flex")]
pub(crate) use history_mix::History;
#[cfg(feature = "flex")]
pub(crate) mod normed_projection;
#[cfg(any(feature = "cube-kernels", feature = "flex"))]
pub(crate) mod sinkhorn;
#[cfg(feature = "flex")]
pub(crate) mod stream_mix;
#[cfg(feature = "flex")]
pub(crate) use stream_mix::UnitsGradient;

/// Every backend name this crate knows, compiled in or not.
pub const BACKENDS: [&str; 7] = ["flex", "ndarray", "wgpu", "vulkan", "metal", "cuda", "tch"];

/// The backend names compiled into this build.
pub fn compiled_backends() -> Vec<&'static str> {
    BACKENDS
        .into_iter()
        .filter(|name| is_compiled(name))
        .collect()
}

fn is_compiled(name: &str) -> bool {
    match name {
        "flex" => cfg!(feature = "flex"),
        "ndarray" => cfg!(feature = "ndarray"),
        "wgpu" => cfg!(feature = "wgpu"),
        "vulkan" => cfg!(feature = "vulkan"),
        "metal" => cfg!(feature = "metal"),
        "cuda" => cfg!(feature = "cuda"),
        "tch" => cfg!(feature = "tch"),
        _ => false,
    }
}

/// The default device of the backend called `name` (no autodiff; call `.autodiff()` to train).
///
/// # Errors
/// [`Error::Backend`] if the name is unknown or its cargo feature is not enabled.
pub fn device(name: &str) -> Result<Device> {
    let unavailable = |reason: String| Error::Backend {
        name: name.to_string(),
        reason,
        available: compiled_backends().join(", "),
    };
    if !BACKENDS.contains(&name) {
        return Err(unavailable(format!(
            "unknown backend, expected one of {}",
            BACKENDS.join(", ")
        )));
    }
    if !is_compiled(name) {
        return Err(unavailable(format!("rebuild with `--features {name}`")));
    }
    compiled_device(name).ok_or_else(|| unavailable("no device constructor".to_string()))
}

/// `count` devices of the backend called `name` (no autodiff), for multi-device training: CUDA
/// devices `0..count`; one device of any other backend (only CUDA devices are indexed here).
///
/// # Errors
/// [`Error::OutOfRange`] for `count = 0`; [`Error::Backend`] if the backend cannot be used (see
/// [`device`]) or several devices of a backend other than CUDA are asked for.
pub fn devices(name: &str, count: usize) -> Result<Vec<Device>> {
    crate::error::check_size("device count", count)?;
    let first = device(name)?;
    if count == 1 {
        return Ok(vec![first]);
    }
    #[cfg(feature = "cuda")]
    if name == "cuda" {
        return Ok((0..count).map(Device::cuda).collect());
    }
    Err(Error::Backend {
        name: name.to_string(),
        reason: format!("{count} devices asked for: only CUDA devices are indexed here"),
        available: compiled_backends().join(", "),
    })
}

#[allow(deprecated)] // NdArray is deprecated in Burn 0.22 but still supported here.
fn compiled_device(name: &str) -> Option<Device> {
    match name {
        #[cfg(feature = "flex")]
        "flex" => Some(Device::flex()),
        #[cfg(feature = "ndarray")]
        "ndarray" => Some(Device::ndarray()),
        #[cfg(feature = "wgpu")]
        "wgpu" => Some(Device::wgpu(Default::default())),
        #[cfg(feature = "vulkan")]
        "vulkan" => Some(Device::vulkan(Default::default())),
        #[cfg(feature = "metal")]
        "metal" => Some(Device::metal(Default::default())),
        #[cfg(feature = "cuda")]
        "cuda" => Some(Device::cuda(0)),
        #[cfg(feature = "tch")]
        "tch" => Some(Device::libtorch()),
        _ => None,
    }
}

/// Whether `device` (or the device under its autodiff layer) is a Flex device.
pub(crate) fn is_flex(device: &Device) -> bool {
    #[cfg(feature = "flex")]
    {
        matches!(
            device.clone().without_autodiff().as_dispatch(),
            burn::backend::DispatchDevice::Flex(_)
        )
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = device;
        false
    }
}

/// Whether `device` (or the device under its autodiff layer) runs on CubeCL (wgpu, vulkan,
/// metal, cuda), where Burn's fusion engine merges elementwise operations into kernels.
pub(crate) fn is_cube(device: &Device) -> bool {
    #[cfg(any(
        feature = "wgpu",
        feature = "vulkan",
        feature = "metal",
        feature = "cuda"
    ))]
    {
        matches!(
            device.clone().without_autodiff().as_dispatch(),
            burn::backend::DispatchDevice::Cube(_)
        )
    }
    #[cfg(not(any(
        feature = "wgpu",
        feature = "vulkan",
        feature = "metal",
        feature = "cuda"
    )))]
    {
        let _ = device;
        false
    }
}

/// Whether `tensor` can go through the crate's fused Sinkhorn-Knopp: CubeCL devices, and Flex
/// in f32 or f64.
#[cfg(any(feature = "cube-kernels", feature = "flex"))]
pub(crate) fn has_fused_sinkhorn<const D: usize>(tensor: &Tensor<D>) -> bool {
    is_cube(&tensor.device()) || has_fused_flex_ops(tensor)
}

/// Whether `tensor` can go through the crate's fused CPU ops (`src/backend/`): a Flex device,
/// f32 or f64.
#[cfg(any(feature = "cube-kernels", feature = "flex"))]
pub(crate) fn has_fused_flex_ops<const D: usize>(tensor: &Tensor<D>) -> bool {
    is_flex(&tensor.device())
        && matches!(
            tensor.dtype(),
            burn::tensor::DType::F32 | burn::tensor::DType::F64
        )
}

/// Without Flex there is no fused history mix: no value of this type exists.
#[cfg(not(feature = "flex"))]
#[derive(Clone, Debug)]
pub(crate) enum History {}

#[cfg(not(feature = "flex"))]
impl History {
    #[cfg(test)]
    pub(crate) fn kept_states(&self) -> Vec<usize> {
        match *self {}
    }

    pub(crate) fn forget(&self, _index: usize) {
        match *self {}
    }

    pub(crate) fn mix<const D: usize>(
        &self,
        _terms: Vec<(usize, usize)>,
        _newest_weight: usize,
        _weights: Tensor<1>,
        _newest: Tensor<D>,
    ) -> Tensor<D> {
        match *self {}
    }
}

/// Without Flex there is no fused stream mixing: no value of this type exists.
#[cfg(not(feature = "flex"))]
#[derive(Clone, Debug)]
pub(crate) enum UnitsGradient {}

/// A slot in which a multi-stream layer's ops assemble the gradient of its units `units` in one
/// pass (`src/backend/stream_mix.rs`), where the device has the fused ops and may differentiate:
/// Flex under autodiff, f32 or f64.
pub(crate) fn units_gradient(units: &Tensor<3>) -> Option<UnitsGradient> {
    #[cfg(feature = "flex")]
    {
        (has_fused_flex_ops(units) && units.device().is_autodiff()).then(UnitsGradient::default)
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = units;
        None
    }
}

/// A history for the fused weighted sums of ANCRe and DenseFormer over states like `first`
/// (`src/backend/history_mix.rs`), where the device has them: Flex, f32 or f64.
pub(crate) fn fused_history<const D: usize>(first: &Tensor<D>) -> Option<History> {
    #[cfg(feature = "flex")]
    {
        has_fused_flex_ops(first).then(|| History::new(first.device().is_autodiff()))
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = first;
        None
    }
}

/// Whether `device` (or the device under its autodiff layer) is a LibTorch device.
pub(crate) fn is_libtorch(device: &Device) -> bool {
    #[cfg(feature = "tch")]
    {
        matches!(
            device.clone().without_autodiff().as_dispatch(),
            burn::backend::DispatchDevice::LibTorch(_)
        )
    }
    #[cfg(not(feature = "tch"))]
    {
        let _ = device;
        false
    }
}

/// `norm.forward(input)`; on Flex and LibTorch under autodiff as one op forward and one backward
/// (`backend/layer_norm.rs`), where Burn would differentiate ~9 composed ops.
pub(crate) fn layer_norm<const D: usize>(norm: &LayerNorm, input: Tensor<D>) -> Tensor<D> {
    #[cfg(any(feature = "flex", feature = "tch"))]
    {
        layer_norm::layer_norm(norm, input)
    }
    #[cfg(not(any(feature = "flex", feature = "tch")))]
    {
        norm.forward(input)
    }
}

/// Whether `device` has native FFT kernels: Flex's and CubeCL's own, PyTorch's on LibTorch.
pub(crate) fn has_native_fft(device: &Device) -> bool {
    is_flex(device) || is_cube(device) || is_libtorch(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flex_is_compiled_by_default() {
        assert!(compiled_backends().contains(&"flex"));
        assert!(device("flex").is_ok());
    }

    #[test]
    fn backends_are_recognised_under_autodiff() {
        assert!(is_flex(&Device::flex().autodiff()));
        assert!(has_native_fft(&Device::flex().autodiff()));
        assert!(!is_cube(&Device::flex().autodiff()));
        #[cfg(feature = "ndarray")]
        {
            let ndarray = device("ndarray").unwrap().autodiff();
            assert!(!is_flex(&ndarray));
            assert!(!has_native_fft(&ndarray));
            assert!(!is_cube(&ndarray));
        }
        #[cfg(feature = "wgpu")]
        assert!(is_cube(&device("wgpu").unwrap().autodiff()));
        #[cfg(feature = "tch")]
        {
            let libtorch = device("tch").unwrap().autodiff();
            assert!(is_libtorch(&libtorch) && has_native_fft(&libtorch));
            assert!(!is_flex(&libtorch) && !is_cube(&libtorch));
        }
        assert!(!is_libtorch(&Device::flex().autodiff()));
    }

    #[test]
    fn several_devices_are_cuda_only() {
        assert_eq!(devices("flex", 1).unwrap().len(), 1);
        assert!(matches!(devices("flex", 0), Err(Error::OutOfRange { .. })));
        let err = devices("flex", 2).unwrap_err();
        assert!(err.to_string().contains("only CUDA"), "{err}");
        assert!(matches!(devices("tpu", 2), Err(Error::Backend { .. })));
    }

    #[test]
    fn unknown_and_missing_backends_are_errors() {
        let err = device("tpu").unwrap_err();
        assert!(matches!(err, Error::Backend { .. }));
        assert!(err.to_string().contains("unknown backend"));
        if !cfg!(feature = "cuda") {
            let err = device("cuda").unwrap_err();
            assert!(err.to_string().contains("--features cuda"), "{err}");
        }
    }
}
