//! What a user's program does with the crates: route a request onto the worker that cached its
//! prefix, ingest an event over the native stream (so the static build links the transports
//! too), and export the metrics through a prometheus 0.14 registry. Prints "consumer ok".

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrouter::prometheus::RouterCollector;
use kvrouter::{
    EventBatch, Ingest, IngestOptions, Publisher, RequestOptions, Router, RouterOptions,
    StoredEvent, WorkerConfig,
};
use prometheus::{Encoder, Registry, TextEncoder};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    kvrouter::check_version()?;
    let router = Arc::new(Router::new(&RouterOptions::with_block_size(16))?);
    for id in 1..=3 {
        router.add_worker(&WorkerConfig::new(id))?;
    }

    // Worker 3's engine publishes that it cached the prompt's first two blocks.
    let prompt: Vec<u32> = (1000..1048).collect();
    let ingest = Ingest::with_shared_router(router.clone(), &IngestOptions::default())?;
    let listener = ingest.listen("tcp://127.0.0.1:0")?;
    ingest.start()?;
    let mut batch = EventBatch::new()?;
    batch.add_stored(&StoredEvent {
        worker_id: 3,
        block_hashes: &[0xA1, 0xA2],
        token_ids: &prompt[..32],
        ..Default::default()
    })?;
    Publisher::connect(&listener.endpoint)?.send(&batch)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while ingest.total_stats()?.events_applied < 1 {
        assert!(Instant::now() < deadline, "the event never arrived");
        std::thread::sleep(Duration::from_millis(2));
    }

    let decision = router.find_best_match(&prompt, &RequestOptions::admit("req-1"))?;
    assert_eq!((decision.worker_id, decision.cached_tokens), (3, 32));
    router.mark_prefill_completed("req-1")?;
    router.free_request("req-1")?;

    let registry = Registry::new();
    registry.register(Box::new(RouterCollector::new(router.clone())?))?;
    let mut text = Vec::new();
    TextEncoder::new().encode(&registry.gather(), &mut text)?;
    let text = String::from_utf8(text)?;
    assert!(text.contains("kvrouter_decisions_total 1\n"), "{text}");
    assert!(text.contains("kvrouter_workers 3\n"), "{text}");

    println!(
        "consumer ok: libkvrouter {}, worker {} with {} cached tokens",
        kvrouter::version_string(),
        decision.worker_id,
        decision.cached_tokens
    );
    Ok(())
}
