//! What the safe layer adds per call beyond the same call through `kvrouter-sys` (what a C
//! caller pays: options, NUL-terminated ids and one result struct per chunk prepared outside
//! the clock), measured as issue 16 asks: chunks of calls through each path alternate many
//! times in one run; per chunk the mean time per call; over the chunks the min and the 10th
//! percentile of each side, and their difference (the overhead). Only same-run differences
//! mean anything on a noisy machine.
//!
//! The router is small so that the C call is short and the binding's share shows: 8 workers,
//! 64 prompts of 64 tokens (4 blocks, some cached), ids `request-0` ... `request-255`. Calls:
//! a query-only `find_best_match` (preview), an admitted one and `free_request` of its id
//! (admit+free), the same with the options prepared once (`find_best_match_prepared` with a
//! [`PreparedRequest`] of `RequestOptions::admit("")`: prepared+free, against the same C calls
//! as admit+free), `mark_prefill_completed` and `free_request` (mark+free).
//!
//! ```sh
//! cargo run --release --example overhead -- [--rounds 200] [--chunk 2000]
//! ```

use std::ffi::CString;
use std::hint::black_box;
use std::ptr;
use std::time::Instant;

use kvrouter::{
    compute_block_hashes, HashOptions, PreparedRequest, RequestOptions, Router, RouterOptions,
    StoredEvent, WorkerConfig,
};
use kvrouter_sys as sys;

const BLOCK: u32 = 16;
const QLEN: usize = 4 * BLOCK as usize;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().expect("a number"))
}

fn min_p10(v: &[f64]) -> (f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (s[0], s[s.len() / 10])
}

fn main() {
    let (rounds, chunk) = (arg("--rounds", 200), arg("--chunk", 2000));
    let router = Router::new(&RouterOptions {
        random_seed: 7,
        ..RouterOptions::with_block_size(BLOCK)
    })
    .unwrap();
    for w in 1..=8 {
        router.add_worker(&WorkerConfig::new(w)).unwrap();
    }
    let prompts: Vec<Vec<u32>> = (0..64u32)
        .map(|q| (0..QLEN as u32).map(|i| q * 1000 + i).collect())
        .collect();
    for (q, p) in prompts.iter().enumerate() {
        let blocks = 1 + q % 4;
        let local = compute_block_hashes(p, BLOCK, &HashOptions::default()).unwrap();
        let worker = (q % 8 + 1) as u64;
        let hashes: Vec<u64> = (0..blocks as u64).map(|i| worker << 32 | (i + 1)).collect();
        router
            .apply_stored(&StoredEvent {
                worker_id: worker,
                block_hashes: &hashes,
                local_hashes: Some(&local[..blocks]),
                ..Default::default()
            })
            .unwrap();
    }
    let ids: Vec<String> = (0..256).map(|i| format!("request-{i}")).collect();
    let c_ids: Vec<CString> = ids
        .iter()
        .map(|s| CString::new(s.as_str()).unwrap())
        .collect();
    let raw = router.as_raw();
    let mut admit: sys::kvr_request_options = kvrouter::raw::init();
    admit.flags = sys::KVR_REQUEST_ADMIT;

    let mut prepared = PreparedRequest::new(&RequestOptions::admit("")).unwrap();
    let mut safe = |op: usize, n: usize| {
        for i in 0..n {
            let p = &prompts[i % prompts.len()];
            let id = ids[i % ids.len()].as_str();
            match op {
                0 => {
                    black_box(
                        router
                            .find_best_match(p, &RequestOptions::default())
                            .unwrap(),
                    );
                }
                1 => {
                    black_box(
                        router
                            .find_best_match(p, &RequestOptions::admit(id))
                            .unwrap(),
                    );
                    router.free_request(id).unwrap();
                }
                3 => {
                    black_box(
                        router
                            .find_best_match_prepared(p, &mut prepared, id)
                            .unwrap(),
                    );
                    router.free_request(id).unwrap();
                }
                _ => {
                    router.mark_prefill_completed(id).unwrap();
                    router.free_request(id).unwrap();
                }
            }
        }
    };
    let mut c = |op: usize, n: usize| {
        // One result struct per chunk: a C caller may reuse it (the library reads its
        // struct_size and writes the rest), so no `_init` call per call on this side.
        let mut out: sys::kvr_route_result = kvrouter::raw::init();
        for i in 0..n {
            let p = &prompts[i % prompts.len()];
            let id = c_ids[i % c_ids.len()].as_ptr();
            // SAFETY: a live router; every pointer lives across its call.
            unsafe {
                let st = match op {
                    0 | 1 | 3 => {
                        admit.request_id = id;
                        let opts = if op != 0 {
                            &admit as *const _
                        } else {
                            ptr::null()
                        };
                        let st = sys::kvr_find_best_match(
                            raw,
                            p.as_ptr(),
                            p.len(),
                            opts,
                            &mut out,
                            ptr::null_mut(),
                            0,
                            ptr::null_mut(),
                            ptr::null_mut(),
                        );
                        black_box(&out);
                        if st == sys::KVR_OK && op != 0 {
                            sys::kvr_router_free_request(raw, id, ptr::null_mut())
                        } else {
                            st
                        }
                    }
                    _ => {
                        let st = sys::kvr_router_mark_prefill_completed(raw, id, ptr::null_mut());
                        if st == sys::KVR_OK {
                            sys::kvr_router_free_request(raw, id, ptr::null_mut())
                        } else {
                            st
                        }
                    }
                };
                assert_eq!(st, sys::KVR_OK);
            }
        }
    };
    println!("{rounds} pairs of chunks of {chunk} calls; ns per call (min / p10 of chunk means)");
    // Ops 1 and 3 share their C side; 3 is listed after 1 so the two admitted rows are read
    // together.
    for (op, name) in [
        (0, "preview"),
        (1, "admit+free"),
        (3, "prepared+free"),
        (2, "mark+free"),
    ] {
        let (mut s_ns, mut c_ns) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let t = Instant::now();
            safe(op, chunk);
            s_ns.push(t.elapsed().as_nanos() as f64 / chunk as f64);
            let t = Instant::now();
            c(op, chunk);
            c_ns.push(t.elapsed().as_nanos() as f64 / chunk as f64);
        }
        let ((smin, sp10), (cmin, cp10)) = (min_p10(&s_ns), min_p10(&c_ns));
        println!(
            "{name:<13} safe min {smin:7.1} p10 {sp10:7.1} | sys min {cmin:7.1} p10 {cp10:7.1} | \
             overhead min {:+6.1} p10 {:+6.1}",
            smin - cmin,
            sp10 - cp10
        );
    }
}
