#include "transport/transport.h"

#include <unistd.h>

#include <cmath>
#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"

namespace paramd {
namespace {

struct Backend {
  TransportOpener open;
  TransportProbe probe;
};

class Registry {
 public:
  static Registry& Get() {
    static Registry* registry = new Registry();  // never destroyed
    return *registry;
  }

  void Add(absl::string_view name, Backend backend) {
    absl::MutexLock lock(&mu_);
    backends_.emplace(std::string(name), std::move(backend));
  }

  absl::StatusOr<Backend> Find(absl::string_view name) {
    absl::MutexLock lock(&mu_);
    auto it = backends_.find(std::string(name));
    if (it == backends_.end()) {
      std::vector<std::string> names;
      for (const auto& [n, b] : backends_) names.push_back(n);
      return absl::NotFoundError(absl::StrCat(
          "no transport backend '", name,
          "' is linked in; available: ", names.empty() ? "none" : absl::StrJoin(names, ", ")));
    }
    return it->second;
  }

  std::vector<std::string> Names() {
    absl::MutexLock lock(&mu_);
    std::vector<std::string> names;
    for (const auto& [n, b] : backends_) names.push_back(n);
    return names;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, Backend> backends_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

TransportRegistration::TransportRegistration(absl::string_view name, TransportOpener open,
                                             TransportProbe probe) {
  Registry::Get().Add(name, Backend{std::move(open), std::move(probe)});
}

absl::StatusOr<std::unique_ptr<TransportEndpoint>> OpenTransportEndpoint(
    absl::string_view name, const TransportOptions& options) {
  absl::StatusOr<Backend> backend = Registry::Get().Find(name);
  if (!backend.ok()) return backend.status();
  return backend->open(options);
}

absl::Status ProbeTransport(absl::string_view name) {
  absl::StatusOr<Backend> backend = Registry::Get().Find(name);
  if (!backend.ok()) return backend.status();
  return backend->probe ? backend->probe() : absl::OkStatus();
}

std::vector<std::string> RegisteredTransports() { return Registry::Get().Names(); }

absl::StatusOr<std::vector<std::unique_ptr<Transport>>> ConnectInProcessWorld(
    absl::string_view name, int world_size, const TransportOptions& options) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world_size ", world_size));
  }
  std::vector<std::unique_ptr<TransportEndpoint>> endpoints;
  std::vector<std::string> addresses;
  addresses.reserve(world_size);
  endpoints.reserve(world_size);
  for (int r = 0; r < world_size; ++r) {
    absl::StatusOr<std::unique_ptr<TransportEndpoint>> e = OpenTransportEndpoint(name, options);
    if (!e.ok()) return e.status();
    addresses.push_back((*e)->address());
    endpoints.push_back(*std::move(e));
  }
  std::vector<absl::StatusOr<std::unique_ptr<Transport>>> results;
  results.reserve(world_size);
  for (int r = 0; r < world_size; ++r) results.emplace_back(absl::UnknownError("not connected"));
  std::vector<std::thread> threads;
  threads.reserve(world_size);
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] { results[r] = endpoints[r]->Connect(r, addresses); });
  }
  for (std::thread& t : threads) t.join();
  std::vector<std::unique_ptr<Transport>> world;
  for (auto& result : results) {
    if (!result.ok()) return result.status();
    world.push_back(*std::move(result));
  }
  return world;
}

std::string AdvertisedAddress(absl::string_view listen_host, int port,
                              absl::string_view advertise_host) {
  std::string host(listen_host);
  if (host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]") {
    if (!advertise_host.empty()) {
      host = std::string(advertise_host);
    } else {
      char name[256] = {};
      host = gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0' ? name : "localhost";
    }
  }
  if (host.find(':') != std::string::npos && host.front() != '[') {
    host = absl::StrCat("[", host, "]");
  }
  return absl::StrCat(host, ":", port);
}

float MaxIgnoringNan(float a, float b) {
  if (std::isnan(a)) return b;
  if (std::isnan(b)) return a;
  if (a == b) return std::signbit(a) ? b : a;  // +0 over -0, whatever the order
  return a > b ? a : b;
}

}  // namespace paramd
