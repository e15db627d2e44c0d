#include "client/cluster_admin.h"

#include <chrono>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "checkpoint/export_dir.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "proto/checkpoint_service.grpc.pb.h"

namespace paramd {
namespace client {

absl::StatusOr<VersionReader> OpenVersion(Client& client, const OpenVersionOptions& options) {
  ASSIGN_OR_RETURN(const Manifest manifest,
                   client.RefreshManifest(options.timeout, /*with_frozen_data=*/true));
  if (manifest.committed_version < 0) return absl::FailedPreconditionError("no model loaded");
  if (options.version > manifest.committed_version) {
    return absl::FailedPreconditionError(
        absl::StrCat("version ", options.version,
                     " is not committed yet (committed: ", manifest.committed_version, ")"));
  }
  checkpoint::RemoteExportOptions remote;
  remote.values = options.values;
  remote.version =
      static_cast<uint64_t>(options.version >= 0 ? options.version : manifest.committed_version);
  remote.checkpoint_dir = options.checkpoint_dir;
  remote.security = client.security();
  VersionReader reader;
  reader.version = remote.version;
  std::map<std::string, std::vector<checkpoint::RemotePiece>> pieces;
  for (const TensorMeta& tensor : manifest.tensors) {
    reader.tensors.push_back({tensor.name, tensor.shape, tensor.rows, tensor.cols});
    for (const PieceLocation& piece : tensor.pieces) {
      pieces[tensor.name].push_back({piece.row_begin, piece.row_end, piece.daemon_address});
    }
  }
  reader.source = checkpoint::NewRemoteExportSource(std::move(pieces), std::move(remote));
  reader.frozen = manifest.frozen;
  return reader;
}

absl::StatusOr<ExportVersionResult> ExportVersion(Client& client, const OpenVersionOptions& options,
                                                  const checkpoint::ExportOptions& export_options,
                                                  bool overwrite) {
  if (!overwrite) {  // refuse a non-empty directory before any work
    RETURN_IF_ERROR(checkpoint::PrepareExportDir(export_options.out_dir, false).status());
  }
  ASSIGN_OR_RETURN(VersionReader reader, OpenVersion(client, options));
  ExportVersionResult result;
  result.version = reader.version;
  if (overwrite) {
    ASSIGN_OR_RETURN(result.removed, checkpoint::PrepareExportDir(export_options.out_dir, true));
  }
  ASSIGN_OR_RETURN(result.files, checkpoint::ExportSafetensors(reader.tensors, *reader.source,
                                                               export_options, reader.frozen));
  return result;
}

namespace {

using Stub = checkpoint::CheckpointCoordinator::Stub;

template <class Request, class Response>
absl::StatusOr<Response> Invoke(Client& client,
                                grpc::Status (Stub::*call)(grpc::ClientContext*, const Request&,
                                                           Response*),
                                const Request& request, absl::Duration timeout) {
  auto stub = checkpoint::CheckpointCoordinator::NewStub(client.CoordinatorChannel());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
  Response response;
  RETURN_IF_ERROR(FromGrpcStatus((stub.get()->*call)(&context, request, &response), "coordinator"));
  return response;
}

}  // namespace

absl::StatusOr<checkpoint::CheckpointResponse> Checkpoint(
    Client& client, const checkpoint::CheckpointRequest& request, absl::Duration timeout) {
  return Invoke(client, &Stub::Checkpoint, request, timeout);
}

absl::StatusOr<checkpoint::ListCheckpointsResponse> ListCheckpoints(
    Client& client, const checkpoint::ListCheckpointsRequest& request, absl::Duration timeout) {
  return Invoke(client, &Stub::ListCheckpoints, request, timeout);
}

absl::StatusOr<checkpoint::DescribeCheckpointResponse> DescribeCheckpoint(
    Client& client, const checkpoint::DescribeCheckpointRequest& request, absl::Duration timeout) {
  return Invoke(client, &Stub::DescribeCheckpoint, request, timeout);
}

}  // namespace client
}  // namespace paramd
