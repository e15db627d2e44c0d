#include "sharding/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace paramd {
namespace sharding {
namespace {

// A boundary in the end-to-end order of all rows: before row `row` of tensor
// `tensor`. The end of tensor t is normalized to (t + 1, 0).
struct Cut {
  int tensor = 0;
  int64_t row = 0;
};

// Cost bookkeeping shared by planning and the ShardPlan accessors.
class CostModel {
 public:
  CostModel(absl::Span<const ManifestTensor> tensors, const PlanOptions& options)
      : tensors_(tensors), options_(options) {
    base_.resize(tensors.size() + 1, 0);
    for (size_t t = 0; t < tensors.size(); ++t) {
      base_[t + 1] = base_[t] + RowsCost(t, tensors[t].rows);
    }
  }

  // Cost of rows [0, r) of tensor t. Monotone in r; rounded once, so the
  // same inputs give the same integers everywhere.
  int64_t RowsCost(size_t t, int64_t r) const {
    const ManifestTensor& m = tensors_[t];
    return static_cast<int64_t>(
        std::llround(static_cast<double>(r * m.cols) * m.bytes_per_element));
  }
  int64_t TensorCost(size_t t) const { return base_[t + 1] - base_[t]; }
  int64_t total() const { return base_.back(); }

  bool Splittable(size_t t) const {
    return tensors_[t].rows > options_.row_alignment && TensorCost(t) >= options_.min_split_bytes;
  }

  int64_t Position(const Cut& c) const {
    if (c.tensor == static_cast<int>(tensors_.size())) return total();
    return base_[c.tensor] + RowsCost(c.tensor, c.row);
  }

  // The last allowed row boundary of tensor t strictly before row r (r > 0).
  int64_t PrevRow(size_t t, int64_t r) const {
    const int64_t a = options_.row_alignment;
    return Splittable(t) ? ((r - 1) / a) * a : 0;
  }

  // The first cut (in row order) whose position is >= p, for 0 <= p <= total.
  Cut FirstCutAtOrAfter(int64_t p) const {
    if (p <= 0) return Cut{0, 0};
    // First tensor whose end position is >= p.
    const size_t t = std::lower_bound(base_.begin() + 1, base_.end(), p) - (base_.begin() + 1);
    if (!Splittable(t)) return Cut{static_cast<int>(t) + 1, 0};
    const ManifestTensor& m = tensors_[t];
    const int64_t a = options_.row_alignment;
    const int64_t units = (m.rows + a - 1) / a;
    // Smallest j in [1, units] with cost(min(j*a, rows)) >= p - base.
    int64_t lo = 1, hi = units;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (base_[t] + RowsCost(t, std::min(mid * a, m.rows)) >= p) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    const int64_t r = std::min(lo * a, m.rows);
    return r == m.rows ? Cut{static_cast<int>(t) + 1, 0} : Cut{static_cast<int>(t), r};
  }

  // The cut immediately before c (c must not be the very first cut).
  Cut Prev(const Cut& c) const {
    if (c.row > 0) return Cut{c.tensor, PrevRow(c.tensor, c.row)};
    const int t = c.tensor - 1;
    return Cut{t, PrevRow(t, tensors_[t].rows)};
  }

  // The allowed cut nearest to position b; ties and equal positions go to
  // the earliest cut. Monotone in b.
  Cut Nearest(int64_t b) const {
    const Cut hi = FirstCutAtOrAfter(b);
    const int64_t hi_pos = Position(hi);
    if (hi_pos == b || (hi.tensor == 0 && hi.row == 0)) return hi;
    const int64_t lo_pos = Position(Prev(hi));
    if (b - lo_pos <= hi_pos - b) return FirstCutAtOrAfter(lo_pos);
    return hi;
  }

 private:
  absl::Span<const ManifestTensor> tensors_;
  PlanOptions options_;
  std::vector<int64_t> base_;  // base_[t] = cost of tensors [0, t)
};

absl::Status ValidateInputs(absl::Span<const ManifestTensor> tensors, int num_daemons,
                            const PlanOptions& options) {
  if (num_daemons < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_daemons must be >= 1, got ", num_daemons));
  }
  if (options.row_alignment < 128 || options.row_alignment % 128 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "row_alignment must be a positive multiple of 128, got ", options.row_alignment));
  }
  if (options.min_split_bytes < 0) {
    return absl::InvalidArgumentError("min_split_bytes must be >= 0");
  }
  absl::flat_hash_set<std::string> names;
  for (const ManifestTensor& m : tensors) {
    if (m.name.empty()) return absl::InvalidArgumentError("tensor with an empty name");
    if (!names.insert(m.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor name '", m.name, "'"));
    }
    if (m.rows < 1 || m.cols < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", m.name, "' has shape [", m.rows, ", ", m.cols, "]"));
    }
    if (!std::isfinite(m.bytes_per_element) || m.bytes_per_element <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", m.name, "' has bytes_per_element ", m.bytes_per_element));
    }
    // Keep every cost well inside int64 and exactly representable in double.
    if (static_cast<double>(m.rows) * static_cast<double>(m.cols) * m.bytes_per_element > 0x1p52 ||
        m.rows > (int64_t{1} << 40) || m.cols > (int64_t{1} << 40)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", m.name, "' is too large"));
    }
  }
  return absl::OkStatus();
}

int64_t RowOf(const ShardPlan& plan, int t, const Cut& c) {
  if (c.tensor < t) return 0;
  if (c.tensor > t) return plan.tensors[t].rows;
  return c.row;
}

}  // namespace

absl::Span<const Piece> ShardPlan::PiecesOf(int t) const {
  return absl::MakeConstSpan(pieces).subspan(first_piece[t], first_piece[t + 1] - first_piece[t]);
}

int ShardPlan::FindTensor(const std::string& name) const {
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (tensors[t].name == name) return static_cast<int>(t);
  }
  return -1;
}

std::vector<int> ShardPlan::PiecesOnDaemon(int daemon) const {
  std::vector<int> out;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (pieces[i].daemon == daemon) out.push_back(static_cast<int>(i));
  }
  return out;
}

std::vector<int64_t> ShardPlan::DaemonCosts() const {
  std::vector<int64_t> costs(num_daemons, 0);
  for (const Piece& p : pieces) costs[p.daemon] += RowRangeCost(p.tensor, p.row_begin, p.row_end);
  return costs;
}

int64_t ShardPlan::RowRangeCost(int t, int64_t row_begin, int64_t row_end) const {
  CostModel model(absl::MakeConstSpan(tensors).subspan(t, 1), options);
  return model.RowsCost(0, row_end) - model.RowsCost(0, row_begin);
}

bool ShardPlan::IsSplittable(int t) const {
  return CostModel(absl::MakeConstSpan(tensors).subspan(t, 1), options).Splittable(0);
}

int64_t ShardPlan::MaxAtomCost() const {
  int64_t best = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t rows = tensors[t].rows;
    if (!IsSplittable(t)) {
      best = std::max(best, RowRangeCost(t, 0, rows));
      continue;
    }
    // Row blocks have equal sizes up to rounding; the last may be partial.
    const int64_t a = options.row_alignment;
    const int64_t last = ((rows - 1) / a) * a;
    best = std::max({best, RowRangeCost(t, 0, a), RowRangeCost(t, last, rows)});
    if (last >= a) best = std::max(best, RowRangeCost(t, last - a, last));
  }
  // Rounding may make one interior block one unit larger than the first.
  return best + 1;
}

std::string ShardPlan::DebugString() const {
  std::string out = absl::StrFormat("ShardPlan: %d tensors, %d daemons, %d pieces\n",
                                    tensors.size(), num_daemons, pieces.size());
  for (const Piece& p : pieces) {
    const ManifestTensor& m = tensors[p.tensor];
    absl::StrAppendFormat(&out, "  %s [%d x %d] rows [%d, %d) -> daemon %d\n", m.name, m.rows,
                          m.cols, p.row_begin, p.row_end, p.daemon);
  }
  return out;
}

absl::StatusOr<ShardPlan> MakeShardPlan(absl::Span<const ManifestTensor> tensors, int num_daemons,
                                        const PlanOptions& options) {
  if (absl::Status s = ValidateInputs(tensors, num_daemons, options); !s.ok()) return s;
  ShardPlan plan;
  plan.tensors.assign(tensors.begin(), tensors.end());
  plan.num_daemons = num_daemons;
  plan.options = options;

  const CostModel model(plan.tensors, options);
  const int64_t total = model.total();
  const int n = static_cast<int>(plan.tensors.size());
  // cuts[d] .. cuts[d + 1] is daemon d's stretch.
  std::vector<Cut> cuts(num_daemons + 1);
  cuts[0] = Cut{0, 0};
  cuts[num_daemons] = Cut{n, 0};
  for (int d = 1; d < num_daemons; ++d) {
    // floor(d * total / D) without overflow.
    const int64_t target = (total / num_daemons) * d + (total % num_daemons) * d / num_daemons;
    cuts[d] = model.Nearest(target);
  }

  plan.first_piece.assign(n + 1, 0);
  int d = 0;
  for (int t = 0; t < n; ++t) {
    plan.first_piece[t] = static_cast<int>(plan.pieces.size());
    while (true) {
      const int64_t lo = RowOf(plan, t, cuts[d]);
      const int64_t hi = RowOf(plan, t, cuts[d + 1]);
      if (hi > lo) plan.pieces.push_back(Piece{t, lo, hi, d});
      if (cuts[d + 1].tensor > t || d + 1 == num_daemons) break;
      ++d;
    }
  }
  plan.first_piece[n] = static_cast<int>(plan.pieces.size());
  return plan;
}

absl::Status ValidateShardPlan(const ShardPlan& plan) {
  const int n = static_cast<int>(plan.tensors.size());
  if (static_cast<int>(plan.first_piece.size()) != n + 1 || plan.first_piece[0] != 0 ||
      plan.first_piece[n] != static_cast<int>(plan.pieces.size())) {
    return absl::InternalError("first_piece does not index pieces");
  }
  for (int t = 0; t < n; ++t) {
    const ManifestTensor& m = plan.tensors[t];
    int64_t next_row = 0;
    int prev_daemon = 0;
    for (int i = plan.first_piece[t]; i < plan.first_piece[t + 1]; ++i) {
      const Piece& p = plan.pieces[i];
      if (p.tensor != t || p.row_begin != next_row || p.row_end <= p.row_begin ||
          p.row_end > m.rows) {
        return absl::InternalError(
            absl::StrCat("piece ", i, " of '", m.name, "' breaks row coverage"));
      }
      if (p.row_begin % plan.options.row_alignment != 0) {
        return absl::InternalError(absl::StrCat("piece ", i, " of '", m.name, "' starts at row ",
                                                p.row_begin, ", not aligned"));
      }
      if (p.daemon < prev_daemon || p.daemon >= plan.num_daemons) {
        return absl::InternalError(absl::StrCat("piece ", i, " has daemon ", p.daemon));
      }
      prev_daemon = p.daemon;
      next_row = p.row_end;
    }
    if (next_row != m.rows) {
      return absl::InternalError(absl::StrCat("rows of '", m.name, "' not fully covered"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ReshardStep>> MapPieces(const ShardPlan& from, const ShardPlan& to) {
  if (from.tensors.size() != to.tensors.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("plans have ", from.tensors.size(), " and ", to.tensors.size(), " tensors"));
  }
  absl::flat_hash_map<std::string, int> from_index;
  for (size_t t = 0; t < from.tensors.size(); ++t) from_index[from.tensors[t].name] = t;

  std::vector<ReshardStep> steps;
  steps.reserve(to.pieces.size());
  for (size_t t = 0; t < to.tensors.size(); ++t) {
    const ManifestTensor& m = to.tensors[t];
    auto it = from_index.find(m.name);
    if (it == from_index.end()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", m.name, "' not in the old plan"));
    }
    const ManifestTensor& old = from.tensors[it->second];
    if (old.rows != m.rows || old.cols != m.cols) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", m.name, "' changed shape from [",
                                                     old.rows, ", ", old.cols, "] to [", m.rows,
                                                     ", ", m.cols, "]"));
    }
    // Both piece lists cover [0, rows) in order: merge them.
    int j = from.first_piece[it->second];
    for (int i = to.first_piece[t]; i < to.first_piece[t + 1]; ++i) {
      const Piece& np = to.pieces[i];
      ReshardStep step;
      step.new_piece = i;
      while (from.pieces[j].row_end <= np.row_begin) ++j;
      for (int k = j; k < from.first_piece[it->second + 1]; ++k) {
        const Piece& op = from.pieces[k];
        if (op.row_begin >= np.row_end) break;
        step.sources.push_back(
            PieceSource{k, std::max(op.row_begin, np.row_begin), std::min(op.row_end, np.row_end)});
      }
      steps.push_back(std::move(step));
    }
  }
  return steps;
}

}  // namespace sharding
}  // namespace paramd
