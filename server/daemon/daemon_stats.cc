// File: server/daemon/daemon_stats.cc
//
// The daemon's GetStats and the FP8 health of its published pieces
// (server/daemon/daemon.h: Daemon::Stats, Daemon::PublishedHealth).

#include "server/daemon/daemon_internal.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace paramd {

grpc::ServerUnaryReactor* Daemon::Impl::GetStats(grpc::CallbackServerContext* context,
                                                 const rpc::GetStatsRequest* request,
                                                 rpc::GetStatsResponse* response) {
  if (grpc::Status s =
          auth::Authorize(options_.authenticator.get(), *context, "/paramd.rpc.Daemon/GetStats");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  FillStats(request->include_shards(), response->mutable_stats());
  {
    absl::MutexLock lock(&mu_);
    response->set_coordinator_address(coordinator_address_);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

std::vector<PieceHealth> Daemon::Impl::PublishedHealth(int64_t max_samples) const {
  std::shared_ptr<const PublishedVersion> latest;
  std::shared_ptr<const ModelView> view;
  {
    absl::MutexLock lock(&mu_);
    latest = latest_;
    view = view_;
  }
  std::vector<PieceHealth> out;
  if (!latest || !view) return out;
  for (const PublishedPiece& p : latest->pieces) {
    if (p.tensor < 0 || p.tensor >= static_cast<int>(view->tensors.size())) continue;
    const TensorDef& t = view->tensors[p.tensor];
    const QuantSpec& spec = p.direction == Direction::kRowwise ? t.spec.rowwise : t.spec.columnwise;
    PieceHealth h;
    h.tensor = t.name;
    h.direction = p.direction;
    h.format = p.q.format;
    h.row_begin = p.row_begin;
    h.row_end = p.row_end;
    h.amax = p.q.amax;
    h.scale = p.scale;
    h.codes = CountCodes(p.q, spec.fp8_type, max_samples);
    out.push_back(std::move(h));
  }
  return out;
}

void Daemon::Impl::FillStats(bool include_shards, rpc::DaemonStats* stats) const {
  absl::MutexLock lock(&mu_);
  stats->set_rank(rank_);
  stats->set_address(address_);
  stats->set_published_version(latest_ ? latest_->version : -1);
  if (previous_) stats->add_held_versions(previous_->version);
  if (latest_) stats->add_held_versions(latest_->version);
  stats->set_pushers_received(static_cast<int>(pushers_.size()));
  stats->set_pushers_expected(expected_pushers_);
  traffic_.Fill(stats);
  stats->set_steps(steps_);
  stats->set_last_step_seconds(last_step_seconds_);
  if (latest_) {
    const StepReport& r = latest_->report;
    stats->set_optimizer_steps(r.optimizer_steps);
    stats->set_skipped_steps(r.skipped_steps);
    stats->set_lr(r.lr);
    stats->set_grad_norm(r.grad_norm);
    stats->set_clip_factor(r.clip_factor);
  }
  if (shards_ != nullptr) {  // replaced only under mu_ (LoadOnWorker)
    const BackendMemory memory = shards_->memory();
    stats->set_backend(std::string(shards_->name()));
    stats->set_parameters(memory.parameters);
    stats->set_device_bytes(memory.device_bytes);
    stats->set_device_bytes_per_parameter(memory.device_bytes_per_parameter());
  }
  std::string error = join_error_;
  if (failed_step_from_ > -2 && !last_step_error_.ok()) {
    absl::StrAppend(&error, error.empty() ? "" : "; ", "step from ", failed_step_from_,
                    " failed: ", last_step_error_.ToString());
  }
  stats->set_error(error);
  snapshots_->FillStats(stats);
  if (!include_shards || !latest_ || !view_) return;
  for (const PublishedPiece& p : latest_->pieces) {
    if (stats->shards_size() == 0 ||
        stats->shards().rbegin()->tensor() != view_->tensors[p.tensor].name ||
        stats->shards().rbegin()->row_begin() != p.row_begin) {
      rpc::ShardStats* s = stats->add_shards();
      s->set_tensor(view_->tensors[p.tensor].name);
      s->set_row_begin(p.row_begin);
      s->set_row_end(p.row_end);
    }
    rpc::DirectionStats* d = stats->mutable_shards()->rbegin()->add_directions();
    d->set_direction(DirectionToProto(p.direction));
    d->set_format(FormatToProto(p.q.format));
    d->set_scale(p.scale);
    d->set_scale_inv(p.q.scale_inv);
    d->set_amax(p.q.amax);
    // Delayed scaling records the reduced amax of the cast as its newest
    // history entry.
    if (p.q.format == Format::kFp8Delayed) d->set_amax_history_head(p.q.amax);
  }
}

}  // namespace paramd
