// DecodeChunk / CopyFromSlices (client/fetch_stream.h) against protobuf's
// own parse of the same bytes, cut into slices at every boundary.
#include "client/fetch_stream.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace paramd {
namespace client {
namespace internal {
namespace {

std::vector<grpc::Slice> Cut(const std::string& bytes, std::vector<size_t> cuts) {
  std::vector<grpc::Slice> slices;
  size_t begin = 0;
  cuts.push_back(bytes.size());
  for (size_t end : cuts) {
    slices.emplace_back(bytes.data() + begin, end - begin);  // empty slices too
    begin = end;
  }
  return slices;
}

std::string Payload(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + 7) & 0xff);
  return s;
}

// Decodes `bytes` cut at `cuts` and checks the header and payload against
// protobuf's parse.
void ExpectDecodes(const std::string& bytes, const std::vector<size_t>& cuts) {
  rpc::FetchResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  ASSERT_TRUE(parsed.has_chunk());
  const std::vector<grpc::Slice> slices = Cut(bytes, cuts);
  ChunkHeader h;
  size_t slice = 0, pos = 0;
  ASSERT_TRUE(DecodeChunk(slices, &h, &slice, &pos));
  EXPECT_EQ(h.piece, parsed.chunk().piece());
  EXPECT_EQ(h.buffer, parsed.chunk().buffer());
  EXPECT_EQ(h.offset, parsed.chunk().offset());
  ASSERT_EQ(h.size, static_cast<int64_t>(parsed.chunk().data().size()));
  std::string out(h.size, 'x');
  CopyFromSlices(slices, slice, pos, h.size, reinterpret_cast<uint8_t*>(out.data()));
  EXPECT_EQ(out, parsed.chunk().data());
}

rpc::FetchResponse Chunk(int piece, rpc::BufferKind kind, int64_t offset, size_t n) {
  rpc::FetchResponse m;
  m.mutable_chunk()->set_piece(piece);
  m.mutable_chunk()->set_buffer(kind);
  m.mutable_chunk()->set_offset(offset);
  m.mutable_chunk()->set_data(Payload(n));
  return m;
}

TEST(DecodeChunkTest, MatchesProtobufAtEverySliceBoundary) {
  const std::string bytes = Chunk(3, rpc::BUFFER_SCALES, int64_t{5} << 33, 300).SerializeAsString();
  for (size_t a = 0; a <= bytes.size(); ++a) {
    ExpectDecodes(bytes, {a});
    if (a % 7 == 0) ExpectDecodes(bytes, {a / 2, a / 2, a});  // with an empty slice
  }
}

TEST(DecodeChunkTest, DefaultsLargeAndNegativeValues) {
  ExpectDecodes(Chunk(0, rpc::BUFFER_DATA, 0, 0).SerializeAsString(), {});
  ExpectDecodes(Chunk(0, rpc::BUFFER_DATA, 0, 1 << 20).SerializeAsString(), {100, 70000});
  // A negative int32 is a 10-byte varint; the caller refuses the piece.
  ExpectDecodes(Chunk(-1, rpc::BUFFER_DATA, 9, 5).SerializeAsString(), {3});
  rpc::FetchResponse m;
  m.mutable_chunk();  // an empty chunk: only the outer tag and length 0
  ExpectDecodes(m.SerializeAsString(), {});
}

TEST(DecodeChunkTest, OtherShapesAreLeftToProtobuf) {
  ChunkHeader h;
  size_t slice = 0, pos = 0;
  // The plan.
  rpc::FetchResponse plan;
  plan.mutable_plan()->set_version(4);
  EXPECT_FALSE(DecodeChunk(Cut(plan.SerializeAsString(), {}), &h, &slice, &pos));
  // An empty message.
  EXPECT_FALSE(DecodeChunk(Cut("", {}), &h, &slice, &pos));
  const std::string chunk = Chunk(1, rpc::BUFFER_DATA, 8, 16).SerializeAsString();
  // Something after the chunk (a second oneof member: protobuf's rules).
  EXPECT_FALSE(DecodeChunk(Cut(chunk + plan.SerializeAsString(), {}), &h, &slice, &pos));
  // An unknown field inside the chunk (field 9, varint 1).
  std::string inner = Chunk(1, rpc::BUFFER_DATA, 8, 16).chunk().SerializeAsString();
  inner += std::string("\x48\x01", 2);
  std::string unknown = "\x12";
  unknown += static_cast<char>(inner.size());
  unknown += inner;
  rpc::FetchResponse check;
  ASSERT_TRUE(check.ParseFromString(unknown));
  EXPECT_FALSE(DecodeChunk(Cut(unknown, {}), &h, &slice, &pos));
}

TEST(DecodeChunkTest, TruncatedOrOverlongMessagesAreRefused) {
  ChunkHeader h;
  size_t slice = 0, pos = 0;
  const std::string chunk = Chunk(2, rpc::BUFFER_DATA, 1024, 64).SerializeAsString();
  for (size_t n = 0; n < chunk.size(); ++n) {
    EXPECT_FALSE(DecodeChunk(Cut(chunk.substr(0, n), {}), &h, &slice, &pos)) << n;
  }
  // A data length reaching past the end of the chunk.
  std::string bad = chunk;
  bad[bad.size() - 64 - 1] = 65;
  EXPECT_FALSE(DecodeChunk(Cut(bad, {}), &h, &slice, &pos));
  // Eleven continuation bytes: no varint.
  EXPECT_FALSE(DecodeChunk(Cut(std::string("\x12\x0c\x08") + std::string(11, '\x80'), {}), &h,
                           &slice, &pos));
}

}  // namespace
}  // namespace internal
}  // namespace client
}  // namespace paramd
