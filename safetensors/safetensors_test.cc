#include "safetensors/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "safetensors/atomic_file.h"
#include "safetensors/test_util.h"

namespace paramd::safetensors {
namespace {

using testing::ListDir;
using testing::MakeTempDir;
using testing::PatternBytes;
using testing::RawSafetensors;
using testing::ReadFile;
using testing::WriteFile;

std::string AsString(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

TEST(Dtype, NamesSizesAndParsing) {
  EXPECT_EQ(AllDtypes().size(), 16u);
  for (Dtype d : AllDtypes()) {
    EXPECT_EQ(*ParseDtype(DtypeName(d)), d);
    EXPECT_TRUE(DtypeSize(d) == 1 || DtypeSize(d) == 2 || DtypeSize(d) == 4 || DtypeSize(d) == 8);
  }
  EXPECT_EQ(DtypeName(Dtype::kBF16), "BF16");
  EXPECT_EQ(DtypeSize(Dtype::kBF16), 2);
  EXPECT_EQ(DtypeName(Dtype::kF8E4M3), "F8_E4M3");
  EXPECT_EQ(DtypeSize(Dtype::kF64), 8);
  EXPECT_EQ(ParseDtype("F4").status().message(), "unsupported dtype 'F4'");
  EXPECT_FALSE(ParseDtype("f32").ok());  // names are case-sensitive
}

TEST(NumBytes, OverflowAndNegative) {
  EXPECT_EQ(*NumBytes(Dtype::kF32, {}), 4);  // scalar
  EXPECT_EQ(*NumBytes(Dtype::kF32, {3, 0, 5}), 0);
  EXPECT_EQ(*NumBytes(Dtype::kBF16, {4096, 4096}), 2 * 4096 * 4096);
  EXPECT_FALSE(NumBytes(Dtype::kF32, {-1, 2}).ok());
  EXPECT_FALSE(NumBytes(Dtype::kU8, {1ll << 40, 1ll << 40}).ok());
  EXPECT_FALSE(NumBytes(Dtype::kF64, {1ll << 61}).ok());
}

// Writes `specs` with pattern data through the streaming writer; returns
// the data written, by tensor.
std::vector<std::vector<uint8_t>> WriteModel(const std::string& path,
                                             const std::vector<TensorSpec>& specs,
                                             const Metadata& metadata, size_t chunk = 0) {
  auto writer = SafetensorsWriter::Create(path, specs, metadata);
  EXPECT_TRUE(writer.ok()) << writer.status();
  std::vector<std::vector<uint8_t>> data;
  for (size_t i = 0; i < specs.size(); ++i) {
    data.push_back(PatternBytes(*NumBytes(specs[i].dtype, specs[i].shape), i + 1));
    const std::vector<uint8_t>& bytes = data.back();
    if (chunk == 0) {
      EXPECT_TRUE((*writer)->WriteTensor(specs[i].name, bytes).ok());
    } else {
      for (size_t off = 0; off < bytes.size(); off += chunk) {
        size_t n = std::min(chunk, bytes.size() - off);
        absl::Status s =
            (*writer)->AppendTensorData(specs[i].name, absl::MakeConstSpan(bytes.data() + off, n));
        EXPECT_TRUE(s.ok()) << s;
      }
    }
  }
  EXPECT_EQ((*writer)->next_tensor(), "");
  absl::Status finished = (*writer)->Finish();
  EXPECT_TRUE(finished.ok()) << finished;
  return data;
}

TEST(RoundTrip, EveryDtype) {
  std::string dir = MakeTempDir();
  std::vector<TensorSpec> specs;
  int i = 0;
  for (Dtype d : AllDtypes()) {
    // Vary the shapes: odd sizes, rank 1..3.
    std::vector<int64_t> shape = {3 + i % 4};
    if (i % 2 == 0) shape.push_back(5);
    if (i % 3 == 0) shape.push_back(2);
    specs.push_back({absl::StrCat("t", i, ".", DtypeName(d)), d, shape});
    ++i;
  }
  const Metadata metadata = {{"format", "pt"}, {"note", "ünïcode ✓"}};
  std::string path = dir + "/all.safetensors";
  auto data = WriteModel(path, specs, metadata);

  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata(), metadata);
  EXPECT_EQ(file->data_offset() % 8, 0u);
  ASSERT_EQ(file->tensors().size(), specs.size());
  uint64_t expected_begin = 0;
  for (size_t k = 0; k < specs.size(); ++k) {
    // Declaration order is data order.
    const TensorInfo& info = file->tensors()[k];
    EXPECT_EQ(info.name, specs[k].name);
    EXPECT_EQ(info.dtype, specs[k].dtype);
    EXPECT_EQ(info.shape, specs[k].shape);
    EXPECT_EQ(info.begin, expected_begin);
    expected_begin = info.end;
    ASSERT_EQ(file->Find(specs[k].name), &info);
    absl::StatusOr<std::vector<uint8_t>> bytes = file->ReadTensor(specs[k].name);
    ASSERT_TRUE(bytes.ok());
    EXPECT_EQ(*bytes, data[k]) << specs[k].name;
  }
  EXPECT_EQ(file->file_size(), file->data_offset() + expected_begin);
  EXPECT_EQ(file->Find("absent"), nullptr);
  EXPECT_EQ(file->ReadTensor("absent").status().code(), absl::StatusCode::kNotFound);
}

TEST(RoundTrip, ScalarsEmptyTensorsChunksAndNoMetadata) {
  std::string dir = MakeTempDir();
  std::vector<TensorSpec> specs = {
      {"empty_first", Dtype::kF32, {0, 7}},
      {"scalar", Dtype::kF64, {}},
      {"big", Dtype::kBF16, {37, 129}},
      {"empty_mid", Dtype::kI8, {0}},
      {"odd", Dtype::kU8, {13}},
  };
  std::string path = dir + "/m.safetensors";
  auto data = WriteModel(path, specs, {}, /*chunk=*/1000);
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->metadata().empty());
  EXPECT_EQ(file->Find("scalar")->num_elements, 1);
  EXPECT_EQ(file->Find("empty_mid")->num_bytes(), 0u);
  for (size_t k = 0; k < specs.size(); ++k) EXPECT_EQ(*file->ReadTensor(specs[k].name), data[k]);
  // The header has no "__metadata__" key when there is none.
  EXPECT_EQ(ReadFile(path).find("__metadata__"), std::string::npos);
}

TEST(RoundTrip, ReadsAHandCraftedFile) {
  // The layout of the reference implementation's own serialization test.
  std::string header = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
  std::string data;
  for (float f : {0.f, 1.f, 2.f, 3.f, 4.f, 5.f}) data.append(reinterpret_cast<char*>(&f), 4);
  std::string path = MakeTempDir() + "/ref.safetensors";
  WriteFile(path, RawSafetensors(header, data));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(AsString(*file->ReadTensor("attn.0")), data);
  EXPECT_EQ(file->Find("attn.0")->shape, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(file->data_offset(), 8 + header.size());
}

TEST(ReadTensorBytes, PartialReadsAndBounds) {
  std::string path = MakeTempDir() + "/p.safetensors";
  auto data = WriteModel(path, {{"a", Dtype::kU8, {10}}, {"b", Dtype::kF32, {4}}}, {});
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  const TensorInfo& b = *file->Find("b");
  std::vector<uint8_t> out(6);
  ASSERT_TRUE(file->ReadTensorBytes(b, 5, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, std::vector<uint8_t>(data[1].begin() + 5, data[1].begin() + 11));
  absl::Status past = file->ReadTensorBytes(b, 11, absl::MakeSpan(out));
  EXPECT_EQ(past.code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(past.message().find("read of 6 bytes at offset 11 is outside its 16 bytes"),
            std::string::npos)
      << past;
  EXPECT_EQ(file->ReadTensorBytes(b, ~0ull, absl::MakeSpan(out)).code(),
            absl::StatusCode::kOutOfRange);
}

TEST(ReadTensorBytes, FileTruncatedAfterOpenIsDataLoss) {
  std::string path = MakeTempDir() + "/t.safetensors";
  WriteModel(path, {{"a", Dtype::kF32, {100}}}, {});
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  ASSERT_EQ(truncate(path.c_str(), file->data_offset() + 10), 0);
  EXPECT_EQ(file->ReadTensor("a").status().code(), absl::StatusCode::kDataLoss);
}

TEST(Writer, RefusesBadDeclarations) {
  std::string dir = MakeTempDir();
  struct Case {
    std::vector<TensorSpec> specs;
    std::string message;
  };
  std::vector<Case> cases = {
      {{{"", Dtype::kF32, {1}}}, "empty tensor name"},
      {{{"__metadata__", Dtype::kF32, {1}}}, "cannot be named \"__metadata__\""},
      {{{"a", Dtype::kF32, {1}}, {"a", Dtype::kF16, {2}}}, "tensor 'a' declared twice"},
      {{{"neg", Dtype::kF32, {2, -3}}}, "tensor 'neg': negative dimension -3"},
      {{{"huge", Dtype::kF32, {1ll << 62, 4}}}, "tensor 'huge': shape overflows"},
      {{{"bad\xff", Dtype::kF32, {1}}}, "must be UTF-8"},
  };
  for (const Case& c : cases) {
    auto writer = SafetensorsWriter::Create(dir + "/x.safetensors", c.specs);
    ASSERT_FALSE(writer.ok());
    EXPECT_EQ(writer.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(writer.status().message().find(c.message), std::string::npos) << writer.status();
  }
  EXPECT_TRUE(ListDir(dir).empty());
}

TEST(Writer, EnforcesOrderAndSizesAndLeavesNothingBehindOnAbort) {
  std::string dir = MakeTempDir();
  std::string path = dir + "/w.safetensors";
  {
    auto writer = SafetensorsWriter::Create(path, {{"a", Dtype::kF32, {2}}, {"b", Dtype::kU8, {3}}},
                                            {{"k", "v"}});
    ASSERT_TRUE(writer.ok());
    EXPECT_EQ((*writer)->data_bytes(), 11u);
    EXPECT_EQ((*writer)->next_tensor(), "a");
    std::vector<uint8_t> four(4), five(5);
    absl::Status s = (*writer)->AppendTensorData("b", four);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(s.message().find("expected data for tensor 'a', got 'b'"), std::string::npos) << s;
    ASSERT_TRUE((*writer)->AppendTensorData("a", four).ok());
    s = (*writer)->AppendTensorData("a", five);
    EXPECT_NE(s.message().find("chunk of 5 bytes runs past the end of tensor 'a' (4 of 8"),
              std::string::npos)
        << s;
    s = (*writer)->WriteTensor("a", four);
    EXPECT_NE(s.message().find("4 already written"), std::string::npos) << s;
    s = (*writer)->Finish();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(s.message().find("tensor 'a' incomplete: 4 of 8 bytes written"), std::string::npos)
        << s;
    // The temporary file exists while writing, the target does not.
    std::vector<std::string> names = ListDir(dir);
    ASSERT_EQ(names.size(), 1u);
    EXPECT_EQ(names[0].rfind("w.safetensors.tmp-", 0), 0u) << names[0];
  }
  EXPECT_TRUE(ListDir(dir).empty());  // abandoned writer cleaned up
}

TEST(Writer, FinishIsAtomicAndReplacesTheTarget) {
  std::string dir = MakeTempDir();
  std::string path = dir + "/r.safetensors";
  WriteFile(path, "old contents");
  WriteModel(path, {{"x", Dtype::kI64, {3}}}, {});
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{"r.safetensors"});
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  EXPECT_TRUE(SafetensorsFile::Open(path).ok());
}

TEST(Writer, MissingDirectoryIsNotFound) {
  auto writer = SafetensorsWriter::Create(MakeTempDir() + "/no/such/dir/x.safetensors", {});
  EXPECT_EQ(writer.status().code(), absl::StatusCode::kNotFound);
}

TEST(AtomicFile, CommitOnceAndErrnoStatus) {
  std::string path = MakeTempDir() + "/f.txt";
  auto f = AtomicFile::Create(path);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->Append("hello").ok());
  EXPECT_EQ((*f)->bytes_written(), 5u);
  ASSERT_TRUE((*f)->Commit().ok());
  EXPECT_EQ(ReadFile(path), "hello");
  EXPECT_EQ((*f)->Commit().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*f)->Append("x").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ErrnoStatus(ENOSPC, "cannot write", "/x").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus(ENOENT, "cannot open", "/x").message(),
            "cannot open '/x': No such file or directory");
}

// ---------------------------------------------------------------------------
// Malformed files: each refused with a status naming the problem.

struct Malformed {
  std::string name;
  std::string bytes;
  absl::StatusCode code;
  std::string message;  // substring of the status message
};

std::string F32Entry(const std::string& name, const std::string& shape, uint64_t b, uint64_t e) {
  return absl::StrCat("\"", name, "\":{\"dtype\":\"F32\",\"shape\":", shape, ",\"data_offsets\":[",
                      b, ",", e, "]}");
}

std::vector<Malformed> MalformedCases() {
  const std::string ok_entry = F32Entry("w", "[2]", 0, 8);
  const std::string eight(8, 'x');
  const auto inv = absl::StatusCode::kInvalidArgument;
  const auto loss = absl::StatusCode::kDataLoss;
  std::string truncated_header = RawSafetensors("{" + ok_entry + "}", eight);
  truncated_header.resize(20);
  return {
      {"shorter_than_length", "abc", loss, "3 bytes, too short for the 8-byte header length"},
      {"truncated_header", truncated_header, loss,
       "header length runs past the end of the file (20 bytes)"},
      {"absurd_header_length", RawSafetensors("{}", "", 1ull << 60), inv,
       "header length field exceeds the limit of 100000000 bytes"},
      {"zero_header_length", RawSafetensors("", "", 0), inv, "header length is too small"},
      {"bad_json", RawSafetensors("{\"w\": {\"dtype\": ", eight), inv, "header is not valid JSON"},
      {"invalid_utf8", RawSafetensors("{\"w\xff\":1}", ""), inv, "header is not valid JSON"},
      {"long_name",
       RawSafetensors("{" + F32Entry(std::string(100 << 10, 'n'), "[2]", 0, 8) + "}", eight), inv,
       "longer than the limit of 1024 bytes (--max_tensor_name_bytes)"},
      {"nul_in_name", RawSafetensors("{" + F32Entry("a\\u0000b", "[2]", 0, 8) + "}", eight), inv,
       "holds control character 0x00 at byte 1"},
      {"newline_in_name", RawSafetensors("{" + F32Entry("a\\nb", "[2]", 0, 8) + "}", eight), inv,
       "holds control character 0x0a"},
      {"json_not_object", RawSafetensors("[1, 2, 3]", ""), inv,
       "header is not a JSON object but array"},
      {"deeply_nested_json",
       RawSafetensors(std::string(200000, '[') + std::string(200000, ']'), ""), inv,
       "header is not a JSON object but array"},
      {"entry_not_object", RawSafetensors("{\"w\": 5}", ""), inv,
       "tensor 'w': entry is not a JSON object"},
      {"missing_dtype", RawSafetensors(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", eight), inv,
       "tensor 'w': missing \"dtype\""},
      {"missing_shape", RawSafetensors(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", eight), inv,
       "tensor 'w': missing \"shape\""},
      {"missing_data_offsets", RawSafetensors(R"({"w":{"dtype":"F32","shape":[2]}})", eight), inv,
       "tensor 'w': missing \"data_offsets\""},
      {"unknown_dtype",
       RawSafetensors(R"({"w":{"dtype":"F17","shape":[2],"data_offsets":[0,8]}})", eight), inv,
       "tensor 'w': unsupported dtype 'F17'"},
      {"dtype_not_string",
       RawSafetensors(R"({"w":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", eight), inv,
       "tensor 'w': \"dtype\" is not a string"},
      {"shape_bytes_mismatch", RawSafetensors("{" + F32Entry("w", "[3]", 0, 8) + "}", eight), inv,
       "tensor 'w': data_offsets [0, 8] span 8 bytes but F32 [3] needs 12"},
      {"negative_shape", RawSafetensors("{" + F32Entry("w", "[2,-2]", 0, 8) + "}", eight), inv,
       "tensor 'w': shape [2,-2] has a dimension that is not a non-negative integer: -2"},
      {"fractional_shape", RawSafetensors("{" + F32Entry("w", "[2.5]", 0, 8) + "}", eight), inv,
       "not a non-negative integer: 2.5"},
      {"shape_not_array", RawSafetensors("{" + F32Entry("w", "8", 0, 8) + "}", eight), inv,
       "tensor 'w': \"shape\" is not an array"},
      {"shape_overflow",
       RawSafetensors("{" + F32Entry("w", "[4294967296,4294967296]", 0, 8) + "}", eight), inv,
       "tensor 'w': shape overflows"},
      {"offsets_out_of_range", RawSafetensors("{" + F32Entry("w", "[4]", 0, 16) + "}", eight), loss,
       "tensor 'w': data_offsets [0, 16] run past the end of the data section (8 bytes"},
      {"begin_after_end", RawSafetensors("{" + F32Entry("w", "[2]", 8, 0) + "}", eight), inv,
       "tensor 'w': data_offsets [8, 0] have begin > end"},
      {"offsets_wrong_arity",
       RawSafetensors(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8,16]}})", eight), inv,
       "must be [begin, end] of non-negative integers, got [0,8,16]"},
      {"negative_offset",
       RawSafetensors(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[-4,-4]}})", ""), inv,
       "got [-4,-4]"},
      {"overlapping_ranges",
       RawSafetensors("{" + F32Entry("a", "[2]", 0, 8) + "," + F32Entry("b", "[2]", 4, 12) + "}",
                      std::string(12, 'x')),
       inv, "tensor 'b': data_offsets [4, 12] overlap tensor 'a' [0, 8]"},
      {"gap_between_tensors",
       RawSafetensors("{" + F32Entry("a", "[1]", 0, 4) + "," + F32Entry("b", "[1]", 8, 12) + "}",
                      std::string(12, 'x')),
       inv, "tensor 'b': gap: bytes [4, 8) of the data section before this tensor"},
      {"trailing_bytes", RawSafetensors("{" + ok_entry + "}", std::string(11, 'x')), inv,
       "3 trailing bytes after the last tensor"},
      {"truncated_data", RawSafetensors("{" + ok_entry + "}", "xxxxx"), loss,
       "tensor 'w': data_offsets [0, 8] run past the end of the data section (5 bytes"},
      {"duplicate_names", RawSafetensors("{" + ok_entry + "," + ok_entry + "}", eight), inv,
       "tensor 'w': name appears more than once in the header"},
      {"duplicate_field",
       RawSafetensors(R"({"w":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}})",
                      eight),
       inv, "tensor 'w': key \"dtype\" appears more than once"},
      {"metadata_not_string",
       RawSafetensors("{\"__metadata__\":{\"format\":\"pt\",\"step\":5}," + ok_entry + "}", eight),
       inv, "\"__metadata__\" value of key 'step' is not a string: 5"},
      {"metadata_not_object", RawSafetensors("{\"__metadata__\":[1]," + ok_entry + "}", eight), inv,
       "\"__metadata__\" is not a JSON object"},
      {"empty_tensor_name", RawSafetensors("{" + F32Entry("", "[2]", 0, 8) + "}", eight), inv,
       "empty tensor name"},
  };
}

TEST(Malformed, EachIsRefusedWithAClearMessage) {
  std::string dir = MakeTempDir();
  std::vector<Malformed> cases = MalformedCases();
  EXPECT_GE(cases.size(), 15u);
  for (const Malformed& c : cases) {
    std::string path = absl::StrCat(dir, "/", c.name, ".safetensors");
    WriteFile(path, c.bytes);
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok()) << c.name << " was accepted";
    EXPECT_EQ(file.status().code(), c.code) << c.name << ": " << file.status();
    EXPECT_NE(file.status().message().find(c.message), std::string::npos)
        << c.name << ": got " << file.status();
    // Every message names the file.
    EXPECT_EQ(file.status().message().rfind(path, 0), 0u) << file.status();
  }
}

// D6: opening a file that is not safetensors must not show what it holds
// (the header length used to be printed: the first 8 bytes of /etc/passwd
// read "root:x:0"; nlohmann's parse errors quote the text they stopped at).
TEST(Malformed, MessagesNeverEchoTheFilesBytes) {
  const std::string dir = MakeTempDir();
  const std::string passwd = "root:x:0:0:root:/root:/bin/bash\nsecret-token-123\n";
  std::string small(8, '\0');
  small[0] = 40;  // a plausible length, then text that is not JSON
  for (const std::string& bytes :
       {passwd, small + "secret-token-123 not json at all......................",
        RawSafetensors("{\"w\": secret-token-123}", "")}) {
    const std::string path = dir + "/not_safetensors";
    WriteFile(path, bytes);
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok());
    const std::string message(file.status().message());
    EXPECT_EQ(message.find("root:x"), std::string::npos) << message;
    EXPECT_EQ(message.find("secret"), std::string::npos) << message;
    uint64_t as_number = 0;
    std::memcpy(&as_number, passwd.data(), 8);
    EXPECT_EQ(message.find(absl::StrCat(as_number)), std::string::npos) << message;
  }
}

TEST(Malformed, NameLimitIsAParameter) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/long.safetensors";
  WriteFile(path, RawSafetensors("{" + F32Entry(std::string(2000, 'n'), "[2]", 0, 8) + "}",
                                 std::string(8, 'x')));
  EXPECT_EQ(SafetensorsFile::Open(path).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SafetensorsFile::Open(path, 4096).ok());
}

TEST(Malformed, MissingFileIsNotFound) {
  auto file = SafetensorsFile::Open(MakeTempDir() + "/none.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(file.status().message().find("none.safetensors"), std::string::npos);
}

TEST(Malformed, DirectoryIsRefused) {
  auto file = SafetensorsFile::Open(MakeTempDir());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(file.status().message().find("not a regular file"), std::string::npos);
}

// Every truncation and single-byte corruption of a valid file is either
// refused or, for corruptions in the data, accepted: never a crash or an
// over-read (run under ASan/valgrind to see the latter).
TEST(Malformed, TruncationsAndByteFlipsNeverCrash) {
  std::string dir = MakeTempDir();
  std::string good_path = dir + "/good.safetensors";
  WriteModel(good_path,
             {{"a", Dtype::kF32, {3, 2}}, {"b", Dtype::kBF16, {5}}, {"c", Dtype::kU8, {1}}},
             {{"format", "pt"}});
  const std::string good = ReadFile(good_path);
  auto original = SafetensorsFile::Open(good_path);
  ASSERT_TRUE(original.ok());
  const size_t data_offset = original->data_offset();
  std::string path = dir + "/bad.safetensors";
  for (size_t n = 0; n < good.size(); ++n) {
    WriteFile(path, good.substr(0, n));
    EXPECT_FALSE(SafetensorsFile::Open(path).ok()) << "prefix of " << n << " bytes accepted";
  }
  int accepted = 0;
  for (size_t i = 0; i < good.size(); ++i) {
    for (uint8_t flip : {0x01, 0x80, 0xFF}) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ flip);
      WriteFile(path, bad);
      absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
      if (file.ok()) {
        ++accepted;
        for (const TensorInfo& t : file->tensors()) EXPECT_TRUE(file->ReadTensor(t.name).ok());
      }
      if (i >= data_offset) {
        EXPECT_TRUE(file.ok()) << "data byte " << i;
      }
    }
  }
  EXPECT_GE(accepted, 3 * static_cast<int>(good.size() - data_offset));
}

}  // namespace
}  // namespace paramd::safetensors
