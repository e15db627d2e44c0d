// File: client/weight_stream.h
//
// Loading a model from the machine running the client (hpctl load of a
// directory or a sharded Hugging Face checkpoint): the tensors are declared
// to the coordinator (Client::LoadDeclared) and their values streamed to the
// daemons owning their rows over Daemon.PushWeights, one client stream per
// daemon, in parallel. No path needs to be shared with the daemons. Version
// 0 is committed once every daemon has all its rows.
//
//   std::vector<client::WeightSource> sources = ...;   // e.g. from safetensors files
//   ASSIGN_OR_RETURN(int64_t v, client::StreamLoad(*c, sources, recipe, progress));
//
// Threading: StreamLoad blocks; `read` and `progress` are called from one
// internal thread per daemon (progress under a lock, so it need not be
// thread-safe; `read` must be). Errors: those of Client::LoadDeclared and
// of the daemons' PushWeights (INVALID_ARGUMENT for values of the wrong
// size, ...), a failed `read` as is, DEADLINE_EXCEEDED if the version is not
// committed within `timeout`.
#ifndef PARAMD_CLIENT_WEIGHT_STREAM_H_
#define PARAMD_CLIENT_WEIGHT_STREAM_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/client.h"

namespace paramd {
namespace client {

// One tensor of the model: name, shape, and its values as little-endian
// FP32 or BF16, row-major.
struct WeightSource {
  std::string name;
  std::vector<int64_t> shape;
  Gradient::DType dtype = Gradient::DType::kFp32;
  // Fills `out` with the value bytes starting `offset` bytes into the
  // tensor. Called concurrently for different ranges.
  std::function<absl::Status(int64_t offset, absl::Span<uint8_t> out)> read;
};

struct StreamProgress {
  int64_t bytes_sent = 0;
  int64_t bytes_total = 0;
};

// Declares `sources` (with `recipe_text`), streams them, and waits for
// version 0. Returns the committed version. A cluster that already holds a
// model refuses (FAILED_PRECONDITION) unless `replace_model`. `frozen`: the
// model's frozen buffers (non-floating tensors), sent whole with the
// declaration.
absl::StatusOr<int64_t> StreamLoad(Client& client, const std::vector<WeightSource>& sources,
                                   const std::string& recipe_text,
                                   const std::function<void(const StreamProgress&)>& progress,
                                   absl::Duration timeout = absl::Minutes(10),
                                   bool replace_model = false,
                                   const std::vector<FrozenTensor>& frozen = {});

}  // namespace client
}  // namespace paramd

#endif  // PARAMD_CLIENT_WEIGHT_STREAM_H_
