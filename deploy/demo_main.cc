// The hybrid-paramd demo: `bazel run //deploy:demo` (or tools/demo.sh).
//
// Starts, as separate processes on loopback (ports 0 + port files), a
// coordinator, two hybrid-paramd daemons and two trainers; loads the demo
// model (deploy/model.h) with deploy/recipes/demo.textproto; trains it for
// --steps synchronous steps (each trainer computes the gradients of half of
// each batch from the fetched quantized weights and pushes them; the daemons
// sum, step, quantize and publish); then trains the same model in-process
// with FP32 weights and the same data, seeds and optimizer, and compares.
//
// Exit status 0 only if the loss fell and the final held-out loss is within
// --tolerance (relative) of the FP32 baseline's. Every child process is
// stopped on every exit path (and dies with this process if it is killed).
//
// Internal mode: with --trainer_rank=R this binary is trainer R
// (deploy/demo_trainer.h) and reports JSON lines on stdout.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <google/protobuf/text_format.h>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "common/cli.h"
#include "common/status_macros.h"
#include "deploy/demo_report.h"
#include "deploy/demo_trainer.h"
#include "deploy/model.h"
#include "deploy/process.h"
#include "deploy/training.h"
#include "kernels/format.h"
#include "nlohmann/json.hpp"
#include "safetensors/safetensors.h"
#include "server/step/optimizer.h"
#include "server/step/optimizer_config.h"

ABSL_FLAG(int64_t, steps, 30, "training steps");
ABSL_FLAG(int64_t, batch_size, 256, "global batch per step (split between the two trainers)");
ABSL_FLAG(std::string, recipe, "deploy/recipes/demo.textproto",
          "recipe (protobuf text); relative paths are looked up in the runfiles too");
ABSL_FLAG(std::string, server_binary, "server/hybrid-paramd",
          "the hybrid-paramd binary; relative paths are looked up in the runfiles too");
ABSL_FLAG(std::string, summary_json, "", "write the figures of the run to this JSON file");
ABSL_FLAG(double, tolerance, 0.05,
          "max relative difference of the final held-out loss from the FP32 baseline's");
ABSL_FLAG(double, lr, 2e-3, "AdamW learning rate (daemons and baseline)");
ABSL_FLAG(double, weight_decay, 0.0, "AdamW decoupled weight decay (daemons and baseline)");
ABSL_FLAG(double, warmup_fraction, 0.1,
          "linear lr warmup over this fraction of the steps, then cosine decay to lr / 10");
ABSL_FLAG(double, max_grad_norm, 1.0, "global-norm gradient clipping (0 = off)");
ABSL_FLAG(bool, push_bf16, false, "push gradients as BF16 instead of FP32");
ABSL_FLAG(int32_t, timeout_s, 120, "give up (and fail) after this many seconds");
ABSL_FLAG(std::string, workdir, "",
          "directory for the model file, port files and logs (default: a fresh temp dir, "
          "removed at exit)");
ABSL_FLAG(int64_t, kill_daemon_at_step, -1,
          "after step S: SIGKILL one daemon process and start a replacement with its --rank; "
          "the cluster rewinds to its newest checkpoint (--checkpoint_every) and the trainers "
          "resume from it (-1 = no kill)");
ABSL_FLAG(int32_t, checkpoint_every, 5,
          "with --kill_daemon_at_step: the coordinator checkpoints every N committed versions");
ABSL_FLAG(bool, show_logs, false, "print the servers' and trainers' logs at the end");
// Internal: run as a trainer.
ABSL_FLAG(int64_t, trainer_rank, -1, "internal: run as trainer RANK");
ABSL_FLAG(std::string, coordinator, "", "internal: coordinator address for a trainer");

namespace paramd {
namespace demo {
namespace {

constexpr int kNumDaemons = 2;
constexpr int kNumTrainers = 2;
constexpr size_t kTailSteps = 5;

std::string HumanBytes(double n) {
  if (n >= (1 << 20)) return absl::StrFormat("%.2f MiB", n / (1 << 20));
  if (n >= (1 << 10)) return absl::StrFormat("%.1f KiB", n / (1 << 10));
  return absl::StrFormat("%.0f B", n);
}

// "layers.2.attn.proj.weight" -> "attn.proj": enough to tell the layers apart.
std::string ShortName(const std::string& tensor) {
  std::string name = tensor;
  if (absl::StartsWith(name, "layers.")) name = name.substr(name.find('.', 7) + 1);
  if (absl::EndsWith(name, ".weight")) name.resize(name.size() - 7);
  return name;
}

// A path as given if it exists, else inside this binary's runfiles.
std::string Runfile(const std::string& path) {
  if (path.empty() || path[0] == '/' || std::filesystem::exists(path)) return path;
  std::vector<std::string> roots;
  if (const char* dir = getenv("RUNFILES_DIR")) roots.push_back(dir);
  if (const char* dir = getenv("TEST_SRCDIR")) roots.push_back(dir);
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (!ec) roots.push_back(self + ".runfiles");
  for (const std::string& root : roots) {
    const std::string candidate = root + "/hybrid_paramd/" + path;
    if (std::filesystem::exists(candidate)) return candidate;
  }
  return path;
}

OptimizerOptions DemoOptimizer() {
  OptimizerOptions o;
  o.kind = OptimizerKind::kAdamW;
  o.lr = static_cast<float>(absl::GetFlag(FLAGS_lr));
  o.weight_decay = static_cast<float>(absl::GetFlag(FLAGS_weight_decay));
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  o.schedule.warmup_steps =
      static_cast<int64_t>(absl::GetFlag(FLAGS_warmup_fraction) * static_cast<double>(steps));
  o.schedule.decay = LrDecay::kCosine;
  o.schedule.decay_steps = std::max<int64_t>(1, steps - o.schedule.warmup_steps);
  o.schedule.min_lr = o.lr / 10;
  o.max_grad_norm = static_cast<float>(absl::GetFlag(FLAGS_max_grad_norm));
  return o;
}

TrainSchedule Schedule() {
  TrainSchedule s;
  s.steps = absl::GetFlag(FLAGS_steps);
  s.batch_size = absl::GetFlag(FLAGS_batch_size);
  s.num_trainers = kNumTrainers;
  return s;
}

absl::Status WriteModel(const std::string& path, const ModelConfig& config) {
  ASSIGN_OR_RETURN(const std::vector<WeightShape> shapes, ModelShapes(config));
  ASSIGN_OR_RETURN(const std::vector<std::vector<float>> weights, InitialWeights(config));
  std::vector<safetensors::TensorSpec> specs;
  for (const WeightShape& s : shapes) {
    specs.push_back({s.name, safetensors::Dtype::kF32, {s.rows, s.cols}});
  }
  ASSIGN_OR_RETURN(auto writer, safetensors::SafetensorsWriter::Create(
                                    path, specs, {{"model", "hybrid-paramd demo MLP"}}));
  for (size_t l = 0; l < shapes.size(); ++l) {
    RETURN_IF_ERROR(writer->WriteTensor(
        shapes[l].name, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(weights[l].data()),
                                            weights[l].size() * sizeof(float))));
  }
  return writer->Finish();
}

// One step as both trainers saw it.
struct StepRow {
  std::map<int64_t, StepReport> by_rank;
  double loss = 0;
  double accuracy = 0;
};

class Demo {
 public:
  absl::Status Run();
  int exit_code() const { return exit_code_; }

 private:
  absl::Status StartCluster();
  absl::Status LoadModel();
  absl::Status Train();
  absl::Status HandleLine(int rank, const std::string& line);
  // --kill_daemon_at_step: SIGKILL daemon process 1 and start a
  // replacement with its rank.
  absl::Status KillAndReplaceDaemon(int64_t step);
  std::vector<std::string> DaemonArgv(const std::string& name) const;
  void PrintStep(int64_t step);
  void PrintManifest();
  absl::Status Finish();
  void DumpLogs(bool always);
  std::string Log(const std::string& name) const { return workdir_ + "/" + name + ".log"; }
  absl::Duration Remaining() const { return deadline_ - absl::Now(); }

  const ModelConfig model_;
  const TrainSchedule schedule_ = Schedule();
  const absl::Time start_ = absl::Now();
  const absl::Time deadline_ = start_ + absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  std::unique_ptr<TempDir> temp_;
  std::string workdir_;
  std::string recipe_path_;
  ChildProcesses children_;
  std::vector<int> servers_;  // coordinator, daemons
  std::vector<int> trainers_;
  std::vector<std::string> log_names_;
  std::string coordinator_address_;
  client::Manifest manifest_;
  std::map<int64_t, StepRow> steps_;
  std::map<int64_t, FinalReport> finals_;
  std::unique_ptr<client::Client> observer_;  // status, recovery
  std::string server_;                        // the hybrid-paramd binary
  // --kill_daemon_at_step: what happened.
  int64_t killed_at_step_ = -1;
  int killed_rank_ = -1;
  absl::Time killed_at_;
  double kill_to_next_version_s_ = -1;
  rpc::RecoveryStatus recovery_;  // the coordinator's, at the end of training
  absl::Time train_start_, train_end_;
  int exit_code_ = 1;
};

absl::Status Demo::StartCluster() {
  const std::string server = Runfile(absl::GetFlag(FLAGS_server_binary));
  if (!std::filesystem::exists(server)) {
    return absl::NotFoundError(absl::StrCat("no hybrid-paramd binary at ", server,
                                            " (use bazel run //deploy:demo or --server_binary)"));
  }
  server_ = server;
  const std::string coordinator_port = workdir_ + "/coordinator.port";
  // The coordinator's optimizer config (warmup + cosine, clipping); the
  // daemons take it at join.
  const std::string optimizer_path = workdir_ + "/optimizer.textproto";
  {
    std::string text;
    google::protobuf::TextFormat::PrintToString(OptimizerToProto(DemoOptimizer()), &text);
    std::ofstream(optimizer_path) << text;
  }
  std::printf("optimizer: %s\n", DescribeOptimizer(DemoOptimizer()).c_str());
  std::vector<std::string> coordinator_argv = {server,
                                               "--role=coordinator",
                                               "--listen=127.0.0.1:0",
                                               "--port_file=" + coordinator_port,
                                               absl::StrCat("--daemons=", kNumDaemons),
                                               absl::StrCat("--expected_pushers=", kNumTrainers),
                                               "--recipe=" + recipe_path_,
                                               "--data_plane=host",
                                               "--optimizer=" + optimizer_path};
  if (absl::GetFlag(FLAGS_kill_daemon_at_step) >= 0) {
    // The replacement proves the cluster secret with this file
    // (docs/SECURITY.md "The cluster secret").
    coordinator_argv.push_back("--cluster_secret_out=" + workdir_ + "/cluster_secret");
    coordinator_argv.push_back("--checkpoint_dir=" + workdir_ + "/ckpt");
    coordinator_argv.push_back(
        absl::StrCat("--checkpoint_every=", absl::GetFlag(FLAGS_checkpoint_every)));
  }
  ASSIGN_OR_RETURN(int c, children_.Start({"coordinator", std::move(coordinator_argv),
                                           Log("coordinator"), Log("coordinator")}));
  servers_.push_back(c);
  log_names_.push_back("coordinator");
  ASSIGN_OR_RETURN(const int port, WaitForPortFile(coordinator_port, Remaining(), &children_, c));
  coordinator_address_ = absl::StrCat("127.0.0.1:", port);
  for (int d = 0; d < kNumDaemons; ++d) {
    const std::string name = absl::StrCat("daemon", d);
    ASSIGN_OR_RETURN(int index, children_.Start({name, DaemonArgv(name), Log(name), Log(name)}));
    servers_.push_back(index);
    log_names_.push_back(name);
  }
  for (int d = 0; d < kNumDaemons; ++d) {
    RETURN_IF_ERROR(WaitForPortFile(absl::StrCat(workdir_, "/daemon", d, ".port"), Remaining(),
                                    &children_, servers_[d + 1])
                        .status());
  }
  std::printf("cluster: coordinator %s, %d daemons, %d trainers (separate processes)\n",
              coordinator_address_.c_str(), kNumDaemons, kNumTrainers);
  return absl::OkStatus();
}

std::vector<std::string> Demo::DaemonArgv(const std::string& name) const {
  // No optimizer flags: the daemon takes the coordinator's config at join.
  std::vector<std::string> argv = {server_,
                                   "--role=daemon",
                                   "--listen=127.0.0.1:0",
                                   "--port_file=" + workdir_ + "/" + name + ".port",
                                   "--coordinator=" + coordinator_address_,
                                   "--data_plane=host"};
  if (absl::GetFlag(FLAGS_kill_daemon_at_step) >= 0) {
    argv.push_back("--checkpoint_dir=" + workdir_ + "/ckpt");
  }
  return argv;
}

absl::Status Demo::KillAndReplaceDaemon(int64_t step) {
  // Daemon process 1 (servers_[2]); its rank from the coordinator.
  const int victim = servers_[2];
  ASSIGN_OR_RETURN(const int port,
                   WaitForPortFile(workdir_ + "/daemon1.port", Remaining(), &children_, victim));
  ASSIGN_OR_RETURN(rpc::GetStatusResponse status, observer_->Status(false, Remaining()));
  for (const rpc::Member& m : status.members()) {
    if (m.role() == rpc::ROLE_DAEMON && m.address() == absl::StrCat("127.0.0.1:", port)) {
      killed_rank_ = m.rank();
    }
  }
  if (killed_rank_ < 0) return absl::InternalError("daemon1 is not a member");
  children_.Signal(victim, SIGKILL);
  killed_at_ = absl::Now();
  killed_at_step_ = step;
  (void)children_.Wait(victim, absl::Seconds(10));
  std::vector<std::string> argv = DaemonArgv("daemon1r");
  argv.push_back(absl::StrCat("--rank=", killed_rank_));
  argv.push_back("--cluster_secret_file=" + workdir_ + "/cluster_secret");
  ASSIGN_OR_RETURN(const int index, children_.Start({"daemon1r", std::move(argv), Log("daemon1r"),
                                                     Log("daemon1r")}));
  servers_[2] = index;
  log_names_.push_back("daemon1r");
  std::printf(
      "killed daemon rank %d (SIGKILL) after step %lld; started a replacement with "
      "--rank=%d --cluster_secret_file\n",
      killed_rank_, static_cast<long long>(step), killed_rank_);
  std::fflush(stdout);
  return absl::OkStatus();
}

absl::Status Demo::LoadModel() {
  const std::string model_path = workdir_ + "/model.safetensors";
  RETURN_IF_ERROR(WriteModel(model_path, model_));
  std::ifstream in(recipe_path_);
  std::stringstream recipe;
  recipe << in.rdbuf();
  client::ClientOptions options;
  options.coordinator_address = coordinator_address_;
  options.role = client::ClientOptions::Role::kObserver;
  options.name = "demo";
  options.connect_timeout = Remaining();
  options.call_timeout = Remaining();
  ASSIGN_OR_RETURN(observer_, client::Client::Connect(options));
  client::Client* const observer = observer_.get();
  // The daemons join the coordinator in the background after binding their
  // ports: UNAVAILABLE ("waiting for daemons") means retry.
  absl::StatusOr<int64_t> version;
  while (true) {
    version = observer->Load(model_path, recipe.str(), Remaining());
    if (version.ok() || version.status().code() != absl::StatusCode::kUnavailable ||
        Remaining() <= absl::ZeroDuration()) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  RETURN_IF_ERROR(version.status());
  manifest_ = observer->manifest();
  std::printf("loaded the demo model (%s) with recipe %s: version %lld\n", model_path.c_str(),
              absl::GetFlag(FLAGS_recipe).c_str(), static_cast<long long>(*version));
  PrintManifest();
  return absl::OkStatus();
}

void Demo::PrintManifest() {
  for (const client::TensorMeta& t : manifest_.tensors) {
    std::string pieces;
    for (const client::PieceLocation& p : t.pieces) {
      absl::StrAppend(&pieces, pieces.empty() ? "" : " ", "[", p.row_begin, ",", p.row_end, ")->d",
                      p.daemon_rank);
    }
    std::printf(
        "  %-26s %5lldx%-5lld row %-17s col %-17s %-19s %s\n", t.name.c_str(),
        static_cast<long long>(t.rows), static_cast<long long>(t.cols),
        t.spec.rowwise_usage ? std::string(FormatName(t.spec.rowwise.format)).c_str() : "-",
        t.spec.columnwise_usage ? std::string(FormatName(t.spec.columnwise.format)).c_str() : "-",
        t.spec.columnwise_source == ColumnwiseSource::kRowwiseDequantized ? "col_from=rowwise"
                                                                          : "col_from=original",
        pieces.c_str());
  }
}

absl::Status Demo::HandleLine(int rank, const std::string& line) {
  ASSIGN_OR_RETURN(Report report, ParseReport(line));
  if (auto* final_report = std::get_if<FinalReport>(&report)) {
    finals_[final_report->rank] = *final_report;
    return absl::OkStatus();
  }
  const StepReport& step = std::get<StepReport>(report);
  if (step.rank != rank) return absl::InternalError("trainer reported another rank");
  StepRow& row = steps_[step.step];
  // A step run again after a rewind replaces the first run's reports.
  if (row.by_rank.count(rank) > 0) row = StepRow();
  row.by_rank[rank] = step;
  if (row.by_rank.size() != static_cast<size_t>(kNumTrainers)) return absl::OkStatus();
  PrintStep(step.step);
  if (killed_at_step_ >= 0 && kill_to_next_version_s_ < 0) {
    kill_to_next_version_s_ = absl::ToDoubleSeconds(absl::Now() - killed_at_);
  }
  const int64_t kill_at = absl::GetFlag(FLAGS_kill_daemon_at_step);
  if (kill_at >= 0 && killed_at_step_ < 0 && step.step >= kill_at) {
    return KillAndReplaceDaemon(step.step);
  }
  return absl::OkStatus();
}

void Demo::PrintStep(int64_t step) {
  StepRow& row = steps_[step];
  double loss_sum = 0;
  int64_t samples = 0, correct = 0;
  double step_ms = 0;
  for (const auto& [rank, r] : row.by_rank) {
    loss_sum += r.loss_sum;
    samples += r.samples;
    correct += r.correct;
    step_ms = std::max(step_ms, r.step_ms);
  }
  row.loss = loss_sum / samples;
  row.accuracy = static_cast<double>(correct) / samples;
  const StepReport& r0 = row.by_rank.begin()->second;
  // Scaling state: the first tensor of each of a few formats.
  std::string scales;
  std::vector<std::string> shown;
  for (const ScaleReport& s : r0.scales) {
    if (s.direction != "rowwise" ||
        std::find(shown.begin(), shown.end(), s.format) != shown.end()) {
      continue;
    }
    if (s.format == "nvfp4") {
      absl::StrAppendFormat(&scales, " | %s nvfp4 A=%.4g", ShortName(s.tensor), s.amax);
    } else if (s.format == "fp8_delayed" || s.format == "fp8_current") {
      absl::StrAppendFormat(&scales, " | %s %s scale=%.4g amax=%.4g", ShortName(s.tensor), s.format,
                            1.0 / s.scale_inv, s.amax);
    } else {
      continue;
    }
    shown.push_back(s.format);
  }
  std::printf(
      "step %3lld v%-3lld loss %.4f acc %.3f | fetched/trainer row %s (FP32 %s, BF16 %s) "
      "col %s (FP32 %s, BF16 %s)%s | %.0f ms\n",
      static_cast<long long>(step), static_cast<long long>(r0.version), row.loss, row.accuracy,
      HumanBytes(r0.received.rowwise).c_str(), HumanBytes(r0.fp32.rowwise).c_str(),
      HumanBytes(r0.bf16.rowwise).c_str(), HumanBytes(r0.received.columnwise).c_str(),
      HumanBytes(r0.fp32.columnwise).c_str(), HumanBytes(r0.bf16.columnwise).c_str(),
      scales.c_str(), step_ms);
  std::fflush(stdout);
}

absl::Status Demo::Train() {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  train_start_ = absl::Now();
  for (int r = 0; r < kNumTrainers; ++r) {
    const std::string name = absl::StrCat("trainer", r);
    std::vector<std::string> argv = {self, absl::StrCat("--trainer_rank=", r),
                                     "--coordinator=" + coordinator_address_,
                                     absl::StrCat("--steps=", schedule_.steps),
                                     absl::StrCat("--batch_size=", schedule_.batch_size),
                                     absl::StrCat("--timeout_s=", absl::GetFlag(FLAGS_timeout_s)),
                                     // Unused by trainers; tags them as this run's processes.
                                     "--workdir=" + workdir_};
    if (absl::GetFlag(FLAGS_push_bf16)) argv.push_back("--push_bf16");
    ChildOptions options{name, argv, "", Log(name), /*pipe_stdout=*/true};
    ASSIGN_OR_RETURN(int index, children_.Start(options));
    trainers_.push_back(index);
    log_names_.push_back(name);
  }
  std::vector<std::string> pending(kNumTrainers);
  std::vector<bool> open(kNumTrainers, true);
  while (std::count(open.begin(), open.end(), true) > 0) {
    if (Remaining() <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat("the demo did not finish within --timeout_s=",
                                                      absl::GetFlag(FLAGS_timeout_s)));
    }
    for (int s : servers_) {
      if (auto status = children_.Poll(s)) {
        return absl::UnavailableError(
            absl::StrCat(children_.name(s), " exited (status ", *status, ") during training"));
      }
    }
    std::vector<pollfd> fds;
    std::vector<int> ranks;
    for (int r = 0; r < kNumTrainers; ++r) {
      if (open[r]) {
        fds.push_back({children_.stdout_fd(trainers_[r]), POLLIN, 0});
        ranks.push_back(r);
      }
    }
    if (poll(fds.data(), fds.size(), 100) < 0 && errno != EINTR) {
      return absl::InternalError("poll failed");
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const int r = ranks[i];
      char buf[65536];
      const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
      if (n <= 0) {
        open[r] = false;
        continue;
      }
      pending[r].append(buf, n);
      size_t newline;
      while ((newline = pending[r].find('\n')) != std::string::npos) {
        const std::string line = pending[r].substr(0, newline);
        pending[r].erase(0, newline + 1);
        RETURN_IF_ERROR(HandleLine(r, line));
      }
    }
  }
  for (int r = 0; r < kNumTrainers; ++r) {
    ASSIGN_OR_RETURN(const int status, children_.Wait(trainers_[r], Remaining()));
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      return absl::InternalError(
          absl::StrCat("trainer ", r, " failed (status ", status, "); see its log below"));
    }
  }
  train_end_ = absl::Now();
  if (steps_.size() != static_cast<size_t>(schedule_.steps) || finals_.count(0) == 0) {
    return absl::InternalError("the trainers exited without reporting every step");
  }
  return absl::OkStatus();
}

absl::Status Demo::Finish() {
  const double distributed_s = absl::ToDoubleSeconds(train_end_ - train_start_);
  std::printf("training done in %.1f s; running the FP32 baseline in-process...\n", distributed_s);
  std::fflush(stdout);
  const absl::Time baseline_start = absl::Now();
  ASSIGN_OR_RETURN(const BaselineRun baseline, TrainBaseline(model_, schedule_, DemoOptimizer()));
  const double baseline_s = absl::ToDoubleSeconds(absl::Now() - baseline_start);

  std::vector<double> losses, step_ms;
  Bytes2 received, fp32, bf16;  // per trainer, summed over steps
  for (const auto& [step, row] : steps_) {
    losses.push_back(row.loss);
    const StepReport& r0 = row.by_rank.begin()->second;
    double ms = 0;
    for (const auto& [rank, r] : row.by_rank) ms = std::max(ms, r.step_ms);
    step_ms.push_back(ms);
    received.rowwise += r0.received.rowwise;
    received.columnwise += r0.received.columnwise;
    fp32.rowwise += r0.fp32.rowwise;
    fp32.columnwise += r0.fp32.columnwise;
    bf16.rowwise += r0.bf16.rowwise;
    bf16.columnwise += r0.bf16.columnwise;
  }
  std::vector<double> sorted_ms = step_ms;
  std::sort(sorted_ms.begin(), sorted_ms.end());
  const double mean_ms = [&] {
    double s = 0;
    for (double v : step_ms) s += v;
    return s / step_ms.size();
  }();
  const double median_ms = sorted_ms[sorted_ms.size() / 2];
  const double initial = losses.front();
  const double tail = TailMean(losses, kTailSteps);
  const double baseline_tail = TailMean(baseline.losses, kTailSteps);
  const double eval = finals_.at(0).eval_loss;
  const double tolerance = absl::GetFlag(FLAGS_tolerance);
  const double rel_diff = std::fabs(eval - baseline.eval_loss) / baseline.eval_loss;
  const bool loss_fell = tail < 0.9 * initial;
  const bool within = rel_diff <= tolerance;
  const double wall_s = absl::ToDoubleSeconds(absl::Now() - start_);
  const int64_t steps = schedule_.steps;

  std::printf("\n== summary (%lld steps, batch %lld, %d trainers x %d daemons)\n",
              static_cast<long long>(steps), static_cast<long long>(schedule_.batch_size),
              kNumTrainers, kNumDaemons);
  std::printf("loss: %.4f -> %.4f (mean of last %zu steps); FP32 baseline %.4f -> %.4f\n", initial,
              tail, kTailSteps, baseline.losses.front(), baseline_tail);
  std::printf(
      "held-out loss (%lld samples): hybrid %.4f, FP32 baseline %.4f, "
      "difference %.2f%% (tolerance %.2f%%)\n",
      static_cast<long long>(finals_.at(0).eval_samples), eval, baseline.eval_loss, 100 * rel_diff,
      100 * tolerance);
  std::printf(
      "fetched per trainer per step: rowwise %s (FP32 %s, BF16 %s), columnwise %s "
      "(FP32 %s, BF16 %s); total %s = %.2fx less than FP32, %.2fx less than BF16\n",
      HumanBytes(double(received.rowwise) / steps).c_str(),
      HumanBytes(double(fp32.rowwise) / steps).c_str(),
      HumanBytes(double(bf16.rowwise) / steps).c_str(),
      HumanBytes(double(received.columnwise) / steps).c_str(),
      HumanBytes(double(fp32.columnwise) / steps).c_str(),
      HumanBytes(double(bf16.columnwise) / steps).c_str(),
      HumanBytes(double(received.total()) / steps).c_str(), double(fp32.total()) / received.total(),
      double(bf16.total()) / received.total());
  std::printf(
      "step time: mean %.1f ms, median %.1f ms; training %.1f s, baseline %.1f s, "
      "wall %.1f s\n",
      mean_ms, median_ms, distributed_s, baseline_s, wall_s);

  nlohmann::json recovery = nullptr;
  if (killed_at_step_ >= 0) {
    const rpc::RecoveryStatus& r = recovery_;
    recovery = {{"killed_after_step", killed_at_step_},
                {"killed_rank", killed_rank_},
                {"recovered", r.epoch() >= 1},
                {"recoveries", r.epoch()},
                {"rewound_to_version", r.rewound_to_version()},
                {"committed_before", r.committed_before()},
                {"steps_lost", r.versions_lost()},
                {"source", r.source()},
                {"recovery_seconds", r.seconds()},
                {"kill_to_next_step_seconds", kill_to_next_version_s_}};
    std::printf(
        "recovery: daemon rank %d killed after step %lld; every daemon rewound to "
        "version %lld (committed was %lld: %lld step%s lost) from %s, %.2f s after the "
        "lease expired; %.2f s from the kill to the next completed step\n",
        killed_rank_, static_cast<long long>(killed_at_step_),
        static_cast<long long>(r.rewound_to_version()),
        static_cast<long long>(r.committed_before()), static_cast<long long>(r.versions_lost()),
        r.versions_lost() == 1 ? "" : "s", r.source().c_str(), r.seconds(),
        kill_to_next_version_s_);
    if (r.epoch() < 1) {
      std::printf("FAIL: the cluster did not recover from the killed daemon\n");
      exit_code_ = 1;
      return absl::OkStatus();
    }
  }

  if (!absl::GetFlag(FLAGS_summary_json).empty()) {
    nlohmann::json j;
    j["recovery"] = recovery;
    j["steps"] = steps;
    j["batch_size"] = schedule_.batch_size;
    j["num_trainers"] = kNumTrainers;
    j["num_daemons"] = kNumDaemons;
    j["recipe"] = recipe_path_;
    j["push_dtype"] = absl::GetFlag(FLAGS_push_bf16) ? "bf16" : "fp32";
    j["losses"] = losses;
    j["baseline_losses"] = baseline.losses;
    j["initial_loss"] = initial;
    j["final_loss"] = tail;
    j["baseline_final_loss"] = baseline_tail;
    j["final_loss_steps"] = kTailSteps;
    j["eval_loss"] = eval;
    j["baseline_eval_loss"] = baseline.eval_loss;
    j["eval_relative_difference"] = rel_diff;
    j["tolerance"] = tolerance;
    j["loss_fell"] = loss_fell;
    j["within_tolerance"] = within;
    j["ok"] = loss_fell && within;
    j["bytes_per_trainer"] = {{"rowwise", received.rowwise},
                              {"columnwise", received.columnwise},
                              {"total", received.total()},
                              {"fp32", fp32.total()},
                              {"fp32_rowwise", fp32.rowwise},
                              {"fp32_columnwise", fp32.columnwise},
                              {"bf16", bf16.total()},
                              {"bf16_rowwise", bf16.rowwise},
                              {"bf16_columnwise", bf16.columnwise}};
    j["step_ms"] = step_ms;
    j["step_ms_mean"] = mean_ms;
    j["step_ms_median"] = median_ms;
    j["training_seconds"] = distributed_s;
    j["baseline_seconds"] = baseline_s;
    j["wall_seconds"] = wall_s;
    nlohmann::json tensors = nlohmann::json::array();
    for (const client::TensorMeta& t : manifest_.tensors) {
      nlohmann::json pieces = nlohmann::json::array();
      for (const client::PieceLocation& p : t.pieces) {
        pieces.push_back({p.row_begin, p.row_end, p.daemon_rank});
      }
      tensors.push_back(
          {{"name", t.name},
           {"rows", t.rows},
           {"cols", t.cols},
           {"rowwise", t.spec.rowwise_usage ? FormatName(t.spec.rowwise.format) : "-"},
           {"columnwise", t.spec.columnwise_usage ? FormatName(t.spec.columnwise.format) : "-"},
           {"columnwise_source", t.spec.columnwise_source == ColumnwiseSource::kRowwiseDequantized
                                     ? "rowwise_dequantized"
                                     : "original"},
           {"pieces", pieces}});
    }
    j["tensors"] = tensors;
    nlohmann::json per_step = nlohmann::json::array();
    for (const auto& [step, row] : steps_) {
      const StepReport& r0 = row.by_rank.begin()->second;
      per_step.push_back({{"step", step},
                          {"version", r0.version},
                          {"loss", row.loss},
                          {"accuracy", row.accuracy},
                          {"received_rowwise", r0.received.rowwise},
                          {"received_columnwise", r0.received.columnwise},
                          {"fp32", r0.fp32.total()},
                          {"bf16", r0.bf16.total()},
                          {"fetch_ms", r0.fetch_ms},
                          {"compute_ms", r0.compute_ms},
                          {"push_ms", r0.push_ms},
                          {"wait_ms", r0.wait_ms},
                          {"scales", ScalesJson(r0.scales)}});
    }
    j["per_step"] = per_step;
    std::ofstream out(absl::GetFlag(FLAGS_summary_json));
    out << j.dump(2) << "\n";
    if (!out) {
      return absl::InternalError("cannot write " + absl::GetFlag(FLAGS_summary_json));
    }
  }

  if (!loss_fell) {
    std::printf("FAIL: the loss did not fall (%.4f -> %.4f)\n", initial, tail);
  } else if (!within) {
    std::printf(
        "FAIL: held-out loss %.4f is %.2f%% from the FP32 baseline's %.4f (tolerance "
        "%.2f%%)\n",
        eval, 100 * rel_diff, baseline.eval_loss, 100 * tolerance);
  } else {
    std::printf("OK: the loss fell and the hybrid-quantized run is within %.2f%% of FP32\n",
                100 * tolerance);
  }
  exit_code_ = loss_fell && within ? 0 : 1;
  return absl::OkStatus();
}

void Demo::DumpLogs(bool always) {
  if (!always && exit_code_ == 0) return;
  for (const std::string& name : log_names_) {
    std::ifstream in(Log(name));
    std::string line;
    std::vector<std::string> lines;
    while (std::getline(in, line)) lines.push_back(line);
    const size_t keep = always ? lines.size() : std::min<size_t>(lines.size(), 20);
    std::fprintf(stderr, "---- %s log (last %zu lines) ----\n", name.c_str(), keep);
    for (size_t i = lines.size() - keep; i < lines.size(); ++i) {
      std::fprintf(stderr, "%s\n", lines[i].c_str());
    }
  }
}

absl::Status Demo::Run() {
  InstallCleanupSignalHandlers();
  if (absl::GetFlag(FLAGS_steps) < 1 || absl::GetFlag(FLAGS_batch_size) < kNumTrainers) {
    return absl::InvalidArgumentError("need --steps >= 1 and --batch_size >= 2");
  }
  workdir_ = absl::GetFlag(FLAGS_workdir);
  if (workdir_.empty()) {
    ASSIGN_OR_RETURN(TempDir dir, TempDir::Create("paramd_demo"));
    temp_ = std::make_unique<TempDir>(std::move(dir));
    workdir_ = temp_->path();
  } else {
    std::filesystem::create_directories(workdir_);
  }
  recipe_path_ = std::filesystem::absolute(Runfile(absl::GetFlag(FLAGS_recipe))).string();
  if (!std::filesystem::exists(recipe_path_)) {
    return absl::NotFoundError("no recipe at " + recipe_path_);
  }
  absl::Status s = StartCluster();
  if (s.ok()) s = LoadModel();
  if (s.ok()) s = Train();
  if (s.ok() && killed_at_step_ >= 0) {
    absl::StatusOr<rpc::GetStatusResponse> status = observer_->Status(false, Remaining());
    if (status.ok()) recovery_ = status->recovery();
    s = status.status();
  }
  // Servers are stopped before the baseline runs: it needs the CPU.
  children_.TerminateAll(absl::Seconds(3));
  if (s.ok()) s = Finish();
  if (!s.ok()) exit_code_ = 1;
  DumpLogs(absl::GetFlag(FLAGS_show_logs));
  return s;
}

int TrainerMain() {
  TrainerConfig config;
  config.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  config.rank = absl::GetFlag(FLAGS_trainer_rank);
  config.schedule = Schedule();
  config.push_bf16 = absl::GetFlag(FLAGS_push_bf16);
  config.call_timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  const absl::Status s = RunTrainer(config, std::cout);
  if (!s.ok()) {
    std::fprintf(stderr, "trainer %lld: %s\n", static_cast<long long>(config.rank),
                 s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace demo
}  // namespace paramd

int main(int argc, char** argv) {
  paramd::AbslCliOptions cli;
  cli.program = "hybrid-paramd-demo";
  cli.usage =
      "hybrid-paramd demo: a coordinator, two daemons and two trainers on loopback train a "
      "small MLP with hybrid-quantized weights and compare with FP32.\n"
      "Usage: bazel run //deploy:demo -- [--steps=N] [--summary_json=PATH] [flags]";
  cli.flags_file = "deploy/demo_main.cc";
  paramd::ParseAbslFlagsOrExit(argc, argv, cli);
  setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines interleave with logs on stderr
  if (absl::GetFlag(FLAGS_trainer_rank) >= 0) return paramd::demo::TrainerMain();
  paramd::demo::Demo demo;
  const absl::Status s = demo.Run();
  if (!s.ok()) {
    std::fprintf(stderr, "demo: %s\n", s.ToString().c_str());
    return 1;
  }
  return demo.exit_code();
}
