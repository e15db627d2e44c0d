// File: common/line_pipe_test.cc
#include "common/line_pipe.h"

#include <signal.h>
#include <unistd.h>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace paramd {
namespace {

class LinePipeTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(pipe(fds_), 0); }
  void TearDown() override {
    if (fds_[0] >= 0) close(fds_[0]);
    if (fds_[1] >= 0) close(fds_[1]);
  }
  int fds_[2] = {-1, -1};
};

TEST_F(LinePipeTest, LinesArriveInOrderWithoutNewlines) {
  WriteLine(fds_[1], "nccl|127.0.0.1:1|127.0.0.1:2|host|0000:01:00.0");
  WriteLine(fds_[1], "");
  WriteLine(fds_[1], "end");
  EXPECT_EQ(ReadLine(fds_[0], absl::Seconds(5)), "nccl|127.0.0.1:1|127.0.0.1:2|host|0000:01:00.0");
  EXPECT_EQ(ReadLine(fds_[0], absl::Seconds(5)), "");  // an empty line reads as ""
  EXPECT_EQ(ReadLine(fds_[0], absl::Seconds(5)), "end");
}

TEST_F(LinePipeTest, TimeoutWithoutACompleteLine) {
  ASSERT_EQ(write(fds_[1], "partial", 7), 7);
  const absl::Time start = absl::Now();
  EXPECT_EQ(ReadLine(fds_[0], absl::Milliseconds(100)), "");
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(90));
}

TEST_F(LinePipeTest, EofReadsEmpty) {
  close(fds_[1]);
  fds_[1] = -1;
  EXPECT_EQ(ReadLine(fds_[0], absl::Seconds(5)), "");
}

TEST_F(LinePipeTest, WriteToAClosedReaderDoesNotCrash) {
  close(fds_[0]);
  fds_[0] = -1;
  signal(SIGPIPE, SIG_IGN);
  WriteLine(fds_[1], "nobody listens");  // returns; no exception, no hang
  SUCCEED();
}

}  // namespace
}  // namespace paramd
