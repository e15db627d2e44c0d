#include "server/coordinator/coordinator_state.h"

#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace paramd {
namespace {

constexpr int kFormat = 1;

}  // namespace

absl::StatusOr<std::optional<rpc::CoordinatorState>> ReadStateFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (errno == ENOENT) return std::optional<rpc::CoordinatorState>();
    return ErrnoStatus(errno, "cannot open state file", path);
  }
  std::stringstream bytes;
  bytes << in.rdbuf();
  rpc::CoordinatorState state;
  if (!state.ParseFromString(bytes.str())) {
    return absl::DataLossError(absl::StrCat("state file ", path, " does not parse"));
  }
  if (state.format() != kFormat) {
    return absl::FailedPreconditionError(absl::StrCat(
        "state file ", path, " has format ", state.format(), ", this build reads ", kFormat));
  }
  return std::optional<rpc::CoordinatorState>(std::move(state));
}

absl::Status WriteStateFile(const std::string& path, const rpc::CoordinatorState& state) {
  rpc::CoordinatorState copy = state;
  copy.set_format(kFormat);
  // It holds the cluster's secrets: 0600, through a fresh temporary name
  // that a symlink planted beside it cannot redirect.
  return WriteFileAtomically(path, copy.SerializeAsString(), 0600);
}

StateWriter::StateWriter(std::string path, std::function<rpc::CoordinatorState()> make_state)
    : path_(std::move(path)), make_state_(std::move(make_state)), thread_([this] { Run(); }) {}

StateWriter::~StateWriter() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
  std::vector<std::pair<int64_t, std::function<void()>>> left;
  {
    absl::MutexLock lock(&mu_);
    left.swap(waiting_);
  }
  for (auto& [mark, then] : left) then();
}

void StateWriter::WhenWritten(std::function<void()> then) {
  {
    absl::MutexLock lock(&mu_);
    if (written_ < marked_ && !stop_) {
      waiting_.emplace_back(marked_, std::move(then));
      return;
    }
  }
  then();
}

void StateWriter::MarkDirty() {
  absl::MutexLock lock(&mu_);
  ++marked_;
}

absl::Status StateWriter::Flush() {
  absl::MutexLock lock(&mu_);
  const int64_t want = marked_;
  auto done = [this, want]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return written_ >= want || stop_; };
  mu_.Await(absl::Condition(&done));
  return last_;
}

void StateWriter::Run() {
  for (;;) {
    int64_t mark;
    bool last;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || marked_ > written_; };
      mu_.Await(absl::Condition(&ready));
      if (marked_ == written_) return;  // stopping, nothing new
      mark = marked_;
      last = stop_;
    }
    const absl::Status s = WriteStateFile(path_, make_state_());
    if (!s.ok())
      LogError("coordinator", absl::StrCat("writing the state file failed: ", s.ToString()));
    std::vector<std::function<void()>> ready;
    {
      absl::MutexLock lock(&mu_);
      written_ = mark;
      last_ = s;
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if (it->first <= written_) {
          ready.push_back(std::move(it->second));
          it = waiting_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& then : ready) then();
    absl::MutexLock lock(&mu_);
    if (last && marked_ == written_) return;
  }
}

}  // namespace paramd
