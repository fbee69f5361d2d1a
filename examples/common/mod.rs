//! Helpers shared by the examples: command-line flags and the digits data set.

#![allow(dead_code)] // each example uses a different part

use std::collections::HashMap;
use std::str::FromStr;

use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::prelude::*;
use burn_connectivity::{Hacn, HacnConfig, MlpBlock, MlpBlockConfig, Stack};

/// `--name value` flags and positional arguments.
pub struct Args {
    flags: HashMap<String, String>,
    /// Arguments that are not flags, in order.
    pub positional: Vec<String>,
}

impl Args {
    /// Parses the process arguments. Every flag takes a value; `known` lists the accepted
    /// names besides `device`. `--help` prints `usage` and exits.
    pub fn parse(usage: &str, known: &[&str]) -> Result<Self, String> {
        let mut flags = HashMap::new();
        let mut positional = Vec::new();
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            if arg == "-h" || arg == "--help" {
                println!("{usage}");
                std::process::exit(0);
            }
            match arg.strip_prefix("--") {
                Some(name) if name == "device" || known.contains(&name) => {
                    let value = args
                        .next()
                        .ok_or_else(|| format!("--{name} needs a value\n{usage}"))?;
                    flags.insert(name.to_string(), value);
                }
                Some(name) => return Err(format!("unknown flag --{name}\n{usage}")),
                None => positional.push(arg),
            }
        }
        Ok(Self { flags, positional })
    }

    /// The value of `--name`, or `default`.
    pub fn get<T: FromStr>(&self, name: &str, default: T) -> Result<T, String> {
        match self.flags.get(name) {
            Some(text) => text
                .parse()
                .map_err(|_| format!("invalid value for --{name}: {text:?}")),
            None => Ok(default),
        }
    }

    /// The device named by `--device` (default `flex`); an error names the compiled backends.
    pub fn device(&self) -> Result<Device, String> {
        let name = self.get("device", String::from("flex"))?;
        burn_connectivity::backend::device(&name).map_err(|err| err.to_string())
    }
}

/// The UCI handwritten digits (8x8 images, pixels 0..16, labels 0..9; CC BY 4.0, see
/// examples/data/README.md), shipped in the crate so the examples run offline.
pub struct Digits {
    /// One row of 64 pixels per image, scaled to `[0, 1]`.
    pub pixels: Vec<[f32; 64]>,
    /// The digit shown.
    pub labels: Vec<usize>,
}

impl Digits {
    /// Number of classes.
    pub const CLASSES: usize = 10;

    /// Parses the bundled CSV.
    pub fn load() -> Result<Self, String> {
        let mut digits = Self {
            pixels: Vec::new(),
            labels: Vec::new(),
        };
        for (line_number, line) in include_str!("../data/digits.csv").lines().enumerate() {
            let values: Vec<u8> = line
                .split(',')
                .map(|value| value.trim().parse())
                .collect::<Result<_, _>>()
                .map_err(|err| format!("digits.csv line {}: {err}", line_number + 1))?;
            let (label, pixels) = values.split_last().ok_or("digits.csv: empty line")?;
            let pixels: [u8; 64] = pixels
                .try_into()
                .map_err(|_| format!("digits.csv line {}: expected 64 pixels", line_number + 1))?;
            digits
                .pixels
                .push(pixels.map(|pixel| f32::from(pixel) / 16.0));
            digits.labels.push(usize::from(*label));
        }
        Ok(digits)
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// A shuffled split into (train, held-out test), deterministic for a given `seed`.
    pub fn split(self, test_fraction: f64, seed: u64) -> (Self, Self) {
        let order = shuffled(self.len(), seed);
        let test_len = (self.len() as f64 * test_fraction).round() as usize;
        let pick = |indices: &[usize]| Self {
            pixels: indices.iter().map(|&i| self.pixels[i]).collect(),
            labels: indices.iter().map(|&i| self.labels[i]).collect(),
        };
        (pick(&order[test_len..]), pick(&order[..test_len]))
    }

    /// The images at `indices` as `[n, 64]` features and `[n]` labels.
    pub fn batch(&self, indices: &[usize], device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
        let pixels: Vec<f32> = indices.iter().flat_map(|&i| self.pixels[i]).collect();
        let labels: Vec<i64> = indices.iter().map(|&i| self.labels[i] as i64).collect();
        (
            Tensor::from_data(TensorData::new(pixels, [indices.len(), 64]), device),
            Tensor::from_data(TensorData::new(labels, [indices.len()]), device),
        )
    }
}

/// `0..len` in a pseudo-random order (a small LCG: the examples need no RNG crate).
pub fn shuffled(len: usize, seed: u64) -> Vec<usize> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut order: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        order.swap(i, (state >> 33) as usize % (i + 1));
    }
    order
}

/// Fraction of rows of `logits` whose arg-max is the label.
pub fn accuracy(logits: Tensor<2>, labels: Tensor<1, Int>) -> f64 {
    let total = labels.dims()[0];
    let predictions = logits.argmax(1).flatten::<1>(0, 1);
    let correct = predictions.equal(labels).int().sum().into_scalar::<i64>();
    correct as f64 / total as f64
}

/// Pixels → embedding → connected stack of MLP blocks → LayerNorm → linear head.
#[derive(Module, Debug)]
pub struct Classifier {
    pub embed: Linear,
    pub stack: Stack<MlpBlock, Hacn>,
    pub norm: LayerNorm,
    pub head: Linear,
}

impl Classifier {
    /// `blocks` MLP blocks of width `width` wired by `connectivity`.
    pub fn new(
        connectivity: &HacnConfig,
        blocks: usize,
        width: usize,
        device: &Device,
    ) -> Result<Self, String> {
        // Blocks and head are drawn before the connectivity so every variant starts from the
        // same weights; only H-ACN's noisy gates draw after them.
        let embed = LinearConfig::new(64, width).init(device);
        let blocks = MlpBlockConfig::new(width, 2 * width)
            .init_stack(blocks, device)
            .map_err(|err| err.to_string())?;
        let norm = LayerNormConfig::new(width).init(device);
        let head = LinearConfig::new(width, Digits::CLASSES).init(device);
        let stack = Stack::new(blocks, connectivity, device).map_err(|err| err.to_string())?;
        Ok(Self {
            embed,
            stack,
            norm,
            head,
        })
    }

    pub fn classify(&self, readout: Tensor<2>) -> Tensor<2> {
        self.head.forward(self.norm.forward(readout))
    }

    pub fn forward(&self, pixels: Tensor<2>) -> Tensor<2> {
        self.classify(self.stack.forward(self.embed.forward(pixels)))
    }

    /// Logits of every readout `y_0..y_L` through the shared head.
    pub fn layerwise(&self, pixels: Tensor<2>) -> Vec<Tensor<2>> {
        let readout = self.stack.readout(self.embed.forward(pixels));
        readout.into_iter().map(|y| self.classify(y)).collect()
    }
}
