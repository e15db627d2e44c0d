// File: sharding/plan.h
//
// The shard plan: which daemon owns which rows of which weight.
//
// A plan is a pure function of (manifest, number of daemons, options). Every
// tensor is cut into row ranges [row_begin, row_end) whose inner boundaries
// are multiples of `PlanOptions::row_alignment` (128 by default), so that
// every block format's blocks (32x32, 16x16, 128x128, 1x128 along M) stay
// whole inside one piece and block scales are local to the daemon that owns
// the piece. Tensors smaller than the split threshold stay whole.
//
// Placement balances a per-tensor cost (elements x bytes per element) across
// daemons. The tensors are laid end to end in manifest order; daemon d gets
// the stretch between cut points d and d+1, where cut point d is the allowed
// boundary (a tensor boundary, or an aligned row boundary inside a splittable
// tensor) nearest to d/D of the total cost. Consequences, all tested:
//   * every row of every tensor is in exactly one piece;
//   * pieces of one tensor are ordered by rows and go to non-decreasing daemons;
//   * |cost(daemon d) - total/D| <= MaxAtomCost(plan) + 1, where an atom is one
//     aligned row block of a splittable tensor or a whole unsplittable tensor;
//   * a daemon may own nothing when there are fewer atoms than daemons.
//
// The same plan type serves checkpoint resharding: MapPieces() says, for each
// piece of a new plan, which rows of which pieces of an old plan feed it.
//
// Pure host code; all functions are thread-compatible and allocate only their
// results. Integer arithmetic only after per-row costs are rounded, so a plan
// is bit-for-bit reproducible across processes and machines.
#ifndef PARAMD_SHARDING_PLAN_H_
#define PARAMD_SHARDING_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace paramd {
namespace sharding {

// One weight of the model, as the plan sees it: a logical [rows, cols]
// matrix (FORMATS.md §0: rows = M, cols = K) and a balancing weight.
struct ManifestTensor {
  std::string name;  // unique, non-empty
  int64_t rows = 0;  // M >= 1
  int64_t cols = 0;  // K >= 1
  // Bytes a daemon spends per element of this tensor (master, optimizer
  // state, published copies...). Only its relative size matters; > 0 and
  // finite. ManifestEntry() in sharding/balance.h derives it from a
  // tensor's HybridSpec.
  double bytes_per_element = 4.0;
};

struct PlanOptions {
  // Inner piece boundaries are multiples of this. A positive multiple of 128.
  int64_t row_alignment = 128;
  // Tensors whose cost (rows * cols * bytes_per_element, rounded) is below
  // this stay whole, as do tensors with rows <= row_alignment.
  int64_t min_split_bytes = int64_t{1} << 20;
};

// Rows [row_begin, row_end) of tensor `tensor` (an index into
// ShardPlan::tensors), owned by daemon `daemon`.
struct Piece {
  int tensor = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int daemon = 0;

  int64_t rows() const { return row_end - row_begin; }
  friend bool operator==(const Piece& a, const Piece& b) {
    return a.tensor == b.tensor && a.row_begin == b.row_begin && a.row_end == b.row_end &&
           a.daemon == b.daemon;
  }
  friend bool operator!=(const Piece& a, const Piece& b) { return !(a == b); }
};

struct ShardPlan {
  std::vector<ManifestTensor> tensors;  // the manifest, in its order
  int num_daemons = 0;
  PlanOptions options;
  // Sorted by (tensor, row_begin); pieces of tensor t are
  // pieces[first_piece[t] .. first_piece[t + 1]).
  std::vector<Piece> pieces;
  std::vector<int> first_piece;  // size tensors.size() + 1

  // The pieces of tensor `t`, in row order.
  absl::Span<const Piece> PiecesOf(int t) const;
  // Index into `tensors` of the tensor named `name`, or -1.
  int FindTensor(const std::string& name) const;
  // Indices into `pieces` owned by `daemon`, in plan order.
  std::vector<int> PiecesOnDaemon(int daemon) const;
  // Balancing cost (the plan's rounded bytes) owned by each daemon.
  std::vector<int64_t> DaemonCosts() const;
  // Cost of rows [row_begin, row_end) of tensor t, as the plan computes it.
  int64_t RowRangeCost(int t, int64_t row_begin, int64_t row_end) const;
  // Whether tensor t may be cut (see PlanOptions).
  bool IsSplittable(int t) const;
  // The largest atom: one aligned row block of a splittable tensor, or a
  // whole unsplittable tensor. Bounds the imbalance (file comment).
  int64_t MaxAtomCost() const;
  // Human-readable listing, one line per piece.
  std::string DebugString() const;
};

// Builds the plan. InvalidArgument for num_daemons < 1, an empty or
// duplicate name, rows or cols < 1, bytes_per_element not finite and > 0,
// row_alignment not a positive multiple of 128, or min_split_bytes < 0.
absl::StatusOr<ShardPlan> MakeShardPlan(absl::Span<const ManifestTensor> tensors, int num_daemons,
                                        const PlanOptions& options = {});

// Checks the invariants of a plan (coverage, order, alignment, daemon
// range). OK for every plan MakeShardPlan returns; useful after a plan was
// deserialized. Internal with the first violation otherwise.
absl::Status ValidateShardPlan(const ShardPlan& plan);

// ---- Resharding ----

// Rows [row_begin, row_end) (tensor coordinates) of old piece `old_piece`
// (an index into the old plan's pieces).
struct PieceSource {
  int old_piece = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
};

// What new piece `new_piece` (an index into the new plan's pieces) is made
// of: sources in row order, exactly covering the new piece's rows.
struct ReshardStep {
  int new_piece = 0;
  std::vector<PieceSource> sources;
};

// One step per piece of `to`, in `to.pieces` order. Tensors are matched by
// name (the two manifests may list them in different orders) and must have
// the same shapes; InvalidArgument if the name sets or shapes differ.
absl::StatusOr<std::vector<ReshardStep>> MapPieces(const ShardPlan& from, const ShardPlan& to);

}  // namespace sharding
}  // namespace paramd

#endif  // PARAMD_SHARDING_PLAN_H_
