#include "tests/recovery_test_util.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "safetensors/safetensors.h"

namespace paramd {
namespace testing {

const std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> kTensors = {
    {"a.weight", {256, 64}}, {"b.weight", {2304, 1024}}};

std::string SocketsOnPort(int port) {
  std::ifstream in("/proc/net/tcp");
  std::string line, out;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    char local[64] = {}, remote[64] = {}, state[8] = {};
    if (std::sscanf(line.c_str(), "%*d: %63s %63s %7s", local, remote, state) != 3) continue;
    auto port_of = [](const char* address) {
      const char* colon = std::strchr(address, ':');
      return colon == nullptr ? -1 : static_cast<int>(std::strtol(colon + 1, nullptr, 16));
    };
    if (port_of(local) == port || port_of(remote) == port) {
      absl::StrAppend(&out, "  ", local, " -> ", remote, " state ", state, "\n");
    }
  }
  return out.empty() ? "  (none)\n" : out;
}

void WriteModel(const std::string& path, float offset) {
  std::vector<safetensors::TensorSpec> specs;
  for (const auto& [name, shape] : kTensors) {
    specs.push_back({name, safetensors::Dtype::kF32, {shape.first, shape.second}});
  }
  auto writer = safetensors::SafetensorsWriter::Create(path, specs);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (const auto& spec : specs) {
    std::vector<float> v(spec.shape[0] * spec.shape[1]);
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] = 0.01f * static_cast<float>((i * 37) % 101) - 0.5f + offset;
    }
    ASSERT_TRUE(
        (*writer)
            ->WriteTensor(spec.name, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v.data()),
                                                         v.size() * 4))
            .ok());
  }
  ASSERT_TRUE((*writer)->Finish().ok());
}

std::vector<std::vector<float>> GradientsFor(int64_t version) {
  std::vector<std::vector<float>> out;
  for (size_t t = 0; t < kTensors.size(); ++t) {
    const int64_t n = kTensors[t].second.first * kTensors[t].second.second;
    std::vector<float> g(n);
    uint32_t s = static_cast<uint32_t>(version * 7919 + t * 104729 + 1);
    for (int64_t i = 0; i < n; ++i) {
      s = s * 1664525u + 1013904223u;
      g[i] = (static_cast<float>(s >> 8) / 16777216.0f - 0.5f) * 0.1f;
    }
    out.push_back(std::move(g));
  }
  return out;
}

absl::StatusOr<int64_t> WriteAndLoadModel(client::Client& client, const std::string& path) {
  WriteModel(path);
  if (::testing::Test::HasFatalFailure()) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  absl::StatusOr<int64_t> loaded;
  for (int attempt = 0; attempt < 200; ++attempt) {
    loaded = client.Load(path, "", absl::Seconds(30));
    if (!absl::IsUnavailable(loaded.status())) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return loaded;
}

absl::Status PushGradientsFor(client::Client& client, int64_t version) {
  const std::vector<std::vector<float>> g = GradientsFor(version);
  std::vector<client::Gradient> grads;
  for (size_t t = 0; t < kTensors.size(); ++t) {
    grads.push_back(client::Gradient::Fp32(kTensors[t].first, g[t]));
  }
  return client.PushGradients(version, grads).status();
}

int DaemonProcessOfRank(const rpc::GetStatusResponse& status, const TestCluster& cluster,
                        int rank) {
  for (const rpc::Member& m : status.members()) {
    if (m.role() != rpc::ROLE_DAEMON || m.rank() != rank) continue;
    for (int d = 0; d < cluster.num_daemon_processes(); ++d) {
      if (m.address() == absl::StrCat("127.0.0.1:", cluster.daemon_port(d))) return d;
    }
  }
  return -1;
}

int EnvInt(const char* name, int fallback) {
  const char* value = getenv(name);
  return value != nullptr ? atoi(value) : fallback;
}

}  // namespace testing
}  // namespace paramd
