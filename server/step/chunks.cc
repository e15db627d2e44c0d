#include "server/step/chunks.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "format/convert.h"
#include "server/step/optimizer_config.h"

namespace paramd {

int ModelView::Find(const std::string& name) const {
  auto it = index.find(name);
  return it == index.end() ? -1 : it->second;
}

int ModelView::FindShard(int tensor, int64_t row_begin, int64_t row_end) const {
  for (size_t i = 0; i < shards.size(); ++i) {
    const ShardDef& d = shards[i];
    if (d.tensor == tensor && d.row_begin <= row_begin && row_end <= d.row_end) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

absl::StatusOr<ModelView> MakeModelView(const rpc::Manifest& manifest, int rank,
                                        int64_t generation) {
  ModelView v;
  v.generation = generation;
  v.rank = rank;
  v.manifest = manifest;
  for (int i = 0; i < manifest.tensors_size(); ++i) {
    const rpc::TensorInfo& t = manifest.tensors(i);
    TensorDef d;
    d.name = t.name();
    d.rows = t.rows();
    d.cols = t.cols();
    if (d.name.empty() || d.rows < 1 || d.cols < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest tensor ", i, " (", d.name, "): bad name or shape"));
    }
    ASSIGN_OR_RETURN(d.spec, HybridSpecFromProto(t.spec()));
    if (t.has_optimizer()) d.optimizer = TensorOptimizerFromProto(t.optimizer());
    if (!v.index.emplace(d.name, i).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor ", d.name));
    }
    v.tensors.push_back(std::move(d));
  }
  if (manifest.has_optimizer_config()) {
    ASSIGN_OR_RETURN(v.optimizer, OptimizerFromProto(manifest.optimizer_config()));
  }
  for (const rpc::ShardPiece& p : manifest.pieces()) {
    if (p.daemon_rank() != rank) continue;
    const int t = v.Find(p.tensor());
    if (t < 0 || p.row_begin() < 0 || p.row_end() <= p.row_begin() ||
        p.row_end() > v.tensors[t].rows) {
      return absl::InvalidArgumentError(absl::StrCat("bad manifest piece ", p.tensor(), " [",
                                                     p.row_begin(), ", ", p.row_end(), ")"));
    }
    v.shards.push_back({t, p.row_begin(), p.row_end()});
  }
  std::sort(v.shards.begin(), v.shards.end(), [](const ShardDef& a, const ShardDef& b) {
    return std::make_pair(a.tensor, a.row_begin) < std::make_pair(b.tensor, b.row_begin);
  });
  return v;
}

ChunkAssembler::ChunkAssembler(const ModelView* view, bool allow_non_finite)
    : view_(view), allow_non_finite_(allow_non_finite) {}

absl::Status ChunkAssembler::Add(const rpc::GradientChunk& c) {
  const int t = view_->Find(c.tensor());
  if (t < 0) return UnknownTensorError(c.tensor());
  const TensorDef& def = view_->tensors[t];
  ASSIGN_OR_RETURN(const int elem, DTypeSize(c.dtype()));
  if (c.row_begin() < 0 || c.row_end() <= c.row_begin() || c.row_end() > def.rows) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", def.name, ": rows [", c.row_begin(),
                                                   ", ", c.row_end(), ") outside [0, ", def.rows,
                                                   ")"));
  }
  const std::string where =
      absl::StrCat("tensor ", def.name, " rows [", c.row_begin(), ", ", c.row_end(), ")");
  if (c.data().size() % elem != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": chunk of ", c.data().size(), " bytes splits an element"));
  }
  if (open_) {
    const StagedPiece& p = pieces_.back();
    if (p.tensor != t || p.row_begin != c.row_begin() || p.row_end != c.row_end() ||
        open_dtype_ != c.dtype() || c.offset() != open_received_) {
      return absl::InvalidArgumentError(
          absl::StrCat("piece ", view_->tensors[p.tensor].name, " rows [", p.row_begin, ", ",
                       p.row_end, ") is incomplete: expected its chunk at offset ", open_received_,
                       ", got ", where, " offset ", c.offset()));
    }
  } else {
    const int shard = view_->FindShard(t, c.row_begin(), c.row_end());
    if (shard < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, " are not held by daemon rank ", view_->rank,
                       " (wrong daemon or a row range spanning shards; re-read the manifest)"));
    }
    if (c.offset() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": first chunk at offset ", c.offset(), ", expected 0"));
    }
    for (const StagedPiece& p : pieces_) {
      if (p.tensor == t && p.row_begin < c.row_end() && c.row_begin() < p.row_end) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, " overlap rows already sent in this stream"));
      }
    }
    StagedPiece p;
    p.shard = shard;
    p.tensor = t;
    p.row_begin = c.row_begin();
    p.row_end = c.row_end();
    p.values.reserve((p.row_end - p.row_begin) * def.cols);
    pieces_.push_back(std::move(p));
    open_ = true;
    open_dtype_ = c.dtype();
    open_received_ = 0;
    open_expected_ = (c.row_end() - c.row_begin()) * def.cols * elem;
  }
  if (open_received_ + static_cast<int64_t>(c.data().size()) > open_expected_) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", open_received_ + c.data().size(),
                                                   " bytes, expected ", open_expected_));
  }
  StagedPiece& p = pieces_.back();
  const size_t before = p.values.size();
  RETURN_IF_ERROR(DecodeValues(c.dtype(), c.data(), p.values));
  if (!allow_non_finite_) {
    for (size_t i = before; i < p.values.size(); ++i) {
      if (!std::isfinite(p.values[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": non-finite value ", p.values[i], " at element ", i));
      }
    }
  }
  open_received_ += c.data().size();
  bytes_ += c.data().size();
  if (open_received_ == open_expected_) open_ = false;
  return absl::OkStatus();
}

absl::Status ChunkAssembler::Close() const {
  if (!open_) return absl::OkStatus();
  const StagedPiece& p = pieces_.back();
  return absl::InvalidArgumentError(absl::StrCat(
      "stream ended inside piece ", view_->tensors[p.tensor].name, " rows [", p.row_begin, ", ",
      p.row_end, "): ", open_received_, " of ", open_expected_, " bytes"));
}

}  // namespace paramd
