//! Column `c` of each of `S` tables of one shape, side by side: AttnRes's logits of one query
//! over its sources (each source's logits for every query are one table `[..., Q]`).
//!
//! ```text
//! out[..., s] = L_s[..., c]                   ∂L_s = e_c ⊗ ∂out[..., s]
//! ```
//!
//! Composed, each table is a narrow and the tables a concatenation: forward a copy per table,
//! backward per table a slice of `∂out`, the narrow's zero fill and slice-assign, and autodiff's
//! add into the table's gradient so far. A source's table is read by every later mixture, so
//! over `L` blocks that is `O(L²)` small kernels. On the CubeCL backends the gather is a chain
//! of parts of up to [`PART`](parts::PART) tables, each one kernel forward (it also copies the
//! columns the earlier parts wrote) and one backward, which writes each table's gradient so far
//! plus its column (as the token mix does, [`token_mix`](super::token_mix)): no add follows.
//! Elsewhere the composed form. Not differentiable twice.

use burn::prelude::*;

/// `[L_0[..., c_0], …, L_{S−1}[..., c_{S−1}]]` along the last axis for `S` tables `[..., Q_s]`.
/// The CubeCL kernels take one column of tables of one width (see
/// [`gathers_columns_apart`]); other tables and columns compose.
pub(crate) fn gather_columns<const D: usize>(
    tables: Vec<Tensor<D>>,
    columns: &[usize],
) -> Tensor<D> {
    assert!(!tables.is_empty(), "gather column: no tables");
    assert_eq!(
        tables.len(),
        columns.len(),
        "gather column: one column per table"
    );
    #[cfg(feature = "cube-kernels")]
    {
        let shape = tables[0].dims();
        let dtype = tables[0].dtype();
        let column = columns[0];
        if tables
            .iter()
            .all(|table| table.dims() == shape && table.dtype() == dtype)
            && columns.iter().all(|&c| c == column)
            && column < shape[D - 1]
            && super::cube_kernels_take(&tables[0])
        {
            return parts::gather(tables, column);
        }
    }
    composed(tables, columns)
}

/// Whether [`gather_columns`] on `device` runs as fast with tables of their own widths, each
/// at its own column, as with one column of same-width tables: everywhere but the CubeCL
/// devices, whose kernels take the latter.
pub(crate) fn gathers_columns_apart(device: &Device) -> bool {
    !super::is_cube(device)
}

/// [`gather_columns`] as tensor ops: a narrow per table, concatenated.
pub(crate) fn composed<const D: usize>(tables: Vec<Tensor<D>>, columns: &[usize]) -> Tensor<D> {
    let columns = tables
        .into_iter()
        .zip(columns)
        .map(|(table, &column)| table.narrow(D - 1, column, 1))
        .collect();
    Tensor::cat(columns, D - 1)
}

#[cfg(feature = "cube-kernels")]
mod cube;

#[cfg(feature = "cube-kernels")]
mod parts {
    use burn::backend::autodiff::Autodiff;
    use burn::backend::autodiff::checkpoint::base::Checkpointer;
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
    use burn::backend::fusion::custom::TensorSpec;
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, Dispatch, backend_extension};
    use burn::prelude::*;

    use super::super::autodiff::{constant, eight_slots, register_states, take_so_far};
    use super::super::cube_launch::placeholder_spec;

    /// Tables per part.
    pub(crate) const PART: usize = 8;

    /// The spec of a part's output: the tables' with `total` columns.
    fn gathered_spec(table: &TensorSpec, total: usize) -> TensorSpec {
        let mut shape = table.shape.clone();
        let last = shape.num_dims() - 1;
        shape.as_mut_slice()[last] = total;
        TensorSpec::new(shape, table.dtype)
    }

    /// The spec of table `k`'s gradient: its own where wanted, else a placeholder.
    fn table_grad_spec(table: &TensorSpec, wanted: u32, k: usize) -> TensorSpec {
        if wanted >> k & 1 == 1 {
            table.clone()
        } else {
            placeholder_spec(table)
        }
    }

    /// A part of the gather (see [the module](super)).
    #[backend_extension(
        Cube: cfg(feature = "cube-kernels"),
        Fusion: cfg(feature = "cube-kernels"),
        Autodiff
    )]
    pub(crate) trait ColumnGatherBackend: Backend {
        /// `[..., total]`: columns `first .. first + count` from the tables' column `column`,
        /// the columns before `first` from `previous` where `with_previous` (else unread), the
        /// columns after unwritten (a later part writes them). The slots past `count` are
        /// unread (the caller repeats `t0` there).
        #[fusion(meta = |_, t0, _, _, _, _, _, _, _, _, _, _, total, _| gathered_spec(t0, *total))]
        #[allow(clippy::too_many_arguments)]
        fn gather_part(
            previous: FloatTensor<Self>,
            t0: FloatTensor<Self>,
            t1: FloatTensor<Self>,
            t2: FloatTensor<Self>,
            t3: FloatTensor<Self>,
            t4: FloatTensor<Self>,
            t5: FloatTensor<Self>,
            t6: FloatTensor<Self>,
            t7: FloatTensor<Self>,
            column: usize,
            first: usize,
            count: usize,
            total: usize,
            with_previous: bool,
        ) -> FloatTensor<Self>;

        /// `(∂L_0, …, ∂L_7)` of a part given `grad = ∂out [..., total]`: where bit `k` of
        /// `wanted` is set, `f_k + e_column ⊗ ∂out[..., first + k]` (`f_k`, `L_k`'s gradient
        /// so far, only where bit `k` of `sofar` is set; `L_k` gives the shape), else a `[1]`
        /// placeholder.
        #[fusion(meta = |_, t0, t1, t2, t3, t4, t5, t6, t7, _, _, _, _, _, _, _, _, _, _, _, _,
            wanted| (
            table_grad_spec(t0, *wanted, 0),
            table_grad_spec(t1, *wanted, 1),
            table_grad_spec(t2, *wanted, 2),
            table_grad_spec(t3, *wanted, 3),
            table_grad_spec(t4, *wanted, 4),
            table_grad_spec(t5, *wanted, 5),
            table_grad_spec(t6, *wanted, 6),
            table_grad_spec(t7, *wanted, 7),
        ))]
        #[allow(clippy::too_many_arguments, clippy::type_complexity)]
        fn gather_part_backward(
            grad: FloatTensor<Self>,
            t0: FloatTensor<Self>,
            t1: FloatTensor<Self>,
            t2: FloatTensor<Self>,
            t3: FloatTensor<Self>,
            t4: FloatTensor<Self>,
            t5: FloatTensor<Self>,
            t6: FloatTensor<Self>,
            t7: FloatTensor<Self>,
            f0: FloatTensor<Self>,
            f1: FloatTensor<Self>,
            f2: FloatTensor<Self>,
            f3: FloatTensor<Self>,
            f4: FloatTensor<Self>,
            f5: FloatTensor<Self>,
            f6: FloatTensor<Self>,
            f7: FloatTensor<Self>,
            column: usize,
            first: usize,
            count: usize,
            sofar: u32,
            wanted: u32,
        ) -> (
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
        );
    }

    /// The gather as a chain of parts (see [the module](super)).
    pub(super) fn gather<const D: usize>(tables: Vec<Tensor<D>>, column: usize) -> Tensor<D> {
        let total = tables.len();
        let mut gathered: Option<Tensor<D>> = None;
        for (part, chunk) in tables.chunks(PART).enumerate() {
            let slot = |k: usize| chunk.get(k).unwrap_or(&chunk[0]).clone().into_dispatch();
            let previous = gathered.clone().unwrap_or_else(|| chunk[0].clone());
            let next = <Dispatch as ColumnGatherBackend>::gather_part(
                previous.into_dispatch(),
                slot(0),
                slot(1),
                slot(2),
                slot(3),
                slot(4),
                slot(5),
                slot(6),
                slot(7),
                column,
                part * PART,
                chunk.len(),
                total,
                gathered.is_some(),
            );
            gathered = Some(Tensor::from_dispatch(next));
        }
        gathered.expect("at least one table")
    }

    /// A part under autodiff: parents `[previous, L_0, …, L_7]` (`L_0` repeated in the unused).
    #[derive(Debug)]
    struct GatherPart;

    /// What a part's backward keeps: its tables (their shapes) and their autodiff tensors (whose
    /// gradients so far it takes over), the column, where its columns start, whether it copies
    /// an earlier part's.
    #[derive(Debug, Clone)]
    struct Kept<B: Backend> {
        tables: Vec<FloatTensor<B>>,
        nodes: Vec<FloatTensor<Autodiff<B>>>,
        column: usize,
        first: usize,
        with_previous: bool,
    }

    impl<B: ColumnGatherBackend> Backward<B, 9> for GatherPart {
        type State = Kept<B>;

        fn backward(
            self,
            ops: Ops<Self::State, 9>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let Kept {
                tables,
                nodes,
                column,
                first,
                with_previous,
            } = ops.state;
            let count = tables.len();
            let grad = grads.consume::<B>(&ops.node);
            let tracked: Vec<bool> = (0..count).map(|k| ops.parents[1 + k].is_some()).collect();
            let (sofar, sofar_mask, wanted) = take_so_far::<B>(grads, &nodes, &tracked, &grad);
            let [t0, t1, t2, t3, t4, t5, t6, t7] = eight_slots(tables.clone(), &tables[0]);
            let [f0, f1, f2, f3, f4, f5, f6, f7] = eight_slots(sofar, &grad);
            let (g0, g1, g2, g3, g4, g5, g6, g7) = B::gather_part_backward(
                grad.clone(),
                t0,
                t1,
                t2,
                t3,
                t4,
                t5,
                t6,
                t7,
                f0,
                f1,
                f2,
                f3,
                f4,
                f5,
                f6,
                f7,
                column,
                first,
                count,
                sofar_mask,
                wanted,
            );
            register_states::<B>(grads, &nodes, &tracked, [g0, g1, g2, g3, g4, g5, g6, g7]);
            // The earlier parts' columns pass through whole (each reads its own).
            if with_previous && let Some(parent) = &ops.parents[0] {
                grads.register::<B>(parent.id, grad);
            }
        }
    }

    impl<B: ColumnGatherBackend, C: CheckpointStrategy> ColumnGatherBackend for Autodiff<B, C> {
        fn gather_part(
            previous: FloatTensor<Self>,
            t0: FloatTensor<Self>,
            t1: FloatTensor<Self>,
            t2: FloatTensor<Self>,
            t3: FloatTensor<Self>,
            t4: FloatTensor<Self>,
            t5: FloatTensor<Self>,
            t6: FloatTensor<Self>,
            t7: FloatTensor<Self>,
            column: usize,
            first: usize,
            count: usize,
            total: usize,
            with_previous: bool,
        ) -> FloatTensor<Self> {
            let parents = [previous, t0, t1, t2, t3, t4, t5, t6, t7];
            let nodes = parents.each_ref().map(|parent| parent.node());
            let kept_nodes: Vec<FloatTensor<Self>> = parents[1..1 + count].to_vec();
            let [p, t0, t1, t2, t3, t4, t5, t6, t7] = parents.map(|parent| parent.into_primitive());
            let tables: Vec<FloatTensor<B>> = [&t0, &t1, &t2, &t3, &t4, &t5, &t6, &t7][..count]
                .iter()
                .map(|table| (*table).clone())
                .collect();
            let gathered = B::gather_part(
                p,
                t0,
                t1,
                t2,
                t3,
                t4,
                t5,
                t6,
                t7,
                column,
                first,
                count,
                total,
                with_previous,
            );
            match GatherPart.prepare::<C>(nodes).compute_bound().stateful() {
                OpsKind::Tracked(prep) => {
                    let kept = Kept {
                        tables,
                        nodes: kept_nodes,
                        column,
                        first,
                        with_previous,
                    };
                    prep.finish(kept, gathered)
                }
                OpsKind::UnTracked(prep) => prep.finish(gathered),
            }
        }

        fn gather_part_backward(
            grad: FloatTensor<Self>,
            t0: FloatTensor<Self>,
            t1: FloatTensor<Self>,
            t2: FloatTensor<Self>,
            t3: FloatTensor<Self>,
            t4: FloatTensor<Self>,
            t5: FloatTensor<Self>,
            t6: FloatTensor<Self>,
            t7: FloatTensor<Self>,
            f0: FloatTensor<Self>,
            f1: FloatTensor<Self>,
            f2: FloatTensor<Self>,
            f3: FloatTensor<Self>,
            f4: FloatTensor<Self>,
            f5: FloatTensor<Self>,
            f6: FloatTensor<Self>,
            f7: FloatTensor<Self>,
            column: usize,
            first: usize,
            count: usize,
            sofar: u32,
            wanted: u32,
        ) -> (
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
        ) {
            let inner = |tensor: FloatTensor<Self>| tensor.into_primitive();
            // First-order only: the gradients are constants to the graph.
            let (a, b, c, d, e, f, g, h) = B::gather_part_backward(
                inner(grad),
                inner(t0),
                inner(t1),
                inner(t2),
                inner(t3),
                inner(t4),
                inner(t5),
                inner(t6),
                inner(t7),
                inner(f0),
                inner(f1),
                inner(f2),
                inner(f3),
                inner(f4),
                inner(f5),
                inner(f6),
                inner(f7),
                column,
                first,
                count,
                sofar,
                wanted,
            );
            (
                constant::<B, C>(a),
                constant::<B, C>(b),
                constant::<B, C>(c),
                constant::<B, C>(d),
                constant::<B, C>(e),
                constant::<B, C>(f),
                constant::<B, C>(g),
                constant::<B, C>(h),
            )
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use std::sync::atomic::Ordering;

    use burn::prelude::*;
    use burn::tensor::{Distribution, Tolerance};

    /// The kernels against the composed form on wgpu, values and every tracked table's
    /// gradient, for one part, a full part, and chains of two and three parts, with an untracked
    /// table and the same table twice (each table also read elsewhere, so that its gradient so
    /// far is taken over); then through the one-slot backward kernel.
    #[test]
    fn kernels_equal_composed_on_wgpu() {
        let device = crate::test_util::wgpu_autodiff();
        let launches = || super::cube::BACKWARD_LAUNCHES.load(Ordering::Relaxed);
        let before = launches();
        let run_all = |counts: &[usize]| {
            for &count in counts {
                let normal = Distribution::Normal(0.0, 1.0);
                let leaves: Vec<Tensor<3>> = (0..count)
                    .map(|_| Tensor::<3>::random([2, 7, 5], normal, &device))
                    .collect();
                let probe = Tensor::<3>::random([2, 7, count], normal, &device);
                let other = Tensor::<3>::random([2, 7, 5], normal, &device);
                let run = |fused: bool| {
                    let tables: Vec<Tensor<3>> = leaves
                        .iter()
                        .enumerate()
                        .map(|(k, leaf)| {
                            // Table 0 needs no gradient where there are others.
                            if k == 0 && count > 1 {
                                leaf.clone()
                            } else {
                                leaf.clone().require_grad()
                            }
                        })
                        .collect();
                    let mut inputs: Vec<Tensor<3>> =
                        tables.iter().map(|t| t.clone() * 1.5).collect();
                    if count >= 3 {
                        inputs[count - 1] = inputs[1].clone();
                    }
                    // Every table also feeds a second term, whose gradient reaches it first.
                    let elsewhere = inputs
                        .iter()
                        .map(|t| (t.clone() * other.clone()).sum())
                        .reduce(|a, b| a + b)
                        .expect("one table");
                    let columns = vec![3; inputs.len()];
                    let gathered = if fused {
                        super::gather_columns(inputs, &columns)
                    } else {
                        super::composed(inputs, &columns)
                    };
                    let loss = (gathered.clone() * probe.clone()).sum() + elsewhere;
                    let grads = loss.backward();
                    let used = if count >= 3 { count - 1 } else { count };
                    let mut out = vec![gathered.into_data()];
                    let tracked = if count > 1 { 1 } else { 0 };
                    out.extend(
                        tables[tracked..used]
                            .iter()
                            .map(|t| t.grad(&grads).unwrap().into_data()),
                    );
                    out
                };
                let tolerance = Tolerance::absolute(1e-5).set_relative(1e-5);
                for (fused, composed) in run(true).into_iter().zip(run(false)) {
                    fused.assert_approx_eq::<f32>(&composed, tolerance);
                }
            }
        };
        run_all(&[1, 3, 8, 9, 19]);
        // One backward per part: 1 + 1 + 1 + 2 + 3.
        assert!(launches() >= before + 8, "the kernels ran");
        super::cube::one_slot_backward(true);
        run_all(&[3, 9]);
        super::cube::one_slot_backward(false);
    }
}
