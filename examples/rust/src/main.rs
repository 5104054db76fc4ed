//! An LLM gateway routed by kvrouter: OpenAI-style completions with token-id prompts, over
//! `std::net` and a thread per connection.
//!
//! ```text
//! gateway --port 8000 --block-size 16 \
//!     --engine 1=http://127.0.0.1:9001 --engine 2=http://127.0.0.1:9002 \
//!     --engine-zmq 1=tcp://127.0.0.1:5557 --engine-zmq 2=tcp://127.0.0.1:5558 \
//!     [--kv-listen tcp://127.0.0.1:5600]     # engines publishing kvrouter's native stream
//! ```
//!
//! For each `POST /v1/completions` (`{"prompt": [token ids], "max_tokens": N, "stream": bool}`)
//! the gateway asks the router for the worker holding the longest cached prefix of the prompt
//! at the lowest load and books the request there (`find_best_match` with a request id), sends
//! it to that engine (always streaming), and passes the engine's server-sent events through to
//! the client, or gathers them into one JSON response. The first token marks the request's
//! prefill completed; the end of the stream, an engine failure or the client going away frees
//! it. The engines' KV events reach the router through an ingest loop: ZMQ subscriptions to
//! vLLM (or SGLang) publishers, `--engine-zmq`, or a native stream listener, `--kv-listen`. So
//! the router's index follows what every engine caches.
//!
//! `GET /metrics` serves the router's and the ingest's metrics and the gateway's own counters
//! from one `prometheus::Registry` (kvrouter's `RouterCollector`); `GET /health` answers ok.
//! The gateway prints one JSON line when it listens: `{"listening": "http://...",
//! "kv_endpoint": ...}`.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Instant;

use kvrouter::prometheus::RouterCollector;
use kvrouter::{
    EngineWorker, Ingest, IngestOptions, RequestOptions, RouteResult, Router, RouterOptions,
    WorkerConfig,
};
use kvrouter_gateway_example::http;
use prometheus::{Counter, Encoder, IntCounter, Registry, TextEncoder};
use serde_json::{json, Value};

struct Args {
    host: String,
    port: u16,
    block_size: u32,
    /// Worker id and the engine's `host:port`.
    engines: Vec<(u64, String)>,
    /// Worker id and its ZMQ KV event endpoint.
    engine_zmq: Vec<(u64, String)>,
    kv_listen: Option<String>,
    verbose: bool,
}

const USAGE: &str = "usage: gateway [--host H] [--port P] [--block-size N] \
    --engine ID=http://HOST:PORT ... [--engine-zmq ID=tcp://HOST:PORT ...] \
    [--kv-listen tcp://HOST:PORT|unix://PATH] [-v]";

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        host: "127.0.0.1".into(),
        port: 8000,
        block_size: 16,
        engines: Vec::new(),
        engine_zmq: Vec::new(),
        kv_listen: None,
        verbose: false,
    };
    let id_and = |spec: String| -> Result<(u64, String), String> {
        let (id, rest) = spec.split_once('=').ok_or(format!("{spec}: not ID=..."))?;
        let id = id.parse().map_err(|_| format!("{spec}: bad worker id"))?;
        Ok((id, rest.to_string()))
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--host" => args.host = value()?,
            "--port" => args.port = value()?.parse().map_err(|_| "bad --port")?,
            "--block-size" => args.block_size = value()?.parse().map_err(|_| "bad --block-size")?,
            "--engine" => {
                let (id, url) = id_and(value()?)?;
                let address = url
                    .strip_prefix("http://")
                    .ok_or(format!("{url}: only http:// engines"))?
                    .trim_end_matches('/')
                    .to_string();
                args.engines.push((id, address));
            }
            "--engine-zmq" => args.engine_zmq.push(id_and(value()?)?),
            "--kv-listen" => args.kv_listen = Some(value()?),
            "-v" | "--verbose" => args.verbose = true,
            "-h" | "--help" => return Err(USAGE.into()),
            _ => return Err(format!("unknown argument {flag}\n{USAGE}")),
        }
    }
    if args.engines.is_empty() {
        return Err(format!("at least one --engine\n{USAGE}"));
    }
    Ok(args)
}

/// The gateway's own counters, in the registry beside the router's families.
struct Counters {
    requests: IntCounter,
    completed: IntCounter,
    disconnects: IntCounter,
    engine_errors: IntCounter,
    first_token_seconds: Counter,
}

impl Counters {
    fn register(registry: &Registry) -> prometheus::Result<Counters> {
        let int = |name: &str, help: &str| -> prometheus::Result<IntCounter> {
            let c = IntCounter::new(name, help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let first_token_seconds = Counter::new(
            "kvrouter_gateway_first_token_seconds_total",
            "Time to first token, summed.",
        )?;
        registry.register(Box::new(first_token_seconds.clone()))?;
        Ok(Counters {
            requests: int(
                "kvrouter_gateway_requests_total",
                "Completion requests received.",
            )?,
            completed: int(
                "kvrouter_gateway_completed_total",
                "Requests streamed to their end.",
            )?,
            disconnects: int(
                "kvrouter_gateway_disconnects_total",
                "Requests whose client went away first.",
            )?,
            engine_errors: int(
                "kvrouter_gateway_engine_errors_total",
                "Requests an engine failed.",
            )?,
            first_token_seconds,
        })
    }
}

struct Gateway {
    router: Arc<Router>,
    /// Applies the engines' KV events to the router on a loop thread of its own.
    _ingest: Arc<Ingest<'static>>,
    engines: HashMap<u64, String>,
    next_id: AtomicU64,
    registry: Registry,
    counters: Counters,
    verbose: bool,
}

/// How a proxied request ended.
enum Outcome {
    Completed,
    /// The client went away (its connection closed, or a write to it failed).
    Disconnected,
    /// The engine failed before anything was sent to the client, which was answered with this
    /// status and message.
    Failed(u16, String),
    /// The engine's stream broke or ended early after the client's had started: it just ends.
    Broken,
}

/// Frees the request when dropped: whether it ended, failed or was abandoned, it is no longer
/// load on its worker.
struct Booking<'a> {
    router: &'a Router,
    id: &'a str,
}

impl Drop for Booking<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.router.free_request(self.id) {
            eprintln!("gateway: freeing {}: {e}", self.id);
        }
    }
}

impl Gateway {
    fn new(args: &Args) -> Result<(Gateway, Option<String>), Box<dyn std::error::Error>> {
        let router = Arc::new(Router::new(&RouterOptions::with_block_size(
            args.block_size,
        ))?);
        for (id, _) in &args.engines {
            router.add_worker(&WorkerConfig::new(*id))?;
        }
        let ingest = Arc::new(Ingest::with_shared_router(
            router.clone(),
            &IngestOptions::default(),
        )?);
        let kv_endpoint = match &args.kv_listen {
            Some(endpoint) => Some(ingest.listen(endpoint)?.endpoint),
            None => None,
        };
        for (id, endpoint) in &args.engine_zmq {
            ingest.add_engine_worker(&EngineWorker {
                block_size: args.block_size,
                ..EngineWorker::new(endpoint, *id)
            })?;
        }
        ingest.start()?;

        let registry = Registry::new();
        let collector = RouterCollector::new(router.clone())?.with_ingest(ingest.clone())?;
        registry.register(Box::new(collector))?;
        let counters = Counters::register(&registry)?;
        let gateway = Gateway {
            router,
            _ingest: ingest,
            engines: args.engines.iter().cloned().collect(),
            next_id: AtomicU64::new(1),
            registry,
            counters,
            verbose: args.verbose,
        };
        Ok((gateway, kv_endpoint))
    }

    fn handle(&self, client: TcpStream) -> io::Result<()> {
        let mut reader = BufReader::new(client.try_clone()?);
        let mut out = client;
        let req = match http::read_request(&mut reader) {
            Ok(Some(req)) => req,
            Ok(None) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                return http::write_error(&mut out, 400, &e.to_string())
            }
            Err(e) => return Err(e),
        };
        match (req.method.as_str(), req.path.as_str()) {
            ("POST", "/v1/completions") => self.completions(&req.body, reader, out),
            (_, "/v1/completions") => http::write_error(&mut out, 405, "POST only"),
            ("GET", "/metrics") => {
                let mut text = Vec::new();
                TextEncoder::new()
                    .encode(&self.registry.gather(), &mut text)
                    .map_err(io::Error::other)?;
                http::write_response(&mut out, 200, "text/plain; version=0.0.4", &[], &text)
            }
            ("GET", "/health") => http::write_response(
                &mut out,
                200,
                "application/json",
                &[],
                b"{\"status\":\"ok\"}",
            ),
            _ => http::write_error(&mut out, 404, &format!("no route {}", req.path)),
        }
    }

    fn completions(
        &self,
        body: &[u8],
        client_reader: BufReader<TcpStream>,
        mut client: TcpStream,
    ) -> io::Result<()> {
        let request: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return http::write_error(&mut client, 400, &format!("bad JSON: {e}")),
        };
        let prompt: Option<Vec<u32>> = request["prompt"].as_array().and_then(|p| {
            p.iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect()
        });
        let Some(prompt) = prompt else {
            return http::write_error(&mut client, 400, "prompt must be a list of token ids");
        };
        let stream = request["stream"].as_bool().unwrap_or(false);
        self.counters.requests.inc();
        let id = format!("gw-{}", self.next_id.fetch_add(1, Ordering::Relaxed));
        let started = Instant::now();

        let decision = match self
            .router
            .find_best_match(&prompt, &RequestOptions::admit(&id))
        {
            Ok(d) => d,
            Err(e) => return http::write_error(&mut client, 503, &format!("no worker: {e}")),
        };
        let _booking = Booking {
            router: &self.router,
            id: &id,
        };
        if self.verbose {
            eprintln!(
                "gateway: {id}: {} tokens -> worker {} ({} cached)",
                prompt.len(),
                decision.worker_id,
                decision.cached_tokens
            );
        }

        let outcome = self.proxy(
            &request,
            &id,
            &decision,
            stream,
            client_reader,
            &mut client,
            started,
        );
        match outcome {
            Outcome::Completed => self.counters.completed.inc(),
            Outcome::Disconnected => {
                self.counters.disconnects.inc();
                if self.verbose {
                    eprintln!("gateway: {id}: the client went away; freed");
                }
            }
            Outcome::Failed(..) | Outcome::Broken => self.counters.engine_errors.inc(),
        }
        Ok(())
        // _booking drops here: the request is freed.
    }

    /// Sends the request to the chosen engine and passes its tokens on (an error status to the
    /// client if the engine fails before any was sent). A thread watches the
    /// client's side of the connection meanwhile: the client sends nothing more, so its end of
    /// stream (or a reset) means it went away, and the engine connection is shut down, which
    /// ends the engine's stream (the engine sees the request cancelled) and this loop.
    #[allow(clippy::too_many_arguments)]
    fn proxy(
        &self,
        request: &Value,
        id: &str,
        decision: &RouteResult,
        stream: bool,
        mut client_reader: BufReader<TcpStream>,
        client: &mut TcpStream,
        started: Instant,
    ) -> Outcome {
        let worker = decision.worker_id;
        let fail = |client: &mut TcpStream, message: String| {
            let _ = http::write_error(client, 502, &message);
            Outcome::Failed(502, message)
        };
        let Some(address) = self.engines.get(&worker) else {
            return fail(client, format!("no engine for worker {worker}"));
        };
        let engine = match TcpStream::connect(address) {
            Ok(s) => s,
            Err(e) => return fail(client, format!("engine {worker} unreachable: {e}")),
        };
        let _ = engine.set_nodelay(true);

        // The watcher.
        let finished = Arc::new(AtomicBool::new(false));
        let gone = Arc::new(AtomicBool::new(false));
        let watcher = {
            let (finished, gone) = (finished.clone(), gone.clone());
            let engine = engine.try_clone();
            thread::spawn(move || {
                let mut byte = [0u8; 1];
                // Bytes after the request (a client pipelining) are ignored.
                while matches!(client_reader.read(&mut byte), Ok(n) if n > 0) {}
                if !finished.load(Ordering::SeqCst) {
                    gone.store(true, Ordering::SeqCst);
                    if let Ok(engine) = engine {
                        let _ = engine.shutdown(Shutdown::Both);
                    }
                }
            })
        };
        let outcome = self.forward(
            request, id, decision, stream, &engine, client, started, &gone,
        );
        if let Outcome::Failed(status, message) = &outcome {
            let _ = http::write_error(client, *status, message); // nothing was sent yet
        }
        finished.store(true, Ordering::SeqCst);
        // Ends the watcher's read (and the response: every response closes its connection).
        let _ = client.shutdown(Shutdown::Both);
        let _ = engine.shutdown(Shutdown::Both);
        let _ = watcher.join();
        outcome
    }

    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        request: &Value,
        id: &str,
        decision: &RouteResult,
        stream: bool,
        engine: &TcpStream,
        client: &mut TcpStream,
        started: Instant,
        gone: &AtomicBool,
    ) -> Outcome {
        let worker = decision.worker_id;
        let failed = |what: &str, e: &dyn std::fmt::Display| {
            if gone.load(Ordering::SeqCst) {
                Outcome::Disconnected
            } else {
                Outcome::Failed(502, format!("engine {worker}: {what}: {e}"))
            }
        };
        let mut upstream = request.clone();
        upstream["stream"] = json!(true); // the first token is seen as it comes
        let payload = upstream.to_string();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nx-request-id: {id}\r\nconnection: close\r\n\r\n",
            self.engines[&worker],
            payload.len()
        );
        let mut engine_out = engine;
        if let Err(e) = engine_out
            .write_all(head.as_bytes())
            .and_then(|()| engine_out.write_all(payload.as_bytes()))
        {
            return failed("sending the request", &e);
        }
        let mut engine_in = BufReader::new(engine);
        let (status, headers) = match http::read_response_head(&mut engine_in) {
            Ok(head) => head,
            Err(e) => return failed("reading the response", &e),
        };
        if status != 200 {
            return Outcome::Failed(502, format!("engine {worker} answered {status}"));
        }
        let worker_header = worker.to_string();
        let cached_header = decision.cached_tokens.to_string();
        let routing = [
            ("x-kvrouter-worker", worker_header.as_str()),
            ("x-kvrouter-cached-tokens", cached_header.as_str()),
            ("x-request-id", id),
        ];
        if stream {
            let mut headers = vec![
                ("content-type", "text/event-stream"),
                ("cache-control", "no-cache"),
                ("connection", "close"),
            ];
            headers.extend_from_slice(&routing);
            if http::write_head(client, 200, &headers).is_err() {
                return Outcome::Disconnected;
            }
        }

        let body = http::Body::new(engine_in, &headers);
        let mut first = true;
        let mut text = String::new();
        let mut finish = Value::Null;
        let mut done = false;
        for line in body.lines() {
            let line = match line {
                Ok(line) => line,
                Err(_) if stream && !gone.load(Ordering::SeqCst) => return Outcome::Broken,
                Err(e) => return failed("the stream broke", &e),
            };
            let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if first {
                first = false;
                let _ = self.router.mark_prefill_completed(id); // the first token is out
                self.counters
                    .first_token_seconds
                    .inc_by(started.elapsed().as_secs_f64());
            }
            if data == "[DONE]" {
                done = true;
                break;
            }
            if stream {
                let event = format!("data: {data}\n\n");
                if client.write_all(event.as_bytes()).is_err() {
                    return Outcome::Disconnected;
                }
            } else if let Ok(chunk) = serde_json::from_str::<Value>(data) {
                let choice = &chunk["choices"][0];
                text.push_str(choice["text"].as_str().unwrap_or(""));
                if !choice["finish_reason"].is_null() {
                    finish = choice["finish_reason"].clone();
                }
            }
        }
        if gone.load(Ordering::SeqCst) {
            return Outcome::Disconnected;
        }
        if !done {
            return if stream {
                Outcome::Broken
            } else {
                Outcome::Failed(502, format!("engine {worker} ended the stream early"))
            };
        }
        let sent = if stream {
            client.write_all(b"data: [DONE]\n\n")
        } else {
            let body = json!({
                "id": id, "object": "text_completion", "model": request["model"],
                "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            })
            .to_string();
            http::write_response(client, 200, "application/json", &routing, body.as_bytes())
        };
        match sent {
            Ok(()) => Outcome::Completed,
            Err(_) => Outcome::Disconnected,
        }
    }
}

fn main() {
    let args = parse_args().unwrap_or_else(|e| {
        eprintln!("gateway: {e}");
        std::process::exit(2);
    });
    let (gateway, kv_endpoint) = Gateway::new(&args).unwrap_or_else(|e| {
        eprintln!("gateway: {e}");
        std::process::exit(1);
    });
    let listener = TcpListener::bind((args.host.as_str(), args.port)).unwrap_or_else(|e| {
        eprintln!("gateway: cannot listen on {}:{}: {e}", args.host, args.port);
        std::process::exit(1);
    });
    // One line for whoever started it (the test reads it): where it listens.
    let address = listener.local_addr().expect("a bound address");
    println!(
        "{}",
        json!({ "listening": format!("http://{address}"), "kv_endpoint": kv_endpoint })
    );
    io::stdout().flush().expect("stdout");
    let gateway = Arc::new(gateway);
    for client in listener.incoming().flatten() {
        let gateway = gateway.clone();
        thread::spawn(move || {
            if let Err(e) = gateway.handle(client) {
                if gateway.verbose {
                    eprintln!("gateway: {e}");
                }
            }
        });
    }
}
