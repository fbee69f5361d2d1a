//! The mechanics shared by the multi-stream connectivities (hyper-connections, frac-connections,
//! mHC): `U` residual units of width `w` per token, mixed into the block input and into the next
//! units by per-token matrices (MATH §5.1–5.2).
//!
//! Every token carries its units as the rows of a `[U, w]` matrix `S`. A layer supplies, for
//! every token (or once for all tokens when it is static), the transposed width connections
//! `Aᵀ = [A_in | A_res]ᵀ` (`[V + U, U]`: `V` rows for the views that make the block input, `U` for
//! the next units), and the depth connections `β` (`[U]`):
//!
//! ```text
//! input = A_inᵀ S            (V views of width w, concatenated into the block input of width d)
//! S'    = A_resᵀ S + β ⊙ h   (h split into V views; unit (k, f) receives view f)
//! ```
//!
//! With `V = 1` and `w = d` the units are hyper-connections' streams; with `V = m` views of width
//! `d/m` they are frac-connections' fractions, `n` streams of them (`U = n·m`, unit `k·m + f` is
//! fraction `f` of stream `k`). The mixing works on the whole `[tokens, U, w]` state at once,
//! whatever the rank of the streams (tensors of any rank are flattened to tokens × width): one
//! fused op with its own backward per mixing on Flex, one kernel each way on CubeCL (where a
//! layer with token-dependent connections makes them as one table `[A_inᵀ; A_resᵀ; βᵀ]` in one
//! kernel), `U` broadcast multiply-adds elsewhere, chosen once per forward pass. The residual mixing waits for the block's output, so that
//! `A_resᵀ S + β h` is made in one pass.

use burn::module::ModuleDisplay;
use burn::prelude::*;

use crate::backend::{Gains, LayerOps, MatrixRows, UnitOps};
use crate::connectivity::{Connectivity, StreamConnectivity};
use crate::error::{Error, Result};
use crate::matrix::ConnectivityMatrix;

/// How the streams are reduced to the stack's output (and to every readout).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum StreamReduce {
    /// `y = Σ_k S_k` (hyper-connections' default).
    Sum,
    /// `y = (1/n) Σ_k S_k` (mHC's default).
    Mean,
}

/// The width and depth connections of one layer, for every token (leading axis = tokens) or for
/// all of them at once (leading axis 1).
pub struct Mixing {
    /// `A_inᵀ`, `V` rows of `[tokens | 1, ·, U]` matrices: they make the views.
    pub input: MatrixRows,
    /// The views `A_inᵀ S` (`[tokens, V, w]`) where the kernel that made a table made them too;
    /// else the pass's ops mix them.
    pub made_input: Option<Tensor<3>>,
    /// `A_resᵀ`, `U` rows of `[tokens | 1, ·, U]` matrices: they make the next units.
    pub residual: MatrixRows,
    /// `β`: `[tokens | 1, U, 1]`, or a row of the residual rows' matrices.
    pub beta: Gains,
    /// The gradient slot the table's mixes share (0: none; see the backend's
    /// `gradient_slots`).
    pub slot: u64,
}

impl Mixing {
    /// From `Aᵀ = [A_in | A_res]ᵀ` (`[tokens | 1, V + U, U]`), read in place.
    pub fn stacked(width: Tensor<3>, beta: Tensor<3>) -> Self {
        let [_, rows, units] = width.dims();
        let views = rows - units;
        Self {
            input: MatrixRows {
                matrices: width.clone(),
                first: 0,
                count: views,
            },
            made_input: None,
            residual: MatrixRows {
                matrices: width,
                first: views,
                count: units,
            },
            beta: Gains::Own(beta),
            slot: 0,
        }
    }

    /// From a table `[tokens, V + U + 1, U]`: `A_inᵀ`, `A_resᵀ` and `βᵀ` as its rows, read in
    /// place; the views `input` and `slot` as made with the table.
    pub fn table(table: Tensor<3>, input: Tensor<3>, views: usize, slot: u64) -> Self {
        let [_, rows, units] = table.dims();
        debug_assert_eq!(rows, views + units + 1, "a table of V + U + 1 rows");
        Self {
            input: MatrixRows {
                matrices: table.clone(),
                first: 0,
                count: views,
            },
            made_input: Some(input),
            residual: MatrixRows {
                matrices: table,
                first: views,
                count: units,
            },
            beta: Gains::Row(views + units),
            slot,
        }
    }
}

/// A layer of a multi-stream connectivity: its mixing as a function of the units.
pub trait MixingLayer {
    /// The layer's connections for the units `[tokens, U, w]`, computed with the pass's unit
    /// ops `ops` (its normalised projection, fused or composed as chosen for the whole pass).
    fn mixing(&self, units: &Tensor<3>, ops: &LayerOps) -> Mixing;
}

/// The layout of the units: `n` streams of `m` fractions of width `w = d/m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// `n`.
    pub streams: usize,
    /// `m`.
    pub fractions: usize,
}

impl Layout {
    pub fn units(self) -> usize {
        self.streams * self.fractions
    }

    /// Checks that the fractions divide `width` and returns the unit width.
    pub fn unit_width(self, width: usize) -> Result<usize> {
        if width == 0 || !width.is_multiple_of(self.fractions) {
            return Err(Error::WidthMismatch {
                name: format!(
                    "a width divisible into {} fractions (frac-connections)",
                    self.fractions
                ),
                expected: width.div_ceil(self.fractions).max(1) * self.fractions,
                found: width,
            });
        }
        Ok(width / self.fractions)
    }
}

/// The running state of a multi-stream connectivity.
#[derive(Debug, Clone)]
pub struct MultiStreamState<const D: usize> {
    /// The units `[tokens, U, w]` (tokens = the product of the leading axes of the stack input).
    pub units: Tensor<3>,
    /// Shape of the stack input (and of every block input and output).
    shape: [usize; D],
    /// How the units make streams.
    layout: Layout,
    /// Fused or composed unit ops, chosen once for the whole pass.
    ops: UnitOps,
    /// The next block's input and the parts of the next units that do not depend on its output;
    /// `None` after the last block.
    next: Option<Prepared<D>>,
}

#[derive(Debug, Clone)]
struct Prepared<const D: usize> {
    input: Tensor<D>,
    /// `A_resᵀ` (`[tokens | 1, U, U]`), applied when the block's output arrives.
    residual: MatrixRows,
    beta: Gains,
    slot: u64,
    /// The layer's ops (their gradient slot is shared by its projection and both mixes).
    ops: LayerOps,
}

impl<const D: usize> MultiStreamState<D> {
    /// Mean over tokens of the spread between streams: the standard deviation across the `n`
    /// streams, relative to the root mean square of the units (0 when every stream is equal,
    /// as at the start).
    pub fn stream_spread(&self) -> f64 {
        let [tokens, units, width] = self.units.dims();
        let streams = self.layout.streams;
        let per_stream = self
            .units
            .clone()
            .reshape([tokens, streams, units / streams * width]);
        let spread = per_stream
            .clone()
            .var_bias(1)
            .mean()
            .into_scalar::<f64>()
            .sqrt();
        let scale = per_stream.square().mean().into_scalar::<f64>().sqrt();
        if scale > 0.0 { spread / scale } else { 0.0 }
    }
}

/// `x` copied into every stream (split into fractions), with the first layer's mixing prepared.
pub(crate) fn start<const D: usize>(
    input: Tensor<D>,
    layout: Layout,
    first: &impl MixingLayer,
) -> MultiStreamState<D> {
    let shape = input.dims();
    let width = shape[D - 1];
    let tokens = input.shape().num_elements() / width.max(1);
    let unit_width = width / layout.fractions;
    let units = input
        .reshape([tokens, 1, layout.fractions, unit_width])
        .expand([tokens, layout.streams, layout.fractions, unit_width])
        .reshape([tokens, layout.units(), unit_width]);
    let ops = UnitOps::for_units(&units);
    let next = Some(prepare(&units, shape, ops, first));
    MultiStreamState {
        units,
        shape,
        layout,
        ops,
        next,
    }
}

fn prepare<const D: usize>(
    units: &Tensor<3>,
    shape: [usize; D],
    ops: UnitOps,
    layer: &impl MixingLayer,
) -> Prepared<D> {
    let ops = ops.layer();
    let Mixing {
        input,
        made_input,
        residual,
        beta,
        slot,
    } = layer.mixing(units, &ops);
    let input = made_input.unwrap_or_else(|| ops.mix(input, units.clone(), None, slot));
    Prepared {
        input: input.reshape(shape),
        residual,
        beta,
        slot,
        ops,
    }
}

/// The input of the next block; `None` after the last block.
pub(crate) fn block_input<const D: usize>(state: &MultiStreamState<D>) -> Option<Tensor<D>> {
    state.next.as_ref().map(|prepared| prepared.input.clone())
}

/// `S' = A_resᵀ S + β ⊙ h`, then the mixing of `next` prepared.
pub(crate) fn step<const D: usize>(
    state: MultiStreamState<D>,
    branch: Tensor<D>,
    next: Option<&impl MixingLayer>,
) -> MultiStreamState<D> {
    let MultiStreamState {
        units,
        shape,
        layout,
        ops,
        next: prepared,
    } = state;
    let Prepared {
        residual,
        beta,
        slot,
        ops: layer_ops,
        ..
    } = prepared.expect("blocks are stepped once each, in order");
    let [tokens, _, unit_width] = units.dims();
    let branch = branch.reshape([tokens, layout.fractions, unit_width]);
    let units = layer_ops.mix(residual, units, Some((beta, branch)), slot);
    let next = next.map(|layer| prepare(&units, shape, ops, layer));
    MultiStreamState {
        units,
        shape,
        layout,
        ops,
        next,
    }
}

/// The branch a whole layer adds when a tail follows the block: `tail(input + branch) − input`
/// (see [`StreamConnectivity::step_with_tail`](crate::StreamConnectivity::step_with_tail)).
pub(crate) fn layer_branch<const D: usize>(
    state: &MultiStreamState<D>,
    branch: Tensor<D>,
    tail: impl FnOnce(Tensor<D>) -> Tensor<D>,
) -> Tensor<D> {
    let input = block_input(state).expect("a block is stepped before the last one ends");
    tail(input.clone() + branch) - input
}

/// The streams reduced to one tensor of the input's shape.
pub(crate) fn output<const D: usize>(
    state: &MultiStreamState<D>,
    reduce: StreamReduce,
) -> Tensor<D> {
    let layout = state.layout;
    let [tokens, _, unit_width] = state.units.dims();
    // On the CubeCL kernels: `W S` with `W[t, f, u]` the gain where unit `u` is fraction `f` of
    // a stream, one mix kernel forward and one backward (composed: a sum, a scale and their
    // backward, a kernel each). `W` is uploaded, per token so that no sum over the tokens makes
    // its (unused) gradient.
    #[cfg(feature = "cube-kernels")]
    if let UnitOps::Kernels = state.ops {
        let fractions = layout.fractions;
        let units = layout.units();
        let gain = match reduce {
            StreamReduce::Sum => 1.0,
            StreamReduce::Mean => 1.0 / layout.streams as f32,
        };
        let row: Vec<f32> = (0..fractions)
            .flat_map(|f| (0..units).map(move |u| if u % fractions == f { gain } else { 0.0 }))
            .collect();
        let data = burn::tensor::TensorData::new(row.repeat(tokens), [tokens, fractions, units]);
        let device = state.units.device();
        let weights = Tensor::<3>::from_data(data, (&device, state.units.dtype()));
        return weighted_units(state, weights);
    }
    let per_stream =
        state
            .units
            .clone()
            .reshape([tokens, layout.streams, layout.fractions * unit_width]);
    let total = per_stream.sum_dim(1);
    let reduced = match reduce {
        StreamReduce::Sum => total,
        StreamReduce::Mean => total.div_scalar(layout.streams as f64),
    };
    reduced.reshape(state.shape)
}

/// A layer's data-independent connections read back to the host: `input[u][v]` (weight of unit
/// `u` in view `v`), `residual[u][u']`, `beta[u]`.
pub(crate) struct StaticMixing {
    pub input: Vec<Vec<f64>>,
    pub residual: Vec<Vec<f64>>,
    pub beta: Vec<f64>,
}

impl StaticMixing {
    /// From a [`Mixing`] with leading axis 1.
    pub fn from_mixing(mixing: Mixing) -> Self {
        // Stored transposed: entry [r][u] of Aᵀ is A[u][r].
        let columns = |rows: MatrixRows| -> Vec<Vec<f64>> {
            let (count, units) = (rows.count, rows.matrices.dims()[2]);
            let values: Vec<f64> = rows.taken().into_data().iter::<f64>().collect();
            (0..units)
                .map(|u| (0..count).map(|r| values[r * units + u]).collect())
                .collect()
        };
        let beta = mixing.beta.tensor(&mixing.residual.matrices);
        Self {
            input: columns(mixing.input),
            residual: columns(mixing.residual),
            beta: beta.into_data().iter::<f64>().collect(),
        }
    }
}

/// `C` and the output column of the static part of a multi-stream connectivity: the connections
/// its layers give a token whose units vanish (`[1, U, w]` zeros), read back to the host.
pub(crate) fn static_part_matrix<L: MixingLayer>(
    layers: impl Iterator<Item = L>,
    layout: Layout,
    output: StaticOutput,
    unit_width: usize,
    device: &Device,
) -> ConnectivityMatrix {
    let zero = Tensor::zeros([1, layout.units(), unit_width], device);
    let layers: Vec<StaticMixing> = layers
        .map(|layer| StaticMixing::from_mixing(layer.mixing(&zero, &LayerOps::composed())))
        .collect();
    static_matrix(&layers, layout, output)
}

/// How the static part's output weighs the units.
pub(crate) enum StaticOutput {
    /// The fixed reduction.
    Reduce(StreamReduce),
    /// A head's weights per unit.
    Head(Vec<f64>),
}

/// `C` and the output column of a multi-stream connectivity whose layers have the given
/// data-independent connections, by running the recursion on coefficient vectors.
///
/// Each unit is a combination of the fractions of `h_0..h_L`. `C[i][j]` is the coefficient of
/// `h_i` in the input of block `j`, averaged over the views (view `f` against fraction `f` of
/// `h_i`); `out[i]` likewise for the output. With one fraction both are exact.
fn static_matrix(
    layers: &[StaticMixing],
    layout: Layout,
    output: StaticOutput,
) -> ConnectivityMatrix {
    let size = layers.len() + 1;
    let (n, m) = (layout.streams, layout.fractions);
    // coef[u][i * m + f]: coefficient of fraction f of h_i in unit u.
    let mut coef: Vec<Vec<f64>> = (0..n * m)
        .map(|u| {
            let mut vector = vec![0.0; size * m];
            vector[u % m] = 1.0;
            vector
        })
        .collect();
    let combine = |weights: &dyn Fn(usize) -> f64, coef: &[Vec<f64>]| -> Vec<f64> {
        let mut total = vec![0.0; size * m];
        for (u, vector) in coef.iter().enumerate() {
            let weight = weights(u);
            for (sum, value) in total.iter_mut().zip(vector) {
                *sum += weight * value;
            }
        }
        total
    };
    let diagonal = |views: &[Vec<f64>]| -> Vec<f64> {
        (0..size)
            .map(|i| (0..m).map(|f| views[f][i * m + f]).sum::<f64>() / m as f64)
            .collect()
    };
    let mut columns = vec![vec![0.0; size]];
    for (index, layer) in layers.iter().enumerate() {
        let views: Vec<Vec<f64>> = (0..m)
            .map(|v| combine(&|u| layer.input[u][v], &coef))
            .collect();
        columns.push(diagonal(&views));
        coef = (0..n * m)
            .map(|target| {
                let mut vector = combine(&|u| layer.residual[u][target], &coef);
                vector[(index + 1) * m + target % m] += layer.beta[target];
                vector
            })
            .collect();
    }
    let weight = |u: usize| match &output {
        StaticOutput::Reduce(StreamReduce::Sum) => 1.0,
        StaticOutput::Reduce(StreamReduce::Mean) => 1.0 / n as f64,
        StaticOutput::Head(weights) => weights[u],
    };
    let outputs: Vec<Vec<f64>> = (0..m)
        .map(|f| combine(&|u| if u % m == f { weight(u) } else { 0.0 }, &coef))
        .collect();
    ConnectivityMatrix::from_columns(&columns, diagonal(&outputs))
        .expect("columns of L+1 entries by construction")
}

/// The stack input's last axis against the width a multi-stream connectivity was built for.
pub(crate) fn check_width(name: &str, width: usize, dims: &[usize]) -> Result<()> {
    let found = dims.last().copied().unwrap_or(0);
    if found != width {
        return Err(Error::WidthMismatch {
            name: format!(
                "{name} stream width (its config's `width`) against the stack input's last axis"
            ),
            expected: width,
            found,
        });
    }
    Ok(())
}

/// A multi-stream connectivity (hyper-connections, mHC): what it must tell for the generic
/// [`Connectivity`] and [`StreamConnectivity`] implementations below. Public only in name: the
/// module is private, so it cannot be implemented outside the crate.
///
/// Its `C` is that of the static part (the connections of a token whose streams vanish). At a
/// layer whose own wiring goes on after the block (a transformer layer at block granularity),
/// the streams receive the layer's whole update `tail(M_0 + h) − M_0`. After the last block,
/// `block_input` is the output (there is no block left to feed).
pub trait MultiStream: Module + ModuleDisplay + Clone {
    /// Names the connectivity in errors.
    const NAME: &'static str;

    /// One block's mixing.
    #[doc(hidden)]
    type Layer<'a>: MixingLayer
    where
        Self: 'a;

    /// The width of the stack's streams.
    fn stream_width(&self) -> usize;

    /// How the units make streams.
    #[doc(hidden)]
    fn layout(&self) -> Layout;

    /// How the streams make the output.
    fn reduce(&self) -> StreamReduce;

    /// Number of blocks (one layer of connections each).
    fn num_layers(&self) -> usize;

    /// Block `block`'s mixing; `None` past the last block.
    #[doc(hidden)]
    fn mixing(&self, block: usize) -> Option<Self::Layer<'_>>;

    /// The same connectivity with the layers of the first `depth` blocks only.
    fn first_layers(&self, depth: usize) -> Self;

    /// Per-token weights `[T, U]` of the units in the output where a learned head makes them
    /// from the units (DeepSeek-V4's); `None`: the fixed [`reduce`](Self::reduce).
    #[doc(hidden)]
    fn head_weights(&self, units: &Tensor<3>) -> Option<Tensor<2>> {
        let _ = units;
        None
    }
}

/// The output of `connectivity` from the units of `state`: its head's weighted sum of the units,
/// or its fixed reduction.
fn readout<T: MultiStream, const D: usize>(
    connectivity: &T,
    state: &MultiStreamState<D>,
) -> Tensor<D> {
    match connectivity.head_weights(&state.units) {
        Some(weights) => {
            let [tokens, units, _] = state.units.dims();
            weighted_units(state, weights.reshape([tokens, 1, units]))
        }
        None => output(state, connectivity.reduce()),
    }
}

/// `W S` for per-token weights `W [T, R, U]` of the units, reshaped to the stack's shape: the
/// mix kernel on CubeCL; elsewhere tensor ops (the fused Flex mix assembles a layer's units
/// gradient with its projection's, which an output mix has no part in).
fn weighted_units<const D: usize>(state: &MultiStreamState<D>, weights: Tensor<3>) -> Tensor<D> {
    let ops = match state.ops {
        UnitOps::Kernels => state.ops.layer(),
        _ => LayerOps::composed(),
    };
    ops.mix(MatrixRows::all(weights), state.units.clone(), None, 0)
        .reshape(state.shape)
}

impl<T: MultiStream> Connectivity for T {
    fn num_blocks(&self) -> usize {
        self.num_layers()
    }

    fn matrix(&self) -> ConnectivityMatrix {
        let layout = self.layout();
        let device = &self.devices()[0];
        let zero = Tensor::zeros(
            [1, layout.units(), self.stream_width() / layout.fractions],
            device,
        );
        let output = match self.head_weights(&zero) {
            Some(weights) => StaticOutput::Head(weights.into_data().iter::<f64>().collect()),
            None => StaticOutput::Reduce(self.reduce()),
        };
        static_part_matrix(
            (0..self.num_layers()).filter_map(|block| self.mixing(block)),
            layout,
            output,
            self.stream_width() / layout.fractions,
            &self.devices()[0],
        )
    }

    fn truncated(&self, depth: usize) -> Result<Self> {
        crate::error::check_depth(depth, 1, self.num_layers())?;
        Ok(self.first_layers(depth))
    }

    fn stream_width(&self) -> Option<usize> {
        Some(MultiStream::stream_width(self))
    }

    fn check_input(&self, dims: &[usize]) -> Result<()> {
        check_width(T::NAME, MultiStream::stream_width(self), dims)
    }
}

impl<T: MultiStream, const D: usize> StreamConnectivity<D> for T {
    type State = MultiStreamState<D>;

    fn start(&self, input: Tensor<D>) -> Self::State {
        let first = self.mixing(0).expect("at least one block");
        start(input, self.layout(), &first)
    }

    fn block_input(&self, state: &Self::State) -> Tensor<D> {
        block_input(state).unwrap_or_else(|| readout(self, state))
    }

    fn step(&self, state: Self::State, block: usize, branch: Tensor<D>) -> Self::State {
        step(state, branch, self.mixing(block + 1).as_ref())
    }

    fn step_with_tail(
        &self,
        state: Self::State,
        block: usize,
        branch: Tensor<D>,
        tail: impl FnOnce(Tensor<D>) -> Tensor<D>,
    ) -> Self::State {
        let branch = layer_branch(&state, branch, tail);
        StreamConnectivity::step(self, state, block, branch)
    }

    fn output(&self, state: &Self::State) -> Tensor<D> {
        readout(self, state)
    }
}
