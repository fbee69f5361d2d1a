//! The global convolution on the CubeCL backends: one cube per row, its `n`-point transforms in
//! shared memory (radix 2, in f32), one launch forward and one backward.
//!
//! Two real rows go through one complex transform: with `U = FFT(x + i·k)`,
//! `X_f = (U_f + conj(U_{n−f})) / 2` and `K_f = −i (U_f − conj(U_{n−f})) / 2`. The forward
//! transform runs decimation in frequency (natural order in, bit-reversed out), the inverse
//! decimation in time (bit-reversed in, natural out), so no pass reorders the entries; the
//! spectral products read each bin `f` with its mirror `n − f` at their bit-reversed places.
//!
//! - forward: `U = FFT(x + i·k)`, `Y_f = X_f K_f` (Hermitian: `Y_{n−f} = conj(Y_f)`), then
//!   `out[t] = Re IFFT(Y)[s₀ + t]`: two transforms.
//! - backward: `U` as above (each unit keeps its bins' `X_f`, `K_f` in registers),
//!   `G = FFT(∂full)`, then `W_f = G_f conj(K_f) + i G_f conj(X_f)`, whose inverse is
//!   `∂x + i ∂k` (both real): three transforms.
//!
//! A row's transform takes `8n` bytes of shared memory: `T ≤ 2048` in the 32 kB that every
//! backend offers.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::prelude::*;
use burn::tensor::DType;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

use super::{FftConvBackend, fft_length};
use crate::backend::cube_launch::{empty, per_item};
use kernels::{fft_conv_backward_kernel, fft_conv_forward_kernel};

/// Most units per cube: a transform of `n` points has `n / 2` butterflies a stage.
const MOST_THREADS: usize = 256;

/// Shared memory assumed where the device does not say (what every CubeCL backend offers).
const DEFAULT_SHARED_BYTES: usize = 32 * 1024;

/// Whether the kernels take `signal [B, C, T]` and `kernel [B | 1, C, T]` (see
/// [`takes`](super::takes)).
pub(super) fn takes(signal: &Tensor<3>, kernel: &Tensor<3>) -> bool {
    if !crate::backend::cube_kernels_take(signal) || !crate::backend::cube_kernels_take(kernel) {
        return false;
    }
    if !matches!(signal.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return false;
    }
    let device = signal.device().without_autodiff();
    let burn::backend::DispatchDevice::Cube(device) = device.as_dispatch() else {
        return false;
    };
    let length = signal.dims()[2];
    let shared = match device.client().properties().hardware.max_shared_memory_size {
        0 => DEFAULT_SHARED_BYTES,
        bytes => bytes,
    };
    length > 0 && 2 * fft_length(length) * size_of::<f32>() <= shared
}

/// One cube per row `(b, c)`: `threads` units (a power of two, at most `n / 2`).
struct RowLaunch {
    rows: usize,
    n: usize,
    log_n: u32,
    threads: usize,
}

impl RowLaunch {
    fn new(signal: &CubeTensor) -> Self {
        let shape = signal.meta.shape();
        let (rows, length) = (shape[0] * shape[1], shape[2]);
        let n = fft_length(length);
        let most = MOST_THREADS
            .min(n / 2)
            .min(signal.client.properties().hardware.max_units_per_cube as usize)
            .max(1);
        Self {
            rows,
            n,
            log_n: n.ilog2(),
            threads: 1 << most.ilog2(),
        }
    }
}

impl FftConvBackend for CubeBackend {
    fn fft_conv_1d(
        signal: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        start: usize,
    ) -> CubeTensor {
        let launch = RowLaunch::new(&signal);
        let output = empty(&signal, signal.meta.shape().clone());
        let (count, dim) = per_item(&signal, launch.rows, launch.threads);
        fft_conv_forward_kernel::launch(
            &signal.client,
            count,
            dim,
            signal.clone().into_tensor_arg(),
            kernel.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            start,
            launch.rows,
            launch.n,
            launch.log_n,
            launch.threads,
            dtype_to_storage_type(signal.dtype),
        );
        output
    }

    fn fft_conv_1d_backward(
        signal: CubeTensor,
        kernel: CubeTensor,
        grad: CubeTensor,
        start: usize,
    ) -> (CubeTensor, CubeTensor) {
        let launch = RowLaunch::new(&signal);
        let shape = signal.meta.shape().clone();
        let kernel_batch = kernel.meta.shape()[0];
        let grad_signal = empty(&signal, shape.clone());
        // `∂k` per sample row; summed over the batch below when the kernel is shared.
        let grad_kernel = empty(&signal, shape.clone());
        let (count, dim) = per_item(&signal, launch.rows, launch.threads);
        fft_conv_backward_kernel::launch(
            &signal.client,
            count,
            dim,
            signal.clone().into_tensor_arg(),
            kernel.into_tensor_arg(),
            grad.into_tensor_arg(),
            grad_signal.clone().into_tensor_arg(),
            grad_kernel.clone().into_tensor_arg(),
            start,
            launch.rows,
            launch.n,
            launch.log_n,
            launch.threads,
            dtype_to_storage_type(signal.dtype),
        );
        let grad_kernel = if kernel_batch == 1 && shape[0] > 1 {
            Self::float_sum_dim(grad_kernel, 0)
        } else {
            grad_kernel
        };
        (grad_signal, grad_kernel)
    }
}

mod kernels {
    use cubecl::prelude::*;

    /// `π` for the twiddle factors.
    const PI: f32 = core::f32::consts::PI;

    /// The place of bin `f` in a transform left in bit-reversed order.
    #[cube]
    fn reversed(f: usize, #[comptime] log_n: u32) -> usize {
        (u32::reverse_bits(f as u32) >> comptime!(32 - log_n)) as usize
    }

    /// Entry `t` of the row at `base` of `tensor [B | 1, C, T]` (read through its strides), zero
    /// past `T`.
    #[cube]
    fn entry<E: Float>(tensor: &Tensor<E>, base: usize, t: usize, length: usize) -> f32 {
        let mut value = 0.0f32;
        if t < length {
            value = f32::cast_from(tensor[base + t * tensor.stride(2)]);
        }
        value
    }

    /// The forward transform of `n` points in place, natural order in, bit-reversed out
    /// (decimation in frequency, `exp(−2πi·jk/n)`). Every unit of the cube takes part.
    #[cube]
    fn forward_transform(re: &mut Shared<[f32]>, im: &mut Shared<[f32]>, #[comptime] n: usize) {
        let (unit, units) = (UNIT_POS as usize, CUBE_DIM as usize);
        // Stages of `half = n/2, n/4, …, 1` butterflies apart, counted up by `stage = n / 2half`.
        let mut stage = 1usize;
        while stage < n {
            let half = comptime!(n / 2) / stage;
            let step = -PI / f32::cast_from(half);
            let mut j = unit;
            while j < comptime!(n / 2) {
                let position = j % half;
                let first = 2 * (j - position) + position;
                let second = first + half;
                let (a_re, a_im, b_re, b_im) = (re[first], im[first], re[second], im[second]);
                re[first] = a_re + b_re;
                im[first] = a_im + b_im;
                let (d_re, d_im) = (a_re - b_re, a_im - b_im);
                let angle = step * f32::cast_from(position);
                let (cos, sin) = (angle.cos(), angle.sin());
                re[second] = d_re * cos - d_im * sin;
                im[second] = d_re * sin + d_im * cos;
                j += units;
            }
            sync_cube();
            stage *= 2;
        }
    }

    /// The inverse transform of `n` points in place, without the `1/n`: bit-reversed order in,
    /// natural out (decimation in time, `exp(+2πi·jk/n)`).
    #[cube]
    fn inverse_transform(re: &mut Shared<[f32]>, im: &mut Shared<[f32]>, #[comptime] n: usize) {
        let (unit, units) = (UNIT_POS as usize, CUBE_DIM as usize);
        let mut half = 1usize;
        while half < n {
            let step = PI / f32::cast_from(half);
            let mut j = unit;
            while j < comptime!(n / 2) {
                let position = j % half;
                let first = 2 * (j - position) + position;
                let second = first + half;
                let angle = step * f32::cast_from(position);
                let (cos, sin) = (angle.cos(), angle.sin());
                let (b_re, b_im) = (re[second], im[second]);
                let (w_re, w_im) = (b_re * cos - b_im * sin, b_re * sin + b_im * cos);
                let (a_re, a_im) = (re[first], im[first]);
                re[first] = a_re + w_re;
                im[first] = a_im + w_im;
                re[second] = a_re - w_re;
                im[second] = a_im - w_im;
                j += units;
            }
            sync_cube();
            half *= 2;
        }
    }

    /// Loads `x + i·k` of one row, zero-padded to `n`, and transforms it (bit-reversed out).
    #[cube]
    fn transform_pair<E: Float>(
        signal: &Tensor<E>,
        kernel: &Tensor<E>,
        re: &mut Shared<[f32]>,
        im: &mut Shared<[f32]>,
        row: usize,
        #[comptime] n: usize,
    ) {
        let channels = signal.shape(1);
        let length = signal.shape(2);
        let (b, c) = (row / channels, row % channels);
        let signal_base = b * signal.stride(0) + c * signal.stride(1);
        let kernel_base = (b % kernel.shape(0)) * kernel.stride(0) + c * kernel.stride(1);
        let mut t = UNIT_POS as usize;
        while t < n {
            re[t] = entry::<E>(signal, signal_base, t, length);
            im[t] = entry::<E>(kernel, kernel_base, t, length);
            t += CUBE_DIM as usize;
        }
        sync_cube();
        forward_transform(re, im, n);
    }

    /// `(X_f, K_f)` as `(re, im, re, im)` from the transform of `x + i·k`, left bit-reversed.
    #[cube]
    fn split_pair(
        re: &Shared<[f32]>,
        im: &Shared<[f32]>,
        f: usize,
        #[comptime] n: usize,
        #[comptime] log_n: u32,
    ) -> (f32, f32, f32, f32) {
        let at = reversed(f, log_n);
        let mirror = reversed((comptime!(n) - f) % comptime!(n), log_n);
        let (u_re, u_im, v_re, v_im) = (re[at], im[at], re[mirror], im[mirror]);
        (
            (u_re + v_re) * 0.5,
            (u_im - v_im) * 0.5,
            (u_im + v_im) * 0.5,
            (v_re - u_re) * 0.5,
        )
    }

    /// Writes bin `f` and its mirror `n − f` of a spectrum left bit-reversed: `(re, im)` at `f`,
    /// `(mirror_re, mirror_im)` at `n − f` (one place for `f = 0` and `f = n/2`).
    #[cube]
    fn write_pair(
        re: &mut Shared<[f32]>,
        im: &mut Shared<[f32]>,
        f: usize,
        value: (f32, f32),
        mirror_value: (f32, f32),
        #[comptime] n: usize,
        #[comptime] log_n: u32,
    ) {
        let at = reversed(f, log_n);
        let mirror = reversed((comptime!(n) - f) % comptime!(n), log_n);
        re[mirror] = mirror_value.0;
        im[mirror] = mirror_value.1;
        re[at] = value.0;
        im[at] = value.1;
    }

    #[cube(launch)]
    pub(super) fn fft_conv_forward_kernel<E: Float>(
        signal: &Tensor<E>,
        kernel: &Tensor<E>,
        output: &mut Tensor<E>,
        start: usize,
        rows: usize,
        #[comptime] n: usize,
        #[comptime] log_n: u32,
        #[comptime] threads: usize,
        #[define(E)] _dtype: ElemType,
    ) {
        // A grid over several axes adds cubes past the last row: each leaves whole, before any
        // `sync_cube`.
        let row = CUBE_POS;
        if row >= rows {
            terminate!();
        }
        let mut re = Shared::<[f32]>::new_slice(n);
        let mut im = Shared::<[f32]>::new_slice(n);
        transform_pair::<E>(signal, kernel, &mut re, &mut im, row, n);

        // Y_f = X_f K_f, and Y_{n−f} = conj(Y_f): each unit owns its bins and their mirrors.
        let mut f = UNIT_POS as usize;
        while f <= comptime!(n / 2) {
            let (x_re, x_im, k_re, k_im) = split_pair(&re, &im, f, n, log_n);
            let (y_re, y_im) = (x_re * k_re - x_im * k_im, x_re * k_im + x_im * k_re);
            write_pair(&mut re, &mut im, f, (y_re, y_im), (y_re, -y_im), n, log_n);
            f += threads;
        }
        sync_cube();
        inverse_transform(&mut re, &mut im, n);

        let length = signal.shape(2);
        let scale = comptime!(1.0 / n as f32);
        let base = row * length;
        let mut t = UNIT_POS as usize;
        while t < length {
            output[base + t] = E::cast_from(re[start + t] * scale);
            t += threads;
        }
    }

    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fft_conv_backward_kernel<E: Float>(
        signal: &Tensor<E>,
        kernel: &Tensor<E>,
        grad: &Tensor<E>,
        grad_signal: &mut Tensor<E>,
        grad_kernel: &mut Tensor<E>,
        start: usize,
        rows: usize,
        #[comptime] n: usize,
        #[comptime] log_n: u32,
        #[comptime] threads: usize,
        #[define(E)] _dtype: ElemType,
    ) {
        let row = CUBE_POS;
        if row >= rows {
            terminate!();
        }
        let mut re = Shared::<[f32]>::new_slice(n);
        let mut im = Shared::<[f32]>::new_slice(n);
        transform_pair::<E>(signal, kernel, &mut re, &mut im, row, n);

        // This unit's bins f = unit + p·threads, p < bins: (X_f, K_f) kept in registers.
        let bins = comptime!(n / 2 / threads + 1);
        let mut kept = Array::<f32>::new(comptime!(4 * bins));
        #[unroll]
        for p in 0..bins {
            let f = UNIT_POS as usize + p * threads;
            if f <= comptime!(n / 2) {
                let (x_re, x_im, k_re, k_im) = split_pair(&re, &im, f, n, log_n);
                kept[4 * p] = x_re;
                kept[4 * p + 1] = x_im;
                kept[4 * p + 2] = k_re;
                kept[4 * p + 3] = k_im;
            }
        }
        sync_cube();

        // G = FFT(∂full), ∂full = ∂out placed at s₀.
        let channels = grad.shape(1);
        let length = grad.shape(2);
        let (b, c) = (row / channels, row % channels);
        let grad_base = b * grad.stride(0) + c * grad.stride(1);
        let mut t = UNIT_POS as usize;
        while t < n {
            let mut value = 0.0f32;
            if t >= start {
                value = entry::<E>(grad, grad_base, t - start, length);
            }
            re[t] = value;
            im[t] = 0.0;
            t += threads;
        }
        sync_cube();
        forward_transform(&mut re, &mut im, n);

        // W_f = G_f conj(K_f) + i·G_f conj(X_f); at n − f the conjugates of both products.
        #[unroll]
        for p in 0..bins {
            let f = UNIT_POS as usize + p * threads;
            if f <= comptime!(n / 2) {
                let at = reversed(f, log_n);
                let (g_re, g_im) = (re[at], im[at]);
                let (x_re, x_im) = (kept[4 * p], kept[4 * p + 1]);
                let (k_re, k_im) = (kept[4 * p + 2], kept[4 * p + 3]);
                // A = G conj(K), B = G conj(X).
                let (a_re, a_im) = (g_re * k_re + g_im * k_im, g_im * k_re - g_re * k_im);
                let (b_re, b_im) = (g_re * x_re + g_im * x_im, g_im * x_re - g_re * x_im);
                write_pair(
                    &mut re,
                    &mut im,
                    f,
                    (a_re - b_im, a_im + b_re),
                    (a_re + b_im, b_re - a_im),
                    n,
                    log_n,
                );
            }
        }
        sync_cube();
        inverse_transform(&mut re, &mut im, n);

        let scale = comptime!(1.0 / n as f32);
        let base = row * length;
        let mut t = UNIT_POS as usize;
        while t < length {
            grad_signal[base + t] = E::cast_from(re[t] * scale);
            grad_kernel[base + t] = E::cast_from(im[t] * scale);
            t += threads;
        }
    }
}
