// Package kvrouter is the Go binding of kvrouter, a KV-cache-aware LLM request router: a thin
// wrapper over its C ABI (include/kvrouter.h, libkvrouter.so), found with pkg-config.
//
// A gateway creates a Router, registers its workers, feeds it the KV events its engines
// publish (directly, as encoded EventBatches, or through an Ingest listening on sockets or
// NATS), and asks per request which worker and data-parallel rank should serve a prompt
// (FindBestMatch, or PreviewRoute / PlanRoute / CommitRoute). It then reports the prefill's
// end (MarkPrefillCompleted), optionally the output generated so far (RecordOutput, on a router
// with TrackOutputBlocks), and the request's end (FreeRequest). A prompt is its token ids, or,
// hashed by the caller (ComputeBlockHashes), RequestOptions.Prehashed with nil tokens.
//
// Errors are *Error values carrying the library's kvr_status (Code) and message; the Err*
// Status constants work with errors.Is. Handles (Router, Disagg, Ingest, EventBatch,
// Publisher) are released by Close, which is idempotent; a finalizer frees a forgotten handle.
// Router, Disagg and Ingest are safe for concurrent use, Close included (an object closed under
// calls in flight is freed when the last of them returns; a Router's Close first cancels the
// requests waiting in its admission queue, an Ingest's stops it), EventBatch and Publisher are not,
// following the @thread_safety tags of the header. Slices and strings passed in are only
// borrowed for the call. A string holding a NUL byte (request ids, names, endpoints, ...),
// which C would read as its end, is refused with ErrInvalidArgument naming it, before any call
// into the library.
//
// This release of the package is for libkvrouter 0.2.x. It checks the loaded library's version
// when it is initialised: with any other major.minor, CheckVersion and every constructor return
// ErrFailedPrecondition naming both versions, and the constructors do not call into the library.
package kvrouter
