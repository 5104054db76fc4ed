//! The `prometheus` feature's collector in a `prometheus::Registry`, encoded by its
//! `TextEncoder`, after real events and decisions: the library's families, names, labels and
//! values come through unchanged.
#![cfg(feature = "prometheus")]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use common::{prompt, router, store, wait_for};
use kvrouter::prometheus::RouterCollector;
use kvrouter::{
    EventBatch, Ingest, IngestOptions, Publisher, RemovedEvent, RequestOptions, StoredEvent,
};
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
            .map(normalize)
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

/// A bucket bound as a number (`le="2.5e-05"` and `le="0.000025"` are one bucket; `+Inf`).
fn normalize(label: &str) -> String {
    match label.strip_prefix("le=") {
        Some(bound) => {
            let bound: f64 = bound.trim_matches('"').parse().unwrap();
            format!("le=\"{bound:?}\"")
        }
        None => label.to_string(),
    }
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
    // The decision-latency histogram: the first of the two routing calls (the library times
    // one call in 16, the first included), bucketed as kvr_metrics says.
    assert!(text.contains("# TYPE kvrouter_decision_duration_seconds histogram\n"));
    let latency = &m.decision_latency;
    assert_eq!(latency.count, 1);
    let histogram = |series: &str, le: Option<f64>| {
        let le = le.map_or(String::new(), |b| format!("le=\"{b:?}\","));
        value(&format!(
            "kvrouter_decision_duration_seconds_{series}{{{le}router=\"main\"}}"
        ))
    };
    assert_eq!(histogram("count", None), 1.0);
    assert_eq!(histogram("bucket", Some(f64::INFINITY)), 1.0);
    for (bound_ns, le) in latency.bounds_ns.iter().zip(latency.le) {
        assert_eq!(histogram("bucket", Some(*bound_ns as f64 / 1e9)), le as f64);
    }
    assert!((histogram("sum", None) - latency.sum_ns as f64 / 1e9).abs() < 1e-9);
    assert!(text.contains("# TYPE kvrouter_decisions_total counter\n"));
    assert!(text.contains("# TYPE kvrouter_requests_active gauge\n"));

    // Collected again after the last request ends: the values follow the router.
    router.free_request("b").unwrap();
    let (after, _) = series(&encode(&registry), &[]);
    assert_eq!(after["kvrouter_requests_active{router=\"main\"}"], 0.0);
    assert_eq!(after[&prefill], 0.0);
}

#[test]
fn an_ingests_sources_are_collected_beside_the_router() {
    let router = Arc::new(router(2));
    let ingest =
        Arc::new(Ingest::with_shared_router(router.clone(), &IngestOptions::default()).unwrap());
    let listener = ingest.listen("tcp://127.0.0.1:0").unwrap();
    ingest.start().unwrap();
    let collector = RouterCollector::new(router.clone())
        .unwrap()
        .with_ingest(ingest.clone())
        .unwrap();
    let registry = Registry::new();
    registry.register(Box::new(collector)).unwrap();

    // A publisher sends one good batch (carrying its publication time) and one bad frame.
    let tokens = prompt(5, 2);
    let mut batch = EventBatch::new().unwrap();
    batch
        .add_stored(&StoredEvent {
            worker_id: 1,
            block_hashes: &[11, 12],
            token_ids: &tokens,
            ..Default::default()
        })
        .unwrap();
    batch.set_publish_time(Some(SystemTime::now())).unwrap();
    let mut publisher = Publisher::connect(&listener.endpoint).unwrap();
    publisher.send(&batch).unwrap();
    publisher.send_encoded(b"not flatbuffers").unwrap();
    wait_for("both frames", || {
        (ingest.total_stats().unwrap().messages == 2).then_some(())
    });

    let text = encode(&registry);
    let (got, got_headers) = series(&text, &[]);
    let library = router.metrics_prometheus().unwrap() + &ingest.metrics_prometheus().unwrap();
    let (want, want_headers) = series(&library, &[]);
    assert_eq!(got_headers, want_headers, "{text}");
    assert_eq!(got, want, "{text}");

    let source = format!(
        "endpoint=\"{}\",kind=\"listener\",source_id=\"{}\"",
        listener.endpoint, listener.source_id
    );
    let value = |name: &str, extra: &str| {
        let key = format!("{name}{{{extra}{source}}}");
        *got.get(&key)
            .unwrap_or_else(|| panic!("no {key} in\n{text}"))
    };
    assert_eq!(value("kvrouter_ingest_messages_total", ""), 2.0);
    assert_eq!(value("kvrouter_ingest_events_applied_total", ""), 1.0);
    assert_eq!(value("kvrouter_ingest_connections_total", ""), 1.0);
    let rejected: Vec<(&String, &f64)> = got
        .iter()
        .filter(|(k, v)| k.starts_with("kvrouter_ingest_rejected_total{") && **v > 0.0)
        .collect();
    assert_eq!(rejected.len(), 1, "{text}");
    assert!(
        rejected[0].0.contains("reason=\"bad_flatbuffers\""),
        "{rejected:?}"
    );
    assert!(
        text.contains("# TYPE kvrouter_ingest_lag_seconds summary\n"),
        "{text}"
    );
    assert_eq!(value("kvrouter_ingest_lag_seconds_count", ""), 1.0);
    assert_eq!(got["kvrouter_index_blocks{}"], 2.0);
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
