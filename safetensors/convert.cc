#include "safetensors/convert.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/reference.h"

namespace paramd {
namespace safetensors {
namespace {

uint16_t Load16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// IEEE binary16 -> binary32, exact.
float DecodeF16(uint16_t h) {
  const int exponent = (h >> 10) & 0x1F;
  const int mantissa = h & 0x3FF;
  float v;
  if (exponent == 0) {
    v = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    v = mantissa != 0 ? std::numeric_limits<float>::quiet_NaN()
                      : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  }
  return (h & 0x8000) ? -v : v;
}

}  // namespace

bool ConvertsToFloat(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF64:
    case Dtype::kF32:
    case Dtype::kF16:
    case Dtype::kBF16:
    case Dtype::kF8E4M3:
    case Dtype::kF8E5M2:
      return true;
    default:
      return false;
  }
}

absl::Status DecodeToFloat(Dtype dtype, absl::Span<const uint8_t> bytes, absl::Span<float> out) {
  if (!ConvertsToFloat(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype ", DtypeName(dtype), " does not convert to FP32"));
  }
  const size_t elem = static_cast<size_t>(DtypeSize(dtype));
  if (bytes.size() % elem != 0 || bytes.size() / elem != out.size()) {
    return absl::InvalidArgumentError(absl::StrCat(bytes.size(), " bytes of ", DtypeName(dtype),
                                                   " do not make ", out.size(), " values"));
  }
  const uint8_t* p = bytes.data();
  const size_t n = out.size();
  switch (dtype) {
    case Dtype::kF32:
      std::memcpy(out.data(), p, n * 4);  // little-endian host
      break;
    case Dtype::kF64:
      for (size_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, p + 8 * i, 8);
        out[i] = static_cast<float>(d);
      }
      break;
    case Dtype::kF16:
      for (size_t i = 0; i < n; ++i) out[i] = DecodeF16(Load16(p + 2 * i));
      break;
    case Dtype::kBF16:
      for (size_t i = 0; i < n; ++i) out[i] = ref::DecodeBf16(Load16(p + 2 * i));
      break;
    case Dtype::kF8E4M3:
      for (size_t i = 0; i < n; ++i) out[i] = ref::DecodeE4M3(p[i]);
      break;
    case Dtype::kF8E5M2:
      for (size_t i = 0; i < n; ++i) out[i] = ref::DecodeE5M2(p[i]);
      break;
    default:
      break;  // excluded above
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> ReadTensorAsFloat(const SafetensorsFile& file,
                                                     const TensorInfo& tensor) {
  if (!ConvertsToFloat(tensor.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor '", tensor.name,
                                                   "' has dtype ", DtypeName(tensor.dtype),
                                                   ", which does not convert to FP32"));
  }
  std::vector<uint8_t> bytes(tensor.num_bytes());
  RETURN_IF_ERROR(file.ReadTensorBytes(tensor, 0, absl::MakeSpan(bytes)));
  std::vector<float> values(static_cast<size_t>(tensor.num_elements));
  RETURN_IF_ERROR(DecodeToFloat(tensor.dtype, bytes, absl::MakeSpan(values)));
  return values;
}

void AppendBf16(absl::Span<const float> values, std::vector<uint8_t>& out) {
  out.reserve(out.size() + 2 * values.size());
  for (float v : values) {
    const uint16_t b = ref::EncodeBf16(v);
    out.push_back(static_cast<uint8_t>(b & 0xFF));
    out.push_back(static_cast<uint8_t>(b >> 8));
  }
}

void AppendF32(absl::Span<const float> values, std::vector<uint8_t>& out) {
  const size_t start = out.size();
  out.resize(start + 4 * values.size());
  std::memcpy(out.data() + start, values.data(), 4 * values.size());
}

}  // namespace safetensors
}  // namespace paramd
