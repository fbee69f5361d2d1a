//! Real and complex DFTs along one axis, on every backend, differentiable.
//!
//! Burn's `signal::{rfft, irfft, cfft}` have kernels on Flex, the CubeCL backends and LibTorch
//! only; on NdArray they compile and panic at run time. [`FftPath::for_device`] picks them where they
//! exist and a dense DFT by matrix products elsewhere (O(T·n) per row instead of O(n log n),
//! exact and differentiable through plain tensor ops).

use std::f64::consts::PI;

use burn::prelude::*;
use burn::tensor::{DType, FloatDType};

use crate::backend::has_native_fft;

/// How the transforms are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FftPath {
    /// `burn::signal` (Flex, CubeCL backends, LibTorch).
    Native,
    /// Dense DFT matrices and matrix products (any backend).
    Matmul,
}

impl FftPath {
    /// The native FFT where the backend has one, the matmul DFT otherwise.
    pub fn for_device(device: &Device) -> Self {
        if has_native_fft(device) {
            Self::Native
        } else {
            Self::Matmul
        }
    }

    /// Spectrum `(re, im)` of the real signal `x` zero-padded to `n` (a power of two) along
    /// `dim`: `n/2 + 1` bins.
    pub fn rfft<const D: usize>(
        self,
        x: Tensor<D>,
        dim: usize,
        n: usize,
    ) -> (Tensor<D>, Tensor<D>) {
        let half = half_type(&x);
        let x = widened(x, half);
        let (re, im) = match self {
            Self::Native => burn::signal::rfft(x, dim, Some(n)),
            Self::Matmul => {
                let length = x.dims()[dim];
                let bins = n / 2 + 1;
                let (cos, sin) = dft_tables(length, bins, n, &x);
                let x = x.swap_dims(dim, D - 1);
                let re = matmul_last(x.clone(), cos);
                let im = matmul_last(x, sin).neg();
                (re.swap_dims(dim, D - 1), im.swap_dims(dim, D - 1))
            }
        };
        (narrowed(re, half), narrowed(im, half))
    }

    /// The real signal of length `n` whose half spectrum is `(re, im)` along `dim`.
    pub fn irfft<const D: usize>(
        self,
        re: Tensor<D>,
        im: Tensor<D>,
        dim: usize,
        n: usize,
    ) -> Tensor<D> {
        let half = half_type(&re);
        let (re, im) = (widened(re, half), widened(im, half));
        let signal = match self {
            Self::Native => burn::signal::irfft(re, im, dim, Some(n)),
            Self::Matmul => {
                let bins = re.dims()[dim];
                let device = re.device();
                // x[t] = Σ_f w_f (Re_f cos(2πft/n) − Im_f sin(2πft/n)) / n, w = 1 at DC and Nyquist, 2 between.
                let weight = |f: usize| if f == 0 || 2 * f == n { 1.0 } else { 2.0 } / n as f64;
                let (cos, sin) = dft_tables(bins, n, n, &re);
                let weights: Vec<f64> = (0..bins).map(weight).collect();
                let weights = TensorData::new(weights, [bins, 1]);
                let weights = Tensor::<2>::from_data(weights, (&device, re.dtype()));
                let (cos, sin) = (cos * weights.clone(), sin * weights);
                let (re, im) = (re.swap_dims(dim, D - 1), im.swap_dims(dim, D - 1));
                (matmul_last(re, cos) - matmul_last(im, sin)).swap_dims(dim, D - 1)
            }
        };
        narrowed(signal, half)
    }

    /// Full complex spectrum of `(re, im)` zero-padded to `n` along `dim`; with `inverse`, the
    /// inverse transform (including the `1/n`).
    pub fn cfft<const D: usize>(
        self,
        re: Tensor<D>,
        im: Tensor<D>,
        dim: usize,
        n: usize,
        inverse: bool,
    ) -> (Tensor<D>, Tensor<D>) {
        let half = half_type(&re);
        let (re, im) = (widened(re, half), widened(im, half));
        // ifft(x) = conj(fft(conj(x))) / n.
        let im = if inverse { im.neg() } else { im };
        let (out_re, out_im) = match self {
            Self::Native => burn::signal::cfft(re, im, dim, Some(n)),
            Self::Matmul => {
                let length = re.dims()[dim];
                let (cos, sin) = dft_tables(length, n, n, &re);
                let (re, im) = (re.swap_dims(dim, D - 1), im.swap_dims(dim, D - 1));
                // (a + ib)(cos − i sin) = (a cos + b sin) + i(b cos − a sin).
                let out_re =
                    matmul_last(re.clone(), cos.clone()) + matmul_last(im.clone(), sin.clone());
                let out_im = matmul_last(im, cos) - matmul_last(re, sin);
                (out_re.swap_dims(dim, D - 1), out_im.swap_dims(dim, D - 1))
            }
        };
        let (out_re, out_im) = if inverse {
            let scale = 1.0 / n as f64;
            (out_re.mul_scalar(scale), out_im.mul_scalar(-scale))
        } else {
            (out_re, out_im)
        };
        (narrowed(out_re, half), narrowed(out_im, half))
    }
}

/// The half-precision type of `x`, if it has one (f16 or bf16).
fn half_type<const D: usize>(x: &Tensor<D>) -> Option<FloatDType> {
    matches!(x.dtype(), DType::F16 | DType::BF16).then(|| FloatDType::from(x.dtype()))
}

/// `x` in f32 where it is in a half type: the transforms run in f32 then. Burn 0.22.1's CubeCL
/// FFT takes no f16 (it panics), and a transform's sums over `n` entries would lose most of a
/// half type's bits.
fn widened<const D: usize>(x: Tensor<D>, half: Option<FloatDType>) -> Tensor<D> {
    match half {
        Some(_) => x.cast(FloatDType::F32),
        None => x,
    }
}

/// A transform's result back in the input's half type (see [`widened`]).
fn narrowed<const D: usize>(x: Tensor<D>, half: Option<FloatDType>) -> Tensor<D> {
    match half {
        Some(dtype) => x.cast(dtype),
        None => x,
    }
}

/// `cos(2π·t·f/n)` and `sin(2π·t·f/n)` for `t < rows`, `f < columns`, as `[rows, columns]` in
/// the float type of `like`, on its device.
fn dft_tables<const D: usize>(
    rows: usize,
    columns: usize,
    n: usize,
    like: &Tensor<D>,
) -> (Tensor<2>, Tensor<2>) {
    let options = (&like.device(), like.dtype());
    let angle = |index: usize| {
        let (t, f) = (index / columns, index % columns);
        // Reduce t·f mod n in integers so large products keep full precision.
        2.0 * PI * ((t * f) % n) as f64 / n as f64
    };
    let cos: Vec<f64> = (0..rows * columns).map(|i| angle(i).cos()).collect();
    let sin: Vec<f64> = (0..rows * columns).map(|i| angle(i).sin()).collect();
    (
        Tensor::from_data(TensorData::new(cos, [rows, columns]), options),
        Tensor::from_data(TensorData::new(sin, [rows, columns]), options),
    )
}

/// `x @ table` over the last axis of `x` (`[.., rows] @ [rows, columns]`).
fn matmul_last<const D: usize>(x: Tensor<D>, table: Tensor<2>) -> Tensor<D> {
    let mut shape = [1usize; D];
    let [rows, columns] = table.dims();
    shape[D - 2] = rows;
    shape[D - 1] = columns;
    x.matmul(table.reshape(shape))
}
