// A mutex that spins a little before it sleeps (glibc's PTHREAD_MUTEX_ADAPTIVE_NP), for locks
// held a microsecond or two by callers on other cores: the Router's admission gate, taken
// three times per request (candidates, pick and booking, release). std::mutex sleeps in the
// kernel at the first contention, and the wake-up costs more than the wait would have.
//
// Thread-safety: a mutex (BasicLockable, Lockable); not recursive.
#pragma once

#include <pthread.h>

namespace kvrouter {

class AdaptiveMutex {
 public:
  AdaptiveMutex() {
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
    pthread_mutex_init(&mutex_, &attr);
    pthread_mutexattr_destroy(&attr);
  }
  ~AdaptiveMutex() { pthread_mutex_destroy(&mutex_); }
  AdaptiveMutex(const AdaptiveMutex&) = delete;
  AdaptiveMutex& operator=(const AdaptiveMutex&) = delete;

  void lock() { pthread_mutex_lock(&mutex_); }
  bool try_lock() { return pthread_mutex_trylock(&mutex_) == 0; }
  void unlock() { pthread_mutex_unlock(&mutex_); }

 private:
  pthread_mutex_t mutex_;
};

}  // namespace kvrouter
