// The locked rendezvous store: c10d's store semantics, and what it refuses (wrong token,
// garbage, oversized messages) while serving the clients that proved the token.
#include "replica/core/error.h"
#include "replica/distributed/store.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <thread>

using namespace replica::distributed::rdzv;

namespace {

Bytes bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }

std::unique_ptr<Client> client(const Server& server, const std::string& token) {
  return Client::connect("127.0.0.1", server.port(), token, Clock::now() + std::chrono::seconds(10));
}

// A raw TCP connection to the server; returns the fd after reading the greeting.
int raw_connect(int port, std::string* greeting = nullptr) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  std::string g(kGreetingBytes, '\0');
  size_t got = 0;
  while (got < g.size()) {
    ssize_t n = recv(fd, g.data() + got, g.size() - got, 0);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  EXPECT_EQ(got, kGreetingBytes);
  if (greeting) *greeting = g;
  return fd;
}

// Everything the server sends until it closes the connection.
std::string read_until_closed(int fd) {
  std::string all;
  char buf[256];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    all.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return all;
}

}  // namespace

TEST(RendezvousStore, SetGetAddCompareSetDeleteCountAcrossClients) {
  Server server("127.0.0.1", 0, "secret");
  auto a = client(server, "secret");
  auto b = client(server, "secret");
  ASSERT_TRUE(a && b);
  a->set("k", bytes("v1"));
  EXPECT_EQ(b->get("k"), bytes("v1"));
  EXPECT_FALSE(b->get("missing").has_value());
  EXPECT_EQ(a->add("n", 5), 5);
  EXPECT_EQ(b->add("n", -2), 3);
  EXPECT_THROW(a->add("k", 1), replica::Error);  // "v1" is no integer
  // c10d compareSet: a missing key is set only when expected is empty.
  EXPECT_EQ(a->compare_set("c", bytes("x"), bytes("y")), bytes("x"));
  EXPECT_FALSE(a->get("c").has_value());
  EXPECT_EQ(a->compare_set("c", {}, bytes("y")), bytes("y"));
  EXPECT_EQ(b->compare_set("c", bytes("wrong"), bytes("z")), bytes("y"));
  EXPECT_EQ(b->compare_set("c", bytes("y"), bytes("z")), bytes("z"));
  EXPECT_TRUE(a->check({"k", "n", "c"}));
  EXPECT_FALSE(a->check({"k", "nope"}));
  EXPECT_EQ(a->num_keys(), 3);
  EXPECT_TRUE(a->remove("k"));
  EXPECT_FALSE(a->remove("k"));
  EXPECT_EQ(b->num_keys(), 2);
  EXPECT_EQ(server.refused(), 0);
}

TEST(RendezvousStore, WaitEndsWhenAnotherClientSetsTheKeyAndTimesOutOtherwise) {
  Server server("127.0.0.1", 0, "secret");
  auto waiter = client(server, "secret");
  auto setter = client(server, "secret");
  EXPECT_FALSE(waiter->wait({"never"}, std::chrono::milliseconds(50)));
  std::thread t([&] { setter->set("later", bytes("1")); });
  EXPECT_TRUE(waiter->wait({"later"}, std::chrono::seconds(30)));
  t.join();
  EXPECT_EQ(waiter->get("later"), bytes("1"));
}

TEST(RendezvousStore, WrongTokenIsRefusedWithAMessageAndTheStoreGoesOn) {
  Server server("127.0.0.1", 0, "right");
  auto good = client(server, "right");
  try {
    client(server, "wrong");
    FAIL() << "a wrong token must be refused";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("refused this worker's token"), std::string::npos) << e.what();
  }
  good->set("still", bytes("works"));
  EXPECT_EQ(good->get("still"), bytes("works"));
  EXPECT_EQ(server.refused(), 1);
}

TEST(RendezvousStore, GarbageWrongProofAndOversizedFramesAreRefused) {
  Server server("127.0.0.1", 0, "right");
  auto good = client(server, "right");

  // Garbage instead of the handshake: closed without a verdict.
  int fd = raw_connect(server.port());
  const std::string junk = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
  EXPECT_EQ(read_until_closed(fd), "");

  // The right magic with a proof made from another token: 'R' and closed.
  std::string greeting;
  fd = raw_connect(server.port(), &greeting);
  const Bytes proof = proof_for("guess", reinterpret_cast<const uint8_t*>(greeting.data()) + 8, kNonceBytes);
  std::string hello(kMagic, sizeof kMagic);
  hello.append(reinterpret_cast<const char*>(proof.data()), proof.size());
  send(fd, hello.data(), hello.size(), MSG_NOSIGNAL);
  EXPECT_EQ(read_until_closed(fd), "R");

  // Admitted, then a frame header claiming 2 GiB: closed, nothing allocated.
  fd = raw_connect(server.port(), &greeting);
  const Bytes good_proof = proof_for("right", reinterpret_cast<const uint8_t*>(greeting.data()) + 8, kNonceBytes);
  hello.assign(kMagic, sizeof kMagic);
  hello.append(reinterpret_cast<const char*>(good_proof.data()), good_proof.size());
  hello += std::string("\x00\x00\x00\x80", 4);
  send(fd, hello.data(), hello.size(), MSG_NOSIGNAL);
  EXPECT_EQ(read_until_closed(fd), "A");

  // A connection that closes before proving anything counts as refused too.
  close(raw_connect(server.port()));

  good->set("after", bytes("intruders"));
  EXPECT_EQ(good->get("after"), bytes("intruders"));
  // The last close is seen by the server asynchronously; its count is checked by the
  // session tests below. The three intrusions before it are all in.
  EXPECT_GE(server.refused(), 3);
}

TEST(RendezvousSession, ParsesOnlyAfterTheProofAndBoundsEveryLength) {
  Table table;
  const Bytes nonce(kNonceBytes, 7);
  const auto now = Clock::now();
  std::string out;
  {
    // A store command before the handshake is refused unread.
    Session s(table, "t", nonce);
    const uint8_t frame[] = {5, 0, 0, 0, 1, 0, 0, 0, 0};
    EXPECT_FALSE(s.feed(frame, sizeof frame, out, now));
    EXPECT_NE(s.refusal().find("not a replica worker"), std::string::npos);
    EXPECT_TRUE(table.values.empty());
  }
  auto admitted = [&](Session& s) {
    std::string hello(kMagic, sizeof kMagic);
    const Bytes proof = proof_for("t", nonce.data(), nonce.size());
    hello.append(reinterpret_cast<const char*>(proof.data()), proof.size());
    std::string o;
    EXPECT_TRUE(s.feed(reinterpret_cast<const uint8_t*>(hello.data()), hello.size(), o, now));
    EXPECT_EQ(o, "A");
  };
  {
    // A set whose key length runs past the frame.
    Session s(table, "t", nonce);
    admitted(s);
    const uint8_t frame[] = {9, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0x7f, 'k', 0, 0, 0};
    EXPECT_FALSE(s.feed(frame, sizeof frame, out, now));
    EXPECT_NE(s.refusal().find("malformed request 1"), std::string::npos) << s.refusal();
  }
  {
    // A key list claiming 2^32-1 entries.
    Session s(table, "t", nonce);
    admitted(s);
    const uint8_t frame[] = {5, 0, 0, 0, 5, 0xff, 0xff, 0xff, 0xff};
    EXPECT_FALSE(s.feed(frame, sizeof frame, out, now));
  }
  {
    // Unknown command.
    Session s(table, "t", nonce);
    admitted(s);
    const uint8_t frame[] = {1, 0, 0, 0, 99};
    EXPECT_FALSE(s.feed(frame, sizeof frame, out, now));
    EXPECT_NE(s.refusal().find("unknown request 99"), std::string::npos);
  }
  EXPECT_TRUE(table.values.empty());
}

TEST(RendezvousStore, ListensOnlyOnTheGivenAddress) {
  Server server("127.0.0.1", 0, "t");
  // 127.0.0.2 is loopback too, but not the address the server was given.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(server.port()));
  inet_pton(AF_INET, "127.0.0.2", &a.sin_addr);
  EXPECT_NE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  close(fd);
}
