// File: common/line_pipe.h
//
// Newline-framed text over a pipe or socket file descriptor, for the
// multi-process GPU tests and reproducers (a parent and its forked children
// exchange addresses and commands this way).
//
// Blocking calls on caller-owned descriptors; no state; thread-compatible
// (one reader and one writer per descriptor).
#ifndef PARAMD_COMMON_LINE_PIPE_H_
#define PARAMD_COMMON_LINE_PIPE_H_

#include <string>

#include "absl/time/time.h"

namespace paramd {

// Writes `line` and a '\n'. Stops silently when the reader is gone (the
// caller's ReadLine on the other side then sees EOF).
void WriteLine(int fd, const std::string& line);

// Reads one line (without its '\n'); "" on EOF, a read error, or when no
// complete line arrived within `timeout`.
std::string ReadLine(int fd, absl::Duration timeout);

}  // namespace paramd

#endif  // PARAMD_COMMON_LINE_PIPE_H_
