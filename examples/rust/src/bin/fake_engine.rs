//! A fake LLM engine for the gateway example and its test: an OpenAI-style completions server
//! that "generates" one token every `--token-delay-ms` and, like vLLM with prefix caching and
//! `--kv-events-config`, publishes KV events for the blocks it caches on a ZeroMQ PUB socket.
//!
//! ```text
//! fake_engine --port 9001 --worker-id 1 --zmq tcp://127.0.0.1:5557
//! ```
//!
//! Before its first token it caches the prompt's complete blocks and publishes a vLLM
//! `BlockStored` event (msgpack, vLLM's array encoding:
//! `[ts, [["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]], dp_rank]`) for
//! the blocks it did not hold yet; its block hashes are the chained sequence hashes of the
//! tokens (vLLM's are SHA-256 based; the router hashes the tokens itself and uses these only
//! to name blocks). With `--capacity` it evicts the least recently used blocks, deepest first,
//! and publishes `BlockRemoved`. The completion streams as server-sent events in a chunked
//! body, as vLLM's does. `GET /stats` counts requests, completions, requests the client
//! abandoned (the gateway closing the connection) and ZMQ subscribers.
//!
//! It prints one JSON line when ready: `{"listening": "http://...", "zmq": "tcp://..."}`.

use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvrouter::{compute_block_hashes, compute_sequence_hashes, HashOptions};
use kvrouter_gateway_example::{http, msgpack, zmtp};
use serde_json::{json, Value};

struct Args {
    port: u16,
    worker_id: u64,
    block_size: u32,
    zmq: String,
    token_delay: Duration,
    capacity: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        port: 0,
        worker_id: 0,
        block_size: 16,
        zmq: "tcp://127.0.0.1:0".into(),
        token_delay: Duration::from_millis(5),
        capacity: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let bad = |e: &dyn std::fmt::Display| format!("{flag}: {e}");
        match flag.as_str() {
            "--port" => args.port = value()?.parse().map_err(|e| bad(&e))?,
            "--worker-id" => args.worker_id = value()?.parse().map_err(|e| bad(&e))?,
            "--block-size" => args.block_size = value()?.parse().map_err(|e| bad(&e))?,
            "--zmq" => args.zmq = value()?,
            "--token-delay-ms" => {
                args.token_delay = Duration::from_millis(value()?.parse().map_err(|e| bad(&e))?)
            }
            "--capacity" => args.capacity = value()?.parse().map_err(|e| bad(&e))?,
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    if args.worker_id == 0 {
        return Err("--worker-id is required".into());
    }
    Ok(args)
}

#[derive(Default)]
struct Cache {
    /// Engine hash -> (parent, last use): what the engine holds.
    blocks: HashMap<u64, (Option<u64>, u64)>,
    clock: u64,
}

struct Engine {
    args: Args,
    publisher: zmtp::Publisher,
    cache: Mutex<Cache>,
    requests: AtomicU64,
    completed: AtomicU64,
    cancelled: AtomicU64,
    stored_blocks: AtomicU64,
    removed_blocks: AtomicU64,
}

fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Engine {
    /// Caches the prompt's complete blocks; publishes what is new, and what it evicted.
    fn cache_prompt(&self, prompt: &[u32]) -> kvrouter::Result<()> {
        let bs = self.args.block_size;
        let local = compute_block_hashes(prompt, bs, &HashOptions::default())?;
        let hashes = compute_sequence_hashes(&local)?;
        let mut cache = self.cache.lock().unwrap();
        cache.clock += 1;
        let clock = cache.clock;
        let mut held = 0;
        while held < hashes.len() && cache.blocks.contains_key(&hashes[held]) {
            cache.blocks.get_mut(&hashes[held]).unwrap().1 = clock;
            held += 1;
        }
        if held == hashes.len() {
            return Ok(());
        }
        let parent = held.checked_sub(1).map(|i| hashes[i]);
        for i in held..hashes.len() {
            let parent = i.checked_sub(1).map(|p| hashes[p]);
            cache.blocks.insert(hashes[i], (parent, clock));
        }
        self.stored_blocks
            .fetch_add((hashes.len() - held) as u64, Ordering::Relaxed);
        let mut events = Vec::new();
        let mut count = 1;
        // ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
        msgpack::array(&mut events, 7);
        msgpack::str(&mut events, "BlockStored");
        msgpack::array(&mut events, hashes.len() - held);
        for &h in &hashes[held..] {
            msgpack::uint(&mut events, h);
        }
        match parent {
            Some(p) => msgpack::uint(&mut events, p),
            None => msgpack::nil(&mut events),
        }
        let tokens = &prompt[held * bs as usize..hashes.len() * bs as usize];
        msgpack::array(&mut events, tokens.len());
        for &t in tokens {
            msgpack::uint(&mut events, u64::from(t));
        }
        msgpack::uint(&mut events, u64::from(bs));
        msgpack::nil(&mut events);
        msgpack::str(&mut events, "GPU");

        let evicted = evict(&mut cache, self.args.capacity);
        if !evicted.is_empty() {
            // ["BlockRemoved", block_hashes, medium]
            count += 1;
            msgpack::array(&mut events, 3);
            msgpack::str(&mut events, "BlockRemoved");
            msgpack::array(&mut events, evicted.len());
            for &h in &evicted {
                msgpack::uint(&mut events, h);
            }
            msgpack::str(&mut events, "GPU");
            self.removed_blocks
                .fetch_add(evicted.len() as u64, Ordering::Relaxed);
        }
        // [ts, events, data_parallel_rank]
        let mut batch = Vec::with_capacity(events.len() + 16);
        msgpack::array(&mut batch, 3);
        msgpack::float(&mut batch, now_seconds());
        msgpack::array(&mut batch, count);
        batch.extend_from_slice(&events);
        msgpack::uint(&mut batch, 0);
        self.publisher.send(b"", &batch);
        Ok(())
    }

    fn handle(&self, stream: TcpStream) -> std::io::Result<()> {
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut out = stream;
        let Some(req) = http::read_request(&mut reader)? else {
            return Ok(());
        };
        match (req.method.as_str(), req.path.as_str()) {
            ("GET", "/stats") => {
                let stats = json!({
                    "requests": self.requests.load(Ordering::Relaxed),
                    "completed": self.completed.load(Ordering::Relaxed),
                    "cancelled": self.cancelled.load(Ordering::Relaxed),
                    "stored_blocks": self.stored_blocks.load(Ordering::Relaxed),
                    "removed_blocks": self.removed_blocks.load(Ordering::Relaxed),
                    "subscribers": self.publisher.subscribers(),
                });
                let body = stats.to_string();
                http::write_response(&mut out, 200, "application/json", &[], body.as_bytes())
            }
            ("POST", "/v1/completions") => self.complete(&req.body, &mut out),
            _ => http::write_error(&mut out, 404, "no such route"),
        }
    }

    fn complete(&self, body: &[u8], out: &mut TcpStream) -> std::io::Result<()> {
        let request: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return http::write_error(out, 400, &e.to_string()),
        };
        let Some(prompt) = request["prompt"].as_array().and_then(|p| {
            p.iter()
                .map(|t| t.as_u64().map(|t| t as u32))
                .collect::<Option<Vec<_>>>()
        }) else {
            return http::write_error(out, 400, "prompt must be a list of token ids");
        };
        let max_tokens = request["max_tokens"].as_u64().unwrap_or(16);
        self.requests.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.cache_prompt(&prompt) {
            return http::write_error(out, 400, &e.to_string());
        }
        http::write_head(
            out,
            200,
            &[
                ("content-type", "text/event-stream"),
                ("transfer-encoding", "chunked"),
                ("connection", "close"),
            ],
        )?;
        let model = format!("fake-{}", self.args.worker_id);
        let sent = (|| {
            for i in 0..max_tokens {
                thread::sleep(self.args.token_delay);
                let finish = if i + 1 == max_tokens {
                    json!("length")
                } else {
                    Value::Null
                };
                let chunk = json!({
                    "id": "cmpl-fake", "object": "text_completion", "model": model,
                    "choices": [{"index": 0, "text": format!(" t{i}"), "finish_reason": finish}],
                });
                http::write_chunk(out, format!("data: {chunk}\n\n").as_bytes())?;
            }
            http::write_chunk(out, b"data: [DONE]\n\n")
        })();
        match sent {
            Ok(()) => {
                self.completed.fetch_add(1, Ordering::Relaxed);
                // The client may have closed the connection at [DONE] already.
                let _ = http::write_last_chunk(out);
            }
            Err(_) => {
                self.cancelled.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }
}

/// Evicts least recently used blocks that no cached block extends (leaves) until at most
/// `capacity` are held (0: no limit); returns them.
fn evict(cache: &mut Cache, capacity: usize) -> Vec<u64> {
    let mut evicted = Vec::new();
    while capacity > 0 && cache.blocks.len() > capacity {
        let parents: std::collections::HashSet<u64> =
            cache.blocks.values().filter_map(|(p, _)| *p).collect();
        let Some(leaf) = cache
            .blocks
            .iter()
            .filter(|(h, _)| !parents.contains(h))
            .min_by_key(|(h, (_, used))| (*used, **h))
            .map(|(h, _)| *h)
        else {
            break;
        };
        cache.blocks.remove(&leaf);
        evicted.push(leaf);
    }
    evicted
}

fn main() {
    let args = parse_args().unwrap_or_else(|e| {
        eprintln!("fake_engine: {e}");
        std::process::exit(2);
    });
    let zmq = args
        .zmq
        .strip_prefix("tcp://")
        .unwrap_or(&args.zmq)
        .to_string();
    let publisher = zmtp::Publisher::bind(&zmq).expect("bind the ZMQ endpoint");
    let listener = TcpListener::bind(("127.0.0.1", args.port)).expect("bind the HTTP port");
    println!(
        "{}",
        json!({
            "listening": format!("http://{}", listener.local_addr().unwrap()),
            "zmq": publisher.endpoint(),
        })
    );
    std::io::stdout().flush().unwrap();
    let engine = Arc::new(Engine {
        args,
        publisher,
        cache: Mutex::default(),
        requests: AtomicU64::new(0),
        completed: AtomicU64::new(0),
        cancelled: AtomicU64::new(0),
        stored_blocks: AtomicU64::new(0),
        removed_blocks: AtomicU64::new(0),
    });
    for stream in listener.incoming().flatten() {
        let engine = engine.clone();
        thread::spawn(move || {
            let _ = engine.handle(stream);
        });
    }
}
