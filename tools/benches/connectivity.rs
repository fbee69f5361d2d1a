//! Divan benches of the workloads in `src/workloads.rs` (`cargo bench -p burn-connectivity-tools`).
//!
//! The backend is Flex unless `BENCH_DEVICE` names another compiled one (`ndarray`, `wgpu`…).
//! Each bench runs its work once untimed (kernel compilation and autotune on GPU backends), then
//! times it with a device sync at the end of every sample. The `bench_connectivity` tool runs
//! the same workloads and prints JSON lines and ratios.

use burn_connectivity_tools::workloads;

use burn::prelude::*;
use divan::Bencher;
use workloads::{ConvMethod, GCONV_LENGTHS, Model, Variant, gconv_inputs, stack_input};

fn main() {
    divan::main();
}

fn device() -> Device {
    let name = std::env::var("BENCH_DEVICE").unwrap_or_else(|_| "flex".into());
    burn_connectivity::device::device(&name).unwrap_or_else(|err| panic!("BENCH_DEVICE: {err}"))
}

fn bench_synced<T>(bencher: Bencher, device: &Device, work: impl Fn() -> T + Sync) {
    drop(work());
    device.sync().expect("device sync");
    bencher.bench(|| {
        let output = work();
        device.sync().expect("device sync");
        output
    });
}

#[divan::bench(args = Variant::ALL, consts = [12, 24], sample_count = 10, sample_size = 1)]
fn stack_forward<const DEPTH: usize>(bencher: Bencher, variant: Variant) {
    let device = device();
    let model = Model::new(variant, DEPTH, &device);
    let input = stack_input(&device);
    bench_synced(bencher, &device, || model.forward(input.clone()));
}

#[divan::bench(args = Variant::ALL, consts = [12, 24], sample_count = 10, sample_size = 1)]
fn stack_train_step<const DEPTH: usize>(bencher: Bencher, variant: Variant) {
    let device = device().autodiff();
    let model = Model::new(variant, DEPTH, &device);
    let input = stack_input(&device);
    bench_synced(bencher, &device, || model.train_step(input.clone()));
}

#[divan::bench(args = GCONV_LENGTHS, sample_count = 10, sample_size = 1)]
fn gconv_fft(bencher: Bencher, length: usize) {
    gconv(bencher, ConvMethod::Fft, length);
}

#[divan::bench(args = GCONV_LENGTHS, sample_count = 5, sample_size = 1)]
fn gconv_direct(bencher: Bencher, length: usize) {
    gconv(bencher, ConvMethod::Direct, length);
}

fn gconv(bencher: Bencher, method: ConvMethod, length: usize) {
    let device = device();
    let (z, kernel) = gconv_inputs(length, &device);
    bench_synced(bencher, &device, || method.apply(z.clone(), kernel.clone()));
}

/// Ten chained adds `sum += p_i · stream` on `[8, 128, 256]`, forward and backward, with each
/// `p_i` an entry of a coefficient vector that gets a gradient (`scaled = true`, as ANCRe's
/// mixture does on CPU backends) or without the scale: the per-shortcut cost of ANCRe.
#[divan::bench(args = [false, true], sample_count = 20, sample_size = 1)]
fn chained_adds_train(bencher: Bencher, scaled: bool) {
    const ADDS: usize = 10;
    let device = device().autodiff();
    let start = stack_input(&device).require_grad();
    let stream = stack_input(&device).require_grad();
    let coefficients = Tensor::<1>::ones([ADDS], &device).require_grad();
    bench_synced(bencher, &device, || {
        let mut sum = start.clone();
        for index in 0..ADDS {
            let term = if scaled {
                let position = Tensor::<1, Int>::from_data([index as i64], &device);
                stream.clone() * coefficients.clone().select(0, position).reshape([1, 1, 1])
            } else {
                stream.clone()
            };
            sum = sum + term;
        }
        sum.sum().backward()
    });
}
