// File: server/coordinator/coordinator.h
//
// The coordinator role of `hybrid-paramd`: the gRPC service
// paramd.rpc.Coordinator of proto/paramd.proto. Single source of truth for
// membership and ranks (daemons get ranks 0..D-1, trainers D, D+1, ...),
// the data-plane rendezvous (transport name + address book), the manifest
// (tensors, their HybridSpecs from the recipe, the shard plan of
// //sharding:plan with daemon addresses) and the committed version: version
// v is committed once every daemon has reported publishing it.
//
// Loading: once every expected daemon has joined, Load (or the startup
// model, CoordinatorOptions::model_path) builds the manifest and sends each
// daemon LoadShards; version 0 is committed when every daemon has published
// it. A Load that arrives before every daemon has joined waits for the
// joins (CoordinatorOptions::load_join_wait) instead of being refused. Steps are driven by the
// trainers' pushes (each daemon steps on its own when all expected pushers have pushed) or by the
// admin Step RPC.
//
// Membership (server/coordinator/membership.h): a daemon keeps its rank by heartbeats;
// one silent for longer than the lease is DOWN, and a process started with
// its rank (or at its address) takes its place.
//
// Threading: thread-safe; gRPC callbacks never block (waits are reactors
// woken by state changes, fan-outs to daemons are async calls). One thread
// of its own checks the leases.
#ifndef PARAMD_SERVER_COORDINATOR_COORDINATOR_H_
#define PARAMD_SERVER_COORDINATOR_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "auth/security.h"
#include "grpcpp/grpcpp.h"
#include "kernels/format.h"
#include "proto/paramd.pb.h"
#include "server/rpc/request_checks.h"
#include "server/step/optimizer.h"
#include "sharding/plan.h"

namespace paramd {

// The HybridSpec of a tensor (name, shape as in the model file): a recipe.
using SpecResolver = std::function<absl::StatusOr<HybridSpec>(const std::string& name,
                                                              absl::Span<const int64_t> shape)>;
// A tensor's optimizer overrides (the recipe rule that gives its spec).
using OptimizerResolver = std::function<TensorOptimizer(const std::string& name)>;
// What recipe text (LoadRequest.recipe_text) gives: specs, optimizer
// overrides and, if the recipe has an `optimizer` section, a config that
// replaces the coordinator's.
struct ParsedRecipe {
  SpecResolver resolver;
  OptimizerResolver optimizer_resolver;
  std::optional<OptimizerOptions> optimizer;
};
using RecipeParser = std::function<absl::StatusOr<ParsedRecipe>(const std::string& text)>;

struct CoordinatorOptions {
  int expected_daemons = 1;
  // Pushes per version each daemon waits for before stepping; 0 = steps
  // only on admin Step.
  int expected_pushers = 1;
  // Data-plane transport handed to members: "host" or "local".
  std::string data_plane = "host";
  // Specs of tensors; null = HybridSpec{} (BF16 passthrough both ways).
  SpecResolver resolver;
  // For LoadRequest.recipe_text; null = such requests are UNIMPLEMENTED.
  RecipeParser recipe_parser;
  // Safetensors file loaded as soon as every daemon has joined ("" = wait
  // for a Load RPC).
  std::string model_path;
  // Or: restore this checkpoint store's version (-1 = newest complete) as
  // soon as every daemon has joined (takes precedence over model_path).
  std::string restore_from;
  int64_t restore_version = -1;
  // The cluster's optimizer config: given to every daemon at join and with
  // every manifest. `optimizer_explicit`: it was given (recipe section,
  // --optimizer file or flags), so a restore uses it instead of the
  // checkpoint's (and logs the override); otherwise a restore takes the
  // checkpoint's config.
  OptimizerOptions optimizer;
  bool optimizer_explicit = false;
  // Per-tensor overrides; null = none.
  OptimizerResolver optimizer_resolver;
  sharding::PlanOptions plan;
  // Deadline of LoadShards calls (reading + quantizing a model) and of
  // other calls to daemons.
  absl::Duration load_timeout = absl::Minutes(10);
  absl::Duration daemon_call_timeout = absl::Seconds(10);
  // A Load that arrives before every expected daemon has joined waits for
  // the joins until its deadline (answering a little before it, so that the
  // caller sees why), and at most this long (also without a deadline); then
  // it is refused with UNAVAILABLE naming the ranks still missing. No
  // gRPC thread is held while it waits.
  absl::Duration load_join_wait = absl::Seconds(60);
  // Every Nth committed version is logged at INFO (the others at --v=1):
  // a line per version would be 360k lines an hour at 10 ms steps.
  int log_every_versions = 100;
  // A daemon whose heartbeats stop for this long is DOWN (logged, in
  // GetStatus and the metrics): steps needing it are refused with
  // UNAVAILABLE naming it until a replacement takes its rank. The daemons
  // heartbeat every DaemonOptions::heartbeat_interval (default 250 ms).
  absl::Duration daemon_lease = absl::Milliseconds(1500);
  // The checkpoint store (--checkpoint_dir) a recovery may restore from
  // once a replacement has taken the rank of a DOWN daemon: its newest
  // complete checkpoint, when that is newer than the newest in-memory
  // snapshot every rank still has (server/coordinator/recovery.h). Empty: snapshots
  // only (without them a recovery fails with FAILED_PRECONDITION and steps
  // stay refused).
  std::string checkpoint_root;
  // --state_file: where the coordinator keeps what a restart needs to take
  // its cluster back (server/coordinator/coordinator_state.h; mode 0600, it holds the
  // cluster and member secrets). Read at Create: a coordinator started
  // with an existing file takes its daemons, model, committed version and
  // recovery epoch back while the daemons keep serving. "" = none.
  std::string state_file;
  // Called (on a gRPC thread, must not block) after each newly committed
  // version, e.g. to start a periodic checkpoint.
  std::function<void(int64_t version)> on_commit;
  // Limits on what a Load may declare (server/rpc/request_checks.h); the names
  // and count of a safetensors file's tensors are checked the same way.
  RequestLimits limits;

  // Security (auth/security.h, docs/SECURITY.md). Who may call this
  // service (null: no checks; ParamdServer always sets one).
  std::shared_ptr<auth::Authenticator> authenticator;
  // TLS of the channels to the daemons (client side).
  auth::TlsConfig tls;
  // The cluster secret handed to daemons in their Join reply and carried
  // by their internal calls. "" = a random one, generated at Create (then,
  // without a token file, a new daemon may join without credentials while
  // the world is incomplete). Set = every daemon join must present it (or
  // a `cluster` token).
  std::string cluster_secret;
};

class Coordinator {
 public:
  // InvalidArgument for bad options.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(CoordinatorOptions options);

  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // The paramd.rpc.Coordinator service to register. Owned by this object.
  grpc::Service* service();
  // Fails every waiting call (UNAVAILABLE) and refuses new waits.
  // Idempotent.
  void Shutdown();

  // -1 until version 0 is committed.
  int64_t committed_version() const;
  // What GetManifest with_frozen_data returns (with pieces, daemon
  // addresses and the frozen buffers' bytes).
  rpc::Manifest manifest() const;
  // Daemons joined so far, and the world size they are waited for.
  int joined_daemons() const;
  int expected_daemons() const;
  // Not OK once the startup load (model_path / restore_from) has failed:
  // the process cannot become what it was started to be (server/server.h
  // exits with it).
  absl::Status startup_error() const;
  // The daemons that have joined, by rank, with their lease state
  // (Member.state, heartbeat_age_seconds, down_reason).
  std::vector<rpc::Member> daemon_members() const;
  // Leases that expired since start (daemons seen dead or stopped).
  int64_t daemons_lost() const;
  // What GetStatus says of recoveries (RecoveryStatus.needs_load: the
  // cluster cannot serve until a load replaces the lost state).
  rpc::RecoveryStatus recovery() const;
  // The cluster secret (CoordinatorOptions::cluster_secret or the generated
  // one): what this process's other channels to the daemons present.
  const std::string& cluster_secret() const;

  class Impl;

 private:
  explicit Coordinator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_COORDINATOR_COORDINATOR_H_
