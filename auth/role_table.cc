#include "auth/role_table.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "auth/security.h"

namespace paramd {
namespace auth {
namespace {

// "/paramd.rpc.Coordinator/Join#daemon" -> "`Coordinator.Join` as a daemon".
std::string MethodLabel(absl::string_view method) {
  absl::ConsumePrefix(&method, "/");
  std::string suffix;
  if (const size_t hash = method.find('#'); hash != absl::string_view::npos) {
    suffix = absl::StrCat(" as a ", method.substr(hash + 1));
    method = method.substr(0, hash);
  }
  const size_t slash = method.find('/');
  absl::string_view service = method.substr(0, slash);
  if (const size_t dot = service.rfind('.'); dot != absl::string_view::npos) {
    service = service.substr(dot + 1);
  }
  return absl::StrCat("`", service, ".", method.substr(slash + 1), "`", suffix);
}

// Who may call a method when no token file is given.
absl::string_view WithoutTokens(const MethodPolicy& p) {
  if (p.method == kJoinAsDaemon) return "cluster secret (a rank's first join: anyone)";
  return p.internal ? "cluster secret" : "anyone";
}

}  // namespace

std::string RoleTableMarkdown() {
  std::string out =
      "| method | trainer | operator | cluster | without a token file |\n"
      "|---|:-:|:-:|:-:|---|\n";
  for (const MethodPolicy& p : AllPolicies()) {
    absl::StrAppend(&out, "| ", MethodLabel(p.method));
    for (Role r : {Role::kTrainer, Role::kOperator, Role::kCluster}) {
      absl::StrAppend(&out, " | ", p.roles.contains(r) ? "yes" : "");
    }
    absl::StrAppend(&out, " | ", WithoutTokens(p), " |\n");
  }
  return out;
}

absl::StatusOr<std::string> SpliceRoleTable(absl::string_view doc) {
  const std::string begin = absl::StrCat(kRoleTableBegin, "\n");
  const std::string end = absl::StrCat("\n", kRoleTableEnd);
  const size_t b = doc.find(begin);
  const size_t e = b == absl::string_view::npos ? b : doc.find(end, b);
  if (b == absl::string_view::npos || e == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "want a line \"", kRoleTableBegin, "\" followed later by a line \"", kRoleTableEnd, "\""));
  }
  return absl::StrCat(doc.substr(0, b + begin.size()), RoleTableMarkdown(), doc.substr(e + 1));
}

}  // namespace auth
}  // namespace paramd
