//! `find_best_match_prepared` against `find_best_match`: two routers built alike (same seed,
//! workers, events) receive the same calls, one through each path; every decision, booking and
//! error must be the same (and, with the clocks driven by hand, every cost).

mod common;

use std::time::Duration;

use kvrouter::{
    Code, CostFunction, Multimodal, PreparedRequest, RequestOptions, Result, RouteResult, Router,
    RouterRef,
};

/// Two identical routers of 4 workers, each holding a different depth of the same prompts.
fn twins() -> (Router, Router, Vec<Vec<u32>>) {
    let prompts: Vec<Vec<u32>> = (0..8).map(|s| common::prompt(s, 4)).collect();
    let make = || {
        let router = common::router(4);
        for (i, p) in prompts.iter().enumerate() {
            let worker = i as u64 % 4 + 1;
            common::store(&router, worker, p, 1 + i % 4, 100 * i as u64 + 1);
        }
        router
    };
    (make(), make(), prompts)
}

/// The options of `opts` with `id`, through the per-call path.
fn per_call(
    router: &RouterRef,
    tokens: &[u32],
    opts: &RequestOptions<'_>,
    id: &str,
) -> Result<RouteResult> {
    router.find_best_match(
        tokens,
        &RequestOptions {
            request_id: Some(id),
            ..*opts
        },
    )
}

/// What a router holds for every prompt: per-rank loads (active blocks, prefill tokens and
/// requests) and the metrics' request counts.
fn state(router: &RouterRef, prompts: &[Vec<u32>]) -> Vec<String> {
    let mut out: Vec<String> = prompts
        .iter()
        .map(|p| {
            format!(
                "{:?}",
                router
                    .potential_loads(p, &RequestOptions::default())
                    .unwrap()
            )
        })
        .collect();
    let m = router.metrics().unwrap();
    out.push(format!("{} {}", m.requests_active, m.decisions));
    out
}

/// Runs `opts` through both paths on twin routers: ids booked, booked again (AlreadyExists),
/// freed, and the routers compared after each step.
fn same_through_both_paths(opts: &RequestOptions<'_>) {
    let (a, b, prompts) = twins();
    let mut prepared = PreparedRequest::new(opts).unwrap();
    assert_eq!(prepared.admits(), opts.admit);
    let ids: Vec<String> = (0..24).map(|i| format!("request-{i}")).collect();
    for round in 0..3 {
        // Both clocks driven by hand: the predicted-TTFT cost learns a rate from the time
        // between booking and prefill completed.
        for r in [&a, &b] {
            r.set_time((round as i64 + 1) * 1_000_000_000).unwrap();
        }
        for (i, id) in ids.iter().enumerate() {
            let p = &prompts[(i + round) % prompts.len()];
            let expected = per_call(&a, p, opts, id);
            let got = b.find_best_match_prepared(p, &mut prepared, id);
            assert_eq!(got, expected, "{opts:?}, {id}, round {round}");
            if round == 1 && opts.admit {
                // Booked in round 0: the same AlreadyExists, message included.
                assert_eq!(got.unwrap_err().code(), Code::AlreadyExists);
            }
        }
        assert_eq!(state(&a, &prompts), state(&b, &prompts), "round {round}");
        if round == 1 {
            for id in &ids {
                a.mark_prefill_completed(id).unwrap();
                b.mark_prefill_completed(id).unwrap();
                a.free_request(id).unwrap();
                b.free_request(id).unwrap();
            }
        }
    }
}

#[test]
fn admitted_calls_decide_and_book_as_per_call() {
    same_through_both_paths(&RequestOptions::admit(""));
}

#[test]
fn previews_decide_as_per_call_and_book_nothing() {
    same_through_both_paths(&RequestOptions::default());
    let (a, _, prompts) = twins();
    let mut preview = PreparedRequest::new(&RequestOptions::default()).unwrap();
    let r = a
        .find_best_match_prepared(&prompts[0], &mut preview, "")
        .unwrap();
    assert!(!r.booked);
    assert_eq!(a.metrics().unwrap().requests_active, 0);
}

#[test]
fn every_option_applies_as_per_call() {
    let allowed = [2u64, 3, 4];
    let (hashes, counts) = ([7u64, 8], [1usize, 0, 1, 0]);
    same_through_both_paths(&RequestOptions {
        lora_name: Some("adapter"),
        cache_namespace: Some("tenant-a"),
        allowed_worker_ids: Some(&allowed),
        overlap_score_credit: Some(0.5),
        prefill_load_scale: Some(2.0),
        temperature: Some(0.0),
        assume_kv_reuse: Some(false),
        expected_output_tokens: Some(64),
        decode_active_request_weight: Some(0.5),
        ..RequestOptions::admit("")
    });
    same_through_both_paths(&RequestOptions {
        multimodal: Some(Multimodal {
            hashes: &hashes,
            counts: &counts,
        }),
        cost_function: Some(CostFunction::PredictedTtft),
        queue_timeout: Some(Duration::from_secs(1)),
        ..RequestOptions::admit("")
    });
    // Softmax sampling draws from the router's seeded source: the same draws both ways.
    same_through_both_paths(&RequestOptions {
        temperature: Some(2.0),
        ..RequestOptions::admit("")
    });
}

#[test]
fn errors_are_the_per_call_ones() {
    let (a, b, prompts) = twins();
    let p = &prompts[0];
    let both = |opts: &RequestOptions<'_>, id: &str| {
        let expected = per_call(&a, p, opts, id);
        let got = PreparedRequest::new(opts)
            .and_then(|mut prepared| b.find_best_match_prepared(p, &mut prepared, id));
        assert_eq!(got, expected, "{opts:?}, {id:?}");
        got
    };
    let admit = RequestOptions::admit("");
    // An empty id and an id with a NUL byte, refused alike.
    assert_eq!(both(&admit, "").unwrap_err().code(), Code::InvalidArgument);
    let nul = both(&admit, "a\0b").unwrap_err();
    assert_eq!(nul.code(), Code::InvalidArgument);
    assert!(nul.message().contains("request_id contains a NUL byte"));
    let long_nul = format!("{}\0", "y".repeat(300));
    assert_eq!(both(&admit, &long_nul).unwrap_err(), nul);
    // A pin to a worker the router does not know.
    let unknown = [99u64];
    let pinned = RequestOptions {
        allowed_worker_ids: Some(&unknown),
        ..admit
    };
    assert_eq!(
        both(&pinned, "pinned").unwrap_err().code(),
        Code::Unavailable
    );
    // Duplicate ids.
    both(&admit, "dup").unwrap();
    assert_eq!(both(&admit, "dup").unwrap_err().code(), Code::AlreadyExists);
    // Options the binding refuses before C: the same errors from PreparedRequest::new.
    for opts in [
        RequestOptions {
            lora_name: Some("a\0b"),
            ..admit
        },
        RequestOptions {
            cache_namespace: Some("a\0b"),
            ..admit
        },
        RequestOptions {
            multimodal: Some(Multimodal {
                hashes: &[1],
                counts: &[2],
            }),
            ..admit
        },
    ] {
        assert_eq!(both(&opts, "r").unwrap_err().code(), Code::InvalidArgument);
    }
    // A router without workers.
    let empty = common::router(0);
    let expected = empty.find_best_match(p, &RequestOptions::admit("x"));
    let mut prepared = PreparedRequest::new(&admit).unwrap();
    assert_eq!(
        empty.find_best_match_prepared(p, &mut prepared, "x"),
        expected
    );
    assert!(expected.is_err());
    // After an error the prepared request works as before.
    let ok = b
        .find_best_match_prepared(p, &mut prepared, "after")
        .unwrap();
    assert_eq!(ok, per_call(&a, p, &admit, "after").unwrap());
}

#[test]
fn a_prepared_request_owns_its_data() {
    let (a, b, prompts) = twins();
    // Built from borrowed strings and slices that are gone before it is used.
    let mut prepared = {
        let lora = String::from("adapter");
        let allowed = vec![1u64, 2];
        PreparedRequest::new(&RequestOptions {
            lora_name: Some(&lora),
            allowed_worker_ids: Some(&allowed),
            ..RequestOptions::admit("ignored")
        })
        .unwrap()
    };
    let opts = RequestOptions {
        lora_name: Some("adapter"),
        allowed_worker_ids: Some(&[1, 2]),
        ..RequestOptions::admit("")
    };
    // Moved to another thread and back, cloned: each copy points at its own buffers.
    let prepared = std::thread::spawn(move || {
        let r = b.find_best_match_prepared(&prompts[1], &mut prepared, "t-1");
        (prepared, b, prompts, r)
    })
    .join()
    .unwrap();
    assert_eq!(prepared.3, per_call(&a, &prepared.2[1], &opts, "t-1"));
    let mut copy = prepared.0.clone();
    drop(prepared.0);
    let long_id = "z".repeat(200); // past the first buffer: it grows
    for id in ["t-2", long_id.as_str(), "t-3"] {
        assert_eq!(
            prepared
                .1
                .find_best_match_prepared(&prepared.2[2], &mut copy, id),
            per_call(&a, &prepared.2[2], &opts, id)
        );
    }
    assert_eq!(state(&a, &prepared.2), state(&prepared.1, &prepared.2));
    // The id given to new() is not kept.
    assert_eq!(prepared.1.free_request("ignored"), Ok(()));
    assert!(format!("{copy:?}").contains("adapter"));
}

#[test]
fn prepared_requests_are_send_and_sync() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<PreparedRequest>();
}
