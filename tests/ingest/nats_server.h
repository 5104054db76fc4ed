// A real nats-server (Debian's package) for the tests that need one: started as a child
// process on 127.0.0.1 on a free port, killed when the test ends.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

namespace kvrouter {

// Whether 127.0.0.1:port can be bound now.
inline bool Bindable(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// The lowest port the kernel hands out by itself (ip_local_port_range; 32768 by default).
inline int EphemeralPortsStart() {
  FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
  int low = 32768, high = 60999;
  if (f != nullptr) {
    if (std::fscanf(f, "%d %d", &low, &high) != 2) low = 32768;
    std::fclose(f);
  }
  return low;
}

// A port for a test's server, below the ephemeral range: a port the kernel chose for a bind
// to port 0 may be handed out again at once, to a listener of the same test bound to port 0 or
// as the local port of an outgoing connection (a ZMQ subscriber reconnecting), so the server
// then fails to bind ("Address already in use"). Each process walks its own stretch from a
// start drawn from its pid, skipping ports bound now.
inline int FreePort() {
  static int next = -1;
  const int top = EphemeralPortsStart();
  const int bottom = top > 12000 ? top - 12000 : 1024;
  if (next < 0) next = bottom + static_cast<int>(getpid() * 997L % (top - bottom));
  for (int tries = 0; tries < top - bottom; ++tries) {
    const int port = next;
    next = next + 1 < top ? next + 1 : bottom;
    if (Bindable(port)) return port;
  }
  return -1;
}

// Whether something accepts TCP connections on 127.0.0.1:port.
inline bool Accepts(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// A nats-server child process on 127.0.0.1:port.
class NatsServer {
 public:
  // `store_dir` not empty: JetStream on, its streams kept there (so they survive a restart).
  // `config_file` not empty: the server's configuration file (-c), e.g. a smaller max_payload.
  explicit NatsServer(int port, std::string store_dir = "", std::string config_file = "")
      : port_(port), store_dir_(std::move(store_dir)), config_file_(std::move(config_file)) {}
  ~NatsServer() { Stop(); }

  // Starts the server and waits (bounded) until it accepts connections.
  bool Start() {
    // The command line is built before the fork: the child of a process with threads must not
    // allocate (another thread may have held the heap's lock at the fork).
    const std::string port = std::to_string(port_);
    std::vector<const char*> argv = {"nats-server", "-a", "127.0.0.1", "-p", port.c_str()};
    if (!store_dir_.empty()) argv.insert(argv.end(), {"-js", "-sd", store_dir_.c_str()});
    if (!config_file_.empty()) argv.insert(argv.end(), {"-c", config_file_.c_str()});
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      const int devnull = open("/dev/null", O_WRONLY);
      dup2(devnull, 1);
      dup2(devnull, 2);
      execv("/usr/sbin/nats-server", const_cast<char* const*>(argv.data()));
      _exit(127);
    }
    if (pid_ < 0) return false;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      if (Accepts(port_)) return true;
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {  // died (port taken?)
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  std::string url() const { return "nats://127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }

 private:
  int port_;
  std::string store_dir_;
  std::string config_file_;
  pid_t pid_ = -1;
};

}  // namespace kvrouter
