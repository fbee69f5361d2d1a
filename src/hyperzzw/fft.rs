//! Real and complex DFTs along one axis, on every backend, differentiable.
//!
//! Burn's `signal::{rfft, irfft, cfft}` have kernels on Flex, the CubeCL backends and LibTorch
//! only; on NdArray they compile and panic at run time. [`FftPath::for_device`] picks them where they
//! exist and a dense DFT by matrix products elsewhere (O(T·n) per row instead of O(n log n),
//! exact and differentiable through plain tensor ops).

use std::f64::consts::PI;

use burn::prelude::*;

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
        match self {
            Self::Native => burn::signal::rfft(x, dim, Some(n)),
            Self::Matmul => {
                let length = x.dims()[dim];
                let bins = n / 2 + 1;
                let (cos, sin) = dft_tables(length, bins, n, &x.device());
                let x = x.swap_dims(dim, D - 1);
                let re = matmul_last(x.clone(), cos);
                let im = matmul_last(x, sin).neg();
                (re.swap_dims(dim, D - 1), im.swap_dims(dim, D - 1))
            }
        }
    }

    /// The real signal of length `n` whose half spectrum is `(re, im)` along `dim`.
    pub fn irfft<const D: usize>(
        self,
        re: Tensor<D>,
        im: Tensor<D>,
        dim: usize,
        n: usize,
    ) -> Tensor<D> {
        match self {
            Self::Native => burn::signal::irfft(re, im, dim, Some(n)),
            Self::Matmul => {
                let bins = re.dims()[dim];
                let device = re.device();
                // x[t] = Σ_f w_f (Re_f cos(2πft/n) − Im_f sin(2πft/n)) / n, w = 1 at DC and Nyquist, 2 between.
                let weight = |f: usize| if f == 0 || 2 * f == n { 1.0 } else { 2.0 } / n as f64;
                let (cos, sin) = dft_tables(bins, n, n, &device);
                let weights: Vec<f64> = (0..bins).map(weight).collect();
                let weights = Tensor::<2>::from_data(TensorData::new(weights, [bins, 1]), &device);
                let (cos, sin) = (cos * weights.clone(), sin * weights);
                let (re, im) = (re.swap_dims(dim, D - 1), im.swap_dims(dim, D - 1));
                (matmul_last(re, cos) - matmul_last(im, sin)).swap_dims(dim, D - 1)
            }
        }
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
        // ifft(x) = conj(fft(conj(x))) / n.
        let im = if inverse { im.neg() } else { im };
        let (out_re, out_im) = match self {
            Self::Native => burn::signal::cfft(re, im, dim, Some(n)),
            Self::Matmul => {
                let length = re.dims()[dim];
                let (cos, sin) = dft_tables(length, n, n, &re.device());
                let (re, im) = (re.swap_dims(dim, D - 1), im.swap_dims(dim, D - 1));
                // (a + ib)(cos − i sin) = (a cos + b sin) + i(b cos − a sin).
                let out_re =
                    matmul_last(re.clone(), cos.clone()) + matmul_last(im.clone(), sin.clone());
                let out_im = matmul_last(im, cos) - matmul_last(re, sin);
                (out_re.swap_dims(dim, D - 1), out_im.swap_dims(dim, D - 1))
            }
        };
        if inverse {
            let scale = 1.0 / n as f64;
            (out_re.mul_scalar(scale), out_im.mul_scalar(-scale))
        } else {
            (out_re, out_im)
        }
    }
}

/// `cos(2π·t·f/n)` and `sin(2π·t·f/n)` for `t < rows`, `f < columns`, as `[rows, columns]`.
fn dft_tables(rows: usize, columns: usize, n: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let angle = |index: usize| {
        let (t, f) = (index / columns, index % columns);
        // Reduce t·f mod n in integers so large products keep full precision.
        2.0 * PI * ((t * f) % n) as f64 / n as f64
    };
    let cos: Vec<f64> = (0..rows * columns).map(|i| angle(i).cos()).collect();
    let sin: Vec<f64> = (0..rows * columns).map(|i| angle(i).sin()).collect();
    (
        Tensor::from_data(TensorData::new(cos, [rows, columns]), device),
        Tensor::from_data(TensorData::new(sin, [rows, columns]), device),
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
