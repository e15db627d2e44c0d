#include "server/config.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"

// A few of hybrid-paramd's flags, by the same names (the config applies to
// whatever flags the binary defines).
ABSL_FLAG(std::string, role, "both", "");
ABSL_FLAG(std::string, listen, "0.0.0.0:7070", "");
ABSL_FLAG(int32_t, daemons, 1, "");
ABSL_FLAG(double, lr, 1e-3, "");
ABSL_FLAG(std::string, data_plane, "host", "");
ABSL_FLAG(bool, extra_knob, false, "");

namespace paramd {
namespace {

class ConfigTest : public ::testing::Test {
 protected:
  absl::FlagSaver saver_;  // every test starts from the defaults
};

TEST_F(ConfigTest, SetsTheNamedFlagsAndGenericOnes) {
  ASSERT_TRUE(ApplyConfigText(R"txt(
    role: "coordinator"
    daemons: 4
    lr: 0.25
    flag { name: "extra_knob" value: "true" }
  )txt",
                              "c.textproto")
                  .ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_role), "coordinator");
  EXPECT_EQ(absl::GetFlag(FLAGS_daemons), 4);
  EXPECT_EQ(absl::GetFlag(FLAGS_lr), 0.25);
  EXPECT_TRUE(absl::GetFlag(FLAGS_extra_knob));
  EXPECT_EQ(absl::GetFlag(FLAGS_listen), "0.0.0.0:7070") << "not in the file: default";
}

TEST_F(ConfigTest, SyntaxErrorsNameLineAndColumn) {
  const absl::Status s = ApplyConfigText("role: \"daemon\"\ndaemons: 2\n  lr 0.5\n", "c.textproto");
  ASSERT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_TRUE(absl::StartsWith(s.message(), "c.textproto:3:6: ")) << s;
  EXPECT_EQ(absl::GetFlag(FLAGS_role), "both") << "nothing applied";
}

TEST_F(ConfigTest, UnknownFieldsAndWrongTypesNameTheirLine) {
  absl::Status s = ApplyConfigText("daemons: 2\nlisten_on: \"x\"\n", "c.textproto");
  // (protobuf points just past the unknown name)
  EXPECT_TRUE(absl::StartsWith(s.message(), "c.textproto:2:10: ")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "listen_on")) << s;
  s = ApplyConfigText("\ndaemons: \"two\"\n", "c.textproto");
  EXPECT_TRUE(absl::StartsWith(s.message(), "c.textproto:2:10: ")) << s;
  EXPECT_EQ(absl::GetFlag(FLAGS_daemons), 1);
}

TEST_F(ConfigTest, ValuesOutsideAFlagsChoicesAreRefusedWithTheirLine) {
  const absl::Status s =
      ApplyConfigText("daemons: 3\n   role: \"boss\"\ndata_plane: \"ucx\"\n", "c.textproto");
  ASSERT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(),
                                "c.textproto:2:4: role must be one of coordinator, daemon, both; "
                                "got \"boss\""))
      << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "c.textproto:3:1: data_plane must be one of")) << s;
  EXPECT_EQ(absl::GetFlag(FLAGS_daemons), 1) << "nothing applied";
}

TEST_F(ConfigTest, GenericFlagsAreCheckedByNameAndType) {
  absl::Status s = ApplyConfigText("flag { name: \"nope\" value: \"1\" }\n", "c.textproto");
  EXPECT_TRUE(absl::StrContains(s.message(), "c.textproto:1:1: hybrid-paramd has no flag --nope"))
      << s;
  s = ApplyConfigText("\n\nflag { name: \"extra_knob\" value: \"maybe\" }\n", "c.textproto");
  EXPECT_TRUE(
      absl::StrContains(s.message(), "c.textproto:3:1: bad value \"maybe\" for --extra_knob"))
      << s;
  // A field of the schema whose flag this binary lacks.
  s = ApplyConfigText("optimizer: \"sgd\"\n", "c.textproto");
  EXPECT_TRUE(absl::StrContains(s.message(), "no flag --optimizer")) << s;
}

TEST_F(ConfigTest, TheCommandLineWins) {
  std::vector<std::string> args = {"config_test", "--daemons=8"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  absl::ParseCommandLine(static_cast<int>(argv.size()), argv.data());
  ASSERT_TRUE(ApplyConfigText("daemons: 2\nrole: \"daemon\"\n", "c.textproto").ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_daemons), 8);
  EXPECT_EQ(absl::GetFlag(FLAGS_role), "daemon");
}

TEST_F(ConfigTest, AMissingFileIsNamed) {
  const absl::Status s = ApplyConfigFile("/no/such/file.textproto");
  EXPECT_TRUE(absl::StrContains(s.message(), "/no/such/file.textproto")) << s;
}

}  // namespace
}  // namespace paramd
