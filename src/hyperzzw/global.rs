//! Global HyperZZW (paper eqs. 5–7, MATH §3.2): a context-dependent kernel `K̂ = Z ⊙ K` and the
//! linear convolution of `Z` with it over the whole sequence or map.
//!
//! ```text
//! K̂   = Z ⊙ K                    K: [1, C, T] (or [1, C, H, W]) broadcast over the batch
//! Z_g = conv(Z, K̂)               full[t] = Σ_s Z[s] · K̂[t − s],  t = 0..2T−2
//! ```
//!
//! computed as `irfft(rfft(Z, n) · rfft(K̂, n), n)` with zero padding to `n = next_pow2(2T − 1)`
//! per axis (never circular), then cropped to `T`: **causal** `full[0..T]` (the output at `t`
//! only sees `Z` at `s <= t`) or **same** `full[(T−1)/2 .. (T−1)/2 + T]`. Any length works, powers
//! of two or not. On backends without a native FFT the transform is a dense DFT by matrix
//! products (see [`FftPath`]).
//!
//! The `dot` mode of the 2D reference code replaces the convolution by a per-channel matrix
//! product over the two spatial axes: `Z_g[b, c] = K̂[b, c] @ V[b, c]`.

use burn::prelude::*;

use crate::error::{Error, Result};
use crate::hyperzzw::fft::FftPath;

/// Which `T` outputs of the full `2T − 1` linear convolution are kept.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Crop {
    /// `full[0..T]`: causal, the default for sequences.
    Causal,
    /// `full[(T−1)/2 .. (T−1)/2 + T]`: centred, the default for maps.
    Same,
}

impl Crop {
    fn start(self, length: usize) -> usize {
        match self {
            Self::Causal => 0,
            Self::Same => (length - 1) / 2,
        }
    }
}

/// The spatial layout behind a `[B, C, P]` tensor: a sequence of `P` steps or an `H x W` map
/// flattened row-major.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Geometry {
    /// A sequence of `length` positions.
    Sequence {
        /// Number of positions `T`.
        length: usize,
    },
    /// A `rows x columns` map.
    Map {
        /// Height `H`.
        rows: usize,
        /// Width `W`.
        columns: usize,
    },
}

impl Geometry {
    /// Points per axis: `[T]` or `[H, W]`.
    pub fn grid(&self) -> Vec<usize> {
        match *self {
            Self::Sequence { length } => vec![length],
            Self::Map { rows, columns } => vec![rows, columns],
        }
    }

    /// Number of positions `P`.
    pub fn positions(&self) -> usize {
        self.grid().iter().product()
    }

    /// Causal for sequences, same for maps (MATH §3.2).
    pub fn default_crop(&self) -> Crop {
        match self {
            Self::Sequence { .. } => Crop::Causal,
            Self::Map { .. } => Crop::Same,
        }
    }

    /// Rejects empty axes.
    pub(crate) fn check(&self) -> Result<()> {
        if self.grid().contains(&0) {
            return Err(Error::OutOfRange {
                name: "geometry size",
                value: 0.0,
                requirement: ">= 1 on every axis",
            });
        }
        Ok(())
    }
}

/// `conv(·, kernel)` over the positions of `[B, C, P]` tensors laid out as `geometry`, by FFT,
/// with the kernel's spectrum computed once for every tensor it convolves (the SFNE block
/// applies one context kernel to three branches).
pub(crate) struct SpectralConv {
    geometry: Geometry,
    crop: Crop,
    path: FftPath,
    /// The kernel's spectrum, `[1 or B, C, bins]` (a map's `n_rows x bins` flattened).
    spectrum: (Tensor<3>, Tensor<3>),
}

impl SpectralConv {
    /// Transforms `kernel: [1 or B, C, P]`.
    pub(crate) fn new(kernel: Tensor<3>, geometry: Geometry, crop: Crop, path: FftPath) -> Self {
        let spectrum = match geometry {
            Geometry::Sequence { length } => path.rfft(kernel, 2, fft_length(length)),
            Geometry::Map { rows, columns } => {
                let [batch, channels, _] = kernel.dims();
                let (re, im) = spectrum_2d(kernel.reshape([batch, channels, rows, columns]), path);
                let flatten = |x: Tensor<4>| x.flatten::<3>(2, 3);
                (flatten(re), flatten(im))
            }
        };
        Self {
            geometry,
            crop,
            path,
            spectrum,
        }
    }

    /// `conv(values, kernel)` cropped to the positions, `values: [B, C, P]`.
    pub(crate) fn apply(&self, values: Tensor<3>) -> Tensor<3> {
        let (path, crop) = (self.path, self.crop);
        let (kernel_re, kernel_im) = self.spectrum.clone();
        match self.geometry {
            Geometry::Sequence { length } => {
                let n = fft_length(length);
                let (re, im) = complex_mul(path.rfft(values, 2, n), (kernel_re, kernel_im));
                path.irfft(re, im, 2, n)
                    .narrow(2, crop.start(length), length)
            }
            Geometry::Map { rows, columns } => {
                let [batch, channels, positions] = values.dims();
                let [kernel_batch, _, _] = kernel_re.dims();
                let (n_rows, n_columns) = (fft_length(rows), fft_length(columns));
                let unflatten =
                    |x: Tensor<3>| x.reshape([kernel_batch, channels, n_rows, n_columns / 2 + 1]);
                let kernel = (unflatten(kernel_re), unflatten(kernel_im));
                let (re, im) = complex_mul(
                    spectrum_2d(values.reshape([batch, channels, rows, columns]), path),
                    kernel,
                );
                let (re, im) = path.cfft(re, im, 2, n_rows, true);
                path.irfft(re, im, 3, n_columns)
                    .narrow(2, crop.start(rows), rows)
                    .narrow(3, crop.start(columns), columns)
                    .reshape([batch, channels, positions])
            }
        }
    }
}

/// The FFT length of a linear convolution of two length-`length` signals: a power of two, and
/// at least 2 because CubeCL's real FFT needs both the DC and the Nyquist bin.
fn fft_length(length: usize) -> usize {
    (2 * length - 1).next_power_of_two().max(2)
}

/// Spectrum of `x: [B, C, H, W]` zero-padded for a linear convolution: real FFT along `W`,
/// complex FFT along `H`.
fn spectrum_2d(x: Tensor<4>, path: FftPath) -> (Tensor<4>, Tensor<4>) {
    let [_, _, rows, columns] = x.dims();
    let (re, im) = path.rfft(x, 3, fft_length(columns));
    path.cfft(re, im, 2, fft_length(rows), false)
}

/// Checks that `kernel` (`[1 or B, C, …]`) fits `z` (`[B, C, …]`) and that nothing is empty.
fn check_kernel<const D: usize>(z: &Tensor<D>, kernel: &Tensor<D>) -> Result<()> {
    let (z_dims, k_dims) = (z.dims(), kernel.dims());
    if z_dims.contains(&0) {
        return Err(Error::OutOfRange {
            name: "HyperZZW input size",
            value: 0.0,
            requirement: ">= 1 on every axis",
        });
    }
    if k_dims[0] != 1 && k_dims[0] != z_dims[0] {
        return Err(Error::WidthMismatch {
            name: "kernel batch (1 or the input's)".into(),
            expected: z_dims[0],
            found: k_dims[0],
        });
    }
    for axis in 1..D {
        if k_dims[axis] != z_dims[axis] {
            return Err(Error::WidthMismatch {
                name: format!("kernel axis {axis}"),
                expected: z_dims[axis],
                found: k_dims[axis],
            });
        }
    }
    Ok(())
}

/// Global HyperZZW over sequences: `conv(Z, Z ⊙ K)` cropped to `T`.
///
/// `z`: `[B, C, T]`; `kernel`: `[1, C, T]` (the slow network's output) or `[B, C, T]`.
///
/// # Errors
/// [`Error::WidthMismatch`] or [`Error::OutOfRange`] for shapes that do not fit.
pub fn global_hyperzzw_1d(z: Tensor<3>, kernel: Tensor<3>, crop: Crop) -> Result<Tensor<3>> {
    check_kernel(&z, &kernel)?;
    let context_kernel = z.clone() * kernel;
    let path = FftPath::for_device(&z.device());
    Ok(fft_conv_1d(z, context_kernel, crop, path))
}

/// Global HyperZZW over maps: `conv2d(Z, Z ⊙ K)` cropped to `H x W`.
///
/// `z`: `[B, C, H, W]`; `kernel`: `[1, C, H, W]` or `[B, C, H, W]`.
///
/// # Errors
/// [`Error::WidthMismatch`] or [`Error::OutOfRange`] for shapes that do not fit.
pub fn global_hyperzzw_2d(z: Tensor<4>, kernel: Tensor<4>, crop: Crop) -> Result<Tensor<4>> {
    check_kernel(&z, &kernel)?;
    let context_kernel = z.clone() * kernel;
    let path = FftPath::for_device(&z.device());
    Ok(fft_conv_2d(z, context_kernel, crop, path))
}

/// The `dot` mode of the 2D reference code: `(Z ⊙ K) @ V` per sample and channel, for square
/// maps whose side is the kernel size.
///
/// # Errors
/// [`Error::WidthMismatch`] unless `z`, `kernel` and `values` are square maps of one size
/// (`kernel` with batch 1 or `B`).
pub fn global_hyperzzw_dot(
    z: Tensor<4>,
    kernel: Tensor<4>,
    values: Tensor<4>,
) -> Result<Tensor<4>> {
    check_kernel(&z, &kernel)?;
    let [_, _, rows, columns] = z.dims();
    if rows != columns {
        return Err(Error::WidthMismatch {
            name: "dot mode needs square maps".into(),
            expected: rows,
            found: columns,
        });
    }
    if values.dims() != z.dims() {
        let found = values.dims()[3];
        return Err(Error::WidthMismatch {
            name: "dot-mode values".into(),
            expected: columns,
            found,
        });
    }
    Ok((z * kernel).matmul(values))
}

/// Linear convolution along the last axis by FFT, cropped to the signal length.
pub(crate) fn fft_conv_1d(
    signal: Tensor<3>,
    kernel: Tensor<3>,
    crop: Crop,
    path: FftPath,
) -> Tensor<3> {
    let length = signal.dims()[2];
    #[cfg(any(feature = "flex", feature = "cube-kernels"))]
    if path == FftPath::Native && crate::backend::fft_conv::takes(&signal, &kernel) {
        // Transforms, product and crop per row in one op (src/backend/fft_conv.rs).
        return crate::backend::fft_conv::fft_conv_1d(signal, kernel, crop.start(length));
    }
    SpectralConv::new(kernel, Geometry::Sequence { length }, crop, path).apply(signal)
}

/// Linear convolution over the last two axes by FFT, cropped to the map size.
pub(crate) fn fft_conv_2d(
    signal: Tensor<4>,
    kernel: Tensor<4>,
    crop: Crop,
    path: FftPath,
) -> Tensor<4> {
    let [batch, channels, rows, columns] = signal.dims();
    let geometry = Geometry::Map { rows, columns };
    let flat = |x: Tensor<4>| x.flatten::<3>(2, 3);
    SpectralConv::new(flat(kernel), geometry, crop, path)
        .apply(flat(signal))
        .reshape([batch, channels, rows, columns])
}

fn complex_mul<const D: usize>(
    (a_re, a_im): (Tensor<D>, Tensor<D>),
    (b_re, b_im): (Tensor<D>, Tensor<D>),
) -> (Tensor<D>, Tensor<D>) {
    let re = a_re.clone() * b_re.clone() - a_im.clone() * b_im.clone();
    let im = a_re * b_im + a_im * b_re;
    (re, im)
}

/// The same linear convolution computed directly, `O(T²)`: `full[t] = Σ_s x[s] k[t − s]`,
/// cropped. The reference the FFT path is tested and benchmarked against.
///
/// `signal`: `[B, C, T]`; `kernel`: `[B, C, T]`.
pub fn direct_conv_1d(signal: Tensor<3>, kernel: Tensor<3>, crop: Crop) -> Tensor<3> {
    let [batch, channels, length] = signal.dims();
    // One group per (sample, channel); cross-correlation with the flipped kernel is convolution.
    let groups = batch * channels;
    let weight = kernel.flip([2]).reshape([groups, 1, length]);
    let options = burn::tensor::ops::ConvOptions::new([1], [length - 1], [1], groups);
    let full =
        burn::tensor::module::conv1d(signal.reshape([1, groups, length]), weight, None, options);
    full.reshape([batch, channels, 2 * length - 1])
        .narrow(2, crop.start(length), length)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Distribution, Tolerance};

    use super::*;

    /// The fused op against the direct `O(T²)` convolution, forward and both gradients, for
    /// both crops, a kernel shared by the batch or one per sample, lengths that are and are not
    /// powers of two, a transposed (non-contiguous) signal, in f32 and f64.
    #[cfg(feature = "flex")]
    #[test]
    fn fused_fft_conv_matches_the_direct_convolution() {
        use burn::tensor::DType;
        let device = Device::flex().autodiff();
        for dtype in [DType::F32, DType::F64] {
            for (length, kernel_batch, crop) in [
                (1, 1, Crop::Causal),
                (7, 3, Crop::Same),
                (16, 1, Crop::Same),
                (33, 3, Crop::Causal),
            ] {
                let random = |shape: [usize; 3]| {
                    Tensor::<3>::random(
                        shape,
                        burn::tensor::Distribution::Normal(0.0, 1.0),
                        &device,
                    )
                    .cast(dtype)
                };
                let (signal, kernel) = (random([3, length, 2]), random([kernel_batch, 2, length]));
                let probe = random([3, 2, length]);
                let start = match crop {
                    Crop::Causal => 0,
                    Crop::Same => (length - 1) / 2,
                };
                // Output, signal gradient and kernel gradient, on fresh leaves (one graph each);
                // the signal `[B, C, T]` is read through a transpose of `[B, T, C]`.
                let run = |fused: bool| {
                    let (leaf, kernel) =
                        (signal.clone().require_grad(), kernel.clone().require_grad());
                    let x = leaf.clone().swap_dims(1, 2);
                    let out = if fused {
                        crate::backend::fft_conv::fft_conv_1d(x, kernel.clone(), start)
                    } else {
                        direct_conv_1d(x, kernel.clone().expand([3, 2, length]), crop)
                    };
                    let grads = (out.clone() * probe.clone()).sum().backward();
                    [
                        out.into_data(),
                        leaf.grad(&grads).unwrap().into_data(),
                        kernel.grad(&grads).unwrap().into_data(),
                    ]
                };
                let tolerance = burn::tensor::Tolerance::absolute(if dtype == DType::F32 {
                    1e-4
                } else {
                    1e-10
                });
                for (fused, direct) in run(true).iter().zip(&run(false)) {
                    fused.assert_approx_eq::<f64>(direct, tolerance);
                }
            }
        }
    }

    /// The CubeCL kernels (on wgpu) against the direct `O(T²)` convolution on Flex in f64,
    /// forward and both gradients: both crops, a kernel shared by the batch or one per sample,
    /// lengths from 1 to 1024 (one cube of one unit up to 256 units), a transposed signal; in
    /// f32, and in f16 (transforms in f32) to its precision (WGSL has no bf16).
    #[cfg(all(feature = "wgpu", feature = "flex"))]
    #[test]
    fn cube_fft_conv_matches_the_direct_convolution() {
        use burn::tensor::DType;
        let (wgpu, flex) = (crate::test_util::wgpu_autodiff(), Device::flex().autodiff());
        let cases = [
            (1, 1, Crop::Causal, DType::F32),
            (2, 3, Crop::Same, DType::F32),
            (7, 3, Crop::Same, DType::F32),
            (33, 1, Crop::Causal, DType::F32),
            (100, 3, Crop::Same, DType::F32),
            (1024, 1, Crop::Causal, DType::F32),
            (1024, 3, Crop::Same, DType::F32),
            (40, 3, Crop::Causal, DType::F16),
            (40, 1, Crop::Same, DType::F16),
        ];
        // Past the kernels' limits the composed form runs: a row transform larger than any
        // cube's shared memory, and f64.
        let zeros =
            |length: usize, dtype: DType| Tensor::<3>::zeros([1, 1, length], &wgpu).cast(dtype);
        let (long, double) = (zeros(1 << 20, DType::F32), zeros(8, DType::F64));
        assert!(!crate::backend::fft_conv::takes(&long, &long));
        assert!(!crate::backend::fft_conv::takes(&double, &double));
        for (case, (length, kernel_batch, crop, dtype)) in cases.into_iter().enumerate() {
            let seed = 7 + case as u64;
            let host = |shape: [usize; 3], offset: u64| {
                crate::test_util::standard_normal(shape, seed * 3 + offset, &flex).into_data()
            };
            let (signal, kernel) = (host([3, length, 2], 0), host([kernel_batch, 2, length], 1));
            let probe = host([3, 2, length], 2);
            // Output, signal gradient and kernel gradient; the signal `[B, C, T]` is read
            // through a transpose of `[B, T, C]`.
            let run = |device: &Device, float: DType, fused: bool| {
                let leaf = |data: &TensorData| {
                    Tensor::<3>::from_data(data.clone(), device)
                        .cast(float)
                        .require_grad()
                };
                let (leaf_signal, leaf_kernel) = (leaf(&signal), leaf(&kernel));
                let x = leaf_signal.clone().swap_dims(1, 2);
                let out = if fused {
                    assert!(crate::backend::fft_conv::takes(&x, &leaf_kernel));
                    crate::backend::fft_conv::fft_conv_1d(
                        x,
                        leaf_kernel.clone(),
                        crop.start(length),
                    )
                } else {
                    direct_conv_1d(x, leaf_kernel.clone().expand([3, 2, length]), crop)
                };
                let probe = Tensor::<3>::from_data(probe.clone(), device).cast(float);
                let grads = (out.clone() * probe).sum().backward();
                let read = |x: Tensor<3>| x.cast(DType::F64).into_data();
                [
                    read(out.inner()),
                    read(leaf_signal.grad(&grads).unwrap()),
                    read(leaf_kernel.grad(&grads).unwrap()),
                ]
            };
            let exact = run(&flex, DType::F64, false);
            let fused = run(&wgpu, dtype, true);
            // Each entry sums up to `T` products of unit normals: errors grow as `√T` (seen on
            // lavapipe: f32 8.0e-5 at T = 1024, f16 9.9e-3 at T = 40, 1.6 and 2.5 times below).
            let unit = match dtype {
                DType::F16 => 4e-3,
                _ => 4e-6,
            };
            let tolerance = unit * (length as f64).sqrt();
            for (part, (fused, exact)) in ["output", "∂signal", "∂kernel"]
                .iter()
                .zip(fused.iter().zip(&exact))
            {
                let (fused, exact) = (
                    fused.try_to_vec::<f64>().unwrap(),
                    exact.try_to_vec::<f64>().unwrap(),
                );
                let error = fused
                    .iter()
                    .zip(&exact)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f64::max);
                assert!(
                    error <= tolerance,
                    "{part}, T = {length}, kernel batch {kernel_batch}, {crop:?}, {dtype:?}: \
                     error {error:.2e} > {tolerance:.2e}"
                );
            }
        }
    }

    fn random<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
    }

    /// Direct 2D linear convolution on the host, cropped.
    fn host_conv_2d(x: &[f64], k: &[f64], rows: usize, columns: usize, crop: Crop) -> Vec<f64> {
        let (r0, c0) = (crop.start(rows), crop.start(columns));
        let mut out = vec![0.0; rows * columns];
        for (index, value) in out.iter_mut().enumerate() {
            let (i, j) = (index / columns + r0, index % columns + c0);
            for (s, t) in (0..rows).flat_map(|s| (0..columns).map(move |t| (s, t))) {
                if i >= s && j >= t && i - s < rows && j - t < columns {
                    *value += x[s * columns + t] * k[(i - s) * columns + (j - t)];
                }
            }
        }
        out
    }

    #[test]
    fn fft_matches_direct_convolution_for_any_length_on_both_paths() {
        let device = Device::flex();
        for length in [1, 2, 5, 12, 16, 33] {
            let (x, k) = (
                random([2, 3, length], &device),
                random([2, 3, length], &device),
            );
            for crop in [Crop::Causal, Crop::Same] {
                let direct = direct_conv_1d(x.clone(), k.clone(), crop).into_data();
                for path in [FftPath::Native, FftPath::Matmul] {
                    let fft = fft_conv_1d(x.clone(), k.clone(), crop, path).into_data();
                    fft.assert_approx_eq::<f32>(&direct, Tolerance::absolute(1e-5));
                }
            }
        }
    }

    #[test]
    fn two_dimensional_fft_matches_a_host_convolution() {
        let device = Device::flex();
        for (rows, columns) in [(5, 6), (4, 4), (1, 3)] {
            let (x, k) = (
                random([1, 1, rows, columns], &device),
                random([1, 1, rows, columns], &device),
            );
            let (xs, ks): (Vec<f64>, Vec<f64>) =
                (x.to_data().iter().collect(), k.to_data().iter().collect());
            for crop in [Crop::Causal, Crop::Same] {
                let expected = host_conv_2d(&xs, &ks, rows, columns, crop);
                let expected = TensorData::new(expected, [1, 1, rows, columns]);
                for path in [FftPath::Native, FftPath::Matmul] {
                    let fft = fft_conv_2d(x.clone(), k.clone(), crop, path)
                        .into_data()
                        .convert::<f64>();
                    fft.assert_approx_eq::<f64>(&expected, Tolerance::absolute(1e-5));
                }
            }
        }
    }

    #[test]
    fn causal_output_ignores_the_future() {
        let device = Device::flex();
        let z = random([1, 2, 10], &device);
        let kernel = random([1, 2, 10], &device);
        let base = global_hyperzzw_1d(z.clone(), kernel.clone(), Crop::Causal).unwrap();
        // Changing z at t >= 6 leaves outputs at t < 6 unchanged.
        let changed = z
            .clone()
            .slice_assign([0..1, 0..2, 6..10], random([1, 2, 4], &device));
        let other = global_hyperzzw_1d(changed, kernel, Crop::Causal).unwrap();
        base.narrow(2, 0, 6).into_data().assert_approx_eq::<f32>(
            &other.narrow(2, 0, 6).into_data(),
            Tolerance::absolute(1e-5),
        );
    }

    #[test]
    fn the_context_kernel_is_z_times_k() {
        let device = Device::flex();
        let (z, kernel) = (random([2, 3, 9], &device), random([1, 3, 9], &device));
        let expected = direct_conv_1d(z.clone(), z.clone() * kernel.clone(), Crop::Same);
        let actual = global_hyperzzw_1d(z, kernel, Crop::Same).unwrap();
        actual
            .into_data()
            .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-5));
    }

    #[test]
    fn dot_mode_is_a_per_channel_matrix_product() {
        let device = Device::flex();
        let (z, kernel, values) = (
            random([2, 3, 4, 4], &device),
            random([1, 3, 4, 4], &device),
            random([2, 3, 4, 4], &device),
        );
        let out = global_hyperzzw_dot(z.clone(), kernel.clone(), values.clone()).unwrap();
        let expected = (z.clone() * kernel.clone())
            .narrow(0, 1, 1)
            .narrow(1, 2, 1)
            .reshape([4, 4])
            .matmul(
                values
                    .clone()
                    .narrow(0, 1, 1)
                    .narrow(1, 2, 1)
                    .reshape([4, 4]),
            );
        out.narrow(0, 1, 1)
            .narrow(1, 2, 1)
            .reshape([4, 4])
            .into_data()
            .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-5));
        assert!(
            global_hyperzzw_dot(
                random([1, 1, 4, 5], &device),
                random([1, 1, 4, 5], &device),
                random([1, 1, 4, 5], &device)
            )
            .is_err()
        );
    }

    #[test]
    fn mismatched_shapes_are_errors() {
        let device = Device::flex();
        let z = random([2, 3, 8], &device);
        assert!(global_hyperzzw_1d(z.clone(), random([1, 4, 8], &device), Crop::Causal).is_err());
        assert!(global_hyperzzw_1d(z.clone(), random([1, 3, 7], &device), Crop::Causal).is_err());
        assert!(global_hyperzzw_1d(z, random([3, 3, 8], &device), Crop::Causal).is_err());
        assert!(
            global_hyperzzw_2d(
                random([1, 2, 4, 4], &device),
                random([1, 2, 4, 5], &device),
                Crop::Same
            )
            .is_err()
        );
    }
}
