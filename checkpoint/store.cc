#include "checkpoint/store.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "checkpoint/file_util.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace paramd {
namespace checkpoint {
namespace {

constexpr char kManifestMagic[8] = {'H', 'P', 'C', 'K', 'M', 'A', 'N', '1'};
constexpr size_t kManifestHeaderBytes = 24;

std::string Hex(uint64_t v) { return absl::StrFormat("0x%016x", v); }

// "v<digits>" without leading zeros (so that one version has one name).
bool ParseVersionDirName(absl::string_view name, uint64_t* version) {
  if (name.size() < 2 || name[0] != 'v') return false;
  absl::string_view digits = name.substr(1);
  if (digits.size() > 1 && digits[0] == '0') return false;
  for (char c : digits) {
    if (c < '0' || c > '9') return false;
  }
  return absl::SimpleAtoi(digits, version);
}

bool IsTempName(absl::string_view name) {
  return absl::StartsWith(name, ".") && absl::StrContains(name, ".tmp-");
}

// A temporary file whose writer is gone: the pid after ".tmp-" is not this
// process and is not running here (kill(pid, 0) fails with ESRCH).
bool IsStaleTempName(absl::string_view name) {
  if (!IsTempName(name)) return false;
  absl::string_view rest = name.substr(name.rfind(".tmp-") + 5);
  rest = rest.substr(0, rest.find('-'));
  int pid = 0;
  if (!absl::SimpleAtoi(rest, &pid) || pid <= 0) return false;
  if (pid == ::getpid()) return false;
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

// Names KeepLast may delete inside a version directory.
bool IsCheckpointFileName(absl::string_view name) {
  return name == kManifestFileName || IsTempName(name) ||
         (absl::StartsWith(name, "shard-") && absl::EndsWith(name, ".ckpt"));
}

absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ErrnoStatus(errno, "list", dir);
  std::vector<std::string> names;
  while (struct dirent* entry = ::readdir(d)) {
    absl::string_view name = entry->d_name;
    if (name == "." || name == "..") continue;
    names.emplace_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

absl::Status UnlinkIfPresent(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoStatus(errno, "unlink", path);
  return absl::OkStatus();
}

absl::StatusOr<Manifest> ReadManifestFile(const std::string& path) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(path));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "stat", path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (!S_ISREG(st.st_mode) || size < kManifestHeaderBytes) {
    return absl::DataLossError(absl::StrCat("manifest ", path, " is damaged (", size, " bytes)"));
  }
  std::string bytes(size, '\0');
  RETURN_IF_ERROR(PReadAll(fd.get(), bytes.data(), size, 0, path));
  uint64_t length, hash;
  std::memcpy(&length, bytes.data() + 8, 8);
  std::memcpy(&hash, bytes.data() + 16, 8);
  absl::string_view payload = absl::string_view(bytes).substr(kManifestHeaderBytes);
  Manifest manifest;
  if (std::memcmp(bytes.data(), kManifestMagic, sizeof(kManifestMagic)) != 0 ||
      length != payload.size() || Xxh3(payload) != hash ||
      !manifest.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return absl::DataLossError(absl::StrCat("manifest ", path, " is damaged (checksum)"));
  }
  if (manifest.format_version() != kManifestFormatVersion) {
    return absl::DataLossError(absl::StrCat("manifest ", path, " has format version ",
                                            manifest.format_version(), ", this build reads ",
                                            kManifestFormatVersion));
  }
  return manifest;
}

// The refusal of a tensor a checkpoint does not hold (the name may come
// from a request: quoted and bounded).
absl::Status NoSuchTensor(uint64_t version, absl::string_view tensor) {
  return absl::NotFoundError(
      absl::StrCat("checkpoint v", version, " has no tensor ", QuoteForMessage(tensor)));
}

// One shard file per rank 0..world-1, each named ShardFileName(rank,
// world): the only names a reader joins to the version directory (so a
// crafted manifest cannot name "../x" or an absolute path).
absl::Status CheckShardNames(const Manifest& manifest) {
  const int world = manifest.world_size();
  if (world < 1 || manifest.shards_size() != world) {
    return absl::InvalidArgumentError(
        absl::StrCat(manifest.shards_size(), " shard files for ", world, " daemons"));
  }
  std::vector<bool> seen(world, false);
  for (const ShardFileInfo& shard : manifest.shards()) {
    const int rank = shard.daemon_rank();
    if (rank < 0 || rank >= world || seen[rank] || shard.name() != ShardFileName(rank, world)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unexpected shard file ", QuoteForMessage(shard.name()), " for daemon ", rank));
    }
    seen[rank] = true;
  }
  return absl::OkStatus();
}

// Every tensor's master rows [0, rows) covered exactly once by the pieces.
absl::Status CheckCoverage(const Manifest& manifest) {
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> pieces;
  for (const TensorInfo& tensor : manifest.tensors()) {
    if (tensor.name().empty() || tensor.rows() < 1 || tensor.cols() < 1) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", QuoteForMessage(tensor.name()),
                                                     " has shape ", tensor.rows(), " x ",
                                                     tensor.cols()));
    }
    if (!pieces.emplace(tensor.name(), std::vector<std::pair<int64_t, int64_t>>()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", QuoteForMessage(tensor.name()), " listed twice"));
    }
  }
  for (const ShardFileInfo& shard : manifest.shards()) {
    for (const PieceInfo& piece : shard.pieces()) {
      auto it = pieces.find(piece.tensor());
      if (it == pieces.end()) {
        return absl::FailedPreconditionError(
            absl::StrCat("shard file ", QuoteForMessage(shard.name()),
                         " holds rows of unknown tensor ", QuoteForMessage(piece.tensor())));
      }
      it->second.emplace_back(piece.row_begin(), piece.row_end());
    }
  }
  for (const TensorInfo& tensor : manifest.tensors()) {
    auto& ranges = pieces[tensor.name()];
    std::sort(ranges.begin(), ranges.end());
    int64_t next = 0;
    for (const auto& [begin, end] : ranges) {
      if (begin != next || end <= begin) {
        return absl::FailedPreconditionError(
            absl::StrCat("tensor ", QuoteForMessage(tensor.name()),
                         ": master rows are not covered exactly once (",
                         begin < next ? "overlap" : "gap", " at row ", std::min(begin, next), ")"));
      }
      next = end;
    }
    if (next != tensor.rows()) {
      return absl::FailedPreconditionError(absl::StrCat("tensor ", QuoteForMessage(tensor.name()),
                                                        ": master rows end at ", next, " of ",
                                                        tensor.rows()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string VersionDirName(uint64_t version) { return absl::StrCat("v", version); }

absl::StatusOr<CheckpointStore> CheckpointStore::Open(const std::string& root, bool create,
                                                      FileModes modes) {
  if (root.empty()) return absl::InvalidArgumentError("empty checkpoint directory");
  if (create) {
    // The configured root itself is trusted (operator input).
    RETURN_IF_ERROR(MakeDirs(root, modes.dir));
  }
  ASSIGN_OR_RETURN(std::string real, RealPath(root));
  struct stat st;
  if (::stat(real.c_str(), &st) != 0) return ErrnoStatus(errno, "stat", real);
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(real, " is not a directory"));
  }
  return CheckpointStore(std::move(real), modes);
}

absl::StatusOr<CheckpointStore> CheckpointStore::OpenUnder(const std::string& root,
                                                           absl::string_view relative, bool create,
                                                           FileModes modes,
                                                           std::vector<std::string>* created) {
  ASSIGN_OR_RETURN(CheckpointStore base, Open(root, create, modes));
  std::string path;
  if (create) {
    ASSIGN_OR_RETURN(path, MakeDirsUnder(base.root(), relative, modes.dir, created));
  } else {
    ASSIGN_OR_RETURN(path, SafeJoin(base.root(), relative));
  }
  return Open(path, /*create=*/false, modes);
}

std::string CheckpointStore::VersionDir(uint64_t version) const {
  return absl::StrCat(root_, "/", VersionDirName(version));
}

absl::StatusOr<std::vector<uint64_t>> CheckpointStore::VersionDirs() const {
  ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(root_));
  std::vector<uint64_t> versions;
  for (const std::string& name : names) {
    uint64_t version;
    if (!ParseVersionDirName(name, &version)) continue;
    struct stat st;
    const std::string path = absl::StrCat(root_, "/", name);
    // A symlink named like a version is not ours: never read through it.
    if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    versions.push_back(version);
  }
  std::sort(versions.begin(), versions.end());
  return versions;
}

absl::StatusOr<Manifest> CheckpointStore::ReadManifest(uint64_t version) const {
  struct stat st;
  const std::string dir = VersionDir(version);
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(
          absl::StrCat("no complete checkpoint of version ", version, " in ", root_));
    }
    return ErrnoStatus(errno, "stat", dir);
  }
  if (!S_ISDIR(st.st_mode)) {
    // A symlink named like a version is not ours: never read through it.
    return absl::InvalidArgumentError(absl::StrCat(dir, " is not a checkpoint directory"));
  }
  const std::string path = absl::StrCat(VersionDir(version), "/", kManifestFileName);
  absl::StatusOr<Manifest> manifest = ReadManifestFile(path);
  if (absl::IsNotFound(manifest.status())) {
    return absl::NotFoundError(
        absl::StrCat("no complete checkpoint of version ", version, " in ", root_));
  }
  RETURN_IF_ERROR(manifest.status());
  if (manifest->version() != version) {
    return absl::DataLossError(
        absl::StrCat("manifest ", path, " is for version ", manifest->version()));
  }
  if (absl::Status names = CheckShardNames(*manifest); !names.ok()) {
    return absl::DataLossError(absl::StrCat("manifest ", path, ": ", names.message()));
  }
  return manifest;
}

absl::StatusOr<std::vector<CheckpointSummary>> CheckpointStore::List() const {
  ASSIGN_OR_RETURN(std::vector<uint64_t> versions, VersionDirs());
  std::vector<CheckpointSummary> result;
  for (uint64_t version : versions) {
    absl::StatusOr<Manifest> manifest = ReadManifest(version);
    if (!manifest.ok()) continue;  // in progress, abandoned or damaged
    CheckpointSummary summary;
    summary.version = version;
    summary.world_size = manifest->world_size();
    summary.created_unix_micros = manifest->created_unix_micros();
    summary.num_tensors = manifest->tensors_size();
    for (const ShardFileInfo& shard : manifest->shards()) summary.total_bytes += shard.size_bytes();
    summary.path = VersionDir(version);
    result.push_back(std::move(summary));
  }
  return result;
}

absl::StatusOr<uint64_t> CheckpointStore::LatestVersion() const {
  ASSIGN_OR_RETURN(std::vector<CheckpointSummary> all, List());
  if (all.empty()) return absl::NotFoundError(absl::StrCat("no complete checkpoint in ", root_));
  return all.back().version;
}

absl::StatusOr<std::unique_ptr<ShardWriter>> CheckpointStore::NewShardWriter(
    uint64_t version, int daemon_rank, int world_size, std::vector<std::string>* created) const {
  // Refused before anything is created: a refused request changes nothing.
  if (world_size < 1 || daemon_rank < 0 || daemon_rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("daemon rank ", daemon_rank, " of world ", world_size));
  }
  if (ReadManifest(version).ok()) {
    return absl::AlreadyExistsError(
        absl::StrCat("version ", version, " is already checkpointed in ", root_));
  }
  ASSIGN_OR_RETURN(std::string dir,
                   MakeDirsUnder(root_, VersionDirName(version), modes_.dir, created));
  RETURN_IF_ERROR(RemoveStaleTempFiles(version).status());
  return ShardWriter::Create(std::move(dir), ShardFileName(daemon_rank, world_size), version,
                             daemon_rank, world_size, modes_.file);
}

absl::Status CheckpointStore::CommitManifest(Manifest manifest) const {
  const uint64_t version = manifest.version();
  const std::string dir = VersionDir(version);
  const std::string path = absl::StrCat(dir, "/", kManifestFileName);
  if (ReadManifest(version).ok()) {
    return absl::AlreadyExistsError(
        absl::StrCat("version ", version, " is already checkpointed in ", root_));
  }
  if (absl::Status names = CheckShardNames(manifest); !names.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint v", version, ": ", names.message()));
  }
  for (const ShardFileInfo& shard : manifest.shards()) {
    const std::string shard_path = absl::StrCat(dir, "/", shard.name());
    absl::StatusOr<uint64_t> size = RegularFileSize(shard_path);
    if (!size.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint v", version, ": ", size.status().message()));
    }
    if (*size != shard.size_bytes()) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint v", version, ": ", shard_path,
                                                        " has ", *size, " bytes, its daemon wrote ",
                                                        shard.size_bytes()));
    }
  }
  RETURN_IF_ERROR(CheckCoverage(manifest));

  manifest.set_format_version(kManifestFormatVersion);
  if (manifest.created_unix_micros() == 0) {
    manifest.set_created_unix_micros(absl::ToUnixMicros(absl::Now()));
  }
  std::string payload;
  if (!manifest.SerializeToString(&payload)) {
    return absl::InternalError("cannot serialize the manifest");
  }
  std::string bytes(kManifestMagic, sizeof(kManifestMagic));
  const uint64_t length = payload.size();
  const uint64_t hash = Xxh3(payload);
  bytes.append(reinterpret_cast<const char*>(&length), 8);
  bytes.append(reinterpret_cast<const char*>(&hash), 8);
  bytes.append(payload);

  // A fresh name (the pid lets RemoveStaleTempFiles tell a killed writer's).
  ASSIGN_OR_RETURN(
      UniqueFile created,
      CreateUniqueFile(dir, absl::StrCat(".", kManifestFileName, ".tmp-", ::getpid(), "-"),
                       modes_.file));
  const std::string temp = created.path;
  {
    UniqueFd fd(created.fd);
    absl::Status status = WriteAll(fd.get(), bytes.data(), bytes.size(), temp);
    if (status.ok()) status = FsyncFd(fd.get(), temp);
    if (status.ok()) status = fd.Close(temp);
    if (!status.ok()) {
      ::unlink(temp.c_str());
      return status;
    }
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    absl::Status status = ErrnoStatus(errno, absl::StrCat("rename ", temp, " to"), path);
    ::unlink(temp.c_str());
    return status;
  }
  return FsyncDir(dir);
}

absl::Status CheckpointStore::Verify(uint64_t version, const ProgressFn& progress) const {
  ASSIGN_OR_RETURN(Manifest manifest, ReadManifest(version));
  uint64_t total = 0;
  for (const ShardFileInfo& shard : manifest.shards()) total += shard.size_bytes();
  uint64_t done = 0;
  const std::string dir = VersionDir(version);
  for (const ShardFileInfo& shard : manifest.shards()) {
    const std::string path = absl::StrCat(dir, "/", shard.name());
    absl::StatusOr<FileDigest> digest = DigestFile(path, [&](uint64_t n) {
      done += n;
      if (progress) progress(done, total);
    });
    if (!digest.ok()) {
      return absl::DataLossError(absl::StrCat("checkpoint v", version, ": shard file ", path,
                                              " cannot be read: ", digest.status().message()));
    }
    if (digest->size != shard.size_bytes()) {
      return absl::DataLossError(absl::StrCat("checkpoint v", version, ": shard file ", path,
                                              " has ", digest->size, " bytes, expected ",
                                              shard.size_bytes(), " (truncated?)"));
    }
    if (digest->xxh3_64 != shard.xxh3_64()) {
      return absl::DataLossError(absl::StrCat("checkpoint v", version, ": shard file ", path,
                                              " is damaged: XXH3-64 ", Hex(digest->xxh3_64),
                                              ", expected ", Hex(shard.xxh3_64())));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckpointStore::RemoveVersion(uint64_t version) const {
  const std::string dir = VersionDir(version);
  // The MANIFEST goes first and durably: from then on the checkpoint is not
  // listed, whatever happens to the rest.
  RETURN_IF_ERROR(UnlinkIfPresent(absl::StrCat(dir, "/", kManifestFileName)));
  RETURN_IF_ERROR(FsyncDir(dir));
  ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(dir));
  bool foreign = false;
  for (const std::string& name : names) {
    if (!IsCheckpointFileName(name)) {
      foreign = true;  // not ours: leave it, and the directory, alone
      continue;
    }
    RETURN_IF_ERROR(UnlinkIfPresent(absl::StrCat(dir, "/", name)));
  }
  if (!foreign && ::rmdir(dir.c_str()) != 0 && errno != ENOENT) {
    return ErrnoStatus(errno, "rmdir", dir);
  }
  return FsyncDir(root_);
}

absl::StatusOr<std::vector<uint64_t>> CheckpointStore::KeepLast(
    int keep, const std::set<uint64_t>& in_progress) const {
  if (keep < 1) {
    return absl::InvalidArgumentError(absl::StrCat("keep ", keep, " checkpoints: must be >= 1"));
  }
  ASSIGN_OR_RETURN(std::vector<uint64_t> versions, VersionDirs());
  std::vector<uint64_t> complete;
  for (uint64_t version : versions) {
    if (ReadManifest(version).ok()) complete.push_back(version);
  }
  std::vector<uint64_t> removed;
  if (complete.empty()) return removed;  // whatever is there may be in progress
  const uint64_t newest = complete.back();
  const size_t first_kept =
      complete.size() > static_cast<size_t>(keep) ? complete.size() - static_cast<size_t>(keep) : 0;
  const std::set<uint64_t> kept(complete.begin() + first_kept, complete.end());
  for (uint64_t version : versions) {
    if (version >= newest || in_progress.count(version) > 0) continue;
    if (kept.count(version) > 0) continue;
    RETURN_IF_ERROR(RemoveVersion(version));
    removed.push_back(version);
  }
  // Temporary files in kept checkpoints come from killed earlier attempts of
  // the same version; nothing writes into a complete checkpoint.
  for (uint64_t version : kept) {
    const std::string dir = VersionDir(version);
    ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(dir));
    for (const std::string& name : names) {
      if (IsTempName(name)) RETURN_IF_ERROR(UnlinkIfPresent(absl::StrCat(dir, "/", name)));
    }
  }
  return removed;
}

absl::StatusOr<int> CheckpointStore::RemoveStaleTempFiles(uint64_t version) const {
  const std::string dir = VersionDir(version);
  absl::StatusOr<std::vector<std::string>> names = ListDir(dir);
  if (absl::IsNotFound(names.status())) return 0;
  RETURN_IF_ERROR(names.status());
  int removed = 0;
  for (const std::string& name : *names) {
    if (!IsStaleTempName(name)) continue;
    RETURN_IF_ERROR(UnlinkIfPresent(absl::StrCat(dir, "/", name)));
    ++removed;
  }
  if (removed > 0) RETURN_IF_ERROR(FsyncDir(dir));
  return removed;
}

absl::StatusOr<int> CheckpointStore::RemoveStaleTempFilesEverywhere() const {
  ASSIGN_OR_RETURN(std::vector<uint64_t> versions, VersionDirs());
  int removed = 0;
  for (uint64_t version : versions) {
    ASSIGN_OR_RETURN(int n, RemoveStaleTempFiles(version));
    removed += n;
  }
  return removed;
}

// ---------------------------------------------------------------------------
// CheckpointReader

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(
    const CheckpointStore& store, uint64_t version) {
  std::unique_ptr<CheckpointReader> reader(new CheckpointReader());
  ASSIGN_OR_RETURN(reader->manifest_, store.ReadManifest(version));
  const std::string dir = store.VersionDir(version);
  for (const ShardFileInfo& shard : reader->manifest_.shards()) {
    const std::string path = absl::StrCat(dir, "/", shard.name());
    absl::StatusOr<std::unique_ptr<ShardFileReader>> file = ShardFileReader::Open(path);
    if (!file.ok()) {
      return absl::DataLossError(
          absl::StrCat("checkpoint v", version, ": ", file.status().message()));
    }
    const ShardIndex& index = (*file)->index();
    if ((*file)->size_bytes() != shard.size_bytes() || index.version() != version ||
        index.daemon_rank() != shard.daemon_rank()) {
      return absl::DataLossError(absl::StrCat("checkpoint v", version, ": shard file ", path,
                                              " does not match the manifest"));
    }
    reader->files_.push_back(*std::move(file));
  }
  RETURN_IF_ERROR(reader->BuildIndex());
  return reader;
}

absl::Status CheckpointReader::BuildIndex() {
  for (const auto& file : files_) {
    for (const Section& section : file->index().sections()) {
      auto key = std::make_pair(section.tensor(), section.name());
      if (section.kind() == Section::ROWS) {
        const TensorInfo* tensor = FindTensor(section.tensor());
        if (tensor == nullptr || section.cols() != tensor->cols() ||
            section.row_end() > tensor->rows()) {
          return absl::DataLossError(absl::StrCat("shard file ", file->path(), ": section ",
                                                  SectionForMessage(section),
                                                  " does not fit the manifest's tensors"));
        }
        rows_[key].push_back({file.get(), &section});
      } else {
        blobs_[key].push_back({file.get(), &section});
      }
    }
  }
  for (auto& [key, locations] : rows_) {
    std::sort(locations.begin(), locations.end(), [](const Location& a, const Location& b) {
      return a.section->row_begin() < b.section->row_begin();
    });
    for (size_t i = 1; i < locations.size(); ++i) {
      if (locations[i].section->row_begin() < locations[i - 1].section->row_end()) {
        return absl::DataLossError(absl::StrCat("tensor ", QuoteForMessage(key.first), " section ",
                                                QuoteForMessage(key.second), ": rows saved twice (",
                                                locations[i - 1].file->path(), ", ",
                                                locations[i].file->path(), ")"));
      }
    }
  }
  return absl::OkStatus();
}

const TensorInfo* CheckpointReader::FindTensor(absl::string_view name) const {
  for (const TensorInfo& tensor : manifest_.tensors()) {
    if (tensor.name() == name) return &tensor;
  }
  return nullptr;
}

absl::Status CheckpointReader::ReadRows(absl::string_view tensor, absl::string_view name,
                                        int64_t row_begin, int64_t row_end,
                                        absl::Span<float> out) const {
  const TensorInfo* info = FindTensor(tensor);
  if (info == nullptr) return NoSuchTensor(manifest_.version(), tensor);
  if (row_begin < 0 || row_end > info->rows() || row_end < row_begin) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", QuoteForMessage(tensor), " has ",
                                                   info->rows(), " rows; asked for [", row_begin,
                                                   ", ", row_end, ")"));
  }
  const int64_t cols = info->cols();
  if (static_cast<int64_t>(out.size()) != (row_end - row_begin) * cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("output holds ", out.size(), " floats, need ", (row_end - row_begin) * cols));
  }
  auto it = rows_.find(std::make_pair(std::string(tensor), std::string(name)));
  int64_t next = row_begin;
  if (it != rows_.end()) {
    for (const Location& location : it->second) {
      if (next >= row_end) break;
      const Section& section = *location.section;
      if (section.row_end() <= next) continue;
      if (section.row_begin() > next) break;  // a gap
      const int64_t end = std::min(row_end, section.row_end());
      RETURN_IF_ERROR(location.file->ReadRows(
          section, next, end, out.subspan((next - row_begin) * cols, (end - next) * cols)));
      next = end;
    }
  }
  if (next < row_end) {
    return absl::NotFoundError(absl::StrCat("checkpoint v", manifest_.version(), ": rows ", next,
                                            ".. of ", QuoteForMessage(tensor), "/",
                                            QuoteForMessage(name), " are in no shard file"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> CheckpointReader::ReadRows(absl::string_view tensor,
                                                              absl::string_view name,
                                                              int64_t row_begin,
                                                              int64_t row_end) const {
  const TensorInfo* info = FindTensor(tensor);
  if (info == nullptr) return NoSuchTensor(manifest_.version(), tensor);
  std::vector<float> out(static_cast<size_t>(std::max<int64_t>(0, row_end - row_begin)) *
                         info->cols());
  RETURN_IF_ERROR(ReadRows(tensor, name, row_begin, row_end, absl::MakeSpan(out)));
  return out;
}

std::vector<std::string> CheckpointReader::RowSectionNames(absl::string_view tensor) const {
  std::vector<std::string> names;
  for (const auto& [key, locations] : rows_) {
    if (key.first != tensor) continue;
    if (key.second == kMasterSection) {
      names.insert(names.begin(), key.second);
    } else {
      names.push_back(key.second);
    }
  }
  return names;
}

absl::StatusOr<std::string> CheckpointReader::ReadBlob(absl::string_view tensor,
                                                       absl::string_view name) const {
  auto it = blobs_.find(std::make_pair(std::string(tensor), std::string(name)));
  if (it == blobs_.end()) {
    return absl::NotFoundError(absl::StrCat("checkpoint v", manifest_.version(), " has no ",
                                            QuoteForMessage(name), " for tensor ",
                                            QuoteForMessage(tensor)));
  }
  std::string first;
  for (size_t i = 0; i < it->second.size(); ++i) {
    ASSIGN_OR_RETURN(std::string bytes, it->second[i].file->ReadBlob(*it->second[i].section));
    if (i == 0) {
      first = std::move(bytes);
    } else if (bytes != first) {
      return absl::DataLossError(absl::StrCat(
          "tensor ", QuoteForMessage(tensor), " ", QuoteForMessage(name), ": copies in ",
          it->second[0].file->path(), " and ", it->second[i].file->path(), " differ"));
    }
  }
  return first;
}

absl::StatusOr<TensorState> CheckpointReader::ReadTensorState(absl::string_view tensor) const {
  ASSIGN_OR_RETURN(std::string bytes, ReadBlob(tensor, kTensorStateSection));
  TensorState state;
  if (!state.ParseFromString(bytes)) {
    return absl::DataLossError(
        absl::StrCat("tensor ", QuoteForMessage(tensor), ": state does not parse"));
  }
  return state;
}

}  // namespace checkpoint
}  // namespace paramd
