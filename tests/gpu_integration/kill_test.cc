// Kill tests of the NCCL data plane, with real processes: the test process
// only orchestrates (it never touches CUDA, so it can fork); each role is a
// child process with its own GPU, and the orchestrator SIGKILLs one of them
// in the middle of an 8 GiB device-to-device fetch.
//   TrainerKilledMidFetch: the daemon (GPU 0) gets an error within its
//     deadline, then keeps serving another trainer, and a later send to the
//     dead trainer fails at once.
//   DaemonKilledMidFetch: the trainer (GPU 1) gets an error within its
//     deadline, never a hang.
// Tag gpu. Two GPUs: the bytes move over NCCL. One GPU: every role on GPU 0,
// where the transport moves device messages inline through the host (NCCL
// refuses two ranks on one GPU), so the same kills test the control
// channel's hang-up detection and the inline path; the big transfer is
// 1 GiB there (it is staged in host memory twice).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/line_pipe.h"
#include "gtest/gtest.h"
#include "transport/nccl_transport.h"

namespace paramd {
namespace {

constexpr size_t kWarm = size_t{64} << 20;
constexpr size_t kBig = size_t{8} << 30;
constexpr size_t kBigOneGpu = size_t{1} << 30;

// Set by Roles() before the children fork (they inherit them): the
// trainers' GPU and the big transfer's size.
int g_trainer_device = 1;
size_t g_big = kBig;

// A child process running `role(in_fd, out_fd)`.
struct Child {
  pid_t pid = -1;
  int to = -1;    // parent writes
  int from = -1;  // parent reads
};

template <typename Fn>
Child Spawn(Fn role) {
  int down[2], up[2];
  if (pipe(down) != 0 || pipe(up) != 0) return {};
  pid_t pid = fork();
  if (pid == 0) {
    close(down[1]);
    close(up[0]);
    role(down[0], up[1]);
    _exit(0);
  }
  close(down[0]);
  close(up[1]);
  return Child{pid, down[1], up[0]};
}

void Reap(std::vector<Child>& children) {
  for (Child& c : children) {
    if (c.pid <= 0) continue;
    int status = 0;
    for (int i = 0; i < 100 && waitpid(c.pid, &status, WNOHANG) == 0; ++i) {
      absl::SleepFor(absl::Milliseconds(100));
    }
    if (waitpid(c.pid, &status, WNOHANG) == 0) {
      kill(c.pid, SIGKILL);
      waitpid(c.pid, &status, 0);
    }
    close(c.to);
    close(c.from);
  }
}

// Common start of every role: endpoint on `device`, address up, world down,
// connect. Null on failure (reported as "error ...").
std::unique_ptr<Transport> Join(int device, int rank, int in, int out) {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  cudaSetDevice(device);
  absl::StatusOr<std::unique_ptr<TransportEndpoint>> e = OpenNcclEndpoint();
  if (!e.ok()) {
    WriteLine(out, absl::StrCat("error ", e.status().ToString()));
    return nullptr;
  }
  WriteLine(out, absl::StrCat("addr ", (*e)->address()));
  std::string world = ReadLine(in, absl::Seconds(60));
  std::vector<std::string> addresses = absl::StrSplit(world, ' ', absl::SkipEmpty());
  if (addresses.empty() || addresses[0] != "world") return nullptr;
  addresses.erase(addresses.begin());
  absl::StatusOr<std::unique_ptr<Transport>> t = (*e)->Connect(rank, addresses);
  if (!t.ok()) {
    WriteLine(out, absl::StrCat("error ", t.status().ToString()));
    return nullptr;
  }
  WriteLine(out, "connected");
  return *std::move(t);
}

void* DeviceFill(size_t bytes, int value) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
  cudaMemset(p, value, bytes);
  cudaDeviceSynchronize();
  return p;
}

bool DeviceAllEqual(const void* p, size_t bytes, uint8_t value) {
  std::vector<uint8_t> host(bytes);
  cudaMemcpy(host.data(), p, bytes, cudaMemcpyDeviceToHost);
  for (uint8_t b : host) {
    if (b != value) return false;
  }
  return true;
}

std::string Outcome(const absl::Status& s, absl::Time start) {
  return absl::StrCat("done ", static_cast<int>(s.code()), " ",
                      absl::ToInt64Milliseconds(absl::Now() - start));
}

// Runs the handshake from the orchestrator's side.
bool StartWorld(std::vector<Child>& children) {
  std::vector<std::string> addresses;
  for (Child& c : children) {
    std::string line = ReadLine(c.from, absl::Seconds(120));
    if (line.rfind("addr ", 0) != 0) {
      ADD_FAILURE() << "child said: '" << line << "'";
      return false;
    }
    addresses.push_back(line.substr(5));
  }
  for (Child& c : children) WriteLine(c.to, "world " + absl::StrJoin(addresses, " "));
  for (Child& c : children) {
    std::string line = ReadLine(c.from, absl::Seconds(120));
    if (line != "connected") {
      ADD_FAILURE() << "child said: '" << line << "'";
      return false;
    }
  }
  return true;
}

// "done <code> <ms>" -> (code, ms).
std::pair<int, int64_t> ParseDone(const std::string& line) {
  std::vector<std::string> f = absl::StrSplit(line, ' ');
  int code = -1;
  int64_t ms = -1;
  if (f.size() == 3 && f[0] == "done") {
    (void)absl::SimpleAtoi(f[1], &code);
    (void)absl::SimpleAtoi(f[2], &ms);
  }
  return {code, ms};
}

int GpuCountInChild() {
  // Writing to a killed child's pipe must not kill the orchestrator.
  signal(SIGPIPE, SIG_IGN);
  // The orchestrator must not initialise CUDA: ask a throwaway child.
  int fds[2];
  if (pipe(fds) != 0) return 0;
  pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    WriteLine(fds[1], absl::StrCat(n));
    _exit(0);
  }
  close(fds[1]);
  std::string line = ReadLine(fds[0], absl::Seconds(60));
  close(fds[0]);
  int status;
  waitpid(pid, &status, 0);
  int n = 0;
  (void)absl::SimpleAtoi(line, &n);
  return n;
}

// Trainers on GPU 1 with two GPUs, else beside the daemon on GPU 0. False
// without a GPU.
bool Roles() {
  const int gpus = GpuCountInChild();
  g_trainer_device = gpus >= 2 ? 1 : 0;
  g_big = gpus >= 2 ? kBig : kBigOneGpu;
  std::printf("kill_test: %d GPU(s): trainers on GPU %d, %s, big transfer %zu MiB\n", gpus,
              g_trainer_device, gpus >= 2 ? "NCCL" : "inline (one GPU)", g_big >> 20);
  return gpus >= 1;
}

TEST(GpuKillTest, TrainerKilledMidFetch) {
  if (!Roles()) GTEST_SKIP() << "needs a GPU";
  std::vector<Child> children;
  // rank 0: daemon on GPU 0.
  children.push_back(Spawn([](int in, int out) {
    std::unique_ptr<Transport> t = Join(0, 0, in, out);
    if (t == nullptr) return;
    NcclTransport& n = *AsNcclTransport(t.get());
    void* big = DeviceFill(g_big, 7);
    for (std::string cmd; !(cmd = ReadLine(in, absl::Seconds(120))).empty();) {
      const absl::Time start = absl::Now();
      absl::Status s;
      if (cmd == "warm") {
        s = n.SendDevice(1, 1, {{big, kWarm}}, nullptr, start + absl::Seconds(60));
        if (s.ok()) s = n.SendDevice(2, 2, {{big, kWarm}}, nullptr, start + absl::Seconds(60));
      } else if (cmd == "big") {
        WriteLine(out, "sending");
        s = n.SendDevice(1, 3, {{big, g_big}}, nullptr, start + absl::Seconds(5));
      } else if (cmd == "serve_b") {
        s = n.SendDevice(2, 4, {{big, kWarm}}, nullptr, start + absl::Seconds(30));
      } else if (cmd == "again_a") {
        s = n.SendDevice(1, 5, {{big, kWarm}}, nullptr, start + absl::Seconds(5));
      } else {
        break;
      }
      WriteLine(out, Outcome(s, start));
    }
  }));
  // ranks 1 and 2: trainers A and B on GPU 1.
  for (int rank : {1, 2}) {
    children.push_back(Spawn([rank](int in, int out) {
      std::unique_ptr<Transport> t = Join(g_trainer_device, rank, in, out);
      if (t == nullptr) return;
      NcclTransport& n = *AsNcclTransport(t.get());
      void* buf = DeviceFill(rank == 1 ? g_big : kWarm, 0);
      for (std::string cmd; !(cmd = ReadLine(in, absl::Seconds(120))).empty();) {
        const absl::Time start = absl::Now();
        absl::Status s;
        if (cmd == "warm") {
          s = n.RecvDevice(0, rank, {{buf, kWarm}}, start + absl::Seconds(60));
          if (s.ok() && !DeviceAllEqual(buf, kWarm, 7)) s = absl::DataLossError("bytes");
        } else if (cmd == "big") {
          WriteLine(out, "posted");
          s = n.RecvDevice(0, 3, {{buf, g_big}}, start + absl::Seconds(60));
        } else if (cmd == "recv4") {
          cudaMemset(buf, 0, kWarm);
          cudaDeviceSynchronize();
          s = n.RecvDevice(0, 4, {{buf, kWarm}}, start + absl::Seconds(30));
          if (s.ok() && !DeviceAllEqual(buf, kWarm, 7)) s = absl::DataLossError("bytes");
        } else {
          break;
        }
        WriteLine(out, Outcome(s, start));
      }
    }));
  }
  Child& daemon = children[0];
  Child& a = children[1];
  Child& b = children[2];
  if (StartWorld(children)) {
    for (Child* c : {&daemon, &a, &b}) WriteLine(c->to, "warm");
    for (Child* c : {&daemon, &a, &b}) {
      EXPECT_EQ(ParseDone(ReadLine(c->from, absl::Seconds(120))).first, 0) << "warm-up";
    }
    WriteLine(a.to, "big");
    EXPECT_EQ(ReadLine(a.from, absl::Seconds(30)), "posted");
    WriteLine(daemon.to, "big");
    EXPECT_EQ(ReadLine(daemon.from, absl::Seconds(30)), "sending");
    absl::SleepFor(absl::Milliseconds(3));
    kill(a.pid, SIGKILL);
    const auto [code, ms] = ParseDone(ReadLine(daemon.from, absl::Seconds(30)));
    // An error (or, if the 8 GiB got out before the kill, success) within
    // the 5 s deadline plus slack: never a hang.
    EXPECT_GE(code, 0) << "daemon did not answer";
    EXPECT_LT(ms, 8000);
    std::printf("daemon's send to the killed trainer: code %d after %lld ms\n", code,
                static_cast<long long>(ms));
    // The daemon keeps serving trainer B.
    WriteLine(b.to, "recv4");
    WriteLine(daemon.to, "serve_b");
    EXPECT_EQ(ParseDone(ReadLine(daemon.from, absl::Seconds(60))).first, 0) << "serving B";
    EXPECT_EQ(ParseDone(ReadLine(b.from, absl::Seconds(60))).first, 0) << "B received";
    // A later send to the dead trainer fails, quickly.
    WriteLine(daemon.to, "again_a");
    const auto [code2, ms2] = ParseDone(ReadLine(daemon.from, absl::Seconds(30)));
    EXPECT_GT(code2, 0);
    EXPECT_LT(ms2, 6000);
  }
  for (Child& c : children) WriteLine(c.to, "quit");
  Reap(children);
}

TEST(GpuKillTest, DaemonKilledMidFetch) {
  if (!Roles()) GTEST_SKIP() << "needs a GPU";
  std::vector<Child> children;
  children.push_back(Spawn([](int in, int out) {
    std::unique_ptr<Transport> t = Join(0, 0, in, out);
    if (t == nullptr) return;
    NcclTransport& n = *AsNcclTransport(t.get());
    void* big = DeviceFill(g_big, 9);
    for (std::string cmd; !(cmd = ReadLine(in, absl::Seconds(120))).empty();) {
      const absl::Time start = absl::Now();
      absl::Status s;
      if (cmd == "warm") {
        s = n.SendDevice(1, 1, {{big, kWarm}}, nullptr, start + absl::Seconds(60));
      } else if (cmd == "big") {
        WriteLine(out, "sending");
        s = n.SendDevice(1, 3, {{big, g_big}}, nullptr, start + absl::Seconds(60));
      } else {
        break;
      }
      WriteLine(out, Outcome(s, start));
    }
  }));
  children.push_back(Spawn([](int in, int out) {
    std::unique_ptr<Transport> t = Join(g_trainer_device, 1, in, out);
    if (t == nullptr) return;
    NcclTransport& n = *AsNcclTransport(t.get());
    void* buf = DeviceFill(g_big, 0);
    for (std::string cmd; !(cmd = ReadLine(in, absl::Seconds(120))).empty();) {
      const absl::Time start = absl::Now();
      absl::Status s;
      if (cmd == "warm") {
        s = n.RecvDevice(0, 1, {{buf, kWarm}}, start + absl::Seconds(60));
      } else if (cmd == "big") {
        WriteLine(out, "posted");
        s = n.RecvDevice(0, 3, {{buf, g_big}}, start + absl::Seconds(5));
      } else {
        break;
      }
      WriteLine(out, Outcome(s, start));
    }
  }));
  Child& daemon = children[0];
  Child& trainer = children[1];
  if (StartWorld(children)) {
    for (Child* c : {&daemon, &trainer}) WriteLine(c->to, "warm");
    for (Child* c : {&daemon, &trainer}) {
      EXPECT_EQ(ParseDone(ReadLine(c->from, absl::Seconds(120))).first, 0) << "warm-up";
    }
    WriteLine(trainer.to, "big");
    EXPECT_EQ(ReadLine(trainer.from, absl::Seconds(30)), "posted");
    WriteLine(daemon.to, "big");
    EXPECT_EQ(ReadLine(daemon.from, absl::Seconds(30)), "sending");
    absl::SleepFor(absl::Milliseconds(3));
    kill(daemon.pid, SIGKILL);
    const auto [code, ms] = ParseDone(ReadLine(trainer.from, absl::Seconds(30)));
    std::printf("trainer's fetch from the killed daemon: code %d after %lld ms\n", code,
                static_cast<long long>(ms));
    EXPECT_GT(code, 0) << "the trainer must see an error (or it did not answer: -1)";
    EXPECT_LT(ms, 5000 + 2000) << "error within the 5 s deadline (+ abort)";
  }
  for (Child& c : children) WriteLine(c.to, "quit");
  Reap(children);
}

}  // namespace
}  // namespace paramd
