#include "transport/local_transport.h"

#include <atomic>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "transport/message_transport.h"

namespace paramd {
namespace {

using transport_internal::Mailbox;
using transport_internal::MessageTransport;

// The mailboxes of the endpoints that met under one name.
class Fabric {
 public:
  explicit Fabric(const std::string& name) : prefix_(absl::StrCat("local:", name, "/")) {}

  const std::string& prefix() const { return prefix_; }

  std::string Add(std::shared_ptr<Mailbox> mailbox) {
    absl::MutexLock lock(&mu_);
    std::string address = absl::StrCat(prefix_, next_id_++);
    mailboxes_[address] = std::move(mailbox);
    return address;
  }

  // Null once the endpoint is gone.
  std::shared_ptr<Mailbox> Find(const std::string& address) {
    absl::MutexLock lock(&mu_);
    auto it = mailboxes_.find(address);
    return it == mailboxes_.end() ? nullptr : it->second;
  }

  void Remove(const std::string& address) {
    absl::MutexLock lock(&mu_);
    mailboxes_.erase(address);
  }

 private:
  const std::string prefix_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Mailbox>> mailboxes_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
};

std::shared_ptr<Fabric> NamedFabric(const std::string& name) {
  static absl::Mutex mu;
  static auto* fabrics = new absl::flat_hash_map<std::string, std::shared_ptr<Fabric>>();
  absl::MutexLock lock(&mu);
  std::shared_ptr<Fabric>& fabric = (*fabrics)[name];
  if (fabric == nullptr) fabric = std::make_shared<Fabric>(name);
  return fabric;
}

std::shared_ptr<Fabric> PrivateFabric() {
  static std::atomic<int64_t> counter{0};
  return std::make_shared<Fabric>(absl::StrCat("private-", counter++));
}

class LocalTransport final : public MessageTransport {
 public:
  LocalTransport(int rank, std::vector<std::string> addresses, std::shared_ptr<Fabric> fabric,
                 std::shared_ptr<Mailbox> mailbox)
      : MessageTransport(rank, static_cast<int>(addresses.size()), std::move(mailbox)),
        addresses_(std::move(addresses)),
        fabric_(std::move(fabric)) {}

  ~LocalTransport() override { Shutdown(); }

  absl::string_view backend() const override { return "local"; }

  absl::Status CanConnect(int peer, absl::Time /*deadline*/) override {
    if (absl::Status s = CheckPeer(peer); !s.ok()) return s;
    std::shared_ptr<Mailbox> box = fabric_->Find(addresses_[peer]);
    if (box == nullptr || box->closed()) {
      return absl::UnavailableError(absl::StrCat("rank ", peer, " has shut down"));
    }
    return absl::OkStatus();
  }

  void Shutdown() override {
    if (stopping_.exchange(true)) return;
    MessageTransport::Shutdown();
    fabric_->Remove(addresses_[rank()]);
    for (int p = 0; p < world_size(); ++p) {
      if (p == rank()) continue;
      if (std::shared_ptr<Mailbox> box = fabric_->Find(addresses_[p])) box->MarkGone(rank());
    }
  }

 protected:
  absl::Status DoSend(int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                      absl::Time /*deadline: never waits*/) override {
    std::shared_ptr<Mailbox> box = fabric_->Find(addresses_[peer]);
    if (box == nullptr) {
      return absl::UnavailableError(absl::StrCat("rank ", peer, " has shut down"));
    }
    return box->Deliver(rank(), tag,
                        std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  }

 private:
  const std::vector<std::string> addresses_;
  const std::shared_ptr<Fabric> fabric_;
  std::atomic<bool> stopping_{false};
};

class LocalEndpoint final : public TransportEndpoint {
 public:
  explicit LocalEndpoint(std::shared_ptr<Fabric> fabric)
      : fabric_(std::move(fabric)),
        mailbox_(std::make_shared<Mailbox>()),
        address_(fabric_->Add(mailbox_)) {}

  ~LocalEndpoint() override {
    if (!connected_) {
      fabric_->Remove(address_);
      mailbox_->Close();
    }
  }

  std::string address() const override { return address_; }

  absl::StatusOr<std::unique_ptr<Transport>> Connect(
      int rank, const std::vector<std::string>& addresses) override {
    if (connected_) return absl::FailedPreconditionError("endpoint already connected");
    if (rank < 0 || rank >= static_cast<int>(addresses.size()) || addresses[rank] != address_) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, " is not this endpoint (", address_, ") in the book"));
    }
    for (const std::string& a : addresses) {
      if (!absl::StartsWith(a, fabric_->prefix())) {
        return absl::InvalidArgumentError(
            absl::StrCat("address '", a, "' is not on fabric ", fabric_->prefix()));
      }
    }
    connected_ = true;
    return std::make_unique<LocalTransport>(rank, addresses, fabric_, mailbox_);
  }

 private:
  const std::shared_ptr<Fabric> fabric_;
  const std::shared_ptr<Mailbox> mailbox_;
  const std::string address_;
  bool connected_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<TransportEndpoint>> OpenLocalEndpoint(
    const TransportOptions& options) {
  return std::make_unique<LocalEndpoint>(
      NamedFabric(options.listen_address.empty() ? "default" : options.listen_address));
}

absl::StatusOr<std::vector<std::unique_ptr<Transport>>> CreateLocalWorld(int world_size) {
  if (world_size < 1) return absl::InvalidArgumentError("world_size must be >= 1");
  const std::shared_ptr<Fabric> fabric = PrivateFabric();
  std::vector<std::unique_ptr<LocalEndpoint>> opened;
  std::vector<std::string> addresses;
  for (int r = 0; r < world_size; ++r) {
    opened.push_back(std::make_unique<LocalEndpoint>(fabric));
    addresses.push_back(opened.back()->address());
  }
  std::vector<std::unique_ptr<Transport>> world;
  for (int r = 0; r < world_size; ++r) {
    absl::StatusOr<std::unique_ptr<Transport>> t = opened[r]->Connect(r, addresses);
    if (!t.ok()) return t.status();
    world.push_back(*std::move(t));
  }
  return world;
}

namespace {
const TransportRegistration kLocalRegistration("local", [](const TransportOptions& options) {
  return OpenLocalEndpoint(options);
});
}  // namespace

}  // namespace paramd
