// A child process the fault tests command line by line (its stdin and stdout are pipes; its
// stderr is the test's, so that a sanitizer report of the child shows in the test's log), and
// kill with SIGKILL. Started with posix_spawn: nothing runs between fork and exec in this
// multi-threaded process.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

extern char** environ;

namespace kvr_fault {

class ChildProcess {
 public:
  // Starts `path` with `args`; pid() is -1 if it could not be started.
  ChildProcess(const std::string& path, const std::vector<std::string>& args) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0) return;
    if (pipe2(out, O_CLOEXEC) != 0) {
      close(in[0]);
      close(in[1]);
      return;
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    std::vector<std::string> argv_storage{path};
    argv_storage.insert(argv_storage.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : argv_storage) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, path.c_str(), &actions, nullptr, argv.data(), environ) != 0) {
      pid_ = -1;
    }
    posix_spawn_file_actions_destroy(&actions);
    close(in[0]);
    close(out[1]);
    to_child_ = in[1];
    from_child_ = out[0];
  }
  ~ChildProcess() {
    Kill();
    if (to_child_ >= 0) close(to_child_);
    if (from_child_ >= 0) close(from_child_);
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  bool alive() const { return pid_ > 0; }

  // Sends `line` and returns the reply line, or nullopt if none came within `timeout` (or the
  // child is gone).
  std::optional<std::string> Command(const std::string& line,
                                     std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    if (!Send(line)) return std::nullopt;
    return ReadLine(timeout);
  }

  // Sends `line` without waiting for the reply (read it later with ReadLine, or never).
  bool Send(const std::string& line) {
    const std::string out = line + "\n";
    size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = write(to_child_, out.data() + done, out.size() - done);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }

  std::optional<std::string> ReadLine(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (const size_t nl = buffer_.find('\n'); nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{from_child_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char buf[65536];
      const ssize_t n = read(from_child_, buf, sizeof buf);
      if (n <= 0) return std::nullopt;
      buffer_.append(buf, static_cast<size_t>(n));
    }
  }

  // SIGKILL, then reaped.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // Closes its stdin and waits for it to exit by itself; its exit status (-1 if it was killed
  // by a signal or is not running).
  int Wait() {
    if (pid_ <= 0) return -1;
    if (to_child_ >= 0) {
      close(to_child_);
      to_child_ = -1;
    }
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buffer_;
};

}  // namespace kvr_fault
