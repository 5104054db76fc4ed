// A TCP proxy on 127.0.0.1 between clients and one server, for tests of what a network does
// to a connection: it forwards both ways, can lose what the server sends while the connection
// stays up (as a path that drops packets before either end sees it break), and can cut every
// connection.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

namespace kvrouter {

class TcpProxy {
 public:
  explicit TcpProxy(int server_port) : server_port_(server_port) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address = Loopback(0);
    if (listener_ < 0 ||
        bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        listen(listener_, 16) != 0) {
      return;
    }
    socklen_t length = sizeof(address);
    getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    acceptor_ = std::thread([this] { Accept(); });
  }
  ~TcpProxy() {
    stopping_ = true;
    shutdown(listener_, SHUT_RDWR);
    if (acceptor_.joinable()) acceptor_.join();
    close(listener_);
    CutConnections();
    for (std::thread& pump : pumps_) pump.join();
  }
  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  int port() const { return port_; }  // 0: it could not listen
  // While set, what the server sends is read and thrown away.
  void LoseServerBytes(bool lose) { losing_ = lose; }
  // From now on what the server sends is kept, not forwarded, until ReleaseThenLose.
  void HoldServerBytes() {
    std::lock_guard lock(hold_mutex_);
    holding_ = true;
  }
  // Forwards what was kept, then forwards again (Release) or loses (ReleaseThenLose) what the
  // server sends.
  void Release() { Forward(/*then_lose=*/false); }
  void ReleaseThenLose() { Forward(/*then_lose=*/true); }
  // Every connection made so far is closed at both ends (new ones are forwarded).
  void CutConnections() {
    std::lock_guard lock(mutex_);
    for (int fd : open_) shutdown(fd, SHUT_RDWR);
  }

 private:
  static sockaddr_in Loopback(int port) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return address;
  }

  void Accept() {
    while (!stopping_) {
      const int client = accept(listener_, nullptr, nullptr);
      if (client < 0) return;  // shut down
      const int server = socket(AF_INET, SOCK_STREAM, 0);
      const sockaddr_in address = Loopback(server_port_);
      if (connect(server, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
        close(server);
        close(client);
        continue;
      }
      std::lock_guard lock(mutex_);
      open_.insert(open_.end(), {client, server});
      pumps_.emplace_back([this, client, server] { Pump(client, server); });
    }
  }

  // Forwards until either end closes (or is cut), then closes both.
  void Pump(int client, int server) {
    pollfd fds[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
    char buffer[65536];
    for (bool open = true; open;) {
      if (poll(fds, 2, -1) < 0) break;
      for (int from = 0; from < 2 && open; ++from) {
        if (fds[from].revents == 0) continue;
        const ssize_t n = read(fds[from].fd, buffer, sizeof(buffer));
        if (n <= 0) {
          open = false;
        } else if (from == 0 || !(Held(buffer, n, fds[0].fd) || losing_)) {
          open = WriteAll(fds[1 - from].fd, buffer, static_cast<size_t>(n));
        }
      }
    }
    std::lock_guard lock(mutex_);
    std::erase(open_, client);
    std::erase(open_, server);
    close(client);
    close(server);
  }

  void Forward(bool then_lose) {
    std::lock_guard lock(hold_mutex_);
    if (held_for_ >= 0) WriteAll(held_for_, held_.data(), held_.size());
    held_.clear();
    holding_ = false;
    losing_ = then_lose;
  }
  // Keeps what the server sent for `client` while holding: whether it did.
  bool Held(const char* data, ssize_t n, int client) {
    std::lock_guard lock(hold_mutex_);
    if (!holding_) return false;
    held_.insert(held_.end(), data, data + n);
    held_for_ = client;
    return true;
  }

  static bool WriteAll(int fd, const char* data, size_t size) {
    while (size > 0) {
      const ssize_t n = send(fd, data, size, MSG_NOSIGNAL);
      if (n <= 0) return false;
      data += n;
      size -= static_cast<size_t>(n);
    }
    return true;
  }

  const int server_port_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> losing_{false};
  std::thread acceptor_;
  std::mutex mutex_;
  std::vector<int> open_;           // guarded by mutex_
  std::vector<std::thread> pumps_;  // guarded by mutex_ (joined after the acceptor stops)
  std::mutex hold_mutex_;
  bool holding_ = false;    // guarded by hold_mutex_
  std::vector<char> held_;  // guarded by hold_mutex_
  int held_for_ = -1;       // guarded by hold_mutex_: the client it was sent to
};

}  // namespace kvrouter
