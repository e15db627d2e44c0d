// File: auth/role_table.h
//
// The method-to-role table of auth/method_policy.cc as markdown, for
// docs/SECURITY.md: the doc holds it between kRoleTableBegin and
// kRoleTableEnd, `bazel run //auth:role_table -- --update` rewrites that
// block, and //auth:role_table_doc_test fails while the doc and the code
// disagree. Pure functions, thread-safe.
#ifndef PARAMD_AUTH_ROLE_TABLE_H_
#define PARAMD_AUTH_ROLE_TABLE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace paramd {
namespace auth {

inline constexpr absl::string_view kRoleTableBegin = "<!-- role-table begin -->";
inline constexpr absl::string_view kRoleTableEnd = "<!-- role-table end -->";

// One row per entry of AllPolicies(), in its order: the method, a mark per
// role that may call it with a token file, and who may call it without one.
std::string RoleTableMarkdown();

// `doc` with the text between the markers (each on a line of its own)
// replaced by RoleTableMarkdown(). InvalidArgument when a marker is missing
// or out of order.
absl::StatusOr<std::string> SpliceRoleTable(absl::string_view doc);

}  // namespace auth
}  // namespace paramd

#endif  // PARAMD_AUTH_ROLE_TABLE_H_
