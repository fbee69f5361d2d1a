//! burn-nn transformer encoders wrapped by `ConnectedEncoder`: the presets against the plain
//! encoder, the closed forms of H-ACN and ANCRe at every granularity, DepthLN, readouts and
//! truncation, loading a saved encoder, and the errors.

use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderInput};
use burn::tensor::{Distribution, Tolerance};

use burn::module::Param;
use burn::nn::LayerNorm;
use burn::nn::attention::MhaInput;
use burn::nn::transformer::TransformerEncoder;
use burn::nn::transformer::TransformerEncoderLayer;
use burn::prelude::*;
use burn_connectivity::hyperzzw::HyperZzwConnectivityConfig;
use burn_connectivity::transformer::{ConnectedEncoder, EncoderMasks, Granularity};
use burn_connectivity::{
    AncreConfig, Connectivity, Error, GateInit, HacnConfig, Normalization, Result,
};

const WIDTH: usize = 8;
const LAYERS: usize = 3;
const GATES: [f64; 6] = [0.3, 0.7, 0.5, 0.2, 0.9, 0.4];

fn encoder(norm_first: bool, device: &Device) -> TransformerEncoder {
    TransformerEncoderConfig::new(WIDTH, 16, 2, LAYERS)
        .with_norm_first(norm_first)
        .with_dropout(0.0)
        .init(device)
}

fn input(device: &Device) -> Tensor<3> {
    Tensor::random([2, 5, WIDTH], Distribution::Normal(0.0, 1.0), device)
}

/// Causal attention, and the last two positions of the second sequence padded.
fn masks(device: &Device) -> EncoderMasks {
    let pad = Tensor::<1, Int>::arange(0..5, device)
        .reshape([1, 5])
        .repeat_dim(0, 2)
        .greater_equal(Tensor::<2, Int>::from_data([[5], [3]], device));
    EncoderMasks::causal(2, 5, device).with_pad(pad)
}

fn plain(encoder: &TransformerEncoder, input: Tensor<3>, masks: &EncoderMasks) -> Tensor<3> {
    let masks = masks.clone();
    encoder.forward(
        TransformerEncoderInput::new(input)
            .mask_pad(masks.pad.unwrap())
            .mask_attn(masks.attention.unwrap()),
    )
}

/// Equal up to f32 rounding: `1e-5` relative, or `1e-5` of the tensor's largest entry (at
/// least 1). The crate runs the feed-forward on folded rows where burn-nn's reference runs it
/// batched, so the products sum in another order, and on Flex its GELU is its own (within
/// 1.5e-7 of `erf`'s). With random weights, MUDD's dense mixtures reach entries of 3.5–8.7 (six
/// draws), where the two orders once differed by `1.36e-5`; a small entry of such a tensor
/// carries its large neighbours' rounding (one draw in about 60 differed by `1.09e-5` at an
/// entry of 0.18 when the bound was `1e-5` absolute).
fn assert_close(actual: Tensor<3>, expected: Tensor<3>) {
    let scale = expected.clone().abs().max().into_scalar::<f32>().max(1.0);
    actual.into_data().assert_approx_eq::<f32>(
        &expected.into_data(),
        Tolerance::rel_abs(1e-5, 1e-5 * scale),
    );
}

fn gates(blocks: usize) -> HacnConfig {
    HacnConfig::new().with_init(GateInit::Values {
        values: GATES[..blocks].to_vec(),
    })
}

const VARIANTS: [(bool, Granularity); 4] = [
    (true, Granularity::Block),
    (true, Granularity::Sublayer),
    (false, Granularity::Block),
    (false, Granularity::Sublayer),
];

#[test]
fn resnet_preset_is_the_plain_encoder_with_masks() {
    let device = Device::flex();
    let (x, masks) = (input(&device), masks(&device));
    for (norm_first, granularity) in VARIANTS {
        let encoder = encoder(norm_first, &device);
        let expected = plain(&encoder, x.clone(), &masks);
        let model =
            ConnectedEncoder::new(encoder, granularity, &HacnConfig::resnet(), &device).unwrap();
        assert_close(model.forward(x.clone(), &masks), expected);
    }
}

/// One static stream of hyper-connections, DWA, the paper's LAuReL (RW+LR+PA) and MUDD (four
/// ways) at init are exactly the plain encoder at either granularity (a whole layer's update
/// `tail(M_0 + h) − M_0` at block level), mHC and mHC-lite are within their init tolerance.
#[test]
fn multi_stream_and_dense_presets_are_the_plain_encoder() {
    use burn_connectivity::{
        DenseFormerConfig, HyperConnectionsConfig, LaurelConfig, MhcConfig, MhcLiteConfig,
        MuddConfig,
    };
    let device = Device::flex();
    let (x, masks) = (input(&device), masks(&device));
    let one_stream = HyperConnectionsConfig::new(WIDTH)
        .with_streams(1)
        .with_dynamic(false);
    for (norm_first, granularity) in VARIANTS {
        let encoder = encoder(norm_first, &device);
        let expected = plain(&encoder, x.clone(), &masks).into_data();
        let check = |model: Result<Tensor<3>>, tolerance: f64| {
            model
                .unwrap()
                .into_data()
                .assert_approx_eq::<f32>(&expected, Tolerance::absolute(tolerance));
        };
        let layers = || encoder.layers.clone();
        check(
            ConnectedEncoder::from_layers(layers(), granularity, &one_stream, &device)
                .map(|model| model.forward(x.clone(), &masks)),
            1e-5,
        );
        let dwa = DenseFormerConfig::new();
        check(
            ConnectedEncoder::from_layers(layers(), granularity, &dwa, &device)
                .map(|model| model.forward(x.clone(), &masks)),
            1e-6,
        );
        let mhc = MhcConfig::new(WIDTH);
        check(
            ConnectedEncoder::from_layers(layers(), granularity, &mhc, &device)
                .map(|model| model.forward(x.clone(), &masks)),
            1e-2,
        );
        let lite = MhcLiteConfig::new(WIDTH);
        check(
            ConnectedEncoder::from_layers(layers(), granularity, &lite, &device)
                .map(|model| model.forward(x.clone(), &masks)),
            2e-2,
        );
        let laurel = LaurelConfig::rw_lr_pa(WIDTH, 2, 2);
        check(
            ConnectedEncoder::from_layers(layers(), granularity, &laurel, &device)
                .map(|model| model.forward(x.clone(), &masks)),
            1e-5,
        );
        let mudd = MuddConfig::multiway(WIDTH);
        check(
            ConnectedEncoder::from_layers(layers(), granularity, &mudd, &device)
                .map(|model| model.forward(x.clone(), &masks)),
            1e-5,
        );
    }
}

#[test]
fn ancre_residual_preset_is_near_the_plain_encoder() {
    let device = Device::flex();
    let (x, masks) = (input(&device), masks(&device));
    for (norm_first, granularity) in VARIANTS {
        let encoder = encoder(norm_first, &device);
        let expected = plain(&encoder, x.clone(), &masks);
        let config = AncreConfig::residual(1e-6);
        let model = ConnectedEncoder::new(encoder, granularity, &config, &device).unwrap();
        model
            .forward(x.clone(), &masks)
            .into_data()
            .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-4));
    }
}

/// Block level, pre-norm: `a = A(norm_2(s)) + g s`, `s' = a + F(norm_1(a))`,
/// `y = s_0 + Σ_j (s_j − g_j s_{j-1})`, written out by hand.
#[test]
fn hacn_block_level_pre_norm_matches_its_closed_form() {
    let device = Device::flex();
    let (x, masks) = (input(&device), masks(&device));
    let encoder = encoder(true, &device);
    let model =
        ConnectedEncoder::new(encoder, Granularity::Block, &gates(LAYERS), &device).unwrap();

    let (mut stream, mut sum) = (x.clone(), x.clone());
    for (layer, gate) in model.layers.iter().zip(GATES) {
        let carried = stream.clone() * gate;
        let mixed = attention(layer, layer.norm_2.forward(stream), &masks) + carried.clone();
        stream = mixed.clone() + feed_forward(layer, layer.norm_1.forward(mixed));
        sum = sum + stream.clone() - carried;
    }
    assert_close(model.forward(x, &masks), sum);
}

/// Sublayer level, post-norm: `m = norm_1(A(s) + g s)`, `s' = norm_2(F(m) + g' m)`, and the
/// output credits each sublayer with its stream minus the carried part.
#[test]
fn hacn_sublayer_level_post_norm_matches_its_closed_form() {
    let device = Device::flex();
    let (x, masks) = (input(&device), masks(&device));
    let encoder = encoder(false, &device);
    let config = gates(2 * LAYERS);
    let model = ConnectedEncoder::new(encoder, Granularity::Sublayer, &config, &device).unwrap();

    let (mut stream, mut sum) = (x.clone(), x.clone());
    for (layer, pair) in model.layers.iter().zip(GATES.chunks(2)) {
        let carried = stream.clone() * pair[0];
        let mixed = layer
            .norm_1
            .forward(attention(layer, stream, &masks) + carried.clone());
        sum = sum + mixed.clone() - carried;
        let carried = mixed.clone() * pair[1];
        stream = layer
            .norm_2
            .forward(feed_forward(layer, mixed) + carried.clone());
        sum = sum + stream.clone() - carried;
    }
    assert_close(model.forward(x, &masks), sum);
}

/// Sublayer level, pre-norm, is an ordinary connectivity over `2L` branches: ANCRe's
/// progressive mixture must equal `s_j = h_j + Σ_i p_ij s_i` with every state kept.
#[test]
fn ancre_sublayer_level_pre_norm_mixes_every_earlier_state() {
    let device = Device::flex();
    let (x, masks) = (input(&device), masks(&device));
    let config = AncreConfig::new()
        .with_temperature(1.0)
        .with_normalization(Normalization::Ingoing);
    let model = ConnectedEncoder::new(
        encoder(true, &device),
        Granularity::Sublayer,
        &config,
        &device,
    )
    .unwrap();
    let p = model.connectivity.coefficient_values();

    let mut states = vec![x.clone()];
    for (block, layer) in (0..2 * LAYERS).map(|b| (b, &model.layers[b / 2])) {
        let input = states[block].clone();
        let branch = if block % 2 == 0 {
            attention(layer, layer.norm_2.forward(input), &masks)
        } else {
            feed_forward(layer, layer.norm_1.forward(input))
        };
        let mixture = states
            .iter()
            .enumerate()
            .map(|(i, s)| s.clone() * p[i][block + 1])
            .reduce(|a, b| a + b)
            .unwrap();
        states.push(branch + mixture);
    }
    assert_close(model.forward(x, &masks), states.pop().unwrap());
}

/// DepthLN keeps the loaded norms and scales each by `(1 + l·s_l)`: the wrapper equals a
/// hand-written pre-norm block-level H-ACN whose norms are `DepthLn` modules holding the
/// layer's own LayerNorm, at every granularity the scale reaches every norm, and truncation
/// keeps the leading strengths.
#[test]
fn depth_ln_scales_the_loaded_norms_by_depth() {
    use burn_connectivity::DepthLn;
    let device = Device::flex();
    let (x, masks) = (input(&device), masks(&device));
    let strengths = [0.05, -0.3, 0.2];
    let model = ConnectedEncoder::new(
        encoder(true, &device),
        Granularity::Block,
        &gates(LAYERS),
        &device,
    )
    .unwrap()
    .with_depth_ln(0.05)
    .unwrap();
    let model = ConnectedEncoder {
        depth_ln: Some(Param::from_data(strengths, &device)),
        ..model
    };
    let depth_ln = |norm: &LayerNorm, depth: usize| DepthLn {
        norm: norm.clone(),
        strength: Param::from_data([strengths[depth - 1]], &device),
        depth,
    };

    let (mut stream, mut sum) = (x.clone(), x.clone());
    for (index, (layer, gate)) in model.layers.iter().zip(GATES).enumerate() {
        let (norm_1, norm_2) = (
            depth_ln(&layer.norm_1, index + 1),
            depth_ln(&layer.norm_2, index + 1),
        );
        let carried = stream.clone() * gate;
        let mixed = attention(layer, norm_2.forward(stream), &masks) + carried.clone();
        stream = mixed.clone() + feed_forward(layer, norm_1.forward(mixed));
        sum = sum + stream.clone() - carried;
    }
    assert_close(model.forward(x.clone(), &masks), sum);

    // Strength 0 is the plain wrapper; any other changes every variant's output.
    for (norm_first, granularity) in VARIANTS {
        let config = gates(LAYERS * granularity.blocks_per_layer());
        let plain =
            ConnectedEncoder::new(encoder(norm_first, &device), granularity, &config, &device)
                .unwrap();
        let expected = plain.forward(x.clone(), &masks);
        let zero = plain.clone().with_depth_ln(0.0).unwrap();
        assert_close(zero.forward(x.clone(), &masks), expected.clone());
        let scaled = plain.with_depth_ln(0.05).unwrap();
        let difference = (scaled.forward(x.clone(), &masks) - expected)
            .abs()
            .max()
            .into_scalar::<f32>();
        assert!(
            difference > 1e-3,
            "{norm_first} {granularity:?}: {difference}"
        );
        let truncated = scaled.truncated(2).unwrap();
        assert_eq!(truncated.depth_ln.unwrap().dims(), [2]);
    }
    assert!(matches!(
        model.with_depth_ln(f64::NAN),
        Err(Error::NonFinite { .. })
    ));
}

#[test]
fn depth_ln_strengths_train() {
    let device = Device::flex().autodiff();
    let model = ConnectedEncoder::new(
        encoder(true, &device),
        Granularity::Sublayer,
        &gates(2 * LAYERS),
        &device,
    )
    .unwrap()
    .with_depth_ln(0.05)
    .unwrap();
    let grads = model
        .forward(input(&device), &EncoderMasks::default())
        .powf_scalar(2.0)
        .sum()
        .backward();
    let strengths = model.depth_ln.as_ref().unwrap();
    let gradient = gradient(strengths, &grads);
    assert_eq!(gradient.len(), LAYERS);
    assert!(
        gradient.iter().all(|g| g.is_finite() && *g != 0.0),
        "{gradient:?}"
    );
}

/// Module level, pre-norm, for each of the paper's rows: the wrapper equals
/// `m_j = MHSA_j(LN(a_j)) + Σ_i pA_ij a_i`, `a_{j+1} = FFN_j(LN(m_j)) + Σ_i pF_ij m_i`
/// written out with separate attention and feed-forward histories, and the learning
/// families' coefficients are distributions over their own sublayer inputs.
#[test]
fn ancre_module_level_has_two_families() {
    use burn_connectivity::ModuleLevel;
    let device = Device::flex();
    let (x, masks) = (input(&device), masks(&device));
    let size = 2 * LAYERS + 1;
    let logits: Vec<Vec<f64>> = (0..size)
        .map(|i| {
            (0..size)
                .map(|j| ((5 * i + 3 * j) % 7) as f64 * 0.1)
                .collect()
        })
        .collect();
    for level in [
        ModuleLevel::Attention,
        ModuleLevel::FeedForward,
        ModuleLevel::Both,
    ] {
        let config = AncreConfig::module_level(level)
            .with_temperature(1.0)
            .with_init(burn_connectivity::AncreInit::Values {
                logits: logits.clone(),
            });
        let model = ConnectedEncoder::new(
            encoder(true, &device),
            Granularity::Sublayer,
            &config,
            &device,
        )
        .unwrap();
        let p = model.connectivity.coefficient_values();
        // Block 2j+1 is layer j's attention (input a_j = s_{2j}), block 2j+2 its
        // feed-forward (input m_j = s_{2j+1}).
        let (mut attention_inputs, mut feed_forward_inputs) = (vec![x.clone()], vec![]);
        for (j, layer) in model.layers.iter().enumerate() {
            let a = attention_inputs[j].clone();
            let mut m = attention(layer, layer.norm_2.forward(a.clone()), &masks);
            for (i, source) in attention_inputs.iter().enumerate() {
                m = m + source.clone() * p[2 * i][2 * j + 1];
            }
            feed_forward_inputs.push(m.clone());
            let mut next = feed_forward(layer, layer.norm_1.forward(m));
            for (i, source) in feed_forward_inputs.iter().enumerate() {
                next = next + source.clone() * p[2 * i + 1][2 * j + 2];
            }
            attention_inputs.push(next);
        }
        assert_close(
            model.forward(x.clone(), &masks),
            attention_inputs.pop().unwrap(),
        );
        for target in 1..size {
            let family = (target - 1) % 2;
            let learns = match level {
                ModuleLevel::Attention => family == 0,
                ModuleLevel::FeedForward => family == 1,
                ModuleLevel::Both => true,
            };
            let column: Vec<f64> = p.iter().map(|row| row[target]).collect();
            let total: f64 = column.iter().sum();
            assert!((total - 1.0).abs() < 1e-6, "{level:?} column {target}");
            let sources = column.iter().filter(|&&value| value > 0.0).count();
            let expected = if learns { target.div_ceil(2) } else { 1 };
            assert_eq!(sources, expected, "{level:?} column {target}: {column:?}");
        }
    }
}

/// MHSA-only at module level is block level: the same model when the attention family's
/// logits are block level's.
#[test]
fn ancre_mhsa_only_module_level_is_block_level() {
    use burn_connectivity::{AncreInit, ModuleLevel};
    let device = Device::flex();
    let (x, masks) = (input(&device), masks(&device));
    let block_logits: Vec<Vec<f64>> = (0..=LAYERS)
        .map(|i| {
            (0..=LAYERS)
                .map(|j| (i as f64 - 0.3 * j as f64).sin())
                .collect()
        })
        .collect();
    let size = 2 * LAYERS + 1;
    let mut module_logits = vec![vec![0.0; size]; size];
    for (i, row) in block_logits.iter().enumerate() {
        for (j, &logit) in row.iter().enumerate().skip(1) {
            module_logits[2 * i][2 * j - 1] = logit;
        }
    }
    let encoder = encoder(true, &device);
    let block = ConnectedEncoder::new(
        encoder.clone(),
        Granularity::Block,
        &AncreConfig::new().with_init(AncreInit::Values {
            logits: block_logits,
        }),
        &device,
    )
    .unwrap();
    let module = ConnectedEncoder::new(
        encoder,
        Granularity::Sublayer,
        &AncreConfig::module_level(ModuleLevel::Attention).with_init(AncreInit::Values {
            logits: module_logits,
        }),
        &device,
    )
    .unwrap();
    assert_close(module.forward(x.clone(), &masks), block.forward(x, &masks));
}

/// The additive variant: `s_j = T(s_{j-1}) + Σ_i p_ij s_i` with `T` the plain layer
/// (burn-nn's own forward), both norm placements.
#[test]
fn layer_granularity_adds_the_mixture_to_the_whole_layer() {
    let device = Device::flex();
    let x = input(&device);
    let config = AncreConfig::new().with_temperature(1.0);
    for norm_first in [true, false] {
        let encoder = encoder(norm_first, &device);
        let model =
            ConnectedEncoder::new(encoder.clone(), Granularity::Layer, &config, &device).unwrap();
        let p = model.connectivity.coefficient_values();
        let mut states = vec![x.clone()];
        for (j, layer) in encoder.layers.iter().enumerate() {
            let mut next = layer.forward(states[j].clone(), None, None);
            for (i, state) in states.iter().enumerate() {
                next = next + state.clone() * p[i][j + 1];
            }
            states.push(next);
        }
        assert_close(
            model.forward(x.clone(), &EncoderMasks::default()),
            states.pop().unwrap(),
        );
    }
}

#[test]
fn readout_and_truncation_agree() {
    let device = Device::flex();
    let (x, masks) = (input(&device), masks(&device));
    for (norm_first, granularity) in VARIANTS {
        let config = gates(LAYERS * granularity.blocks_per_layer());
        let model =
            ConnectedEncoder::new(encoder(norm_first, &device), granularity, &config, &device)
                .unwrap();
        let readout = model.readout(x.clone(), &masks);
        assert_eq!(readout.len(), LAYERS + 1);
        assert_close(readout[0].clone(), x.clone());
        for (layers, expected) in readout.iter().enumerate().skip(1) {
            let truncated = model.truncated(layers).unwrap();
            assert_eq!(truncated.num_layers(), layers);
            assert_close(truncated.forward(x.clone(), &masks), expected.clone());
        }
        assert_close(model.forward(x.clone(), &masks), readout[LAYERS].clone());
        assert!(model.truncated(0).is_err());
        assert!(model.truncated(LAYERS + 1).is_err());
    }
}

#[test]
fn hyperzzw_connectivity_wraps_an_encoder() {
    let device = Device::flex();
    let x = input(&device);
    let masks = EncoderMasks::causal(2, 5, &device);
    let config = HyperZzwConnectivityConfig::new(WIDTH, 8)
        .with_local_kernel_sizes(vec![])
        .with_hidden(8);
    for granularity in [Granularity::Block, Granularity::Sublayer] {
        let model =
            ConnectedEncoder::new(encoder(true, &device), granularity, &config, &device).unwrap();
        assert_eq!(
            model.connectivity.num_blocks(),
            LAYERS * granularity.blocks_per_layer()
        );
        model.check_input(&x, &masks).unwrap();
        let y = model.forward(x.clone(), &masks);
        assert_eq!(y.dims(), [2, 5, WIDTH]);
        assert!(y.into_data().iter::<f32>().all(f32::is_finite));
        let too_long = Tensor::<3>::zeros([1, 9, WIDTH], &device);
        assert!(
            model
                .check_input(&too_long, &EncoderMasks::default())
                .is_err()
        );
    }
}

#[test]
fn a_saved_encoder_loads_into_the_wrapper() {
    let device = Device::flex();
    let (x, masks) = (input(&device), masks(&device));
    let trained = encoder(true, &device);
    let expected = plain(&trained, x.clone(), &masks);
    let record = trained.into_record();

    let fresh = ConnectedEncoder::new(
        encoder(true, &device),
        Granularity::Sublayer,
        &HacnConfig::resnet(),
        &device,
    )
    .unwrap();
    let loaded = fresh.load_encoder_record(record).unwrap();
    assert_close(loaded.forward(x, &masks), expected);

    let deeper = TransformerEncoderConfig::new(WIDTH, 16, 2, LAYERS + 1).init(&device);
    let fresh = ConnectedEncoder::new(
        encoder(true, &device),
        Granularity::Block,
        &gates(3),
        &device,
    )
    .unwrap();
    let err = fresh.load_encoder_record(deeper.into_record()).unwrap_err();
    assert!(matches!(err, Error::Record(_)), "{err}");
}

#[test]
fn bad_shapes_and_configs_are_errors() {
    let device = Device::flex();
    let model = ConnectedEncoder::new(
        encoder(true, &device),
        Granularity::Block,
        &gates(3),
        &device,
    )
    .unwrap();
    let x = input(&device);
    let wide = Tensor::<3>::zeros([2, 5, WIDTH + 1], &device);
    let err = model
        .check_input(&wide, &EncoderMasks::default())
        .unwrap_err();
    assert!(matches!(err, Error::WidthMismatch { .. }), "{err}");
    let short_mask = EncoderMasks::causal(2, 4, &device);
    let err = model.check_input(&x, &short_mask).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");

    let wrong_count = ConnectedEncoder::new(
        encoder(true, &device),
        Granularity::Sublayer,
        &gates(3),
        &device,
    );
    assert!(matches!(wrong_count, Err(Error::CountMismatch { .. })));
    let empty = ConnectedEncoder::from_layers(vec![], Granularity::Block, &gates(3), &device);
    assert!(matches!(empty, Err(Error::NoBlocks)));
    let mut layers = encoder(true, &device).layers;
    layers.push(
        TransformerEncoderConfig::new(WIDTH * 2, 16, 2, 1)
            .init(&device)
            .layers
            .remove(0),
    );
    let mixed =
        ConnectedEncoder::from_layers(layers, Granularity::Block, &HacnConfig::new(), &device);
    assert!(matches!(mixed, Err(Error::WidthMismatch { .. })));
}

/// The gradient of `param` in `grads`, read back to the host (panics if it has none).
fn gradient<const D: usize>(
    param: &burn::module::Param<Tensor<D>>,
    grads: &burn::tensor::Gradients,
) -> Vec<f64> {
    param
        .val()
        .grad(grads)
        .expect("the parameter has a gradient")
        .into_data()
        .iter()
        .collect()
}

/// `Dropout(MHA(input))` with the masks: burn-nn's attention, for the closed forms.
fn attention(layer: &TransformerEncoderLayer, input: Tensor<3>, masks: &EncoderMasks) -> Tensor<3> {
    let mut query = MhaInput::self_attn(input);
    if let Some(pad) = &masks.pad {
        query = query.mask_pad(pad.clone());
    }
    if let Some(attention) = &masks.attention {
        query = query.mask_attn(attention.clone());
    }
    layer.dropout.forward(layer.mha.forward(query).context)
}

/// `Dropout(FFN(input))`: burn-nn's feed-forward, for the closed forms.
fn feed_forward(layer: &TransformerEncoderLayer, input: Tensor<3>) -> Tensor<3> {
    layer.dropout.forward(layer.pwff.forward(input))
}

/// Full AttnRes (zero queries, output `Sum`) on a pre-norm encoder: every block reads the mean of
/// `x` and the earlier blocks' outputs, at block level (a whole layer's update is one source) and
/// at sublayer level (attention and feed-forward each one), and the output is `x` plus every
/// source; the readout agrees with the truncated models. (burn-nn's pre-norm layer normalises
/// with `norm_2` before the attention and `norm_1` before the feed-forward.)
#[test]
fn attention_residuals_wrap_an_encoder_at_both_granularities() {
    use burn_connectivity::{AttentionResidualsConfig, AttnResOutput};
    let device = Device::flex();
    let (x, masks) = (input(&device), masks(&device));
    let config = AttentionResidualsConfig::new(WIDTH).with_output(AttnResOutput::Sum);
    let mean = |sources: &[Tensor<3>]| {
        let count = sources.len() as f64;
        sources
            .iter()
            .cloned()
            .reduce(|sum, source| sum + source)
            .unwrap()
            .div_scalar(count)
    };
    for granularity in [Granularity::Block, Granularity::Sublayer] {
        let encoder = encoder(true, &device);
        let mut sources = vec![x.clone()];
        for layer in &encoder.layers {
            let h = mean(&sources);
            let attended = attention(layer, layer.norm_2.forward(h.clone()), &masks);
            match granularity {
                Granularity::Sublayer => {
                    sources.push(attended);
                    let h = mean(&sources);
                    sources.push(feed_forward(layer, layer.norm_1.forward(h)));
                }
                _ => {
                    let inner = h.clone() + attended;
                    let out = inner.clone() + feed_forward(layer, layer.norm_1.forward(inner));
                    sources.push(out - h);
                }
            }
        }
        let expected = sources
            .into_iter()
            .reduce(|sum, source| sum + source)
            .unwrap();
        let model = ConnectedEncoder::new(encoder, granularity, &config, &device).unwrap();
        assert_close(model.forward(x.clone(), &masks), expected.clone());
        let readout = model.readout(x.clone(), &masks);
        assert_close(readout[LAYERS].clone(), expected);
        for (layers, expected) in readout.iter().enumerate().skip(1) {
            let truncated = model.truncated(layers).unwrap();
            assert_close(truncated.forward(x.clone(), &masks), expected.clone());
        }
    }
}

/// `Dropout(MHA(query, key, value))` with the masks.
fn attention_apart(
    layer: &TransformerEncoderLayer,
    [query, key, value]: [Tensor<3>; 3],
    masks: &EncoderMasks,
) -> Tensor<3> {
    let mut input = MhaInput::new(query, key, value);
    if let Some(pad) = &masks.pad {
        input = input.mask_pad(pad.clone());
    }
    if let Some(attention) = &masks.attention {
        input = input.mask_attn(attention.clone());
    }
    layer.dropout.forward(layer.mha.forward(input).context)
}

/// MUDD's four ways on a pre-norm encoder at block level, against the equations: the layer's
/// attention takes the query, key and value mixtures apart (each through `norm_2`), its
/// shortcut and the layer's feed-forward the residual way; after each layer the weights are
/// `GELU(rms(X) W1) W2 + a` per token. Random weights, so that every way differs.
#[test]
fn mudd_feeds_query_key_value_apart_to_the_attention() {
    use burn::tensor::activation::gelu;
    use burn_connectivity::MuddConfig;
    let device = Device::flex();
    let (x, masks) = (input(&device), masks(&device));
    let encoder = encoder(true, &device);
    let mut model = ConnectedEncoder::new(
        encoder,
        Granularity::Block,
        &MuddConfig::multiway(WIDTH),
        &device,
    )
    .unwrap();
    for layer in &mut model.connectivity.layers {
        let noise =
            |tensor: Tensor<2>| tensor.clone() + tensor.random_like(Distribution::Normal(0.0, 0.3));
        layer.w2 = Param::from_tensor(noise(layer.w2.val()));
        layer.static_weights = Param::from_tensor(noise(layer.static_weights.val()));
    }
    let mudd = &model.connectivity;
    let mut states = vec![x.clone()];
    let mut ways = vec![x.clone(); 4];
    for (layer, weights) in model.layers.iter().zip(&mudd.layers) {
        let apart = [0, 1, 2].map(|c| layer.norm_2.forward(ways[c].clone()));
        let mixed = ways[3].clone() + attention_apart(layer, apart, &masks);
        let out = mixed.clone() + feed_forward(layer, layer.norm_1.forward(mixed));
        states.push(out.clone());
        let rms = out.clone() / (out.clone().square().mean_dim(2).add_scalar(mudd.epsilon)).sqrt();
        let [batch, length, _] = out.dims();
        let [count, size] = weights.static_weights.dims();
        let z = gelu(
            rms.reshape([batch * length, WIDTH])
                .matmul(weights.w1.val()),
        )
        .matmul(weights.w2.val())
            + weights.static_weights.val().reshape([1, count * size]);
        let z = z.reshape([batch, length, count * size]);
        ways = (0..count)
            .map(|c| {
                states
                    .iter()
                    .enumerate()
                    .map(|(j, state)| z.clone().narrow(2, c * size + j, 1) * state.clone())
                    .reduce(|sum, term| sum + term)
                    .unwrap()
            })
            .collect();
    }
    let expected = ways.last().unwrap().clone();
    assert_close(model.forward(x.clone(), &masks), expected);
    let readout = model.readout(x.clone(), &masks);
    for (layers, expected) in readout.iter().enumerate().skip(1) {
        let truncated = model.truncated(layers).unwrap();
        assert_close(truncated.forward(x.clone(), &masks), expected.clone());
    }
}
