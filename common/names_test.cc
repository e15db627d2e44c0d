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

}  // namespace
}  // namespace paramd
