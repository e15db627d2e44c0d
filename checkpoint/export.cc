#include "checkpoint/export.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "safetensors/convert.h"
#include "safetensors/safetensors.h"
#include "safetensors/sharded.h"

namespace paramd {
namespace checkpoint {
namespace {

safetensors::Dtype ToSafetensorsDtype(ExportDtype dtype) {
  return dtype == ExportDtype::kBf16 ? safetensors::Dtype::kBF16 : safetensors::Dtype::kF32;
}

absl::Status CheckTensor(const ExportTensor& tensor) {
  if (tensor.rows < 1 || tensor.cols < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor.name, " has ", tensor.rows,
                                                   " x ", tensor.cols, " rows x cols"));
  }
  ASSIGN_OR_RETURN(int64_t elements, safetensors::NumElements(tensor.shape));
  if (elements != tensor.rows * tensor.cols) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor.name, ": shape holds ",
                                                   elements, " elements, rows x cols ",
                                                   tensor.rows * tensor.cols));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view ExportDtypeName(ExportDtype dtype) {
  return dtype == ExportDtype::kBf16 ? "bf16" : "fp32";
}

absl::StatusOr<ExportDtype> ParseExportDtype(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "bf16" || lower == "bfloat16") return ExportDtype::kBf16;
  if (lower == "fp32" || lower == "f32" || lower == "float32") return ExportDtype::kFp32;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown export dtype '", name, "' (bf16 or fp32)"));
}

int ExportDtypeSize(ExportDtype dtype) { return dtype == ExportDtype::kBf16 ? 2 : 4; }

void AppendForExport(absl::Span<const float> values, ExportDtype dtype, std::vector<uint8_t>& out) {
  if (dtype == ExportDtype::kBf16) {
    safetensors::AppendBf16(values, out);
  } else {
    safetensors::AppendF32(values, out);
  }
}

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  std::string s = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(text));
  struct Unit {
    const char* suffix;
    double factor;
  };
  // Longest suffixes first.
  static constexpr Unit kUnits[] = {
      {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0},
      {"KB", 1e3},     {"MB", 1e6},        {"GB", 1e9},           {"TB", 1e12},
      {"B", 1.0}};
  double factor = 1.0;
  for (const Unit& unit : kUnits) {
    const size_t n = std::strlen(unit.suffix);
    if (s.size() > n && s.compare(s.size() - n, n, unit.suffix) == 0) {
      factor = unit.factor;
      s.resize(s.size() - n);
      break;
    }
  }
  double number;
  if (s.empty() || !absl::SimpleAtod(absl::StripAsciiWhitespace(s), &number) ||
      !std::isfinite(number) || number <= 0 ||
      number * factor >= static_cast<double>(std::numeric_limits<uint64_t>::max()) ||
      number * factor < 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a size (e.g. 5GB, 500MB, 2GiB, 1048576)"));
  }
  return static_cast<uint64_t>(std::llround(number * factor));
}

std::vector<ExportTensor> ExportTensorsOf(const Manifest& manifest) {
  std::vector<ExportTensor> tensors;
  for (const TensorInfo& info : manifest.tensors()) {
    ExportTensor tensor;
    tensor.name = info.name();
    tensor.shape.assign(info.shape().begin(), info.shape().end());
    if (tensor.shape.empty()) tensor.shape = {info.rows(), info.cols()};
    tensor.rows = info.rows();
    tensor.cols = info.cols();
    tensors.push_back(std::move(tensor));
  }
  return tensors;
}

FloatRowSource::FloatRowSource(ReadRowsFn read, uint64_t chunk_bytes)
    : read_(std::move(read)), chunk_bytes_(std::max<uint64_t>(chunk_bytes, 1)) {}

absl::Status FloatRowSource::StreamTensor(const ExportTensor& tensor, ExportDtype dtype,
                                          const Sink& sink) {
  const int64_t rows_per_chunk = std::max<int64_t>(
      1, static_cast<int64_t>(chunk_bytes_ / (sizeof(float) * static_cast<uint64_t>(tensor.cols))));
  std::vector<float> values;
  std::vector<uint8_t> bytes;
  for (int64_t row = 0; row < tensor.rows; row += rows_per_chunk) {
    const int64_t end = std::min(tensor.rows, row + rows_per_chunk);
    values.resize(static_cast<size_t>((end - row) * tensor.cols));
    RETURN_IF_ERROR(read_(tensor, row, end, absl::MakeSpan(values)));
    bytes.clear();
    AppendForExport(values, dtype, bytes);
    RETURN_IF_ERROR(sink(bytes));
  }
  return absl::OkStatus();
}

std::unique_ptr<ExportSource> NewCheckpointExportSource(const CheckpointReader* reader,
                                                        uint64_t chunk_bytes) {
  return std::make_unique<FloatRowSource>(
      [reader](const ExportTensor& tensor, int64_t row_begin, int64_t row_end,
               absl::Span<float> out) {
        return reader->ReadRows(tensor.name, kMasterSection, row_begin, row_end, out);
      },
      chunk_bytes);
}

absl::StatusOr<ExportResult> ExportSafetensors(const std::vector<ExportTensor>& tensors,
                                               ExportSource& source, const ExportOptions& options,
                                               absl::Span<const FrozenTensor> frozen) {
  if (options.out_dir.empty()) return absl::InvalidArgumentError("no output directory");
  std::vector<safetensors::TensorSpec> specs;
  for (const ExportTensor& tensor : tensors) {
    RETURN_IF_ERROR(CheckTensor(tensor));
    specs.push_back({tensor.name, ToSafetensorsDtype(options.dtype), tensor.shape});
  }
  for (const FrozenTensor& f : frozen) {
    absl::StatusOr<safetensors::Dtype> dtype = safetensors::ParseDtype(f.dtype());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("frozen buffer ", f.name(), ": ", dtype.status().message()));
    }
    int64_t bytes = safetensors::DtypeSize(*dtype);
    for (int64_t d : f.shape()) {
      if (d < 0 || (d > 0 && bytes > std::numeric_limits<int64_t>::max() / d)) {
        return absl::InvalidArgumentError(absl::StrCat("frozen buffer ", f.name(), ": bad shape"));
      }
      bytes *= d;
    }
    if (bytes != static_cast<int64_t>(f.data().size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "frozen buffer ", f.name(), " has ", f.data().size(), " bytes; its shape needs ", bytes));
    }
    specs.push_back({f.name(), *dtype, std::vector<int64_t>(f.shape().begin(), f.shape().end())});
  }
  ASSIGN_OR_RETURN(
      safetensors::ShardPlan plan,
      safetensors::PlanShards(std::move(specs), options.max_shard_bytes, options.prefix));
  RETURN_IF_ERROR(MakeDirs(options.out_dir, options.modes.dir));
  ASSIGN_OR_RETURN(std::unique_ptr<safetensors::ShardedWriter> writer,
                   safetensors::ShardedWriter::Create(options.out_dir, plan, {{"format", "pt"}},
                                                      options.modes.file));

  const uint64_t total = plan.total_size;
  const int64_t element_bytes = ExportDtypeSize(options.dtype);
  uint64_t done = 0;
  if (options.progress) options.progress(0, total);
  for (const ExportTensor& tensor : tensors) {
    const uint64_t expected = static_cast<uint64_t>(tensor.rows * tensor.cols * element_bytes);
    uint64_t delivered = 0;
    absl::Status status = source.StreamTensor(
        tensor, options.dtype, [&](absl::Span<const uint8_t> bytes) -> absl::Status {
          if (delivered + bytes.size() > expected || bytes.size() % element_bytes != 0) {
            return absl::InternalError(absl::StrCat("export source sent ", delivered + bytes.size(),
                                                    " bytes for tensor ", tensor.name,
                                                    ", which has ", expected));
          }
          RETURN_IF_ERROR(writer->AppendTensorData(tensor.name, bytes));
          delivered += bytes.size();
          done += bytes.size();
          if (options.progress) options.progress(done, total);
          return absl::OkStatus();
        });
    RETURN_IF_ERROR(status);
    if (delivered != expected) {
      return absl::InternalError(absl::StrCat("export source sent ", delivered,
                                              " bytes for tensor ", tensor.name, ", which has ",
                                              expected));
    }
  }
  for (const FrozenTensor& f : frozen) {
    const absl::Span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(f.data().data()),
                                          f.data().size());
    RETURN_IF_ERROR(writer->AppendTensorData(f.name(), bytes));
    done += bytes.size();
    if (options.progress) options.progress(done, total);
  }
  RETURN_IF_ERROR(writer->Finish());

  ExportResult result;
  for (const auto& shard : plan.shards) result.files.push_back(shard.file_name);
  result.files.push_back(safetensors::kIndexFileName);
  result.total_bytes = total;
  result.num_tensors = static_cast<int>(tensors.size() + frozen.size());
  return result;
}

}  // namespace checkpoint
}  // namespace paramd
