// Multi-process: a coordinator and two daemons (real hybrid-paramd
// processes, host data plane). A [520 x 200] weight is split across both
// daemons; for every format pair (and both columnwise sources) the fetched
// pieces carry ONE global scale/amax and assemble to exactly the CPU
// reference quantization of the whole master, at version 0 and after a step
// that sums two pushers' gradients once.
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "format/convert.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "server/step/reference_step.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr int64_t kRows = 520;  // not a multiple of 32 or 128: partial blocks
constexpr int64_t kCols = 200;
constexpr float kLr = 0.5f;

class ServerFormatsTest : public ::testing::TestWithParam<FormatCombo> {
 protected:
  static void SetUpTestSuite() {
    TestClusterOptions options;
    options.daemons = 2;
    options.expected_pushers = 2;
    options.optimizer = "sgd";
    options.lr = kLr;
    absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = c->release();
    tensors_ = {{"w", {kRows, kCols}, RandomValues(kRows * kCols, 1)},
                {"b", {77}, RandomValues(77, 2, 0.1f)}};
    // The second daemon's rows hold the largest values: its amax is global.
    for (int64_t i = 300 * kCols; i < kRows * kCols; ++i) tensors_[0].values[i] *= 4.0f;
    model_path_ = cluster_->cluster().dir() + "/model.safetensors";
    ASSERT_TRUE(WriteModel(model_path_, tensors_).ok());
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  void TearDown() override {
    if (HasFailure() && cluster_ != nullptr) ADD_FAILURE() << cluster_->cluster().Logs();
  }

  // Every published direction of every tensor equals the reference of
  // `masters` at `version`; per-tensor numbers agree across pieces.
  void ExpectVersionMatches(int64_t version,
                            const std::map<std::string, std::vector<float>>& masters,
                            std::map<std::string, ReferenceTensorState>& states) {
    for (const TestTensor& t : tensors_) {
      SCOPED_TRACE(t.name);
      const rpc::TensorInfo& info = cluster_->tensor(t.name);
      const HybridSpec spec = cluster_->spec(t.name);
      absl::StatusOr<ref::HybridResult> expected =
          ReferencePublish(masters.at(t.name), info.rows(), info.cols(), spec, states[t.name]);
      ASSERT_TRUE(expected.ok()) << expected.status();
      for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
        SCOPED_TRACE(DirectionName(d));
        const std::optional<QuantizedTensor>& want =
            d == Direction::kRowwise ? expected->rowwise : expected->columnwise;
        if (!want) {
          rpc::FetchRequest request;
          request.set_version(version);
          rpc::TensorDirections* td = request.add_tensors();
          td->set_tensor(t.name);
          td->add_directions(DirectionToProto(d));
          FetchedPieces got;
          EXPECT_EQ(cluster_->FetchFrom(0, request, absl::Seconds(5), &got).error_code(),
                    grpc::StatusCode::FAILED_PRECONDITION);
          continue;
        }
        absl::StatusOr<std::vector<QuantizedTensor>> pieces =
            cluster_->FetchPieces(version, t.name, d);
        ASSERT_TRUE(pieces.ok()) << pieces.status();
        for (const QuantizedTensor& p : *pieces) {
          EXPECT_EQ(p.scale_inv, want->scale_inv) << "one global scale";
          const QuantSpec& qs = d == Direction::kRowwise ? spec.rowwise : spec.columnwise;
          if (NeedsGlobalAmax(qs.format)) {
            EXPECT_EQ(p.amax, want->amax) << "one global amax";
          }
        }
        absl::StatusOr<QuantizedTensor> got = cluster_->FetchAssembled(version, t.name, d);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_EQ(got->data, want->data);
        EXPECT_EQ(got->scales, want->scales);
        EXPECT_EQ(got->scale_inv, want->scale_inv);
      }
    }
  }

  static RawCluster* cluster_;
  static std::vector<TestTensor> tensors_;
  static std::string model_path_;
};

RawCluster* ServerFormatsTest::cluster_ = nullptr;
std::vector<TestTensor> ServerFormatsTest::tensors_;
std::string ServerFormatsTest::model_path_;

TEST_P(ServerFormatsTest, SplitTensorMatchesReferenceBeforeAndAfterAStep) {
  ASSERT_NE(cluster_, nullptr);
  const std::string recipe = absl::StrCat("default_spec { ", GetParam().spec, " }");
  absl::StatusOr<int64_t> v0 = cluster_->Load(model_path_, recipe);
  ASSERT_TRUE(v0.ok()) << v0.status();
  ASSERT_EQ(*v0, 0);
  // The weight is split across both daemons.
  std::map<int, int> pieces_per_daemon;
  for (const rpc::ShardPiece& p : cluster_->manifest().pieces()) {
    if (p.tensor() == "w") ++pieces_per_daemon[p.daemon_rank()];
  }
  ASSERT_EQ(pieces_per_daemon.size(), 2u) << cluster_->manifest().DebugString();

  std::map<std::string, std::vector<float>> masters;
  std::map<std::string, ReferenceTensorState> states;
  for (const TestTensor& t : tensors_) {
    masters[t.name] = t.values;
    states[t.name] = InitialReferenceState(cluster_->spec(t.name));
  }
  ExpectVersionMatches(0, masters, states);

  // Two pushers; the daemons sum g1 + g2 once and apply SGD.
  std::map<std::string, std::vector<float>> g1, g2;
  for (const TestTensor& t : tensors_) {
    g1[t.name] = RandomValues(t.values.size(), 10, 0.3f);
    g2[t.name] = RandomValues(t.values.size(), 20, 0.3f);
  }
  ASSERT_TRUE(cluster_->PushAll(0, "trainer-a", g1).ok());
  ASSERT_TRUE(cluster_->PushAll(0, "trainer-b", g2).ok());
  absl::StatusOr<int64_t> v1 = cluster_->WaitForVersion(1);
  ASSERT_TRUE(v1.ok()) << v1.status();
  for (auto& [name, w] : masters) {
    for (size_t i = 0; i < w.size(); ++i) w[i] -= kLr * (g1[name][i] + g2[name][i]);
  }
  ExpectVersionMatches(1, masters, states);
}

INSTANTIATE_TEST_SUITE_P(Formats, ServerFormatsTest, ::testing::ValuesIn(FormatCombos()),
                         [](const ::testing::TestParamInfo<FormatCombo>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace testing
}  // namespace paramd
