// Threads of the daemon's own for calls that never wait in the router's admission queue but may
// cost real time to parse (a preview's prompt: a 4 MiB body of token ids is tens of
// milliseconds of JSON). On the event loop such a parse stalls every connection; on libuv's
// thread pool it would queue behind routing calls waiting in the admission queue (all
// `routing-threads` of them may be). Each call runs on one of these threads; what follows it
// (the answer) runs on the loop.
#pragma once

#include <uv.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace kvrouterd {

class QuickCallPool {
 public:
  // `threads` (at least 1) started now; completions run on `loop`.
  QuickCallPool(uv_loop_t* loop, uint32_t threads);
  // Close() must have been called, and the loop run until its handle closed.
  ~QuickCallPool();
  QuickCallPool(const QuickCallPool&) = delete;
  QuickCallPool& operator=(const QuickCallPool&) = delete;

  // Runs `work` on a pool thread, then `done` on the loop (whatever `work` throws). What `work`
  // captures is destroyed on the pool thread: share with `done` what must end on the loop.
  // Loop thread only.
  void Submit(std::function<void()> work, std::function<void()> done);
  // Lets the threads finish the calls queued, joins them, and closes the loop handle (whose
  // last completions then run). Loop thread only.
  void Close();

 private:
  struct Call {
    std::function<void()> work;
    std::function<void()> done;
  };
  void Serve();
  void RunCompletions();

  uv_async_t completed_{};  // wakes the loop for the calls done
  std::mutex mutex_;
  std::condition_variable wake_;
  // A call moves from queued_ to its thread's list and on to done_ by splicing its node: the
  // pool thread allocates nothing (a refusal there would end the process).
  std::list<Call> queued_;
  std::list<Call> done_;  // calls run, their completion not yet
  bool closing_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvrouterd
