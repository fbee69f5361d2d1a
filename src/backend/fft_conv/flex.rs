//! The global convolution on Flex: every row's transforms, spectral product and crop in one
//! pass, on RustFFT's plans (through `realfft`), the rows spread over the cores.

use burn::tensor::DType;
use burn_flex::{Flex, FlexTensor};
use rayon::prelude::*;
use realfft::num_complex::Complex;
use realfft::{ComplexToReal, FftNum, RealFftPlanner, RealToComplex};
use std::sync::Arc;

use super::{FftConvBackend, fft_length};
use crate::backend::flex_kernels::{Scalar, dims, tensor, values};

/// Forward and inverse real transforms of one length, shared by the threads.
struct Plans<E: FftNum> {
    n: usize,
    forward: Arc<dyn RealToComplex<E>>,
    inverse: Arc<dyn ComplexToReal<E>>,
}

/// One thread's buffers: a time-domain row, two half spectra and the plans' scratch.
struct Scratch<E> {
    time: Vec<E>,
    spectrum: Vec<Complex<E>>,
    other: Vec<Complex<E>>,
    work: Vec<Complex<E>>,
}

impl<E: Scalar + FftNum> Plans<E> {
    fn new(length: usize) -> Self {
        let n = fft_length(length);
        let mut planner = RealFftPlanner::<E>::new();
        Self {
            n,
            forward: planner.plan_fft_forward(n),
            inverse: planner.plan_fft_inverse(n),
        }
    }

    fn scratch(&self) -> Scratch<E> {
        let work = self
            .forward
            .get_scratch_len()
            .max(self.inverse.get_scratch_len());
        Scratch {
            time: vec![E::zero(); self.n],
            spectrum: self.forward.make_output_vec(),
            other: self.forward.make_output_vec(),
            work: vec![Complex::new(E::zero(), E::zero()); work],
        }
    }

    /// `rfft(row placed at offset, zero elsewhere, n)` into `out`, through `time`.
    fn transform(
        &self,
        row: &[E],
        offset: usize,
        time: &mut [E],
        out: &mut [Complex<E>],
        work: &mut [Complex<E>],
    ) {
        time.fill(E::zero());
        time[offset..offset + row.len()].copy_from_slice(row);
        self.forward
            .process_with_scratch(time, out, work)
            .expect("buffer lengths come from the plan");
    }

    /// `out = irfft(spectrum, n)[offset..offset + out.len()]` (with the `1/n`); `spectrum` is
    /// used up.
    fn inverse_into(
        &self,
        spectrum: &mut [Complex<E>],
        offset: usize,
        time: &mut [E],
        work: &mut [Complex<E>],
        out: &mut [E],
    ) {
        // The imaginary parts of DC and Nyquist are zero in exact arithmetic; realfft insists.
        let last = spectrum.len() - 1;
        spectrum[0].im = E::zero();
        spectrum[last].im = E::zero();
        self.inverse
            .process_with_scratch(spectrum, time, work)
            .expect("buffer lengths come from the plan");
        let scale = E::one() / <E as num_traits::NumCast>::from(self.n).expect("FFT length fits");
        for (o, &v) in out.iter_mut().zip(&time[offset..]) {
            *o = v * scale;
        }
    }
}

/// `a ← a · b`, or `a ← a · conj(b)`.
fn multiply<E: Scalar + FftNum>(a: &mut [Complex<E>], b: &[Complex<E>], conjugate: bool) {
    if conjugate {
        a.iter_mut().zip(b).for_each(|(x, y)| *x = *x * y.conj());
    } else {
        a.iter_mut().zip(b).for_each(|(x, y)| *x = *x * *y);
    }
}

/// The kernel rows, with their spectra per channel computed once when one kernel row serves the
/// whole batch (`shared`), or transformed row by row when every sample has its own.
struct KernelRows<'a, E> {
    rows: &'a [E],
    length: usize,
    channels: usize,
    shared: Option<Vec<Vec<Complex<E>>>>,
}

impl<'a, E: Scalar + FftNum> KernelRows<'a, E> {
    fn new(plans: &Plans<E>, rows: &'a [E], [batch, channels, length]: [usize; 3]) -> Self {
        let shared = (rows.len() == channels * length && batch > 1).then(|| {
            rows.par_chunks(length)
                .map(|row| {
                    let mut scratch = plans.scratch();
                    let mut spectrum = plans.forward.make_output_vec();
                    plans.transform(row, 0, &mut scratch.time, &mut spectrum, &mut scratch.work);
                    spectrum
                })
                .collect()
        });
        Self {
            rows,
            length,
            channels,
            shared,
        }
    }

    /// `s.spectrum ← s.spectrum · K` (or `· conj(K)`) with the kernel of signal row `row`.
    fn multiply(&self, plans: &Plans<E>, s: &mut Scratch<E>, row: usize, conjugate: bool) {
        match &self.shared {
            Some(spectra) => multiply(&mut s.spectrum, &spectra[row % self.channels], conjugate),
            None => {
                let kernel_row = &self.rows[row * self.length..][..self.length];
                plans.transform(kernel_row, 0, &mut s.time, &mut s.other, &mut s.work);
                multiply(&mut s.spectrum, &s.other, conjugate);
            }
        }
    }
}

fn forward<E: Scalar + FftNum>(
    signal: &FlexTensor,
    kernel: &FlexTensor,
    start: usize,
) -> FlexTensor {
    let shape @ [batch, channels, length] = dims::<3>(signal);
    let plans = Plans::<E>::new(length);
    let (x, k) = (values::<E>(signal), values::<E>(kernel));
    let kernel = KernelRows::new(&plans, &k, shape);
    let mut out = vec![E::zero(); batch * channels * length];
    out.par_chunks_mut(length).enumerate().for_each_init(
        || plans.scratch(),
        |s, (row, out)| {
            let signal_row = &x[row * length..][..length];
            plans.transform(signal_row, 0, &mut s.time, &mut s.spectrum, &mut s.work);
            kernel.multiply(&plans, s, row, false);
            plans.inverse_into(&mut s.spectrum, start, &mut s.time, &mut s.work, out);
        },
    );
    tensor(out, [batch, channels, length])
}

fn backward<E: Scalar + FftNum>(
    signal: &FlexTensor,
    kernel: &FlexTensor,
    grad: &FlexTensor,
    start: usize,
) -> (FlexTensor, FlexTensor) {
    let shape @ [batch, channels, length] = dims::<3>(signal);
    let kernel_batch = dims::<3>(kernel)[0];
    let plans = Plans::<E>::new(length);
    let (x, k, g) = (values::<E>(signal), values::<E>(kernel), values::<E>(grad));
    let kernel = KernelRows::new(&plans, &k, shape);
    let rows = batch * channels * length;
    // ∂k per sample row; summed over the batch below when the kernel is shared.
    let (mut grad_signal, mut grad_kernel) = (vec![E::zero(); rows], vec![E::zero(); rows]);
    grad_signal
        .par_chunks_mut(length)
        .zip(grad_kernel.par_chunks_mut(length))
        .enumerate()
        .for_each_init(
            || (plans.scratch(), plans.forward.make_output_vec()),
            |(s, upstream), (row, (grad_signal, grad_kernel))| {
                let grad_row = &g[row * length..][..length];
                plans.transform(grad_row, start, &mut s.time, upstream, &mut s.work);
                // ∂x = irfft(G · conj(K)).
                s.spectrum.copy_from_slice(upstream);
                kernel.multiply(&plans, s, row, true);
                plans.inverse_into(&mut s.spectrum, 0, &mut s.time, &mut s.work, grad_signal);
                // ∂k = irfft(G · conj(X)).
                let signal_row = &x[row * length..][..length];
                plans.transform(signal_row, 0, &mut s.time, &mut s.other, &mut s.work);
                multiply(upstream, &s.other, true);
                plans.inverse_into(upstream, 0, &mut s.time, &mut s.work, grad_kernel);
            },
        );
    let grad_kernel = if kernel_batch == 1 && batch > 1 {
        let (first, rest) = grad_kernel.split_at_mut(channels * length);
        for sample in rest.chunks(channels * length) {
            first.iter_mut().zip(sample).for_each(|(sum, &v)| *sum += v);
        }
        grad_kernel.truncate(channels * length);
        grad_kernel
    } else {
        grad_kernel
    };
    (
        tensor(grad_signal, [batch, channels, length]),
        tensor(grad_kernel, [kernel_batch, channels, length]),
    )
}

impl FftConvBackend for Flex {
    fn fft_conv_1d(signal: FlexTensor, kernel: FlexTensor, start: usize) -> FlexTensor {
        match signal.dtype() {
            DType::F32 => forward::<f32>(&signal, &kernel, start),
            DType::F64 => forward::<f64>(&signal, &kernel, start),
            other => panic!("fused FFT convolution: f32 or f64, got {other:?}"),
        }
    }

    fn fft_conv_1d_backward(
        signal: FlexTensor,
        kernel: FlexTensor,
        grad: FlexTensor,
        start: usize,
    ) -> (FlexTensor, FlexTensor) {
        match signal.dtype() {
            DType::F32 => backward::<f32>(&signal, &kernel, &grad, start),
            DType::F64 => backward::<f64>(&signal, &kernel, &grad, start),
            other => panic!("fused FFT convolution: f32 or f64, got {other:?}"),
        }
    }
}
