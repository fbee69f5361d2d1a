//! Picking a Burn device by backend name, for command-line tools and examples.
//!
//! Each backend is a cargo feature of this crate forwarding to Burn's feature of the same name:
//! `flex` (default, pure-Rust CPU), `ndarray` (deprecated upstream), `wgpu`, `vulkan`, `metal`,
//! `cuda` and `tch` (LibTorch's CPU device; PyTorch's kernels, see the README for the setup).
//!
//! ```
//! let device = burn_connectivity::device::device("flex")?; // `.autodiff()` to train
//! assert!(burn_connectivity::device::compiled_backends().contains(&"flex"));
//! # Ok::<(), burn_connectivity::Error>(())
//! ```

use burn::prelude::*;

use crate::error::{Error, Result};

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flex_is_compiled_by_default() {
        assert!(compiled_backends().contains(&"flex"));
        assert!(device("flex").is_ok());
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
