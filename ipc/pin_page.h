// File: ipc/pin_page.h
//
// The shared-memory pin page of one same-GPU session (proto/ipc.proto,
// docs/ARCHITECTURE.md "Co-located trainers"): one page of a memfd that the
// daemon creates per session and hands to the trainer over the FdSocket, so
// that handing the trainer version v+1 needs no RPC.
//
//   daemon writes: the pinnable versions, one entry per double-buffer slot
//                  of the published buffers (PinKey packed, 0: none);
//   trainer writes: its pins (up to kPagePins packed keys, 0: free).
//
// The protocol is a Dekker handshake over sequentially consistent atomics
// (both processes map the same physical page):
//   trainer pin:  store pins[i] = key; then load the entry of the slot: if
//                 it still equals key, the version is pinned; else clear
//                 pins[i] and ask over RPC (PinIpc answers why).
//   daemon step:  store entry = 0 for the version whose buffers it is about
//                 to rewrite (Withdraw); then load every live session's pins
//                 (PinTable::Retire) and wait while one holds the key.
// At least one side sees the other's store, so either the trainer backs off
// or the step waits; never both miss. A page pin counts only while its
// session is live (the lease, renewed by the session's keep-alive RPCs):
// a killed trainer's page pins lapse with its lease like table pins.
//
// A trainer can only write its own session's page (one memfd per session),
// so it cannot release or forge another trainer's pins.
//
// Threading: every field is a lock-free 64-bit atomic; any thread of
// either process may read or write its side at any time. Nothing blocks.
#ifndef PARAMD_IPC_PIN_PAGE_H_
#define PARAMD_IPC_PIN_PAGE_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace paramd {
namespace ipc {

constexpr int kPagePins = 4;   // PinTableOptions::max_pins_per_session's default
constexpr int kPageSlots = 2;  // the published buffers' double-buffer slots
constexpr uint64_t kPinPageMagic = 0x31656761506e6950ull;  // "PinPage1"

// (model generation, version) in one word: generation's low 16 bits, then
// version + 1 in 48 bits; 0 means "none". Versions are < 2^47.
inline uint64_t PackPin(int64_t generation, int64_t version) {
  if (version < 0) return 0;
  return (static_cast<uint64_t>(generation) & 0xffffu) << 48 |
         (static_cast<uint64_t>(version + 1) & ((uint64_t{1} << 48) - 1));
}
inline int64_t PinVersion(uint64_t packed) {
  return static_cast<int64_t>(packed & ((uint64_t{1} << 48) - 1)) - 1;
}

struct PinPageLayout {
  std::atomic<uint64_t> magic;
  std::atomic<uint64_t> slots[kPageSlots];  // daemon: pinnable version per slot
  std::atomic<uint64_t> pins[kPagePins];    // trainer: its page pins
};
static_assert(sizeof(PinPageLayout) <= 4096, "one page");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared across processes");

// One mapping of a pin page. Move-only; unmaps on destruction.
class PinPage {
 public:
  // A new zeroed page (the daemon), backed by a memfd.
  static absl::StatusOr<std::unique_ptr<PinPage>> Create();
  // Maps the page behind `fd` (the trainer; `fd` is closed). INVALID_ARGUMENT
  // if it is not a pin page.
  static absl::StatusOr<std::unique_ptr<PinPage>> Map(int fd);
  ~PinPage();
  PinPage(const PinPage&) = delete;
  PinPage& operator=(const PinPage&) = delete;

  // A new descriptor for the page (the caller owns it).
  absl::StatusOr<int> Dup() const;

  PinPageLayout& page() { return *page_; }
  const PinPageLayout& page() const { return *page_; }

  // Daemon: slot `slot` now holds `key` (0: none) for pinning.
  void Publish(int slot, uint64_t key) { page_->slots[slot].store(key); }
  // Daemon: no new page pin of `key` succeeds from now on (the entry that
  // holds it is cleared). Call before checking the pins.
  void Withdraw(uint64_t key);
  // Daemon: whether the trainer's pins hold `key`.
  bool Holds(uint64_t key) const;

  // Trainer: pins `key` if slot `slot` offers it: the pin's index, or -1
  // (not offered: ask over RPC; or all kPagePins in use).
  int TryPin(int slot, uint64_t key);
  // Trainer: the slot offering `key`, or -1.
  int SlotOf(uint64_t key) const;
  // Trainer: releases pin `index` (from TryPin).
  void Unpin(int index) { page_->pins[index].store(0); }

 private:
  PinPage(int fd, PinPageLayout* page) : fd_(fd), page_(page) {}
  int fd_ = -1;
  PinPageLayout* page_ = nullptr;
};

}  // namespace ipc
}  // namespace paramd

#endif  // PARAMD_IPC_PIN_PAGE_H_
