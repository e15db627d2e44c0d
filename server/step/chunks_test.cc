#include "server/step/chunks.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "format/convert.h"
#include "gtest/gtest.h"

namespace paramd {
namespace {

// Tensor "a" [256 x 4]: rows [0,128) on daemon 0, [128,256) on daemon 1.
// Tensor "b" [2 x 3] whole on daemon 0.
ModelView View() {
  rpc::Manifest m;
  auto add_tensor = [&](const std::string& name, int64_t rows, int64_t cols) {
    rpc::TensorInfo* t = m.add_tensors();
    t->set_name(name);
    t->set_rows(rows);
    t->set_cols(cols);
    *t->mutable_spec() = HybridSpecToProto(HybridSpec());
  };
  auto add_piece = [&](const std::string& name, int64_t b, int64_t e, int rank) {
    rpc::ShardPiece* p = m.add_pieces();
    p->set_tensor(name);
    p->set_row_begin(b);
    p->set_row_end(e);
    p->set_daemon_rank(rank);
  };
  add_tensor("a", 256, 4);
  add_tensor("b", 2, 3);
  add_piece("a", 0, 128, 0);
  add_piece("a", 128, 256, 1);
  add_piece("b", 0, 2, 0);
  absl::StatusOr<ModelView> v = MakeModelView(m, 0, 1);
  EXPECT_TRUE(v.ok()) << v.status();
  return *v;
}

std::string Fp32(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

rpc::GradientChunk Chunk(const std::string& tensor, int64_t b, int64_t e, std::string data,
                         int64_t offset = 0, rpc::DType dtype = rpc::DTYPE_FP32) {
  rpc::GradientChunk c;
  c.set_tensor(tensor);
  c.set_row_begin(b);
  c.set_row_end(e);
  c.set_dtype(dtype);
  c.set_offset(offset);
  c.set_data(std::move(data));
  return c;
}

TEST(ChunksTest, ViewHoldsOnlyThisDaemonsShards) {
  const ModelView v = View();
  ASSERT_EQ(v.shards.size(), 2u);
  EXPECT_EQ(v.FindShard(0, 0, 128), 0);
  EXPECT_EQ(v.FindShard(0, 120, 130), -1);
  EXPECT_EQ(v.FindShard(1, 1, 2), 1);
}

TEST(ChunksTest, AssemblesChunkedPieces) {
  const ModelView v = View();
  ChunkAssembler a(&v, /*allow_non_finite=*/false);
  // Rows [0,1) of "b" in two FP32 chunks, then rows [1,2) as BF16.
  ASSERT_TRUE(a.Add(Chunk("b", 0, 1, Fp32({1.0f, 2.0f}))).ok());
  EXPECT_FALSE(a.Close().ok());  // incomplete piece
  ASSERT_TRUE(a.Add(Chunk("b", 0, 1, Fp32({3.0f}), 8)).ok());
  ASSERT_TRUE(
      a.Add(Chunk("b", 1, 2, std::string("\x80\x3F\x00\x40\x40\xC0", 6), 0, rpc::DTYPE_BF16)).ok());
  ASSERT_TRUE(a.Close().ok());
  ASSERT_EQ(a.pieces().size(), 2u);
  EXPECT_EQ(a.pieces()[0].values, (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(a.pieces()[1].values, (std::vector<float>{1, 2, -3}));
  EXPECT_EQ(a.pieces()[1].shard, 1);
  EXPECT_EQ(a.bytes(), 12 + 6);
}

TEST(ChunksTest, RefusesBadChunksWithTheRightCode) {
  const ModelView v = View();
  struct Case {
    const char* name;
    rpc::GradientChunk chunk;
    absl::StatusCode code;
  };
  const std::vector<Case> cases = {
      {"unknown tensor", Chunk("nope", 0, 1, Fp32({1})), absl::StatusCode::kNotFound},
      {"unspecified dtype", Chunk("b", 0, 1, Fp32({1, 2, 3}), 0, rpc::DTYPE_UNSPECIFIED),
       absl::StatusCode::kInvalidArgument},
      {"rows outside", Chunk("b", 1, 3, Fp32({1})), absl::StatusCode::kInvalidArgument},
      {"empty range", Chunk("b", 1, 1, ""), absl::StatusCode::kInvalidArgument},
      {"other daemon's rows", Chunk("a", 128, 129, Fp32({1, 2, 3, 4})),
       absl::StatusCode::kFailedPrecondition},
      {"spans shards", Chunk("a", 100, 140, ""), absl::StatusCode::kFailedPrecondition},
      {"first offset not 0", Chunk("b", 0, 1, Fp32({1}), 4), absl::StatusCode::kInvalidArgument},
      {"too many bytes", Chunk("b", 0, 1, Fp32({1, 2, 3, 4})), absl::StatusCode::kInvalidArgument},
      {"split element", Chunk("b", 0, 1, "abc"), absl::StatusCode::kInvalidArgument},
      {"NaN gradient", Chunk("b", 0, 1, Fp32({1, std::nanf(""), 3})),
       absl::StatusCode::kInvalidArgument},
      {"Inf gradient", Chunk("b", 0, 1, Fp32({1, std::numeric_limits<float>::infinity(), 3})),
       absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    ChunkAssembler a(&v, false);
    EXPECT_EQ(a.Add(c.chunk).code(), c.code) << c.name;
  }
}

TEST(ChunksTest, RefusesOutOfOrderAndOverlap) {
  const ModelView v = View();
  {
    ChunkAssembler a(&v, false);
    ASSERT_TRUE(a.Add(Chunk("b", 0, 1, Fp32({1}))).ok());
    // Another piece before the first is complete.
    EXPECT_EQ(a.Add(Chunk("b", 1, 2, Fp32({1, 2, 3}))).code(), absl::StatusCode::kInvalidArgument);
  }
  {
    ChunkAssembler a(&v, false);
    ASSERT_TRUE(a.Add(Chunk("b", 0, 1, Fp32({1}))).ok());
    EXPECT_EQ(a.Add(Chunk("b", 0, 1, Fp32({1}), 8)).code(), absl::StatusCode::kInvalidArgument);
  }
  {
    ChunkAssembler a(&v, false);
    ASSERT_TRUE(a.Add(Chunk("b", 0, 2, Fp32({1, 2, 3, 4, 5, 6}))).ok());
    EXPECT_EQ(a.Add(Chunk("b", 1, 2, Fp32({1, 2, 3}))).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(ChunksTest, WeightsMayBeNonFinite) {
  const ModelView v = View();
  ChunkAssembler a(&v, /*allow_non_finite=*/true);
  EXPECT_TRUE(a.Add(Chunk("b", 0, 1, Fp32({1, std::nanf(""), 3}))).ok());
}

}  // namespace
}  // namespace paramd
