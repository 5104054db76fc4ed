//! An `Ingest` dropped or stopped from inside a replica publisher closure, which the library
//! runs under its router's lock on the thread making a change: a caller's, or the ingest's own
//! loop thread (its sync's heartbeats go through the router's current publisher). There the
//! free would join the loop thread from itself (std::terminate: SIGABRT), so it moves to a
//! thread of its own, as does `stop`. Scenarios that aborted run in a child process.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread;
use std::time::Duration;

use common::{
    child_nats_url, in_child, router, run_in_child, run_in_child_with, skipped_without_nats,
    wait_for, NatsServer, CHILD_NATS_URL,
};
use kvrouter::{Code, Ingest, IngestOptions, Publisher, Router};

/// Beats every 20 ms.
fn beating() -> IngestOptions {
    IngestOptions {
        replica_heartbeat_ms: 20,
        ..IngestOptions::default()
    }
}

/// A started ingest object for `router`, syncing its replicas over the nats-server at `url`:
/// once a Rust publisher replaces the sync's, the sync's heartbeats call it on the loop thread.
fn syncing(router: &Arc<Router>, url: &str, subject: &str) -> Ingest<'static> {
    let ingest = Ingest::with_shared_router(router.clone(), &beating()).unwrap();
    ingest.start().unwrap();
    ingest.sync_replicas(url, subject, "a").unwrap();
    ingest
}

static OWNED: Mutex<Option<(Ingest<'static>, Arc<Router>)>> = Mutex::new(None);

#[test]
fn a_publisher_on_the_loop_thread_may_drop_the_last_ingest_and_router() {
    const TEST: &str = "a_publisher_on_the_loop_thread_may_drop_the_last_ingest_and_router";
    if !in_child(TEST) {
        // The server is the parent's: a child killed after its deadline runs no Drop.
        let Some(server) = NatsServer::start() else {
            skipped_without_nats(TEST);
            return;
        };
        let url = server.url();
        let run = run_in_child_with(TEST, Duration::from_secs(60), &[(CHILD_NATS_URL, &url)]);
        run.assert_success("the last Ingest and Arc<Router> dropped on the loop thread");
        assert!(run.output.contains("child: done"), "{}", run.output);
        return;
    }
    let router = Arc::new(router(1));
    let weak = Arc::downgrade(&router);
    let ingest = syncing(&router, &child_nats_url(), "kvrouter.test.drop");
    let endpoint = ingest.listen("tcp://127.0.0.1:0").unwrap().endpoint;
    *OWNED.lock().unwrap() = Some((ingest, router.clone()));
    let main = thread::current().id();
    let (dropped, on_loop) = mpsc::channel();
    router
        .set_replica_publisher("a", move |_| {
            if thread::current().id() == main {
                return; // the announcement, inside set_replica_publisher
            }
            // A heartbeat, on the ingest's loop thread: the closure drops the last handles of
            // the ingest object and of the router (this closure's own: the table frees it with
            // the router).
            if let Some(owned) = OWNED.lock().unwrap().take() {
                drop(owned);
                let _ = dropped.send(thread::current().name().map(str::to_owned));
            }
        })
        .unwrap();
    drop(router);
    let thread = on_loop
        .recv_timeout(Duration::from_secs(10))
        .expect("a heartbeat on the loop thread");
    println!("child: dropped on thread {thread:?}");
    // The free, then the router's, on a thread of their own once the publisher returned.
    wait_for("the router freed", || {
        weak.upgrade().is_none().then_some(())
    });
    let e = Publisher::connect(&endpoint).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    println!("child: done");
}

#[test]
fn a_publisher_on_the_callers_thread_may_drop_the_last_ingest() {
    // The closure runs inside routing calls, under the router's lock; a free there would join
    // a loop that may wait for that lock. Bounded, in a child: a deadlock fails the test.
    const TEST: &str = "a_publisher_on_the_callers_thread_may_drop_the_last_ingest";
    if !in_child(TEST) {
        run_in_child(TEST, Duration::from_secs(60)).assert_success("dropped inside a booking");
        return;
    }
    let router = Arc::new(router(1));
    let ingest = Ingest::with_shared_router(router.clone(), &IngestOptions::default()).unwrap();
    ingest.start().unwrap();
    let endpoint = ingest.listen("tcp://127.0.0.1:0").unwrap().endpoint;
    let slot = Arc::new(Mutex::new(Some(ingest)));
    let held = slot.clone();
    let armed = Arc::new(AtomicBool::new(false));
    let arm = armed.clone();
    router
        .set_replica_publisher("a", move |_| {
            if arm.load(Ordering::SeqCst) {
                drop(held.lock().unwrap().take());
            }
        })
        .unwrap();
    armed.store(true, Ordering::SeqCst);
    let tokens = common::prompt(1, 2);
    router
        .find_best_match(&tokens, &kvrouter::RequestOptions::admit("r1"))
        .unwrap(); // the booking's change: the closure drops the ingest
    assert!(slot.lock().unwrap().is_none());
    wait_for("the ingest freed", || {
        Publisher::connect(&endpoint).is_err().then_some(())
    });
    router.free_request("r1").unwrap();
    // Its Arc goes after the free, on the freeing thread.
    wait_for("the ingest's Arc dropped", || {
        (Arc::strong_count(&router) == 1).then_some(())
    });
}

#[test]
fn stop_from_a_publisher_on_the_loop_thread_is_asynchronous() {
    const TEST: &str = "stop_from_a_publisher_on_the_loop_thread_is_asynchronous";
    let Some(server) = NatsServer::start() else {
        skipped_without_nats(TEST);
        return;
    };
    let router = Arc::new(router(1));
    let ingest = Arc::new(syncing(&router, &server.url(), "kvrouter.test.stop"));
    let shared: Arc<OnceLock<Arc<Ingest<'static>>>> = Arc::new(OnceLock::new());
    let seen = shared.clone();
    let main = thread::current().id();
    let (stopped, reported) = mpsc::channel();
    router
        .set_replica_publisher("a", move |_| {
            if thread::current().id() == main {
                return;
            }
            if let Some(ingest) = seen.get() {
                let _ = stopped.send(ingest.stop()); // &self: through the Arc
            }
        })
        .unwrap();
    let _ = shared.set(ingest.clone());
    let result = reported
        .recv_timeout(Duration::from_secs(10))
        .expect("a heartbeat on the loop thread");
    assert_eq!(result, Ok(()), "returns at once");
    // Stopped soon after, by a thread of its own: a stopped ingest takes no new source.
    wait_for("the ingest stopped", || {
        ingest
            .listen("tcp://127.0.0.1:0")
            .err()
            .filter(|e| e.code() == Code::FailedPrecondition)
    });
    // Outside a publisher it is synchronous, and idempotent.
    ingest.stop().unwrap();
}

#[test]
fn stop_is_concurrent_with_the_other_calls() {
    // &self: it may be called through a shared reference while other threads use the object.
    let router = Arc::new(router(1));
    let ingest = Arc::new(Ingest::with_shared_router(router, &IngestOptions::default()).unwrap());
    ingest.start().unwrap();
    thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..50 {
                    let _ = ingest.total_stats().unwrap();
                    let _ = ingest.listen("tcp://127.0.0.1:0");
                }
            });
        }
        s.spawn(|| ingest.stop().unwrap());
    });
    let e = ingest.listen("tcp://127.0.0.1:0").unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
}

#[test]
fn a_scope_is_refused_inside_a_publisher() {
    let router = router(1);
    let other = Arc::new(common::router(1));
    let (report, reported) = mpsc::channel();
    let report = Mutex::new(Some(report));
    // The announcement runs the closure inside set_replica_publisher.
    router
        .set_replica_publisher("a", move |_| {
            if let Some(report) = report.lock().unwrap().take() {
                let r = Ingest::scope(&other, &IngestOptions::default(), |_| ());
                let _ = report.send(r);
            }
        })
        .unwrap();
    let e = reported.recv().unwrap().unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
}
