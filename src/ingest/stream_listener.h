// The native stream source: TCP and Unix-socket listeners taking length-prefixed FlatBuffers
// EventBatches (wire/framing.h, wire/flatbuffers_codec.h) on the ingest loop. A frame header
// announcing an absurd length loses the stream's frame boundaries, so that connection is
// closed; a well-framed payload that fails verification is rejected alone and the connection
// goes on (its neighbours' events still apply).
#pragma once

#include <cstdint>
#include <list>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ingest/ingest_loop.h"
#include "wire/endpoint.h"

namespace kvrouter {

class StreamListeners {
 public:
  explicit StreamListeners(IngestLoop& loop) : loop_(loop) {}
  StreamListeners(const StreamListeners&) = delete;
  StreamListeners& operator=(const StreamListeners&) = delete;

  // Listens on "tcp://HOST:PORT" (PORT 0 = any free port) or "unix://PATH"; `bound` receives the
  // endpoint actually bound. Returns the source id. Any thread.
  absl::StatusOr<uint64_t> Listen(const std::string& endpoint, std::string* bound);
  // Closes every listener and connection. Loop thread (or before Start).
  void CloseAll();

 private:
  struct Listener;
  struct Connection;

  absl::Status ListenOnLoop(const StreamEndpoint& where, std::string* bound, uint64_t& id);
  // ListenOnLoop's bookkeeping once the listener listens: its bound endpoint, its source, its
  // place in the list. May throw std::bad_alloc (the caller then closes the listener).
  void Register(Listener& listener, const StreamEndpoint& where, std::string& bound, uint64_t& id);
  static void OnConnection(uv_stream_t* server, int status);
  // A connection arrived on `listener`: accepted, or turned away if the heap refuses it memory.
  void Arrive(Listener& listener);
  // Accepts the waiting connection into the listener's own spare handle and closes it at once.
  void TurnAway(Listener& listener);
  static void OnTurnedAway(uv_handle_t* handle);
  // Closes the listener; it is deleted once every handle of it has closed.
  static void CloseListener(Listener* listener);
  // One of its handles has closed: whether that was the last (the listener is then deleted).
  static bool ListenerHandleClosed(Listener* listener);
  void Accept(Listener& listener);
  static void OnRead(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf);
  // OnRead's work, which a refused allocation may cut short (OnRead contains it).
  void Read(Connection* conn, ssize_t nread, const uv_buf_t* buf);
  void CloseConnection(Connection* conn);
  // Applies one frame's batch; counted after it is handled, as engine messages are.
  void HandleFrame(const std::vector<uint8_t>& frame, SourceCounters& source);

  IngestLoop& loop_;
  std::list<Listener*> listeners_;
  std::list<Connection*> connections_;
};

}  // namespace kvrouter
