// Command kvrouter-epp is kvrouter's endpoint picker for Envoy: an ext_proc (gRPC) server that
// asks kvrouterd where each completion request goes and tells Envoy through the header
// x-gateway-destination-endpoint and the dynamic metadata envoy.lb. See service/epp/README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvrouter/kvrouter/service/epp/internal/picker"
)

type options struct {
	listen       string
	kvrouterd    string
	healthListen string
	drainTimeout time.Duration
	logLevel     slog.Level
	picker       picker.Config
}

func parseFlags(args []string, output io.Writer) (options, error) {
	o := options{picker: picker.DefaultConfig()}
	fs := flag.NewFlagSet("kvrouter-epp", flag.ContinueOnError)
	fs.SetOutput(output)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), `Usage: kvrouter-epp [flags]

kvrouter's endpoint picker for Envoy. Envoy's ext_proc filter sends each request here; the
picker reads the completion's token ids, asks kvrouterd (POST /v1/route) for a worker, and
answers with the header x-gateway-destination-endpoint and the dynamic metadata envoy.lb.
It tells kvrouterd when the response starts (prefill_completed) and ends (free).
Request body modes: BUFFERED or FULL_DUPLEX_STREAMED. Logs: JSON on stderr.

Flags:
`)
		fs.PrintDefaults()
	}
	fs.StringVar(&o.listen, "listen", "127.0.0.1:9002", "gRPC (ext_proc) listen address")
	fs.StringVar(&o.kvrouterd, "kvrouterd", "http://127.0.0.1:8080", "kvrouterd's base URL")
	fs.StringVar(&o.healthListen, "health-listen", "", "if set, serve HTTP GET /healthz on this address (the gRPC health service is always on --listen)")
	fs.IntVar(&o.picker.MaxBodyBytes, "max-body-bytes", o.picker.MaxBodyBytes, "largest request body accumulated; larger requests get 413")
	fs.DurationVar(&o.picker.RouteTimeout, "route-timeout", o.picker.RouteTimeout, "bound on the route call (including kvrouterd's admission queue); then 504")
	fs.DurationVar(&o.picker.CallTimeout, "call-timeout", o.picker.CallTimeout, "bound on the prefill_completed and free calls")
	fs.DurationVar(&o.picker.WorkersTTL, "workers-ttl", o.picker.WorkersTTL, "how long kvrouterd's worker list (to map subset addresses to worker ids) is reused")
	fs.BoolVar(&o.picker.ModelAsLora, "model-as-lora", false, "send the body's \"model\" as the route's lora_name")
	fs.DurationVar(&o.drainTimeout, "drain-timeout", 30*time.Second, "on SIGTERM/SIGINT, how long open streams may finish before they are cut (and freed)")
	fs.TextVar(&o.logLevel, "log-level", slog.LevelInfo, "log level: DEBUG, INFO, WARN or ERROR")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if o.picker.MaxBodyBytes <= 0 || o.picker.RouteTimeout <= 0 || o.picker.CallTimeout <= 0 {
		return o, errors.New("--max-body-bytes, --route-timeout and --call-timeout must be positive")
	}
	// Checked here: a bad URL would otherwise show only as a 503 on every request.
	if u, err := url.Parse(o.kvrouterd); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return o, fmt.Errorf("--kvrouterd %q: want a base URL like http://127.0.0.1:8080", o.kvrouterd)
	}
	return o, nil
}

func main() {
	o, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvrouter-epp:", err)
		os.Exit(2)
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: o.logLevel}))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, o, log); err != nil {
		log.Error("exiting", "error", err)
		os.Exit(1)
	}
}

// run serves until ctx is done (SIGTERM or SIGINT), then drains and stops.
func run(ctx context.Context, o options, log *slog.Logger) error {
	lis, err := net.Listen("tcp", o.listen)
	if err != nil {
		return err
	}
	httpClient := &http.Client{Transport: &http.Transport{
		MaxIdleConnsPerHost: 64, // one kvrouterd, many concurrent streams
		IdleConnTimeout:     90 * time.Second,
	}}
	// WaitForHandlers: Stop returns once the cut streams have freed their bookings.
	// MaxRecvMsgSize: a BUFFERED body comes in one message, and gRPC's default limit (4 MiB)
	// is below --max-body-bytes' default.
	srv := grpc.NewServer(grpc.WaitForHandlers(true), grpc.MaxRecvMsgSize(o.picker.MaxBodyBytes+64<<10))
	extprocv3.RegisterExternalProcessorServer(srv, picker.NewServer(picker.NewClient(o.kvrouterd, httpClient), o.picker, log))
	healthSrv := health.NewServer()
	healthpb.RegisterHealthServer(srv, healthSrv)

	var healthHTTP *http.Server
	if o.healthListen != "" {
		if healthHTTP, err = serveHealthz(o.healthListen, log); err != nil {
			return err
		}
	}

	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	log.Info("serving", "listen", lis.Addr().String(), "kvrouterd", o.kvrouterd, "health_listen", o.healthListen)

	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	log.Info("stopping: draining open streams", "drain_timeout", o.drainTimeout)
	healthSrv.Shutdown() // NOT_SERVING: health-checking proxies stop sending new requests
	if healthHTTP != nil {
		_ = healthHTTP.Close()
	}
	gracefulStop(srv, o.drainTimeout)
	log.Info("stopped")
	return nil
}

// gracefulStop lets open streams finish for up to timeout, then cuts them; the picker frees the
// bookings of cut streams as they end.
func gracefulStop(srv *grpc.Server, timeout time.Duration) {
	done := make(chan struct{})
	go func() { srv.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(timeout):
		srv.Stop()
		<-done
	}
}

func serveHealthz(addr string, log *slog.Logger) (*http.Server, error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"status": "ok"}`+"\n")
	})
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := hs.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("health server", "error", err)
		}
	}()
	return hs, nil
}
