//! Staged routing (preview, plan, commit, abort), plan deadlines, pins, sessions, the
//! admission queue, and disaggregated prefill / decode.

mod common;

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::{prompt, router, store, BS};
use kvrouter::{
    Code, Disagg, DisaggOptions, DisaggPolicy, Phase, PrefillReason, RequestOptions, Router,
    RouterOptions, RoutingHints, SessionMode, WorkerConfig,
};

/// Replicas compare index digests: two routers holding the same blocks agree, and a booking
/// moves the state digest but not the index digest.
#[test]
fn the_index_digest_is_the_blocks_alone() {
    let (a, b) = (router(2), router(2));
    let tokens = prompt(4, 3);
    store(&a, 1, &tokens, 3, 10);
    store(&a, 2, &tokens, 1, 20);
    store(&b, 2, &tokens, 1, 20); // the other order
    store(&b, 1, &tokens, 3, 10);
    let digest = a.index_digest().unwrap();
    assert_eq!(b.index_digest().unwrap(), digest);

    let state = a.state_digest().unwrap();
    a.find_best_match(&tokens, &RequestOptions::admit("booked"))
        .unwrap();
    assert_ne!(a.state_digest().unwrap(), state);
    assert_eq!(a.index_digest().unwrap(), digest);
}

#[test]
fn a_preview_changes_nothing_and_a_plan_books() {
    let router = router(3);
    let tokens = prompt(1, 8);
    store(&router, 2, &tokens, 8, 100);
    let before = router.state_digest().unwrap();
    let opts = RequestOptions::with_id("p1");
    let hints = RoutingHints {
        session_id: Some("s"),
        ..Default::default()
    };
    let mut preview = None;
    for _ in 0..1000 {
        preview = Some(router.preview_route(&tokens, &opts, Some(&hints)).unwrap());
    }
    let preview = preview.unwrap();
    assert_eq!(router.state_digest().unwrap(), before);
    assert_eq!(
        (
            preview.worker_id,
            preview.overlap_blocks,
            preview.prompt_blocks
        ),
        (2, 8, 8)
    );
    assert!(!preview.booked);

    let plan = router
        .plan_route(&tokens, &opts, None, Some(&preview))
        .unwrap();
    assert!(plan.booked && !plan.moved);
    assert_eq!(plan.worker_id, 2);
    assert_ne!(router.state_digest().unwrap(), before);
    assert_eq!(router.metrics().unwrap().requests_active, 1);
    // Idempotent: the same id returns the live plan.
    assert_eq!(
        router
            .plan_route(&tokens, &opts, None, None)
            .unwrap()
            .worker_id,
        2
    );

    router.commit_route("p1").unwrap();
    router.commit_route("p1").unwrap(); // committed and active: OK
    router.free_request("p1").unwrap();
    assert_eq!(router.metrics().unwrap().requests_active, 0);
    assert_eq!(
        router.commit_route("p1").unwrap_err().code(),
        Code::NotFound
    );

    // Abort frees a plan once; unknown ids are no error.
    router
        .plan_route(&tokens, &RequestOptions::with_id("p2"), None, None)
        .unwrap();
    assert!(router.abort_route("p2").unwrap());
    assert!(!router.abort_route("p2").unwrap());
    assert_eq!(router.metrics().unwrap().requests_active, 0);

    // A previewed rank that is gone: the plan moves.
    let gone = router.preview_route(&tokens, &opts, None).unwrap();
    router.remove_worker(gone.worker_id).unwrap();
    let moved = router
        .plan_route(&tokens, &RequestOptions::with_id("p3"), None, Some(&gone))
        .unwrap();
    assert!(moved.moved);
    assert_ne!(moved.worker_id, gone.worker_id);
}

#[test]
fn plans_expire_after_their_deadline() {
    let router = router(2);
    let tokens = prompt(2, 2);
    assert_eq!(
        router.set_plan_deadline(Duration::ZERO).unwrap_err().code(),
        Code::InvalidArgument
    );
    // Time passes when the test says: a stalled test thread sees no plan expire early.
    router.set_time(0).unwrap();
    router
        .set_plan_deadline(Duration::from_millis(300))
        .unwrap();
    router
        .plan_route(&tokens, &RequestOptions::with_id("late"), None, None)
        .unwrap();
    router
        .plan_route(&tokens, &RequestOptions::with_id("later"), None, None)
        .unwrap();
    assert_eq!(router.expire_plans().unwrap(), 0);
    router.set_time(400_000_000).unwrap();
    assert_eq!(router.expire_plans().unwrap(), 2);
    assert_eq!(
        router.commit_route("late").unwrap_err().code(),
        Code::NotFound
    );
    assert_eq!(router.metrics().unwrap().requests_active, 0);
}

#[test]
fn a_lost_request_expires_on_demand() {
    let router = router(1);
    let tokens = prompt(2, 2);
    router.set_time(0).unwrap();
    router
        .find_best_match(&tokens, &RequestOptions::admit("lost"))
        .unwrap();
    assert_eq!(router.expire_requests().unwrap(), 0);
    router.set_time(301_000_000_000).unwrap(); // past the default 300 s expiry
    assert_eq!(router.expire_requests().unwrap(), 1);
    assert_eq!(router.metrics().unwrap().requests_active, 0);
}

#[test]
fn pins_restrict_the_candidates() {
    let router = router(3);
    let tokens = prompt(3, 4);
    store(&router, 1, &tokens, 4, 100);
    let pin3 = RoutingHints {
        worker_id: Some(3),
        ..Default::default()
    };
    let r = router
        .preview_route(&tokens, &RequestOptions::default(), Some(&pin3))
        .unwrap();
    assert_eq!(r.worker_id, 3);

    let pin9 = RoutingHints {
        worker_id: Some(9),
        ..Default::default()
    };
    let e = router
        .preview_route(&tokens, &RequestOptions::default(), Some(&pin9))
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    let allowed = [1u64, 2];
    let opts = RequestOptions {
        allowed_worker_ids: Some(&allowed),
        ..Default::default()
    };
    let e = router
        .preview_route(&tokens, &opts, Some(&pin3))
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // The phase picks the pin: a decode pin is ignored in the prefill phase.
    let prefill = RoutingHints {
        phase: Phase::Prefill,
        decode_worker_id: Some(3),
        prefill_worker_id: Some(2),
        ..Default::default()
    };
    let r = router
        .preview_route(&tokens, &RequestOptions::default(), Some(&prefill))
        .unwrap();
    assert_eq!(r.worker_id, 2);
}

#[test]
fn sessions_bind_at_commit() {
    let router = router(3);
    let tokens = prompt(4, 4);
    let hints = RoutingHints {
        session_id: Some("conversation-7"),
        worker_id: Some(2),
        session_mode: SessionMode::Soft,
        ..Default::default()
    };
    router
        .plan_route(&tokens, &RequestOptions::with_id("a"), Some(&hints), None)
        .unwrap();
    assert_eq!(router.session_binding("conversation-7").unwrap(), None);
    router.commit_route("a").unwrap();
    assert_eq!(
        router.session_binding("conversation-7").unwrap(),
        Some((2, 0))
    );

    // Unpinned, the session keeps the conversation on worker 2 although worker 3 holds the
    // prompt... in soft mode, while worker 2 is a candidate.
    store(&router, 3, &tokens, 4, 100);
    let follow = RoutingHints {
        session_id: Some("conversation-7"),
        ..Default::default()
    };
    let r = router
        .preview_route(&tokens, &RequestOptions::default(), Some(&follow))
        .unwrap();
    assert_eq!(r.worker_id, 2);

    router.close_session("conversation-7").unwrap();
    assert_eq!(router.session_binding("conversation-7").unwrap(), None);

    // A short TTL lapses and is reclaimed. Time passes when the test says.
    router.set_time(0).unwrap();
    let short = RoutingHints {
        session_id: Some("brief"),
        session_ttl: Some(Duration::from_millis(300)), // not lapsed before it is checked
        ..Default::default()
    };
    router
        .plan_route(&tokens, &RequestOptions::with_id("b"), Some(&short), None)
        .unwrap();
    router.commit_route("b").unwrap();
    assert!(router.session_binding("brief").unwrap().is_some());
    router.set_time(400_000_000).unwrap();
    assert_eq!(router.session_binding("brief").unwrap(), None);
    assert_eq!(router.reclaim_sessions().unwrap(), 1);
}

#[test]
fn the_admission_queue_blocks_and_times_out() {
    let router = Router::new(&RouterOptions {
        queue_threshold: Some(0.5),
        ..RouterOptions::with_block_size(BS)
    })
    .unwrap();
    router
        .add_worker(&WorkerConfig {
            max_num_batched_tokens: 64,
            ..WorkerConfig::new(1)
        })
        .unwrap();
    let tokens = prompt(5, 8); // 128 prefill tokens > 0.5 × 64
    let first = router
        .find_best_match(&tokens, &RequestOptions::admit("q1"))
        .unwrap();
    assert!(!first.queued);

    // The worker is over the threshold: the next admission waits, then gives up.
    let opts = RequestOptions {
        queue_timeout: Some(Duration::from_millis(50)),
        ..RequestOptions::admit("q2")
    };
    let start = Instant::now();
    let e = router.find_best_match(&tokens, &opts).unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded);
    assert!(start.elapsed() >= Duration::from_millis(40));
    // A sub-millisecond timeout waits (a whole millisecond), not 0 ms = give up at once.
    let brief = RequestOptions {
        queue_timeout: Some(Duration::from_micros(500)),
        ..RequestOptions::admit("q2")
    };
    let start = Instant::now();
    let e = router.find_best_match(&tokens, &brief).unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded);
    assert!(
        start.elapsed() >= Duration::from_micros(500),
        "gave up after {:?}",
        start.elapsed()
    );
    assert_eq!(router.metrics().unwrap().queue_pending, 0);

    // A waiter is admitted when the first request's prefill completes.
    std::thread::scope(|s| {
        let waiter = s.spawn(|| router.find_best_match(&tokens, &RequestOptions::admit("q3")));
        common::wait_for("q3 to queue", || {
            (router.metrics().unwrap().queue_pending == 1).then_some(())
        });
        router.mark_prefill_completed("q1").unwrap();
        let admitted = waiter.join().unwrap().unwrap();
        assert!(admitted.queued && admitted.booked);
    });
}

/// A shutdown closes the queue: a call waiting there with no timeout (which nothing else would
/// end) fails with `Cancelled`, and so does every later one that would wait, at once; previews
/// and requests admitted at once go on. Idempotent.
#[test]
fn closing_the_queue_cancels_its_waiters_for_good() {
    let router = Arc::new(
        Router::new(&RouterOptions {
            queue_threshold: Some(0.0),
            ..RouterOptions::with_block_size(BS)
        })
        .unwrap(),
    );
    router
        .add_worker(&WorkerConfig {
            max_num_batched_tokens: 16,
            ..WorkerConfig::new(1)
        })
        .unwrap();
    let tokens = prompt(9, 4);
    let busy = router
        .find_best_match(&tokens, &RequestOptions::admit("busy"))
        .unwrap();
    assert!(busy.booked && !busy.queued); // the only rank is now over the threshold

    // Not a scoped thread: were the waiter never woken, the test fails below instead of hanging.
    let (sent, waited) = mpsc::channel();
    let waiter = {
        let (router, tokens) = (Arc::clone(&router), tokens.clone());
        std::thread::spawn(move || {
            let r = router.find_best_match(&tokens, &RequestOptions::admit("waiting"));
            sent.send(r).unwrap();
        })
    };
    common::wait_for("the request to queue", || {
        (router.metrics().unwrap().queue_pending == 1).then_some(())
    });
    assert_eq!(router.close_queue().unwrap(), 1);
    let e = waited
        .recv_timeout(Duration::from_secs(10))
        .expect("the waiting call was not woken")
        .unwrap_err();
    assert_eq!(e.code(), Code::Cancelled, "{e}");
    waiter.join().unwrap();
    assert_eq!(router.metrics().unwrap().queue_pending, 0);

    // A later request that would wait is cancelled at once (not after its timeout).
    let late = RequestOptions {
        queue_timeout: Some(Duration::from_secs(30)),
        ..RequestOptions::admit("late")
    };
    let start = Instant::now();
    let e = router.find_best_match(&tokens, &late).unwrap_err();
    assert_eq!(e.code(), Code::Cancelled, "{e}");
    assert!(start.elapsed() < Duration::from_secs(10));

    // Previews still work; so does a request admitted at once, once there is room.
    let preview = router
        .find_best_match(&tokens, &RequestOptions::default())
        .unwrap();
    assert_eq!((preview.worker_id, preview.booked), (1, false));
    router.free_request("busy").unwrap();
    let fresh = router
        .find_best_match(&tokens, &RequestOptions::admit("fresh"))
        .unwrap();
    assert!(fresh.booked && !fresh.queued);
    router.free_request("fresh").unwrap();

    assert_eq!(router.close_queue().unwrap(), 0);
    assert_eq!(router.metrics().unwrap().requests_active, 0);
}

fn disagg(policy: DisaggPolicy, prefill_workers: u64) -> Disagg {
    let opts = RouterOptions::with_block_size(BS);
    let d = Disagg::new(
        &opts,
        &opts,
        &DisaggOptions {
            policy,
            ..Default::default()
        },
    )
    .unwrap();
    for w in 0..prefill_workers {
        d.prefill_router()
            .add_worker(&WorkerConfig::new(10 + w))
            .unwrap();
    }
    d.decode_router()
        .add_worker(&WorkerConfig::new(20))
        .unwrap();
    d.decode_router()
        .add_worker(&WorkerConfig::new(21))
        .unwrap();
    d
}

#[test]
fn disaggregated_prefill_then_decode() {
    let d = disagg(DisaggPolicy::Always, 2);
    let tokens = prompt(6, 8);
    store(d.prefill_router(), 11, &tokens, 8, 100);
    let opts = RequestOptions::with_id("d1");

    let prefill = d.route_prefill(&tokens, &opts, None).unwrap();
    assert!(prefill.remote);
    assert_eq!(prefill.reason, PrefillReason::Remote);
    assert_eq!(prefill.worker_id, 11);
    assert_eq!(prefill.cached_tokens, 8 * u64::from(BS));
    assert!(prefill.bootstrap_room.is_some_and(|r| r >= 0));
    assert_eq!(d.prefill_router().metrics().unwrap().requests_active, 1);

    let decode = d.route_decode(&tokens, &opts, None, true).unwrap();
    assert!(decode.booked);
    assert!([20, 21].contains(&decode.worker_id));
    assert_eq!(d.decode_router().metrics().unwrap().requests_active, 1);

    // Busy check: well under 1 × the default 10 M batched tokens.
    assert!(!d
        .prefill_worker_busy(&tokens, &RequestOptions::default(), 1.0)
        .unwrap());

    d.prefill_router().free_request("d1").unwrap();
    d.decode_router().free_request("d1").unwrap();

    // An empty allow-list allows no worker of either pool: Unavailable, nothing booked (and
    // no prefill rank is free).
    let nobody = RequestOptions {
        allowed_worker_ids: Some(&[]),
        ..RequestOptions::with_id("d2")
    };
    let e = d.route_prefill(&tokens, &nobody, None).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    let e = d.route_decode(&tokens, &nobody, None, true).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(d.prefill_worker_busy(&tokens, &nobody, 1.0).unwrap());
    assert_eq!(d.prefill_router().metrics().unwrap().requests_active, 0);
    assert_eq!(d.decode_router().metrics().unwrap().requests_active, 0);

    // With no prefill workers the request runs aggregated on the decode pool...
    let alone = disagg(DisaggPolicy::Always, 0);
    let r = alone.route_prefill(&tokens, &opts, None).unwrap();
    assert!(!r.remote);
    assert_eq!(r.reason, PrefillReason::NoPrefillWorkers);
    assert_eq!(r.bootstrap_room, None);
    // ... and an empty prefill pool is busy by definition.
    assert!(alone
        .prefill_worker_busy(&tokens, &RequestOptions::default(), 1.0)
        .unwrap());

    // ... unless enforced.
    let strict_opts = RouterOptions::with_block_size(BS);
    let strict = Disagg::new(
        &strict_opts,
        &strict_opts,
        &DisaggOptions {
            enforce: true,
            ..Default::default()
        },
    )
    .unwrap();
    strict
        .decode_router()
        .add_worker(&WorkerConfig::new(20))
        .unwrap();
    let e = strict.route_prefill(&tokens, &opts, None).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
}

#[test]
fn conditional_disaggregation_keeps_short_prompts_local() {
    let opts = RouterOptions::with_block_size(BS);
    let d = Disagg::new(
        &opts,
        &opts,
        &DisaggOptions {
            policy: DisaggPolicy::IslBounding,
            max_local_prefill_tokens: 64,
            decode_busy_threshold: Some(0.9),
            ..Default::default()
        },
    )
    .unwrap();
    d.prefill_router()
        .add_worker(&WorkerConfig::new(10))
        .unwrap();
    d.decode_router()
        .add_worker(&WorkerConfig {
            total_kv_blocks: 10_000,
            ..WorkerConfig::new(20)
        })
        .unwrap();
    let short = prompt(7, 2); // 32 tokens uncached <= 64
    let r = d
        .route_prefill(&short, &RequestOptions::with_id("s"), None)
        .unwrap();
    assert!(!r.remote);
    assert_eq!(r.reason, PrefillReason::ShortIsl);
    let long = prompt(8, 16);
    let r = d
        .route_prefill(&long, &RequestOptions::with_id("l"), None)
        .unwrap();
    assert!(r.remote);
}
