#include "safetensors/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "safetensors/atomic_file.h"
#include "safetensors/json_util.h"

namespace paramd {
namespace safetensors {
namespace {

using Json = nlohmann::json;

struct DtypeEntry {
  Dtype dtype;
  const char* name;
  int size;
};

constexpr DtypeEntry kDtypes[] = {
    {Dtype::kBool, "BOOL", 1},      {Dtype::kU8, "U8", 1},          {Dtype::kI8, "I8", 1},
    {Dtype::kF8E5M2, "F8_E5M2", 1}, {Dtype::kF8E4M3, "F8_E4M3", 1}, {Dtype::kF8E8M0, "F8_E8M0", 1},
    {Dtype::kI16, "I16", 2},        {Dtype::kU16, "U16", 2},        {Dtype::kF16, "F16", 2},
    {Dtype::kBF16, "BF16", 2},      {Dtype::kI32, "I32", 4},        {Dtype::kU32, "U32", 4},
    {Dtype::kF32, "F32", 4},        {Dtype::kF64, "F64", 8},        {Dtype::kI64, "I64", 8},
    {Dtype::kU64, "U64", 8},
};

constexpr char kMetadataKey[] = "__metadata__";

const DtypeEntry& Entry(Dtype dtype) { return kDtypes[static_cast<int>(dtype)]; }

// "<path>: tensor 'name': <what>"
// (the name C-escaped, cut at 256 bytes: it comes from the file).
absl::Status Bad(absl::string_view path, absl::string_view tensor, absl::string_view what) {
  if (tensor.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
  const std::string quoted = QuoteForError(tensor, 256);
  return absl::InvalidArgumentError(absl::StrCat(
      path, ": tensor '", absl::string_view(quoted).substr(1, quoted.size() - 2), "': ", what));
}

// A non-negative JSON integer that fits int64, or nullopt.
bool AsNonNegative(const Json& value, uint64_t* out) {
  if (!value.is_number_unsigned()) return false;
  uint64_t v = value.get<uint64_t>();
  if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = v;
  return true;
}

absl::Status ReadFully(int fd, uint64_t offset, uint8_t* out, size_t size, absl::string_view path) {
  while (size > 0) {
    ssize_t n = pread(fd, out, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "cannot read", path);
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(path, ": unexpected end of file at byte ", offset));
    }
    out += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

// Parses one tensor entry of the header.
absl::StatusOr<TensorInfo> ParseTensorEntry(absl::string_view path, const std::string& name,
                                            const Json& entry, int64_t max_name_bytes) {
  if (name.empty()) return Bad(path, "", "empty tensor name");
  if (absl::Status s = CheckTensorName(name, max_name_bytes); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
  }
  if (!entry.is_object()) return Bad(path, name, "entry is not a JSON object");
  TensorInfo info;
  info.name = name;

  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end()) return Bad(path, name, "missing \"dtype\"");
  if (!dtype_it->is_string()) return Bad(path, name, "\"dtype\" is not a string");
  absl::StatusOr<Dtype> dtype = ParseDtype(dtype_it->get_ref<const std::string&>());
  if (!dtype.ok()) return Bad(path, name, dtype.status().message());
  info.dtype = *dtype;

  auto shape_it = entry.find("shape");
  if (shape_it == entry.end()) return Bad(path, name, "missing \"shape\"");
  if (!shape_it->is_array()) return Bad(path, name, "\"shape\" is not an array");
  for (const Json& dim : *shape_it) {
    uint64_t d = 0;
    if (!AsNonNegative(dim, &d)) {
      return Bad(path, name,
                 absl::StrCat("shape ", shape_it->dump(),
                              " has a dimension that is not a non-negative integer: ", dim.dump()));
    }
    info.shape.push_back(static_cast<int64_t>(d));
  }
  absl::StatusOr<int64_t> bytes = NumBytes(info.dtype, info.shape);
  if (!bytes.ok()) return Bad(path, name, bytes.status().message());
  info.num_elements = *NumElements(info.shape);

  auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end()) return Bad(path, name, "missing \"data_offsets\"");
  if (!offsets_it->is_array() || offsets_it->size() != 2 ||
      !AsNonNegative((*offsets_it)[0], &info.begin) ||
      !AsNonNegative((*offsets_it)[1], &info.end)) {
    return Bad(path, name,
               absl::StrCat("\"data_offsets\" must be [begin, end] of non-negative integers, got ",
                            offsets_it->dump()));
  }
  if (info.begin > info.end) {
    return Bad(path, name,
               absl::StrCat("data_offsets [", info.begin, ", ", info.end, "] have begin > end"));
  }
  if (info.end - info.begin != static_cast<uint64_t>(*bytes)) {
    return Bad(path, name,
               absl::StrCat("data_offsets [", info.begin, ", ", info.end, "] span ",
                            info.end - info.begin, " bytes but ", DtypeName(info.dtype), " ",
                            shape_it->dump(), " needs ", *bytes));
  }
  return info;
}

absl::StatusOr<Metadata> ParseMetadata(absl::string_view path, const Json& value) {
  if (!value.is_object()) return Bad(path, "", "\"__metadata__\" is not a JSON object");
  Metadata metadata;
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (!it->is_string()) {
      return Bad(path, "",
                 absl::StrCat("\"__metadata__\" value of key '", it.key(),
                              "' is not a string: ", it->dump()));
    }
    metadata.emplace(it.key(), it->get<std::string>());
  }
  return metadata;
}

// The tensors' ranges, sorted, must tile [0, data_size) exactly.
absl::Status CheckCoverage(absl::string_view path, std::vector<TensorInfo>& tensors,
                           uint64_t data_size) {
  for (const TensorInfo& t : tensors) {
    if (t.end > data_size) {
      return absl::DataLossError(absl::StrCat(
          path, ": tensor '", t.name, "': data_offsets [", t.begin, ", ", t.end,
          "] run past the end of the data section (", data_size, " bytes; file truncated?)"));
    }
  }
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t expected = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& t : tensors) {
    if (t.begin < expected) {
      return Bad(path, t.name,
                 absl::StrCat("data_offsets [", t.begin, ", ", t.end, "] overlap tensor '",
                              previous->name, "' [", previous->begin, ", ", previous->end, "]"));
    }
    if (t.begin > expected) {
      return Bad(path, t.name,
                 absl::StrCat("gap: bytes [", expected, ", ", t.begin,
                              ") of the data section before this tensor belong to no tensor"));
    }
    expected = t.end;
    previous = &t;
  }
  if (expected != data_size) {
    return Bad(path, "",
               absl::StrCat(data_size - expected,
                            " trailing bytes after the last tensor (data "
                            "section is ",
                            data_size, " bytes, tensors cover ", expected, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Span<const Dtype> AllDtypes() {
  static const auto* all = [] {
    auto* v = new std::vector<Dtype>();
    for (const DtypeEntry& e : kDtypes) v->push_back(e.dtype);
    return v;
  }();
  return *all;
}

absl::string_view DtypeName(Dtype dtype) { return Entry(dtype).name; }

bool IsTrainableDtype(Dtype dtype) {
  return dtype == Dtype::kF32 || dtype == Dtype::kBF16 || dtype == Dtype::kF16;
}

int DtypeSize(Dtype dtype) { return Entry(dtype).size; }

absl::StatusOr<Dtype> ParseDtype(absl::string_view name) {
  for (const DtypeEntry& e : kDtypes) {
    if (name == e.name) return e.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unsupported dtype '", name, "'"));
}

absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative dimension ", d));
    if (__builtin_mul_overflow(n, d, &n)) {
      return absl::InvalidArgumentError("shape overflows: too many elements");
    }
  }
  return n;
}

absl::StatusOr<int64_t> NumBytes(Dtype dtype, absl::Span<const int64_t> shape) {
  ASSIGN_OR_RETURN(int64_t n, NumElements(shape));
  int64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<int64_t>(DtypeSize(dtype)), &bytes)) {
    return absl::InvalidArgumentError("shape overflows: too many bytes");
  }
  return bytes;
}

// ---------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    file_size_ = other.file_size_;
    data_offset_ = other.data_offset_;
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path,
                                                      int64_t max_name_bytes) {
  SafetensorsFile file;
  file.path_ = path;
  file.fd_ = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file.fd_ < 0) return ErrnoStatus(errno, "cannot open", path);
  struct stat st;
  if (fstat(file.fd_, &st) != 0) return ErrnoStatus(errno, "cannot stat", path);
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError(path + ": not a regular file");
  file.file_size_ = static_cast<uint64_t>(st.st_size);

  if (file.file_size_ < 8) {
    return absl::DataLossError(absl::StrCat(path, ": file is ", file.file_size_,
                                            " bytes, too short for the 8-byte header length"));
  }
  uint8_t length_bytes[8];
  RETURN_IF_ERROR(ReadFully(file.fd_, 0, length_bytes, 8, path));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | length_bytes[i];
  // The length's value is never printed: for a file that is not
  // safetensors it is the file's first 8 bytes.
  if (header_len > kMaxHeaderBytes) {
    return Bad(path, "",
               absl::StrCat("not a safetensors file: its header length field exceeds the limit "
                            "of ",
                            kMaxHeaderBytes, " bytes"));
  }
  if (header_len < 2) {
    return Bad(path, "", "not a safetensors file: its header length is too small for JSON");
  }
  if (header_len > file.file_size_ - 8) {
    return absl::DataLossError(absl::StrCat(path, ": header length runs past the end of the file (",
                                            file.file_size_, " bytes); truncated header?"));
  }
  file.data_offset_ = 8 + header_len;
  std::string header(header_len, '\0');
  RETURN_IF_ERROR(
      ReadFully(file.fd_, 8, reinterpret_cast<uint8_t*>(header.data()), header_len, path));

  ASSIGN_OR_RETURN(internal::StrictJson parsed,
                   internal::ParseStrictJson(header, absl::StrCat(path, ": header")));
  const Json& root = parsed.value;
  if (!root.is_object()) {
    return Bad(path, "", absl::StrCat("header is not a JSON object but ", root.type_name()));
  }
  const std::vector<std::string>& dup = parsed.duplicate_key_path;
  if (dup.size() == 1) return Bad(path, dup[0], "name appears more than once in the header");
  if (dup.size() > 1) {
    return Bad(path, dup[0], absl::StrCat("key \"", dup.back(), "\" appears more than once"));
  }

  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == kMetadataKey) {
      ASSIGN_OR_RETURN(file.metadata_, ParseMetadata(path, *it));
      continue;
    }
    ASSIGN_OR_RETURN(TensorInfo info, ParseTensorEntry(path, it.key(), *it, max_name_bytes));
    file.tensors_.push_back(std::move(info));
  }
  RETURN_IF_ERROR(CheckCoverage(path, file.tensors_, file.file_size_ - file.data_offset_));
  for (size_t i = 0; i < file.tensors_.size(); ++i) file.index_.emplace(file.tensors_[i].name, i);
  return file;
}

const TensorInfo* SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status SafetensorsFile::ReadTensorBytes(const TensorInfo& tensor, uint64_t offset,
                                              absl::Span<uint8_t> out) const {
  if (offset > tensor.num_bytes() || out.size() > tensor.num_bytes() - offset) {
    return absl::OutOfRangeError(absl::StrCat(path_, ": tensor '", tensor.name, "': read of ",
                                              out.size(), " bytes at offset ", offset,
                                              " is outside its ", tensor.num_bytes(), " bytes"));
  }
  return ReadFully(fd_, data_offset_ + tensor.begin + offset, out.data(), out.size(), path_);
}

absl::StatusOr<std::vector<uint8_t>> SafetensorsFile::ReadTensor(absl::string_view name) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor '", name, "'"));
  }
  std::vector<uint8_t> bytes(info->num_bytes());
  RETURN_IF_ERROR(ReadTensorBytes(*info, 0, absl::MakeSpan(bytes)));
  return bytes;
}

// ---------------------------------------------------------------------------
// Writing

absl::StatusOr<std::string> EncodeHeader(absl::Span<const TensorSpec> tensors,
                                         const Metadata& metadata) {
  nlohmann::ordered_json root = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    root[kMetadataKey] = std::move(meta);
  }
  uint64_t offset = 0;
  std::set<absl::string_view> names;
  for (const TensorSpec& t : tensors) {
    if (t.name.empty()) return absl::InvalidArgumentError("empty tensor name");
    if (t.name == kMetadataKey) {
      return absl::InvalidArgumentError("a tensor cannot be named \"__metadata__\"");
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' declared twice"));
    }
    absl::StatusOr<int64_t> bytes = NumBytes(t.dtype, t.shape);
    if (!bytes.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "': ", bytes.status().message()));
    }
    if (__builtin_add_overflow(offset, static_cast<uint64_t>(*bytes), &offset) ||
        offset > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError("total data size overflows");
    }
    root[t.name] = {{"dtype", DtypeName(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset - static_cast<uint64_t>(*bytes), offset}}};
  }
  std::string json;
  try {
    json = root.dump();
  } catch (const nlohmann::ordered_json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("header cannot be encoded (names and metadata must be UTF-8): ", e.what()));
  }
  json.append((8 - json.size() % 8) % 8, ' ');  // data section starts 8-aligned
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  out += json;
  return out;
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<TensorSpec> tensors, const Metadata& metadata,
    mode_t mode) {
  ASSIGN_OR_RETURN(std::string header, EncodeHeader(tensors, metadata));
  std::unique_ptr<SafetensorsWriter> writer(new SafetensorsWriter());
  for (const TensorSpec& t : tensors) {
    uint64_t bytes = static_cast<uint64_t>(*NumBytes(t.dtype, t.shape));
    writer->sizes_.push_back(bytes);
    writer->data_bytes_ += bytes;
  }
  writer->specs_ = std::move(tensors);
  while (writer->current_ < writer->specs_.size() && writer->sizes_[writer->current_] == 0) {
    ++writer->current_;
  }
  ASSIGN_OR_RETURN(writer->out_, AtomicFile::Create(path, mode));
  RETURN_IF_ERROR(writer->out_->Append(header));
  return writer;
}

SafetensorsWriter::~SafetensorsWriter() = default;

absl::string_view SafetensorsWriter::next_tensor() const {
  return current_ < specs_.size() ? absl::string_view(specs_[current_].name) : "";
}

absl::Status SafetensorsWriter::AppendTensorData(absl::string_view name,
                                                 absl::Span<const uint8_t> chunk) {
  if (out_ == nullptr) return absl::FailedPreconditionError("writer already finished");
  if (current_ >= specs_.size() || specs_[current_].name != name) {
    // An empty write to a zero-byte tensor is always fine.
    for (size_t i = 0; i < specs_.size(); ++i) {
      if (specs_[i].name == name && sizes_[i] == 0 && chunk.empty()) return absl::OkStatus();
    }
    if (current_ >= specs_.size()) {
      return absl::FailedPreconditionError(
          absl::StrCat("data for tensor '", name, "' after all tensors were written"));
    }
    return absl::FailedPreconditionError(absl::StrCat("expected data for tensor '",
                                                      specs_[current_].name, "', got '", name,
                                                      "' (tensors are written in declared order)"));
  }
  const uint64_t size = sizes_[current_];
  if (chunk.size() > size - current_done_) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk of ", chunk.size(), " bytes runs past the end of tensor '", name, "' (",
                     current_done_, " of ", size, " bytes written)"));
  }
  RETURN_IF_ERROR(out_->Append(chunk));
  current_done_ += chunk.size();
  if (current_done_ == size) {
    current_done_ = 0;
    ++current_;
    while (current_ < specs_.size() && sizes_[current_] == 0) ++current_;
  }
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::WriteTensor(absl::string_view name,
                                            absl::Span<const uint8_t> bytes) {
  if (current_ < specs_.size() && specs_[current_].name == name &&
      (current_done_ != 0 || bytes.size() != sizes_[current_])) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "' is ", sizes_[current_], " bytes (", current_done_,
                     " already written), got a whole-tensor write of ", bytes.size()));
  }
  return AppendTensorData(name, bytes);
}

absl::Status SafetensorsWriter::Finish() {
  if (out_ == nullptr) return absl::FailedPreconditionError("writer already finished");
  if (current_ < specs_.size()) {
    return absl::FailedPreconditionError(absl::StrCat("tensor '", specs_[current_].name,
                                                      "' incomplete: ", current_done_, " of ",
                                                      sizes_[current_], " bytes written"));
  }
  absl::Status status = out_->Commit();
  out_.reset();
  return status;
}

}  // namespace safetensors
}  // namespace paramd
