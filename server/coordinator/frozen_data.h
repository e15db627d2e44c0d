// File: server/coordinator/frozen_data.h
//
// Where a model's frozen buffers (proto/frozen.proto: tensors loaded,
// checkpointed and exported, never stepped) travel with their bytes. The
// coordinator keeps them whole in its manifest and gives them to whoever
// asks (GetManifest with_frozen_data: exports, state_dict, checkpoints);
// everyone else (the daemons, which never read them; status; plain
// GetManifest) gets their names, dtypes and shapes only.
//
// Thread-compatible pure functions.
#ifndef PARAMD_SERVER_COORDINATOR_FROZEN_DATA_H_
#define PARAMD_SERVER_COORDINATOR_FROZEN_DATA_H_

#include "proto/paramd.pb.h"

namespace paramd {

// Drops the data of every frozen buffer of `manifest` (names, dtypes and
// shapes stay). The plan fingerprint is unchanged: it was computed with
// the data.
inline void ClearFrozenData(rpc::Manifest& manifest) {
  for (FrozenTensor& f : *manifest.mutable_frozen()) f.clear_data();
}

// The manifest a daemon is sent (LoadShards, Recover).
inline rpc::Manifest ManifestForDaemons(rpc::Manifest manifest) {
  ClearFrozenData(manifest);
  return manifest;
}

}  // namespace paramd

#endif  // PARAMD_SERVER_COORDINATOR_FROZEN_DATA_H_
