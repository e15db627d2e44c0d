// role_table: prints the method-to-role table of auth/method_policy.cc as
// markdown; with --update, rewrites the table between the role-table
// markers of docs/SECURITY.md in the workspace it is run from:
//
//   bazel run //auth:role_table -- --update
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/statusor.h"
#include "auth/role_table.h"

int main(int argc, char** argv) {
  const bool update = argc == 2 && std::string(argv[1]) == "--update";
  if (argc > 1 && !update) {
    std::fprintf(stderr, "usage: role_table [--update]\n");
    return 2;
  }
  if (!update) {
    std::fputs(paramd::auth::RoleTableMarkdown().c_str(), stdout);
    return 0;
  }
  // `bazel run` starts the tool in its runfiles; the workspace is here.
  const char* workspace = std::getenv("BUILD_WORKSPACE_DIRECTORY");
  const std::string path = std::string(workspace ? workspace : ".") + "/docs/SECURITY.md";
  std::ifstream in(path);
  std::stringstream doc;
  doc << in.rdbuf();
  if (!in) {
    std::fprintf(stderr, "role_table: cannot read %s\n", path.c_str());
    return 1;
  }
  absl::StatusOr<std::string> updated = paramd::auth::SpliceRoleTable(doc.str());
  if (!updated.ok()) {
    std::fprintf(stderr, "role_table: %s: %s\n", path.c_str(),
                 std::string(updated.status().message()).c_str());
    return 1;
  }
  std::ofstream out(path, std::ios::trunc);
  out << *updated;
  if (!out) {
    std::fprintf(stderr, "role_table: cannot write %s\n", path.c_str());
    return 1;
  }
  std::printf("updated the role table of %s\n", path.c_str());
  return 0;
}
