//! ANCRe case study (paper §3): shortcut topology and gradient-descent speed in deep linear
//! networks.
//!
//! ```text
//! cargo run --release --features plot --example ancre_linear [-- --dim 8 --steps 3000 --lr 0.02 --out DIR]
//! ```
//!
//! A `K`-layer linear network `s_j = s_{j-1} W_j + Σ_i a_ij s_i` is fitted by full-batch
//! gradient descent on `½‖s_K − Y‖²` with whitened inputs (`X = I`, so `Y = X A = A`) and a small
//! random initialisation. Fixed shortcut topologies (none, cascade residual, a single shortcut)
//! are compared with ANCRe's learned softmax shortcuts: K = 3 with {none, cascade, 0:1, 0:2,
//! ANCRe} and K = 4 with {none, cascade, 0:3, ANCRe}. Prints the loss every `--every` steps, the
//! steps each needs to reach `--target` × the initial loss, and writes the curves to PNG files
//! (log-scale y).

use burn_connectivity_tools as common;

use std::path::PathBuf;
use std::process::ExitCode;

use burn::module::Param;
use burn::optim::{GradientsParams, SgdConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_connectivity::plot::{LineChart, Series};
use burn_connectivity::{
    AncreConfig, Block, Connectivity, ConnectivityConfig, ConnectivityMatrix, Error, Stack,
    StreamConnectivity,
};
use clap::Parser;
use common::DeviceArg;

/// ANCRe's deep-linear-network case study: shortcut topology vs gradient-descent speed.
#[derive(Parser, Debug)]
#[command(long_about = None)]
struct Flags {
    #[command(flatten)]
    device: DeviceArg,
    /// Width d of the linear layers.
    #[arg(long, default_value_t = 8)]
    dim: usize,
    /// Gradient-descent steps per topology.
    #[arg(long, default_value_t = 3000)]
    steps: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.02)]
    lr: f64,
    /// Scale of the initial weights (times 1/sqrt(d)).
    #[arg(long, default_value_t = 0.1)]
    init_scale: f64,
    /// Loss fraction (of the initial loss) a run must reach to count as converged.
    #[arg(long, default_value_t = 1e-3)]
    target: f64,
    /// Print the losses every N steps.
    #[arg(long, default_value_t = 250)]
    every: usize,
    /// Seed of the target and the weights.
    #[arg(long, default_value_t = 3)]
    seed: u64,
    /// Where the charts go.
    #[arg(long, default_value = "target/example-output")]
    out: PathBuf,
}

/// One linear layer without bias: the branch `f(s) = s W`.
#[derive(Module, Debug)]
struct LinearMap {
    weight: Param<Tensor<2>>,
}

impl Block<2> for LinearMap {
    type Context = ();

    fn branch(&self, input: Tensor<2>, _context: &()) -> Tensor<2> {
        input.matmul(self.weight.val())
    }
}

/// A fixed topology: `s_j = h_j + Σ_{i<j} a[i][j] s_i`, output `s_K`.
///
/// A connectivity written outside the crate, to show that the abstraction is open.
#[derive(Module, Debug)]
struct FixedShortcuts {
    #[module(skip)]
    coefficients: Vec<Vec<f64>>,
}

impl FixedShortcuts {
    /// Only the shortcuts `(source, target)` listed, each with coefficient 1.
    fn new(num_blocks: usize, shortcuts: &[(usize, usize)]) -> Self {
        let mut coefficients = vec![vec![0.0; num_blocks + 1]; num_blocks + 1];
        for &(source, target) in shortcuts {
            coefficients[source][target] = 1.0;
        }
        Self { coefficients }
    }
}

impl Connectivity for FixedShortcuts {
    fn num_blocks(&self) -> usize {
        self.coefficients.len() - 1
    }

    fn matrix(&self) -> ConnectivityMatrix {
        ConnectivityMatrix::from_stream_mixture(&self.coefficients).expect("square coefficients")
    }

    fn truncated(&self, depth: usize) -> Result<Self, Error> {
        if depth == 0 || depth > self.num_blocks() {
            return Err(Error::DepthOutOfRange {
                depth,
                min: 1,
                blocks: self.num_blocks(),
            });
        }
        let coefficients = self.coefficients[..=depth]
            .iter()
            .map(|row| row[..=depth].to_vec())
            .collect();
        Ok(Self { coefficients })
    }
}

impl StreamConnectivity<2> for FixedShortcuts {
    /// Every state so far (the networks here are a few layers deep).
    type State = Vec<Tensor<2>>;

    fn start(&self, input: Tensor<2>) -> Vec<Tensor<2>> {
        vec![input]
    }

    fn block_input(&self, states: &Vec<Tensor<2>>) -> Tensor<2> {
        states[states.len() - 1].clone()
    }

    fn step_with_tail(
        &self,
        mut states: Vec<Tensor<2>>,
        block: usize,
        branch: Tensor<2>,
        tail: impl FnOnce(Tensor<2>) -> Tensor<2>,
    ) -> Vec<Tensor<2>> {
        let target = block + 1;
        let next = states
            .iter()
            .enumerate()
            .fold(branch, |sum, (source, state)| {
                match self.coefficients[source][target] {
                    0.0 => sum,
                    coefficient => sum + state.clone().mul_scalar(coefficient),
                }
            });
        states.push(tail(next));
        states
    }

    fn output(&self, states: &Vec<Tensor<2>>) -> Tensor<2> {
        self.block_input(states)
    }
}

struct Problem {
    dim: usize,
    steps: usize,
    learning_rate: f64,
    init_scale: f64,
    seed: u64,
    target: Tensor<2>,
    device: Device,
}

struct Run {
    name: String,
    losses: Vec<f64>,
}

impl Problem {
    fn layers(&self, depth: usize) -> Vec<LinearMap> {
        // Same seed for every topology: identical initial weights.
        self.device.seed(self.seed);
        let std = self.init_scale / (self.dim as f64).sqrt();
        (0..depth)
            .map(|_| LinearMap {
                weight: Param::from_tensor(Tensor::random(
                    [self.dim, self.dim],
                    Distribution::Normal(0.0, std),
                    &self.device,
                )),
            })
            .collect()
    }

    /// Full-batch gradient descent; returns the loss before every step and after the last, and
    /// the trained model.
    fn train<C: StreamConnectivity<2>>(
        &self,
        name: &str,
        mut model: Stack<LinearMap, C>,
    ) -> (Run, Stack<LinearMap, C>) {
        let mut optimizer = SgdConfig::new().init();
        let inputs = Tensor::<2>::eye(self.dim, &self.device);
        let mut losses = Vec::with_capacity(self.steps + 1);
        for step in 0..=self.steps {
            let residual = model.forward(inputs.clone()) - self.target.clone();
            let loss = residual.powf_scalar(2.0).sum().mul_scalar(0.5);
            losses.push(loss.clone().into_scalar::<f64>());
            if step < self.steps {
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optimizer.step(self.learning_rate, model, grads);
            }
        }
        (
            Run {
                name: name.to_string(),
                losses,
            },
            model,
        )
    }

    fn fixed(&self, depth: usize, name: &str, shortcuts: &[(usize, usize)]) -> Run {
        let model = Stack::from_parts(self.layers(depth), FixedShortcuts::new(depth, shortcuts))
            .expect("matching depth");
        self.train(name, model).0
    }

    fn ancre(&self, depth: usize) -> Result<(Run, Vec<Vec<f64>>), String> {
        let connectivity = AncreConfig::new()
            .init(depth, &self.device)
            .map_err(|err| err.to_string())?;
        let model =
            Stack::from_parts(self.layers(depth), connectivity).map_err(|err| err.to_string())?;
        let (run, trained) = self.train("ANCRe", model);
        Ok((run, trained.connectivity.coefficient_values()))
    }
}

fn steps_to(losses: &[f64], threshold: f64) -> Option<usize> {
    losses.iter().position(|&loss| loss <= threshold)
}

fn report(
    depth: usize,
    runs: &[Run],
    problem: &Problem,
    target_fraction: f64,
    every: usize,
    out: &std::path::Path,
) -> Result<(), String> {
    let threshold = runs[0].losses[0] * target_fraction;
    println!("\nK = {depth}: loss every {every} steps");
    let header: String = runs.iter().map(|run| format!("{:>12}", run.name)).collect();
    println!("{:>6}{header}", "step");
    for step in (0..=problem.steps).step_by(every) {
        let row: String = runs
            .iter()
            .map(|run| format!("{:>12.3e}", run.losses[step]))
            .collect();
        println!("{step:>6}{row}");
    }
    println!("steps to reach {threshold:.3e} ({target_fraction:.0e} x the initial loss):");
    for run in runs {
        match steps_to(&run.losses, threshold) {
            Some(steps) => println!("  {:>8}: {steps}", run.name),
            None => println!(
                "  {:>8}: not within {} steps (final loss {:.3e})",
                run.name, problem.steps, run.losses[problem.steps]
            ),
        }
    }
    let chart = runs.iter().fold(
        LineChart::new(format!(
            "Deep linear network, K = {depth}: gradient descent"
        ))
        .with_labels("step", "loss ½‖s_K − Y‖²")
        .with_log_y(true),
        |chart, run| {
            let points = run
                .losses
                .iter()
                .enumerate()
                .map(|(step, &loss)| (step as f64, loss))
                .collect();
            chart.with_series(Series::new(run.name.clone(), points))
        },
    );
    let path = out.join(format!("ancre_linear_k{depth}.png"));
    chart.write_png(&path).map_err(|err| err.to_string())?;
    println!("curves written to {}", path.display());
    Ok(())
}

/// The learned `p_ij`, one line per target `j`.
fn print_coefficients(p: &[Vec<f64>]) {
    println!("ANCRe's learned coefficients p_ij (target j: sources i = 0..j-1):");
    for j in 1..p.len() {
        let sources: Vec<String> = p[..j].iter().map(|row| format!("{:.3}", row[j])).collect();
        println!("  j = {j}: [{}]", sources.join(", "));
    }
}

fn run(flags: Flags) -> Result<(), String> {
    if flags.dim == 0 || flags.steps == 0 || flags.every == 0 {
        return Err("--dim, --steps and --every must be at least 1".into());
    }
    let dim = flags.dim;
    let device = flags.device.device()?.autodiff();
    let seed = flags.seed;
    device.seed(seed + 1);
    let target = Tensor::<2>::random([dim, dim], Distribution::Normal(0.0, 1.0), &device);
    let problem = Problem {
        dim,
        steps: flags.steps,
        learning_rate: flags.lr,
        init_scale: flags.init_scale,
        seed,
        target,
        device,
    };
    let target_fraction = flags.target;
    let every = flags.every;
    let out = flags.out;
    std::fs::create_dir_all(&out).map_err(|err| format!("{}: {err}", out.display()))?;
    println!(
        "d = {dim}, X = I (whitened), Y = A ~ N(0, 1), W_j ~ N(0, ({} / sqrt(d))^2), gradient descent lr {}",
        problem.init_scale, problem.learning_rate
    );

    let cascade3 = [(0, 1), (1, 2), (2, 3)];
    let mut runs3 = vec![
        problem.fixed(3, "none", &[]),
        problem.fixed(3, "cascade", &cascade3),
        problem.fixed(3, "0:1 only", &[(0, 1)]),
        problem.fixed(3, "0:2 only", &[(0, 2)]),
    ];
    let (ancre3, learned3) = problem.ancre(3)?;
    runs3.push(ancre3);
    report(3, &runs3, &problem, target_fraction, every, &out)?;
    print_coefficients(&learned3);

    let cascade4 = [(0, 1), (1, 2), (2, 3), (3, 4)];
    let mut runs4 = vec![
        problem.fixed(4, "none", &[]),
        problem.fixed(4, "cascade", &cascade4),
        problem.fixed(4, "0:3 only", &[(0, 3)]),
    ];
    let (ancre4, learned4) = problem.ancre(4)?;
    runs4.push(ancre4);
    report(4, &runs4, &problem, target_fraction, every, &out)?;
    print_coefficients(&learned4);
    Ok(())
}

fn main() -> ExitCode {
    common::exit(run(Flags::parse()))
}
