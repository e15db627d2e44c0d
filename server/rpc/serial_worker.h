// File: server/rpc/serial_worker.h
//
// One thread running posted tasks in order (the daemon's worker, the
// snapshot keeper's copier and sender).
//
// Threading: Post and Stop are thread-safe. Stop (and the destructor) runs
// the tasks already queued, then joins; tasks posted after Stop are dropped.
// Never call Stop from a task of the same worker.
#ifndef PARAMD_SERVER_RPC_SERIAL_WORKER_H_
#define PARAMD_SERVER_RPC_SERIAL_WORKER_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace paramd {

class SerialWorker {
 public:
  SerialWorker() : thread_([this] { Run(); }) {}
  ~SerialWorker() { Stop(); }
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  void Post(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    tasks_.push_back(std::move(task));
    cv_.notify_one();
  }

  // Whether tasks wait behind the running one (or Stop was called): the
  // daemon's pipelined step, waiting for pushes, gives the worker up then.
  bool HasPending() {
    std::lock_guard<std::mutex> lock(mu_);
    return stop_ || !tasks_.empty();
  }

  // Runs the queued tasks, then joins. Idempotent.
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_RPC_SERIAL_WORKER_H_
