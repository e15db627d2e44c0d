// //transport:nccl_shared_gpu_repro — is the "two daemons on one GPU"
// corruption NCCL's or ours? (tag gpu, 2 GPUs; not a test: it prints RESULT
// lines and exits non-zero on any wrong byte, error or hang.)
//
// Shape of the failing setup of daemon_fetch_test (PARAMD_SPLIT_SAME_GPU=1):
// two sender processes on GPU 0 (the daemons) and one receiver process on
// GPU 1 (the trainer); each sender and the receiver form their own 2-rank
// NCCL communicator (sender rank 0, receiver rank 1), so the receiver holds
// two communicators whose peers are two processes on ONE GPU.
//
//   --mode=raw:       plain ncclCommInitRankConfig + ncclSend/ncclRecv (one
//                     group per message, one op per piece), blocking or
//                     --nonblocking communicators (our transport's kind);
//   --mode=transport: the same messages through NcclTransport (SendDevice /
//                     RecvDevice of //transport:nccl), one 2-rank world per
//                     sender.
// Each run does --iters messages per sender "serial" (the receiver takes A's
// message, then B's; a sender starts only when told to) and then --iters
// "concurrent" (both senders told at once, the receiver receives from both
// on two threads). Every message: pieces of several sizes (60000, 4, 4,
// 44000, 4, 4, 77, 4, 4 bytes like a split FP8 fetch, plus one of 0.5-2.5 MiB
// that varies per iteration), each byte a function of (sender, iteration,
// piece, offset) written by the sender before the send; the receiver
// poisons its buffers (0xEE) before each receive and checks every byte,
// classifying the first wrong byte of each piece: "other-sender" (the other
// sender's byte of the same iteration/piece/offset), "stale" (this
// sender's previous iteration), "unwritten" (poison) or "garbage".
// --skew makes sender B allocate 256 MiB first (other device addresses than
// A, to test the identical-address hypothesis). --senders_see_one_gpu runs
// the senders with CUDA_VISIBLE_DEVICES set to one GPU, as hybrid-paramd
// --gpu=N does (the receiver's GPU is then invisible to them).
// --receiver_uses_sender_gpu gives the receiver a context and an allocation
// on the senders' GPU too, as daemon_fetch_test's process has.
//
// The orchestrating parent never touches CUDA (it forks); children talk
// over pipes. Run with NCCL_NVLS_ENABLE=0.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/line_pipe.h"
#include "transport/nccl_transport.h"

ABSL_FLAG(std::string, mode, "raw", "raw (plain NCCL) or transport (NcclTransport)");
ABSL_FLAG(int, iters, 200, "messages per sender per phase");
ABSL_FLAG(bool, nonblocking, false, "raw mode: non-blocking communicators");
ABSL_FLAG(bool, skew, false, "sender B allocates 256 MiB first (different addresses)");
ABSL_FLAG(int, timeout_s, 90, "kill everything after this long");
ABSL_FLAG(bool, senders_see_one_gpu, false,
          "senders run with CUDA_VISIBLE_DEVICES=<first visible GPU> (like hybrid-paramd "
          "--gpu=0): the receiver's GPU is invisible to them");
ABSL_FLAG(bool, receiver_uses_sender_gpu, false,
          "the receiver also makes a context and 64 MiB on the senders' GPU first (like "
          "daemon_fetch_test's process, which also fetches on GPU 0)");

namespace paramd {
namespace {

constexpr int kSenders = 2;
constexpr uint8_t kPoison = 0xEE;

std::string Hex(const void* p, size_t n) {
  std::string s;
  const uint8_t* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) absl::StrAppend(&s, absl::Hex(b[i], absl::kZeroPad2));
  return s;
}

void Unhex(const std::string& s, void* p, size_t n) {
  uint8_t* b = static_cast<uint8_t*>(p);
  for (size_t i = 0; i < n && 2 * i + 1 < s.size(); ++i) {
    b[i] = static_cast<uint8_t>(std::stoi(s.substr(2 * i, 2), nullptr, 16));
  }
}

// ---- the messages ----

std::vector<size_t> PieceSizes(int iter) {
  return {60000, 4,  4, 44000, 4,
          4,     77, 4, 4,     (size_t{1} << 19) + static_cast<size_t>((iter * 40961) % (2 << 20))};
}
size_t MaxPieceSize(size_t piece) { return piece == 9 ? (size_t{5} << 19) : PieceSizes(0)[piece]; }

inline uint32_t PatternWord(int sender, int iter, int piece, size_t word) {
  uint32_t x = static_cast<uint32_t>(word) * 2654435761u;
  x ^= (static_cast<uint32_t>(sender + 1) << 28) ^ (static_cast<uint32_t>(iter) << 12) ^
       (static_cast<uint32_t>(piece) << 4);
  x ^= x >> 15;
  x *= 0x2c1b3c6du;
  x ^= x >> 12;
  return x;
}
inline uint8_t PatternByte(int sender, int iter, int piece, size_t offset) {
  return static_cast<uint8_t>(PatternWord(sender, iter, piece, offset >> 2) >> (8 * (offset & 3)));
}
// The `size` bytes of (sender, iter, piece) into `dst`.
void WritePattern(uint8_t* dst, size_t size, int sender, int iter, int piece) {
  size_t k = 0;
  for (; k + 4 <= size; k += 4) {
    const uint32_t w = PatternWord(sender, iter, piece, k >> 2);
    std::memcpy(dst + k, &w, 4);
  }
  for (; k < size; ++k) dst[k] = PatternByte(sender, iter, piece, k);
}

struct Buffers {
  std::vector<void*> dev;
  std::vector<uint8_t*> host;     // pinned
  std::vector<uint8_t> expected;  // receiver: scratch
};

Buffers Allocate() {
  Buffers b;
  for (size_t p = 0; p < PieceSizes(0).size(); ++p) {
    void* d = nullptr;
    void* h = nullptr;
    cudaMalloc(&d, MaxPieceSize(p));
    cudaHostAlloc(&h, MaxPieceSize(p), cudaHostAllocDefault);
    b.dev.push_back(d);
    b.host.push_back(static_cast<uint8_t*>(h));
  }
  return b;
}

// Sender: the iteration's bytes into its device buffers.
void Fill(Buffers& b, int sender, int iter, cudaStream_t stream) {
  const std::vector<size_t> sizes = PieceSizes(iter);
  for (size_t p = 0; p < sizes.size(); ++p) {
    WritePattern(b.host[p], sizes[p], sender, iter, p);
    cudaMemcpyAsync(b.dev[p], b.host[p], sizes[p], cudaMemcpyHostToDevice, stream);
  }
  cudaStreamSynchronize(stream);
}

void Poison(Buffers& b, int iter, cudaStream_t stream) {
  const std::vector<size_t> sizes = PieceSizes(iter);
  for (size_t p = 0; p < sizes.size(); ++p) cudaMemsetAsync(b.dev[p], kPoison, sizes[p], stream);
  cudaStreamSynchronize(stream);
}

struct Tally {
  int bad_messages = 0;
  int bad_pieces = 0;
  uint64_t bad_bytes = 0;
  int other_sender = 0, stale = 0, unwritten = 0, garbage = 0;
  std::string first;
  std::string errors;
  void Add(const Tally& t) {
    bad_messages += t.bad_messages;
    bad_pieces += t.bad_pieces;
    bad_bytes += t.bad_bytes;
    other_sender += t.other_sender;
    stale += t.stale;
    unwritten += t.unwritten;
    garbage += t.garbage;
    if (first.empty()) first = t.first;
    if (errors.empty()) errors = t.errors;
  }
};

// Receiver: checks every byte of `sender`'s message `iter`.
void Check(Buffers& b, int sender, int iter, Tally& tally) {
  const std::vector<size_t> sizes = PieceSizes(iter);
  bool bad_message = false;
  for (size_t p = 0; p < sizes.size(); ++p) {
    cudaMemcpy(b.host[p], b.dev[p], sizes[p], cudaMemcpyDeviceToHost);
    b.expected.resize(sizes[p]);
    WritePattern(b.expected.data(), sizes[p], sender, iter, p);
    if (std::memcmp(b.expected.data(), b.host[p], sizes[p]) == 0) continue;
    uint64_t bad = 0;
    size_t first = 0;
    for (size_t k = 0; k < sizes[p]; ++k) {
      if (b.host[p][k] != PatternByte(sender, iter, p, k)) {
        if (bad == 0) first = k;
        ++bad;
      }
    }
    if (bad == 0) continue;
    bad_message = true;
    ++tally.bad_pieces;
    tally.bad_bytes += bad;
    const uint8_t got = b.host[p][first];
    const char* kind = "garbage";
    if (got == PatternByte(1 - sender, iter, p, first)) {
      kind = "other-sender";
      ++tally.other_sender;
    } else if (iter > 0 && got == PatternByte(sender, iter - 1, p, first)) {
      kind = "stale";
      ++tally.stale;
    } else if (got == kPoison) {
      kind = "unwritten";
      ++tally.unwritten;
    } else {
      ++tally.garbage;
    }
    if (tally.first.empty()) {
      tally.first = absl::StrCat("sender ", sender, " iter ", iter, " piece ", p, " (", sizes[p],
                                 " B) offset ", first, ": got ", got, " want ",
                                 PatternByte(sender, iter, p, first), " (", kind, "), ", bad,
                                 " bad bytes in the piece");
    }
  }
  if (bad_message) ++tally.bad_messages;
}

// ---- raw NCCL ----

ncclResult_t WaitComm(ncclComm_t comm, ncclResult_t r) {
  if (r != ncclSuccess && r != ncclInProgress) return r;
  ncclResult_t state = ncclInProgress;
  while (state == ncclInProgress) {
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) return ncclSystemError;
  }
  return state;
}

absl::Status WaitStream(cudaStream_t stream, ncclComm_t comm, absl::Time deadline) {
  while (true) {
    cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) {
      return absl::InternalError(absl::StrCat("CUDA: ", cudaGetErrorString(q)));
    }
    ncclResult_t async = ncclSuccess;
    if (comm != nullptr) ncclCommGetAsyncError(comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      return absl::InternalError(absl::StrCat("NCCL: ", ncclGetErrorString(async)));
    }
    if (absl::Now() > deadline) return absl::DeadlineExceededError("stream wait");
    std::this_thread::yield();
  }
}

struct RawPeer {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
};

absl::Status RawInit(RawPeer& peer, const ncclUniqueId& id, int rank) {
  cudaStreamCreateWithFlags(&peer.stream, cudaStreamNonBlocking);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = absl::GetFlag(FLAGS_nonblocking) ? 0 : 1;
  ncclUniqueId copy = id;
  ncclResult_t r = ncclCommInitRankConfig(&peer.comm, 2, copy, rank, &config);
  if (config.blocking == 0) r = WaitComm(peer.comm, r);
  if (r != ncclSuccess) return absl::InternalError(ncclGetErrorString(r));
  return absl::OkStatus();
}

absl::Status RawMessage(RawPeer& peer, Buffers& b, int iter, bool send) {
  const std::vector<size_t> sizes = PieceSizes(iter);
  ncclGroupStart();
  for (size_t p = 0; p < sizes.size(); ++p) {
    if (send) {
      ncclSend(b.dev[p], sizes[p], ncclUint8, 1, peer.comm, peer.stream);
    } else {
      ncclRecv(b.dev[p], sizes[p], ncclUint8, 0, peer.comm, peer.stream);
    }
  }
  ncclResult_t r = ncclGroupEnd();
  if (absl::GetFlag(FLAGS_nonblocking)) r = WaitComm(peer.comm, r);
  if (r != ncclSuccess) return absl::InternalError(ncclGetErrorString(r));
  return WaitStream(peer.stream, peer.comm, absl::Now() + absl::Seconds(20));
}

// ---- transport ----

std::vector<MutableDeviceBytes> RecvPieces(Buffers& b, int iter) {
  std::vector<MutableDeviceBytes> out;
  const std::vector<size_t> sizes = PieceSizes(iter);
  for (size_t p = 0; p < sizes.size(); ++p) out.push_back({b.dev[p], sizes[p]});
  return out;
}
std::vector<DeviceBytes> SendPieces(Buffers& b, int iter) {
  std::vector<DeviceBytes> out;
  const std::vector<size_t> sizes = PieceSizes(iter);
  for (size_t p = 0; p < sizes.size(); ++p) out.push_back({b.dev[p], sizes[p]});
  return out;
}

// ---- roles ----

struct Link {
  int in = -1;   // from the other side
  int out = -1;  // to the other side
};

// Sender `s` on GPU 0: setup, then "go <iter>" -> one message -> "sent".
int Sender(int s, Link link, bool transport) {
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  if (absl::GetFlag(FLAGS_senders_see_one_gpu)) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    std::string first =
        visible == nullptr ? "0" : std::string(visible).substr(0, std::string(visible).find(','));
    setenv("CUDA_VISIBLE_DEVICES", first.c_str(), 1);
  }
  cudaSetDevice(0);
  void* skew = nullptr;
  if (s == 1 && absl::GetFlag(FLAGS_skew)) cudaMalloc(&skew, size_t{256} << 20);
  cudaStream_t fill;
  cudaStreamCreateWithFlags(&fill, cudaStreamNonBlocking);
  Buffers b = Allocate();
  RawPeer raw;
  std::unique_ptr<Transport> t;
  if (transport) {
    absl::StatusOr<std::unique_ptr<TransportEndpoint>> e = OpenNcclEndpoint();
    if (!e.ok()) {
      std::fprintf(stderr, "sender %d: %s\n", s, e.status().ToString().c_str());
      return 2;
    }
    WriteLine(link.out, (*e)->address());
    const std::string peer = ReadLine(link.in, absl::Seconds(60));
    absl::StatusOr<std::unique_ptr<Transport>> c = (*e)->Connect(0, {(*e)->address(), peer});
    if (!c.ok()) {
      std::fprintf(stderr, "sender %d: %s\n", s, c.status().ToString().c_str());
      return 2;
    }
    t = *std::move(c);
  } else {
    ncclUniqueId id;
    Unhex(ReadLine(link.in, absl::Seconds(60)), &id, sizeof(id));
    absl::Status st = RawInit(raw, id, 0);
    if (!st.ok()) {
      std::fprintf(stderr, "sender %d init: %s\n", s, st.ToString().c_str());
      return 2;
    }
  }
  std::printf("sender %d (pid %d) buffer 0 at %p\n", s, getpid(), b.dev[0]);
  std::fflush(stdout);
  WriteLine(link.out, "ready");
  for (std::string cmd; !(cmd = ReadLine(link.in, absl::Seconds(60))).empty() && cmd != "end";) {
    const int iter = std::stoi(cmd.substr(3));
    Fill(b, s, iter, fill);
    absl::Status st;
    if (transport) {
      st = AsNcclTransport(t.get())->SendDevice(1, 1 + iter, SendPieces(b, iter), nullptr,
                                                absl::Now() + absl::Seconds(20));
    } else {
      st = RawMessage(raw, b, iter, /*send=*/true);
    }
    if (!st.ok()) {
      std::fprintf(stderr, "sender %d iter %d: %s\n", s, iter, st.ToString().c_str());
      return 3;
    }
  }
  if (t != nullptr) t->Shutdown();
  if (raw.comm != nullptr) ncclCommDestroy(raw.comm);
  return 0;
}

// Receiver on GPU 1.
int Receiver(Link links[kSenders], bool transport) {
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  if (absl::GetFlag(FLAGS_receiver_uses_sender_gpu)) {
    void* p = nullptr;
    cudaSetDevice(0);
    cudaMalloc(&p, size_t{64} << 20);
    cudaMemset(p, 0, size_t{64} << 20);
    cudaDeviceSynchronize();
  }
  cudaSetDevice(1);
  const bool nonblocking = absl::GetFlag(FLAGS_nonblocking);
  Buffers b[kSenders] = {Allocate(), Allocate()};
  cudaStream_t poison;
  cudaStreamCreateWithFlags(&poison, cudaStreamNonBlocking);
  RawPeer raw[kSenders];
  std::unique_ptr<Transport> t[kSenders];
  if (transport) {
    std::unique_ptr<TransportEndpoint> e[kSenders];
    for (int s = 0; s < kSenders; ++s) {
      absl::StatusOr<std::unique_ptr<TransportEndpoint>> ep = OpenNcclEndpoint();
      if (!ep.ok()) return 2;
      e[s] = *std::move(ep);
      WriteLine(links[s].out, e[s]->address());
    }
    std::vector<std::thread> connects;
    absl::Status st[kSenders];
    for (int s = 0; s < kSenders; ++s) {
      const std::string peer = ReadLine(links[s].in, absl::Seconds(60));
      connects.emplace_back([&, s, peer] {
        cudaSetDevice(1);
        absl::StatusOr<std::unique_ptr<Transport>> c = e[s]->Connect(1, {peer, e[s]->address()});
        st[s] = c.status();
        if (c.ok()) t[s] = *std::move(c);
      });
    }
    for (std::thread& c : connects) c.join();
    for (int s = 0; s < kSenders; ++s) {
      if (!st[s].ok()) {
        std::fprintf(stderr, "receiver connect %d: %s\n", s, st[s].ToString().c_str());
        return 2;
      }
    }
  } else {
    ncclUniqueId id[kSenders];
    for (int s = 0; s < kSenders; ++s) {
      ncclGetUniqueId(&id[s]);
      WriteLine(links[s].out, Hex(&id[s], sizeof(id[s])));
    }
    // Both inits at once (each needs its sender).
    absl::Status st[kSenders];
    std::vector<std::thread> inits;
    for (int s = 0; s < kSenders; ++s) {
      inits.emplace_back([&, s] {
        cudaSetDevice(1);
        st[s] = RawInit(raw[s], id[s], 1);
      });
    }
    for (std::thread& i : inits) i.join();
    for (int s = 0; s < kSenders; ++s) {
      if (!st[s].ok()) {
        std::fprintf(stderr, "receiver init %d: %s\n", s, st[s].ToString().c_str());
        return 2;
      }
    }
  }
  for (int s = 0; s < kSenders; ++s) {
    if (ReadLine(links[s].in, absl::Seconds(60)) != "ready") return 2;
  }
  std::printf("receiver (pid %d) buffers of sender 0 at %p, of sender 1 at %p\n", getpid(),
              b[0].dev[0], b[1].dev[0]);
  const int iters = absl::GetFlag(FLAGS_iters);
  // One receive of sender s's message `iter`, checked.
  auto receive = [&](int s, int iter, Tally& tally) -> bool {
    cudaSetDevice(1);
    absl::Status st;
    if (transport) {
      st = AsNcclTransport(t[s].get())
               ->RecvDevice(0, 1 + iter, RecvPieces(b[s], iter), absl::Now() + absl::Seconds(20));
    } else {
      st = RawMessage(raw[s], b[s], iter, /*send=*/false);
    }
    if (!st.ok()) {
      tally.errors = absl::StrCat("sender ", s, " iter ", iter, ": ", st.ToString());
      return false;
    }
    Check(b[s], s, iter, tally);
    return true;
  };
  int rc = 0;
  const std::string mode =
      transport ? "transport" : (nonblocking ? "raw-nonblocking" : "raw-blocking");
  for (const bool concurrent : {false, true}) {
    Tally total;
    const absl::Time start = absl::Now();
    bool ok = true;
    for (int i = 0; i < iters && ok; ++i) {
      // Each phase uses its own iteration numbers (tags stay unique).
      const int iter = (concurrent ? iters : 0) + i;
      for (int s = 0; s < kSenders; ++s) Poison(b[s], iter, poison);
      if (concurrent) {
        Tally tally[kSenders];
        bool got[kSenders] = {false, false};
        std::vector<std::thread> threads;
        for (int s = 0; s < kSenders; ++s) WriteLine(links[s].out, absl::StrCat("go ", iter));
        for (int s = 0; s < kSenders; ++s) {
          threads.emplace_back([&, s] { got[s] = receive(s, iter, tally[s]); });
        }
        for (std::thread& th : threads) th.join();
        for (int s = 0; s < kSenders; ++s) {
          total.Add(tally[s]);
          ok = ok && got[s];
        }
      } else {
        for (int s = 0; s < kSenders && ok; ++s) {
          WriteLine(links[s].out, absl::StrCat("go ", iter));
          ok = receive(s, iter, total);
        }
      }
    }
    if (!ok || total.bad_messages > 0) rc = 1;
    std::printf(
        "RESULT mode=%s phase=%s skew=%d messages=%d bad_messages=%d bad_pieces=%d "
        "bad_bytes=%llu other-sender=%d stale=%d unwritten=%d garbage=%d error=%s "
        "seconds=%.2f\n",
        mode.c_str(), concurrent ? "concurrent" : "serial", absl::GetFlag(FLAGS_skew) ? 1 : 0,
        kSenders * iters, total.bad_messages, total.bad_pieces,
        static_cast<unsigned long long>(total.bad_bytes), total.other_sender, total.stale,
        total.unwritten, total.garbage, total.errors.empty() ? "none" : total.errors.c_str(),
        absl::ToDoubleSeconds(absl::Now() - start));
    if (!total.first.empty()) std::printf("  first wrong byte: %s\n", total.first.c_str());
    std::fflush(stdout);
    if (!ok) break;  // an error: the senders may be stuck
  }
  for (int s = 0; s < kSenders; ++s) WriteLine(links[s].out, "end");
  for (int s = 0; s < kSenders; ++s) {
    if (t[s] != nullptr) t[s]->Shutdown();
    if (raw[s].comm != nullptr) ncclCommDestroy(raw[s].comm);
  }
  return rc;
}

int Main() {
  signal(SIGPIPE, SIG_IGN);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "raw" && mode != "transport") {
    std::fprintf(stderr, "--mode=raw|transport\n");
    return 2;
  }
  const bool transport = mode == "transport";
  // pipes[s][0]: receiver -> sender s, pipes[s][1]: sender s -> receiver.
  int pipes[kSenders][2][2];
  for (auto& per : pipes) {
    for (auto& p : per) {
      if (pipe(p) != 0) return 2;
    }
  }
  std::vector<pid_t> pids;
  for (int s = 0; s < kSenders; ++s) {
    pid_t pid = fork();
    if (pid == 0) _exit(Sender(s, Link{pipes[s][0][0], pipes[s][1][1]}, transport));
    pids.push_back(pid);
  }
  pid_t rpid = fork();
  if (rpid == 0) {
    Link links[kSenders];
    for (int s = 0; s < kSenders; ++s) links[s] = Link{pipes[s][1][0], pipes[s][0][1]};
    _exit(Receiver(links, transport));
  }
  pids.push_back(rpid);
  const absl::Time deadline = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  int rc = 0;
  std::vector<bool> done(pids.size(), false);
  for (size_t left = pids.size(); left > 0;) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      if (waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        done[i] = true;
        --left;
        const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (code != 0) {
          std::printf("%s exited with %d\n", i + 1 == pids.size() ? "receiver" : "a sender", code);
          rc = 1;
        }
      }
    }
    if (left > 0 && absl::Now() > deadline) {
      std::printf("HANG: killing the children after %d s\n", absl::GetFlag(FLAGS_timeout_s));
      for (size_t i = 0; i < pids.size(); ++i) {
        if (!done[i]) kill(pids[i], SIGKILL);
      }
      for (size_t i = 0; i < pids.size(); ++i) {
        if (!done[i]) waitpid(pids[i], nullptr, 0);
      }
      return 1;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::printf("REPRO %s%s%s%s%s: %s\n", mode.c_str(),
              absl::GetFlag(FLAGS_nonblocking) ? " nonblocking" : "",
              absl::GetFlag(FLAGS_skew) ? " skew" : "",
              absl::GetFlag(FLAGS_senders_see_one_gpu) ? " senders-see-one-gpu" : "",
              absl::GetFlag(FLAGS_receiver_uses_sender_gpu) ? " receiver-uses-sender-gpu" : "",
              rc == 0 ? "CLEAN" : "FAILED");
  return rc;
}

}  // namespace
}  // namespace paramd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return paramd::Main();
}
