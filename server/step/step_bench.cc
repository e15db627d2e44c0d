// step_bench: wall time of one daemon step (the cpu backend's step:
// AdamW, packed amax all-reduce, scaling, quantization of both directions)
// for the demo model (deploy/model.h shapes) under a recipe, with the
// weights sharded by //sharding:plan over 1..N in-process daemons (one
// thread each, "local" transport for the all-reduce).
//
//   bazel run -c opt //server/step:step_bench -- --daemons=2 --iters=20
//
// Prints one line per daemon count: median and mean step milliseconds
// (slowest daemon per step), parameters and published bytes per version.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "recipe/recipe.h"
#include "server/step/shard_set.h"
#include "sharding/balance.h"
#include "sharding/plan.h"
#include "transport/local_transport.h"

ABSL_FLAG(std::string, recipe, "deploy/recipes/demo.textproto",
          "recipe file (protobuf text); relative to the workspace");
ABSL_FLAG(std::string, daemons, "1,2", "comma-separated daemon counts to measure");
ABSL_FLAG(int32_t, iters, 20, "steps per measurement (after one warm-up step)");
ABSL_FLAG(std::string, shapes,
          "layers.0.mlp.up.weight=1024x64,layers.1.mlp.down.weight=256x1024,"
          "layers.2.attn.proj.weight=64x256,head.weight=16x64",
          "name=ROWSxCOLS,... (default: the demo model)");

namespace paramd {
namespace {

absl::Status Run() {
  ASSIGN_OR_RETURN(Recipe recipe, Recipe::Load(absl::GetFlag(FLAGS_recipe)));
  std::vector<TensorDef> tensors;
  std::vector<sharding::ManifestTensor> entries;
  int64_t params = 0;
  for (absl::string_view item : absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',')) {
    std::vector<std::string> kv = absl::StrSplit(item, '=');
    std::vector<std::string> dims = absl::StrSplit(kv.at(1), 'x');
    TensorDef t{kv[0], std::stoll(dims.at(0)), std::stoll(dims.at(1)), recipe.SpecFor(kv[0])};
    params += t.rows * t.cols;
    ASSIGN_OR_RETURN(sharding::ManifestTensor e,
                     sharding::ManifestEntry(t.name, t.rows, t.cols, t.spec));
    entries.push_back(e);
    tensors.push_back(std::move(t));
  }
  const int iters = absl::GetFlag(FLAGS_iters);
  for (absl::string_view n_text : absl::StrSplit(absl::GetFlag(FLAGS_daemons), ',')) {
    const int n = std::stoi(std::string(n_text));
    ASSIGN_OR_RETURN(sharding::ShardPlan plan, sharding::MakeShardPlan(entries, n));
    ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Transport>> world, CreateLocalWorld(n));
    std::vector<std::unique_ptr<ShardSet>> sets;
    std::vector<int> group(n);
    std::iota(group.begin(), group.end(), 0);
    for (int d = 0; d < n; ++d) {
      std::vector<ShardDef> shards;
      for (int p : plan.PiecesOnDaemon(d)) {
        const sharding::Piece& piece = plan.pieces[p];
        shards.push_back({piece.tensor, piece.row_begin, piece.row_end});
      }
      ASSIGN_OR_RETURN(std::unique_ptr<ShardSet> set,
                       ShardSet::Create(tensors, shards, OptimizerOptions()));
      for (size_t i = 0; i < set->shards().size(); ++i) {
        absl::Span<float> m = set->master(i);
        for (size_t j = 0; j < m.size(); ++j)
          m[j] = 0.01f * static_cast<float>((j * 7919) % 201 - 100);
      }
      sets.push_back(std::move(set));
    }
    std::vector<double> ms;
    int64_t published_bytes = 0;
    for (int it = -1; it < iters; ++it) {
      std::vector<absl::Status> status(n);
      std::vector<double> took(n);
      std::vector<int64_t> bytes(n);
      std::vector<std::thread> threads;
      for (int d = 0; d < n; ++d) {
        threads.emplace_back([&, d] {
          absl::Span<float> g =
              sets[d]->shards().empty() ? absl::Span<float>() : sets[d]->gradient(0);
          for (size_t j = 0; j < g.size(); ++j) g[j] = 1e-3f * static_cast<float>(j % 17);
          Transport* t = world[d].get();
          const absl::Time start = absl::Now();
          auto r = sets[d]->Step(it + 2, /*apply_optimizer=*/true, [&](absl::Span<float> v) {
            return t->AllReduceMax(group, v, absl::Now() + absl::Seconds(30));
          });
          took[d] = absl::ToDoubleMilliseconds(absl::Now() - start);
          status[d] = r.status();
          if (r.ok()) {
            for (const PublishedPiece& p : (*r)->pieces) {
              bytes[d] += p.q.data.size() + p.q.scales.size();
            }
          }
        });
      }
      for (std::thread& t : threads) t.join();
      for (const absl::Status& s : status) RETURN_IF_ERROR(s);
      if (it >= 0) ms.push_back(*std::max_element(took.begin(), took.end()));
      published_bytes = std::accumulate(bytes.begin(), bytes.end(), int64_t{0});
    }
    std::sort(ms.begin(), ms.end());
    const double mean = std::accumulate(ms.begin(), ms.end(), 0.0) / ms.size();
    std::printf(
        "daemons=%d params=%lld published_bytes_per_version=%lld step_ms median=%.2f "
        "mean=%.2f min=%.2f max=%.2f (%d steps)\n",
        n, static_cast<long long>(params), static_cast<long long>(published_bytes),
        ms[ms.size() / 2], mean, ms.front(), ms.back(), iters);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace paramd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status s = paramd::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "step_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
