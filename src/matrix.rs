//! The direct connectivity matrix, the common language of all connectivities.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The direct layer connectivity matrix `C` plus the output column (MATH §0, H-ACN eq. 3).
///
/// For a stack of `L` blocks with branch outputs `h_0 = x, h_1..h_L`:
/// * `matrix[i][j]` (row = source `h_i`, column = target block `j`) is the coefficient of `h_i`
///   in the input of block `j`: `s_{j-1} = Σ_{i<j} C[i][j] h_i`. Column 0 is all zero.
/// * `output[i]` is the coefficient of `h_i` in the stack's output `y`.
///
/// It serialises to JSON as `{"matrix": [[...], ...], "output": [...]}` and to CSV as one row
/// per source with a header `source,target_0..target_L,output`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConnectivityMatrix {
    /// `(L+1) x (L+1)`, rows are sources, columns are targets.
    pub matrix: Vec<Vec<f64>>,
    /// `L+1` output coefficients.
    pub output: Vec<f64>,
}

impl ConnectivityMatrix {
    /// Builds a matrix from its rows (sources) and the output column.
    ///
    /// # Errors
    /// [`Error::InvalidMatrix`] unless `matrix` is square with as many rows as `output` has
    /// entries, and at least `1 x 1`.
    pub fn new(matrix: Vec<Vec<f64>>, output: Vec<f64>) -> Result<Self> {
        let size = output.len();
        if size == 0 {
            return Err(Error::InvalidMatrix("the output column is empty".into()));
        }
        if matrix.len() != size {
            return Err(Error::InvalidMatrix(format!(
                "{} rows for an output column of {size} entries",
                matrix.len()
            )));
        }
        if let Some((i, row)) = matrix.iter().enumerate().find(|(_, row)| row.len() != size) {
            return Err(Error::InvalidMatrix(format!(
                "row {i} has {} entries, expected {size}",
                row.len()
            )));
        }
        Ok(Self { matrix, output })
    }

    /// Builds a matrix from its columns (targets) and the output column.
    ///
    /// # Errors
    /// As [`ConnectivityMatrix::new`].
    pub fn from_columns(columns: &[Vec<f64>], output: Vec<f64>) -> Result<Self> {
        if let Some((j, column)) = columns
            .iter()
            .enumerate()
            .find(|(_, column)| column.len() != output.len())
        {
            return Err(Error::InvalidMatrix(format!(
                "column {j} has {} entries, expected {}",
                column.len(),
                output.len()
            )));
        }
        let rows = (0..output.len())
            .map(|i| columns.iter().map(|column| column[i]).collect())
            .collect();
        Self::new(rows, output)
    }

    /// The connectivity of a stack whose states mix earlier states with fixed coefficients,
    /// `s_j = h_j + Σ_{i<j} a[i][j] s_i`, with output `s_L` (`a` is `(L+1) x (L+1)`, entries
    /// `i >= j` ignored).
    ///
    /// Expanding the recursion, `coef(s_j) = e_j + Σ_{i<j} a[i][j] coef(s_i)`, so
    /// `C[:, j] = coef(s_{j-1})` and `out = coef(s_L)`.
    ///
    /// # Errors
    /// [`Error::InvalidMatrix`] unless `a` is square and at least `1 x 1`.
    pub fn from_stream_mixture(a: &[Vec<f64>]) -> Result<Self> {
        let size = a.len();
        if size == 0 || a.iter().any(|row| row.len() != size) {
            return Err(Error::InvalidMatrix(format!(
                "mixture coefficients must be square and non-empty, got {size} rows"
            )));
        }
        let mut states: Vec<Vec<f64>> = Vec::with_capacity(size);
        for j in 0..size {
            let mut coef = vec![0.0; size];
            coef[j] = 1.0;
            for (earlier, source) in states.iter().zip(a) {
                for (value, contribution) in coef.iter_mut().zip(earlier) {
                    *value += source[j] * contribution;
                }
            }
            states.push(coef);
        }
        let output = states.pop().unwrap_or_default();
        let mut columns = vec![vec![0.0; size]];
        columns.extend(states);
        Self::from_columns(&columns, output)
    }

    /// Number of blocks `L` (the matrix is `(L+1) x (L+1)`).
    pub fn num_blocks(&self) -> usize {
        self.output.len() - 1
    }

    /// Largest absolute entry-wise difference to `other` (matrix and output column), or
    /// infinity when the sizes differ.
    pub fn max_abs_diff(&self, other: &Self) -> f64 {
        if self.output.len() != other.output.len() {
            return f64::INFINITY;
        }
        let matrix = self
            .matrix
            .iter()
            .flatten()
            .zip(other.matrix.iter().flatten());
        let output = self.output.iter().zip(&other.output);
        matrix
            .chain(output)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max)
    }

    /// The matrix as pretty-printed JSON.
    ///
    /// # Errors
    /// [`Error::Json`] if serialisation fails (it does not for finite values).
    pub fn to_json(&self) -> Result<String> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    /// Parses a matrix written by [`ConnectivityMatrix::to_json`] and validates its shape.
    ///
    /// # Errors
    /// [`Error::Json`] for malformed JSON, [`Error::InvalidMatrix`] for inconsistent sizes.
    pub fn from_json(json: &str) -> Result<Self> {
        let parsed: Self = serde_json::from_str(json)?;
        Self::new(parsed.matrix, parsed.output)
    }

    /// The matrix as CSV: a header `source,target_0,…,target_L,output`, then one row per
    /// source `h_i`.
    pub fn to_csv(&self) -> String {
        let size = self.output.len();
        let mut csv = String::from("source");
        for j in 0..size {
            let _ = write!(csv, ",target_{j}");
        }
        csv.push_str(",output\n");
        for (i, row) in self.matrix.iter().enumerate() {
            let _ = write!(csv, "h_{i}");
            for value in row.iter().chain([&self.output[i]]) {
                let _ = write!(csv, ",{value}");
            }
            csv.push('\n');
        }
        csv
    }

    /// Writes [`ConnectivityMatrix::to_json`] to `path`.
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::Json`].
    pub fn write_json(&self, path: impl AsRef<Path>) -> Result<()> {
        Ok(std::fs::write(path, self.to_json()?)?)
    }

    /// Writes [`ConnectivityMatrix::to_csv`] to `path`.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn write_csv(&self, path: impl AsRef<Path>) -> Result<()> {
        Ok(std::fs::write(path, self.to_csv())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ConnectivityMatrix {
        ConnectivityMatrix::new(
            vec![
                vec![0.0, 1.0, 0.5],
                vec![0.0, 0.0, 1.0],
                vec![0.0, 0.0, 0.0],
            ],
            vec![1.0, 1.0, 1.0],
        )
        .unwrap()
    }

    #[test]
    fn json_round_trip_is_exact() {
        let matrix = sample();
        let parsed = ConnectivityMatrix::from_json(&matrix.to_json().unwrap()).unwrap();
        assert_eq!(parsed, matrix);
        assert_eq!(parsed.num_blocks(), 2);
    }

    #[test]
    fn csv_has_a_header_and_one_row_per_source() {
        let csv = sample().to_csv();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines[0], "source,target_0,target_1,target_2,output");
        assert_eq!(lines[1], "h_0,0,1,0.5,1");
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn columns_are_transposed_into_rows() {
        let columns = vec![
            vec![0.0, 0.0, 0.0],
            vec![1.0, 0.0, 0.0],
            vec![0.5, 1.0, 0.0],
        ];
        let matrix = ConnectivityMatrix::from_columns(&columns, vec![1.0; 3]).unwrap();
        assert_eq!(matrix, sample());
    }

    #[test]
    fn residual_mixture_is_the_all_ones_upper_triangle() {
        let size = 4;
        let residual: Vec<Vec<f64>> = (0..size)
            .map(|i| {
                (0..size)
                    .map(|j| if i + 1 == j { 1.0 } else { 0.0 })
                    .collect()
            })
            .collect();
        let matrix = ConnectivityMatrix::from_stream_mixture(&residual).unwrap();
        for (i, row) in matrix.matrix.iter().enumerate() {
            for (j, value) in row.iter().enumerate() {
                assert_eq!(*value, if i < j { 1.0 } else { 0.0 });
            }
        }
        assert_eq!(matrix.output, vec![1.0; size]);
        assert!(ConnectivityMatrix::from_stream_mixture(&[]).is_err());
        assert!(ConnectivityMatrix::from_stream_mixture(&[vec![0.0; 2]]).is_err());
    }

    #[test]
    fn inconsistent_sizes_are_errors() {
        assert!(matches!(
            ConnectivityMatrix::new(vec![vec![0.0; 2]; 3], vec![1.0; 3]),
            Err(Error::InvalidMatrix(_))
        ));
        assert!(matches!(
            ConnectivityMatrix::new(vec![], vec![]),
            Err(Error::InvalidMatrix(_))
        ));
        assert!(matches!(
            ConnectivityMatrix::from_json(r#"{"matrix": [[0.0]], "output": [1.0, 1.0]}"#),
            Err(Error::InvalidMatrix(_))
        ));
        assert!(matches!(
            ConnectivityMatrix::from_json("{"),
            Err(Error::Json(_))
        ));
    }
}
