//! The family-agnostic connectivity abstraction.
//!
//! A connectivity decides, for a stack of branches `f_1..f_L`, what each block reads and what
//! the stack outputs (SPEC §0): with `s_0 = x` and `h_j = f_j(s_{j-1})`, it maps the branch
//! outputs seen so far to the next block input `s_j` and to the output `y`. It is written as a
//! state machine whose state is passed by value:
//!
//! ```text
//! state = start(x)
//! for j in 0..L:  state = step(state, j, f_j(block_input(&state)))
//! y = output(&state)
//! ```
//!
//! `output` after `k` steps is the layer-wise readout `y_k`: the output of the model truncated
//! to its first `k` blocks.

use burn::module::{ModuleDisplay, Param};
use burn::prelude::*;

use crate::backend::is_cube;
use crate::error::Result;
use crate::matrix::ConnectivityMatrix;

/// What every connectivity offers, whatever the rank of the tensors it wires.
pub trait Connectivity: Module + ModuleDisplay {
    /// Number of blocks this connectivity wires.
    fn num_blocks(&self) -> usize;

    /// The direct connectivity matrix `C` and the output column (SPEC §0).
    ///
    /// This reads parameters back from the device.
    fn matrix(&self) -> ConnectivityMatrix;

    /// The same connectivity restricted to the first `depth` blocks, such that a stack of those
    /// blocks outputs the readout `y_depth` of the full one.
    ///
    /// # Errors
    /// [`Error::DepthOutOfRange`](crate::Error::DepthOutOfRange) unless `1 <= depth <= num_blocks()`.
    fn truncated(&self, depth: usize) -> Result<Self>
    where
        Self: Sized;

    /// Checks the shape of a stack input (`dims` of the tensor), for connectivities with
    /// parameters of a fixed width or length. Accepts everything by default.
    ///
    /// # Errors
    /// An [`Error`](crate::Error) describing the mismatch.
    fn check_input(&self, dims: &[usize]) -> Result<()> {
        let _ = dims;
        Ok(())
    }
}

/// How a connectivity propagates rank-`D` streams through the blocks.
pub trait StreamConnectivity<const D: usize>: Connectivity {
    /// What the connectivity keeps between blocks (the running stream, accumulators…).
    type State;

    /// The state before the first block, from the input `x = s_0`.
    fn start(&self, input: Tensor<D>) -> Self::State;

    /// The input of the next block, `s_j`.
    fn block_input(&self, state: &Self::State) -> Tensor<D>;

    /// Takes in the output `branch = h_{block+1}` of block number `block` (0-based), for a
    /// block whose layer goes on after the connectivity has combined the branch with its
    /// shortcut: the next stream is `s_{block+1} = tail(combined)`, where `combined` is what the
    /// connectivity alone would make the next stream.
    ///
    /// Blocks are stepped in order, `block = 0, 1, …, num_blocks() - 1`; implementations may
    /// panic otherwise.
    ///
    /// The tail is how a transformer layer keeps part of its own wiring: at ANCRe's block level
    /// the mixture replaces the attention shortcut and the feed-forward then adds its own
    /// residual (`tail(a) = a + FFN(LN(a))`); a post-norm layer normalises the sum
    /// (`tail = LN`). Connectivities whose output is not the stream credit the block with
    /// `s_j − shortcut`, the part of the new stream the shortcut did not carry, which is
    /// `branch` when `tail` is the identity.
    fn step_with_tail(
        &self,
        state: Self::State,
        block: usize,
        branch: Tensor<D>,
        tail: impl FnOnce(Tensor<D>) -> Tensor<D>,
    ) -> Self::State;

    /// [`step_with_tail`](Self::step_with_tail) with the identity tail: the plain recursion
    /// `s_{block+1} = combine(branch, shortcut)`.
    fn step(&self, state: Self::State, block: usize, branch: Tensor<D>) -> Self::State {
        self.step_with_tail(state, block, branch, |stream| stream)
    }

    /// The output of the stack so far: `y_k` after `k` steps, `y` after all of them.
    fn output(&self, state: &Self::State) -> Tensor<D>;
}

/// A config that builds a connectivity for a given number of blocks.
pub trait ConnectivityConfig {
    /// The connectivity it builds.
    type Connectivity: Connectivity;

    /// Builds the connectivity for `num_blocks` blocks on `device`.
    ///
    /// # Errors
    /// Invalid settings, or settings that do not fit `num_blocks`.
    fn init(&self, num_blocks: usize, device: &Device) -> Result<Self::Connectivity>;
}

/// The first `length` entries along every axis of `param`, as a fresh leaf that keeps the
/// parameter's trainability: the parameters of a truncated connectivity.
pub(crate) fn leading_part<const D: usize>(
    param: &Param<Tensor<D>>,
    length: usize,
) -> Param<Tensor<D>> {
    param.clone().map(|tensor| {
        let trainable = tensor.is_require_grad();
        let part = (0..D).fold(tensor, |part, axis| part.narrow(axis, 0, length));
        part.detach().set_require_grad(trainable)
    })
}

/// Tracked scales become entries of a table on CubeCL backends when the stream's width spans
/// a multiple of this many bytes: the buffer offset alignment of every CubeCL runtime (256 on
/// wgpu, 512 on CUDA), so that each entry is a view of the table rather than a copy.
const ALIGNED_ROW_BYTES: usize = 512;

/// The scalars a connectivity multiplies its streams by (gates, coefficients), a matrix of
/// them fetched once per forward pass.
///
/// The goal is one kernel per connectivity step on CubeCL backends, where fusion merges the
/// step's multiplications and additions into one kernel, provided that taking a scalar does
/// not launch a kernel of its own:
/// - no gradient flows to them (inference, frozen parameters): they are read back to the host
///   once, and a multiplication by a host scalar is a kernel argument;
/// - under a gradient on CubeCL, with streams whose last axis spans a multiple of
///   [`ALIGNED_ROW_BYTES`]: value `(r, c)` is repeated along the last axis of a
///   `[rows, columns, width]` table (one kernel per pass), every used entry is taken once per
///   pass as a view, and a stream is multiplied by its entry broadcast over the leading axes;
/// - under a gradient otherwise: each use selects its entry, a kernel of its own on CubeCL.
///
/// A slice at an unaligned offset is also a copy kernel, and the formulation that fusion would
/// absorb, a `gather` with a broadcast output, gives wrong values in burn-cubecl-fusion 0.22.1
/// (see the `kernel_counts` example).
#[derive(Debug, Clone)]
pub(crate) enum Scales {
    /// Values read back from the device, row-major.
    Host { values: Vec<f64>, columns: usize },
    /// The differentiable values, row-major (boxed: a tensor handle is much larger than a `Vec`).
    Tracked {
        values: Box<Tensor<1>>,
        columns: usize,
    },
    /// The differentiable values, value `(r, c)` repeated along
    /// `entries[r][c - used.first_column(r)]` (`[1, 1, width]`).
    AlignedEntries {
        entries: Vec<Vec<Tensor<3>>>,
        used: UsedEntries,
    },
}

/// Which entries of a [`Scales`] matrix a connectivity multiplies by: only those are taken
/// out of the table, each taken view costing host time on every pass.
#[derive(Debug, Clone, Copy)]
pub(crate) enum UsedEntries {
    /// Every entry (the gates of H-ACN, one row).
    All,
    /// The entries right of the diagonal (ANCRe's shortcuts `i -> j`, `i < j`).
    AboveDiagonal,
}

impl UsedEntries {
    fn first_column(self, row: usize) -> usize {
        match self {
            Self::All => 0,
            Self::AboveDiagonal => row + 1,
        }
    }
}

impl Scales {
    /// `values`: `[rows, columns]`, of which `used` will scale streams. `tracked`: whether a
    /// gradient flows to them, i.e. whether the parameters they are computed from require one
    /// (a computed tensor does not report it itself). `width`: the size of the last axis of the
    /// streams they will scale.
    pub(crate) fn new(values: Tensor<2>, used: UsedEntries, tracked: bool, width: usize) -> Self {
        let [rows, columns] = values.dims();
        if !tracked {
            let values = values.into_data().iter::<f64>().collect();
            return Self::Host { values, columns };
        }
        let row_bytes = width * values.dtype().size();
        if !is_cube(&values.device()) || !row_bytes.is_multiple_of(ALIGNED_ROW_BYTES) {
            let values = Box::new(values.reshape([rows * columns]));
            return Self::Tracked { values, columns };
        }
        // The product materialises the table: entries of a broadcast view would not be aligned.
        let table = values
            .reshape([rows, columns, 1])
            .expand([rows, columns, width])
            * 1.0;
        // The gradient of a view is as large as the tensor it is taken from: taking entries
        // from their row rather than from the whole table keeps the backward pass small.
        let entries = table
            .chunk(rows, 0)
            .into_iter()
            .enumerate()
            .map(|(row, row_table)| {
                let first = used.first_column(row).min(columns);
                let count = columns - first;
                if count == 0 {
                    Vec::new()
                } else {
                    row_table.narrow(1, first, count).chunk(count, 1)
                }
            })
            .collect();
        Self::AlignedEntries { entries, used }
    }

    /// `values[row][column] · value`.
    pub(crate) fn scale<const D: usize>(
        &self,
        row: usize,
        column: usize,
        value: Tensor<D>,
    ) -> Tensor<D> {
        match self {
            Self::Host { values, columns } => value * values[row * columns + column],
            Self::Tracked { values, columns } => {
                let index = (row * columns + column) as i64;
                let position = Tensor::<1, Int>::from_data([index], &values.device());
                let entry = values.as_ref().clone().select(0, position);
                value * entry.reshape([1usize; D])
            }
            Self::AlignedEntries { entries, used } => {
                let entry = entries[row][column - used.first_column(row)].clone();
                let mut dims = [1usize; D];
                dims[D - 1] = entry.dims()[2];
                value * entry.reshape(dims)
            }
        }
    }
}

/// Computes `C` and the output column by running the connectivity's own recursion on basis
/// vectors.
///
/// Valid for connectivities that are linear in the branch outputs with data-independent
/// coefficients (H-ACN, ANCRe): feeding `x = e_0` and `h_j = e_j` makes `block_input` before
/// block `j` the coefficient vector of `s_{j-1}` over `h_0..h_L`, i.e. column `j` of `C`.
/// Closed-form implementations of [`Connectivity::matrix`] are tested against it.
///
/// # Errors
/// [`Error::InvalidMatrix`](crate::Error::InvalidMatrix) if the connectivity's states do not
/// keep the width of the basis vectors.
pub fn probe_matrix<C: StreamConnectivity<2>>(
    connectivity: &C,
    device: &Device,
) -> Result<ConnectivityMatrix> {
    let size = connectivity.num_blocks() + 1;
    let basis = Tensor::<2>::eye(size, device);
    let row = |i: usize| basis.clone().narrow(0, i, 1);
    let values = |tensor: Tensor<2>| -> Vec<f64> { tensor.into_data().iter::<f64>().collect() };

    let mut columns = vec![vec![0.0; size]];
    let mut state = connectivity.start(row(0));
    for block in 0..connectivity.num_blocks() {
        columns.push(values(connectivity.block_input(&state)));
        state = connectivity.step(state, block, row(block + 1));
    }
    let output = values(connectivity.output(&state));
    ConnectivityMatrix::from_columns(&columns, output)
}
