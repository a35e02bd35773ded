// The rendezvous server's message parser (replica/distributed/store.h Session): bytes from the
// network before and after the HMAC handshake. Input byte 0: bit 0 set = send a valid proof
// first (so the command parser is reached); byte 1 = where to split the rest into two reads.
#include "fuzz_input.h"
#include "replica/core/error.h"
#include "replica/distributed/store.h"

#include <cstring>

using namespace replica::distributed::rdzv;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  static const Bytes nonce(kNonceBytes, 0x5a);
  static const std::string token = "fuzz-token";
  Table table;
  Session session(table, token, nonce);
  std::string out;
  const auto now = Clock::now();
  if (data[0] & 1) {
    std::string hello(kMagic, sizeof kMagic);
    const Bytes proof = proof_for(token, nonce.data(), nonce.size());
    hello.append(reinterpret_cast<const char*>(proof.data()), proof.size());
    if (!session.feed(reinterpret_cast<const uint8_t*>(hello.data()), hello.size(), out, now)) __builtin_trap();
  }
  const size_t split = std::min<size_t>(data[1], size - 2);
  const uint8_t* rest = data + 2;
  if (session.feed(rest, split, out, now) && session.feed(rest + split, size - 2 - split, out, now)) {
    // Every pending wait (one per frame at most) either completes or times out; each
    // one's timeout is at most 7 days from when it was parsed.
    auto later = now;
    for (size_t i = 0; i <= size && session.waiting(); ++i) {
      later += std::chrono::hours(24 * 8);
      if (!session.progress(out, later)) break;
    }
    if (session.waiting()) __builtin_trap();
  }
  return 0;
}
