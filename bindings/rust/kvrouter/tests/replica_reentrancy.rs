//! A replica publisher closure that drops a router, or installs another router's publisher,
//! while the library runs it (its announcement, its farewell): the binding holds no lock of its
//! own then. A test binary of its own, every test under a deadline: a binding that deadlocked
//! would leave its closure table locked for good, and any other test using it would hang.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::router;
use kvrouter::Router;

/// Runs `f` on a thread of its own and fails if it has not returned within 10 s (a deadlock
/// fails the test instead of hanging it; the stuck thread is left behind). A panic in `f` is
/// resumed here.
fn within_deadline(f: impl FnOnce() + Send + 'static) {
    let (done, finished) = mpsc::channel();
    let worker = thread::spawn(move || {
        f();
        let _ = done.send(());
    });
    match finished.recv_timeout(Duration::from_secs(10)) {
        Ok(()) => worker.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            // f panicked: the sender went with the unwinding thread.
            if let Err(payload) = worker.join() {
                std::panic::resume_unwind(payload);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("deadlocked: not done after 10 s"),
    }
}

/// A router with a publisher installed whose closure holds a clone of the returned Arc (its
/// strong count tells whether the closure has been freed).
fn router_with_publisher(id: &str) -> (Router, Arc<()>) {
    let r = router(1);
    let alive = Arc::new(());
    let held = alive.clone();
    r.set_replica_publisher(id, move |_| {
        let _ = &held;
    })
    .unwrap();
    (r, alive)
}

#[test]
fn a_publisher_may_drop_a_router_while_it_is_installed() {
    within_deadline(|| {
        let a = router(1);
        let (b, b_alive) = router_with_publisher("b");
        let owned = Mutex::new(Some(b));
        let dropped = Arc::new(AtomicBool::new(false));
        let seen = dropped.clone();
        // Its announcement (Reset, SyncRequest) runs it inside set_replica_publisher.
        a.set_replica_publisher("a", move |_| {
            if let Some(b) = owned.lock().unwrap().take() {
                drop(b);
                seen.store(true, Ordering::SeqCst);
            }
        })
        .unwrap();
        assert!(
            dropped.load(Ordering::SeqCst),
            "b was dropped by the announcement"
        );
        assert_eq!(Arc::strong_count(&b_alive), 1, "b's closure freed with b");
        a.clear_replica_publisher().unwrap();
    });
}

#[test]
fn a_replaced_publisher_may_drop_a_router_on_its_farewell() {
    within_deadline(|| {
        let a = router(1);
        let (b, b_alive) = router_with_publisher("b");
        let owned = Mutex::new(Some(b));
        let armed = Arc::new(AtomicBool::new(false));
        let farewell = armed.clone();
        a.set_replica_publisher("a", move |_| {
            if farewell.load(Ordering::SeqCst) {
                drop(owned.lock().unwrap().take());
            }
        })
        .unwrap();
        assert_eq!(
            Arc::strong_count(&b_alive),
            2,
            "b is alive after the announcement"
        );
        armed.store(true, Ordering::SeqCst);
        // The old closure's farewell (a Reset) runs inside this call, and drops b.
        a.set_replica_publisher("a", |_| {}).unwrap();
        assert_eq!(Arc::strong_count(&b_alive), 1, "b's closure freed with b");
    });
}

#[test]
fn a_publisher_may_install_another_routers_publisher() {
    // The header advises against calling a router from a publisher (two routers publishing to
    // each other synchronously could deadlock on their own locks); nothing here calls back, so
    // only a lock of the binding's could deadlock.
    within_deadline(|| {
        let a = router(1);
        let b = Arc::new(router(1));
        let b_alive = Arc::new(());
        let held = Mutex::new(Some(b_alive.clone()));
        let target = b.clone();
        a.set_replica_publisher("a", move |_| {
            if let Some(alive) = held.lock().unwrap().take() {
                target
                    .set_replica_publisher("b", move |_| {
                        let _ = &alive;
                    })
                    .unwrap();
            }
        })
        .unwrap();
        assert_eq!(Arc::strong_count(&b_alive), 2, "b's publisher installed");
        // a's closure holds a clone of b: freed first, so that b's drop frees b's closure.
        drop(a);
        let b = Arc::try_unwrap(b).unwrap_or_else(|_| panic!("a's closure freed with a"));
        drop(b);
        assert_eq!(Arc::strong_count(&b_alive), 1, "b's closure freed with b");
    });
}
