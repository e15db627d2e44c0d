#include "deploy/process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace paramd {
namespace demo {
namespace {

// True while `pid` exists and is not a zombie.
bool Alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string pid_text, comm, state;
  if (!(stat >> pid_text >> comm >> state)) return false;
  return state != "Z" && state != "X";
}

bool WaitDead(pid_t pid) {
  for (int i = 0; i < 300 && Alive(pid); ++i) usleep(10000);
  return !Alive(pid);
}

TEST(Process, ReadsPortFileAndTerminates) {
  auto dir = TempDir::Create("process_test");
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::string port_file = dir->path() + "/port";
  ChildProcesses children;
  auto index = children.Start(
      {"sleeper", {"/bin/sh", "-c", "echo 4321 > " + port_file + "; exec sleep 100"}});
  ASSERT_TRUE(index.ok()) << index.status();
  auto port = WaitForPortFile(port_file, absl::Seconds(10), &children, *index);
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_EQ(*port, 4321);
  const pid_t pid = children.pid(*index);
  EXPECT_TRUE(Alive(pid));
  EXPECT_FALSE(children.Poll(*index).has_value());
  const int status = children.Stop(*index, absl::Seconds(2));
  EXPECT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGTERM);
  EXPECT_FALSE(Alive(pid));
}

TEST(Process, ChildDyingBeforePortFileIsUnavailable) {
  auto dir = TempDir::Create("process_test");
  ASSERT_TRUE(dir.ok());
  ChildProcesses children;
  auto index = children.Start({"quitter", {"/bin/sh", "-c", "exit 3"}});
  ASSERT_TRUE(index.ok());
  auto port = WaitForPortFile(dir->path() + "/none", absl::Seconds(10), &children, *index);
  EXPECT_EQ(port.status().code(), absl::StatusCode::kUnavailable) << port.status();
  EXPECT_EQ(WEXITSTATUS(*children.Poll(*index)), 3);
}

TEST(Process, PortFileTimeout) {
  auto dir = TempDir::Create("process_test");
  ASSERT_TRUE(dir.ok());
  auto port = WaitForPortFile(dir->path() + "/none", absl::Milliseconds(50));
  EXPECT_EQ(port.status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(Process, PipesStdoutAndReportsExecFailure) {
  ChildProcesses children;
  auto echo = children.Start({"echo", {"/bin/echo", "hello"}, "", "", /*pipe_stdout=*/true});
  ASSERT_TRUE(echo.ok());
  char buf[16] = {};
  ASSERT_EQ(read(children.stdout_fd(*echo), buf, sizeof(buf)), 6);
  EXPECT_EQ(std::string(buf), "hello\n");
  auto missing = children.Start({"missing", {"/nonexistent/program"}, "/dev/null", "/dev/null"});
  ASSERT_TRUE(missing.ok());
  auto status = children.Wait(*missing, absl::Seconds(10));
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(WEXITSTATUS(*status), 127);
}

TEST(Process, DestructorKillsEverything) {
  pid_t pid;
  {
    ChildProcesses children;
    // Ignores SIGTERM: the destructor must escalate to SIGKILL.
    auto index = children.Start({"stubborn", {"/bin/sh", "-c", "trap '' TERM; sleep 100"}});
    ASSERT_TRUE(index.ok());
    pid = children.pid(*index);
    usleep(100000);
  }
  EXPECT_FALSE(Alive(pid));
}

TEST(Process, ChildrenDieWithAKilledParent) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t parent = fork();
  ASSERT_GE(parent, 0);
  if (parent == 0) {
    ChildProcesses children;
    auto index = children.Start({"orphan", {"/bin/sleep", "100"}});
    const pid_t child = index.ok() ? children.pid(*index) : -1;
    (void)!write(fds[1], &child, sizeof(child));
    pause();  // until SIGKILL: no destructor runs
    _exit(0);
  }
  pid_t grandchild = -1;
  ASSERT_EQ(read(fds[0], &grandchild, sizeof(grandchild)), static_cast<ssize_t>(sizeof(pid_t)));
  ASSERT_GT(grandchild, 0);
  EXPECT_TRUE(Alive(grandchild));
  kill(parent, SIGKILL);
  waitpid(parent, nullptr, 0);
  EXPECT_TRUE(WaitDead(grandchild));
}

}  // namespace
}  // namespace demo
}  // namespace paramd
