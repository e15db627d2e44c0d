// The training loop through real hybrid-paramd processes on the host data
// plane (cpu backend): a trainer pushes FP32 gradients for version v, the
// daemons step, the trainer fetches v+1 (FP8 current scaling, rowwise +
// columnwise) before its next step. Two clusters in the same run, one
// stepping whole versions, one with --pipelined_step (the trainer then
// fetches with Client::FetchAsReady while its push is still streaming);
// and each phase alone (push, step, fetch) on the sequential cluster.
//
//   bazel run -c opt //tests:pipeline_bench -- --tensors=16 --rows=512 --cols=1024
//
// Prints one table (milliseconds: median and mean over --steps loops).
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/status_macros.h"
#include "tests/server_test_util.h"

ABSL_FLAG(int, tensors, 16, "tensors in the model");
ABSL_FLAG(int64_t, rows, 512, "rows of each tensor");
ABSL_FLAG(int64_t, cols, 1024, "columns of each tensor");
ABSL_FLAG(int, daemons, 1, "daemons per cluster");
ABSL_FLAG(int, steps, 10, "timed loops per mode (after one warm-up loop)");
ABSL_FLAG(int64_t, bucket_elements, 0,
          "--step_bucket_elements of the pipelined daemons (0: one bucket per tensor)");

namespace paramd {
namespace testing {
namespace {

struct Times {
  std::vector<double> ms;
  void Add(absl::Duration d) { ms.push_back(absl::ToDoubleMilliseconds(d)); }
  std::string Row(const std::string& name) const {
    std::vector<double> s = ms;
    std::sort(s.begin(), s.end());
    const double mean = std::accumulate(s.begin(), s.end(), 0.0) / std::max<size_t>(1, s.size());
    return absl::StrFormat("| %-34s | %9.1f | %9.1f |", name, s.empty() ? 0.0 : s[s.size() / 2],
                           mean);
  }
};

constexpr char kRecipe[] = R"txt(
  default_spec { rowwise { format: FP8_CURRENT } columnwise { format: FP8_CURRENT } })txt";

struct Bench {
  std::unique_ptr<RawCluster> raw;
  std::unique_ptr<client::Client> trainer;
  std::vector<client::FetchTarget> targets;
};

absl::StatusOr<Bench> StartCluster(bool pipelined, const std::string& model_dir) {
  TestClusterOptions options;
  options.daemons = absl::GetFlag(FLAGS_daemons);
  options.expected_pushers = 1;
  options.optimizer = "adamw";
  options.lr = 1e-3;
  if (pipelined) {
    options.daemon_flags = {"--pipelined_step", absl::StrCat("--step_bucket_elements=",
                                                             absl::GetFlag(FLAGS_bucket_elements))};
  }
  Bench b;
  ASSIGN_OR_RETURN(b.raw, RawCluster::Start(options));
  const std::string model = b.raw->cluster().dir() + "/model.safetensors";
  std::vector<TestTensor> tensors;
  for (int t = 0; t < absl::GetFlag(FLAGS_tensors); ++t) {
    const int64_t rows = absl::GetFlag(FLAGS_rows), cols = absl::GetFlag(FLAGS_cols);
    tensors.push_back(
        {absl::StrCat("layers.", t, ".weight"), {rows, cols}, RandomValues(rows * cols, t + 1)});
  }
  RETURN_IF_ERROR(WriteModel(model, tensors));
  RETURN_IF_ERROR(b.raw->Load(model, kRecipe, absl::Minutes(5)).status());
  client::ClientOptions c;
  c.coordinator_address = b.raw->cluster().coordinator_address();
  c.call_timeout = absl::Minutes(2);
  ASSIGN_OR_RETURN(b.trainer, client::Client::Connect(c));
  b.targets =
      client::AllTargets(b.trainer->manifest(), {Direction::kRowwise, Direction::kColumnwise});
  (void)model_dir;
  return b;
}

absl::Status Run() {
  const int n = absl::GetFlag(FLAGS_tensors);
  const int64_t elements = absl::GetFlag(FLAGS_rows) * absl::GetFlag(FLAGS_cols);
  std::vector<std::vector<float>> grads;
  for (int t = 0; t < n; ++t) grads.push_back(RandomValues(elements, 1000 + t, 1e-3f));
  std::vector<client::Gradient> g;
  for (int t = 0; t < n; ++t) {
    g.push_back(client::Gradient::Fp32(absl::StrCat("layers.", t, ".weight"), grads[t]));
  }
  const int steps = absl::GetFlag(FLAGS_steps);

  ASSIGN_OR_RETURN(Bench seq, StartCluster(false, ""));
  ASSIGN_OR_RETURN(Bench pip, StartCluster(true, ""));
  Times push, step, fetch, loop_seq, loop_pip, first_tensor;

  // Sequential loop, and its phases timed one by one.
  ASSIGN_OR_RETURN(int64_t v, seq.trainer->WaitForVersion(0, absl::Minutes(1)));
  for (int i = 0; i <= steps; ++i, ++v) {
    const absl::Time t0 = absl::Now();
    RETURN_IF_ERROR(seq.trainer->PushGradients(v, g).status());
    const absl::Time t1 = absl::Now();
    RETURN_IF_ERROR(seq.trainer->WaitForVersion(v + 1, absl::Minutes(1)).status());
    const absl::Time t2 = absl::Now();
    RETURN_IF_ERROR(seq.trainer->Fetch(v + 1, seq.targets).status());
    const absl::Time t3 = absl::Now();
    if (i == 0) continue;  // warm-up
    push.Add(t1 - t0);
    step.Add(t2 - t1);
    fetch.Add(t3 - t2);
    loop_seq.Add(t3 - t0);
  }
  // Pipelined loop: the fetch of v+1 runs beside the push of v.
  ASSIGN_OR_RETURN(v, pip.trainer->WaitForVersion(0, absl::Minutes(1)));
  for (int i = 0; i <= steps; ++i, ++v) {
    const absl::Time t0 = absl::Now();
    absl::Status pushed;
    std::thread pusher([&] { pushed = pip.trainer->PushGradients(v, g).status(); });
    absl::Time first = absl::InfiniteFuture();
    absl::Status fetched = pip.trainer->FetchAsReady(
        v + 1, pip.targets,
        [&](int, const client::FetchedTensor&) { first = std::min(first, absl::Now()); });
    const absl::Time t1 = absl::Now();
    pusher.join();
    RETURN_IF_ERROR(pushed);
    RETURN_IF_ERROR(fetched);
    if (i == 0) continue;
    loop_pip.Add(t1 - t0);
    first_tensor.Add(first - t0);
  }
  const int64_t params = n * elements;
  std::printf(
      "model: %d tensors x [%ld x %ld] = %.1f M parameters, FP8 current row + col, "
      "%d daemon(s), 1 pusher, %d loops\n",
      n, static_cast<long>(absl::GetFlag(FLAGS_rows)), static_cast<long>(absl::GetFlag(FLAGS_cols)),
      params / 1e6, absl::GetFlag(FLAGS_daemons), steps);
  std::printf("| %-34s | %9s | %9s |\n", "ms", "median", "mean");
  std::printf("|%s|%s|%s|\n", std::string(36, '-').c_str(), std::string(11, '-').c_str(),
              std::string(11, '-').c_str());
  for (const auto& [name, t] : std::vector<std::pair<std::string, const Times*>>{
           {"push alone", &push},
           {"step alone (push end -> publish)", &step},
           {"fetch alone (v+1 published)", &fetch},
           {"loop, sequential", &loop_seq},
           {"loop, pipelined", &loop_pip},
           {"pipelined: first tensor in hand", &first_tensor}}) {
    std::printf("%s\n", t->Row(name).c_str());
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace testing
}  // namespace paramd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "pipeline_bench: push/step/fetch loop through hybrid-paramd processes, whole-version vs "
      "--pipelined_step, each phase alone");
  absl::ParseCommandLine(argc, argv);
  absl::Status s = paramd::testing::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "pipeline_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
