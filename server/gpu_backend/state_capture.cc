#include "server/gpu_backend/state_capture.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/gpu_status.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace paramd {
namespace gpu_backend {
namespace {

// Two page-locked buffers of this size: the download alternates between
// them (one is filled by the device while the other is copied out).
constexpr size_t kBounceBytes = size_t{32} << 20;

// The copy out of a bounce buffer into the snapshot's pageable vectors is
// the slow half of the download (one core's memcpy, and first-touch page
// faults into vectors that are not recycled yet): it is split over up to
// this many threads (a quarter of the machine's cores at most).
int CopyOutThreads() {
  static const int threads = [] {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    return std::clamp(cores / 4, 1, 8);
  }();
  return threads;
}

// memcpy of `bytes` from `src` to `dst` split over `threads` threads (this
// one included), in 64 KiB-aligned slices.
void ParallelMemcpy(void* dst, const void* src, size_t bytes, int threads) {
  constexpr size_t kAlign = size_t{64} << 10;
  const size_t slice = (bytes / threads + kAlign - 1) / kAlign * kAlign;
  if (threads <= 1 || slice >= bytes) {
    std::memcpy(dst, src, bytes);
    return;
  }
  auto copy = [&](size_t begin) {
    const size_t end = std::min(bytes, begin + slice);
    std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin,
                end - begin);
  };
  std::vector<std::thread> helpers;
  for (size_t begin = slice; begin < bytes; begin += slice) helpers.emplace_back(copy, begin);
  copy(0);
  for (std::thread& t : helpers) t.join();
}

// Device memory left free beside the spare: the store's later growth (the
// push staging buffer), NCCL and the same-GPU trainers' mappings.
int64_t Reserve(size_t total) {
  return std::max<int64_t>(int64_t{2} << 30, static_cast<int64_t>(total / 20));
}

int64_t Count(const GpuShardDef& d) { return d.rows * d.cols; }

}  // namespace

// One capture: where its arrays are (the spare or the live buffers) and
// which exist. Holds the spare (and so the store) until copied.
class DeviceSnapshotSpare::Capture_ : public StateCapture {
 public:
  Capture_(std::shared_ptr<DeviceSnapshotSpare> owner, bool spare, bool moments)
      : owner_(std::move(owner)), spare_(spare), moments_(moments) {}
  ~Capture_() override { owner_->in_use_.store(false); }

  absl::string_view kind() const override { return spare_ ? "device spare" : "device direct"; }
  bool reads_live_state() const override { return !spare_; }

  absl::Status Copy(std::vector<std::array<std::vector<float>, 3>>& arrays) override {
    GpuShardStore& store = *owner_->store_;
    const std::vector<GpuShardDef>& shards = store.shards();
    // Into the vectors `arrays` already has (a recycled snapshot's, of the
    // same sizes): resize keeps their memory and does not fill it.
    arrays.resize(shards.size());
    std::vector<Piece> pieces;
    for (size_t i = 0; i < shards.size(); ++i) {
      const int s = static_cast<int>(i);
      const float* live[3] = {store.master(s), store.exp_avg(s), store.exp_avg_sq(s)};
      for (int k = 0; k < 3; ++k) {
        if (live[k] == nullptr || (k > 0 && !moments_)) {
          arrays[i][k].clear();
          continue;
        }
        const float* src = spare_ ? owner_->spare_ + owner_->offsets_[i][k] : live[k];
        arrays[i][k].resize(static_cast<size_t>(Count(shards[i])));
        pieces.push_back({src, arrays[i][k].data(), Count(shards[i])});
      }
    }
    RETURN_IF_ERROR(owner_->Download(pieces));
    if (spare_) {
      float ms = 0;
      if (cudaEventElapsedTime(&ms, owner_->copy_start_, owner_->copied_) == cudaSuccess) {
        owner_->last_copy_ms_.store(ms);
      }
    }
    return absl::OkStatus();
  }

 private:
  const std::shared_ptr<DeviceSnapshotSpare> owner_;
  const bool spare_;
  const bool moments_;
};

std::shared_ptr<DeviceSnapshotSpare> DeviceSnapshotSpare::Create(
    std::shared_ptr<GpuShardStore> store) {
  return std::shared_ptr<DeviceSnapshotSpare>(new DeviceSnapshotSpare(std::move(store)));
}

DeviceSnapshotSpare::~DeviceSnapshotSpare() {
  ScopedDevice guard(store_->device());
  if (side_ != nullptr) cudaStreamSynchronize(side_);
  if (spare_ != nullptr) cudaFree(spare_);
  for (void* b : bounce_) {
    if (b != nullptr) cudaFreeHost(b);
  }
  for (cudaEvent_t e : {after_step_, copy_start_, copied_, bounce_done_[0], bounce_done_[1]}) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (side_ != nullptr) cudaStreamDestroy(side_);
}

absl::Status DeviceSnapshotSpare::Init() {
  if (side_ != nullptr) return absl::OkStatus();
  GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&after_step_, cudaEventDisableTiming));
  GPU_RETURN_IF_ERROR(cudaEventCreate(&copy_start_));
  GPU_RETURN_IF_ERROR(cudaEventCreate(&copied_));
  for (int b = 0; b < 2; ++b) {
    GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&bounce_done_[b], cudaEventDisableTiming));
    GPU_RETURN_IF_ERROR(cudaMallocHost(&bounce_[b], kBounceBytes));
  }
  return absl::OkStatus();
}

std::vector<std::array<int64_t, 3>> DeviceSnapshotSpare::Layout(int64_t* floats) const {
  const std::vector<GpuShardDef>& shards = store_->shards();
  *floats = 0;
  std::vector<std::array<int64_t, 3>> offsets(shards.size(), {-1, -1, -1});
  for (size_t i = 0; i < shards.size(); ++i) {
    const int s = static_cast<int>(i);
    const float* live[3] = {store_->master(s), store_->exp_avg(s), store_->exp_avg_sq(s)};
    for (int k = 0; k < 3; ++k) {
      if (live[k] == nullptr) continue;
      offsets[i][k] = *floats;
      *floats += (Count(shards[i]) + 63) / 64 * 64;  // 256-byte aligned pieces
    }
  }
  return offsets;
}

absl::Status DeviceSnapshotSpare::ChooseMode() {
  int64_t floats = 0;
  std::vector<std::array<int64_t, 3>> offsets = Layout(&floats);
  // Decided once, again when the store's buffers changed (SGD momentum
  // turned on allocates them).
  if (mode_chosen_ && offsets == offsets_) return absl::OkStatus();
  if (spare_ != nullptr) {
    RETURN_IF_ERROR(WaitHost());
    GPU_RETURN_IF_ERROR(cudaFree(spare_));
    spare_ = nullptr;
    spare_bytes_.store(0);
  }
  use_spare_ = false;
  mode_chosen_ = true;
  offsets_ = std::move(offsets);
  const size_t bytes = static_cast<size_t>(floats) * sizeof(float);
  const char* env = std::getenv("PARAMD_GPU_SNAPSHOT_SPARE");
  const bool forced_off = env != nullptr && std::string(env) == "0";
  size_t free_bytes = 0, total = 0;
  GPU_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total));
  const int64_t reserve = Reserve(total);
  std::string why;
  if (forced_off) {
    why = "PARAMD_GPU_SNAPSHOT_SPARE=0";
  } else if (static_cast<int64_t>(free_bytes) < static_cast<int64_t>(bytes) + reserve) {
    why = absl::StrCat("the spare needs ", bytes >> 20, " MiB, the device has ", free_bytes >> 20,
                       " MiB free (", reserve >> 20, " MiB kept in reserve)");
  } else {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaSuccess) {
      spare_ = static_cast<float*>(p);
      use_spare_ = true;
      spare_bytes_.store(static_cast<int64_t>(bytes));
    } else {
      cudaGetLastError();
      why = absl::StrCat("allocating the ", bytes >> 20,
                         " MiB spare failed: ", cudaGetErrorString(e));
    }
  }
  if (use_spare_) {
    LogInfo("gpu", absl::StrCat("gpu backend: snapshots capture into a ", bytes >> 20,
                                " MiB device spare"));
  } else {
    LogInfo("gpu", absl::StrCat("gpu backend: snapshots read the live device buffers (", why,
                                "); the step after a snapshot waits for its download"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StateCapture>> DeviceSnapshotSpare::Capture() {
  ScopedDevice guard(store_->device());
  RETURN_IF_ERROR(Init());
  if (in_use_.exchange(true)) {
    return absl::FailedPreconditionError("the previous snapshot's capture is not copied yet");
  }
  if (absl::Status s = ChooseMode(); !s.ok()) {
    in_use_.store(false);
    return s;
  }
  const bool moments = store_->optimizer_steps() > 0;
  auto capture = std::make_unique<Capture_>(shared_from_this(), use_spare_, moments);
  // After everything the store enqueued so far (the step, and the pushes
  // already added into the accumulators, which nothing here reads).
  GPU_RETURN_IF_ERROR(cudaEventRecord(after_step_, store_->stream()));
  GPU_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, after_step_, 0));
  if (use_spare_) {
    GPU_RETURN_IF_ERROR(cudaEventRecord(copy_start_, side_));
    const std::vector<GpuShardDef>& shards = store_->shards();
    for (size_t i = 0; i < shards.size(); ++i) {
      const int s = static_cast<int>(i);
      const float* live[3] = {store_->master(s), store_->exp_avg(s), store_->exp_avg_sq(s)};
      for (int k = 0; k < 3; ++k) {
        if (live[k] == nullptr || (k > 0 && !moments)) continue;
        GPU_RETURN_IF_ERROR(cudaMemcpyAsync(spare_ + offsets_[i][k], live[k],
                                            Count(shards[i]) * sizeof(float),
                                            cudaMemcpyDeviceToDevice, side_));
      }
    }
    GPU_RETURN_IF_ERROR(cudaEventRecord(copied_, side_));
    copy_pending_ = true;
  }
  return std::unique_ptr<StateCapture>(std::move(capture));
}

absl::Status DeviceSnapshotSpare::OrderBefore(cudaStream_t stream) {
  if (!copy_pending_) return absl::OkStatus();
  ScopedDevice guard(store_->device());
  GPU_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, copied_, 0));
  return absl::OkStatus();
}

absl::Status DeviceSnapshotSpare::WaitHost() {
  if (!copy_pending_) return absl::OkStatus();
  ScopedDevice guard(store_->device());
  GPU_RETURN_IF_ERROR(cudaEventSynchronize(copied_));
  copy_pending_ = false;
  return absl::OkStatus();
}

absl::Status DeviceSnapshotSpare::Download(const std::vector<Piece>& pieces) {
  ScopedDevice guard(store_->device());
  // Bounce-sized chunks of every piece, in order.
  struct Chunk {
    const float* src;
    float* dst;
    size_t bytes;
  };
  std::vector<Chunk> chunks;
  const int64_t per = static_cast<int64_t>(kBounceBytes / sizeof(float));
  for (const Piece& p : pieces) {
    for (int64_t off = 0; off < p.count; off += per) {
      chunks.push_back({p.src + off, p.dst + off,
                        static_cast<size_t>(std::min(per, p.count - off)) * sizeof(float)});
    }
  }
  // Chunk j goes into bounce j % 2; chunk j-1 is copied out while j moves.
  auto copy_out = [&](size_t j) -> absl::Status {
    GPU_RETURN_IF_ERROR(cudaEventSynchronize(bounce_done_[j % 2]));
    ParallelMemcpy(chunks[j].dst, bounce_[j % 2], chunks[j].bytes, CopyOutThreads());
    return absl::OkStatus();
  };
  for (size_t j = 0; j < chunks.size(); ++j) {
    GPU_RETURN_IF_ERROR(cudaMemcpyAsync(bounce_[j % 2], chunks[j].src, chunks[j].bytes,
                                        cudaMemcpyDeviceToHost, side_));
    GPU_RETURN_IF_ERROR(cudaEventRecord(bounce_done_[j % 2], side_));
    if (j > 0) RETURN_IF_ERROR(copy_out(j - 1));
  }
  if (!chunks.empty()) RETURN_IF_ERROR(copy_out(chunks.size() - 1));
  return absl::OkStatus();
}

}  // namespace gpu_backend
}  // namespace paramd
