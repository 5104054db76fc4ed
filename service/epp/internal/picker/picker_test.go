package picker_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/kvrouter/kvrouter/service/epp/internal/picker"
)

const completionBody = `{"model": "m", "prompt": [11, 12, 13, 14], "max_tokens": 8}`

// routeBuffered plays a request with a BUFFERED body up to the routing answer, and checks the
// destination it carries.
func routeBuffered(t *testing.T, e *envoy, requestID, body, wantAddress string) {
	t.Helper()
	if resp := e.exchange(requestHeaders(requestID, false)); resp.GetRequestHeaders() == nil {
		t.Fatalf("request headers: got %v, want a headers response", resp)
	}
	resp := e.exchange(requestBody(body, true))
	checkDestination(t, resp, resp.GetRequestBody().GetResponse().GetHeaderMutation(), wantAddress)
}

func checkDestination(t *testing.T, resp *extprocv3.ProcessingResponse, m *extprocv3.HeaderMutation, want string) {
	t.Helper()
	if got := setHeaders(m)[picker.DestinationHeader]; got != want {
		t.Fatalf("header %s = %q, want %q (answer %v)", picker.DestinationHeader, got, want, resp)
	}
	if got := metadataDestination(resp); got != want {
		t.Fatalf("dynamic metadata %s/%s = %q, want %q", picker.DestinationMetadata, picker.DestinationHeader, got, want)
	}
}

// The whole life of a request with a buffered body and a streamed response: routed once with
// the body's token ids, prefill completed at the first response chunk, freed at the last, and
// nothing more when Envoy closes the stream.
func TestBufferedRequestRoutedThenPrefilledThenFreed(t *testing.T) {
	fake := newFakeKvrouterd(t)
	e := openStream(t, startPicker(t, fake.URL, nil))

	routeBuffered(t, e, "req-1", completionBody, "10.0.0.1:8000")
	routes := fake.callsOf("route")
	if len(routes) != 1 || routes[0].ID != "req-1" || !slices.Equal(routes[0].Route.TokenIDs, []uint32{11, 12, 13, 14}) {
		t.Fatalf("route calls = %+v, want one for req-1 with tokens [11 12 13 14]", routes)
	}
	if routes[0].Route.LoraName != "" || routes[0].Route.AllowedWorkerIDs != nil {
		t.Fatalf("route request = %+v: no lora_name (flag off) and no allowed_worker_ids (no subset) expected", routes[0].Route)
	}

	if resp := e.exchange(responseHeaders(false)); resp.GetResponseHeaders() == nil {
		t.Fatalf("response headers: got %v", resp)
	}
	fake.waitOps(t, "route")
	for i, chunk := range []string{"data: a\n\n", "data: b\n\n", "data: [DONE]\n\n"} {
		last := i == 2
		if resp := e.exchange(responseBody(chunk, last)); resp.GetResponseBody() == nil {
			t.Fatalf("response body %d: got %v", i, resp)
		}
		if i == 0 {
			fake.waitOps(t, "route", "prefill")
		}
	}
	fake.waitOps(t, "route", "prefill", "free")
	e.finish()
	fake.waitOps(t, "route", "prefill", "free")
	for _, c := range fake.callsOf("") {
		if c.ID != "req-1" {
			t.Fatalf("call %+v is not for req-1", c)
		}
	}
}

// A body in several chunks, in FULL_DUPLEX_STREAMED mode: nothing is answered until the body
// ends; then the headers answer carries the destination and the body comes back whole.
func TestFullDuplexChunkedBody(t *testing.T) {
	fake := newFakeKvrouterd(t)
	e := openStream(t, startPicker(t, fake.URL, nil))
	duplex := filterv3.ProcessingMode_FULL_DUPLEX_STREAMED

	e.send(withModes(requestHeaders("req-dup", false), duplex, duplex))
	chunks := []string{`{"model": "m", "prompt_tok`, `en_ids": [5, 6`, `, 7]}`}
	for i, c := range chunks {
		e.send(requestBody(c, i == len(chunks)-1))
	}
	headersResp := e.recv()
	if headersResp.GetRequestHeaders() == nil {
		t.Fatalf("first answer: got %v, want the (held) request headers answer", headersResp)
	}
	checkDestination(t, headersResp, headersResp.GetRequestHeaders().GetResponse().GetHeaderMutation(), "10.0.0.1:8000")
	if got := receiveBodyBack(e); got != strings.Join(chunks, "") {
		t.Fatalf("body sent back = %q, want the whole body", got)
	}
	if routes := fake.callsOf("route"); len(routes) != 1 || !slices.Equal(routes[0].Route.TokenIDs, []uint32{5, 6, 7}) {
		t.Fatalf("route calls = %+v, want one with tokens [5 6 7]", routes)
	}

	// The response in full duplex: every chunk is echoed back.
	e.send(responseHeaders(false))
	if resp := e.recv(); resp.GetResponseHeaders() == nil {
		t.Fatalf("response headers: got %v", resp)
	}
	for i, c := range []string{"first", "last"} {
		resp := e.exchange(responseBody(c, i == 1))
		echoed := resp.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if string(echoed.GetBody()) != c || echoed.GetEndOfStream() != (i == 1) {
			t.Fatalf("response chunk %d echoed as %v", i, resp)
		}
	}
	fake.waitOps(t, "route", "prefill", "free")
	e.finish()
}

// Chunks that are answered one by one (STREAMED or BUFFERED_PARTIAL): each is acknowledged,
// the last carries the destination.
func TestAcknowledgedChunksRouteOnTheLast(t *testing.T) {
	fake := newFakeKvrouterd(t)
	e := openStream(t, startPicker(t, fake.URL, nil))

	e.exchange(requestHeaders("req-chunks", false))
	for _, c := range []string{`{"prompt": [[1, `, `2, 3]]`} {
		resp := e.exchange(requestBody(c, false))
		if resp.GetRequestBody() == nil || resp.GetRequestBody().GetResponse().GetHeaderMutation() != nil {
			t.Fatalf("chunk: got %v, want a plain body acknowledgement", resp)
		}
	}
	fake.waitOps(t)
	resp := e.exchange(requestBody(`}`, true))
	checkDestination(t, resp, resp.GetRequestBody().GetResponse().GetHeaderMutation(), "10.0.0.1:8000")
	if routes := fake.callsOf("route"); len(routes) != 1 || !slices.Equal(routes[0].Route.TokenIDs, []uint32{1, 2, 3}) {
		t.Fatalf("route calls = %+v, want one with tokens [1 2 3] (prompt as a batch of one)", routes)
	}
}

// A stream cut (Envoy resets it: the client went away) frees the booking once: mid-response
// after the prefill, and before any response.
func TestCutStreamFreesTheRequest(t *testing.T) {
	for _, tc := range []struct {
		name      string
		responded bool
		want      []string
	}{
		{"mid-response", true, []string{"route", "prefill", "free"}},
		{"before the response", false, []string{"route", "free"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fake := newFakeKvrouterd(t)
			e := openStream(t, startPicker(t, fake.URL, nil))
			routeBuffered(t, e, "req-cut", completionBody, "10.0.0.1:8000")
			if tc.responded {
				e.exchange(responseHeaders(false))
				e.exchange(responseBody("data: a\n\n", false))
			}
			e.cancel()
			fake.waitOps(t, tc.want...)
			if frees := fake.callsOf("free"); frees[0].ID != "req-cut" {
				t.Fatalf("freed %q, want req-cut", frees[0].ID)
			}
		})
	}
}

// A response without a body: its headers mark the prefill completed and free the request.
func TestBodilessResponse(t *testing.T) {
	fake := newFakeKvrouterd(t)
	e := openStream(t, startPicker(t, fake.URL, nil))
	routeBuffered(t, e, "req-204", completionBody, "10.0.0.1:8000")
	e.exchange(responseHeaders(true))
	fake.waitOps(t, "route", "prefill", "free")
	e.finish()
	fake.waitOps(t, "route", "prefill", "free")
}

// kvrouterd's refusals become Envoy immediate responses; nothing is booked, so nothing is freed.
func TestKvrouterdErrorsBecomeImmediateResponses(t *testing.T) {
	for _, tc := range []struct{ kvrouterd, want int }{
		{503, 503}, // no eligible worker
		{429, 429}, // shed
		{504, 504}, // the admission queue timed out
		{500, 503},
	} {
		t.Run(fmt.Sprint(tc.kvrouterd), func(t *testing.T) {
			fake := newFakeKvrouterd(t)
			fake.set(func(f *fakeKvrouterd) { f.routeStatus = tc.kvrouterd })
			e := openStream(t, startPicker(t, fake.URL, nil))
			e.exchange(requestHeaders("req-err", false))
			resp := e.exchange(requestBody(completionBody, true))
			if got := immediateStatus(resp); got != tc.want {
				t.Fatalf("kvrouterd %d: immediate status %d, want %d (%v)", tc.kvrouterd, got, tc.want, resp)
			}
			if !strings.Contains(string(resp.GetImmediateResponse().GetBody()), fmt.Sprintf("fake says %d", tc.kvrouterd)) {
				t.Fatalf("immediate body %q does not carry kvrouterd's message", resp.GetImmediateResponse().GetBody())
			}
			e.finish()
			fake.waitOps(t, "route")
		})
	}
}

func TestUnreachableKvrouterdIs503(t *testing.T) {
	fake := newFakeKvrouterd(t)
	url := fake.URL
	fake.Close() // nothing listens there now
	e := openStream(t, startPicker(t, url, nil))
	e.exchange(requestHeaders("req-down", false))
	if resp := e.exchange(requestBody(completionBody, true)); immediateStatus(resp) != 503 {
		t.Fatalf("got %v, want an immediate 503", resp)
	}
}

// A decision without an address cannot be followed: 503, and the booking is freed at once.
func TestDecisionWithoutAddressIs503AndFreed(t *testing.T) {
	fake := newFakeKvrouterd(t)
	fake.set(func(f *fakeKvrouterd) { f.noAddress = true })
	e := openStream(t, startPicker(t, fake.URL, nil))
	e.exchange(requestHeaders("req-noaddr", false))
	resp := e.exchange(requestBody(completionBody, true))
	if immediateStatus(resp) != 503 || !strings.Contains(string(resp.GetImmediateResponse().GetBody()), "no address") {
		t.Fatalf("got %v, want an immediate 503 saying the worker has no address", resp)
	}
	e.finish()
	fake.waitOps(t, "route", "free")
}

// Bodies the picker cannot route get 400, and kvrouterd is not asked.
func TestBadBodiesAre400WithoutRoute(t *testing.T) {
	for name, body := range map[string]string{
		"not json":        `prompt=1,2,3`,
		"text prompt":     `{"prompt": "hello"}`,
		"no prompt":       `{"model": "m"}`,
		"empty prompt":    `{"prompt": []}`,
		"negative id":     `{"prompt": [1, -2]}`,
		"fractional id":   `{"prompt": [1.5]}`,
		"batch of two":    `{"prompt": [[1], [2]]}`,
		"ids not numbers": `{"prompt_token_ids": ["1"]}`,
	} {
		t.Run(name, func(t *testing.T) {
			fake := newFakeKvrouterd(t)
			e := openStream(t, startPicker(t, fake.URL, nil))
			e.exchange(requestHeaders("req-bad", false))
			if resp := e.exchange(requestBody(body, true)); immediateStatus(resp) != 400 {
				t.Fatalf("body %s: got %v, want an immediate 400", body, resp)
			}
			fake.waitOps(t)
		})
	}
}

func TestBodilessRequestIs400(t *testing.T) {
	fake := newFakeKvrouterd(t)
	e := openStream(t, startPicker(t, fake.URL, nil))
	if resp := e.exchange(requestHeaders("req-get", true)); immediateStatus(resp) != 400 {
		t.Fatalf("got %v, want an immediate 400", resp)
	}
	fake.waitOps(t)
}

func TestOversizedBodyIs413(t *testing.T) {
	fake := newFakeKvrouterd(t)
	e := openStream(t, startPicker(t, fake.URL, func(c *picker.Config) { c.MaxBodyBytes = 32 }))
	e.exchange(requestHeaders("req-big", false))
	e.exchange(requestBody(`{"prompt": [1, 2, 3, `, false))
	if resp := e.exchange(requestBody(`4, 5, 6, 7, 8, 9]}`, true)); immediateStatus(resp) != 413 {
		t.Fatalf("got %v, want an immediate 413", resp)
	}
	fake.waitOps(t)
}

// The proxy's subset becomes allowed_worker_ids through GET /v1/workers, which is cached.
func TestSubsetHintRestrictsWorkers(t *testing.T) {
	fake := newFakeKvrouterd(t)
	client := startPicker(t, fake.URL, func(c *picker.Config) { c.WorkersTTL = time.Minute })

	for i := range 2 {
		e := openStream(t, client)
		id := fmt.Sprintf("req-subset-%d", i)
		e.exchange(withSubset(requestHeaders(id, false), "10.0.0.3:8000", "10.9.9.9:1", "10.0.0.2:8000"))
		resp := e.exchange(requestBody(completionBody, true))
		checkDestination(t, resp, resp.GetRequestBody().GetResponse().GetHeaderMutation(), "10.0.0.3:8000")
		e.finish()
	}
	for _, r := range fake.callsOf("route") {
		if !slices.Equal(r.Route.AllowedWorkerIDs, []uint64{3, 2}) {
			t.Fatalf("allowed_worker_ids = %v, want [3 2] (the subset's known workers, in order)", r.Route.AllowedWorkerIDs)
		}
	}
	if n := len(fake.callsOf("workers")); n != 1 {
		t.Fatalf("GET /v1/workers called %d times, want 1 (cached)", n)
	}
}

// A subset that names no worker of kvrouterd leaves nothing eligible: 503 without a route.
func TestSubsetWithoutKnownWorkersIs503(t *testing.T) {
	fake := newFakeKvrouterd(t)
	e := openStream(t, startPicker(t, fake.URL, nil))
	e.exchange(withSubset(requestHeaders("req-nobody", false), "192.0.2.1:8000"))
	if resp := e.exchange(requestBody(completionBody, true)); immediateStatus(resp) != 503 {
		t.Fatalf("got %v, want an immediate 503", resp)
	}
	fake.waitOps(t, "workers")
}

// Request ids are percent-encoded path segments in the lifecycle calls.
func TestRequestIDIsPercentEncoded(t *testing.T) {
	fake := newFakeKvrouterd(t)
	e := openStream(t, startPicker(t, fake.URL, nil))
	const id = "tenant/a b?c%d"
	routeBuffered(t, e, id, completionBody, "10.0.0.1:8000")
	e.exchange(responseHeaders(true))
	fake.waitOps(t, "route", "prefill", "free")
	for _, c := range append(fake.callsOf("prefill"), fake.callsOf("free")...) {
		if c.ID != id || !strings.HasPrefix(c.RawPath, "/v1/requests/tenant%2Fa%20b%3Fc%25d") {
			t.Fatalf("%s call: id %q, path %q; want id %q as one encoded segment", c.Op, c.ID, c.RawPath, id)
		}
	}
}

// Without x-request-id the picker makes one up, and tells the engine through the same header.
func TestGeneratedRequestID(t *testing.T) {
	fake := newFakeKvrouterd(t)
	e := openStream(t, startPicker(t, fake.URL, nil))
	e.exchange(requestHeaders("", false))
	resp := e.exchange(requestBody(completionBody, true))
	routes := fake.callsOf("route")
	if len(routes) != 1 || !strings.HasPrefix(routes[0].ID, "epp-") {
		t.Fatalf("route calls = %+v, want one with a generated epp-... id", routes)
	}
	if got := setHeaders(resp.GetRequestBody().GetResponse().GetHeaderMutation())["x-request-id"]; got != routes[0].ID {
		t.Fatalf("x-request-id set to %q, want %q", got, routes[0].ID)
	}
}

// A replayed decision (another stream booked the same id) is followed but not freed here.
func TestReplayedDecisionIsNotFreed(t *testing.T) {
	fake := newFakeKvrouterd(t)
	fake.set(func(f *fakeKvrouterd) { f.replayed = true })
	e := openStream(t, startPicker(t, fake.URL, nil))
	routeBuffered(t, e, "req-dup-id", completionBody, "10.0.0.1:8000")
	e.exchange(responseHeaders(false))
	e.exchange(responseBody("x", true))
	e.finish()
	fake.waitOps(t, "route")
}

func TestModelAsLora(t *testing.T) {
	fake := newFakeKvrouterd(t)
	e := openStream(t, startPicker(t, fake.URL, func(c *picker.Config) { c.ModelAsLora = true }))
	routeBuffered(t, e, "req-lora", `{"model": "adapter-a", "prompt": [1]}`, "10.0.0.1:8000")
	if routes := fake.callsOf("route"); len(routes) != 1 || routes[0].Route.LoraName != "adapter-a" {
		t.Fatalf("route calls = %+v, want lora_name adapter-a", routes)
	}
}

// receiveBodyBack collects the request body a full-duplex picker sends back, up to its end of
// stream, checking that no piece is larger than Envoy's recommended 64 KiB.
func receiveBodyBack(e *envoy) string {
	e.t.Helper()
	var body strings.Builder
	for {
		resp := e.recv()
		streamed := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if streamed == nil {
			e.t.Fatalf("got %v, want a streamed request body", resp)
		}
		if len(streamed.GetBody()) > 64<<10 {
			e.t.Fatalf("a body piece of %d bytes: more than 64 KiB", len(streamed.GetBody()))
		}
		body.Write(streamed.GetBody())
		if streamed.GetEndOfStream() {
			return body.String()
		}
	}
}

// A body larger than 64 KiB goes back to Envoy in pieces of at most 64 KiB; a body that ends
// with trailers (no end of stream on its last chunk) is routed when they arrive.
func TestFullDuplexLargeBodyWithTrailers(t *testing.T) {
	fake := newFakeKvrouterd(t)
	e := openStream(t, startPicker(t, fake.URL, nil))
	duplex := filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	ids := make([]string, 30000)
	for i := range ids {
		ids[i] = fmt.Sprint(100000 + i)
	}
	body := `{"prompt": [` + strings.Join(ids, ", ") + `]}` // about 240 KB

	e.send(withModes(requestHeaders("req-large", false), duplex, duplex))
	for i := 0; i < len(body); i += 50000 {
		e.send(requestBody(body[i:min(i+50000, len(body))], false))
	}
	e.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{
		RequestTrailers: &extprocv3.HttpTrailers{},
	}})
	resp := e.recv()
	checkDestination(t, resp, resp.GetRequestHeaders().GetResponse().GetHeaderMutation(), "10.0.0.1:8000")
	var got strings.Builder
	for got.Len() < len(body) {
		streamed := e.recv().GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if n := len(streamed.GetBody()); n == 0 || n > 64<<10 || streamed.GetEndOfStream() {
			t.Fatalf("body piece of %d bytes, end of stream %v: want 1..64 KiB, no end (trailers follow)", n, streamed.GetEndOfStream())
		}
		got.Write(streamed.GetBody())
	}
	if got.String() != body {
		t.Fatal("the body sent back differs from the body received")
	}
	if e.recv().GetRequestTrailers() == nil {
		t.Fatal("want the trailers answer after the body")
	}
	if routes := fake.callsOf("route"); len(routes) != 1 || len(routes[0].Route.TokenIDs) != len(ids) {
		t.Fatalf("want one route with %d tokens, got %d routes", len(ids), len(routes))
	}
}
