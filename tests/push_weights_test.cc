// Multi-process: Daemon.PushWeights (the streamed load behind `hpctl load
// DIR`) copies rows only on its end marker. A coordinator + two daemon
// processes, a model declared by shape; streams that fail mid-way (a
// message over the daemon's size limit after a whole good piece), end
// without the marker or with a wrong total change nothing -- proven by the
// next stream, whose rows alone then do not complete the daemon -- and the
// upload that follows commits version 0 with exactly the values sent.
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr int64_t kRows = 300;  // large enough to be split over both daemons
constexpr int64_t kCols = 128;
// The daemons' --max_message_bytes: a message above it fails the read.
constexpr int64_t kMaxMessage = 1 << 20;

// Rows [begin, end) of `values` as one PushWeights chunk message.
rpc::PushWeightsRequest Rows(const std::vector<float>& values, int64_t begin, int64_t end) {
  rpc::PushWeightsRequest r;
  rpc::GradientChunk* c = r.mutable_chunk();
  c->set_tensor("w");
  c->set_row_begin(begin);
  c->set_row_end(end);
  c->set_dtype(rpc::DTYPE_FP32);
  c->set_data(reinterpret_cast<const char*>(values.data() + begin * kCols),
              (end - begin) * kCols * sizeof(float));
  return r;
}

rpc::PushWeightsRequest End(int64_t total_bytes) {
  rpc::PushWeightsRequest r;
  r.mutable_end()->set_total_bytes(total_bytes);
  return r;
}

struct Streamed {
  grpc::Status status;
  rpc::PushWeightsResponse response;
};

Streamed Stream(RawCluster& c, int rank, const std::vector<rpc::PushWeightsRequest>& messages) {
  Streamed out;
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  auto writer = c.daemon(rank).PushWeights(&context, &out.response);
  for (const rpc::PushWeightsRequest& m : messages) {
    if (!writer->Write(m)) break;
  }
  writer->WritesDone();
  out.status = writer->Finish();
  return out;
}

TEST(PushWeightsTest, OnlyAStreamEndedByItsMarkerIsCopied) {
  TestClusterOptions options = TwoDaemonSgd(0.5);
  options.daemon_flags = {absl::StrCat("--max_message_bytes=", kMaxMessage)};
  absl::StatusOr<std::unique_ptr<RawCluster>> started = RawCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  RawCluster& c = **started;
  client::ClientOptions copts;
  copts.coordinator_address = c.cluster().coordinator_address();
  copts.role = client::ClientOptions::Role::kObserver;
  copts.name = "push_weights_test";
  absl::StatusOr<std::unique_ptr<client::Client>> operator_client = client::Client::Connect(copts);
  ASSERT_TRUE(operator_client.ok()) << operator_client.status();
  absl::StatusOr<int64_t> declared =
      (*operator_client)
          ->LoadDeclared({{"w", {kRows, kCols}}}, kFp32PassthroughRecipe, absl::Seconds(20));
  ASSERT_TRUE(declared.ok()) << declared.status() << c.cluster().Logs();
  ASSERT_TRUE(c.RefreshManifest().ok());
  // Daemon `low` holds rows [0, split), daemon `high` [split, kRows).
  int64_t split = 0;
  int low = -1, high = -1;
  for (const rpc::ShardPiece& p : c.manifest().pieces()) {
    if (p.tensor() != "w") continue;
    if (p.row_begin() == 0) {
      low = p.daemon_rank();
      split = p.row_end();
    } else {
      high = p.daemon_rank();
    }
  }
  ASSERT_TRUE(split > 1 && split < kRows && low >= 0 && high >= 0 && low != high)
      << c.manifest().DebugString();
  const std::vector<float> w = RandomValues(kRows * kCols, 5);
  const int64_t half = split / 2;
  const rpc::PushWeightsRequest first = Rows(w, 0, half), second = Rows(w, half, split);
  const int64_t first_bytes = static_cast<int64_t>(first.chunk().data().size());

  // Mid-way failures: the whole first half, then a message over the limit.
  rpc::PushWeightsRequest huge = second;
  huge.mutable_chunk()->set_data(std::string(2 * kMaxMessage, '\0'));
  for (int i = 0; i < 20; ++i) {
    const Streamed s = Stream(c, low, {first, huge, End(first_bytes + 2 * kMaxMessage)});
    ASSERT_FALSE(s.status.ok()) << "attempt " << i;
  }
  // Half-closed without the marker; a marker with the wrong total.
  Streamed s = Stream(c, low, {first});
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.status.error_message();
  EXPECT_TRUE(absl::StrContains(s.status.error_message(), "end marker"))
      << s.status.error_message();
  s = Stream(c, low, {first, End(first_bytes - 4)});
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.status.error_message();
  EXPECT_TRUE(absl::StrContains(s.status.error_message(), "end marker says"))
      << s.status.error_message();

  // None of the first half was copied: the second half alone leaves the
  // daemon incomplete.
  s = Stream(c, low, {second, End(static_cast<int64_t>(second.chunk().data().size()))});
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_FALSE(s.response.complete()) << "rows of a failed stream were copied";
  s = Stream(c, low, {first, End(first_bytes)});
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_TRUE(s.response.complete());
  EXPECT_EQ(s.response.bytes_received(), first_bytes);
  // The other daemon: one message carrying its rows and the marker.
  rpc::PushWeightsRequest rest = Rows(w, split, kRows);
  rest.mutable_end()->set_total_bytes(static_cast<int64_t>(rest.chunk().data().size()));
  s = Stream(c, high, {rest});
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_TRUE(s.response.complete());

  absl::StatusOr<int64_t> v = c.WaitForVersion(0);
  ASSERT_TRUE(v.ok()) << v.status() << c.cluster().Logs();
  absl::StatusOr<std::map<std::string, std::vector<float>>> masters = c.Fp32Masters(0, {"w"});
  ASSERT_TRUE(masters.ok()) << masters.status();
  EXPECT_EQ(masters->at("w"), w);
}

}  // namespace
}  // namespace testing
}  // namespace paramd
