//! Live ingestion: a Unix-socket and a TCP listener fed by the publisher, bad frames counted,
//! lag measured from the publish time, engine-worker registration rules, the lifecycle, and
//! NATS (subjects, a JetStream stream, replica sync and a replica joining late) when
//! `nats-server` is installed.

mod common;

use std::io::Write;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use common::{free_port, prompt, router, wait_for, NatsServer, TempDir, BS};
use kvrouter::{
    Code, EngineWorker, EventBatch, Ingest, IngestOptions, IngestStats, JetStreamSource, Publisher,
    RejectReason, RequestOptions, StoredEvent,
};

/// A batch storing `blocks` blocks of `tokens` on `worker` (engine hashes from `first`).
fn stored_batch(worker: u64, tokens: &[u32], blocks: usize, first: u64) -> EventBatch {
    let hashes = common::engine_hashes(first, blocks);
    let mut batch = EventBatch::new().unwrap();
    batch
        .add_stored(&StoredEvent {
            worker_id: worker,
            event_id: first,
            block_hashes: &hashes,
            token_ids: &tokens[..blocks * BS as usize],
            ..Default::default()
        })
        .unwrap();
    batch
}

fn wait_messages(ingest: &Ingest<'_>, source: u64, messages: u64) -> IngestStats {
    wait_for("ingested messages", || {
        let stats = ingest.stats(source).unwrap();
        (stats.messages >= messages).then_some(stats)
    })
}

fn device_blocks(router: &kvrouter::RouterRef, tokens: &[u32], worker: u64) -> u32 {
    router
        .overlap_scores(tokens, &RequestOptions::default())
        .unwrap()
        .iter()
        .find(|o| o.worker_id == worker)
        .map_or(0, |o| o.device_blocks)
}

#[test]
fn unix_socket_events_reach_the_router_and_bad_frames_are_counted() {
    let dir = TempDir::new();
    let router = router(2);
    // A router on the stack: the scope borrows it, and frees the ingest object before it ends.
    Ingest::scope(&router, &IngestOptions::default(), |ingest| {
        ingest.start().unwrap();
        let endpoint = format!("unix://{}/events.sock", dir.0.display());
        let listener = ingest.listen(&endpoint).unwrap();
        assert_eq!(listener.endpoint, endpoint);
        assert_ne!(listener.source_id, 0);
        assert_eq!(
            ingest.source_endpoint(listener.source_id).unwrap(),
            endpoint
        );
        assert_eq!(
            ingest.source_endpoint(4242).unwrap_err().code(),
            Code::NotFound
        );

        let tokens = prompt(1, 4);
        let mut publisher = Publisher::connect(&listener.endpoint).unwrap();
        publisher.send(&stored_batch(2, &tokens, 4, 100)).unwrap();
        let stats = wait_messages(ingest, listener.source_id, 1);
        assert_eq!((stats.events_applied, stats.connections), (1, 1));
        assert_eq!(device_blocks(&router, &tokens, 2), 4);
        let r = router
            .find_best_match(&tokens, &RequestOptions::default())
            .unwrap();
        assert_eq!((r.worker_id, r.device_overlap_blocks), (2, 4));

        // Well-framed garbage is rejected alone; the connection's next batch still applies.
        publisher
            .send_encoded(b"this is not a flatbuffer at all")
            .unwrap();
        let more = prompt(2, 2);
        let encoded = stored_batch(1, &more, 2, 200).encode().unwrap();
        publisher.send_encoded(&encoded).unwrap();
        let stats = wait_messages(ingest, listener.source_id, 3);
        assert_eq!(stats.rejected(RejectReason::BadFlatbuffers), 1);
        assert!(
            stats.last_reject.contains("file identifier"),
            "{}",
            stats.last_reject
        );
        assert_eq!(stats.events_applied, 2);
        assert_eq!(device_blocks(&router, &more, 1), 2);

        // The totals agree with the only source; unknown sources are NotFound.
        assert_eq!(
            ingest.total_stats().unwrap(),
            ingest.stats(listener.source_id).unwrap()
        );
        assert_eq!(ingest.stats(9999).unwrap_err().code(), Code::NotFound);

        // Binding the same path twice fails.
        assert_eq!(
            ingest.listen(&endpoint).unwrap_err().code(),
            Code::Unavailable
        );
    })
    .unwrap();
}

#[test]
fn tcp_port_zero_binds_a_free_port_and_lag_is_measured() {
    let router = Arc::new(router(2));
    let ingest = Ingest::with_shared_router(router.clone(), &IngestOptions::default()).unwrap();
    ingest.start().unwrap();
    let listener = ingest.listen("tcp://127.0.0.1:0").unwrap();
    assert!(listener.endpoint.starts_with("tcp://127.0.0.1:"));
    assert_ne!(listener.endpoint, "tcp://127.0.0.1:0");

    let tokens = prompt(3, 1);
    let mut publisher = Publisher::connect(&listener.endpoint).unwrap();
    let mut batch = stored_batch(1, &tokens, 1, 300);

    // Published 3 s ago: the lag is at least that.
    let three_s = Duration::from_secs(3);
    batch
        .set_publish_time(Some(SystemTime::now() - three_s))
        .unwrap();
    publisher.send(&batch).unwrap();
    let stats = wait_messages(&ingest, listener.source_id, 1);
    assert_eq!(stats.lag_samples, 1);
    assert!(stats.lag_last_us >= three_s.as_micros() as u64, "{stats:?}");
    assert_eq!(stats.lag_max_us, stats.lag_last_us);
    assert_eq!(stats.lag_total_us, stats.lag_last_us);

    // Unstamped: not measured.
    batch.set_publish_time(None).unwrap();
    publisher.send(&batch).unwrap();
    let stats = wait_messages(&ingest, listener.source_id, 2);
    assert_eq!(stats.lag_samples, 1);

    // Cleared: stamped with the wall clock at sending, so a small lag; the maximum stays.
    batch.clear();
    batch
        .add_stored(&StoredEvent {
            worker_id: 1,
            block_hashes: &[300],
            token_ids: &tokens,
            ..Default::default()
        })
        .unwrap();
    publisher.send(&batch).unwrap();
    let stats = wait_messages(&ingest, listener.source_id, 3);
    assert_eq!(stats.lag_samples, 2);
    assert!(stats.lag_last_us < three_s.as_micros() as u64);
    assert!(stats.lag_max_us >= three_s.as_micros() as u64);
    assert_eq!(stats.events_applied, 3);

    // The same counters in the Prometheus text, labelled by source.
    let text = ingest.metrics_prometheus().unwrap();
    let labels = format!(
        "{{source_id=\"{}\",kind=\"listener\",endpoint=\"{}\"}}",
        listener.source_id, listener.endpoint
    );
    for (name, value) in [
        ("kvrouter_ingest_messages_total", 3),
        ("kvrouter_ingest_events_applied_total", 3),
        ("kvrouter_ingest_connections_total", 1),
        ("kvrouter_ingest_lag_seconds_count", 2),
    ] {
        let line = format!("{name}{labels} {value}\n");
        assert!(text.contains(&line), "no {line:?} in\n{text}");
    }
    assert!(
        text.contains("# TYPE kvrouter_ingest_lag_seconds summary\n"),
        "{text}"
    );
}

#[test]
fn a_shared_router_is_fed_while_other_threads_route_and_read_stats() {
    let router = Arc::new(router(2));
    let ingest =
        Arc::new(Ingest::with_shared_router(router.clone(), &IngestOptions::default()).unwrap());
    ingest.start().unwrap();
    let listener = ingest.listen("tcp://127.0.0.1:0").unwrap();
    const BATCHES: u64 = 50;
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut publisher = Publisher::connect(&listener.endpoint).unwrap();
            for i in 0..BATCHES {
                let tokens = prompt(1000 + i as u32, 2);
                publisher
                    .send(&stored_batch(1 + i % 2, &tokens, 2, 10 * i))
                    .unwrap();
            }
        });
        for _ in 0..2 {
            s.spawn(|| {
                for i in 0..200u32 {
                    router
                        .find_best_match(&prompt(1000 + i % 50, 2), &RequestOptions::default())
                        .unwrap();
                    ingest.stats(listener.source_id).unwrap();
                }
            });
        }
    });
    let stats = wait_messages(&ingest, listener.source_id, BATCHES);
    assert_eq!(stats.events_applied, BATCHES);
    for i in 0..BATCHES {
        assert_eq!(
            device_blocks(&router, &prompt(1000 + i as u32, 2), 1 + i % 2),
            2
        );
    }
    drop(ingest); // stops the loop; the router stays usable through the other Arc
    assert_eq!(router.metrics().unwrap().index_blocks, 2 * BATCHES);
}

#[test]
fn engine_workers_and_the_lifecycle_follow_the_rules() {
    let router = Arc::new(router(1));
    let ingest = Ingest::with_shared_router(router.clone(), &IngestOptions::default()).unwrap();
    // ZMQ connects lazily: no engine needs to listen for the registration to succeed.
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let source = ingest
        .add_engine_worker(&EngineWorker {
            dp_size: 2,
            topic: Some("kv-events"),
            ..EngineWorker::new(&endpoint, 7)
        })
        .unwrap();
    assert_ne!(source, 0);
    assert_eq!(ingest.stats(source).unwrap(), IngestStats::default());
    assert_eq!(ingest.source_endpoint(source).unwrap(), endpoint);
    let e = ingest
        .add_engine_worker(&EngineWorker::new(&endpoint, 7))
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);
    let e = ingest
        .add_engine_worker(&EngineWorker {
            block_size: 32,
            ..EngineWorker::new(&endpoint, 8)
        })
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("32") && e.message().contains("16"),
        "{e}"
    );
    let e = ingest
        .add_engine_worker(&EngineWorker {
            dp_size: 0,
            ..EngineWorker::new(&endpoint, 9)
        })
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    ingest.start().unwrap();
    assert_eq!(ingest.start().unwrap_err().code(), Code::FailedPrecondition);
    ingest.remove_engine_worker(7, true).unwrap();
    assert_eq!(
        ingest.remove_engine_worker(7, false).unwrap_err().code(),
        Code::NotFound
    );
    ingest.stop().unwrap();
    ingest.stop().unwrap(); // idempotent
    assert_eq!(ingest.start().unwrap_err().code(), Code::FailedPrecondition);
    // A stopped object takes no new sources.
    let e = ingest.listen("tcp://127.0.0.1:0").unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
}

#[test]
fn ingest_strings_with_a_nul_byte_are_refused_naming_them() {
    // Refused before C (no listener bound, no connection tried), so no server is needed.
    let router = Arc::new(router(1));
    let ingest = Ingest::with_shared_router(router.clone(), &IngestOptions::default()).unwrap();
    let refused = |result: kvrouter::Result<u64>, what: &str| {
        let e = result.expect_err(what);
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e}");
        assert_eq!(e.message(), format!("{what} contains a NUL byte"), "{what}");
    };
    let bad = "nats://127.0.0.1:4222\0x";
    refused(ingest.listen(bad).map(|l| l.source_id), "endpoint");
    refused(
        ingest.add_engine_worker(&EngineWorker::new(bad, 1)),
        "endpoint",
    );
    refused(
        ingest.add_engine_worker(&EngineWorker {
            topic: Some("kv\0"),
            ..EngineWorker::new("tcp://127.0.0.1:1", 1)
        }),
        "topic",
    );
    refused(
        ingest.add_engine_worker(&EngineWorker {
            replay_endpoint: Some("tcp://\0"),
            ..EngineWorker::new("tcp://127.0.0.1:1", 1)
        }),
        "replay_endpoint",
    );
    let url = "nats://127.0.0.1:1";
    refused(ingest.subscribe_nats(bad, "kv"), "url");
    refused(ingest.subscribe_nats(url, "kv\0"), "subject");
    refused(ingest.sync_replicas(bad, "r", "a"), "url");
    refused(ingest.sync_replicas(url, "r\0", "a"), "subject");
    refused(ingest.sync_replicas(url, "r", "a\0b"), "replica_id");
    let js = |url, stream, subject, durable| JetStreamSource {
        durable,
        ..JetStreamSource::new(url, stream, subject)
    };
    for (source, what) in [
        (js(bad, "KV", "kv.>", None), "url"),
        (js(url, "K\0V", "kv.>", None), "stream"),
        (js(url, "KV", "kv.\0", None), "subject"),
        (js(url, "KV", "kv.>", Some("gw\0")), "durable"),
    ] {
        refused(ingest.subscribe_jetstream(&source), what);
        if what != "durable" {
            refused(ingest.relay_jetstream(&source), what);
        }
    }
    refused(Publisher::connect(bad).map(|_| 0), "endpoint");
    assert_eq!(ingest.total_stats().unwrap().messages, 0);
}

#[test]
fn a_publisher_to_nowhere_is_unavailable() {
    let e = Publisher::connect(&format!("tcp://127.0.0.1:{}", free_port())).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    let e = Publisher::connect("unix:///nonexistent/kvrouter.sock").unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
}

#[test]
fn nats_subjects_feed_the_router() {
    let Some(server) = NatsServer::start() else {
        // Straight to stderr, past the test harness's capture, so the skip is visible.
        let _ = writeln!(
            std::io::stderr(),
            "nats_subjects_feed_the_router: skipped, no nats-server"
        );
        return;
    };
    let router = Arc::new(router(2));
    let ingest = Ingest::with_shared_router(router.clone(), &IngestOptions::default()).unwrap();
    ingest.start().unwrap();
    let source = ingest.subscribe_nats(&server.url(), "kv.*.events").unwrap();

    let (a, b) = (prompt(10, 3), prompt(11, 2));
    let first = stored_batch(1, &a, 3, 100).encode().unwrap();
    let second = stored_batch(2, &b, 2, 200).encode().unwrap();
    server.publish(&[
        ("kv.w1.events", &first),
        ("kv.w2.events", b"garbage, not an EventBatch"),
        ("kv.w2.events", &second),
        ("other.subject", &first),
    ]);
    let stats = wait_messages(&ingest, source, 3);
    assert_eq!(stats.messages, 3);
    assert_eq!(stats.events_applied, 2);
    assert_eq!(stats.rejected(RejectReason::BadFlatbuffers), 1);
    assert_eq!(stats.connections, 1);
    assert_eq!(
        stats.lag_samples, 2,
        "encode() stamps batches with the wall clock"
    );
    assert_eq!(device_blocks(&router, &a, 1), 3);
    assert_eq!(device_blocks(&router, &b, 2), 2);

    // No server there: the first connection fails.
    let e = ingest
        .subscribe_nats(&format!("nats://127.0.0.1:{}", free_port()), "kv.>")
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
}

#[test]
fn jetstream_stream_created_consumed_and_acknowledged() {
    let Some(server) = NatsServer::start_with(true) else {
        let _ = writeln!(
            std::io::stderr(),
            "jetstream_stream_created_consumed_and_acknowledged: skipped, no nats-server"
        );
        return;
    };
    let router = Arc::new(router(2));
    let ingest = Ingest::with_shared_router(router.clone(), &IngestOptions::default()).unwrap();
    ingest.start().unwrap();
    let url = server.url();
    let mut source = JetStreamSource {
        durable: Some("gw-1"),
        ..JetStreamSource::new(&url, "KV", "kv.>")
    };

    // The refusals: no stream yet (and not asked to create it), a name with '.', no server.
    let e = ingest.subscribe_jetstream(&source).unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    let bad = JetStreamSource {
        stream: "K.V",
        create_stream: true,
        ..source
    };
    let e = ingest.subscribe_jetstream(&bad).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    let nowhere = format!("nats://127.0.0.1:{}", free_port());
    let away = JetStreamSource {
        url: &nowhere,
        create_stream: true,
        ..source
    };
    let e = ingest.subscribe_jetstream(&away).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");

    source.create_stream = true;
    let id = ingest.subscribe_jetstream(&source).unwrap();
    assert_eq!(ingest.source_endpoint(id).unwrap(), url);
    let a = prompt(12, 3);
    let batch = stored_batch(1, &a, 3, 100).encode().unwrap();
    server.publish(&[("kv.w1", &batch)]); // a core publish: the stream stores it
    let stats = wait_for("the stream's first message applied", || {
        let s = ingest.stats(id).unwrap();
        (s.stream_sequence >= 1).then_some(s)
    });
    assert_eq!(
        (stats.stream_sequence, stats.messages, stats.events_applied),
        (1, 1, 1)
    );
    // Nothing was lost: the consumer was never made again.
    assert_eq!(
        (stats.consumer_remakes, stats.consumer_remake_failures),
        (0, 0)
    );
    assert_eq!(ingest.total_stats().unwrap().stream_sequence, 1);
    assert_eq!(device_blocks(&router, &a, 1), 3);
}

#[test]
fn jetstream_relay_feeds_another_router() {
    let Some(server) = NatsServer::start_with(true) else {
        let _ = writeln!(
            std::io::stderr(),
            "jetstream_relay_feeds_another_router: skipped, no nats-server"
        );
        return;
    };
    let dir = TempDir::new();
    let url = server.url();
    let (first, second) = (Arc::new(router(2)), Arc::new(router(2)));
    let ingest = Ingest::with_shared_router(first.clone(), &IngestOptions::default()).unwrap();
    let listener = ingest
        .listen(&format!("unix://{}/relay.sock", dir.0.display()))
        .unwrap();
    ingest.start().unwrap();

    // A consumer's field is refused; then the relay, and no second one.
    let target = JetStreamSource {
        create_stream: true,
        ..JetStreamSource::new(&url, "KV", "kv.relay")
    };
    let durable = JetStreamSource {
        durable: Some("relay-1"),
        ..target
    };
    let e = ingest.relay_jetstream(&durable).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    let relay = ingest.relay_jetstream(&target).unwrap();
    assert_ne!(relay, 0);
    assert_ne!(relay, listener.source_id);
    let e = ingest.relay_jetstream(&target).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");

    // The second router consumes what the relay publishes.
    let ingest2 = Ingest::with_shared_router(second.clone(), &IngestOptions::default()).unwrap();
    ingest2.start().unwrap();
    let consumer = ingest2
        .subscribe_jetstream(&JetStreamSource {
            durable: Some("gw-2"),
            ..JetStreamSource::new(&url, "KV", "kv.relay.>")
        })
        .unwrap();

    let tokens = prompt(14, 3);
    let mut publisher = Publisher::connect(&listener.endpoint).unwrap();
    publisher.send(&stored_batch(1, &tokens, 3, 100)).unwrap();
    wait_messages(&ingest, listener.source_id, 1);
    let relayed = wait_for("the relay caught up", || {
        let s = ingest.stats(relay).unwrap();
        (s.messages >= 1
            && s.messages == s.events_applied + s.missed_messages
            && s.state_unknown == 0)
            .then_some(s)
    });
    assert!(relayed.stream_sequence > 0, "{relayed:?}");
    assert!(relayed.published > 0, "{relayed:?}");
    assert_eq!(relayed.missed_messages, 0);
    let consumed = wait_for("the consumer at the relay's last message", || {
        let s = ingest2.stats(consumer).unwrap();
        (s.stream_sequence >= relayed.stream_sequence).then_some(s)
    });
    assert_eq!(consumed.stream_sequence, relayed.stream_sequence);
    assert_eq!(
        first.index_digest().unwrap(),
        second.index_digest().unwrap()
    );
    assert_eq!(device_blocks(&second, &tokens, 1), 3);
}

// Replica sync without heartbeats: the first goes out as a sync starts, and the tests below
// count every message.
fn without_heartbeats() -> IngestOptions {
    IngestOptions {
        replica_heartbeat_ms: 0,
        ..IngestOptions::default()
    }
}

#[test]
fn replicas_sync_their_bookings_over_nats() {
    let Some(server) = NatsServer::start() else {
        let _ = writeln!(
            std::io::stderr(),
            "replicas_sync_their_bookings_over_nats: skipped, no nats-server"
        );
        return;
    };
    let (a, b) = (Arc::new(router(2)), Arc::new(router(2)));
    let ingest_a = Ingest::with_shared_router(a.clone(), &without_heartbeats()).unwrap();
    let ingest_b = Ingest::with_shared_router(b.clone(), &without_heartbeats()).unwrap();
    ingest_a.start().unwrap();
    ingest_b.start().unwrap();
    let source_a = ingest_a
        .sync_replicas(&server.url(), "kvrouter.test.replicas", "a")
        .unwrap();
    // a announced itself (Reset, SyncRequest) to nobody.
    assert_eq!(ingest_a.stats(source_a).unwrap().published, 2);
    let source_b = ingest_b
        .sync_replicas(&server.url(), "kvrouter.test.replicas", "b")
        .unwrap();
    let e = ingest_a
        .sync_replicas(&server.url(), "other", "a2")
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);

    // b's Reset and SyncRequest reach a, which answers with its Reset (it books nothing yet);
    // wait for that exchange so that the counts below are exact.
    let stats = wait_messages(&ingest_a, source_a, 2);
    assert_eq!((stats.messages, stats.events_applied), (2, 2));
    let stats = wait_messages(&ingest_b, source_b, 1);
    assert_eq!((stats.messages, stats.events_applied), (1, 1));
    assert_eq!(ingest_a.stats(source_a).unwrap().published, 3);
    assert_eq!(ingest_b.stats(source_b).unwrap().published, 2);

    let tokens = prompt(20, 32);
    let booked = a
        .find_best_match(&tokens, &RequestOptions::admit("shared"))
        .unwrap();
    // (A message is counted once the router has applied it.)
    let stats = wait_messages(&ingest_b, source_b, 2);
    assert_eq!(stats.events_applied, 2);
    assert_eq!(b.metrics().unwrap().replica_requests_active, 1);
    assert_eq!(ingest_a.stats(source_a).unwrap().published, 4);
    let r = b
        .find_best_match(&tokens, &RequestOptions::default())
        .unwrap();
    assert_ne!(r.worker_id, booked.worker_id);

    a.free_request("shared").unwrap();
    let stats = wait_messages(&ingest_b, source_b, 3);
    assert_eq!((stats.messages, stats.events_applied), (3, 3));
    assert_eq!(b.metrics().unwrap().replica_requests_active, 0);
    let stats = ingest_a.stats(source_a).unwrap();
    assert_eq!((stats.published, stats.publish_failures), (5, 0));
    // A short booking over the server's 1 MiB messages: not trimmed.
    assert_eq!(stats.bookings_trimmed, 0);
    // a applied b's two announcement messages; nothing of its own came back.
    assert_eq!(a.metrics().unwrap().replica_changes_applied, 2);
}

#[test]
fn a_booking_too_long_for_the_servers_messages_is_published_trimmed() {
    // Messages of at most 4 KiB, the least sync_replicas accepts (the default is 1 MiB).
    let Some(server) = NatsServer::start_configured(false, Some("max_payload: 4096\n")) else {
        let _ = writeln!(
            std::io::stderr(),
            "a_booking_too_long_for_the_servers_messages_is_published_trimmed: skipped, no nats-server"
        );
        return;
    };
    let a = Arc::new(router(1));
    let ingest = Ingest::with_shared_router(a.clone(), &without_heartbeats()).unwrap();
    ingest.start().unwrap();
    let source = ingest
        .sync_replicas(&server.url(), "kvrouter.test.trimmed", "a")
        .unwrap();
    // The changes are published (and counted) within the routing calls.
    a.add_request(&prompt(40, 4), 1, 0, &RequestOptions::with_id("short"))
        .unwrap();
    assert_eq!(ingest.stats(source).unwrap().bookings_trimmed, 0);
    // 1,000 blocks: 8 KB of block ids, sent with as many of the leading ones as fit. Its free
    // carries no block ids.
    a.add_request(&prompt(41, 1000), 1, 0, &RequestOptions::with_id("long"))
        .unwrap();
    a.free_request("long").unwrap();
    let stats = ingest.stats(source).unwrap();
    assert_eq!(
        (
            stats.bookings_trimmed,
            stats.published,
            stats.publish_failures
        ),
        (1, 5, 0),
        "{stats:?}"
    );
    assert_eq!(ingest.stats(0).unwrap().bookings_trimmed, 1);
}

#[test]
fn a_replica_joining_over_nats_learns_the_bookings_made_before_it() {
    let Some(server) = NatsServer::start() else {
        let _ = writeln!(
            std::io::stderr(),
            "a_replica_joining_over_nats_learns_the_bookings_made_before_it: skipped, no nats-server"
        );
        return;
    };
    let subject = "kvrouter.test.join";
    let (a, b) = (Arc::new(router(2)), Arc::new(router(2)));
    // a books two requests, then syncs: it announces them (Reset, two Added, SyncRequest) to
    // nobody. sync_replicas on a started ingest returns once the server has had those
    // messages, so none of them can reach b, which subscribes later. (A change published
    // after that, from a routing call, could still be in the client's buffer then.)
    let first = a
        .find_best_match(&prompt(30, 4), &RequestOptions::admit("early"))
        .unwrap();
    let second = a
        .find_best_match(&prompt(31, 2), &RequestOptions::admit("later"))
        .unwrap();
    assert_ne!(first.worker_id, second.worker_id);
    let ingest_a = Ingest::with_shared_router(a.clone(), &without_heartbeats()).unwrap();
    ingest_a.start().unwrap();
    let source_a = ingest_a.sync_replicas(&server.url(), subject, "a").unwrap();
    assert_eq!(ingest_a.stats(source_a).unwrap().published, 4);

    // b also holds a booking when it joins: a learns it from b's announcement, and b learns
    // both of a's from a's answer to its SyncRequest, without a booking anything more.
    b.find_best_match(&prompt(32, 1), &RequestOptions::admit("b-own"))
        .unwrap();
    let ingest_b = Ingest::with_shared_router(b.clone(), &without_heartbeats()).unwrap();
    ingest_b.start().unwrap();
    let source_b = ingest_b.sync_replicas(&server.url(), subject, "b").unwrap();
    // b published Reset, Added, SyncRequest; a applied them and answered, while applying the
    // SyncRequest, with a Reset and its two bookings, which b applied.
    let stats = wait_messages(&ingest_a, source_a, 3);
    assert_eq!(
        (stats.messages, stats.events_applied, stats.published),
        (3, 3, 7)
    );
    let stats = wait_messages(&ingest_b, source_b, 3);
    assert_eq!(
        (stats.messages, stats.events_applied, stats.published),
        (3, 3, 3)
    );
    assert_eq!(a.metrics().unwrap().replica_requests_active, 1);
    assert_eq!(b.metrics().unwrap().replica_requests_active, 2);
    assert_eq!(a.metrics().unwrap().requests_active, 3);
    assert_eq!(b.metrics().unwrap().requests_active, 3);
    let load = |r: &kvrouter::RouterRef| -> Vec<(u64, u64)> {
        let mut l: Vec<_> = r
            .potential_loads(&prompt(33, 1), &RequestOptions::default())
            .unwrap()
            .iter()
            .map(|p| (p.worker_id, p.active_requests))
            .collect();
        l.sort_unstable();
        l
    };
    assert_eq!(load(&a), load(&b), "both replicas see the same load");
}

#[test]
fn sync_replicas_refuses_a_replica_id_with_byte_0x1f_before_connecting() {
    let router = Arc::new(router(1));
    let ingest = Ingest::with_shared_router(router.clone(), &IngestOptions::default()).unwrap();
    // No server there: the id is refused before any connection is tried.
    let url = format!("nats://127.0.0.1:{}", free_port());
    for id in ["", "gw\x1f1", "\x1f"] {
        let e = ingest.sync_replicas(&url, "replicas", id).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{id:?}");
    }
    assert_eq!(
        ingest
            .sync_replicas(&url, "replicas", "gw-1")
            .unwrap_err()
            .code(),
        Code::Unavailable
    );
}

#[test]
fn sync_replicas_frees_the_closure_it_replaces() {
    let Some(server) = NatsServer::start() else {
        let _ = writeln!(
            std::io::stderr(),
            "sync_replicas_frees_the_closure_it_replaces: skipped, no nats-server"
        );
        return;
    };
    let router = Arc::new(router(1));
    let alive = Arc::new(());
    let held = alive.clone();
    let calls = Arc::new(AtomicU32::new(0));
    let counted = calls.clone();
    router
        .set_replica_publisher("a", move |_| {
            let _ = &held;
            counted.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2, "Reset, SyncRequest");
    let ingest = Ingest::with_shared_router(router.clone(), &without_heartbeats()).unwrap();
    ingest.start().unwrap();
    // A failed sync (no server there) replaced nothing: the closure stays.
    let nowhere = format!("nats://127.0.0.1:{}", free_port());
    let e = ingest.sync_replicas(&nowhere, "r", "a").unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert_eq!(Arc::strong_count(&alive), 2);
    // Replaced by the sync (after its farewell), it is dropped before sync_replicas returns.
    // Before, it stayed in the binding's table until the next setter or the router's drop
    // (for good if it owned the router).
    ingest
        .sync_replicas(&server.url(), "kvrouter.test.replaced", "a")
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3, "the farewell Reset");
    assert_eq!(
        Arc::strong_count(&alive),
        1,
        "the replaced closure is freed"
    );
}
