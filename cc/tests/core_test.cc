// Single-process checks of the box core: reduction kernels (including the
// float16/bfloat16 rounding), the box lifecycle and the segment table, and the
// job-wide order of collectives across nodes (Decider), which silences
// across nodes count (Liveness), and the all-reduce across nodes (ring, or
// halving and doubling) over an in-memory point-to-point (NodesAllReduce,
// AllReduceQueue).
// Multi-process collectives are tested from Python (tests/test_core.py).
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cc/smb/box.h"
#include "cc/smb/communicator.h"
#include "cc/smb/dtype.h"
#include "cc/smb/link/decider.h"
#include "cc/smb/link/liveness.h"
#include "cc/smb/node_link.h"
#include "cc/smb/transport/nodes_allreduce.h"
#include "cc/tests/check.h"

namespace {

using smb_test::Check;

void TestSums() {
  const float a[] = {1.5f, -2.0f, 1e30f};
  const float b[] = {2.25f, 2.0f, 1e30f};
  float f[3];
  smb::SumInto(smb::DType::kFloat32, f, a, b, 3);
  Check(f[0] == 3.75f && f[1] == 0.0f && f[2] == 2e30f, "float32 sum");

  // float16: 1.0 (0x3c00) + 2^-11 (0x1000) is a tie, rounds to even: 1.0.
  const uint16_t h1[] = {0x3c00, 0x3c00, 0x7bff, 0x0001};
  const uint16_t h2[] = {0x1000, 0x3c00, 0x7bff, 0x0001};
  uint16_t h[4];
  smb::SumInto(smb::DType::kFloat16, h, h1, h2, 4);
  Check(h[0] == 0x3c00, "float16 tie to even");
  Check(h[1] == 0x4000, "float16 1+1=2");
  Check(h[2] == 0x7c00, "float16 overflow to inf");
  Check(h[3] == 0x0002, "float16 subnormals");

  // bfloat16: 1.0 (0x3f80) + 1.0 = 2.0 (0x4000).
  const uint16_t g1[] = {0x3f80, 0x7fc0};
  const uint16_t g2[] = {0x3f80, 0x3f80};
  uint16_t g[2];
  smb::SumInto(smb::DType::kBFloat16, g, g1, g2, 2);
  Check(g[0] == 0x4000, "bfloat16 1+1=2");
  Check((g[1] & 0x7f80) == 0x7f80 && (g[1] & 0x7f) != 0, "bfloat16 NaN stays NaN");

  const int32_t i1[] = {2147483647};
  const int32_t i2[] = {1};
  int32_t i[1];
  smb::SumInto(smb::DType::kInt32, i, i1, i2, 1);
  Check(i[0] == -2147483647 - 1, "int32 wraps");

  const int8_t c1[] = {127, -3};
  const int8_t c2[] = {1, 2};
  int8_t c[2];
  smb::SumInto(smb::DType::kInt8, c, c1, c2, 2);
  Check(c[0] == -128 && c[1] == -1, "int8 wraps");
  const uint16_t u1[] = {65535};
  const uint16_t u2[] = {2};
  uint16_t u[1];
  smb::SumInto(smb::DType::kUInt16, u, u1, u2, 1);
  Check(u[0] == 1, "uint16 wraps");
}

// y += a*x for bfloat16 rounds once: 1 + (2^-8 + 2^-16) is above the tie
// between 1 and 1 + 2^-7, so it rounds up; rounding a*x to bfloat16 first
// (2^-8, a tie) and then the sum would give 1.0.
void TestAxpyRoundsOnce() {
  uint16_t y[] = {0x3f80};        // 1.0
  const uint16_t x[] = {0x3f80};  // 1.0
  smb::AxpyHalfLike(smb::DType::kBFloat16, y, 0.00392150878906250, x, 1);
  Check(y[0] == 0x3f81, "bfloat16 axpy rounds once");
  // float16: 1 + (2^-11 + 2^-21) rounds up to 1 + 2^-10 (0x3c01).
  uint16_t h[] = {0x3c00};
  const uint16_t one[] = {0x3c00};
  smb::AxpyHalfLike(smb::DType::kFloat16, h, 0.00048875808715820312, one, 1);
  Check(h[0] == 0x3c01, "float16 axpy rounds once");
  // Momentum in bfloat16: v = 0.5*0 - 1*(-1) = 1; w = 1 + 1 = 2.
  uint16_t w[] = {0x3f80}, v[] = {0x0000};
  const uint16_t g[] = {0xbf80};  // -1.0
  smb::MomentumHalfLike(smb::DType::kBFloat16, w, v, 1.0, 0.5, g, 1);
  Check(v[0] == 0x3f80 && w[0] == 0x4000, "bfloat16 momentum step");
}

void TestBoxAndSegments() {
  smb::Box::Options o;
  o.job_id = "core-test-" + std::to_string(getpid());
  o.world = 2;
  o.heap_bytes = 1 << 20;
  std::unique_ptr<smb::Box> box;
  smb::Status s = smb::Box::Create(o, &box);
  Check(s.ok(), "create: " + s.ToString());
  if (!s.ok()) return;
  std::unique_ptr<smb::Box> again;
  Check(smb::Box::Create(o, &again).code() == smb::Code::kAlreadyExists,
        "second create of a live job fails");
  uint64_t key = 0;
  Check(box->CreateSegment("w", smb::DType::kFloat32, {2, 3}, &key).ok(), "segment");
  smb::Segment seg;
  Check(box->AttachSegment(key, smb::DType::kFloat32, {2, 3}, &seg).ok() &&
            seg.bytes == 24,
        "attach segment");
  Check(box->AttachSegment(key, smb::DType::kInt32, {2, 3}, &seg).code() ==
            smb::Code::kInvalidArgument,
        "attach with other dtype fails");
  Check(box->CreateSegment("big", smb::DType::kFloat64, {1 << 20}, &key).code() ==
            smb::Code::kResourceExhausted,
        "heap bound");
  Check(box->CreateSegment("huge", smb::DType::kFloat64, {int64_t{1} << 40, int64_t{1} << 30},
                           &key).code() == smb::Code::kInvalidArgument,
        "shape whose byte count overflows refused");
  Check(smb::Box::ValidateJobId("../etc").code() == smb::Code::kInvalidArgument,
        "job id with '/' refused");
}

void TestSingleWorkerCommunicator() {
  smb::Communicator::Options o;
  o.job_id = "unused";
  std::unique_ptr<smb::Communicator> comm;
  Check(smb::Communicator::Open(o, &comm).ok(), "open world 1");
  std::vector<double> in = {1, 2, 3}, out(3);
  Check(comm->AllReduceSum({{smb::DType::kFloat64, {3}, in.data(), out.data()}}).ok() &&
            out == in,
        "world-1 all-reduce copies");
  o.rank = 1;
  Check(smb::Communicator::Open(o, &comm).code() == smb::Code::kInvalidArgument,
        "rank out of range refused");
  // A process set's members: one job rank per rank of it, and only across nodes.
  o.rank = 0;
  o.world = 2;
  o.members = {0, 2};
  Check(smb::Communicator::Open(o, &comm).code() == smb::Code::kInvalidArgument,
        "members without across_nodes refused");
  o.across_nodes = true;
  o.members = {0, 2, 3};
  Check(smb::Communicator::Open(o, &comm).code() == smb::Code::kInvalidArgument,
        "members of another size than the world refused");
}

}  // namespace

// The keys decided, in order.
std::vector<uint64_t> Keys(const std::vector<smb::Decision>& decisions, uint64_t* number) {
  std::vector<uint64_t> keys;
  for (const smb::Decision& d : decisions) {
    keys.push_back(d.key);
    *number = d.number;
  }
  return keys;
}

void TestDecider() {
  using V = std::vector<uint64_t>;
  constexpr uint64_t kA = 1, kB = 2, kC = 3, kJoin = 9, kAny = smb::kAnyCollective;
  smb::Decider decider(2);
  uint64_t number = 0;
  // Node 0's order wins; a key is decided once both nodes offer it.
  Check(Keys(decider.Offer(0, {0, kA, kB}), &number).empty(), "decider: node 1 offered nothing");
  Check(Keys(decider.Offer(1, {0, kB, kA}), &number) == V{kA, kB} && number == 2,
        "decider: node 0's order, numbered 1, 2");
  // Offered again before every node took them: not decided twice.
  Check(Keys(decider.Offer(1, {0, kB, kA}), &number).empty(), "decider: no decision twice");
  // Once both nodes took both, the same key is a new collective.
  Check(Keys(decider.Offer(0, {2, kA}), &number).empty(), "decider: only node 0 offers A again");
  Check(Keys(decider.Offer(1, {2, kC, kA}), &number) == V{kA} && number == 3,
        "decider: A again, as decision 3");
  // Node 0 wholly joined: node 1's order, each key taken with "any".
  smb::Decider joined(2);
  Check(Keys(joined.Offer(0, {0, kAny}), &number).empty(), "decider: node 1 offered nothing yet");
  Check(Keys(joined.Offer(1, {0, kC, kB}), &number) == V{kC, kB}, "decider: node 1's order");
  // Every node joined: only the join, once every node offers it.
  smb::Decider all(2);
  Check(Keys(all.Offer(0, {0, kAny, kJoin}), &number).empty(), "decider: node 1 not joined yet");
  Check(Keys(all.Offer(1, {0, kAny}), &number).empty(), "decider: node 1 has not offered the join");
  Check(Keys(all.Offer(1, {0, kAny, kJoin}), &number) == V{kJoin}, "decider: the join");
}

void TestLiveness() {
  using V = std::vector<int>;
  // Rank 1 is on another node; lost after 1 s of silence.
  smb::Liveness quiet({false, true}, 1.0, 0.0);
  Check(quiet.Ticked(0.5, 1).judge && quiet.Silent(0.5).empty(), "liveness: heard at start");
  Check(quiet.Ticked(1.0, 2).judge && quiet.Silent(1.0) == V{1}, "liveness: 1 s silent");
  quiet.Left(1);
  Check(quiet.Silent(5.0).empty(), "liveness: a rank that left is not silent");
  // The process stopped 2.5 s between ticks: nobody could be heard meanwhile.
  smb::Liveness stopped({false, true}, 1.0, 0.0);
  stopped.Ticked(0.5, 1);
  Check(stopped.Ticked(3.0, 2).judge && stopped.Silent(3.0).empty(),
        "liveness: silence while this process was stopped is excused");
  // The link's thread sat in one transport call for 2.5 s: no judging meanwhile,
  // and the silence is excused once the call ends.
  smb::Liveness long_call({false, true}, 1.0, 0.0);
  for (double t = 0.5; t <= 2.0; t += 0.5) long_call.Ticked(t, 1);
  const smb::Liveness::Tick still = long_call.Ticked(2.75, 1);
  Check(!still.judge && !still.stuck, "liveness: no judging inside a long call");
  Check(long_call.Ticked(3.0, 2).judge && long_call.Silent(3.0).empty(),
        "liveness: the long call's silence is excused");
  // Inside one call for 3 x 1 s: stuck for good, and the silence counts.
  smb::Liveness stuck({false, true}, 1.0, 0.0);
  smb::Liveness::Tick tick{};
  for (double t = 0.5; t <= 3.5; t += 0.5) tick = stuck.Ticked(t, 1);
  Check(tick.stuck && tick.judge && stuck.Silent(3.5) == V{1}, "liveness: a stuck thread");
  stuck.MarkLost(1);
  Check(stuck.lost(1) && stuck.Silent(4.0).empty(), "liveness: a lost rank is judged once");
}

// Messages between the nodes of one process, in order per (to, from, tag).
struct Mailboxes {
  std::map<std::tuple<int, int, int>, std::deque<std::vector<char>>> queued;
};

struct MemoryTransfer : smb::Transfer {
  bool receive = false;
  int from = 0, tag = 0;
  void* out = nullptr;
  size_t bytes = 0;
};

class MemoryPointToPoint : public smb::PointToPoint {
 public:
  MemoryPointToPoint(Mailboxes* mail, int node, int nodes, int max_tag)
      : mail_(mail), node_(node), nodes_(nodes), max_tag_(max_tag) {}
  int node() const override { return node_; }
  int nodes() const override { return nodes_; }
  int max_tag() const override { return max_tag_; }
  smb::Status StartSendTo(int to, int tag, const void* data, size_t bytes,
                          std::unique_ptr<smb::Transfer>* out) override {
    const char* p = static_cast<const char*>(data);
    mail_->queued[{to, node_, tag}].emplace_back(p, p + bytes);
    *out = std::make_unique<MemoryTransfer>();
    return smb::Status::Ok();
  }
  smb::Status StartReceiveFrom(int from, int tag, void* data, size_t bytes,
                               std::unique_ptr<smb::Transfer>* out) override {
    auto t = std::make_unique<MemoryTransfer>();
    t->receive = true;
    t->from = from;
    t->tag = tag;
    t->out = data;
    t->bytes = bytes;
    *out = std::move(t);
    return smb::Status::Ok();
  }
  bool TestTransfer(smb::Transfer* transfer, smb::Status* error) override {
    auto* t = static_cast<MemoryTransfer*>(transfer);
    *error = smb::Status::Ok();
    if (!t->receive) return true;
    auto it = mail_->queued.find({node_, t->from, t->tag});
    if (it == mail_->queued.end()) return false;
    if (it->second.front().size() != t->bytes) {
      *error = smb::InvalidArgument("a message of " + std::to_string(it->second.front().size()) +
                                    " bytes, expected " + std::to_string(t->bytes));
    } else if (t->bytes > 0) {
      std::memcpy(t->out, it->second.front().data(), t->bytes);
    }
    it->second.pop_front();
    if (it->second.empty()) mail_->queued.erase(it);
    return true;
  }

 private:
  Mailboxes* mail_;
  const int node_, nodes_, max_tag_;
};

// `ops` all-reduces of `count` floats at once on `nodes` nodes, windowed by an
// AllReduceQueue each, moved on in turn: every node ends with the same bits,
// the sum of the nodes' values (in float, so close to the exact one), every
// message was received (nothing left in the mailboxes), in 2 log2 N steps
// for a power of two (up to kHalvingMaxBytes; 1 at 2 nodes), else 2 (N - 1).
void CheckAllReduces(int nodes, size_t count, int rings, int window, int max_tag) {
  const std::string what = "nodes all-reduce: " + std::to_string(nodes) + " nodes, " +
                           std::to_string(rings) + " x " + std::to_string(count) + " floats";
  Mailboxes mail;
  std::mt19937 random(static_cast<unsigned>(nodes * 1000 + count));
  std::uniform_real_distribution<float> value(-1, 1);
  std::vector<std::vector<double>> sum(rings, std::vector<double>(count, 0.0));
  std::vector<std::vector<std::vector<float>>> data(nodes);
  std::vector<std::unique_ptr<MemoryPointToPoint>> links;
  std::vector<std::unique_ptr<smb::AllReduceQueue>> queues;
  std::vector<std::vector<std::unique_ptr<smb::NodesAllReduce>>> ops(nodes);
  for (int n = 0; n < nodes; ++n) {
    links.push_back(std::make_unique<MemoryPointToPoint>(&mail, n, nodes, max_tag));
    queues.push_back(std::make_unique<smb::AllReduceQueue>(window));
    for (int r = 0; r < rings; ++r) {
      data[n].emplace_back(count);
      for (size_t i = 0; i < count; ++i) {
        data[n][r][i] = value(random);
        sum[r][i] += data[n][r][i];
      }
    }
  }
  for (int n = 0; n < nodes; ++n) {
    for (int r = 0; r < rings; ++r) {
      ops[n].push_back(std::make_unique<smb::NodesAllReduce>(
          links[n].get(), static_cast<uint64_t>(r), smb::DType::kFloat32, data[n][r].data(),
          count));
      queues[n]->Add(ops[n].back().get());
    }
  }
  std::vector<std::vector<bool>> done(nodes, std::vector<bool>(rings, false));
  int left = nodes * rings;
  for (int pass = 0; left > 0 && pass < 100000; ++pass) {
    // The nodes in a different order each pass, the latest first on odd passes.
    for (int k = 0; k < nodes; ++k) {
      const int n = (k + pass) % nodes;
      for (int j = 0; j < rings; ++j) {
        const int r = pass % 2 ? rings - 1 - j : j;
        smb::Status error;
        if (done[n][r] || !queues[n]->Progress(ops[n][r].get(), &error)) continue;
        Check(error.ok(), what + ": " + error.ToString());
        done[n][r] = true;
        --left;
      }
    }
  }
  Check(left == 0, what + ": " + std::to_string(left) + " all-reduces never finished");
  int log2 = 0;
  while ((1 << log2) < nodes) ++log2;
  const bool halving = (1 << log2) == nodes && count * sizeof(float) <= smb::kHalvingMaxBytes;
  const size_t steps = nodes < 2                                            ? 0
                       : nodes == 2 && count * sizeof(float) <= smb::kHalvingMaxBytes ? 1
                       : halving                                              ? 2 * log2
                                                                              : 2 * (nodes - 1);
  Check(ops[0][0]->steps() == steps, what + ": " + std::to_string(ops[0][0]->steps()) +
                                         " steps, expected " + std::to_string(steps));
  Check(mail.queued.empty(), what + ": messages left unreceived");
  for (int r = 0; r < rings; ++r) {
    double worst = 0;
    for (size_t i = 0; i < count; ++i) worst = std::max(worst, std::fabs(data[0][r][i] - sum[r][i]));
    Check(worst <= 1e-5 * nodes, what + ": off the sum by " + std::to_string(worst));
    for (int n = 1; n < nodes; ++n) {
      Check(std::memcmp(data[n][r].data(), data[0][r].data(), count * sizeof(float)) == 0,
            what + ": node " + std::to_string(n) + " got other bits than node 0");
    }
  }
}

void TestNodesAllReduce() {
  // Blocks of different sizes (count not a multiple of the nodes), empty
  // blocks (count < nodes), one node; both schedules (halving and doubling at
  // 2, 4, 8 nodes up to 2 MiB; the ring at 3, 5, 6 and above); concurrent all-reduces sharing tags
  // (max_tag small: their numbers wrap) and queued behind a window.
  for (int nodes : {1, 2, 3, 4, 5, 6, 8}) {
    for (size_t count : {size_t{1}, size_t{7}, size_t{1000}, size_t{65537}, size_t{600000}}) {
      CheckAllReduces(nodes, count, /*ops=*/3, /*window=*/2, /*max_tag=*/32767);
    }
  }
  CheckAllReduces(4, 1001, /*ops=*/9, /*window=*/4, /*max_tag=*/4 * 8);
  CheckAllReduces(3, 1001, /*ops=*/9, /*window=*/4, /*max_tag=*/4 * 6);
}

int main() {
  TestSums();
  TestAxpyRoundsOnce();
  TestBoxAndSegments();
  TestSingleWorkerCommunicator();
  TestDecider();
  TestLiveness();
  TestNodesAllReduce();
  return smb_test::Report("core_test");
}
