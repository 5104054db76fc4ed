//! KV events one by one and in FlatBuffers batches, the batch encoder, snapshots.

mod common;

use common::{prompt, router, store, BS};
use kvrouter::{
    Code, EventBatch, EventKind, EventOutcome, RemovedEvent, RequestOptions, Router, RouterOptions,
    SlidingWindow, StoredEvent, Tier,
};

fn device_blocks(router: &kvrouter::RouterRef, tokens: &[u32], worker: u64) -> u32 {
    router
        .overlap_scores(tokens, &RequestOptions::default())
        .unwrap()
        .iter()
        .find(|o| o.worker_id == worker)
        .map_or(0, |o| o.device_blocks)
}

#[test]
fn removed_and_cleared_events_drop_blocks() {
    let router = router(2);
    let tokens = prompt(1, 4);
    store(&router, 1, &tokens, 4, 100);
    store(&router, 2, &tokens, 4, 200);
    assert_eq!(device_blocks(&router, &tokens, 1), 4);

    // Removing block 3 (engine hash 102) leaves the first two as the cached prefix.
    router
        .apply_removed(&RemovedEvent {
            worker_id: 1,
            block_hashes: &[102],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(device_blocks(&router, &tokens, 1), 2);

    // An unknown engine hash is reported and counted.
    let e = router
        .apply_removed(&RemovedEvent {
            worker_id: 1,
            block_hashes: &[999],
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let m = router.metrics().unwrap();
    assert_eq!(m.events(EventKind::Removed, EventOutcome::Applied), 1);
    assert_eq!(m.events(EventKind::Removed, EventOutcome::BlockNotFound), 1);

    router.apply_cleared(2, 0, 300).unwrap();
    assert_eq!(device_blocks(&router, &tokens, 2), 0);
    assert_eq!(device_blocks(&router, &tokens, 1), 2);
}

#[test]
fn an_encoded_batch_applies_like_its_events() {
    let tokens = prompt(2, 6);
    let other = prompt(3, 2);
    let mut batch = EventBatch::new().unwrap();
    assert!(batch.is_empty());
    batch
        .add_stored(&StoredEvent {
            worker_id: 1,
            event_id: 1,
            block_hashes: &[10, 11, 12, 13],
            token_ids: &tokens[..4 * BS as usize],
            ..Default::default()
        })
        .unwrap();
    // A continuation with a parent, on the host tier.
    batch
        .add_stored(&StoredEvent {
            worker_id: 1,
            event_id: 2,
            parent_hash: Some(13),
            tier: Tier::HostPinned,
            block_hashes: &[14, 15],
            token_ids: &tokens[4 * BS as usize..],
            ..Default::default()
        })
        .unwrap();
    batch
        .add_stored(&StoredEvent {
            worker_id: 2,
            event_id: 3,
            block_hashes: &[20, 21],
            token_ids: &other,
            ..Default::default()
        })
        .unwrap();
    batch
        .add_removed(&RemovedEvent {
            worker_id: 1,
            event_id: 4,
            block_hashes: &[13],
            ..Default::default()
        })
        .unwrap();
    batch.add_cleared(2, 0, 5).unwrap();
    assert_eq!(batch.len(), 5);
    // The encoder knows no block size, so a partial block is only refused when applied.
    batch
        .add_stored(&StoredEvent {
            worker_id: 1,
            event_id: 6,
            block_hashes: &[30],
            token_ids: &other[..3],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(batch.len(), 6);

    let bytes = batch.encode().unwrap();
    assert!(bytes.len() > 64);
    assert_eq!(batch.len(), 6, "encoding keeps the events");

    // The bad event is reported; every other event of the batch applied.
    let router = router(2);
    let e = router.apply_event_batch(&bytes).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let overlaps = router
        .overlap_scores(&tokens, &RequestOptions::default())
        .unwrap();
    assert_eq!(overlaps.len(), 1);
    assert_eq!((overlaps[0].worker_id, overlaps[0].device_blocks), (1, 3));
    assert_eq!(device_blocks(&router, &other, 2), 0);
    let m = router.metrics().unwrap();
    assert_eq!(m.events(EventKind::Stored, EventOutcome::Applied), 3);
    assert_eq!(m.events(EventKind::Removed, EventOutcome::Applied), 1);
    assert_eq!(m.events(EventKind::Cleared, EventOutcome::Applied), 1);
    assert_eq!(m.events(EventKind::Stored, EventOutcome::InvalidBlock), 1);

    // A truncated batch fails verification and changes nothing.
    let fresh = common::router(2);
    let e = fresh
        .apply_event_batch(&bytes[..bytes.len() / 2])
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(fresh.metrics().unwrap().index_blocks, 0);

    batch.clear();
    assert!(batch.is_empty());
    let empty = batch.encode().unwrap();
    fresh.apply_event_batch(&empty).unwrap();
}

/// tests/capi/events_test.c's sliding_window_stores_and_removals: a hybrid model's
/// sliding-window stores and removals, one by one and in a batch.
#[test]
fn sliding_window_stores_and_removals() {
    let router = router(2);
    let tokens = prompt(7, 4);
    store(&router, 1, &tokens, 4, 100); // engine hashes 100..=103
    let mut longer = tokens.clone(); // the prompt and one more token: 4 blocks to resume
    longer.push(7);
    let mut shorter = tokens.clone(); // shares the first 3 blocks only
    shorter[3 * BS as usize..].fill(999);
    // Group 0's 32-token window holds the last two blocks.
    let window = StoredEvent {
        worker_id: 1,
        block_hashes: &[102, 103],
        sliding_window: Some(SlidingWindow {
            group: 0,
            window_tokens: 2 * BS,
        }),
        ..Default::default()
    };
    router.apply_stored(&window).unwrap();
    assert_eq!(device_blocks(&router, &longer, 1), 4);
    let preview = router
        .find_best_match(&longer, &RequestOptions::default())
        .unwrap();
    assert_eq!((preview.worker_id, preview.device_overlap_blocks), (1, 4));
    // Resuming at block 3 needs blocks 1 and 2 in the window, which lacks block 1: nothing.
    assert_eq!(device_blocks(&router, &shorter, 1), 0);

    // A block full attention does not hold cannot be placed (counted as a reject).
    let unheld = StoredEvent {
        block_hashes: &[999],
        ..window
    };
    assert_eq!(
        router.apply_stored(&unheld).unwrap_err().code(),
        Code::NotFound
    );
    // A sliding-window store names blocks only, on the device (refused before it applies).
    let with_tokens = StoredEvent {
        token_ids: &tokens[2 * BS as usize..],
        ..window
    };
    assert_eq!(
        router.apply_stored(&with_tokens).unwrap_err().code(),
        Code::InvalidArgument
    );
    let on_host = StoredEvent {
        tier: Tier::HostPinned,
        ..window
    };
    assert_eq!(
        router.apply_stored(&on_host).unwrap_err().code(),
        Code::InvalidArgument
    );

    // The window lets block 3 go: no hit left on worker 1; its full-attention blocks stay.
    router
        .apply_removed(&RemovedEvent {
            worker_id: 1,
            block_hashes: &[103],
            sliding_group: Some(0),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(device_blocks(&router, &longer, 1), 0);
    let m = router.metrics().unwrap();
    assert_eq!((m.index_blocks, m.index_sliding_blocks), (4, 1));
    assert_eq!(
        (m.sliding_events_applied, m.sliding_events_rejected),
        (2, 1)
    );

    // The same store through an event batch brings the hit back; a removal in a batch takes it
    // away again.
    let mut batch = EventBatch::new().unwrap();
    assert_eq!(
        batch.add_stored(&with_tokens).unwrap_err().code(),
        Code::InvalidArgument
    );
    batch
        .add_stored(&StoredEvent {
            block_hashes: &[103],
            ..window
        })
        .unwrap();
    router.apply_event_batch(&batch.encode().unwrap()).unwrap();
    assert_eq!(device_blocks(&router, &longer, 1), 4);
    batch.clear();
    batch
        .add_removed(&RemovedEvent {
            worker_id: 1,
            block_hashes: &[102],
            sliding_group: Some(0),
            ..Default::default()
        })
        .unwrap();
    router.apply_event_batch(&batch.encode().unwrap()).unwrap();
    assert_eq!(device_blocks(&router, &longer, 1), 0);
    let m = router.metrics().unwrap();
    assert_eq!((m.index_blocks, m.index_sliding_blocks), (4, 1));
    assert_eq!(
        (m.sliding_events_applied, m.sliding_events_rejected),
        (4, 1)
    );
}

#[test]
fn snapshots_restore_the_index() {
    let router = router(3);
    let tokens = prompt(4, 8);
    store(&router, 1, &tokens, 8, 100);
    store(&router, 2, &tokens, 3, 200);
    let snapshot = router.snapshot().unwrap();
    assert!(!snapshot.is_empty());

    let replica = common::router(3);
    replica.restore(&snapshot).unwrap();
    let opts = RequestOptions::default();
    assert_eq!(
        replica.overlap_scores(&tokens, &opts).unwrap(),
        router.overlap_scores(&tokens, &opts).unwrap()
    );
    assert_eq!(
        replica.find_best_match(&tokens, &opts).unwrap().worker_id,
        1
    );
    // Engine hashes came along: a removal by engine hash applies on the replica.
    replica
        .apply_removed(&RemovedEvent {
            worker_id: 1,
            block_hashes: &[100],
            ..Default::default()
        })
        .unwrap();

    // Restoring over a non-empty index, garbage, or another block size is refused.
    assert_eq!(
        replica.restore(&snapshot).unwrap_err().code(),
        Code::FailedPrecondition
    );
    let fresh = common::router(1);
    assert_eq!(
        fresh.restore(b"garbage!").unwrap_err().code(),
        Code::InvalidArgument
    );
    let other = Router::new(&RouterOptions::with_block_size(32)).unwrap();
    assert_eq!(
        other.restore(&snapshot).unwrap_err().code(),
        Code::InvalidArgument
    );
}

#[test]
fn every_call_taking_encoded_bytes_refuses_empty_ones_alike() {
    // Before, restore(&[]) passed NULL and got "data is NULL", while the others said how short.
    let router = router(1);
    for (what, result) in [
        ("index snapshot", router.restore(&[])),
        ("event batch", router.apply_event_batch(&[])),
        ("replica change", router.apply_replica_event(&[])),
    ] {
        let e = result.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e}");
        assert_eq!(
            e.message(),
            format!("{what} of 0 bytes is too short to be a FlatBuffer"),
            "{what}"
        );
    }
    assert_eq!(router.metrics().unwrap().index_blocks, 0);
}

#[test]
fn approximate_mode_refuses_events_and_learns_from_decisions() {
    let router = Router::new(&RouterOptions {
        approximate: true,
        ..RouterOptions::with_block_size(BS)
    })
    .unwrap();
    for w in 1..=3 {
        router.add_worker(&kvrouter::WorkerConfig::new(w)).unwrap();
    }
    let tokens = prompt(5, 4);
    let e = router
        .apply_stored(&StoredEvent {
            worker_id: 1,
            block_hashes: &[1],
            token_ids: &tokens[..BS as usize],
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);

    // An admitted decision is recorded: the same prompt goes back to that worker.
    let first = router
        .find_best_match(&tokens, &RequestOptions::admit("a"))
        .unwrap();
    router.free_request("a").unwrap();
    let again = router
        .find_best_match(&tokens, &RequestOptions::default())
        .unwrap();
    assert_eq!(again.worker_id, first.worker_id);
    assert_eq!(again.device_overlap_blocks, 4);
}
