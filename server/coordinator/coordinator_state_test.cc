// WriteStateFile / ReadStateFile: the state file holds the cluster's
// secrets, so it is 0600 whatever the umask, and nothing planted beside it
// (a symlink at a temporary name) redirects the write.
#include "server/coordinator/coordinator_state.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace paramd {
namespace {

std::string MakeTempDir() {
  const char* base = getenv("TEST_TMPDIR");
  std::string pattern = std::string(base ? base : "/tmp") + "/state.XXXXXX";
  EXPECT_NE(mkdtemp(pattern.data()), nullptr);
  return pattern;
}

std::string Contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

TEST(CoordinatorStateTest, SymlinkAtTheTemporaryNameIsNeverFollowed) {
  const std::string dir = MakeTempDir();
  const std::string victim = dir + "/victim";
  std::ofstream(victim) << "keep";
  const std::string path = dir + "/coordinator.state";
  ASSERT_EQ(::symlink(victim.c_str(), absl::StrCat(path, ".tmp-", ::getpid()).c_str()), 0);
  ASSERT_EQ(::symlink(victim.c_str(), (path + ".tmp").c_str()), 0);
  rpc::CoordinatorState state;
  state.set_committed_version(42);
  const mode_t old_umask = ::umask(0);
  const absl::Status written = WriteStateFile(path, state);
  ::umask(old_umask);
  ASSERT_TRUE(written.ok()) << written;
  EXPECT_EQ(Contents(victim), "keep");
  struct stat st;
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the state file is a file, not the planted symlink";
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  absl::StatusOr<std::optional<rpc::CoordinatorState>> read = ReadStateFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE(read->has_value());
  EXPECT_EQ((*read)->committed_version(), 42);
}

}  // namespace
}  // namespace paramd
