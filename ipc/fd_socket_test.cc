#include "ipc/fd_socket.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "gtest/gtest.h"

namespace paramd {
namespace ipc {
namespace {

// A memfd holding `text` (stands in for a CUDA shareable handle).
int MemFd(const std::string& text) {
  int fd = memfd_create("fd_socket_test", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  return fd;
}

std::string ReadAll(int fd) {
  char buf[64] = {};
  EXPECT_GE(pread(fd, buf, sizeof(buf) - 1, 0), 0);
  return buf;
}

TEST(FdSocket, DescriptorsTravelBothWaysAndTheSecretIsChecked) {
  std::string registered;
  uint64_t registered_id = 0;
  absl::StatusOr<std::unique_ptr<FdSocketServer>> server =
      FdSocketServer::Start([&](const FdRequest& r, int fd) {
        FdReply reply;
        if (r.op == FdOp::kRegisterBuffer) {
          registered = fd >= 0 ? ReadAll(fd) : "";
          registered_id = r.arg0;
          if (fd >= 0) close(fd);
          return reply;
        }
        if (r.session != 7) {
          reply.status = absl::NotFoundError("no such session");
          return reply;
        }
        reply.epoch = 42;
        reply.fds = {MemFd("region-a"), MemFd("region-b")};
        reply.sizes = {100, 200};
        return reply;
      });
  ASSERT_TRUE(server.ok()) << server.status();
  FdRequest request;
  request.secret = (*server)->secret();
  request.session = 7;
  absl::StatusOr<FdReply> reply = FdSocketCall((*server)->name(), request);
  ASSERT_TRUE(reply.ok()) << reply.status();
  ASSERT_TRUE(reply->status.ok()) << reply->status;
  EXPECT_EQ(reply->epoch, 42u);
  ASSERT_EQ(reply->fds.size(), 2u);
  EXPECT_EQ(ReadAll(reply->fds[0]), "region-a");
  EXPECT_EQ(ReadAll(reply->fds[1]), "region-b");
  EXPECT_EQ(reply->sizes, (std::vector<uint64_t>{100, 200}));
  for (int fd : reply->fds) close(fd);

  request.session = 8;
  reply = FdSocketCall((*server)->name(), request);
  ASSERT_TRUE(reply.ok());
  EXPECT_EQ(reply->status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reply->status.message(), "no such session");

  request.op = FdOp::kRegisterBuffer;
  request.arg0 = 3;
  int mine = MemFd("gradients");
  reply = FdSocketCall((*server)->name(), request, mine);
  close(mine);
  ASSERT_TRUE(reply.ok());
  EXPECT_TRUE(reply->status.ok());
  EXPECT_EQ(registered, "gradients");
  EXPECT_EQ(registered_id, 3u);

  request.secret[0] ^= 1;
  reply = FdSocketCall((*server)->name(), request);
  ASSERT_TRUE(reply.ok());
  EXPECT_EQ(reply->status.code(), absl::StatusCode::kPermissionDenied);

  // A stopped server (a dead daemon): UNAVAILABLE, not a hang.
  const std::string name = (*server)->name();
  server->reset();
  request.secret[0] ^= 1;
  reply = FdSocketCall(name, request);
  EXPECT_EQ(reply.status().code(), absl::StatusCode::kUnavailable) << reply.status();
}

}  // namespace
}  // namespace ipc
}  // namespace paramd
