// The rendezvous store: protocol (Session), server loop and client. See store.h for the
// wire format and why it exists.
#include "replica/distributed/store.h"

#include "replica/core/error.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

namespace replica::distributed::rdzv {
namespace {

constexpr char kProofContext[] = "replica-rdzv-v1";
constexpr auto kHandshakeTimeout = std::chrono::seconds(30);
constexpr size_t kMaxConnections = 4096;
constexpr int64_t kMaxWaitMs = int64_t{7} * 24 * 3600 * 1000;

enum Status : uint8_t { kOk = 0, kTimedOut = 1, kFailed = 2 };

// Bounds-checked reading of one request's arguments.
struct Reader {
  const uint8_t* p;
  size_t n;
  bool take(void* dst, size_t k) {
    if (k > n) return false;
    std::memcpy(dst, p, k);
    p += k;
    n -= k;
    return true;
  }
  bool u32(uint32_t& v) {
    uint8_t b[4];
    if (!take(b, 4)) return false;
    v = uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
    return true;
  }
  bool i64(int64_t& v) {
    uint8_t b[8];
    if (!take(b, 8)) return false;
    uint64_t u = 0;
    for (int i = 7; i >= 0; --i) u = u << 8 | b[i];
    v = static_cast<int64_t>(u);
    return true;
  }
  bool bytes(Bytes& v) {
    uint32_t len = 0;
    if (!u32(len) || len > n) return false;
    v.assign(p, p + len);
    p += len;
    n -= len;
    return true;
  }
  bool str(std::string& v) {
    uint32_t len = 0;
    if (!u32(len) || len > n) return false;
    v.assign(reinterpret_cast<const char*>(p), len);
    p += len;
    n -= len;
    return true;
  }
  bool list(std::vector<std::string>& v) {
    uint32_t count = 0;
    if (!u32(count) || count > kMaxKeysPerRequest || count > n / 4) return false;
    v.resize(count);
    for (auto& s : v) {
      if (!str(s)) return false;
    }
    return true;
  }
};

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i) & 0xff));
}
void put_i64(std::string& out, int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(u >> (8 * i) & 0xff));
}
void put_str(std::string& out, const std::string& s) {
  put_u32(out, static_cast<uint32_t>(s.size()));
  out += s;
}
void put_bytes(std::string& out, const Bytes& b) {
  put_u32(out, static_cast<uint32_t>(b.size()));
  out.append(reinterpret_cast<const char*>(b.data()), b.size());
}
void put_list(std::string& out, const std::vector<std::string>& keys) {
  put_u32(out, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) put_str(out, k);
}

void reply(std::string& out, Status status, const std::string& body = {}) {
  put_u32(out, static_cast<uint32_t>(1 + body.size()));
  out.push_back(static_cast<char>(status));
  out += body;
}

std::optional<int64_t> parse_int(const Bytes& b) {
  if (b.empty() || b.size() > 20) return std::nullopt;
  size_t i = 0;
  bool negative = false;
  if (b[0] == '-') negative = true, i = 1;
  if (i == b.size()) return std::nullopt;
  int64_t v = 0;
  for (; i < b.size(); ++i) {
    if (b[i] < '0' || b[i] > '9') return std::nullopt;
    if (__builtin_mul_overflow(v, 10, &v) ||
        (negative ? __builtin_sub_overflow(v, b[i] - '0', &v) : __builtin_add_overflow(v, b[i] - '0', &v))) {
      return std::nullopt;
    }
  }
  return v;
}

std::string peer_name(const sockaddr_storage& a) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    port = ntohs(in->sin_port);
    return fmt::format("{}:{}", host, port);
  }
  if (a.ss_family == AF_INET6) {
    const auto* in = reinterpret_cast<const sockaddr_in6*>(&a);
    inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof host);
    port = ntohs(in->sin6_port);
    return fmt::format("[{}]:{}", host, port);
  }
  return "an unknown address";
}

addrinfo* resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (getaddrinfo(host.c_str(), service.c_str(), &hints, &res) != 0 || res == nullptr) {
    fail("MASTER_ADDR '{}' does not resolve to an address", host);
  }
  return res;
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace

Bytes proof_for(const std::string& token, const uint8_t* nonce, size_t nonce_size) {
  std::string message(kProofContext);
  message.append(reinterpret_cast<const char*>(nonce), nonce_size);
  Bytes mac(EVP_MAX_MD_SIZE);
  unsigned int len = 0;
  // An empty key is valid HMAC input; OpenSSL wants a non-null pointer for it.
  static const unsigned char kEmpty = 0;
  if (!HMAC(EVP_sha256(), token.empty() ? static_cast<const void*>(&kEmpty) : static_cast<const void*>(token.data()), static_cast<int>(token.size()),
            reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac.data(), &len)) {
    fail("rendezvous: HMAC-SHA256 failed in OpenSSL");
  }
  mac.resize(len);
  return mac;
}

Bytes random_bytes(size_t n) {
  Bytes b(n);
  if (RAND_bytes(b.data(), static_cast<int>(n)) != 1) fail("rendezvous: OpenSSL could not produce random bytes");
  return b;
}

// ---- Session ------------------------------------------------------------------------------

Session::Session(Table& table, std::string token, Bytes nonce)
    : table_(table), token_(std::move(token)), nonce_(std::move(nonce)) {}

std::string Session::greeting() const {
  std::string g(kMagic, sizeof kMagic);
  g.append(reinterpret_cast<const char*>(nonce_.data()), nonce_.size());
  return g;
}

bool Session::refuse(std::string why) {
  refusal_ = std::move(why);
  buffer_.clear();
  return false;
}

bool Session::feed(const uint8_t* data, size_t size, std::string& out, Clock::time_point now) {
  changed_ = false;
  if (!refusal_.empty()) return false;
  // A client sends one request and waits for its reply, so more than one frame (or the
  // handshake) buffered at once is abuse: bound the buffer instead of growing it.
  if (buffer_.size() + size > size_t{kMaxFrameBytes} + 4 + kHelloBytes) {
    return refuse("sent more than one request's worth of bytes at once");
  }
  buffer_.append(reinterpret_cast<const char*>(data), size);
  return progress(out, now);
}

bool Session::progress(std::string& out, Clock::time_point now) {
  if (!refusal_.empty()) return false;
  if (!authenticated_) {
    const size_t magic = std::min(buffer_.size(), sizeof kMagic);
    if (std::memcmp(buffer_.data(), kMagic, magic) != 0) {
      return refuse("not a replica worker (unexpected bytes instead of the handshake)");
    }
    if (buffer_.size() < kHelloBytes) return true;
    const Bytes expected = proof_for(token_, nonce_.data(), nonce_.size());
    if (expected.size() != kProofBytes ||
        CRYPTO_memcmp(expected.data(), buffer_.data() + sizeof kMagic, kProofBytes) != 0) {
      out.push_back('R');
      return refuse("wrong token (the HMAC proof of REPLICA_TOKEN did not match)");
    }
    out.push_back('A');
    authenticated_ = true;
    buffer_.erase(0, kHelloBytes);
  }
  if (wait_keys_) {
    if (all_present(*wait_keys_)) {
      reply(out, kOk);
    } else if (now >= wait_deadline_) {
      reply(out, kTimedOut);
    } else {
      return true;
    }
    wait_keys_.reset();
  }
  size_t offset = 0;
  bool ok = true;
  while (ok && !wait_keys_ && buffer_.size() - offset >= 4) {
    Reader header{reinterpret_cast<const uint8_t*>(buffer_.data()) + offset, 4};
    uint32_t len = 0;
    header.u32(len);
    if (len == 0 || len > kMaxFrameBytes) {
      return refuse(fmt::format("oversized or empty message ({} bytes; limit {})", len, kMaxFrameBytes));
    }
    if (buffer_.size() - offset - 4 < len) break;
    ok = handle_frame(reinterpret_cast<const uint8_t*>(buffer_.data()) + offset + 4, len, out, now);
    offset += 4 + size_t{len};
  }
  if (!ok) return false;
  buffer_.erase(0, offset);
  return true;
}

bool Session::all_present(const std::vector<std::string>& keys) const {
  for (const auto& k : keys) {
    if (table_.values.find(k) == table_.values.end()) return false;
  }
  return true;
}

bool Session::store(const std::string& key, Bytes value) {
  auto it = table_.values.find(key);
  const size_t old = it == table_.values.end() ? 0 : key.size() + it->second.size();
  const size_t now = table_.stored_bytes - old + key.size() + value.size();
  if (now > kMaxStoredBytes || (it == table_.values.end() && table_.values.size() >= kMaxKeys)) {
    return refuse(fmt::format("the store is full ({} keys, {} bytes)", table_.values.size(), table_.stored_bytes));
  }
  table_.stored_bytes = now;
  table_.values[key] = std::move(value);
  changed_ = true;
  return true;
}

bool Session::handle_frame(const uint8_t* p, size_t n, std::string& out, Clock::time_point now) {
  Reader in{p, n};
  uint8_t command = 0;
  in.take(&command, 1);
  std::string key;
  std::string body;
  bool parsed = false;
  switch (static_cast<Command>(command)) {
    case Command::kSet: {
      Bytes value;
      parsed = in.str(key) && in.bytes(value) && in.n == 0;
      if (!parsed) break;
      if (!store(key, std::move(value))) return false;
      reply(out, kOk);
      return true;
    }
    case Command::kGet: {
      parsed = in.str(key) && in.n == 0;
      if (!parsed) break;
      auto it = table_.values.find(key);
      body.push_back(it == table_.values.end() ? 0 : 1);
      put_bytes(body, it == table_.values.end() ? Bytes{} : it->second);
      reply(out, kOk, body);
      return true;
    }
    case Command::kAdd: {
      int64_t delta = 0;
      parsed = in.str(key) && in.i64(delta) && in.n == 0;
      if (!parsed) break;
      int64_t value = 0;
      if (auto it = table_.values.find(key); it != table_.values.end()) {
        auto current = parse_int(it->second);
        if (!current) {
          reply(out, kFailed, fmt::format("add: key '{}' does not hold an integer", key));
          return true;
        }
        value = *current;
      }
      if (__builtin_add_overflow(value, delta, &value)) {
        reply(out, kFailed, fmt::format("add: key '{}' would overflow", key));
        return true;
      }
      const std::string text = std::to_string(value);
      if (!store(key, Bytes(text.begin(), text.end()))) return false;
      put_i64(body, value);
      reply(out, kOk, body);
      return true;
    }
    case Command::kCompareSet: {
      Bytes expected, desired;
      parsed = in.str(key) && in.bytes(expected) && in.bytes(desired) && in.n == 0;
      if (!parsed) break;
      // c10d's semantics: a missing key is set only when `expected` is empty; either way the
      // reply is the value the caller should now believe is stored.
      auto it = table_.values.find(key);
      Bytes result;
      if ((it == table_.values.end() && expected.empty()) || (it != table_.values.end() && it->second == expected)) {
        if (!store(key, desired)) return false;
        result = desired;
      } else {
        result = it == table_.values.end() ? expected : it->second;
      }
      put_bytes(body, result);
      reply(out, kOk, body);
      return true;
    }
    case Command::kCheck: {
      std::vector<std::string> keys;
      parsed = in.list(keys) && in.n == 0;
      if (!parsed) break;
      body.push_back(all_present(keys) ? 1 : 0);
      reply(out, kOk, body);
      return true;
    }
    case Command::kWait: {
      std::vector<std::string> keys;
      int64_t timeout_ms = 0;
      parsed = in.list(keys) && in.i64(timeout_ms) && in.n == 0;
      if (!parsed) break;
      if (timeout_ms < 0 || timeout_ms > kMaxWaitMs) {
        reply(out, kFailed, fmt::format("wait: timeout {} ms is out of range", timeout_ms));
        return true;
      }
      if (all_present(keys)) {
        reply(out, kOk);
        return true;
      }
      wait_keys_ = std::move(keys);
      wait_deadline_ = now + std::chrono::milliseconds(timeout_ms);
      return true;
    }
    case Command::kDelete: {
      parsed = in.str(key) && in.n == 0;
      if (!parsed) break;
      auto it = table_.values.find(key);
      const bool existed = it != table_.values.end();
      if (existed) {
        table_.stored_bytes -= key.size() + it->second.size();
        table_.values.erase(it);
        changed_ = true;
      }
      body.push_back(existed ? 1 : 0);
      reply(out, kOk, body);
      return true;
    }
    case Command::kNumKeys: {
      parsed = in.n == 0;
      if (!parsed) break;
      put_i64(body, static_cast<int64_t>(table_.values.size()));
      reply(out, kOk, body);
      return true;
    }
  }
  if (command < static_cast<uint8_t>(Command::kSet) || command > static_cast<uint8_t>(Command::kNumKeys)) {
    return refuse(fmt::format("unknown request {}", command));
  }
  return refuse(fmt::format("malformed request {} ({} bytes)", command, n));
}

// ---- Server -------------------------------------------------------------------------------

struct Server::State {
  std::string where;
  std::string token;
  int listen_fd = -1;
  int wake_fd = -1;
  std::atomic<bool> stop{false};
  std::atomic<int> refused{0};
  Table table;
  struct Conn {
    std::string peer;
    std::unique_ptr<Session> session;
    std::string out;
    Clock::time_point accepted;
    bool closing = false;  // flush `out`, then close
  };
  std::map<int, Conn> conns;
};

Server::Server(const std::string& host, int port, std::string token) : state_(std::make_unique<State>()) {
  state_->where = fmt::format("{}:{}", host, port);
  state_->token = std::move(token);
  addrinfo* res = resolve(host, port, true);
  int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int rc = bind(fd, res->ai_addr, res->ai_addrlen);
  int err = errno;
  if (rc == 0) rc = listen(fd, 128), err = errno;
  freeaddrinfo(res);
  if (rc != 0) {
    close(fd);
    if (err == EADDRINUSE) {
      fail("rendezvous port {} on {} is already in use (MASTER_PORT); choose another with "
           "--master-port / params.master_port, or leave it unset on one node for a free port",
           port, host);
    }
    if (err == EADDRNOTAVAIL) {
      fail("MASTER_ADDR {} is not an address of this host, but rank 0 must host the rendezvous there", host);
    }
    fail("cannot listen on {}:{} for the rendezvous: {}", host, port, std::strerror(err));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  state_->where = fmt::format("{}:{}", host, port_);
  state_->listen_fd = fd;
  state_->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  thread_ = std::thread([this] { loop(); });
}

Server::~Server() {
  state_->stop = true;
  uint64_t one = 1;
  [[maybe_unused]] auto n = write(state_->wake_fd, &one, sizeof one);
  thread_.join();
  for (auto& [fd, conn] : state_->conns) close(fd);
  close(state_->listen_fd);
  close(state_->wake_fd);
}

int Server::refused() const { return state_->refused.load(); }

void Server::loop() {
  State& s = *state_;
  std::vector<uint8_t> chunk(64 * 1024);
  auto drop = [&](int fd, State::Conn& c) {
    if (!c.session->refusal().empty() || !c.session->authenticated()) {
      const std::string why = c.session->refusal().empty()
                                  ? (c.session->authenticated() ? "" : "closed before proving the token")
                                  : c.session->refusal();
      spdlog::warn("rendezvous {}: refused connection from {}: {}", s.where, c.peer, why);
      s.refused.fetch_add(1);
    }
    close(fd);
  };
  while (!s.stop) {
    const auto now = Clock::now();
    // Wake for the nearest wait deadline or handshake deadline.
    auto next = now + std::chrono::seconds(1);
    std::vector<pollfd> fds{{s.listen_fd, POLLIN, 0}, {s.wake_fd, POLLIN, 0}};
    for (auto& [fd, c] : s.conns) {
      short events = c.closing ? 0 : POLLIN;
      if (!c.out.empty()) events |= POLLOUT;
      fds.push_back({fd, events, 0});
      if (c.session->waiting()) next = std::min(next, c.session->wait_deadline());
      if (!c.session->authenticated()) next = std::min(next, c.accepted + kHandshakeTimeout);
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count();
    if (poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(ms, 0) + 1)) < 0 && errno != EINTR) {
      spdlog::error("rendezvous {}: poll failed: {}", s.where, std::strerror(errno));
      return;
    }
    if (s.stop) return;
    bool table_changed = false;
    std::vector<int> to_close;
    for (size_t i = 2; i < fds.size(); ++i) {
      const int fd = fds[i].fd;
      auto& c = s.conns.at(fd);
      if (fds[i].revents & POLLOUT) {
        ssize_t n = send(fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
        if (n > 0) c.out.erase(0, static_cast<size_t>(n));
        if (n < 0 && errno != EAGAIN && errno != EINTR) c.closing = true, c.out.clear();
      }
      if (c.closing) {
        if (c.out.empty()) to_close.push_back(fd);
        continue;
      }
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
        ssize_t n = recv(fd, chunk.data(), chunk.size(), 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
          to_close.push_back(fd);
          continue;
        }
        if (n > 0 && !c.session->feed(chunk.data(), static_cast<size_t>(n), c.out, Clock::now())) {
          c.closing = true;  // send the verdict, if any, then close
        }
        table_changed |= c.session->changed_table();
      }
    }
    // A change may end other connections' waits; deadlines may have passed.
    const auto after = Clock::now();
    for (auto& [fd, c] : s.conns) {
      if (c.closing) {
        if (c.out.empty()) to_close.push_back(fd);
        continue;
      }
      if (!c.session->authenticated() && after >= c.accepted + kHandshakeTimeout) {
        to_close.push_back(fd);
        continue;
      }
      if (c.session->waiting() && (table_changed || after >= c.session->wait_deadline())) {
        if (!c.session->progress(c.out, after)) c.closing = true;
      }
      if (c.closing && c.out.empty()) to_close.push_back(fd);
    }
    for (int fd : to_close) {
      auto it = s.conns.find(fd);
      if (it == s.conns.end()) continue;
      if (!it->second.session->authenticated() && it->second.session->refusal().empty() &&
          after >= it->second.accepted + kHandshakeTimeout) {
        spdlog::warn("rendezvous {}: refused connection from {}: no handshake within {} s", s.where,
                     it->second.peer, kHandshakeTimeout.count());
        s.refused.fetch_add(1);
        close(fd);
      } else {
        drop(fd, it->second);
      }
      s.conns.erase(it);
    }
    if (fds[0].revents & POLLIN) {
      for (;;) {
        sockaddr_storage peer{};
        socklen_t len = sizeof peer;
        int fd = accept4(s.listen_fd, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) break;
        if (s.conns.size() >= kMaxConnections) {
          spdlog::warn("rendezvous {}: refused connection from {}: too many connections ({})", s.where,
                       peer_name(peer), kMaxConnections);
          s.refused.fetch_add(1);
          close(fd);
          continue;
        }
        set_nodelay(fd);
        State::Conn c;
        c.peer = peer_name(peer);
        c.session = std::make_unique<Session>(s.table, s.token, random_bytes(kNonceBytes));
        c.out = c.session->greeting();
        c.accepted = Clock::now();
        s.conns.emplace(fd, std::move(c));
      }
    }
  }
}

// ---- Client -------------------------------------------------------------------------------

struct Client::Lock {
  std::mutex mutex;
};

namespace {

// Reads exactly n bytes; false on EOF or error. `deadline` bounds the handshake only.
bool read_exact(int fd, void* dst, size_t n, std::optional<Clock::time_point> deadline = std::nullopt) {
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    if (deadline) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - Clock::now()).count();
      pollfd pfd{fd, POLLIN, 0};
      if (ms <= 0 || poll(&pfd, 1, static_cast<int>(ms)) <= 0) return false;
    }
    ssize_t k = recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

}  // namespace

std::unique_ptr<Client> Client::connect(const std::string& host, int port, const std::string& token,
                                        Clock::time_point deadline) {
  addrinfo* res = resolve(host, port, false);
  int fd = -1;
  for (;;) {
    fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (::connect(fd, res->ai_addr, res->ai_addrlen) == 0) break;
    close(fd);
    fd = -1;
    if (Clock::now() >= deadline) break;
    // Rank 0 may not listen yet: retry quietly until the rendezvous deadline.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  freeaddrinfo(res);
  if (fd < 0) return nullptr;
  set_nodelay(fd);
  const std::string where = fmt::format("{}:{}", host, port);
  // The handshake gets at least a few seconds even when the connect took the whole budget.
  const auto handshake_deadline = std::max(deadline, Clock::now() + std::chrono::seconds(10));
  uint8_t greeting[kGreetingBytes];
  if (!read_exact(fd, greeting, sizeof greeting, handshake_deadline) ||
      std::memcmp(greeting, kMagic, sizeof kMagic) != 0) {
    close(fd);
    fail("the rendezvous at {} did not greet like a replica rank 0 (another program on that port?)", where);
  }
  std::string hello(kMagic, sizeof kMagic);
  const Bytes proof = proof_for(token, greeting + sizeof kMagic, kNonceBytes);
  hello.append(reinterpret_cast<const char*>(proof.data()), proof.size());
  char verdict = 0;
  if (!write_all(fd, hello.data(), hello.size()) || !read_exact(fd, &verdict, 1, handshake_deadline) ||
      verdict != 'A') {
    close(fd);
    fail("the rendezvous at {} refused this worker's token: REPLICA_TOKEN / --token must be the same "
         "for every worker of the job",
         where);
  }
  return std::unique_ptr<Client>(new Client(fd, host, port, token));
}

Client::Client(int fd, std::string host, int port, std::string token)
    : fd_(fd), host_(std::move(host)), port_(port), token_(std::move(token)), lock_(std::make_unique<Lock>()) {}

Client::~Client() { close(fd_); }

std::string Client::request(const std::string& payload, uint8_t* status) {
  std::lock_guard<std::mutex> guard(lock_->mutex);
  if (payload.size() > kMaxFrameBytes) {
    fail("rendezvous request of {} bytes exceeds the limit of {}", payload.size(), kMaxFrameBytes);
  }
  std::string frame;
  put_u32(frame, static_cast<uint32_t>(payload.size()));
  frame += payload;
  uint8_t header[4];
  if (!write_all(fd_, frame.data(), frame.size()) || !read_exact(fd_, header, 4)) {
    fail("lost the connection to the rendezvous at {}:{} (rank 0 gone?)", host_, port_);
  }
  Reader r{header, 4};
  uint32_t len = 0;
  r.u32(len);
  if (len == 0 || len > kMaxFrameBytes) fail("rendezvous at {}:{} sent a malformed reply", host_, port_);
  std::string body(len, '\0');
  if (!read_exact(fd_, body.data(), len)) {
    fail("lost the connection to the rendezvous at {}:{} (rank 0 gone?)", host_, port_);
  }
  *status = static_cast<uint8_t>(body[0]);
  if (*status == kFailed) fail("rendezvous at {}:{}: {}", host_, port_, body.substr(1));
  return body.substr(1);
}

namespace {
std::string command(Command c) { return std::string(1, static_cast<char>(c)); }
Reader reader_of(const std::string& s) { return Reader{reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }
[[noreturn]] void malformed(const Client& c) {
  fail("rendezvous at {}:{} sent a malformed reply", c.host(), c.port());
}
}  // namespace

void Client::set(const std::string& key, const Bytes& value) {
  std::string p = command(Command::kSet);
  put_str(p, key);
  put_bytes(p, value);
  uint8_t status = 0;
  request(p, &status);
}

std::optional<Bytes> Client::get(const std::string& key) {
  std::string p = command(Command::kGet);
  put_str(p, key);
  uint8_t status = 0;
  const std::string body = request(p, &status);
  Reader r = reader_of(body);
  uint8_t found = 0;
  Bytes value;
  if (!r.take(&found, 1) || !r.bytes(value)) malformed(*this);
  if (!found) return std::nullopt;
  return value;
}

int64_t Client::add(const std::string& key, int64_t delta) {
  std::string p = command(Command::kAdd);
  put_str(p, key);
  put_i64(p, delta);
  uint8_t status = 0;
  const std::string body = request(p, &status);
  Reader r = reader_of(body);
  int64_t v = 0;
  if (!r.i64(v)) malformed(*this);
  return v;
}

Bytes Client::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  std::string p = command(Command::kCompareSet);
  put_str(p, key);
  put_bytes(p, expected);
  put_bytes(p, desired);
  uint8_t status = 0;
  const std::string body = request(p, &status);
  Reader r = reader_of(body);
  Bytes v;
  if (!r.bytes(v)) malformed(*this);
  return v;
}

bool Client::check(const std::vector<std::string>& keys) {
  std::string p = command(Command::kCheck);
  put_list(p, keys);
  uint8_t status = 0;
  const std::string body = request(p, &status);
  if (body.size() != 1) malformed(*this);
  return body[0] != 0;
}

bool Client::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::string p = command(Command::kWait);
  put_list(p, keys);
  put_i64(p, std::min<int64_t>(timeout.count(), kMaxWaitMs));
  uint8_t status = 0;
  request(p, &status);
  return status == kOk;
}

bool Client::remove(const std::string& key) {
  std::string p = command(Command::kDelete);
  put_str(p, key);
  uint8_t status = 0;
  const std::string body = request(p, &status);
  if (body.size() != 1) malformed(*this);
  return body[0] != 0;
}

int64_t Client::num_keys() {
  uint8_t status = 0;
  const std::string body = request(command(Command::kNumKeys), &status);
  Reader r = reader_of(body);
  int64_t v = 0;
  if (!r.i64(v)) malformed(*this);
  return v;
}

}  // namespace replica::distributed::rdzv
