// Integration test of //client against real processes: a coordinator and
// two hybrid-paramd daemons (tests/client_cluster.h), a model written here,
// and a recipe with five formats and both columnwise sources.
#include <signal.h>
#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "safetensors/safetensors.h"
#include "tests/client_cluster.h"

namespace paramd {
namespace {

using client::Client;
using client::ClientOptions;
using client::FetchResult;
using client::FetchTarget;
using client::Gradient;
using client::PushCoverage;
using testing::TestCluster;

constexpr char kRecipe[] = R"txt(
  name: "client_test"
  rule {
    name: "big"
    pattern: "big\\.weight"
    spec {
      rowwise { format: NVFP4 }
      columnwise { format: FP8_BLOCK_128X128 }
      columnwise_source: ORIGINAL
      source_dtype: FP32
    }
  }
  rule {
    name: "mid"
    pattern: "mid\\.weight"
    spec {
      rowwise { format: FP8_CURRENT }
      columnwise { format: MXFP8 }
      columnwise_source: ROWWISE_DEQUANTIZED
    }
  }
  default_spec {
    rowwise { format: IDENTITY_BF16 }
    columnwise { format: IDENTITY_BF16 }
  }
)txt";

struct TensorData {
  std::string name;
  std::vector<int64_t> shape;
  int64_t rows, cols;
  std::vector<float> values;
};

// Deterministic values with a spread of magnitudes (so that block scales
// differ from block to block).
std::vector<float> Values(int64_t n, uint32_t seed, float scale) {
  std::vector<float> v(n);
  uint32_t s = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    const float u = static_cast<float>(s >> 8) / 16777216.0f - 0.5f;
    v[i] = u * scale * (1.0f + static_cast<float>((i / 97) % 7));
  }
  return v;
}

std::vector<TensorData> Model() {
  return {
      {"big.weight", {512, 384}, 512, 384, Values(512 * 384, 1, 0.1f)},
      {"mid.weight", {256, 512}, 256, 512, Values(256 * 512, 2, 0.05f)},
      {"small.bias", {64}, 1, 64, Values(64, 3, 1.0f)},
  };
}

void WriteModel(const std::string& path, const std::vector<TensorData>& model) {
  std::vector<safetensors::TensorSpec> specs;
  for (const TensorData& t : model) specs.push_back({t.name, safetensors::Dtype::kF32, t.shape});
  auto writer = safetensors::SafetensorsWriter::Create(path, specs);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (const TensorData& t : model) {
    ASSERT_TRUE((*writer)
                    ->WriteTensor(t.name, absl::MakeConstSpan(
                                              reinterpret_cast<const uint8_t*>(t.values.data()),
                                              t.values.size() * 4))
                    .ok());
  }
  ASSERT_TRUE((*writer)->Finish().ok());
}

// What a whole-tensor quantization of `master` with the global scaling gives.
ref::HybridResult Expected(absl::Span<const float> master, int64_t rows, int64_t cols,
                           const HybridSpec& spec) {
  const std::vector<float> source = ref::RoundToSource(master, spec.source_dtype);
  ref::HybridScaling scaling;
  scaling.rowwise = ref::ScalingFromAmax(spec.rowwise, ref::Amax(source));
  auto col_values = ref::ColumnwiseSourceValues(master, rows, cols, spec, scaling.rowwise);
  EXPECT_TRUE(col_values.ok()) << col_values.status();
  scaling.columnwise = ref::ScalingFromAmax(spec.columnwise, ref::Amax(*col_values));
  auto result = ref::QuantizeHybrid(master, rows, cols, spec, scaling);
  EXPECT_TRUE(result.ok()) << result.status();
  return *result;
}

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override { StartCluster(); }

  void StartCluster() {
    auto cluster = TestCluster::Start({});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    model_ = Model();
    model_path_ = cluster_->dir() + "/model.safetensors";
    WriteModel(model_path_, model_);
    trainer_a_ = Connect("a");
    trainer_b_ = Connect("b");
    ASSERT_NE(trainer_a_, nullptr);
    ASSERT_NE(trainer_b_, nullptr);
    // Daemons join in the background: UNAVAILABLE until they have.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    absl::StatusOr<int64_t> version;
    do {
      version = trainer_a_->Load(model_path_, kRecipe, absl::Seconds(30));
    } while (version.status().code() == absl::StatusCode::kUnavailable && absl::Now() < deadline &&
             (absl::SleepFor(absl::Milliseconds(50)), true));
    ASSERT_TRUE(version.ok()) << version.status() << cluster_->Logs();
    ASSERT_EQ(*version, 0);
    ASSERT_TRUE(trainer_b_->RefreshManifest().ok());
  }

  std::unique_ptr<Client> Connect(const std::string& name) {
    ClientOptions options;
    options.coordinator_address = cluster_->coordinator_address();
    options.name = name;
    options.expected_pushers = 2;
    options.call_timeout = absl::Seconds(20);
    auto c = Client::Connect(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  const TensorData& Tensor(const std::string& name) const {
    for (const TensorData& t : model_) {
      if (t.name == name) return t;
    }
    std::abort();
  }

  // Every (tensor, direction) fetched at `version` equals whole-tensor
  // quantization of `masters` (same order as model_).
  void ExpectMatchesReference(int64_t version, const std::vector<std::vector<float>>& masters) {
    const client::Manifest m = trainer_a_->manifest();
    auto fetched = trainer_a_->Fetch(
        version, client::AllTargets(m, {Direction::kRowwise, Direction::kColumnwise}));
    ASSERT_TRUE(fetched.ok()) << fetched.status() << cluster_->Logs();
    ASSERT_EQ(fetched->tensors.size(), 6u);
    for (const client::FetchedTensor& t : fetched->tensors) {
      const client::TensorMeta* meta = m.Find(t.tensor);
      size_t index = 0;
      while (model_[index].name != t.tensor) ++index;
      const ref::HybridResult expected =
          Expected(masters[index], meta->rows, meta->cols, meta->spec);
      const QuantizedTensor& want =
          t.value.direction == Direction::kRowwise ? *expected.rowwise : *expected.columnwise;
      const std::string what = absl::StrCat(t.tensor, " ", DirectionName(t.value.direction), " (",
                                            FormatName(t.value.format), ", ", meta->pieces.size(),
                                            " pieces) v", version);
      EXPECT_EQ(t.value.format, want.format) << what;
      EXPECT_EQ(t.value.rows, meta->rows) << what;
      EXPECT_EQ(t.value.cols, meta->cols) << what;
      EXPECT_TRUE(t.value.data == want.data) << what << ": data differs";
      EXPECT_TRUE(t.value.scales == want.scales) << what << ": scales differ";
      EXPECT_EQ(t.value.scale_inv, want.scale_inv) << what;
      if (t.value.format == Format::kNvfp4 || t.value.format == Format::kFp8Current) {
        EXPECT_EQ(t.value.amax, want.amax) << what;
      }
    }
  }

  std::unique_ptr<TestCluster> cluster_;
  std::vector<TensorData> model_;
  std::string model_path_;
  std::unique_ptr<Client> trainer_a_, trainer_b_;
};

TEST_F(ClientTest, ManifestSplitsTheLargeTensorAcrossBothDaemons) {
  const client::Manifest m = trainer_a_->manifest();
  EXPECT_EQ(m.num_daemons, 2);
  EXPECT_EQ(m.expected_pushers, 2);
  EXPECT_EQ(m.committed_version, 0);
  ASSERT_EQ(m.tensors.size(), 3u);
  const client::TensorMeta* big = m.Find("big.weight");
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(big->spec.rowwise.format, Format::kNvfp4);
  EXPECT_EQ(big->spec.columnwise.format, Format::kFp8Block128x128);
  EXPECT_EQ(m.Find("mid.weight")->spec.columnwise_source, ColumnwiseSource::kRowwiseDequantized);
  std::set<int> daemons;
  int64_t next = 0;
  for (const client::PieceLocation& p : big->pieces) {
    daemons.insert(p.daemon_rank);
    EXPECT_EQ(p.row_begin, next);
    EXPECT_EQ(p.row_begin % 128, 0);
    next = p.row_end;
  }
  EXPECT_EQ(next, 512);
  EXPECT_EQ(daemons.size(), 2u) << "big.weight should be split across both daemons";
  EXPECT_EQ(m.Find("small.bias")->rows, 1);
  EXPECT_EQ(m.Find("small.bias")->cols, 64);
}

TEST_F(ClientTest, AssembledPiecesEqualWholeTensorQuantization) {
  std::vector<std::vector<float>> masters;
  for (const TensorData& t : model_) masters.push_back(t.values);
  ExpectMatchesReference(0, masters);
}

TEST_F(ClientTest, GradientsFromTwoPushersAreSummedOnceAndRoutedByRows) {
  // Trainer a pushes FP32, trainer b BF16; the daemons (SGD, lr 0.5, no
  // momentum) must produce master - 0.5 * (g_a + bf16(g_b)) in every row.
  std::vector<std::vector<float>> ga, gb;
  std::vector<std::vector<uint16_t>> gb16;
  std::vector<Gradient> push_a, push_b;
  for (size_t i = 0; i < model_.size(); ++i) {
    ga.push_back(Values(model_[i].values.size(), 10 + i, 0.02f));
    gb.push_back(Values(model_[i].values.size(), 20 + i, 0.03f));
    std::vector<uint16_t> b16;
    for (float g : gb.back()) b16.push_back(ref::EncodeBf16(g));
    gb16.push_back(std::move(b16));
  }
  for (size_t i = 0; i < model_.size(); ++i) {
    push_a.push_back(Gradient::Fp32(model_[i].name, ga[i]));
    push_b.push_back(Gradient::Bf16(model_[i].name, gb16[i]));
  }
  auto a = trainer_a_->PushGradients(0, push_a);
  ASSERT_TRUE(a.ok()) << a.status() << cluster_->Logs();
  EXPECT_EQ(a->pushers_received, 1);
  EXPECT_EQ(a->pushers_expected, 2);
  EXPECT_EQ(a->bytes_sent, (512 * 384 + 256 * 512 + 64) * 4);
  // The same pusher again: refused, never summed twice.
  auto again = trainer_a_->PushGradients(0, push_a);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
  // Not stepped yet: version 1 is not published.
  EXPECT_EQ(trainer_a_->WaitForVersion(1, absl::Milliseconds(200)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  auto b = trainer_b_->PushGradients(0, push_b);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->pushers_received, 2);
  auto v = trainer_a_->WaitForVersion(1, absl::Seconds(20));
  ASSERT_TRUE(v.ok()) << v.status() << cluster_->Logs();
  EXPECT_EQ(*v, 1);

  std::vector<std::vector<float>> masters;
  for (size_t i = 0; i < model_.size(); ++i) {
    std::vector<float> w = model_[i].values;
    for (size_t j = 0; j < w.size(); ++j) {
      const float g = ga[i][j] + ref::DecodeBf16(gb16[i][j]);
      w[j] -= 0.5f * g;
    }
    masters.push_back(std::move(w));
  }
  ExpectMatchesReference(1, masters);

  // A push for a version that is no longer current is refused.
  EXPECT_EQ(trainer_b_->PushGradients(0, push_b).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // One from the future, too (retry after WaitForVersion).
  EXPECT_EQ(trainer_b_->PushGradients(5, push_b).status().code(), absl::StatusCode::kOutOfRange);
}

TEST_F(ClientTest, RowwiseOnlyFetchMovesOnlyRowwiseBytes) {
  const client::Manifest m = trainer_a_->manifest();
  auto before = trainer_a_->Status(false);
  ASSERT_TRUE(before.ok()) << before.status();
  auto fetched = trainer_a_->Fetch(0, client::AllTargets(m, {Direction::kRowwise}));
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  int64_t layout_bytes = 0, fp32 = 0;
  for (const client::FetchedTensor& t : fetched->tensors) {
    EXPECT_EQ(t.value.direction, Direction::kRowwise);
    layout_bytes += t.layout.data_bytes() + t.layout.scale_bytes();
    fp32 += t.value.rows * t.value.cols * 4;
  }
  EXPECT_EQ(fetched->stats.received.columnwise, 0);
  EXPECT_EQ(fetched->stats.received.rowwise, layout_bytes);
  EXPECT_EQ(fetched->stats.fp32_equivalent.rowwise, fp32);
  EXPECT_EQ(fetched->stats.fp32_equivalent.columnwise, 0);
  EXPECT_EQ(fetched->stats.bf16_equivalent.rowwise, fp32 / 2);
  EXPECT_LT(fetched->stats.received.rowwise, fp32 / 3);  // NVFP4 + FP8 + BF16 bias
  // The daemons agree: no columnwise byte left them.
  auto after = trainer_a_->Status(false);
  ASSERT_TRUE(after.ok());
  int64_t served_row = 0, served_col = 0;
  for (int i = 0; i < after->daemons_size(); ++i) {
    served_row +=
        after->daemons(i).bytes_served_rowwise() - before->daemons(i).bytes_served_rowwise();
    served_col +=
        after->daemons(i).bytes_served_columnwise() - before->daemons(i).bytes_served_columnwise();
  }
  EXPECT_EQ(served_col, 0);
  EXPECT_GE(served_row, layout_bytes);
  // Totals accumulate across calls.
  ASSERT_TRUE(trainer_a_->Fetch(0, {{"mid.weight", Direction::kColumnwise, {}, {}}}).ok());
  const client::FetchStats totals = trainer_a_->fetch_stats();
  EXPECT_EQ(totals.received.rowwise, layout_bytes);
  EXPECT_EQ(totals.received.columnwise,
            trainer_a_->LayoutOf("mid.weight", Direction::kColumnwise)->data_bytes() +
                trainer_a_->LayoutOf("mid.weight", Direction::kColumnwise)->scale_bytes());
  EXPECT_EQ(totals.fetches, 2);
}

TEST_F(ClientTest, FetchIntoCallerBuffers) {
  auto layout = trainer_a_->LayoutOf("big.weight", Direction::kColumnwise);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_TRUE(layout->transposed);
  std::vector<uint8_t> data(layout->data_bytes(), 0xAB), scales(layout->scale_bytes(), 0xCD);
  auto mine = trainer_a_->Fetch(
      0, {{"big.weight", Direction::kColumnwise, absl::MakeSpan(data), absl::MakeSpan(scales)}});
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_TRUE(mine->tensors[0].value.data.empty());
  auto owned = trainer_a_->Fetch(0, {{"big.weight", Direction::kColumnwise, {}, {}}});
  ASSERT_TRUE(owned.ok());
  EXPECT_TRUE(owned->tensors[0].value.data == data);
  EXPECT_TRUE(owned->tensors[0].value.scales == scales);
  std::vector<uint8_t> small(layout->data_bytes() - 1);
  EXPECT_EQ(trainer_a_
                ->Fetch(0, {{"big.weight", Direction::kColumnwise, absl::MakeSpan(small),
                             absl::MakeSpan(scales)}})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientTest, BadRequestsAreRefusedAndTheClusterKeepsServing) {
  EXPECT_EQ(trainer_a_->Fetch(0, {{"nope", Direction::kRowwise, {}, {}}}).status().code(),
            absl::StatusCode::kNotFound);
  std::vector<float> g(10);
  EXPECT_EQ(trainer_a_->PushGradients(0, {Gradient::Fp32("nope", g)}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(trainer_a_->PushGradients(0, {Gradient::Fp32("big.weight", g)}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A push that leaves out tensors is refused, naming them, unless partial.
  std::vector<float> bias(64);
  const absl::Status missing =
      trainer_a_->PushGradients(0, {Gradient::Fp32("small.bias", bias)}).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument) << missing;
  EXPECT_TRUE(absl::StrContains(missing.message(), "the push misses")) << missing;
  EXPECT_TRUE(absl::StrContains(missing.message(), "big.weight")) << missing;
  auto latest = trainer_a_->Fetch(Client::kLatest, {{"small.bias", Direction::kRowwise, {}, {}}});
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->version, 0);
}

TEST_F(ClientTest, UnpublishedVersionIsDeadlineExceeded) {
  const absl::Time start = absl::Now();
  auto fetched =
      trainer_a_->Fetch(3, client::AllTargets(trainer_a_->manifest(), {Direction::kRowwise}),
                        absl::Milliseconds(500));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kDeadlineExceeded) << fetched.status();
  EXPECT_TRUE(absl::StrContains(fetched.status().message(), "version 3 not published by then"))
      << fetched.status();
  EXPECT_GE(took, absl::Milliseconds(450));
  EXPECT_LT(took, absl::Seconds(5));
  EXPECT_EQ(trainer_a_->WaitForVersion(3, absl::Milliseconds(300)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // The cluster still serves version 0.
  EXPECT_TRUE(trainer_a_->Fetch(0, {{"mid.weight", Direction::kRowwise, {}, {}}}).ok());
}

TEST_F(ClientTest, DeadDaemonIsUnavailableWithinTheDeadline) {
  const client::Manifest m = trainer_a_->manifest();
  // Kill the daemon that does not hold mid.weight (which is small enough to
  // stay whole): big.weight (split) then has a dead piece, mid.weight none.
  // Ranks follow the order of joining, so find the process by its port.
  const int alive_rank = m.Find("mid.weight")->pieces[0].daemon_rank;
  int dead_process = -1;
  for (int d = 0; d < 2; ++d) {
    std::ifstream port_file(absl::StrCat(cluster_->dir(), "/daemon", d, ".port"));
    int port = 0;
    port_file >> port;
    if (m.daemon_addresses[alive_rank] != absl::StrCat("127.0.0.1:", port)) dead_process = d;
  }
  ASSERT_GE(dead_process, 0);
  cluster_->KillDaemon(dead_process);
  const absl::Time start = absl::Now();
  auto fetched =
      trainer_a_->Fetch(0, client::AllTargets(m, {Direction::kRowwise}), absl::Seconds(10));
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kUnavailable) << fetched.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // Same for an unpublished version: no waiting on the live daemon until
  // the deadline once the dead one has failed the call.
  const absl::Time start2 = absl::Now();
  auto future =
      trainer_a_->Fetch(1, client::AllTargets(m, {Direction::kRowwise}), absl::Seconds(10));
  EXPECT_EQ(future.status().code(), absl::StatusCode::kUnavailable) << future.status();
  EXPECT_LT(absl::Now() - start2, absl::Seconds(5));
  std::vector<float> g(64);
  const absl::Time start3 = absl::Now();
  EXPECT_EQ(trainer_a_
                ->PushGradients(0, {Gradient::Fp32("small.bias", g)}, absl::Seconds(10),
                                PushCoverage::kPartial)
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start3, absl::Seconds(5));
  // Tensors held only by the live daemon are still served.
  int served = 0;
  for (const client::TensorMeta& t : m.tensors) {
    bool on_dead = false;
    for (const client::PieceLocation& p : t.pieces) on_dead |= p.daemon_rank != alive_rank;
    if (on_dead) continue;
    auto alive = trainer_a_->Fetch(0, {{t.name, Direction::kRowwise, {}, {}}});
    EXPECT_TRUE(alive.ok()) << t.name << ": " << alive.status();
    ++served;
  }
  EXPECT_GE(served, 1);
}

TEST(ClientConnect, NoCoordinatorIsUnavailableAfterTheConnectTimeout) {
  ClientOptions options;
  options.coordinator_address = "127.0.0.1:1";  // nothing listens on port 1
  options.connect_timeout = absl::Milliseconds(500);
  const absl::Time start = absl::Now();
  auto c = Client::Connect(options);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // It says why (a plain connection is refused) and how long it waited.
  EXPECT_TRUE(absl::StrContains(c.status().message(), "refused")) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "(waited 500ms)")) << c.status();
  // An empty address is $PARAMD_COORDINATOR's.
  options.coordinator_address = "";
  ASSERT_EQ(setenv("PARAMD_COORDINATOR", "127.0.0.1:1", 1), 0);
  c = Client::Connect(options);
  unsetenv("PARAMD_COORDINATOR");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "127.0.0.1:1")) << c.status();
}

TEST(ClientConnect, MalformedAddressIsRefusedAtOnce) {
  ClientOptions options;
  options.connect_timeout = absl::Seconds(20);
  for (const char* bad : {"localhost", "127.0.0.1:", "node0:70x", "h:65536"}) {
    options.coordinator_address = bad;
    const absl::Time start = absl::Now();
    auto c = Client::Connect(options);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << bad << ": " << c.status();
    EXPECT_TRUE(absl::StrContains(c.status().message(), "coordinator address")) << c.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << bad;
  }
}

}  // namespace
}  // namespace paramd
