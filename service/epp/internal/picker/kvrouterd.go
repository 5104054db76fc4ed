package picker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
)

// RouteRequest is the part of kvrouterd's route body (docs/kvrouterd.md, "Routing") the picker
// fills in.
type RouteRequest struct {
	RequestID        string   `json:"request_id"`
	TokenIDs         []uint32 `json:"token_ids"`
	LoraName         string   `json:"lora_name,omitempty"`
	AllowedWorkerIDs []uint64 `json:"allowed_worker_ids,omitempty"`
	QueueTimeoutMs   int64    `json:"queue_timeout_ms,omitempty"`
}

// Decision is kvrouterd's answer to a route.
type Decision struct {
	RequestID    string  `json:"request_id"`
	WorkerID     uint64  `json:"worker_id"`
	DPRank       uint32  `json:"dp_rank"`
	Address      *string `json:"address"` // null when the worker has no configured address
	PromptTokens int64   `json:"prompt_tokens"`
	CachedTokens int64   `json:"cached_tokens"`
	Booked       bool    `json:"booked"`
	Queued       bool    `json:"queued"`
	Replayed     bool    `json:"replayed"`
}

// Worker is the part of kvrouterd's worker the picker needs: where it listens.
type Worker struct {
	WorkerID uint64 `json:"worker_id"`
	Address  string `json:"address"`
}

// APIError is an answer of kvrouterd with a status other than 2xx.
type APIError struct {
	HTTPStatus int
	Status     string // kvr_status without KVR_, when the body had one
	Message    string
}

func (e *APIError) Error() string {
	return fmt.Sprintf("kvrouterd: HTTP %d %s: %s", e.HTTPStatus, e.Status, e.Message)
}

// Client calls kvrouterd's HTTP/JSON API.
type Client struct {
	base string // e.g. http://127.0.0.1:8080, without a trailing slash
	http *http.Client
}

// NewClient returns a client of the kvrouterd at baseURL.
func NewClient(baseURL string, httpClient *http.Client) *Client {
	if httpClient == nil {
		httpClient = http.DefaultClient
	}
	return &Client{base: strings.TrimRight(baseURL, "/"), http: httpClient}
}

// Route routes and books a request (POST /v1/route).
func (c *Client) Route(ctx context.Context, req *RouteRequest) (*Decision, error) {
	var d Decision
	if err := c.call(ctx, http.MethodPost, "/v1/route", req, &d); err != nil {
		return nil, err
	}
	return &d, nil
}

// PrefillCompleted tells the router the request's prompt is processed
// (POST /v1/requests/{id}/prefill_completed).
func (c *Client) PrefillCompleted(ctx context.Context, requestID string) error {
	return c.call(ctx, http.MethodPost, requestPath(requestID)+"/prefill_completed", nil, nil)
}

// Free releases the request's booking (DELETE /v1/requests/{id}).
func (c *Client) Free(ctx context.Context, requestID string) error {
	return c.call(ctx, http.MethodDelete, requestPath(requestID), nil, nil)
}

// Workers lists every worker (GET /v1/workers).
func (c *Client) Workers(ctx context.Context) ([]Worker, error) {
	var answer struct {
		Workers []Worker `json:"workers"`
	}
	if err := c.call(ctx, http.MethodGet, "/v1/workers", nil, &answer); err != nil {
		return nil, err
	}
	return answer.Workers, nil
}

// requestPath is /v1/requests/{id} with the id as one percent-encoded path segment: ids are
// the clients' x-request-id and may hold '/', '?' or spaces.
func requestPath(requestID string) string {
	return "/v1/requests/" + url.PathEscape(requestID)
}

// call sends in (if not nil) as JSON and decodes a 2xx answer into out (if not nil). A non-2xx
// answer is an *APIError; a transport failure is returned as is.
func (c *Client) call(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		encoded, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(encoded)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, body)
	if err != nil {
		return err
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	// Bounded: kvrouterd's answers are small; a runaway one must not exhaust memory.
	answer, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return apiError(resp.StatusCode, answer)
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(answer, out); err != nil {
		return fmt.Errorf("kvrouterd %s %s: bad answer: %w", method, path, err)
	}
	return nil
}

// apiError reads the contract's error body {"error": {"status", "message"}}, or keeps the
// raw text when the body is something else (a proxy's error page, say).
func apiError(httpStatus int, body []byte) *APIError {
	var parsed struct {
		Error struct {
			Status  string `json:"status"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &parsed) == nil && parsed.Error.Message != "" {
		return &APIError{HTTPStatus: httpStatus, Status: parsed.Error.Status, Message: parsed.Error.Message}
	}
	return &APIError{HTTPStatus: httpStatus, Message: strings.TrimSpace(string(body))}
}

// httpStatusOf is the HTTP status of err when it is an *APIError, or 0.
func httpStatusOf(err error) int {
	var apiErr *APIError
	if errors.As(err, &apiErr) {
		return apiErr.HTTPStatus
	}
	return 0
}
