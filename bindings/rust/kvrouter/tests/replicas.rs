//! Router replicas: booking changes published through a Rust closure and applied at a peer,
//! the announcement a publisher makes when installed (Reset, bookings, SyncRequest), a peer
//! answering a SyncRequest, a restarted replica replacing its stale bookings, replica ids,
//! a panicking publisher, liveness (a heartbeat, then the silent replica's bookings dropped on
//! a clock driven by hand). Sync over NATS is in ingest.rs.

mod common;

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{prompt, router};
use kvrouter::{Code, Disagg, DisaggOptions, RequestOptions, RouterOptions, RouterRef};

/// A publisher closure sending every change to a channel, and that channel's receiver.
fn bus() -> (
    impl Fn(&[u8]) + Send + Sync + 'static,
    mpsc::Receiver<Vec<u8>>,
) {
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    let tx = Mutex::new(tx);
    (
        move |change: &[u8]| tx.lock().unwrap().send(change.to_vec()).unwrap(),
        rx,
    )
}

/// Everything published so far.
fn drain(rx: &mpsc::Receiver<Vec<u8>>) -> Vec<Vec<u8>> {
    rx.try_iter().collect()
}

/// Applies `changes` to `peer`, in order.
fn deliver(peer: &RouterRef, changes: &[Vec<u8>]) {
    for change in changes {
        peer.apply_replica_event(change).unwrap();
    }
}

/// (replica_changes_applied, replica_changes_rejected, replica_requests_active,
/// requests_active).
fn replica_counts(router: &RouterRef) -> (u64, u64, u64, u64) {
    let m = router.metrics().unwrap();
    (
        m.replica_changes_applied,
        m.replica_changes_rejected,
        m.replica_requests_active,
        m.requests_active,
    )
}

/// Active requests per worker id, local and replicas' alike.
fn active_by_worker(router: &RouterRef) -> Vec<(u64, u64)> {
    let mut loads: Vec<(u64, u64)> = router
        .potential_loads(&prompt(999, 1), &RequestOptions::default())
        .unwrap()
        .iter()
        .map(|l| (l.worker_id, l.active_requests))
        .collect();
    loads.sort_unstable();
    loads
}

#[test]
fn installing_a_publisher_announces_a_reset_then_a_sync_request() {
    let (a, b) = (router(2), router(2));
    let (publish, rx) = bus();
    a.set_replica_publisher("replica-a", publish).unwrap();
    // Nothing booked: Reset, then SyncRequest, published before the call returned.
    let announced = drain(&rx);
    assert_eq!(announced.len(), 2, "a Reset and a SyncRequest");
    for change in &announced {
        assert_eq!(&change[4..8], b"KVSC", "a SequenceChange (file identifier)");
    }
    assert_ne!(announced[0], announced[1]);

    // A peer applies both; it held nothing from a, and has no publisher to answer with.
    deliver(&b, &announced);
    assert_eq!(replica_counts(&b), (2, 0, 0, 0));
    assert_eq!(active_by_worker(&b), [(1, 0), (2, 0)]);

    // Replacing the publisher says farewell through the old closure (a Reset), then announces
    // again through the new one.
    let (publish, rx2) = bus();
    a.set_replica_publisher("replica-a", publish).unwrap();
    assert_eq!(drain(&rx).len(), 1, "the replaced closure's farewell");
    assert_eq!(drain(&rx2).len(), 2);
    // Clearing says farewell, and then nothing more.
    a.clear_replica_publisher().unwrap();
    assert_eq!(drain(&rx2).len(), 1);
}

#[test]
fn a_peer_counts_the_other_replicas_bookings_as_load() {
    let (a, b) = (router(2), router(2));
    let (publish, rx) = bus();
    a.set_replica_publisher("replica-a", publish).unwrap();
    deliver(&b, &drain(&rx)); // the Reset and the SyncRequest
    assert_eq!(replica_counts(&b), (2, 0, 0, 0));
    let tokens = prompt(1, 32);

    // Without sync, b sees two idle workers; a books its request on one of them.
    let booked = a
        .find_best_match(&tokens, &RequestOptions::admit("r1"))
        .unwrap();
    let change = rx.try_recv().expect("a booking is published");
    assert!(rx.try_recv().is_err(), "one change per booking");
    b.apply_replica_event(&change).unwrap();
    assert_eq!(replica_counts(&b), (3, 0, 1, 1));

    // b now sends the same prompt to the other worker.
    let r = b
        .find_best_match(&tokens, &RequestOptions::default())
        .unwrap();
    assert_ne!(r.worker_id, booked.worker_id);

    // Applying the same booking twice is refused and counted; garbage too.
    assert_eq!(
        b.apply_replica_event(&change).unwrap_err().code(),
        Code::AlreadyExists
    );
    assert_eq!(
        b.apply_replica_event(b"junk").unwrap_err().code(),
        Code::InvalidArgument
    );
    assert_eq!(b.metrics().unwrap().replica_changes_rejected, 2);

    // The free travels too.
    a.free_request("r1").unwrap();
    b.apply_replica_event(&rx.try_recv().unwrap()).unwrap();
    assert_eq!(b.metrics().unwrap().replica_requests_active, 0);

    // Cleared: a farewell, then nothing more is published. Previews never are.
    a.clear_replica_publisher().unwrap();
    assert_eq!(drain(&rx).len(), 1);
    a.find_best_match(&tokens, &RequestOptions::admit("r2"))
        .unwrap();
    assert!(rx.try_recv().is_err());
}

#[test]
fn a_router_holding_bookings_announces_them_when_the_publisher_is_installed() {
    let a = router(2);
    let first = a
        .find_best_match(&prompt(3, 4), &RequestOptions::admit("r1"))
        .unwrap();
    let second = a
        .find_best_match(&prompt(4, 2), &RequestOptions::admit("r2"))
        .unwrap();
    assert_ne!(first.worker_id, second.worker_id, "the load spreads them");

    let (publish, rx) = bus();
    a.set_replica_publisher("replica-a", publish).unwrap();
    let announced = drain(&rx);
    assert_eq!(announced.len(), 4, "Reset, two Added, SyncRequest");

    // A fresh peer learns both bookings, on the same workers.
    let b = router(2);
    deliver(&b, &announced);
    assert_eq!(replica_counts(&b), (4, 0, 2, 2));
    assert_eq!(active_by_worker(&b), active_by_worker(&a));
    assert_eq!(active_by_worker(&b), [(1, 1), (2, 1)]);

    // The bookings are the peer's to track from then on: a free follows.
    a.free_request("r1").unwrap();
    deliver(&b, &drain(&rx));
    assert_eq!(b.metrics().unwrap().replica_requests_active, 1);
    assert_eq!(active_by_worker(&b), active_by_worker(&a));

    // Announced again (a second SyncRequest's answer, or a reinstall) nothing is counted twice.
    let (publish, rx) = bus();
    a.set_replica_publisher("replica-a", publish).unwrap();
    let again = drain(&rx);
    assert_eq!(again.len(), 3, "Reset, r2, SyncRequest");
    deliver(&b, &again);
    assert_eq!(b.metrics().unwrap().replica_requests_active, 1);
    assert_eq!(active_by_worker(&b), active_by_worker(&a));
}

#[test]
fn a_joining_replica_asks_and_its_peers_answer_with_their_bookings() {
    // a has been publishing for a while; its booking reached no one yet.
    let a = router(2);
    let (publish_a, from_a) = bus();
    a.set_replica_publisher("replica-a", publish_a).unwrap();
    drain(&from_a);
    a.find_best_match(&prompt(5, 3), &RequestOptions::admit("a1"))
        .unwrap();
    drain(&from_a);

    // c starts with a booking of its own and joins: Reset, Added c1, SyncRequest.
    let c = router(2);
    c.find_best_match(&prompt(6, 2), &RequestOptions::admit("c1"))
        .unwrap();
    let (publish_c, from_c) = bus();
    c.set_replica_publisher("replica-c", publish_c).unwrap();
    let joined = drain(&from_c);
    assert_eq!(joined.len(), 3);

    // a applies them: it now holds c1, and the SyncRequest makes it answer, on this thread,
    // with a Reset and its own booking (not c's, which it only holds).
    deliver(&a, &joined);
    assert_eq!(a.metrics().unwrap().replica_requests_active, 1);
    let answer = drain(&from_a);
    assert_eq!(answer.len(), 2, "Reset, Added a1");

    // c applies the answer: it sees a's booking as well as its own.
    deliver(&c, &answer);
    assert_eq!(replica_counts(&c), (2, 0, 1, 2));
    assert_eq!(active_by_worker(&c), active_by_worker(&a));
    assert!(from_c.try_recv().is_err(), "a Reset is not answered");
}

#[test]
fn a_restarted_replica_replaces_its_stale_bookings() {
    let b = router(2);
    {
        // The first life of replica "gw": two bookings reach b, their frees never do.
        let old = router(2);
        let (publish, rx) = bus();
        old.set_replica_publisher("gw", publish).unwrap();
        old.find_best_match(&prompt(7, 2), &RequestOptions::admit("x1"))
            .unwrap();
        old.find_best_match(&prompt(8, 2), &RequestOptions::admit("x2"))
            .unwrap();
        deliver(&b, &drain(&rx));
        assert_eq!(b.metrics().unwrap().replica_requests_active, 2);
    }
    // Restarted under the same id with one booking: its Reset drops the two stale ones.
    let new = router(2);
    new.find_best_match(&prompt(9, 2), &RequestOptions::admit("y1"))
        .unwrap();
    let (publish, rx) = bus();
    new.set_replica_publisher("gw", publish).unwrap();
    deliver(&b, &drain(&rx));
    assert_eq!(b.metrics().unwrap().replica_requests_active, 1);
    assert_eq!(active_by_worker(&b), active_by_worker(&new));

    // Another replica's Reset leaves them alone.
    let other = router(2);
    let (publish, rx) = bus();
    other.set_replica_publisher("gw2", publish).unwrap();
    deliver(&b, &drain(&rx));
    assert_eq!(b.metrics().unwrap().replica_requests_active, 1);
}

#[test]
fn replica_ids_are_checked() {
    let router = router(1);
    let held = Arc::new(());
    for id in ["", "a\x1fb", "\x1f", "trailing\x1f"] {
        let h = held.clone();
        let e = router
            .set_replica_publisher(id, move |_| {
                let _ = &h;
                panic!("a refused publisher is never called");
            })
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{id:?}");
        assert_eq!(
            Arc::strong_count(&held),
            1,
            "the refused closure is dropped"
        );
    }
    // A NUL byte cannot reach C at all.
    let e = router.set_replica_publisher("a\0b", |_| {}).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // A refused id leaves the installed publisher in place and silent.
    let (publish, rx) = bus();
    router.set_replica_publisher("gw-1", publish).unwrap();
    assert_eq!(drain(&rx).len(), 2);
    let e = router.set_replica_publisher("gw\x1f2", |_| {}).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(rx.try_recv().is_err());
    router
        .find_best_match(&prompt(10, 1), &RequestOptions::admit("r"))
        .unwrap();
    assert_eq!(
        drain(&rx).len(),
        1,
        "still publishing through the first closure"
    );

    // Any other text is fine.
    router.set_replica_publisher("gw-3:4171:é", |_| {}).unwrap();
    router.clear_replica_publisher().unwrap();
}

#[test]
fn replacing_a_publisher_drops_the_old_closure() {
    let router = router(1);
    let first = Arc::new(());
    let held = first.clone();
    router
        .set_replica_publisher("r", move |_| {
            let _ = &held;
        })
        .unwrap();
    assert_eq!(Arc::strong_count(&first), 2);
    router.set_replica_publisher("r", |_| {}).unwrap();
    assert_eq!(
        Arc::strong_count(&first),
        1,
        "the replaced closure is freed"
    );

    let second = Arc::new(());
    let held = second.clone();
    router
        .set_replica_publisher("r", move |_| {
            let _ = &held;
        })
        .unwrap();
    drop(router);
    assert_eq!(Arc::strong_count(&second), 1, "freed with its router");
}

#[test]
fn overlapping_setters_on_one_router_free_every_closure_they_replaced() {
    // Setters do not hold the closure table across the C call (a closure may lock it): one
    // frees only the closures of setters that returned before it started, as it cannot tell
    // which of those that overlapped it C applied last. None may be freed while C can call it
    // (routing threads make the closures run meanwhile), and none is kept for ever.
    let router = Arc::new(router(2));
    let alive = Arc::new(());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut threads = Vec::new();
    for t in 0..2u32 {
        let (router, stop) = (router.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let id = format!("route-{t}-{n}");
                router
                    .find_best_match(&prompt(t, 2), &RequestOptions::admit(&id))
                    .unwrap();
                router.free_request(&id).unwrap();
                n += 1;
            }
        }));
    }
    let setters: Vec<_> = (0..4)
        .map(|_| {
            let (router, alive) = (router.clone(), alive.clone());
            std::thread::spawn(move || {
                for _ in 0..200 {
                    let held = alive.clone();
                    router
                        .set_replica_publisher("r", move |change| {
                            assert!(!change.is_empty());
                            let _ = &held;
                        })
                        .unwrap();
                }
            })
        })
        .collect();
    for setter in setters {
        setter.join().unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for thread in threads {
        thread.join().unwrap();
    }
    // A setter that starts after every other returned frees all they installed.
    router.set_replica_publisher("r", |_| {}).unwrap();
    assert_eq!(Arc::strong_count(&alive), 1, "every replaced closure freed");

    let held = alive.clone();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let held = held.clone();
                router
                    .set_replica_publisher("r", move |_| {
                        let _ = &held;
                    })
                    .unwrap();
            });
        }
    });
    drop(held);
    assert!(
        Arc::strong_count(&alive) >= 2,
        "the current closure is kept"
    );
    drop(Arc::try_unwrap(router).unwrap_or_else(|_| panic!("the threads are done")));
    assert_eq!(Arc::strong_count(&alive), 1, "freed with their router");
}

#[test]
fn a_disaggs_pools_free_their_closures_with_it() {
    let opts = RouterOptions::with_block_size(common::BS);
    let d = Disagg::new(&opts, &opts, &DisaggOptions::default()).unwrap();
    let (prefill, decode) = (Arc::new(()), Arc::new(()));
    let held = prefill.clone();
    d.prefill_router()
        .set_replica_publisher("p", move |_| {
            let _ = &held;
        })
        .unwrap();
    let held = decode.clone();
    d.decode_router()
        .set_replica_publisher("d", move |_| {
            let _ = &held;
        })
        .unwrap();
    assert_eq!(Arc::strong_count(&prefill), 2);
    assert_eq!(Arc::strong_count(&decode), 2);
    drop(d);
    assert_eq!(
        Arc::strong_count(&prefill),
        1,
        "freed with the prefill pool"
    );
    assert_eq!(Arc::strong_count(&decode), 1, "freed with the decode pool");
}

#[test]
fn a_panicking_publisher_unwinds_in_the_caller_not_through_c() {
    let router = router(1);
    let alive = Arc::new(());
    let held = alive.clone();
    let calls = Arc::new(Mutex::new(0u32));
    let counted = calls.clone();
    let install = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        router.set_replica_publisher("r", move |_| {
            let _ = &held;
            *counted.lock().unwrap() += 1;
            panic!("publisher failed");
        })
    }));
    // The announcement (Reset, SyncRequest) ran the closure inside the call: the panic comes
    // out of set_replica_publisher, and the closure stays installed and alive.
    let payload = install.expect_err("the announcement's panic reaches the caller");
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"publisher failed"));
    assert_eq!(
        *calls.lock().unwrap(),
        2,
        "both messages were still offered"
    );
    assert_eq!(Arc::strong_count(&alive), 2, "C still holds the closure");

    let tokens = prompt(2, 2);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        router.find_best_match(&tokens, &RequestOptions::admit("p"))
    }));
    let payload = result.expect_err("the panic reaches the caller");
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"publisher failed"));
    assert_eq!(*calls.lock().unwrap(), 3);
    // The router is intact: the booking was made before the callback ran.
    assert_eq!(router.metrics().unwrap().requests_active, 1);
    // Clearing offers the farewell to the closure, whose panic comes out of the call; cleared
    // all the same.
    let cleared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        router.clear_replica_publisher()
    }));
    assert!(cleared.is_err(), "the farewell's panic reaches the caller");
    assert_eq!(*calls.lock().unwrap(), 4);
    assert_eq!(Arc::strong_count(&alive), 1, "freed once cleared");
    router.free_request("p").unwrap();
}

#[test]
fn a_silent_replica_that_sent_heartbeats_is_expired_with_its_bookings() {
    let (a, b) = (router(2), router(2));
    let (publish, rx) = bus();
    a.set_replica_publisher("replica-a", publish).unwrap();
    b.set_time(0).unwrap();
    deliver(&b, &drain(&rx)); // the Reset and the SyncRequest
    a.find_best_match(&prompt(1, 4), &RequestOptions::admit("r1"))
        .unwrap();
    a.replica_heartbeat(1000).unwrap();
    let changes = drain(&rx);
    assert_eq!(changes.len(), 2, "the booking and the heartbeat");
    deliver(&b, &changes);
    let m = b.metrics().unwrap();
    assert_eq!((m.replicas_live, m.replicas_expired), (1, 0));
    // The router counts a heartbeat as an applied change, as it counts a Reset or a SyncRequest.
    assert_eq!(replica_counts(&b), (4, 0, 1, 1));

    // 9 s of silence is within a 10 s timeout (three 1 s intervals are less).
    b.set_time(9_000_000_000).unwrap();
    assert_eq!(b.expire_replicas(Duration::from_secs(10)).unwrap(), 0);
    b.set_time(11_000_000_000).unwrap();
    assert_eq!(b.expire_replicas(Duration::from_secs(10)).unwrap(), 1);
    let m = b.metrics().unwrap();
    assert_eq!((m.replicas_live, m.replicas_expired), (0, 1));
    assert_eq!(replica_counts(&b), (4, 0, 0, 0), "a's booking is gone at b");
    assert_eq!(active_by_worker(&b), [(1, 0), (2, 0)]);
    assert_eq!(b.expire_replicas(Duration::from_secs(10)).unwrap(), 0);
    assert_eq!(a.metrics().unwrap().requests_active, 1, "a keeps its own");

    assert_eq!(
        a.replica_heartbeat(0).unwrap_err().code(),
        Code::InvalidArgument
    );
    assert_eq!(
        b.replica_heartbeat(1000).unwrap_err().code(),
        Code::FailedPrecondition,
        "b has no publisher"
    );
    assert_eq!(
        b.expire_replicas(Duration::ZERO).unwrap_err().code(),
        Code::InvalidArgument
    );
    assert!(rx.try_recv().is_err(), "refused heartbeats publish nothing");
}
