// The manifest and push routing of client/client.h (pure functions).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client_internal.h"
#include "common/status_macros.h"
#include "format/convert.h"

namespace paramd {
namespace client {

namespace internal {

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
  out.frozen.assign(m.frozen().begin(), m.frozen().end());
  for (TensorMeta& t : out.tensors) {
    std::sort(t.pieces.begin(), t.pieces.end(), [](const PieceLocation& a, const PieceLocation& b) {
      return a.row_begin < b.row_begin;
    });
  }
  return out;
}

}  // namespace internal

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

const FrozenTensor* Manifest::FindFrozen(const std::string& name) const {
  for (const FrozenTensor& f : frozen) {
    if (f.name() == name) return &f;
  }
  return nullptr;
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

absl::Status CheckPushGradients(const Manifest& manifest, absl::Span<const Gradient> gradients,
                                PushCoverage coverage) {
  for (size_t i = 0; i < gradients.size(); ++i) {
    const Gradient& g = gradients[i];
    const TensorMeta* meta = manifest.Find(g.tensor);
    if (meta == nullptr) {
      if (manifest.FindFrozen(g.tensor) != nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "gradient of '", g.tensor,
            "', a frozen buffer (a non-floating tensor of the model: loaded, checkpointed and "
            "exported, never stepped): leave it out of the push"));
      }
      return absl::InvalidArgumentError(
          absl::StrCat("gradient of unknown tensor '", g.tensor, "'"));
    }
    const int64_t element = g.dtype == Gradient::DType::kFp32 ? 4 : 2;
    if (static_cast<int64_t>(g.bytes.size()) != meta->rows * meta->cols * element) {
      const bool whole = g.bytes.size() % element == 0;
      return absl::InvalidArgumentError(
          absl::StrCat("gradient of ", g.tensor, " has ",
                       whole ? absl::StrCat(g.bytes.size() / element, " values")
                             : absl::StrCat(g.bytes.size(), " bytes"),
                       "; expected ", meta->rows * meta->cols, " (", meta->rows, " x ", meta->cols,
                       ", ", g.dtype == Gradient::DType::kFp32 ? "FP32" : "BF16", ": ",
                       meta->rows * meta->cols * element, " bytes)"));
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
  if (coverage == PushCoverage::kEveryTensor) {
    std::vector<absl::string_view> missing;
    for (const TensorMeta& t : manifest.tensors) {
      const bool given = std::any_of(gradients.begin(), gradients.end(),
                                     [&](const Gradient& g) { return g.tensor == t.name; });
      if (!given) missing.push_back(t.name);
    }
    if (!missing.empty()) {
      constexpr size_t kNamed = 8;
      const size_t named = std::min(missing.size(), kNamed);
      return absl::InvalidArgumentError(absl::StrCat(
          "the push misses ", missing.size(), " of the model's ", manifest.tensors.size(),
          " tensors: ", absl::StrJoin(absl::MakeConstSpan(missing.data(), named), ", "),
          missing.size() > named ? absl::StrCat(" and ", missing.size() - named, " more") : "",
          "; give every gradient of the step, or push as partial (the tensors left out then "
          "count as zero)"));
    }
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
  // In manifest tensor order: a daemon running --pipelined_step steps each
  // bucket of tensors once the pushes have moved past it (and refuses a
  // piece of an earlier tensor than the one before it).
  auto order = [&](const PushRoute& r) {
    return std::make_pair(manifest.Find(gradients[r.gradient].tensor) - manifest.tensors.data(),
                          r.row_begin);
  };
  std::stable_sort(routes.begin(), routes.end(),
                   [&](const PushRoute& a, const PushRoute& b) { return order(a) < order(b); });
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

}  // namespace client
}  // namespace paramd
