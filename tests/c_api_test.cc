// client/c_api.h against a real cluster: every call's errors (NULL, closed
// and foreign handles, NULL pointers, an unreachable coordinator, buffers of
// the wrong size, bad enums, unknown tensors, unpublished directions) come
// back as codes with messages, never an abort; and a fetch / push through
// the API equals client::Client's.
#include "client/c_api.h"

#include <stdlib.h>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "client/client.h"
#include "safetensors/safetensors.h"
#include "tests/client_cluster.h"

namespace paramd {
namespace {

constexpr char kRecipe[] = R"txt(
  rule {
    pattern: "w"
    spec { rowwise { format: MXFP8 } columnwise { format: FP8_CURRENT } }
  }
  rule {
    pattern: "b"
    spec { rowwise { format: IDENTITY_FP32 } columnwise_usage: false }
  }
)txt";

// hpd_watch_version's events, kept until `stop_after` of them arrived.
struct WatchLog {
  std::vector<hpd_version_info> events;
  size_t stop_after = 0;  // 0: never stop
};

int32_t CountEvent(void* arg, const hpd_version_info* event) {
  if (arg == nullptr) return 1;
  auto* log = static_cast<WatchLog*>(arg);
  log->events.push_back(*event);
  return log->stop_after == 0 || log->events.size() < log->stop_after ? 1 : 0;
}

class CApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cluster = testing::TestCluster::Start({.daemons = 2, .expected_pushers = 1});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    const std::string path = cluster_->dir() + "/m.safetensors";
    {
      auto w = safetensors::SafetensorsWriter::Create(
          path, {{"w", safetensors::Dtype::kF32, {64, 96}}, {"b", safetensors::Dtype::kF32, {8}}});
      ASSERT_TRUE(w.ok());
      std::vector<float> wv(64 * 96), bv(8);
      for (size_t i = 0; i < wv.size(); ++i) wv[i] = 0.01f * static_cast<float>(i % 37) - 0.1f;
      for (size_t i = 0; i < bv.size(); ++i) bv[i] = static_cast<float>(i);
      ASSERT_TRUE(
          (*w)->WriteTensor("w", {reinterpret_cast<uint8_t*>(wv.data()), wv.size() * 4}).ok());
      ASSERT_TRUE(
          (*w)->WriteTensor("b", {reinterpret_cast<uint8_t*>(bv.data()), bv.size() * 4}).ok());
      ASSERT_TRUE((*w)->Finish().ok());
    }
    address_ = cluster_->coordinator_address();
    ASSERT_EQ(Connect(address_, /*observer=*/1, &admin_), HPD_OK) << st_.message;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    int32_t code;
    while ((code = hpd_load(admin_, path.c_str(), kRecipe, 30000, nullptr, &st_)) ==
               HPD_UNAVAILABLE &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    ASSERT_EQ(code, HPD_OK) << st_.message << cluster_->Logs();
  }
  void TearDown() override { EXPECT_EQ(hpd_close(admin_, nullptr), HPD_OK); }

  int32_t Connect(const std::string& address, int observer, hpd_client** c) {
    hpd_connect_options o;
    hpd_connect_options_init(&o);
    o.address = address.c_str();
    o.observer = observer;
    o.connect_timeout_ms = 2000;
    return hpd_connect(&o, c, &st_);
  }

  std::unique_ptr<testing::TestCluster> cluster_;
  std::string address_;
  hpd_client* admin_ = nullptr;
  hpd_status st_{};
};

TEST_F(CApiTest, VersionAndCodeNames) {
  EXPECT_EQ(hpd_api_version(), HPD_API_VERSION);
  EXPECT_STREQ(hpd_code_name(HPD_UNAVAILABLE), "UNAVAILABLE");
  EXPECT_STREQ(hpd_code_name(99), "UNKNOWN");
}

TEST_F(CApiTest, ConnectErrors) {
  hpd_client* c = reinterpret_cast<hpd_client*>(0x1);
  EXPECT_EQ(hpd_connect(nullptr, &c, &st_), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(c, nullptr);
  hpd_connect_options o;
  hpd_connect_options_init(&o);
  EXPECT_EQ(hpd_connect(&o, nullptr, &st_), HPD_INVALID_ARGUMENT);
  // No address: $PARAMD_COORDINATOR's (here one without a port).
  ASSERT_EQ(setenv("PARAMD_COORDINATOR", "nowhere", 1), 0);
  EXPECT_EQ(hpd_connect(&o, &c, &st_), HPD_INVALID_ARGUMENT);
  unsetenv("PARAMD_COORDINATOR");
  EXPECT_NE(std::strstr(st_.message, "'nowhere' has no port"), nullptr) << st_.message;
  o.address = address_.c_str();
  o.struct_size = 4;
  EXPECT_EQ(hpd_connect(&o, &c, &st_), HPD_INVALID_ARGUMENT);
  hpd_connect_options_init(&o);
  o.address = address_.c_str();
  o.token = "token-0123456789abcdef";
  o.token_file = "/nonexistent/tokens";
  EXPECT_EQ(hpd_connect(&o, &c, &st_), HPD_INVALID_ARGUMENT);  // both
  EXPECT_NE(std::strstr(st_.message, "not both"), nullptr) << st_.message;
  o.token = nullptr;
  EXPECT_EQ(hpd_connect(&o, &c, &st_), HPD_NOT_FOUND) << st_.message;
  EXPECT_NE(std::strstr(st_.message, "/nonexistent/tokens"), nullptr) << st_.message;
  o.token_file = nullptr;
  o.tls_root_certs_path = "/nonexistent/ca.pem";
  EXPECT_EQ(hpd_connect(&o, &c, &st_), HPD_NOT_FOUND) << st_.message;
  EXPECT_EQ(c, nullptr);
  // A caller built against API 1000 (no tls_server_name / token_file):
  // accepted, and the fields past its struct_size are never read.
  hpd_connect_options_init(&o);
  o.address = address_.c_str();
  o.observer = 1;
  o.struct_size = offsetof(hpd_connect_options, tls_server_name);
  o.token_file = "/nonexistent/tokens";
  ASSERT_EQ(hpd_connect(&o, &c, &st_), HPD_OK) << st_.message;
  ASSERT_EQ(hpd_close(c, &st_), HPD_OK);
  c = nullptr;
  const absl::Time start = absl::Now();
  EXPECT_EQ(Connect("127.0.0.1:1", 1, &c), HPD_UNAVAILABLE) << st_.message;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(c, nullptr);
  // A NULL status is allowed: only the code comes back.
  EXPECT_EQ(hpd_connect(nullptr, &c, nullptr), HPD_INVALID_ARGUMENT);
}

TEST_F(CApiTest, BadHandlesAreRefused) {
  hpd_client* closed = nullptr;
  ASSERT_EQ(Connect(address_, 1, &closed), HPD_OK);
  ASSERT_EQ(hpd_close(closed, &st_), HPD_OK);
  int dummy = 0;
  hpd_client* foreign = reinterpret_cast<hpd_client*>(&dummy);
  for (hpd_client* h : {static_cast<hpd_client*>(nullptr), closed, foreign}) {
    int64_t v;
    hpd_manifest* m = nullptr;
    char* json = nullptr;
    int32_t rank;
    EXPECT_EQ(hpd_wait_for_version(h, 0, 100, &v, &st_), HPD_INVALID_ARGUMENT);
    EXPECT_EQ(hpd_get_manifest(h, 0, &m, &st_), HPD_INVALID_ARGUMENT);
    EXPECT_EQ(m, nullptr);
    EXPECT_EQ(hpd_fetch(h, 0, nullptr, 0, 0, nullptr, nullptr, &st_), HPD_INVALID_ARGUMENT);
    EXPECT_EQ(hpd_fetch_device(h, 0, nullptr, 0, 0, nullptr, 0, nullptr, &st_),
              HPD_INVALID_ARGUMENT);
    EXPECT_EQ(hpd_push_gradients(h, 0, nullptr, 0, -1, nullptr, 0, nullptr, &st_),
              HPD_INVALID_ARGUMENT);
    EXPECT_EQ(hpd_status_json(h, 0, 0, &json, &st_), HPD_INVALID_ARGUMENT);
    EXPECT_EQ(hpd_load(h, "/x", nullptr, 0, nullptr, &st_), HPD_INVALID_ARGUMENT);
    EXPECT_EQ(hpd_step(h, 0, 0, 0, nullptr, &st_), HPD_INVALID_ARGUMENT);
    hpd_version_info vi;
    EXPECT_EQ(hpd_wait_for_version_info(h, 0, 100, &vi, &st_), HPD_INVALID_ARGUMENT);
    EXPECT_EQ(hpd_watch_version(h, 0, 100, CountEvent, nullptr, &st_), HPD_INVALID_ARGUMENT);
    hpd_load_options lo;
    hpd_load_options_init(&lo);
    lo.model = "/x";
    EXPECT_EQ(hpd_load_model(h, &lo, &v, &st_), HPD_INVALID_ARGUMENT);
    EXPECT_EQ(hpd_set_optimizer_schedule(h, "", 0, 0, 0, &json, &st_), HPD_INVALID_ARGUMENT);
    EXPECT_EQ(json, nullptr);
    EXPECT_EQ(hpd_member(h, &rank, nullptr, 0, &st_), HPD_INVALID_ARGUMENT);
  }
  EXPECT_EQ(hpd_close(nullptr, &st_), HPD_OK);
  EXPECT_EQ(hpd_close(closed, &st_), HPD_INVALID_ARGUMENT);  // twice
  EXPECT_EQ(hpd_close(foreign, &st_), HPD_INVALID_ARGUMENT);
  const hpd_manifest* fm = reinterpret_cast<const hpd_manifest*>(&dummy);
  int64_t n;
  hpd_tensor_info info;
  EXPECT_EQ(hpd_manifest_num_tensors(nullptr, &n, &st_), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(hpd_manifest_num_tensors(fm, &n, &st_), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(hpd_manifest_tensor(fm, 0, &info, &st_), HPD_INVALID_ARGUMENT);
  hpd_manifest_free(const_cast<hpd_manifest*>(fm));  // ignored, no crash
  hpd_manifest_free(nullptr);
}

TEST_F(CApiTest, LoadScheduleAndWaitInfoErrors) {
  hpd_load_options lo;
  hpd_load_options_init(&lo);
  int64_t v = -7;
  EXPECT_EQ(hpd_load_model(admin_, nullptr, &v, &st_), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(hpd_load_model(admin_, &lo, &v, &st_), HPD_INVALID_ARGUMENT);  // no model
  lo.model = "/nonexistent/model-dir";
  EXPECT_EQ(hpd_load_model(admin_, &lo, &v, &st_), HPD_NOT_FOUND) << st_.message;
  lo.struct_size = 8;
  EXPECT_EQ(hpd_load_model(admin_, &lo, &v, &st_), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(v, -7);
  char* json = reinterpret_cast<char*>(0x1);
  EXPECT_EQ(hpd_set_optimizer_schedule(admin_, nullptr, 0, 0, 0, &json, &st_),
            HPD_INVALID_ARGUMENT);
  EXPECT_EQ(json, nullptr);
  EXPECT_EQ(hpd_set_optimizer_schedule(admin_, "decay: NOPE", 0, 0, 0, &json, &st_),
            HPD_INVALID_ARGUMENT);
  EXPECT_NE(std::strstr(st_.message, "1:"), nullptr) << st_.message;  // line:column
  EXPECT_EQ(hpd_set_optimizer_schedule(admin_, "{\"decay\": [", 0, 0, 0, &json, &st_),
            HPD_INVALID_ARGUMENT);
  ASSERT_EQ(hpd_set_optimizer_schedule(admin_, "warmup_steps: 3", 1, 0.125f, 0, &json, &st_),
            HPD_OK)
      << st_.message;
  ASSERT_NE(json, nullptr);
  EXPECT_NE(std::strstr(json, "\"warmup_steps\""), nullptr) << json;
  EXPECT_NE(std::strstr(json, "0.125"), nullptr) << json;
  hpd_free_string(json);
  EXPECT_EQ(hpd_set_optimizer_schedule(admin_, "", 0, 0, 0, nullptr, &st_), HPD_OK)
      << st_.message;  // back to constant, result not wanted
  EXPECT_EQ(hpd_wait_for_version_info(admin_, 0, 100, nullptr, &st_), HPD_INVALID_ARGUMENT);
  hpd_version_info info;
  ASSERT_EQ(hpd_wait_for_version_info(admin_, 0, 5000, &info, &st_), HPD_OK) << st_.message;
  EXPECT_EQ(info.committed_version, 0);
  EXPECT_EQ(info.rewound, 0);
  EXPECT_EQ(info.recovery_epoch, 0);
  EXPECT_EQ(hpd_wait_for_version_info(admin_, 99, 200, &info, &st_), HPD_DEADLINE_EXCEEDED);
}

TEST_F(CApiTest, WatchVersionStreamsUntilTheCallbackStops) {
  EXPECT_EQ(hpd_watch_version(admin_, 0, 100, nullptr, nullptr, &st_), HPD_INVALID_ARGUMENT);
  // Version 0 at once; the callback's 0 ends the watch with OK.
  WatchLog log;
  log.stop_after = 1;
  ASSERT_EQ(hpd_watch_version(admin_, 0, 5000, CountEvent, &log, &st_), HPD_OK) << st_.message;
  ASSERT_EQ(log.events.size(), 1u);
  EXPECT_EQ(log.events[0].committed_version, 0);
  EXPECT_EQ(log.events[0].rewound, 0);
  EXPECT_EQ(log.events[0].recovery_epoch, 0);
  // Nothing newer: the timeout ends it, without a call.
  WatchLog none;
  EXPECT_EQ(hpd_watch_version(admin_, 1, 200, CountEvent, &none, &st_), HPD_DEADLINE_EXCEEDED);
  EXPECT_TRUE(none.events.empty());
  // A commit while watching arrives as the next event.
  hpd_client* trainer = nullptr;
  ASSERT_EQ(Connect(address_, 0, &trainer), HPD_OK) << st_.message;
  std::vector<float> gw(64 * 96, 0.5f), gb(8, 1.0f);
  hpd_gradient g[2] = {{"w", HPD_GRAD_FP32, gw.data(), gw.size() * 4},
                       {"b", HPD_GRAD_FP32, gb.data(), gb.size() * 4}};
  ASSERT_EQ(hpd_push_gradients(trainer, 0, g, 2, -1, nullptr, 0, nullptr, &st_), HPD_OK)
      << st_.message;
  WatchLog two;
  two.stop_after = 1;
  ASSERT_EQ(hpd_watch_version(admin_, 1, 20000, CountEvent, &two, &st_), HPD_OK) << st_.message;
  ASSERT_EQ(two.events.size(), 1u);
  EXPECT_EQ(two.events[0].committed_version, 1);
  EXPECT_EQ(hpd_close(trainer, &st_), HPD_OK);
}

TEST_F(CApiTest, ManifestAndItsErrors) {
  hpd_manifest* m = nullptr;
  ASSERT_EQ(hpd_get_manifest(admin_, 1, &m, &st_), HPD_OK) << st_.message;
  int64_t n = 0, index = -1, committed = -2;
  int32_t daemons = 0, pushers = 0;
  ASSERT_EQ(hpd_manifest_num_tensors(m, &n, &st_), HPD_OK);
  EXPECT_EQ(n, 2);
  ASSERT_EQ(hpd_manifest_summary(m, &daemons, &pushers, &committed, &st_), HPD_OK);
  EXPECT_EQ(daemons, 2);
  EXPECT_EQ(pushers, 1);
  EXPECT_EQ(committed, 0);
  ASSERT_EQ(hpd_manifest_find(m, "w", &index, &st_), HPD_OK);
  hpd_tensor_info info;
  ASSERT_EQ(hpd_manifest_tensor(m, index, &info, &st_), HPD_OK);
  EXPECT_STREQ(info.name, "w");
  EXPECT_EQ(info.rows, 64);
  EXPECT_EQ(info.cols, 96);
  EXPECT_EQ(info.dir[HPD_ROWWISE].format, HPD_FORMAT_MXFP8);
  EXPECT_EQ(info.dir[HPD_ROWWISE].data_bytes, 64 * 96);
  EXPECT_EQ(info.dir[HPD_ROWWISE].scale_bytes, 128 * 4);
  EXPECT_EQ(info.dir[HPD_COLUMNWISE].format, HPD_FORMAT_FP8_CURRENT);
  EXPECT_EQ(info.dir[HPD_COLUMNWISE].transposed, 1);
  EXPECT_EQ(info.dir[HPD_COLUMNWISE].data_rows, 96);
  EXPECT_EQ(hpd_manifest_find(m, "nope", &index, &st_), HPD_NOT_FOUND);
  EXPECT_EQ(hpd_manifest_find(m, nullptr, &index, &st_), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(hpd_manifest_tensor(m, 2, &info, &st_), HPD_OUT_OF_RANGE);
  EXPECT_EQ(hpd_manifest_tensor(m, -1, &info, &st_), HPD_OUT_OF_RANGE);
  EXPECT_EQ(hpd_manifest_tensor(m, 0, nullptr, &st_), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(hpd_manifest_num_tensors(m, nullptr, &st_), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(hpd_get_manifest(admin_, 0, nullptr, &st_), HPD_INVALID_ARGUMENT);
  hpd_manifest_free(m);
  EXPECT_EQ(hpd_manifest_num_tensors(m, &n, &st_), HPD_INVALID_ARGUMENT);  // freed
}

TEST_F(CApiTest, FetchEqualsClientAndRefusesBadTargets) {
  std::vector<uint8_t> data(64 * 96), scales(128 * 4), col(64 * 96);
  hpd_fetch_target t[2] = {
      {"w", HPD_ROWWISE, data.data(), data.size(), scales.data(), scales.size(), nullptr, nullptr},
      {"w", HPD_COLUMNWISE, col.data(), col.size(), nullptr, 0, nullptr, nullptr}};
  hpd_fetch_output out[2];
  hpd_fetch_stats stats;
  ASSERT_EQ(hpd_fetch(admin_, HPD_LATEST, t, 2, 0, out, &stats, &st_), HPD_OK) << st_.message;
  EXPECT_EQ(stats.version, 0);
  EXPECT_EQ(stats.rowwise_bytes, 64 * 96 + 128 * 4);
  EXPECT_EQ(stats.columnwise_bytes, 64 * 96);
  EXPECT_EQ(stats.rowwise_bf16_bytes, 64 * 96 * 2);
  auto c = client::Client::Connect(
      {.coordinator_address = address_, .role = client::ClientOptions::Role::kObserver});
  ASSERT_TRUE(c.ok()) << c.status();
  auto want = (*c)->Fetch(
      0,
      client::AllTargets((*c)->manifest(), {Direction::kRowwise, Direction::kColumnwise}, {"w"}));
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(want->tensors.size(), 2u);
  EXPECT_TRUE(want->tensors[0].value.data == data);
  EXPECT_TRUE(want->tensors[0].value.scales == scales);
  EXPECT_TRUE(want->tensors[1].value.data == col);
  EXPECT_EQ(out[1].scale_inv, want->tensors[1].value.scale_inv);
  EXPECT_EQ(out[1].amax, want->tensors[1].value.amax);

  hpd_fetch_target bad = t[0];
  bad.data_bytes -= 1;  // one byte short
  EXPECT_EQ(hpd_fetch(admin_, 0, &bad, 1, 0, out, nullptr, &st_), HPD_INVALID_ARGUMENT);
  EXPECT_NE(std::strstr(st_.message, "layout needs"), nullptr) << st_.message;
  bad = t[0];
  bad.scales = nullptr;
  EXPECT_EQ(hpd_fetch(admin_, 0, &bad, 1, 0, out, nullptr, &st_), HPD_INVALID_ARGUMENT);
  bad = t[0];
  bad.data = nullptr;
  EXPECT_EQ(hpd_fetch(admin_, 0, &bad, 1, 0, out, nullptr, &st_), HPD_INVALID_ARGUMENT);
  bad = t[0];
  bad.direction = 7;
  EXPECT_EQ(hpd_fetch(admin_, 0, &bad, 1, 0, out, nullptr, &st_), HPD_INVALID_ARGUMENT);
  bad = t[0];
  bad.tensor = nullptr;
  EXPECT_EQ(hpd_fetch(admin_, 0, &bad, 1, 0, out, nullptr, &st_), HPD_INVALID_ARGUMENT);
  bad = t[0];
  bad.tensor = "nope";
  EXPECT_EQ(hpd_fetch(admin_, 0, &bad, 1, 0, out, nullptr, &st_), HPD_NOT_FOUND);
  hpd_fetch_target twice[2] = {t[0], t[0]};
  EXPECT_EQ(hpd_fetch(admin_, 0, twice, 2, 0, out, nullptr, &st_), HPD_INVALID_ARGUMENT);
  float b[8];
  hpd_fetch_target bcol = {"b", HPD_COLUMNWISE, b, sizeof(b), nullptr, 0, nullptr, nullptr};
  EXPECT_EQ(hpd_fetch(admin_, 0, &bcol, 1, 0, out, nullptr, &st_), HPD_FAILED_PRECONDITION);
  EXPECT_EQ(hpd_fetch(admin_, 0, t, 1, 0, nullptr, nullptr, &st_), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(hpd_fetch(admin_, 0, nullptr, 1, 0, out, nullptr, &st_), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(hpd_fetch(admin_, 9, t, 1, 300, out, nullptr, &st_), HPD_DEADLINE_EXCEEDED);
  if (!hpd_has_cuda()) {
    EXPECT_EQ(hpd_fetch_device(admin_, 0, t, 1, 0, nullptr, 0, nullptr, &st_), HPD_UNIMPLEMENTED);
    EXPECT_NE(std::strstr(st_.message, "--config=cuda"), nullptr) << st_.message;
  }
}

TEST_F(CApiTest, PushStepsAndRefusesBadGradients) {
  hpd_client* trainer = nullptr;
  ASSERT_EQ(Connect(address_, 0, &trainer), HPD_OK) << st_.message;
  std::vector<float> gw(64 * 96, 0.5f), gb(8, 1.0f);
  hpd_gradient bad[1] = {{"w", HPD_GRAD_FP32, gw.data(), gw.size() * 4 - 4}};
  EXPECT_EQ(hpd_push_gradients(trainer, 0, bad, 1, -1, nullptr, 0, nullptr, &st_),
            HPD_INVALID_ARGUMENT);
  bad[0] = {"w", 5, gw.data(), gw.size() * 4};
  EXPECT_EQ(hpd_push_gradients(trainer, 0, bad, 1, -1, nullptr, 0, nullptr, &st_),
            HPD_INVALID_ARGUMENT);
  bad[0] = {"nope", HPD_GRAD_FP32, gw.data(), gw.size() * 4};
  EXPECT_EQ(hpd_push_gradients(trainer, 0, bad, 1, -1, nullptr, 0, nullptr, &st_),
            HPD_INVALID_ARGUMENT);
  bad[0] = {"w", HPD_GRAD_FP32, nullptr, gw.size() * 4};
  EXPECT_EQ(hpd_push_gradients(trainer, 0, bad, 1, -1, nullptr, 0, nullptr, &st_),
            HPD_INVALID_ARGUMENT);
  if (!hpd_has_cuda()) {
    hpd_gradient g = {"w", HPD_GRAD_FP32, gw.data(), gw.size() * 4};
    EXPECT_EQ(hpd_push_gradients(trainer, 0, &g, 1, 0, nullptr, 0, nullptr, &st_),
              HPD_UNIMPLEMENTED);
  }
  hpd_gradient good[2] = {{"w", HPD_GRAD_FP32, gw.data(), gw.size() * 4},
                          {"b", HPD_GRAD_FP32, gb.data(), gb.size() * 4}};
  hpd_push_result r;
  ASSERT_EQ(hpd_push_gradients(trainer, 0, good, 2, -1, nullptr, 0, &r, &st_), HPD_OK)
      << st_.message;
  EXPECT_EQ(r.version, 0);
  EXPECT_EQ(r.pushers_received, 1);
  EXPECT_EQ(r.bytes_sent, (64 * 96 + 8) * 4);
  // Again: a duplicate (or, once the step has run, a stale) push is refused.
  const int32_t again = hpd_push_gradients(trainer, 0, good, 2, -1, nullptr, 0, &r, &st_);
  EXPECT_TRUE(again == HPD_ALREADY_EXISTS || again == HPD_FAILED_PRECONDITION) << again;
  int64_t v = -1;
  ASSERT_EQ(hpd_wait_for_version(admin_, 1, 20000, &v, &st_), HPD_OK) << st_.message;
  EXPECT_EQ(v, 1);
  // SGD lr 0.5: b = i - 0.5 (identity FP32 rowwise).
  float b[8];
  hpd_fetch_target t = {"b", HPD_ROWWISE, b, sizeof(b), nullptr, 0, nullptr, nullptr};
  hpd_fetch_output out;
  ASSERT_EQ(hpd_fetch(admin_, 1, &t, 1, 0, &out, nullptr, &st_), HPD_OK) << st_.message;
  for (int i = 0; i < 8; ++i) EXPECT_EQ(b[i], static_cast<float>(i) - 0.5f) << i;
  char* json = nullptr;
  ASSERT_EQ(hpd_status_json(admin_, 0, 0, &json, &st_), HPD_OK) << st_.message;
  EXPECT_NE(std::strstr(json, "committed_version"), nullptr) << json;
  hpd_free_string(json);
  EXPECT_EQ(hpd_status_json(admin_, 0, 0, nullptr, &st_), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(hpd_close(trainer, &st_), HPD_OK);
}

}  // namespace
}  // namespace paramd
