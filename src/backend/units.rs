//! The ops of the multi-stream connectivities on their `[tokens, U, w]` units: the normalised
//! projection that starts token-dependent connections and the mixing `Aᵀ S (+ β h)`. Fused with
//! their own backward on Flex (`normed_projection.rs`, `stream_mix.rs`) and on the CubeCL
//! backends (`unit_kernels.rs`), tensor ops elsewhere; which form is chosen once per forward
//! pass ([`UnitOps::for_units`]).

use burn::prelude::*;

use super::UnitsGradient;

/// The row scale `s(n) = a / max(√(n² + c) + b, f)` of a row of norm `n`, in
/// [`LayerOps::normed_projection`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RowScale {
    /// `a`.
    pub numerator: f64,
    /// `b`.
    pub offset: f64,
    /// `f`.
    pub floor: f64,
    /// `c` (an RMS norm's `ε` inside the root: `1/sqrt(n²/N + ε)` is `a = √N, c = Nε`). The
    /// gated connection table's kernels (HC's row scale) take `c = 0` only.
    pub root_offset: f64,
}

impl RowScale {
    /// The RMS normalisation's `1 / sqrt(n²/N + ε)` for rows of `N` entries (`a = √N, c = Nε`).
    pub(crate) fn rms(entries: usize, epsilon: f64) -> Self {
        let entries = entries as f64;
        Self {
            numerator: entries.sqrt(),
            offset: 0.0,
            floor: 0.0,
            root_offset: entries * epsilon,
        }
    }
}

/// `rms(x_r) W` for the rows of `state [..., w]` and `weights [w, C]`, `rms(x) = x /
/// sqrt(mean(x²) + ε)`; `[..., C]`: the normalised projection with the RMS scale, one fused op
/// each way on Flex (f32, f64) and on the CubeCL backends, tensor ops elsewhere.
pub(crate) fn rms_projection<const D: usize>(
    state: Tensor<D>,
    weights: Tensor<2>,
    epsilon: f64,
) -> Tensor<D> {
    rms_projection_writing(state, weights, epsilon, None)
}

/// [`rms_projection`] whose backward, where fused, writes the whole gradient of `state`: on
/// Flex it claims `gradient` (from [`state_gradient`](super::state_gradient)), in which the
/// token mixes over that state leave their terms (see [`UnitsGradient`]); on the CubeCL
/// backends it adds its term to the state's gradient so far in its kernel.
pub(crate) fn rms_projection_writing<const D: usize>(
    state: Tensor<D>,
    weights: Tensor<2>,
    epsilon: f64,
    gradient: Option<&UnitsGradient>,
) -> Tensor<D> {
    let scale = RowScale::rms(state.dims()[D - 1], epsilon);
    #[cfg(feature = "cube-kernels")]
    if super::cube_kernels_take(&state) && super::unit_kernels::projects(&state, &weights) {
        // The state itself, not its reshape, so that the backward finds its gradient so far.
        return super::unit_kernels::state_projection(state, weights, scale);
    }
    super::on_rows(state, |rows| {
        let [count, width] = rows.dims();
        let mut ops = LayerOps::standalone(&rows.clone().reshape([count, 1, width]));
        ops.gradient = gradient.cloned();
        ops.normed_projection(rows, weights, scale)
    })
}

/// How one forward pass runs its unit ops, chosen from its first units: every layer of the pass
/// then uses the same form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UnitOps {
    /// The fused Flex ops; `autodiff`: whether a layer's ops share one gradient slot for its
    /// units. Never chosen in a build without `flex`.
    #[cfg_attr(not(feature = "flex"), allow(dead_code))]
    Fused { autodiff: bool },
    /// The CubeCL kernels, each with its own backward. Never chosen in a build without
    /// `cube-kernels`.
    #[cfg_attr(not(feature = "cube-kernels"), allow(dead_code))]
    Kernels,
    /// Tensor ops.
    Composed,
}

impl UnitOps {
    /// The fused ops where the device has them (Flex, f32 or f64; CubeCL devices, up to
    /// `unit_kernels::MAX_UNITS` units), else the composed ones.
    pub(crate) fn for_units(units: &Tensor<3>) -> Self {
        #[cfg(feature = "flex")]
        if super::has_fused_flex_ops(units) {
            return Self::Fused {
                autodiff: units.device().is_autodiff(),
            };
        }
        #[cfg(feature = "cube-kernels")]
        if super::unit_kernels::supports(units) {
            return Self::Kernels;
        }
        let _ = units;
        Self::Composed
    }

    /// The ops of one layer: under autodiff on Flex with a fresh slot in which the layer's
    /// projection and both mixes assemble the gradient of its units in one pass.
    pub(crate) fn layer(self) -> LayerOps {
        let gradient = match self {
            Self::Fused { autodiff: true } => new_units_gradient(),
            _ => None,
        };
        LayerOps {
            ops: self,
            gradient,
        }
    }
}

#[cfg(feature = "flex")]
fn new_units_gradient() -> Option<UnitsGradient> {
    Some(UnitsGradient::default())
}

#[cfg(not(feature = "flex"))]
fn new_units_gradient() -> Option<UnitsGradient> {
    None
}

/// Rows `first..first + count` of the per-token matrices `[tokens | 1, R, U]` a mixing reads
/// (`Aᵀ`'s view rows or residual rows). The kernels read them in place; taken out as a slice
/// they would be a copy on CubeCL (an unaligned offset), and the slice's gradient a zero fill
/// and a slice-assign.
#[derive(Debug, Clone)]
pub struct MatrixRows {
    /// The matrices, all their rows.
    pub matrices: Tensor<3>,
    /// The first row read.
    pub first: usize,
    /// How many rows are read.
    pub count: usize,
}

impl MatrixRows {
    /// Every row of `matrices`.
    pub(crate) fn all(matrices: Tensor<3>) -> Self {
        let count = matrices.dims()[1];
        Self {
            matrices,
            first: 0,
            count,
        }
    }

    /// The rows read, as a tensor of their own `[tokens | 1, count, U]`.
    pub(crate) fn taken(self) -> Tensor<3> {
        if self.first == 0 && self.count == self.matrices.dims()[1] {
            return self.matrices;
        }
        self.matrices.narrow(1, self.first, self.count)
    }
}

/// The gains `β` of the block output in a mixing `Aᵀ S + β h`.
#[derive(Debug, Clone)]
// One per mixing, moved along: the size of a tensor handle is no cost here.
#[allow(clippy::large_enum_variant)]
pub enum Gains {
    /// A tensor of their own, `[T | 1, R, 1]`.
    Own(Tensor<3>),
    /// Row `row` of the mixing's matrices: `β[t, r] = matrices[t, row, r]` (a layer's
    /// connections made as one table).
    Row(usize),
}

impl Gains {
    /// `β` as `[T | 1, R, 1]`, read from `matrices` where it is one of their rows.
    pub(crate) fn tensor(self, matrices: &Tensor<3>) -> Tensor<3> {
        match self {
            Self::Own(beta) => beta,
            Self::Row(row) => matrices.clone().narrow(1, row, 1).swap_dims(1, 2),
        }
    }
}

/// The unit ops of one layer (see [`UnitOps::layer`]).
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "flex"), allow(dead_code))] // read by the fused ops only
pub struct LayerOps {
    ops: UnitOps,
    gradient: Option<UnitsGradient>,
}

impl LayerOps {
    /// The composed ops, for connections read back without a forward pass.
    pub(crate) fn composed() -> Self {
        UnitOps::Composed.layer()
    }

    /// The ops for `units` outside a forward pass: fused where the device has them, each op
    /// with its own backward (no shared gradient slot).
    pub(crate) fn standalone(units: &Tensor<3>) -> Self {
        Self {
            ops: UnitOps::for_units(units),
            gradient: None,
        }
    }

    /// `P_r = s(‖x_r‖₂) · x_r W` for `rows [R, w]` (the layer's units, reshaped) and
    /// `weights [w, C]`.
    pub(crate) fn normed_projection(
        &self,
        rows: Tensor<2>,
        weights: Tensor<2>,
        scale: RowScale,
    ) -> Tensor<2> {
        #[cfg(feature = "flex")]
        if let UnitOps::Fused { .. } = self.ops {
            return super::normed_projection::fused_normed_projection(
                rows,
                weights,
                scale,
                self.gradient.as_ref(),
            );
        }
        #[cfg(feature = "cube-kernels")]
        if let UnitOps::Kernels = self.ops
            && super::unit_kernels::projects(&rows, &weights)
        {
            return super::unit_kernels::projection(rows, weights, scale);
        }
        composed_normed_projection(rows, weights, scale)
    }

    /// `Aᵀ S (+ β h)` per token: `weights` the `R` rows of `Aᵀ` (`[tokens | 1, R, U]`),
    /// `units [tokens, U, w]`, and the optional `β` (`[tokens | 1, R, 1]`), `h [tokens, V, w]`
    /// (row `r` receives view `r mod V`); `[tokens, R, w]`.
    ///
    /// `slot`: the gradient slot of the layer's table (from [`table`](Self::table)), 0
    /// where its connections are not one table.
    pub(crate) fn mix(
        &self,
        weights: MatrixRows,
        units: Tensor<3>,
        addend: Option<(Gains, Tensor<3>)>,
        slot: u64,
    ) -> Tensor<3> {
        #[cfg(feature = "cube-kernels")]
        if let UnitOps::Kernels = self.ops
            && super::unit_kernels::mixes(&weights.matrices, &units, addend.as_ref())
        {
            return super::unit_kernels::mix(weights, units, addend, slot);
        }
        let _ = slot;
        let addend = addend.map(|(gains, branch)| (gains.tensor(&weights.matrices), branch));
        #[cfg(feature = "flex")]
        if let UnitOps::Fused { .. } = self.ops {
            return super::stream_mix::fused_stream_mix(
                weights.taken(),
                units,
                addend,
                self.gradient.as_ref(),
            );
        }
        composed_mix(weights.taken(), units, addend)
    }

    /// The layer's connections as one table `[T, V + U + 1, U]` through the CubeCL kernels
    /// (see [`connection_tables`](super::connection_tables)), the block input `A_inᵀ S`
    /// (`[T, V, w]`) made by the same kernel, and the gradient slot the table's mixes share (see
    /// [`gradient_slots`](super::gradient_slots)), where this pass runs them and every input has
    /// the rows' float type; `None` where the caller composes them.
    #[cfg(feature = "cube-kernels")]
    pub(crate) fn table<F: super::TableForm>(
        &self,
        inputs: impl FnOnce() -> F,
    ) -> Option<(Tensor<3>, Tensor<3>, u64)> {
        if !matches!(self.ops, UnitOps::Kernels) {
            return None;
        }
        let inputs = inputs();
        // One float type for every input: the kernels read them all as the rows' type.
        if !inputs.one_float_type() {
            return None;
        }
        let slot = super::gradient_slots::new_key();
        let (table, input) = inputs.table(slot);
        Some((table, input, slot))
    }
}

/// [`LayerOps::mix`] as `U` broadcast multiply-adds `Σ_u Aᵀ[:, :, u] ⊗ S_u` (then `+ β ⊗ h`):
/// with matrices this small (`U`, `R` ≤ 8), a batched matrix product is one tiny product per
/// token, about 4× slower on CPU backends (4.7 ms against 1.2 ms for
/// `[1024, 5, 4] × [1024, 4, 256]` on Flex), while the multiply-adds fuse into one kernel on
/// CubeCL backends.
pub(crate) fn composed_mix(
    weights: Tensor<3>,
    units: Tensor<3>,
    addend: Option<(Tensor<3>, Tensor<3>)>,
) -> Tensor<3> {
    let [_, _, count] = weights.dims();
    let mixed = (0..count)
        .map(|u| weights.clone().narrow(2, u, 1) * units.clone().narrow(1, u, 1))
        .reduce(|sum, term| sum + term)
        .expect("at least one unit");
    let Some((beta, branch)) = addend else {
        return mixed;
    };
    let [tokens, rows, width] = mixed.dims();
    let [beta_tokens, _, _] = beta.dims();
    let views = branch.dims()[1];
    let groups = rows / views;
    (mixed.reshape([tokens, groups, views, width])
        + beta.reshape([beta_tokens, groups, views, 1]) * branch.reshape([tokens, 1, views, width]))
    .reshape([tokens, rows, width])
}

/// [`LayerOps::normed_projection`] from tensor ops.
pub(crate) fn composed_normed_projection(
    rows: Tensor<2>,
    weights: Tensor<2>,
    scale: RowScale,
) -> Tensor<2> {
    // The scale in f32 for half types (see `exact_float`): the row itself is cast only for its
    // sum of squares; the projection stays in the rows' type.
    let dtype = rows.dtype();
    let exact = super::exact_float(dtype);
    let projected = rows.clone().matmul(weights).cast(exact);
    let squares = rows.cast(exact).square().sum_dim(1);
    let mut denominator = if scale.root_offset != 0.0 {
        squares.add_scalar(scale.root_offset).sqrt()
    } else {
        squares.sqrt()
    };
    if scale.offset != 0.0 {
        denominator = denominator.add_scalar(scale.offset);
    }
    if scale.floor != 0.0 {
        denominator = denominator.clamp_min(scale.floor);
    }
    (projected / denominator * scale.numerator).cast(dtype)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{DType, Distribution};

    use super::*;
    use crate::test_util::errors_in_float_type;

    /// In f16 the composed projection takes its row scale in f32: for rows of 3072 entries of
    /// RMS 5 (`‖x‖² ≈ 7.7·10⁴`, past f16's largest value, 65504) and hyper-connections', mHC's
    /// and the RMS row scales, the value and both gradients come within 16 of f16's unit
    /// roundoffs of the f32 ones (relative to each result's largest entry). With `‖x‖²` in f16
    /// the norm was infinite, the scale 0 and the value and `∂W` zero: an error of 1.
    #[test]
    fn composed_projection_in_f16_takes_norms_whose_squares_f16_overflows() {
        let device = Device::flex().autodiff();
        let (count, width, columns) = (16, 3072, 24);
        let normal = |shape: [usize; 2], std: f64| {
            Tensor::<2>::random(shape, Distribution::Normal(0.0, std), &device)
        };
        let (rows, weights, probe) = (
            normal([count, width], 5.0),
            normal([width, columns], 0.02),
            normal([count, columns], 1.0),
        );
        let root = (width as f64).sqrt();
        let hyper_connections = RowScale {
            numerator: root,
            offset: 0.0,
            floor: 1e-12,
            root_offset: 0.0,
        };
        let mhc = RowScale {
            numerator: root,
            offset: 1e-6 * root,
            floor: 0.0,
            root_offset: 0.0,
        };
        for scale in [hyper_connections, mhc, RowScale::rms(width, 1e-6)] {
            let case = format!("the composed projection in f16, {scale:?}");
            let projected =
                |x: Vec<Tensor<2>>| composed_normed_projection(x[0].clone(), x[1].clone(), scale);
            let inputs = [rows.clone(), weights.clone()];
            let errors = errors_in_float_type(DType::F16, &inputs, &probe, projected, &case);
            for (name, error) in ["P", "∂x", "∂W"].iter().zip(errors) {
                assert!(
                    error <= 16.0 / 2048.0,
                    "{case}, {name}: {error:e} of its scale"
                );
            }
        }
    }
}
