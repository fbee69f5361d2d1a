//! A softmax mixture of states whose logits are one column of a table per state, as one fused
//! op each way on Flex (f32, f64): AttnRes's mixtures, whose sources' logits for the queries
//! that read them are one table per source.
//!
//! For states `v_0 … v_{K−1}` `[..., d]` (rows `t`) and tables `L_k` `[..., Q_k]`, column `c_k`
//! of table `k` holding state `k`'s logits:
//!
//! ```text
//! z[t, k] = L_k[t, c_k]        p[t] = softmax_k(z[t])        h[t] = Σ_k p[t, k] v_k[t]
//!
//! ∂v_k[t] = p[t, k] ∂h[t]      ∂L_k[t, c_k] = ∂z[t, k] = p[t, k] (⟨∂h[t], v_k[t]⟩ − ⟨∂h[t], h[t]⟩)
//! ```
//!
//! (the softmax's backward `p_k (g_k − Σ_j p_j g_j)` with `g_k = ⟨∂h, v_k⟩`, whose mean
//! `Σ_j p_j g_j` is `⟨∂h, h⟩`). Composed, the mixture is a narrow per table and their
//! concatenation, a softmax (five ops each way) and the weighted sum; backward the weighted
//! sum reads every state for `g_k` and reads and writes every state's gradient.
//!
//! Here the forward reads each row's logits, its weights and its states once and writes `h`
//! and `p` once. Where a state's table is the output of a normalised projection of that state
//! which claimed the state's gradient slot ([`UnitsGradient`], AttnRes's sources and their
//! logits), the backward only computes `⟨∂h, h⟩` and leaves `(p[:, k], ∂h, ⟨∂h, h⟩, c_k)` there:
//! the projection's backward, which autodiff runs after every mixture over the state (the
//! table is the mixture's parent) and which reads the state anyway, takes `g_k = ⟨∂h, v_k⟩` in
//! its pass, adds `∂z` to column `c_k` of its output's gradient and `p ∂h` to the state's. A
//! (mixture, state) pair then costs a pass over the state forward and one over `∂h` backward,
//! where the composed backward reads the state, and the state's gradient is written once. The
//! table gets a zero gradient (once) so that the projection's backward finds one. A state
//! without a slot that takes the part gets its gradients here, its gradient written onto its
//! gradient so far (taken out of autodiff's) so that no add follows.
//!
//! The last state's logit may also be made here, `z[t, K−1] = s(‖v_t‖) v_t · w` with the RMS
//! scale `s(n) = 1 / sqrt(n²/d + ε)` and a column `w` of a weight matrix ([`OwnLogit`]), for a
//! state that this mixture alone reads (AttnRes's partial sum), whose table would otherwise be a
//! projection of its own, a pass over the state and an op each way. Its backward, in the pass
//! that computes `⟨∂h, h⟩`:
//!
//! ```text
//! ∂v_{K−1}[t] = p ∂h[t] + ∂z (s w + s'(n)/n (v_t · w) v_t)      ∂w = Σ_t ∂z s v_t
//! ```
//!
//! with `p = p[t, K−1]`, `∂z = p (⟨∂h[t], v_t⟩ − ⟨∂h[t], h[t]⟩)`. Not differentiable twice.

use std::borrow::Cow;

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::prelude::*;
use burn::tensor::DType;
use burn_flex::{Flex, FlexTensor};
use rayon::prelude::*;

use super::autodiff::{Staged, constant};
use super::flex_kernels::{
    Scalar, axpy, contiguous, dims, dot, rows_and_width, rows_per_task, tensor, token_row,
    unwritten, values, write_axpy, write_weighted_sum, written,
};
use super::stream_mix::LogitTerm;
use super::{OwnLogit, RowScale, UnitsGradient};

/// The most states of one fused mixture (its parents, a table and a state each, fill 64).
const MAX_STATES: usize = 32;

/// `Σ_k softmax_k(tables[k][..., columns[k]]) states[k]` through the fused Flex op, with the
/// states' gradient slots (`slots[k]`, missing entries none) and, with `own`, the last state's
/// logit made here (then one table fewer than states; see [`OwnLogit`]); `None` where it does
/// not apply (not Flex in f32 or f64, states of different shapes, a table whose leading axes
/// differ from the states' or without its column, more than [`MAX_STATES`] states, weights
/// that do not match the states' width), for the caller to compose.
pub(crate) fn fused_softmax_mix<const D: usize>(
    tables: &[Tensor<D>],
    columns: &[usize],
    states: &[Tensor<D>],
    slots: &[Option<UnitsGradient>],
    own: Option<&OwnLogit>,
) -> Option<Tensor<D>> {
    let count = states.len();
    let own_count = usize::from(own.is_some());
    if count == 0
        || count > MAX_STATES
        || tables.len() + own_count != count
        || columns.len() != count
    {
        return None;
    }
    let shape = states[0].dims();
    let dtype = states[0].dtype();
    let applies = super::has_fused_flex_ops(&states[0])
        && states
            .iter()
            .all(|state| state.dims() == shape && state.dtype() == dtype)
        && tables.iter().zip(columns).all(|(table, &column)| {
            let dims = table.dims();
            dims[..D - 1] == shape[..D - 1] && column < dims[D - 1] && table.dtype() == dtype
        })
        && own.is_none_or(|own| {
            let [width, queries] = own.weights.dims();
            width == shape[D - 1] && columns[count - 1] < queries && own.weights.dtype() == dtype
        });
    if !applies {
        return None;
    }
    // Every input but the last state staged (the tables, the own logit's weights, the states);
    // the last goes in as the op's tensor argument.
    let staged = Staged::default();
    let stage = |input: FloatTensor<Dispatch>| {
        let _ = <Dispatch as SoftmaxMixBackend>::softmax_mix_stage(input, staged.clone());
    };
    for table in tables {
        stage(table.clone().into_dispatch());
    }
    if let Some(own) = own {
        stage(own.weights.clone().into_dispatch());
    }
    for state in &states[..count - 1] {
        stage(state.clone().into_dispatch());
    }
    let slots = (0..count)
        .map(|k| slots.get(k).cloned().flatten())
        .collect();
    let own_scale = own.map(|own| RowScale::rms(shape[D - 1], own.epsilon));
    let last = states[count - 1].clone().into_dispatch();
    let mixed = <Dispatch as SoftmaxMixBackend>::softmax_mix(
        last,
        staged,
        columns.to_vec(),
        slots,
        own_scale,
    );
    Some(Tensor::from_dispatch(mixed))
}

/// The fused mixture (see the [module docs](self)).
#[backend_extension(Flex: cfg(feature = "flex"), Autodiff)]
pub(crate) trait SoftmaxMixBackend: Backend {
    /// Adds `input` to `staged`; returns it unchanged.
    fn softmax_mix_stage(input: FloatTensor<Self>, staged: Staged) -> FloatTensor<Self>;

    /// `h` for the `K` tables then the first `K − 1` states staged, and the last state; under
    /// autodiff, the backward may leave state `k`'s part in `slots[k]`. With `own`, the last
    /// "table" is the weights `W` `[d, Q]` of the last state's own logit (see [`OwnLogit`]).
    fn softmax_mix(
        last: FloatTensor<Self>,
        staged: Staged,
        columns: Vec<usize>,
        slots: Vec<Option<UnitsGradient>>,
        own: Option<RowScale>,
    ) -> FloatTensor<Self>;

    /// `[h, p]`: the mixture and its weights `[..., K]` (inputs as [`softmax_mix`](Self::softmax_mix)).
    fn softmax_mix_weights(
        last: FloatTensor<Self>,
        staged: Staged,
        columns: Vec<usize>,
        own: Option<RowScale>,
    ) -> Vec<FloatTensor<Self>>;

    /// The gradients for `∂h` of the `K` tables then the `K` states staged (`p` the weights,
    /// `h` the output): each slot in `leave` takes its state's part, and its table's gradient
    /// is zero where `wanted[k]` (else empty); the others' gradients where `wanted` (table
    /// `k`, then state `K + k`), empty tensors where not. A state gradient computed here is
    /// written as the state's gradient so far (`so_far`: one `Option` per state) plus the op's
    /// term, so that no add follows. With `own`, the last state's slot takes nothing and the
    /// last "table"'s gradient is that of the own logit's weights.
    #[allow(clippy::too_many_arguments)]
    fn softmax_mix_backward(
        staged: Staged,
        columns: Vec<usize>,
        weights: FloatTensor<Self>,
        output: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        leave: Vec<Option<UnitsGradient>>,
        wanted: Vec<bool>,
        own: Option<RowScale>,
        so_far: Staged,
    ) -> Vec<FloatTensor<Self>>;
}

/// Column `column` of a `[d, Q]` weight matrix, `[d]`.
fn weights_column<E: Scalar>(weights: &FlexTensor, column: usize) -> Vec<E> {
    let [_, queries] = dims::<2>(weights);
    values::<E>(weights)
        .chunks_exact(queries)
        .map(|row| row[column])
        .collect()
}

/// `(h, p)` of the mixture of `states` with logits `tables[k][:, columns[k]]`, the last one's
/// made here with `own` (its table then the weights, see [`OwnLogit`]).
fn forward<E: Scalar>(
    tables: &[FlexTensor],
    columns: &[usize],
    states: &[FlexTensor],
    own: Option<RowScale>,
) -> (FlexTensor, FlexTensor) {
    let (tokens, width) = rows_and_width(&states[0]);
    let count = states.len();
    let shape = states[0].layout().shape().clone();
    let mut weight_shape = shape.clone();
    weight_shape[shape.num_dims() - 1] = count;
    let own = own.map(|scale| {
        (
            weights_column::<E>(&tables[count - 1], columns[count - 1]),
            scale,
        )
    });
    let tables: Vec<(Cow<'_, [E]>, usize)> = tables[..count - usize::from(own.is_some())]
        .iter()
        .map(|table| (values::<E>(table), rows_and_width(table).1))
        .collect();
    let states: Vec<Cow<'_, [E]>> = states.iter().map(values::<E>).collect();
    let rows = rows_per_task(width);
    let mut out = unwritten::<E>(tokens * width);
    let mut weights = vec![E::zero(); tokens * count];
    out.par_chunks_mut(rows * width)
        .zip(weights.par_chunks_mut(rows * count))
        .enumerate()
        .for_each(|(task, (chunk, weight_chunk))| {
            let first = task * rows;
            let mut terms = Vec::with_capacity(count);
            for (i, (out, p)) in chunk
                .chunks_mut(width)
                .zip(weight_chunk.chunks_mut(count))
                .enumerate()
            {
                let t = first + i;
                // The softmax of the row's logits, its largest subtracted.
                for ((p, (table, len)), &column) in p.iter_mut().zip(&tables).zip(columns) {
                    *p = table[t * len + column];
                }
                if let Some((query, scale)) = &own {
                    let state = token_row(&states[count - 1], t, width);
                    p[count - 1] = scale.of_row(state).0 * dot(state, query);
                }
                let largest = p.iter().copied().fold(E::neg_infinity(), E::max);
                let mut sum = E::zero();
                for p in p.iter_mut() {
                    *p = (*p - largest).exp();
                    sum += *p;
                }
                p.iter_mut().for_each(|p| *p = *p / sum);
                terms.clear();
                terms.extend(
                    p.iter()
                        .zip(&states)
                        .map(|(&p, state)| (p, token_row(state, t, width))),
                );
                write_weighted_sum(out, &terms);
            }
        });
    // SAFETY: the chunks partition `out`, and each row of each was written whole.
    let output = tensor(unsafe { written(out) }, [tokens, width]).reshape(shape);
    (
        output,
        tensor(weights, [tokens, count]).reshape(weight_shape),
    )
}

/// See [`SoftmaxMixBackend::softmax_mix_backward`].
#[allow(clippy::too_many_arguments)]
fn backward<E: Scalar>(
    tables: &[FlexTensor],
    columns: &[usize],
    states: &[FlexTensor],
    weights: &FlexTensor,
    output: &FlexTensor,
    grad: &FlexTensor,
    leave: &[Option<UnitsGradient>],
    wanted: &[bool],
    own: Option<RowScale>,
    so_far: &[Option<FlexTensor>],
) -> Vec<FlexTensor> {
    let (tokens, width) = rows_and_width(&states[0]);
    let so_far: Vec<Option<Cow<'_, [E]>>> = so_far
        .iter()
        .map(|grad| grad.as_ref().map(values::<E>))
        .collect();
    let count = states.len();
    let p = values::<E>(weights);
    let h = values::<E>(output);
    let dh = values::<E>(grad);
    // `⟨∂h, h⟩` per token: the softmax's mean term of every state's `∂z`; with the last
    // state's own logit, that state's gradients in the same pass.
    let mut centre = vec![E::zero(); tokens];
    let mut own_grads = match own {
        Some(scale) => {
            let query = weights_column::<E>(&tables[count - 1], columns[count - 1]);
            let last = values::<E>(&states[count - 1]);
            let rows = OwnRows {
                grad: &dh,
                output: &h,
                state: &last,
                weights: &p,
                so_far: so_far[count - 1].as_deref(),
            };
            Some(own_backward(rows, &query, scale, &mut centre))
        }
        None => {
            centre.par_iter_mut().enumerate().for_each(|(t, centre)| {
                *centre = dot(token_row(&dh, t, width), token_row(&h, t, width));
            });
            None
        }
    };
    let column_of = |k: usize| -> Vec<E> { p.chunks_exact(count).map(|p| p[k]).collect() };
    // Shared by every part left: `∂h` as rows, and `⟨∂h, h⟩`.
    let dh_rows = contiguous(grad.clone()).reshape(Shape::from([tokens, width]));
    let centre_tensor = tensor(centre.clone(), [tokens]);
    let empty = || tensor(Vec::<E>::new(), [0]);
    let mut table_grads = Vec::with_capacity(count);
    let mut state_grads = Vec::with_capacity(count);
    for k in 0..count {
        let (want_table, want_state) = (wanted[k], wanted[count + k]);
        if k == count - 1
            && let Some((state_grad, column_grad)) = own_grads.take()
        {
            // The own logit's weights, `[d, Q]`, nonzero in their column.
            table_grads.push(if want_table {
                let [rows, queries] = dims::<2>(&tables[k]);
                let mut grad = vec![E::zero(); rows * queries];
                for (row, value) in grad.chunks_exact_mut(queries).zip(column_grad) {
                    row[columns[k]] = value;
                }
                tensor(grad, [rows, queries])
            } else {
                empty()
            });
            state_grads.push(if want_state {
                tensor(state_grad, [tokens, width]).reshape(states[k].layout().shape().clone())
            } else {
                empty()
            });
            continue;
        }
        let table_len = rows_and_width(&tables[k]).1;
        let table_shape = tables[k].layout().shape().clone();
        if let Some(slot) = &leave[k] {
            slot.leave_logit(LogitTerm {
                weights: tensor(column_of(k), [tokens]),
                grad: dh_rows.clone(),
                centre: centre_tensor.clone(),
                column: columns[k],
            });
            table_grads.push(if want_table {
                tensor(vec![E::zero(); tokens * table_len], [tokens, table_len])
                    .reshape(table_shape)
            } else {
                empty()
            });
            state_grads.push(empty());
            continue;
        }
        // No slot takes it: this state's gradients here.
        if want_table {
            let state = values::<E>(&states[k]);
            let mut table_grad = vec![E::zero(); tokens * table_len];
            table_grad
                .par_chunks_mut(table_len)
                .enumerate()
                .for_each(|(t, out)| {
                    let g = dot(token_row(&dh, t, width), token_row(&state, t, width));
                    out[columns[k]] = p[t * count + k] * (g - centre[t]);
                });
            table_grads.push(tensor(table_grad, [tokens, table_len]).reshape(table_shape));
        } else {
            table_grads.push(empty());
        }
        if want_state {
            let mut state_grad = unwritten::<E>(tokens * width);
            state_grad
                .par_chunks_mut(width)
                .enumerate()
                .for_each(|(t, out)| {
                    let base = so_far[k].as_ref().map(|grad| token_row(grad, t, width));
                    write_axpy(out, base, p[t * count + k], token_row(&dh, t, width));
                });
            // SAFETY: every row was written whole.
            let state_grad = tensor(unsafe { written(state_grad) }, [tokens, width]);
            state_grads.push(state_grad.reshape(states[k].layout().shape().clone()));
        } else {
            state_grads.push(empty());
        }
    }
    table_grads.extend(state_grads);
    table_grads
}

/// The rows [`own_backward`] reads: `∂h`, `h`, the last state, the weights `p` `[T, K]` and
/// the last state's gradient so far, if any.
struct OwnRows<'a, E> {
    grad: &'a [E],
    output: &'a [E],
    state: &'a [E],
    weights: &'a [E],
    so_far: Option<&'a [E]>,
}

/// With the last state's logit made in the op (`z = s(‖v‖) v · w`): `⟨∂h, h⟩` per token into
/// `centre`, the last state's gradient `p ∂h + ∂z (s w + s'(n)/n (v · w) v)` with
/// `∂z = p (⟨∂h, v⟩ − ⟨∂h, h⟩)` (plus its gradient so far), and the query's `Σ_t ∂z s v_t`, in
/// one pass over the rows. `normed_projection`'s one-pass backward computes the same terms for
/// one column, but from a `⟨∂h, h⟩` made before it: here that sum comes from the same pass,
/// which saves a read of `∂h` and `h`.
fn own_backward<E: Scalar>(
    rows: OwnRows<'_, E>,
    query: &[E],
    scale: RowScale,
    centre: &mut [E],
) -> (Vec<E>, Vec<E>) {
    let width = query.len();
    let count = rows.weights.len() / centre.len().max(1);
    let per_task = rows_per_task(width);
    let mut grad = unwritten::<E>(centre.len() * width);
    let parts: Vec<Vec<E>> = centre
        .par_chunks_mut(per_task)
        .zip(grad.par_chunks_mut(per_task * width))
        .enumerate()
        .map(|(task, (centre, grad))| {
            let mut part = vec![E::zero(); width];
            let mut terms = Vec::with_capacity(4);
            for (i, (centre, out)) in centre.iter_mut().zip(grad.chunks_mut(width)).enumerate() {
                let t = task * per_task + i;
                let dh = token_row(rows.grad, t, width);
                let v = token_row(rows.state, t, width);
                *centre = dot(dh, token_row(rows.output, t, width));
                let weight = rows.weights[t * count + count - 1];
                let grad_logit = weight * (dot(dh, v) - *centre);
                let (s, slope) = scale.of_row(v);
                let along = dot(v, query);
                terms.clear();
                terms.extend(
                    rows.so_far
                        .map(|grad| (E::one(), token_row(grad, t, width))),
                );
                terms.extend([
                    (weight, dh),
                    (grad_logit * s, query),
                    (grad_logit * slope * along, v),
                ]);
                write_weighted_sum(out, &terms);
                axpy(&mut part, grad_logit * s, v);
            }
            part
        })
        .collect();
    let mut column = vec![E::zero(); width];
    for part in &parts {
        axpy(&mut column, E::one(), part);
    }
    // SAFETY: the tasks' chunks partition `grad`, each row written whole.
    (unsafe { written(grad) }, column)
}

/// The staged inputs (and the last state, where it came apart) split into the tables and the
/// states.
fn split_staged<T: std::any::Any>(staged: &Staged, last: Option<T>) -> (Vec<T>, Vec<T>) {
    let mut tables = staged.take::<T>();
    tables.extend(last);
    let states = tables.split_off(tables.len() / 2);
    (tables, states)
}

impl SoftmaxMixBackend for Flex {
    fn softmax_mix_stage(input: FlexTensor, staged: Staged) -> FlexTensor {
        staged.push(input.clone());
        input
    }

    fn softmax_mix(
        last: FlexTensor,
        staged: Staged,
        columns: Vec<usize>,
        _slots: Vec<Option<UnitsGradient>>,
        own: Option<RowScale>,
    ) -> FlexTensor {
        let mut outputs = Self::softmax_mix_weights(last, staged, columns, own);
        outputs.swap_remove(0)
    }

    fn softmax_mix_weights(
        last: FlexTensor,
        staged: Staged,
        columns: Vec<usize>,
        own: Option<RowScale>,
    ) -> Vec<FlexTensor> {
        let (tables, states) = split_staged::<FlexTensor>(&staged, Some(last));
        let (output, weights) = match states[0].dtype() {
            DType::F32 => forward::<f32>(&tables, &columns, &states, own),
            DType::F64 => forward::<f64>(&tables, &columns, &states, own),
            other => panic!("softmax mix: unsupported dtype {other:?}"),
        };
        vec![output, weights]
    }

    fn softmax_mix_backward(
        staged: Staged,
        columns: Vec<usize>,
        weights: FlexTensor,
        output: FlexTensor,
        grad: FlexTensor,
        leave: Vec<Option<UnitsGradient>>,
        wanted: Vec<bool>,
        own: Option<RowScale>,
        so_far: Staged,
    ) -> Vec<FlexTensor> {
        let (tables, states) = split_staged::<FlexTensor>(&staged, None);
        let so_far = so_far.take::<Option<FlexTensor>>();
        let run = |dtype| match dtype {
            DType::F32 => backward::<f32>(
                &tables, &columns, &states, &weights, &output, &grad, &leave, &wanted, own, &so_far,
            ),
            DType::F64 => backward::<f64>(
                &tables, &columns, &states, &weights, &output, &grad, &leave, &wanted, own, &so_far,
            ),
            other => panic!("softmax mix: unsupported dtype {other:?}"),
        };
        run(states[0].dtype())
    }
}

/// The fused mixture under autodiff: parents `[L_0, …, L_{K−1}, v_0, …, v_{K−1}, L_0, …]` (`N`
/// of them, padded with the first table).
#[derive(Debug)]
struct FusedSoftmaxMix;

/// What the backward pass keeps: the inputs (the tables then the states), the tables' and the
/// states' autodiff tensors (to find whether one has a gradient yet, and take it), the columns,
/// the weights and the output, the states' slots and the own logit's scale.
#[derive(Debug, Clone)]
struct Kept<B: Backend> {
    inputs: Vec<FloatTensor<B>>,
    tables: Vec<FloatTensor<Autodiff<B>>>,
    states: Vec<FloatTensor<Autodiff<B>>>,
    columns: Vec<usize>,
    weights: FloatTensor<B>,
    output: FloatTensor<B>,
    slots: Vec<Option<UnitsGradient>>,
    own: Option<RowScale>,
}

impl<B: SoftmaxMixBackend, const N: usize> Backward<B, N> for FusedSoftmaxMix {
    type State = Kept<B>;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let Kept {
            inputs,
            tables,
            states,
            columns,
            weights,
            output,
            slots,
            own,
        } = ops.state;
        let count = tables.len();
        let grad = grads.consume::<B>(&ops.node);
        let tracked: Vec<bool> = ops.parents[..2 * count]
            .iter()
            .map(Option::is_some)
            .collect();
        // A slot takes its state's part where its projection claimed it and has not run; a
        // state whose logit the op made has no projection.
        let leave: Vec<Option<UnitsGradient>> = slots
            .into_iter()
            .enumerate()
            .map(|(k, slot)| {
                let own_logit = own.is_some() && k == count - 1;
                slot.filter(|slot| !own_logit && slot.accepts())
            })
            .collect();
        let mut wanted = tracked.clone();
        for k in 0..count {
            if leave[k].is_some() {
                // The table's zero gradient, once; the state's comes from the projection.
                wanted[k] = tracked[k] && grads.get::<B>(&tables[k]).is_none();
                wanted[count + k] = false;
            }
        }
        // Each state gradient computed here is written with the gradient so far: no add.
        let so_far: Vec<Option<FloatTensor<B>>> = states
            .iter()
            .enumerate()
            .map(|(k, state)| {
                if wanted[count + k] {
                    grads.remove::<B>(state)
                } else {
                    None
                }
            })
            .collect();
        let computed = B::softmax_mix_backward(
            Staged::of(inputs),
            columns,
            weights,
            output,
            grad,
            leave,
            wanted.clone(),
            own,
            Staged::of(so_far),
        );
        for ((parent, wanted), grad) in ops.parents.iter().zip(&wanted).zip(computed) {
            if let (Some(parent), true) = (parent, wanted) {
                grads.register::<B>(parent.id, grad);
            }
        }
    }
}

/// The op with `N` parents.
fn tracked<B, C, const N: usize>(
    inputs: Vec<FloatTensor<Autodiff<B, C>>>,
    columns: Vec<usize>,
    slots: Vec<Option<UnitsGradient>>,
    own: Option<RowScale>,
) -> FloatTensor<Autodiff<B, C>>
where
    B: SoftmaxMixBackend,
    C: CheckpointStrategy,
{
    let count = inputs.len() / 2;
    let tables: Vec<_> = inputs[..count].to_vec();
    let states: Vec<_> = inputs[count..].to_vec();
    let nodes: [_; N] =
        std::array::from_fn(|i| inputs[if i < inputs.len() { i } else { 0 }].node());
    let primitives: Vec<FloatTensor<B>> = inputs
        .into_iter()
        .map(|input| input.into_primitive())
        .collect();
    // The inner op takes the last state apart from the staged inputs.
    let split = |mut primitives: Vec<FloatTensor<B>>| {
        let last = primitives.pop().expect("a state");
        (last, Staged::of(primitives))
    };
    match FusedSoftmaxMix
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (last, staged) = split(primitives.clone());
            let mut outputs = B::softmax_mix_weights(last, staged, columns.clone(), own);
            let weights = outputs.pop().expect("the weights");
            let output = outputs.pop().expect("the mixture");
            let kept = Kept {
                inputs: primitives,
                tables,
                states,
                columns,
                weights,
                output: output.clone(),
                slots,
                own,
            };
            prep.finish(kept, output)
        }
        OpsKind::UnTracked(prep) => {
            let (last, staged) = split(primitives);
            prep.finish(B::softmax_mix(last, staged, columns, Vec::new(), own))
        }
    }
}

impl<B: SoftmaxMixBackend, C: CheckpointStrategy> SoftmaxMixBackend for Autodiff<B, C> {
    fn softmax_mix_stage(input: FloatTensor<Self>, staged: Staged) -> FloatTensor<Self> {
        staged.push(input.clone());
        input
    }

    fn softmax_mix(
        last: FloatTensor<Self>,
        staged: Staged,
        columns: Vec<usize>,
        slots: Vec<Option<UnitsGradient>>,
        own: Option<RowScale>,
    ) -> FloatTensor<Self> {
        let mut inputs = staged.take::<FloatTensor<Self>>();
        inputs.push(last);
        match inputs.len() {
            0..=8 => tracked::<B, C, 8>(inputs, columns, slots, own),
            9..=16 => tracked::<B, C, 16>(inputs, columns, slots, own),
            17..=32 => tracked::<B, C, 32>(inputs, columns, slots, own),
            parents => {
                assert!(parents <= 2 * MAX_STATES, "softmax mix: too many states");
                tracked::<B, C, 64>(inputs, columns, slots, own)
            }
        }
    }

    fn softmax_mix_weights(
        last: FloatTensor<Self>,
        staged: Staged,
        columns: Vec<usize>,
        own: Option<RowScale>,
    ) -> Vec<FloatTensor<Self>> {
        let inputs: Vec<FloatTensor<B>> = staged
            .take::<FloatTensor<Self>>()
            .into_iter()
            .map(|input| input.into_primitive())
            .collect();
        B::softmax_mix_weights(last.into_primitive(), Staged::of(inputs), columns, own)
            .into_iter()
            .map(constant::<B, C>)
            .collect()
    }

    fn softmax_mix_backward(
        staged: Staged,
        columns: Vec<usize>,
        weights: FloatTensor<Self>,
        output: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        leave: Vec<Option<UnitsGradient>>,
        wanted: Vec<bool>,
        own: Option<RowScale>,
        so_far: Staged,
    ) -> Vec<FloatTensor<Self>> {
        let so_far: Vec<Option<FloatTensor<B>>> = so_far
            .take::<Option<FloatTensor<Self>>>()
            .into_iter()
            .map(|grad| grad.map(|grad| grad.into_primitive()))
            .collect();
        let inputs: Vec<FloatTensor<B>> = staged
            .take::<FloatTensor<Self>>()
            .into_iter()
            .map(|input| input.into_primitive())
            .collect();
        // First-order only: the gradients are constants to the graph.
        B::softmax_mix_backward(
            Staged::of(inputs),
            columns,
            weights.into_primitive(),
            output.into_primitive(),
            grad.into_primitive(),
            leave,
            wanted,
            own,
            Staged::of(so_far),
        )
        .into_iter()
        .map(constant::<B, C>)
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use burn::prelude::*;
    use burn::tensor::activation::softmax;
    use burn::tensor::{Distribution, FloatDType, TensorData};

    use super::super::{rms_projection_writing, state_gradient, token_mix, token_mix_leaving};
    use crate::test_util::assert_tensors_close;

    const WIDTH: usize = 20;

    /// How a run makes the logits and the mixtures.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Mixer {
        /// Tensor ops throughout.
        Composed,
        /// The fused projections and mixtures; `slotted`: the states' parts left in their slots
        /// for the projections (else the mixture's own gradients).
        Fused { slotted: bool },
        /// As `Fused { slotted: true }`, with the last state's logit made in the mixture
        /// ([`OwnLogit`](super::OwnLogit)) where it is state 2 or 4 (AttnRes's partial sum).
        OwnLogit,
        /// The fused projections, the logits' softmax from tensor ops and the fused token mix
        /// leaving `(W[:, k], ∂m)` in the slots (AttnRes's form where this op does not apply).
        TokenMix,
    }

    /// Mixtures over states and their logits tables as AttnRes makes them (a projection of each
    /// state onto the queries from its first reader's on, one to three columns; RMS keys with a
    /// large `ε`, written out as tensor ops in the composed form): values and the gradients of
    /// every tracked state and of the queries equal the composed form's, with a state read by
    /// three mixtures, one untracked (its table still tracked through the queries), and in the
    /// `OwnLogit` form the last state's logit made in the mixture at each query column, for a
    /// state read by two mixtures and by an add and for one read by one mixture alone.
    #[test]
    fn fused_equals_composed_with_and_without_slots() {
        const EPSILON: f64 = 0.5;
        // The first query column of each state's table (AttnRes's `first_column`).
        const FIRST: [usize; 5] = [0, 1, 1, 0, 0];
        let device = Device::flex().autodiff();
        for dtype in [FloatDType::F32, FloatDType::F64] {
            let normal = Distribution::Normal(0.0, 1.0);
            let random = |shape: [usize; 3]| {
                Tensor::<3>::random(shape, normal, &device)
                    .cast(dtype)
                    .into_data()
            };
            let leaves: Vec<TensorData> = (0..5).map(|_| random([2, 9, WIDTH])).collect();
            let queries = random([1, WIDTH, 3]);
            let probes: Vec<TensorData> = (0..3).map(|_| random([2, 9, WIDTH])).collect();
            let run = |mixer: Mixer| {
                let tensor =
                    |data: &TensorData| Tensor::<3>::from_data(data.clone(), &device).cast(dtype);
                // Leaf 3 is untracked.
                let leaves: Vec<Tensor<3>> = leaves
                    .iter()
                    .enumerate()
                    .map(|(k, leaf)| tensor(leaf).set_require_grad(k != 3))
                    .collect();
                let queries = tensor(&queries).require_grad();
                let query_matrix = queries.clone().reshape([WIDTH, 3]);
                let x: Vec<Tensor<3>> = leaves.iter().map(|leaf| leaf.clone() * 1.5).collect();
                let slotted = matches!(
                    mixer,
                    Mixer::Fused { slotted: true } | Mixer::TokenMix | Mixer::OwnLogit
                );
                let slots: Vec<_> = x
                    .iter()
                    .map(|x| if slotted { state_gradient(x) } else { None })
                    .collect();
                assert_eq!(slots.iter().all(Option::is_some), slotted);
                // States 2 and 4 are the last of their mixtures: their logits made there.
                let own_logit = |k: usize| mixer == Mixer::OwnLogit && (k == 2 || k == 4);
                let tables: Vec<Option<Tensor<3>>> = (0..5)
                    .map(|k| {
                        if own_logit(k) {
                            return None;
                        }
                        let rows = x[k].clone().reshape([18, WIDTH]);
                        let weights = query_matrix.clone().narrow(1, FIRST[k], 3 - FIRST[k]);
                        let columns = weights.dims()[1];
                        let projected = match mixer {
                            Mixer::Composed => {
                                let scale = (rows.clone().square().mean_dim(1) + EPSILON).sqrt();
                                (rows / scale).matmul(weights)
                            }
                            _ => rms_projection_writing(rows, weights, EPSILON, slots[k].as_ref()),
                        };
                        Some(projected.reshape([2, 9, columns]))
                    })
                    .collect();
                let mix = |column: usize, picked: &[usize]| {
                    let count = picked.len();
                    let last = picked[count - 1];
                    let mut columns: Vec<usize> =
                        picked.iter().map(|&k| column - FIRST[k]).collect();
                    let states: Vec<Tensor<3>> = picked.iter().map(|&k| x[k].clone()).collect();
                    let mut slots: Vec<_> = picked.iter().map(|&k| slots[k].clone()).collect();
                    if own_logit(last) {
                        let tables: Vec<Tensor<3>> = picked[..count - 1]
                            .iter()
                            .map(|&k| tables[k].clone().expect("a table"))
                            .collect();
                        columns[count - 1] = column;
                        slots[count - 1] = None;
                        let own = super::OwnLogit {
                            weights: query_matrix.clone(),
                            epsilon: EPSILON,
                        };
                        return super::fused_softmax_mix(
                            &tables,
                            &columns,
                            &states,
                            &slots,
                            Some(&own),
                        )
                        .expect("applies on Flex");
                    }
                    let tables: Vec<Tensor<3>> = picked
                        .iter()
                        .map(|&k| tables[k].clone().expect("a table"))
                        .collect();
                    if let Mixer::Fused { .. } = mixer {
                        return super::fused_softmax_mix(&tables, &columns, &states, &slots, None)
                            .expect("applies on Flex");
                    }
                    let logits = tables
                        .into_iter()
                        .zip(&columns)
                        .map(|(table, &c)| table.narrow(2, c, 1))
                        .collect();
                    let weights = softmax(Tensor::cat(logits, 2), 2);
                    match mixer {
                        Mixer::TokenMix => token_mix_leaving(weights, states, slots),
                        _ => token_mix::composed(weights, states),
                    }
                };
                let first = mix(0, &[0, 3, 4]);
                let second = mix(1, &[0, 1, 3, 2]);
                let third = mix(2, &[0, 1, 3, 2]) + x[2].clone();
                let loss = (first * tensor(&probes[0])).sum()
                    + (second * tensor(&probes[1])).sum()
                    + (third.clone() * tensor(&probes[2])).sum();
                let grads = loss.backward();
                let mut out = vec![third.into_data()];
                out.extend(
                    leaves
                        .iter()
                        .enumerate()
                        .filter(|&(k, _)| k != 3)
                        .map(|(_, l)| l.grad(&grads).unwrap().into_data()),
                );
                out.push(queries.grad(&grads).unwrap().into_data());
                out
            };
            // To the entry or to the tensor's scale: the queries' gradients sum terms over every
            // row and mixture, in another order in each form.
            let relative = match dtype {
                FloatDType::F64 => 1e-10,
                _ => 1e-4,
            };
            let composed = run(Mixer::Composed);
            let fused = [true, false].map(|slotted| Mixer::Fused { slotted });
            for mixer in fused.into_iter().chain([Mixer::TokenMix, Mixer::OwnLogit]) {
                let case = format!("{mixer:?} in {dtype:?}");
                assert_tensors_close(&run(mixer), &composed, relative, &case);
            }
        }
    }
}
