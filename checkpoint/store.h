// File: checkpoint/store.h
//
// A directory of checkpoints, and the reader that restores one of them,
// onto any number of daemons.
//
//   <root>/v<version>/shard-<rank>-of-<world>.ckpt   one per daemon (shard_file.h)
//   <root>/v<version>/MANIFEST                       written last, by the coordinator
//
// A checkpoint of version v exists once, and only once, its MANIFEST does:
// List, Describe, LatestVersion and CheckpointReader never look at a version
// directory without a MANIFEST that parses and whose checksum matches. The
// MANIFEST file is magic "HPCKMAN1", u64 length, u64 XXH3-64 of the payload,
// then a serialized paramd.checkpoint.Manifest; it is written to a temporary
// name, fsynced, renamed and its directory fsynced, after CommitManifest
// checked that every daemon's shard file is there with the size it reported
// and that the master rows of every tensor are covered exactly once.
//
// Crash consistency follows: a process killed anywhere in a checkpoint
// leaves the previous checkpoints as they were and the new one unlisted
// (temporary files and shard files without a manifest); KeepLast removes a
// checkpoint by unlinking its MANIFEST first, so a crash during garbage
// collection cannot leave a listed checkpoint with missing files.
//
// Status codes: NotFound (no such checkpoint), DataLoss (a file is damaged:
// the message names it), InvalidArgument (a refused name or argument),
// AlreadyExists (the version is already checkpointed), FailedPrecondition
// (the coordinator commits an incomplete set of shard files).
//
// Threading: CheckpointStore is an immutable value; its methods may be
// called from several threads and processes (each daemon writes its own
// shard file). KeepLast must not run concurrently with a checkpoint of a
// version it could remove (pass in-progress versions in `in_progress`).
// Everything blocks on the file system.
#ifndef PARAMD_CHECKPOINT_STORE_H_
#define PARAMD_CHECKPOINT_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "checkpoint/shard_file.h"
#include "proto/checkpoint.pb.h"

namespace paramd {
namespace checkpoint {

inline constexpr uint32_t kManifestFormatVersion = 1;
inline constexpr char kManifestFileName[] = "MANIFEST";
// Manifest metadata: the model generation (rpc::Manifest.model_generation)
// the checkpoint was written of; absent in checkpoints written before
// generations were recorded (server/coordinator/model_generation.h).
inline constexpr char kModelGenerationKey[] = "model_generation";

// "v42".
std::string VersionDirName(uint64_t version);

// One complete checkpoint, as List reports it.
struct CheckpointSummary {
  uint64_t version = 0;
  int world_size = 0;
  int64_t created_unix_micros = 0;
  uint64_t total_bytes = 0;  // sum of the shard file sizes
  int num_tensors = 0;
  std::string path;  // the version directory
};

// Called with (bytes done, bytes total) while a long operation runs.
using ProgressFn = std::function<void(uint64_t done, uint64_t total)>;

class CheckpointStore {
 public:
  // Opens the checkpoint directory `root` (created, with its parents, when
  // `create` is set). Every later path is confined to realpath(root).
  // Directories and files the store creates get exactly `modes` (0700 and
  // 0600 unless the operator lets the group read them).
  static absl::StatusOr<CheckpointStore> Open(const std::string& root, bool create,
                                              FileModes modes = {});

  // The store in `relative` below `root`, e.g. the `--dir` of a request.
  // The name is validated with SafeJoin (no "..", no absolute path, no
  // symlink out of `root`); the directory is created when `create` is set,
  // and `created` (if given) gets the directories that were made
  // (RemoveCreatedDirs undoes them).
  static absl::StatusOr<CheckpointStore> OpenUnder(const std::string& root,
                                                   absl::string_view relative, bool create,
                                                   FileModes modes = {},
                                                   std::vector<std::string>* created = nullptr);

  const std::string& root() const { return root_; }
  std::string VersionDir(uint64_t version) const;

  // Complete checkpoints, oldest first. Version directories without a valid
  // MANIFEST (in progress, abandoned) are left out.
  absl::StatusOr<std::vector<CheckpointSummary>> List() const;

  // The newest complete checkpoint; NotFound if there is none.
  absl::StatusOr<uint64_t> LatestVersion() const;

  // The manifest of a complete checkpoint (Describe). NotFound when the
  // version has no MANIFEST, DataLoss when it is damaged.
  absl::StatusOr<Manifest> ReadManifest(uint64_t version) const;

  // ---- daemon role ----
  // Creates v<version>/ if needed (recorded in `created`, if given) and a
  // writer for this daemon's shard file. AlreadyExists when the version is
  // already complete; InvalidArgument for a rank outside [0, world_size).
  absl::StatusOr<std::unique_ptr<ShardWriter>> NewShardWriter(
      uint64_t version, int daemon_rank, int world_size,
      std::vector<std::string>* created = nullptr) const;

  // ---- coordinator role ----
  // Writes `manifest` (shards = what every daemon's Finish() returned) as
  // the last step of a checkpoint; sets format_version and, if zero,
  // created_unix_micros. Checks first that there is one shard file per rank
  // 0..world_size-1, each present with its recorded size, and that every
  // tensor's master rows [0, rows) are covered exactly once.
  absl::Status CommitManifest(Manifest manifest) const;

  // Reads every shard file of `version` and compares size and XXH3-64 with
  // the manifest. DataLoss naming the first damaged or missing file.
  absl::Status Verify(uint64_t version, const ProgressFn& progress = nullptr) const;

  // Keeps the newest `keep` (>= 1) complete checkpoints and removes the
  // rest, together with abandoned version directories older than the newest
  // complete checkpoint and leftover temporary files. Never removes the
  // newest complete checkpoint, a version newer than it, or one listed in
  // `in_progress`. Returns the removed versions.
  absl::StatusOr<std::vector<uint64_t>> KeepLast(int keep,
                                                 const std::set<uint64_t>& in_progress = {}) const;

  // Removes the temporary files ("." name ".tmp-<pid>...") of writers that
  // are gone -- a pid other than this process's that no longer runs on this
  // machine -- from v<version>/ (NewShardWriter does this first, so a
  // retried version drops what a killed attempt left), or from every
  // version directory (a daemon does this at start). Live writers' files
  // stay. Returns how many files were removed.
  absl::StatusOr<int> RemoveStaleTempFiles(uint64_t version) const;
  absl::StatusOr<int> RemoveStaleTempFilesEverywhere() const;

 private:
  CheckpointStore(std::string root, FileModes modes) : root_(std::move(root)), modes_(modes) {}
  // Version numbers of every "v<N>" directory, complete or not.
  absl::StatusOr<std::vector<uint64_t>> VersionDirs() const;
  absl::Status RemoveVersion(uint64_t version) const;

  std::string root_;
  FileModes modes_;
};

// Restores one complete checkpoint. Open checks the manifest against the
// shard files' indexes (sizes, pieces); it does not read the data, so call
// CheckpointStore::Verify first when the checksums matter (restore does).
//
// Reads are by row range and need not match how the checkpoint was cut:
// ReadRows assembles [row_begin, row_end) from whichever shard files hold
// those rows, which is how a checkpoint written by N daemons is restored
// onto M. Thread-safe after Open.
class CheckpointReader {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(const CheckpointStore& store,
                                                                uint64_t version);

  const Manifest& manifest() const { return manifest_; }
  // The tensor's entry in the manifest, or nullptr.
  const TensorInfo* FindTensor(absl::string_view name) const;

  // Rows [row_begin, row_end) of section `name` ("master", "exp_avg", ...)
  // of `tensor` into `out` ((row_end - row_begin) * cols floats). NotFound
  // when no shard file holds some of those rows.
  absl::Status ReadRows(absl::string_view tensor, absl::string_view name, int64_t row_begin,
                        int64_t row_end, absl::Span<float> out) const;
  absl::StatusOr<std::vector<float>> ReadRows(absl::string_view tensor, absl::string_view name,
                                              int64_t row_begin, int64_t row_end) const;

  // Names of the ROWS sections saved for `tensor` ("master" first).
  std::vector<std::string> RowSectionNames(absl::string_view tensor) const;

  // A BLOB section. Every daemon that held a piece of the tensor saved a
  // copy; the copies must be identical (DataLoss otherwise).
  absl::StatusOr<std::string> ReadBlob(absl::string_view tensor, absl::string_view name) const;
  // The tensor's TensorState ("state" blob, parsed).
  absl::StatusOr<TensorState> ReadTensorState(absl::string_view tensor) const;

 private:
  struct Location {
    const ShardFileReader* file;
    const Section* section;
  };
  CheckpointReader() = default;
  absl::Status BuildIndex();

  Manifest manifest_;
  std::vector<std::unique_ptr<ShardFileReader>> files_;
  // (tensor, section name) -> locations; ROWS sorted by row_begin.
  std::map<std::pair<std::string, std::string>, std::vector<Location>> rows_;
  std::map<std::pair<std::string, std::string>, std::vector<Location>> blobs_;
};

}  // namespace checkpoint
}  // namespace paramd

#endif  // PARAMD_CHECKPOINT_STORE_H_
