// Runs a piece of a test in a child process, so that a crash or a hang there is a finding the
// parent reports like any other (the allocation-failure sweeps refuse allocations that may
// well crash the code under test). The child writes what it has to say to a pipe.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

struct ChildRun {
  std::string output;   // everything the child wrote to its fd
  int wait_status = 0;  // as waitpid gives it (WIFSIGNALED, WEXITSTATUS, ...)
};

// `body(fd)` in a forked child that then exits with 0 (unless `body` exits first); what it
// wrote to `fd`, and how it ended.
template <typename Body>
ChildRun RunInChild(Body body) {
  int fds[2];
  if (pipe(fds) != 0) std::abort();
  std::fflush(nullptr);  // nothing buffered is written twice
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    body(fds[1]);
    _exit(0);
  }
  close(fds[1]);
  ChildRun run;
  char buffer[4096];
  for (ssize_t got; (got = read(fds[0], buffer, sizeof buffer)) > 0;) {
    run.output.append(buffer, static_cast<size_t>(got));
  }
  close(fds[0]);
  waitpid(pid, &run.wait_status, 0);
  return run;
}
