// Checkpoint and export throughput through the real binaries: a coordinator
// and two hybrid-paramd daemon processes (AdamW, --checkpoint_dir) hold
// --master_mb of FP32 masters (tensors of [4096, 4096]); `hpctl step` makes
// version 1 (moments allocated), then, --runs times, the wall time of each
// hpctl process is measured: `hpctl checkpoint`, `hpctl checkpoint describe
// --verify`, `hpctl export` (BF16 and FP32), and the restore of the
// checkpoint by fresh processes started with --restore_from (from their
// start to the version being served). MB = 10^6 bytes.
//
//   bazel run //tests:checkpoint_export_bench -- --master_mb=1024 --runs=2
//
// Files go under $TMPDIR (or /tmp); everything is removed at the end.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "tests/checkpoint_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr int64_t kSide = 4096;

struct Args {
  int64_t master_mb = 1024;
  int runs = 2;
};

Args ParseArgs(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    if (absl::ConsumePrefix(&a, "--master_mb=") && absl::SimpleAtoi(a, &args.master_mb)) continue;
    if (absl::ConsumePrefix(&a, "--runs=") && absl::SimpleAtoi(a, &args.runs)) continue;
    std::fprintf(stderr, "usage: checkpoint_export_bench [--master_mb=1024] [--runs=2]\n");
    std::exit(2);
  }
  return args;
}

TestClusterOptions Options(const std::string& root, bool restore) {
  TestClusterOptions o;
  o.daemons = 2;
  o.expected_pushers = 1;
  o.optimizer = "adamw";
  o.lr = 1e-3;
  o.coordinator_flags = {"--checkpoint_dir=" + root};
  if (restore) o.coordinator_flags.push_back("--restore_from=" + root);
  o.daemon_flags = {"--checkpoint_dir=" + root};
  return o;
}

uint64_t DirBytes(const std::string& dir) {
  uint64_t total = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) total += e.file_size();
  }
  return total;
}

void Row(const std::string& phase, double mb, double seconds) {
  std::printf("| %s | %.0f | %.2f | %.0f |\n", phase.c_str(), mb, seconds, mb / seconds);
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  const Args args = ParseArgs(argc, argv);
  absl::StatusOr<demo::TempDir> dir = demo::TempDir::Create("ckpt_export_bench");
  if (!dir.ok()) return 1;
  const std::string root = dir->path() + "/ckpt";
  const int64_t tensors = std::max<int64_t>(1, args.master_mb * (1 << 20) / (kSide * kSide * 4));
  const double master_mb = tensors * kSide * kSide * 4 / 1e6;
  std::printf("%lld tensors of [%lld, %lld] FP32 = %.1f MB of masters; files in %s\n",
              static_cast<long long>(tensors), static_cast<long long>(kSide),
              static_cast<long long>(kSide), master_mb, dir->path().c_str());
  {
    std::vector<TestTensor> model;
    const std::vector<float> block = RandomValues(kSide * kSide, 1, 0.02f);
    for (int64_t t = 0; t < tensors; ++t) {
      model.push_back({absl::StrCat("layers.", t, ".weight"), {kSide, kSide}, block});
      model.back().values[t] = 1.0f + t;  // not all tensors identical
    }
    if (absl::Status s = WriteModel(dir->path() + "/model.safetensors", model); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
  }
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(Options(root, false));
  if (!c.ok()) return 1;
  RawCluster& cluster = **c;
  absl::Time start = absl::Now();
  absl::StatusOr<int64_t> loaded =
      cluster.Load(dir->path() + "/model.safetensors", "", absl::Minutes(10));
  if (!loaded.ok()) {
    std::fprintf(stderr, "load: %s\n%s", loaded.status().ToString().c_str(),
                 cluster.cluster().Logs().c_str());
    return 1;
  }
  const double load_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const std::string address = "--address=" + cluster.cluster().coordinator_address();
  auto hpctl = [&](std::vector<std::string> argv, double* seconds) {
    argv.insert(argv.begin(), "hpctl/hpctl");
    argv.push_back(address);
    argv.push_back("--timeout=600");
    const absl::Time t0 = absl::Now();
    ProgramRun run = RunProgram(argv, dir->path(), absl::Minutes(20));
    *seconds = absl::ToDoubleSeconds(absl::Now() - t0);
    if (run.exit_code != 0) {
      std::fprintf(stderr, "%s failed:\n%s\n%s", argv[1].c_str(), run.out.c_str(),
                   cluster.cluster().Logs().c_str());
      std::exit(1);
    }
    return run.out;
  };
  double seconds = 0;
  hpctl({"step"}, &seconds);  // version 1, with AdamW moments
  std::printf("hpctl step (AdamW, zero gradient): %.1f s\n\n", seconds);
  std::printf("| phase | MB | s | MB/s |\n|---|---:|---:|---:|\n");
  Row("load from safetensors (hpctl-style Load RPC: read, first publish)", master_mb, load_seconds);
  for (int run = 0; run < args.runs; ++run) {
    std::filesystem::remove_all(root);
    ::sync();  // earlier writes (model file, exports) are not flushed during the checkpoint
    std::string out = hpctl({"checkpoint"}, &seconds);
    const double ckpt_mb = DirBytes(root) / 1e6;
    Row(absl::StrCat("run ", run + 1, ": hpctl checkpoint (masters + 2 AdamW moments)"), ckpt_mb,
        seconds);
    hpctl({"checkpoint", "describe", "--verify"}, &seconds);
    Row(absl::StrCat("run ", run + 1, ": hpctl checkpoint describe --verify"), ckpt_mb, seconds);
    for (const std::string dtype : {"bf16", "fp32"}) {
      const std::string export_dir = dir->path() + "/export_" + dtype;
      std::filesystem::remove_all(export_dir);
      hpctl({"export", "--out", export_dir, "--dtype", dtype}, &seconds);
      Row(absl::StrCat("run ", run + 1, ": hpctl export --dtype ", dtype, " (MB of masters; ",
                       static_cast<int>(DirBytes(export_dir) / 1e6), " MB written)"),
          master_mb, seconds);
      std::filesystem::remove_all(export_dir);
    }
  }
  // Restore: fresh processes, from their start to version 1 being served.
  c->reset();
  ::sync();
  start = absl::Now();
  absl::StatusOr<std::unique_ptr<RawCluster>> restored = RawCluster::Start(Options(root, true));
  if (!restored.ok()) return 1;
  absl::StatusOr<int64_t> v = (*restored)->WaitForVersion(1, absl::Minutes(10));
  if (!v.ok()) {
    std::fprintf(stderr, "restore: %s\n%s", v.status().ToString().c_str(),
                 (*restored)->cluster().Logs().c_str());
    return 1;
  }
  Row("fresh processes --restore_from: start to version served (verify XXH3, read, republish)",
      DirBytes(root) / 1e6, absl::ToDoubleSeconds(absl::Now() - start));
  return 0;
}

}  // namespace
}  // namespace testing
}  // namespace paramd

int main(int argc, char** argv) { return paramd::testing::Main(argc, argv); }
