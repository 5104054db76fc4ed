//! A ZeroMQ PUB socket bound on TCP, written against the wire protocol (ZMTP 3.0, RFC 23, with
//! the NULL mechanism) so that the fake engine publishes its KV events as vLLM does without a
//! ZeroMQ library: libzmq's SUB sockets (the gateway's ingest) connect to it like to pyzmq's.
//!
//! Each subscriber connection gets the greeting and a READY command (`Socket-Type: PUB`), reads
//! the peer's, then counts as subscribed once it has sent a subscription (a message whose first
//! byte is 1 in ZMTP 3.0, a `SUBSCRIBE` command in 3.1). Every message goes to every
//! subscriber whatever its topic: the subscribers here take every topic; a PUB filtering by
//! prefix would compare it with the subscriptions. A subscriber whose connection fails is
//! dropped, as a PUB drops what it cannot deliver.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

/// A bound PUB socket.
pub struct Publisher {
    endpoint: String,
    subscribers: Arc<Mutex<Vec<TcpStream>>>,
    /// vLLM numbers its messages per publisher from 0.
    seq: AtomicU64,
}

impl Publisher {
    /// Binds `addr` (e.g. `127.0.0.1:0`) and accepts subscribers on a thread of its own.
    pub fn bind(addr: &str) -> io::Result<Publisher> {
        let listener = TcpListener::bind(addr)?;
        let endpoint = format!("tcp://{}", listener.local_addr()?);
        let subscribers = Arc::new(Mutex::new(Vec::new()));
        let list = subscribers.clone();
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let list = list.clone();
                thread::spawn(move || {
                    let _ = serve(stream, &list);
                });
            }
        });
        Ok(Publisher {
            endpoint,
            subscribers,
            seq: AtomicU64::new(0),
        })
    }

    /// `tcp://HOST:PORT`, the real port when bound to port 0.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Connections that have subscribed.
    pub fn subscribers(&self) -> usize {
        self.subscribers.lock().unwrap().len()
    }

    /// Sends `[topic, seq (8 bytes big-endian), payload]`, vLLM's message, to every subscriber;
    /// returns the sequence number used.
    pub fn send(&self, topic: &[u8], payload: &[u8]) -> u64 {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let mut message = Vec::with_capacity(payload.len() + topic.len() + 32);
        frame(&mut message, FLAG_MORE, topic);
        frame(&mut message, FLAG_MORE, &seq.to_be_bytes());
        frame(&mut message, 0, payload);
        let mut subscribers = self.subscribers.lock().unwrap();
        subscribers.retain_mut(|s| s.write_all(&message).is_ok());
        seq
    }
}

/// Appends one frame: flags, size (1 byte, or 8 with FLAG_LONG), body.
fn frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    if body.len() > 255 {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// Reads one frame: (flags, body).
fn read_frame(r: &mut impl Read) -> io::Result<(u8, Vec<u8>)> {
    let mut flags = [0u8; 1];
    r.read_exact(&mut flags)?;
    let size = if flags[0] & FLAG_LONG != 0 {
        let mut size = [0u8; 8];
        r.read_exact(&mut size)?;
        u64::from_be_bytes(size)
    } else {
        let mut size = [0u8; 1];
        r.read_exact(&mut size)?;
        u64::from(size[0])
    };
    if size > 1 << 20 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "frame too large",
        ));
    }
    let mut body = vec![0; size as usize];
    r.read_exact(&mut body)?;
    Ok((flags[0], body))
}

/// A command frame's name (`READY`, `SUBSCRIBE`, ...).
fn command_name(body: &[u8]) -> &[u8] {
    let len = body.first().copied().unwrap_or(0) as usize;
    body.get(1..1 + len).unwrap_or(&[])
}

/// One subscriber connection: the handshake, then its subscriptions until it goes away.
fn serve(mut stream: TcpStream, subscribers: &Mutex<Vec<TcpStream>>) -> io::Result<()> {
    stream.set_nodelay(true)?;
    // Greeting: signature, version 3.0, mechanism NULL, as-server 0, filler: 64 bytes.
    let mut greeting = [0u8; 64];
    greeting[0] = 0xff;
    greeting[8] = 0x01;
    greeting[9] = 0x7f;
    greeting[10] = 3;
    greeting[11] = 0;
    greeting[12..16].copy_from_slice(b"NULL");
    stream.write_all(&greeting)?;
    let mut peer = [0u8; 64];
    stream.read_exact(&mut peer)?;
    if peer[0] != 0xff || peer[9] != 0x7f || peer[10] < 3 || &peer[12..16] != b"NULL" {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a ZMTP 3 NULL peer",
        ));
    }
    // READY with our socket type.
    let mut ready = vec![5];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&3u32.to_be_bytes());
    ready.extend_from_slice(b"PUB");
    let mut out = Vec::new();
    frame(&mut out, FLAG_COMMAND, &ready);
    stream.write_all(&out)?;

    let mut subscribed = false;
    loop {
        let (flags, body) = read_frame(&mut stream)?;
        let subscription = if flags & FLAG_COMMAND != 0 {
            command_name(&body) == b"SUBSCRIBE" // ZMTP 3.1; READY, PING and others: nothing
        } else {
            body.first() == Some(&1) // ZMTP 3.0: a message [1, topic...]
        };
        if subscription && !subscribed {
            subscribed = true;
            subscribers.lock().unwrap().push(stream.try_clone()?);
        }
    }
}
