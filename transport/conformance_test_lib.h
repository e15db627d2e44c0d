// File: transport/conformance_test_lib.h
//
// The conformance suite every Transport backend passes (STYLE.md practice
// 9; "local" is the reference). A backend's test instantiates it:
//
//   INSTANTIATE_TEST_SUITE_P(Host, TransportConformanceTest,
//                            ::testing::Values(RegistryConformanceParam("host")),
//                            ConformanceParamName);
//
// and links //transport:conformance_test_lib (testonly, alwayslink). Each
// test builds a fresh world through the param's factory. The suite only
// posts a Recv concurrently with (never after) the matching Send, so
// rendezvous backends (NCCL) can pass it too.
//
// Covered: rank/world size, point-to-point from 0 bytes to 64 MiB in both
// directions and to self, Recv posted before Send, tag matching out of
// order, FIFO per tag, many concurrent senders, size mismatch, deadlines
// (no sender, past deadline, missing all-reduce member), argument checks,
// all-reduce max with NaN/Inf/-0/subnormals over overlapping and
// concurrent groups, all-reduce size disagreement, CanConnect, and a peer
// that shuts down (messages sent before are still received; then
// UNAVAILABLE quickly; own calls FAILED_PRECONDITION/CANCELLED).
#ifndef PARAMD_TRANSPORT_CONFORMANCE_TEST_LIB_H_
#define PARAMD_TRANSPORT_CONFORMANCE_TEST_LIB_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "transport/transport.h"

namespace paramd {

struct TransportConformanceParam {
  // Suffix of the instantiated test names.
  std::string name;
  // A connected world of `world_size` ranks; index = rank.
  std::function<absl::StatusOr<std::vector<std::unique_ptr<Transport>>>(int world_size)> make_world;
  // A message larger than the Recv buffer gives INVALID_ARGUMENT and a
  // smaller one returns its size. Backends that need exact sizes say false.
  bool detects_size_mismatch = true;
  // Send returns without a matching Recv (the message waits at the
  // receiver). Rendezvous backends say false.
  bool buffered_sends = true;
  // The largest point-to-point message tried.
  int64_t max_message_bytes = int64_t{64} << 20;
};

// A param whose worlds come from ConnectInProcessWorld(backend, n, options).
TransportConformanceParam RegistryConformanceParam(const std::string& backend,
                                                   const TransportOptions& options = {});

// For INSTANTIATE_TEST_SUITE_P: names instances by param.name.
std::string ConformanceParamName(const ::testing::TestParamInfo<TransportConformanceParam>& info);

class TransportConformanceTest : public ::testing::TestWithParam<TransportConformanceParam> {
 protected:
  // Adds a test failure and returns an empty vector if the world cannot be
  // made (callers ASSERT on the size).
  std::vector<std::unique_ptr<Transport>> MakeWorld(int world_size);
};

}  // namespace paramd

#endif  // PARAMD_TRANSPORT_CONFORMANCE_TEST_LIB_H_
