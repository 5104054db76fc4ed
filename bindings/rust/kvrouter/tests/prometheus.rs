//! The `prometheus` feature's collector in a `prometheus::Registry`, encoded by its
//! `TextEncoder`, after real events and decisions: the library's families, names, labels and
//! values come through unchanged.
#![cfg(feature = "prometheus")]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{prompt, router, store};
use kvrouter::prometheus::RouterCollector;
use kvrouter::{RemovedEvent, RequestOptions, StoredEvent};
use prometheus::{Encoder, Registry, TextEncoder};

/// Series of a text: "name{labels}" (labels sorted, `extra` added) to value; and every
/// `# HELP` / `# TYPE` line.
fn series(text: &str, extra: &[(&str, &str)]) -> (BTreeMap<String, f64>, Vec<String>) {
    let mut out = BTreeMap::new();
    let mut headers = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') {
            headers.push(line.to_string());
            continue;
        }
        let (key, value) = line.rsplit_once(' ').unwrap();
        let (name, labels) = match key.split_once('{') {
            Some((name, labels)) => (name, labels.trim_end_matches('}')),
            None => (key, ""),
        };
        let mut labels: Vec<String> = labels
            .split(',')
            .filter(|l| !l.is_empty())
            .map(String::from)
            .chain(extra.iter().map(|(n, v)| format!("{n}=\"{v}\"")))
            .collect();
        labels.sort();
        out.insert(
            format!("{name}{{{}}}", labels.join(",")),
            value.parse().unwrap(),
        );
    }
    headers.sort();
    (out, headers)
}

fn encode(registry: &Registry) -> String {
    let mut buf = Vec::new();
    TextEncoder::new()
        .encode(&registry.gather(), &mut buf)
        .unwrap();
    String::from_utf8(buf).unwrap()
}

#[test]
fn the_registry_exposes_the_librarys_metrics_after_events_and_decisions() {
    let router = Arc::new(router(3));
    let cached = prompt(1, 4);
    store(&router, 2, &cached, 4, 100);
    // Rejected events (counted, and NotFound to the caller): an unknown parent, an unknown
    // removed block.
    let other = prompt(2, 2);
    router
        .apply_stored(&StoredEvent {
            worker_id: 1,
            parent_hash: Some(999),
            block_hashes: &[500, 501],
            token_ids: &other,
            ..Default::default()
        })
        .unwrap_err();
    router
        .apply_removed(&RemovedEvent {
            worker_id: 3,
            block_hashes: &[777],
            ..Default::default()
        })
        .unwrap_err();
    // Two decisions: the cached prompt goes to worker 2, a second one elsewhere; one stays
    // booked, with its prefill outstanding.
    let first = router
        .find_best_match(&cached, &RequestOptions::admit("a"))
        .unwrap();
    assert_eq!(first.worker_id, 2);
    let fresh = prompt(3, 3);
    let second = router
        .find_best_match(&fresh, &RequestOptions::admit("b"))
        .unwrap();
    router.free_request("a").unwrap();

    let registry = Registry::new();
    let collector = RouterCollector::new(router.clone())
        .unwrap()
        .with_const_label("router", "main")
        .unwrap();
    registry.register(Box::new(collector)).unwrap();
    let text = encode(&registry);
    let library = router.metrics_prometheus().unwrap();

    // Every family and series of the library's text, with the same help and type, and the
    // same values, plus the constant label; nothing else.
    let (got, got_headers) = series(&text, &[]);
    let (want, want_headers) = series(&library, &[("router", "main")]);
    assert_eq!(got_headers, want_headers, "{text}");
    assert_eq!(got, want, "{text}");

    // And the values are the events and decisions above.
    let value = |key: &str| {
        *got.get(key)
            .unwrap_or_else(|| panic!("no {key} in\n{text}"))
    };
    let m = router.metrics().unwrap();
    assert_eq!(value("kvrouter_decisions_total{router=\"main\"}"), 2.0);
    assert_eq!(value("kvrouter_requests_active{router=\"main\"}"), 1.0);
    assert_eq!(value("kvrouter_workers{router=\"main\"}"), 3.0);
    assert_eq!(value("kvrouter_index_blocks{router=\"main\"}"), 4.0);
    assert_eq!(
        value("kvrouter_kv_events_total{kind=\"stored\",outcome=\"ok\",router=\"main\"}"),
        1.0
    );
    let stored_rejected: f64 = got
        .iter()
        .filter(|(k, _)| k.starts_with("kvrouter_kv_events_total{kind=\"stored\""))
        .filter(|(k, _)| !k.contains("outcome=\"ok\""))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(stored_rejected, 1.0, "the unknown parent");
    assert_eq!(m.decisions, 2);
    let prefill = format!(
        "kvrouter_worker_active_prefill_tokens{{dp_rank=\"0\",router=\"main\",worker_id=\"{}\"}}",
        second.worker_id
    );
    assert_eq!(value(&prefill), fresh.len() as f64);
    assert!(text.contains("# TYPE kvrouter_decisions_total counter\n"));
    assert!(text.contains("# TYPE kvrouter_requests_active gauge\n"));

    // Collected again after the last request ends: the values follow the router.
    router.free_request("b").unwrap();
    let (after, _) = series(&encode(&registry), &[]);
    assert_eq!(after["kvrouter_requests_active{router=\"main\"}"], 0.0);
    assert_eq!(after[&prefill], 0.0);
}

#[test]
fn two_collectors_in_one_registry_need_distinct_constant_labels() {
    let prefill = Arc::new(router(1));
    let decode = Arc::new(router(2));
    let registry = Registry::new();
    registry
        .register(Box::new(RouterCollector::new(prefill.clone()).unwrap()))
        .unwrap();
    // The same families again, not told apart: refused.
    assert!(registry
        .register(Box::new(RouterCollector::new(decode.clone()).unwrap()))
        .is_err());

    let registry = Registry::new();
    for (name, router) in [("prefill", &prefill), ("decode", &decode)] {
        let collector = RouterCollector::new(router.clone())
            .unwrap()
            .with_const_label("phase", name)
            .unwrap();
        registry.register(Box::new(collector)).unwrap();
    }
    let text = encode(&registry);
    assert!(
        text.contains("kvrouter_workers{phase=\"prefill\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("kvrouter_workers{phase=\"decode\"} 2\n"),
        "{text}"
    );

    // A constant label may not shadow one of the library's, nor be given twice.
    let router = Arc::new(router(1));
    let collector = RouterCollector::new(router.clone()).unwrap();
    assert!(collector.with_const_label("worker_id", "x").is_err());
    let collector = RouterCollector::new(router.clone()).unwrap();
    assert!(collector.with_const_label("bad-name", "x").is_err());
    let collector = RouterCollector::new(router)
        .unwrap()
        .with_const_label("a", "1")
        .unwrap();
    assert!(collector.with_const_label("a", "2").is_err());
}

#[test]
fn a_text_source_is_collected_like_a_router() {
    let router = Arc::new(router(2));
    let shared = router.clone();
    let collector = RouterCollector::from_text(move || shared.metrics_prometheus())
        .unwrap()
        .with_text(|| {
            Ok("# HELP app_up Whether the app is up.\n# TYPE app_up gauge\napp_up 1\n".into())
        })
        .unwrap();
    let registry = Registry::new();
    registry.register(Box::new(collector)).unwrap();
    let text = encode(&registry);
    assert!(text.contains("kvrouter_workers 2\n"), "{text}");
    assert!(
        text.contains("# HELP app_up Whether the app is up.\n"),
        "{text}"
    );
    assert!(text.contains("app_up 1\n"), "{text}");
}
