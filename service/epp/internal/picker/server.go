// Package picker is kvrouter's endpoint picker for Envoy: an ext_proc server that routes each
// completion request through kvrouterd (POST /v1/route), tells Envoy where to send it
// (x-gateway-destination-endpoint), and reports the request's progress back to kvrouterd
// (prefill completed at the first response byte, freed at the end of the response or of the
// stream). docs/kvrouterd.md is the contract with kvrouterd.
package picker

import (
	"errors"
	"io"
	"log/slog"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Config is the picker's behaviour.
type Config struct {
	// MaxBodyBytes bounds the request body the picker accumulates; beyond it the request gets 413.
	MaxBodyBytes int
	// RouteTimeout bounds the subset lookup and the route call; kvrouterd's admission queue is
	// told to give up a little before (queue_timeout_ms).
	RouteTimeout time.Duration
	// CallTimeout bounds the prefill_completed and free calls.
	CallTimeout time.Duration
	// WorkersTTL is how long the address -> worker id map from GET /v1/workers is reused.
	WorkersTTL time.Duration
	// ModelAsLora sends the body's `model` as the route's lora_name.
	ModelAsLora bool
}

// DefaultConfig is the configuration the flags start from.
func DefaultConfig() Config {
	return Config{
		MaxBodyBytes: 8 << 20,
		RouteTimeout: 5 * time.Second,
		CallTimeout:  2 * time.Second,
		WorkersTTL:   2 * time.Second,
	}
}

// Server implements envoy.service.ext_proc.v3.ExternalProcessor.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	client *Client
	book   *addressBook
	cfg    Config
	log    *slog.Logger
}

// NewServer returns a picker asking client, configured by cfg, logging to log.
func NewServer(client *Client, cfg Config, log *slog.Logger) *Server {
	return &Server{client: client, book: newAddressBook(client, cfg.WorkersTTL), cfg: cfg, log: log}
}

// Process serves one HTTP request's stream: Envoy opens one per request.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	st := newStreamState(s, stream)
	// However the stream ends, a booking it still holds is freed (once).
	defer st.release()
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			if status.Code(err) == codes.Canceled {
				return nil // Envoy (or its client) went away: not an error of ours
			}
			return err
		}
		if err := st.handle(req); err != nil {
			return err
		}
		if st.finished {
			return nil // an immediate response ends the HTTP request
		}
	}
}
