#include "ipc/pin_page.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace paramd {
namespace ipc {
namespace {

constexpr size_t kPageBytes = 4096;

absl::Status Errno(const char* what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PinPage>> PinPage::Create() {
  const int fd = memfd_create("paramd-ipc-pins", MFD_CLOEXEC);
  if (fd < 0) return Errno("memfd_create");
  if (ftruncate(fd, kPageBytes) != 0) {
    absl::Status s = Errno("ftruncate");
    close(fd);
    return s;
  }
  void* p = mmap(nullptr, kPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    absl::Status s = Errno("mmap");
    close(fd);
    return s;
  }
  auto* page = static_cast<PinPageLayout*>(p);  // zero-filled by ftruncate
  page->magic.store(kPinPageMagic);
  return std::unique_ptr<PinPage>(new PinPage(fd, page));
}

absl::StatusOr<std::unique_ptr<PinPage>> PinPage::Map(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(kPageBytes)) {
    close(fd);
    return absl::InvalidArgumentError("the daemon's pin page is not a page");
  }
  void* p = mmap(nullptr, kPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    absl::Status s = Errno("mmap of the pin page");
    close(fd);
    return s;
  }
  auto* page = static_cast<PinPageLayout*>(p);
  if (page->magic.load() != kPinPageMagic) {
    munmap(p, kPageBytes);
    close(fd);
    return absl::InvalidArgumentError("the daemon's pin page has a wrong magic number");
  }
  return std::unique_ptr<PinPage>(new PinPage(fd, page));
}

PinPage::~PinPage() {
  if (page_ != nullptr) munmap(page_, kPageBytes);
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<int> PinPage::Dup() const {
  const int fd = fcntl(fd_, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return Errno("dup of the pin page");
  return fd;
}

void PinPage::Withdraw(uint64_t key) {
  if (key == 0) return;
  for (std::atomic<uint64_t>& s : page_->slots) {
    uint64_t expected = key;
    s.compare_exchange_strong(expected, 0);  // seq_cst
  }
}

bool PinPage::Holds(uint64_t key) const {
  if (key == 0) return false;
  for (const std::atomic<uint64_t>& p : page_->pins) {
    if (p.load() == key) return true;
  }
  return false;
}

int PinPage::SlotOf(uint64_t key) const {
  if (key == 0) return -1;
  for (int i = 0; i < kPageSlots; ++i) {
    if (page_->slots[i].load() == key) return i;
  }
  return -1;
}

int PinPage::TryPin(int slot, uint64_t key) {
  if (key == 0 || slot < 0 || slot >= kPageSlots) return -1;
  int index = -1;
  for (int i = 0; i < kPagePins && index < 0; ++i) {
    if (page_->pins[i].load(std::memory_order_relaxed) == 0) index = i;
  }
  if (index < 0) return -1;
  page_->pins[index].store(key);  // seq_cst: before the re-check below
  if (page_->slots[slot].load() != key) {
    page_->pins[index].store(0);
    return -1;
  }
  return index;
}

}  // namespace ipc
}  // namespace paramd
