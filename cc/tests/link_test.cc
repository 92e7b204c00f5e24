// The link between nodes (link/transport_link.h) over ranks that are threads
// of one process (transport/thread_transport.h), so the sanitizers see every
// rank (tests/test_sanitizers.py builds and runs this under both): the
// memory server's calls and their errors, step clocks, files for rank 0, a
// failure reaching every rank, a message no rank sends failing every rank, and a node cut off, which fails a synchronous
// job and which the asynchronous mode survives, a combined push on the wire
// when its home node is lost, which still counts once, and an update queued
// at a stalled server and sent again elsewhere, which also counts once.
// (cc/tests/collectives_test.cc runs the collectives across nodes over the
// same transport.)
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cc/smb/box.h"
#include "cc/smb/link/transport_link.h"
#include "cc/smb/segment/segment_table.h"
#include "cc/smb/transport/shm_peers.h"
#include "cc/smb/transport/thread_transport.h"
#include "cc/tests/check.h"

namespace {

using smb_test::Check;

bool Contains(const smb::Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

// Runs body(rank, link) on nodes x local_size threads, each with its link;
// `timeout_s` also bounds how long a link's exit waits for the others to leave.
void RunLinks(int nodes, int local_size, double lost_after_s,
              const std::function<void(int, smb::ThreadNetwork&, smb::NodeLink&)>& body,
              double timeout_s = 30) {
  smb::ThreadNetwork network(nodes, local_size);
  const int world = nodes * local_size;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      smb::LinkOptions options;
      options.rank = r;
      options.world = world;
      options.timeout_s = timeout_s;
      options.lost_after_s = lost_after_s;
      std::shared_ptr<smb::NodeLink> link;
      const smb::Status s = smb::StartTransportLink(network.Connect(r), options, &link);
      Check(s.ok(), "rank " + std::to_string(r) + " starting: " + s.ToString());
      if (!s.ok()) return;
      body(r, network, *link);
      link->Stop();
    });
  }
  for (std::thread& t : threads) t.join();
}

// Waits up to `seconds` for `done`.
bool Eventually(double seconds, const std::function<bool()>& done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

smb::SegmentRequest Request(smb::SegmentRequest::Kind kind, const std::string& name) {
  smb::SegmentRequest request;
  request.kind = kind;
  request.name = name;
  request.shape = {4};
  return request;
}

// 2 nodes x 2: every rank serves segment "w" (4 floats, its node's) and
// calls the other node's; updates add up at home, errors come back with
// their code and text, clocks and rank 0's files arrive.
void TestSegmentsClocksAndFiles() {
  std::vector<std::vector<float>> homes(2, std::vector<float>(4, 0.0f));
  std::mutex homes_mu;
  std::atomic<int> files{0};
  std::atomic<int> published{0};
  RunLinks(2, 2, 10, [&](int rank, smb::ThreadNetwork&, smb::NodeLink& link) {
    const int node = link.node();
    Check(link.nodes() == 2 && link.local_size() == 2 && node == rank / 2 &&
              link.JobRank(node, link.local_rank()) == rank,
          "rank " + std::to_string(rank) + ": layout");
    link.SetSegmentServer([&, node](const smb::SegmentRequest& request, const void* payload,
                                    size_t bytes, std::vector<char>* reply) {
      if (request.name != "w") return smb::InvalidArgument("no segment '" + request.name + "'");
      std::lock_guard<std::mutex> lock(homes_mu);
      std::vector<float>& home = homes[node];
      if (request.kind == smb::SegmentRequest::Kind::kUpdate) {
        if (bytes != 4 * sizeof(float)) return smb::InvalidArgument("4 floats expected");
        const float* delta = static_cast<const float*>(payload);
        for (int i = 0; i < 4; ++i) home[i] += delta[i];
      }
      reply->resize(4 * sizeof(float));
      std::memcpy(reply->data(), home.data(), reply->size());
      return smb::Status::Ok();
    });
    if (rank == 0) {
      link.SetRankZeroReceiver([&](int from, std::vector<char> bytes) {
        if (bytes.size() == 1 && bytes[0] == static_cast<char>(from)) ++files;
      });
    }
    const int other = 1 - node;
    const std::vector<float> one(4, 1.0f);
    std::vector<float> read(4, -1.0f);
    for (int k = 0; k < 25; ++k) {
      const smb::Status s = link.CallSegmentServer(
          other, Request(smb::SegmentRequest::Kind::kUpdate, "w"), one.data(),
          4 * sizeof(float), read.data(), 4 * sizeof(float), 30);
      Check(s.ok(), "rank " + std::to_string(rank) + ": update " + s.ToString());
    }
    const smb::Status missing = link.CallSegmentServer(
        other, Request(smb::SegmentRequest::Kind::kRead, "nope"), nullptr, 0, read.data(),
        4 * sizeof(float), 30);
    Check(missing.code() == smb::Code::kInvalidArgument && Contains(missing, "no segment 'nope'"),
          "rank " + std::to_string(rank) + ": the server's error: " + missing.ToString());
    smb::SegmentRequest too_long = Request(smb::SegmentRequest::Kind::kRead, std::string(200, 'x'));
    const smb::Status refused = link.CallSegmentServer(other, too_long, nullptr, 0, read.data(),
                                                       4 * sizeof(float), 30);
    Check(refused.code() == smb::Code::kInvalidArgument && Contains(refused, "too long"),
          "rank " + std::to_string(rank) + ": a name too long: " + refused.ToString());
    link.PublishClock(7 + rank, 1);
    ++published;
    Check(Eventually(10, [&] {
            const std::vector<smb::RemoteClock> clocks = link.RemoteClocks();
            return clocks.size() == 2 && std::all_of(clocks.begin(), clocks.end(), [](auto& c) {
                     return c.steps == static_cast<uint64_t>(7 + c.rank) && c.phase == 1;
                   });
          }),
          "rank " + std::to_string(rank) + ": the other node's clocks");
    // Node 1's ranks saw rank 0's clock, published after it set its receiver.
    if (node == 1) link.SendToRankZero({static_cast<char>(rank)});
    std::vector<int> word(1, rank), words(2, -1);
    Check(link.AllGather(word.data(), sizeof(int), words.data(), 30).ok() &&
              words[0] == link.local_rank() && words[1] == 2 + link.local_rank(),
          "rank " + std::to_string(rank) + ": all-gather among counterparts");
    if (rank == 0) {
      Check(Eventually(10, [&] { return files.load() == 2; }),
            "rank 0 got " + std::to_string(files.load()) + " of 2 files");
    }
  });
  for (int node = 0; node < 2; ++node) {
    Check(homes[node] == std::vector<float>(4, 50.0f),
          "node " + std::to_string(node) + "'s segment holds 2 ranks x 25 updates: " +
              std::to_string(homes[node][0]));
  }
}

// A failure one rank sends reaches every other rank, with its text.
void TestFailureReachesEveryRank() {
  std::atomic<int> told[4] = {};
  std::atomic<int> listening{0};
  RunLinks(2, 2, 10, [&](int rank, smb::ThreadNetwork&, smb::NodeLink& link) {
    link.SetCallbacks([&told, rank](const smb::Status&) { ++told[rank]; }, [] {},
                      [] { return smb::Status::Ok(); });
    ++listening;
    if (rank == 3 && Eventually(10, [&] { return listening.load() == 4; })) {
      link.SendFailure(smb::Status(smb::Code::kInternal, "rank 3 broke"));
    }
    Check(Eventually(10, [&] { return Contains(link.Failure(), "rank 3 broke"); }),
          "rank " + std::to_string(rank) + " heard the failure: " + link.Failure().ToString());
    if (rank != 3) {
      Check(Eventually(10, [&] { return told[rank].load() == 1; }),
            "rank " + std::to_string(rank) + ": the failure callback ran once");
    }
    float x = 1;
    const smb::Status after = link.AllReduceSum(smb::DType::kFloat32, &x, 1, 5);
    Check(Contains(after, "rank 3 broke"),
          "rank " + std::to_string(rank) + ": a collective after the failure: " + after.ToString());
    link.SetCallbacks(nullptr, nullptr, nullptr);
  });
}

// A message no rank sends (an unknown tag, or a known one of the wrong size)
// fails the rank that got it, saying what came, and through it every rank.
void TestUnreadableMessageFailsEveryRank(int tag, size_t bytes) {
  std::atomic<int> listening{0};
  RunLinks(2, 1, 10, [&](int rank, smb::ThreadNetwork& network, smb::NodeLink& link) {
    ++listening;
    if (rank == 0 && Eventually(10, [&] { return listening.load() == 2; })) {
      network.Inject(0, 1, tag, std::vector<char>(bytes, 1));
    }
    const std::string said = "rank 1 got a message it cannot read from rank 0: tag " +
                             std::to_string(tag) + ", " + std::to_string(bytes) + " bytes";
    Check(Eventually(10, [&] { return Contains(link.Failure(), said); }),
          "rank " + std::to_string(rank) + " heard of the unreadable message (tag " +
              std::to_string(tag) + "): " + link.Failure().ToString());
  });
}

// Node 1 (ranks 2, 3) is cut off after a first all-reduce. A synchronous job
// fails on node 0, naming the lost ranks; with KeepGoingWithoutLostRanks
// node 0 goes on: their clocks count as finished, calls to their segments and
// collectives across nodes fail at once.
void TestNodeCutOff(bool keep_going) {
  const std::string mode = keep_going ? "async" : "sync";
  RunLinks(2, 2, 1, [&](int rank, smb::ThreadNetwork& network, smb::NodeLink& link) {
    if (keep_going) link.KeepGoingWithoutLostRanks();
    link.SetSegmentServer([](const smb::SegmentRequest&, const void*, size_t,
                             std::vector<char>* reply) {
      reply->assign(4 * sizeof(float), 0);
      return smb::Status::Ok();
    });
    float x = static_cast<float>(rank);
    Check(link.AllReduceSum(smb::DType::kFloat32, &x, 1, 30).ok() &&
              x == static_cast<float>(2 * (rank % 2) + 2),
          mode + ": rank " + std::to_string(rank) + ": all-reduce before the cut: " +
              std::to_string(x));
    std::vector<float> read(4);
    if (rank >= 2) {
      network.Cut(rank);
      return;  // its link hears no one now, and stops
    }
    if (!keep_going) {
      Check(Eventually(10, [&] { return !link.Failure().ok(); }) &&
                Contains(link.Failure(), " (node 1) sent nothing for 1 s: lost") &&
                Contains(link.Failure(), "a synchronous job cannot go on"),
            "sync: rank " + std::to_string(rank) + ": " + link.Failure().ToString());
      return;
    }
    Check(Eventually(10, [&] { return link.NodeLost(1); }),
          "async: rank " + std::to_string(rank) + " found node 1 lost");
    Check(link.Failure().ok(), "async: the job goes on: " + link.Failure().ToString());
    for (const smb::RemoteClock& clock : link.RemoteClocks()) {
      Check(clock.phase == smb::kPhaseDoneForGood,
            "async: lost rank " + std::to_string(clock.rank) + " counts as finished");
    }
    const smb::Status call = link.CallSegmentServer(
        1, Request(smb::SegmentRequest::Kind::kRead, "w"), nullptr, 0, read.data(),
        4 * sizeof(float), 30);
    Check(call.code() == smb::Code::kAborted && Contains(call, "every rank of node 1"),
          "async: a call to the lost node: " + call.ToString());
    const smb::Status home = link.CallSegmentServer(
        0, Request(smb::SegmentRequest::Kind::kRead, "w"), nullptr, 0, read.data(),
        4 * sizeof(float), 30);
    Check(home.ok(), "async: a call to a live node: " + home.ToString());
    const smb::Status collective = link.AllReduceSum(smb::DType::kFloat32, &x, 1, 30);
    Check(collective.code() == smb::Code::kAborted && Contains(collective, "were lost"),
          "async: a collective across nodes: " + collective.ToString());
  });
}

// 2 nodes x 1 rank, the asynchronous mode's segments (SegmentTable, pushes
// combined per node): "w" lives on node 1. Node 0 pushes +1 (the value comes
// back: 1), node 1 is cut off, and node 0 pushes +1 again at once: that push
// is on the wire when node 1 is found lost (1 s of silence), so it is retried
// at the segment's new home, node 0, which starts from node 0's copy. The
// copy must not hold the retried sum already: w ends at 2, not 3.
void TestPushInFlightToLostNodeCountsOnce() {
  std::atomic<bool> cut{false};
  RunLinks(2, 1, 1, [&](int rank, smb::ThreadNetwork& network, smb::NodeLink& link) {
    const std::string who = "lost home: rank " + std::to_string(rank);
    smb::Box::Options o;
    o.job_id = "link-test-" + std::to_string(getpid()) + "-" + std::to_string(rank);
    o.world = 1;
    o.heap_bytes = 1 << 20;
    std::unique_ptr<smb::Box> made;
    smb::Status s = smb::Box::Create(o, &made);
    Check(s.ok(), who + ": create box: " + s.ToString());
    if (!s.ok()) return;
    struct Unlinked {  // the box's name goes however this rank leaves
      std::shared_ptr<smb::Box> box;
      ~Unlinked() { box->Unlink(); }
    } box{std::shared_ptr<smb::Box>(std::move(made))};
    std::unique_ptr<smb::ShmPeers> joined;
    s = smb::ShmPeers::Join(box.box, 0, &joined);
    Check(s.ok(), who + ": join: " + s.ToString());
    if (!s.ok()) return;
    auto table = std::make_shared<smb::SegmentTable>(std::shared_ptr<smb::Peers>(std::move(joined)),
                                                     &link);
    link.SetSegmentServer([table](const smb::SegmentRequest& request, const void* payload,
                                  size_t bytes, std::vector<char>* reply) {
      return table->Serve(request, payload, bytes, reply);
    });
    const std::vector<int64_t> shape{4};
    const std::vector<float> zeros(4, 0.0f), one(4, 1.0f);
    std::vector<float> read(4, -1.0f);
    int word = rank, words[2];
    auto in_step = [&](const char* where) {  // both ranks got here
      const smb::Status met = link.AllGather(&word, sizeof(int), words, 30);
      Check(met.ok(), who + ": " + where + ": " + met.ToString());
      return met.ok();
    };
    // Equal sizes: "a" goes to node 0, "w" to node 1 (placement, segment_table.h).
    for (const char* name : {"a", "w"}) {
      s = table->Create(name, smb::DType::kFloat32, shape, zeros.data(), rank == 0, 30);
      Check(s.ok(), who + ": create " + name + ": " + s.ToString());
    }
    if (!in_step("after creating")) return;
    if (rank == 0) {
      s = table->Update("w", smb::DType::kFloat32, shape, {smb::UpdateRule::kDelta}, one.data(),
                        0.0, 30, read.data());
      Check(s.ok() && table->Home("w") == 1 && read == one,
            who + ": the first push, w = " + std::to_string(read[0]) + ": " + s.ToString());
    }
    if (!in_step("after the first push")) return;
    if (rank == 1) {
      network.Cut(rank);
      cut = true;
      return;
    }
    while (!cut) std::this_thread::yield();
    s = table->Update("w", smb::DType::kFloat32, shape, {smb::UpdateRule::kDelta}, one.data(),
                      0.0, 30);
    if (s.ok()) s = table->FlushCombined(30);  // the push's retry ends
    if (s.ok()) {
      s = table->Read("w", smb::DType::kFloat32, shape, smb::ReadMode::kConsistent, read.data(),
                      30);
    }
    Check(s.ok() && table->Home("w") == 0,
          who + ": w moved to node 0: home " + std::to_string(table->Home("w")) + ", " +
              s.ToString());
    Check(read == std::vector<float>(4, 2.0f),
          who + ": w = " + std::to_string(read[0]) +
              " after two pushes of +1, the second on the wire when its home was lost "
              "(expected 2: each push counted once)");
  });
}

// 2 nodes x 2, the asynchronous mode: rank 2 (node 1), the memory server of
// rank 0's calls to node 1, stalls (its link thread stops, as in a stopped
// process) with rank 0's update waiting in its queue. Rank 0 finds it lost
// (4 s of silence) and sends the update again, to rank 3, which applies it to
// node 1's box. When rank 2 goes on, the update still in its queue must not
// be applied a second time: it learns it was left behind, and node 1's box
// took the update once.
void TestStalledServerAppliesNoStaleUpdate() {
  std::atomic<int> applied{0};  // updates node 1's box took (ranks 2 and 3 share it)
  std::atomic<bool> stalled{false}, retried{false}, checked{false};
  // 4 s, well above Liveness::kStalledS (2 s): a rank excuses the others'
  // silence once its link thread made no pass for that long (it was
  // stalled), but judges them before; with 1 s it would count them lost.
  RunLinks(2, 2, 4, [&](int rank, smb::ThreadNetwork& network, smb::NodeLink& link) {
    const std::string who = "stalled server: rank " + std::to_string(rank);
    link.KeepGoingWithoutLostRanks();
    link.SetSegmentServer([&applied, rank](const smb::SegmentRequest& request, const void*,
                                           size_t, std::vector<char>*) {
      if (request.kind == smb::SegmentRequest::Kind::kUpdate && rank >= 2) ++applied;
      return smb::Status::Ok();
    });
    float x = 1;
    const smb::Status met = link.AllReduceSum(smb::DType::kFloat32, &x, 1, 30);
    Check(met.ok(), who + ": all-reduce before the stall: " + met.ToString());
    if (!met.ok()) return;
    if (rank == 2) {
      network.Stall(rank);
      stalled = true;
      Check(Eventually(20, [&] { return retried.load(); }), who + ": rank 0 sent it again");
      network.Resume(rank);
      // Its queue (rank 0's first update, then what tells it it was lost) is
      // read in order.
      Check(Eventually(20, [&] { return Contains(link.Failure(), "went on without it"); }),
            who + " learns it was left behind: " + link.Failure().ToString());
      Check(applied == 1, "node 1's box took the update " + std::to_string(applied.load()) +
                              " times: rank 2, stalled while it was queued there, applied it "
                              "after rank 0 had sent it again to rank 3 (expected once)");
      checked = true;
      return;
    }
    if (rank == 0) {
      Check(Eventually(20, [&] { return stalled.load(); }), who + ": rank 2 stalled");
      const std::vector<float> one(4, 1.0f);
      const smb::SegmentRequest update = Request(smb::SegmentRequest::Kind::kUpdate, "w");
      smb::Status s = link.CallSegmentServer(1, update, one.data(), 4 * sizeof(float), nullptr,
                                             0, 30);
      Check(s.code() == smb::Code::kAborted && Contains(s, "rank 2 was lost"),
            who + ": the call to the stalled rank: " + s.ToString());
      s = link.CallSegmentServer(1, update, one.data(), 4 * sizeof(float), nullptr, 0, 30);
      Check(s.ok() && applied == 1, who + ": sent again, to rank 3: applied " +
                                        std::to_string(applied.load()) + ", " + s.ToString());
      retried = true;
    }
    Check(Eventually(30, [&] { return checked.load(); }), who + ": rank 2 checked");
  }, /*timeout_s=*/5);  // rank 3's exit waits that long for rank 2, which stopped
}

}  // namespace

int main() {
  const auto timed = [](const char* name, const std::function<void()>& test) {
    const auto start = std::chrono::steady_clock::now();
    test();
    std::printf("%s: %.1f s\n", name,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  };
  timed("segments, clocks, files", TestSegmentsClocksAndFiles);
  timed("failure", TestFailureReachesEveryRank);
  timed("unknown tag", [] { TestUnreadableMessageFailsEveryRank(/*tag=*/99, 8); });
  timed("clock of the wrong size", [] { TestUnreadableMessageFailsEveryRank(/*tag=*/16, 5); });
  timed("node cut off, sync", [] { TestNodeCutOff(/*keep_going=*/false); });
  timed("node cut off, async", [] { TestNodeCutOff(/*keep_going=*/true); });
  timed("push in flight to a lost node", TestPushInFlightToLostNodeCountsOnce);
  timed("stalled server", TestStalledServerAppliesNoStaleUpdate);
  return smb_test::Report("link_test");
}
