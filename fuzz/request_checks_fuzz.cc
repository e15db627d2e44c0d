// libFuzzer target: the validation every RPC handler runs first
// (server/rpc/request_checks.h) and the tensor-name rule (common/names.h), on
// requests decoded from arbitrary bytes. The first byte picks the message;
// the rest is its protobuf wire encoding. Built and run by tools/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/names.h"
#include "proto/paramd.pb.h"
#include "server/rpc/request_checks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  paramd::RequestLimits limits;
  limits.max_tensors = 64;  // keep one input cheap
  (void)paramd::CheckTensorName(bytes);
  switch (data[0] % 4) {
    case 0: {
      paramd::rpc::LoadRequest r;
      if (r.ParseFromString(bytes)) (void)paramd::CheckLoadRequest(r, limits);
      break;
    }
    case 1: {
      paramd::rpc::LoadShardsRequest r;
      if (r.ParseFromString(bytes)) (void)paramd::CheckLoadShardsRequest(r, limits);
      break;
    }
    case 2: {
      paramd::rpc::FetchRequest r;
      if (r.ParseFromString(bytes)) (void)paramd::CheckFetchRequest(r, limits);
      break;
    }
    default: {
      paramd::rpc::DaemonStepRequest r;
      if (r.ParseFromString(bytes)) (void)paramd::CheckDaemonStepRequest(r);
      break;
    }
  }
  return 0;
}
