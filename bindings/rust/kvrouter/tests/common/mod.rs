//! What the integration tests share: routers with workers, prompts, stored events, polling.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use kvrouter::{Router, RouterOptions, StoredEvent, WorkerConfig};

pub const BS: u32 = 16;

/// A router of block size 16 with workers `1..=workers` (seeded: deterministic tie-breaks).
pub fn router(workers: u64) -> Router {
    let router = Router::new(&RouterOptions {
        random_seed: 7,
        ..RouterOptions::with_block_size(BS)
    })
    .unwrap();
    for id in 1..=workers {
        router.add_worker(&WorkerConfig::new(id)).unwrap();
    }
    router
}

/// `blocks` full blocks of distinct tokens starting at `seed`.
pub fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks as u32 * BS))
        .map(|i| seed.wrapping_mul(7919).wrapping_add(i))
        .collect()
}

/// Engine hashes `first..first + n`.
pub fn engine_hashes(first: u64, n: usize) -> Vec<u64> {
    (first..first + n as u64).collect()
}

/// Worker `worker` caches the first `blocks` blocks of `tokens` (engine hashes from `first`).
pub fn store(router: &kvrouter::RouterRef, worker: u64, tokens: &[u32], blocks: usize, first: u64) {
    let hashes = engine_hashes(first, blocks);
    router
        .apply_stored(&StoredEvent {
            worker_id: worker,
            event_id: first,
            block_hashes: &hashes,
            token_ids: &tokens[..blocks * BS as usize],
            ..Default::default()
        })
        .unwrap();
}

/// Polls `f` every millisecond until it returns Some, for at most 10 s.
pub fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Held while a probe listener is open (`free_port`) and while a child process is started: a
/// fork in another test thread would otherwise copy the listener into the child until its exec.
static FORK_GUARD: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn fork_guard() -> std::sync::MutexGuard<'static, ()> {
    FORK_GUARD.lock().unwrap_or_else(|e| e.into_inner())
}

/// A TCP port nothing listens on (at the time): bound, read, and released.
pub fn free_port() -> u16 {
    let _guard = fork_guard();
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether this process is the child `run_in_child(test)` started to run `test`.
pub fn in_child(test: &str) -> bool {
    std::env::var("KVR_TEST_CHILD").is_ok_and(|t| t == test)
}

/// How a child process ended: its exit status (None: killed after its deadline) and its
/// stdout and stderr.
#[derive(Debug)]
pub struct ChildRun {
    pub status: Option<std::process::ExitStatus>,
    pub output: String,
}

impl ChildRun {
    /// Asserts that the child exited with status 0 before its deadline.
    pub fn assert_success(&self, what: &str) {
        match self.status {
            None => panic!(
                "{what}: the child hung (killed after its deadline)\n{}",
                self.output
            ),
            Some(s) if !s.success() => panic!("{what}: the child failed ({s})\n{}", self.output),
            Some(_) => {}
        }
    }
}

/// Runs the test `test` of this test binary again, alone, in a child process (where
/// `in_child(test)` is true), for a scenario that could abort or hang the process: a failure
/// then fails this test instead of the whole binary. The child is killed after `deadline`.
pub fn run_in_child(test: &str, deadline: Duration) -> ChildRun {
    run_in_child_with(test, deadline, &[])
}

/// The environment variable in which `run_in_child_with` passes a child the url of the
/// nats-server its parent started (`child_nats_url`).
pub const CHILD_NATS_URL: &str = "KVR_TEST_NATS_URL";

/// In a child of `run_in_child_with(.., &[(CHILD_NATS_URL, url)])`: the parent's nats-server.
/// A child killed after its deadline runs no `Drop`: a server it started itself would outlive
/// it, so the parent starts it and kills it.
pub fn child_nats_url() -> String {
    std::env::var(CHILD_NATS_URL).expect("the parent passes its nats-server's url")
}

/// As `run_in_child`, with `env` set in the child's environment.
pub fn run_in_child_with(test: &str, deadline: Duration, env: &[(&str, &str)]) -> ChildRun {
    use std::io::Read;
    let mut child = {
        let _guard = fork_guard();
        Command::new(std::env::current_exe().unwrap())
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env("KVR_TEST_CHILD", test)
            .env("RUST_BACKTRACE", "0")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let pipes = [
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    ];
    let readers: Vec<_> = pipes
        .into_iter()
        .flatten()
        .map(|mut pipe| {
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = pipe.read_to_string(&mut text);
                text
            })
        })
        .collect();
    let end = Instant::now() + deadline;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let output = readers
        .into_iter()
        .map(|r| r.join().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n--- stderr ---\n");
    ChildRun { status, output }
}

/// A nats-server on 127.0.0.1, killed on drop.
pub struct NatsServer {
    child: Child,
    pub port: u16,
    /// JetStream's store, when on (removed after the server is killed: fields drop after
    /// Drop::drop).
    _store: Option<TempDir>,
    /// The directory of its configuration file, when it has one.
    _config: Option<TempDir>,
}

impl NatsServer {
    pub fn start() -> Option<NatsServer> {
        NatsServer::start_with(false)
    }

    /// With `jetstream`: JetStream on, its store in a temporary directory.
    pub fn start_with(jetstream: bool) -> Option<NatsServer> {
        NatsServer::start_configured(jetstream, None)
    }

    /// As `start_with`, and with `config` (a configuration file's text, e.g.
    /// `"max_payload: 4096\n"`) when given, written into a temporary directory and passed with
    /// `-c`.
    pub fn start_configured(jetstream: bool, config: Option<&str>) -> Option<NatsServer> {
        let binary = [
            "nats-server",
            "/usr/sbin/nats-server",
            "/usr/bin/nats-server",
        ]
        .into_iter()
        .find(|b| {
            let _guard = fork_guard();
            Command::new(b).arg("--version").output().is_ok()
        })?;
        let port = free_port();
        let store = jetstream.then(TempDir::new);
        let config_dir = config.map(|text| {
            let dir = TempDir::new();
            std::fs::write(dir.0.join("nats.conf"), text).unwrap();
            dir
        });
        let child = {
            let _guard = fork_guard();
            let mut command = Command::new(binary);
            command.args(["-a", "127.0.0.1", "-p", &port.to_string()]);
            if let Some(store) = &store {
                command.arg("-js").arg("-sd").arg(&store.0);
            }
            if let Some(dir) = &config_dir {
                command.arg("-c").arg(dir.0.join("nats.conf"));
            }
            command
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .ok()?
        };
        let server = NatsServer {
            child,
            port,
            _store: store,
            _config: config_dir,
        };
        wait_for("nats-server to accept connections", || {
            TcpStream::connect(("127.0.0.1", port)).ok()
        });
        Some(server)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Publishes raw payloads with the NATS text protocol (no client library), then waits for
    /// the server's PONG, so they have been routed to subscribers.
    pub fn publish(&self, messages: &[(&str, &[u8])]) {
        let stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        assert!(line.starts_with("INFO "), "{line}");
        let mut out = stream;
        out.write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false}\r\n")
            .unwrap();
        for (subject, payload) in messages {
            out.write_all(format!("PUB {subject} {}\r\n", payload.len()).as_bytes())
                .unwrap();
            out.write_all(payload).unwrap();
            out.write_all(b"\r\n").unwrap();
        }
        out.write_all(b"PING\r\n").unwrap();
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            assert!(!line.starts_with("-ERR"), "{line}");
            if line.starts_with("PONG") {
                break;
            }
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvr-rust-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Says on stderr (past the harness's capture) that `test` was skipped for want of nats-server.
pub fn skipped_without_nats(test: &str) {
    let _ = writeln!(std::io::stderr(), "{test}: skipped, no nats-server");
}
