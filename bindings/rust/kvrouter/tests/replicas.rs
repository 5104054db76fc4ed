//! Router replicas: booking changes published through a Rust closure and applied at a peer,
//! a panicking publisher, and sync over NATS.

mod common;

use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use common::{prompt, router};
use kvrouter::{Code, RequestOptions};

#[test]
fn a_peer_counts_the_other_replicas_bookings_as_load() {
    let (a, b) = (router(2), router(2));
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    let tx = Mutex::new(tx);
    a.set_replica_publisher("replica-a", move |change| {
        tx.lock().unwrap().send(change.to_vec()).unwrap();
    })
    .unwrap();
    let tokens = prompt(1, 32);

    // Without sync, b sees two idle workers; a books its request on one of them.
    let booked = a
        .find_best_match(&tokens, &RequestOptions::admit("r1"))
        .unwrap();
    let change = rx.try_recv().expect("a booking is published");
    assert!(rx.try_recv().is_err(), "one change per booking");
    b.apply_replica_event(&change).unwrap();
    let m = b.metrics().unwrap();
    assert_eq!(
        (
            m.replica_changes_applied,
            m.replica_requests_active,
            m.requests_active
        ),
        (1, 1, 1)
    );

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

    // Cleared: nothing more is published. Previews never are.
    a.clear_replica_publisher().unwrap();
    a.find_best_match(&tokens, &RequestOptions::admit("r2"))
        .unwrap();
    assert!(rx.try_recv().is_err());
    let e = a.set_replica_publisher("", |_| {}).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
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
fn a_panicking_publisher_unwinds_in_the_caller_not_through_c() {
    let router = router(1);
    router
        .set_replica_publisher("r", |_| panic!("publisher failed"))
        .unwrap();
    let tokens = prompt(2, 2);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        router.find_best_match(&tokens, &RequestOptions::admit("p"))
    }));
    let payload = result.expect_err("the panic reaches the caller");
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"publisher failed"));
    // The router is intact: the booking was made before the callback ran.
    assert_eq!(router.metrics().unwrap().requests_active, 1);
    router.clear_replica_publisher().unwrap();
    router.free_request("p").unwrap();
}
