package main

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// Stopping (SIGTERM: run's context ends) with a routed request still streaming: the stream gets
// --drain-timeout, is then cut, its booking is freed, and run returns.
func TestStopCutsOpenStreamsAndFreesThem(t *testing.T) {
	var mu sync.Mutex
	var freed []string
	kvrouterd := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == "POST" && r.URL.Path == "/v1/route":
			_, _ = io.WriteString(w, `{"request_id": "req-stop", "worker_id": 1, "address": "10.0.0.1:8000", "booked": true}`)
		case r.Method == "DELETE":
			// Slow: run must wait for the cut stream's free, not return before it lands.
			time.Sleep(300 * time.Millisecond)
			mu.Lock()
			freed = append(freed, r.URL.Path)
			mu.Unlock()
			_, _ = io.WriteString(w, `{"request_id": "req-stop", "freed": true}`)
		default:
			http.NotFound(w, r)
		}
	}))
	defer kvrouterd.Close()

	o, err := parseFlags([]string{"--listen", freeAddress(t), "--kvrouterd", kvrouterd.URL, "--drain-timeout", "200ms"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	ran := make(chan error, 1)
	go func() { ran <- run(ctx, o, slog.New(slog.NewJSONHandler(io.Discard, nil))) }()

	stream := openRoutedStream(t, o.listen)
	defer stream.CloseSend()
	stop()
	select {
	case err := <-ran:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return after the drain timeout")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(freed) != 1 || freed[0] != "/v1/requests/req-stop" {
		t.Fatalf("frees = %q, want one of req-stop", freed)
	}
}

func freeAddress(t *testing.T) string {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	return lis.Addr().String()
}

// openRoutedStream sends a request through the picker at addr up to its routing answer.
func openRoutedStream(t *testing.T, addr string) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	// WaitForReady: run may not be listening yet.
	stream, err := extprocv3.NewExternalProcessorClient(conn).Process(context.Background(), grpc.WaitForReady(true))
	if err != nil {
		t.Fatal(err)
	}
	headers := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "x-request-id", RawValue: []byte("req-stop")}}}
	for _, req := range []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: headers}}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(`{"prompt": [1, 2]}`), EndOfStream: true}}},
	} {
		if err := stream.Send(req); err != nil {
			t.Fatal(err)
		}
		if _, err := stream.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	return stream
}
