//! A prompt given as its local hashes (`RequestOptions::prehashed`, `KVR_REQUEST_PREHASHED`) is
//! routed, previewed, planned, booked and priced as its tokens are, through every call taking
//! a prompt (a prepared request included); a hash count that is not the prompt's complete
//! blocks, and tokens beside the hashes, are refused with `InvalidArgument`.

mod common;

use common::{router, store, BS};
use kvrouter::{
    compute_block_hashes, Code, Disagg, DisaggOptions, DisaggPolicy, HashOptions, PotentialLoad,
    PrefillReason, PrehashedPrompt, PreparedRequest, RequestOptions, Result, RouterOptions,
    WorkerConfig,
};

/// `blocks` full blocks and `extra` more tokens (a partial last block, which has no hash).
fn prompt(seed: u32, blocks: usize, extra: usize) -> Vec<u32> {
    let mut p = common::prompt(seed, blocks + 1);
    p.truncate(blocks * BS as usize + extra);
    p
}

/// The prompt's local hashes as the test routers compute them (block size 16, base model).
fn hashes_of(tokens: &[u32]) -> Vec<u64> {
    compute_block_hashes(tokens, BS, &HashOptions::default()).unwrap()
}

fn by_worker<T>(mut rows: Vec<T>, id: impl Fn(&T) -> u64) -> Vec<T> {
    rows.sort_by_key(|r| id(r));
    rows
}

fn loads(
    router: &kvrouter::RouterRef,
    tokens: &[u32],
    opts: &RequestOptions<'_>,
) -> Vec<PotentialLoad> {
    by_worker(router.potential_loads(tokens, opts).unwrap(), |l| {
        l.worker_id
    })
}

/// Worker 2 caches the prompt's first two blocks: the hashed prompt gets the decision (worker,
/// overlap, cached and prompt tokens, blocks, cost, every candidate), the preview, the overlaps
/// and the potential loads of its tokens, with and without other options.
#[test]
fn a_hashed_prompt_routes_as_its_tokens() {
    let router = router(3);
    let tokens = prompt(1, 4, 5);
    store(&router, 2, &tokens, 2, 100);
    let hashes = hashes_of(&tokens);
    assert_eq!(hashes.len(), 4);

    let ids = [1u64, 2, 3];
    let overrides = RequestOptions {
        overlap_score_credit: Some(0.5),
        allowed_worker_ids: Some(&ids),
        ..Default::default()
    };
    for (what, by_tokens) in [
        ("no options", RequestOptions::default()),
        ("overrides", overrides),
    ] {
        let by_hashes = by_tokens.prehashed(&hashes, tokens.len());
        let (mut want_candidates, mut got_candidates) = (Vec::new(), Vec::new());
        let want = router
            .find_best_match_with_candidates(&tokens, &by_tokens, &mut want_candidates)
            .unwrap();
        let got = router
            .find_best_match_with_candidates(&[], &by_hashes, &mut got_candidates)
            .unwrap();
        assert_eq!(got, want, "{what}: the decision");
        assert_eq!(got_candidates, want_candidates, "{what}: the candidates");
        let (decision, total) = got;
        assert_eq!(total, 3, "{what}");
        assert_eq!(
            (decision.worker_id, decision.device_overlap_blocks),
            (2, 2),
            "{what}: {decision:?}"
        );
        assert_eq!(decision.cached_tokens, 2 * u64::from(BS), "{what}");
        assert_eq!(decision.prompt_tokens, tokens.len() as u64, "{what}");
        assert_eq!(decision.prompt_blocks, 4, "{what}");
        assert!(!decision.booked, "{what}");

        let preview = router.preview_route(&[], &by_hashes, None).unwrap();
        assert_eq!(
            preview,
            router.preview_route(&tokens, &by_tokens, None).unwrap(),
            "{what}: the preview"
        );
        assert_eq!((preview.worker_id, preview.overlap_blocks), (2, 2));

        let overlaps = by_worker(router.overlap_scores(&[], &by_hashes).unwrap(), |o| {
            o.worker_id
        });
        assert_eq!(
            overlaps,
            by_worker(router.overlap_scores(&tokens, &by_tokens).unwrap(), |o| {
                o.worker_id
            }),
            "{what}: the overlaps"
        );
        assert_eq!(overlaps.len(), 1);
        assert_eq!(overlaps[0].device_blocks, 2);

        let potential = loads(&router, &[], &by_hashes);
        assert_eq!(
            potential,
            loads(&router, &tokens, &by_tokens),
            "{what}: the loads"
        );
        assert_eq!(potential.len(), 3);
    }

    // The hashes carry the LoRA (and namespace, multimodal content): the options' own are not
    // read. The LoRA's hashes miss worker 2's base-model blocks as its tokens do; the base
    // hashes hit them whatever lora_name says.
    let lora = compute_block_hashes(
        &tokens,
        BS,
        &HashOptions {
            lora_name: Some("adapter"),
            ..Default::default()
        },
    )
    .unwrap();
    let by_lora_tokens = RequestOptions {
        lora_name: Some("adapter"),
        ..Default::default()
    };
    let want = router.find_best_match(&tokens, &by_lora_tokens).unwrap();
    let got = router
        .find_best_match(
            &[],
            &RequestOptions::default().prehashed(&lora, tokens.len()),
        )
        .unwrap();
    assert_eq!(got.device_overlap_blocks, 0);
    assert_eq!(
        (got.cached_tokens, got.prompt_blocks),
        (want.cached_tokens, want.prompt_blocks)
    );
    let got = router
        .find_best_match(&[], &by_lora_tokens.prehashed(&hashes, tokens.len()))
        .unwrap();
    assert_eq!((got.worker_id, got.device_overlap_blocks), (2, 2));

    // A prompt shorter than a block has no hash, and needs none.
    let short = RequestOptions::default().prehashed(&[], BS as usize - 1);
    let got = router.find_best_match(&[], &short).unwrap();
    assert_eq!(got.prompt_tokens, u64::from(BS) - 1);
    assert_eq!((got.prompt_blocks, got.device_overlap_blocks), (0, 0));
}

/// A request booked from its hashes (admitted, planned and committed, added on a rank chosen
/// elsewhere, or through a prepared request) weighs on its rank exactly as one booked from its
/// tokens, and is freed.
#[test]
fn a_booking_from_hashes_shows_in_the_loads_and_is_freed() {
    let router = router(3);
    let tokens = prompt(2, 4, 5);
    store(&router, 2, &tokens, 2, 100);
    let hashes = hashes_of(&tokens);
    let idle = loads(&router, &tokens, &RequestOptions::default());
    assert!(idle
        .iter()
        .all(|l| l.active_requests == 0 && l.active_blocks == 0));

    type Book<'t> = Box<dyn Fn(&str, &[u32], Option<PrehashedPrompt<'_>>) -> Result<()> + 't>;
    let router = &router;
    let n = tokens.len();
    let ways: [(&str, Book); 4] = [
        (
            "find_best_match (admit)",
            Box::new(|id, tokens, prehashed| {
                let opts = RequestOptions {
                    prehashed,
                    ..RequestOptions::admit(id)
                };
                let r = router.find_best_match(tokens, &opts)?;
                assert!(r.booked && r.worker_id == 2, "{r:?}");
                Ok(())
            }),
        ),
        (
            "plan_route + commit_route",
            Box::new(|id, tokens, prehashed| {
                let opts = RequestOptions {
                    prehashed,
                    ..RequestOptions::with_id(id)
                };
                let plan = router.plan_route(tokens, &opts, None, None)?;
                assert!(plan.booked && plan.worker_id == 2, "{plan:?}");
                assert_eq!(plan.prompt_tokens, n as u64);
                router.commit_route(id)
            }),
        ),
        (
            "add_request on worker 3",
            Box::new(|id, tokens, prehashed| {
                let opts = RequestOptions {
                    prehashed,
                    ..RequestOptions::with_id(id)
                };
                router.add_request(tokens, 3, 0, &opts)
            }),
        ),
        (
            "find_best_match_prepared",
            Box::new(|id, tokens, prehashed| {
                let mut prepared = PreparedRequest::new(&RequestOptions {
                    prehashed,
                    ..RequestOptions::admit("")
                })?;
                let r = router.find_best_match_prepared(tokens, &mut prepared, id)?;
                assert!(r.booked && r.worker_id == 2, "{r:?}");
                Ok(())
            }),
        ),
    ];
    let hashed = PrehashedPrompt {
        local_hashes: &hashes,
        num_tokens: n,
    };
    for (what, book) in &ways {
        book("from-tokens", &tokens, None).unwrap();
        let from_tokens = loads(router, &tokens, &RequestOptions::default());
        router.free_request("from-tokens").unwrap();
        book("from-hashes", &[], Some(hashed)).unwrap();
        let from_hashes = loads(router, &tokens, &RequestOptions::default());
        // The per-rank queries from hashes see the booking too.
        let via_hashes = loads(
            router,
            &[],
            &RequestOptions::default().prehashed(&hashes, n),
        );
        router.free_request("from-hashes").unwrap();
        assert_eq!(from_hashes, from_tokens, "{what}: the loads");
        assert_eq!(
            via_hashes, from_tokens,
            "{what}: the loads queried by hashes"
        );
        let booked: Vec<_> = from_hashes
            .iter()
            .filter(|l| l.active_requests > 0)
            .collect();
        assert_eq!(booked.len(), 1, "{what}: {from_hashes:?}");
        assert_eq!(booked[0].active_requests, 1, "{what}");
        assert!(booked[0].active_blocks > 0, "{what}");
        if booked[0].worker_id == 2 {
            assert_eq!(
                booked[0].active_prefill_tokens,
                (n - 2 * BS as usize) as u64,
                "{what}: the uncached tokens"
            );
        }
        assert_eq!(
            loads(router, &tokens, &RequestOptions::default()),
            idle,
            "{what}: after the frees"
        );
    }
    assert_eq!(router.metrics().unwrap().requests_active, 0);
}

/// The disaggregated router reads a hashed prompt's length as its tokens': 128 uncached tokens
/// over `max_local_prefill_tokens` go to the prefill pool (a length read as 0 would prefill
/// locally), on the rank caching the prefix, and the decode pool books it as the tokens.
#[test]
fn a_hashed_prompt_in_the_disaggregated_router() {
    let opts = RouterOptions {
        random_seed: 7,
        ..RouterOptions::with_block_size(BS)
    };
    let d = Disagg::new(
        &opts,
        &opts,
        &DisaggOptions {
            policy: DisaggPolicy::IslBounding,
            max_local_prefill_tokens: 16,
            ..Default::default()
        },
    )
    .unwrap();
    for id in [1, 2] {
        d.prefill_router()
            .add_worker(&WorkerConfig {
                max_num_batched_tokens: 1000,
                ..WorkerConfig::new(id)
            })
            .unwrap();
    }
    d.decode_router()
        .add_worker(&WorkerConfig {
            total_kv_blocks: 1000,
            ..WorkerConfig::new(10)
        })
        .unwrap();
    let tokens = prompt(3, 8, 0);
    store(d.prefill_router(), 2, &tokens, 3, 100);
    let hashes = hashes_of(&tokens);

    let route = |id: &str, tokens: &[u32], prehashed: Option<PrehashedPrompt<'_>>| {
        let opts = RequestOptions {
            prehashed,
            ..RequestOptions::with_id(id)
        };
        let busy = d.prefill_worker_busy(tokens, &opts, 0.05).unwrap();
        let mut prefill = d.route_prefill(tokens, &opts, None).unwrap();
        let decode = d.route_decode(tokens, &opts, None, prefill.remote).unwrap();
        d.prefill_router().free_request(id).unwrap();
        d.decode_router().free_request(id).unwrap();
        prefill.bootstrap_room = None; // random
        (prefill, decode, busy)
    };
    let from_tokens = route("t", &tokens, None);
    let from_hashes = route(
        "h",
        &[],
        Some(PrehashedPrompt {
            local_hashes: &hashes,
            num_tokens: tokens.len(),
        }),
    );
    assert_eq!(from_hashes, from_tokens);
    let (prefill, decode, busy) = from_hashes;
    assert!(prefill.remote, "{prefill:?}");
    assert_eq!(prefill.reason, PrefillReason::Remote);
    assert_eq!(
        (prefill.worker_id, prefill.cached_tokens),
        (2, 3 * u64::from(BS))
    );
    assert!(decode.booked && decode.worker_id == 10, "{decode:?}");
    assert_eq!(
        (decode.prompt_tokens, decode.prompt_blocks),
        (tokens.len() as u64, 8)
    );
    // 80 uncached tokens on worker 2 against 0.05 × 1000 batched tokens.
    assert!(busy);
}

/// A hash count that is not the prompt's complete blocks (one block short, none, one too many)
/// and tokens beside the hashes are `InvalidArgument` at every call taking a prompt, and book
/// nothing; the same call with the hashes alone, or the tokens alone, is accepted.
#[test]
fn wrong_hash_counts_and_tokens_beside_hashes_are_refused() {
    let router = router(2);
    let d = Disagg::new(
        &RouterOptions::with_block_size(BS),
        &RouterOptions::with_block_size(BS),
        &DisaggOptions::default(),
    )
    .unwrap();
    d.prefill_router()
        .add_worker(&WorkerConfig::new(1))
        .unwrap();
    d.decode_router().add_worker(&WorkerConfig::new(2)).unwrap();
    let tokens = prompt(4, 4, 5);
    let hashes = hashes_of(&tokens);
    let n = tokens.len();
    let five = [hashes.as_slice(), &[9]].concat();

    type Call<'t> = Box<dyn Fn(&[u32], &RequestOptions<'_>) -> Result<()> + 't>;
    let (router, d) = (&router, &d);
    let calls: Vec<(&str, Call)> = vec![
        (
            "find_best_match",
            Box::new(|t, o| router.find_best_match(t, o).map(drop)),
        ),
        (
            "find_best_match (admit)",
            Box::new(|t, o| {
                let o = RequestOptions { admit: true, ..*o };
                router.find_best_match(t, &o).map(drop)
            }),
        ),
        (
            "find_best_match_prepared",
            Box::new(|t, o| {
                let mut prepared = PreparedRequest::new(&RequestOptions { admit: true, ..*o })?;
                router
                    .find_best_match_prepared(t, &mut prepared, "x")
                    .map(drop)
            }),
        ),
        (
            "preview_route",
            Box::new(|t, o| router.preview_route(t, o, None).map(drop)),
        ),
        (
            "plan_route",
            Box::new(|t, o| router.plan_route(t, o, None, None).map(drop)),
        ),
        (
            "add_request",
            Box::new(|t, o| router.add_request(t, 1, 0, o)),
        ),
        (
            "overlap_scores",
            Box::new(|t, o| router.overlap_scores(t, o).map(drop)),
        ),
        (
            "potential_loads",
            Box::new(|t, o| router.potential_loads(t, o).map(drop)),
        ),
        (
            "Disagg::route_prefill",
            Box::new(|t, o| d.route_prefill(t, o, None).map(drop)),
        ),
        (
            "Disagg::route_decode",
            Box::new(|t, o| d.route_decode(t, o, None, false).map(drop)),
        ),
        (
            "Disagg::prefill_worker_busy",
            Box::new(|t, o| d.prefill_worker_busy(t, o, 1.0).map(drop)),
        ),
    ];
    let free = || {
        router.abort_route("x").unwrap();
        router.free_request("x").unwrap();
        d.prefill_router().free_request("x").unwrap();
        d.decode_router().free_request("x").unwrap();
    };
    let id = RequestOptions::with_id("x");
    for (what, call) in &calls {
        for (bad, t, opts) in [
            (
                "a block longer than its hashes",
                &[][..],
                id.prehashed(&hashes, n + BS as usize),
            ),
            ("one hash too many", &[][..], id.prehashed(&five, n)),
            ("no hashes", &[][..], id.prehashed(&[], n)),
            (
                "tokens beside the hashes",
                &tokens[..],
                id.prehashed(&hashes, n),
            ),
        ] {
            let e = call(t, &opts).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{what} with {bad}: {e}");
            assert!(!e.message().is_empty());
        }
        for r in [&**router, d.prefill_router(), d.decode_router()] {
            let m = r.metrics().unwrap();
            assert_eq!(
                (m.requests_active, m.queue_pending),
                (0, 0),
                "{what}: booked by a refused call"
            );
        }
        call(&[], &id.prehashed(&hashes, n)).unwrap();
        free();
        call(&tokens, &id).unwrap();
        free();
    }
}
