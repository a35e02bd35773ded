// The bar on a terminal (a pseudo-terminal from openpty) and plain lines on a pipe.
#include "replica/obs/progress.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <termios.h>
#include <unistd.h>

using namespace replica::obs;

namespace {

// Everything written so far to the other end of `fd` (non-blocking drain).
std::string drain(int fd) {
  std::string out;
  char buf[4096];
  while (true) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 0) <= 0 || !(p.revents & POLLIN)) break;
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

ProgressState state(int64_t step, int64_t total, double loss) {
  ProgressState s;
  s.step = step;
  s.total_steps = total;
  s.epoch = step / 10.0;
  s.loss = loss;
  s.samples_per_s = 1234;
  return s;
}

}  // namespace

TEST(ProgressLine, ShowsStepEpochLossRateAndEta) {
  const std::string line = render_progress_line(state(25, 100, 0.5), 75, 100);
  EXPECT_EQ(line.rfind(" 25% |", 0), 0u) << line;
  EXPECT_NE(line.find(" 25/100 "), std::string::npos) << line;
  EXPECT_NE(line.find("epoch 2.50"), std::string::npos) << line;
  EXPECT_NE(line.find("loss 0.5000"), std::string::npos) << line;
  EXPECT_NE(line.find("1234 samples/s"), std::string::npos) << line;
  EXPECT_NE(line.find("ETA 1:15"), std::string::npos) << line;
  EXPECT_EQ(line.size(), 99u);  // one column short of the terminal: no wrap
  // A quarter of the bar is filled.
  const size_t open = line.find('|'), close = line.find('|', open + 1);
  const std::string bar = line.substr(open + 1, close - open - 1);
  EXPECT_EQ(std::count(bar.begin(), bar.end(), '#'), static_cast<long>(bar.size() / 4));

  auto tokens = state(1, 2, std::nan(""));
  tokens.tokens_per_s = 5000;
  const std::string t = render_progress_line(tokens, -1, 80);
  EXPECT_NE(t.find("5000 tokens/s"), std::string::npos) << t;
  EXPECT_EQ(t.find("samples/s"), std::string::npos) << t;
  EXPECT_EQ(t.find("loss"), std::string::npos) << t;
  EXPECT_NE(t.find("ETA ?"), std::string::npos) << t;
  EXPECT_EQ(format_duration(3725), "1:02:05");
}

TEST(Progress, DrawsALiveBarOnATerminal) {
  int master = -1, slave = -1;
  winsize ws{};
  ws.ws_col = 120;
  ws.ws_row = 40;
  ASSERT_EQ(openpty(&master, &slave, nullptr, nullptr, &ws), 0);
  {
    Progress progress(slave);  // detects the terminal itself
    EXPECT_TRUE(progress.live());
    progress.update(state(1, 4, 1.5));
    progress.line("eval step 1: eval_loss 1.2");
    progress.update(state(4, 4, 0.25));  // the last step is always drawn
    progress.finish();
  }
  const std::string out = drain(master);
  // Redrawn in place: carriage returns and erase-line codes, the final state, 100 %.
  EXPECT_NE(out.find("\r"), std::string::npos);
  EXPECT_NE(out.find("\x1b[K"), std::string::npos);
  EXPECT_NE(out.find(" 1/4 "), std::string::npos) << out;
  EXPECT_NE(out.find("100% |"), std::string::npos) << out;
  EXPECT_NE(out.find(" 4/4 "), std::string::npos) << out;
  EXPECT_NE(out.find("loss 0.2500"), std::string::npos) << out;
  // The log line sits above the bar, which is drawn again after it.
  const size_t log = out.find("eval step 1: eval_loss 1.2");
  ASSERT_NE(log, std::string::npos) << out;
  EXPECT_NE(out.find(" 1/4 ", log), std::string::npos) << out;
  close(master);
  close(slave);
}

TEST(Progress, WritesPlainLinesToAPipe) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  {
    Progress progress(fds[1]);
    EXPECT_FALSE(progress.live());
    progress.update(state(1, 4, 1.5));
    progress.line("step 2/4 epoch 0.20 loss 1.0000");
    progress.update(state(4, 4, 0.25));
    progress.line("step 4/4 epoch 0.40 loss 0.2500");
    progress.finish();
  }
  close(fds[1]);
  const std::string out = drain(fds[0]);
  close(fds[0]);
  EXPECT_EQ(out.find('\r'), std::string::npos) << out;
  EXPECT_EQ(out.find('\x1b'), std::string::npos) << out;
  EXPECT_EQ(out.find('#'), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 2);
  EXPECT_NE(out.find("info] step 2/4 epoch 0.20 loss 1.0000\n"), std::string::npos) << out;
  EXPECT_NE(out.find("info] step 4/4 epoch 0.40 loss 0.2500\n"), std::string::npos) << out;
}
