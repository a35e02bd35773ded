// Tests for the launcher: real worker processes (/bin/sh scripts), real signals.
//
// Waiting for a worker to reach a point is done by polling for a file it writes, with a
// bound; nothing relies on a sleep being long enough.
#include "replica/launch/launcher.h"

#include "replica/core/cuda.h"
#include "replica/core/error.h"
#include "replica/core/system.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;
using replica::launch::LaunchOptions;
using replica::launch::WorkerExit;

namespace {

using Clock = std::chrono::steady_clock;

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  std::string text = s.str();
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

// Polls until every file exists, at most `limit`. Returns whether they all appeared.
bool wait_for_files(const std::vector<fs::path>& paths, std::chrono::seconds limit = std::chrono::seconds(20)) {
  const auto deadline = Clock::now() + limit;
  for (;;) {
    bool all = true;
    for (const auto& p : paths) all = all && fs::exists(p);
    if (all) return true;
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

bool process_exists(pid_t pid) { return kill(pid, 0) == 0 || errno == EPERM; }

// Waits for a child of this process, at most `limit`; kills it (and fails) when it overstays.
int wait_child(pid_t pid, std::chrono::seconds limit = std::chrono::seconds(30)) {
  const auto deadline = Clock::now() + limit;
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0) {
      ADD_FAILURE() << "waitpid(" << pid << ") failed: " << std::strerror(errno);
      return -1;
    }
    if (Clock::now() > deadline) {
      ADD_FAILURE() << "process " << pid << " did not exit within " << limit.count() << " s";
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// The shell line that records the worker's pid atomically (write, then rename), so a reader
// never sees a half-written file.
const char* kWritePid = "echo $$ > \"$OUT/pid.$RANK.tmp\" && mv \"$OUT/pid.$RANK.tmp\" \"$OUT/pid.$RANK\"; ";

class LauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "replica-launch-test-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr) << std::strerror(errno);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  // Options for `nproc` workers running `script` under /bin/sh, with $OUT = the test dir.
  LaunchOptions shell(const std::string& script, int nproc) const {
    LaunchOptions o;
    o.nproc_per_node = nproc;
    o.command = {"/bin/sh", "-c", script};
    o.env["OUT"] = dir_.string();
    return o;
  }

  pid_t pid_of(int rank) const { return std::stoi(read_text(dir_ / ("pid." + std::to_string(rank)))); }

  fs::path dir_;
};

TEST_F(LauncherTest, EveryWorkerGetsTheTorchrunEnvironment) {
  const char* saved_omp = std::getenv("OMP_NUM_THREADS");
  std::string saved = saved_omp ? saved_omp : "";
  unsetenv("OMP_NUM_THREADS");

  LaunchOptions o = shell(
      "echo $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT "
      "$REPLICA_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT $OMP_NUM_THREADS $REPLICA_THREADS_PER_WORKER "
      "$EXTRA > \"$OUT/out.$RANK\"",
      3);
  o.nnodes = 2;
  o.node_rank = 1;
  o.master_addr = "10.1.2.3";
  o.master_port = 29123;
  o.env["EXTRA"] = "extra-value";
  o.env["RANK"] = "999";  // the launcher's own variables cannot be overridden
  const int rc = replica::launch::run(o);
  if (saved_omp) setenv("OMP_NUM_THREADS", saved.c_str(), 1);

  ASSERT_EQ(rc, 0);
  const int threads = std::max(1, replica::usable_cores() / 3);
  for (int local = 0; local < 3; ++local) {
    const int rank = 3 + local;
    const std::string expected = std::to_string(rank) + " " + std::to_string(local) + " 6 3 1 10.1.2.3 29123 0 0 " +
                                 std::to_string(threads) + " " + std::to_string(threads) + " extra-value";
    EXPECT_EQ(read_text(dir_ / ("out." + std::to_string(rank))), expected) << "rank " << rank;
  }
  // Only this node's ranks ran.
  EXPECT_FALSE(fs::exists(dir_ / "out.0"));
}

TEST_F(LauncherTest, UserOmpNumThreadsAndThreadsPerWorker) {
  const char* saved_omp = std::getenv("OMP_NUM_THREADS");
  std::string saved = saved_omp ? saved_omp : "";
  setenv("OMP_NUM_THREADS", "7", 1);
  LaunchOptions o = shell("echo $OMP_NUM_THREADS $REPLICA_THREADS_PER_WORKER > \"$OUT/out.$RANK\"", 2);
  o.threads_per_worker = 5;
  const int rc = replica::launch::run(o);
  if (saved_omp) {
    setenv("OMP_NUM_THREADS", saved.c_str(), 1);
  } else {
    unsetenv("OMP_NUM_THREADS");
  }
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(read_text(dir_ / "out.0"), "7 5");
  EXPECT_EQ(read_text(dir_ / "out.1"), "7 5");
}

TEST_F(LauncherTest, PortZeroPicksOneFreePortForAllWorkers) {
  LaunchOptions o = shell("echo $MASTER_PORT > \"$OUT/out.$RANK\"", 2);
  o.master_port = 0;
  ASSERT_EQ(replica::launch::run(o), 0);
  const std::string port0 = read_text(dir_ / "out.0");
  EXPECT_EQ(port0, read_text(dir_ / "out.1"));
  const int port = std::stoi(port0);
  EXPECT_GT(port, 0);
  EXPECT_LT(port, 65536);
}

// The rendezvous secret: one fresh random token per one-node job, shared by its workers;
// an explicit one is passed through as it is; several nodes never get a made-up one.
TEST_F(LauncherTest, OneNodeJobGetsOneRandomTokenAndAGivenTokenIsPassedThrough) {
  const char* saved = std::getenv("REPLICA_TOKEN");
  const std::string saved_value = saved ? saved : "";
  unsetenv("REPLICA_TOKEN");
  LaunchOptions o = shell("printf %s \"$REPLICA_TOKEN\" > \"$OUT/token.$RANK\"", 2);
  ASSERT_EQ(replica::launch::run(o), 0);
  const std::string first = read_text(dir_ / "token.0");
  EXPECT_EQ(first.size(), 64u) << first;
  EXPECT_EQ(first.find_first_not_of("0123456789abcdef"), std::string::npos) << first;
  EXPECT_EQ(first, read_text(dir_ / "token.1"));
  ASSERT_EQ(replica::launch::run(o), 0);
  EXPECT_NE(read_text(dir_ / "token.0"), first) << "each job needs its own secret";

  o.token = "given-secret";
  ASSERT_EQ(replica::launch::run(o), 0);
  EXPECT_EQ(read_text(dir_ / "token.1"), "given-secret");
  if (saved) setenv("REPLICA_TOKEN", saved_value.c_str(), 1);
}

TEST_F(LauncherTest, PortZeroOnSeveralNodesIsAnError) {
  LaunchOptions o = shell("true", 1);
  o.nnodes = 2;
  o.master_port = 0;
  try {
    replica::launch::run(o);
    FAIL() << "expected replica::Error";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("master_port"), std::string::npos) << e.what();
  }
}

TEST_F(LauncherTest, FailingWorkerStopsTheOthersQuickly) {
  // Rank 0 waits (bounded) until ranks 1 and 2 are running, then fails with code 3.
  const std::string script =
      "if [ \"$RANK\" = 0 ]; then i=0; "
      "while { [ ! -e \"$OUT/pid.1\" ] || [ ! -e \"$OUT/pid.2\" ]; } && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done; "
      "exit 3; fi; " +
      std::string(kWritePid) + "exec sleep 60";
  LaunchOptions o = shell(script, 3);
  testing::internal::CaptureStderr();
  const auto start = Clock::now();
  const int rc = replica::launch::run(o);
  const auto elapsed = Clock::now() - start;
  const std::string log = testing::internal::GetCapturedStderr();

  EXPECT_EQ(rc, 3);
  EXPECT_LT(elapsed, std::chrono::seconds(5));
  EXPECT_NE(log.find("replica launch: rank 0 (local rank 0, pid "), std::string::npos) << log;
  EXPECT_NE(log.find(") exited with code 3"), std::string::npos) << log;
  for (int rank : {1, 2}) {
    ASSERT_TRUE(fs::exists(dir_ / ("pid." + std::to_string(rank))));
    EXPECT_FALSE(process_exists(pid_of(rank))) << "rank " << rank << " outlived the failed group";
  }
}

TEST_F(LauncherTest, WorkerIgnoringSigtermIsKilledAfterTheGracePeriod) {
  // Rank 1 ignores SIGTERM (the disposition survives exec), so only SIGKILL stops it.
  const std::string script =
      "if [ \"$RANK\" = 0 ]; then i=0; while [ ! -e \"$OUT/pid.1\" ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); "
      "done; exit 4; fi; trap '' TERM; " +
      std::string(kWritePid) + "exec sleep 60";
  LaunchOptions o = shell(script, 2);
  o.kill_grace_s = 0.2;
  testing::internal::CaptureStderr();
  const int rc = replica::launch::run(o);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 4);
  EXPECT_NE(log.find("sending SIGKILL"), std::string::npos) << log;
  EXPECT_FALSE(process_exists(pid_of(1)));
}

TEST_F(LauncherTest, WorkerKilledBySignalGives128PlusSigno) {
  LaunchOptions o = shell("if [ \"$RANK\" = 1 ]; then kill -KILL $$; fi; exit 0", 2);
  testing::internal::CaptureStderr();
  const int rc = replica::launch::run(o);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 128 + SIGKILL);
  EXPECT_NE(log.find("rank 1 (local rank 1, pid "), std::string::npos) << log;
  EXPECT_NE(log.find("was killed by SIGKILL"), std::string::npos) << log;
}

TEST(WorkerExitTest, Describe) {
  WorkerExit killed;
  killed.rank = 1;
  killed.local_rank = 1;
  killed.pid = 1234;
  killed.signaled = true;
  killed.code = SIGKILL;
  EXPECT_EQ(killed.describe(), "rank 1 (local rank 1, pid 1234) was killed by SIGKILL");
  WorkerExit exited;
  exited.rank = 5;
  exited.local_rank = 2;
  exited.pid = 77;
  exited.code = 3;
  EXPECT_EQ(exited.describe(), "rank 5 (local rank 2, pid 77) exited with code 3");
}

TEST_F(LauncherTest, RestartsTheGroupAfterAFailure) {
  // Rank 1 fails only on the first attempt; every attempt appends to attempts.$RANK.
  LaunchOptions o = shell(
      "echo $REPLICA_RESTART_COUNT >> \"$OUT/attempts.$RANK\"; "
      "if [ \"$RANK\" = 1 ] && [ \"$REPLICA_RESTART_COUNT\" = 0 ]; then exit 5; fi; "
      "echo $REPLICA_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT > \"$OUT/out.$RANK\"",
      2);
  o.max_restarts = 1;
  testing::internal::CaptureStderr();
  const int rc = replica::launch::run(o);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 0) << log;
  EXPECT_NE(log.find("restarting workers (restart 1 of 1)"), std::string::npos) << log;
  EXPECT_EQ(read_text(dir_ / "out.0"), "1 1");
  EXPECT_EQ(read_text(dir_ / "out.1"), "1 1");
  EXPECT_EQ(read_text(dir_ / "attempts.1"), "0\n1");
}

TEST_F(LauncherTest, GivesUpWhenRestartsRunOut) {
  LaunchOptions o = shell("echo $REPLICA_RESTART_COUNT >> \"$OUT/attempts\"; exit 6", 1);
  o.max_restarts = 2;
  testing::internal::CaptureStderr();
  const int rc = replica::launch::run(o);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 6);
  EXPECT_EQ(read_text(dir_ / "attempts"), "0\n1\n2");
  EXPECT_NE(log.find("restart 2 of 2"), std::string::npos) << log;
}

TEST_F(LauncherTest, SigtermToTheLauncherReachesEveryWorker) {
  // Each worker traps TERM, leaves a marker and stops its background sleep. SIGKILL, since
  // a TERM that reaches the freshly forked sleep before it resets dash's trap is lost.
  const std::string script =
      "trap 'touch \"$OUT/term.$RANK\"; kill -KILL $! 2>/dev/null; exit 0' TERM; " + std::string(kWritePid) +
      "sleep 60 </dev/null >/dev/null 2>&1 & wait $!";
  LaunchOptions o = shell(script, 2);
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    int rc = 100;
    try {
      rc = replica::launch::run(o);
    } catch (...) {
    }
    _exit(rc);
  }
  const bool started = wait_for_files({dir_ / "pid.0", dir_ / "pid.1"});
  ASSERT_EQ(kill(launcher, SIGTERM), 0);
  const int status = wait_child(launcher);
  ASSERT_TRUE(started) << "workers did not start";
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  EXPECT_TRUE(fs::exists(dir_ / "term.0"));
  EXPECT_TRUE(fs::exists(dir_ / "term.1"));
  EXPECT_FALSE(process_exists(pid_of(0)));
  EXPECT_FALSE(process_exists(pid_of(1)));
}

TEST_F(LauncherTest, WorkersDieWithAKilledLauncher) {
  // Become a subreaper so orphaned workers are reparented to this test process and we can
  // see how they ended.
  ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  LaunchOptions o = shell(std::string(kWritePid) + "exec sleep 60", 2);
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) _exit(replica::launch::run(o));
  const bool started = wait_for_files({dir_ / "pid.0", dir_ / "pid.1"});
  kill(launcher, SIGKILL);
  const int launcher_status = wait_child(launcher);
  EXPECT_TRUE(WIFSIGNALED(launcher_status));
  if (started) {
    for (int rank : {0, 1}) {
      const int status = wait_child(pid_of(rank));
      EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "rank " << rank << " status " << status;
    }
  }
  prctl(PR_SET_CHILD_SUBREAPER, 0);
  ASSERT_TRUE(started) << "workers did not start";
}

TEST_F(LauncherTest, MissingProgramFailsNamingIt) {
  LaunchOptions o;
  o.nproc_per_node = 2;
  o.command = {"replica-no-such-program-xyz", "--flag"};
  testing::internal::CaptureStderr();
  const int rc = replica::launch::run(o);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(rc, 0);
  EXPECT_NE(log.find("replica launch: cannot execute 'replica-no-such-program-xyz': No such file or directory"),
            std::string::npos)
      << log;
}

TEST_F(LauncherTest, SignalDispositionsAreRestored) {
  struct sigaction before {}, after {};
  sigaction(SIGCHLD, nullptr, &before);
  ASSERT_EQ(replica::launch::run(shell("true", 1)), 0);
  sigaction(SIGCHLD, nullptr, &after);
  EXPECT_EQ(before.sa_handler, after.sa_handler);
}

TEST_F(LauncherTest, InvalidOptionsAreErrors) {
  LaunchOptions o = shell("true", 1);
  o.nproc_per_node = 0;
  EXPECT_THROW(replica::launch::run(o), replica::Error);
  o = shell("true", 1);
  o.node_rank = 1;
  EXPECT_THROW(replica::launch::run(o), replica::Error);
  o = shell("true", 1);
  o.command.clear();
  EXPECT_THROW(replica::launch::run(o), replica::Error);
}

// On the CPU (no GPU, or a job on the CPU: gpus = 0).
TEST(ResolveNproc, AutoAndNumbers) {
  const int cores = replica::usable_cores();
  EXPECT_EQ(replica::launch::resolve_nproc("auto", 0), cores);
  EXPECT_EQ(replica::launch::resolve_nproc("1", 0), 1);
  EXPECT_EQ(replica::launch::resolve_nproc(std::to_string(4 * cores), 0), 4 * cores);
  // Without a count: the GPUs this process sees (none on CI).
  EXPECT_EQ(replica::launch::resolve_nproc("auto"), replica::launch::resolve_nproc("auto", replica::visible_gpu_count()));
}

// With GPUs: one worker per GPU; more is an error naming both counts.
TEST(ResolveNproc, OneWorkerPerGpu) {
  EXPECT_EQ(replica::launch::resolve_nproc("auto", 8), 8);
  EXPECT_EQ(replica::launch::resolve_nproc("2", 8), 2);
  EXPECT_EQ(replica::launch::resolve_nproc("8", 8), 8);
  try {
    replica::launch::resolve_nproc("3", 2);
    FAIL() << "expected replica::Error";
  } catch (const replica::Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("nproc_per_node 3 exceeds the 2 GPUs visible on this node", 0), 0u) << what;
    EXPECT_NE(what.find("start at most 2"), std::string::npos) << what;
    EXPECT_NE(what.find("ddp_backend: gloo"), std::string::npos) << what;
  }
  // Workers sharing GPUs over Gloo (ddp_backend gloo): more workers than GPUs; auto stays one
  // per GPU.
  EXPECT_EQ(replica::launch::resolve_nproc("3", 2, /*gpus_shared=*/true), 3);
  EXPECT_EQ(replica::launch::resolve_nproc("auto", 2, /*gpus_shared=*/true), 2);
}

TEST(ResolveNproc, BadValuesNameTheValue) {
  for (const std::string bad : {"0", "-1", "abc", "", "2x"}) {
    try {
      replica::launch::resolve_nproc(bad, 0);
      ADD_FAILURE() << "no error for '" << bad << "'";
    } catch (const replica::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'" + bad + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(ResolveNproc, TooManyWorkersPerCore) {
  const int cores = replica::usable_cores();
  const int n = 4 * cores + 1;
  try {
    replica::launch::resolve_nproc(std::to_string(n), 0);
    FAIL() << "expected replica::Error";
  } catch (const replica::Error& e) {
    const std::string expected = "nproc_per_node " + std::to_string(n) + " exceeds the limit of " +
                                 std::to_string(4 * cores) + " workers (4 per core x " + std::to_string(cores) +
                                 (cores == 1 ? " core" : " cores") + ") on CPU";
    EXPECT_EQ(e.what(), expected);
  }
  EXPECT_THROW(replica::launch::resolve_nproc("99999999999999", 0), replica::Error);
}

TEST(FindFreePort, ReturnsABindablePort) {
  const int port = replica::launch::find_free_port("127.0.0.1");
  ASSERT_GT(port, 0);
  ASSERT_LT(port, 65536);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
  close(fd);
}

TEST(FindFreePort, UnresolvableAddressIsAnError) {
  EXPECT_THROW(replica::launch::find_free_port("no-such-host.invalid"), replica::Error);
}

}  // namespace

// Every failed worker leaves a record per rank and attempt: its own (REPLICA_ERROR_FILE), or
// the launcher's when it left none; the launcher prints the message, rank and time.
TEST_F(LauncherTest, FailedWorkersLeaveErrorFilesThatTheLauncherReports) {
  LaunchOptions o = shell(
      "if [ \"$REPLICA_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then "
      "  mkdir -p \"$(dirname \"$REPLICA_ERROR_FILE\")\"; "
      "  printf '{\"message\":\"bad shard 7\",\"rank\":1,\"time\":\"2026-01-01T00:00:00Z\"}' > \"$REPLICA_ERROR_FILE\"; "
      "  exit 4; fi; "
      "if [ \"$RANK\" = 0 ]; then exec sleep 30; fi; "
      "kill -9 $$",
      2);
  o.max_restarts = 1;
  o.error_dir = (dir_ / "errors").string();
  testing::internal::CaptureStderr();
  const int rc = replica::launch::run(o);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 128 + SIGKILL) << log;
  const fs::path own = dir_ / "errors" / "rank-1.restart-0.json";
  EXPECT_NE(log.find("rank 1 reported at 2026-01-01T00:00:00Z: bad shard 7 (error file " + own.string() + ")"),
            std::string::npos)
      << log;
  // Second attempt: rank 1 killed itself; the launcher wrote the record.
  const fs::path written = dir_ / "errors" / "rank-1.restart-1.json";
  ASSERT_TRUE(fs::exists(written)) << log;
  const std::string record = read_text(written);
  EXPECT_NE(record.find("\"rank\":1"), std::string::npos) << record;
  EXPECT_NE(record.find("killed by SIGKILL"), std::string::npos) << record;
  EXPECT_NE(record.find("\"restart\":1"), std::string::npos) << record;
  EXPECT_NE(record.find("\"time\":\"20"), std::string::npos) << record;
  // Rank 0 was stopped by the launcher, not failed: no record.
  EXPECT_FALSE(fs::exists(dir_ / "errors" / "rank-0.restart-0.json"));
}

TEST_F(LauncherTest, IfaceBecomesGlooSocketIfname) {
  LaunchOptions o = shell("echo \"$GLOO_SOCKET_IFNAME\" > \"$OUT/iface.$RANK\"", 1);
  o.iface = "lo";
  EXPECT_EQ(replica::launch::run(o), 0);
  EXPECT_EQ(read_text(dir_ / "iface.0"), "lo");
  o.iface = "nosuch0";
  try {
    replica::launch::run(o);
    ADD_FAILURE() << "an unknown interface was accepted";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("network interface 'nosuch0' (--iface) does not exist"), std::string::npos)
        << e.what();
  }
}
