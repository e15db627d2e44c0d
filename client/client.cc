#include "client/client.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/paramd.grpc.pb.h"
#include "server/convert.h"
#include "sharding/assemble.h"

namespace paramd {
namespace client {
namespace {

constexpr int64_t kPushChunkBytes = int64_t{1} << 20;

std::chrono::system_clock::time_point ToChrono(absl::Time t) { return absl::ToChronoTime(t); }

std::string DefaultName() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "localhost");
  return absl::StrCat(host, ":", getpid());
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                          const auth::ChannelSecurity& security) {
  grpc::ChannelArguments args;
  // Reconnect quickly after a daemon restarts; fail fast while it is down.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetMaxReceiveMessageSize(64 << 20);
  return auth::CreateChannel(address, security, args);
}

absl::StatusOr<Manifest> ManifestFromProto(const rpc::Manifest& m) {
  Manifest out;
  out.committed_version = m.committed_version();
  out.expected_pushers = m.expected_pushers();
  out.optimizer = m.optimizer();
  out.plan_fingerprint = m.plan_fingerprint();
  out.num_daemons = m.daemons_size();
  for (const rpc::DaemonInfo& d : m.daemons()) {
    if (d.rank() < 0 || d.rank() >= m.daemons_size()) {
      return absl::InternalError(absl::StrCat("manifest: daemon rank ", d.rank(), " out of range"));
    }
  }
  out.daemon_addresses.resize(m.daemons_size());
  for (const rpc::DaemonInfo& d : m.daemons()) out.daemon_addresses[d.rank()] = d.address();
  for (const rpc::TensorInfo& t : m.tensors()) {
    TensorMeta meta;
    meta.name = t.name();
    meta.shape.assign(t.shape().begin(), t.shape().end());
    meta.rows = t.rows();
    meta.cols = t.cols();
    ASSIGN_OR_RETURN(meta.spec, HybridSpecFromProto(t.spec()));
    out.tensors.push_back(std::move(meta));
  }
  for (const rpc::ShardPiece& p : m.pieces()) {
    if (p.tensor_index() < 0 || p.tensor_index() >= static_cast<int>(out.tensors.size())) {
      return absl::InternalError(absl::StrCat("manifest: piece of unknown tensor ", p.tensor()));
    }
    out.tensors[p.tensor_index()].pieces.push_back(
        {p.row_begin(), p.row_end(), p.daemon_rank(), p.daemon_address()});
  }
  for (TensorMeta& t : out.tensors) {
    std::sort(t.pieces.begin(), t.pieces.end(),
              [](const PieceLocation& a, const PieceLocation& b) {
                return a.row_begin < b.row_begin;
              });
  }
  return out;
}

// Cancels every registered call once one of them fails, so that a dead
// daemon ends a multi-daemon call at once instead of at the deadline.
class CallGroup {
 public:
  void Register(grpc::ClientContext* context) {
    absl::MutexLock lock(&mu_);
    contexts_.push_back(context);
    if (failed_) context->TryCancel();
  }
  void Unregister(grpc::ClientContext* context) {
    absl::MutexLock lock(&mu_);
    contexts_.erase(std::find(contexts_.begin(), contexts_.end(), context));
  }
  void Fail() {
    absl::MutexLock lock(&mu_);
    failed_ = true;
    for (grpc::ClientContext* c : contexts_) c->TryCancel();
  }
  bool failed() const {
    absl::MutexLock lock(&mu_);
    return failed_;
  }

 private:
  mutable absl::Mutex mu_;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<grpc::ClientContext*> contexts_ ABSL_GUARDED_BY(mu_);
};

// The context of one call in a CallGroup, registered for its lifetime.
class GroupCall {
 public:
  GroupCall(CallGroup& group, absl::Time deadline) : group_(group) {
    context_.set_deadline(ToChrono(deadline));
    group_.Register(&context_);
  }
  ~GroupCall() { group_.Unregister(&context_); }
  grpc::ClientContext& context() { return context_; }

 private:
  CallGroup& group_;
  grpc::ClientContext context_;
};

// Runs fn(i) for i in [0, n) on n threads (the last on the caller's) and
// returns the statuses. The first error, in index order, is what callers
// report; errors caused by cancelling the group are CANCELLED and lose to
// the error that caused them.
std::vector<absl::Status> RunParallel(int n, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  for (int i = 0; i + 1 < n; ++i) threads.emplace_back([&, i] { statuses[i] = fn(i); });
  if (n > 0) statuses[n - 1] = fn(n - 1);
  for (std::thread& t : threads) t.join();
  return statuses;
}

absl::Status FirstError(const std::vector<absl::Status>& statuses) {
  for (const absl::Status& s : statuses) {
    if (!s.ok() && s.code() != absl::StatusCode::kCancelled) return s;
  }
  for (const absl::Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

FetchStats& FetchStats::operator+=(const FetchStats& o) {
  for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
    received[d] += o.received[d];
    fp32_equivalent[d] += o.fp32_equivalent[d];
    bf16_equivalent[d] += o.bf16_equivalent[d];
  }
  pieces += o.pieces;
  fetches += o.fetches;
  return *this;
}

const TensorMeta* Manifest::Find(const std::string& name) const {
  for (const TensorMeta& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::vector<FetchTarget> AllTargets(const Manifest& manifest,
                                    const std::vector<Direction>& directions,
                                    const std::vector<std::string>& tensors) {
  std::vector<FetchTarget> targets;
  for (const TensorMeta& t : manifest.tensors) {
    if (!tensors.empty() && std::find(tensors.begin(), tensors.end(), t.name) == tensors.end()) {
      continue;
    }
    for (Direction d : directions) {
      if (t.Publishes(d)) targets.push_back({t.name, d, {}, {}});
    }
  }
  return targets;
}

absl::Status CheckPushGradients(const Manifest& manifest, absl::Span<const Gradient> gradients) {
  for (size_t i = 0; i < gradients.size(); ++i) {
    const Gradient& g = gradients[i];
    const TensorMeta* meta = manifest.Find(g.tensor);
    if (meta == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("gradient of unknown tensor '", g.tensor, "'"));
    }
    const int64_t element = g.dtype == Gradient::DType::kFp32 ? 4 : 2;
    if (static_cast<int64_t>(g.bytes.size()) != meta->rows * meta->cols * element) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient of ", g.tensor, " has ", g.bytes.size(), " bytes; expected ",
                       meta->rows * meta->cols * element));
    }
    for (size_t j = 0; j < i; ++j) {
      if (gradients[j].tensor == g.tensor) {
        return absl::InvalidArgumentError(absl::StrCat("two gradients of ", g.tensor));
      }
    }
  }
  if (manifest.num_daemons == 0) {
    return absl::FailedPreconditionError("no model loaded (the manifest has no daemons)");
  }
  return absl::OkStatus();
}

std::vector<PushRoute> PushRoutesTo(const Manifest& manifest, int rank,
                                    absl::Span<const Gradient> gradients) {
  std::vector<PushRoute> routes;
  for (size_t i = 0; i < gradients.size(); ++i) {
    const Gradient& g = gradients[i];
    const TensorMeta* meta = manifest.Find(g.tensor);
    if (meta == nullptr) continue;  // refused by CheckPushGradients
    const int64_t row_bytes = meta->cols * (g.dtype == Gradient::DType::kFp32 ? 4 : 2);
    for (const PieceLocation& p : meta->pieces) {
      if (p.daemon_rank != rank) continue;
      routes.push_back({static_cast<int>(i), p.row_begin, p.row_end, p.row_begin * row_bytes,
                        (p.row_end - p.row_begin) * row_bytes});
    }
  }
  return routes;
}

Gradient Gradient::Fp32(std::string tensor, absl::Span<const float> values) {
  return {std::move(tensor), DType::kFp32,
          absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(values.data()),
                              values.size() * sizeof(float))};
}

Gradient Gradient::Bf16(std::string tensor, absl::Span<const uint16_t> values) {
  return {std::move(tensor), DType::kBf16,
          absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(values.data()),
                              values.size() * sizeof(uint16_t))};
}

// ---------------------------------------------------------------------------

class Client::Impl {
 public:
  explicit Impl(ClientOptions options) : options_(std::move(options)) {}

  absl::Status Connect();
  void Leave();

  absl::Time DeadlineFor(absl::Duration timeout) const {
    return absl::Now() + (timeout == absl::ZeroDuration() ? options_.call_timeout : timeout);
  }

  absl::StatusOr<Manifest> RefreshManifest(absl::Time deadline);
  Manifest manifest() const {
    absl::MutexLock lock(&mu_);
    return manifest_;
  }
  absl::StatusOr<Layout> LayoutOf(const std::string& tensor, Direction direction) const;
  absl::StatusOr<FetchResult> Fetch(int64_t version, const std::vector<FetchTarget>& targets,
                                    absl::Time deadline);
  absl::StatusOr<PushResult> PushGradients(int64_t version, absl::Span<const Gradient> gradients,
                                           absl::Time deadline);
  absl::StatusOr<int64_t> WaitForVersion(int64_t min_version, absl::Time deadline);
  absl::StatusOr<VersionInfo> WaitForVersionInfo(int64_t min_version, absl::Time deadline);
  absl::StatusOr<rpc::GetStatusResponse> Status(bool include_shards, absl::Time deadline);
  absl::StatusOr<int64_t> Load(const std::string& path, const std::string& recipe,
                               absl::Time deadline, bool replace_model);
  absl::StatusOr<int64_t> Step(int64_t version, bool wait, absl::Time deadline);
  absl::StatusOr<recipe::OptimizerConfig> SetOptimizerSchedule(const recipe::LrSchedule& schedule,
                                                               std::optional<float> lr,
                                                               absl::Time deadline);
  FetchStats fetch_stats() const {
    absl::MutexLock lock(&mu_);
    return totals_;
  }

  std::string member_id_;
  int rank_ = -1;

  std::shared_ptr<grpc::Channel> DaemonChannel(const std::string& address) {
    absl::MutexLock lock(&mu_);
    return DaemonChannelLocked(address);
  }
  absl::StatusOr<int64_t> LoadDeclared(
      const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors,
      const std::string& recipe, absl::Time deadline, bool replace_model);

 private:
  // One (tensor, direction) of a fetch, resolved against the manifest.
  struct Resolved {
    const TensorMeta* meta = nullptr;
    Direction direction = Direction::kRowwise;
    QuantSpec spec;
    Layout layout;
    absl::Span<uint8_t> data;    // destination (caller's or the result's)
    absl::Span<uint8_t> scales;
    // Filled while pieces arrive (under the fetch's mutex).
    int64_t rows_covered = 0;
    bool have_scale = false;
    float scale_inv = 1.0f;
    float amax = 0.0f;
  };

  void SetManifest(Manifest m) {
    absl::MutexLock lock(&mu_);
    manifest_ = std::move(m);
  }
  std::shared_ptr<rpc::Daemon::Stub> DaemonStub(const std::string& address);
  std::shared_ptr<grpc::Channel> DaemonChannelLocked(const std::string& address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status FetchFromDaemon(int64_t version, const std::string& address,
                               const rpc::FetchRequest& request,
                               std::map<std::pair<std::string, Direction>, int>& index,
                               std::vector<Resolved>& resolved, absl::Mutex& result_mu,
                               FetchStats& stats, CallGroup& group, absl::Time deadline);
  absl::Status PushToDaemon(int64_t version, const Manifest& manifest, int rank,
                            absl::Span<const Gradient> gradients, PushResult& result,
                            absl::Mutex& result_mu, CallGroup& group, absl::Time deadline);

  ClientOptions options_;
  auth::ChannelSecurity security_;  // set by Connect, then read-only
  std::shared_ptr<grpc::Channel> coordinator_channel_;
  std::unique_ptr<rpc::Coordinator::Stub> coordinator_;

  mutable absl::Mutex mu_;
  Manifest manifest_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<rpc::Daemon::Stub>> daemons_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<grpc::Channel>> daemon_channels_ ABSL_GUARDED_BY(mu_);
  FetchStats totals_ ABSL_GUARDED_BY(mu_);
  // The coordinator's recovery epoch as last seen (-1: none seen yet).
  int64_t recovery_epoch_ ABSL_GUARDED_BY(mu_) = -1;
};

absl::Status Client::Impl::Connect() {
  if (options_.coordinator_address.empty()) {
    return absl::InvalidArgumentError("ClientOptions::coordinator_address is empty");
  }
  if (options_.name.empty()) options_.name = DefaultName();
  ASSIGN_OR_RETURN(security_.tls, auth::LoadTls(options_.tls));
  security_.token = std::make_shared<auth::BearerToken>(options_.token);
  coordinator_channel_ = MakeChannel(options_.coordinator_address, security_);
  coordinator_ = rpc::Coordinator::NewStub(coordinator_channel_);
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  if (!coordinator_channel_->WaitForConnected(ToChrono(deadline))) {
    return absl::UnavailableError(absl::StrCat(
        "cannot reach the coordinator at ", options_.coordinator_address, " within ",
        absl::FormatDuration(options_.connect_timeout),
        security_.tls.enabled() ? " over TLS (is its certificate signed by the given CA and "
                                  "issued for that address?)"
                                : " over plaintext (a TLS server refuses plaintext clients)"));
  }
  rpc::JoinRequest request;
  request.set_role(options_.role == ClientOptions::Role::kTrainer ? rpc::ROLE_TRAINER
                                                                  : rpc::ROLE_OBSERVER);
  request.set_name(options_.name);
  request.set_pusher(options_.role == ClientOptions::Role::kTrainer && options_.pusher);
  request.set_expected_pushers(options_.expected_pushers);
  rpc::JoinResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(FromGrpcStatus(coordinator_->Join(&context, request, &response),
                                 "join the coordinator"));
  member_id_ = response.member_id();
  rank_ = response.rank();
  return RefreshManifest(deadline).status();
}

void Client::Impl::Leave() {
  if (coordinator_ == nullptr || member_id_.empty()) return;
  rpc::LeaveRequest request;
  request.set_member_id(member_id_);
  rpc::LeaveResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(absl::Now() + std::min(options_.call_timeout, absl::Seconds(2))));
  (void)coordinator_->Leave(&context, request, &response);
}

absl::StatusOr<Manifest> Client::Impl::RefreshManifest(absl::Time deadline) {
  rpc::GetManifestResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(FromGrpcStatus(
      coordinator_->GetManifest(&context, rpc::GetManifestRequest(), &response), "GetManifest"));
  ASSIGN_OR_RETURN(Manifest m, ManifestFromProto(response.manifest()));
  SetManifest(m);
  return m;
}

absl::StatusOr<Layout> Client::Impl::LayoutOf(const std::string& tensor,
                                              Direction direction) const {
  absl::MutexLock lock(&mu_);
  const TensorMeta* meta = manifest_.Find(tensor);
  if (meta == nullptr) return absl::NotFoundError(absl::StrCat("no tensor '", tensor, "'"));
  if (!meta->Publishes(direction)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor '", tensor, "' does not publish a ", DirectionName(direction), " copy"));
  }
  return ComputeLayout(meta->SpecOf(direction), direction, meta->rows, meta->cols);
}

std::shared_ptr<rpc::Daemon::Stub> Client::Impl::DaemonStub(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& stub = daemons_[address];
  if (stub == nullptr) stub = rpc::Daemon::NewStub(DaemonChannelLocked(address));
  return stub;
}

std::shared_ptr<grpc::Channel> Client::Impl::DaemonChannelLocked(const std::string& address) {
  auto& channel = daemon_channels_[address];
  if (channel == nullptr) channel = MakeChannel(address, security_);
  return channel;
}

absl::StatusOr<VersionInfo> Client::Impl::WaitForVersionInfo(int64_t min_version,
                                                            absl::Time deadline) {
  rpc::WaitForVersionRequest request;
  request.set_min_version(min_version);
  {
    absl::MutexLock lock(&mu_);
    if (recovery_epoch_ >= 0) request.set_recovery_epoch(recovery_epoch_);
  }
  rpc::WaitForVersionResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(FromGrpcStatus(coordinator_->WaitForVersion(&context, request, &response),
                                 absl::StrCat("wait for version ", min_version)));
  {
    absl::MutexLock lock(&mu_);
    recovery_epoch_ = std::max(recovery_epoch_, response.recovery_epoch());
  }
  VersionInfo info;
  info.committed_version = response.committed_version();
  info.recovery_epoch = response.recovery_epoch();
  if (response.has_rewound_to_version()) {
    info.rewound_to = response.rewound_to_version();
    // A replacement daemon serves the lost rank at another address.
    RETURN_IF_ERROR(RefreshManifest(deadline).status());
  }
  return info;
}

constexpr char kRewoundPayload[] = "type.paramd/rewound_to_version";

absl::StatusOr<int64_t> Client::Impl::WaitForVersion(int64_t min_version, absl::Time deadline) {
  ASSIGN_OR_RETURN(VersionInfo info, WaitForVersionInfo(min_version, deadline));
  if (info.rewound_to.has_value()) {
    absl::Status s = absl::AbortedError(absl::StrCat(
        "wait for version ", min_version, ": the cluster rewound to version ", *info.rewound_to,
        " (recovery ", info.recovery_epoch,
        ": a daemon was lost and replaced); go back to that version and push for it"));
    s.SetPayload(kRewoundPayload, absl::Cord(absl::StrCat(*info.rewound_to)));
    return s;
  }
  return info.committed_version;
}

absl::StatusOr<FetchResult> Client::Impl::Fetch(int64_t version,
                                                const std::vector<FetchTarget>& targets,
                                                absl::Time deadline) {
  if (version == kLatest) {
    ASSIGN_OR_RETURN(version, WaitForVersion(0, deadline));
  }
  if (version < 0) return absl::InvalidArgumentError(absl::StrCat("bad version ", version));
  Manifest manifest = this->manifest();
  bool refreshed = false;
  FetchResult result;
  result.version = version;
  result.tensors.resize(targets.size());
  std::vector<Resolved> resolved(targets.size());
  std::map<std::pair<std::string, Direction>, int> index;
  for (size_t i = 0; i < targets.size(); ++i) {
    const FetchTarget& target = targets[i];
    const TensorMeta* meta = manifest.Find(target.tensor);
    if (meta == nullptr && !refreshed) {
      ASSIGN_OR_RETURN(manifest, RefreshManifest(deadline));
      refreshed = true;
      meta = manifest.Find(target.tensor);
    }
    if (meta == nullptr) {
      return absl::NotFoundError(absl::StrCat("no tensor '", target.tensor, "' in the manifest"));
    }
    if (!index.emplace(std::make_pair(target.tensor, target.direction), i).second) {
      return absl::InvalidArgumentError(absl::StrCat("target ", target.tensor, " ",
                                                     DirectionName(target.direction),
                                                     " given twice"));
    }
    if (!meta->Publishes(target.direction)) {
      return absl::FailedPreconditionError(absl::StrCat("tensor '", target.tensor,
                                                        "' does not publish a ",
                                                        DirectionName(target.direction), " copy"));
    }
    Resolved& r = resolved[i];
    r.meta = meta;
    r.direction = target.direction;
    r.spec = meta->SpecOf(target.direction);
    ASSIGN_OR_RETURN(r.layout, ComputeLayout(r.spec, r.direction, meta->rows, meta->cols));
    FetchedTensor& out = result.tensors[i];
    out.tensor = target.tensor;
    out.spec = r.spec;
    out.layout = r.layout;
    if (!target.data.empty() || !target.scales.empty()) {
      if (static_cast<int64_t>(target.data.size()) < r.layout.data_bytes() ||
          static_cast<int64_t>(target.scales.size()) < r.layout.scale_bytes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "buffers for ", target.tensor, " ", DirectionName(target.direction), " hold ",
            target.data.size(), "+", target.scales.size(), " bytes; the layout needs ",
            r.layout.data_bytes(), "+", r.layout.scale_bytes()));
      }
      r.data = target.data.subspan(0, r.layout.data_bytes());
      r.scales = target.scales.subspan(0, r.layout.scale_bytes());
    } else {
      out.value.data.resize(r.layout.data_bytes());
      out.value.scales.resize(r.layout.scale_bytes());
      r.data = absl::MakeSpan(out.value.data);
      r.scales = absl::MakeSpan(out.value.scales);
    }
    std::fill(r.scales.begin(), r.scales.end(), 0);  // padding is 0 (D8)
  }

  // One request per daemon holding pieces of the targets.
  std::map<std::string, rpc::FetchRequest> requests;
  for (const Resolved& r : resolved) {
    for (const PieceLocation& p : r.meta->pieces) {
      rpc::FetchRequest& request = requests[p.daemon_address];
      request.set_version(version);
      request.set_max_chunk_bytes(options_.max_chunk_bytes);
      rpc::TensorDirections* td = nullptr;
      for (auto& existing : *request.mutable_tensors()) {
        if (existing.tensor() == r.meta->name) td = &existing;
      }
      if (td == nullptr) {
        td = request.add_tensors();
        td->set_tensor(r.meta->name);
      }
      const rpc::Direction d = DirectionToProto(r.direction);
      if (std::find(td->directions().begin(), td->directions().end(), d) ==
          td->directions().end()) {
        td->add_directions(d);
      }
    }
  }
  std::vector<std::pair<std::string, rpc::FetchRequest>> per_daemon(requests.begin(),
                                                                    requests.end());
  absl::Mutex result_mu;
  CallGroup group;
  const std::vector<absl::Status> statuses =
      RunParallel(per_daemon.size(), [&](int i) {
        absl::Status s = FetchFromDaemon(version, per_daemon[i].first, per_daemon[i].second,
                                         index, resolved, result_mu, result.stats, group,
                                         deadline);
        if (!s.ok()) group.Fail();
        return s;
      });
  RETURN_IF_ERROR(FirstError(statuses));

  for (size_t i = 0; i < resolved.size(); ++i) {
    const Resolved& r = resolved[i];
    if (r.rows_covered != r.meta->rows) {
      // The daemons cut the tensor differently from our manifest: the plan
      // changed under us. Re-read it; the caller retries.
      (void)RefreshManifest(deadline);
      return absl::AbortedError(absl::StrCat("fetch of ", r.meta->name, " covered ",
                                             r.rows_covered, " of ", r.meta->rows,
                                             " rows: the shard plan changed; retry"));
    }
    QuantizedTensor& v = result.tensors[i].value;
    v.format = r.spec.format;
    v.direction = r.direction;
    v.rows = r.meta->rows;
    v.cols = r.meta->cols;
    v.scale_inv = r.scale_inv;
    v.amax = r.amax;
    const int64_t elements = r.meta->rows * r.meta->cols;
    result.stats.fp32_equivalent[r.direction] += elements * 4;
    result.stats.bf16_equivalent[r.direction] += elements * 2;
  }
  result.stats.fetches = 1;
  absl::MutexLock lock(&mu_);
  totals_ += result.stats;
  return result;
}

absl::Status Client::Impl::FetchFromDaemon(
    int64_t version, const std::string& address, const rpc::FetchRequest& request,
    std::map<std::pair<std::string, Direction>, int>& index, std::vector<Resolved>& resolved,
    absl::Mutex& result_mu, FetchStats& stats, CallGroup& group, absl::Time deadline) {
  const std::string where = absl::StrCat("fetch of version ", version, " from ", address);
  std::shared_ptr<rpc::Daemon::Stub> stub = DaemonStub(address);
  GroupCall call(group, deadline);
  grpc::ClientContext& context = call.context();
  std::unique_ptr<grpc::ClientReader<rpc::FetchResponse>> reader = stub->Fetch(&context, request);

  rpc::FetchResponse message;
  if (!reader->Read(&message) || !message.has_plan()) {
    absl::Status s = FromGrpcStatus(reader->Finish(), where);
    if (s.ok()) return absl::InternalError(absl::StrCat(where, ": stream without a plan"));
    return s;
  }
  const rpc::FetchPlan plan = message.plan();
  if (plan.version() != version) {
    return absl::InternalError(
        absl::StrCat(where, ": the daemon answered with version ", plan.version()));
  }
  // Per plan piece: where its bytes go. A piece that is the whole tensor is
  // received straight into the destination; others into a staging buffer,
  // placed with sharding::CopyPieceIn when complete.
  struct Incoming {
    int target = 0;
    sharding::PiecePlacement placement;
    bool direct = false;
    std::vector<uint8_t> data, scales;  // staging (!direct)
    absl::Span<uint8_t> data_dst, scales_dst;
    int64_t data_received = 0, scales_received = 0;
  };
  std::vector<Incoming> pieces(plan.pieces_size());
  for (int p = 0; p < plan.pieces_size(); ++p) {
    const rpc::FetchPiece& fp = plan.pieces(p);
    ASSIGN_OR_RETURN(Direction direction, DirectionFromProto(fp.direction()));
    auto it = index.find({fp.tensor(), direction});
    if (it == index.end()) {
      return absl::InternalError(absl::StrCat(where, ": unrequested piece ", fp.tensor(), " ",
                                              DirectionName(direction)));
    }
    Incoming& in = pieces[p];
    in.target = it->second;
    const Resolved& r = resolved[in.target];
    auto placement = sharding::PlacePiece(r.spec, direction, r.meta->rows, r.meta->cols,
                                          fp.row_begin(), fp.row_end());
    if (!placement.ok()) {
      return absl::InternalError(absl::StrCat(where, ": bad piece: ", placement.status().message()));
    }
    in.placement = *placement;
    if (fp.data_bytes() != in.placement.piece.data_bytes() ||
        fp.scale_bytes() != in.placement.piece.scale_bytes()) {
      return absl::InternalError(absl::StrCat(where, ": piece ", fp.tensor(), " rows [",
                                              fp.row_begin(), ", ", fp.row_end(),
                                              ") has sizes that do not match its layout"));
    }
    in.direct = fp.row_begin() == 0 && fp.row_end() == r.meta->rows;
    if (in.direct) {
      in.data_dst = r.data;
      in.scales_dst = r.scales;
    } else {
      in.data.resize(fp.data_bytes());
      in.scales.resize(fp.scale_bytes());
      in.data_dst = absl::MakeSpan(in.data);
      in.scales_dst = absl::MakeSpan(in.scales);
    }
  }

  DirectionBytes received;
  while (reader->Read(&message)) {
    if (!message.has_chunk()) {
      context.TryCancel();
      return absl::InternalError(absl::StrCat(where, ": a second plan in the stream"));
    }
    const rpc::FetchChunk& chunk = message.chunk();
    if (chunk.piece() < 0 || chunk.piece() >= static_cast<int>(pieces.size())) {
      context.TryCancel();
      return absl::InternalError(absl::StrCat(where, ": chunk of unknown piece ", chunk.piece()));
    }
    Incoming& in = pieces[chunk.piece()];
    const bool is_data = chunk.buffer() == rpc::BUFFER_DATA;
    absl::Span<uint8_t> dst = is_data ? in.data_dst : in.scales_dst;
    int64_t& got = is_data ? in.data_received : in.scales_received;
    const int64_t size = static_cast<int64_t>(chunk.data().size());
    if (chunk.offset() != got || chunk.offset() + size > static_cast<int64_t>(dst.size())) {
      context.TryCancel();
      return absl::InternalError(absl::StrCat(where, ": chunk at offset ", chunk.offset(),
                                              " of ", size, " bytes does not fit"));
    }
    std::memcpy(dst.data() + chunk.offset(), chunk.data().data(), size);
    got += size;
    received[resolved[in.target].direction] += size;
  }
  RETURN_IF_ERROR(FromGrpcStatus(reader->Finish(), where));

  absl::MutexLock lock(&result_mu);
  for (int p = 0; p < plan.pieces_size(); ++p) {
    const rpc::FetchPiece& fp = plan.pieces(p);
    Incoming& in = pieces[p];
    Resolved& r = resolved[in.target];
    if (in.data_received != fp.data_bytes() || in.scales_received != fp.scale_bytes()) {
      return absl::DataLossError(absl::StrCat(where, ": piece ", fp.tensor(), " rows [",
                                              fp.row_begin(), ", ", fp.row_end(),
                                              ") arrived incomplete"));
    }
    if (!in.direct) {
      RETURN_IF_ERROR(sharding::CopyPieceIn(in.placement, in.data, in.scales, r.data, r.scales));
    }
    if (r.have_scale && fp.scale_inv() != r.scale_inv) {
      return absl::InternalError(absl::StrCat(where, ": pieces of ", fp.tensor(),
                                              " disagree on scale_inv"));
    }
    r.have_scale = true;
    r.scale_inv = fp.scale_inv();
    r.amax = std::max(r.amax, fp.amax());
    r.rows_covered += fp.row_end() - fp.row_begin();
  }
  stats.received.rowwise += received.rowwise;
  stats.received.columnwise += received.columnwise;
  stats.pieces += plan.pieces_size();
  return absl::OkStatus();
}

absl::StatusOr<PushResult> Client::Impl::PushGradients(int64_t version,
                                                       absl::Span<const Gradient> gradients,
                                                       absl::Time deadline) {
  const Manifest manifest = this->manifest();
  RETURN_IF_ERROR(CheckPushGradients(manifest, gradients));
  PushResult result;
  result.version = version;
  result.pushers_received = -1;
  absl::Mutex result_mu;
  CallGroup group;
  const std::vector<absl::Status> statuses = RunParallel(manifest.num_daemons, [&](int rank) {
    absl::Status s =
        PushToDaemon(version, manifest, rank, gradients, result, result_mu, group, deadline);
    if (!s.ok()) group.Fail();
    return s;
  });
  RETURN_IF_ERROR(FirstError(statuses));
  return result;
}

absl::Status Client::Impl::PushToDaemon(int64_t version, const Manifest& manifest, int rank,
                                        absl::Span<const Gradient> gradients,
                                        PushResult& result, absl::Mutex& result_mu,
                                        CallGroup& group, absl::Time deadline) {
  const std::string& address = manifest.daemon_addresses[rank];
  const std::string where = absl::StrCat("push of version ", version, " to ", address);
  std::shared_ptr<rpc::Daemon::Stub> stub = DaemonStub(address);
  GroupCall call(group, deadline);
  grpc::ClientContext& context = call.context();
  rpc::PushGradientsResponse response;
  std::unique_ptr<grpc::ClientWriter<rpc::PushGradientsRequest>> writer =
      stub->PushGradients(&context, &response);
  rpc::PushGradientsRequest message;
  message.set_version(version);
  message.set_pusher_id(member_id_);
  bool first = true;
  int64_t sent = 0;
  bool stream_ok = true;
  for (const PushRoute& p : PushRoutesTo(manifest, rank, gradients)) {
    if (!stream_ok) break;
    const Gradient& g = gradients[p.gradient];
    const uint8_t* base = g.bytes.data() + p.byte_offset;
    for (int64_t offset = 0; offset < p.bytes && stream_ok; offset += kPushChunkBytes) {
      const int64_t n = std::min(kPushChunkBytes, p.bytes - offset);
      if (!first) message.Clear();
      first = false;
      rpc::GradientChunk* chunk = message.mutable_chunk();
      chunk->set_tensor(g.tensor);
      chunk->set_row_begin(p.row_begin);
      chunk->set_row_end(p.row_end);
      chunk->set_dtype(g.dtype == Gradient::DType::kFp32 ? rpc::DTYPE_FP32 : rpc::DTYPE_BF16);
      chunk->set_offset(offset);
      chunk->set_data(base + offset, n);
      stream_ok = writer->Write(message);
      sent += n;
    }
  }
  // The end marker: the daemon applies the stream only when it arrives
  // with the right total. A daemon owning none of these rows still gets it
  // (with the version and pusher of the first message), so that it counts
  // this pusher.
  if (stream_ok) {
    if (!first) message.Clear();
    message.mutable_end()->set_total_bytes(sent);
    stream_ok = writer->Write(message);
  }
  // The daemon answers on the end marker and may have finished already.
  if (stream_ok) writer->WritesDone();
  RETURN_IF_ERROR(FromGrpcStatus(writer->Finish(), where));
  absl::MutexLock lock(&result_mu);
  result.bytes_sent += sent;
  result.pushers_received = result.pushers_received < 0
                                ? response.pushers_received()
                                : std::min(result.pushers_received, response.pushers_received());
  result.pushers_expected = response.pushers_expected();
  return absl::OkStatus();
}

absl::StatusOr<rpc::GetStatusResponse> Client::Impl::Status(bool include_shards,
                                                            absl::Time deadline) {
  rpc::GetStatusRequest request;
  request.set_include_shards(include_shards);
  rpc::GetStatusResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(
      FromGrpcStatus(coordinator_->GetStatus(&context, request, &response), "GetStatus"));
  return response;
}

absl::StatusOr<int64_t> Client::Impl::Load(const std::string& path, const std::string& recipe,
                                           absl::Time deadline, bool replace_model) {
  rpc::LoadRequest request;
  request.set_safetensors_path(path);
  request.set_recipe_text(recipe);
  request.set_force(replace_model);
  rpc::LoadResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(FromGrpcStatus(coordinator_->Load(&context, request, &response),
                                 absl::StrCat("load ", path)));
  ASSIGN_OR_RETURN(Manifest m, ManifestFromProto(response.manifest()));
  SetManifest(std::move(m));
  return response.committed_version();
}

absl::StatusOr<int64_t> Client::Impl::LoadDeclared(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors,
    const std::string& recipe, absl::Time deadline, bool replace_model) {
  rpc::LoadRequest request;
  for (const auto& [name, shape] : tensors) {
    rpc::TensorDecl* d = request.add_tensors();
    d->set_name(name);
    for (int64_t s : shape) d->add_shape(s);
  }
  request.set_recipe_text(recipe);
  request.set_force(replace_model);
  rpc::LoadResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(FromGrpcStatus(coordinator_->Load(&context, request, &response),
                                 absl::StrCat("load of ", tensors.size(), " declared tensors")));
  ASSIGN_OR_RETURN(Manifest m, ManifestFromProto(response.manifest()));
  SetManifest(std::move(m));
  return response.committed_version();
}

absl::StatusOr<int64_t> Client::Impl::Step(int64_t version, bool wait, absl::Time deadline) {
  rpc::StepRequest request;
  request.set_version(version);
  request.set_wait(wait);
  rpc::StepResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(FromGrpcStatus(coordinator_->Step(&context, request, &response),
                                 absl::StrCat("step from version ", version)));
  return response.committed_version();
}

absl::StatusOr<recipe::OptimizerConfig> Client::Impl::SetOptimizerSchedule(
    const recipe::LrSchedule& schedule, std::optional<float> lr, absl::Time deadline) {
  rpc::SetOptimizerScheduleRequest request;
  *request.mutable_schedule() = schedule;
  if (lr.has_value()) request.set_lr(*lr);
  rpc::SetOptimizerScheduleResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(FromGrpcStatus(
      coordinator_->SetOptimizerSchedule(&context, request, &response), "SetOptimizerSchedule"));
  return response.optimizer();
}

// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  RETURN_IF_ERROR(impl->Connect());
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() { impl_->Leave(); }

const std::string& Client::member_id() const { return impl_->member_id_; }
int Client::rank() const { return impl_->rank_; }
Manifest Client::manifest() const { return impl_->manifest(); }

absl::StatusOr<Manifest> Client::RefreshManifest(absl::Duration timeout) {
  return impl_->RefreshManifest(impl_->DeadlineFor(timeout));
}

absl::StatusOr<Layout> Client::LayoutOf(const std::string& tensor, Direction direction) const {
  return impl_->LayoutOf(tensor, direction);
}

absl::StatusOr<FetchResult> Client::Fetch(int64_t version, const std::vector<FetchTarget>& targets,
                                          absl::Duration timeout) {
  return impl_->Fetch(version, targets, impl_->DeadlineFor(timeout));
}

absl::StatusOr<PushResult> Client::PushGradients(int64_t version,
                                                 absl::Span<const Gradient> gradients,
                                                 absl::Duration timeout) {
  return impl_->PushGradients(version, gradients, impl_->DeadlineFor(timeout));
}

absl::StatusOr<int64_t> Client::WaitForVersion(int64_t min_version, absl::Duration timeout) {
  return impl_->WaitForVersion(min_version, absl::Now() + timeout);
}

absl::StatusOr<VersionInfo> Client::WaitForVersionInfo(int64_t min_version,
                                                      absl::Duration timeout) {
  return impl_->WaitForVersionInfo(min_version, absl::Now() + timeout);
}

std::optional<int64_t> RewoundTo(const absl::Status& status) {
  if (!absl::IsAborted(status)) return std::nullopt;
  auto payload = status.GetPayload(kRewoundPayload);
  int64_t v = 0;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &v)) return std::nullopt;
  return v;
}

absl::StatusOr<rpc::GetStatusResponse> Client::Status(bool include_shards,
                                                      absl::Duration timeout) {
  return impl_->Status(include_shards, impl_->DeadlineFor(timeout));
}

absl::StatusOr<int64_t> Client::Load(const std::string& safetensors_path,
                                     const std::string& recipe_text, absl::Duration timeout,
                                     bool replace_model) {
  return impl_->Load(safetensors_path, recipe_text, impl_->DeadlineFor(timeout), replace_model);
}

absl::StatusOr<int64_t> Client::Step(int64_t version, bool wait, absl::Duration timeout) {
  return impl_->Step(version, wait, impl_->DeadlineFor(timeout));
}

absl::StatusOr<int64_t> Client::LoadDeclared(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors,
    const std::string& recipe_text, absl::Duration timeout, bool replace_model) {
  return impl_->LoadDeclared(tensors, recipe_text, impl_->DeadlineFor(timeout), replace_model);
}

absl::StatusOr<recipe::OptimizerConfig> Client::SetOptimizerSchedule(
    const recipe::LrSchedule& schedule, std::optional<float> lr, absl::Duration timeout) {
  return impl_->SetOptimizerSchedule(schedule, lr, impl_->DeadlineFor(timeout));
}

std::shared_ptr<grpc::Channel> Client::DaemonChannel(const std::string& address) {
  return impl_->DaemonChannel(address);
}

FetchStats Client::fetch_stats() const { return impl_->fetch_stats(); }

}  // namespace client
}  // namespace paramd
