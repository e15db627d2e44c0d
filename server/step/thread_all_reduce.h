// File: server/step/thread_all_reduce.h
//
// TEST ONLY. A MAX all-reduce between the threads of one test, standing in
// for the daemons' transport (the multi-process tests use the real one):
// every member's call blocks until all `n` have called, then each gets the
// element-wise maximum. Thread-safe; reusable for any number of rounds.
#ifndef PARAMD_SERVER_STEP_THREAD_ALL_REDUCE_H_
#define PARAMD_SERVER_STEP_THREAD_ALL_REDUCE_H_

#include <cmath>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "server/step/shard_set.h"

namespace paramd {

class ThreadAllReduce {
 public:
  explicit ThreadAllReduce(int n) : n_(n) {}
  AllReduceMaxFn Member() {
    return [this](absl::Span<float> v) {
      std::unique_lock<std::mutex> lock(mu_);
      const int gen = generation_;
      if (arrived_ == 0) acc_.assign(v.begin(), v.end());
      for (size_t i = 0; i < v.size(); ++i) acc_[i] = std::fmax(acc_[i], v[i]);
      if (++arrived_ == n_) {
        result_ = acc_;
        arrived_ = 0;
        ++generation_;
        cv_.notify_all();
      } else {
        cv_.wait(lock, [&] { return generation_ != gen; });
      }
      std::copy(result_.begin(), result_.end(), v.begin());
      return absl::OkStatus();
    };
  }

 private:
  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int generation_ = 0;
  std::vector<float> acc_, result_;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_STEP_THREAD_ALL_REDUCE_H_
