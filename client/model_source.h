// File: client/model_source.h
//
// The values of a model on the machine running the client, as
// client::WeightSource (client/weight_stream.h) for StreamLoad: what
// `hpctl load DIR` and the C API's hpd_load_model (Python's
// Client.load) stream to the daemons.
//
//   ASSIGN_OR_RETURN(std::vector<std::string> files, client::ModelFiles(path));
//   ASSIGN_OR_RETURN(std::vector<client::WeightSource> s, client::WeightSources(files));
//   ASSIGN_OR_RETURN(int64_t v, client::StreamLoad(c, s, recipe, progress));
//
// Threading: the functions are pure (they only read files); the returned
// sources keep their files open and may be read concurrently.
#ifndef PARAMD_CLIENT_MODEL_SOURCE_H_
#define PARAMD_CLIENT_MODEL_SOURCE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/weight_stream.h"
#include "common/names.h"

namespace paramd {
namespace client {

// The safetensors files of `model`: the file itself; the shards a
// `*.index.json` names (a Hugging Face model.safetensors.index.json, whose
// shard names must be files beside it); a directory's
// model.safetensors.index.json if it has one, else every *.safetensors in
// it (sorted). NOT_FOUND for a path that is none of these or an empty
// directory; INVALID_ARGUMENT for an index that is not one, or one naming
// a tensor that breaks the name rule (common/names.h, at most
// `max_name_bytes`: set it as the cluster's --max_tensor_name_bytes).
absl::StatusOr<std::vector<std::string>> ModelFiles(
    const std::string& model, int64_t max_name_bytes = kDefaultMaxTensorNameBytes);

// The tensors of a model's files: the trainable ones as sources to stream,
// the others (integer, boolean, F64: safetensors::IsTrainableDtype) read
// whole as frozen buffers.
struct ModelSources {
  std::vector<WeightSource> weights;
  std::vector<FrozenTensor> frozen;
};

// The tensors of `files`, in file order: F32 and BF16 weights are sent as
// they are, F16 as FP32 (exact); every other dtype is a frozen buffer.
// INVALID_ARGUMENT for a tensor in two files, or frozen buffers of more
// than `max_frozen_bytes` in all (the cluster's --max_frozen_bytes refuses
// them anyway; this is before they are read); the reader's errors for a
// file that is not safetensors or holds a name that breaks the name rule
// (at most `max_name_bytes`).
absl::StatusOr<ModelSources> WeightSources(const std::vector<std::string>& files,
                                           int64_t max_name_bytes = kDefaultMaxTensorNameBytes,
                                           int64_t max_frozen_bytes = int64_t{1} << 30);

}  // namespace client
}  // namespace paramd

#endif  // PARAMD_CLIENT_MODEL_SOURCE_H_
