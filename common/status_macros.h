// File: common/status_macros.h
//
// RETURN_IF_ERROR / ASSIGN_OR_RETURN for absl::Status and absl::StatusOr.
// Debian 12's Abseil (20220623) predates absl/status/status_macros.h, so the
// project defines them once, here.
#ifndef PARAMD_COMMON_STATUS_MACROS_H_
#define PARAMD_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PARAMD_STATUS_CONCAT_INNER(a, b) a##b
#define PARAMD_STATUS_CONCAT(a, b) PARAMD_STATUS_CONCAT_INNER(a, b)

// Evaluates `expr` (an absl::Status) once; returns it from the enclosing
// function if it is not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status paramd_status_ = (expr);          \
    if (!paramd_status_.ok()) return paramd_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, Foo());` or `ASSIGN_OR_RETURN(x, Foo());`:
// evaluates the StatusOr once, returns its status on error, else moves the
// value into `lhs`.
#define ASSIGN_OR_RETURN(lhs, expr) \
  PARAMD_ASSIGN_OR_RETURN_IMPL(PARAMD_STATUS_CONCAT(paramd_statusor_, __LINE__), lhs, expr)

// `tmp` is a name and `lhs` a declaration ("auto x"): neither can be
// parenthesized (hence the NOLINTs).
#define PARAMD_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr)                                      \
  auto tmp = (expr);                             /* NOLINT(bugprone-macro-parentheses) */ \
  if (!tmp.ok()) return std::move(tmp).status(); /* NOLINT(bugprone-macro-parentheses) */ \
  lhs = std::move(tmp).value()                   /* NOLINT(bugprone-macro-parentheses) */

#endif  // PARAMD_COMMON_STATUS_MACROS_H_
