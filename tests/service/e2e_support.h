// What the end-to-end tests of kvrouterd need: the daemon as a child process (started with
// posix_spawn, signalled, waited for with a deadline), a small HTTP/1.1 client over plain
// sockets, and polling with a deadline.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace kvrouterd_test {

using Clock = std::chrono::steady_clock;

// Polls `done` every 20 ms until it holds or `seconds` pass (generous: sanitizer builds are slow).
inline bool WaitFor(const std::function<bool()>& done, double seconds = 30) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done();
}

class DaemonProcess {
 public:
  // Starts `binary args...`, its stderr into `stderr_path` if given; pid() is -1 if that failed.
  DaemonProcess(const std::string& binary, const std::vector<std::string>& args,
                const std::string& stderr_path = "") {
    std::vector<std::string> storage{binary};
    storage.insert(storage.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : storage) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    if (!stderr_path.empty()) {
      posix_spawn_file_actions_addopen(&actions, 2, stderr_path.c_str(),
                                       O_WRONLY | O_CREAT | O_TRUNC, 0644);
    }
    if (posix_spawn(&pid_, binary.c_str(), &actions, nullptr, argv.data(), environ) != 0) {
      pid_ = -1;
    }
    posix_spawn_file_actions_destroy(&actions);
  }
  ~DaemonProcess() {
    if (pid_ > 0 && !exit_status_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  pid_t pid() const { return pid_; }
  void Signal(int signum) const { kill(pid_, signum); }

  // The exit code once it exited (within `seconds`), -1 if killed by a signal; nullopt if it
  // still runs.
  std::optional<int> WaitExit(double seconds = 30) {
    WaitFor(
        [&] {
          int status = 0;
          if (!exit_status_ && waitpid(pid_, &status, WNOHANG) == pid_) exit_status_ = status;
          return exit_status_.has_value();
        },
        seconds);
    if (!exit_status_) return std::nullopt;
    return WIFEXITED(*exit_status_) ? WEXITSTATUS(*exit_status_) : -1;
  }

 private:
  pid_t pid_ = -1;
  std::optional<int> exit_status_;
};

struct HttpAnswer {
  int status = 0;  // 0: no answer (connection failed)
  std::string head;
  std::string body;
};

// A connection to 127.0.0.1:`port`, -1 if refused. `receive_buffer_bytes` > 0 fixes the
// socket's receive buffer (no autotuning): a client that reads nothing then holds little.
inline int Connect(int port, int receive_buffer_bytes = 0) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (receive_buffer_bytes > 0) {
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receive_buffer_bytes, sizeof receive_buffer_bytes);
  }
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    close(fd);
    return -1;
  }
  timeval timeout{30, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  return fd;
}

inline bool SendAll(int fd, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

// Everything the server sends until it closes the connection.
inline std::string ReadToEnd(int fd) {
  std::string bytes;
  char buffer[65536];
  for (;;) {
    const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) break;
    bytes.append(buffer, static_cast<size_t>(n));
  }
  return bytes;
}

inline std::string RequestText(const std::string& method, const std::string& path,
                               const std::string& body, const std::string& extra_headers = "") {
  std::string text = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra_headers;
  if (!body.empty() || method == "POST" || method == "PUT") {
    text += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  }
  return text + "\r\n" + body;
}

// Splits answers read back to back (Content-Length bodies).
inline std::vector<HttpAnswer> ParseAnswers(const std::string& bytes) {
  std::vector<HttpAnswer> answers;
  size_t pos = 0;
  while (pos < bytes.size()) {
    const size_t end = bytes.find("\r\n\r\n", pos);
    if (end == std::string::npos) break;
    HttpAnswer answer;
    answer.head = bytes.substr(pos, end - pos);
    answer.status = std::stoi(answer.head.substr(9, 3));
    size_t length = 0;
    const size_t header = answer.head.find("Content-Length: ");
    if (header != std::string::npos) length = std::stoul(answer.head.substr(header + 16));
    answer.body = bytes.substr(end + 4, length);
    pos = end + 4 + length;
    answers.push_back(std::move(answer));
  }
  return answers;
}

// One request on its own connection (Connection: close).
inline HttpAnswer Http(int port, const std::string& method, const std::string& path,
                       const std::string& body = "") {
  const int fd = Connect(port);
  if (fd < 0) return {};
  SendAll(fd, RequestText(method, path, body, "Connection: close\r\n"));
  const std::vector<HttpAnswer> answers = ParseAnswers(ReadToEnd(fd));
  close(fd);
  return answers.empty() ? HttpAnswer{} : answers.front();
}

// The value of an unlabelled series in a Prometheus text ("name value" lines); -1 if absent.
inline double MetricValue(const std::string& text, const std::string& name) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.size() > name.size() && line.compare(0, name.size() + 1, name + " ") == 0) {
      return std::stod(line.substr(name.size() + 1));
    }
  }
  return -1;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace kvrouterd_test
