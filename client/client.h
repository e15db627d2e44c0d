// File: client/client.h
//
// The library trainers (and hpctl) link to talk to a hybrid-paramd cluster:
// join through the coordinator, read the manifest, fetch the published
// quantized copies of the weights, push gradients, wait for versions.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<client::Client> c,
//                    client::Client::Connect({.coordinator_address = "127.0.0.1:7070"}));
//   ASSIGN_OR_RETURN(int64_t v, c->WaitForVersion(0, absl::Seconds(30)));
//   ASSIGN_OR_RETURN(client::FetchResult w,
//                    c->Fetch(v, client::AllTargets(c->manifest(), {Direction::kRowwise})));
//   ... forward with w.tensors[i].value (ref::Dequantize(value, spec)) ...
//   RETURN_IF_ERROR(c->PushGradients(v, grads).status());
//   ASSIGN_OR_RETURN(v, c->WaitForVersion(v + 1, absl::Seconds(30)));
//
// What a fetch returns: for each (tensor, direction) asked for, one
// QuantizedTensor (kernels/format.h) of the WHOLE tensor in exactly the
// layout of docs/FORMATS.md (ComputeLayout(spec, direction, M, K)),
// quantized with the tensor's global scaling, whatever the number of
// daemons holding pieces of it: pieces are assembled with //sharding:assemble
// (columnwise layouts that are stored transposed, [K][M], arrive as column
// blocks and are put in place). Only the directions asked for cross the
// wire: fetching only rowwise moves only rowwise bytes (FetchStats counts
// them per direction).
//
// Device memory (--config=cuda): gpu_fetch::DeviceFetcher
// (client/gpu_fetch/device_fetcher.h) fetches over NCCL from --backend=gpu
// daemons straight into the trainer's GPU buffers, in the same layouts, on
// top of a Client.
//
// Errors (absl::Status codes, chosen by what a retry should do; see the
// table in proto/paramd.proto):
//   UNAVAILABLE        the coordinator or a daemon is down or unreachable
//                      (reported as soon as gRPC knows, at the latest at the
//                      call's deadline; never a hang). Retry with backoff.
//   DEADLINE_EXCEEDED  the deadline passed first, e.g. Fetch or
//                      WaitForVersion of a version that is never published.
//   NOT_FOUND          unknown tensor, or a version the daemons dropped
//                      (they keep the last two).
//   FAILED_PRECONDITION / ALREADY_EXISTS / OUT_OF_RANGE  a push that does not
//                      fit the daemons' state (stale, duplicate, future).
//   INVALID_ARGUMENT   a malformed request (sizes, buffers too small, ...).
//
// Threading: a Client is thread-safe; every method may be called from any
// thread, concurrently. Every method blocks the calling thread until it is
// done or its timeout passes; calls that talk to several daemons (Fetch,
// PushGradients) talk to them in parallel on internal threads. No callback
// ever runs on the caller's thread. A timeout of zero means
// ClientOptions::call_timeout.
//
// Ownership: the Client owns its gRPC channels. Fetch writes into caller
// buffers when given (the caller keeps ownership; they must stay valid until
// Fetch returns) or returns owned vectors. Destroying the Client leaves the
// cluster (best effort, bounded by call_timeout) and must not race with
// calls in progress.
#ifndef PARAMD_CLIENT_CLIENT_H_
#define PARAMD_CLIENT_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "auth/security.h"
#include "kernels/format.h"
#include "proto/paramd.pb.h"

namespace grpc {
class Channel;
}

namespace paramd {
namespace client {

struct ClientOptions {
  // "host:port" of the coordinator's gRPC service. Empty: the environment
  // variable PARAMD_COORDINATOR, else "127.0.0.1:7070".
  std::string coordinator_address;
  // kTrainer joins with a rank; kObserver (hpctl, tools) joins without one.
  enum class Role { kTrainer, kObserver };
  Role role = Role::kTrainer;
  // Trainers: whether this trainer pushes gradients (counted among the
  // pushers every step waits for).
  bool pusher = true;
  // If > 0, Connect fails (FAILED_PRECONDITION) unless the coordinator
  // expects exactly this many pushers.
  int expected_pushers = 0;
  // For humans (status listings). Empty: "<hostname>:<pid>".
  std::string name;
  // How long Connect waits for the coordinator to accept the connection and
  // the Join; UNAVAILABLE after that.
  absl::Duration connect_timeout = absl::Seconds(10);
  // Timeout of every call that is given none.
  absl::Duration call_timeout = absl::Seconds(30);
  // Largest chunk asked of a daemon's fetch stream (0 = server default).
  int64_t max_chunk_bytes = 0;
  // Fix glibc's malloc thresholds for the whole process at the first
  // Connect, so that gRPC's fetch receive buffers are reused instead of
  // being returned to the kernel and faulted in again (a third of a host
  // fetch's CPU time; client/host_allocator.h). The environment variable
  // PARAMD_CLIENT_MALLOC_TUNING=0 turns it off as well.
  bool tune_host_allocator = true;
  // Security (docs/SECURITY.md). TLS: `tls.ca` (PEM roots that signed the
  // servers' certificates) turns TLS on; `tls.cert`/`tls.key` add a client
  // certificate (mutual TLS); `tls.server_name` overrides the name checked
  // in the servers' certificates. Empty = plaintext, unless the environment
  // variable HPCTL_TLS_CA names a CA (taken when `tls.ca` and `tls.cert`
  // are both empty).
  auth::TlsFiles tls;
  // Bearer token presented on every call (`authorization: Bearer ...`) to
  // a cluster started with --auth_token_file; "" = none. A trainer's token
  // has role trainer; hpctl's role operator.
  std::string token;
};

// Where rows [row_begin, row_end) of a tensor live.
struct PieceLocation {
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int daemon_rank = 0;
  std::string daemon_address;
};

struct TensorMeta {
  std::string name;
  std::vector<int64_t> shape;  // as in the model file
  int64_t rows = 0;            // M: product of shape[:-1]
  int64_t cols = 0;            // K: shape[-1]
  HybridSpec spec;
  std::vector<PieceLocation> pieces;  // in row order, covering [0, rows)
  // The QuantSpec of one direction, and whether that direction is published.
  const QuantSpec& SpecOf(Direction d) const {
    return d == Direction::kRowwise ? spec.rowwise : spec.columnwise;
  }
  bool Publishes(Direction d) const {
    return d == Direction::kRowwise ? spec.rowwise_usage : spec.columnwise_usage;
  }
};

struct Manifest {
  std::vector<TensorMeta> tensors;  // in the manifest's order
  int num_daemons = 0;
  std::vector<std::string> daemon_addresses;  // gRPC address by daemon rank
  int expected_pushers = 0;
  int64_t committed_version = -1;  // when the manifest was read; -1: no model
  std::string optimizer;
  uint64_t plan_fingerprint = 0;
  // The model's frozen buffers (proto/frozen.proto: loaded, checkpointed
  // and exported, never stepped, never fetched); their `data` only when the
  // manifest was read with_frozen_data.
  std::vector<FrozenTensor> frozen;
  // The tensor called `name`, or nullptr.
  const TensorMeta* Find(const std::string& name) const;
  // The frozen buffer called `name`, or nullptr.
  const FrozenTensor* FindFrozen(const std::string& name) const;
};

// Bytes by direction.
struct DirectionBytes {
  int64_t rowwise = 0;
  int64_t columnwise = 0;
  int64_t& operator[](Direction d) { return d == Direction::kRowwise ? rowwise : columnwise; }
  int64_t operator[](Direction d) const { return d == Direction::kRowwise ? rowwise : columnwise; }
  int64_t total() const { return rowwise + columnwise; }
};

struct FetchStats {
  // Payload bytes (data + scale buffers) received from daemons.
  DirectionBytes received;
  // What the same (tensor, direction) fetches would have moved as FP32
  // (4 bytes per element) or BF16 (2 bytes per element).
  DirectionBytes fp32_equivalent;
  DirectionBytes bf16_equivalent;
  int64_t pieces = 0;   // shard pieces received
  int64_t fetches = 0;  // successful Fetch calls
  FetchStats& operator+=(const FetchStats& other);
};

// One (tensor, direction) to fetch.
struct FetchTarget {
  std::string tensor;
  Direction direction = Direction::kRowwise;
  // Optional caller-owned destinations of at least Layout::data_bytes() and
  // Layout::scale_bytes() bytes (see Client::LayoutOf); the bytes land here
  // and the returned QuantizedTensor's data/scales stay empty. Leave both
  // empty to get owned vectors instead. Give both or neither (a format with
  // no scale buffer needs no `scales`).
  absl::Span<uint8_t> data;
  absl::Span<uint8_t> scales;
};

// Targets for every tensor of `manifest` (or the named ones) in each of
// `directions` that the tensor publishes, client-owned buffers.
std::vector<FetchTarget> AllTargets(const Manifest& manifest,
                                    const std::vector<Direction>& directions,
                                    const std::vector<std::string>& tensors = {});

struct FetchedTensor {
  std::string tensor;
  QuantSpec spec;  // of this direction: what ref::Dequantize needs
  Layout layout;
  // format, direction, rows, cols, scale_inv and amax always; data and
  // scales unless the target gave caller buffers.
  QuantizedTensor value;
};

struct FetchResult {
  int64_t version = 0;                 // the version fetched (resolved if kLatest was asked)
  std::vector<FetchedTensor> tensors;  // one per target, in target order
  FetchStats stats;                    // of this call
};

// A gradient for one whole tensor: rows * cols little-endian values.
struct Gradient {
  enum class DType { kFp32, kBf16 };
  std::string tensor;
  DType dtype = DType::kFp32;
  absl::Span<const uint8_t> bytes;  // caller-owned, valid during the call

  static Gradient Fp32(std::string tensor, absl::Span<const float> values);
  static Gradient Bf16(std::string tensor, absl::Span<const uint16_t> values);
};

struct PushResult {
  int64_t version = 0;
  int64_t bytes_sent = 0;  // gradient payload, all daemons
  // Pushers the daemons had counted for `version` including this one
  // (minimum over daemons).
  int pushers_received = 0;
  int pushers_expected = 0;
};

// What WaitForVersionInfo returns.
struct VersionInfo {
  int64_t committed_version = -1;
  // Set when every daemon went back to an earlier version since the last
  // wait (a daemon was lost and replaced; docs/ARCHITECTURE.md
  // "Recovery"): committed_version is that version, possibly below the one
  // waited for.
  std::optional<int64_t> rewound_to;
  int64_t recovery_epoch = 0;  // recoveries the cluster has completed
};

// The version of an ABORTED "rewound to version V" from WaitForVersion
// (also through Fetch of kLatest), else nullopt.
std::optional<int64_t> RewoundTo(const absl::Status& status);

// The routing of a gradient push (Client::PushGradients; reused by
// gpu_fetch::DeviceFetcher::Push for device buffers). Only tensor, dtype
// and bytes.size() of a Gradient are read, never its bytes.
//
// INVALID_ARGUMENT for a gradient of an unknown tensor, of the wrong size,
// or a tensor given twice; FAILED_PRECONDITION when no model is loaded.
//
// A push gives every tensor of the model unless it says it is partial: a
// tensor left out of a kEveryTensor push is refused (INVALID_ARGUMENT naming
// the missing ones), since a trainer that forgot one would otherwise
// contribute a zero gradient for it without a word. With kPartial the
// tensors left out count as zero for this pusher.
enum class PushCoverage { kEveryTensor, kPartial };
absl::Status CheckPushGradients(const Manifest& manifest, absl::Span<const Gradient> gradients,
                                PushCoverage coverage);

// One piece of a push to one daemon: rows [row_begin, row_end) of
// gradients[gradient], `bytes` bytes from `byte_offset` of its values.
struct PushRoute {
  int gradient = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int64_t byte_offset = 0;
  int64_t bytes = 0;
};
// What daemon `rank` receives of `gradients` (checked): that daemon's
// pieces of their tensors in manifest tensor order, then row order
// (possibly none).
std::vector<PushRoute> PushRoutesTo(const Manifest& manifest, int rank,
                                    absl::Span<const Gradient> gradients);

class Client {
 public:
  // Connects to the coordinator, joins (ClientOptions::role) and reads the
  // manifest. INVALID_ARGUMENT at once for an address that is not HOST:PORT
  // (or a gRPC target with a scheme). FAILED_PRECONDITION at once, in
  // words, for what waiting will not mend (auth/endpoint_probe.h): a TLS
  // server spoken to in plaintext or the reverse, a certificate the CA did
  // not sign or issued for another name, a missing or refused client
  // certificate; and for an address where a daemon answers, naming the
  // coordinator that daemon joins. UNAVAILABLE if the coordinator cannot be
  // reached within connect_timeout (blocks that long: a coordinator may
  // start after its trainers), with the reason a plain connection meets
  // (refused, unresolvable); FAILED_PRECONDITION if expected_pushers
  // disagrees.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // This member's id and data-plane rank (-1 for observers).
  const std::string& member_id() const;
  int rank() const;

  // The manifest as last read (Connect, RefreshManifest, Load, or a fetch
  // that found the plan changed). A copy: safe to keep.
  Manifest manifest() const;
  // Reads the manifest from the coordinator again; `with_frozen_data` also
  // brings the frozen buffers' bytes (up to the cluster's
  // --max_frozen_bytes).
  absl::StatusOr<Manifest> RefreshManifest(absl::Duration timeout = absl::ZeroDuration(),
                                           bool with_frozen_data = false);

  // The layout a fetch of (tensor, direction) fills: size caller buffers
  // with it. NOT_FOUND for an unknown tensor; FAILED_PRECONDITION if the
  // tensor does not publish that direction.
  absl::StatusOr<Layout> LayoutOf(const std::string& tensor, Direction direction) const;

  // Fetches `targets` at `version` (kLatest: the committed version). Waits
  // for the version to be published until the timeout (DEADLINE_EXCEEDED).
  // All targets or none: on error no result is returned (caller buffers may
  // have been partly written).
  static constexpr int64_t kLatest = -1;
  absl::StatusOr<FetchResult> Fetch(int64_t version, const std::vector<FetchTarget>& targets,
                                    absl::Duration timeout = absl::ZeroDuration());

  // Fetches `targets` of `version` as the step producing it makes each one
  // ready, from daemons running --pipelined_step (docs/ARCHITECTURE.md
  // "Pipelined step"), so that a forward pass can start on the first layer:
  // `on_ready(i, tensor)` is called once per target i as soon as its bytes
  // are in place (on an internal thread, one call at a time, in no fixed
  // order), possibly before `version` is published. Returns OK once the
  // daemons published `version` (every tensor handed out is then that
  // version's); ABORTED if the step failed or was started again after
  // tensors were handed out (drop them and fetch again); otherwise Fetch's
  // errors. A published version, or daemons that do not pipeline, behave as
  // Fetch (each tensor is handed out when the whole version is there).
  // Costs one request per target and daemon, in parallel (one thread per
  // target). Caller buffers in `targets` are filled as in Fetch.
  absl::Status FetchAsReady(int64_t version, const std::vector<FetchTarget>& targets,
                            const std::function<void(int, const FetchedTensor&)>& on_ready,
                            absl::Duration timeout = absl::ZeroDuration());

  // Pushes this trainer's gradients for `version` (the version the trainer
  // computed them on). Each tensor's rows go to the daemons owning them, in
  // one stream per daemon: a push is one atomic contribution per daemon, so
  // give every gradient of the step in one call: a tensor left out is
  // refused unless `coverage` is kPartial (then it counts as zero). Every
  // daemon receives a stream, even one owning none of the tensors, so that
  // it can count this pusher. INVALID_ARGUMENT for an unknown tensor, a
  // wrong byte count or a missing tensor; ALREADY_EXISTS,
  // FAILED_PRECONDITION or OUT_OF_RANGE as the daemons say (a push refused
  // by one daemon may have been accepted by another: the statuses say which
  // retry is safe).
  absl::StatusOr<PushResult> PushGradients(int64_t version, absl::Span<const Gradient> gradients,
                                           absl::Duration timeout = absl::ZeroDuration(),
                                           PushCoverage coverage = PushCoverage::kEveryTensor);

  // Blocks until the committed version is >= `min_version`; returns it.
  // DEADLINE_EXCEEDED after `timeout`. ABORTED if the cluster rewound
  // meanwhile (a daemon was lost, see WaitForVersionInfo): the message
  // says "rewound to version V" and RewoundTo(status) gives V.
  absl::StatusOr<int64_t> WaitForVersion(int64_t min_version, absl::Duration timeout);
  // The same wait, with the rewind as a result rather than an error: a
  // trainer that finds `rewound_to` set goes back to that version (its data
  // too) and pushes for it next. Each rewind is reported once per Client
  // (the client remembers the recovery epoch it saw).
  absl::StatusOr<VersionInfo> WaitForVersionInfo(int64_t min_version, absl::Duration timeout);
  // Coordinator.WatchVersion: calls `on_event` (on this thread) with the
  // committed version once it is >= min_version and again at every newer
  // commit, until `on_event` returns false (then OK), `timeout` passes
  // (DEADLINE_EXCEEDED) or the stream fails. A rewind comes as an event
  // with `rewound_to` set (committed_version may then be below the last
  // one), reported once per Client as by WaitForVersionInfo; the manifest
  // is refreshed before that event. Blocking.
  absl::Status WatchVersion(int64_t min_version,
                            const std::function<bool(const VersionInfo&)>& on_event,
                            absl::Duration timeout);

  // ---- Administration (hpctl) ----

  // Cluster status: members, versions, per-daemon stats (with per-shard
  // formats and scales if `include_shards`).
  absl::StatusOr<rpc::GetStatusResponse> Status(bool include_shards,
                                                absl::Duration timeout = absl::ZeroDuration());
  // Loads a safetensors file (readable by every daemon) with an optional
  // recipe (protobuf text) and refreshes the manifest. Returns the
  // committed version (0). A cluster that already holds a model refuses
  // (FAILED_PRECONDITION) unless `replace_model`: the load discards the
  // model's training state.
  absl::StatusOr<int64_t> Load(const std::string& safetensors_path,
                               const std::string& recipe_text = "",
                               absl::Duration timeout = absl::ZeroDuration(),
                               bool replace_model = false);
  // Declares a model by its tensors' names and shapes (optional recipe):
  // the daemons then wait for the values through Daemon.PushWeights, which
  // client/weight_stream.h streams from this machine (no shared path).
  // Refreshes the manifest; returns the committed version (-1 until every
  // daemon has all its rows). Refused like Load unless `replace_model`.
  // `frozen`: the model's frozen buffers, whole (sent with the declaration).
  absl::StatusOr<int64_t> LoadDeclared(
      const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors,
      const std::string& recipe_text = "", absl::Duration timeout = absl::ZeroDuration(),
      bool replace_model = false, const std::vector<FrozenTensor>& frozen = {});
  // The gRPC channel to the daemon at `address` (cached; shared with this
  // client's own calls, so it has the client's channel settings).
  std::shared_ptr<grpc::Channel> DaemonChannel(const std::string& address);
  // The channel to the coordinator, for its other services (checkpoints);
  // shared with this client's own calls.
  std::shared_ptr<grpc::Channel> CoordinatorChannel() const;
  // The TLS and token settings of this client's channels, for channels it
  // does not cache (the export streams of client/cluster_admin.h).
  const auth::ChannelSecurity& security() const;
  // Admin step from `version` (the committed one); with `wait`, returns the
  // newly committed version.
  absl::StatusOr<int64_t> Step(int64_t version, bool wait,
                               absl::Duration timeout = absl::ZeroDuration());
  // Replaces the learning-rate schedule (and, if `lr` is set, the peak lr)
  // of the cluster's optimizer between steps (Coordinator.
  // SetOptimizerSchedule); returns the optimizer config now in force.
  // INVALID_ARGUMENT for a schedule the optimizer refuses;
  // FAILED_PRECONDITION while a daemon is unreachable (retry).
  absl::StatusOr<recipe::OptimizerConfig> SetOptimizerSchedule(
      const recipe::LrSchedule& schedule, std::optional<float> lr = std::nullopt,
      absl::Duration timeout = absl::ZeroDuration());

  // Totals of every successful Fetch since Connect.
  FetchStats fetch_stats() const;

 private:
  class Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace client
}  // namespace paramd

#endif  // PARAMD_CLIENT_CLIENT_H_
