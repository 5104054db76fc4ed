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

/// Every request's prefill completes 100 ms after its booking on the router's clock: the
/// fleet's rate is learnt as 560 / 0.1 = 5,600 tokens per second, one rate for every rank. A
/// fresh 512-token prompt is then priced in seconds at that rate, (backlog + 512) / rate +
/// 3 × 512 / rate, so worker 1, with a 512-token backlog, is avoided; the credit form, asked for
/// this request only, prices blocks again.
#[test]
fn predicted_ttft_prices_seconds_at_the_learnt_rate() {
    const WORKERS: u64 = 4;
    const WARM_BLOCKS: usize = 35; // 560 tokens
    const PREFILL_BLOCKS: usize = 32; // 512 tokens
    let rate = (WARM_BLOCKS as f64 * BS as f64) / 0.1;
    let prefill = PREFILL_BLOCKS as f64 * BS as f64;
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
    let warm = prompt(1, WARM_BLOCKS);
    for i in 0..4 {
        for id in 1..=WORKERS {
            let name = format!("warm-{id}-{i}");
            router
                .add_request(&warm, id, 0, &RequestOptions::with_id(&name))
                .unwrap();
            now += 100_000_000;
            router.set_time(now).unwrap();
            router.mark_prefill_completed(&name).unwrap();
            router.free_request(&name).unwrap();
        }
    }
    router
        .add_request(
            &prompt(2, PREFILL_BLOCKS),
            1,
            0,
            &RequestOptions::with_id("backlog"),
        )
        .unwrap();
    let fresh = prompt(3, PREFILL_BLOCKS); // cached nowhere
    let mut candidates = Vec::new();
    let (r, total) = router
        .find_best_match_with_candidates(&fresh, &RequestOptions::default(), &mut candidates)
        .unwrap();
    assert_eq!(total, WORKERS as usize);
    assert_ne!(r.worker_id, 1, "{candidates:?}");
    for c in &candidates {
        // (backlog + 512) / rate + 3 × 512 / rate: 0.457 s behind worker 1's backlog, 0.366 s.
        let backlog = if c.worker_id == 1 { prefill } else { 0.0 };
        let expected = (backlog + 4.0 * prefill) / rate;
        assert!((c.cost - expected).abs() < 1e-9, "{c:?}: want {expected}");
    }
    // The credit form, asked for this request only, prices blocks: 512 / 16 + 32 new = 64.
    let r = router
        .find_best_match(
            &fresh,
            &RequestOptions {
                cost_function: Some(CostFunction::Credit),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(r.cost, 64.0);
    // Time never goes back.
    let e = router.set_time(now - 1).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
}
