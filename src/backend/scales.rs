//! The scalars a connectivity multiplies its streams by, fetched so that each step stays one
//! kernel on CubeCL backends (scalar views of an aligned table, host scalars).

use burn::prelude::*;

/// The scalars a connectivity multiplies its streams by (gates, coefficients), a matrix of
/// them fetched once per forward pass.
///
/// The goal is one kernel per connectivity step on CubeCL backends, where fusion merges the
/// step's multiplications and additions into one kernel, provided that taking a scalar does
/// not launch a kernel of its own:
/// - no gradient flows to them (inference, frozen parameters): they are read back to the host
///   once, and a multiplication by a host scalar is a kernel argument;
/// - under a gradient on CubeCL: every used entry is taken once per pass as a `[1]` view of an
///   aligned table (one kernel per pass; `scale_entries.rs`), and its gradient reaches the
///   values as one elementwise kernel after Burn's reduction, whatever the stream's width;
/// - under a gradient elsewhere: each use selects its entry.
///
/// A slice at an unaligned offset is a copy kernel, and the formulation that fusion would
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
    /// The differentiable values as scalar views, entry `(r, c)` at
    /// `entries[r][c - used.first_column(r)]` (`[1]`). CubeCL devices only.
    #[cfg_attr(not(feature = "cube-kernels"), allow(dead_code))]
    Views {
        entries: Vec<Vec<Tensor<1>>>,
        used: UsedEntries,
    },
    /// The differentiable values as scalar views whose gradients are summed once per pass
    /// (`scale_entries::ScaleChain`): a caller whose every scaled stream leads to the next one's
    /// input. CubeCL devices under autodiff only.
    #[cfg(feature = "cube-kernels")]
    Chained {
        values: Box<Tensor<2>>,
        /// Every entry, row-major, as a constant `[1]` view.
        entries: Vec<Tensor<1>>,
        chain: super::scale_entries::ScaleChain,
        columns: usize,
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
    /// (a computed tensor does not report it itself).
    pub(crate) fn new(values: Tensor<2>, used: UsedEntries, tracked: bool) -> Self {
        let [rows, columns] = values.dims();
        if !tracked {
            let values = values.into_data().iter::<f64>().collect();
            return Self::Host { values, columns };
        }
        #[cfg(feature = "cube-kernels")]
        if super::is_cube(&values.device()) {
            let table = super::scale_entries::table(&values);
            let entries = (0..rows)
                .map(|row| {
                    (used.first_column(row).min(columns)..columns)
                        .map(|column| {
                            super::scale_entries::entry(
                                values.clone(),
                                table.clone(),
                                row * columns + column,
                            )
                        })
                        .collect()
                })
                .collect();
            return Self::Views { entries, used };
        }
        #[cfg(not(feature = "cube-kernels"))]
        let _ = used;
        let values = Box::new(values.reshape([rows * columns]));
        Self::Tracked { values, columns }
    }

    /// As [`new`](Self::new) with every entry used, for a caller whose every scaled stream
    /// leads to the input of every later one (H-ACN's gated stream): on a CubeCL device under
    /// a gradient, each scaled stream's backward is then one kernel, and the values' gradient is
    /// summed once per pass (`scale_entries::ScaleChain`).
    pub(crate) fn chained(values: Tensor<2>, tracked: bool) -> Self {
        #[cfg(feature = "cube-kernels")]
        if tracked && super::is_cube(&values.device()) && values.device().is_autodiff() {
            let [rows, columns] = values.dims();
            let table = super::scale_entries::table(&values);
            let entries = (0..rows * columns)
                .map(|k| super::scale_entries::constant_entry(&values, &table, k))
                .collect();
            return Self::Chained {
                entries,
                chain: super::scale_entries::ScaleChain::new(&values),
                values: Box::new(values),
                columns,
            };
        }
        Self::new(values, UsedEntries::All, tracked)
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
                selected_scale(values.as_ref().clone(), row * columns + column, value)
            }
            Self::Views { entries, used } => {
                let entry = entries[row][column - used.first_column(row)].clone();
                value * entry.reshape([1usize; D])
            }
            #[cfg(feature = "cube-kernels")]
            Self::Chained {
                values,
                entries,
                chain,
                columns,
            } => {
                let index = row * columns + column;
                let values = values.as_ref().clone();
                if !super::indexes_in_32_bits(value.shape().num_elements()) {
                    // Past the chain's kernel (32-bit indices): Burn's ops, as `Tracked`.
                    return selected_scale(values.reshape([-1]), index, value);
                }
                let entry = entries[index].clone();
                super::scale_entries::chained(chain, values, entry, index, value)
            }
        }
    }
}

/// `flat[index] · value`, the entry selected by Burn's ops (its gradient through the select).
fn selected_scale<const D: usize>(flat: Tensor<1>, index: usize, value: Tensor<D>) -> Tensor<D> {
    let position = Tensor::<1, Int>::from_data([index as i64], &flat.device());
    value * flat.select(0, position).reshape([1usize; D])
}
