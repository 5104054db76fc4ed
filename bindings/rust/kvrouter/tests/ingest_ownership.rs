//! What keeps an ingest object's router alive: its loop thread applies events to the router
//! until the object is freed, so a leaked `Ingest` (`mem::forget` is safe) must keep its router
//! too. Before, `Ingest::new(&router)` borrowed it: forgetting the ingest ended the borrow, the
//! router could be dropped, and the thread applied events to freed memory (a SIGSEGV). That
//! constructor is gone (a `compile_fail` doctest on `Ingest` checks it).

mod common;

use std::sync::{Arc, Weak};

use common::{prompt, router, wait_for, BS};
use kvrouter::{
    Code, Disagg, DisaggOptions, DisaggPool, EventBatch, Ingest, IngestOptions, Publisher,
    RequestOptions, RouterOptions, RouterRef, StoredEvent, WorkerConfig,
};

/// A batch storing the first `blocks` blocks of `tokens` on `worker`.
fn stored(worker: u64, tokens: &[u32], blocks: usize) -> EventBatch {
    let hashes = common::engine_hashes(100, blocks);
    let mut batch = EventBatch::new().unwrap();
    batch
        .add_stored(&StoredEvent {
            worker_id: worker,
            event_id: 1,
            block_hashes: &hashes,
            token_ids: &tokens[..blocks * BS as usize],
            ..Default::default()
        })
        .unwrap();
    batch
}

fn device_blocks(router: &RouterRef, tokens: &[u32], worker: u64) -> u32 {
    router
        .overlap_scores(tokens, &RequestOptions::default())
        .unwrap()
        .iter()
        .find(|o| o.worker_id == worker)
        .map_or(0, |o| o.device_blocks)
}

/// Starts the ingest, listens on a free TCP port, and returns its endpoint.
fn listening(ingest: &Ingest<'_>) -> String {
    ingest.start().unwrap();
    ingest.listen("tcp://127.0.0.1:0").unwrap().endpoint
}

#[test]
fn a_leaked_ingest_keeps_its_shared_router_alive() {
    let router = Arc::new(router(2));
    let weak: Weak<_> = Arc::downgrade(&router);
    let ingest = Ingest::with_shared_router(router, &IngestOptions::default()).unwrap();
    let endpoint = listening(&ingest);
    std::mem::forget(ingest); // safe: the loop thread runs on, and the router stays
    let router = weak.upgrade().expect("the leaked ingest keeps the router");
    assert_eq!(Arc::strong_count(&router), 2);
    let tokens = prompt(1, 3);
    Publisher::connect(&endpoint)
        .unwrap()
        .send(&stored(2, &tokens, 3))
        .unwrap();
    wait_for("the event applied", || {
        (device_blocks(&router, &tokens, 2) == 3).then_some(())
    });
}

#[test]
fn a_leaked_ingest_keeps_its_shared_disagg_alive() {
    let options = RouterOptions::with_block_size(BS);
    let disagg = Arc::new(Disagg::new(&options, &options, &DisaggOptions::default()).unwrap());
    disagg
        .prefill_router()
        .add_worker(&WorkerConfig::new(1))
        .unwrap();
    disagg
        .decode_router()
        .add_worker(&WorkerConfig::new(2))
        .unwrap();
    let weak = Arc::downgrade(&disagg);
    let prefill = Ingest::with_shared_disagg(
        disagg.clone(),
        DisaggPool::Prefill,
        &IngestOptions::default(),
    )
    .unwrap();
    let decode =
        Ingest::with_shared_disagg(disagg, DisaggPool::Decode, &IngestOptions::default()).unwrap();
    let (to_prefill, to_decode) = (listening(&prefill), listening(&decode));
    std::mem::forget(prefill);
    std::mem::forget(decode);
    let disagg = weak.upgrade().expect("the leaked ingests keep the Disagg");
    let tokens = prompt(2, 2);
    Publisher::connect(&to_prefill)
        .unwrap()
        .send(&stored(1, &tokens, 2))
        .unwrap();
    Publisher::connect(&to_decode)
        .unwrap()
        .send(&stored(2, &tokens, 1))
        .unwrap();
    // Each pool got its own ingest's events.
    wait_for("both events applied", || {
        (device_blocks(disagg.prefill_router(), &tokens, 1) == 2
            && device_blocks(disagg.decode_router(), &tokens, 2) == 1)
            .then_some(())
    });
}

#[test]
fn an_ingest_of_a_static_router_may_be_leaked() {
    let router: &'static kvrouter::Router = Box::leak(Box::new(router(1)));
    let ingest = Ingest::with_static_router(router, &IngestOptions::default()).unwrap();
    let endpoint = listening(&ingest);
    std::mem::forget(ingest);
    let tokens = prompt(3, 1);
    Publisher::connect(&endpoint)
        .unwrap()
        .send(&stored(1, &tokens, 1))
        .unwrap();
    wait_for("the event applied", || {
        (device_blocks(router, &tokens, 1) == 1).then_some(())
    });
}

#[test]
fn a_scoped_ingest_is_freed_when_its_scope_ends() {
    let router = router(1);
    let tokens = prompt(4, 2);
    let endpoint = Ingest::scope(&router, &IngestOptions::default(), |ingest| {
        let endpoint = listening(ingest);
        Publisher::connect(&endpoint)
            .unwrap()
            .send(&stored(1, &tokens, 2))
            .unwrap();
        // Routing goes on meanwhile, here from a scoped thread.
        std::thread::scope(|s| {
            s.spawn(|| {
                wait_for("the event applied", || {
                    (device_blocks(&router, &tokens, 1) == 2).then_some(())
                })
            });
        });
        endpoint
    })
    .unwrap();
    // Freed, so stopped: nothing listens there any more.
    let e = Publisher::connect(&endpoint).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert_eq!(device_blocks(&router, &tokens, 1), 2);
}

#[test]
fn a_scoped_ingest_is_freed_when_its_closure_panics() {
    let router = router(1);
    let mut endpoint = String::new();
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Ingest::scope(&router, &IngestOptions::default(), |ingest| {
            endpoint = listening(ingest);
            panic!("the scope's closure panics");
        })
    }));
    assert!(unwound.is_err());
    let e = Publisher::connect(&endpoint).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
}

#[test]
fn a_pool_of_a_disagg_on_the_stack_is_fed_in_a_scope() {
    let options = RouterOptions::with_block_size(BS);
    let disagg = Disagg::new(&options, &options, &DisaggOptions::default()).unwrap();
    disagg
        .decode_router()
        .add_worker(&WorkerConfig::new(5))
        .unwrap();
    let tokens = prompt(5, 1);
    Ingest::scope(
        disagg.decode_router(),
        &IngestOptions::default(),
        |ingest| {
            Publisher::connect(&listening(ingest))
                .unwrap()
                .send(&stored(5, &tokens, 1))
                .unwrap();
            wait_for("the event applied", || {
                (device_blocks(disagg.decode_router(), &tokens, 5) == 1).then_some(())
            });
        },
    )
    .unwrap();
    // The scope's error: no ingest object is made for bad options (and f is not run).
    let bad = IngestOptions {
        replica_heartbeat_ms: 3_600_001,
        ..IngestOptions::default()
    };
    let e = Ingest::scope(disagg.decode_router(), &bad, |_| unreachable!()).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
}
