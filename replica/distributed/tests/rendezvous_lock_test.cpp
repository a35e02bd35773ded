// A real 2-worker job started by `replica launch` while intruders knock at its rendezvous
// port: one sends garbage, one proves a wrong token. Both are refused and logged with their
// address; the job goes on and finishes. The workers hold their first collective until the
// intruders are done (a key the test sets with the right token), so the order is certain.
#include "replica/core/error.h"
#include "replica/testing/paths.h"
#include "replica/distributed/process_group.h"
#include "replica/distributed/store.h"
#include "replica/distributed/world.h"
#include "replica/testing/program_runner.h"
#include "replica/distributed/tests/loopback.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <iostream>
#include <thread>

using namespace replica::distributed;

namespace {

using replica::testing::free_port;

constexpr char kReleaseKey[] = "test/intruders_done";

// Connects to 127.0.0.1:port once rank 0 listens (or -1 once `stop` is set) and reads the
// greeting.
int knock(int port, const std::atomic<bool>& stop, std::string* greeting) {
  while (!stop) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      greeting->assign(rdzv::kGreetingBytes, '\0');
      size_t got = 0;
      while (got < greeting->size()) {
        ssize_t n = recv(fd, greeting->data() + got, greeting->size() - got, 0);
        if (n <= 0) break;
        got += static_cast<size_t>(n);
      }
      return fd;
    }
    close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // rank 0 not listening yet
  }
  return -1;
}

std::string read_until_closed(int fd) {
  std::string all;
  char buf[64];
  for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;) all.append(buf, static_cast<size_t>(n));
  close(fd);
  return all;
}

std::string self_exe() {
  char path[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  return std::string(path, n > 0 ? static_cast<size_t>(n) : 0);
}

}  // namespace

// One rank of the locked-rendezvous scenario ("rdzv"), the only scenario of this binary.
int run_test_worker(const std::string& name) {
  if (name != "rdzv") {
    std::cerr << "unknown scenario " << name << "\n";
    return 2;
  }
  try {
    auto world = world_from_env();
    if (!world) throw replica::Error("no world in the environment");
    ProcessGroupOptions options;
    options.rdzv_timeout = std::chrono::seconds(60);
    options.transport = "gloo";
    auto pg = init_process_group(*world, options);
    pg->store_get(kReleaseKey);  // blocks until the test's intruders are done
    auto t = torch::full({4}, static_cast<float>(world->rank + 1));
    pg->allreduce_sum(t).wait();
    if (!torch::equal(t, torch::full({4}, 3.0f))) throw replica::Error("all-reduce gave a wrong sum");
    pg->barrier();
    std::cout << "rank " << world->rank << " finished\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "worker failed: " << e.what() << "\n";
    return 1;
  }
}

TEST(LockedRendezvous, GarbageAndWrongTokenAreRefusedWhileATwoWorkerJobFinishes) {
  const int port = free_port();
  const std::string token = "ci-token-" + std::to_string(getpid());
  std::atomic<bool> stop{false};
  std::string garbage_reply = "unset", wrong_token_reply = "unset";
  std::thread intruders([&] {
    std::string greeting;
    int fd = knock(port, stop, &greeting);
    if (fd < 0) return;
    const std::string junk = "\x16\x03\x01\x02\x00 not the handshake at all";
    send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    garbage_reply = read_until_closed(fd);

    fd = knock(port, stop, &greeting);
    if (fd < 0) return;
    const auto proof = rdzv::proof_for("not-" + token, reinterpret_cast<const uint8_t*>(greeting.data()) + 8,
                                       rdzv::kNonceBytes);
    std::string hello(rdzv::kMagic, sizeof rdzv::kMagic);
    hello.append(reinterpret_cast<const char*>(proof.data()), proof.size());
    send(fd, hello.data(), hello.size(), MSG_NOSIGNAL);
    wrong_token_reply = read_until_closed(fd);

    // Release the workers with the right token.
    auto admitted = rdzv::Client::connect("127.0.0.1", port, token, rdzv::Clock::now() + std::chrono::seconds(30));
    // c10d's PrefixStore joins prefix and key with '/': the process group's user keys live
    // under "replica/restart0/user/" + "/" + key.
    const std::string key = std::string("replica/restart0/user//") + kReleaseKey;
    if (admitted) admitted->set(key, rdzv::Bytes{'1'});
  });
  const auto r = replica::testing::run_program(
      REPLICA_BIN,
      {"launch", "--nproc-per-node", "2", "--master-port", std::to_string(port), "--token", token, "--", self_exe(),
       "--worker", "rdzv"},
      {}, std::chrono::seconds(120));
  stop = true;
  intruders.join();
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_EQ(garbage_reply, "");       // closed without a verdict
  EXPECT_EQ(wrong_token_reply, "R");  // refused
  const std::string log = r.all();
  size_t refusals = 0;
  for (size_t at = 0; (at = log.find("refused connection from 127.0.0.1:", at)) != std::string::npos; ++at) ++refusals;
  EXPECT_EQ(refusals, 2u) << r;
  EXPECT_NE(log.find("not a replica worker"), std::string::npos) << r;
  EXPECT_NE(log.find("wrong token"), std::string::npos) << r;
  EXPECT_NE(log.find("rank 0 finished"), std::string::npos) << r;
  EXPECT_NE(log.find("rank 1 finished"), std::string::npos) << r;
  EXPECT_EQ(log.find(token), std::string::npos) << "the token must never be logged";
}
