//! Weighted sums over a history of states as one fused op per sum, with its own backward:
//! ANCRe's mixtures and DenseFormer's averages, on Flex ([`flex`], CPU loops) and on the CubeCL
//! backends ([`cube`], kernels).
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
//! temporaries over `K` blocks, each a separate pass (a kernel each on a GPU). Here a mix is one
//! pass forward (it reads its `|S_t|` states and writes `m_t`) and one backward, which reads its
//! newest state `x_n` and the gradients `∂m_t` of every mix over it, and writes `∂x_n` whole and
//! every `∂W[k(t, n)]`.
//!
//! The mixes of one forward pass share a [`History`]. Mix `t` pushes its **newest** state `x_n`
//! (the last of `S_t`) as state `n = t` and records `S_t`; the connectivities call it so that
//! each state is the newest of the first mix over it, and so that every mix depends on the
//! first. Every later mix over `x_n` then depends on mix `t`'s output, so the autodiff graph runs
//! its backward first and leaves its `∂m_t'` in the history, and mix `t`'s backward emits
//! everything that involves `x_n` at once; its parents are `W` and `x_n`. The inner products of
//! `∂W` add up in the history, and the first tracked mix's backward, the last to run, hands `∂W`
//! over whole (one gradient for `W` per pass, not one per mix). A mix whose backward never runs
//! (its output not on the path to the loss) adds nothing, as it should. A mix with no backward
//! at all (neither `W` nor its newest state tracked, e.g. a copy of an input that needs no
//! gradient, so that the block reading it does not differentiate its input either) leaves its
//! state's inner products `⟨x_s, ∂m_t⟩` to the backward of each mix `t` over it.
//!
//! - **Flex** (f32, f64): states and gradients are dropped from the history as soon as nothing
//!   needs them.
//! - **CubeCL** (any float type; `W` is cast to the states' type where it differs): the history
//!   has a capacity, the number of mixes, and keeps state `n` in row `n` of one `[capacity, len]`
//!   buffer that mix `n`'s forward kernel writes as it reads `x_n`. A mix is then one kernel with
//!   a fixed number of bindings, however many states it reads (no split at the device's binding
//!   limit). Backward, `∂m_t` goes to row `t` of a second such buffer where an earlier state's
//!   backward reads it, and each kernel's cubes add their inner products to one row each of a
//!   `[cubes, |W|]` table, which the first mix's backward sums (a second, small kernel). Per
//!   pass: one kernel per mix forward, one per mix backward, a zero fill and the sum. The
//!   buffers live as long as the graph: `2 · capacity` states' worth of memory. At most
//!   `MAX_CUBE_MIXES` (64) mixes: a backward kernel keeps one partial sum per later mix in
//!   registers; deeper stacks compose.
//!
//! Not differentiable twice.

use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};

use super::ALIGNED_BYTES;
use super::autodiff::{cast_to, constant};
#[cfg(feature = "cube-kernels")]
use super::cube_launch::placeholder_spec;

#[cfg(feature = "cube-kernels")]
mod cube;
#[cfg(feature = "flex")]
mod flex;

/// The states and mixes of one forward pass, shared by its mix ops (see the [module docs](self)).
#[derive(Clone)]
pub(crate) struct History(Arc<Mutex<Records>>);

impl std::fmt::Debug for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let records = self.lock();
        f.debug_struct("History")
            .field("capacity", &records.capacity)
            .field("mixes", &records.mixes.len())
            .finish()
    }
}

struct Records {
    /// What each mix reads, recorded when it is called (a fused backend runs it later).
    mixes: Vec<MixPlan>,
    /// The weight vectors the mixes take their weights from.
    segments: Vec<Segment>,
    /// The most mixes a pass makes.
    capacity: usize,
    /// States are kept for a backward pass (autodiff) rather than forgotten when told.
    keep_states: bool,
    #[cfg(feature = "flex")]
    flex: flex::Storage,
    #[cfg(feature = "cube-kernels")]
    cube: Option<cube::Storage>,
}

/// One mix: `S_t` (the newest, pushed by this mix, last), the weight vector `W_g` it takes
/// their weights from and their positions in it, and whether the mix has a backward (a gradient
/// reaches `W_g` or its newest state).
struct MixPlan {
    states: Vec<usize>,
    segment: usize,
    positions: Vec<usize>,
    tracked: bool,
}

/// A weight vector `W_g` of the history: its length, its float type once a mix has taken it,
/// and its autodiff node once a mix's backward has seen it tracked (its gradient is then
/// registered there).
struct Segment {
    length: usize,
    dtype: Option<DType>,
    node: Option<NodeId>,
}

impl Records {
    /// `(segments, row)` of the packed weights: `W_g` in row `g`, every row `row` elements of
    /// `dtype`, a multiple of [`ALIGNED_BYTES`], so that each `∂W_g` is a view of the packed
    /// gradient.
    fn packed_layout(&self, dtype: DType) -> [usize; 2] {
        let size = dtype.size();
        let longest = self.segments.iter().map(|segment| segment.length).max();
        let bytes = (longest.unwrap_or(1) * size).next_multiple_of(ALIGNED_BYTES);
        [self.segments.len(), bytes / size]
    }

    /// Where weight `position` of mix `mix` lies in the packed weights.
    #[cfg(feature = "cube-kernels")]
    fn packed_position(&self, mix: usize, position: usize, row: usize) -> usize {
        self.mixes[mix].segment * row + position
    }
}

impl MixPlan {
    /// The earlier states of the mix that no backward of their own covers (their mix is not
    /// tracked, typically an input that needs no gradient): where `W` is trained, this mix's
    /// backward takes their inner products `⟨x_s, ∂m_t⟩`. `(state, position)` pairs.
    fn orphans<'a>(&'a self, mixes: &'a [MixPlan]) -> impl Iterator<Item = (usize, usize)> + 'a {
        let earlier = self.states.len() - 1;
        (self.states[..earlier].iter().zip(&self.positions))
            .filter(|&(&state, _)| !mixes[state].tracked)
            .map(|(&state, &position)| (state, position))
    }
}

/// What a mix's backward computes: the inner products of `∂W` (where `W` is trained), `∂W`
/// whole (by the first tracked mix, the last backward to run), the newest state's gradient.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Wanted {
    weights: bool,
    hand_over: bool,
    newest: bool,
}

impl History {
    /// An empty history of at most `capacity` mixes, whose weights come from vectors of the
    /// given lengths (segments); `keep_states` for a forward pass that a backward pass may
    /// follow.
    pub(crate) fn new(keep_states: bool, capacity: usize, segments: &[usize]) -> Self {
        let segments = (segments.iter())
            .map(|&length| Segment {
                length,
                dtype: None,
                node: None,
            })
            .collect();
        Self(Arc::new(Mutex::new(Records {
            mixes: Vec::new(),
            segments,
            capacity,
            keep_states,
            #[cfg(feature = "flex")]
            flex: flex::Storage::default(),
            #[cfg(feature = "cube-kernels")]
            cube: None,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, Records> {
        self.0
            .lock()
            .expect("no mix panics while holding the history")
    }

    /// The indices of the states held (Flex).
    #[cfg(all(test, feature = "flex"))]
    pub(crate) fn kept_states(&self) -> Vec<usize> {
        self.lock().flex.kept()
    }

    /// Drops state `index` when no later mix reads it and no backward pass will (Flex; the
    /// CubeCL buffer holds every state of the pass).
    pub(crate) fn forget(&self, index: usize) {
        #[cfg(feature = "flex")]
        {
            let mut records = self.lock();
            if !records.keep_states {
                records.flex.forget(index);
            }
        }
        #[cfg(not(feature = "flex"))]
        let _ = index;
    }

    /// `Σ_{(s, k) ∈ terms} W_g[k] x_s + W_g[newest_weight] newest`, pushing `newest` as state
    /// `n` after `n` earlier pushes; `W_g = weights` is segment `g` of the history (ANCRe: one
    /// for every mix; DenseFormer: one per average), the same tensor each time it is named, of
    /// the length declared. Every state of the same shape.
    pub(crate) fn mix<const D: usize>(
        &self,
        terms: Vec<(usize, usize)>,
        newest_weight: usize,
        segment: usize,
        weights: Tensor<1>,
        newest: Tensor<D>,
    ) -> Tensor<D> {
        let mix = {
            let mut records = self.lock();
            let mix = records.mixes.len();
            assert!(
                mix < records.capacity,
                "history mix: more mixes than its capacity"
            );
            let known = &mut records.segments[segment];
            assert_eq!(
                known.length,
                weights.dims()[0],
                "history mix: segment length"
            );
            known.dtype = Some(weights.dtype());
            let (mut states, mut positions): (Vec<usize>, Vec<usize>) = terms.into_iter().unzip();
            states.push(mix);
            positions.push(newest_weight);
            records.mixes.push(MixPlan {
                states,
                segment,
                positions,
                tracked: true,
            });
            mix
        };
        Tensor::from_dispatch(<Dispatch as HistoryMixBackend>::history_mix(
            self.clone(),
            mix,
            weights.into_dispatch(),
            newest.into_dispatch(),
        ))
    }
}

/// The fused history mix (see the [module docs](self)).
#[backend_extension(
    Cube: cfg(feature = "cube-kernels"),
    Fusion: cfg(feature = "cube-kernels"),
    Flex: cfg(feature = "flex"),
    Autodiff
)]
pub(crate) trait HistoryMixBackend: Backend {
    /// Mix `mix` of `history` (recorded there): `Σ_{s ∈ S_t} W[k(t, s)] x_s`, `newest` pushed as
    /// its state.
    #[fusion(meta = |_, _, _, newest| newest.clone())]
    fn history_mix(
        history: History,
        mix: usize,
        weights: FloatTensor<Self>,
        newest: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// Records `grad = ∂m_mix` and returns the packed `∂W` (`[segments, row]` in `grad`'s
    /// float type, from the first tracked mix, whole; a `[1]` placeholder from the others) and
    /// the gradient of the mix's newest state (a `[1]` placeholder where not wanted).
    #[fusion(meta = |history, _, grad, wanted| (
        if wanted.hand_over {
            let shape = history.lock().packed_layout(grad.dtype);
            burn::backend::fusion::custom::TensorSpec::new(burn::tensor::Shape::new(shape), grad.dtype)
        } else {
            placeholder_spec(grad)
        },
        if wanted.newest { grad.clone() } else { placeholder_spec(grad) },
    ))]
    fn history_mix_backward(
        history: History,
        mix: usize,
        grad: FloatTensor<Self>,
        wanted: Wanted,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `∂W_g`, row `segment` of the packed gradient cut to `W_g`'s length (a view where the
    /// backend has them).
    #[fusion(meta = |history, packed, segment| burn::backend::fusion::custom::TensorSpec::new(
        burn::tensor::Shape::new([history.lock().segments[*segment].length]),
        packed.dtype,
    ))]
    fn history_weight_segment(
        history: History,
        packed: FloatTensor<Self>,
        segment: usize,
    ) -> FloatTensor<Self>;
}

/// One mix: parents `[W_g, x_n]`; the state is the history and the mix's index in it. Each
/// `∂W_g` is registered once, by the first tracked mix.
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
        let [weights_parent, newest_parent] = ops.parents;
        let wanted = {
            let mut records = history.lock();
            let segment = records.mixes[mix].segment;
            if let Some(parent) = &weights_parent {
                records.segments[segment].node = Some(parent.id);
            }
            let first_tracked = records.mixes.iter().position(|plan| plan.tracked);
            let trained = records
                .segments
                .iter()
                .any(|segment| segment.node.is_some());
            Wanted {
                weights: trained,
                hand_over: trained && first_tracked == Some(mix),
                newest: newest_parent.is_some(),
            }
        };
        let (packed, grad_newest) = B::history_mix_backward(history.clone(), mix, grad, wanted);
        if wanted.hand_over {
            let segments: Vec<(usize, NodeId, DType)> = (history.lock().segments.iter())
                .enumerate()
                .filter_map(|(g, segment)| Some((g, segment.node?, segment.dtype?)))
                .collect();
            for (segment, node, dtype) in segments {
                let grad = B::history_weight_segment(history.clone(), packed.clone(), segment);
                grads.register::<B>(node, cast_to::<B>(grad, dtype));
            }
        }
        if let Some(newest) = newest_parent {
            grads.register::<B>(newest.id, grad_newest);
        }
    }
}

impl<B: HistoryMixBackend, C: CheckpointStrategy> HistoryMixBackend for Autodiff<B, C> {
    fn history_mix(
        history: History,
        mix: usize,
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
                let output = B::history_mix(
                    history.clone(),
                    mix,
                    weights.into_primitive(),
                    newest.into_primitive(),
                );
                prep.finish((history, mix), output)
            }
            OpsKind::UnTracked(prep) => {
                history.lock().mixes[mix].tracked = false;
                prep.finish(B::history_mix(
                    history,
                    mix,
                    weights.into_primitive(),
                    newest.into_primitive(),
                ))
            }
        }
    }

    // First-order only: the gradients are constants to the graph.
    fn history_mix_backward(
        history: History,
        mix: usize,
        grad: FloatTensor<Self>,
        wanted: Wanted,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (packed, grad_newest) =
            B::history_mix_backward(history, mix, grad.into_primitive(), wanted);
        (constant::<B, C>(packed), constant::<B, C>(grad_newest))
    }

    fn history_weight_segment(
        history: History,
        packed: FloatTensor<Self>,
        segment: usize,
    ) -> FloatTensor<Self> {
        constant::<B, C>(B::history_weight_segment(
            history,
            packed.into_primitive(),
            segment,
        ))
    }
}

#[cfg(test)]
mod tests {
    use burn::prelude::*;
    use burn::tensor::FloatDType;

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
            // Fixed draws (uniform in `(low, high]`, a seed per tensor): a case that fails
            // fails again.
            let mut seed = 0;
            let mut random = |shape: Vec<usize>, low: f64, high: f64| {
                seed += 1;
                let mut uniform = crate::test_util::fixed_uniform(seed);
                let count = shape.iter().product();
                let values: Vec<f32> = (0..count)
                    .map(|_| (low + (high - low) * uniform()) as f32)
                    .collect();
                TensorData::new(values, shape)
            };
            let shape = vec![3, 5, 2900]; // more than one task of elements
            let mut states = |low: f64, high: f64| {
                Tensor::<3>::from_data(random(shape.clone(), low, high), device).cast(dtype)
            };
            let x = states(-1.0, 1.0);
            let scales = plan.iter().map(|_| states(0.5, 1.5)).collect();
            let probes = plan.iter().map(|_| states(-1.0, 1.0)).collect();
            let weights = random(vec![weight_count(plan)], -1.0, 1.0);
            Self {
                x,
                scales,
                weights: Tensor::<1>::from_data(weights, device).cast(dtype),
                probes,
            }
        }
    }

    /// Runs a plan: state `n + 1 = tanh(m_n) · a_n` (so later states depend on earlier mixes,
    /// as in a network), loss `Σ_n ⟨probe_n, m_n⟩` over the mixes in `used`. Returns the mixes
    /// and the gradients of the input, of every `a_n` and of the weights. With `orphan_first`
    /// the input needs no gradient and the first mix takes `W` untracked: it has no backward
    /// (DenseFormer's `Y_0 = X_0`), and the later mixes' backward covers its state.
    fn run(
        plan: &Plan,
        inputs: &Inputs,
        used: &[usize],
        fused: bool,
        orphan_first: bool,
    ) -> (Vec<TensorData>, Vec<TensorData>) {
        // Fresh leaves on the autodiff device, each run its own graph.
        let device = inputs.x.device().autodiff();
        let dtype = inputs.x.dtype();
        let leaf = |tensor: &Tensor<3>| {
            let tensor: Tensor<3> = Tensor::from_data(tensor.to_data(), &device);
            tensor.cast(dtype).require_grad()
        };
        let x = if orphan_first {
            Tensor::<3>::from_data(inputs.x.to_data(), &device).cast(dtype)
        } else {
            leaf(&inputs.x)
        };
        assert_eq!(x.dtype(), inputs.x.dtype(), "the run keeps the dtype");
        let scales: Vec<_> = inputs.scales.iter().map(leaf).collect();
        let weights: Tensor<1> = Tensor::from_data(inputs.weights.to_data(), &device);
        let weights = weights.cast(dtype).require_grad();
        let probes: Vec<Tensor<3>> = (inputs.probes.iter())
            .map(|p| Tensor::<3>::from_data(p.to_data(), &device).cast(dtype))
            .collect();
        let history = History::new(true, plan.len(), &[weight_count(plan)]);
        let mut states = vec![x.clone()];
        let mut mixes = Vec::new();
        for (n, sources) in plan.iter().enumerate() {
            let newest = states[n].clone();
            let weights = if orphan_first && n == 0 {
                weights.clone().set_require_grad(false)
            } else {
                weights.clone()
            };
            let mixed = if fused {
                let terms = (sources.iter().enumerate())
                    .map(|(k, &s)| (s, position(plan, n, k)))
                    .collect();
                let newest_weight = position(plan, n, sources.len());
                history.mix(terms, newest_weight, 0, weights.clone(), newest)
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
        let mut gradients = Vec::new();
        if !orphan_first {
            gradients.push(x.grad(&grads).expect("x is used").into_data());
        }
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

    /// The fused op against the same sums from tensor ops on `device`, forward and every
    /// gradient, with every mix in the loss and with only some (the later mixes' backward never
    /// runs, or runs without reaching the first ones).
    /// `tolerance`: relative, in f32 (see `assert_tensors_close`).
    fn assert_fused_matches_composed(device: &Device, dtypes: &[FloatDType], tolerance: f64) {
        for &dtype in dtypes {
            for (name, plan) in plans() {
                let last = plan.len() - 1;
                let inputs = Inputs::new(&plan, dtype, device);
                assert_eq!(inputs.x.dtype(), dtype.into());
                let cases = [
                    ((0..=last).collect::<Vec<_>>(), false),
                    (vec![1, last - 1], false),
                    (vec![last], false),
                    ((0..=last).collect::<Vec<_>>(), true),
                    (vec![last], true),
                ];
                for (used, orphan_first) in cases {
                    let (fused, fused_grads) = run(&plan, &inputs, &used, true, orphan_first);
                    let (composed, composed_grads) =
                        run(&plan, &inputs, &used, false, orphan_first);
                    // `∂W` sums ~10⁴ products in another order: an entry that cancels keeps
                    // their rounding (see `assert_tensors_close`). f64 to 1e-9, far below f32.
                    let relative = match dtype {
                        FloatDType::F64 => 1e-9,
                        _ => tolerance,
                    };
                    crate::test_util::assert_tensors_close(
                        &[fused, fused_grads].concat(),
                        &[composed, composed_grads].concat(),
                        relative,
                        &format!("{name} {used:?} {dtype:?}"),
                    );
                }
            }
        }
    }

    #[test]
    fn fused_mixes_match_the_composed_sums() {
        assert_fused_matches_composed(&Device::flex(), &[FloatDType::F32, FloatDType::F64], 1e-4);
    }

    /// In f16 the kernels sum in f32: the mixes and `∂W` over states of 2²⁰ entries, whose
    /// 1024 cubes' partial sums `column_sums` adds (the offsets make the sums grow against
    /// each term; the probes' 1e-2 keeps them inside f16's range). The composed reference runs
    /// on Flex: lavapipe stops a shader's loops after 65535 iterations in all (Mesa's
    /// `LP_MAX_TGSI_LOOP_ITERATIONS`), so Burn's reductions of a `[1, 1, 1]` factor's gradient
    /// over these states come out short there (262132 for 2²⁰ ones), not on a GPU.
    #[cfg(feature = "wgpu")]
    #[test]
    fn half_precision_kernels_sum_in_f32() {
        use crate::test_util::fixed_normal;
        let wgpu = crate::device::device("wgpu").expect("wgpu compiled in");
        let plan: Plan = vec![vec![], vec![0], vec![0, 1]];
        let shape = [4, 512, 512];
        let draw = |seed: u64, mean: f64, std: f64| fixed_normal(shape, std, seed, &wgpu) + mean;
        let x = draw(1, 1.0, 0.3);
        let scales: Vec<Tensor<3>> = (0..plan.len())
            .map(|n| draw(10 + n as u64, 1.0, 0.2))
            .collect();
        let probes: Vec<Tensor<3>> = (0..plan.len())
            .map(|n| draw(20 + n as u64, 1e-2, 3e-3))
            .collect();
        let weights = fixed_normal([weight_count(&plan)], 0.2, 30, &wgpu) + 0.5;
        let used: Vec<usize> = (0..plan.len()).collect();
        crate::test_util::assert_half_sums_in_f32("history mix", |dtype, fused| {
            let device = if fused { wgpu.clone() } else { Device::flex() };
            let on =
                |tensor: &Tensor<3>| Tensor::<3>::from_data(tensor.to_data(), &device).cast(dtype);
            let inputs = Inputs {
                x: on(&x),
                scales: scales.iter().map(on).collect(),
                weights: Tensor::<1>::from_data(weights.to_data(), &device).cast(dtype),
                probes: probes.iter().map(on).collect(),
            };
            let (mut results, gradients) = run(&plan, &inputs, &used, fused, false);
            // The other gradients pass through Burn's element-wise ops in f16 as well.
            results.extend(gradients.last().cloned());
            results
        });
    }

    /// The CubeCL kernels (one per mix forward and backward, the states in one buffer). `∂W`
    /// entries are f32 sums of ~10⁴ products, summed in another order than Burn's reduction:
    /// they agree to ~2e-4 relative.
    #[cfg(feature = "wgpu")]
    #[test]
    fn kernels_match_the_composed_sums() {
        let wgpu = crate::device::device("wgpu").expect("wgpu compiled in");
        assert_fused_matches_composed(&wgpu, &[FloatDType::F32], 1e-3);
    }
}
