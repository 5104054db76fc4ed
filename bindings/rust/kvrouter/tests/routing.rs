//! Routing through the safe layer: prefix affinity, load, candidates, request options,
//! Dynamo's newer cost knobs (request weight, credit decay) and output-block tracking, errors
//! and their codes, caller-buffer growth, hashing vectors, version, a sharded index answering as
//! a single tree.

mod common;

use common::{prompt, router, store, BS};
use kvrouter::{
    compute_block_hashes, compute_sequence_hashes, tier_from_medium, Candidate, Code, EventKind,
    EventOutcome, HashOptions, Multimodal, Overlap, RemovedEvent, RequestOptions, Router,
    RouterOptions, StoredEvent, Tier, WorkerConfig,
};

#[test]
fn routing_picks_the_worker_holding_the_prefix() {
    let router = router(4);
    let tokens = prompt(1, 8);
    store(&router, 3, &tokens, 4, 100);

    let preview = router
        .find_best_match(&tokens, &RequestOptions::default())
        .unwrap();
    assert_eq!(preview.worker_id, 3);
    assert_eq!(preview.device_overlap_blocks, 4);
    assert_eq!(preview.cached_tokens, 4 * u64::from(BS));
    assert_eq!(preview.prompt_blocks, 8);
    assert_eq!(preview.prompt_tokens, tokens.len() as u64);
    assert!(!preview.booked);

    let mut candidates = Vec::new();
    let (result, total) = router
        .find_best_match_with_candidates(&tokens, &RequestOptions::admit("r1"), &mut candidates)
        .unwrap();
    assert!(result.booked);
    assert_eq!(result.worker_id, 3);
    assert_eq!(total, 4);
    assert_eq!(candidates.len(), 4);
    let chosen: Vec<_> = candidates.iter().filter(|c| c.chosen).collect();
    assert_eq!(chosen.len(), 1);
    assert_eq!(chosen[0].worker_id, 3);
    assert_eq!(chosen[0].device_blocks, 4);
    assert_eq!(chosen[0].cost, result.cost);
    for c in candidates.iter().filter(|c| !c.chosen) {
        assert_eq!(c.device_blocks, 0);
        assert!(c.cost > chosen[0].cost, "{c:?} vs {:?}", chosen[0]);
    }
    assert_eq!(router.metrics().unwrap().requests_active, 1);
    router.mark_prefill_completed("r1").unwrap();
    router.free_request("r1").unwrap();
    router.free_request("r1").unwrap(); // idempotent
    assert_eq!(router.metrics().unwrap().requests_active, 0);
}

#[test]
fn load_changes_the_choice() {
    let router = router(2);
    let tokens = prompt(2, 16);
    store(&router, 1, &tokens, 2, 100);
    let opts = RequestOptions::default();
    assert_eq!(router.find_best_match(&tokens, &opts).unwrap().worker_id, 1);

    // Worker 1 gets busy with other prompts: prefill tokens and KV blocks in flight.
    for i in 0..4 {
        let id = format!("busy-{i}");
        router
            .add_request(&prompt(100 + i, 32), 1, 0, &RequestOptions::with_id(&id))
            .unwrap();
    }
    let loads = router.potential_loads(&tokens, &opts).unwrap();
    let busy = loads.iter().find(|l| l.worker_id == 1).unwrap();
    assert_eq!(busy.active_requests, 4);
    assert!(busy.active_prefill_tokens >= 4 * 32 * u64::from(BS));
    assert_eq!(router.find_best_match(&tokens, &opts).unwrap().worker_id, 2);

    // Prefill done: the prefill term drops, the KV blocks stay: still busier than worker 2.
    for i in 0..4 {
        router.mark_prefill_completed(&format!("busy-{i}")).unwrap();
    }
    let busy = router.potential_loads(&tokens, &opts).unwrap();
    assert_eq!(
        busy.iter()
            .find(|l| l.worker_id == 1)
            .unwrap()
            .active_prefill_tokens,
        0
    );

    // Freed: the cached prefix wins again.
    for i in 0..4 {
        router.free_request(&format!("busy-{i}")).unwrap();
    }
    assert_eq!(router.find_best_match(&tokens, &opts).unwrap().worker_id, 1);
}

#[test]
fn request_options_steer_routing() {
    let router = router(3);
    let tokens = prompt(3, 4);
    store(&router, 1, &tokens, 4, 100);

    // Only workers 2 and 3 allowed: the cached worker is not a candidate.
    let allowed = [2u64, 3];
    let opts = RequestOptions {
        allowed_worker_ids: Some(&allowed),
        ..Default::default()
    };
    let r = router.find_best_match(&tokens, &opts).unwrap();
    assert!(allowed.contains(&r.worker_id));
    assert_eq!(r.device_overlap_blocks, 0);

    // Another LoRA hashes the same tokens differently: nothing cached for it.
    let lora = RequestOptions {
        lora_name: Some("adapter-a"),
        ..Default::default()
    };
    assert_eq!(
        router
            .find_best_match(&tokens, &lora)
            .unwrap()
            .device_overlap_blocks,
        0
    );
    assert!(router.overlap_scores(&tokens, &lora).unwrap().is_empty());
    let base = router
        .overlap_scores(&tokens, &RequestOptions::default())
        .unwrap();
    // The same prompt, hashed by the caller, gets the same rows.
    let hashes = kvrouter::compute_block_hashes(&tokens, 16, &Default::default()).unwrap();
    let hashed = router
        .overlap_scores_hashed(&hashes, &RequestOptions::default())
        .unwrap();
    assert_eq!(hashed.len(), base.len());
    assert_eq!(
        (
            hashed[0].worker_id,
            hashed[0].device_blocks,
            hashed[0].tree_size
        ),
        (base[0].worker_id, base[0].device_blocks, base[0].tree_size)
    );
    assert_eq!(base.len(), 1);
    assert_eq!(
        (base[0].worker_id, base[0].device_blocks, base[0].tree_size),
        (1, 4, 4)
    );

    // Overlap credit 0: the cache earns nothing, every worker costs the same.
    let mut candidates = Vec::new();
    let no_credit = RequestOptions {
        overlap_score_credit: Some(0.0),
        ..Default::default()
    };
    router
        .find_best_match_with_candidates(&tokens, &no_credit, &mut candidates)
        .unwrap();
    assert!(candidates
        .iter()
        .all(|c| c.credit == 0.0 && c.cost == candidates[0].cost));
}

#[test]
fn an_empty_allow_list_allows_no_worker() {
    // A gateway that filtered a tenant's workers down to none: `Some(&[])` is a list naming no
    // worker (`KVR_REQUEST_ALLOW_LIST`), never "every worker", on every path that routes.
    let router = router(3);
    let tokens = prompt(5, 4);
    let none: [u64; 0] = [];
    let nobody = RequestOptions {
        allowed_worker_ids: Some(&none),
        ..RequestOptions::admit("nobody")
    };
    let unavailable = |r: kvrouter::Result<()>, what: &str| {
        let e = r.expect_err(what);
        assert_eq!(e.code(), Code::Unavailable, "{what}: {e}");
    };
    unavailable(
        router.find_best_match(&tokens, &nobody).map(drop),
        "admitted",
    );
    let preview = RequestOptions {
        admit: false,
        ..nobody
    };
    unavailable(
        router.find_best_match(&tokens, &preview).map(drop),
        "preview",
    );
    let mut candidates = Vec::new();
    unavailable(
        router
            .find_best_match_with_candidates(&tokens, &nobody, &mut candidates)
            .map(drop),
        "with candidates",
    );
    let mut prepared = kvrouter::PreparedRequest::new(&nobody).unwrap();
    unavailable(
        router
            .find_best_match_prepared(&tokens, &mut prepared, "nobody")
            .map(drop),
        "prepared",
    );
    unavailable(
        router
            .find_best_match_prepared(&tokens, &mut prepared.clone(), "nobody")
            .map(drop),
        "prepared clone",
    );
    unavailable(
        router.preview_route(&tokens, &nobody, None).map(drop),
        "preview_route",
    );
    unavailable(
        router.plan_route(&tokens, &nobody, None, None).map(drop),
        "plan_route",
    );
    // Potential loads are of allowed ranks only: none.
    assert!(router.potential_loads(&tokens, &nobody).unwrap().is_empty());
    assert_eq!(
        router
            .potential_loads(&tokens, &RequestOptions::default())
            .unwrap()
            .len(),
        3
    );
    // Nothing was booked, planned or decided on anyone's worker.
    let m = router.metrics().unwrap();
    assert_eq!((m.requests_active, m.queue_pending), (0, 0));
    assert!(!router.abort_route("nobody").unwrap(), "a plan was made");

    // None still means every worker.
    let anybody = RequestOptions {
        allowed_worker_ids: None,
        ..nobody
    };
    let r = router.find_best_match(&tokens, &anybody).unwrap();
    assert!(r.booked && (1..=3).contains(&r.worker_id));
    assert_eq!(router.metrics().unwrap().requests_active, 1);
    router.free_request("nobody").unwrap();
    let mut prepared = kvrouter::PreparedRequest::new(&anybody).unwrap();
    assert!(
        router
            .find_best_match_prepared(&tokens, &mut prepared, "anybody")
            .unwrap()
            .booked
    );
}

/// `InvalidArgument` naming the argument: "`what` contains a NUL byte".
fn refused_for_nul<T: std::fmt::Debug>(result: kvrouter::Result<T>, what: &str) {
    let e = result.expect_err(what);
    assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e}");
    assert_eq!(e.message(), format!("{what} contains a NUL byte"), "{what}");
}

#[test]
fn every_string_with_a_nul_byte_is_refused_naming_it() {
    // C would read such a string up to its NUL: "a\0b" would book, free or hash as "a". The
    // binding refuses each before the call, short (copied on the stack) or long (the heap).
    let router = router(2);
    let tokens = prompt(8, 2);
    let long = format!("{}\0", "y".repeat(300));
    for bad in ["a\0b", "\0", long.as_str()] {
        let ok = "ok";
        let route = |opts: &RequestOptions<'_>| router.find_best_match(&tokens, opts);
        refused_for_nul(route(&RequestOptions::admit(bad)), "request_id");
        for opts in [
            RequestOptions {
                lora_name: Some(bad),
                ..RequestOptions::admit(ok)
            },
            RequestOptions {
                lora_name: Some(bad),
                ..Default::default()
            },
        ] {
            refused_for_nul(route(&opts), "lora_name");
            refused_for_nul(kvrouter::PreparedRequest::new(&opts), "lora_name");
            refused_for_nul(router.overlap_scores(&tokens, &opts), "lora_name");
            refused_for_nul(router.preview_route(&tokens, &opts, None), "lora_name");
        }
        let namespace = RequestOptions {
            cache_namespace: Some(bad),
            ..RequestOptions::admit(ok)
        };
        refused_for_nul(route(&namespace), "cache_namespace");
        refused_for_nul(
            kvrouter::PreparedRequest::new(&namespace),
            "cache_namespace",
        );
        let mut prepared = kvrouter::PreparedRequest::new(&RequestOptions::admit("")).unwrap();
        refused_for_nul(
            router.find_best_match_prepared(&tokens, &mut prepared, bad),
            "request_id",
        );
        refused_for_nul(
            router.add_request(&tokens, 1, 0, &RequestOptions::with_id(bad)),
            "request_id",
        );
        refused_for_nul(
            router.plan_route(&tokens, &RequestOptions::with_id(bad), None, None),
            "request_id",
        );
        refused_for_nul(router.mark_prefill_completed(bad), "request_id");
        refused_for_nul(router.record_output(bad, 1), "request_id");
        refused_for_nul(router.free_request(bad), "request_id");
        refused_for_nul(router.commit_route(bad), "request_id");
        refused_for_nul(router.abort_route(bad), "request_id");
        refused_for_nul(router.session_binding(bad), "session_id");
        refused_for_nul(router.close_session(bad), "session_id");
        let hints = kvrouter::RoutingHints {
            session_id: Some(bad),
            ..Default::default()
        };
        refused_for_nul(
            router.preview_route(&tokens, &RequestOptions::default(), Some(&hints)),
            "session_id",
        );
        refused_for_nul(router.set_replica_publisher(bad, |_| {}), "replica_id");
        for (options, what) in [
            (
                HashOptions {
                    lora_name: Some(bad),
                    ..Default::default()
                },
                "lora_name",
            ),
            (
                HashOptions {
                    cache_namespace: Some(bad),
                    ..Default::default()
                },
                "cache_namespace",
            ),
        ] {
            refused_for_nul(compute_block_hashes(&tokens, BS, &options), what);
        }
        let block = &tokens[..BS as usize];
        for (event, what) in [
            (
                StoredEvent {
                    worker_id: 1,
                    block_hashes: &[1],
                    token_ids: block,
                    lora_name: Some(bad),
                    ..Default::default()
                },
                "lora_name",
            ),
            (
                StoredEvent {
                    worker_id: 1,
                    block_hashes: &[1],
                    token_ids: block,
                    cache_namespace: Some(bad),
                    ..Default::default()
                },
                "cache_namespace",
            ),
        ] {
            refused_for_nul(router.apply_stored(&event), what);
            let mut batch = kvrouter::EventBatch::new().unwrap();
            refused_for_nul(batch.add_stored(&event), what);
            assert!(batch.is_empty());
        }
    }
    // None of it reached the router: nothing booked, planned, stored or published.
    let m = router.metrics().unwrap();
    assert_eq!((m.requests_active, m.decisions, m.index_blocks), (0, 0, 0));
    assert!(router
        .overlap_scores(&tokens, &RequestOptions::default())
        .unwrap()
        .is_empty());
}

#[test]
fn errors_carry_the_right_code_and_message() {
    let router = router(2);
    let tokens = prompt(4, 4);

    let e = router.remove_worker(99).unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(!e.message().is_empty());
    assert!(e.to_string().starts_with("KVR_NOT_FOUND: "), "{e}");

    let e = router.add_worker(&WorkerConfig::new(1)).unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);

    let e = router
        .add_worker(&WorkerConfig {
            block_size: 32,
            ..WorkerConfig::new(5)
        })
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("32") && e.message().contains("16"),
        "{e}"
    );

    // A duplicate request id.
    router
        .find_best_match(&tokens, &RequestOptions::admit("dup"))
        .unwrap();
    let e = router
        .find_best_match(&tokens, &RequestOptions::admit("dup"))
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);
    let e = router
        .add_request(&tokens, 1, 0, &RequestOptions::with_id("dup"))
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);

    // An unregistered rank; admission without an id.
    let e = router
        .add_request(&tokens, 42, 0, &RequestOptions::with_id("x"))
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let admit_no_id = RequestOptions {
        admit: true,
        ..Default::default()
    };
    let e = router.find_best_match(&tokens, &admit_no_id).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // Bytes that are not an EventBatch: refused whole, and counted.
    let e = router
        .apply_event_batch(b"definitely not a flatbuffer")
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(router.metrics().unwrap().event_batches_rejected, 1);

    // A stored event whose parent nobody stored.
    let e = router
        .apply_stored(&StoredEvent {
            worker_id: 1,
            parent_hash: Some(0xdead),
            block_hashes: &[1],
            token_ids: &tokens[..BS as usize],
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let m = router.metrics().unwrap();
    assert_eq!(
        m.events(EventKind::Stored, EventOutcome::ParentBlockNotFound),
        1
    );

    // Refused by the binding before C: an interior NUL, a local-hash count mismatch.
    let e = router.free_request("a\0b").unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("NUL"));
    let e = router
        .apply_stored(&StoredEvent {
            worker_id: 1,
            block_hashes: &[1, 2],
            local_hashes: Some(&[7]),
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = router
        .find_best_match(
            &tokens,
            &RequestOptions {
                multimodal: Some(Multimodal {
                    hashes: &[1],
                    counts: &[1, 1],
                }),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // No worker at all.
    let empty = Router::new(&RouterOptions::default()).unwrap();
    let e = empty
        .find_best_match(&tokens, &RequestOptions::default())
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);

    // A bad router setting names itself.
    let e = Router::new(&RouterOptions::with_block_size(0)).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("block_size"), "{e}");

    // It is a std error.
    let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(e);
    assert!(boxed.to_string().contains("KVR_INVALID_ARGUMENT"));
    assert_eq!(Code::from_raw(100), Code::BufferTooSmall);
    assert_eq!(Code::BufferTooSmall.name(), "KVR_BUFFER_TOO_SMALL");
    assert_eq!(Code::from_raw(77), Code::Other(77));
    assert_eq!(kvrouter::status_name(77), "KVR_UNKNOWN");
}

#[test]
fn caller_buffers_grow_to_what_the_library_needs() {
    // 100 workers hold the prompt's prefix: more rows than any first guess.
    let router = router(100);
    let tokens = prompt(5, 4);
    for w in 1..=100 {
        store(&router, w, &tokens, 1 + (w as usize % 4), w * 1000);
    }
    let opts = RequestOptions::default();
    let overlaps = router.overlap_scores(&tokens, &opts).unwrap();
    assert_eq!(overlaps.len(), 100);
    for o in &overlaps {
        assert_eq!(o.device_blocks as usize, 1 + (o.worker_id as usize % 4));
    }
    assert_eq!(router.potential_loads(&tokens, &opts).unwrap().len(), 100);
    // The walk alone: the same depths and tree sizes, as many rows.
    let hashes = compute_block_hashes(&tokens, BS, &Default::default()).unwrap();
    let mut matches = router.find_matches(&hashes).unwrap();
    let mut rows = overlaps.clone();
    matches.sort_by_key(|m| m.worker_id);
    rows.sort_by_key(|o| o.worker_id);
    assert_eq!(matches.len(), 100);
    for (m, o) in matches.iter().zip(&rows) {
        assert_eq!(
            (
                m.worker_id,
                m.dp_rank,
                m.device_blocks,
                m.host_blocks,
                m.tree_size
            ),
            (
                o.worker_id,
                o.dp_rank,
                o.device_blocks,
                o.host_blocks,
                o.tree_size
            )
        );
    }
    assert!(router.find_matches(&[]).unwrap().is_empty());

    // Candidates: at most max(capacity, 64) come back, with the total beside them.
    let mut candidates = Vec::new();
    let (r, total) = router
        .find_best_match_with_candidates(&tokens, &opts, &mut candidates)
        .unwrap();
    assert_eq!((candidates.len(), total), (64, 100));
    candidates.reserve(total);
    let (again, total) = router
        .find_best_match_with_candidates(&tokens, &opts, &mut candidates)
        .unwrap();
    assert_eq!((candidates.len(), total), (100, 100));
    assert_eq!(r.device_overlap_blocks, 4);
    assert_eq!(again.device_overlap_blocks, 4);
    assert_eq!(candidates.iter().filter(|c| c.chosen).count(), 1);

    // Prometheus text with 100 workers' gauges is larger than the first 4 KiB guess.
    let text = router.metrics_prometheus().unwrap();
    assert!(text.len() > 4096, "{} bytes", text.len());
    assert!(!text.contains('\0'));
    assert!(text.contains("# TYPE"), "{}", &text[..200]);
    assert!(text.ends_with('\n'));
}

#[test]
fn metrics_count_events_workers_and_decisions() {
    let router = router(3);
    let tokens = prompt(6, 4);
    store(&router, 1, &tokens, 4, 10);
    store(&router, 2, &tokens, 2, 20);
    router
        .find_best_match(&tokens, &RequestOptions::default())
        .unwrap();
    router
        .find_best_match(&tokens, &RequestOptions::admit("m"))
        .unwrap();
    let m = router.metrics().unwrap();
    assert_eq!(m.workers, 3);
    assert_eq!(m.decisions, 2);
    assert_eq!(m.requests_active, 1);
    assert_eq!(m.events(EventKind::Stored, EventOutcome::Applied), 2);
    assert_eq!(m.index_blocks, 6);
    // A node is a run of blocks held alike (path compression): blocks 1-2 held by workers 1
    // and 2, blocks 3-4 by worker 1 only (plus any root).
    assert!(m.index_nodes >= 2, "{m:?}");
    assert!(m.index_bytes > 0);
    // Nothing was refused memory; the Prometheus text counts both all the same.
    assert_eq!(m.events_refused_for_memory, 0);
    assert_eq!(m.replica_changes_unpublished, 0);
    // One caller at a time: no decision collided with another.
    assert_eq!(m.decisions_priced_again, 0);
    // No sliding-window events (no hybrid model): none applied or rejected, no entries held.
    assert_eq!(m.sliding_events_applied, 0);
    assert_eq!(m.sliding_events_rejected, 0);
    assert_eq!(m.index_sliding_blocks, 0);
    let text = router.metrics_prometheus().unwrap();
    for line in [
        "# TYPE kvrouter_events_refused_for_memory_total counter\n",
        "\nkvrouter_events_refused_for_memory_total 0\n",
        "# TYPE kvrouter_replica_changes_unpublished_total counter\n",
        "\nkvrouter_replica_changes_unpublished_total 0\n",
        "# TYPE kvrouter_decisions_priced_again_total counter\n",
        "\nkvrouter_decisions_priced_again_total 0\n",
        "# TYPE kvrouter_sliding_window_events_applied_total counter\n",
        "\nkvrouter_sliding_window_events_applied_total 0\n",
        "# TYPE kvrouter_sliding_window_events_rejected_total counter\n",
        "\nkvrouter_sliding_window_events_rejected_total 0\n",
        "# TYPE kvrouter_index_sliding_blocks gauge\n",
        "\nkvrouter_index_sliding_blocks 0\n",
    ] {
        assert!(text.contains(line), "no {line:?} in\n{text}");
    }
}

#[test]
fn hashing_matches_dynamo_vectors() {
    // data/vectors/dynamo_block_hash_vectors.json
    let tokens: Vec<u32> = (0..37).collect();
    let local = compute_block_hashes(&tokens, 16, &HashOptions::default()).unwrap();
    assert_eq!(local, [15310707395893867146, 15292316782987903195]);
    let seq = compute_sequence_hashes(&local).unwrap();
    assert_eq!(seq, [15310707395893867146, 13769157705258532664]);
    assert_eq!(
        compute_block_hashes(&[1, 2, 3, 4], 4, &HashOptions::default()).unwrap(),
        [14643705804678351452]
    );
    assert!(
        compute_block_hashes(&[0, 1, 2, 3, 4], 16, &HashOptions::default())
            .unwrap()
            .is_empty()
    );

    let tokens: Vec<u32> = (100..132).collect();
    let opts = HashOptions {
        lora_name: Some("adapter-b"),
        cache_namespace: Some("tenant-2"),
        ..Default::default()
    };
    assert_eq!(
        compute_block_hashes(&tokens, 16, &opts).unwrap(),
        [11802432356634032379, 5964709424852623607]
    );
    let mm = HashOptions {
        multimodal: Some(Multimodal {
            hashes: &[9, 3, 5],
            counts: &[2, 1],
        }),
        ..Default::default()
    };
    assert_eq!(
        compute_block_hashes(&[7, 8, 9, 10, 11, 12], 3, &mm).unwrap(),
        [8964971868145781830, 10311331095896773576]
    );
    let eagle = HashOptions {
        eagle: true,
        ..Default::default()
    };
    assert_eq!(
        compute_block_hashes(&[10, 11, 12, 13, 14], 2, &eagle).unwrap(),
        [5959138341449004422, 13917772031453556700]
    );
    let e = compute_block_hashes(&[1, 2], 0, &HashOptions::default()).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // Precomputed local hashes index exactly like the tokens they were computed from.
    let router = router(2);
    let tokens = prompt(7, 4);
    let local = compute_block_hashes(&tokens, BS, &HashOptions::default()).unwrap();
    router
        .apply_stored(&StoredEvent {
            worker_id: 2,
            block_hashes: &[1, 2, 3, 4],
            local_hashes: Some(&local),
            ..Default::default()
        })
        .unwrap();
    let r = router
        .find_best_match(&tokens, &RequestOptions::default())
        .unwrap();
    assert_eq!((r.worker_id, r.device_overlap_blocks), (2, 4));
}

#[test]
fn tiers_and_version() {
    assert_eq!(tier_from_medium(Some("GPU")), Tier::Device);
    assert_eq!(tier_from_medium(Some("cpu_pinned")), Tier::HostPinned);
    assert_eq!(tier_from_medium(Some("DISK")), Tier::Disk);
    assert_eq!(tier_from_medium(Some("EXTERNAL")), Tier::External);
    assert_eq!(tier_from_medium(Some("floppy")), Tier::Device);
    assert_eq!(tier_from_medium(None), Tier::Device);

    kvrouter::check_version().unwrap();
    assert_eq!(
        kvrouter::version() / 100,
        kvrouter::sys::KVR_VERSION_NUMBER / 100
    );
    // This release of the binding is for libkvrouter 0.2.x.
    assert!(kvrouter::version_string().starts_with("0.2."));
}

#[test]
fn lower_tiers_earn_weighted_credit() {
    let router = router(2);
    let tokens = prompt(8, 4);
    let hashes = [1, 2, 3, 4];
    router
        .apply_stored(&StoredEvent {
            worker_id: 1,
            tier: Tier::HostPinned,
            block_hashes: &hashes,
            token_ids: &tokens,
            ..Default::default()
        })
        .unwrap();
    let overlaps = router
        .overlap_scores(&tokens, &RequestOptions::default())
        .unwrap();
    assert_eq!(overlaps.len(), 1);
    assert_eq!((overlaps[0].device_blocks, overlaps[0].host_blocks), (0, 4));
    assert_eq!(overlaps[0].effective_overlap_blocks, 4.0 * 0.75);
}

/// A seeded router of block size 16 with workers 1 and 2 and the given options.
fn router_with(options: RouterOptions) -> Router {
    let router = Router::new(&RouterOptions {
        block_size: BS,
        random_seed: 7,
        ..options
    })
    .unwrap();
    for id in 1..=2 {
        router.add_worker(&WorkerConfig::new(id)).unwrap();
    }
    router
}

fn candidates_for(
    router: &Router,
    tokens: &[u32],
    opts: &RequestOptions<'_>,
) -> (u64, Vec<Candidate>) {
    let mut candidates = Vec::new();
    let (r, total) = router
        .find_best_match_with_candidates(tokens, opts, &mut candidates)
        .unwrap();
    assert_eq!(total, candidates.len());
    candidates.sort_by_key(|c| c.worker_id);
    (r.worker_id, candidates)
}

#[test]
fn new_cost_knobs_are_off_by_default() {
    let defaults = RouterOptions::default();
    assert_eq!(defaults.overlap_score_credit_decay, 0.0);
    assert_eq!(defaults.decode_active_request_weight, 0.0);
    assert!(!defaults.track_output_blocks);
    let opts = RequestOptions::default();
    assert_eq!(opts.overlap_score_credit_decay, None);
    assert_eq!(opts.decode_active_request_weight, None);

    let router = router(2);
    let tokens = prompt(20, 4);
    store(&router, 1, &tokens, 4, 100);
    router
        .add_request(&prompt(21, 2), 1, 0, &RequestOptions::with_id("busy"))
        .unwrap();
    let (_, candidates) = candidates_for(&router, &tokens, &opts);
    for c in &candidates {
        assert_eq!((c.credit_decay, c.request_cost), (1.0, 0.0), "{c:?}");
        assert_eq!(c.cost, c.prefill_cost + c.decode_blocks as f64, "{c:?}");
    }
    assert_eq!(candidates[0].active_requests, 1);
    assert_eq!(candidates[1].active_requests, 0);
}

#[test]
fn request_weight_charges_active_requests_and_flips_the_choice() {
    // Worker 1 holds the whole 8-block prompt and runs 4 small prefilled requests (one block
    // each): prefill 0, decode 4 active + 8 new blocks (new = not held by its active
    // requests) = 12, against worker 2's prefill 8 + decode 8 = 16. Charging 5 per active
    // request adds 20 to worker 1 only, which then costs more than worker 2.
    let weighted = router_with(RouterOptions {
        decode_active_request_weight: 5.0,
        ..Default::default()
    });
    let unweighted = router_with(RouterOptions::default());
    let tokens = prompt(30, 8);
    for router in [&weighted, &unweighted] {
        store(router, 1, &tokens, 8, 100);
        for i in 0..4 {
            let id = format!("small-{i}");
            router
                .add_request(&prompt(40 + i, 1), 1, 0, &RequestOptions::with_id(&id))
                .unwrap();
            router.mark_prefill_completed(&id).unwrap();
        }
    }

    let (plain_pick, plain) = candidates_for(&unweighted, &tokens, &RequestOptions::default());
    assert_eq!(plain_pick, 1);
    assert_eq!((plain[0].cost, plain[1].cost), (12.0, 16.0));
    // An unset override keeps the router's weight (5), which flips the choice.
    let (pick, costs) = candidates_for(&weighted, &tokens, &RequestOptions::default());
    assert_eq!(pick, 2);
    assert_eq!((costs[0].active_requests, costs[1].active_requests), (4, 0));
    for (c, p) in costs.iter().zip(&plain) {
        assert_eq!(c.worker_id, p.worker_id);
        assert_eq!(c.request_cost, 5.0 * c.active_requests as f64, "{c:?}");
        assert_eq!(
            c.cost - p.cost,
            5.0 * c.active_requests as f64,
            "{c:?} vs {p:?}"
        );
        assert_eq!(
            c.cost,
            c.prefill_cost + c.decode_blocks as f64 + c.request_cost
        );
    }
    assert!(costs[0].cost > costs[1].cost && plain[0].cost < plain[1].cost);

    // Per request: 0 turns the router's weight off, a weight turns it on where it is off.
    let off = RequestOptions {
        decode_active_request_weight: Some(0.0),
        ..Default::default()
    };
    let (pick, costs) = candidates_for(&weighted, &tokens, &off);
    assert_eq!(pick, 1);
    assert!(costs.iter().all(|c| c.request_cost == 0.0));
    let on = RequestOptions {
        decode_active_request_weight: Some(5.0),
        ..Default::default()
    };
    let (pick, costs) = candidates_for(&unweighted, &tokens, &on);
    assert_eq!(pick, 2);
    assert_eq!(costs[0].request_cost, 20.0);

    // Out of range: refused by the library, naming the setting.
    let e = weighted
        .find_best_match(
            &tokens,
            &RequestOptions {
                decode_active_request_weight: Some(-1.0),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("decode_active_request_weight"), "{e}");
    let e = Router::new(&RouterOptions {
        overlap_score_credit_decay: f64::NAN,
        ..Default::default()
    })
    .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("overlap_score_credit_decay"), "{e}");
}

#[test]
fn credit_decay_discounts_a_hit_behind_a_prefill_backlog() {
    // Worker 1 holds the 4-block prompt but has 8 blocks of prefill queued (an unrelated
    // request, not yet prefilled); worker 2 has none. With decay 1 the hit keeps
    // 1 / (1 + 1 × 8 / 4) = 1/3 of its credit.
    let router = router_with(RouterOptions {
        overlap_score_credit_decay: 1.0,
        ..Default::default()
    });
    let tokens = prompt(50, 4);
    store(&router, 1, &tokens, 4, 100);
    router
        .add_request(&prompt(51, 8), 1, 0, &RequestOptions::with_id("backlog"))
        .unwrap();

    let (_, costs) = candidates_for(&router, &tokens, &RequestOptions::default());
    let (busy, idle) = (&costs[0], &costs[1]);
    assert_eq!(busy.device_blocks, 4);
    assert_eq!(busy.active_prefill_tokens, 8 * u64::from(BS));
    assert_eq!(idle.active_prefill_tokens, 0);
    let excess_blocks = (busy.active_prefill_tokens - idle.active_prefill_tokens) as f64 / 16.0;
    let expected = 1.0 / (1.0 + 1.0 * excess_blocks / 4.0);
    assert!((busy.credit_decay - expected).abs() < 1e-12, "{busy:?}");
    assert!(busy.credit_decay < 1.0);
    assert!((busy.credit - 4.0 * expected).abs() < 1e-12, "{busy:?}");
    assert_eq!(idle.credit_decay, 1.0);

    // An unset override keeps the router's decay; 0 turns it off for this request.
    let keep = RequestOptions {
        overlap_score_credit_decay: None,
        ..Default::default()
    };
    assert_eq!(
        candidates_for(&router, &tokens, &keep).1[0].credit_decay,
        busy.credit_decay
    );
    let off = RequestOptions {
        overlap_score_credit_decay: Some(0.0),
        ..Default::default()
    };
    let (_, plain) = candidates_for(&router, &tokens, &off);
    assert_eq!((plain[0].credit_decay, plain[0].credit), (1.0, 4.0));
    assert!(plain[0].cost < busy.cost);
    // A stronger decay per request keeps less.
    let strong = RequestOptions {
        overlap_score_credit_decay: Some(3.0),
        ..Default::default()
    };
    let (_, strong) = candidates_for(&router, &tokens, &strong);
    assert!((strong[0].credit_decay - 1.0 / (1.0 + 3.0 * excess_blocks / 4.0)).abs() < 1e-12);
}

#[test]
fn record_output_grows_the_rank_blocks_until_freed() {
    let router = router_with(RouterOptions {
        track_output_blocks: true,
        ..Default::default()
    });
    let tokens = prompt(60, 2);
    router
        .add_request(&tokens, 1, 0, &RequestOptions::with_id("gen"))
        .unwrap();
    let blocks_of_worker_1 = || {
        router
            .potential_loads(&tokens, &RequestOptions::default())
            .unwrap()
            .iter()
            .find(|l| l.worker_id == 1)
            .unwrap()
            .active_blocks
    };
    assert_eq!(blocks_of_worker_1(), 2);
    // Cumulative counts: 32 + 1 tokens span 3 blocks, 32 + 49 span 6.
    router.record_output("gen", 1).unwrap();
    assert_eq!(blocks_of_worker_1(), 3);
    router.record_output("gen", 3 * u64::from(BS) + 1).unwrap();
    assert_eq!(blocks_of_worker_1(), 6);
    router.record_output("gen", 3 * u64::from(BS) + 1).unwrap();
    assert_eq!(blocks_of_worker_1(), 6);
    // The candidates see it too.
    let (_, costs) = candidates_for(&router, &prompt(61, 1), &RequestOptions::default());
    assert_eq!(costs[0].active_blocks, 6);
    // An unknown id is no error; an interior NUL is refused before C.
    router.record_output("unknown", 100).unwrap();
    let e = router.record_output("g\0en", 1).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    router.free_request("gen").unwrap();
    assert_eq!(blocks_of_worker_1(), 0);

    // A router that does not track output refuses it.
    let plain = router_with(RouterOptions::default());
    plain
        .add_request(&tokens, 1, 0, &RequestOptions::with_id("gen"))
        .unwrap();
    let e = plain.record_output("gen", 40).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(!e.message().is_empty());
}

/// A router with `index_shards` trees and workers `1..=workers`, each holding a 4-block stem
/// and 2 blocks of its own (engine hashes from `1000 × worker`), after worker 2 evicts its last
/// block and worker 4 leaves. Returns the router and each worker's 6-block prompt.
fn sharded_router_with_events(index_shards: u32, workers: u64) -> (Router, Vec<Vec<u32>>) {
    let router = Router::new(&RouterOptions {
        random_seed: 7,
        index_shards,
        ..RouterOptions::with_block_size(BS)
    })
    .unwrap();
    let prompts: Vec<Vec<u32>> = (1..=workers)
        .map(|w| [prompt(1, 4), prompt(100 + w as u32, 2)].concat())
        .collect();
    for (w, tokens) in (1..=workers).zip(&prompts) {
        router.add_worker(&WorkerConfig::new(w)).unwrap();
        store(&router, w, tokens, 6, 1000 * w);
    }
    router
        .apply_removed(&RemovedEvent {
            worker_id: 2,
            block_hashes: &[2005],
            ..Default::default()
        })
        .unwrap();
    router.remove_worker(4).unwrap();
    (router, prompts)
}

fn sorted_overlaps(router: &Router, tokens: &[u32]) -> Vec<Overlap> {
    let mut overlaps = router
        .overlap_scores(tokens, &RequestOptions::default())
        .unwrap();
    overlaps.sort_by_key(|o| o.worker_id);
    overlaps
}

#[test]
fn index_shards_change_no_answer() {
    assert_eq!(RouterOptions::default().index_shards, 1);
    let (single, prompts) = sharded_router_with_events(RouterOptions::default().index_shards, 9);
    let (sharded, _) = sharded_router_with_events(4, 9);
    let opts = RequestOptions::default();
    for (w, tokens) in (1..=9u64).zip(&prompts) {
        let want = sorted_overlaps(&single, tokens);
        assert_eq!(
            sorted_overlaps(&sharded, tokens),
            want,
            "prompt of worker {w}"
        );
        // What each holds of it: the stem, all of it for w itself (worker 2 evicted its last
        // block); worker 4 has left.
        let held: Vec<(u64, u32)> = want
            .iter()
            .map(|o| (o.worker_id, o.device_blocks))
            .collect();
        let expected: Vec<(u64, u32)> = (1..=9u64)
            .filter(|&v| v != 4)
            .map(|v| match v {
                2 if v == w => (v, 5),
                _ if v == w => (v, 6),
                _ => (v, 4),
            })
            .collect();
        assert_eq!(held, expected, "prompt of worker {w}");
        if w == 4 {
            continue; // the stem only, everywhere: a random tie-break
        }
        let one = single.find_best_match(tokens, &opts).unwrap();
        assert_eq!(one.worker_id, w);
        assert_eq!(sharded.find_best_match(tokens, &opts).unwrap(), one);
    }
    let blocks = |r: &Router| r.metrics().unwrap().index_blocks;
    assert_eq!(blocks(&single), 8 * 6 - 1);
    assert_eq!(blocks(&sharded), blocks(&single));
}

#[test]
fn index_shards_out_of_range_are_refused_naming_the_field() {
    for index_shards in [0, 65] {
        let e = Router::new(&RouterOptions {
            index_shards,
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{index_shards}: {e}");
        assert!(e.message().contains("index_shards"), "{e}");
    }
}

#[test]
fn the_decision_latency_histogram_counts_routing_calls() {
    let router = router(2);
    let before = router.metrics().unwrap().decision_latency;
    assert_eq!((before.count, before.sum_ns, before.mean_ns()), (0, 0, 0.0));
    assert!(before.bounds_ns[0] > 0, "{before:?}");
    assert!(
        before.bounds_ns.windows(2).all(|w| w[0] < w[1]),
        "{before:?}"
    );

    let tokens = prompt(9, 4);
    for i in 0..16 {
        router
            .find_best_match(&tokens, &RequestOptions::admit(&format!("r{i}")))
            .unwrap();
    }
    router
        .find_best_match(&tokens, &RequestOptions::default())
        .unwrap();
    let m = router.metrics().unwrap();
    let latency = m.decision_latency;
    // One routing call in 16 is timed, the first included: calls 1 and 17.
    assert_eq!((latency.count, m.decisions), (2, 17));
    assert_eq!(latency.bounds_ns, before.bounds_ns);
    assert!(latency.le.windows(2).all(|w| w[0] <= w[1]), "{latency:?}");
    assert!(latency.le[latency.le.len() - 1] <= latency.count);
    assert!(latency.sum_ns > 0 && latency.mean_ns() > 0.0, "{latency:?}");
    let text = router.metrics_prometheus().unwrap();
    assert!(
        text.contains("kvrouter_decision_duration_seconds_count 2\n"),
        "{text}"
    );
    assert!(text.contains("# TYPE kvrouter_decision_duration_seconds histogram\n"));
}
