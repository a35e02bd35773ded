// The rendezvous store: a small key-value server that rank 0 hosts and every rank (and Gloo,
// through the c10d adaptor in c10d_compat.cpp) talks to.
//
// Why our own and not c10d's TCPStore: TCPStore binds every interface and admits anyone who
// connects (pytorch#173909). This one listens only on the address it is given (loopback for
// a single-node job) and admits a connection only after it proves the job's shared secret
// (REPLICA_TOKEN / --token) by HMAC-SHA256 over a fresh server nonce. Until then no store
// command is read. A stray connection, garbage bytes, an oversized message or a wrong token
// is refused, logged with the peer's address, and the job goes on.
//
// Wire format (all integers little-endian):
//   server -> client  greeting: "RPLRDZV1" + 32-byte nonce
//   client -> server  proof:    "RPLRDZV1" + HMAC-SHA256(token, "replica-rdzv-v1" + nonce)
//   server -> client  verdict:  'A' (admitted) or 'R' (refused, then the server closes)
//   then requests and replies, each a frame: u32 length (1..kMaxFrameBytes) + payload.
//   request payload: u8 command + arguments; string = u32 length + bytes; list = u32 count
//   + strings; int = 8 bytes. reply payload: u8 status (0 ok, 1 timed out) + result.
// Every length is checked against what is left of its frame and against the limits below.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace replica::distributed::rdzv {

using Bytes = std::vector<uint8_t>;
using Clock = std::chrono::steady_clock;

constexpr char kMagic[8] = {'R', 'P', 'L', 'R', 'D', 'Z', 'V', '1'};
constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;
constexpr size_t kGreetingBytes = sizeof(kMagic) + kNonceBytes;
constexpr size_t kHelloBytes = sizeof(kMagic) + kProofBytes;
constexpr uint32_t kMaxFrameBytes = 16u << 20;   // rendezvous values are addresses and small blobs
constexpr uint32_t kMaxKeysPerRequest = 65536;
constexpr size_t kMaxKeys = 1u << 20;            // keys the server holds at most
constexpr size_t kMaxStoredBytes = 1u << 30;     // bytes of keys + values the server holds at most

enum class Command : uint8_t {
  kSet = 1,         // key, value                 -> ()
  kGet = 2,         // key                        -> u8 found + value
  kAdd = 3,         // key, i64                   -> i64 new value
  kCompareSet = 4,  // key, expected, desired     -> value now stored (c10d semantics)
  kCheck = 5,       // keys                       -> u8 all present
  kWait = 6,        // keys, i64 timeout ms       -> status 0 when all present, 1 on timeout
  kDelete = 7,      // key                        -> u8 existed
  kNumKeys = 8,     // ()                         -> i64
};

// HMAC-SHA256(token, "replica-rdzv-v1" + nonce): what a client sends to prove the token.
Bytes proof_for(const std::string& token, const uint8_t* nonce, size_t nonce_size);

// Cryptographically random bytes (OpenSSL's RAND_bytes).
Bytes random_bytes(size_t n);

// The key-value data the server holds.
struct Table {
  std::map<std::string, Bytes> values;
  size_t stored_bytes = 0;
};

// One connection's protocol state, independent of sockets so that it can be tested and
// fuzzed on bytes alone. feed() consumes what arrived; replies go to `out`.
class Session {
 public:
  Session(Table& table, std::string token, Bytes nonce);

  // The greeting to send first.
  std::string greeting() const;
  // Consumes received bytes, appending replies to `out`. Returns false when the connection
  // must be closed; refusal() then says why (empty for an orderly close).
  bool feed(const uint8_t* data, size_t size, std::string& out, Clock::time_point now);
  // Completes or expires a pending wait and resumes parsing buffered requests. Call after
  // any change to the table and when wait_deadline() passes. Same result as feed().
  bool progress(std::string& out, Clock::time_point now);

  bool authenticated() const { return authenticated_; }
  bool waiting() const { return wait_keys_.has_value(); }
  Clock::time_point wait_deadline() const { return wait_deadline_; }
  // True when the last feed()/progress() changed the table (other sessions' waits may end).
  bool changed_table() const { return changed_; }
  const std::string& refusal() const { return refusal_; }

 private:
  bool refuse(std::string why);
  bool handle_frame(const uint8_t* p, size_t n, std::string& out, Clock::time_point now);
  bool all_present(const std::vector<std::string>& keys) const;
  bool store(const std::string& key, Bytes value);

  Table& table_;
  std::string token_;
  Bytes nonce_;
  std::string buffer_;
  bool authenticated_ = false;
  bool changed_ = false;
  std::optional<std::vector<std::string>> wait_keys_;
  Clock::time_point wait_deadline_{};
  std::string refusal_;
};

// The server: one thread polling the listening socket and every connection.
class Server {
 public:
  // Listens on host:port (that address only; port 0 picks a free one). replica::Error when
  // the address does not resolve, is not this host's, or the port is taken. Log lines name
  // the rendezvous as host:port.
  Server(const std::string& host, int port, std::string token);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  // Connections refused so far (for tests and the job's log).
  int refused() const;

 private:
  void loop();
  struct State;
  std::unique_ptr<State> state_;
  int port_ = 0;
  std::thread thread_;
};

// A connection to the server. Thread-safe: one request at a time.
class Client {
 public:
  // Connects to host:port, retrying while nothing listens there until `deadline`, then
  // proves `token`. Returns nullptr when nothing answered before the deadline;
  // replica::Error when the server refused the token or spoke something else.
  static std::unique_ptr<Client> connect(const std::string& host, int port, const std::string& token,
                                         Clock::time_point deadline);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  void set(const std::string& key, const Bytes& value);
  std::optional<Bytes> get(const std::string& key);
  int64_t add(const std::string& key, int64_t delta);
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired);
  bool check(const std::vector<std::string>& keys);
  // True when every key is present within `timeout`, false when the timeout passed first.
  bool wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  bool remove(const std::string& key);
  int64_t num_keys();

  const std::string& host() const { return host_; }
  int port() const { return port_; }
  const std::string& token() const { return token_; }

 private:
  Client(int fd, std::string host, int port, std::string token);
  std::string request(const std::string& payload, uint8_t* status);
  struct Lock;
  int fd_ = -1;
  std::string host_;
  int port_ = 0;
  std::string token_;
  std::unique_ptr<Lock> lock_;
};

}  // namespace replica::distributed::rdzv
