#include "client/gpu_fetch/device_fetcher.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/gpu_fetch/fetch_jobs.h"
#include "common/gpu_status.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "format/convert.h"
#include "format/fetch_plan.h"
#include "grpcpp/grpcpp.h"
#include "proto/paramd.grpc.pb.h"
#include "sharding/assemble.h"
#include "transport/channel_secret.h"
#include "transport/nccl_address.h"
#include "transport/nccl_transport.h"

namespace paramd {
namespace gpu_fetch {

namespace {

std::string DefaultName() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat(host, ":", getpid());
}

}  // namespace

using fetch_jobs::DaemonJob;
using fetch_jobs::FetchInPlace;
using fetch_jobs::InDaemonContext;
using fetch_jobs::WaitForCallerWork;

DeviceFetcher::DeviceFetcher(client::Client* client, const DeviceFetcherOptions& options)
    : client_(client), options_(options), pool_(options.device) {}

absl::StatusOr<std::unique_ptr<DeviceFetcher>> DeviceFetcher::Create(
    client::Client* client, const DeviceFetcherOptions& options) {
  if (client == nullptr) return absl::InvalidArgumentError("DeviceFetcher without a client");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("device fetch: no CUDA device");
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device fetch: device ", options.device, " of ", count));
  }
  std::unique_ptr<DeviceFetcher> f(new DeviceFetcher(client, options));
  GPU_RETURN_IF_ERROR(cudaSetDevice(options.device));
  GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&f->copy_stream_, cudaStreamNonBlocking));
  return f;
}

DeviceFetcher::~DeviceFetcher() {
  std::lock_guard<std::mutex> lock(mu_);
  channels_.clear();  // closes them
  if (copy_stream_ != nullptr) {
    cudaSetDevice(options_.device);
    cudaStreamDestroy(copy_stream_);
  }
}

int DeviceFetcher::open_channels() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(channels_.size());
}

void DeviceFetcher::CloseChannel(int daemon) { channels_.erase(daemon); }

absl::Status DeviceFetcher::CheckSharedGpu(int daemon, const std::string& address,
                                           const Channel& channel) const {
  // Diagnostics only (to reproduce the corruption): skips the guard.
  const char* allow = std::getenv("PARAMD_ALLOW_SHARED_GPU_NCCL");
  if (allow != nullptr && std::string(allow) == "1") return absl::OkStatus();
  std::vector<std::string> open;
  for (const auto& [rank, c] : channels_) open.push_back(c->daemon_address);
  return CheckNcclPeerGpuUnshared(channel.trainer_address, open, channel.daemon_address,
                                  absl::StrCat("daemon ", daemon, " at ", address),
                                  NcclP2pDisabledInEnv());
}

absl::StatusOr<DeviceFetcher::Channel*> DeviceFetcher::ChannelTo(int daemon,
                                                                 const std::string& address,
                                                                 absl::Time deadline) {
  auto it = channels_.find(daemon);
  if (it != channels_.end()) return it->second.get();
  GPU_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  TransportOptions endpoint_options;
  endpoint_options.listen_address = options_.listen_address;
  // The endpoint accepts only the daemon of this channel: it proves the
  // channel's secret, which the daemon's first event hands over (below).
  ChannelSecret secret;
  ASSIGN_OR_RETURN(std::unique_ptr<TransportEndpoint> endpoint,
                   OpenNcclEndpoint(secret.Apply(endpoint_options)));
  auto c = std::make_unique<Channel>();
  // The client's channel to the daemon: its TLS and token.
  c->grpc_channel = client_->DaemonChannel(address);
  c->stub = rpc::Daemon::NewStub(c->grpc_channel);
  c->context = std::make_unique<grpc::ClientContext>();  // no deadline: lives with the channel
  rpc::OpenDeviceChannelRequest request;
  request.set_trainer_address(endpoint->address());
  request.set_name(options_.name.empty() ? DefaultName() : options_.name);
  c->reader = c->stub->OpenDeviceChannel(c->context.get(), request);
  // The first event, bounded by the deadline (the stream itself has none).
  rpc::DeviceChannelEvent event;
  grpc::ClientReader<rpc::DeviceChannelEvent>* reader = c->reader.get();
  std::future<bool> first =
      std::async(std::launch::async, [reader, &event] { return reader->Read(&event); });
  if (first.wait_until(absl::ToChronoTime(deadline)) != std::future_status::ready) {
    c->context->TryCancel();
    first.wait();
    c->reader->Finish();
    c->reader.reset();
    return absl::DeadlineExceededError(
        absl::StrCat("opening a device channel to daemon ", daemon, " at ", address));
  }
  if (!first.get()) {
    const grpc::Status s = c->reader->Finish();
    c->reader.reset();
    return FromGrpcStatus(
        s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "device channel stream ended") : s,
        absl::StrCat("OpenDeviceChannel on daemon ", daemon, " (", address, ")"));
  }
  if (event.channel_secret().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "daemon ", daemon, " at ", address,
        " opened a device channel without a channel secret (an older hybrid-paramd?)"));
  }
  c->id = event.channel();
  c->secret = event.channel_secret();
  secret.Set(c->secret);  // before Connect: the control channel then accepts the daemon
  c->daemon_address = event.daemon_address();
  c->trainer_address = request.trainer_address();
  // Two daemons on one GPU reached over NCCL: refused (nccl_address.h).
  // Closing `c` closes the daemon's end.
  RETURN_IF_ERROR(CheckSharedGpu(daemon, address, *c));
  ASSIGN_OR_RETURN(c->transport,
                   endpoint->Connect(1, {event.daemon_address(), request.trainer_address()}));
  c->nccl = AsNcclTransport(c->transport.get());
  if (c->nccl == nullptr) return absl::InternalError("device channel transport is not nccl");
  c->StartWatch();
  Channel* raw = c.get();
  channels_[daemon] = std::move(c);
  return raw;
}

IpcFetcher* DeviceFetcher::LocalDaemon(int daemon) {
  if (!options_.same_gpu_ipc) return nullptr;
  auto it = local_.find(daemon);
  if (it != local_.end()) return it->second.get();
  IpcFetcherOptions o;
  o.device = options_.device;
  o.name = options_.name;
  // FAILED_PRECONDITION (another GPU, a cpu daemon, no exporter) or
  // UNIMPLEMENTED (an older daemon): NCCL. Other errors: NCCL this time, and
  // asked again next time.
  absl::StatusOr<std::unique_ptr<IpcFetcher>> f = IpcFetcher::Open(client_, daemon, o);
  if (f.ok()) return (local_[daemon] = *std::move(f)).get();
  if (absl::IsFailedPrecondition(f.status()) || absl::IsUnimplemented(f.status())) {
    local_[daemon] = nullptr;
  }
  return nullptr;
}

DevicePathStats DeviceFetcher::path_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

absl::StatusOr<void*> DeviceFetcher::GradientBuffer(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const client::Manifest manifest = client_->manifest();
  for (int rank = 0; rank < manifest.num_daemons; ++rank) {
    if (IpcFetcher* ipc = LocalDaemon(rank)) return ipc->GradientBuffer(bytes);
  }
  return absl::FailedPreconditionError(
      "no daemon of this model runs on this trainer's GPU: allocate gradients with cudaMalloc");
}

int DeviceFetcher::same_gpu_daemons() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const auto& [rank, f] : local_) n += f != nullptr ? 1 : 0;
  return n;
}

absl::StatusOr<DeviceDirection> DeviceFetcher::Owned(const std::string& key, const Layout& layout) {
  auto it = owned_.find(key);
  if (it != owned_.end() && it->second.layout.data_bytes() == layout.data_bytes() &&
      it->second.layout.scale_bytes() == layout.scale_bytes()) {
    it->second.layout = layout;
    return it->second;
  }
  ASSIGN_OR_RETURN(DeviceDirection d, pool_.Allocate(layout));
  owned_[key] = d;  // a stale one stays in the pool until the fetcher goes
  return d;
}

absl::StatusOr<DeviceFetchResult> DeviceFetcher::Fetch(int64_t version,
                                                       const std::vector<DeviceTarget>& targets,
                                                       cudaStream_t stream,
                                                       absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) timeout = options_.timeout;
  const absl::Time deadline = absl::Now() + timeout;
  std::lock_guard<std::mutex> lock(mu_);
  GPU_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  if (version < 0) {
    ASSIGN_OR_RETURN(version, client_->WaitForVersion(0, deadline - absl::Now()));
  }
  const client::Manifest manifest = client_->manifest();

  DeviceFetchResult result;
  result.version = version;
  ASSIGN_OR_RETURN(
      fetch_jobs::FetchJobs plan,
      fetch_jobs::PlanFetch(
          manifest, targets,
          [this](const std::string& key, const Layout& layout) { return Owned(key, layout); },
          &result));
  std::map<int, DaemonJob>& jobs = plan.jobs;
  // Work the caller enqueued on `stream` may still read the destinations.
  RETURN_IF_ERROR(WaitForCallerWork(stream));

  // Daemons on this GPU: in place through a same-GPU session, then device
  // copies (NCCL cannot join two ranks on one GPU); NCCL for the others.
  int in_place = 0;
  for (auto it = jobs.begin(); it != jobs.end();) {
    IpcFetcher* ipc = LocalDaemon(it->first);
    if (ipc == nullptr) {
      ++it;
      continue;
    }
    // The committed version is published on every daemon (waits, as the
    // NCCL path does, for one not yet committed).
    ASSIGN_OR_RETURN(int64_t committed, client_->WaitForVersion(version, deadline - absl::Now()));
    (void)committed;
    absl::Status s = FetchInPlace(*ipc, it->second, version, copy_stream_);
    if (absl::IsUnavailable(s)) local_.erase(it->first);  // reopened by the next fetch
    // Named like the NCCL path's errors ("device fetch from daemon N ..."):
    // the session's own messages know only the daemon's pid.
    if (!s.ok())
      return InDaemonContext(s, "same-GPU fetch", version, it->second.rank, it->second.address);
    ++in_place;
    it = jobs.erase(it);
  }
  // Channels (opened on this thread: they are the fetcher's state).
  for (auto& [rank, job] : jobs) {
    absl::StatusOr<Channel*> c = ChannelTo(rank, job.address, deadline);
    if (!c.ok()) return c.status();
    job.channel = *c;
    job.request.set_channel(job.channel->id);
    job.request.set_channel_secret(job.channel->secret);
    job.request.set_version(version);
    job.request.set_tag(next_tag_++);
  }
  // One plan + one receive per daemon, in parallel.
  std::vector<std::thread> threads;
  for (auto& [rank, job] : jobs) {
    auto exchange = [j = &job, device = options_.device, deadline, version,
                     early = options_.stream_in_flight] {
      fetch_jobs::ExchangeWithDaemon(j, device, deadline, version, early);
    };
    if (options_.parallel && jobs.size() > 1) {
      threads.emplace_back(exchange);
    } else {
      exchange();
    }
  }
  for (std::thread& t : threads) t.join();
  absl::Status first_error;
  for (auto& [rank, job] : jobs) {
    if (job.status.ok()) continue;
    // A failed exchange may leave a send queued on the daemon: reopen the
    // channel (the daemon drops its end when the stream closes).
    CloseChannel(rank);
    if (first_error.ok()) first_error = job.status;
  }
  if (!first_error.ok()) return first_error;
  result.daemons = static_cast<int>(jobs.size()) + in_place;
  stats_.fetch_same_gpu += in_place;
  stats_.fetch_nccl += static_cast<int64_t>(jobs.size());

  RETURN_IF_ERROR(fetch_jobs::AssembleSplit(plan.split, result, copy_stream_));
  return result;
}

absl::StatusOr<std::vector<IpcGradient>> DeviceFetcher::InPlaceGradients(
    IpcFetcher& ipc, int rank, const client::Manifest& manifest,
    const std::vector<DeviceGradient>& gradients) {
  // The gradients with rows on daemon `rank`: where they lie in one of the
  // session's GradientBuffers, as they are; the others copied (whole
  // tensors) into one staging GradientBuffer of the session.
  std::vector<IpcGradient> out;
  std::vector<std::pair<size_t, size_t>> copies;  // (gradient, staging offset)
  size_t staging = 0;
  for (size_t i = 0; i < gradients.size(); ++i) {
    const DeviceGradient& g = gradients[i];
    const client::TensorMeta* meta = manifest.Find(g.tensor);
    if (meta == nullptr) return absl::NotFoundError(absl::StrCat("unknown tensor ", g.tensor));
    bool here = false;
    for (const client::PieceLocation& p : meta->pieces) here = here || p.daemon_rank == rank;
    if (!here) continue;
    out.push_back({g.tensor, g.dtype, g.data});
    if (!ipc.InGradientBuffer(g.data, g.bytes)) {
      copies.push_back({out.size() - 1, staging});
      staging += (g.bytes + 255) / 256 * 256;
    }
  }
  if (copies.empty()) return out;
  ASSIGN_OR_RETURN(void* base, ipc.StagingBuffer(staging));
  for (const auto& [k, offset] : copies) {
    const DeviceGradient* g = nullptr;
    for (const DeviceGradient& x : gradients) {
      if (x.tensor == out[k].tensor) g = &x;
    }
    char* dst = static_cast<char*>(base) + offset;
    GPU_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, g->data, g->bytes, cudaMemcpyDeviceToDevice, copy_stream_));
    out[k].data = dst;
  }
  GPU_RETURN_IF_ERROR(cudaStreamSynchronize(copy_stream_));
  return out;
}

absl::StatusOr<client::PushResult> DeviceFetcher::Push(int64_t version,
                                                       const std::vector<DeviceGradient>& gradients,
                                                       cudaStream_t stream, absl::Duration timeout,
                                                       client::PushCoverage coverage) {
  if (timeout <= absl::ZeroDuration()) timeout = options_.timeout;
  const absl::Time deadline = absl::Now() + timeout;
  std::lock_guard<std::mutex> lock(mu_);
  GPU_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  const client::Manifest manifest = client_->manifest();
  // The host push's routing (only sizes are read from these spans).
  std::vector<client::Gradient> routed;
  for (const DeviceGradient& g : gradients) {
    if (g.data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("gradient of ", g.tensor, " has no buffer"));
    }
    routed.push_back(
        {g.tensor, g.dtype, absl::MakeConstSpan(static_cast<const uint8_t*>(g.data), g.bytes)});
  }
  RETURN_IF_ERROR(client::CheckPushGradients(manifest, routed, coverage));
  // The gradients were written on `stream` (a pageable host-to-device
  // cudaMemcpy may return before its bytes reach the device); every read
  // below runs on a cudaStreamNonBlocking stream.
  RETURN_IF_ERROR(WaitForCallerWork(stream));

  struct PushJob {
    int rank = 0;
    std::string address;
    rpc::PushGradientsDeviceRequest request;
    std::vector<DeviceBytes> pieces;
    Channel* channel = nullptr;  // null: no rows here (nothing sent)
    IpcFetcher* ipc = nullptr;   // a daemon on this GPU: read in place
    std::vector<IpcGradient> ipc_gradients;
    rpc::PushGradientsResponse response;
    absl::Status status;
  };
  std::vector<PushJob> jobs(manifest.num_daemons);
  for (int rank = 0; rank < manifest.num_daemons; ++rank) {
    PushJob& j = jobs[rank];
    j.rank = rank;
    j.address = rank < static_cast<int>(manifest.daemon_addresses.size())
                    ? manifest.daemon_addresses[rank]
                    : "";
    j.request.set_version(version);
    j.request.set_pusher_id(client_->member_id());
    for (const client::PushRoute& r : client::PushRoutesTo(manifest, rank, routed)) {
      const client::Gradient& g = routed[r.gradient];
      rpc::DevicePushTensor* t = j.request.add_tensors();
      t->set_tensor(g.tensor);
      t->set_row_begin(r.row_begin);
      t->set_row_end(r.row_end);
      t->set_dtype(g.dtype == client::Gradient::DType::kFp32 ? rpc::DTYPE_FP32 : rpc::DTYPE_BF16);
      j.pieces.push_back({g.bytes.data() + r.byte_offset, static_cast<size_t>(r.bytes)});
    }
    if (j.pieces.empty()) continue;
    if (IpcFetcher* ipc = LocalDaemon(rank)) {
      ASSIGN_OR_RETURN(j.ipc_gradients, InPlaceGradients(*ipc, rank, manifest, gradients));
      j.ipc = ipc;
      continue;
    }
    ASSIGN_OR_RETURN(j.channel, ChannelTo(rank, j.address, deadline));
    j.request.set_channel(j.channel->id);
    j.request.set_channel_secret(j.channel->secret);
    j.request.set_tag(next_tag_++);
  }
  const int device = options_.device;
  client::Client* const client = client_;
  auto exchange = [device, deadline, client](PushJob* j) {
    cudaSetDevice(device);
    std::unique_ptr<rpc::Daemon::Stub> stub;
    rpc::Daemon::StubInterface* s = nullptr;
    if (j->channel != nullptr) {
      s = j->channel->stub.get();
    } else {
      stub = rpc::Daemon::NewStub(client->DaemonChannel(j->address));
      s = stub.get();
    }
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    const std::string where = absl::StrCat("device push of version ", j->request.version(),
                                           " to daemon ", j->rank, " (", j->address, ")");
    if (j->ipc != nullptr) {
      absl::StatusOr<rpc::PushGradientsResponse> r =
          j->ipc->Push(j->request.version(), j->ipc_gradients);
      if (r.ok()) {
        j->response = *std::move(r);
      } else {
        j->status =
            InDaemonContext(r.status(), "same-GPU push", j->request.version(), j->rank, j->address);
      }
      return;
    }
    if (j->channel == nullptr) {
      j->status = FromGrpcStatus(s->PushGradientsDevice(&context, j->request, &j->response), where);
      return;
    }
    // The call answers once the daemon has received and committed the
    // bytes: send them meanwhile. A refusal ends the call at once: the
    // transport is shut down so that the send stops waiting for a receiver.
    Channel* c = j->channel;
    std::future<grpc::Status> call = std::async(std::launch::async, [&] {
      grpc::Status g = s->PushGradientsDevice(&context, j->request, &j->response);
      if (!g.ok()) c->transport->Shutdown();
      return g;
    });
    const absl::Status sent =
        c->nccl->SendDevice(0, j->request.tag(), j->pieces, nullptr, deadline);
    if (!sent.ok()) context.TryCancel();
    const grpc::Status g = call.get();
    if (!g.ok()) {
      j->status = FromGrpcStatus(g, where);
    } else if (!sent.ok()) {
      j->status = sent;  // cannot happen: the daemon answered after receiving
    }
  };
  std::vector<std::thread> threads;
  for (PushJob& j : jobs) {
    if (options_.parallel && jobs.size() > 1) {
      threads.emplace_back(exchange, &j);
    } else {
      exchange(&j);
    }
  }
  for (std::thread& t : threads) t.join();
  client::PushResult result;
  result.version = version;
  result.pushers_received = -1;
  absl::Status first_error;
  for (PushJob& j : jobs) {
    if (j.ipc != nullptr) {
      ++stats_.push_same_gpu;
      if (absl::IsUnavailable(j.status)) local_.erase(j.rank);  // reopened next time
    } else if (j.channel != nullptr) {
      ++stats_.push_nccl;
    }
    if (!j.status.ok()) {
      // The channel may hold half a message: reopen it next time.
      if (j.channel != nullptr) CloseChannel(j.rank);
      if (first_error.ok()) first_error = j.status;
      continue;
    }
    for (const DeviceBytes& b : j.pieces) result.bytes_sent += static_cast<int64_t>(b.size);
    result.pushers_received = result.pushers_received < 0 ? j.response.pushers_received()
                                                          : std::min(result.pushers_received,
                                                                     j.response.pushers_received());
    result.pushers_expected = j.response.pushers_expected();
  }
  if (!first_error.ok()) return first_error;
  return result;
}

}  // namespace gpu_fetch
}  // namespace paramd
