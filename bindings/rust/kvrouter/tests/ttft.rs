//! The predicted-TTFT cost (`RouterOptions::cost_function`, its per-request overrides) and the
//! router's clock driven by hand (`set_time`).

mod common;

use common::{prompt, router, BS};
use kvrouter::{Code, CostFunction, RequestOptions, Router, RouterOptions, WorkerConfig};

#[test]
fn predicted_ttft_options_default_and_refuse_bad_values() {
    let d = RouterOptions::default();
    assert_eq!(d.cost_function, CostFunction::Credit);
    assert_eq!(
        (d.ttft_miss_weight, d.prefill_tokens_per_second),
        (3.0, 0.0)
    );
    let opts = RequestOptions::default();
    assert_eq!((opts.cost_function, opts.ttft_miss_weight), (None, None));

    for bad in [
        RouterOptions {
            ttft_miss_weight: -1.0,
            ..Default::default()
        },
        RouterOptions {
            ttft_miss_weight: f64::INFINITY,
            ..Default::default()
        },
        RouterOptions {
            cost_function: CostFunction::PredictedTtft,
            track_prefill_tokens: false,
            ..Default::default()
        },
    ] {
        let e = Router::new(&bad).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}: {e}");
    }
    // An unknown cost function cannot be written in CostFunction; the library's refusal of one
    // is tested in C (tests/capi/routing_test.c).
    let router = router(1);
    let p = prompt(1, 2);
    let e = router
        .find_best_match(
            &p,
            &RequestOptions {
                ttft_miss_weight: Some(-1.0),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    router
        .find_best_match(
            &p,
            &RequestOptions {
                cost_function: Some(CostFunction::PredictedTtft),
                ttft_miss_weight: Some(0.5),
                ..Default::default()
            },
        )
        .unwrap();
    // Time never goes back.
    router.set_time(5_000_000_000).unwrap();
    router.set_time(5_000_000_000).unwrap();
    let e = router.set_time(4_999_999_999).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
}

/// Worker 1 prefills ten times as fast as the others (its requests complete in 10 ms of the
/// router's clock, theirs in 100 ms): with a 512-token backlog it still gives a fresh
/// 512-token prompt its first token soonest, which the predicted-TTFT cost sees and the credit
/// form does not.
#[test]
fn predicted_ttft_follows_the_calibrated_rates() {
    const WORKERS: u64 = 4;
    let router = Router::new(&RouterOptions {
        random_seed: 7,
        cost_function: CostFunction::PredictedTtft,
        ..RouterOptions::with_block_size(BS)
    })
    .unwrap();
    for id in 1..=WORKERS {
        router.add_worker(&WorkerConfig::new(id)).unwrap();
    }
    let mut now: i64 = 5_000_000_000;
    router.set_time(now).unwrap();
    let warm = prompt(1, 32);
    for i in 0..16 {
        for id in 1..=WORKERS {
            let name = format!("warm-{id}-{i}");
            router
                .add_request(&warm, id, 0, &RequestOptions::with_id(&name))
                .unwrap();
            now += if id == 1 { 10_000_000 } else { 100_000_000 };
            router.set_time(now).unwrap();
            router.mark_prefill_completed(&name).unwrap();
            router.free_request(&name).unwrap();
        }
    }
    router
        .add_request(&prompt(2, 32), 1, 0, &RequestOptions::with_id("backlog"))
        .unwrap();
    let fresh = prompt(3, 32); // cached nowhere
    let mut candidates = Vec::new();
    let (r, total) = router
        .find_best_match_with_candidates(&fresh, &RequestOptions::default(), &mut candidates)
        .unwrap();
    assert_eq!((r.worker_id, total), (1, WORKERS as usize));
    for c in &candidates {
        // Seconds: (backlog + 3 × 512 tokens) at thousands of tokens per second.
        assert!(c.cost > 0.0 && c.cost < 1.0, "{c:?}");
    }
    // The credit form, asked for this request only, avoids worker 1's backlog.
    let r = router
        .find_best_match(
            &fresh,
            &RequestOptions {
                cost_function: Some(CostFunction::Credit),
                ..Default::default()
            },
        )
        .unwrap();
    assert_ne!(r.worker_id, 1);
}
