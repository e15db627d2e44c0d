// File: server/coordinator/coordinator_load.cc
//
// The coordinator's Load (server/coordinator/coordinator.h): the manifest from a
// safetensors file, declared tensors or a checkpoint (with the optimizer it
// was saved with), the shard plan, and LoadShards fanned out to the daemons.
// GetManifest.

#include "server/coordinator/coordinator_internal.h"

#include <google/protobuf/text_format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "checkpoint/daemon_io.h"
#include "checkpoint/store.h"
#include "common/file_util.h"
#include "common/grpc_status.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "format/convert.h"
#include "grpcpp/alarm.h"
#include "safetensors/safetensors.h"
#include "server/coordinator/frozen_data.h"
#include "server/coordinator/recovery.h"
#include "server/rpc/fan_out.h"
#include "server/step/optimizer_config.h"
#include "sharding/balance.h"

namespace paramd {

using coordinator_internal::kTag;

namespace {

absl::StatusOr<SavedOptimizer> ReadSavedOptimizer(const checkpoint::Manifest& manifest) {
  SavedOptimizer saved;
  auto it = manifest.metadata().find("optimizer_config");
  if (it == manifest.metadata().end()) return saved;
  absl::StatusOr<OptimizerOptions> config =
      ParseOptimizerConfig(it->second, "checkpoint metadata optimizer_config");
  if (!config.ok()) return absl::DataLossError(config.status().message());
  saved.config = *config;
  auto t = manifest.metadata().find("optimizer_tensors");
  if (t != manifest.metadata().end()) {
    rpc::Manifest tensors;
    if (!google::protobuf::TextFormat::ParseFromString(t->second, &tensors)) {
      return absl::DataLossError("checkpoint metadata optimizer_tensors does not parse");
    }
    for (const rpc::TensorInfo& info : tensors.tensors()) {
      saved.tensors[info.name()] = TensorOptimizerFromProto(info.optimizer());
    }
  }
  return saved;
}

// Where a load takes its model from, for log lines and the recovery status:
// "checkpoint V of \"PATH\"", "\"PATH\"" or "pushed weights" (paths quoted
// and bounded with QuoteForMessage).
std::string LoadSourceForMessage(const rpc::LoadRequest& request, int64_t checkpoint_version) {
  if (!request.checkpoint_path().empty()) {
    return absl::StrCat("checkpoint ", checkpoint_version, " of ",
                        QuoteForMessage(request.checkpoint_path()));
  }
  return request.safetensors_path().empty() ? "pushed weights"
                                            : QuoteForMessage(request.safetensors_path());
}

}  // namespace

struct Coordinator::Impl::LoadJoinWait {
  rpc::LoadRequest request;
  LoadDone done;     // called once, by the call that settles the wait
  absl::Time since;  // when the Load arrived
  absl::Time give_up;
  grpc::Alarm alarm;  // TryLoadJoinWait at give_up
  absl::Mutex mu;
  bool settled ABSL_GUARDED_BY(mu) = false;
  // A registration on world_waiters_ (it holds the wait) is pending.
  bool registered ABSL_GUARDED_BY(mu) = false;
  WaitList::Id id ABSL_GUARDED_BY(mu) = 0;
};

grpc::ServerUnaryReactor* Coordinator::Impl::Load(grpc::CallbackServerContext* context,
                                                  const rpc::LoadRequest* request,
                                                  rpc::LoadResponse* response) {
  if (grpc::Status s =
          auth::Authorize(options_.authenticator.get(), *context, "/paramd.rpc.Coordinator/Load");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  LoadDone done = [reactor, response](const absl::Status& s, const rpc::LoadResponse& r) {
    if (s.ok()) *response = r;
    reactor->Finish(ToGrpcStatus(s));
  };
  bool joined;
  {
    absl::MutexLock lock(&mu_);
    joined = table_.all_joined() || shut_down_;
  }
  if (joined) {
    StartLoad(*request, std::move(done));
    return reactor;
  }
  // Daemons still joining (a cluster being started): wait for them, up to
  // load_join_wait and a little before the call's deadline, so that the
  // caller gets UNAVAILABLE naming the missing ranks rather than
  // DEADLINE_EXCEEDED.
  const absl::Time now = absl::Now();
  absl::Time give_up = now + options_.load_join_wait;
  const auto deadline = context->deadline();
  if (deadline < absl::ToChronoTime(give_up)) {
    const absl::Time d = absl::FromChrono(deadline);
    give_up = d - std::min(absl::Seconds(1), std::max(absl::ZeroDuration(), (d - now) / 10));
  }
  auto wait = std::make_shared<LoadJoinWait>();
  wait->request = *request;
  wait->done = std::move(done);
  wait->since = now;
  wait->give_up = give_up;
  // The alarm holds the wait weakly: a settled wait is freed (and its alarm
  // cancelled) without waiting for give_up.
  wait->alarm.Set(absl::ToChronoTime(give_up),
                  [this, weak = std::weak_ptr<LoadJoinWait>(wait)](bool fired) {
                    if (!fired) return;
                    if (std::shared_ptr<LoadJoinWait> w = weak.lock()) {
                      TryLoadJoinWait(w, /*woken=*/false, /*at_give_up=*/true);
                    }
                  });
  TryLoadJoinWait(wait, /*woken=*/false, /*at_give_up=*/false);
  return reactor;
}

void Coordinator::Impl::TryLoadJoinWait(const std::shared_ptr<LoadJoinWait>& wait, bool woken,
                                        bool at_give_up) {
  absl::Status refused;
  {
    absl::MutexLock wait_lock(&wait->mu);
    if (woken) wait->registered = false;
    if (wait->settled) return;
    if (!wait->registered) {
      wait->id = world_waiters_.Add(
          [this, wait] { TryLoadJoinWait(wait, /*woken=*/true, /*at_give_up=*/false); });
      wait->registered = true;
    }
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      // Once all have joined, also until each is ready: a DOWN daemon (say
      // stopped) may heartbeat again (Heartbeat wakes world_waiters_ when it
      // is back). One waiting in its Join is not DOWN: the open Join holds
      // its lease (DaemonTable::JoinWaitBegan).
      absl::Status ready = table_.all_joined() ? table_.CheckAllReady("a load", now)
                                               : absl::UnavailableError("not all joined");
      if (shut_down_) {
        refused = absl::UnavailableError("coordinator shutting down");
      } else if (!ready.ok()) {
        if (!at_give_up && now < wait->give_up) return;  // a join or the alarm comes back
        if (table_.all_joined()) {
          refused = ready;
        } else {
          std::vector<std::string> missing;
          for (int r = 0; r < table_.size(); ++r) {
            if (!table_.slot(r).joined) missing.push_back(table_.Name(r));
          }
          refused = absl::UnavailableError(absl::StrCat(
              "waiting for daemons: ", table_.joined(), " of ", options_.expected_daemons,
              " joined after ",
              absl::FormatDuration(absl::Trunc(now - wait->since, absl::Milliseconds(100))),
              " (missing ", absl::StrJoin(missing, ", "),
              "); start them (hybrid-paramd --role=daemon) and load again"));
        }
      }
    }
    wait->settled = true;
    if (wait->registered && world_waiters_.Remove(wait->id)) wait->registered = false;
  }
  // Settled here: nothing else reads request or done from now on.
  LoadDone done = std::move(wait->done);
  if (!refused.ok()) {
    LogInfo(kTag, absl::StrCat("Load refused: ", refused.message()));
    done(refused, rpc::LoadResponse());
    return;
  }
  StartLoad(wait->request, std::move(done));
}

grpc::ServerUnaryReactor* Coordinator::Impl::GetManifest(grpc::CallbackServerContext* context,
                                                         const rpc::GetManifestRequest* request,
                                                         rpc::GetManifestResponse* response) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Coordinator/GetManifest");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  absl::MutexLock lock(&mu_);
  *response->mutable_manifest() = ManifestLocked(/*with_pieces=*/true, request->with_frozen_data());
  return Done(context, absl::OkStatus());
}

rpc::Manifest Coordinator::Impl::ManifestLocked(bool with_pieces, bool with_frozen_data) const {
  rpc::Manifest m;
  if (with_frozen_data) {
    m = manifest_;
  } else {
    // The frozen buffers' bytes (up to --max_frozen_bytes) are not copied
    // under mu_ for a status or a manifest refresh: they are moved aside
    // for the copy (mu_ is held, nothing else reads manifest_ meanwhile)
    // and only their names, dtypes and shapes are given.
    auto& held = const_cast<rpc::Manifest&>(manifest_);
    google::protobuf::RepeatedPtrField<FrozenTensor> frozen;
    frozen.Swap(held.mutable_frozen());
    m = held;
    held.mutable_frozen()->Swap(&frozen);
    for (const FrozenTensor& f : manifest_.frozen()) {
      FrozenTensor* named = m.add_frozen();
      named->set_name(f.name());
      named->set_dtype(f.dtype());
      *named->mutable_shape() = f.shape();
    }
  }
  if (!with_pieces) m.clear_pieces();
  m.set_committed_version(committed_);
  m.set_expected_pushers(options_.expected_pushers);
  m.clear_daemons();
  for (int r = 0; r < table_.size(); ++r) {
    const DaemonSlot& d = table_.slot(r);
    if (!d.joined) continue;
    rpc::DaemonInfo* info = m.add_daemons();
    info->set_rank(r);
    info->set_address(d.member.address());
    info->set_data_plane_address(d.member.data_plane_address());
    info->set_published_version(d.published);
  }
  return m;
}

absl::StatusOr<std::vector<rpc::TensorDecl>> Coordinator::Impl::LoadTensors(
    const rpc::LoadRequest& request, google::protobuf::RepeatedPtrField<FrozenTensor>* frozen) {
  std::vector<rpc::TensorDecl> tensors;
  if (!request.safetensors_path().empty()) {
    if (request.tensors_size() > 0) {
      return absl::InvalidArgumentError("Load: give a safetensors path or tensors, not both");
    }
    ASSIGN_OR_RETURN(safetensors::SafetensorsFile file,
                     safetensors::SafetensorsFile::Open(request.safetensors_path(),
                                                        options_.limits.max_tensor_name_bytes));
    // (request.safetensors_path() is already resolved below --model_root:
    // ConfineLoadPaths.)
    std::vector<const safetensors::TensorInfo*> frozen_infos;
    for (const safetensors::TensorInfo& t : file.tensors()) {
      if (!safetensors::IsTrainableDtype(t.dtype)) {
        FrozenTensor* f = frozen->Add();
        f->set_name(t.name);
        f->set_dtype(std::string(safetensors::DtypeName(t.dtype)));
        for (int64_t s : t.shape) f->add_shape(s);
        frozen_infos.push_back(&t);
        continue;
      }
      rpc::TensorDecl d;
      d.set_name(t.name);
      for (int64_t s : t.shape) d.add_shape(s);
      tensors.push_back(std::move(d));
    }
    // Sizes first: nothing over --max_frozen_bytes is read.
    RETURN_IF_ERROR(CheckFrozenTensors(*frozen, tensors, options_.limits, /*check_data=*/false));
    for (int i = 0; i < frozen->size(); ++i) {
      std::string* data = frozen->Mutable(i)->mutable_data();
      data->resize(static_cast<size_t>(frozen_infos[i]->num_elements) *
                   safetensors::DtypeSize(frozen_infos[i]->dtype));
      RETURN_IF_ERROR(file.ReadTensorBytes(
          *frozen_infos[i], 0,
          absl::MakeSpan(reinterpret_cast<uint8_t*>(data->data()), data->size())));
    }
  } else {
    tensors.assign(request.tensors().begin(), request.tensors().end());
    *frozen = request.frozen();
  }
  if (tensors.empty()) {
    return absl::InvalidArgumentError(
        frozen->empty()
            ? "Load: no tensors"
            : "Load: no floating-point tensors (only frozen buffers: nothing to train)");
  }
  RETURN_IF_ERROR(CheckTensorDecls(tensors, options_.limits));
  RETURN_IF_ERROR(CheckFrozenTensors(*frozen, tensors, options_.limits));
  return tensors;
}

absl::StatusOr<std::vector<std::pair<rpc::TensorDecl, HybridSpec>>>
Coordinator::Impl::CheckpointTensors(const std::string& path, int64_t& version,
                                     SavedOptimizer* saved_optimizer,
                                     google::protobuf::RepeatedPtrField<FrozenTensor>* frozen) {
  ASSIGN_OR_RETURN(checkpoint::CheckpointStore store,
                   checkpoint::CheckpointStore::Open(path, /*create=*/false));
  ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::CheckpointReader> reader,
                   checkpoint::OpenForRestore(store, version, /*verify=*/true));
  version = static_cast<int64_t>(reader->manifest().version());
  ASSIGN_OR_RETURN(*saved_optimizer, ReadSavedOptimizer(reader->manifest()));
  std::vector<std::pair<rpc::TensorDecl, HybridSpec>> out;
  for (const checkpoint::TensorInfo& t : reader->manifest().tensors()) {
    rpc::TensorDecl d;
    d.set_name(t.name());
    *d.mutable_shape() = t.shape();
    rpc::HybridSpec proto;
    if (!proto.ParseFromString(t.spec())) {
      return absl::DataLossError(absl::StrCat("checkpoint ", version, ": tensor ",
                                              QuoteForMessage(t.name()), " has a bad spec"));
    }
    ASSIGN_OR_RETURN(HybridSpec spec, HybridSpecFromProto(proto));
    out.emplace_back(std::move(d), spec);
  }
  *frozen = reader->manifest().frozen();
  std::vector<rpc::TensorDecl> decls;
  decls.reserve(out.size());
  for (const auto& [decl, spec] : out) decls.push_back(decl);
  if (absl::Status s = CheckFrozenTensors(*frozen, decls, options_.limits); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("checkpoint ", version, ": ", s.message()));
  }
  return out;
}

absl::StatusOr<rpc::Manifest> Coordinator::Impl::BuildManifest(const rpc::LoadRequest& request,
                                                               int64_t& checkpoint_version) {
  RETURN_IF_ERROR(CheckLoadRequest(request, options_.limits));
  std::vector<rpc::TensorDecl> decls;
  std::vector<HybridSpec> saved_specs;
  SavedOptimizer saved_optimizer;
  google::protobuf::RepeatedPtrField<FrozenTensor> frozen;
  if (!request.checkpoint_path().empty()) {
    if (!request.safetensors_path().empty() || request.tensors_size() > 0 ||
        !request.recipe_text().empty()) {
      return absl::InvalidArgumentError(
          "Load: a checkpoint restore takes no safetensors path, tensors or recipe");
    }
    checkpoint_version = request.checkpoint_version();
    ASSIGN_OR_RETURN(auto saved, CheckpointTensors(request.checkpoint_path(), checkpoint_version,
                                                   &saved_optimizer, &frozen));
    for (auto& [decl, spec] : saved) {
      decls.push_back(std::move(decl));
      saved_specs.push_back(spec);
    }
  } else {
    ASSIGN_OR_RETURN(decls, LoadTensors(request, &frozen));
  }
  SpecResolver resolver = options_.resolver;
  OptimizerResolver optimizer_resolver = options_.optimizer_resolver;
  OptimizerOptions optimizer;
  {
    absl::MutexLock lock(&mu_);
    optimizer = optimizer_;
  }
  if (!saved_specs.empty()) {
    resolver = [&](const std::string& name,
                   absl::Span<const int64_t>) -> absl::StatusOr<HybridSpec> {
      for (size_t i = 0; i < decls.size(); ++i) {
        if (decls[i].name() == name) return saved_specs[i];
      }
      return absl::InternalError(name);
    };
  }
  if (!request.recipe_text().empty()) {
    if (!options_.recipe_parser) {
      return absl::UnimplementedError("this coordinator cannot parse recipes");
    }
    ASSIGN_OR_RETURN(ParsedRecipe parsed, options_.recipe_parser(request.recipe_text()));
    resolver = parsed.resolver;
    optimizer_resolver = parsed.optimizer_resolver;
    if (parsed.optimizer.has_value()) optimizer = *parsed.optimizer;
  }
  // A restore steps on with the checkpoint's optimizer config and
  // overrides, unless this coordinator was given a config: that one is
  // an override, logged here and recorded by the next checkpoint.
  if (!request.checkpoint_path().empty() && saved_optimizer.config.has_value()) {
    if (!options_.optimizer_explicit) {
      optimizer = *saved_optimizer.config;
      optimizer_resolver = [tensors = saved_optimizer.tensors](const std::string& name) {
        auto it = tensors.find(name);
        return it == tensors.end() ? TensorOptimizer() : it->second;
      };
    } else if (DescribeOptimizer(optimizer) != DescribeOptimizer(*saved_optimizer.config)) {
      Log(kTag, absl::StrCat("restore of checkpoint ", checkpoint_version,
                             ": optimizer config override: the checkpoint has ",
                             DescribeOptimizer(*saved_optimizer.config), "; stepping with ",
                             DescribeOptimizer(optimizer)));
    }
  }
  rpc::Manifest manifest;
  std::vector<sharding::ManifestTensor> entries;
  for (size_t i = 0; i < decls.size(); ++i) {
    const rpc::TensorDecl& d = decls[i];
    int64_t rows = 1;
    for (int j = 0; j + 1 < d.shape_size(); ++j) rows *= d.shape(j);
    const int64_t cols = d.shape_size() > 0 ? d.shape(d.shape_size() - 1) : 1;
    for (int64_t s : d.shape()) {
      if (s < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", QuoteForMessage(d.name()), " has an empty dimension"));
      }
    }
    HybridSpec spec;
    if (resolver) {
      ASSIGN_OR_RETURN(
          spec, resolver(d.name(), std::vector<int64_t>(d.shape().begin(), d.shape().end())));
    }
    rpc::TensorInfo* t = manifest.add_tensors();
    t->set_name(d.name());
    *t->mutable_shape() = d.shape();
    t->set_rows(rows);
    t->set_cols(cols);
    *t->mutable_spec() = HybridSpecToProto(spec);
    t->set_index(static_cast<int>(i));
    *t->mutable_optimizer() = TensorOptimizerToProto(
        optimizer_resolver ? optimizer_resolver(d.name()) : TensorOptimizer(), optimizer);
    ASSIGN_OR_RETURN(sharding::ManifestTensor e,
                     sharding::ManifestEntry(d.name(), rows, cols, spec));
    entries.push_back(std::move(e));
  }
  ASSIGN_OR_RETURN(sharding::ShardPlan plan,
                   sharding::MakeShardPlan(entries, options_.expected_daemons, options_.plan));
  absl::MutexLock lock(&mu_);
  for (const sharding::Piece& p : plan.pieces) {
    rpc::ShardPiece* sp = manifest.add_pieces();
    sp->set_tensor(plan.tensors[p.tensor].name);
    sp->set_tensor_index(p.tensor);
    sp->set_row_begin(p.row_begin);
    sp->set_row_end(p.row_end);
    sp->set_daemon_rank(p.daemon);
    sp->set_daemon_address(table_.slot(p.daemon).member.address());
  }
  manifest.set_expected_pushers(options_.expected_pushers);
  *manifest.mutable_frozen() = std::move(frozen);
  manifest.set_optimizer(std::string(OptimizerName(optimizer.kind)));
  *manifest.mutable_optimizer_config() = OptimizerToProto(optimizer);
  RETURN_IF_ERROR(CheckMemoryBudget(manifest, options_.limits));
  // The next model generation, before the fingerprint: a manifest of
  // another generation never has the same one (server/coordinator/model_generation.h).
  // model_generation_ moves only once the load is accepted (FanOutLoad).
  manifest.set_model_generation(model_generation_ + 1);
  if (!request.checkpoint_path().empty()) {
    manifest.mutable_restored_from()->set_path(request.checkpoint_path());
    manifest.mutable_restored_from()->set_version(checkpoint_version);
    manifest.set_loaded_from(
        absl::StrCat("checkpoint ", checkpoint_version, " of ", request.checkpoint_path()));
  } else {
    manifest.set_loaded_from(request.safetensors_path().empty() ? "pushed weights"
                                                                : request.safetensors_path());
  }
  manifest.set_plan_fingerprint(absl::HashOf(manifest.SerializeAsString()));
  // Every daemon's address: snapshots go to the buddy (server/snapshot/snapshot.h).
  for (int r = 0; r < table_.size(); ++r) {
    rpc::DaemonInfo* info = manifest.add_daemons();
    info->set_rank(r);
    info->set_address(table_.slot(r).member.address());
  }
  // The coordinator's optimizer_ changes only once the load is accepted
  // (AdoptManifestOptimizerLocked): a refused load changes nothing.
  return manifest;
}

void Coordinator::Impl::AdoptManifestOptimizerLocked(const rpc::Manifest& manifest) {
  absl::StatusOr<OptimizerOptions> optimizer = OptimizerFromProto(manifest.optimizer_config());
  if (!optimizer.ok()) return;  // BuildManifest wrote it from an OptimizerOptions
  if (DescribeOptimizer(*optimizer) != DescribeOptimizer(optimizer_)) {
    Log(kTag, absl::StrCat("optimizer for this model: ", DescribeOptimizer(*optimizer)));
  }
  optimizer_ = *optimizer;
}

absl::StatusOr<rpc::LoadRequest> Coordinator::Impl::ConfineLoadPaths(
    rpc::LoadRequest request) const {
  RETURN_IF_ERROR(CheckSourcePaths(request.safetensors_path(), request.checkpoint_path()));
  const std::vector<std::string>& roots = options_.limits.file_roots;
  if (!request.safetensors_path().empty()) {
    ASSIGN_OR_RETURN(*request.mutable_safetensors_path(),
                     ResolveBelow(roots, request.safetensors_path(), "--model_root"));
  }
  if (!request.checkpoint_path().empty()) {
    ASSIGN_OR_RETURN(*request.mutable_checkpoint_path(),
                     ResolveBelow(roots, request.checkpoint_path(), "--model_root"));
  }
  return request;
}

void Coordinator::Impl::StartLoad(const rpc::LoadRequest& original, LoadDone done) {
  absl::StatusOr<rpc::LoadRequest> confined = ConfineLoadPaths(original);
  if (!confined.ok()) {
    done(confined.status(), rpc::LoadResponse());
    return;
  }
  const rpc::LoadRequest& request = *confined;
  {
    absl::MutexLock lock(&mu_);
    absl::Status s;
    if (!table_.all_joined()) {
      s = absl::UnavailableError(absl::StrCat("waiting for daemons: ", table_.joined(), " of ",
                                              options_.expected_daemons, " joined"));
    } else if (absl::Status ready =
                   table_.CheckAllReady("a load", absl::Now(),
                                        // After a recovery found nothing to recover from, a load
                                        // is the way out: it gives the replacements their state.
                                        /*state_needed=*/!recovery_.needs_load());
               !ready.ok()) {
      s = ready;
    } else if (loading_) {
      s = absl::FailedPreconditionError("a load is already in progress");
    }
    if (!s.ok()) {
      done(s, rpc::LoadResponse());
      return;
    }
    loading_ = true;
  }
  int64_t checkpoint_version = -1;
  absl::StatusOr<rpc::Manifest> manifest = BuildManifest(request, checkpoint_version);
  if (manifest.ok() && !request.force()) {
    // After BuildManifest, so that a bad request gets its own error; the
    // running model is untouched either way.
    absl::MutexLock lock(&mu_);
    if (committed_ >= 0) {
      manifest = absl::FailedPreconditionError(
          absl::StrCat("the cluster already holds a model (", manifest_.tensors_size(),
                       " tensors, committed version ", committed_,
                       "); loading another discards it and its training state: set force "
                       "(hpctl load --force) to replace it"));
    }
  }
  if (!manifest.ok()) {
    absl::MutexLock lock(&mu_);
    loading_ = false;
    done(manifest.status(), rpc::LoadResponse());
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    if (recovery_.needs_load()) {
      // The daemons left their data-plane world in the failed recovery:
      // it is rebuilt first, on a thread (it blocks), then the load runs.
      if (rebuild_thread_for_load_.joinable()) rebuild_thread_for_load_.join();  // it has ended
      rebuild_thread_for_load_ =
          std::thread([this, manifest = *std::move(manifest), request, checkpoint_version,
                       done = std::move(done)]() mutable {
            RebuildThenLoad(manifest, request, checkpoint_version, std::move(done));
          });
      return;
    }
  }
  FanOutLoad(*manifest, request, checkpoint_version, std::move(done));
}

void Coordinator::Impl::RebuildThenLoad(const rpc::Manifest& manifest,
                                        const rpc::LoadRequest& request, int64_t checkpoint_version,
                                        LoadDone done) {
  RecoveryPlan plan;  // no model: only the data plane
  plan.transport = options_.data_plane;
  plan.prepare_timeout = options_.daemon_call_timeout;
  plan.recover_timeout = options_.daemon_call_timeout;
  {
    absl::MutexLock lock(&mu_);
    // A recovery attempt in flight ends first: its PrepareRecovery would
    // take the daemons out of the world built here.
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shut_down_ || !recovering_; };
    mu_.Await(absl::Condition(&idle));
    if (shut_down_) {
      loading_ = false;
      done(absl::UnavailableError("coordinator shutting down"), rpc::LoadResponse());
      return;
    }
    recovering_ = true;
    plan.epoch = recovery_epoch_ + 1;
    plan.stubs = stubs_;
    for (int r = 0; r < table_.size(); ++r) {
      plan.addresses.push_back(table_.slot(r).member.address());
    }
  }
  absl::StatusOr<RecoveryResult> world = RunRecovery(plan);
  {
    absl::MutexLock lock(&mu_);
    recovering_ = false;
    if (!world.ok()) {
      loading_ = false;
      const absl::Status s(world.status().code(),
                           absl::StrCat("the load could not rebuild the daemons' data plane: ",
                                        world.status().message()));
      LogError(kTag, s.ToString());
      done(s, rpc::LoadResponse());
      return;
    }
    const int64_t first = checkpoint_version >= 0 ? checkpoint_version : 0;
    AdoptRecoveredWorldLocked(*world, plan.epoch);
    // As a recovery: trainers waiting learn that the cluster goes back to
    // the load's first version.
    recovery_.set_committed_before(committed_);
    recovery_.set_rewound_to_version(first);
    recovery_.set_versions_lost(std::max<int64_t>(0, committed_ - first));
    recovery_.set_source(
        request.checkpoint_path().empty()
            ? absl::StrCat("load of ", LoadSourceForMessage(request, first))
            : absl::StrCat("checkpoint ", QuoteForMessage(request.checkpoint_path()), " v", first));
    recovery_.set_state("data plane rebuilt; loading");
    LogInfo(kTag, absl::StrCat("recovery ", plan.epoch,
                               ": data plane rebuilt for the load that replaces the lost state"));
  }
  FanOutLoad(manifest, request, checkpoint_version, std::move(done));
}

void Coordinator::Impl::FanOutLoad(const rpc::Manifest& manifest, const rpc::LoadRequest& request,
                                   int64_t checkpoint_version, LoadDone done) {
  std::vector<std::shared_ptr<rpc::Daemon::Stub>> stubs;
  {
    absl::MutexLock lock(&mu_);
    manifest_ = manifest;
    AdoptManifestOptimizerLocked(manifest_);
    model_generation_ = std::max(model_generation_, manifest_.model_generation());
    committed_ = -1;
    for (int r = 0; r < table_.size(); ++r) table_.slot(r).published = -1;
    stubs = StubsLocked();
  }
  LogInfo(kTag, absl::StrCat("loading ", manifest.tensors_size(), " tensors in ",
                             manifest.pieces_size(), " pieces on ", stubs.size(), " daemons from ",
                             LoadSourceForMessage(request, checkpoint_version)));
  const absl::Time load_start = absl::Now();
  FanOut<rpc::LoadShardsRequest, rpc::LoadShardsResponse>(
      stubs, options_.load_timeout,
      [this, &manifest, &request, checkpoint_version](int rank, rpc::LoadShardsRequest* r) {
        *r->mutable_manifest() = ManifestForDaemons(manifest);
        r->set_daemon_rank(rank);
        r->set_safetensors_path(request.safetensors_path());
        r->set_expected_pushers(options_.expected_pushers);
        r->set_checkpoint_path(request.checkpoint_path());
        r->set_checkpoint_version(checkpoint_version);
      },
      [](rpc::Daemon::Stub* stub, grpc::ClientContext* c, const rpc::LoadShardsRequest* req,
         rpc::LoadShardsResponse* resp, std::function<void(grpc::Status)> cb) {
        stub->async()->LoadShards(c, req, resp, std::move(cb));
      },
      [this, load_start, done = std::move(done)](auto& calls) {
        absl::Status s = FirstError(calls, "LoadShards");
        const std::string took =
            absl::FormatDuration(absl::Trunc(absl::Now() - load_start, absl::Milliseconds(1)));
        if (s.ok()) {
          LogInfo(kTag, absl::StrCat("load done in ", took, " on ", calls.size(), " daemons"));
        } else {
          LogError(kTag, absl::StrCat("load failed after ", took, ": ", s.ToString()));
        }
        rpc::LoadResponse response;
        bool advanced = false;
        {
          absl::MutexLock lock(&mu_);
          loading_ = false;
          StateChangedLocked();
          if (s.ok()) {
            for (size_t i = 0; i < calls.size(); ++i) {
              DaemonSlot& d = table_.slot(static_cast<int>(i));
              d.published = std::max(d.published, calls[i]->response.published_version());
            }
            advanced = RecomputeCommittedLocked();
            if (recovery_.needs_load()) {  // the lost state is replaced: serving again
              recovery_.set_needs_load(false);
              recovery_.set_error("");
              recovery_.set_state("done (a load replaced the lost state)");
            }
          }
          *response.mutable_manifest() = ManifestLocked(/*with_pieces=*/true);
          response.set_committed_version(committed_);
        }
        if (advanced) version_waiters_.WakeAll();
        // Answered once the state file holds the model: a coordinator
        // killed after the reply and restarted from the file still has it.
        if (state_writer_) {
          state_writer_->WhenWritten([done, s, response] { done(s, response); });
        } else {
          done(s, response);
        }
      });
}

}  // namespace paramd
