// The core's collectives with ranks as threads of one process (ThreadGroup),
// so ThreadSanitizer and AddressSanitizer see every rank at once
// (tests/test_sanitizers.py builds and runs this under both):
// partitioned all-reduce (copied out and kept in result buffers, chunked),
// broadcast, barrier, agreement failures, the scheduler's agreed order with
// collectives submitted from several threads in a different order on every
// rank, failure that stops every rank, a rank that leaves, the step clock,
// Horovod's join (ranks that ran out of data add zeros), a node's async
// pushes combined in its box (NodeCombiner, with its pushing thread). The
// collectives run again with the ranks spread over 2 and 3 nodes, each node's
// box a ThreadGroup and the nodes joined by the link over a ThreadNetwork.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <future>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cc/smb/algorithms/replica_sum.h"
#include "cc/smb/communicator.h"
#include "cc/smb/link/transport_link.h"
#include "cc/smb/param_server.h"
#include "cc/smb/process.h"
#include "cc/smb/scheduler.h"
#include "cc/smb/segment/node_combiner.h"
#include "cc/smb/transport/shm_peers.h"
#include "cc/smb/transport/thread_peers.h"
#include "cc/smb/transport/thread_transport.h"
#include "cc/tests/check.h"

namespace {

using smb_test::Check;

// The nodes the ranks of RunRanks are spread over (main runs the tests with 1,
// 2 and 3), evenly, or in these sizes when given (nodes of different sizes).
int nodes = 1;
std::vector<int> sizes;

// Runs body(rank, comm) on `world` threads, each with its own Communicator.
// Across nodes, each node's ranks meet in a ThreadGroup (the node's box) and
// the nodes are joined by the link between nodes over a ThreadNetwork.
void RunRanks(int world, size_t staging, double timeout_s,
              const std::function<void(int, std::shared_ptr<smb::Communicator>)>& body) {
  std::vector<int> per_node = sizes.empty() ? std::vector<int>(nodes, world / nodes) : sizes;
  Check(std::accumulate(per_node.begin(), per_node.end(), 0) == world,
        "a world of " + std::to_string(world) + " over " + std::to_string(per_node.size()) +
            " nodes");
  std::vector<std::unique_ptr<smb::ThreadGroup>> boxes;
  for (int n : per_node) {
    boxes.push_back(std::make_unique<smb::ThreadGroup>(n, staging, size_t{16} << 20));
  }
  smb::ThreadNetwork network(per_node);
  const bool linked = per_node.size() > 1;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::shared_ptr<smb::NodeLink> link;
      if (linked) {
        smb::LinkOptions options;
        options.rank = r;
        options.world = world;
        options.timeout_s = timeout_s;
        smb::Status s = smb::StartTransportLink(network.Connect(r), options, &link);
        Check(s.ok(), "rank " + std::to_string(r) + " starting the link: " + s.ToString());
        if (!s.ok()) return;
      }
      body(r, smb::Communicator::Create(
                  boxes[network.node_of(r)]->Join(network.local_of(r)), timeout_s, link));
      if (link) link->Stop();  // before the network goes
    });
  }
  for (std::thread& t : threads) t.join();
}

std::string Where(const std::string& what, int world, int rank) {
  return what + " (world " + std::to_string(world) + ", rank " + std::to_string(rank) + ")";
}

void TestAllReduceAndBroadcast(int world) {
  // 256-byte staging: every tensor goes through in many chunks.
  RunRanks(world, 256, 30, [world](int rank, std::shared_ptr<smb::Communicator> comm) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}}) {
      std::vector<float> f(n), fout(n);
      std::vector<int64_t> i(n + 3), iout(n + 3);
      for (size_t k = 0; k < n; ++k) f[k] = static_cast<float>(k + rank);
      for (size_t k = 0; k < n + 3; ++k) i[k] = static_cast<int64_t>(k * (rank + 1));
      smb::Status s = comm->AllReduceSum(
          {{smb::DType::kFloat32, {static_cast<int64_t>(n)}, f.data(), fout.data()},
           {smb::DType::kInt64, {static_cast<int64_t>(n + 3)}, i.data(), iout.data()}});
      Check(s.ok(), Where("all-reduce: " + s.ToString(), world, rank));
      bool exact = true;
      for (size_t k = 0; k < n; ++k) {
        exact &= fout[k] == static_cast<float>(world * k + world * (world - 1) / 2);
      }
      for (size_t k = 0; k < n + 3; ++k) {
        exact &= iout[k] == static_cast<int64_t>(k * world * (world + 1) / 2);
      }
      Check(exact, Where("all-reduce sums of " + std::to_string(n), world, rank));
    }
    for (int root = 0; root < world; ++root) {
      std::vector<double> d(300, rank + 0.5), dout(300);
      smb::Status s = comm->Broadcast(root, {{smb::DType::kFloat64, {300}, d.data(), dout.data()}});
      Check(s.ok() && std::all_of(dout.begin(), dout.end(),
                                  [root](double v) { return v == root + 0.5; }),
            Where("broadcast from " + std::to_string(root), world, rank));
    }
    Check(comm->Barrier().ok(), Where("barrier", world, rank));
  });
}

// An adapter whose one output is a given buffer.
class VectorOutput : public smb::OpContext {
 public:
  explicit VectorOutput(float* out) : out_(out) {}
  smb::Status AllocateOutputs(std::vector<smb::TensorRef>* tensors) override {
    (*tensors)[0].out = out_;
    return smb::Status::Ok();
  }

 private:
  float* out_;
};

void TestSharedResults(int world) {
  // Sums kept in result buffers: every rank reads the same memory; holds
  // keep a buffer from reuse, so 9 held sums need 9 > 8 buffers: the 9th is
  // copied out.
  RunRanks(world, 4096, 30, [world](int rank, std::shared_ptr<smb::Communicator> comm) {
    const size_t n = smb::kSharedResultMinBytes / sizeof(float);
    std::vector<float> in(n, static_cast<float>(rank + 1));
    std::vector<std::vector<float>> outs(9, std::vector<float>(n));
    std::vector<std::shared_ptr<smb::ResultHold>> holds;
    std::vector<const float*> sums;
    for (int k = 0; k < 9; ++k) {
      std::vector<void*> where;
      std::shared_ptr<smb::ResultHold> hold;
      VectorOutput output(outs[k].data());
      smb::Status s = comm->AllReduceSumShared(
          {{smb::DType::kFloat32, {static_cast<int64_t>(n)}, in.data(), nullptr}}, &output,
          &where, &hold);
      Check(s.ok(), Where("shared all-reduce: " + s.ToString(), world, rank));
      Check((hold != nullptr) == (k < 8), Where("result buffer " + std::to_string(k), world, rank));
      sums.push_back(hold ? static_cast<const float*>(where[0]) : outs[k].data());
      holds.push_back(hold);
    }
    Check(comm->Barrier().ok(), Where("barrier", world, rank));
    const float total = static_cast<float>(world * (world + 1) / 2);
    for (const float* sum : sums) {
      Check(std::all_of(sum, sum + n, [total](float v) { return v == total; }),
            Where("held sums intact", world, rank));
    }
    holds.clear();
    Check(comm->Barrier().ok(), Where("barrier after release", world, rank));
  });
}

void TestDisagreementStopsEveryRank(int world) {
  RunRanks(world, 1024, 30, [world](int rank, std::shared_ptr<smb::Communicator> comm) {
    std::vector<float> a(3 + (rank == world - 1)), out(a.size());
    smb::Status s = comm->AllReduceSum(
        {{smb::DType::kFloat32, {static_cast<int64_t>(a.size())}, a.data(), out.data()}});
    Check(s.code() == smb::Code::kInvalidArgument &&
              s.message().find("ranks disagree") != std::string::npos,
          Where("disagreement: " + s.ToString(), world, rank));
  });
}

// A collective with an agreement (Horovod's semantics): the last rank calls it
// with another shape, so every rank fails it alike with kFailedPrecondition
// naming the field and each rank's value, through the scheduler, which does
// not stop the job: the next all-reduce, broadcast and barrier work.
void TestRecoverableDisagreement(int world) {
  RunRanks(world, 1024, 30, [world](int rank, std::shared_ptr<smb::Communicator> comm) {
    auto scheduler = smb::CollectiveScheduler::Start(comm);
    auto run = [&](const std::string& key, const std::string& agreement,
                   std::function<smb::Status(smb::Communicator*)> collective) {
      std::promise<smb::Status> done;
      auto result = done.get_future();
      scheduler->Submit(key, key,
                        [&](smb::Communicator* c) {
                          c->group().SetNextAgreement(agreement);
                          return collective(c);
                        },
                        [&](const smb::Status& s) { done.set_value(s); });
      return result.get();
    };
    const bool odd = rank == world - 1;
    std::vector<float> a(odd ? 4 : 3, 1.0f), out(a.size(), -1.0f);
    smb::Status s = run("mixed", std::string("hvd.allreduce\nshape=[") + (odd ? "4" : "3") + "]",
                        [&](smb::Communicator* c) {
                          return c->AllReduceSum({{smb::DType::kFloat32,
                                                   {static_cast<int64_t>(a.size())}, a.data(),
                                                   out.data()}});
                        });
    // Across nodes, the node whose ranks disagree names them; where the odd
    // rank is alone on its node, the nodes disagree, and each is named with
    // its node.
    const bool by_node = nodes > 1 && (world == nodes || (!sizes.empty() && sizes.back() == 1));
    const std::string first = by_node      ? "rank 0 (node 0): [3], "
                              : nodes == 1 ? "rank 0: [3], "
                                           : "rank " + std::to_string(world - 2) + ": [3], ";
    const std::string last = "rank " + std::to_string(world - 1) +
                             (by_node ? " (node " + std::to_string(nodes - 1) + ")" : "") +
                             ": [4])";
    Check(s.code() == smb::Code::kFailedPrecondition &&
              s.message().find("hvd.allreduce: the ranks disagree on the shape (" + first) == 0 &&
              s.message().find(last) != std::string::npos,
          Where("recoverable disagreement: " + s.ToString(), world, rank));
    Check(out[0] == -1.0f, Where("nothing written on a disagreement", world, rank));
    std::vector<float> b(5, static_cast<float>(rank + 1)), sum(5);
    s = run("after", "hvd.allreduce\nshape=[5]", [&](smb::Communicator* c) {
      return c->AllReduceSum({{smb::DType::kFloat32, {5}, b.data(), sum.data()}});
    });
    Check(s.ok() && sum[4] == static_cast<float>(world * (world + 1) / 2),
          Where("all-reduce after a disagreement: " + s.ToString(), world, rank));
    std::vector<int32_t> value(2, rank), got(2, -1);
    s = run("root", "hvd.broadcast\nroot rank=" + std::to_string(odd ? 1 : 0),
            [&](smb::Communicator* c) {
              return c->Broadcast(0, {{smb::DType::kInt32, {2}, value.data(), got.data()}});
            });
    Check(s.code() == smb::Code::kFailedPrecondition &&
              s.message().find("disagree on the root rank") != std::string::npos,
          Where("broadcast disagreement: " + s.ToString(), world, rank));
    s = run("barrier", "hvd.barrier\n", [](smb::Communicator* c) { return c->Barrier(); });
    Check(s.ok(), Where("barrier after disagreements: " + s.ToString(), world, rank));
    s = run("broadcast", "hvd.broadcast\nroot rank=0", [&](smb::Communicator* c) {
      return c->Broadcast(0, {{smb::DType::kInt32, {2}, value.data(), got.data()}});
    });
    Check(s.ok() && got[0] == 0 && got[1] == 0,
          Where("broadcast after disagreements: " + s.ToString(), world, rank));
  });
}

// Every rank submits the same keyed collectives from 3 threads of its own, in
// an order shuffled differently on each rank: the scheduler pairs them by key.
void TestSchedulerAgreesOrder(int world) {
  RunRanks(world, 512, 30, [world](int rank, std::shared_ptr<smb::Communicator> comm) {
    auto scheduler = smb::CollectiveScheduler::Start(comm);
    constexpr int kKeys = 24;
    std::vector<int> order(kKeys);
    for (int k = 0; k < kKeys; ++k) order[k] = k;
    std::mt19937 rng(1234 + rank);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::vector<float>> ins(kKeys), outs(kKeys);
    std::vector<std::promise<smb::Status>> done(kKeys);
    std::vector<std::future<smb::Status>> results;
    for (auto& p : done) results.push_back(p.get_future());
    std::vector<std::thread> submitters;
    for (int t = 0; t < 3; ++t) {
      submitters.emplace_back([&, t] {
        for (int j = t; j < kKeys; j += 3) {
          const int k = order[j];
          ins[k].assign(100, static_cast<float>(k * 10 + rank));
          outs[k].assign(100, 0.0f);
          scheduler->Submit(
              "key" + std::to_string(k), "allreduce",
              [&ins, &outs, k](smb::Communicator* c) {
                return c->AllReduceSum(
                    {{smb::DType::kFloat32, {100}, ins[k].data(), outs[k].data()}});
              },
              [&done, k](const smb::Status& s) { done[k].set_value(s); });
        }
      });
    }
    for (std::thread& t : submitters) t.join();
    for (int k = 0; k < kKeys; ++k) {
      smb::Status s = results[k].get();
      const float want = static_cast<float>(world * k * 10 + world * (world - 1) / 2);
      Check(s.ok() && std::all_of(outs[k].begin(), outs[k].end(),
                                  [want](float v) { return v == want; }),
            Where("scheduled key" + std::to_string(k) + ": " + s.ToString(), world, rank));
    }
    // After a failure every later submission fails at once with it.
    std::vector<float> bad(2 + rank), bad_out(bad.size());
    std::promise<smb::Status> failed, later;
    scheduler->Submit(
        "bad", "allreduce",
        [&](smb::Communicator* c) {
          return c->AllReduceSum(
              {{smb::DType::kFloat32, {static_cast<int64_t>(bad.size())}, bad.data(),
                bad_out.data()}});
        },
        [&failed](const smb::Status& s) { failed.set_value(s); });
    const smb::Status first = failed.get_future().get();
    scheduler->Submit(
        "after", "barrier", [](smb::Communicator* c) { return c->Barrier(); },
        [&later](const smb::Status& s) { later.set_value(s); });
    const smb::Status second = later.get_future().get();
    Check(first.code() == smb::Code::kInvalidArgument,
          Where("first failure: " + first.ToString(), world, rank));
    Check(second.code() == smb::Code::kInvalidArgument &&
              second.message().find("ranks disagree") != std::string::npos,
          Where("later call fails fast with the first error: " + second.ToString(), world, rank));
  });
}

// Horovod's join: rank r runs r + 1 all-reduces (small and chunked, and one
// large enough for a shared result buffer), then joins (the last rank first
// broadcasts and passes a barrier); the ranks that joined (rank 0 first, which then
// picks the next collective from the others' keys) add zeros. Every rank
// learns that the last rank joined last, and counts its calls afresh after.
void TestJoin(int world) {
  RunRanks(world, 512, 30, [world](int rank, std::shared_ptr<smb::Communicator> comm) {
    auto scheduler = smb::CollectiveScheduler::Start(comm);
    auto run = [&](const std::string& key, smb::CollectiveScheduler::Run body) {
      std::promise<smb::Status> done;
      scheduler->Submit(key, key, std::move(body),
                        [&done](const smb::Status& s) { done.set_value(s); });
      return done.get_future().get();
    };
    for (int step = 0; step <= rank; ++step) {
      for (const int64_t n : {int64_t{3}, int64_t{300}, int64_t{70000}}) {
        // As the TF kernels do (a joined rank serves all-reduces this way).
        std::vector<float> in(n, static_cast<float>(rank + 1)), out(n, -1.0f);
        const smb::Status s = run("step", [&](smb::Communicator* c) {
          VectorOutput output(out.data());
          std::vector<void*> sums;
          std::shared_ptr<smb::ResultHold> hold;
          SMB_RETURN_IF_ERROR(c->AllReduceSumShared(
              {{smb::DType::kFloat32, {n}, in.data(), nullptr}}, &output, &sums, &hold));
          if (hold != nullptr) std::copy_n(static_cast<const float*>(sums[0]), n, out.data());
          return smb::Status::Ok();
        });
        // Ranks step..world-1 still train: the sum of their rank + 1.
        const float want = static_cast<float>((world * (world + 1) - step * (step + 1)) / 2);
        Check(s.ok() && std::all_of(out.begin(), out.end(), [want](float v) { return v == want; }),
              Where("join: step " + std::to_string(step) + " of " + std::to_string(n) + ": " +
                        s.ToString(), world, rank));
      }
      // A model's worth of gradients in one collective (ResNet-50 has 161):
      // a joined rank reads all their shapes from the description (across
      // nodes, a wholly joined node gets it whole from a training node).
      constexpr int kTensors = 400;
      std::vector<std::vector<float>> ins, outs;
      std::vector<smb::TensorRef> refs;
      for (int i = 0; i < kTensors; ++i) {
        const int64_t rows = 1 + i % 7;
        ins.emplace_back(rows * 3, static_cast<float>(rank + 1));
        outs.emplace_back(rows * 3, -1.0f);
      }
      for (int i = 0; i < kTensors; ++i) {
        refs.push_back({smb::DType::kFloat32, {1 + i % 7, 3}, ins[i].data(), outs[i].data()});
      }
      const smb::Status many = run("many", [&](smb::Communicator* c) {
        return c->AllReduceSum(refs);
      });
      const float want = static_cast<float>((world * (world + 1) - step * (step + 1)) / 2);
      bool right = many.ok();
      for (const auto& o : outs) {
        right = right && std::all_of(o.begin(), o.end(), [want](float v) { return v == want; });
      }
      Check(right, Where("join: step " + std::to_string(step) + ", " +
                             std::to_string(kTensors) + " tensors: " + many.ToString(),
                         world, rank));
    }
    if (rank == world - 1) {  // the others have joined (or are about to)
      std::vector<int32_t> value = {42};
      const smb::Status sent = run("bcast", [&](smb::Communicator* c) {
        return c->Broadcast(rank, {{smb::DType::kInt32, {1}, value.data(), value.data()}});
      });
      const smb::Status passed = run("barrier", [](smb::Communicator* c) { return c->Barrier(); });
      Check(sent.ok() && value[0] == 42 && passed.ok(),
            Where("join: broadcast and barrier among joined ranks: " + sent.ToString() + " " +
                      passed.ToString(), world, rank));
    }
    std::promise<smb::Status> joined;
    int last = -1;
    scheduler->SubmitJoin([&last](smb::Communicator* c) { return c->FinishJoin(&last); },
                          [&joined](const smb::Status& s) { joined.set_value(s); });
    const smb::Status s = joined.get_future().get();
    Check(s.ok() && last == world - 1,
          Where("join: last rank " + std::to_string(last) + ": " + s.ToString(), world, rank));
    std::vector<float> in(5, 1.0f), out(5, 0.0f);
    const smb::Status after = run("step", [&](smb::Communicator* c) {
      return c->AllReduceSum({{smb::DType::kFloat32, {5}, in.data(), out.data()}});
    });
    Check(after.ok() && out[0] == static_cast<float>(world),
          Where("join: the same key after the join: " + after.ToString(), world, rank));
    // Zeros would corrupt a minimum: a joined rank refuses, and the job stops.
    smb::Status refused;
    if (rank == world - 1) {
      refused = run("min", [&](smb::Communicator* c) {
        c->group().SetNextAgreement("hvd.allreduce\ncollective=allreduce;reduce op=Min");
        return c->AllReduceSum({{smb::DType::kFloat32, {5}, in.data(), out.data()}});
      });
    } else {
      std::promise<smb::Status> again;
      scheduler->SubmitJoin([&last](smb::Communicator* c) { return c->FinishJoin(&last); },
                            [&again](const smb::Status& s) { again.set_value(s); });
      refused = again.get_future().get();
    }
    Check(refused.code() == smb::Code::kInvalidArgument &&
              refused.message().find("cannot take part in an all-reduce with op Min") !=
                  std::string::npos,
          Where("join: a minimum refused: " + refused.ToString(), world, rank));
  });
}

void TestGoneRankFailsTheOthers() {
  // Rank 1 leaves the group without calling the barrier: rank 0 fails at
  // once naming it, not after the 30 s timeout.
  smb::ThreadGroup group(2, 1024);
  std::thread leaver([&group] { group.Join(1); });
  leaver.join();
  std::unique_ptr<smb::Communicator> comm = smb::Communicator::Create(group.Join(0), 30);
  smb::Status s = comm->Barrier();
  Check(s.code() == smb::Code::kAborted && s.message().find("rank 1") != std::string::npos,
        "gone rank named: " + s.ToString());
}

void TestStepClock() {
  // Staleness 1: rank 0 never gets more than 1 step ahead of rank 1. Rank 0
  // ticks in two halves as the TF op does (waiting only when Within says so).
  std::atomic<int64_t> max_lead{0};
  std::atomic<int> waits{0};
  RunRanks(2, 1024, 30, [&](int rank, std::shared_ptr<smb::Communicator> comm) {
    // The TF layer may change the timeout while another thread waits.
    std::thread retimer([comm] {
      for (int k = 0; k < 100; ++k) comm->set_timeout(30.0 + k);
    });
    for (int step = 0; step < 50; ++step) {
      int64_t lead = 0;
      if (rank == 0) {
        smb::StepClock& clock = comm->clock();
        const uint64_t mine = clock.Advance();
        if (!clock.Within(mine, 1, &lead)) {
          ++waits;
          Check(clock.WaitWithin(mine, 1, &lead).ok(), "clock wait");
        }
      } else {
        Check(comm->clock().Tick(1, &lead).ok(), "clock tick");
      }
      if (rank == 0) {
        int64_t seen = max_lead.load();
        while (lead > seen && !max_lead.compare_exchange_weak(seen, lead)) {
        }
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    retimer.join();
    comm->clock().Finish();
    Check(comm->clock().WaitAllFinished().ok(), "wait all finished");
  });
  Check(max_lead.load() <= 1, "staleness bound held: lead " + std::to_string(max_lead.load()));
  Check(waits.load() > 0, "rank 0, never slowed, had to wait");
}

void TestWaitAllFinishedWaitsForTheSameRound() {
  // Two rounds of training (two fits). Rank 1 starts its second round late:
  // still finished from the first, it must not count as finished for rank
  // 0's second round. Rank 1's second round starts with a step, as a custom
  // loop's would (no Resume).
  std::atomic<bool> second_done{false};
  RunRanks(2, 1024, 30, [&](int rank, std::shared_ptr<smb::Communicator> comm) {
    smb::StepClock& clock = comm->clock();
    int64_t lead = 0;
    Check(clock.Tick(-1, &lead).ok(), "first round's step");
    clock.Finish();
    Check(clock.WaitAllFinished().ok(), "first round's wait");
    if (rank == 0) {
      clock.Resume();
      clock.Finish();
      Check(clock.WaitAllFinished().ok(), "second round's wait");
      Check(second_done.load(), "rank 0's second round waited for rank 1's");
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      Check(clock.Tick(-1, &lead).ok(), "second round's step");
      second_done.store(true);
      clock.Finish();
      clock.Finish();  // idempotent: still the second round
      Check(clock.WaitAllFinished().ok(), "second round's wait");
    }
  });
}

// The replicas of one process summed in place by parts on threads: every
// element of every tensor (sizes that do not split evenly included) is the
// exact sum, for float32 and int64, with 1 to 4 replicas and parts.
void TestReplicaSum() {
  for (int replicas = 1; replicas <= 4; ++replicas) {
    for (int parts = 1; parts <= 4; ++parts) {
      const std::vector<size_t> sizes = {1, 0, 37, 1000, 4099};
      std::vector<std::vector<std::vector<float>>> floats(sizes.size());
      std::vector<std::vector<int64_t>> ints(replicas, std::vector<int64_t>(777));
      std::vector<std::vector<float>> float_out(sizes.size());
      std::vector<int64_t> int_out(777, -1);
      std::vector<smb::ReplicaSumTensor> tensors;
      for (size_t i = 0; i < sizes.size(); ++i) {
        floats[i].resize(replicas);
        smb::ReplicaSumTensor t{smb::DType::kFloat32, sizes[i], {}, nullptr};
        for (int r = 0; r < replicas; ++r) {
          floats[i][r].resize(sizes[i]);
          for (size_t k = 0; k < sizes[i]; ++k) floats[i][r][k] = float(k % 97) + float(r) * 0.5f;
          t.replicas.push_back(floats[i][r].data());
        }
        float_out[i].assign(sizes[i], -1.0f);
        t.out = float_out[i].data();
        tensors.push_back(t);
      }
      smb::ReplicaSumTensor t{smb::DType::kInt64, 777, {}, int_out.data()};
      for (int r = 0; r < replicas; ++r) {
        for (size_t k = 0; k < 777; ++k) ints[r][k] = int64_t{1} << 40 | int64_t(k * (r + 1));
        t.replicas.push_back(ints[r].data());
      }
      tensors.push_back(t);
      std::atomic<int> ran{0};
      smb::Status s = smb::ReplicaSum(tensors, parts, [&](int used, const std::function<void(int)>& part) {
        ran = used;
        smb::RunPartsOnThreads(used, part);
      });
      const std::string where = std::to_string(replicas) + " replicas, " + std::to_string(parts) + " parts";
      Check(s.ok(), "replica sum ok: " + where);
      Check(ran.load() >= 1 && ran.load() <= parts, "replica sum used 1.." + std::to_string(parts) + " parts: " + where);
      bool exact = true;
      for (size_t i = 0; i < sizes.size(); ++i) {
        for (size_t k = 0; k < sizes[i]; ++k) {
          float want = 0;
          for (int r = 0; r < replicas; ++r) want += floats[i][r][k];
          exact = exact && float_out[i][k] == want;
        }
      }
      for (size_t k = 0; k < 777; ++k) {
        int64_t want = 0;
        for (int r = 0; r < replicas; ++r) want += ints[r][k];
        exact = exact && int_out[k] == want;
      }
      Check(exact, "replica sum exact: " + where);
    }
  }
  smb::ReplicaSumTensor none{smb::DType::kFloat32, 4, {}, nullptr};
  Check(smb::ReplicaSum({none}, 2, smb::RunPartsOnThreads).code() == smb::Code::kInvalidArgument,
        "replica sum without replicas: InvalidArgument");
}

// Three replica threads hand the server 2,000 "+1" updates each while
// another thread reads: none is lost, each update sees the one before it
// applied, the first failure is reported, and the destructor applies what
// is still queued.
void TestParamServer() {
  int64_t w = 0;  // touched only by the server thread while it runs
  {
    smb::ParamServer server;
    std::vector<std::thread> replicas;
    for (int r = 0; r < 3; ++r) {
      replicas.emplace_back([&] {
        for (int i = 0; i < 2000; ++i) {
          server.Submit([&w] { ++w; return smb::Status::Ok(); });
        }
      });
    }
    for (auto& t : replicas) t.join();
    Check(server.WaitPending(0, 60).ok(), "param server drained");
    Check(w == 6000, "param server applied 6000 updates, w = " + std::to_string(w));
    Check(server.applied() == 6000, "param server counted 6000");
    server.Submit([] { return smb::Status(smb::Code::kInvalidArgument, "bad update"); });
    smb::Status s = server.WaitPending(0, 60);
    Check(s.code() == smb::Code::kInvalidArgument && s.message() == "bad update",
          "param server reports a failed update: " + s.ToString());
    std::atomic<bool> release{false};
    server.Submit([&release] {
      while (!release.load()) std::this_thread::yield();
      return smb::Status::Ok();
    });
    Check(server.WaitPending(0, 0.05).code() == smb::Code::kDeadlineExceeded,
          "param server wait times out while an update runs");
    release = true;
    for (int i = 0; i < 100; ++i) server.Submit([&w] { ++w; return smb::Status::Ok(); });
  }
  Check(w == 6100, "param server applied what was queued at destruction, w = " + std::to_string(w));
}

}  // namespace

// Two local ranks (threads here, processes in a job) add +1 to a segment homed
// on "another node" (a vector behind a mutex): every update arrives once, a
// rank reads its own updates at once, reads are whole versions, and the
// updates travel in at most one push per two.
void TestNodeCombiner() {
  constexpr int kUpdates = 300;
  constexpr int64_t kN = 1000;
  smb::Box::Options o;
  o.job_id = "combiner-test-" + std::to_string(getpid());
  o.world = 2;
  o.heap_bytes = 1 << 20;
  std::unique_ptr<smb::Box> made;
  smb::Status created = smb::Box::Create(o, &made);
  Check(created.ok(), "combiner: create box: " + created.ToString());
  if (!created.ok()) return;
  std::shared_ptr<smb::Box> box(std::move(made));
  std::mutex home_mu;
  std::vector<float> home(kN, 0.0f);
  std::atomic<int> pushes{0};
  auto push = [&](const std::string& name, smb::DType, const std::vector<int64_t>& shape,
                  const void* delta, void* fresh, double) -> smb::Status {
    if (name != "w" || shape != std::vector<int64_t>{kN}) return smb::InvalidArgument(name);
    std::this_thread::sleep_for(std::chrono::microseconds(50));  // on the wire
    std::lock_guard<std::mutex> lock(home_mu);
    const float* d = static_cast<const float*>(delta);
    for (int64_t i = 0; i < kN; ++i) home[i] += d[i];
    std::copy(home.begin(), home.end(), static_cast<float*>(fresh));
    ++pushes;
    return smb::Status::Ok();
  };
  auto fetch = [&](float* dst) {
    std::lock_guard<std::mutex> lock(home_mu);
    std::copy(home.begin(), home.end(), dst);
  };
  std::atomic<int> read_first{0}, looped{0};
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      std::unique_ptr<smb::ShmPeers> joined;
      smb::Status s = smb::ShmPeers::Join(box, rank, &joined);
      Check(s.ok(), "combiner: join: " + s.ToString());
      if (!s.ok()) {
        read_first += 2;  // the other rank need not wait
        return;
      }
      // Idle pushes after 0.2-0.4 s: they do not thin out the main loop's combining.
      smb::NodeCombiner combiner(std::shared_ptr<smb::Peers>(std::move(joined)), push, 0.2);
      std::vector<float> one(kN, 1.0f), minus_one(kN, -1.0f), read(kN);
      bool taken = true;
      s = combiner.Read("w", smb::DType::kFloat32, {kN}, smb::ReadMode::kConsistent,
                        read.data(), 10, &taken);
      Check(s.ok() && !taken, "combiner: nothing fetched yet, the caller fetches");
      // Both read before either pushes (a push would give the node its copy).
      ++read_first;
      while (read_first < 2) std::this_thread::yield();
      for (int u = 1; u <= kUpdates; ++u) {
        // Rank 1 pushes gradients of -1 at rate 1 (kSgd): +1 as well.
        s = rank == 0 ? combiner.Push("w", smb::DType::kFloat32, {kN}, {smb::UpdateRule::kDelta},
                                      one.data(), 0.0, 10)
                      : combiner.Push("w", smb::DType::kFloat32, {kN}, {smb::UpdateRule::kSgd},
                                      minus_one.data(), 1.0, 10);
        Check(s.ok(), "combiner: push: " + s.ToString());
        if (u % 7 != 0) continue;
        s = combiner.Read("w", smb::DType::kFloat32, {kN}, smb::ReadMode::kConsistent,
                          read.data(), 10, &taken);
        if (!taken) fetch(read.data());
        Check(s.ok() && read[0] >= u && read[0] <= 2 * kUpdates &&
                  std::all_of(read.begin(), read.end(), [&](float v) { return v == read[0]; }),
              "combiner: rank " + std::to_string(rank) + " read " + std::to_string(read[0]) +
                  " after its " + std::to_string(u) + " updates, whole and its own included");
      }
      s = combiner.FlushAll(10);
      Check(s.ok(), "combiner: flush: " + s.ToString());
      // Then one update, short of a round (2), and nobody pushes or flushes:
      // it goes home on its own once it sat unchanged.
      ++looped;
      while (looped < 2) std::this_thread::yield();
      if (rank == 0) {
        s = combiner.Push("w", smb::DType::kFloat32, {kN}, {smb::UpdateRule::kDelta}, one.data(),
                          0.0, 10);
        Check(s.ok(), "combiner: last push: " + s.ToString());
      }
      const double deadline = smb::MonotonicSeconds() + 10;
      float at_home = 0;
      while (smb::MonotonicSeconds() < deadline) {
        fetch(read.data());
        at_home = read[0];
        if (at_home == 2 * kUpdates + 1) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      Check(at_home == 2 * kUpdates + 1,
            "combiner: rank " + std::to_string(rank) + ": the home holds " +
                std::to_string(at_home) + " 10 s after the last update, not every update");
    });
  }
  for (std::thread& t : ranks) t.join();
  Check(std::all_of(home.begin(), home.end(), [](float v) { return v == 2 * kUpdates + 1; }),
        "combiner: home holds every update once: " + std::to_string(home[0]));
  Check(pushes > 0 && pushes <= kUpdates + 4,
        "combiner: " + std::to_string(pushes.load()) + " pushes carried " +
            std::to_string(2 * kUpdates) + " updates");
  box->Unlink();
}

// Each collective test at each world size, the ranks spread over `spread` nodes.
void TestCollectives(int spread, std::initializer_list<int> worlds) {
  nodes = spread;
  for (int world : worlds) {
    std::printf("%d node(s), world %d\n", spread, world);
    std::fflush(stdout);
    TestAllReduceAndBroadcast(world);
    TestSharedResults(world);
    TestDisagreementStopsEveryRank(world);
    TestRecoverableDisagreement(world);
    TestSchedulerAgreesOrder(world);
    TestJoin(world);
  }
  nodes = 1;
}

int main() {
  TestReplicaSum();
  TestParamServer();
  TestCollectives(1, {2, 3});
  // Across nodes (1 and 2 ranks a node), over the link between nodes.
  TestCollectives(2, {2, 4});
  TestCollectives(3, {3, 6});
  // Nodes of different sizes, 2 + 1 ranks: node 0's rank 1 has no counterpart
  // and learns each outcome through the box; a broadcast from it crosses from
  // rank 0; it joins with the rest.
  sizes = {2, 1};
  TestCollectives(2, {3});
  sizes.clear();
  TestGoneRankFailsTheOthers();
  TestStepClock();
  TestWaitAllFinishedWaitsForTheSameRound();
  TestNodeCombiner();
  return smb_test::Report("collectives_test");
}
