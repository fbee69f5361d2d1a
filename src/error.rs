//! The crate's error type.

use thiserror::Error;

/// Everything that can go wrong when building or inspecting a connected stack.
///
/// Constructors and config `init`s validate their input and return this error instead of
/// panicking; forward passes follow Burn's convention and only panic on tensor shape errors.
#[derive(Debug, Error)]
pub enum Error {
    /// A stack (or a connectivity) needs at least one block.
    #[error("a stack needs at least one block, got none")]
    NoBlocks,

    /// The connectivity was built for a different number of blocks than the stack holds.
    #[error("the connectivity is built for {connectivity} blocks but the stack holds {blocks}")]
    BlockCountMismatch {
        /// Blocks the connectivity expects.
        connectivity: usize,
        /// Blocks in the stack.
        blocks: usize,
    },

    /// Explicit per-block values (gates, depths…) do not match the number of blocks.
    #[error("{name} has {found} values but the stack has {expected} blocks")]
    CountMismatch {
        /// What was counted.
        name: &'static str,
        /// Number of blocks.
        expected: usize,
        /// Number of values given.
        found: usize,
    },

    /// A configuration value is NaN or infinite.
    #[error("{name} must be finite, got {value}")]
    NonFinite {
        /// The offending setting.
        name: &'static str,
        /// Its value.
        value: f64,
    },

    /// A configuration value is outside its valid range.
    #[error("{name} must be {requirement}, got {value}")]
    OutOfRange {
        /// The offending setting.
        name: &'static str,
        /// Its value.
        value: f64,
        /// The rule it breaks, e.g. `">= 0"`.
        requirement: &'static str,
    },

    /// Two widths (feature sizes) that must agree do not.
    #[error("{name}: expected width {expected}, found {found}")]
    WidthMismatch {
        /// Where the mismatch was found.
        name: String,
        /// The width required there.
        expected: usize,
        /// The width found.
        found: usize,
    },

    /// A tensor (an input or a mask) whose shape does not fit the model.
    #[error("{name}: expected shape {expected:?}, found {found:?}")]
    ShapeMismatch {
        /// What has the wrong shape.
        name: String,
        /// The shape required.
        expected: Vec<usize>,
        /// The shape found.
        found: Vec<usize>,
    },

    /// A saved record that does not fit the module it is loaded into.
    #[error("cannot load the record: {0}")]
    Record(String),

    /// A depth (number of blocks to keep or run) outside `min..=blocks`.
    #[error(
        "depth {depth} is out of range for a stack of {blocks} blocks (valid: {min}..={blocks})"
    )]
    DepthOutOfRange {
        /// The depth asked for.
        depth: usize,
        /// The smallest valid depth.
        min: usize,
        /// Blocks in the stack.
        blocks: usize,
    },

    /// A connectivity matrix whose parts do not fit together.
    #[error("invalid connectivity matrix: {0}")]
    InvalidMatrix(String),

    /// A backend name that is unknown or not compiled in.
    #[error("backend `{name}` is not available: {reason} (compiled in: {available})")]
    Backend {
        /// The name asked for.
        name: String,
        /// Why it cannot be used.
        reason: String,
        /// The backends this build can use, comma separated.
        available: String,
    },

    /// burn-optim refused a learning-rate schedule.
    #[error("invalid learning-rate schedule: {0}")]
    Schedule(String),

    /// Drawing a chart failed (feature `plot`).
    #[error("plotting failed: {0}")]
    Plot(String),

    /// Reading or writing a file failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),

    /// JSON (de)serialisation failed.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Rejects NaN and infinities.
pub(crate) fn check_finite(name: &'static str, value: f64) -> Result<()> {
    if value.is_finite() {
        Ok(())
    } else {
        Err(Error::NonFinite { name, value })
    }
}

/// Rejects non-finite and negative values.
pub(crate) fn check_non_negative(name: &'static str, value: f64) -> Result<()> {
    check_finite(name, value)?;
    if value < 0.0 {
        return Err(Error::OutOfRange {
            name,
            value,
            requirement: ">= 0",
        });
    }
    Ok(())
}

/// Rejects non-finite and non-positive values.
pub(crate) fn check_positive(name: &'static str, value: f64) -> Result<()> {
    check_finite(name, value)?;
    if value <= 0.0 {
        return Err(Error::OutOfRange {
            name,
            value,
            requirement: "> 0",
        });
    }
    Ok(())
}

/// Checks that a probability lies in `[0, 1)`.
pub(crate) fn check_probability(name: &'static str, value: f64) -> Result<()> {
    check_non_negative(name, value)?;
    if value >= 1.0 {
        return Err(Error::OutOfRange {
            name,
            value,
            requirement: "in [0, 1)",
        });
    }
    Ok(())
}

/// Rejects zero sizes.
pub(crate) fn check_size(name: &'static str, value: usize) -> Result<()> {
    if value == 0 {
        return Err(Error::OutOfRange {
            name,
            value: 0.0,
            requirement: ">= 1",
        });
    }
    Ok(())
}

/// Checks a depth against `min..=blocks`.
pub(crate) fn check_depth(depth: usize, min: usize, blocks: usize) -> Result<()> {
    if depth < min || depth > blocks {
        return Err(Error::DepthOutOfRange { depth, min, blocks });
    }
    Ok(())
}
