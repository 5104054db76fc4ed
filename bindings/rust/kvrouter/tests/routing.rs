//! Routing through the safe layer: prefix affinity, load, candidates, request options,
//! errors and their codes, caller-buffer growth, hashing vectors, version.

mod common;

use common::{prompt, router, store, BS};
use kvrouter::{
    compute_block_hashes, compute_sequence_hashes, tier_from_medium, Code, EventKind, EventOutcome,
    HashOptions, Multimodal, RequestOptions, Router, RouterOptions, StoredEvent, Tier,
    WorkerConfig,
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
    assert!(m.index_nodes >= 4, "{m:?}"); // 4 distinct blocks (plus any root)
    assert!(m.index_bytes > 0);
}

#[test]
fn hashing_matches_dynamo_vectors() {
    // shared/data/dynamo_block_hash_vectors.json
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
    assert!(kvrouter::version_string().starts_with("0.1."));
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
