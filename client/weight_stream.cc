#include "client/weight_stream.h"

#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/paramd.grpc.pb.h"

namespace paramd {
namespace client {
namespace {

constexpr int64_t kChunkBytes = 1 << 20;

std::chrono::system_clock::time_point ToChrono(absl::Time t) { return absl::ToChronoTime(t); }

}  // namespace

absl::StatusOr<int64_t> StreamLoad(Client& client, const std::vector<WeightSource>& sources,
                                   const std::string& recipe_text,
                                   const std::function<void(const StreamProgress&)>& progress,
                                   absl::Duration timeout, bool replace_model,
                                   const std::vector<FrozenTensor>& frozen) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<std::pair<std::string, std::vector<int64_t>>> decls;
  std::map<std::string, const WeightSource*> by_name;
  for (const WeightSource& s : sources) {
    if (!s.read) return absl::InvalidArgumentError(absl::StrCat(s.name, ": no reader"));
    if (!by_name.emplace(s.name, &s).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", s.name, "' given twice"));
    }
    decls.emplace_back(s.name, s.shape);
  }
  ASSIGN_OR_RETURN(const int64_t declared,
                   client.LoadDeclared(decls, recipe_text, timeout, replace_model, frozen));
  (void)declared;
  const Manifest manifest = client.manifest();

  StreamProgress done;
  for (const TensorMeta& t : manifest.tensors) {
    const WeightSource* s = by_name.at(t.name);
    done.bytes_total += t.rows * t.cols * (s->dtype == Gradient::DType::kFp32 ? 4 : 2);
  }
  absl::Mutex mu;
  std::vector<absl::Status> statuses(manifest.num_daemons);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < manifest.num_daemons; ++rank) {
    // A daemon that holds no rows of the model published its (empty)
    // share at the load and waits for no weights: nothing to send it.
    bool holds_rows = false;
    for (const TensorMeta& t : manifest.tensors) {
      for (const PieceLocation& p : t.pieces) holds_rows |= p.daemon_rank == rank;
    }
    if (!holds_rows) continue;
    threads.emplace_back([&, rank] {
      const std::string& address = manifest.daemon_addresses[rank];
      auto stub = rpc::Daemon::NewStub(client.DaemonChannel(address));
      grpc::ClientContext context;
      context.set_deadline(ToChrono(deadline));
      rpc::PushWeightsResponse response;
      auto writer = stub->PushWeights(&context, &response);
      absl::Status status;
      std::vector<uint8_t> buffer;
      bool ok = true;
      int64_t sent = 0;  // chunk bytes written (the end marker's total)
      for (const TensorMeta& t : manifest.tensors) {
        const WeightSource& s = *by_name.at(t.name);
        const int64_t esize = s.dtype == Gradient::DType::kFp32 ? 4 : 2;
        for (const PieceLocation& p : t.pieces) {
          if (p.daemon_rank != rank || !ok) continue;
          const int64_t begin = p.row_begin * t.cols * esize;
          const int64_t bytes = (p.row_end - p.row_begin) * t.cols * esize;
          for (int64_t off = 0; off < bytes && ok; off += kChunkBytes) {
            const int64_t n = std::min(kChunkBytes, bytes - off);
            buffer.resize(n);
            status = s.read(begin + off, absl::MakeSpan(buffer));
            if (!status.ok()) {
              status = absl::Status(status.code(), absl::StrCat(t.name, ": ", status.message()));
              ok = false;
              break;
            }
            rpc::PushWeightsRequest request;
            rpc::GradientChunk* c = request.mutable_chunk();
            c->set_tensor(t.name);
            c->set_row_begin(p.row_begin);
            c->set_row_end(p.row_end);
            c->set_dtype(s.dtype == Gradient::DType::kFp32 ? rpc::DTYPE_FP32 : rpc::DTYPE_BF16);
            c->set_offset(off);
            c->set_data(buffer.data(), n);
            ok = writer->Write(request);
            sent += n;
            absl::MutexLock lock(&mu);
            done.bytes_sent += n;
            if (progress) progress(done);
          }
        }
      }
      // The end marker commits the stream (nothing is copied without it).
      if (ok && status.ok()) {
        rpc::PushWeightsRequest end;
        end.mutable_end()->set_total_bytes(sent);
        ok = writer->Write(end);
      }
      if (ok) writer->WritesDone();
      if (!status.ok()) context.TryCancel();
      const absl::Status rpc_status = FromGrpcStatus(
          writer->Finish(), absl::StrCat("push weights to daemon ", rank, " (", address, ")"));
      statuses[rank] = status.ok() ? rpc_status : status;
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : statuses) RETURN_IF_ERROR(s);
  ASSIGN_OR_RETURN(const int64_t v, client.WaitForVersion(0, deadline - absl::Now()));
  (void)client.RefreshManifest();
  return v;
}

}  // namespace client
}  // namespace paramd
