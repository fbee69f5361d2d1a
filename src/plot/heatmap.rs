//! Matrices as PNG heatmaps with a colour bar: a connectivity matrix `C` or ANCRe's `p`.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::{FONT, plot_error, register_bundled_font, tick_label};
use crate::error::{Error, Result};
use crate::matrix::ConnectivityMatrix;

/// Viridis, sampled at 0, 0.25, 0.5, 0.75 and 1 and interpolated linearly.
const VIRIDIS: [(u8, u8, u8); 5] = [
    (68, 1, 84),
    (59, 82, 139),
    (33, 145, 140),
    (94, 201, 98),
    (253, 231, 37),
];

/// Colour of `t` in `[0, 1]`.
fn viridis(t: f64) -> RGBColor {
    let scaled = t.clamp(0.0, 1.0) * (VIRIDIS.len() - 1) as f64;
    let index = (scaled.floor() as usize).min(VIRIDIS.len() - 2);
    let fraction = scaled - index as f64;
    let mix =
        |a: u8, b: u8| (f64::from(a) + fraction * (f64::from(b) - f64::from(a))).round() as u8;
    let (low, high) = (VIRIDIS[index], VIRIDIS[index + 1]);
    RGBColor(mix(low.0, high.0), mix(low.1, high.1), mix(low.2, high.2))
}

/// Cells that are not drawn on the colour scale: structural zeros (`C[i][j]` for `i >= j`),
/// NaNs, and zeros on a log scale.
const BLANK: RGBColor = RGBColor(235, 235, 235);

/// A matrix drawn as coloured cells (row `i` from the top, column `j` from the left) with a
/// colour bar, optionally on a logarithmic scale as in the ANCRe paper's Fig. 6.
///
/// ```no_run
/// # use burn_connectivity::{ConnectivityMatrix, plot::Heatmap};
/// # fn show(c: &ConnectivityMatrix) -> burn_connectivity::Result<()> {
/// Heatmap::from_matrix("H-ACN, C", c).with_log_scale(true).write_png("c.png")
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Heatmap {
    title: String,
    x_label: String,
    y_label: String,
    column_names: Vec<String>,
    log_scale: bool,
    size: (u32, u32),
    values: Vec<Vec<f64>>,
}

impl Heatmap {
    /// `values[i][j]` drawn at row `i`, column `j`; NaN entries are left blank. Columns are
    /// labelled `0, 1, …`, axes "target" and "source".
    pub fn new(title: impl Into<String>, values: Vec<Vec<f64>>) -> Self {
        let columns = values.first().map_or(0, Vec::len);
        Self {
            title: title.into(),
            x_label: "target j".into(),
            y_label: "source i".into(),
            column_names: (0..columns).map(|j| j.to_string()).collect(),
            log_scale: false,
            size: (820, 700),
            values,
        }
    }

    /// The direct connectivity matrix (its strictly upper triangle: `C[i][j]` for `i < j`) and
    /// its output column, labelled `out`.
    pub fn from_matrix(title: impl Into<String>, matrix: &ConnectivityMatrix) -> Self {
        let values = matrix
            .matrix
            .iter()
            .enumerate()
            .map(|(i, row)| {
                let mut cells: Vec<f64> = row
                    .iter()
                    .enumerate()
                    .map(|(j, &value)| if i < j { value } else { f64::NAN })
                    .collect();
                cells.push(matrix.output[i]);
                cells
            })
            .collect();
        let mut heatmap = Self::new(title, values);
        if let Some(last) = heatmap.column_names.last_mut() {
            *last = "out".into();
        }
        heatmap
    }

    /// ANCRe's coefficients `p[i][j]` (`i < j`), e.g. from
    /// [`Ancre::coefficient_values`](crate::Ancre::coefficient_values).
    pub fn from_coefficients(title: impl Into<String>, p: &[Vec<f64>]) -> Self {
        let values = p
            .iter()
            .enumerate()
            .map(|(i, row)| {
                row.iter()
                    .enumerate()
                    .map(|(j, &value)| if i < j { value } else { f64::NAN })
                    .collect()
            })
            .collect();
        Self::new(title, values)
    }

    /// Axis labels (defaults: "target j", "source i").
    pub fn with_labels(mut self, x_label: impl Into<String>, y_label: impl Into<String>) -> Self {
        self.x_label = x_label.into();
        self.y_label = y_label.into();
        self
    }

    /// Logarithmic colour scale (zeros and negative values are left blank).
    pub fn with_log_scale(mut self, log_scale: bool) -> Self {
        self.log_scale = log_scale;
        self
    }

    /// Image size in pixels.
    pub fn with_size(mut self, width: u32, height: u32) -> Self {
        self.size = (width, height);
        self
    }

    /// Where `value` sits on the colour scale, `None` if it is not drawn.
    fn scale_position(&self, value: f64, (low, high): (f64, f64)) -> Option<f64> {
        let mapped = self.mapped(value)?;
        Some(if high > low {
            (mapped - low) / (high - low)
        } else {
            0.5
        })
    }

    /// `value` (or its log10 on a log scale), `None` if it is not drawn.
    fn mapped(&self, value: f64) -> Option<f64> {
        match (value.is_finite(), self.log_scale) {
            (false, _) => None,
            (true, true) if value <= 0.0 => None,
            (true, true) => Some(value.log10()),
            (true, false) => Some(value),
        }
    }

    /// Draws the heatmap into a PNG file.
    ///
    /// # Errors
    /// [`Error::Plot`] for an empty or ragged matrix, one without a drawable value, or a
    /// drawing failure; [`Error::Io`] for file errors.
    pub fn write_png(&self, path: impl AsRef<Path>) -> Result<()> {
        let rows = self.values.len();
        let columns = self.column_names.len();
        if rows == 0 || columns == 0 || self.values.iter().any(|row| row.len() != columns) {
            return Err(Error::Plot(format!(
                "`{}` needs a non-empty rectangular matrix",
                self.title
            )));
        }
        let mapped: Vec<f64> = self
            .values
            .iter()
            .flatten()
            .filter_map(|&value| self.mapped(value))
            .collect();
        let low = mapped.iter().copied().fold(f64::INFINITY, f64::min);
        let high = mapped.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if mapped.is_empty() {
            return Err(Error::Plot(format!(
                "`{}` has no drawable value",
                self.title
            )));
        }
        register_bundled_font()?;
        let root = BitMapBackend::new(path.as_ref(), self.size).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let (cells, bar) = root.split_horizontally(self.size.0.saturating_sub(130));
        self.draw_cells(&cells, (low, high))?;
        self.draw_colour_bar(&bar, (low, high))?;
        root.present().map_err(plot_error)
    }

    fn draw_cells(
        &self,
        area: &DrawingArea<BitMapBackend<'_>, Shift>,
        range: (f64, f64),
    ) -> Result<()> {
        let (rows, columns) = (self.values.len(), self.column_names.len());
        let mut chart = ChartBuilder::on(area)
            .caption(&self.title, (FONT, 22))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(55)
            .build_cartesian_2d(0.0..columns as f64, rows as f64..0.0)
            .map_err(plot_error)?;
        let names = &self.column_names;
        let column_label = |x: &f64| -> String {
            let index = x.floor() as usize;
            match names.get(index) {
                Some(name) if (x - index as f64 - 0.5).abs() < 1e-9 => name.clone(),
                _ => String::new(),
            }
        };
        let row_label = |y: &f64| {
            let index = y.floor();
            if (y - index - 0.5).abs() < 1e-9 {
                format!("{index}")
            } else {
                String::new()
            }
        };
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .label_style((FONT, 13))
            .x_labels(2 * columns + 1)
            .y_labels(2 * rows + 1)
            .x_label_formatter(&column_label)
            .y_label_formatter(&row_label)
            .draw()
            .map_err(plot_error)?;
        let annotate = rows * columns <= 144;
        for (i, row) in self.values.iter().enumerate() {
            for (j, &value) in row.iter().enumerate() {
                let position = self.scale_position(value, range);
                let colour = position.map_or(BLANK, viridis);
                let (x, y) = (j as f64, i as f64);
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(x, y), (x + 1.0, y + 1.0)],
                        colour.filled(),
                    )))
                    .map_err(plot_error)?;
                if annotate && value.is_finite() {
                    let light = position.is_some_and(|t| t < 0.6);
                    let ink = if light { WHITE } else { BLACK };
                    let style = TextStyle::from((FONT, 12).into_font()).color(&ink).pos(
                        plotters::style::text_anchor::Pos::new(
                            plotters::style::text_anchor::HPos::Center,
                            plotters::style::text_anchor::VPos::Center,
                        ),
                    );
                    chart
                        .draw_series(std::iter::once(Text::new(
                            tick_label(value),
                            (x + 0.5, y + 0.5),
                            style,
                        )))
                        .map_err(plot_error)?;
                }
            }
        }
        Ok(())
    }

    fn draw_colour_bar(
        &self,
        area: &DrawingArea<BitMapBackend<'_>, Shift>,
        (low, high): (f64, f64),
    ) -> Result<()> {
        let (low, high) = if high > low {
            (low, high)
        } else {
            (low - 0.5, high + 0.5)
        };
        let log = self.log_scale;
        let mut chart = ChartBuilder::on(area)
            .margin_top(60)
            .margin_bottom(60)
            .margin_right(10)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..1.0, low..high)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .disable_mesh()
            .disable_x_axis()
            .label_style((FONT, 13))
            .y_desc(if log { "value (log scale)" } else { "value" })
            .y_label_formatter(&|y| tick_label(if log { 10f64.powf(*y) } else { *y }))
            .draw()
            .map_err(plot_error)?;
        let steps = 100;
        let band = (high - low) / steps as f64;
        chart
            .draw_series((0..steps).map(|step| {
                let bottom = low + step as f64 * band;
                let colour = viridis((step as f64 + 0.5) / steps as f64);
                Rectangle::new([(0.0, bottom), (1.0, bottom + band)], colour.filled())
            }))
            .map_err(plot_error)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temporary_png(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!(
            "burn-connectivity-{name}-{}-{:?}.png",
            std::process::id(),
            std::thread::current().id()
        ))
    }

    #[test]
    fn viridis_runs_from_purple_to_yellow() {
        assert_eq!(viridis(0.0), RGBColor(68, 1, 84));
        assert_eq!(viridis(1.0), RGBColor(253, 231, 37));
        assert_eq!(viridis(0.5), RGBColor(33, 145, 140));
        assert_eq!(viridis(2.0), viridis(1.0));
    }

    #[test]
    fn connectivity_matrices_keep_the_upper_triangle_and_the_output() {
        let matrix = ConnectivityMatrix::new(
            vec![
                vec![0.0, 1.0, 0.5],
                vec![0.0, 0.0, 1.0],
                vec![0.0, 0.0, 0.0],
            ],
            vec![1.0, 1.0, 1.0],
        )
        .unwrap();
        let heatmap = Heatmap::from_matrix("C", &matrix);
        assert_eq!(heatmap.column_names, ["0", "1", "2", "out"]);
        assert_eq!(heatmap.values[0][1], 1.0);
        assert!(heatmap.values[1][1].is_nan());
        assert_eq!(heatmap.values[2][3], 1.0);
    }

    #[test]
    fn log_scale_leaves_zeros_blank() {
        let heatmap = Heatmap::new("p", vec![vec![0.0, 1e-3, 1.0]]).with_log_scale(true);
        assert_eq!(heatmap.scale_position(0.0, (-3.0, 0.0)), None);
        assert_eq!(heatmap.scale_position(1e-3, (-3.0, 0.0)), Some(0.0));
        assert_eq!(heatmap.scale_position(1.0, (-3.0, 0.0)), Some(1.0));
    }

    #[test]
    fn writes_a_png_and_rejects_bad_matrices() {
        let path = temporary_png("heatmap");
        let p = vec![
            vec![0.0, 1.0, 0.3, 0.01],
            vec![0.0, 0.0, 0.7, 0.19],
            vec![0.0, 0.0, 0.0, 0.8],
            vec![0.0; 4],
        ];
        Heatmap::from_coefficients("p", &p)
            .with_log_scale(true)
            .write_png(&path)
            .unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");

        let ragged = Heatmap::new("ragged", vec![vec![1.0, 2.0], vec![3.0]]);
        assert!(matches!(ragged.write_png(&path), Err(Error::Plot(_))));
        let blank = Heatmap::new("blank", vec![vec![0.0]]).with_log_scale(true);
        assert!(matches!(blank.write_png(&path), Err(Error::Plot(_))));
    }
}
