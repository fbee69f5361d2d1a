//! Weighted sums over a history of states as one fused CPU op on Flex, with its own backward:
//! ANCRe's mixtures and DenseFormer's averages.
//!
//! Both connectivities form, once per block, a sum over earlier states of one shape, with
//! weights taken from one weight vector `W` per forward pass (ANCRe's `p`, flattened; DWA's `α`s
//! side by side):
//!
//! ```text
//! m_t = Σ_{s ∈ S_t} W[k(t, s)] x_s
//!
//! ∂W[k(t, s)] = ⟨x_s, ∂m_t⟩            ∂x_n = Σ_{t : n ∈ S_t} W[k(t, n)] ∂m_t
//! ```
//!
//! Composed from tensor ops, every term is a scaled copy and an add forward, and a scaled copy of
//! `∂m_t`, a product with its reduction and an add into `∂x_s` backward: `O(K²)` full-size
//! temporaries over `K` blocks, each a separate pass. Here a mix is one pass forward (it reads
//! its `|S_t|` states and writes `m_t`) and one backward, which reads its newest state `x_n` and
//! the gradients `∂m_t` of every mix over it, and writes `∂x_n` whole and every `∂W[k(t, n)]`.
//!
//! The mixes of one forward pass share a [`History`]. Mix `t` pushes its **newest** state `x_n`
//! (the last of `S_t`) and records `S_t`; the connectivities call it so that each state is the
//! newest of the first mix over it. Every later mix over `x_n` then depends on mix `t`'s output,
//! so the autodiff graph runs its backward first and leaves its `∂m_t'` in the history, and mix
//! `t`'s backward emits everything that involves `x_n` at once; its parents are `W` and `x_n`.
//! A mix whose backward never runs (its output not on the path to the loss) adds nothing, as it
//! should. States and gradients are dropped from the history as soon as nothing needs them.
//! Flex only (f32 and f64); other backends compose the same sums from tensor ops.

use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Shape, Tensor, TensorData};
use burn_flex::{Flex, FlexTensor};
use rayon::prelude::*;

use super::autodiff::constant;
use super::flex_kernels::{
    Scalar, add_weighted_sum, dots, from_f64, to_f64, unwritten, written, zeroed,
};

/// Elements per parallel task: a 16 kB (f32) slice of the output stays in L1 while every
/// state's slice is added to it.
const ELEMENTS_PER_TASK: usize = 4096;

/// The states and mixes of one forward pass, shared by its mix ops (see the [module docs](self)).
#[derive(Clone, Default)]
pub(crate) struct History(Arc<Mutex<Records>>);

impl std::fmt::Debug for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let records = self.lock();
        f.debug_struct("History")
            .field("states", &records.states.len())
            .field("mixes", &records.mixes.len())
            .finish()
    }
}

#[derive(Default)]
struct Records {
    /// The pushed states (contiguous), `None` once nothing needs them.
    states: Vec<Option<FlexTensor>>,
    mixes: Vec<MixRecord>,
    /// `∂m_t` of the mixes whose backward has run, until their oldest state's gradient is out.
    grads: Vec<Option<FlexTensor>>,
    /// States are kept for a backward pass (autodiff) rather than forgotten when told.
    keep_states: bool,
    /// The length and float type of `W` (the same vector for every mix).
    weight_layout: Option<(usize, DType)>,
}

struct MixRecord {
    /// `S_t`, the newest state last.
    states: Vec<usize>,
    /// The positions in `W` of their weights.
    positions: Vec<usize>,
    /// Their weights.
    weights: Vec<f64>,
}

impl History {
    /// An empty history; `keep_states` for a forward pass that a backward pass may follow.
    pub(crate) fn new(keep_states: bool) -> Self {
        let history = Self::default();
        history.lock().keep_states = keep_states;
        history
    }

    fn lock(&self) -> MutexGuard<'_, Records> {
        self.0
            .lock()
            .expect("no mix panics while holding the history")
    }

    /// The indices of the states held.
    #[cfg(test)]
    pub(crate) fn kept_states(&self) -> Vec<usize> {
        let records = self.lock();
        (0..records.states.len())
            .filter(|&k| records.states[k].is_some())
            .collect()
    }

    /// Drops state `index` when no later mix reads it and no backward pass will.
    pub(crate) fn forget(&self, index: usize) {
        let mut records = self.lock();
        if !records.keep_states {
            records.states[index] = None;
        }
    }

    /// `Σ_{(s, k) ∈ terms} W[k] x_s + W[newest_weight] newest`, pushing `newest` as state `n`
    /// after `n` earlier pushes. `W` is the same vector for every mix of the history; every state
    /// of the same shape. Flex devices, f32 or f64.
    pub(crate) fn mix<const D: usize>(
        &self,
        terms: Vec<(usize, usize)>,
        newest_weight: usize,
        weights: Tensor<1>,
        newest: Tensor<D>,
    ) -> Tensor<D> {
        Tensor::from_dispatch(<Dispatch as HistoryMixBackend>::history_mix(
            self.clone(),
            terms,
            newest_weight,
            weights.into_dispatch(),
            newest.into_dispatch(),
        ))
    }
}

/// The fused history mix (see the [module docs](self)).
#[backend_extension(Flex: cfg(feature = "flex"), Autodiff)]
pub(crate) trait HistoryMixBackend: Backend {
    /// `Σ_{(s, k) ∈ terms} W[k] x_s + W[newest_weight] newest`; pushes `newest` into `history`.
    fn history_mix(
        history: History,
        terms: Vec<(usize, usize)>,
        newest_weight: usize,
        weights: FloatTensor<Self>,
        newest: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// Records `grad = ∂m_mix` and returns, for the mix's newest state `x_n`, the part of `∂W`
    /// that involves it and its whole gradient (each a `[1]` placeholder where `wanted` says
    /// it is not needed).
    fn history_mix_backward(
        history: History,
        mix: usize,
        grad: FloatTensor<Self>,
        wanted: [bool; 2],
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

fn contiguous(tensor: FlexTensor) -> FlexTensor {
    if tensor.is_contiguous() && tensor.layout().start_offset() == 0 {
        tensor
    } else {
        tensor.to_contiguous()
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

fn forward<E: Scalar>(
    history: &History,
    terms: &[(usize, usize)],
    newest_weight: usize,
    weights: &FlexTensor,
    newest: FlexTensor,
) -> FlexTensor {
    let mut records = history.lock();
    let newest = contiguous(newest);
    let shape = newest.layout().shape().clone();
    let index = records.states.len();
    records.states.push(Some(newest));
    let (states, positions): (Vec<usize>, Vec<usize>) = terms
        .iter()
        .copied()
        .chain([(index, newest_weight)])
        .unzip();
    // `W` may be of another float type than the states (parameters vs input).
    let weights_dtype = weights.dtype();
    let all_weights: Vec<f64> = weights.clone().into_data().iter::<f64>().collect();
    let weights: Vec<f64> = positions.iter().map(|&k| all_weights[k]).collect();
    let terms: Vec<(E, &[E])> = states
        .iter()
        .zip(&weights)
        .map(|(&state, &weight)| {
            let tensor = records.states[state]
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
    records.weight_layout = Some((all_weights.len(), weights_dtype));
    records.mixes.push(MixRecord {
        states,
        positions,
        weights,
    });
    flex_tensor(out, shape)
}

fn backward<E: Scalar>(
    history: &History,
    mix: usize,
    grad: FlexTensor,
    [weights_wanted, newest_wanted]: [bool; 2],
) -> (FlexTensor, FlexTensor) {
    let mut records = history.lock();
    let shape = grad.layout().shape().clone();
    let mix_count = records.mixes.len();
    records.grads.resize_with(mix_count, || None);
    records.grads[mix] = Some(contiguous(grad));
    let newest = *records.mixes[mix].states.last().expect("a mix has a state");
    let (grad_weights, grad_newest) = {
        let records = &*records;
        // Every mix over the newest state has run its backward by now (it depends on this one):
        // (its weight of x_n, its position in W, ∂m_t).
        let contributions: Vec<(E, usize, &[E])> = records.mixes[mix..]
            .iter()
            .zip(&records.grads[mix..])
            .filter_map(|(record, grad)| {
                let term = record.states.iter().position(|&s| s == newest)?;
                let weight = from_f64::<E>(record.weights[term]);
                Some((weight, record.positions[term], slice::<E>(grad.as_ref()?)))
            })
            .collect();
        let state: &[E] = if weights_wanted {
            slice::<E>(records.states[newest].as_ref().expect("kept for backward"))
        } else {
            &[]
        };
        let scaled: Vec<(E, &[E])> = contributions.iter().map(|&(w, _, g)| (w, g)).collect();
        let len = shape.num_elements();
        let mut grad_newest = unwritten::<E>(if newest_wanted { len } else { 0 });
        let mut newest_tasks: Vec<&mut [std::mem::MaybeUninit<E>]> =
            grad_newest.chunks_mut(ELEMENTS_PER_TASK).collect();
        newest_tasks.resize_with(len.div_ceil(ELEMENTS_PER_TASK), || &mut []);
        let dots: Vec<Vec<E>> = newest_tasks
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
        let grad_weights = if weights_wanted {
            let (count, dtype) = records.weight_layout.expect("set by every mix");
            let mut sums = vec![0.0f64; count];
            for task in &dots {
                for (&(_, position, _), value) in contributions.iter().zip(task) {
                    sums[position] += to_f64(*value);
                }
            }
            FlexTensor::from_data(TensorData::new(sums, [count]).convert_dtype(dtype))
        } else {
            placeholder::<E>()
        };
        let grad_newest = if newest_wanted {
            // SAFETY: the tasks' chunks partition `grad_newest`, and each was zeroed.
            flex_tensor(unsafe { written(grad_newest) }, shape)
        } else {
            placeholder::<E>()
        };
        (grad_weights, grad_newest)
    };
    // Nothing reads the newest state again, nor the gradients of mixes whose oldest state it is.
    records.states[newest] = None;
    let Records { mixes, grads, .. } = &mut *records;
    for (record, grad) in mixes.iter().zip(grads.iter_mut()).skip(mix) {
        if record.states.iter().min() == Some(&newest) {
            *grad = None;
        }
    }
    (grad_weights, grad_newest)
}

impl HistoryMixBackend for Flex {
    fn history_mix(
        history: History,
        terms: Vec<(usize, usize)>,
        newest_weight: usize,
        weights: FlexTensor,
        newest: FlexTensor,
    ) -> FlexTensor {
        match newest.dtype() {
            DType::F32 => forward::<f32>(&history, &terms, newest_weight, &weights, newest),
            DType::F64 => forward::<f64>(&history, &terms, newest_weight, &weights, newest),
            other => panic!("history mix: unsupported dtype {other:?}"),
        }
    }

    fn history_mix_backward(
        history: History,
        mix: usize,
        grad: FlexTensor,
        wanted: [bool; 2],
    ) -> (FlexTensor, FlexTensor) {
        match grad.dtype() {
            DType::F32 => backward::<f32>(&history, mix, grad, wanted),
            DType::F64 => backward::<f64>(&history, mix, grad, wanted),
            other => panic!("history mix: unsupported dtype {other:?}"),
        }
    }
}

/// One mix: parents `[W, x_n]`; the state is the history and the mix's index in it.
#[derive(Debug)]
struct Mix;

impl<B: HistoryMixBackend> Backward<B, 2> for Mix {
    type State = (History, usize);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (history, mix) = ops.state;
        let wanted = ops.parents.each_ref().map(Option::is_some);
        let computed = B::history_mix_backward(history, mix, grad, wanted);
        register_tracked!(grads, ops.parents, <[_; 2]>::from(computed));
    }
}

impl<B: HistoryMixBackend, C: CheckpointStrategy> HistoryMixBackend for Autodiff<B, C> {
    fn history_mix(
        history: History,
        terms: Vec<(usize, usize)>,
        newest_weight: usize,
        weights: FloatTensor<Self>,
        newest: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        // Compute-bound, so never recomputed: a second forward would push its state again.
        // The backward reads its newest state and the gradients later mixes left in the
        // history, kept there rather than checkpointed.
        match Mix
            .prepare::<C>([weights.node(), newest.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let mix = history.lock().mixes.len();
                let output = B::history_mix(
                    history.clone(),
                    terms,
                    newest_weight,
                    weights.into_primitive(),
                    newest.into_primitive(),
                );
                prep.finish((history, mix), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::history_mix(
                history,
                terms,
                newest_weight,
                weights.into_primitive(),
                newest.into_primitive(),
            )),
        }
    }

    // First-order only: the gradients are constants to the graph.
    fn history_mix_backward(
        history: History,
        mix: usize,
        grad: FloatTensor<Self>,
        wanted: [bool; 2],
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (grad_weights, grad_newest) =
            B::history_mix_backward(history, mix, grad.into_primitive(), wanted);
        (
            constant::<B, C>(grad_weights),
            constant::<B, C>(grad_newest),
        )
    }
}

#[cfg(test)]
mod tests {
    use burn::prelude::*;
    use burn::tensor::{Distribution, FloatDType, Tolerance};

    use super::History;

    /// The mixes of a test: `(sources, newest)` per mix, newest pushed as the next state.
    type Plan = Vec<Vec<usize>>;

    /// ANCRe's plan over `k` states (every mix over all earlier states) and DWA's with dilation
    /// 2 (every other state, starting at the mix's parity), as the connectivities call it.
    fn plans() -> Vec<(&'static str, Plan)> {
        let ancre = (0..6).map(|t| (0..t).collect()).collect();
        let dwa = (0..7).map(|t| (t % 2..t).step_by(2).collect()).collect();
        let single = (0..4).map(|_| Vec::new()).collect();
        vec![
            ("all earlier", ancre),
            ("dilation 2", dwa),
            ("newest only", single),
        ]
    }

    /// The inputs of a plan: `x`, a scale per mix, the shared weights (one spare entry), a
    /// probe per mix.
    struct Inputs {
        x: Tensor<3>,
        scales: Vec<Tensor<3>>,
        weights: Tensor<1>,
        probes: Vec<Tensor<3>>,
    }

    /// The position in `W` of term `k` of mix `n` (the newest last): from the end, so that
    /// positions and term order differ.
    fn position(plan: &Plan, n: usize, k: usize) -> usize {
        let before: usize = plan[..n].iter().map(|sources| sources.len() + 1).sum();
        weight_count(plan) - 1 - (before + k)
    }

    fn weight_count(plan: &Plan) -> usize {
        plan.iter().map(|sources| sources.len() + 1).sum::<usize>() + 1
    }

    impl Inputs {
        fn new(plan: &Plan, dtype: FloatDType, device: &Device) -> Self {
            let shape = [3, 5, 2900]; // more than one task of elements
            let random = |low: f64, high: f64| {
                Tensor::<3>::random(shape, Distribution::Uniform(low, high), device).cast(dtype)
            };
            Self {
                x: random(-1.0, 1.0),
                scales: plan.iter().map(|_| random(0.5, 1.5)).collect(),
                weights: Tensor::<1>::random(
                    [weight_count(plan)],
                    Distribution::Uniform(-1.0, 1.0),
                    device,
                )
                .cast(dtype),
                probes: plan.iter().map(|_| random(-1.0, 1.0)).collect(),
            }
        }
    }

    /// Runs a plan: state `n + 1 = tanh(m_n) · a_n` (so later states depend on earlier mixes,
    /// as in a network), loss `Σ_n ⟨probe_n, m_n⟩` over the mixes in `used`. Returns the mixes
    /// and the gradients of the input, of every `a_n` and of the weights.
    fn run(
        plan: &Plan,
        inputs: &Inputs,
        used: &[usize],
        fused: bool,
    ) -> (Vec<TensorData>, Vec<TensorData>) {
        // Fresh leaves on the autodiff device, each run its own graph.
        let device = inputs.x.device().autodiff();
        let dtype = inputs.x.dtype();
        let leaf = |tensor: &Tensor<3>| {
            let tensor: Tensor<3> = Tensor::from_data(tensor.to_data(), &device);
            tensor.cast(dtype).require_grad()
        };
        let x = leaf(&inputs.x);
        assert_eq!(x.dtype(), inputs.x.dtype(), "the run keeps the dtype");
        let scales: Vec<_> = inputs.scales.iter().map(leaf).collect();
        let weights: Tensor<1> = Tensor::from_data(inputs.weights.to_data(), &device);
        let weights = weights.cast(dtype).require_grad();
        let probes: Vec<Tensor<3>> = (inputs.probes.iter())
            .map(|p| Tensor::<3>::from_data(p.to_data(), &device).cast(dtype))
            .collect();
        let history = History::new(true);
        let mut states = vec![x.clone()];
        let mut mixes = Vec::new();
        for (n, sources) in plan.iter().enumerate() {
            let newest = states[n].clone();
            let mixed = if fused {
                let terms = (sources.iter().enumerate())
                    .map(|(k, &s)| (s, position(plan, n, k)))
                    .collect();
                let newest_weight = position(plan, n, sources.len());
                history.mix(terms, newest_weight, weights.clone(), newest)
            } else {
                let terms = sources.iter().copied().chain([n]).enumerate();
                terms
                    .map(|(k, s)| {
                        let at = position(plan, n, k);
                        let weight = weights.clone().slice(at..at + 1).reshape([1, 1, 1]);
                        states[s].clone() * weight
                    })
                    .reduce(|a, b| a + b)
                    .expect("a term")
            };
            states.push(mixed.clone().tanh() * scales[n].clone());
            mixes.push(mixed);
        }
        let loss = used
            .iter()
            .map(|&n| (mixes[n].clone() * probes[n].clone()).sum())
            .reduce(|a, b| a + b)
            .expect("a used mix");
        let grads = loss.backward();
        let mut gradients = vec![x.grad(&grads).expect("x is used").into_data()];
        for scale in &scales {
            // A scale after the last used mix gets no gradient.
            gradients.extend(scale.grad(&grads).map(|g| g.into_data()));
        }
        gradients.push(weights.grad(&grads).expect("weights are used").into_data());
        (
            mixes.into_iter().map(|m| m.into_data()).collect(),
            gradients,
        )
    }

    /// The fused op against the same sums from tensor ops, forward and every gradient, in f32
    /// and f64, with every mix in the loss and with only some (the later mixes' backward never
    /// runs, or runs without reaching the first ones).
    #[test]
    fn fused_mixes_match_the_composed_sums() {
        let device = Device::flex();
        for dtype in [FloatDType::F32, FloatDType::F64] {
            for (name, plan) in plans() {
                let last = plan.len() - 1;
                let inputs = Inputs::new(&plan, dtype, &device);
                assert_eq!(inputs.x.dtype(), dtype.into());
                for used in [
                    (0..=last).collect::<Vec<_>>(),
                    vec![1, last - 1],
                    vec![last],
                ] {
                    let (fused, fused_grads) = run(&plan, &inputs, &used, true);
                    let (composed, composed_grads) = run(&plan, &inputs, &used, false);
                    let tolerance = Tolerance::absolute(1e-4).set_relative(1e-4);
                    assert_eq!(fused_grads.len(), composed_grads.len(), "{name} {used:?}");
                    for (a, b) in fused
                        .iter()
                        .zip(&composed)
                        .chain(fused_grads.iter().zip(&composed_grads))
                    {
                        assert_eq!(a.shape(), b.shape(), "{name} {used:?}");
                        a.assert_approx_eq::<f64>(b, tolerance);
                    }
                }
            }
        }
    }
}
