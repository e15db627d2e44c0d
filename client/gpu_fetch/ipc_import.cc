#include "client/gpu_fetch/ipc_import.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"

namespace paramd {
namespace gpu_fetch {

absl::StatusOr<std::string> DeviceUuid(int device) {
  cudaDeviceProp prop;
  GPU_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  return std::string(prop.uuid.bytes, sizeof(prop.uuid.bytes));
}

absl::StatusOr<std::unique_ptr<IpcFetcher>> IpcFetcher::Open(client::Client* client,
                                                             int daemon_rank,
                                                             const IpcFetcherOptions& options) {
  const client::Manifest& m = client->manifest();
  if (daemon_rank < 0 || daemon_rank >= static_cast<int>(m.daemon_addresses.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no daemon rank ", daemon_rank));
  }
  std::unique_ptr<IpcFetcher> f(new IpcFetcher(client, daemon_rank, options));
  ipc::IpcSessionOptions so;
  so.lease = options.lease;
  so.name = options.name;
  ASSIGN_OR_RETURN(f->session_, ipc::IpcSession::Open(
                                    client->DaemonChannel(m.daemon_addresses[daemon_rank]), so));
  ASSIGN_OR_RETURN(std::string mine, DeviceUuid(options.device));
  if (mine != f->session_->device_uuid()) {
    return absl::FailedPreconditionError(
        absl::StrCat("daemon rank ", daemon_rank, " runs on another GPU than CUDA device ",
                     options.device, " of this trainer; fetch over NCCL (DeviceFetcher) instead"));
  }
  // Best effort: without the page every acquire goes over PinIpc.
  if (absl::StatusOr<std::unique_ptr<ipc::PinPage>> page = f->session_->GetPinPage(); page.ok()) {
    f->page_ = *std::move(page);
  }
  return f;
}

IpcFetcher::~IpcFetcher() {
  if (session_ != nullptr) (void)ReleaseHeld();
  // Kernels of this process may still read the mappings: wait for them.
  if (mapped_ || !gradient_buffers_.empty()) cudaDeviceSynchronize();
  session_.reset();  // closes the session (the daemon unmaps our buffers)
}

absl::Status IpcFetcher::Check() const { return session_->Healthy(); }

int64_t IpcFetcher::mapped_bytes() const {
  int64_t n = 0;
  for (const ipc::VmmBuffer& r : regions_) n += static_cast<int64_t>(r.size());
  return n;
}

absl::Status IpcFetcher::MapRegions(uint64_t epoch) {
  ASSIGN_OR_RETURN(ipc::FdReply reply, session_->GetRegions());
  std::vector<ipc::VmmBuffer> regions;
  absl::Status s;
  for (size_t i = 0; i < reply.fds.size(); ++i) {
    if (!s.ok()) {
      close(reply.fds[i]);
      continue;
    }
    absl::StatusOr<ipc::VmmBuffer> b =
        ipc::VmmBuffer::Import(reply.fds[i], reply.sizes[i], options_.device);
    if (b.ok()) {
      regions.push_back(*std::move(b));
    } else {
      s = b.status();
    }
  }
  RETURN_IF_ERROR(s);
  if (reply.epoch != epoch) {
    return absl::AbortedError("the daemon reloaded its model meanwhile; acquire again");
  }
  // Views into the old regions go with them (they were of another model).
  cudaDeviceSynchronize();
  for (SlotView& v : slot_views_) v = SlotView();
  regions_ = std::move(regions);
  epoch_ = epoch;
  mapped_ = true;
  return absl::OkStatus();
}

absl::StatusOr<const IpcVersion*> IpcFetcher::AcquireFromPage(
    int64_t version, const std::vector<std::pair<std::string, Direction>>& targets) {
  RETURN_IF_ERROR(session_->Healthy());
  uint64_t key = 0;
  int slot = -1;
  if (version >= 0) {
    key = ipc::PackPin(static_cast<int64_t>(epoch_), version);
    slot = page_->SlotOf(key);
  } else {  // the latest the page offers of this model
    for (int i = 0; i < ipc::kPageSlots; ++i) {
      const uint64_t k = page_->page().slots[i].load();
      if (k == 0 || (k >> 48) != (epoch_ & 0xffffu)) continue;
      if (slot < 0 || ipc::PinVersion(k) > ipc::PinVersion(key)) {
        key = k;
        slot = i;
      }
    }
  }
  if (slot < 0) return nullptr;
  const SlotView& known = slot_views_[slot];
  if (!known.valid || known.epoch != epoch_ || known.targets != targets) return nullptr;
  const int pin = page_->TryPin(slot, key);
  if (pin < 0) return nullptr;  // withdrawn meanwhile (a step rewrites it)
  (void)ReleaseHeld();
  page_pin_ = pin;
  acquired_ = known.view;
  acquired_.version = ipc::PinVersion(key);
  ++page_acquires_;
  return &acquired_;
}

absl::Status IpcFetcher::ReleaseHeld() {
  const int64_t v = acquired_.version;
  acquired_ = IpcVersion();
  if (page_pin_ >= 0) {
    page_->Unpin(page_pin_);
    page_pin_ = -1;
    return absl::OkStatus();
  }
  return v >= 0 ? session_->Unpin(v) : absl::OkStatus();
}

absl::StatusOr<const IpcVersion*> IpcFetcher::Acquire(
    int64_t version, const std::vector<std::pair<std::string, Direction>>& targets) {
  if (page_ != nullptr && mapped_) {
    ASSIGN_OR_RETURN(const IpcVersion* v, AcquireFromPage(version, targets));
    if (v != nullptr) return v;
  }
  std::vector<rpc::TensorDirections> request;
  for (const auto& [name, dir] : targets) {
    rpc::TensorDirections td;
    td.set_tensor(name);
    td.add_directions(static_cast<rpc::Direction>(dir));
    request.push_back(td);
  }
  // A PinIpc pin of the version acquired before is released in the same
  // call; a page pin of it once the new one is held.
  const int64_t previous = page_pin_ >= 0 ? -1 : acquired_.version;
  ASSIGN_OR_RETURN(rpc::PinIpcResponse pin, session_->Pin(version, request, previous));
  const int previous_page_pin = page_pin_;
  page_pin_ = -1;
  if (previous_page_pin >= 0) page_->Unpin(previous_page_pin);
  acquired_ = IpcVersion();
  if (!mapped_ || pin.regions_epoch() != epoch_) {
    if (absl::Status s = MapRegions(pin.regions_epoch()); !s.ok()) {
      (void)session_->Unpin(pin.version());
      return s;
    }
  }
  IpcVersion out;
  out.version = pin.version();
  const client::Manifest& m = client_->manifest();
  auto fail = [&](absl::Status s) {
    (void)session_->Unpin(pin.version());
    return s;
  };
  for (const rpc::IpcPiece& p : pin.pieces()) {
    const Direction dir = static_cast<Direction>(p.direction());
    if (out.tensors.empty() || out.tensors.back().tensor != p.tensor() ||
        out.tensors.back().direction != dir) {
      const client::TensorMeta* meta = m.Find(p.tensor());
      if (meta == nullptr) {
        return fail(absl::FailedPreconditionError(absl::StrCat(
            "tensor ", p.tensor(), " is not in this client's manifest: RefreshManifest")));
      }
      IpcTensor t;
      t.tensor = p.tensor();
      t.direction = dir;
      t.spec = meta->SpecOf(dir);
      t.rows = meta->rows;
      t.cols = meta->cols;
      out.tensors.push_back(std::move(t));
    }
    IpcTensor& t = out.tensors.back();
    absl::StatusOr<Layout> layout = ComputeLayout(t.spec, dir, p.row_end() - p.row_begin(), t.cols);
    if (!layout.ok()) return fail(layout.status());
    if (layout->data_bytes() != p.data_bytes() || layout->scale_bytes() != p.scale_bytes()) {
      return fail(absl::FailedPreconditionError(
          absl::StrCat("tensor ", p.tensor(),
                       ": the daemon's layout differs from the manifest's: "
                       "RefreshManifest")));
    }
    auto at = [&](const rpc::IpcRef& r, uint64_t bytes) -> absl::StatusOr<void*> {
      if (r.region() >= regions_.size() || r.offset() + bytes > regions_[r.region()].size()) {
        return absl::InternalError("an IPC buffer outside the daemon's regions");
      }
      return static_cast<char*>(regions_[r.region()].data()) + r.offset();
    };
    IpcTensor::Piece piece;
    piece.row_begin = p.row_begin();
    piece.row_end = p.row_end();
    piece.buffers.layout = *layout;
    absl::StatusOr<void*> data = at(p.data(), p.data_bytes());
    if (!data.ok()) return fail(data.status());
    piece.buffers.data = *data;
    if (p.scale_bytes() > 0) {
      absl::StatusOr<void*> scales = at(p.scales(), p.scale_bytes());
      if (!scales.ok()) return fail(scales.status());
      piece.buffers.scales = *scales;
    }
    absl::StatusOr<void*> scale_inv = at(p.scale_inv(), 4), amax = at(p.amax(), 4);
    if (!scale_inv.ok()) return fail(scale_inv.status());
    if (!amax.ok()) return fail(amax.status());
    piece.buffers.scale_inv = static_cast<float*>(*scale_inv);
    piece.buffers.amax = static_cast<float*>(*amax);
    t.pieces.push_back(piece);
  }
  acquired_ = std::move(out);
  ++rpc_acquires_;
  // The slot's pointers are known now: later versions in it are handed over
  // through the page. The PinIpc pin becomes a page pin when the page
  // offers this version (one more RPC here, none on the next hand-overs).
  if (page_ != nullptr) {
    const uint64_t key = ipc::PackPin(static_cast<int64_t>(epoch_), acquired_.version);
    const int slot = page_->SlotOf(key);
    if (slot >= 0) {
      slot_views_[slot] = {true, epoch_, targets, acquired_};
      const int page_pin = page_->TryPin(slot, key);
      if (page_pin >= 0) {
        if (session_->Unpin(acquired_.version).ok()) {
          page_pin_ = page_pin;
        } else {
          page_->Unpin(page_pin);  // keep the PinIpc pin
        }
      }
    }
  }
  return &acquired_;
}

absl::Status IpcFetcher::Release() { return ReleaseHeld(); }

absl::Status IpcFetcher::CopyTo(const IpcTensor& t, const DeviceDirection& dst,
                                cudaStream_t stream) {
  RETURN_IF_ERROR(Check());
  if (!t.whole()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", t.tensor, " is split across daemons: fetch it through DeviceFetcher"));
  }
  const DeviceDirection& src = t.pieces[0].buffers;
  if (dst.data == nullptr || (src.layout.scale_bytes() > 0 && dst.scales == nullptr) ||
      dst.scale_inv == nullptr || dst.amax == nullptr) {
    return absl::InvalidArgumentError("CopyTo needs data, scales (if any), scale_inv and amax");
  }
  GPU_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  GPU_RETURN_IF_ERROR(cudaMemcpyAsync(dst.data, src.data, src.layout.data_bytes(),
                                      cudaMemcpyDeviceToDevice, stream));
  if (src.layout.scale_bytes() > 0) {
    GPU_RETURN_IF_ERROR(cudaMemcpyAsync(dst.scales, src.scales, src.layout.scale_bytes(),
                                        cudaMemcpyDeviceToDevice, stream));
  }
  GPU_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst.scale_inv, src.scale_inv, 4, cudaMemcpyDeviceToDevice, stream));
  GPU_RETURN_IF_ERROR(cudaMemcpyAsync(dst.amax, src.amax, 4, cudaMemcpyDeviceToDevice, stream));
  return absl::OkStatus();
}

bool IpcFetcher::InGradientBuffer(const void* data, size_t bytes) const {
  const uintptr_t at = reinterpret_cast<uintptr_t>(data);
  for (const Buffer& b : gradient_buffers_) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(b.memory.data());
    if (at >= base && at + bytes <= base + b.memory.size()) return true;
  }
  return false;
}

absl::StatusOr<void*> IpcFetcher::StagingBuffer(size_t bytes) {
  auto it = gradient_buffers_.begin();
  while (it != gradient_buffers_.end() && (staging_id_ == 0 || it->id != staging_id_)) ++it;
  if (it != gradient_buffers_.end() && it->memory.size() >= bytes) return it->memory.data();
  RETURN_IF_ERROR(Check());
  ASSIGN_OR_RETURN(ipc::VmmBuffer b, ipc::VmmBuffer::Allocate(bytes, options_.device));
  ASSIGN_OR_RETURN(int fd, b.Export());
  if (staging_id_ == 0) staging_id_ = next_buffer_id_++;
  // The same id: the daemon replaces (unmaps) its mapping of the old one.
  absl::Status s = session_->RegisterBuffer(staging_id_, fd, b.size());
  close(fd);
  RETURN_IF_ERROR(s);
  if (it != gradient_buffers_.end()) {
    cudaDeviceSynchronize();  // no copy still writes the old one
    gradient_buffers_.erase(it);
  }
  void* p = b.data();
  gradient_buffers_.push_back({staging_id_, std::move(b)});
  return p;
}

absl::StatusOr<void*> IpcFetcher::GradientBuffer(size_t bytes) {
  RETURN_IF_ERROR(Check());
  ASSIGN_OR_RETURN(ipc::VmmBuffer b, ipc::VmmBuffer::Allocate(bytes, options_.device));
  ASSIGN_OR_RETURN(int fd, b.Export());
  const uint64_t id = next_buffer_id_++;
  absl::Status s = session_->RegisterBuffer(id, fd, b.size());
  close(fd);
  RETURN_IF_ERROR(s);
  void* p = b.data();
  gradient_buffers_.push_back({id, std::move(b)});
  return p;
}

absl::StatusOr<rpc::PushGradientsResponse> IpcFetcher::Push(
    int64_t version, const std::vector<IpcGradient>& gradients) {
  const client::Manifest& m = client_->manifest();
  rpc::PushGradientsIpcRequest request;
  request.set_version(version);
  request.set_pusher_id(client_->member_id());
  for (const IpcGradient& g : gradients) {
    const client::TensorMeta* meta = m.Find(g.tensor);
    if (meta == nullptr) return absl::NotFoundError(absl::StrCat("unknown tensor ", g.tensor));
    const bool bf16 = g.dtype == client::Gradient::DType::kBf16;
    const size_t elem = bf16 ? 2 : 4;
    const uintptr_t at = reinterpret_cast<uintptr_t>(g.data);
    const Buffer* buffer = nullptr;
    for (const Buffer& b : gradient_buffers_) {
      const uintptr_t base = reinterpret_cast<uintptr_t>(b.memory.data());
      if (at >= base && at + meta->rows * meta->cols * elem <= base + b.memory.size()) buffer = &b;
    }
    if (buffer == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the gradient of ", g.tensor, " does not lie in a GradientBuffer of this fetcher"));
    }
    for (const client::PieceLocation& p : meta->pieces) {
      if (p.daemon_rank != rank_) continue;
      rpc::IpcPushTensor* t = request.add_tensors();
      t->set_tensor(g.tensor);
      t->set_row_begin(p.row_begin);
      t->set_row_end(p.row_end);
      t->set_dtype(bf16 ? rpc::DTYPE_BF16 : rpc::DTYPE_FP32);
      t->set_buffer(buffer->id);
      t->set_offset(at - reinterpret_cast<uintptr_t>(buffer->memory.data()) +
                    p.row_begin * meta->cols * elem);
    }
  }
  return session_->Push(std::move(request));
}

}  // namespace gpu_fetch
}  // namespace paramd
