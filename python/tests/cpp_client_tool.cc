// The C++ client's side of the Python package's tests and benchmark: what
// client::Client fetches and pushes, for the Python tests to compare with.
//
//   cpp_client_tool fetch ADDR VERSION OUTDIR
//       every published (tensor, direction) of VERSION -> OUTDIR/<i>.data,
//       OUTDIR/<i>.scales, OUTDIR/<i>.deq (ref::Dequantize, float32 [M][K])
//       and OUTDIR/index.json (tensor, direction, format,
//       scale_inv, amax, file stem).
//   cpp_client_tool push ADDR VERSION GRADS.safetensors
//       pushes every tensor of the file (F32 or BF16) as one trainer's
//       gradients of VERSION.
//   cpp_client_tool bench ADDR DIRECTION REPEATS
//       times REPEATS fetches of every tensor's DIRECTION (row|col) copy of
//       the latest version into preallocated buffers (after one untimed
//       fetch); prints JSON (with this process's page faults per fetch).
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/status_macros.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "nlohmann/json.hpp"
#include "safetensors/safetensors.h"

namespace paramd {
namespace {

absl::StatusOr<std::unique_ptr<client::Client>> Connect(const std::string& address, bool trainer) {
  client::ClientOptions o;
  o.coordinator_address = address;
  o.role = trainer ? client::ClientOptions::Role::kTrainer : client::ClientOptions::Role::kObserver;
  o.name = "cpp_client_tool";
  return client::Client::Connect(o);
}

absl::Status WriteFile(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::Status Fetch(const std::string& address, int64_t version, const std::string& dir) {
  ASSIGN_OR_RETURN(auto c, Connect(address, false));
  ASSIGN_OR_RETURN(client::FetchResult r,
                   c->Fetch(version, client::AllTargets(c->manifest(), {Direction::kRowwise,
                                                                        Direction::kColumnwise})));
  nlohmann::json index = nlohmann::json::array();
  for (size_t i = 0; i < r.tensors.size(); ++i) {
    const client::FetchedTensor& t = r.tensors[i];
    const std::string stem = absl::StrCat(i);
    RETURN_IF_ERROR(WriteFile(dir + "/" + stem + ".data", t.value.data));
    RETURN_IF_ERROR(WriteFile(dir + "/" + stem + ".scales", t.value.scales));
    ASSIGN_OR_RETURN(std::vector<float> deq, ref::Dequantize(t.value, t.spec));
    const auto* p = reinterpret_cast<const uint8_t*>(deq.data());
    RETURN_IF_ERROR(
        WriteFile(dir + "/" + stem + ".deq", std::vector<uint8_t>(p, p + deq.size() * 4)));
    index.push_back({{"tensor", t.tensor},
                     {"direction", std::string(DirectionName(t.value.direction))},
                     {"format", std::string(FormatName(t.value.format))},
                     {"scale_inv", t.value.scale_inv},
                     {"amax", t.value.amax},
                     {"stem", stem}});
  }
  std::ofstream out(dir + "/index.json");
  out << nlohmann::json{{"version", r.version}, {"tensors", index}}.dump(1);
  return out ? absl::OkStatus() : absl::InternalError("cannot write index.json");
}

absl::Status Push(const std::string& address, int64_t version, const std::string& path) {
  ASSIGN_OR_RETURN(safetensors::SafetensorsFile file, safetensors::SafetensorsFile::Open(path));
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<client::Gradient> grads;
  for (const safetensors::TensorInfo& t : file.tensors()) {
    ASSIGN_OR_RETURN(std::vector<uint8_t> b, file.ReadTensor(t.name));
    bytes.push_back(std::move(b));
    client::Gradient g;
    g.tensor = t.name;
    if (t.dtype == safetensors::Dtype::kF32) {
      g.dtype = client::Gradient::DType::kFp32;
    } else if (t.dtype == safetensors::Dtype::kBF16) {
      g.dtype = client::Gradient::DType::kBf16;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(t.name, ": F32 or BF16 only"));
    }
    grads.push_back(g);
  }
  for (size_t i = 0; i < grads.size(); ++i) grads[i].bytes = absl::MakeConstSpan(bytes[i]);
  ASSIGN_OR_RETURN(auto c, Connect(address, true));
  ASSIGN_OR_RETURN(client::PushResult r, c->PushGradients(version, grads));
  std::cout << nlohmann::json{{"version", r.version}, {"bytes_sent", r.bytes_sent}}.dump() << "\n";
  return absl::OkStatus();
}

// This process's minor page faults so far (the timed fetches' faults are
// the difference).
long MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

absl::Status Bench(const std::string& address, const std::string& direction, int repeats) {
  ASSIGN_OR_RETURN(auto c, Connect(address, false));
  const Direction d = direction == "col" ? Direction::kColumnwise : Direction::kRowwise;
  std::vector<client::FetchTarget> targets = client::AllTargets(c->manifest(), {d});
  std::vector<std::vector<uint8_t>> buffers;
  for (client::FetchTarget& t : targets) {
    ASSIGN_OR_RETURN(Layout l, c->LayoutOf(t.tensor, t.direction));
    buffers.emplace_back(l.data_bytes());
    t.data = absl::MakeSpan(buffers.back());
    buffers.emplace_back(l.scale_bytes());
    t.scales = absl::MakeSpan(buffers.back());
  }
  // One untimed fetch first: channels connected, buffers touched.
  RETURN_IF_ERROR(c->Fetch(client::Client::kLatest, targets).status());
  nlohmann::json seconds = nlohmann::json::array();
  int64_t bytes = 0;
  const long faults_before = MinorFaults();
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(client::FetchResult r, c->Fetch(client::Client::kLatest, targets));
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    bytes = r.stats.received.total();
  }
  const double faults = static_cast<double>(MinorFaults() - faults_before) / std::max(repeats, 1);
  std::cout << nlohmann::json{{"tensors", targets.size()},
                              {"bytes", bytes},
                              {"seconds", seconds},
                              {"page_faults_per_fetch", faults}}
                   .dump()
            << "\n";
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  absl::Status s;
  if (cmd == "fetch" && argc == 5) {
    s = Fetch(argv[2], std::atoll(argv[3]), argv[4]);
  } else if (cmd == "push" && argc == 5) {
    s = Push(argv[2], std::atoll(argv[3]), argv[4]);
  } else if (cmd == "bench" && argc == 5) {
    s = Bench(argv[2], argv[3], std::atoi(argv[4]));
  } else {
    std::cerr << "usage: cpp_client_tool fetch ADDR VERSION OUTDIR | push ADDR VERSION "
                 "GRADS.safetensors | bench ADDR row|col REPEATS\n";
    return 2;
  }
  if (!s.ok()) {
    std::cerr << "cpp_client_tool " << cmd << ": " << s << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace paramd

int main(int argc, char** argv) { return paramd::Main(argc, argv); }
