package picker_test

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"sync"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvrouter/kvrouter/service/epp/internal/picker"
)

// startPicker runs the picker's gRPC server on 127.0.0.1 against kvrouterd at kvrouterdURL and
// returns a client to it.
func startPicker(t *testing.T, kvrouterdURL string, configure func(*picker.Config)) extprocv3.ExternalProcessorClient {
	t.Helper()
	cfg := picker.DefaultConfig()
	if configure != nil {
		configure(&cfg)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewJSONHandler(newTestLog(t), &slog.HandlerOptions{Level: slog.LevelDebug}))
	srv := grpc.NewServer(grpc.WaitForHandlers(true))
	extprocv3.RegisterExternalProcessorServer(srv, picker.NewServer(picker.NewClient(kvrouterdURL, nil), cfg, log))
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return extprocv3.NewExternalProcessorClient(conn)
}

// testLog keeps the picker's logs and shows them when the test fails (go test -v would show
// every t.Log of passing tests too).
type testLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func newTestLog(t *testing.T) *testLog {
	l := &testLog{}
	t.Cleanup(func() {
		if t.Failed() {
			l.mu.Lock()
			defer l.mu.Unlock()
			t.Logf("picker's log:\n%s", l.buf.String())
		}
	})
	return l
}

func (l *testLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// envoy plays Envoy's part of one ext_proc stream.
type envoy struct {
	t      *testing.T
	stream extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc // resets the stream, as Envoy does when the client goes away
}

func openStream(t *testing.T, client extprocv3.ExternalProcessorClient) *envoy {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	stream, err := client.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return &envoy{t: t, stream: stream, cancel: cancel}
}

func (e *envoy) send(req *extprocv3.ProcessingRequest) {
	e.t.Helper()
	if err := e.stream.Send(req); err != nil {
		e.t.Fatalf("send: %v", err)
	}
}

func (e *envoy) recv() *extprocv3.ProcessingResponse {
	e.t.Helper()
	resp, err := e.stream.Recv()
	if err != nil {
		e.t.Fatalf("recv: %v", err)
	}
	return resp
}

// exchange sends req and returns the picker's answer.
func (e *envoy) exchange(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	e.t.Helper()
	e.send(req)
	return e.recv()
}

// finish half-closes the stream, as Envoy does at the end of the HTTP stream, and expects the
// picker to end it too.
func (e *envoy) finish() {
	e.t.Helper()
	if err := e.stream.CloseSend(); err != nil {
		e.t.Fatal(err)
	}
	if resp, err := e.stream.Recv(); err != io.EOF {
		e.t.Fatalf("after CloseSend: got %v, %v; want EOF", resp, err)
	}
}

// Envoy's messages.

func requestHeaders(requestID string, endOfStream bool) *extprocv3.ProcessingRequest {
	headers := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte("POST")},
		{Key: ":path", RawValue: []byte("/v1/completions")},
		{Key: "content-type", RawValue: []byte("application/json")},
	}
	if requestID != "" {
		headers = append(headers, &corev3.HeaderValue{Key: "x-request-id", RawValue: []byte(requestID)})
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: headers}, EndOfStream: endOfStream},
	}}
}

// withSubset adds the proxy's subset hint (metadata envoy.lb.subset_hint) to req.
func withSubset(req *extprocv3.ProcessingRequest, addresses ...string) *extprocv3.ProcessingRequest {
	list := make([]any, len(addresses))
	for i, a := range addresses {
		list[i] = a
	}
	hint, err := structpb.NewStruct(map[string]any{picker.SubsetKey: list})
	if err != nil {
		panic(err)
	}
	req.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{picker.SubsetNamespace: hint}}
	return req
}

// withModes adds the protocol configuration Envoy sends with a stream's first message.
func withModes(req *extprocv3.ProcessingRequest, request, response filterv3.ProcessingMode_BodySendMode) *extprocv3.ProcessingRequest {
	req.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: request, ResponseBodyMode: response}
	return req
}

func requestBody(body string, endOfStream bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: endOfStream},
	}}
}

func responseHeaders(endOfStream bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{
			Headers:     &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("200")}}},
			EndOfStream: endOfStream,
		},
	}}
}

func responseBody(body string, endOfStream bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: endOfStream},
	}}
}

// What the picker answered.

func setHeaders(m *extprocv3.HeaderMutation) map[string]string {
	out := map[string]string{}
	for _, h := range m.GetSetHeaders() {
		value := string(h.GetHeader().GetRawValue())
		if value == "" {
			value = h.GetHeader().GetValue()
		}
		out[h.GetHeader().GetKey()] = value
	}
	return out
}

func metadataDestination(resp *extprocv3.ProcessingResponse) string {
	ns := resp.GetDynamicMetadata().GetFields()[picker.DestinationMetadata]
	return ns.GetStructValue().GetFields()[picker.DestinationHeader].GetStringValue()
}

func immediateStatus(resp *extprocv3.ProcessingResponse) int {
	return int(resp.GetImmediateResponse().GetStatus().GetCode())
}
