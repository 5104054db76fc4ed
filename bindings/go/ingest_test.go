package kvrouter

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// waitStats polls a source's counters until ok accepts them (bounded by 10 s).
func waitStats(t *testing.T, in *Ingest, source uint64, ok func(IngestStats) bool) IngestStats {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		s, err := in.Stats(source)
		must(t, err)
		if ok(s) {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for the ingest counters; last %+v", s)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func newIngest(t *testing.T, r *Router) *Ingest {
	t.Helper()
	in, err := NewIngest(r, &IngestOptions{ReplayTimeout: time.Second})
	must(t, err)
	t.Cleanup(func() { in.Close() })
	return in
}

// The replica liveness settings reach the library, which refuses more than an hour.
func TestIngestReplicaLivenessOptions(t *testing.T) {
	r := newTestRouter(t, 1)
	for _, o := range []IngestOptions{{ReplicaHeartbeat: time.Hour + time.Millisecond}, {ReplicaTimeout: 2 * time.Hour}} {
		in, err := NewIngest(r, &o)
		wantCode(t, err, ErrInvalidArgument)
		if in != nil {
			in.Close()
		}
	}
	in, err := NewIngest(r, &IngestOptions{ReplicaHeartbeat: time.Hour, ReplicaTimeout: -1})
	must(t, err)
	must(t, in.Close())
}

// Events published over a Unix socket reach the index; bad frames are counted and the
// connection goes on.
func TestIngestUnixSocketWithPublisher(t *testing.T) {
	r := newTestRouter(t, 3)
	in := newIngest(t, r)
	path := filepath.Join(t.TempDir(), "events.sock")
	src, bound, err := in.Listen("unix://" + path)
	must(t, err)
	if bound != "unix://"+path || src == 0 {
		t.Fatalf("Listen: source %d, bound %q", src, bound)
	}
	must(t, in.Start())
	wantCode(t, in.Start(), ErrFailedPrecondition)

	pub, err := ConnectPublisher(bound)
	must(t, err)
	defer pub.Close()
	b, err := NewEventBatch()
	must(t, err)
	defer b.Close()
	p := prompt(64, 77)
	must(t, b.AddStored(storedPrefix(3, p, 4)))
	must(t, b.AddStored(storedPrefix(2, p, 1)))
	must(t, pub.Send(b))
	s := waitStats(t, in, src, func(s IngestStats) bool { return s.EventsApplied >= 2 })
	if s.Messages != 1 || s.Connections != 1 || s.EventsApplied != 2 {
		t.Errorf("stats after one batch: %+v", s)
	}
	res, err := r.FindBestMatch(p, nil)
	must(t, err)
	if res.WorkerID != 3 || res.DeviceOverlapBlocks != 4 {
		t.Errorf("routing after ingest: %+v", res)
	}

	// A frame that is not an EventBatch is rejected and counted; the next one still applies.
	must(t, pub.SendEncoded([]byte("this is not a flatbuffer, not at all")))
	b.Clear()
	must(t, b.AddCleared(3, 0, 5))
	enc, err := b.Encode()
	must(t, err)
	must(t, pub.SendEncoded(enc))
	s = waitStats(t, in, src, func(s IngestStats) bool { return s.Messages >= 3 && s.EventsApplied >= 3 })
	if s.Rejected[RejectBadFlatBuffers] != 1 || s.EventsApplied != 3 || s.Connections != 1 {
		t.Errorf("stats after a bad frame: %+v", s)
	}
	if !strings.Contains(s.LastReject, "file identifier") { // the reason, in words
		t.Errorf("LastReject after a bad frame: %q", s.LastReject)
	}
	res, err = r.FindBestMatch(p, nil)
	must(t, err)
	if res.WorkerID == 3 {
		t.Errorf("worker 3 was cleared but still chosen: %+v", res)
	}
	// The same through source 0 (every source).
	all, err := in.Stats(0)
	must(t, err)
	if all.Messages != s.Messages || all.EventsApplied != s.EventsApplied {
		t.Errorf("totals %+v vs %+v", all, s)
	}
	_, err = in.Stats(12345)
	wantCode(t, err, ErrNotFound)

	// Stop is final and idempotent; the publisher then loses its connection.
	must(t, in.Stop())
	must(t, in.Stop())
	wantCode(t, in.Start(), ErrFailedPrecondition)
	must(t, in.Close())
	must(t, in.Close())
	if _, err := in.Stats(0); err != ErrClosed {
		t.Errorf("Stats after Close: %v", err)
	}
	if err := in.Stop(); err != ErrClosed {
		t.Errorf("Stop after Close: %v", err)
	}
}

func TestIngestTCPAndErrors(t *testing.T) {
	r := newTestRouter(t, 2)
	in := newIngest(t, r)
	// Sources added before Start.
	src, bound, err := in.Listen("tcp://127.0.0.1:0")
	must(t, err)
	if !strings.HasPrefix(bound, "tcp://127.0.0.1:") || strings.HasSuffix(bound, ":0") {
		t.Fatalf("bound %q", bound)
	}
	_, _, err = in.Listen("carrier-pigeon://nowhere")
	if StatusOf(err) != ErrInvalidArgument && StatusOf(err) != ErrUnavailable {
		t.Errorf("bad endpoint: %v", err)
	}
	_, _, err = in.Listen(bound) // already bound
	wantCode(t, err, ErrUnavailable)
	_, err = ConnectPublisher("tcp://127.0.0.1:1")
	wantCode(t, err, ErrUnavailable)
	must(t, in.Start())

	pub, err := ConnectPublisher(bound)
	must(t, err)
	defer pub.Close()
	p := prompt(32, 1)
	b, err := NewEventBatch()
	must(t, err)
	defer b.Close()
	for i := 0; i < 10; i++ {
		b.Clear()
		must(t, b.AddStored(&StoredEvent{WorkerID: 1, EventID: uint64(i), BlockHashes: []uint64{uint64(100 + i)}, TokenIDs: prompt(16, uint32(1000*i))}))
		must(t, pub.Send(b))
	}
	// An event the index refuses (unknown parent) is counted per reason.
	b.Clear()
	must(t, b.AddStored(&StoredEvent{WorkerID: 2, HasParent: true, ParentHash: 4242, BlockHashes: []uint64{1}, TokenIDs: p[:16]}))
	must(t, pub.Send(b))
	s := waitStats(t, in, src, func(s IngestStats) bool { return s.Messages >= 11 })
	if s.EventsApplied != 10 || s.Rejected[RejectIndex] != 1 {
		t.Errorf("stats %+v", s)
	}
	m, err := r.Metrics()
	must(t, err)
	if m.IndexBlocks != 10 {
		t.Errorf("index blocks %d, want 10", m.IndexBlocks)
	}
	// A publisher whose batch is closed reports ErrClosed rather than crashing.
	closed, _ := NewEventBatch()
	closed.Close()
	if err := pub.Send(closed); err != ErrClosed {
		t.Errorf("Send(closed batch) = %v", err)
	}
	must(t, pub.Close())
	must(t, pub.Close())
	if err := pub.SendEncoded([]byte{1}); err != ErrClosed {
		t.Errorf("SendEncoded after Close = %v", err)
	}
}

var (
	portMu   sync.Mutex
	nextPort int // guarded by portMu
)

// freePort is a free port on 127.0.0.1 below the ephemeral range, as tests/ingest/nats_server.h
// picks: a port the kernel chose for a listener on port 0 may be handed out again at once (the
// local port of a reconnecting ZMQ socket, say), and the server meant for it then fails to
// bind. Each process walks its own stretch, from a start drawn from its pid.
func freePort(t *testing.T) int {
	portMu.Lock()
	defer portMu.Unlock()
	top := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if fields := strings.Fields(string(b)); len(fields) > 0 {
			fmt.Sscan(fields[0], &top)
		}
	}
	bottom := top - 12000
	if bottom < 1024 {
		bottom = 1024
	}
	if nextPort == 0 {
		nextPort = bottom + os.Getpid()*997%(top-bottom)
	}
	for tries := 0; tries < top-bottom; tries++ {
		port := nextPort
		if nextPort++; nextPort >= top {
			nextPort = bottom
		}
		if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port)); err == nil {
			l.Close()
			return port
		}
	}
	t.Fatal("no free port below the ephemeral range")
	return 0
}

func TestIngestEngineWorkers(t *testing.T) {
	r := newTestRouter(t, 1)
	in := newIngest(t, r)
	must(t, in.Start())
	port := freePort(t) // nobody publishes on it
	w := EngineWorker{Engine: EngineVLLM, Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port), WorkerID: 5, DPSize: 2, Topic: "kv"}
	src, err := in.AddEngineWorker(w)
	must(t, err)
	_, err = in.AddEngineWorker(w)
	wantCode(t, err, ErrAlreadyExists)
	w.WorkerID, w.BlockSize = 6, 32
	_, err = in.AddEngineWorker(w)
	wantCode(t, err, ErrInvalidArgument)
	if !strings.Contains(err.Error(), "32") || !strings.Contains(err.Error(), "16") {
		t.Errorf("the block size message names both sizes: %v", err)
	}
	w.BlockSize, w.Engine = 0, Engine(9)
	_, err = in.AddEngineWorker(w)
	wantCode(t, err, ErrInvalidArgument)
	s, err := in.Stats(src)
	must(t, err)
	if s.Messages != 0 || s.StateUnknown != 0 || s.EventsIgnored != 0 || s.BookingsTrimmed != 0 {
		t.Errorf("engine source stats %+v", s)
	}
	wantCode(t, in.RemoveEngineWorker(77, false), ErrNotFound)
	must(t, in.RemoveEngineWorker(5, true))
	wantCode(t, in.RemoveEngineWorker(5, true), ErrNotFound)
}

// The lag counters: a batch stamped 50 ms in the past is measured at >= 50 ms.
func TestIngestLag(t *testing.T) {
	r := newTestRouter(t, 1)
	in := newIngest(t, r)
	src, bound, err := in.Listen("unix://" + filepath.Join(t.TempDir(), "lag.sock"))
	must(t, err)
	must(t, in.Start())
	b, err := NewEventBatch()
	must(t, err)
	defer b.Close()
	must(t, b.AddCleared(1, 0, 1))
	pub, err := ConnectPublisher(bound)
	must(t, err)
	defer pub.Close()
	must(t, b.SetPublishTime(time.Now().Add(-5*time.Second)))
	must(t, pub.Send(b))
	s := waitStats(t, in, src, func(s IngestStats) bool { return s.Messages >= 1 })
	if s.LagSamples != 1 || s.LagLast < 5*time.Second || s.LagMax != s.LagLast ||
		s.LagTotal != s.LagLast || s.MeanLag() != s.LagLast || s.LagLast > 10*time.Second {
		t.Fatalf("lag after a stamped batch: %+v", s)
	}
	// Unstamped (the zero time): not measured. Stamped by default (now): a small lag (well under
	// the first one's 5 s even when the machine stalls).
	must(t, b.SetPublishTime(time.Time{}))
	must(t, pub.Send(b))
	b.Clear() // drops the publish time too: the next send is stamped with the wall clock
	must(t, b.AddCleared(1, 0, 2))
	must(t, pub.Send(b))
	s = waitStats(t, in, src, func(s IngestStats) bool { return s.Messages >= 3 })
	if s.LagSamples != 2 || s.LagLast >= 3*time.Second || s.LagMax < 5*time.Second {
		t.Errorf("lag after an unstamped and a fresh batch: %+v", s)
	}
	total, err := in.Stats(0)
	must(t, err)
	if total.LagSamples != s.LagSamples || total.LagMax != s.LagMax {
		t.Errorf("lag totals %+v vs %+v", total, s)
	}
	if err := b.SetPublishTime(time.Unix(-5, 0)); StatusOf(err) != ErrInvalidArgument {
		t.Errorf("pre-1970 publish time: %v", err)
	}
}

// NATS: a nats-server on 127.0.0.1, a subscription with a wildcard, batches published with a
// minimal client of the NATS text protocol.
func TestIngestNATS(t *testing.T) {
	addr := startNATSServer(t)
	conn, err := net.Dial("tcp", addr)
	must(t, err)
	defer conn.Close()
	nats := newNATSClient(t, conn)

	r := newTestRouter(t, 2)
	in := newIngest(t, r)
	must(t, in.Start())
	src, err := in.SubscribeNATS("nats://"+addr, "kv.*.events")
	must(t, err)
	_, err = in.SubscribeNATS("nats://127.0.0.1:1", "kv")
	wantCode(t, err, ErrUnavailable)

	b, err := NewEventBatch()
	must(t, err)
	defer b.Close()
	p := prompt(48, 3)
	must(t, b.AddStored(storedPrefix(2, p, 3)))
	enc, err := b.Encode()
	must(t, err)
	nats.publish("kv.worker2.events", enc)
	nats.publish("kv.worker2.events", []byte("garbage"))
	nats.publish("other.subject", enc) // not subscribed
	nats.flush()
	s := waitStats(t, in, src, func(s IngestStats) bool { return s.Messages >= 2 })
	if s.EventsApplied != 1 || s.Rejected[RejectBadFlatBuffers] != 1 || s.Connections != 1 {
		t.Errorf("NATS stats %+v", s)
	}
	res, err := r.FindBestMatch(p, nil)
	must(t, err)
	if res.WorkerID != 2 || res.DeviceOverlapBlocks != 3 {
		t.Errorf("routing after NATS: %+v", res)
	}
	must(t, in.Stop())
}

// JetStream: a stream created by the source (CreateStream), a batch published into it with a
// plain NATS publish, applied and acknowledged (StreamSequence); the refusals: a missing stream
// without CreateStream, a stream name with '.', an unreachable server.
func TestIngestJetStream(t *testing.T) {
	addr := startNATSServerWith(t, true)
	url := "nats://" + addr
	r := newTestRouter(t, 2)
	in := newIngest(t, r)
	must(t, in.Start())

	src := JetStreamSource{URL: url, Stream: "KV", Subject: "kv.>", Durable: "gw-1"}
	_, err := in.SubscribeJetStream(src)
	wantCode(t, err, ErrNotFound) // no stream yet, and not asked to create it
	bad := src
	bad.Stream, bad.CreateStream = "K.V", true
	_, err = in.SubscribeJetStream(bad)
	wantCode(t, err, ErrInvalidArgument)
	away := src
	away.URL, away.CreateStream = "nats://127.0.0.1:1", true
	_, err = in.SubscribeJetStream(away)
	wantCode(t, err, ErrUnavailable)

	src.CreateStream = true
	id, err := in.SubscribeJetStream(src)
	must(t, err)
	if ep, err := in.SourceEndpoint(id); err != nil || ep != url {
		t.Errorf("SourceEndpoint(%d) = %q, %v; want %q", id, ep, err, url)
	}

	b, err := NewEventBatch()
	must(t, err)
	defer b.Close()
	p := prompt(48, 5)
	must(t, b.AddStored(storedPrefix(2, p, 3)))
	enc, err := b.Encode()
	must(t, err)
	conn, err := net.Dial("tcp", addr)
	must(t, err)
	defer conn.Close()
	nats := newNATSClient(t, conn)
	nats.publish("kv.w1", enc) // a core publish: the stream stores it
	nats.flush()

	s := waitStats(t, in, id, func(s IngestStats) bool { return s.StreamSequence >= 1 })
	if s.StreamSequence != 1 || s.Messages != 1 || s.EventsApplied != 1 {
		t.Errorf("JetStream stats %+v, want stream sequence 1 and one batch applied", s)
	}
	if s.ConsumerRemakes != 0 || s.ConsumerRemakeFailures != 0 {
		t.Errorf("JetStream stats %+v, want no consumer made again (nothing was lost)", s)
	}
	if total, err := in.Stats(0); err != nil || total.StreamSequence != 1 {
		t.Errorf("total StreamSequence %d (%v), want 1 (the largest over the sources)", total.StreamSequence, err)
	}
	res, err := r.FindBestMatch(p, nil)
	must(t, err)
	if res.WorkerID != 2 || res.DeviceOverlapBlocks != 3 {
		t.Errorf("routing after JetStream: %+v", res)
	}
	must(t, in.Stop())
}

// The JetStream relay: a router fed by a stream listener relays its index changes into stream
// KV on kv.relay.<worker>; a second router consuming kv.relay.> ends with the same index. The
// refusals: a consumer's field (Durable) and a second relay.
func TestIngestRelayJetStream(t *testing.T) {
	addr := startNATSServerWith(t, true)
	url := "nats://" + addr
	r := newTestRouter(t, 2)
	in := newIngest(t, r)
	listener, bound, err := in.Listen("unix://" + filepath.Join(t.TempDir(), "relay.sock"))
	must(t, err)
	must(t, in.Start())

	target := JetStreamSource{URL: url, Stream: "KV", Subject: "kv.relay", CreateStream: true}
	durable := target
	durable.Durable = "relay-1"
	_, err = in.RelayJetStream(durable)
	wantCode(t, err, ErrInvalidArgument)
	relay, err := in.RelayJetStream(target)
	must(t, err)
	if relay == 0 || relay == listener {
		t.Errorf("relay source id %d (listener %d)", relay, listener)
	}
	_, err = in.RelayJetStream(target)
	wantCode(t, err, ErrFailedPrecondition)

	r2 := newTestRouter(t, 2)
	in2 := newIngest(t, r2)
	must(t, in2.Start())
	consumer, err := in2.SubscribeJetStream(JetStreamSource{URL: url, Stream: "KV", Subject: "kv.relay.>", Durable: "gw-2"})
	must(t, err)

	p := prompt(48, 9)
	sendStored(t, bound, storedPrefix(2, p, 3))

	waitStats(t, in, listener, func(s IngestStats) bool { return s.EventsApplied >= 1 })
	rs := waitStats(t, in, relay, func(s IngestStats) bool {
		return s.Messages >= 1 && s.Messages == s.EventsApplied+s.MissedMessages && s.StateUnknown == 0
	})
	if rs.StreamSequence == 0 || rs.Published == 0 || rs.MissedMessages != 0 {
		t.Fatalf("relay stats %+v, want acknowledged messages", rs)
	}
	cs := waitStats(t, in2, consumer, func(s IngestStats) bool { return s.StreamSequence >= rs.StreamSequence })
	if cs.StreamSequence != rs.StreamSequence || cs.EventsApplied == 0 {
		t.Errorf("consumer stats %+v, want stream sequence %d", cs, rs.StreamSequence)
	}
	d1, err := r.IndexDigest()
	must(t, err)
	d2, err := r2.IndexDigest()
	must(t, err)
	if d1 != d2 {
		t.Errorf("index digests differ after the relay: %#x vs %#x", d1, d2)
	}
	res, err := r2.FindBestMatch(p, nil)
	must(t, err)
	if res.WorkerID != 2 || res.DeviceOverlapBlocks != 3 {
		t.Errorf("routing on the consuming router: %+v", res)
	}
	must(t, in.Stop())
	must(t, in2.Stop())
}

// startNATSServer starts nats-server on a free port of 127.0.0.1 for the test (killed when it
// ends) and returns its address once it accepts connections; skips the test without one.
func startNATSServer(t *testing.T) string {
	t.Helper()
	return startNATSServerWith(t, false)
}

// startNATSServerWith is startNATSServer, with JetStream on (its store in a temporary
// directory of the test) when jetstream is true, and nats-server's arguments extra after the
// test's own (e.g. "-c", a configuration file).
func startNATSServerWith(t *testing.T, jetstream bool, extra ...string) string {
	t.Helper()
	server, err := exec.LookPath("nats-server")
	if err != nil {
		if _, statErr := os.Stat("/usr/sbin/nats-server"); statErr != nil {
			t.Skip("nats-server not found (apt-get install nats-server): NATS not tested")
		}
		server = "/usr/sbin/nats-server"
	}
	port := freePort(t)
	argv := []string{"-a", "127.0.0.1", "-p", fmt.Sprint(port)}
	if jetstream {
		argv = append(argv, "-js", "-sd", t.TempDir())
	}
	argv = append(argv, extra...)
	cmd := exec.Command(server, argv...)
	must(t, cmd.Start())
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	for deadline := time.Now().Add(10 * time.Second); ; {
		conn, err := net.Dial("tcp", addr)
		if err == nil {
			conn.Close()
			return addr
		}
		if time.Now().After(deadline) {
			t.Fatalf("nats-server did not start: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

type natsClient struct {
	t    *testing.T
	conn net.Conn
	rd   *bufio.Reader
}

func newNATSClient(t *testing.T, conn net.Conn) *natsClient {
	c := &natsClient{t: t, conn: conn, rd: bufio.NewReader(conn)}
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	line, err := c.rd.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "INFO ") {
		t.Fatalf("NATS greeting %q: %v", line, err)
	}
	c.write([]byte("CONNECT {\"verbose\":false,\"pedantic\":false}\r\n"))
	return c
}

func (c *natsClient) write(b []byte) {
	if _, err := c.conn.Write(b); err != nil {
		c.t.Fatal(err)
	}
}

func (c *natsClient) publish(subject string, payload []byte) {
	c.write([]byte(fmt.Sprintf("PUB %s %d\r\n", subject, len(payload))))
	c.write(append(append([]byte(nil), payload...), '\r', '\n'))
}

// flush waits until the server has processed everything sent (PING, PONG).
func (c *natsClient) flush() {
	c.write([]byte("PING\r\n"))
	for {
		line, err := c.rd.ReadString('\n')
		if err != nil {
			c.t.Fatal(err)
		}
		if strings.HasPrefix(line, "-ERR") {
			c.t.Fatalf("NATS: %s", line)
		}
		if strings.HasPrefix(line, "PONG") {
			return
		}
	}
}

// Ingest calls from many goroutines at once, with Stop racing SubscribeNATS-free calls.
func TestIngestConcurrentCalls(t *testing.T) {
	r := newTestRouter(t, 1)
	in := newIngest(t, r)
	must(t, in.Start())
	dir := t.TempDir()
	done := make(chan error, 8)
	for g := 0; g < 8; g++ {
		go func(g int) {
			_, _, err := in.Listen(fmt.Sprintf("unix://%s/s%d.sock", dir, g))
			if err == nil {
				_, err = in.Stats(0)
			}
			done <- err
		}(g)
	}
	for g := 0; g < 8; g++ {
		must(t, <-done)
	}
	s, err := in.Stats(0)
	must(t, err)
	if s.Messages != 0 {
		t.Errorf("%+v", s)
	}
	go in.Stop()
	in.Close()
	if _, err := in.Stats(0); !errors.Is(err, ErrClosed) {
		t.Error(err)
	}
}

// A router (or a Disagg) is not freed under an Ingest that feeds it.
func TestRouterCloseWaitsForIngest(t *testing.T) {
	r, err := NewRouter(nil)
	must(t, err)
	in, err := NewIngest(r, nil)
	must(t, err)
	must(t, in.Start())
	wantCode(t, r.Close(), ErrFailedPrecondition)
	if _, err := r.Metrics(); err != nil {
		t.Fatalf("the router was closed under its ingest: %v", err)
	}
	must(t, in.Close())
	must(t, r.Close())
	must(t, r.Close())

	d, err := NewDisagg(nil, nil, nil)
	must(t, err)
	in, err = NewIngest(d.DecodeRouter(), nil)
	must(t, err)
	wantCode(t, d.Close(), ErrFailedPrecondition)
	must(t, in.Close())
	must(t, d.Close())
}
