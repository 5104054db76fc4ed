package picker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// streamState follows one HTTP request through its ext_proc stream.
//
// Request side: the routing decision needs the whole body, and Envoy must still hold the
// request headers when the answer comes, so the destination is set by whichever response Envoy
// waits for last:
//   - BUFFERED (and STREAMED/BUFFERED_PARTIAL when the body comes whole): the headers are
//     answered at once, chunks are acknowledged, and the answer to the last chunk carries
//     the header mutation.
//   - FULL_DUPLEX_STREAMED: nothing is answered until the body has ended; then the headers
//     answer carries the mutation, and the whole body goes back in one streamed response.
//
// Response side: the first body chunk (or headers that end the response) marks the prefill
// completed, the end of the body frees the booking; a stream that ends first frees it too.
type streamState struct {
	s      *Server
	ctx    context.Context
	send   func(*extprocv3.ProcessingResponse) error
	log    *slog.Logger
	duplex struct{ request, response bool }

	requestID   string
	generatedID string // the id the picker made up, when the request had no x-request-id
	subset      []string
	hasSubset   bool
	body        []byte
	bodyDone    bool

	owned       bool // this stream booked the request in kvrouterd: it must free it
	prefillSent bool
	freed       bool
	finished    bool // an immediate response was sent
}

func newStreamState(s *Server, stream extprocv3.ExternalProcessor_ProcessServer) *streamState {
	return &streamState{s: s, ctx: stream.Context(), send: stream.Send, log: s.log}
}

func (st *streamState) handle(req *extprocv3.ProcessingRequest) error {
	if pc := req.GetProtocolConfig(); pc != nil { // sent with the first message only
		st.duplex.request = pc.GetRequestBodyMode() == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
		st.duplex.response = pc.GetResponseBodyMode() == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	}
	if !st.hasSubset {
		st.subset, st.hasSubset = subsetHint(req.GetMetadataContext())
	}
	switch r := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return st.onRequestHeaders(r.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		return st.onRequestBody(r.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return st.onRequestTrailers()
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return st.onResponseHeaders(r.ResponseHeaders)
	case *extprocv3.ProcessingRequest_ResponseBody:
		return st.onResponseBody(r.ResponseBody)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return st.onResponseTrailers()
	}
	return nil // flow-control window updates and future messages: nothing to answer
}

func (st *streamState) onRequestHeaders(h *extprocv3.HttpHeaders) error {
	st.requestID = headerValue(h, RequestIDHeader)
	if st.requestID == "" {
		st.requestID = newRequestID()
		st.generatedID = st.requestID
	}
	st.log = st.s.log.With("request_id", st.requestID)
	if h.GetEndOfStream() {
		return st.reject(400, "the request has no body: the picker routes completion requests by their prompt's token ids")
	}
	if st.duplex.request {
		return nil // held until the body has ended: the answer carries the destination
	}
	return st.send(requestHeadersContinue())
}

func (st *streamState) onRequestBody(b *extprocv3.HttpBody) error {
	if st.bodyDone {
		return st.send(bodyContinue(false, b, st.duplex.request))
	}
	if len(st.body)+len(b.GetBody()) > st.s.cfg.MaxBodyBytes {
		return st.reject(413, fmt.Sprintf("the request body is larger than %d bytes", st.s.cfg.MaxBodyBytes))
	}
	st.body = append(st.body, b.GetBody()...)
	if b.GetEndOfStream() {
		return st.finishRequestBody(true)
	}
	if st.duplex.request {
		return nil // kept, and sent back whole once routed
	}
	return st.send(bodyContinue(false, b, false))
}

// onRequestTrailers ends a body that did not say end of stream itself. Only full-duplex mode
// can still route then: in the other modes the chunks were already let through.
func (st *streamState) onRequestTrailers() error {
	if !st.bodyDone {
		if !st.duplex.request {
			return st.reject(400, "the request body did not end before its trailers; use request_body_mode BUFFERED or FULL_DUPLEX_STREAMED")
		}
		if err := st.finishRequestBody(false); err != nil || st.finished {
			return err
		}
	}
	return st.send(trailersContinue(false))
}

// finishRequestBody routes the request and tells Envoy where it goes.
func (st *streamState) finishRequestBody(endOfStream bool) error {
	st.bodyDone = true
	address, status, message := st.route()
	if status != 0 {
		return st.reject(status, message)
	}
	mutation := &extprocv3.CommonResponse{HeaderMutation: destinationMutation(address, st.generatedID)}
	metadata := destinationMetadata(address)
	if !st.duplex.request {
		st.body = nil
		return st.send(&extprocv3.ProcessingResponse{
			Response: &extprocv3.ProcessingResponse_RequestBody{
				RequestBody: &extprocv3.BodyResponse{Response: mutation},
			},
			DynamicMetadata: metadata,
		})
	}
	err := st.send(&extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{Response: mutation},
		},
		DynamicMetadata: metadata,
	})
	if err != nil {
		return err
	}
	body := st.body
	st.body = nil
	return st.sendBodyBack(body, endOfStream)
}

// duplexChunkBytes bounds the body chunks sent back in full-duplex mode: Envoy recommends at
// most 64 KiB per streamed response (its gRPC client's message limit may be no larger).
const duplexChunkBytes = 64 << 10

// sendBodyBack returns the held request body to Envoy in full-duplex mode, which forwards
// upstream only what the processor sends back.
func (st *streamState) sendBodyBack(body []byte, endOfStream bool) error {
	for {
		n := min(len(body), duplexChunkBytes)
		last := n == len(body)
		err := st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
				BodyMutation: streamedBody(body[:n], last && endOfStream),
			}},
		}})
		if err != nil || last {
			return err
		}
		body = body[n:]
	}
}

// route asks kvrouterd for the request's worker. It returns the worker's address, or an HTTP
// status and message to answer the client with.
func (st *streamState) route() (address string, status int, message string) {
	tokens, model, err := parseCompletion(st.body)
	if err != nil {
		return "", 400, err.Error()
	}
	// Not the stream's context: once kvrouterd has booked, the decision must reach this stream
	// so that release frees it, even when the client has gone meanwhile.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(st.ctx), st.s.cfg.RouteTimeout)
	defer cancel()
	req := &RouteRequest{
		RequestID: st.requestID,
		TokenIDs:  tokens,
		// kvrouterd gives up queueing before the picker gives up waiting for it.
		QueueTimeoutMs: (st.s.cfg.RouteTimeout * 9 / 10).Milliseconds(),
	}
	if st.s.cfg.ModelAsLora {
		req.LoraName = model
	}
	if st.hasSubset {
		ids, err := st.s.book.workerIDs(ctx, st.subset)
		if err != nil {
			return "", routeFailureStatus(err), fmt.Sprintf("cannot list kvrouterd's workers: %v", err)
		}
		if len(ids) == 0 {
			return "", 503, fmt.Sprintf("no worker of kvrouterd has an address in the proxy's subset %q", st.subset)
		}
		req.AllowedWorkerIDs = ids
	}
	start := time.Now()
	d, err := st.s.client.Route(ctx, req)
	if err != nil {
		st.log.Warn("route failed", "error", err, "duration", time.Since(start))
		if errors.Is(err, context.DeadlineExceeded) {
			// The route may still be booked after the answer was given up on: undo it.
			st.call("free after a timed-out route", st.s.client.Free)
		}
		return "", routeFailureStatus(err), err.Error()
	}
	// A replayed decision belongs to another stream with the same x-request-id: that stream
	// frees the booking, this one must not free it under it.
	st.owned = d.Booked && !d.Replayed
	st.log.Info("routed", "worker_id", d.WorkerID, "dp_rank", d.DPRank, "address", d.Address,
		"prompt_tokens", d.PromptTokens, "cached_tokens", d.CachedTokens, "queued", d.Queued,
		"replayed", d.Replayed, "duration", time.Since(start))
	if d.Address == nil || *d.Address == "" {
		st.free() // the request cannot go anywhere: its booking must not linger
		return "", 503, fmt.Sprintf("kvrouterd picked worker %d, which has no address configured", d.WorkerID)
	}
	return *d.Address, 0, ""
}

// routeFailureStatus maps a failed kvrouterd call to the client's status: kvrouterd's own
// 400, 429 (shed), 503 (no eligible worker) and 504 (queue timeout) pass through; a picker-side
// timeout is 504; anything else (unreachable, 5xx) is 503, no endpoint.
func routeFailureStatus(err error) int {
	switch status := httpStatusOf(err); status {
	case 400, 429, 503, 504:
		return status
	case 0:
		if errors.Is(err, context.DeadlineExceeded) {
			return 504
		}
	}
	return 503
}

func (st *streamState) onResponseHeaders(h *extprocv3.HttpHeaders) error {
	if err := st.send(responseHeadersContinue()); err != nil {
		return err
	}
	if h.GetEndOfStream() { // a response without a body
		st.prefillCompleted()
		st.free()
	}
	return nil
}

func (st *streamState) onResponseBody(b *extprocv3.HttpBody) error {
	if err := st.send(bodyContinue(true, b, st.duplex.response)); err != nil {
		return err
	}
	st.prefillCompleted()
	if b.GetEndOfStream() {
		st.free()
	}
	return nil
}

func (st *streamState) onResponseTrailers() error {
	if err := st.send(trailersContinue(true)); err != nil {
		return err
	}
	st.prefillCompleted()
	st.free()
	return nil
}

// reject ends the HTTP request with an immediate response.
func (st *streamState) reject(status int, message string) error {
	st.log.Warn("rejected", "status", status, "message", message)
	st.finished = true
	return st.send(immediate(status, message))
}

func (st *streamState) prefillCompleted() {
	if !st.owned || st.prefillSent || st.freed {
		return
	}
	st.prefillSent = true
	st.call("prefill_completed", st.s.client.PrefillCompleted)
}

func (st *streamState) free() {
	if !st.owned || st.freed {
		return
	}
	st.freed = true
	st.call("free", st.s.client.Free)
}

// release frees a booking the stream still holds when it ends: the client went away, Envoy
// reset the stream, or the response ended unseen (response body mode NONE).
func (st *streamState) release() {
	if st.owned && !st.freed {
		st.log.Info("stream ended before the response: freeing")
		st.free()
	}
}

// call makes a lifecycle call to kvrouterd. Failures are logged, not retried: kvrouterd expires
// bookings it is never told about, and the HTTP request must not fail for them.
func (st *streamState) call(what string, fn func(context.Context, string) error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(st.ctx), st.s.cfg.CallTimeout)
	defer cancel()
	if err := fn(ctx, st.requestID); err != nil {
		st.log.Warn(what+" failed", "error", err)
	}
}

// newRequestID makes an id for a request that came without x-request-id.
func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return "epp-" + hex.EncodeToString(b[:])
}
