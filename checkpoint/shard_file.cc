#include "checkpoint/shard_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/names.h"
#include "common/status_macros.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "checkpoint files are little-endian; a big-endian host needs byte swaps");

namespace paramd {
namespace checkpoint {
namespace {

// Writes smaller than this are coalesced; larger ones go straight to write().
constexpr size_t kBufferBytes = 1 << 20;
constexpr size_t kReadBlockBytes = 8 << 20;

void PutU32(std::string* out, uint32_t v) { out->append(reinterpret_cast<const char*>(&v), 4); }
void PutU64(std::string* out, uint64_t v) { out->append(reinterpret_cast<const char*>(&v), 8); }
uint64_t GetU64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

absl::Status Corrupt(absl::string_view path, absl::string_view what) {
  return absl::DataLossError(absl::StrCat("shard file ", path, ": ", what));
}

}  // namespace

std::string SectionForMessage(const Section& section) {
  return absl::StrCat(QuoteForMessage(section.tensor()), "/", QuoteForMessage(section.name()));
}

struct ShardWriter::HashState {
  HashState() : state(XXH3_createState()) { XXH3_64bits_reset(state); }
  ~HashState() { XXH3_freeState(state); }
  void Reset() { XXH3_64bits_reset(state); }
  void Update(const void* data, size_t size) { XXH3_64bits_update(state, data, size); }
  uint64_t Digest() const { return XXH3_64bits_digest(state); }
  XXH3_state_t* state;
};

std::string ShardFileName(int rank, int world_size) {
  return absl::StrFormat("shard-%05d-of-%05d.ckpt", rank, world_size);
}

uint64_t Xxh3(absl::string_view bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

// ---------------------------------------------------------------------------
// ShardWriter

ShardWriter::ShardWriter(std::string dir, std::string name, std::string temp_path, UniqueFd fd)
    : dir_(std::move(dir)),
      name_(std::move(name)),
      temp_path_(std::move(temp_path)),
      fd_(std::move(fd)),
      file_hash_(std::make_unique<HashState>()),
      section_hash_(std::make_unique<HashState>()) {
  buffer_.reserve(kBufferBytes);
}

absl::StatusOr<std::unique_ptr<ShardWriter>> ShardWriter::Create(std::string dir, std::string name,
                                                                 uint64_t version, int daemon_rank,
                                                                 int world_size, mode_t mode) {
  if (name.empty() || name[0] == '.' || name.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("bad shard file name ", QuoteForMessage(name)));
  }
  if (world_size < 1 || daemon_rank < 0 || daemon_rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("daemon rank ", daemon_rank, " of world ", world_size));
  }
  // The pid in the name lets a restarted daemon remove what a killed writer
  // left (CheckpointStore::RemoveStaleTempFiles).
  ASSIGN_OR_RETURN(UniqueFile temp,
                   CreateUniqueFile(dir, absl::StrCat(".", name, ".tmp-", ::getpid(), "-"), mode));
  UniqueFd fd(temp.fd);
  std::unique_ptr<ShardWriter> writer(
      new ShardWriter(std::move(dir), std::move(name), std::move(temp.path), std::move(fd)));
  writer->index_.set_version(version);
  writer->index_.set_daemon_rank(daemon_rank);
  writer->index_.set_world_size(world_size);
  std::string header(kShardMagic, sizeof(kShardMagic));
  PutU32(&header, kShardFormatVersion);
  PutU32(&header, 0);
  RETURN_IF_ERROR(writer->Write(header.data(), header.size()));
  return writer;
}

ShardWriter::~ShardWriter() {
  if (!finished_) {
    fd_ = UniqueFd();
    ::unlink(temp_path_.c_str());
  }
}

absl::Status ShardWriter::CheckOpen() const {
  if (finished_) return absl::FailedPreconditionError("shard writer already finished");
  return sticky_error_;
}

absl::Status ShardWriter::FlushBuffer() {
  if (buffer_.empty()) return absl::OkStatus();
  absl::Status status = WriteAll(fd_.get(), buffer_.data(), buffer_.size(), temp_path_);
  buffer_.clear();
  return status;
}

absl::Status ShardWriter::Write(const void* data, size_t size) {
  file_hash_->Update(data, size);
  if (in_section_) section_hash_->Update(data, size);
  offset_ += size;
  absl::Status status;
  if (buffer_.size() + size <= kBufferBytes) {
    buffer_.append(static_cast<const char*>(data), size);
  } else {
    status = FlushBuffer();
    if (status.ok()) status = WriteAll(fd_.get(), data, size, temp_path_);
  }
  if (!status.ok()) sticky_error_ = status;
  return status;
}

absl::Status ShardWriter::PadToAlignment() {
  static const char kZeros[kSectionAlignment] = {};
  uint64_t pad = (kSectionAlignment - offset_ % kSectionAlignment) % kSectionAlignment;
  return Write(kZeros, pad);
}

absl::Status ShardWriter::BeginSection(Section section) {
  RETURN_IF_ERROR(CheckOpen());
  if (in_section_) return absl::FailedPreconditionError("previous section not ended");
  RETURN_IF_ERROR(PadToAlignment());
  section.set_offset(offset_);
  *index_.add_sections() = std::move(section);
  section_hash_->Reset();
  in_section_ = true;
  return absl::OkStatus();
}

absl::Status ShardWriter::BeginRows(absl::string_view tensor, absl::string_view name,
                                    int64_t row_begin, int64_t row_end, int64_t cols) {
  if (tensor.empty() || name.empty()) {
    return absl::InvalidArgumentError("a ROWS section needs a tensor and a section name");
  }
  if (row_begin < 0 || row_end <= row_begin || cols < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", QuoteForMessage(tensor),
                                                   ": bad rows [", row_begin, ", ", row_end, ") x ",
                                                   cols));
  }
  Section section;
  section.set_kind(Section::ROWS);
  section.set_tensor(std::string(tensor));
  section.set_name(std::string(name));
  section.set_row_begin(row_begin);
  section.set_row_end(row_end);
  section.set_cols(cols);
  section_expected_ = static_cast<uint64_t>(row_end - row_begin) * cols * sizeof(float);
  return BeginSection(std::move(section));
}

absl::Status ShardWriter::AppendRows(absl::Span<const float> data) {
  RETURN_IF_ERROR(CheckOpen());
  if (!in_section_) return absl::FailedPreconditionError("AppendRows outside a section");
  const uint64_t begin = index_.sections().rbegin()->offset();
  if (offset_ - begin + data.size() * sizeof(float) > section_expected_) {
    return absl::InvalidArgumentError(absl::StrCat("section ",
                                                   SectionForMessage(*index_.sections().rbegin()),
                                                   ": more data than rows x cols"));
  }
  return Write(data.data(), data.size() * sizeof(float));
}

absl::Status ShardWriter::EndSection() {
  RETURN_IF_ERROR(CheckOpen());
  if (!in_section_) return absl::FailedPreconditionError("EndSection outside a section");
  Section& section = *index_.mutable_sections()->rbegin();
  const uint64_t length = offset_ - section.offset();
  if (length != section_expected_) {
    return absl::InvalidArgumentError(absl::StrCat("section ", SectionForMessage(section), ": ",
                                                   length, " bytes of ", section_expected_,
                                                   " written"));
  }
  section.set_length(length);
  section.set_xxh3_64(section_hash_->Digest());
  in_section_ = false;
  return absl::OkStatus();
}

absl::Status ShardWriter::AddRows(absl::string_view tensor, absl::string_view name,
                                  int64_t row_begin, int64_t row_end, int64_t cols,
                                  absl::Span<const float> data) {
  RETURN_IF_ERROR(BeginRows(tensor, name, row_begin, row_end, cols));
  RETURN_IF_ERROR(AppendRows(data));
  return EndSection();
}

absl::Status ShardWriter::AddBlob(absl::string_view tensor, absl::string_view name,
                                  absl::string_view bytes) {
  if (name.empty()) return absl::InvalidArgumentError("a BLOB section needs a name");
  Section section;
  section.set_kind(Section::BLOB);
  section.set_tensor(std::string(tensor));
  section.set_name(std::string(name));
  section_expected_ = bytes.size();
  RETURN_IF_ERROR(BeginSection(std::move(section)));
  RETURN_IF_ERROR(Write(bytes.data(), bytes.size()));
  return EndSection();
}

absl::StatusOr<ShardFileInfo> ShardWriter::Finish() {
  RETURN_IF_ERROR(CheckOpen());
  if (in_section_) return absl::FailedPreconditionError("Finish inside an open section");
  RETURN_IF_ERROR(PadToAlignment());
  const uint64_t index_offset = offset_;
  std::string index_bytes;
  if (!index_.SerializeToString(&index_bytes)) {
    return absl::InternalError("cannot serialize the shard index");
  }
  RETURN_IF_ERROR(Write(index_bytes.data(), index_bytes.size()));
  std::string trailer;
  PutU64(&trailer, index_offset);
  PutU64(&trailer, index_bytes.size());
  PutU64(&trailer, Xxh3(index_bytes));
  trailer.append(kShardTrailerMagic, sizeof(kShardTrailerMagic));
  RETURN_IF_ERROR(Write(trailer.data(), trailer.size()));
  RETURN_IF_ERROR(FlushBuffer());
  RETURN_IF_ERROR(FsyncFd(fd_.get(), temp_path_));
  RETURN_IF_ERROR(fd_.Close(temp_path_));
  const std::string final_path = absl::StrCat(dir_, "/", name_);
  if (::rename(temp_path_.c_str(), final_path.c_str()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("rename ", temp_path_, " to"), final_path);
  }
  finished_ = true;
  RETURN_IF_ERROR(FsyncDir(dir_));

  ShardFileInfo info;
  info.set_name(name_);
  info.set_daemon_rank(index_.daemon_rank());
  info.set_size_bytes(offset_);
  info.set_xxh3_64(file_hash_->Digest());
  for (const Section& section : index_.sections()) {
    if (section.kind() != Section::ROWS || section.name() != kMasterSection) continue;
    PieceInfo* piece = info.add_pieces();
    piece->set_tensor(section.tensor());
    piece->set_row_begin(section.row_begin());
    piece->set_row_end(section.row_end());
  }
  return info;
}

// ---------------------------------------------------------------------------
// ShardFileReader

ShardFileReader::ShardFileReader(std::string path, UniqueFd fd, uint64_t size, ShardIndex index)
    : path_(std::move(path)), fd_(std::move(fd)), size_(size), index_(std::move(index)) {}

absl::StatusOr<std::unique_ptr<ShardFileReader>> ShardFileReader::Open(std::string path) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(path));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "stat", path);
  if (!S_ISREG(st.st_mode)) return Corrupt(path, "not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kShardHeaderBytes + kShardTrailerBytes) {
    return Corrupt(path, absl::StrCat("only ", size, " bytes (truncated?)"));
  }
  char header[kShardHeaderBytes];
  RETURN_IF_ERROR(PReadAll(fd.get(), header, sizeof(header), 0, path));
  if (std::memcmp(header, kShardMagic, sizeof(kShardMagic)) != 0) {
    return Corrupt(path, "bad magic (not a hybrid-paramd shard file)");
  }
  uint32_t format_version;
  std::memcpy(&format_version, header + 8, 4);
  if (format_version != kShardFormatVersion) {
    return Corrupt(path, absl::StrCat("format version ", format_version, ", this build reads ",
                                      kShardFormatVersion));
  }
  char trailer[kShardTrailerBytes];
  RETURN_IF_ERROR(PReadAll(fd.get(), trailer, sizeof(trailer), size - kShardTrailerBytes, path));
  if (std::memcmp(trailer + 24, kShardTrailerMagic, sizeof(kShardTrailerMagic)) != 0) {
    return Corrupt(path, "bad trailer magic (truncated or not finished)");
  }
  const uint64_t index_offset = GetU64(trailer);
  const uint64_t index_length = GetU64(trailer + 8);
  if (index_offset < kShardHeaderBytes || index_length > size ||
      index_offset + index_length != size - kShardTrailerBytes) {
    return Corrupt(path, "index position does not fit the file (truncated?)");
  }
  std::string index_bytes(index_length, '\0');
  RETURN_IF_ERROR(PReadAll(fd.get(), index_bytes.data(), index_length, index_offset, path));
  if (Xxh3(index_bytes) != GetU64(trailer + 16)) return Corrupt(path, "index checksum mismatch");
  ShardIndex index;
  if (!index.ParseFromString(index_bytes)) return Corrupt(path, "index does not parse");
  for (const Section& section : index.sections()) {
    if (section.offset() < kShardHeaderBytes || section.offset() > index_offset ||
        section.length() > index_offset - section.offset()) {
      return Corrupt(path, absl::StrCat("section ", SectionForMessage(section),
                                        " lies outside the data area"));
    }
    if (section.kind() == Section::ROWS) {
      if (section.row_begin() < 0 || section.row_end() <= section.row_begin() ||
          section.cols() < 1 ||
          section.length() != static_cast<uint64_t>(section.row_end() - section.row_begin()) *
                                  section.cols() * sizeof(float)) {
        return Corrupt(path, absl::StrCat("section ", SectionForMessage(section),
                                          ": length does not match its rows x cols"));
      }
    } else if (section.kind() != Section::BLOB) {
      return Corrupt(path, absl::StrCat("section ", SectionForMessage(section), ": unknown kind ",
                                        section.kind()));
    }
  }
  return std::unique_ptr<ShardFileReader>(
      new ShardFileReader(std::move(path), std::move(fd), size, std::move(index)));
}

absl::Status ShardFileReader::ReadRows(const Section& section, int64_t row_begin, int64_t row_end,
                                       absl::Span<float> out) const {
  if (section.kind() != Section::ROWS || row_begin < section.row_begin() ||
      row_end > section.row_end() || row_end < row_begin) {
    return absl::InvalidArgumentError(absl::StrCat("rows [", row_begin, ", ", row_end,
                                                   ") not in section ", SectionForMessage(section),
                                                   " of ", path_));
  }
  const uint64_t row_bytes = static_cast<uint64_t>(section.cols()) * sizeof(float);
  const uint64_t bytes = static_cast<uint64_t>(row_end - row_begin) * row_bytes;
  if (out.size() * sizeof(float) != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "output holds ", out.size(), " floats, rows x cols is ", bytes / sizeof(float)));
  }
  const uint64_t offset =
      section.offset() + static_cast<uint64_t>(row_begin - section.row_begin()) * row_bytes;
  RETURN_IF_ERROR(PReadAll(fd_.get(), out.data(), bytes, offset, path_));
  if (row_begin == section.row_begin() && row_end == section.row_end() &&
      XXH3_64bits(out.data(), bytes) != section.xxh3_64()) {
    return Corrupt(path_,
                   absl::StrCat("section ", SectionForMessage(section), ": checksum mismatch"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ShardFileReader::ReadBlob(const Section& section) const {
  if (section.kind() != Section::BLOB) {
    return absl::InvalidArgumentError(
        absl::StrCat("section ", SectionForMessage(section), " is not a blob"));
  }
  std::string bytes(section.length(), '\0');
  RETURN_IF_ERROR(PReadAll(fd_.get(), bytes.data(), bytes.size(), section.offset(), path_));
  if (Xxh3(bytes) != section.xxh3_64()) {
    return Corrupt(path_,
                   absl::StrCat("section ", SectionForMessage(section), ": checksum mismatch"));
  }
  return bytes;
}

absl::StatusOr<FileDigest> DigestFile(const std::string& path,
                                      const std::function<void(uint64_t)>& on_bytes) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(path));
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  std::vector<char> block(kReadBlockBytes);
  FileDigest digest;
  absl::Status status;
  while (true) {
    ssize_t n = ::read(fd.get(), block.data(), block.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      status = ErrnoStatus(errno, "read", path);
      break;
    }
    if (n == 0) break;
    XXH3_64bits_update(state, block.data(), static_cast<size_t>(n));
    digest.size += static_cast<uint64_t>(n);
    if (on_bytes) on_bytes(static_cast<uint64_t>(n));
  }
  digest.xxh3_64 = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  RETURN_IF_ERROR(status);
  return digest;
}

}  // namespace checkpoint
}  // namespace paramd
