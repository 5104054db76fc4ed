//! Panics in replica publisher closures: caught at the C boundary, and resumed only by the
//! call during which they were caught. Scenarios that aborted the process before run in a
//! child process (`common::run_in_child`), so that they fail their test, not the binary.

mod common;

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use common::{in_child, router, run_in_child, skipped_without_nats, NatsServer};
use kvrouter::{Ingest, IngestOptions};

fn payload_number(payload: &(dyn Any + Send)) -> Option<u32> {
    payload.downcast_ref::<u32>().copied()
}

#[test]
fn the_first_panic_of_a_call_is_the_one_resumed() {
    // The announcement runs the closure twice (Reset, SyncRequest): both panic.
    let router = router(1);
    let calls = AtomicU32::new(0);
    let calls = Arc::new(calls);
    let counted = calls.clone();
    let install = panic::catch_unwind(AssertUnwindSafe(|| {
        router.set_replica_publisher("a", move |_| {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            panic::panic_any(n);
        })
    }));
    let payload = install.expect_err("the announcement's panic reaches the caller");
    assert_eq!(calls.load(Ordering::SeqCst), 2, "Reset and SyncRequest");
    assert_eq!(
        payload_number(&*payload),
        Some(1),
        "the first panic is resumed, the second dropped"
    );
}

/// A panic payload whose `Drop` panics (when the thread is not already unwinding).
struct Bomb;

impl Drop for Bomb {
    fn drop(&mut self) {
        if !thread::panicking() {
            panic!("a panic payload's Drop panics");
        }
    }
}

#[test]
fn a_payload_whose_drop_panics_does_not_abort() {
    const TEST: &str = "a_payload_whose_drop_panics_does_not_abort";
    if in_child(TEST) {
        let router = router(1);
        // Both calls of the announcement panic with a Bomb: the second is dropped, and its
        // Drop's panic must not unwind out of the extern "C" trampoline (an abort).
        let install = panic::catch_unwind(AssertUnwindSafe(|| {
            router.set_replica_publisher("a", |_| panic::panic_any(Bomb))
        }));
        let payload = install.expect_err("the announcement's panic reaches the caller");
        assert!(payload.downcast_ref::<Bomb>().is_some());
        std::mem::forget(payload); // dropping it here would panic: it is the test's Bomb
        println!("child: done");
        return;
    }
    let run = run_in_child(TEST, Duration::from_secs(30));
    run.assert_success("a Bomb payload dropped by the trampoline");
    assert!(run.output.contains("child: done"), "{}", run.output);
}

#[test]
fn a_panic_on_an_ingest_thread_is_not_resumed_by_a_later_call_there() {
    const TEST: &str = "a_panic_on_an_ingest_thread_is_not_resumed_by_a_later_call_there";
    let Some(server) = NatsServer::start() else {
        skipped_without_nats(TEST);
        return;
    };
    let router = Arc::new(router(1));
    let other = Arc::new(common::router(1));
    let ingest = Ingest::with_shared_router(
        router.clone(),
        &IngestOptions {
            replica_heartbeat_ms: 20,
            ..IngestOptions::default()
        },
    )
    .unwrap();
    ingest.start().unwrap();
    ingest
        .sync_replicas(&server.url(), "kvrouter.test.panics", "a")
        .unwrap();
    // Replacing the sync's publisher, the closure receives the sync's heartbeats, on the
    // ingest's loop thread, where no Rust call waits to resume a panic.
    let main = thread::current().id();
    let calls = Arc::new(AtomicU32::new(0));
    let (report, reported) = mpsc::channel();
    router
        .set_replica_publisher("a", move |_| {
            if thread::current().id() == main {
                return; // the announcement, inside set_replica_publisher
            }
            match calls.fetch_add(1, Ordering::SeqCst) {
                0 => panic::panic_any(7u32),
                1 => {
                    // An unrelated call on that thread, which ran no panicking callback.
                    let call = panic::catch_unwind(AssertUnwindSafe(|| other.metrics()));
                    let _ = report.send(call.map(|_| ()).map_err(|p| payload_number(&*p)));
                }
                _ => {}
            }
        })
        .unwrap();
    let second = reported
        .recv_timeout(Duration::from_secs(10))
        .expect("a second heartbeat on the loop thread");
    assert_eq!(
        second,
        Ok(()),
        "other.metrics() resumed the panic of an earlier callback of the loop thread"
    );
    drop(ingest);
}
