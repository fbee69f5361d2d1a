//! PNG charts (cargo feature `plot`): curves such as loss vs step or accuracy vs depth
//! ([`LineChart`]), and matrices such as `C` or ANCRe's `p` ([`Heatmap`]).
//!
//! Text is drawn with the bundled DejaVu Sans, so no system font library is needed.

mod heatmap;

pub use heatmap::Heatmap;

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use crate::error::{Error, Result};

const FONT: &str = "sans-serif";

fn register_bundled_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let registered = *REGISTERED.get_or_init(|| {
        register_font(
            FONT,
            FontStyle::Normal,
            include_bytes!("../assets/DejaVuSans.ttf"),
        )
        .is_ok()
    });
    if registered {
        Ok(())
    } else {
        Err(Error::Plot("the bundled font did not load".into()))
    }
}

/// Short tick labels: `200`, `0.25`, `1e-6`.
fn tick_label(value: f64) -> String {
    let magnitude = value.abs();
    if value == 0.0 {
        "0".to_string()
    } else if !(1e-3..1e5).contains(&magnitude) {
        let text = format!("{value:.0e}");
        if text
            .parse::<f64>()
            .is_ok_and(|rounded| (rounded - value).abs() <= 1e-9 * magnitude)
        {
            text
        } else {
            format!("{value:.1e}")
        }
    } else {
        let text = format!("{value:.3}");
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn plot_error(err: impl std::fmt::Display) -> Error {
    Error::Plot(err.to_string())
}

/// One named curve of `(x, y)` points.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend entry.
    pub name: String,
    /// The points, in drawing order.
    pub points: Vec<(f64, f64)>,
}

impl Series {
    /// A curve called `name`.
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.into(),
            points,
        }
    }
}

/// A line chart with several curves, a legend and optionally a logarithmic y axis.
#[derive(Debug, Clone)]
pub struct LineChart {
    title: String,
    x_label: String,
    y_label: String,
    log_y: bool,
    size: (u32, u32),
    series: Vec<Series>,
}

impl LineChart {
    /// An empty chart titled `title`, 900 x 600 pixels, linear axes.
    pub fn new(title: impl Into<String>) -> Self {
        Self {
            title: title.into(),
            x_label: String::new(),
            y_label: String::new(),
            log_y: false,
            size: (900, 600),
            series: Vec::new(),
        }
    }

    /// Axis labels.
    pub fn with_labels(mut self, x_label: impl Into<String>, y_label: impl Into<String>) -> Self {
        self.x_label = x_label.into();
        self.y_label = y_label.into();
        self
    }

    /// Logarithmic y axis (points with `y <= 0` are left out).
    pub fn with_log_y(mut self, log_y: bool) -> Self {
        self.log_y = log_y;
        self
    }

    /// Image size in pixels.
    pub fn with_size(mut self, width: u32, height: u32) -> Self {
        self.size = (width, height);
        self
    }

    /// Adds a curve.
    pub fn with_series(mut self, series: Series) -> Self {
        self.series.push(series);
        self
    }

    fn drawable_points(&self, series: &Series) -> Vec<(f64, f64)> {
        let usable =
            |&&(x, y): &&(f64, f64)| x.is_finite() && y.is_finite() && (!self.log_y || y > 0.0);
        series.points.iter().filter(usable).copied().collect()
    }

    /// Draws the chart into a PNG file.
    ///
    /// # Errors
    /// [`Error::Plot`] when there is nothing to draw or drawing fails, [`Error::Io`] for
    /// file errors.
    pub fn write_png(&self, path: impl AsRef<Path>) -> Result<()> {
        register_bundled_font()?;
        let curves: Vec<(&Series, Vec<(f64, f64)>)> = self
            .series
            .iter()
            .map(|series| (series, self.drawable_points(series)))
            .collect();
        let all = curves.iter().flat_map(|(_, points)| points);
        let (mut x_min, mut x_max, mut y_min, mut y_max) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(x, y) in all {
            (x_min, x_max, y_min, y_max) = (x_min.min(x), x_max.max(x), y_min.min(y), y_max.max(y));
        }
        if x_min > x_max {
            return Err(Error::Plot(format!(
                "`{}` has no drawable point",
                self.title
            )));
        }
        if x_min == x_max {
            (x_min, x_max) = (x_min - 0.5, x_max + 0.5);
        }
        if y_min == y_max {
            let pad = if y_min == 0.0 { 1.0 } else { y_min.abs() * 0.1 };
            (y_min, y_max) = (y_min - pad, y_max + pad);
        }

        let root = BitMapBackend::new(path.as_ref(), self.size).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        if self.log_y {
            self.draw(&root, x_min..x_max, (y_min..y_max).log_scale(), &curves)?;
        } else {
            self.draw(&root, x_min..x_max, y_min..y_max, &curves)?;
        }
        root.present().map_err(plot_error)
    }

    fn draw<Y>(
        &self,
        root: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
        x_range: std::ops::Range<f64>,
        y_axis: Y,
        curves: &[(&Series, Vec<(f64, f64)>)],
    ) -> Result<()>
    where
        Y: AsRangedCoord<Value = f64>,
        Y::CoordDescType: ValueFormatter<f64>,
    {
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, (FONT, 24))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(80)
            .build_cartesian_2d(x_range, y_axis)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .label_style((FONT, 14))
            .x_label_formatter(&|x| tick_label(*x))
            .y_label_formatter(&|y| tick_label(*y))
            .draw()
            .map_err(plot_error)?;
        for (index, (series, points)) in curves.iter().enumerate() {
            let style = Palette99::pick(index).stroke_width(2);
            chart
                .draw_series(LineSeries::new(points.clone(), style))
                .map_err(plot_error)?
                .label(series.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FONT, 16))
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(plot_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(tick_label(200.0), "200");
        assert_eq!(tick_label(0.25), "0.25");
        assert_eq!(tick_label(1e-6), "1e-6");
        assert_eq!(tick_label(0.0), "0");
        assert_eq!(tick_label(2.5e-7), "2.5e-7");
    }

    #[test]
    fn writes_a_png_and_rejects_an_empty_chart() {
        let path = std::env::temp_dir().join(format!(
            "burn-connectivity-chart-{}.png",
            std::process::id()
        ));
        let chart = LineChart::new("test")
            .with_labels("x", "y")
            .with_log_y(true)
            .with_series(Series::new("a", vec![(0.0, 1.0), (1.0, 0.1), (2.0, 0.0)]));
        chart.write_png(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let empty = LineChart::new("empty")
            .with_log_y(true)
            .with_series(Series::new("zero", vec![(0.0, 0.0)]));
        assert!(matches!(empty.write_png(&path), Err(Error::Plot(_))));
    }
}
