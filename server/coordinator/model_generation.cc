#include "server/coordinator/model_generation.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/store.h"

namespace paramd {
namespace {

// The real path of the store at `path`; `path` itself when it cannot be
// opened (then it matches no listed store).
std::string StoreRoot(const std::string& path) {
  absl::StatusOr<checkpoint::CheckpointStore> store =
      checkpoint::CheckpointStore::Open(path, /*create=*/false);
  return store.ok() ? store->root() : path;
}

bool IsRestoredFrom(const CheckpointOfModel& checkpoint, const rpc::Manifest& served) {
  return served.has_restored_from() && served.restored_from().version() == checkpoint.version &&
         StoreRoot(served.restored_from().path()) == StoreRoot(checkpoint.path);
}

}  // namespace

absl::StatusOr<int64_t> CheckpointGeneration(const checkpoint::Manifest& manifest) {
  auto it = manifest.metadata().find(checkpoint::kModelGenerationKey);
  if (it == manifest.metadata().end()) return 0;
  int64_t generation;
  if (!absl::SimpleAtoi(it->second, &generation) || generation < 0) {
    return absl::DataLossError(absl::StrCat("checkpoint ", manifest.version(), ": metadata ",
                                            checkpoint::kModelGenerationKey, " \"", it->second,
                                            "\" is not a model generation"));
  }
  return generation;
}

std::vector<CheckpointOfModel> CheckpointsForRecovery(const std::string& root,
                                                      const rpc::Manifest& served) {
  std::vector<CheckpointOfModel> out;
  // `path`: as given (what messages and the recovery's source name).
  auto add = [&out](const std::string& path, const checkpoint::CheckpointStore& store,
                    uint64_t version) {
    absl::StatusOr<checkpoint::Manifest> manifest = store.ReadManifest(version);
    if (!manifest.ok()) return;
    absl::StatusOr<int64_t> generation = CheckpointGeneration(*manifest);
    if (!generation.ok()) return;  // damaged: not a source
    out.push_back({path, static_cast<int64_t>(version), *generation});
  };
  std::string listed;
  if (!root.empty()) {
    absl::StatusOr<checkpoint::CheckpointStore> store =
        checkpoint::CheckpointStore::Open(root, /*create=*/false);
    if (store.ok()) {
      listed = store->root();
      absl::StatusOr<std::vector<checkpoint::CheckpointSummary>> list = store->List();
      if (list.ok()) {
        for (const checkpoint::CheckpointSummary& s : *list) add(root, *store, s.version);
      }
    }
  }
  if (served.has_restored_from() && served.restored_from().version() >= 0) {
    absl::StatusOr<checkpoint::CheckpointStore> store =
        checkpoint::CheckpointStore::Open(served.restored_from().path(), /*create=*/false);
    if (store.ok() && store->root() != listed) {
      add(served.restored_from().path(), *store,
          static_cast<uint64_t>(served.restored_from().version()));
    }
  }
  return out;
}

bool MayRecoverFrom(const CheckpointOfModel& checkpoint, const rpc::Manifest& served) {
  return checkpoint.generation == served.model_generation() || IsRestoredFrom(checkpoint, served);
}

std::string DescribeGeneration(const rpc::Manifest& served) {
  std::string out = absl::StrCat("generation ", served.model_generation());
  if (served.model_generation() == 0) {
    absl::StrAppend(&out, " (loaded before generations were recorded)");
  } else if (!served.loaded_from().empty()) {
    absl::StrAppend(&out, ", loaded from ", served.loaded_from());
  }
  return out;
}

RecoveryCheckpointChoice ChooseRecoveryCheckpoint(const std::vector<CheckpointOfModel>& seen,
                                                  const rpc::Manifest& served) {
  RecoveryCheckpointChoice choice;
  const CheckpointOfModel* refused = nullptr;
  for (const CheckpointOfModel& c : seen) {
    if (MayRecoverFrom(c, served)) {
      if (!choice.chosen || c.version > choice.chosen->version) choice.chosen = c;
    } else if (refused == nullptr || c.version > refused->version) {
      refused = &c;
    }
  }
  if (refused != nullptr && (!choice.chosen || refused->version > choice.chosen->version)) {
    choice.refused = absl::StrCat(
        "checkpoint ", refused->version, " in ", refused->path, " belongs to another model (",
        refused->generation == 0 ? std::string("it records no model generation: written before "
                                               "generations were recorded")
                                 : absl::StrCat("generation ", refused->generation),
        "; the cluster serves ", DescribeGeneration(served), ")");
  }
  return choice;
}

}  // namespace paramd
