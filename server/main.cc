// hybrid-paramd: the parameter-server process (coordinator and/or daemon).
//
//   hybrid-paramd                      # single node: coordinator + daemon on :7070
//   hybrid-paramd --model=m.safetensors --recipe=r.textproto
//   hybrid-paramd --role=coordinator --daemons=2 --listen=0.0.0.0:7070
//                 --tls_cert=server.pem --tls_key=server.key --tls_ca=ca.pem
//                 --auth_token_file=tokens
//   hybrid-paramd --role=daemon --coordinator=host0:7070 --listen=0.0.0.0:7071 (same TLS/token
//   flags)
//
// Flags live here only; the libraries take Options structs.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "auth/security.h"
#include "checkpoint/service.h"
#include "common/address.h"
#include "common/cli.h"
#include "common/file_util.h"
#include "common/library_log.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "recipe/recipe.h"
#include "server/checkpointing.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/rpc/async_util.h"
#include "server/server.h"
#include "server/step/optimizer.h"
#include "server/step/optimizer_config.h"

ABSL_FLAG(std::string, config, "",
          "configuration file (protobuf text, proto/server_config.proto: the flags below by "
          "name); flags given on the command line override it");
ABSL_FLAG(std::string, role, "both", "coordinator | daemon | both (one process, one port)");
ABSL_FLAG(std::string, listen, "127.0.0.1:7070",
          "gRPC listen address (port 0 = any free port); without --tls_cert only a loopback "
          "address unless --insecure_listen_anywhere");
ABSL_FLAG(bool, insecure_listen_anywhere, false,
          "allow a non-loopback --listen / --data_plane_listen without TLS (plaintext: anyone "
          "on the network can read the traffic and, without --auth_token_file, call it)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of this process: served on its gRPC ports (TLS) and presented "
          "as client certificate on its own channels (docs/SECURITY.md)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificates: check the certificates of the coordinator/daemons this process "
          "calls and of clients that present one; with TLS, this process's channels use TLS");
ABSL_FLAG(bool, tls_require_client_cert, false,
          "mutual TLS: refuse clients without a certificate signed by --tls_ca");
ABSL_FLAG(std::string, tls_server_name, "",
          "the name the peers' certificates must carry (default: the host of their address)");
ABSL_FLAG(std::string, auth_token_file, "",
          "bearer tokens with roles, one `ROLE TOKEN` per line (ROLE = trainer | operator | "
          "cluster; '#' comments); every RPC then needs `authorization: Bearer TOKEN` of a role "
          "allowed to call it (docs/SECURITY.md). Give every process of the cluster the same "
          "file. Empty = no tokens: only the cluster-internal RPCs are authenticated (by the "
          "cluster secret)");
ABSL_FLAG(std::string, cluster_secret_file, "",
          "file (mode 0600) whose first line is the secret shared by the coordinator and its "
          "daemons; daemons must present it to join. Default: the first `cluster` token of "
          "--auth_token_file, else the coordinator generates one at start, hands it to the "
          "daemons joining each rank for the first time, and a replacement of a rank must "
          "present it: start it with --cluster_secret_file=the coordinator's "
          "--cluster_secret_out");
ABSL_FLAG(std::string, cluster_secret_out, "",
          "coordinator: write its cluster secret (the one it generates, or the one it was "
          "given) to this file at start (mode 0600; the same secret after a restart with "
          "--state_file): the --cluster_secret_file of daemons that replace lost ones");
ABSL_FLAG(std::string, advertise_address, "",
          "address other processes use to reach this one (default 127.0.0.1:<port>); its host "
          "is also what a --data_plane_listen / --device_channel_listen on 0.0.0.0 advertises "
          "(default: this machine's hostname)");
ABSL_FLAG(std::string, port_file, "",
          "write the bound gRPC port (one decimal line) to this file once serving");
ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070",
          "coordinator address (--role=daemon; --role=both uses its own)");
ABSL_FLAG(int32_t, daemons, 1, "coordinator: number of daemons in the world");
ABSL_FLAG(int32_t, expected_pushers, 1,
          "coordinator: gradient pushes per version each daemon waits for before stepping "
          "(0 = step only on an admin Step, e.g. `hpctl step`)");
ABSL_FLAG(std::string, recipe, "",
          "coordinator: recipe file (protobuf text, proto/recipe.proto); empty = built-in recipe");
ABSL_FLAG(std::string, model, "",
          "coordinator: safetensors file to load once every daemon has joined (readable by "
          "every daemon)");
ABSL_FLAG(std::string, data_plane, "host",
          "data plane for the daemons' amax all-reduce: host | local | nccl (gpu daemons on "
          "distinct GPUs, built with --config=cuda: the device amax vector is reduced on the "
          "GPUs; set it on the coordinator and every daemon)");
ABSL_FLAG(std::string, data_plane_listen, "",
          "daemon: data-plane listen address (host: \"\" = 127.0.0.1:0; use 0.0.0.0:0 across "
          "machines)");
// Default auto: the gpu backend is byte-identical to the cpu one (steps,
// checkpoints, export, restore; tests/gpu_daemon_backend_test,
// tests/gpu_backend_checkpoint_test on H200s), so a GPU, when there is one,
// is used. Binaries built without --config=cuda always run the cpu backend.
ABSL_FLAG(std::string, backend, "auto",
          "daemon: where the shards live and step: auto (gpu when built with --config=cuda "
          "and a GPU is usable, else cpu) | "
          "cpu | gpu (startup error without CUDA/GPU); see docs/ARCHITECTURE.md");
ABSL_FLAG(int32_t, gpu, -1,
          "daemon: the GPU of the gpu backend and its device-fetch channels: sets "
          "CUDA_VISIBLE_DEVICES to that one device before any CUDA call (an index into an "
          "existing CUDA_VISIBLE_DEVICES list, else the physical ordinal); -1 = leave "
          "CUDA_VISIBLE_DEVICES alone (the daemon uses its device 0)");
ABSL_FLAG(std::string, device_channel_listen, "",
          "daemon (--backend=gpu): listen address of device-fetch channel endpoints (\"\" = "
          "127.0.0.1:0, trainers on this machine; 0.0.0.0:0 across machines)");
ABSL_FLAG(int32_t, rank, -1,
          "daemon: the rank to take (-1 = the coordinator picks the lowest free one). A daemon "
          "started with the rank of one that went down replaces it; see docs/ARCHITECTURE.md");
ABSL_FLAG(int32_t, heartbeat_interval_ms, 250,
          "daemon: how often to renew the lease with the coordinator");
ABSL_FLAG(std::string, state_file, "",
          "coordinator: keep what a restart needs (members, model manifest, committed version, "
          "recovery epoch, secrets; mode 0600) in this file, written atomically; a coordinator "
          "started with an existing file takes its running cluster back (empty = none)");
ABSL_FLAG(int32_t, snapshot_every_steps, 10,
          "daemon: every N optimizer steps copy this daemon's state (masters, optimizer "
          "state, scaling state, counters) to host memory and to its buddy daemon "
          "(rank+1 mod n); a lost daemon's replacement goes back to the newest snapshot "
          "every rank still has, else to the newest checkpoint (0 = no snapshots)");
ABSL_FLAG(int32_t, daemon_lease_ms, 1500,
          "coordinator: a daemon without a heartbeat for this long is DOWN (steps needing it "
          "are refused until a replacement with its --rank joins)");
// The optimizer config is the coordinator's (proto/optimizer.proto): its
// recipe's `optimizer` section, else --optimizer=FILE, else these flags on
// the coordinator. A daemon needs none of them; a daemon flag that is set
// must agree with the coordinator's config (else its join is refused, both
// values named).
ABSL_FLAG(std::string, optimizer, "",
          "adamw | sgd | FILE: coordinator: the optimizer config in protobuf text "
          "(proto/optimizer.proto: kind, lr, betas, eps, weight_decay, schedule, max_grad_norm, "
          "non_finite) or just the kind (unset: adamw); daemon: unset takes the coordinator's "
          "kind, set must agree with it (checked at join)");
// Unset (the default) is no opinion: the coordinator uses the value in the
// brackets, a daemon takes the coordinator's.
ABSL_FLAG(std::optional<double>, lr, std::nullopt,
          "learning rate, the peak of the schedule (coordinator: unset = 1e-3; daemon: unset "
          "takes the coordinator's, set must agree, checked at join)");
ABSL_FLAG(std::optional<double>, beta1, std::nullopt,
          "AdamW beta1 (coordinator: unset = 0.9; daemon: checked at join if set)");
ABSL_FLAG(std::optional<double>, beta2, std::nullopt,
          "AdamW beta2 (coordinator: unset = 0.999; daemon: checked at join if set)");
ABSL_FLAG(std::optional<double>, adam_eps, std::nullopt,
          "AdamW epsilon (coordinator: unset = 1e-8; daemon: checked at join if set)");
ABSL_FLAG(std::optional<double>, weight_decay, std::nullopt,
          "weight decay, AdamW: decoupled; SGD: added to the gradient (coordinator: unset = 0; "
          "daemon: checked at join if set)");
ABSL_FLAG(std::optional<double>, momentum, std::nullopt,
          "SGD momentum (coordinator: unset = 0; daemon: checked at join if set)");
ABSL_FLAG(int64_t, chunk_bytes, int64_t{1} << 20, "daemon: default fetch chunk size in bytes");
ABSL_FLAG(int32_t, step_timeout_s, 60, "daemon: a step whose all-reduce takes longer fails");
ABSL_FLAG(bool, pipelined_step, false,
          "daemon (cpu and gpu backends): step bucket by bucket as the pushes arrive and serve "
          "FetchRequest.as_ready tensors as each is quantized (docs/ARCHITECTURE.md \"Pipelined "
          "step\"); host pushes only (device pushes are refused); every daemon of a cluster "
          "must agree (checked at join)");
ABSL_FLAG(int64_t, step_bucket_elements, int64_t{1} << 22,
          "daemon: parameters per bucket of --pipelined_step (consecutive tensors; a larger "
          "tensor is a bucket of its own)");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "root directory of checkpoints (shared by every process); empty = checkpoints are "
          "refused (exports still work)");
ABSL_FLAG(std::string, restore_from, "",
          "coordinator: restore this checkpoint store (readable by every daemon) once every "
          "daemon has joined, instead of --model; a new model generation (a --state_file "
          "that holds a model wins: it is served and this is not loaded)");
ABSL_FLAG(int64_t, restore_version, -1,
          "coordinator: the version to restore (-1 = the newest complete checkpoint)");
ABSL_FLAG(int32_t, checkpoint_every, 0,
          "coordinator: checkpoint the committed version whenever it is a multiple of N "
          "(0 = only on request; needs --checkpoint_dir). If the daemons have moved on when "
          "it runs, the newer committed version is saved.");
ABSL_FLAG(int32_t, keep_checkpoints, 0,
          "coordinator: keep only the newest N checkpoints (0 = keep all)");
ABSL_FLAG(bool, checkpoint_group_readable, false,
          "checkpoint directories and files are 0750 / 0640 (the group may read them, e.g. "
          "an export job) instead of 0700 / 0600");
ABSL_FLAG(std::string, log_format, "text",
          "log lines on stderr: text (date, level, role, rank, pid, component: message) | json "
          "(one JSON object per line, same fields)");
ABSL_FLAG(std::string, log_level, "info",
          "least severe level logged: debug | info | warning | error");
ABSL_FLAG(int32_t, v, 0, "verbose logging: show debug messages of verbosity <= N (implies debug)");
ABSL_FLAG(int32_t, log_every_versions, 100,
          "coordinator: log every Nth committed version at INFO (the others at --v=1)");
ABSL_FLAG(std::string, metrics_listen, "",
          "serve Prometheus text metrics on http://HOST:PORT/metrics (plain HTTP: a loopback "
          "address unless --insecure_listen_anywhere; port 0 = any free port, logged; \"\" = "
          "off)");
ABSL_FLAG(int32_t, metrics_port, 0,
          "same as --metrics_listen=0.0.0.0:<port>, so it needs --insecure_listen_anywhere "
          "(0 = off; --metrics_listen wins)");
// Input limits (docs/SECURITY.md "Input limits and validation").
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20,
          "largest gRPC message received or sent, in bytes (a push chunk, a fetch chunk, a "
          "Load request)");
ABSL_FLAG(int64_t, max_tensor_name_bytes, paramd::kDefaultMaxTensorNameBytes,
          "longest tensor name accepted anywhere (Load, LoadShards, safetensors headers); NUL "
          "and control characters are always refused");
ABSL_FLAG(int64_t, max_tensors, 100000, "most tensors one model may have");
ABSL_FLAG(int64_t, min_chunk_bytes, 4096,
          "daemon: smallest Fetch max_chunk_bytes accepted (0 there = --chunk_bytes)");
ABSL_FLAG(std::string, model_root, "",
          "read model files (Load's safetensors and checkpoint paths, LoadShards' paths) only "
          "from below this directory (and --checkpoint_dir), after resolving '..' and "
          "symlinks; set the same on every process. Empty = any path the process can read");
ABSL_FLAG(int64_t, max_pushers_per_version, 4096,
          "daemon: most distinct pushers counted for one version");
ABSL_FLAG(int64_t, memory_budget_bytes, 0,
          "host bytes one daemon's shards may need (estimated: FP32 master, gradient, AdamW "
          "state and two published versions); a Load or LoadShards over it is refused. 0 = on "
          "a daemon, 90% of the machine's physical memory; on a coordinator, no check");
ABSL_FLAG(int64_t, max_frozen_bytes, -1,
          "coordinator: bytes of a model's frozen buffers in all (its non-floating tensors: "
          "integer ids, masks, F64; kept whole in the manifest and every checkpoint, never "
          "stepped); at most half of --max_message_bytes. -1 = 16 MiB or that half, whichever "
          "is smaller");
ABSL_FLAG(int64_t, max_parked_fetches_per_client, 256,
          "daemon: most Fetch calls of one client host waiting for an unpublished version");

namespace paramd {
namespace {

// Security and addresses: TLS, tokens, the cluster secret, and the listen
// and dial addresses checked before anything starts.
absl::Status SecurityFromFlags(const std::string& role, ServerOptions& options) {
  options.listen = absl::GetFlag(FLAGS_listen);
  options.insecure_listen_anywhere = absl::GetFlag(FLAGS_insecure_listen_anywhere);
  ASSIGN_OR_RETURN(options.tls,
                   auth::LoadTls({
                       .cert = absl::GetFlag(FLAGS_tls_cert),
                       .key = absl::GetFlag(FLAGS_tls_key),
                       .ca = absl::GetFlag(FLAGS_tls_ca),
                       .require_client_cert = absl::GetFlag(FLAGS_tls_require_client_cert),
                       .server_name = absl::GetFlag(FLAGS_tls_server_name),
                   }));
  if (options.tls.enabled() && options.tls.cert_pem.empty()) {
    return absl::InvalidArgumentError(
        "--tls_ca without --tls_cert/--tls_key: a TLS server needs its own certificate");
  }
  std::vector<auth::TokenEntry> tokens;
  if (!absl::GetFlag(FLAGS_auth_token_file).empty()) {
    ASSIGN_OR_RETURN(tokens, auth::LoadTokenFile(absl::GetFlag(FLAGS_auth_token_file)));
  }
  options.authenticator = std::make_shared<auth::Authenticator>(tokens);
  if (!absl::GetFlag(FLAGS_cluster_secret_file).empty()) {
    ASSIGN_OR_RETURN(
        options.cluster_secret,
        auth::LoadClientToken(absl::GetFlag(FLAGS_cluster_secret_file), auth::Role::kCluster));
  } else {
    for (const auth::TokenEntry& t : tokens) {
      if (t.role == auth::Role::kCluster) {
        options.cluster_secret = t.token;
        break;
      }
    }
  }
  if (!absl::GetFlag(FLAGS_cluster_secret_out).empty() && role == "daemon") {
    return absl::InvalidArgumentError(
        "--cluster_secret_out is the coordinator's (it writes the coordinator's cluster secret)");
  }
  RETURN_IF_ERROR(auth::CheckListenAddress(
      absl::GetFlag(FLAGS_data_plane_listen).empty() ? "127.0.0.1:0"
                                                     : absl::GetFlag(FLAGS_data_plane_listen),
      options.tls.enabled(), options.insecure_listen_anywhere, "--data_plane_listen"));
  RETURN_IF_ERROR(auth::CheckListenAddress(absl::GetFlag(FLAGS_device_channel_listen).empty()
                                               ? "127.0.0.1:0"
                                               : absl::GetFlag(FLAGS_device_channel_listen),
                                           options.tls.enabled(), options.insecure_listen_anywhere,
                                           "--device_channel_listen"));
  options.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  if (role == "daemon") options.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  // Refused now, not after a daemon's minutes of join retries.
  auto check_address = [](absl::string_view flag, const std::string& address) {
    absl::Status s = CheckAddress(address);
    return s.ok() ? s
                  : absl::InvalidArgumentError(
                        absl::StrCat("--", flag, "=", address, ": ", s.message()));
  };
  if (role == "daemon") {
    RETURN_IF_ERROR(check_address("coordinator", options.coordinator_address));
  }
  if (!options.advertise_address.empty()) {
    RETURN_IF_ERROR(check_address("advertise_address", options.advertise_address));
  }
  return absl::OkStatus();
}

// The optimizer flags that are set (on the command line, in a --flagfile or
// in the --config file; an unset one is no opinion) and the daemon role's
// options. `optimizer_file`: --optimizer names a config file.
absl::Status DaemonFromFlags(ServerOptions& options, bool* optimizer_file_out) {
  const std::string optimizer_flag = absl::GetFlag(FLAGS_optimizer);
  const bool optimizer_file =
      !optimizer_flag.empty() && optimizer_flag != "adamw" && optimizer_flag != "sgd";
  recipe::OptimizerConfig& pins = options.daemon.optimizer_flags;
  if (!optimizer_flag.empty() && !optimizer_file) {
    pins.set_kind(optimizer_flag == "sgd" ? recipe::SGD : recipe::ADAMW);
  }
  auto pin = [](const std::optional<double>& flag, auto set) {
    if (flag.has_value()) set(static_cast<float>(*flag));
  };
  pin(absl::GetFlag(FLAGS_lr), [&](float v) { pins.set_lr(v); });
  pin(absl::GetFlag(FLAGS_beta1), [&](float v) { pins.set_beta1(v); });
  pin(absl::GetFlag(FLAGS_beta2), [&](float v) { pins.set_beta2(v); });
  pin(absl::GetFlag(FLAGS_adam_eps), [&](float v) { pins.set_eps(v); });
  pin(absl::GetFlag(FLAGS_weight_decay), [&](float v) { pins.set_weight_decay(v); });
  pin(absl::GetFlag(FLAGS_momentum), [&](float v) { pins.set_momentum(v); });
  if (options.run_daemon && optimizer_file && !options.run_coordinator) {
    return absl::InvalidArgumentError(
        "--optimizer=FILE is the coordinator's; a daemon takes the coordinator's config");
  }
  // Flags alone (no file, no recipe section) make the coordinator's config.
  ASSIGN_OR_RETURN(options.daemon.optimizer, OptimizerFromProto(pins));
  options.daemon.default_chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  options.daemon.data_plane = absl::GetFlag(FLAGS_data_plane);
  options.daemon.data_plane_listen = absl::GetFlag(FLAGS_data_plane_listen);
  options.daemon.step_timeout = absl::Seconds(absl::GetFlag(FLAGS_step_timeout_s));
  options.daemon.pipelined_step = absl::GetFlag(FLAGS_pipelined_step);
  options.daemon.step_bucket_elements = absl::GetFlag(FLAGS_step_bucket_elements);
  options.daemon.backend = absl::GetFlag(FLAGS_backend);
  options.daemon.device_channel_listen = absl::GetFlag(FLAGS_device_channel_listen);
  // A data plane or device channel on 0.0.0.0 is dialled at the name this
  // daemon is advertised by, not at gethostname() (a Kubernetes pod's
  // hostname does not resolve in other pods; its Service DNS name does).
  if (!options.advertise_address.empty()) {
    options.daemon.advertise_host =
        options.advertise_address.substr(0, options.advertise_address.rfind(':'));
  }
  options.daemon.rank = absl::GetFlag(FLAGS_rank);
  if (absl::GetFlag(FLAGS_snapshot_every_steps) < 0) {
    return absl::InvalidArgumentError("--snapshot_every_steps must be >= 0 (0 = no snapshots)");
  }
  options.daemon.snapshot_every_steps = absl::GetFlag(FLAGS_snapshot_every_steps);
  if (absl::GetFlag(FLAGS_heartbeat_interval_ms) < 1 || absl::GetFlag(FLAGS_daemon_lease_ms) < 1) {
    return absl::InvalidArgumentError("--heartbeat_interval_ms and --daemon_lease_ms must be >= 1");
  }
  options.daemon.heartbeat_interval =
      absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
  *optimizer_file_out = optimizer_file;
  return absl::OkStatus();
}

// Request limits (both roles) and the gRPC message size.
absl::Status LimitsFromFlags(ServerOptions& options) {
  RequestLimits limits;
  limits.max_tensor_name_bytes = absl::GetFlag(FLAGS_max_tensor_name_bytes);
  limits.max_tensors = absl::GetFlag(FLAGS_max_tensors);
  limits.min_chunk_bytes = absl::GetFlag(FLAGS_min_chunk_bytes);
  limits.max_pushers_per_version = absl::GetFlag(FLAGS_max_pushers_per_version);
  limits.memory_budget_bytes = absl::GetFlag(FLAGS_memory_budget_bytes);
  if (limits.memory_budget_bytes < 0) {
    return absl::InvalidArgumentError("--memory_budget_bytes must be >= 0");
  }
  limits.max_parked_fetches_per_client = absl::GetFlag(FLAGS_max_parked_fetches_per_client);
  limits.max_frozen_bytes = absl::GetFlag(FLAGS_max_frozen_bytes);
  {
    // A Load request and a GetManifest answer carry them whole: the default
    // shrinks with a small --max_message_bytes; a value given must fit.
    const int64_t fits = absl::GetFlag(FLAGS_max_message_bytes) / 2;
    if (limits.max_frozen_bytes == -1) limits.max_frozen_bytes = std::min<int64_t>(16 << 20, fits);
    if (limits.max_frozen_bytes < 0 || limits.max_frozen_bytes > fits) {
      return absl::InvalidArgumentError(
          absl::StrCat("--max_frozen_bytes must be in [0, --max_message_bytes / 2 = ", fits, "]"));
    }
  }
  if (!absl::GetFlag(FLAGS_model_root).empty()) {
    limits.file_roots.push_back(absl::GetFlag(FLAGS_model_root));
    if (!absl::GetFlag(FLAGS_checkpoint_dir).empty()) {
      limits.file_roots.push_back(absl::GetFlag(FLAGS_checkpoint_dir));
    }
  }
  if (limits.max_tensor_name_bytes < 1 || limits.max_tensors < 1 || limits.min_chunk_bytes < 1 ||
      limits.max_pushers_per_version < 1 || limits.max_parked_fetches_per_client < 1) {
    return absl::InvalidArgumentError(
        "--max_tensor_name_bytes, --max_tensors, --min_chunk_bytes, --max_pushers_per_version "
        "and --max_parked_fetches_per_client must be >= 1");
  }

  const int64_t max_message = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message < 4096 || max_message > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError("--max_message_bytes must be in [4096, 2^31-1]");
  }
  options.max_message_bytes = static_cast<int>(max_message);
  options.daemon.limits = limits;
  if (options.daemon.limits.memory_budget_bytes == 0) {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && page > 0) {
      options.daemon.limits.memory_budget_bytes =
          static_cast<int64_t>(static_cast<double>(pages) * static_cast<double>(page) * 0.9);
    }
  }
  options.coordinator.limits = limits;
  return absl::OkStatus();
}

// The coordinator role's options: membership, files, and its optimizer
// config from the recipe, an --optimizer file or the flags.
absl::Status CoordinatorFromFlags(bool optimizer_file, ServerOptions& options) {
  const std::string optimizer_flag = absl::GetFlag(FLAGS_optimizer);
  const recipe::OptimizerConfig& pins = options.daemon.optimizer_flags;
  CoordinatorOptions& c = options.coordinator;
  c.expected_daemons = absl::GetFlag(FLAGS_daemons);
  if (c.expected_daemons < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--daemons must be >= 1, got ", c.expected_daemons));
  }
  c.expected_pushers = absl::GetFlag(FLAGS_expected_pushers);
  if (c.expected_pushers < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--expected_pushers must be >= 0 (0: admin steps only), got ", c.expected_pushers));
  }
  c.log_every_versions = absl::GetFlag(FLAGS_log_every_versions);
  c.data_plane = absl::GetFlag(FLAGS_data_plane);
  c.model_path = absl::GetFlag(FLAGS_model);
  c.restore_from = absl::GetFlag(FLAGS_restore_from);
  c.restore_version = absl::GetFlag(FLAGS_restore_version);
  c.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_dir);
  c.state_file = absl::GetFlag(FLAGS_state_file);
  c.daemon_lease = absl::Milliseconds(absl::GetFlag(FLAGS_daemon_lease_ms));
  if (options.run_coordinator) {
    auto recipe = std::make_shared<Recipe>(Recipe::Builtin());
    if (!absl::GetFlag(FLAGS_recipe).empty()) {
      ASSIGN_OR_RETURN(*recipe, Recipe::Load(absl::GetFlag(FLAGS_recipe)));
    }
    c.optimizer = options.daemon.optimizer;
    c.optimizer_explicit = pins.ByteSizeLong() > 0;
    if (recipe->optimizer().has_value() && optimizer_file) {
      return absl::InvalidArgumentError(absl::StrCat("the recipe ", absl::GetFlag(FLAGS_recipe),
                                                     " has an optimizer section and --optimizer=",
                                                     optimizer_flag, " gives another; keep one"));
    }
    if (recipe->optimizer().has_value()) {
      absl::StatusOr<OptimizerOptions> o = OptimizerFromProto(*recipe->optimizer());
      if (!o.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(absl::GetFlag(FLAGS_recipe), ": ", o.status().message()));
      }
      c.optimizer = *o;
      c.optimizer_explicit = true;
    } else if (optimizer_file) {
      absl::StatusOr<OptimizerOptions> o = LoadOptimizerConfig(optimizer_flag);
      if (absl::IsNotFound(o.status())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "unknown optimizer \"", optimizer_flag,
            "\" (want adamw, sgd or an optimizer config FILE: ", o.status().message(), ")"));
      }
      RETURN_IF_ERROR(o.status());
      c.optimizer = *o;
      c.optimizer_explicit = true;
    }
    // Flags beside a config file or recipe section must agree with it.
    if (absl::Status s = CheckOptimizerFlags(pins, c.optimizer); !s.ok()) return s;
    options.daemon.optimizer = c.optimizer;
    Log("hybrid-paramd", absl::StrCat("optimizer: ", DescribeOptimizer(c.optimizer)));
    c.resolver = [recipe](const std::string& name,
                          absl::Span<const int64_t>) -> absl::StatusOr<HybridSpec> {
      return recipe->SpecFor(name);
    };
    c.optimizer_resolver = [recipe](const std::string& name) {
      return TensorOptimizerFromRule(recipe->OptimizerFor(recipe->Resolve(name)));
    };
    c.recipe_parser = [](const std::string& text) -> absl::StatusOr<ParsedRecipe> {
      ASSIGN_OR_RETURN(Recipe r, Recipe::Parse(text, "LoadRequest.recipe_text"));
      auto shared = std::make_shared<Recipe>(std::move(r));
      ParsedRecipe parsed;
      parsed.resolver = [shared](const std::string& name,
                                 absl::Span<const int64_t>) -> absl::StatusOr<HybridSpec> {
        return shared->SpecFor(name);
      };
      parsed.optimizer_resolver = [shared](const std::string& name) {
        return TensorOptimizerFromRule(shared->OptimizerFor(shared->Resolve(name)));
      };
      if (shared->optimizer().has_value()) {
        ASSIGN_OR_RETURN(parsed.optimizer, OptimizerFromProto(*shared->optimizer()));
      }
      return parsed;
    };
  }
  return absl::OkStatus();
}

// The checkpoint and export services (checkpoint/) over the roles run
// here, and --checkpoint_every's periodic checkpoints: one at a time, each
// on its own thread (the commit callback runs on a gRPC thread and must not
// block). Install before the server starts; it must outlive the server,
// and JoinPeriodic once the server is gone (no more commits).
class CheckpointWiring {
 public:
  absl::Status Install(ServerOptions& options) {
    options_.root = absl::GetFlag(FLAGS_checkpoint_dir);
    options_.keep = absl::GetFlag(FLAGS_keep_checkpoints);
    options_.modes = FileModes::ForGroupReadable(absl::GetFlag(FLAGS_checkpoint_group_readable));
    options_.authenticator = options.authenticator;
    options.add_services = [this, tls = options.tls](Coordinator* coordinator, Daemon* daemon,
                                                     std::vector<grpc::Service*>* services) {
      return AddServices(tls, coordinator, daemon, services);
    };
    const int every = absl::GetFlag(FLAGS_checkpoint_every);
    if (every <= 0 || !options.run_coordinator) return absl::OkStatus();
    if (options_.root.empty()) {
      return absl::InvalidArgumentError("--checkpoint_every needs --checkpoint_dir");
    }
    options.coordinator.on_commit = [this, every](int64_t version) {
      if (version > 0 && version % every == 0) StartPeriodic(version);
    };
    return absl::OkStatus();
  }

  void JoinPeriodic() {
    std::vector<std::thread> threads;
    {
      absl::MutexLock lock(&periodic_mu_);
      threads.swap(periodic_threads_);
    }
    for (std::thread& t : threads) t.join();
  }

 private:
  absl::Status AddServices(const auth::TlsConfig& tls, Coordinator* coordinator, Daemon* daemon,
                           std::vector<grpc::Service*>* services) {
    if (daemon != nullptr) {
      checkpointable_ = NewCheckpointableDaemon(daemon);
      ASSIGN_OR_RETURN(daemon_service_, checkpoint::CheckpointDaemonService::Create(
                                            options_, checkpointable_.get()));
      services->push_back(daemon_service_->service());
    }
    if (coordinator != nullptr) {
      // WriteShard is cluster-internal: the coordinator's calls present the
      // cluster secret, which every joined daemon accepts.
      options_.daemon_channel = {
          tls, std::make_shared<auth::BearerToken>(coordinator->cluster_secret())};
      // Before the port serves: a replacement daemon may read it at once.
      if (const std::string out = absl::GetFlag(FLAGS_cluster_secret_out); !out.empty()) {
        if (absl::Status s = auth::WriteSecretFile(out, coordinator->cluster_secret()); !s.ok()) {
          return absl::Status(s.code(), absl::StrCat("--cluster_secret_out: ", s.message()));
        }
      }
      ASSIGN_OR_RETURN(coordinator_service_, checkpoint::CheckpointCoordinatorService::Create(
                                                 options_, NewInProcessClusterView(coordinator)));
      services->push_back(coordinator_service_->service());
    }
    return absl::OkStatus();
  }

  void StartPeriodic(int64_t version) {
    absl::MutexLock lock(&periodic_mu_);
    if (periodic_running_ || coordinator_service_ == nullptr) return;
    periodic_running_ = true;
    periodic_threads_.emplace_back([this, version] {
      checkpoint::CheckpointRequest request;
      request.set_version(-1);
      absl::StatusOr<checkpoint::CheckpointResponse> r = coordinator_service_->Checkpoint(request);
      if (r.ok()) {
        LogInfo("hybrid-paramd", absl::StrCat("periodic checkpoint of version ", r->version(),
                                              " (commit ", version, ") done"));
      } else {
        LogError("hybrid-paramd",
                 absl::StrCat("periodic checkpoint failed: ", r.status().ToString()));
      }
      absl::MutexLock lock(&periodic_mu_);
      periodic_running_ = false;
    });
  }

  checkpoint::CheckpointServiceOptions options_;
  std::unique_ptr<checkpoint::CheckpointableDaemon> checkpointable_;
  std::unique_ptr<checkpoint::CheckpointDaemonService> daemon_service_;
  std::unique_ptr<checkpoint::CheckpointCoordinatorService> coordinator_service_;
  absl::Mutex periodic_mu_;
  bool periodic_running_ ABSL_GUARDED_BY(periodic_mu_) = false;
  std::vector<std::thread> periodic_threads_ ABSL_GUARDED_BY(periodic_mu_);
};

absl::Status Run() {
  ServerOptions options;
  const std::string role = absl::GetFlag(FLAGS_role);
  if (role != "both" && role != "coordinator" && role != "daemon") {
    return absl::InvalidArgumentError(
        absl::StrCat("--role must be coordinator, daemon or both, got \"", role, "\""));
  }
  RETURN_IF_ERROR(InitLogging({absl::GetFlag(FLAGS_log_format), absl::GetFlag(FLAGS_log_level),
                               absl::GetFlag(FLAGS_v), role}));
  RouteLibraryLogging();  // gRPC's and protobuf's lines in the same format
  options.run_coordinator = role != "daemon";
  options.run_daemon = role != "coordinator";
  RETURN_IF_ERROR(SecurityFromFlags(role, options));
  bool optimizer_file = false;
  RETURN_IF_ERROR(DaemonFromFlags(options, &optimizer_file));
  RETURN_IF_ERROR(LimitsFromFlags(options));
  RETURN_IF_ERROR(CoordinatorFromFlags(optimizer_file, options));
  CheckpointWiring checkpoints;
  RETURN_IF_ERROR(checkpoints.Install(options));

  // SIGINT/SIGTERM are taken by a thread (sigwait) that shuts down cleanly;
  // block them before any thread exists so that every thread inherits it.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  RETURN_IF_ERROR(CheckMetricsListen(absl::GetFlag(FLAGS_metrics_listen),
                                     absl::GetFlag(FLAGS_metrics_port),
                                     options.insecure_listen_anywhere));
  ASSIGN_OR_RETURN(std::unique_ptr<ParamdServer> server, ParamdServer::Start(options));
  std::unique_ptr<MetricsExporter> metrics;
  std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (metrics_listen.empty() && absl::GetFlag(FLAGS_metrics_port) != 0) {
    if (absl::GetFlag(FLAGS_metrics_port) < 0 || absl::GetFlag(FLAGS_metrics_port) > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("--metrics_port must be in [0, 65535], got ",
                                                     absl::GetFlag(FLAGS_metrics_port)));
    }
    metrics_listen = absl::StrCat("0.0.0.0:", absl::GetFlag(FLAGS_metrics_port));
  }
  if (!metrics_listen.empty()) {
    MetricsOptions metrics_options;
    metrics_options.listen = metrics_listen;
    metrics_options.role = role;
    ASSIGN_OR_RETURN(metrics, MetricsExporter::Start(metrics_options, server.get()));
    Log("hybrid-paramd",
        absl::StrCat("metrics on http://", metrics_listen.substr(0, metrics_listen.rfind(':')), ":",
                     metrics->port(), "/metrics"));
  }
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    // Readable by all (it holds a port number, no secret), never through a
    // symlink planted beside it.
    RETURN_IF_ERROR(WriteFileAtomically(absl::GetFlag(FLAGS_port_file),
                                        absl::StrCat(server->port(), "\n"), 0644));
  }
  std::atomic<bool> waking{false};
  std::thread signal_thread([&server, &waking, signals] {
    int sig = 0;
    sigwait(&signals, &sig);
    if (waking.load()) return;
    Log("hybrid-paramd", absl::StrCat("signal ", sig, ": shutting down"));
    server->Shutdown();
  });
  server->Wait();
  // Wait() returns after Shutdown() or on a fatal error; wake the signal
  // thread if it still waits.
  waking.store(true);
  // A directed signal to the thread blocked in sigwait (SIGTERM is
  // blocked in every thread, so it terminates nothing).
  // NOLINTNEXTLINE(bugprone-bad-signal-to-kill-thread)
  pthread_kill(signal_thread.native_handle(), SIGTERM);
  signal_thread.join();
  absl::Status fatal = server->fatal_error();
  metrics.reset();
  server.reset();  // no more commits: no more periodic checkpoints start
  checkpoints.JoinPeriodic();
  return fatal;
}
}  // namespace
}  // namespace paramd

int main(int argc, char** argv) {
  paramd::ParseAbslFlagsOrExit(
      argc, argv,
      {"hybrid-paramd",
       "parameter-server daemon and coordinator for hybrid-quantized weights.\n"
       "Alone it starts a single-node setup (coordinator + one daemon on :7070);\n"
       "load a model with --model or `hpctl load`.\n"
       "Usage: hybrid-paramd [--role=both|coordinator|daemon] [--listen=HOST:PORT] [flags]",
       "server/main.cc", "log_format"});
  // The chosen --log_format from here on (Run() sets the rest), so that
  // even the errors before Run() are JSON lines in JSON mode; an unknown
  // format keeps text, and Run() names the mistake.
  auto use_log_format = [] {
    (void)paramd::InitLogging({absl::GetFlag(FLAGS_log_format), "info", 0, "-"});
  };
  use_log_format();
  if (const std::string config = absl::GetFlag(FLAGS_config); !config.empty()) {
    if (const absl::Status s = paramd::ApplyConfigFile(config); !s.ok()) {
      paramd::LogError("hybrid-paramd", s.message());
      return 1;
    }
    use_log_format();  // the file may set it
  }
  if (const int gpu = absl::GetFlag(FLAGS_gpu); gpu >= 0) {
    // Before any CUDA call: the gpu backend and the device channels use
    // device 0 of what is visible.
    std::vector<std::string> visible;
    if (const char* env = std::getenv("CUDA_VISIBLE_DEVICES"); env != nullptr && *env != 0) {
      visible = absl::StrSplit(env, ',');
    }
    if (!visible.empty() && gpu >= static_cast<int>(visible.size())) {
      paramd::LogError("hybrid-paramd", absl::StrCat("--gpu=", gpu, " but CUDA_VISIBLE_DEVICES=",
                                                     std::getenv("CUDA_VISIBLE_DEVICES"), " has ",
                                                     visible.size(), " devices"));
      return 1;
    }
    const std::string device = visible.empty() ? std::to_string(gpu) : visible[gpu];
    setenv("CUDA_VISIBLE_DEVICES", device.c_str(), 1);
  }
  const absl::Status s = paramd::Run();
  if (!s.ok()) {
    paramd::LogError("hybrid-paramd", s.ToString());
    return 1;
  }
  return 0;
}
