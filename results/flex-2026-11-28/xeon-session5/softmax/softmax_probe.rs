//! Throwaway (not committed): time of small ops forward + backward on Flex.
use burn::prelude::*;
use burn::tensor::activation::softmax;
use std::time::Instant;

fn time(n: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..20 {
        f();
    }
    let start = Instant::now();
    for _ in 0..n {
        f();
    }
    start.elapsed().as_secs_f64() * 1e6 / n as f64
}

fn main() {
    let device = burn_connectivity::device::device("flex")
        .unwrap()
        .autodiff();
    let rnd = |shape: [usize; 3]| {
        Tensor::<3>::random(shape, burn::tensor::Distribution::Default, &device)
    };
    for k in [2usize, 7, 13] {
        let logits = rnd([8, 128, k]).require_grad();
        let probe = rnd([8, 128, k]);
        let bare = time(1000, || {
            let _ = (logits.clone() * probe.clone()).sum().backward();
        });
        let sm = time(1000, || {
            let _ = (softmax(logits.clone(), 2) * probe.clone())
                .sum()
                .backward();
        });
        let exp = time(1000, || {
            let _ = (logits.clone().exp() * probe.clone()).sum().backward();
        });
        let maxd = time(1000, || {
            let _ = (logits.clone().max_dim(2) * probe.clone().narrow(2, 0, 1))
                .sum()
                .backward();
        });
        let sumd = time(1000, || {
            let _ = (logits.clone().sum_dim(2) * probe.clone().narrow(2, 0, 1))
                .sum()
                .backward();
        });
        let div = time(1000, || {
            let _ = (logits.clone() / logits.clone().sum_dim(2).detach() * probe.clone())
                .sum()
                .backward();
        });
        println!(
            "k={k}: bare {bare:.1} softmax +{:.1} exp +{:.1} max_dim +{:.1} sum_dim +{:.1} div-by-sum +{:.1} us",
            sm - bare,
            exp - bare,
            maxd - bare,
            sumd - bare,
            div - bare
        );
    }
    for s in [3usize, 7, 12] {
        let tables: Vec<_> = (0..s).map(|_| rnd([8, 128, 13]).require_grad()).collect();
        let probe = rnd([8, 128, s]);
        let bare = time(500, || {
            let _ = (tables[0].clone().narrow(2, 0, s.min(13))
                * probe.clone().narrow(2, 0, s.min(13)))
            .sum()
            .backward();
        });
        let gather = time(500, || {
            let cols: Vec<_> = tables.iter().map(|t| t.clone().narrow(2, 3, 1)).collect();
            let _ = (Tensor::cat(cols, 2) * probe.clone()).sum().backward();
        });
        let probe_all = rnd([8, 128, 13 * s]);
        let cat = time(500, || {
            let _ = (Tensor::cat(tables.clone(), 2) * probe_all.clone())
                .sum()
                .backward();
        });
        let bare_all = time(500, || {
            let _ = (probe_all.clone().require_grad() * probe_all.clone())
                .sum()
                .backward();
        });
        println!(
            "S={s}: gather_column composed +{:.1} us, cat +{:.1} us",
            gather - bare,
            cat - bare_all
        );
    }
}
