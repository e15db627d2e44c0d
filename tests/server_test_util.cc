#include "tests/server_test_util.h"

#include "auth/security.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "auth/security.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "format/convert.h"
#include "safetensors/safetensors.h"
#include "sharding/assemble.h"

namespace paramd {
namespace testing {
const char kFp32PassthroughRecipe[] = R"txt(
  default_spec {
    rowwise { format: IDENTITY_FP32 }
    columnwise { format: IDENTITY_FP32 }
    source_dtype: FP32
  })txt";

TestClusterOptions TwoDaemonSgd(double lr) {
  TestClusterOptions options;
  options.daemons = 2;
  options.expected_pushers = 2;
  options.optimizer = "sgd";
  options.lr = lr;
  return options;
}

void SetDeadline(grpc::ClientContext& context, absl::Duration timeout) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return 0;  // what a caller then listens on fails with its own message
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buf[4096];
      for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
    }
  }
  close(fd);
  return out;
}

HealthStatus::ServingStatus Health(const std::string& address, const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(2));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  HealthStatus response;
  if (!stub->Check(&context, request, &response).ok()) return HealthStatus::UNKNOWN;
  return response.status();
}

bool WaitForHealth(const std::string& address, const std::string& service,
                   HealthStatus::ServingStatus want, absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  while (absl::Now() < give_up) {
    if (Health(address, service) == want) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

absl::Status WriteModel(const std::string& path, const std::vector<TestTensor>& tensors) {
  std::vector<safetensors::TensorSpec> specs;
  for (const TestTensor& t : tensors) specs.push_back({t.name, safetensors::Dtype::kF32, t.shape});
  ASSIGN_OR_RETURN(std::unique_ptr<safetensors::SafetensorsWriter> w,
                   safetensors::SafetensorsWriter::Create(path, specs));
  for (const TestTensor& t : tensors) {
    RETURN_IF_ERROR(w->WriteTensor(
        t.name, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(t.values.data()),
                                    t.values.size() * 4)));
  }
  return w->Finish();
}

std::vector<float> RandomValues(int64_t n, uint32_t seed, float stddev) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

rpc::PushGradientsRequest GradientMessage(int64_t version, const std::string& pusher,
                                          const std::string& tensor, int64_t row_begin,
                                          int64_t row_end, const float* values, int64_t cols) {
  rpc::PushGradientsRequest r;
  r.set_version(version);
  r.set_pusher_id(pusher);
  rpc::GradientChunk* c = r.mutable_chunk();
  c->set_tensor(tensor);
  c->set_row_begin(row_begin);
  c->set_row_end(row_end);
  c->set_dtype(rpc::DTYPE_FP32);
  c->set_offset(0);
  c->set_data(reinterpret_cast<const char*>(values + row_begin * cols),
              (row_end - row_begin) * cols * 4);
  return r;
}

absl::StatusOr<std::unique_ptr<RawCluster>> RawCluster::Start(const TestClusterOptions& options) {
  auto c = std::make_unique<RawCluster>();
  ASSIGN_OR_RETURN(c->cluster_, TestCluster::Start(options));
  c->cluster_secret_ = options.cluster_secret;
  c->coordinator_channel_ = c->Channel(c->cluster_->coordinator_address());
  c->coordinator_ = rpc::Coordinator::NewStub(c->coordinator_channel_);
  return c;
}

const rpc::TensorInfo& RawCluster::tensor(const std::string& name) const {
  for (const rpc::TensorInfo& t : manifest_.tensors()) {
    if (t.name() == name) return t;
  }
  static const rpc::TensorInfo* const kNone = new rpc::TensorInfo();
  return *kNone;
}

HybridSpec RawCluster::spec(const std::string& name) const {
  return *HybridSpecFromProto(tensor(name).spec());
}

absl::StatusOr<int64_t> RawCluster::Load(const std::string& path, const std::string& recipe_text,
                                         absl::Duration timeout, bool force) {
  const absl::Time give_up = absl::Now() + timeout;
  rpc::LoadRequest request;
  request.set_safetensors_path(path);
  request.set_recipe_text(recipe_text);
  request.set_force(force);
  for (;;) {
    grpc::ClientContext context;
    SetDeadline(context, give_up - absl::Now());
    rpc::LoadResponse response;
    grpc::Status s = coordinator_->Load(&context, request, &response);
    // UNAVAILABLE: the coordinator or the daemons are still starting.
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(50));
      continue;
    }
    RETURN_IF_ERROR(FromGrpcStatus(s, "Load"));
    RETURN_IF_ERROR(RefreshManifest());
    return response.committed_version();
  }
}

std::shared_ptr<grpc::Channel> RawCluster::Channel(const std::string& address) const {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  auth::ChannelSecurity security;
  if (!cluster_secret_.empty())
    security.token = std::make_shared<auth::BearerToken>(cluster_secret_);
  return auth::CreateChannel(address, security, args);
}

absl::Status RawCluster::RefreshManifest() {
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  rpc::GetManifestResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      coordinator_->GetManifest(&context, rpc::GetManifestRequest(), &response), "GetManifest"));
  manifest_ = response.manifest();
  daemons_.clear();
  for (const rpc::DaemonInfo& d : manifest_.daemons()) {
    daemons_.push_back(rpc::Daemon::NewStub(Channel(d.address())));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> RawCluster::WaitForVersion(int64_t min_version, absl::Duration timeout) {
  grpc::ClientContext context;
  SetDeadline(context, timeout);
  rpc::WaitForVersionRequest request;
  request.set_min_version(min_version);
  rpc::WaitForVersionResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(coordinator_->WaitForVersion(&context, request, &response), "WaitForVersion"));
  return response.committed_version();
}

grpc::Status RawCluster::FetchFrom(int rank, const rpc::FetchRequest& request,
                                   absl::Duration timeout, FetchedPieces* out) {
  grpc::ClientContext context;
  SetDeadline(context, timeout);
  std::unique_ptr<grpc::ClientReader<rpc::FetchResponse>> reader =
      daemon(rank).Fetch(&context, request);
  rpc::FetchResponse message;
  *out = FetchedPieces();
  while (reader->Read(&message)) {
    if (message.has_plan()) {
      out->plan = message.plan();
      for (const rpc::FetchPiece& p : out->plan.pieces()) {
        QuantizedTensor q;
        q.format = *FormatFromProto(p.format());
        q.direction = *DirectionFromProto(p.direction());
        q.rows = p.row_end() - p.row_begin();
        q.cols = p.cols();
        q.scale_inv = p.scale_inv();
        q.amax = p.amax();
        out->pieces.push_back(std::move(q));
      }
      continue;
    }
    const rpc::FetchChunk& c = message.chunk();
    QuantizedTensor& q = out->pieces.at(c.piece());
    std::vector<uint8_t>& buf = c.buffer() == rpc::BUFFER_DATA ? q.data : q.scales;
    if (static_cast<int64_t>(buf.size()) != c.offset()) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "fetch chunk out of order");
    }
    buf.insert(buf.end(), c.data().begin(), c.data().end());
  }
  return reader->Finish();
}

absl::StatusOr<std::vector<QuantizedTensor>> RawCluster::FetchPieces(int64_t version,
                                                                     const std::string& tensor,
                                                                     Direction direction) {
  std::vector<std::pair<int64_t, QuantizedTensor>> pieces;
  for (int r = 0; r < num_daemons(); ++r) {
    rpc::FetchRequest request;
    request.set_version(version);
    rpc::TensorDirections* td = request.add_tensors();
    td->set_tensor(tensor);
    td->add_directions(DirectionToProto(direction));
    FetchedPieces got;
    RETURN_IF_ERROR(FromGrpcStatus(FetchFrom(r, request, absl::Seconds(10), &got),
                                   absl::StrCat("Fetch from daemon ", r)));
    for (int i = 0; i < got.plan.pieces_size(); ++i) {
      pieces.emplace_back(got.plan.pieces(i).row_begin(), std::move(got.pieces[i]));
    }
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<QuantizedTensor> out;
  for (auto& p : pieces) out.push_back(std::move(p.second));
  return out;
}

absl::StatusOr<QuantizedTensor> RawCluster::FetchAssembled(int64_t version,
                                                           const std::string& tensor,
                                                           Direction direction,
                                                           absl::Duration /*timeout*/) {
  ASSIGN_OR_RETURN(std::vector<QuantizedTensor> pieces, FetchPieces(version, tensor, direction));
  const HybridSpec s = spec(tensor);
  return sharding::Assemble(direction == Direction::kRowwise ? s.rowwise : s.columnwise, pieces);
}

rpc::PushGradientsRequest EndMessage(const std::vector<rpc::PushGradientsRequest>& messages) {
  rpc::PushGradientsRequest end;
  int64_t total = 0;
  for (const rpc::PushGradientsRequest& m : messages) total += m.chunk().data().size();
  end.mutable_end()->set_total_bytes(total);
  return end;
}

grpc::Status RawCluster::PushRaw(int rank, const std::vector<rpc::PushGradientsRequest>& messages,
                                 rpc::PushGradientsResponse* response, bool add_end) {
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  rpc::PushGradientsResponse ignored;
  std::unique_ptr<grpc::ClientWriter<rpc::PushGradientsRequest>> writer =
      daemon(rank).PushGradients(&context, response ? response : &ignored);
  std::vector<rpc::PushGradientsRequest> stream = messages;
  if (add_end) stream.push_back(EndMessage(messages));
  for (const rpc::PushGradientsRequest& m : stream) {
    if (!writer->Write(m)) break;  // the server finished early: Finish() says why
  }
  writer->WritesDone();
  return writer->Finish();
}

absl::Status RawCluster::PushAll(int64_t version, const std::string& pusher_id,
                                 const std::map<std::string, std::vector<float>>& gradients) {
  std::vector<std::vector<rpc::PushGradientsRequest>> streams(num_daemons());
  for (const rpc::ShardPiece& p : manifest_.pieces()) {
    auto it = gradients.find(p.tensor());
    if (it == gradients.end()) continue;
    streams[p.daemon_rank()].push_back(
        GradientMessage(version, pusher_id, p.tensor(), p.row_begin(), p.row_end(),
                        it->second.data(), tensor(p.tensor()).cols()));
  }
  std::vector<grpc::Status> statuses(num_daemons());
  std::vector<std::thread> threads;
  for (int r = 0; r < num_daemons(); ++r) {
    if (streams[r].empty()) {  // an end marker naming version and pusher
      rpc::PushGradientsRequest header;
      header.set_version(version);
      header.set_pusher_id(pusher_id);
      header.mutable_end()->set_total_bytes(0);
      streams[r].push_back(header);
      threads.emplace_back([&, r] { statuses[r] = PushRaw(r, streams[r], nullptr, false); });
      continue;
    }
    threads.emplace_back([&, r] { statuses[r] = PushRaw(r, streams[r]); });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < num_daemons(); ++r) {
    RETURN_IF_ERROR(FromGrpcStatus(statuses[r], absl::StrCat("PushGradients to daemon ", r)));
  }
  return absl::OkStatus();
}

absl::StatusOr<rpc::DaemonStats> RawCluster::Stats(int rank, bool include_shards) {
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  rpc::GetStatsRequest request;
  request.set_include_shards(include_shards);
  rpc::GetStatsResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(daemon(rank).GetStats(&context, request, &response),
                                 absl::StrCat("GetStats on daemon ", rank)));
  return response.stats();
}

absl::StatusOr<std::map<std::string, std::vector<float>>> RawCluster::Fp32Masters(
    int64_t version, const std::vector<std::string>& names) {
  std::map<std::string, std::vector<float>> out;
  for (const std::string& name : names) {
    ASSIGN_OR_RETURN(QuantizedTensor q, FetchAssembled(version, name, Direction::kRowwise));
    std::vector<float>& v = out[name];
    v.resize(q.data.size() / 4);
    std::memcpy(v.data(), q.data.data(), q.data.size());
  }
  return out;
}

std::vector<FormatCombo> FormatCombos() {
  auto q = [](const char* f) { return absl::StrCat("{ format: ", f, " }"); };
  auto both = [&](const char* row, const char* col, const char* extra = "") {
    return absl::StrCat("rowwise ", q(row), " columnwise ", q(col), " ", extra);
  };
  return {
      {"Fp8Current", both("FP8_CURRENT", "FP8_CURRENT")},
      {"Fp8Delayed", both("FP8_DELAYED", "FP8_DELAYED")},
      {"Mxfp8", both("MXFP8", "MXFP8")},
      {"Nvfp4", both("NVFP4", "NVFP4")},
      {"Block128", both("FP8_BLOCK_128X128", "FP8_BLOCK_128X128")},
      {"Block1x128", both("FP8_BLOCK_1X128", "FP8_BLOCK_1X128")},
      {"Identity", both("IDENTITY_BF16", "IDENTITY_FP32", "source_dtype: FP32")},
      {"CurrentMxfp8", both("FP8_CURRENT", "MXFP8")},
      {"Pow2CurrentNvfp4Fp32Src",
       "rowwise { format: FP8_CURRENT pow2_scales: true } columnwise { format: NVFP4 } "
       "source_dtype: FP32"},
      {"Mxfp8FromRowwise", both("MXFP8", "FP8_CURRENT", "columnwise_source: ROWWISE_DEQUANTIZED")},
      {"CurrentNvfp4FromRowwise",
       both("FP8_CURRENT", "NVFP4", "columnwise_source: ROWWISE_DEQUANTIZED")},
      {"DelayedNvfp4FromRowwise",
       both("FP8_DELAYED", "NVFP4", "columnwise_source: ROWWISE_DEQUANTIZED")},
      {"RowwiseOnly", absl::StrCat("rowwise ", q("NVFP4"), " columnwise_usage: false")},
  };
}

}  // namespace testing
}  // namespace paramd
