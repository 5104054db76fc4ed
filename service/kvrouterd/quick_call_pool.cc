#include "kvrouterd/quick_call_pool.h"

#include <new>

namespace kvrouterd {

QuickCallPool::QuickCallPool(uv_loop_t* loop, uint32_t threads) {
  uv_async_init(loop, &completed_, [](uv_async_t* handle) {
    static_cast<QuickCallPool*>(handle->data)->RunCompletions();
  });
  completed_.data = this;
  threads_.reserve(threads);
  for (uint32_t i = 0; i < threads; ++i) threads_.emplace_back([this] { Serve(); });
}

QuickCallPool::~QuickCallPool() {
  if (threads_.empty()) return;  // Close() joined them
  // Not closed (the daemon stopped on an exception): the threads still stop, the calls queued
  // run (their completions never will: the loop is gone).
  {
    std::lock_guard lock(mutex_);
    closing_ = true;
  }
  wake_.notify_all();
  for (std::thread& thread : threads_) thread.join();
}

void QuickCallPool::Submit(std::function<void()> work, std::function<void()> done) {
  {
    std::lock_guard lock(mutex_);
    queued_.push_back({std::move(work), std::move(done)});  // on the loop: may throw
  }
  wake_.notify_one();
}

void QuickCallPool::Close() {
  {
    std::lock_guard lock(mutex_);
    closing_ = true;
  }
  wake_.notify_all();
  for (std::thread& thread : threads_) thread.join();
  threads_.clear();
  // Completions posted after the loop last woke for them run here, before the handle goes.
  RunCompletions();
  uv_close(reinterpret_cast<uv_handle_t*>(&completed_), nullptr);
}

void QuickCallPool::Serve() {
  for (;;) {
    std::list<Call> mine;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return closing_ || !queued_.empty(); });
      if (queued_.empty()) return;  // closing, and nothing left to run
      mine.splice(mine.begin(), queued_, queued_.begin());
    }
    Call& call = mine.front();
    try {
      call.work();
    } catch (...) {
      // `work` answers its own errors; whatever escapes, its completion still runs (the daemon
      // waits for every call before it stops).
    }
    // Its captures go here, while `done` still holds what they share with it: the last
    // reference to that goes on the loop.
    call.work = nullptr;
    {
      std::lock_guard lock(mutex_);
      done_.splice(done_.end(), mine);
    }
    uv_async_send(&completed_);
  }
}

void QuickCallPool::RunCompletions() {
  std::list<Call> done;
  {
    std::lock_guard lock(mutex_);
    done.swap(done_);
  }
  // On the loop (a uv_async callback): a completion the heap refused must not unwind into
  // libuv; the others still run.
  for (Call& call : done) {
    try {
      call.done();
    } catch (const std::bad_alloc&) {
    }
  }
}

}  // namespace kvrouterd
