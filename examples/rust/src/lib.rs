//! What the gateway example's programs share: a minimal HTTP/1.1 layer over `std::net`
//! ([`http`]), and for the fake engine, vLLM's KV event wire format: msgpack ([`msgpack`]) on a
//! ZeroMQ PUB socket ([`zmtp`]).

pub mod http;
pub mod msgpack;
pub mod zmtp;
