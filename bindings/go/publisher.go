//go:build cgo

package kvrouter

/*
#include "kvrouter.h"
*/
import "C"

import "runtime"

// Publisher is a blocking client connection to a kvrouter stream listener (Ingest.Listen),
// for engines written in Go. A Publisher is not safe for concurrent use: give each goroutine
// its own, or serialise the calls.
type Publisher struct {
	ptr *C.kvr_publisher
}

// ConnectPublisher connects to "tcp://HOST:PORT" or "unix://PATH". ErrUnavailable if the
// connection fails.
func ConnectPublisher(endpoint string) (*Publisher, error) {
	if err := CheckVersion(); err != nil {
		return nil, err
	}
	var a args
	defer a.release()
	ep := a.str("endpoint", endpoint)
	if err := a.err(); err != nil {
		return nil, err
	}
	var out *C.kvr_publisher
	var cerr *C.kvr_error
	if err := takeError(C.kvr_publisher_connect(ep, &out, &cerr), cerr); err != nil {
		return nil, err
	}
	p := &Publisher{ptr: out}
	runtime.SetFinalizer(p, (*Publisher).Close)
	return p, nil
}

// Close closes the connection; idempotent. Always returns nil.
func (p *Publisher) Close() error {
	if p == nil || p.ptr == nil {
		return nil
	}
	runtime.SetFinalizer(p, nil)
	C.kvr_publisher_free(p.ptr)
	p.ptr = nil
	return nil
}

// Send encodes the batch's events and sends them as one frame (the batch keeps its events).
// ErrUnavailable if the connection is lost.
func (p *Publisher) Send(b *EventBatch) error {
	if p == nil || p.ptr == nil || b == nil || b.ptr == nil {
		return ErrClosed
	}
	var cerr *C.kvr_error
	st := C.kvr_publisher_send(p.ptr, b.ptr, &cerr)
	runtime.KeepAlive(p)
	runtime.KeepAlive(b)
	return takeError(st, cerr)
}

// SendEncoded sends an already encoded EventBatch as one frame (the length header is added).
func (p *Publisher) SendEncoded(batch []byte) error {
	if p == nil || p.ptr == nil {
		return ErrClosed
	}
	data, n := bytesPtr(batch)
	var cerr *C.kvr_error
	st := C.kvr_publisher_send_encoded(p.ptr, data, n, &cerr)
	runtime.KeepAlive(p)
	runtime.KeepAlive(batch)
	return takeError(st, cerr)
}
