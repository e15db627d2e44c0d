// docs/SECURITY.md's role table is the one of auth/method_policy.cc.
#include <fstream>
#include <sstream>
#include <string>

#include "auth/role_table.h"
#include "auth/security.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace paramd {
namespace auth {
namespace {

TEST(RoleTableDoc, SecurityMdHoldsTheTableOfTheCode) {
  std::ifstream in("docs/SECURITY.md");  // runfiles-relative (the test's cwd)
  ASSERT_TRUE(in) << "docs/SECURITY.md is not in the test's runfiles";
  std::stringstream doc;
  doc << in.rdbuf();
  absl::StatusOr<std::string> expected = SpliceRoleTable(doc.str());
  ASSERT_TRUE(expected.ok()) << "docs/SECURITY.md: " << expected.status();
  EXPECT_TRUE(*expected == doc.str())
      << "docs/SECURITY.md's role table differs from auth/method_policy.cc; regenerate it with\n"
         "  bazel run //auth:role_table -- --update\n"
         "The table of the code:\n"
      << RoleTableMarkdown();
}

TEST(RoleTable, OneRowPerPolicyNamingItsRoles) {
  const std::string table = RoleTableMarkdown();
  EXPECT_THAT(table, ::testing::HasSubstr("| `Daemon.PushGradients` | yes |  |  | anyone |\n"));
  EXPECT_THAT(table,
              ::testing::HasSubstr("| `Daemon.LoadShards` |  |  | yes | cluster secret |\n"));
  EXPECT_THAT(table, ::testing::HasSubstr("| `Coordinator.Join` as a daemon |  |  | yes |"));
  int rows = 0;
  for (char c : table) rows += c == '\n';
  EXPECT_EQ(rows, 2 + static_cast<int>(AllPolicies().size()));
}

TEST(RoleTable, SpliceNeedsBothMarkers) {
  EXPECT_FALSE(SpliceRoleTable("no markers\n").ok());
  EXPECT_FALSE(SpliceRoleTable("<!-- role-table end -->\n<!-- role-table begin -->\n").ok());
  absl::StatusOr<std::string> spliced =
      SpliceRoleTable("a\n<!-- role-table begin -->\nold\n<!-- role-table end -->\nb\n");
  ASSERT_TRUE(spliced.ok()) << spliced.status();
  EXPECT_EQ(*spliced, "a\n<!-- role-table begin -->\n" + RoleTableMarkdown() +
                          "<!-- role-table end -->\nb\n");
}

}  // namespace
}  // namespace auth
}  // namespace paramd
