#include "checkpoint/fake_daemon.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "checkpoint/test_util.h"

namespace paramd {
namespace checkpoint {
namespace testing {

FakeDaemon::FakeDaemon(std::vector<TensorInfo> tensors, std::vector<PieceInfo> pieces,
                       int64_t version)
    : tensors_(std::move(tensors)), version_(version) {
  absl::MutexLock lock(&mu_);
  for (PieceInfo& info : pieces) {
    Piece piece;
    piece.info = std::move(info);
    pieces_.push_back(std::move(piece));
  }
  Generate();
}

void FakeDaemon::Generate() {
  for (Piece& piece : pieces_) {
    for (const TensorInfo& tensor : tensors_) {
      if (tensor.name() != piece.info.tensor()) continue;
      const uint64_t seed = static_cast<uint64_t>(version_);
      piece.cols = tensor.cols();
      piece.master =
          FakeRows(seed, tensor, kMasterSection, piece.info.row_begin(), piece.info.row_end());
      piece.exp_avg =
          FakeRows(seed, tensor, "exp_avg", piece.info.row_begin(), piece.info.row_end());
      piece.exp_avg_sq =
          FakeRows(seed, tensor, "exp_avg_sq", piece.info.row_begin(), piece.info.row_end());
    }
  }
}

void FakeDaemon::SetVersion(int64_t version) {
  absl::MutexLock lock(&mu_);
  version_ = version;
  Generate();
}

int64_t FakeDaemon::version() const {
  absl::MutexLock lock(&mu_);
  return version_;
}

void FakeDaemon::set_write_delay(absl::Duration delay) {
  absl::MutexLock lock(&mu_);
  write_delay_ = delay;
}

void FakeDaemon::set_model_generation(int64_t generation) {
  absl::MutexLock lock(&mu_);
  model_generation_ = generation;
}

absl::Status FakeDaemon::WithState(int64_t version,
                                   const std::function<absl::Status(const DaemonStateView&)>& fn) {
  absl::MutexLock lock(&mu_);
  if (version != version_) return NotAtVersion(version_, version);
  if (write_delay_ > absl::ZeroDuration()) absl::SleepFor(write_delay_);
  DaemonStateView view;
  view.version = version_;
  view.model_generation = model_generation_;
  for (const Piece& piece : pieces_) {
    PieceView p;
    p.tensor = piece.info.tensor();
    p.row_begin = piece.info.row_begin();
    p.row_end = piece.info.row_end();
    p.cols = piece.cols;
    p.master = piece.master;
    p.moments = {{"exp_avg", piece.exp_avg}, {"exp_avg_sq", piece.exp_avg_sq}};
    view.pieces.push_back(std::move(p));
    view.tensor_states[piece.info.tensor()] =
        FakeState(static_cast<uint64_t>(version_), piece.info.tensor());
  }
  view.daemon_blob = "fake daemon";
  return fn(view);
}

absl::Status FakeDaemon::ReadRows(int64_t version, ExportValuesKind kind, const std::string& tensor,
                                  int64_t row_begin, int64_t row_end, absl::Span<float> out) {
  absl::MutexLock lock(&mu_);
  if (version != version_) {
    return absl::FailedPreconditionError(
        absl::StrCat("daemon is at version ", version_, ", not ", version));
  }
  for (const Piece& piece : pieces_) {
    if (piece.info.tensor() != tensor || row_begin < piece.info.row_begin() ||
        row_end > piece.info.row_end()) {
      continue;
    }
    if (static_cast<int64_t>(out.size()) != (row_end - row_begin) * piece.cols) {
      return absl::InvalidArgumentError("output size does not match rows x cols");
    }
    if (kind == ExportValuesKind::kMaster) {
      std::memcpy(out.data(),
                  piece.master.data() + (row_begin - piece.info.row_begin()) * piece.cols,
                  out.size() * sizeof(float));
    } else {
      TensorInfo info;
      info.set_name(tensor);
      info.set_cols(piece.cols);
      const std::vector<float> rows = FakeRows(
          static_cast<uint64_t>(version_), info,
          kind == ExportValuesKind::kRowwise ? "rowwise" : "columnwise", row_begin, row_end);
      std::memcpy(out.data(), rows.data(), out.size() * sizeof(float));
    }
    return absl::OkStatus();
  }
  return absl::NotFoundError(
      absl::StrCat("rows [", row_begin, ", ", row_end, ") of ", tensor, " are not held here"));
}

rpc::Manifest FakeClusterManifest(const std::vector<TensorInfo>& tensors,
                                  const std::vector<std::vector<PieceInfo>>& plan,
                                  const std::vector<std::string>& addresses, int64_t version) {
  rpc::Manifest manifest;
  for (size_t i = 0; i < tensors.size(); ++i) {
    rpc::TensorInfo* t = manifest.add_tensors();
    t->set_name(tensors[i].name());
    for (int64_t d : tensors[i].shape()) t->add_shape(d);
    t->set_rows(tensors[i].rows());
    t->set_cols(tensors[i].cols());
    t->set_index(static_cast<int>(i));
  }
  for (size_t rank = 0; rank < plan.size(); ++rank) {
    rpc::DaemonInfo* daemon = manifest.add_daemons();
    daemon->set_rank(static_cast<int>(rank));
    daemon->set_address(addresses[rank]);
    daemon->set_published_version(version);
    for (const PieceInfo& piece : plan[rank]) {
      rpc::ShardPiece* p = manifest.add_pieces();
      p->set_tensor(piece.tensor());
      p->set_row_begin(piece.row_begin());
      p->set_row_end(piece.row_end());
      p->set_daemon_rank(static_cast<int>(rank));
      p->set_daemon_address(addresses[rank]);
    }
  }
  manifest.set_committed_version(version);
  manifest.set_optimizer("adamw");
  return manifest;
}

absl::StatusOr<rpc::Manifest> FakeClusterView::GetManifest() {
  std::function<void()> on_get;
  {
    absl::MutexLock lock(&mu_);
    on_get = on_get_;
  }
  if (on_get) on_get();
  absl::MutexLock lock(&mu_);
  return manifest_;
}

void FakeClusterView::SetCommittedVersion(int64_t version) {
  absl::MutexLock lock(&mu_);
  manifest_.set_committed_version(version);
}

void FakeClusterView::SetModelGeneration(int64_t generation) {
  absl::MutexLock lock(&mu_);
  manifest_.set_model_generation(generation);
}

void FakeClusterView::set_on_get(std::function<void()> on_get) {
  absl::MutexLock lock(&mu_);
  on_get_ = std::move(on_get);
}

}  // namespace testing
}  // namespace checkpoint
}  // namespace paramd
