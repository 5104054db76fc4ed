package kvrouter

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

// wantNUL fails unless err refuses the argument field for its NUL byte (ErrInvalidArgument
// naming it), which C would otherwise have read as the string's end.
func wantNUL(t *testing.T, what string, err error, field string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: no error, want ErrInvalidArgument for %s's NUL byte", what, field)
		return
	}
	var e *Error
	if !errors.As(err, &e) || e.Code() != ErrInvalidArgument ||
		!strings.Contains(e.Message(), field) || !strings.Contains(e.Message(), "NUL byte") {
		t.Errorf("%s: %v, want ErrInvalidArgument naming %s and its NUL byte", what, err, field)
	}
}

// Request ids, names and session ids holding a NUL byte are refused before they reach C:
// cut at the NUL, "t\x00a" and "t\x00b" were one request id, and a LoRA name "x\x00v2" hashed
// as "x". Every routing entry point is tried, the shims' paths (FindBestMatch, the calls taking
// an id) and the C copies' (previews, plans, events, hashing) alike.
func TestRoutingStringsWithNUL(t *testing.T) {
	r := newTestRouter(t, 2)
	p := prompt(48, 1)
	admit := func(id string) *RequestOptions { return &RequestOptions{Admit: true, RequestID: id} }

	// The simple shim (id only), then the options-by-value shim (an override set).
	_, err := r.FindBestMatch(p, admit("t\x00a"))
	wantNUL(t, "FindBestMatch (admit)", err, "RequestOptions.RequestID")
	_, err = r.FindBestMatch(p, admit("t\x00b"))
	wantNUL(t, "FindBestMatch (admit, a second id sharing the prefix)", err, "RequestOptions.RequestID")
	_, err = r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "t\x00c", Temperature: Ptr(0.0)})
	wantNUL(t, "FindBestMatch (admit, override)", err, "RequestOptions.RequestID")
	_, err = r.FindBestMatch(p, &RequestOptions{LoraName: "x\x00v2"})
	wantNUL(t, "FindBestMatch (query)", err, "RequestOptions.LoraName")
	_, err = r.FindBestMatch(p, &RequestOptions{LoraName: "x\x00v2", Temperature: Ptr(0.0)})
	wantNUL(t, "FindBestMatch (query, override)", err, "RequestOptions.LoraName")
	_, _, err = r.FindBestMatchCandidates(p, &RequestOptions{CacheNamespace: "n\x00"}, make([]Candidate, 2))
	wantNUL(t, "FindBestMatchCandidates", err, "RequestOptions.CacheNamespace")
	m, err := r.Metrics()
	must(t, err)
	if m.RequestsActive != 0 || m.Decisions != 0 {
		t.Errorf("a refused call routed or booked: %+v", m)
	}

	// The id-taking calls.
	must(t, r.AddRequest(p, 1, 0, &RequestOptions{RequestID: "t"}))
	wantNUL(t, "MarkPrefillCompleted", r.MarkPrefillCompleted("t\x00a"), "requestID")
	wantNUL(t, "FreeRequest", r.FreeRequest("t\x00a"), "requestID")
	wantNUL(t, "CommitRoute", r.CommitRoute("t\x00a"), "requestID")
	_, err = r.AbortRoute("t\x00a")
	wantNUL(t, "AbortRoute", err, "requestID")
	if m, _ = r.Metrics(); m.RequestsActive != 1 {
		t.Errorf("a request id cut at its NUL byte freed request \"t\": %d active", m.RequestsActive)
	}
	_, _, err = r.SessionBinding("s\x00x")
	wantNUL(t, "SessionBinding", err, "sessionID")
	wantNUL(t, "CloseSession", r.CloseSession("s\x00x"), "sessionID")

	// The calls whose options are C copies.
	wantNUL(t, "AddRequest", r.AddRequest(p, 1, 0, &RequestOptions{RequestID: "u\x00"}), "RequestOptions.RequestID")
	_, err = r.PreviewRoute(p, nil, &RoutingHints{SessionID: "s\x00x"})
	wantNUL(t, "PreviewRoute", err, "RoutingHints.SessionID")
	_, err = r.PlanRoute(p, &RequestOptions{RequestID: "v", LoraName: "x\x00v2"}, nil, nil)
	wantNUL(t, "PlanRoute", err, "RequestOptions.LoraName")
	_, err = r.OverlapScores(p, &RequestOptions{CacheNamespace: "n\x00"})
	wantNUL(t, "OverlapScores", err, "RequestOptions.CacheNamespace")
	_, err = r.PotentialLoads(p, &RequestOptions{LoraName: "x\x00"})
	wantNUL(t, "PotentialLoads", err, "RequestOptions.LoraName")

	// Hashing and events: "x\x00v2" is not the LoRA "x".
	_, err = ComputeBlockHashes(p, bs, &HashOptions{LoraName: "x\x00v2"})
	wantNUL(t, "ComputeBlockHashes", err, "HashOptions.LoraName")
	ev := storedPrefix(1, p, 1)
	ev.LoraName = "x\x00v2"
	wantNUL(t, "ApplyStored", r.ApplyStored(ev), "StoredEvent.LoraName")
	b, err := NewEventBatch()
	must(t, err)
	defer b.Close()
	wantNUL(t, "EventBatch.AddStored", b.AddStored(ev), "StoredEvent.LoraName")
	if b.Len() != 0 {
		t.Error("a refused event was added")
	}
	if TierFromMedium("CPU\x00x") != TierDevice || TierFromMedium("CPU") == TierDevice {
		t.Error("a medium with a NUL byte is no medium C knows: the device")
	}

	// The Disagg calls.
	d, err := NewDisagg(nil, nil, nil)
	must(t, err)
	defer d.Close()
	_, err = d.RoutePrefill(p, &RequestOptions{RequestID: "t\x00a"}, nil)
	wantNUL(t, "RoutePrefill", err, "RequestOptions.RequestID")
	_, err = d.RouteDecode(p, &RequestOptions{RequestID: "t"}, &RoutingHints{SessionID: "\x00"}, false)
	wantNUL(t, "RouteDecode", err, "RoutingHints.SessionID")
	_, err = d.PrefillWorkerBusy(p, &RequestOptions{LoraName: "x\x00"}, 1)
	wantNUL(t, "PrefillWorkerBusy", err, "RequestOptions.LoraName")

	wantNUL(t, "SetReplicaPublisher", r.SetReplicaPublisher("r\x00", func([]byte) {}), "replicaID")
}

// Endpoints, urls, subjects and names of the ingest and publisher calls holding a NUL byte are
// refused before anything is bound, connected or subscribed (cut at the NUL, a listener bound
// the path before it).
func TestIngestStringsWithNUL(t *testing.T) {
	r := newTestRouter(t, 1)
	in := newIngest(t, r)
	must(t, in.Start())
	dir := t.TempDir()
	_, _, err := in.Listen("unix://" + filepath.Join(dir, "a") + "\x00b")
	wantNUL(t, "Listen", err, "endpoint")
	_, err = in.AddEngineWorker(EngineWorker{Engine: EngineVLLM, WorkerID: 1, Endpoint: "tcp://127.0.0.1:1\x00x"})
	wantNUL(t, "AddEngineWorker", err, "EngineWorker.Endpoint")
	_, err = in.AddEngineWorker(EngineWorker{Engine: EngineVLLM, WorkerID: 1, Endpoint: "tcp://127.0.0.1:1", Topic: "kv\x00"})
	wantNUL(t, "AddEngineWorker", err, "EngineWorker.Topic")
	_, err = in.AddEngineWorker(EngineWorker{Engine: EngineVLLM, WorkerID: 1, Endpoint: "tcp://127.0.0.1:1",
		ReplayEndpoint: "tcp://127.0.0.1:2\x00"})
	wantNUL(t, "AddEngineWorker", err, "EngineWorker.ReplayEndpoint")
	_, err = in.SubscribeNATS("nats://127.0.0.1:1\x00", "kv")
	wantNUL(t, "SubscribeNATS", err, "url")
	_, err = in.SubscribeNATS("nats://127.0.0.1:1", "kv\x00.x")
	wantNUL(t, "SubscribeNATS", err, "subject")
	js := JetStreamSource{URL: "nats://127.0.0.1:1", Stream: "KV", Subject: "kv", Durable: "d\x00"}
	_, err = in.SubscribeJetStream(js)
	wantNUL(t, "SubscribeJetStream", err, "JetStreamSource.Durable")
	js.Durable, js.Stream = "", "K\x00V"
	_, err = in.RelayJetStream(js)
	wantNUL(t, "RelayJetStream", err, "JetStreamSource.Stream")
	_, err = in.SyncReplicas("nats://127.0.0.1:1", "replicas", "r\x00")
	wantNUL(t, "SyncReplicas", err, "replicaID")
	s, err := in.Stats(0)
	must(t, err)
	if s.Connections != 0 {
		t.Errorf("a refused source connected: %+v", s)
	}
	if _, err := in.SourceEndpoint(1); err == nil {
		t.Error("a refused source was added")
	}

	_, err = ConnectPublisher("unix://" + filepath.Join(dir, "a") + "\x00b")
	wantNUL(t, "ConnectPublisher", err, "endpoint")
}
