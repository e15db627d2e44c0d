// File: checkpoint/export_dir.h
//
// What an export (`hpctl export`, Python's Client.export) may write into:
// a new or empty directory, or, with overwrite, one holding an older
// export, whose files are removed first so that the result parses as one
// model (readers take every shard the index names, and some glob
// *.safetensors).
//
// Not thread-safe against other writers of the directory (nothing is).
#ifndef PARAMD_CHECKPOINT_EXPORT_DIR_H_
#define PARAMD_CHECKPOINT_EXPORT_DIR_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace paramd {
namespace checkpoint {

// Whether `name` is a file an export writes (or a single-file Hugging Face
// model): model.safetensors.index.json, model-NNNNN-of-NNNNN.safetensors,
// model.safetensors, or the temporary file of one of them.
bool IsExportFile(absl::string_view name);

// Checks `dir` before an export and returns the names of the files removed.
// A missing or empty directory: OK, nothing removed. A non-empty one:
// FAILED_PRECONDITION listing what is there unless `overwrite`; with it,
// every IsExportFile entry (regular files only) is removed and anything else
// (config.json, tokenizer files, ...) is kept. INVALID_ARGUMENT if `dir`
// exists and is not a directory; the filesystem's error if a removal fails.
absl::StatusOr<std::vector<std::string>> PrepareExportDir(const std::string& dir, bool overwrite);

}  // namespace checkpoint
}  // namespace paramd

#endif  // PARAMD_CHECKPOINT_EXPORT_DIR_H_
