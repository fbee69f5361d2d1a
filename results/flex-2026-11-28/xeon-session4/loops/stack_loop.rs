//! Throwaway (not committed): whole stack train steps of each variant in a loop, mean ms,
//! the variants taking turns in blocks of `steps` steps, `rounds` times.
use burn_connectivity_tools::workloads::{Model, StackShape, Variant};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let steps: usize = args[1].parse().unwrap();
    let rounds: usize = args[2].parse().unwrap();
    let variants = Variant::selected(&args[3]).unwrap();
    let device = burn_connectivity::device::device("flex").unwrap().autodiff();
    let shape = StackShape::stack(12);
    let input = shape.input(&device);
    let models: Vec<_> = variants
        .iter()
        .map(|&variant| (variant, Model::with_shape(variant, shape, &device)))
        .collect();
    for (_, model) in &models {
        for _ in 0..2 {
            let _ = model.train_step(input.clone());
        }
    }
    let mut totals = vec![0.0; models.len()];
    for _ in 0..rounds {
        for (index, (_, model)) in models.iter().enumerate() {
            let start = Instant::now();
            for _ in 0..steps {
                let _ = model.train_step(input.clone());
            }
            totals[index] += start.elapsed().as_secs_f64() * 1e3 / (steps * rounds) as f64;
        }
    }
    let line: Vec<String> = models
        .iter()
        .zip(&totals)
        .map(|((variant, _), ms)| format!("{} {:.1}", variant.name(), ms))
        .collect();
    println!("{}", line.join(" "));
}
