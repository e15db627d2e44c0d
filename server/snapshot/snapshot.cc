#include "server/snapshot/snapshot.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include <xxhash.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/rpc/serial_worker.h"
#include "server/step/optimizer_config.h"

namespace paramd {
namespace {

constexpr char kTag[] = "snapshot";

int64_t ArrayBytes(const DaemonSnapshot& s) {
  int64_t bytes = 0;
  for (const auto& a : s.arrays) {
    for (const auto& v : a) bytes += static_cast<int64_t>(v.size() * sizeof(float));
  }
  return bytes;
}

void FillScaling(const DelayedScalingState& after, float cast_scale, rpc::SnapshotScaling* out) {
  out->set_scale(after.scale);
  out->set_cast_scale(cast_scale);
  for (float a : after.amax_history) out->add_amax_history(a);
}

// Builds a snapshot from its chunks, checking every offset against the
// header (the sender is a cluster member, but a bad stream must not write
// out of bounds).
class Assembler {
 public:
  absl::Status Add(const rpc::SnapshotChunk& chunk) {
    if (snapshot_ == nullptr) {
      if (!chunk.has_header()) return absl::InvalidArgumentError("snapshot stream without header");
      snapshot_ = std::make_shared<DaemonSnapshot>();
      snapshot_->header = chunk.header();
      for (const rpc::SnapshotShard& s : snapshot_->header.shards()) {
        if (s.values() < 0 || s.values() > (int64_t{1} << 40) || s.moments() < 0 ||
            s.moments() > 2) {
          return absl::InvalidArgumentError("snapshot header: bad shard");
        }
        std::array<std::vector<float>, 3> a;
        for (int k = 0; k <= s.moments(); ++k) a[k].resize(static_cast<size_t>(s.values()));
        snapshot_->arrays.push_back(std::move(a));
        missing_ += s.values() * (1 + s.moments());
      }
      if (chunk.data().empty()) return absl::OkStatus();
    }
    if (chunk.shard() < 0 || chunk.shard() >= static_cast<int>(snapshot_->arrays.size()) ||
        chunk.array() < 0 || chunk.array() > 2) {
      return absl::InvalidArgumentError("snapshot chunk outside the header's shards");
    }
    std::vector<float>& v = snapshot_->arrays[chunk.shard()][chunk.array()];
    const int64_t n = static_cast<int64_t>(chunk.data().size() / sizeof(float));
    if (chunk.data().size() % sizeof(float) != 0 || chunk.offset() < 0 ||
        chunk.offset() + n > static_cast<int64_t>(v.size())) {
      return absl::InvalidArgumentError("snapshot chunk outside its array");
    }
    std::memcpy(v.data() + chunk.offset(), chunk.data().data(), chunk.data().size());
    missing_ -= n;
    return absl::OkStatus();
  }

  absl::StatusOr<std::shared_ptr<const DaemonSnapshot>> Finish() {
    if (snapshot_ == nullptr) return absl::DataLossError("empty snapshot stream");
    if (missing_ != 0) {
      return absl::DataLossError(
          absl::StrCat("snapshot stream ended with ", missing_, " values missing"));
    }
    return std::shared_ptr<const DaemonSnapshot>(std::move(snapshot_));
  }

 private:
  std::shared_ptr<DaemonSnapshot> snapshot_;
  int64_t missing_ = 0;  // values not yet received (chunks never overlap)
};

// Where each data chunk of a snapshot's stream lies (the header goes first).
struct Piece {
  int shard = 0;
  int array = 0;
  int64_t offset = 0;  // values
  int64_t count = 0;
};

std::vector<Piece> Pieces(const DaemonSnapshot& s, int64_t chunk_bytes) {
  std::vector<Piece> out;
  const int64_t per = std::max<int64_t>(
      1, std::min(chunk_bytes, kMaxSnapshotChunkBytes) / static_cast<int64_t>(sizeof(float)));
  for (size_t i = 0; i < s.arrays.size(); ++i) {
    for (int k = 0; k < 3; ++k) {
      const int64_t n = static_cast<int64_t>(s.arrays[i][k].size());
      for (int64_t off = 0; off < n; off += per) {
        out.push_back({static_cast<int>(i), k, off, std::min(per, n - off)});
      }
    }
  }
  return out;
}

void FillChunk(const DaemonSnapshot& s, const Piece& p, rpc::SnapshotChunk* c) {
  c->Clear();
  c->set_shard(p.shard);
  c->set_array(p.array);
  c->set_offset(p.offset);
  c->set_data(reinterpret_cast<const char*>(s.arrays[p.shard][p.array].data() + p.offset),
              p.count * sizeof(float));
}

class PutReactor : public grpc::ServerReadReactor<rpc::SnapshotChunk> {
 public:
  PutReactor(SnapshotKeeper* keeper, grpc::CallbackServerContext* context)
      : keeper_(keeper), context_(context) {
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (context_->IsCancelled()) {
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "snapshot upload cancelled"));
        return;
      }
      absl::StatusOr<std::shared_ptr<const DaemonSnapshot>> s = assembler_.Finish();
      if (!s.ok()) {
        Finish(ToGrpcStatus(s.status()));
        return;
      }
      keeper_->AddBuddyCopy(*std::move(s));
      Finish(grpc::Status::OK);
      return;
    }
    absl::Status s = assembler_.Add(chunk_);
    if (!s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  SnapshotKeeper* const keeper_;
  grpc::CallbackServerContext* const context_;
  rpc::SnapshotChunk chunk_;
  Assembler assembler_;
};

class GetReactor : public grpc::ServerWriteReactor<rpc::SnapshotChunk> {
 public:
  GetReactor(std::shared_ptr<const DaemonSnapshot> snapshot, int64_t chunk_bytes)
      : snapshot_(std::move(snapshot)), pieces_(Pieces(*snapshot_, chunk_bytes)) {
    *chunk_.mutable_header() = snapshot_->header;
    StartWrite(&chunk_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "snapshot read cancelled"));
      return;
    }
    if (next_ == pieces_.size()) {
      Finish(grpc::Status::OK);
      return;
    }
    FillChunk(*snapshot_, pieces_[next_++], &chunk_);  // one chunk in memory at a time
    StartWrite(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  const std::shared_ptr<const DaemonSnapshot> snapshot_;
  const std::vector<Piece> pieces_;
  size_t next_ = 0;
  rpc::SnapshotChunk chunk_;
};

}  // namespace

struct SnapshotKeeper::Pending {
  std::shared_ptr<DaemonSnapshot> snapshot;
  std::unique_ptr<StateCapture> capture;  // until Copy is done
  bool reads_live_state = true;
  absl::Notification done;
  absl::Time started;
  double capture_seconds = 0;        // on the worker (all of AfterPublish)
  double previous_wait_seconds = 0;  // of that, waiting for the previous copy
  bool block_noted = false;          // guarded by the keeper's mu_
};

std::vector<std::string> DaemonAddresses(const rpc::Manifest& manifest) {
  std::vector<std::string> out;
  for (const rpc::DaemonInfo& d : manifest.daemons()) {
    if (d.rank() < 0 || d.rank() > 1 << 20) continue;
    if (static_cast<int>(out.size()) <= d.rank()) out.resize(d.rank() + 1);
    out[d.rank()] = d.address();
  }
  return out;
}

uint64_t ShardLayoutHash(const std::vector<TensorDef>& tensors,
                         const std::vector<ShardDef>& shards) {
  std::string key;
  for (const ShardDef& d : shards) {
    const TensorDef& t = tensors[d.tensor];
    absl::StrAppend(&key, t.name, ":", t.rows, "x", t.cols, "[", d.row_begin, ",", d.row_end, ");");
  }
  return XXH3_64bits(key.data(), key.size());  // the same in every process
}

absl::StatusOr<std::vector<SavedDelayedState>> RestoreSnapshot(const DaemonSnapshot& snapshot,
                                                               ShardStateSink& shards) {
  const rpc::SnapshotHeader& h = snapshot.header;
  if (h.layout_hash() != ShardLayoutHash(shards.tensors(), shards.shards()) ||
      h.shards_size() != static_cast<int>(shards.shards().size()) ||
      snapshot.arrays.size() != shards.shards().size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "snapshot v", h.version(), " of rank ", h.rank(), " holds other shards than this plan's"));
  }
  ASSIGN_OR_RETURN(OptimizerOptions optimizer, OptimizerFromProto(h.optimizer()));
  if (optimizer.kind != shards.optimizer().kind) {
    return absl::FailedPreconditionError(absl::StrCat(
        "snapshot v", h.version(), " was taken with optimizer ", OptimizerName(optimizer.kind),
        ", this daemon runs ", OptimizerName(shards.optimizer().kind)));
  }
  RETURN_IF_ERROR(shards.RestoreOptimizer(optimizer));
  for (size_t i = 0; i < snapshot.arrays.size(); ++i) {
    const ShardDef& d = shards.shards()[i];
    const size_t want = static_cast<size_t>(d.rows() * shards.tensors()[d.tensor].cols);
    const auto& a = snapshot.arrays[i];
    if (a[0].size() != want) {
      return absl::DataLossError(
          absl::StrCat("snapshot shard ", i, " has ", a[0].size(), " values, want ", want));
    }
    RETURN_IF_ERROR(shards.RestoreMaster(static_cast<int>(i), a[0]));
    RETURN_IF_ERROR(shards.RestoreOptimizerState(static_cast<int>(i), a[1], a[2]));
  }
  RETURN_IF_ERROR(shards.RestoreStepCounts(h.optimizer_steps(), h.skipped_steps()));
  std::vector<SavedDelayedState> next;
  for (const rpc::SnapshotTensor& t : h.tensors()) {
    if (t.tensor() < 0 || t.tensor() >= static_cast<int>(shards.tensors().size())) {
      return absl::DataLossError("snapshot names a tensor outside the manifest");
    }
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      const rpc::SnapshotScaling& s = d == Direction::kRowwise ? t.rowwise() : t.columnwise();
      DelayedScalingState after;
      after.scale = s.scale();
      after.amax_history.assign(s.amax_history().begin(), s.amax_history().end());
      DelayedScalingState cast = after;
      cast.scale = s.cast_scale();  // exactly the scale the version was cast with
      RETURN_IF_ERROR(shards.RestoreDelayedState(t.tensor(), d, std::move(cast)));
      next.push_back({t.tensor(), d, std::move(after)});
    }
  }
  return next;
}

SnapshotKeeper::SnapshotKeeper(SnapshotOptions options)
    : options_(std::move(options)),
      thread_(std::make_unique<SerialWorker>()),
      sender_(std::make_unique<SerialWorker>()) {}

SnapshotKeeper::~SnapshotKeeper() {
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    if (sending_ != nullptr) sending_->TryCancel();
  }
  thread_.reset();  // finishes the queued copies
  sender_.reset();  // the queued sends return at once now
}

void SnapshotKeeper::SetModel(int rank, std::vector<std::string> addresses, uint64_t layout_hash,
                              int64_t model_generation) {
  std::shared_ptr<const DaemonSnapshot> resend;
  {
    absl::MutexLock lock(&mu_);
    const int n = static_cast<int>(addresses.size());
    auto buddy = [&](const std::vector<std::string>& a) {
      return n > 1 && rank >= 0 && rank < n ? a[(rank + 1) % n] : std::string();
    };
    const std::string before =
        addresses_.size() == addresses.size() && rank == rank_ ? buddy(addresses_) : "";
    rank_ = rank;
    layout_hash_ = layout_hash;
    model_generation_ = model_generation;
    // A late copy of the model a load replaced (after DropAll).
    for (auto& [r, copies] : buddy_) {
      copies.erase(std::remove_if(copies.begin(), copies.end(),
                                  [&](const auto& c) {
                                    return c->header.model_generation() < model_generation;
                                  }),
                   copies.end());
    }
    addresses_ = std::move(addresses);
    const std::string after = buddy(addresses_);
    if (!after.empty() && !before.empty() && before != after && !own_.empty()) {
      resend = own_.back();  // the new buddy holds no copy of ours
    }
  }
  if (resend) sender_->Post([this, resend] { Send(resend); });
}

void SnapshotKeeper::DropAll() {
  BeforeChange();
  absl::MutexLock lock(&mu_);
  own_.clear();
  buddy_.clear();
  recycled_.clear();
  frozen_ = false;
}

void SnapshotKeeper::AfterPublish(ShardBackend& backend, const PublishedVersion& published) {
  const int64_t version = published.version;
  if (options_.every_steps <= 0 || version <= 0 || version % options_.every_steps != 0) return;
  // The previous copy first: a gpu capture reuses its device spare. With
  // snapshots N steps apart this is done long before.
  const absl::Time start = absl::Now();
  const double waited = WaitForCopy();
  auto pending = std::make_shared<Pending>();
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_ || rank_ < 0) return;
    if (!own_.empty() && own_.back()->header.version() == version) return;  // republished
    pending->snapshot = std::make_shared<DaemonSnapshot>();
    pending->snapshot->arrays = std::move(recycled_);
    recycled_.clear();
    pending->snapshot->header.set_rank(rank_);
    pending->snapshot->header.set_layout_hash(layout_hash_);
    pending->snapshot->header.set_model_generation(model_generation_);
  }
  absl::StatusOr<CapturedState> captured = backend.CaptureState();
  if (!captured.ok()) {
    LogWarning(
        kTag, absl::StrCat("no snapshot of version ", version, ": ", captured.status().ToString()));
    return;
  }
  rpc::SnapshotHeader& h = pending->snapshot->header;
  h.set_version(version);
  *h.mutable_optimizer() = OptimizerToProto(captured->optimizer);
  h.set_optimizer_steps(captured->optimizer_steps);
  h.set_skipped_steps(captured->skipped_steps);
  std::vector<bool> held(backend.tensors().size(), false);
  for (const ShardDef& d : backend.shards()) {
    rpc::SnapshotShard* s = h.add_shards();
    s->set_tensor(d.tensor);
    s->set_row_begin(d.row_begin);
    s->set_row_end(d.row_end);
    s->set_values(d.rows() * backend.tensors()[d.tensor].cols);
    held[d.tensor] = true;
  }
  for (size_t t = 0; t < held.size(); ++t) {
    if (!held[t] || t >= captured->delayed.size()) continue;
    TensorScalingInfo cast;
    if (t < published.tensors.size()) cast = published.tensors[t];
    rpc::SnapshotTensor* st = h.add_tensors();
    st->set_tensor(static_cast<int>(t));
    FillScaling(captured->delayed[t][0], cast.rowwise_scale, st->mutable_rowwise());
    FillScaling(captured->delayed[t][1], cast.columnwise_scale, st->mutable_columnwise());
  }
  pending->reads_live_state = captured->arrays->reads_live_state();
  pending->capture = std::move(captured->arrays);
  pending->started = start;
  pending->capture_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  pending->previous_wait_seconds = waited;
  {
    absl::MutexLock lock(&mu_);
    copying_ = pending;
    capture_kind_ = std::string(pending->capture->kind());
  }
  thread_->Post([this, pending] { Copy(pending); });
}

void SnapshotKeeper::Copy(const std::shared_ptr<Pending>& pending) {
  DaemonSnapshot& s = *pending->snapshot;
  const absl::Time start = absl::Now();
  absl::Status copied = pending->capture->Copy(s.arrays);
  pending->capture.reset();  // a gpu capture's spare is free again
  if (copied.ok() && s.arrays.size() != static_cast<size_t>(s.header.shards_size())) {
    copied = absl::InternalError(absl::StrCat("the capture copied ", s.arrays.size(),
                                              " shards, the header has ", s.header.shards_size()));
  }
  if (!copied.ok()) {
    LogWarning(kTag, absl::StrCat("snapshot of version ", s.header.version(),
                                  " failed: ", copied.ToString()));
    pending->done.Notify();
    return;
  }
  for (size_t i = 0; i < s.arrays.size(); ++i) {
    auto& a = s.arrays[i];
    if (a[1].empty() && !a[2].empty()) a[1].assign(a[2].size(), 0.0f);  // never: m before v
    s.header.mutable_shards(static_cast<int>(i))
        ->set_moments(a[2].empty() ? (a[1].empty() ? 0 : 1) : 2);
  }
  s.header.set_bytes(ArrayBytes(s));
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  std::shared_ptr<const DaemonSnapshot> done = pending->snapshot;
  {
    absl::MutexLock lock(&mu_);
    own_.push_back(done);
    TrimLocked();
    last_copy_seconds_ = seconds;
  }
  pending->done.Notify();
  LogInfo(kTag, absl::StrCat("rank ", s.header.rank(), ": snapshot of version ", s.header.version(),
                             " (", s.header.bytes() >> 20, " MiB, ", capture_kind(), ") copied in ",
                             absl::FormatDuration(
                                 absl::Trunc(absl::Seconds(seconds), absl::Milliseconds(1)))));
  sender_->Post([this, done] { Send(done); });
}

std::string SnapshotKeeper::capture_kind() const {
  absl::MutexLock lock(&mu_);
  return capture_kind_;
}

double SnapshotKeeper::WaitFor(bool live_readers_only) {
  std::shared_ptr<Pending> pending;
  {
    absl::MutexLock lock(&mu_);
    pending = copying_;
  }
  if (pending == nullptr) return 0;
  const bool wait = !live_readers_only || pending->reads_live_state;
  const absl::Time start = absl::Now();
  if (wait) pending->done.WaitForNotification();
  const double waited = absl::ToDoubleSeconds(absl::Now() - start);
  absl::MutexLock lock(&mu_);
  // The step after a capture: what the capture and this wait held it up.
  if (!pending->block_noted) {
    pending->block_noted = true;
    last_block_seconds_ = pending->capture_seconds + waited;
  }
  if (wait && copying_ == pending) copying_ = nullptr;
  return waited;
}

double SnapshotKeeper::WaitForCopy() { return WaitFor(/*live_readers_only=*/false); }
void SnapshotKeeper::BeforeChange() { WaitFor(/*live_readers_only=*/false); }
void SnapshotKeeper::BeforeStep() { WaitFor(/*live_readers_only=*/true); }

void SnapshotKeeper::Send(const std::shared_ptr<const DaemonSnapshot>& snapshot) {
  std::string address;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    // A newer one is queued or done: send that instead.
    if (!own_.empty() && own_.back()->header.version() > snapshot->header.version()) return;
    const int n = static_cast<int>(addresses_.size());
    if (n < 2 || rank_ < 0 || rank_ >= n) return;
    address = addresses_[(rank_ + 1) % n];
    if (address.empty()) return;
  }
  const absl::Time start = absl::Now();
  auto stub = rpc::Daemon::NewStub(auth::CreateChannel(address, {options_.tls, options_.token}));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.transfer_timeout));
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    sending_ = &context;
  }
  rpc::PutSnapshotResponse response;
  std::unique_ptr<grpc::ClientWriter<rpc::SnapshotChunk>> writer =
      stub->PutSnapshot(&context, &response);
  rpc::SnapshotChunk chunk;
  *chunk.mutable_header() = snapshot->header;
  bool ok = writer->Write(chunk);
  for (const Piece& p : Pieces(*snapshot, options_.chunk_bytes)) {
    if (!ok) break;
    FillChunk(*snapshot, p, &chunk);
    ok = writer->Write(chunk);
  }
  if (ok) writer->WritesDone();
  const grpc::Status s = writer->Finish();
  {
    absl::MutexLock lock(&mu_);
    sending_ = nullptr;
  }
  if (!s.ok()) {
    LogWarning(kTag,
               absl::StrCat("sending snapshot of version ", snapshot->header.version(),
                            " to the buddy daemon at ", address, " failed: ", s.error_message()));
    return;
  }
  LogInfo(kTag, absl::StrCat(
                    "rank ", snapshot->header.rank(), ": snapshot of version ",
                    snapshot->header.version(), " sent to the buddy at ", address, " in ",
                    absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1)))));
}

void SnapshotKeeper::TrimLocked() {
  if (frozen_) return;
  const size_t keep = static_cast<size_t>(std::max(1, options_.keep));
  while (own_.size() > keep) {
    std::shared_ptr<const DaemonSnapshot> oldest = std::move(own_.front());
    own_.pop_front();
    // Every other holder (a buddy send, a GetSnapshot stream, a recovery)
    // took its reference from own_ under mu_, which is held here: with
    // none left, this keeper made the snapshot (non-const) and owns it alone.
    if (oldest.use_count() == 1) {
      recycled_ = std::move(std::const_pointer_cast<DaemonSnapshot>(oldest)->arrays);
    }
  }
  // One copy per rank is enough for the loss of that rank: the others go
  // back with their own copies, which include every version it sent.
  for (auto& [rank, copies] : buddy_) {
    while (copies.size() > 1) copies.pop_front();
  }
}

void SnapshotKeeper::AddBuddyCopy(std::shared_ptr<const DaemonSnapshot> snapshot) {
  absl::MutexLock lock(&mu_);
  const int64_t generation = snapshot->header.model_generation();
  if (generation < model_generation_) return;  // of a model replaced here
  auto& copies = buddy_[snapshot->header.rank()];
  if (!copies.empty() && copies.back()->header.model_generation() != generation) {
    if (copies.back()->header.model_generation() > generation) return;  // late, replaced
    copies.clear();  // another history, whatever its versions
  }
  // Versions only grow within one history; an older one arriving late
  // (a slow send) is kept in order.
  auto it = std::find_if(copies.begin(), copies.end(), [&](const auto& c) {
    return c->header.version() >= snapshot->header.version();
  });
  if (it != copies.end() && (*it)->header.version() == snapshot->header.version()) {
    *it = std::move(snapshot);
  } else {
    copies.insert(it, std::move(snapshot));
  }
  TrimLocked();
}

void SnapshotKeeper::AfterRecovery(int64_t version,
                                   std::shared_ptr<const DaemonSnapshot> restored) {
  absl::MutexLock lock(&mu_);
  auto drop_newer = [version](std::deque<std::shared_ptr<const DaemonSnapshot>>& q) {
    q.erase(std::remove_if(q.begin(), q.end(),
                           [&](const auto& s) { return s->header.version() > version; }),
            q.end());
  };
  drop_newer(own_);
  for (auto& [rank, copies] : buddy_) drop_newer(copies);
  if (restored != nullptr && restored->header.rank() == rank_ &&
      (own_.empty() || own_.back()->header.version() < restored->header.version())) {
    own_.push_back(std::move(restored));
  }
  frozen_ = false;
  TrimLocked();
}

std::vector<rpc::SnapshotHeld> SnapshotKeeper::HoldForRecovery() {
  absl::MutexLock lock(&mu_);
  frozen_ = true;
  std::vector<rpc::SnapshotHeld> held;
  auto add = [&](const DaemonSnapshot& s) {
    rpc::SnapshotHeld h;
    h.set_rank(s.header.rank());
    h.set_version(s.header.version());
    h.set_bytes(s.header.bytes());
    h.set_model_generation(s.header.model_generation());
    held.push_back(std::move(h));
  };
  for (const auto& s : own_) add(*s);
  for (const auto& [rank, copies] : buddy_) {
    for (const auto& s : copies) add(*s);
  }
  return held;
}

std::shared_ptr<const DaemonSnapshot> SnapshotKeeper::Find(int rank, int64_t version,
                                                           int64_t model_generation) const {
  absl::MutexLock lock(&mu_);
  auto match = [&](const DaemonSnapshot& s) {
    return s.header.rank() == rank && s.header.version() == version &&
           s.header.model_generation() == model_generation;
  };
  for (const auto& s : own_) {
    if (match(*s)) return s;
  }
  auto it = buddy_.find(rank);
  if (it == buddy_.end()) return nullptr;
  for (const auto& s : it->second) {
    if (match(*s)) return s;
  }
  return nullptr;
}

absl::StatusOr<std::shared_ptr<const DaemonSnapshot>> SnapshotKeeper::Fetch(
    const std::string& address, int rank, int64_t version, int64_t model_generation) {
  auto stub = rpc::Daemon::NewStub(auth::CreateChannel(address, {options_.tls, options_.token}));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.transfer_timeout));
  rpc::GetSnapshotRequest request;
  request.set_rank(rank);
  request.set_version(version);
  request.set_model_generation(model_generation);
  std::unique_ptr<grpc::ClientReader<rpc::SnapshotChunk>> reader =
      stub->GetSnapshot(&context, request);
  Assembler assembler;
  rpc::SnapshotChunk chunk;
  absl::Status added;
  while (reader->Read(&chunk)) {
    added = assembler.Add(chunk);
    if (!added.ok()) {
      context.TryCancel();
      break;
    }
  }
  const grpc::Status s = reader->Finish();
  RETURN_IF_ERROR(added);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("reading snapshot v", version, " of rank ", rank, " from ",
                                     address, ": ", s.error_message()));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const DaemonSnapshot> snapshot, assembler.Finish());
  if (snapshot->header.rank() != rank || snapshot->header.version() != version ||
      snapshot->header.model_generation() != model_generation) {
    return absl::DataLossError(absl::StrCat(
        "asked ", address, " for snapshot v", version, " of rank ", rank, " of model generation ",
        model_generation, ", got v", snapshot->header.version(), " of rank ",
        snapshot->header.rank(), " of model generation ", snapshot->header.model_generation()));
  }
  return snapshot;
}

grpc::ServerReadReactor<rpc::SnapshotChunk>* SnapshotKeeper::StartPut(
    grpc::CallbackServerContext* context, rpc::PutSnapshotResponse* /*response*/) {
  return new PutReactor(this, context);
}

grpc::ServerWriteReactor<rpc::SnapshotChunk>* SnapshotKeeper::StartGet(
    const rpc::GetSnapshotRequest& request) {
  std::shared_ptr<const DaemonSnapshot> s =
      Find(request.rank(), request.version(), request.model_generation());
  if (s == nullptr) {
    return auth::RefusedWriter<rpc::SnapshotChunk>(grpc::Status(
        grpc::StatusCode::NOT_FOUND,
        absl::StrCat("no snapshot v", request.version(), " of rank ", request.rank(),
                     " of model generation ", request.model_generation(), " held here")));
  }
  return new GetReactor(std::move(s), options_.chunk_bytes);
}

void SnapshotKeeper::FillStats(rpc::DaemonStats* stats) const {
  absl::MutexLock lock(&mu_);
  stats->set_snapshot_version(own_.empty() ? -1 : own_.back()->header.version());
  stats->set_snapshot_bytes(own_.empty() ? 0 : own_.back()->header.bytes());
  stats->set_snapshot_block_seconds(last_block_seconds_);
  stats->set_snapshot_copy_seconds(last_copy_seconds_);
  stats->set_snapshot_capture(capture_kind_);
  int64_t buddy = -1;
  const int n = static_cast<int>(addresses_.size());
  if (n > 1 && rank_ >= 0) {
    auto it = buddy_.find((rank_ + n - 1) % n);
    if (it != buddy_.end() && !it->second.empty()) buddy = it->second.back()->header.version();
  }
  stats->set_buddy_snapshot_version(buddy);
}

}  // namespace paramd
