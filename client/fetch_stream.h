// File: client/fetch_stream.h
//
// Inside client::Client (not for users): the client side of a Daemon.Fetch
// stream read as raw gRPC messages, so that a chunk's payload is copied
// once, from gRPC's receive buffers straight into the caller's destination.
//
// Why: read through the generated stub, every FetchChunk's `data` (1 MiB by
// default) is first parsed into a freshly allocated std::string and then
// copied into the destination: two copies and one large allocation per
// chunk. That second copy and the allocator's behaviour (trimming and
// re-faulting heap pages, relative alignment of source and destination)
// depend on the state of the calling process, which made the same fetch
// slower inside a Python process than in a small C++ program.
//
// FetchStreamReader reads each message as a grpc::ByteBuffer. A message of
// the canonical shape `chunk { piece buffer offset data }` (as the daemon
// writes it) is decoded here without copying its payload; anything else
// (the plan, or fields in an unexpected shape) is parsed by protobuf into
// rpc::FetchResponse as before, so every valid message is accepted.
//
// Threading: one reader per stream, used from one thread. Blocking: Next()
// blocks until a message arrives or the stream ends.
#ifndef PARAMD_CLIENT_FETCH_STREAM_H_
#define PARAMD_CLIENT_FETCH_STREAM_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/sync_stream.h"
#include "proto/paramd.pb.h"

namespace paramd {
namespace client {
namespace internal {

// The Daemon.Fetch method of one channel, registered once (what the
// generated stub holds as rpcmethod_Fetch_).
class FetchMethod {
 public:
  explicit FetchMethod(std::shared_ptr<grpc::Channel> channel);
  grpc::Channel* channel() const { return channel_.get(); }
  const grpc::internal::RpcMethod& method() const { return method_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  grpc::internal::RpcMethod method_;
};

// A chunk decoded without its payload: the payload is `size` bytes that
// CopyChunkData copies out.
struct ChunkHeader {
  int32_t piece = 0;
  int32_t buffer = 0;  // rpc::BufferKind
  int64_t offset = 0;
  int64_t size = 0;
};

// Decodes `slices` (one serialized FetchResponse) if it is a chunk in the
// canonical shape: returns true and fills `header` and the payload's
// position (`slice`, `pos`: the payload starts at byte `pos` of
// slices[slice]). Returns false for anything else (the caller then parses
// the message with protobuf). Never reads past the slices.
bool DecodeChunk(const std::vector<grpc::Slice>& slices, ChunkHeader* header, size_t* slice,
                 size_t* pos);

// Copies `size` bytes starting at byte `pos` of slices[slice] (and on into
// the following slices) to `dst`; the bytes must be there.
void CopyFromSlices(const std::vector<grpc::Slice>& slices, size_t slice, size_t pos, int64_t size,
                    uint8_t* dst);

class FetchStreamReader {
 public:
  // Starts the call (as Daemon::Stub::Fetch does). `method` and `context`
  // outlive the reader.
  FetchStreamReader(const FetchMethod& method, grpc::ClientContext* context,
                    const rpc::FetchRequest& request);

  // The next message: true, or false at the end of the stream (then
  // Finish()); INTERNAL for a message that does not parse. After true:
  // is_chunk() says whether chunk() (and CopyChunkData) or message() holds
  // it.
  absl::StatusOr<bool> Next();
  bool is_chunk() const { return is_chunk_; }
  const ChunkHeader& chunk() const { return chunk_; }
  const rpc::FetchResponse& message() const { return message_; }
  // Copies the current chunk's payload (chunk().size bytes) to `dst`.
  void CopyChunkData(uint8_t* dst) const;

  grpc::Status Finish() { return reader_->Finish(); }

 private:
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader_;
  grpc::ByteBuffer buffer_;
  std::vector<grpc::Slice> slices_;
  bool is_chunk_ = false;
  ChunkHeader chunk_;
  size_t data_slice_ = 0, data_pos_ = 0;
  // The chunk came through protobuf (payload in message_.chunk().data()).
  bool parsed_chunk_ = false;
  rpc::FetchResponse message_;
};

}  // namespace internal
}  // namespace client
}  // namespace paramd

#endif  // PARAMD_CLIENT_FETCH_STREAM_H_
