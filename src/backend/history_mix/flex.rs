//! The history mix on Flex: CPU loops over the states, parallel over slices of the output.

use std::mem::MaybeUninit;

use burn::tensor::{DType, Shape, TensorData};
use burn_flex::{Flex, FlexTensor};
use rayon::prelude::*;

use super::{History, HistoryMixBackend, Records, Wanted};
use crate::backend::flex_kernels::{
    Scalar, add_weighted_sum, contiguous, dot, dots, from_f64, to_f64, unwritten, written, zeroed,
};

/// Elements per parallel task: a 16 kB (f32) slice of the output stays in L1 while every
/// state's slice is added to it.
const ELEMENTS_PER_TASK: usize = 4096;

/// What the Flex ops keep of a history.
#[derive(Default)]
pub(super) struct Storage {
    /// The pushed states (contiguous), `None` once nothing needs them.
    states: Vec<Option<FlexTensor>>,
    /// Each mix's weights, in the order of its states.
    weights: Vec<Vec<f64>>,
    /// `∂m_t` of the mixes whose backward has run, until their oldest state's gradient is out.
    grads: Vec<Option<FlexTensor>>,
    /// `∂W_g` so far, per segment.
    weight_grads: Vec<Vec<f64>>,
}

impl Storage {
    /// Drops state `index` (nothing where the history runs on another backend).
    pub(super) fn forget(&mut self, index: usize) {
        if let Some(state) = self.states.get_mut(index) {
            *state = None;
        }
    }

    #[cfg(test)]
    pub(super) fn kept(&self) -> Vec<usize> {
        (0..self.states.len())
            .filter(|&k| self.states[k].is_some())
            .collect()
    }
}

fn slice<E: Scalar>(tensor: &FlexTensor) -> &[E] {
    tensor
        .as_slice::<E>()
        .expect("history tensors are contiguous")
}

fn flex_tensor<E: Scalar>(values: Vec<E>, shape: Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

fn placeholder<E: Scalar>() -> FlexTensor {
    flex_tensor(vec![E::zero()], Shape::new([1]))
}

/// `out += Σ_k c_k x_k` over one task's range: `out` read and written once for all the terms.
fn weighted_sum<E: Scalar>(out: &mut [E], terms: &[(E, &[E])], start: usize) {
    let end = start + out.len();
    let terms: Vec<(E, &[E])> = terms.iter().map(|&(c, x)| (c, &x[start..end])).collect();
    add_weighted_sum(out, &terms);
}

/// `⟨a, b⟩`, parallel over slices.
fn state_dot<E: Scalar>(a: &[E], b: &[E]) -> E {
    a.par_chunks(ELEMENTS_PER_TASK)
        .zip(b.par_chunks(ELEMENTS_PER_TASK))
        .map(|(a, b)| dot(a, b))
        .reduce(E::zero, |x, y| x + y)
}

fn forward<E: Scalar>(
    records: &mut Records,
    mix: usize,
    weights: &FlexTensor,
    newest: FlexTensor,
) -> FlexTensor {
    let newest = contiguous(newest);
    let shape = newest.layout().shape().clone();
    let storage = &mut records.flex;
    storage.states.resize_with(mix + 1, || None);
    storage.states[mix] = Some(newest);
    let plan = &records.mixes[mix];
    // `W_g` may be of another float type than the states (parameters vs input).
    let all_weights: Vec<f64> = weights.clone().into_data().iter::<f64>().collect();
    let mix_weights: Vec<f64> = plan.positions.iter().map(|&k| all_weights[k]).collect();
    let terms: Vec<(E, &[E])> = plan
        .states
        .iter()
        .zip(&mix_weights)
        .map(|(&state, &weight)| {
            let tensor = storage.states[state]
                .as_ref()
                .expect("history mix: state kept");
            assert_eq!(tensor.layout().shape(), &shape, "history mix: state shapes");
            (from_f64(weight), slice::<E>(tensor))
        })
        .collect();
    let mut out = unwritten::<E>(shape.num_elements());
    out.par_chunks_mut(ELEMENTS_PER_TASK)
        .enumerate()
        .for_each(|(task, out)| weighted_sum(zeroed(out), &terms, task * ELEMENTS_PER_TASK));
    // SAFETY: the tasks' chunks partition `out`, and each was zeroed.
    let out = unsafe { written(out) };
    if storage.weight_grads.is_empty() {
        storage.weight_grads = (records.segments.iter())
            .map(|segment| vec![0.0; segment.length])
            .collect();
    }
    storage.weights.resize_with(mix + 1, Vec::new);
    storage.weights[mix] = mix_weights;
    flex_tensor(out, shape)
}

fn backward<E: Scalar>(
    records: &mut Records,
    mix: usize,
    grad: FlexTensor,
    wanted: Wanted,
) -> (FlexTensor, FlexTensor) {
    let (weights_wanted, newest_wanted) = (wanted.weights, wanted.newest);
    let shape = grad.layout().shape().clone();
    let mix_count = records.mixes.len();
    let [_, row] = records.packed_layout(grad.dtype());
    let Records {
        mixes,
        segments,
        flex,
        ..
    } = records;
    flex.grads.resize_with(mix_count, || None);
    flex.grads[mix] = Some(contiguous(grad));
    // The mix's newest state is the one it pushed.
    let newest = mix;
    // Every mix over the newest state has run its backward by now (it depends on this one):
    // (its weight of x_n, its segment and position there, ∂m_t).
    let contributions: Vec<(E, (usize, usize), &[E])> = (mix..mix_count)
        .filter_map(|t| {
            let term = mixes[t].states.iter().position(|&s| s == newest)?;
            let weight = from_f64::<E>(flex.weights[t][term]);
            let grad = flex.grads[t].as_ref()?;
            let at = (mixes[t].segment, mixes[t].positions[term]);
            Some((weight, at, slice::<E>(grad)))
        })
        .collect();
    let state: &[E] = if weights_wanted {
        slice::<E>(flex.states[newest].as_ref().expect("kept for backward"))
    } else {
        &[]
    };
    let scaled: Vec<(E, &[E])> = contributions.iter().map(|&(w, _, g)| (w, g)).collect();
    let len = shape.num_elements();
    let mut grad_newest = unwritten::<E>(if newest_wanted { len } else { 0 });
    let mut newest_tasks: Vec<&mut [MaybeUninit<E>]> =
        grad_newest.chunks_mut(ELEMENTS_PER_TASK).collect();
    newest_tasks.resize_with(len.div_ceil(ELEMENTS_PER_TASK), || &mut []);
    let task_dots: Vec<Vec<E>> = newest_tasks
        .into_par_iter()
        .enumerate()
        .map(|(task, out)| {
            let start = task * ELEMENTS_PER_TASK;
            if !out.is_empty() {
                weighted_sum(zeroed(out), &scaled, start);
            }
            if state.is_empty() {
                return Vec::new();
            }
            let range = start..(start + ELEMENTS_PER_TASK).min(len);
            let grads: Vec<&[E]> = scaled
                .iter()
                .map(|(_, grad)| &grad[range.clone()])
                .collect();
            let mut products = vec![E::zero(); grads.len()];
            dots(&state[range], &grads, &mut products);
            products
        })
        .collect();
    if weights_wanted {
        let own = slice::<E>(flex.grads[mix].as_ref().expect("recorded above"));
        let segment = mixes[mix].segment;
        let orphans: Vec<((usize, usize), f64)> = mixes[mix]
            .orphans(mixes)
            .map(|(state, position)| {
                let state = slice::<E>(flex.states[state].as_ref().expect("never dropped"));
                ((segment, position), to_f64(state_dot(state, own)))
            })
            .collect();
        let sums = &mut flex.weight_grads;
        for task in &task_dots {
            for (&(_, (g, position), _), value) in contributions.iter().zip(task) {
                sums[g][position] += to_f64(*value);
            }
        }
        for ((g, position), value) in orphans {
            sums[g][position] += value;
        }
    }
    let grad_newest = if newest_wanted {
        // SAFETY: the tasks' chunks partition `grad_newest`, and each was zeroed.
        flex_tensor(unsafe { written(grad_newest) }, shape)
    } else {
        placeholder::<E>()
    };
    let grad_weights = if wanted.hand_over {
        let mut packed = vec![E::zero(); segments.len() * row];
        for (g, sums) in flex.weight_grads.iter().enumerate() {
            for (k, &value) in sums.iter().enumerate() {
                packed[g * row + k] = from_f64(value);
            }
        }
        flex_tensor(packed, Shape::new([segments.len(), row]))
    } else {
        placeholder::<E>()
    };
    // Nothing reads the newest state again, nor the gradients of mixes whose oldest state it is.
    flex.states[newest] = None;
    for (plan, grad) in mixes.iter().zip(flex.grads.iter_mut()).skip(mix) {
        if plan.states.iter().min() == Some(&newest) {
            *grad = None;
        }
    }
    (grad_weights, grad_newest)
}

impl HistoryMixBackend for Flex {
    fn history_mix(
        history: History,
        mix: usize,
        weights: FlexTensor,
        newest: FlexTensor,
    ) -> FlexTensor {
        let mut records = history.lock();
        match newest.dtype() {
            DType::F32 => forward::<f32>(&mut records, mix, &weights, newest),
            DType::F64 => forward::<f64>(&mut records, mix, &weights, newest),
            other => panic!("history mix: unsupported dtype {other:?}"),
        }
    }

    fn history_mix_backward(
        history: History,
        mix: usize,
        grad: FlexTensor,
        wanted: Wanted,
    ) -> (FlexTensor, FlexTensor) {
        let mut records = history.lock();
        match grad.dtype() {
            DType::F32 => backward::<f32>(&mut records, mix, grad, wanted),
            DType::F64 => backward::<f64>(&mut records, mix, grad, wanted),
            other => panic!("history mix: unsupported dtype {other:?}"),
        }
    }

    fn history_weight_segment(history: History, packed: FlexTensor, segment: usize) -> FlexTensor {
        let length = history.lock().segments[segment].length;
        let row = packed.layout().shape()[1];
        let values: Vec<f64> = packed.clone().into_data().iter::<f64>().collect();
        let part = values[segment * row..segment * row + length].to_vec();
        FlexTensor::from_data(TensorData::new(part, [length]).convert_dtype(packed.dtype()))
    }
}
