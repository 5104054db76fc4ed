// A NATS server played by hand on 127.0.0.1, for the tests of what libnats and the ingest do
// when a server is slow, silent, or hangs up at a chosen point.
#pragma once

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace kvrouter {

// A NATS server on 127.0.0.1:`port` that takes a TCP connection and says nothing until told to
// answer: libnats waits for its INFO until the connect timeout (2 s), then gives it up.
class SlowNatsServer {
 public:
  explicit SlowNatsServer(int port) : port_(port) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    const int on = 1;
    setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    listening_ = bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                 listen(listener_, 8) == 0;
  }
  ~SlowNatsServer() {
    if (held_ >= 0) close(held_);
    close(listener_);
  }
  SlowNatsServer(const SlowNatsServer&) = delete;
  SlowNatsServer& operator=(const SlowNatsServer&) = delete;

  bool listening() const { return listening_; }
  int port() const { return port_; }
  // Takes the first connection to come within `at_most`.
  bool Accept(std::chrono::milliseconds at_most) {
    if (!Readable(listener_, at_most)) return false;
    held_ = accept(listener_, nullptr, nullptr);
    return held_ >= 0;
  }
  // Whether the client still waits on the connection taken (it has not given it up).
  bool StillHeld() const {
    char byte;
    return recv(held_, &byte, 1, MSG_PEEK | MSG_DONTWAIT) < 0 && errno == EAGAIN;
  }
  // Answers as a NATS server: INFO, then PONG to the client's CONNECT and PING (its connect
  // then succeeds). Whether the client got that far within `at_most`.
  bool Answer(std::chrono::milliseconds at_most) {
    const std::string info =
        "INFO {\"server_id\":\"slow\",\"version\":\"2.10.0\",\"proto\":1,\"max_payload\":1048576}"
        "\r\n";
    if (send(held_, info.data(), info.size(), MSG_NOSIGNAL) < 0) return false;
    std::string heard;
    while (heard.find("PING\r\n") == std::string::npos) {
      char buffer[512];
      if (!Readable(held_, at_most)) return false;
      const ssize_t n = recv(held_, buffer, sizeof(buffer), 0);
      if (n <= 0) return false;
      heard.append(buffer, static_cast<size_t>(n));
    }
    return send(held_, "PONG\r\n", 6, MSG_NOSIGNAL) == 6;
  }
  // After Answer: waits for the client's subscription and the PING that asks the server to
  // confirm it, then delivers `payload` on that subscription (and answers nothing).
  bool DeliverUnconfirmed(const std::vector<uint8_t>& payload, std::chrono::milliseconds at_most) {
    std::string heard;
    size_t sub = std::string::npos;
    while (sub == std::string::npos || heard.find("PING\r\n", sub) == std::string::npos) {
      char buffer[512];
      if (!Readable(held_, at_most)) return false;
      const ssize_t n = recv(held_, buffer, sizeof(buffer), 0);
      if (n <= 0) return false;
      heard.append(buffer, static_cast<size_t>(n));
      sub = heard.find("SUB ");
    }
    // "SUB <subject> [<queue>] <sid>"
    const std::string line = heard.substr(sub, heard.find("\r\n", sub) - sub);
    const std::string subject = line.substr(4, line.find(' ', 4) - 4);
    const std::string sid = line.substr(line.rfind(' ') + 1);
    const std::string message = "MSG " + subject + " " + sid + " " +
                                std::to_string(payload.size()) + "\r\n" +
                                std::string(payload.begin(), payload.end()) + "\r\n";
    return send(held_, message.data(), message.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(message.size());
  }
  // Whether the client closes the connection within `at_most` (what it sends is read away).
  bool ClosedByClient(std::chrono::milliseconds at_most) {
    const auto deadline = std::chrono::steady_clock::now() + at_most;
    char buffer[512];
    while (std::chrono::steady_clock::now() < deadline) {
      if (!Readable(held_, std::chrono::milliseconds(100))) continue;
      const ssize_t n = recv(held_, buffer, sizeof(buffer), 0);
      if (n == 0) return true;
      if (n < 0 && errno != EAGAIN && errno != EINTR) return true;  // reset
    }
    return false;
  }

 private:
  static bool Readable(int fd, std::chrono::milliseconds at_most) {
    pollfd ready{.fd = fd, .events = POLLIN, .revents = 0};
    return poll(&ready, 1, static_cast<int>(at_most.count())) == 1;
  }

  int port_;
  int listener_ = -1;
  int held_ = -1;
  bool listening_ = false;
};

}  // namespace kvrouter
