//! The README's example: route a prompt to the worker holding its prefix, then end the request.
//! `cargo run --example route`
use kvrouter::{RequestOptions, Router, RouterOptions, StoredEvent, WorkerConfig};

fn main() -> Result<(), kvrouter::Error> {
    let router = Router::new(&RouterOptions::with_block_size(16))?;
    for id in 1..=4 {
        router.add_worker(&WorkerConfig::new(id))?;
    }
    let prompt: Vec<u32> = (1000..1048).collect();
    // Worker 2's engine cached the prompt's first two blocks (a KV "stored" event).
    router.apply_stored(&StoredEvent {
        worker_id: 2,
        block_hashes: &[0xA1, 0xA2],
        token_ids: &prompt[..32],
        ..Default::default()
    })?;
    let r = router.find_best_match(&prompt, &RequestOptions::admit("req-1"))?;
    println!(
        "worker {} rank {}, {} tokens cached",
        r.worker_id, r.dp_rank, r.cached_tokens
    );
    router.mark_prefill_completed("req-1")?; // first token produced
    router.free_request("req-1")?; // request ended
    Ok(())
}
