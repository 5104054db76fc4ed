//! The gateway against two fake engines, all three as processes on 127.0.0.1: the engines'
//! vLLM KV events reach the gateway's router over ZMQ, requests follow the cached prefix, the
//! loads go back to zero after completions and after clients leave mid-request (streaming or
//! not; the engine sees the request cancelled), and /metrics has the router's, the ingest's
//! and the gateway's families.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use kvrouter_gateway_example::http;
use serde_json::{json, Value};

/// A child process, killed on drop.
struct Process {
    child: Child,
    /// Its first stdout line, parsed (where it listens).
    ready: Value,
    _stdout: BufReader<ChildStdout>,
}

impl Process {
    fn start(program: &str, args: &[&str]) -> Process {
        let mut child = Command::new(program)
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let ready = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("{program} printed {line:?}: {e}"));
        Process {
            child,
            ready,
            _stdout: stdout,
        }
    }

    fn address(&self) -> String {
        let url = self.ready["listening"].as_str().unwrap();
        url.strip_prefix("http://").unwrap().to_string()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A response: status, headers, body.
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Response {
    fn header(&self, name: &str) -> &str {
        http::header(&self.headers, name).unwrap_or_else(|| panic!("no {name} header"))
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap()
    }
}

fn send(address: &str, method: &str, path: &str, body: &str) -> TcpStream {
    let mut stream = TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: {address}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    stream
}

fn request(address: &str, method: &str, path: &str, body: &str) -> Response {
    let mut reader = BufReader::new(send(address, method, path, body));
    let (status, headers) = http::read_response_head(&mut reader).unwrap();
    let mut body = String::new();
    http::Body::new(reader, &headers)
        .read_to_string(&mut body)
        .unwrap();
    Response {
        status,
        headers,
        body,
    }
}

fn completion(gateway: &str, prompt: &[u32], max_tokens: u32, stream: bool) -> Response {
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": stream});
    request(gateway, "POST", "/v1/completions", &body.to_string())
}

/// The series of a Prometheus text: `name{labels}` (as written) to value.
fn metrics(gateway: &str) -> (String, BTreeMap<String, f64>) {
    let text = request(gateway, "GET", "/metrics", "").body;
    let series = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (key, value) = l.rsplit_once(' ').unwrap();
            (key.to_string(), value.parse().unwrap())
        })
        .collect();
    (text, series)
}

fn metric(gateway: &str, key: &str) -> f64 {
    let (text, series) = metrics(gateway);
    *series
        .get(key)
        .unwrap_or_else(|| panic!("no {key} in\n{text}"))
}

fn stats(engine: &Process) -> Value {
    request(&engine.address(), "GET", "/stats", "").json()
}

fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `blocks` blocks of 16 distinct tokens starting at `seed`.
fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|i| seed * 1000 + i).collect()
}

/// Every rank's load is zero, and no request is active (the gateway frees a request once it
/// has answered, so the client may ask before).
fn wait_idle(gateway: &str) {
    wait_for("every load back to zero", || {
        let (_, series) = metrics(gateway);
        series["kvrouter_requests_active"] == 0.0
            && series
                .iter()
                .filter(|(key, _)| key.starts_with("kvrouter_worker_active_"))
                .all(|(_, value)| *value == 0.0)
    });
}

#[test]
fn the_gateway_routes_by_cached_prefix_and_frees_every_request() {
    let engine = env!("CARGO_BIN_EXE_fake_engine");
    let engines: Vec<Process> = (1..=2)
        .map(|id| {
            let id = id.to_string();
            Process::start(engine, &["--worker-id", &id, "--token-delay-ms", "2"])
        })
        .collect();
    let mut args: Vec<String> = vec!["--port".into(), "0".into()];
    for (i, e) in engines.iter().enumerate() {
        args.push("--engine".into());
        args.push(format!("{}=http://{}", i + 1, e.address()));
        args.push("--engine-zmq".into());
        args.push(format!("{}={}", i + 1, e.ready["zmq"].as_str().unwrap()));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let gateway = Process::start(env!("CARGO_BIN_EXE_gateway"), &args);
    let gw = gateway.address();
    // A PUB drops what it sends before a subscriber is there (as vLLM's does).
    wait_for("the gateway's subscriptions", || {
        engines.iter().all(|e| stats(e)["subscribers"] == 1)
    });
    assert_eq!(request(&gw, "GET", "/health", "").status, 200);

    // A first prompt: nothing cached anywhere; answered whole.
    let a = prompt(1, 4);
    let first = completion(&gw, &a, 5, false);
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("x-kvrouter-cached-tokens"), "0");
    let worker_a: usize = first.header("x-kvrouter-worker").parse().unwrap();
    let body = first.json();
    assert_eq!(body["choices"][0]["text"], " t0 t1 t2 t3 t4");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    wait_for("the engine's count", || {
        stats(&engines[worker_a - 1])["completed"] == 1
    });

    // Its engine's BlockStored event reaches the router over ZMQ: 4 blocks on that worker.
    wait_for("the engine's KV event", || {
        metrics(&gw).1.get("kvrouter_index_blocks") == Some(&4.0)
    });
    wait_idle(&gw);

    // The prompt extended goes where its prefix is cached, streamed.
    let mut longer = a.clone();
    longer.extend(prompt(2, 2));
    let second = completion(&gw, &longer, 3, true);
    assert_eq!(second.status, 200);
    assert_eq!(second.header("content-type"), "text/event-stream");
    assert_eq!(second.header("x-kvrouter-worker"), worker_a.to_string());
    assert_eq!(second.header("x-kvrouter-cached-tokens"), "64");
    let events: Vec<&str> = second
        .body
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .collect();
    assert_eq!(events.len(), 4, "{}", second.body);
    assert_eq!(events[3], "data: [DONE]");
    let token: Value = serde_json::from_str(events[0].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(token["choices"][0]["text"], " t0");

    // Another prompt while the first worker is busy streaming a long request: the other one
    // takes it (the load counts), and then holds its prefix. The gateway frees a request after
    // its last byte is out, so the client can see [DONE] before the booking is gone: on a loaded
    // machine the previous request, still booked, once sent both new ones to the same worker.
    wait_idle(&gw);
    let busy = send(
        &gw,
        "POST",
        "/v1/completions",
        &json!({"prompt": prompt(3, 4), "max_tokens": 400, "stream": true}).to_string(),
    );
    let mut busy = BufReader::new(busy);
    let (status, headers) = http::read_response_head(&mut busy).unwrap();
    assert_eq!(status, 200);
    let busy_worker: usize = http::header(&headers, "x-kvrouter-worker")
        .unwrap()
        .parse()
        .unwrap();
    let mut line = String::new();
    busy.read_line(&mut line).unwrap(); // its first token is out
    assert!(line.starts_with("data: "), "{line:?}");
    let b = prompt(4, 3);
    let third = completion(&gw, &b, 2, false);
    let worker_b: usize = third.header("x-kvrouter-worker").parse().unwrap();
    assert_ne!(worker_b, busy_worker, "routed onto the busy worker");
    wait_for("the second engine's event", || {
        metrics(&gw).1.get("kvrouter_index_blocks") >= Some(&(4.0 + 2.0 + 4.0 + 3.0))
    });

    // Meanwhile the long request is booked: one active request, its prefill done (the first
    // token is out), its blocks counted on its worker.
    wait_for("the third request freed", || {
        metric(&gw, "kvrouter_requests_active") == 1.0
    });
    let (_, series) = metrics(&gw);
    let rank = |w: usize| format!("{{worker_id=\"{w}\",dp_rank=\"0\"}}");
    assert_eq!(
        series[&format!("kvrouter_worker_active_prefill_tokens{}", rank(busy_worker))],
        0.0
    );
    assert!(series[&format!("kvrouter_worker_active_decode_blocks{}", rank(busy_worker))] > 0.0);

    // The client leaves mid-stream: the request is freed, the engine sees it cancelled.
    drop(busy);
    wait_for("the streaming request freed", || {
        metric(&gw, "kvrouter_requests_active") == 0.0
    });
    wait_for("the engine to see the cancellation", || {
        stats(&engines[busy_worker - 1])["cancelled"] == 1
    });
    wait_idle(&gw);
    assert_eq!(metric(&gw, "kvrouter_gateway_disconnects_total"), 1.0);

    // A prompt with B's prefix goes to B's worker.
    let mut b_longer = b.clone();
    b_longer.extend(prompt(5, 1));
    let fourth = completion(&gw, &b_longer, 2, false);
    assert_eq!(fourth.header("x-kvrouter-worker"), worker_b.to_string());
    assert_eq!(fourth.header("x-kvrouter-cached-tokens"), "48");
    // (Its booking may outlive its response by a moment, as above: counted below otherwise.)
    wait_idle(&gw);

    // A client waiting for a whole (not streamed) response leaves too: freed as well.
    let waiting = send(
        &gw,
        "POST",
        "/v1/completions",
        &json!({"prompt": prompt(6, 2), "max_tokens": 400}).to_string(),
    );
    wait_for("the request at its engine", || {
        let at_engines: u64 = engines
            .iter()
            .map(|e| stats(e)["requests"].as_u64().unwrap())
            .sum();
        at_engines == 6
    });
    assert_eq!(metric(&gw, "kvrouter_requests_active"), 1.0);
    drop(waiting);
    wait_for("the waiting request freed", || {
        metric(&gw, "kvrouter_requests_active") == 0.0
    });
    wait_idle(&gw);
    wait_for("the second disconnect counted", || {
        metric(&gw, "kvrouter_gateway_disconnects_total") == 2.0
    });

    // Bad requests.
    let bad = request(&gw, "POST", "/v1/completions", "{\"prompt\": \"text\"}");
    assert_eq!(bad.status, 400);
    assert!(bad.body.contains("token ids"), "{}", bad.body);
    assert_eq!(request(&gw, "GET", "/nowhere", "").status, 404);

    // /metrics: the router's families, the ingest's per engine, the gateway's counters
    // (counted once a request is answered).
    wait_for("the completions counted, the last event applied", || {
        let (_, series) = metrics(&gw);
        series["kvrouter_gateway_completed_total"] == 4.0
            && series["kvrouter_kv_events_total{kind=\"stored\",outcome=\"ok\"}"] == 6.0
    });
    let (text, series) = metrics(&gw);
    for header in [
        "# TYPE kvrouter_decisions_total counter",
        "# TYPE kvrouter_decision_duration_seconds histogram",
        "# TYPE kvrouter_ingest_events_applied_total counter",
        "# TYPE kvrouter_ingest_lag_seconds summary",
        "# TYPE kvrouter_gateway_requests_total counter",
    ] {
        assert!(text.contains(header), "no {header:?} in\n{text}");
    }
    assert_eq!(series["kvrouter_decisions_total"], 6.0, "{text}");
    // The library times one routing call in 16, the first included: 1 of the 6.
    assert_eq!(
        series["kvrouter_decision_duration_seconds_count"], 1.0,
        "{text}"
    );
    assert_eq!(series["kvrouter_gateway_requests_total"], 6.0, "{text}");
    assert_eq!(series["kvrouter_gateway_completed_total"], 4.0, "{text}");
    assert_eq!(series["kvrouter_gateway_disconnects_total"], 2.0, "{text}");
    assert_eq!(
        series["kvrouter_gateway_engine_errors_total"], 0.0,
        "{text}"
    );
    assert!(
        series["kvrouter_gateway_first_token_seconds_total"] > 0.0,
        "{text}"
    );
    assert_eq!(series["kvrouter_workers"], 2.0);
    let stored_ok = "kvrouter_kv_events_total{kind=\"stored\",outcome=\"ok\"}";
    assert_eq!(series[stored_ok], 6.0, "{text}");
    // Each engine's ZMQ source: the messages it published, every event applied.
    for (i, engine) in engines.iter().enumerate() {
        let labels = format!(
            "{{source_id=\"{}\",kind=\"engine\",endpoint=\"{}\"}}",
            i + 1,
            engine.ready["zmq"].as_str().unwrap()
        );
        let published = stats(engine)["requests"].as_f64().unwrap();
        let key = format!("kvrouter_ingest_messages_total{labels}");
        assert_eq!(series.get(&key), Some(&published), "{key} in\n{text}");
        let key = format!("kvrouter_ingest_events_applied_total{labels}");
        assert_eq!(series.get(&key), Some(&published), "{key} in\n{text}");
        let key = format!("kvrouter_ingest_gaps_total{labels}");
        assert_eq!(series.get(&key), Some(&0.0), "{key} in\n{text}");
    }
}
