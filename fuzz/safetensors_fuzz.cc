// libFuzzer target: SafetensorsFile::Open on arbitrary bytes (the header
// reader of hpctl inspect/load and the coordinator's Load). Any input must
// yield a Status, never a crash, hang or sanitizer report; an accepted file
// must be readable tensor by tensor. Built and run by tools/fuzz.sh.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "safetensors/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // An anonymous in-memory file: Open() takes a path.
  const int fd = memfd_create("safetensors_fuzz", 0);
  if (fd < 0) return 0;
  size_t written = 0;
  while (written < size) {
    const ssize_t n = write(fd, data + written, size - written);
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  absl::StatusOr<paramd::safetensors::SafetensorsFile> file =
      paramd::safetensors::SafetensorsFile::Open(path);
  if (file.ok()) {
    for (const paramd::safetensors::TensorInfo& t : file->tensors()) {
      if (t.num_bytes() > (size_t{1} << 20)) continue;
      (void)file->ReadTensor(t.name);
    }
  }
  close(fd);
  return 0;
}
