// Multi-process: a stranger hammers every RPC of every service of a
// coordinator and two daemons started with --auth_token_file, for a few
// seconds, with random, garbage and oversized requests: without a token,
// with an unknown token, and with a trainer's token on every method a
// trainer may not call. Every such call is refused (UNAUTHENTICATED /
// PERMISSION_DENIED; raw garbage at worst fails to parse); afterwards no
// process has exited, the cluster still holds version 0 of its model and a
// real trainer's push steps it to version 1.
//
// The seed is printed; PARAMD_HOSTILE_SEED=N reruns one sequence and
// PARAMD_HOSTILE_SECONDS=S runs longer.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "auth/security.h"
#include "client/client.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "gtest/gtest.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "proto/ipc.grpc.pb.h"
#include "proto/paramd.grpc.pb.h"
#include "tests/auth_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

namespace pb = google::protobuf;

constexpr int64_t kRows = 64;
constexpr int64_t kCols = 32;

// A string of a size chosen among the edge cases (empty, one byte, around
// the 1 KiB name limit, 256 KiB), of random bytes (NUL and control
// characters included) or of one repeated byte.
// `text`: 7-bit bytes only (a proto3 string must be UTF-8, else the
// request does not parse at all).
std::string RandomBytes(std::mt19937_64& rng, bool text = false) {
  static constexpr size_t kSizes[] = {0, 1, 7, 64, 1023, 1024, 1025, 4096, 256 << 10};
  const size_t n = kSizes[rng() % (sizeof(kSizes) / sizeof(kSizes[0]))];
  const char mask = text ? 0x7f : static_cast<char>(0xff);
  std::string s(n, static_cast<char>(rng() & mask));
  if (rng() % 2 == 0) {
    for (char& c : s) c = static_cast<char>(rng() & mask);
  }
  return s;
}

template <class T>
T RandomInt(std::mt19937_64& rng) {
  switch (rng() % 6) {
    case 0:
      return 0;
    case 1:
      return static_cast<T>(-1);
    case 2:
      return std::numeric_limits<T>::max();
    case 3:
      return std::numeric_limits<T>::min();
    case 4:
      return static_cast<T>(rng() % 16);
    default:
      return static_cast<T>(rng());
  }
}

double RandomReal(std::mt19937_64& rng) {
  static const double kValues[] = {0.0,
                                   -1.0,
                                   1e300,
                                   -1e-300,
                                   std::numeric_limits<double>::quiet_NaN(),
                                   std::numeric_limits<double>::infinity()};
  return rng() % 2 ? kValues[rng() % 6] : static_cast<double>(static_cast<int64_t>(rng()));
}

// Sets a random subset of `m`'s fields (every type, repeated fields with up
// to 3 entries, nested messages to depth 3) to random values.
void Fill(pb::Message* m, std::mt19937_64& rng, int depth = 0) {
  const pb::Descriptor* d = m->GetDescriptor();
  const pb::Reflection* r = m->GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (rng() % 3 == 0) continue;
    const int n = f->is_repeated() ? static_cast<int>(rng() % 4) : 1;
    for (int k = 0; k < n; ++k) {
      const bool add = f->is_repeated();
      switch (f->cpp_type()) {
        case pb::FieldDescriptor::CPPTYPE_INT32:
          add ? r->AddInt32(m, f, RandomInt<int32_t>(rng))
              : r->SetInt32(m, f, RandomInt<int32_t>(rng));
          break;
        case pb::FieldDescriptor::CPPTYPE_INT64:
          add ? r->AddInt64(m, f, RandomInt<int64_t>(rng))
              : r->SetInt64(m, f, RandomInt<int64_t>(rng));
          break;
        case pb::FieldDescriptor::CPPTYPE_UINT32:
          add ? r->AddUInt32(m, f, RandomInt<uint32_t>(rng))
              : r->SetUInt32(m, f, RandomInt<uint32_t>(rng));
          break;
        case pb::FieldDescriptor::CPPTYPE_UINT64:
          add ? r->AddUInt64(m, f, RandomInt<uint64_t>(rng))
              : r->SetUInt64(m, f, RandomInt<uint64_t>(rng));
          break;
        case pb::FieldDescriptor::CPPTYPE_DOUBLE:
          add ? r->AddDouble(m, f, RandomReal(rng)) : r->SetDouble(m, f, RandomReal(rng));
          break;
        case pb::FieldDescriptor::CPPTYPE_FLOAT:
          add ? r->AddFloat(m, f, static_cast<float>(RandomReal(rng)))
              : r->SetFloat(m, f, static_cast<float>(RandomReal(rng)));
          break;
        case pb::FieldDescriptor::CPPTYPE_BOOL:
          add ? r->AddBool(m, f, rng() % 2) : r->SetBool(m, f, rng() % 2);
          break;
        case pb::FieldDescriptor::CPPTYPE_ENUM:  // proto3: unknown values too
          add ? r->AddEnumValue(m, f, RandomInt<int32_t>(rng) % 64)
              : r->SetEnumValue(m, f, RandomInt<int32_t>(rng) % 64);
          break;
        case pb::FieldDescriptor::CPPTYPE_STRING: {
          std::string v = RandomBytes(rng, f->type() == pb::FieldDescriptor::TYPE_STRING);
          add ? r->AddString(m, f, std::move(v)) : r->SetString(m, f, std::move(v));
          break;
        }
        case pb::FieldDescriptor::CPPTYPE_MESSAGE:
          if (depth < 3) Fill(add ? r->AddMessage(m, f) : r->MutableMessage(m, f), rng, depth + 1);
          break;
      }
    }
  }
}

// The messages of one hostile call of `method`: random requests (one, or
// up to 4 for a client stream), or random bytes that are no protobuf.
// Sets *garbage for the latter.
std::vector<std::string> HostileMessages(const pb::MethodDescriptor& method, std::mt19937_64& rng,
                                         bool* garbage) {
  std::vector<std::string> out;
  const int n = method.client_streaming() ? 1 + static_cast<int>(rng() % 4) : 1;
  *garbage = rng() % 5 == 0;
  for (int i = 0; i < n; ++i) {
    if (*garbage) {
      out.push_back(RandomBytes(rng));
      continue;
    }
    std::unique_ptr<pb::Message> m(
        pb::MessageFactory::generated_factory()->GetPrototype(method.input_type())->New());
    Fill(m.get(), rng);
    out.push_back(m->SerializeAsString());
  }
  return out;
}

// "/paramd.rpc.Daemon/Fetch" -> its descriptor.
const pb::MethodDescriptor* Method(absl::string_view name) {
  std::string full(name.substr(1));
  full[full.find('/')] = '.';
  return pb::DescriptorPool::generated_pool()->FindMethodByName(full);
}

bool OnDaemon(absl::string_view method) {
  return absl::StartsWith(method, "/paramd.rpc.Daemon/") ||
         absl::StartsWith(method, "/paramd.rpc.DaemonIpc/") ||
         absl::StartsWith(method, "/paramd.checkpoint.CheckpointDaemon/");
}

uint64_t SeedFromEnv() {
  const char* s = std::getenv("PARAMD_HOSTILE_SEED");
  return s != nullptr ? std::strtoull(s, nullptr, 10) : std::random_device()();
}

TEST(HostileClientTest, StrangersChangeNothingAndTheClusterKeepsServing) {
  auto dir = demo::TempDir::Create("hostile");
  ASSERT_TRUE(dir.ok());
  absl::StatusOr<std::string> tokens = WriteTokenFile(dir->path());
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  TestClusterOptions options;
  options.daemons = 2;
  options.expected_pushers = 1;
  options.coordinator_flags = {"--auth_token_file=" + *tokens};
  options.daemon_flags = {"--auth_token_file=" + *tokens};
  absl::StatusOr<std::unique_ptr<TestCluster>> started = TestCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  TestCluster& cluster = **started;

  const std::string model = dir->path() + "/model.safetensors";
  const std::vector<float> w0 = RandomValues(kRows * kCols, 3);
  ASSERT_TRUE(WriteModel(model, {{"w", {kRows, kCols}, w0}}).ok());
  client::ClientOptions op;
  op.coordinator_address = cluster.coordinator_address();
  op.role = client::ClientOptions::Role::kObserver;
  op.token = kOperatorToken;
  op.name = "hostile_test_operator";
  absl::StatusOr<std::unique_ptr<client::Client>> operator_client;
  absl::StatusOr<int64_t> loaded = absl::UnavailableError("not tried");
  for (int attempt = 0; attempt < 100 && !loaded.ok(); ++attempt) {
    operator_client = client::Client::Connect(op);
    ASSERT_TRUE(operator_client.ok()) << operator_client.status();
    loaded = (*operator_client)->Load(model, kFp32PassthroughRecipe, absl::Seconds(20));
    if (!loaded.ok() && loaded.status().code() != absl::StatusCode::kUnavailable) break;
    if (!loaded.ok()) absl::SleepFor(absl::Milliseconds(100));  // daemons still joining
  }
  ASSERT_TRUE(loaded.ok()) << loaded.status() << cluster.Logs();
  const std::vector<std::string> daemons = (*operator_client)->manifest().daemon_addresses;
  ASSERT_EQ(daemons.size(), 2u);

  // The attack: every method of the table, from two threads.
  struct Target {
    std::string method;
    const pb::MethodDescriptor* descriptor;
    bool trainer_allowed;
  };
  std::vector<Target> targets;
  for (const auth::MethodPolicy& policy : auth::AllPolicies()) {
    const std::string method(policy.method);
    if (absl::StrContains(method, "#")) continue;  // sub-policies of Join
    // The daemons' host data plane listens on its own port (covered by
    // //transport:host_test and //transport:channel_secret_test).
    if (absl::StartsWith(method, "/paramd.transport.")) continue;
    const pb::MethodDescriptor* d = Method(method);
    ASSERT_NE(d, nullptr) << method;
    targets.push_back({method, d, policy.roles.contains(auth::Role::kTrainer)});
  }
  ASSERT_GE(targets.size(), 24u);
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels;  // by address + identity
  const std::vector<std::string> identities = {"", "unknown-token-0123456789abcdef", kTrainerToken};
  for (const std::string& address : {cluster.coordinator_address(), daemons[0], daemons[1]}) {
    for (const std::string& token : identities) {
      absl::StatusOr<std::shared_ptr<grpc::Channel>> c = Channel(address, token);
      ASSERT_TRUE(c.ok());
      channels[address + "|" + token] = *c;
    }
  }
  const uint64_t seed = SeedFromEnv();
  const char* seconds_env = std::getenv("PARAMD_HOSTILE_SECONDS");
  const absl::Duration run_for = absl::Seconds(seconds_env ? std::atof(seconds_env) : 3.0);
  std::cerr << "hostile_client_test: seed " << seed << " (PARAMD_HOSTILE_SEED)\n";
  std::mutex mu;
  std::set<std::string> unexpected;  // calls not refused as they must be (method, code)
  std::atomic<int> calls{0};
  const absl::Time stop = absl::Now() + run_for;
  auto attack = [&](uint64_t thread_seed) {
    std::mt19937_64 rng(thread_seed);
    while (absl::Now() < stop) {
      const Target& t = targets[rng() % targets.size()];
      const int who = static_cast<int>(rng() % identities.size());
      if (who == 2 && t.trainer_allowed) continue;  // a trainer may call these
      const std::string address =
          OnDaemon(t.method) ? daemons[rng() % 2] : cluster.coordinator_address();
      bool garbage = false;
      const std::vector<std::string> messages = HostileMessages(*t.descriptor, rng, &garbage);
      const grpc::Status s = CallRawBytes(channels.at(address + "|" + identities[who]).get(),
                                          t.method, messages, absl::Seconds(2));
      calls.fetch_add(1);
      const grpc::StatusCode want =
          who == 2 ? grpc::StatusCode::PERMISSION_DENIED : grpc::StatusCode::UNAUTHENTICATED;
      if (s.error_code() == want || (garbage && !s.ok())) continue;
      std::lock_guard<std::mutex> lock(mu);
      unexpected.insert(absl::StrCat(t.method, " as ",
                                     who == 0   ? "nobody"
                                     : who == 1 ? "an unknown token"
                                                : "trainer",
                                     garbage ? " (garbage)" : "", ": code ", s.error_code(), " ",
                                     s.error_message().substr(0, 200)));
    }
  };
  std::thread a(attack, seed), b(attack, seed + 1);
  a.join();
  b.join();
  std::cerr << "hostile_client_test: " << calls.load() << " hostile calls\n";
  EXPECT_GE(calls.load(), static_cast<int>(targets.size()));
  EXPECT_TRUE(unexpected.empty()) << "calls not refused:\n" << absl::StrJoin(unexpected, "\n");

  // Nothing crashed, nothing changed, and the cluster still trains.
  EXPECT_TRUE(cluster.Exited().empty()) << cluster.Exited().front() << "\n" << cluster.Logs();
  absl::StatusOr<client::Manifest> manifest = (*operator_client)->RefreshManifest();
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->committed_version, 0);
  client::ClientOptions trainer = op;
  trainer.role = client::ClientOptions::Role::kTrainer;
  trainer.token = kTrainerToken;
  trainer.name = "hostile_test_trainer";
  absl::StatusOr<std::unique_ptr<client::Client>> t = client::Client::Connect(trainer);
  ASSERT_TRUE(t.ok()) << t.status();
  const std::vector<float> g = RandomValues(kRows * kCols, 4, 0.1f);
  absl::StatusOr<client::PushResult> pushed =
      (*t)->PushGradients(0, {client::Gradient::Fp32("w", g)});
  ASSERT_TRUE(pushed.ok()) << pushed.status() << cluster.Logs();
  absl::StatusOr<int64_t> v1 = (*t)->WaitForVersion(1, absl::Seconds(20));
  ASSERT_TRUE(v1.ok()) << v1.status() << cluster.Logs();
  EXPECT_EQ(*v1, 1);
  EXPECT_TRUE(cluster.Exited().empty()) << cluster.Logs();
}

}  // namespace
}  // namespace testing
}  // namespace paramd
