#include "server/snapshot/shard_set_adapter.h"

#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "kernels/reference.h"

namespace paramd {
namespace checkpoint {
namespace {

uint32_t FloatBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

void FillDirection(const DelayedScalingState& delayed, float scale, float amax,
                   DirectionScaling* out) {
  out->set_scale(delayed.scale);
  out->set_scale_inv(scale != 0.0f ? 1.0f / scale : 1.0f);
  out->set_cast_scale(scale);
  out->set_global_amax(amax);
  for (float a : delayed.amax_history) out->add_amax_history(a);
}

}  // namespace

std::vector<std::string> MomentNames(OptimizerKind kind) {
  if (kind == OptimizerKind::kSgd) return {"momentum"};
  return {"exp_avg", "exp_avg_sq"};
}

std::string EncodeOptimizerOptions(const OptimizerOptions& o) {
  return absl::StrFormat(
      "kind=%s lr=%08x beta1=%08x beta2=%08x eps=%08x weight_decay=%08x "
      "momentum=%08x",
      OptimizerName(o.kind), FloatBits(o.lr), FloatBits(o.beta1), FloatBits(o.beta2),
      FloatBits(o.eps), FloatBits(o.weight_decay), FloatBits(o.momentum));
}

absl::Status DecodeOptimizerOptions(const std::string& text, OptimizerOptions* options) {
  OptimizerOptions o;
  int seen = 0;
  for (absl::string_view field : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(field, absl::MaxSplits('=', 1));
    if (kv.first == "kind") {
      ASSIGN_OR_RETURN(o.kind, ParseOptimizerKind(kv.second));
      ++seen;
      continue;
    }
    uint32_t bits;
    if (!absl::SimpleHexAtoi(kv.second, &bits)) {
      return absl::DataLossError(absl::StrCat("optimizer options: bad field '", field, "'"));
    }
    float value;
    std::memcpy(&value, &bits, 4);
    float* target = kv.first == "lr"             ? &o.lr
                    : kv.first == "beta1"        ? &o.beta1
                    : kv.first == "beta2"        ? &o.beta2
                    : kv.first == "eps"          ? &o.eps
                    : kv.first == "weight_decay" ? &o.weight_decay
                    : kv.first == "momentum"     ? &o.momentum
                                                 : nullptr;
    if (target == nullptr) {
      return absl::DataLossError(absl::StrCat("optimizer options: unknown field '", field, "'"));
    }
    *target = value;
    ++seen;
  }
  if (seen != 7) return absl::DataLossError(absl::StrCat("optimizer options: '", text, "'"));
  *options = o;
  return absl::OkStatus();
}

DaemonStateView MakeDaemonStateView(const ShardSet& set, const PublishedVersion& published) {
  DaemonStateView view;
  view.version = published.version;
  const std::vector<std::string> moments = MomentNames(set.optimizer().kind);
  for (size_t i = 0; i < set.shards().size(); ++i) {
    const ShardDef& shard = set.shards()[i];
    const TensorDef& tensor = set.tensors()[shard.tensor];
    PieceView piece;
    piece.tensor = tensor.name;
    piece.row_begin = shard.row_begin;
    piece.row_end = shard.row_end;
    piece.cols = tensor.cols;
    piece.master = set.master(static_cast<int>(i));
    const OptimizerState& state = set.optimizer_state(static_cast<int>(i));
    piece.moments.emplace_back(moments[0], state.m);
    if (moments.size() > 1) piece.moments.emplace_back(moments[1], state.v);
    view.pieces.push_back(std::move(piece));

    if (view.tensor_states.count(tensor.name) > 0) continue;
    TensorState& ts = view.tensor_states[tensor.name];
    ts.set_optimizer_step(set.optimizer_steps());
    ts.set_skipped_steps(set.skipped_steps());
    TensorScalingInfo scaling;
    if (static_cast<size_t>(shard.tensor) < published.tensors.size()) {
      scaling = published.tensors[shard.tensor];
    }
    FillDirection(set.delayed_state(shard.tensor, Direction::kRowwise), scaling.rowwise_scale,
                  scaling.rowwise_amax, ts.mutable_rowwise());
    FillDirection(set.delayed_state(shard.tensor, Direction::kColumnwise), scaling.columnwise_scale,
                  scaling.columnwise_amax, ts.mutable_columnwise());
  }
  view.daemon_blob = EncodeOptimizerOptions(set.optimizer());
  return view;
}

absl::Status ReadPublishedRows(const ShardSet& set, const PublishedVersion& published,
                               ExportValuesKind kind, const std::string& tensor, int64_t row_begin,
                               int64_t row_end, absl::Span<float> out) {
  int t = -1;
  for (size_t i = 0; i < set.tensors().size(); ++i) {
    if (set.tensors()[i].name == tensor) t = static_cast<int>(i);
  }
  const int s = t < 0 ? -1 : set.FindShard(t, row_begin, row_end);
  if (s < 0) {
    return absl::NotFoundError(absl::StrCat("rows [", row_begin, ", ", row_end, ") of ",
                                            QuoteForMessage(tensor),
                                            " are not held by this daemon"));
  }
  const TensorDef& def = set.tensors()[t];
  const ShardDef& shard = set.shards()[s];
  if (static_cast<int64_t>(out.size()) != (row_end - row_begin) * def.cols) {
    return absl::InvalidArgumentError(absl::StrCat("output holds ", out.size(),
                                                   " values, rows x "
                                                   "cols is ",
                                                   (row_end - row_begin) * def.cols));
  }
  const size_t skip = static_cast<size_t>((row_begin - shard.row_begin) * def.cols);
  if (kind == ExportValuesKind::kMaster) {
    std::memcpy(out.data(), set.master(s).data() + skip, out.size() * sizeof(float));
    return absl::OkStatus();
  }
  const Direction direction =
      kind == ExportValuesKind::kRowwise ? Direction::kRowwise : Direction::kColumnwise;
  for (const PublishedPiece& piece : published.pieces) {
    if (piece.shard != s || piece.direction != direction) continue;
    const QuantSpec& spec =
        direction == Direction::kRowwise ? def.spec.rowwise : def.spec.columnwise;
    ASSIGN_OR_RETURN(std::vector<float> values, ref::Dequantize(piece.q, spec));
    std::memcpy(out.data(), values.data() + skip, out.size() * sizeof(float));
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("version ", published.version, " has no ",
                                          DirectionName(direction), " copy of ",
                                          QuoteForMessage(tensor)));
}

}  // namespace checkpoint
}  // namespace paramd
