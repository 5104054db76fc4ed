//! What the integration tests share: routers with workers, prompts, stored events, polling.
#![allow(dead_code)]

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
    use std::process::{Command, Stdio};
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

/// A nats-server on 127.0.0.1 (a free port), killed on drop.
pub struct NatsServer {
    child: std::process::Child,
    pub port: u16,
}

impl NatsServer {
    /// None when no nats-server is installed (the caller skips, saying so on stderr).
    pub fn start() -> Option<NatsServer> {
        use std::process::{Command, Stdio};
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
        let child = {
            let _guard = fork_guard();
            Command::new(binary)
                .args(["-a", "127.0.0.1", "-p", &port.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .ok()?
        };
        let server = NatsServer { child, port };
        wait_for("nats-server to accept connections", || {
            std::net::TcpStream::connect(("127.0.0.1", port)).ok()
        });
        Some(server)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Says on stderr (past the harness's capture) that `test` was skipped for want of nats-server.
pub fn skipped_without_nats(test: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{test}: skipped, no nats-server");
}
