#include "server/rpc/request_checks.h"

#include <limits>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace paramd {
namespace {

rpc::TensorDecl Decl(const std::string& name, std::vector<int64_t> shape) {
  rpc::TensorDecl d;
  d.set_name(name);
  for (int64_t s : shape) d.add_shape(s);
  return d;
}

TEST(RequestChecks, LoadRequestSources) {
  const RequestLimits limits;
  rpc::LoadRequest r;
  EXPECT_EQ(CheckLoadRequest(r, limits).code(), absl::StatusCode::kInvalidArgument);
  r.set_safetensors_path("/m.safetensors");
  EXPECT_TRUE(CheckLoadRequest(r, limits).ok());
  *r.add_tensors() = Decl("w", {2, 3});
  EXPECT_EQ(CheckLoadRequest(r, limits).code(), absl::StatusCode::kInvalidArgument);
  r.clear_safetensors_path();
  EXPECT_TRUE(CheckLoadRequest(r, limits).ok());
  r.set_checkpoint_version(-7);
  EXPECT_EQ(CheckLoadRequest(r, limits).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RequestChecks, DeclaredTensors) {
  RequestLimits limits;
  limits.max_tensors = 3;
  auto check = [&](std::vector<rpc::TensorDecl> d) { return CheckTensorDecls(d, limits); };
  EXPECT_TRUE(check({Decl("a", {2, 3}), Decl("b", {}), Decl("c", {7})}).ok());
  const absl::Status many = check({Decl("a", {1}), Decl("b", {1}), Decl("c", {1}), Decl("d", {1})});
  EXPECT_EQ(many.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(many.message(), "--max_tensors")) << many;
  EXPECT_EQ(check({Decl(std::string(2000, 'x'), {1})}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(check({Decl(std::string("a\0b", 3), {1})}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(check({Decl("a", {1}), Decl("a", {2})}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(check({Decl("a", {0, 3})}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(check({Decl("a", {-1})}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(check({Decl("a", {1 << 30, 1 << 30, 1 << 30})}).code(),
            absl::StatusCode::kInvalidArgument)
      << "overflow";
  EXPECT_EQ(check({Decl("a", {1, 1, 1, 1, 1, 1, 1, 1, 1})}).code(),
            absl::StatusCode::kInvalidArgument);
}

FrozenTensor Frozen(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                    size_t bytes) {
  FrozenTensor f;
  f.set_name(name);
  f.set_dtype(dtype);
  for (int64_t s : shape) f.add_shape(s);
  f.set_data(std::string(bytes, '\1'));
  return f;
}

TEST(RequestChecks, FrozenBuffers) {
  RequestLimits limits;
  limits.max_frozen_bytes = 100;
  const std::vector<rpc::TensorDecl> tensors = {Decl("w", {2, 3})};
  google::protobuf::RepeatedPtrField<FrozenTensor> frozen;
  *frozen.Add() = Frozen("ids", "I64", {1, 4}, 32);
  *frozen.Add() = Frozen("step", "I64", {}, 8);  // a scalar
  *frozen.Add() = Frozen("mask", "BOOL", {0, 3}, 0);
  EXPECT_TRUE(CheckFrozenTensors(frozen, tensors, limits).ok());

  auto refused = [&](FrozenTensor f, absl::StatusCode code, const std::string& says) {
    google::protobuf::RepeatedPtrField<FrozenTensor> bad = frozen;
    *bad.Add() = std::move(f);
    const absl::Status s = CheckFrozenTensors(bad, tensors, limits);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), says)) << s;
  };
  refused(Frozen("w", "I32", {1}, 4), absl::StatusCode::kInvalidArgument, "named twice");
  refused(Frozen("ids", "I32", {1}, 4), absl::StatusCode::kInvalidArgument, "named twice");
  refused(Frozen("x", "I128", {1}, 16), absl::StatusCode::kInvalidArgument, "I128");
  refused(Frozen("x", "I32", {2}, 4), absl::StatusCode::kInvalidArgument, "need 8");
  refused(Frozen("x", "I32", {-1}, 0), absl::StatusCode::kInvalidArgument, "negative");
  refused(Frozen("x", "I64", {int64_t{1} << 40, int64_t{1} << 40}, 0),
          absl::StatusCode::kInvalidArgument, "overflows");
  refused(Frozen("x", "U8", {1, 1, 1, 1, 1, 1, 1, 1, 1}, 1), absl::StatusCode::kInvalidArgument,
          "dimensions");
  refused(Frozen("", "U8", {1}, 1), absl::StatusCode::kInvalidArgument, "");
  refused(Frozen("x", "F64", {8}, 64), absl::StatusCode::kResourceExhausted,
          "--max_frozen_bytes=100");
  // Before the data is read (a safetensors file): the sizes alone.
  google::protobuf::RepeatedPtrField<FrozenTensor> declared = frozen;
  for (FrozenTensor& f : declared) f.clear_data();
  EXPECT_TRUE(CheckFrozenTensors(declared, tensors, limits, /*check_data=*/false).ok());
  EXPECT_EQ(CheckFrozenTensors(declared, tensors, limits).code(),
            absl::StatusCode::kInvalidArgument);

  // In a Load: beside declared tensors only.
  rpc::LoadRequest load;
  *load.add_tensors() = tensors[0];
  *load.mutable_frozen() = frozen;
  EXPECT_TRUE(CheckLoadRequest(load, limits).ok());
  load.clear_tensors();
  load.set_checkpoint_path("/ckpt");
  EXPECT_EQ(CheckLoadRequest(load, limits).code(), absl::StatusCode::kInvalidArgument);
  load.clear_checkpoint_path();
  load.set_safetensors_path("/m.safetensors");
  EXPECT_EQ(CheckLoadRequest(load, limits).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RequestChecks, LoadShardsNeedsAManifest) {
  const RequestLimits limits;
  rpc::LoadShardsRequest r;
  const absl::Status empty = CheckLoadShardsRequest(r, limits);
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(empty.message(), "no tensors")) << empty;
  rpc::TensorInfo* t = r.mutable_manifest()->add_tensors();
  t->set_name("w");
  t->set_rows(4);
  t->set_cols(8);
  EXPECT_TRUE(CheckLoadShardsRequest(r, limits).ok());
  r.set_daemon_rank(-1);
  EXPECT_EQ(CheckLoadShardsRequest(r, limits).code(), absl::StatusCode::kInvalidArgument);
  r.set_daemon_rank(0);
  t->set_name(std::string(5000, 'n'));
  EXPECT_EQ(CheckLoadShardsRequest(r, limits).code(), absl::StatusCode::kInvalidArgument);
  t->set_name("w");
  t->set_cols(0);
  EXPECT_EQ(CheckLoadShardsRequest(r, limits).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RequestChecks, FetchVersionAndChunkSize) {
  const RequestLimits limits;
  rpc::FetchRequest r;
  EXPECT_TRUE(CheckFetchRequest(r, limits).ok());
  r.set_version(-1);
  EXPECT_TRUE(CheckFetchRequest(r, limits).ok()) << "-1 = latest";
  r.set_version(-7);
  EXPECT_EQ(CheckFetchRequest(r, limits).code(), absl::StatusCode::kInvalidArgument);
  r.set_version(3);
  r.set_max_chunk_bytes(1);
  const absl::Status tiny = CheckFetchRequest(r, limits);
  EXPECT_EQ(tiny.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(tiny.message(), "--min_chunk_bytes")) << tiny;
  r.set_max_chunk_bytes(4096);
  EXPECT_TRUE(CheckFetchRequest(r, limits).ok());
  r.add_tensors()->add_directions(static_cast<rpc::Direction>(9));
  EXPECT_EQ(CheckFetchRequest(r, limits).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RequestChecks, DaemonStepFromANegativeVersionIsRefused) {
  rpc::DaemonStepRequest r;
  EXPECT_TRUE(CheckDaemonStepRequest(r).ok());
  r.set_version(-1);
  EXPECT_EQ(CheckDaemonStepRequest(r).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RequestChecks, MemoryBudget) {
  rpc::Manifest m;
  rpc::TensorInfo* t = m.add_tensors();
  t->set_name("w");
  t->set_rows(1000);
  t->set_cols(100);
  t->mutable_spec()->mutable_rowwise()->set_format(rpc::FORMAT_IDENTITY_FP32);
  t->mutable_spec()->mutable_columnwise()->set_format(rpc::FORMAT_FP8_CURRENT);
  for (int rank = 0; rank < 2; ++rank) {
    rpc::ShardPiece* p = m.add_pieces();
    p->set_tensor("w");
    p->set_row_begin(rank * 500);
    p->set_row_end(rank * 500 + 500);
    p->set_daemon_rank(rank);
  }
  // 50000 elements x (16 + 2 x 4 + 2 x 2) bytes each.
  EXPECT_EQ(EstimateDaemonBytes(m, 0), 50000 * 28);
  EXPECT_EQ(EstimateDaemonBytes(m, 2), 0);
  RequestLimits limits;
  EXPECT_TRUE(CheckMemoryBudget(m, limits).ok()) << "0 = no check";
  limits.memory_budget_bytes = 50000 * 28;
  EXPECT_TRUE(CheckMemoryBudget(m, limits).ok());
  limits.memory_budget_bytes -= 1;
  const absl::Status s = CheckMemoryBudget(m, limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(s.message(), "--memory_budget_bytes")) << s;
  // Overflow saturates instead of wrapping to a small number.
  t->set_rows(int64_t{1} << 40);
  t->set_cols(int64_t{1} << 40);
  m.mutable_pieces(0)->set_row_end(int64_t{1} << 40);
  EXPECT_EQ(EstimateDaemonBytes(m, 0), std::numeric_limits<int64_t>::max());
}

}  // namespace
}  // namespace paramd
