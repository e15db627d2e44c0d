#include "common/names.h"

#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace paramd {
namespace {

TEST(NamesTest, OrdinaryNamesPass) {
  EXPECT_TRUE(CheckTensorName("layers.0.mlp.up.weight").ok());
  EXPECT_TRUE(CheckTensorName("\xc3\xa9t\xc3\xa9").ok()) << "UTF-8 passes";
  EXPECT_TRUE(CheckTensorName(std::string(1024, 'a')).ok()) << "exactly the limit";
}

TEST(NamesTest, LongNameIsRefusedNamingTheLimit) {
  const absl::Status s = CheckTensorName(std::string(100 * 1024, 'a'));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "limit of 1024 bytes")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "--max_tensor_name_bytes")) << s;
  EXPECT_LT(s.message().size(), 200u) << "the name is not echoed whole";
  EXPECT_EQ(CheckTensorName(std::string(11, 'a'), 10).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckTensorName(std::string(10, 'a'), 10).ok());
}

TEST(NamesTest, EmptyNulAndControlCharactersAreRefused) {
  EXPECT_EQ(CheckTensorName("").code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& name : {std::string("a\0b", 3), std::string("a\nb"),
                                  std::string("\x1b[2J"), std::string("x\x7f")}) {
    const absl::Status s = CheckTensorName(name);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_TRUE(absl::StrContains(s.message(), "control character")) << s;
    EXPECT_EQ(s.message().find('\n'), std::string::npos) << "escaped in the message";
  }
}

TEST(NamesTest, QuoteForMessageIsBoundedAndEscaped) {
  EXPECT_EQ(QuoteForMessage("w"), "\"w\"");
  const std::string quoted = QuoteForMessage(std::string(1 << 20, 'a'));
  EXPECT_LT(quoted.size(), 300u);
  EXPECT_TRUE(absl::EndsWith(quoted, "...\" (1048576 bytes)")) << quoted;
  const std::string forged = QuoteForMessage("x\nE0101 forged line\r\x1b[2J");
  EXPECT_EQ(forged.find_first_of("\n\r\x1b"), std::string::npos) << forged;
  EXPECT_TRUE(absl::StrContains(forged, "\\n")) << forged;
  // Escaping cannot blow the bound: every byte escapes to at most 4.
  EXPECT_LT(QuoteForMessage(std::string(1 << 20, '\x01')).size(), 4 * 256 + 32u);
}

TEST(NamesTest, CheckClientIdBoundsIds) {
  EXPECT_TRUE(CheckClientId("pusher id", std::string(256, 'p')).ok());
  const absl::Status s = CheckClientId("pusher id", std::string(8 << 20, 'p'));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "pusher id of 8388608 bytes")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "limit of 256 bytes")) << s;
  EXPECT_LT(s.message().size(), 200u);
}

TEST(NamesTest, CheckClientPathBoundsPathsAndRefusesControlCharacters) {
  EXPECT_TRUE(CheckClientPath("safetensors_path", "/models/llama 3/model.safetensors").ok());
  EXPECT_TRUE(CheckClientPath("safetensors_path", std::string(4096, 'p')).ok());
  const absl::Status long_path = CheckClientPath("safetensors_path", std::string(1 << 20, 'p'));
  EXPECT_EQ(long_path.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(long_path.message(), "safetensors_path of 1048576 bytes"))
      << long_path;
  EXPECT_LT(long_path.message().size(), 200u);
  const absl::Status forged = CheckClientPath("checkpoint_path", "/a\nE0101 forged");
  EXPECT_EQ(forged.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(forged.message(), "control character 0x0a at byte 2")) << forged;
  EXPECT_EQ(forged.message().find('\n'), std::string::npos) << forged;
  EXPECT_FALSE(CheckClientPath("dir", std::string("a\0b", 3)).ok());
  EXPECT_FALSE(CheckClientPath("dir", "abcd", 3).ok());
}

}  // namespace
}  // namespace paramd
