//! One router shared by many threads through `Arc`, and the Send/Sync contract.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};

use common::{prompt, router, store};
use kvrouter::{
    Buffer, Disagg, EventBatch, Ingest, Publisher, RequestOptions, Router, RouterRef, StoredEvent,
};

fn assert_send_sync<T: Send + Sync>() {}
fn assert_send<T: Send>() {}

#[test]
fn handles_are_send_and_sync_where_the_header_allows() {
    assert_send_sync::<Router>();
    assert_send_sync::<RouterRef>();
    assert_send_sync::<Disagg>();
    assert_send_sync::<Ingest<'static>>();
    assert_send_sync::<Buffer>();
    assert_send_sync::<Publisher>();
    assert_send_sync::<kvrouter::Error>();
    // Every kvr_event_batch_* function is `none`: it moves between threads, never shared.
    assert_send::<EventBatch>();
}

#[test]
fn many_threads_route_book_and_free_on_one_router() {
    const THREADS: u64 = 8;
    const ROUNDS: u64 = 200;
    let router = Arc::new(router(8));
    let shared = prompt(1, 16);
    store(&router, 5, &shared, 16, 1);
    let barrier = Arc::new(Barrier::new(THREADS as usize + 1));
    let on_five = Arc::new(AtomicU64::new(0));

    let mut threads = Vec::new();
    for t in 0..THREADS {
        let (router, barrier, on_five, shared) = (
            router.clone(),
            barrier.clone(),
            on_five.clone(),
            shared.clone(),
        );
        threads.push(std::thread::spawn(move || {
            barrier.wait();
            for i in 0..ROUNDS {
                let id = format!("t{t}-r{i}");
                let r = router
                    .find_best_match(&shared, &RequestOptions::admit(&id))
                    .unwrap();
                assert!(r.booked);
                if r.worker_id == 5 {
                    on_five.fetch_add(1, Ordering::Relaxed);
                }
                // Concurrent readers of the same router.
                let overlaps = router
                    .overlap_scores(&shared, &RequestOptions::default())
                    .unwrap();
                assert!(overlaps
                    .iter()
                    .any(|o| o.worker_id == 5 && o.device_blocks == 16));
                router.mark_prefill_completed(&id).unwrap();
                router.free_request(&id).unwrap();
            }
        }));
    }
    // A writer applying events while the readers route.
    let writer = {
        let (router, barrier) = (router.clone(), barrier.clone());
        std::thread::spawn(move || {
            barrier.wait();
            for i in 0..ROUNDS {
                let tokens = prompt(1000 + i as u32, 4);
                let hashes = [
                    10_000 + 4 * i,
                    10_001 + 4 * i,
                    10_002 + 4 * i,
                    10_003 + 4 * i,
                ];
                let worker = [1, 2, 3, 4, 6, 7, 8][i as usize % 7]; // never 5, which keeps its prefix
                router
                    .apply_stored(&StoredEvent {
                        worker_id: worker,
                        block_hashes: &hashes,
                        token_ids: &tokens,
                        ..Default::default()
                    })
                    .unwrap();
                router.apply_cleared(worker, 0, i).unwrap();
            }
        })
    };
    for t in threads {
        t.join().unwrap();
    }
    writer.join().unwrap();
    let m = router.metrics().unwrap();
    assert_eq!(m.requests_active, 0);
    assert!(m.decisions >= THREADS * ROUNDS);
    // Worker 5 holds the whole prompt: it serves most requests, not necessarily all.
    assert!(on_five.load(Ordering::Relaxed) > THREADS * ROUNDS / 2);
}

#[test]
fn concurrent_identical_requests_spread_instead_of_piling_up() {
    let router = Arc::new(router(4));
    let tokens = prompt(2, 32);
    let barrier = Arc::new(Barrier::new(8));
    // Spawn all eight first (they meet at the barrier), then join.
    let handles: Vec<_> = (0..8)
        .map(|t| {
            let (router, barrier, tokens) = (router.clone(), barrier.clone(), tokens.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let id = format!("same-{t}");
                router
                    .find_best_match(&tokens, &RequestOptions::admit(&id))
                    .unwrap()
                    .worker_id
            })
        })
        .collect();
    let workers: Vec<u64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let mut counts = [0u32; 5];
    for w in &workers {
        counts[*w as usize] += 1;
    }
    // Each booking is seen by the next decision: 8 requests over 4 workers, 2 each.
    assert_eq!(&counts[1..], &[2, 2, 2, 2], "{workers:?}");
    assert_eq!(router.metrics().unwrap().requests_active, 8);
}

#[test]
fn a_disagg_and_its_pools_are_shared_across_threads() {
    let opts = kvrouter::RouterOptions::with_block_size(common::BS);
    let d = Disagg::new(&opts, &opts, &Default::default()).unwrap();
    d.prefill_router()
        .add_worker(&kvrouter::WorkerConfig::new(1))
        .unwrap();
    d.decode_router()
        .add_worker(&kvrouter::WorkerConfig::new(2))
        .unwrap();
    let tokens = prompt(3, 4);
    std::thread::scope(|s| {
        for t in 0..4 {
            let (d, tokens) = (&d, &tokens);
            s.spawn(move || {
                for i in 0..50 {
                    let id = format!("{t}-{i}");
                    let opts = RequestOptions::with_id(&id);
                    let p = d.route_prefill(tokens, &opts, None).unwrap();
                    assert!(p.remote);
                    d.route_decode(tokens, &opts, None, true).unwrap();
                    d.prefill_router().free_request(&id).unwrap();
                    d.decode_router().free_request(&id).unwrap();
                }
            });
        }
    });
    assert_eq!(d.prefill_router().metrics().unwrap().requests_active, 0);
    assert_eq!(d.decode_router().metrics().unwrap().requests_active, 0);
}
