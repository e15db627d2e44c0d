#include "safetensors/sharded.h"

#include <errno.h>
#include <sys/stat.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file_util.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "safetensors/atomic_file.h"
#include "safetensors/json_util.h"

namespace paramd {
namespace safetensors {
namespace {

using Json = nlohmann::json;

std::string JoinPath(absl::string_view dir, absl::string_view name) {
  if (dir.empty()) return std::string(name);
  if (absl::EndsWith(dir, "/")) return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

absl::Status WithContext(const absl::Status& status, absl::string_view context) {
  return absl::Status(status.code(), absl::StrCat(context, status.message()));
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t limit) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return ErrnoStatus(errno, "cannot stat", path);
  if (static_cast<uint64_t>(st.st_size) > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", st.st_size, " bytes is too large (limit ", limit, ")"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoStatus(errno, "cannot open", path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

bool IsPlainFileName(absl::string_view name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find('/') == absl::string_view::npos && name.find('\0') == absl::string_view::npos;
}

}  // namespace

std::string ShardFileName(absl::string_view prefix, int index, int count) {
  return absl::StrFormat("%s-%05d-of-%05d.safetensors", prefix, index + 1, count);
}

absl::StatusOr<ShardPlan> PlanShards(std::vector<TensorSpec> tensors, uint64_t max_shard_bytes,
                                     absl::string_view prefix) {
  if (max_shard_bytes == 0) return absl::InvalidArgumentError("max_shard_bytes must be > 0");
  // Validates names, shapes and sizes once, the way the writers will.
  RETURN_IF_ERROR(EncodeHeader(tensors, {}).status());
  ShardPlan plan;
  plan.shards.emplace_back();
  for (TensorSpec& t : tensors) {
    uint64_t bytes = static_cast<uint64_t>(*NumBytes(t.dtype, t.shape));
    ShardPlan::Shard* shard = &plan.shards.back();
    if (!shard->tensors.empty() && shard->data_bytes + bytes > max_shard_bytes) {
      plan.shards.emplace_back();
      shard = &plan.shards.back();
    }
    shard->tensors.push_back(std::move(t));
    shard->data_bytes += bytes;
    plan.total_size += bytes;
  }
  const int count = static_cast<int>(plan.shards.size());
  for (int i = 0; i < count; ++i) plan.shards[i].file_name = ShardFileName(prefix, i, count);
  return plan;
}

std::string EncodeIndex(const ShardPlan& plan) {
  Json weight_map = Json::object();  // std::map inside: sorted by name
  for (const ShardPlan::Shard& shard : plan.shards) {
    for (const TensorSpec& t : shard.tensors) weight_map[t.name] = shard.file_name;
  }
  Json index = {{"metadata", {{"total_size", plan.total_size}}}, {"weight_map", weight_map}};
  return index.dump(2) + "\n";
}

// ---------------------------------------------------------------------------
// ShardedWriter

absl::StatusOr<std::unique_ptr<ShardedWriter>> ShardedWriter::Create(const std::string& dir,
                                                                     ShardPlan plan,
                                                                     Metadata metadata,
                                                                     mode_t mode) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return ErrnoStatus(errno, "cannot use directory", dir);
  if (!S_ISDIR(st.st_mode)) return absl::InvalidArgumentError(dir + ": not a directory");
  if (plan.shards.empty()) return absl::InvalidArgumentError("shard plan has no shards");
  std::unique_ptr<ShardedWriter> writer(new ShardedWriter());
  writer->dir_ = dir;
  writer->plan_ = std::move(plan);
  writer->metadata_ = std::move(metadata);
  writer->mode_ = mode;
  const ShardPlan::Shard& first = writer->plan_.shards[0];
  ASSIGN_OR_RETURN(writer->writer_,
                   SafetensorsWriter::Create(JoinPath(dir, first.file_name), first.tensors,
                                             writer->metadata_, mode));
  RETURN_IF_ERROR(writer->Advance());
  return writer;
}

ShardedWriter::~ShardedWriter() = default;

absl::Status ShardedWriter::Advance() {
  while (writer_ != nullptr && writer_->next_tensor().empty()) {
    RETURN_IF_ERROR(writer_->Finish());
    writer_.reset();
    if (++shard_ < plan_.shards.size()) {
      const ShardPlan::Shard& shard = plan_.shards[shard_];
      ASSIGN_OR_RETURN(writer_, SafetensorsWriter::Create(JoinPath(dir_, shard.file_name),
                                                          shard.tensors, metadata_, mode_));
    }
  }
  return absl::OkStatus();
}

absl::string_view ShardedWriter::next_tensor() const {
  return writer_ == nullptr ? "" : writer_->next_tensor();
}

absl::Status ShardedWriter::AppendTensorData(absl::string_view name,
                                             absl::Span<const uint8_t> chunk) {
  if (writer_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("data for tensor '", name, "' after all tensors were written"));
  }
  RETURN_IF_ERROR(writer_->AppendTensorData(name, chunk));
  return Advance();
}

absl::Status ShardedWriter::WriteTensor(absl::string_view name, absl::Span<const uint8_t> bytes) {
  if (writer_ == nullptr) return AppendTensorData(name, bytes);
  RETURN_IF_ERROR(writer_->WriteTensor(name, bytes));
  return Advance();
}

absl::Status ShardedWriter::Finish() {
  if (finished_) return absl::FailedPreconditionError("sharded writer already finished");
  if (writer_ != nullptr) {
    return WithContext(writer_->Finish(), absl::StrCat(plan_.shards[shard_].file_name, ": "));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<AtomicFile> index,
                   AtomicFile::Create(JoinPath(dir_, kIndexFileName), mode_));
  RETURN_IF_ERROR(index->Append(EncodeIndex(plan_)));
  RETURN_IF_ERROR(index->Commit());
  finished_ = true;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// ShardedSafetensors

absl::StatusOr<ShardedSafetensors> ShardedSafetensors::Open(const std::string& path,
                                                            int64_t max_name_bytes) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return ErrnoStatus(errno, "cannot open", path);
  if (S_ISDIR(st.st_mode)) {
    std::string index = JoinPath(path, kIndexFileName);
    if (stat(index.c_str(), &st) == 0) return OpenIndex(index, max_name_bytes);
    std::string single = JoinPath(path, kSingleFileName);
    if (stat(single.c_str(), &st) != 0) {
      return absl::NotFoundError(
          absl::StrCat(path, ": directory has neither ", kIndexFileName, " nor ", kSingleFileName));
    }
    return Open(single, max_name_bytes);
  }
  if (absl::EndsWith(path, ".json")) return OpenIndex(path, max_name_bytes);
  ShardedSafetensors model;
  ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path, max_name_bytes));
  model.files_.push_back(std::make_unique<SafetensorsFile>(std::move(file)));
  model.BuildEntries();
  return model;
}

absl::StatusOr<ShardedSafetensors> ShardedSafetensors::OpenIndex(const std::string& index_path,
                                                                 int64_t max_name_bytes) {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": ", what));
  };
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path, SafetensorsFile::kMaxHeaderBytes));
  ASSIGN_OR_RETURN(internal::StrictJson parsed, internal::ParseStrictJson(text, index_path));
  const Json& root = parsed.value;
  if (!root.is_object()) return bad("index is not a JSON object");
  const std::vector<std::string>& dup = parsed.duplicate_key_path;
  if (dup.size() == 2 && dup[0] == "weight_map") {
    return bad(absl::StrCat("weight_map lists tensor '", dup[1], "' more than once"));
  }
  if (!dup.empty()) return bad(absl::StrCat("key \"", dup.back(), "\" appears more than once"));

  ShardedSafetensors model;
  if (auto meta = root.find("metadata"); meta != root.end()) {
    if (!meta->is_object()) return bad("\"metadata\" is not a JSON object");
    if (auto total = meta->find("total_size"); total != meta->end()) {
      if (!total->is_number_unsigned()) {
        return bad(
            absl::StrCat("metadata.total_size is not a non-negative integer: ", total->dump()));
      }
      model.total_size_ = total->get<uint64_t>();
    }
  }
  auto weight_map = root.find("weight_map");
  if (weight_map == root.end()) return bad("missing \"weight_map\"");
  if (!weight_map->is_object()) return bad("\"weight_map\" is not a JSON object");

  // file name -> tensors the index puts there; sorted, so shards open in order.
  std::map<std::string, std::vector<std::string>> by_file;
  for (auto it = weight_map->begin(); it != weight_map->end(); ++it) {
    // Before any message quotes the name.
    if (absl::Status named = CheckTensorName(it.key(), max_name_bytes); !named.ok()) {
      return bad(absl::StrCat("weight_map: ", named.message()));
    }
    if (!it->is_string()) {
      return bad(
          absl::StrCat("weight_map: tensor '", it.key(), "' maps to a non-string ", it->dump()));
    }
    const std::string& file = it->get_ref<const std::string&>();
    if (!IsPlainFileName(file)) {
      return bad(absl::StrCat("weight_map: tensor '", it.key(), "' maps to '", file,
                              "', which is not a plain file name beside the index"));
    }
    by_file[file].push_back(it.key());
  }

  const std::string dir = DirectoryOf(index_path);
  for (const auto& [file_name, names] : by_file) {
    absl::StatusOr<SafetensorsFile> file =
        SafetensorsFile::Open(JoinPath(dir, file_name), max_name_bytes);
    if (!file.ok()) {
      return WithContext(file.status(), absl::StrCat(index_path, ": shard '", file_name,
                                                     "' (holds tensor '", names.front(), "'): "));
    }
    for (const std::string& name : names) {
      if (file->Find(name) == nullptr) {
        return bad(absl::StrCat("weight_map puts tensor '", name, "' in '", file_name,
                                "', which has no such tensor"));
      }
    }
    if (file->tensors().size() != names.size()) {
      for (const TensorInfo& t : file->tensors()) {
        auto mapped = weight_map->find(t.name);
        if (mapped == weight_map->end() || *mapped != file_name) {
          return bad(absl::StrCat(
              "shard '", file_name, "' holds tensor '", t.name, "', which the weight_map ",
              mapped == weight_map->end() ? "does not list" : "puts in another file"));
        }
      }
    }
    model.files_.push_back(std::make_unique<SafetensorsFile>(*std::move(file)));
  }
  model.BuildEntries();
  return model;
}

void ShardedSafetensors::BuildEntries() {
  for (const auto& file : files_) {
    for (const TensorInfo& info : file->tensors()) {
      by_name_.emplace(info.name, entries_.size());
      entries_.push_back({file.get(), &info});
    }
  }
}

const ShardedSafetensors::Entry* ShardedSafetensors::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

uint64_t ShardedSafetensors::data_bytes() const {
  uint64_t total = 0;
  for (const Entry& e : entries_) total += e.info->num_bytes();
  return total;
}

absl::StatusOr<std::vector<uint8_t>> ShardedSafetensors::ReadTensor(absl::string_view name) const {
  const Entry* entry = Find(name);
  if (entry == nullptr) return absl::NotFoundError(absl::StrCat("no tensor '", name, "'"));
  return entry->file->ReadTensor(name);
}

}  // namespace safetensors
}  // namespace paramd
