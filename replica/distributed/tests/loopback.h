// Loopback rendezvous for tests that start their own process groups.
#pragma once

#include "replica/distributed/world.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace replica::testing {

// A loopback TCP port that was free a moment ago.

inline int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// Rank `rank` of a one-node world of `size` ranks meeting at 127.0.0.1:port.
inline distributed::WorldInfo loopback_world(int rank, int size, int port) {
  distributed::WorldInfo w;
  w.rank = rank;
  w.local_rank = rank;
  w.world_size = size;
  w.local_world_size = size;
  w.master_addr = "127.0.0.1";
  w.master_port = port;
  return w;
}

}  // namespace replica::testing
