//! The hot calls allocate nothing on the Rust heap per call (issue 16), prepared ones included:
//! counted by a global allocator, which is exact where times are not. (The library's own C++
//! allocations are not seen here: this is the binding's share.) Also: ids too long for the
//! stack buffer and ids with a NUL byte still work and fail as before. A prompt given as its
//! local hashes (`RequestOptions::prehashed`) costs no allocation either.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kvrouter::{compute_block_hashes, Code, HashOptions, PreparedRequest, RequestOptions};

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; counting touches only a thread-local Cell.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's layout, as GlobalAlloc requires.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: ptr came from System.alloc with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations on this thread during `f`.
fn allocations(f: impl FnOnce()) -> usize {
    let before = ALLOCATIONS.with(Cell::get);
    f();
    ALLOCATIONS.with(Cell::get) - before
}

#[test]
fn hot_calls_do_not_allocate() {
    assert_eq!(
        allocations(|| drop(std::hint::black_box(vec![1u8]))),
        1,
        "the counter counts"
    );
    let router = common::router(4);
    let prompts: Vec<Vec<u32>> = (0..8).map(|s| common::prompt(s, 4)).collect();
    let ids: Vec<String> = (0..8).map(|i| format!("request-{i}")).collect();
    let hashes: Vec<Vec<u64>> = prompts
        .iter()
        .map(|p| compute_block_hashes(p, common::BS, &HashOptions::default()).unwrap())
        .collect();
    // Warm up: one-time set-up (templates, version check) is not per call.
    router
        .find_best_match(&prompts[0], &RequestOptions::admit(&ids[0]))
        .unwrap();
    router.free_request(&ids[0]).unwrap();
    for i in 0..100 {
        let (p, id) = (&prompts[i % 8], ids[i % 8].as_str());
        let n = allocations(|| {
            let opts = RequestOptions::admit(id).prehashed(&hashes[i % 8], p.len());
            assert!(router.find_best_match(&[], &opts).unwrap().booked);
            router.free_request(id).unwrap();
        });
        assert_eq!(n, 0, "prehashed admit + free allocated {n} times");
        let n = allocations(|| {
            router
                .find_best_match(p, &RequestOptions::default())
                .unwrap();
        });
        assert_eq!(n, 0, "preview allocated {n} times");
        let n = allocations(|| {
            let booked = router
                .find_best_match(p, &RequestOptions::admit(id))
                .unwrap();
            assert!(booked.booked);
            router.mark_prefill_completed(id).unwrap();
            router.free_request(id).unwrap();
        });
        assert_eq!(n, 0, "admit + mark + free allocated {n} times");
    }
}

#[test]
fn prepared_calls_do_not_allocate() {
    let router = common::router(4);
    let prompts: Vec<Vec<u32>> = (0..8).map(|s| common::prompt(s, 4)).collect();
    let ids: Vec<String> = (0..8).map(|i| format!("request-{i}")).collect();
    let allowed = [1u64, 2, 3, 4];
    let mut prepared = PreparedRequest::new(&RequestOptions {
        lora_name: Some("adapter"),
        cache_namespace: Some("tenant"),
        allowed_worker_ids: Some(&allowed),
        ..RequestOptions::admit("")
    })
    .unwrap();
    let mut preview = PreparedRequest::new(&RequestOptions {
        lora_name: Some("adapter"),
        ..Default::default()
    })
    .unwrap();
    // Warm up: one-time set-up (templates, version check) is not per call.
    router
        .find_best_match_prepared(&prompts[0], &mut prepared, &ids[0])
        .unwrap();
    router.free_request(&ids[0]).unwrap();
    for i in 0..100 {
        let (p, id) = (&prompts[i % 8], ids[i % 8].as_str());
        let n = allocations(|| {
            let r = router
                .find_best_match_prepared(p, &mut preview, id)
                .unwrap();
            assert!(!r.booked);
            let r = router
                .find_best_match_prepared(p, &mut prepared, id)
                .unwrap();
            assert!(r.booked);
            router.mark_prefill_completed(id).unwrap();
            router.free_request(id).unwrap();
        });
        assert_eq!(
            n, 0,
            "prepared preview + admit + mark + free allocated {n} times"
        );
    }
    // An id longer than any before grows the id buffer once; then it is reused again.
    let long = "x".repeat(100);
    let n = allocations(|| {
        router
            .find_best_match_prepared(&prompts[1], &mut prepared, &long)
            .unwrap();
    });
    assert_eq!(n, 1, "the first long id");
    router.free_request(&long).unwrap();
    for id in [long.as_str(), "short", long.as_str()] {
        let n = allocations(|| {
            router
                .find_best_match_prepared(&prompts[2], &mut prepared, id)
                .unwrap();
        });
        assert_eq!(n, 0, "{id} allocated {n} times");
        router.free_request(id).unwrap();
    }
}

#[test]
fn long_and_bad_ids() {
    let router = common::router(2);
    let p = common::prompt(1, 2);
    // Past the stack buffer: the strings go to the heap, and work the same.
    let long = "x".repeat(1000);
    let lora = "l".repeat(200);
    let opts = RequestOptions {
        lora_name: Some(&lora),
        ..RequestOptions::admit(&long)
    };
    assert!(router.find_best_match(&p, &opts).unwrap().booked);
    let again = router.find_best_match(&p, &opts).unwrap_err();
    assert_eq!(again.code(), Code::AlreadyExists);
    router.mark_prefill_completed(&long).unwrap();
    router.free_request(&long).unwrap();
    assert!(router.find_best_match(&p, &opts).unwrap().booked);
    router.free_request(&long).unwrap();
    // A NUL byte is refused before C, short or long.
    for id in ["a\0b".to_string(), format!("{}\0", "y".repeat(300))] {
        let err = router
            .find_best_match(&p, &RequestOptions::admit(&id))
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("request_id contains a NUL byte"));
        assert_eq!(
            router.free_request(&id).unwrap_err().code(),
            Code::InvalidArgument
        );
    }
}
