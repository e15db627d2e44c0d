#include "checkpoint/remote_export.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/checkpoint_service.grpc.pb.h"

namespace paramd {
namespace checkpoint {
namespace {

class RemoteExportSource : public ExportSource {
 public:
  RemoteExportSource(std::map<std::string, std::vector<RemotePiece>> pieces,
                     RemoteExportOptions options)
      : pieces_(std::move(pieces)), options_(std::move(options)) {}

  absl::Status StreamTensor(const ExportTensor& tensor, ExportDtype dtype,
                            const Sink& sink) override {
    auto it = pieces_.find(tensor.name);
    if (it == pieces_.end()) {
      return absl::NotFoundError(absl::StrCat("no daemon holds tensor ", tensor.name));
    }
    int64_t next_row = 0;
    for (const RemotePiece& piece : it->second) {
      if (piece.row_begin != next_row || piece.row_end <= piece.row_begin) {
        return absl::InternalError(
            absl::StrCat("pieces of ", tensor.name, " do not tile its rows at row ", next_row));
      }
      RETURN_IF_ERROR(StreamPiece(tensor, piece, dtype, sink));
      next_row = piece.row_end;
    }
    if (next_row != tensor.rows) {
      return absl::InternalError(
          absl::StrCat("pieces of ", tensor.name, " end at row ", next_row, " of ", tensor.rows));
    }
    return absl::OkStatus();
  }

 private:
  absl::Status StreamPiece(const ExportTensor& tensor, const RemotePiece& piece, ExportDtype dtype,
                           const Sink& sink) {
    ExportRowsRequest request;
    request.set_version(options_.version);
    request.set_tensor(tensor.name);
    request.set_row_begin(piece.row_begin);
    request.set_row_end(piece.row_end);
    request.set_cols(tensor.cols);
    request.set_dtype(dtype == ExportDtype::kFp32 ? EXPORT_DTYPE_FP32 : EXPORT_DTYPE_BF16);
    request.set_values(static_cast<ExportValues>(options_.values));
    request.set_max_chunk_bytes(options_.max_chunk_bytes);
    request.set_checkpoint_dir(options_.checkpoint_dir);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(options_.piece_timeout));
    auto reader = StubFor(piece.address)->ExportRows(&context, request);
    const std::string where =
        absl::StrCat("ExportRows of ", tensor.name, " rows [", piece.row_begin, ", ", piece.row_end,
                     ") from ", piece.address);
    ExportRowsChunk chunk;
    int64_t offset = 0;
    absl::Status sink_status;
    while (reader->Read(&chunk)) {
      if (chunk.offset() != offset) {
        sink_status = absl::InternalError(
            absl::StrCat(where, ": chunk at byte ", chunk.offset(), ", expected ", offset));
        break;
      }
      sink_status = sink(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(chunk.data().data()),
                                             chunk.data().size()));
      if (!sink_status.ok()) break;
      offset += static_cast<int64_t>(chunk.data().size());
    }
    if (!sink_status.ok()) {
      context.TryCancel();
      reader->Finish();
      return sink_status;
    }
    RETURN_IF_ERROR(FromGrpcStatus(reader->Finish(), where));
    const int64_t expected =
        (piece.row_end - piece.row_begin) * tensor.cols * ExportDtypeSize(dtype);
    if (offset != expected) {
      return absl::InternalError(absl::StrCat(where, ": ", offset, " bytes, expected ", expected));
    }
    return absl::OkStatus();
  }

  CheckpointDaemon::Stub* StubFor(const std::string& address) {
    auto& stub = stubs_[address];
    if (stub == nullptr) {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(-1);
      stub = CheckpointDaemon::NewStub(auth::CreateChannel(address, options_.security, args));
    }
    return stub.get();
  }

  const std::map<std::string, std::vector<RemotePiece>> pieces_;
  const RemoteExportOptions options_;
  std::map<std::string, std::unique_ptr<CheckpointDaemon::Stub>> stubs_;
};

}  // namespace

std::unique_ptr<ExportSource> NewRemoteExportSource(
    std::map<std::string, std::vector<RemotePiece>> pieces, RemoteExportOptions options) {
  return std::make_unique<RemoteExportSource>(std::move(pieces), std::move(options));
}

}  // namespace checkpoint
}  // namespace paramd
