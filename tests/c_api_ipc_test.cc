// The same-GPU calls of the C API (client/c_api_ipc.h) on bad input and on a
// cpu cluster: clear codes, no crash. NULL and foreign handles are
// INVALID_ARGUMENT; a session with a cpu daemon is UNIMPLEMENTED in a build
// without CUDA, and with CUDA refused at open or at the first acquire
// (FAILED_PRECONDITION: the daemon exports nothing); the client goes on
// serving. The GPU side runs in
// //python/tests:ipc_gpu_test (through hybrid_paramd.IpcSession).
#include "client/c_api_ipc.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "tests/client_cluster.h"

namespace paramd {
namespace {

TEST(CApiIpc, NullAndForeignHandlesAreInvalidArgument) {
  hpd_status st;
  hpd_ipc* ipc = nullptr;
  EXPECT_EQ(hpd_ipc_open(nullptr, 0, 0, 0, &ipc, &st), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(ipc, nullptr);
  int64_t v = 0;
  size_t n = 0;
  EXPECT_EQ(hpd_ipc_acquire(nullptr, -1, nullptr, nullptr, 0, &v, &n, &st), HPD_INVALID_ARGUMENT);
  int junk = 0;
  hpd_ipc* foreign = reinterpret_cast<hpd_ipc*>(&junk);
  hpd_ipc_view view;
  EXPECT_EQ(hpd_ipc_view_at(foreign, 0, &view, &st), HPD_INVALID_ARGUMENT);
  EXPECT_NE(std::string(st.message).find("not a live hpd_ipc"), std::string::npos) << st.message;
  EXPECT_EQ(hpd_ipc_release(foreign, &st), HPD_INVALID_ARGUMENT);
  void* p = nullptr;
  EXPECT_EQ(hpd_ipc_gradient_buffer(foreign, 64, &p, &st), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(hpd_ipc_push(foreign, 0, nullptr, 0, nullptr, &st), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(hpd_ipc_stats(foreign, nullptr, nullptr, &st), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(hpd_ipc_close(foreign, &st), HPD_INVALID_ARGUMENT);
  EXPECT_EQ(hpd_ipc_close(nullptr, nullptr), HPD_INVALID_ARGUMENT);
}

TEST(CApiIpc, ACpuDaemonRefusesASessionAndTheClientGoesOn) {
  auto cluster = testing::TestCluster::Start({.daemons = 1, .expected_pushers = 1});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  hpd_connect_options o;
  hpd_connect_options_init(&o);
  const std::string address = (*cluster)->coordinator_address();
  o.address = address.c_str();
  o.observer = 1;
  hpd_client* c = nullptr;
  hpd_status st;
  ASSERT_EQ(hpd_connect(&o, &c, &st), HPD_OK) << st.message;
  hpd_ipc* ipc = nullptr;
  EXPECT_EQ(hpd_ipc_open(c, 0, -1, 0, &ipc, &st), HPD_INVALID_ARGUMENT);  // bad device
  EXPECT_EQ(hpd_ipc_open(c, 0, 0, -5, &ipc, &st), HPD_INVALID_ARGUMENT);  // bad lease
  EXPECT_EQ(hpd_ipc_open(c, 0, 0, 0, nullptr, &st), HPD_INVALID_ARGUMENT);
  const int32_t code = hpd_ipc_open(c, 0, 0, 0, &ipc, &st);
  if (!hpd_has_cuda()) {
    EXPECT_EQ(code, HPD_UNIMPLEMENTED) << st.message;
    EXPECT_NE(std::string(st.message).find("--config=cuda"), std::string::npos) << st.message;
    EXPECT_EQ(ipc, nullptr);
  } else if (code == HPD_OK) {
    // A CUDA build on a GPU machine opens the session; the cpu daemon
    // (here without a model) exports nothing to pin.
    int64_t v = 0;
    size_t n = 0;
    EXPECT_EQ(hpd_ipc_acquire(ipc, -1, nullptr, nullptr, 0, &v, &n, &st), HPD_FAILED_PRECONDITION)
        << st.message;
    EXPECT_EQ(hpd_ipc_close(ipc, &st), HPD_OK) << st.message;
  } else {
    EXPECT_EQ(code, HPD_FAILED_PRECONDITION) << hpd_code_name(code) << ": " << st.message;
  }
  // The client still serves.
  char* json = nullptr;
  EXPECT_EQ(hpd_status_json(c, 0, 5000, &json, &st), HPD_OK) << st.message;
  hpd_free_string(json);
  EXPECT_EQ(hpd_close(c, &st), HPD_OK);
}

}  // namespace
}  // namespace paramd
