// Raw Daemon.Fetch stream reading (client/fetch_stream.h): chunk payloads
// are copied once, from gRPC's slices into the destination.
#include "client/fetch_stream.h"

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"

#include "grpcpp/impl/codegen/proto_utils.h"  // protobuf SerializationTraits (the request)
#include "grpcpp/support/proto_buffer_reader.h"

namespace paramd {
namespace client {
namespace internal {
namespace {

// The protobuf wire format (FetchResponse.chunk = 2, FetchChunk fields 1-4).
constexpr uint32_t kWireVarint = 0;
constexpr uint32_t kWireLen = 2;
constexpr uint64_t kChunkTag = (2 << 3) | kWireLen;

// A read position in a list of slices; every read checks the bytes left.
class Cursor {
 public:
  explicit Cursor(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& s : slices_) total_ += s.size();
    SkipEmpty();
  }
  size_t consumed() const { return consumed_; }
  size_t total() const { return total_; }
  size_t slice() const { return slice_; }
  size_t pos() const { return pos_; }

  bool ReadVarint(uint64_t* v) {
    uint64_t result = 0;
    for (int shift = 0; shift < 70; shift += 7) {
      if (consumed_ >= total_) return false;
      const uint8_t b = slices_[slice_].begin()[pos_];
      Advance(1);
      result |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) {
        *v = result;
        return true;
      }
    }
    return false;  // longer than 10 bytes
  }

  bool Skip(uint64_t n) {
    if (n > total_ - consumed_) return false;
    while (n > 0) {
      const size_t here = std::min<uint64_t>(n, slices_[slice_].size() - pos_);
      Advance(here);
      n -= here;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    pos_ += n;
    consumed_ += n;
    SkipEmpty();
  }
  void SkipEmpty() {
    while (slice_ < slices_.size() && pos_ >= slices_[slice_].size()) {
      ++slice_;
      pos_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t total_ = 0, consumed_ = 0;
  size_t slice_ = 0, pos_ = 0;
};

}  // namespace

FetchMethod::FetchMethod(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)),
      // The generated stub's name and type for Daemon.Fetch.
      method_("/paramd.rpc.Daemon/Fetch", grpc::internal::RpcMethod::SERVER_STREAMING, channel_) {}

bool DecodeChunk(const std::vector<grpc::Slice>& slices, ChunkHeader* header, size_t* slice,
                 size_t* pos) {
  Cursor c(slices);
  uint64_t tag = 0, length = 0;
  if (!c.ReadVarint(&tag) || tag != kChunkTag || !c.ReadVarint(&length)) return false;
  // The chunk is the whole message (nothing after it: another field would
  // need protobuf's merge rules).
  if (length != c.total() - c.consumed()) return false;
  ChunkHeader h;
  size_t data_slice = 0, data_pos = 0;
  while (c.consumed() < c.total()) {
    uint64_t field = 0, value = 0;
    if (!c.ReadVarint(&field)) return false;
    const uint32_t wire = field & 7;
    field >>= 3;
    if (field >= 1 && field <= 3 && wire == kWireVarint) {
      if (!c.ReadVarint(&value)) return false;
      // int32 / enum / int64 as protobuf reads them (two's complement).
      if (field == 1) h.piece = static_cast<int32_t>(value);
      if (field == 2) h.buffer = static_cast<int32_t>(value);
      if (field == 3) h.offset = static_cast<int64_t>(value);
    } else if (field == 4 && wire == kWireLen) {
      if (!c.ReadVarint(&value) || value > c.total() - c.consumed()) return false;
      h.size = static_cast<int64_t>(value);
      data_slice = c.slice();
      data_pos = c.pos();
      c.Skip(value);
    } else {
      return false;  // unknown field or wire type: protobuf decides
    }
  }
  *header = h;
  *slice = data_slice;
  *pos = data_pos;
  return true;
}

FetchStreamReader::FetchStreamReader(const FetchMethod& method, grpc::ClientContext* context,
                                     const rpc::FetchRequest& request)
    : reader_(grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
          method.channel(), method.method(), context, request)) {}

absl::StatusOr<bool> FetchStreamReader::Next() {
  slices_.clear();  // the previous message's slices
  if (!reader_->Read(&buffer_)) return false;
  if (buffer_.Dump(&slices_).ok() && DecodeChunk(slices_, &chunk_, &data_slice_, &data_pos_)) {
    is_chunk_ = true;
    parsed_chunk_ = false;
    return true;
  }
  is_chunk_ = false;
  grpc::ProtoBufferReader reader(&buffer_);
  if (!message_.ParseFromZeroCopyStream(&reader)) {
    return absl::InternalError("a Fetch message that does not parse as paramd.rpc.FetchResponse");
  }
  if (message_.has_chunk()) {
    // A chunk in another shape (e.g. fields in another order): the same
    // chunk, its payload copied from the parsed string.
    chunk_.piece = message_.chunk().piece();
    chunk_.buffer = message_.chunk().buffer();
    chunk_.offset = message_.chunk().offset();
    chunk_.size = static_cast<int64_t>(message_.chunk().data().size());
    parsed_chunk_ = true;
    is_chunk_ = true;
  } else {
    parsed_chunk_ = false;
  }
  return true;
}

void FetchStreamReader::CopyChunkData(uint8_t* dst) const {
  if (parsed_chunk_) {
    std::memcpy(dst, message_.chunk().data().data(), message_.chunk().data().size());
    return;
  }
  CopyFromSlices(slices_, data_slice_, data_pos_, chunk_.size, dst);
}

void CopyFromSlices(const std::vector<grpc::Slice>& slices, size_t slice, size_t pos, int64_t size,
                    uint8_t* dst) {
  int64_t left = size;
  while (left > 0) {
    const grpc::Slice& s = slices[slice];
    const size_t n = std::min<size_t>(left, s.size() - pos);
    std::memcpy(dst, s.begin() + pos, n);
    dst += n;
    left -= static_cast<int64_t>(n);
    ++slice;
    pos = 0;
  }
}

}  // namespace internal
}  // namespace client
}  // namespace paramd
