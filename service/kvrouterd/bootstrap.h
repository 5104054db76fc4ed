// Warm start from a peer (--bootstrap-from): a new or restarted replica fetches a running
// peer's index snapshot together with the JetStream positions the peer had applied when it took
// it, restores the snapshot, then consumes each stream from the position after the peer's. The
// positions are read before the snapshot is taken, so events between the two are applied twice,
// in order, which leaves the index as it was (kvr_jetstream_source.start_sequence).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace kvrouterd {

// The header of GET /v1/snapshot that carries the positions: "STREAM=SEQ[, STREAM=SEQ...]".
inline constexpr const char* kStreamSequencesHeader = "Kvrouter-Stream-Sequences";

// Stream name -> the last stream sequence applied before the snapshot was taken.
using StreamSequences = std::map<std::string, uint64_t>;

std::string FormatStreamSequences(const StreamSequences& sequences);
// nullopt if `text` is not a list of STREAM=SEQ.
std::optional<StreamSequences> ParseStreamSequences(std::string_view text);

struct PeerSnapshot {
  std::string bytes;  // the body of GET /v1/snapshot
  StreamSequences sequences;
};

// http://HOST:PORT (a trailing "/" allowed; HOST a name or an address): "" and the parts set,
// or why it is not such a URL.
std::string ParsePeerUrl(std::string_view url, std::string* host, int* port);

// Splits a whole HTTP/1.1 answer to GET /v1/snapshot into the snapshot: "" on success, else
// why not (not HTTP, not 200, cut short, a bad positions header).
std::string ParseSnapshotAnswer(const std::string& answer, PeerSnapshot* out);

// GET `peer_url`/v1/snapshot over HTTP/1.1 within `timeout` per connect and read: the snapshot,
// or nullopt with `*error` saying why (unreachable, not 200, bad header).
std::optional<PeerSnapshot> FetchPeerSnapshot(const std::string& peer_url,
                                              std::chrono::milliseconds timeout,
                                              std::string* error);

}  // namespace kvrouterd
