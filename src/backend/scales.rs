//! The scalars a connectivity multiplies its streams by, fetched so that each step stays one
//! kernel on CubeCL backends (buffer alignment, host scalars).

use burn::prelude::*;

use super::is_cube;

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
/// (see the `kernel_counts` tool).
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
    /// Every entry (one gate per block, say: a single row).
    All,
    /// The entries right of the diagonal (shortcuts `i -> j` with `i < j`).
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
