// The timeline recorder (cc/smb/timeline.h) while it records: 3 ranks as
// threads run scheduled collectives (chunked all-reduces, broadcasts,
// barriers) and step clock ticks, while other threads record, name tracks
// and flush at the same time; then the file holds every rank's events, one
// event per collective, phases inside their collective. Also rank 0's merge
// of parts: a gone rank is not waited for, a flushed (not final) part is.
// tests/test_timeline.py builds and runs this under ThreadSanitizer and
// AddressSanitizer.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cc/smb/communicator.h"
#include "cc/smb/scheduler.h"
#include "cc/smb/timeline.h"
#include "cc/smb/transport/thread_peers.h"
#include "cc/tests/check.h"

namespace {

using smb_test::Check;

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string line; std::getline(ss, line);) out.push_back(line);
  return out;
}

// A number field of one trace line ("ts", "dur", "pid").
double Field(const std::string& line, const std::string& key) {
  const size_t at = line.find("\"" + key + "\":");
  return at == std::string::npos ? -1 : std::atof(line.c_str() + at + key.size() + 3);
}

constexpr int kWorld = 3;
constexpr int kRounds = 20;

void RunRanks() {
  smb::ThreadGroup group(kWorld, /*staging_bytes=*/256, size_t{16} << 20);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&group, r] {
      std::shared_ptr<smb::Communicator> comm = smb::Communicator::Create(group.Join(r), 30);
      auto scheduler = smb::CollectiveScheduler::Start(comm);
      std::vector<float> in(300, static_cast<float>(r)), out(300), b(10, 1.0f);
      for (int round = 0; round < kRounds; ++round) {
        std::promise<smb::Status> p1, p2, p3;
        scheduler->Submit(
            "grads", "allreduce",
            [&](smb::Communicator* c) {
              return c->AllReduceSum({{smb::DType::kFloat32, {300}, in.data(), out.data()}});
            },
            [&p1](const smb::Status& s) { p1.set_value(s); });
        scheduler->Submit(
            "weights", "broadcast",
            [&](smb::Communicator* c) {
              return c->Broadcast(0, {{smb::DType::kFloat32, {10}, b.data(), b.data()}});
            },
            [&p2](const smb::Status& s) { p2.set_value(s); });
        scheduler->Submit(
            "sync", "barrier", [](smb::Communicator* c) { return c->Barrier(); },
            [&p3](const smb::Status& s) { p3.set_value(s); });
        Check(p1.get_future().get().ok() && p2.get_future().get().ok() &&
                  p3.get_future().get().ok(),
              "collectives of rank " + std::to_string(r));
        Check(out[0] == static_cast<float>(kWorld * (kWorld - 1) / 2), "all-reduce sum");
        int64_t lead = 0;
        Check(comm->clock().Tick(-1, &lead).ok(), "clock tick");
      }
      comm->clock().Finish();
      Check(comm->clock().WaitAllFinished().ok(), "wait all finished");
    });
  }
  // Meanwhile: other threads record, add tracks and flush.
  std::atomic<bool> stop{false};
  std::vector<std::thread> others;
  for (int t = 0; t < 2; ++t) {
    others.emplace_back([&stop, t] {
      const int track = smb::timeline::TrackId(t == 0 ? "steps" : "extra");
      int k = 0;
      while (!stop.load()) {
        const int64_t now = smb::timeline::NowNs();
        smb::timeline::Record(smb::timeline::kThisProcess, track, "step \"" + std::to_string(k) + "\"",
                              "step", now, now + 1000, "step", k);
        {
          smb::timeline::Scope scope(smb::timeline::kThisProcess, smb::timeline::kSegments,
                                     "push", "segment");
          if (scope.active()) scope.set_name("push w" + std::to_string(k % 3));
        }
        if (++k % 50 == 0) {
          std::string written;
          Check(smb::timeline::Flush(&written).ok(), "flush while recording");
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  stop = true;
  for (std::thread& t : others) t.join();
}

void TestRecording(const std::string& dir) {
  const std::string path = dir + "/sub/trace.json";
  Check(!smb::timeline::On(), "off before Start");
  {
    smb::timeline::Scope scope(0, smb::timeline::kCollectives, "reduce");
    Check(!scope.active(), "a scope while off records nothing");
  }
  smb::timeline::Options o;
  o.path = path;
  o.job_id = "test";
  o.rank = 0;
  o.world = 1;
  Check(smb::timeline::Start(o).ok() && smb::timeline::On(), "started");
  RunRanks();
  Check(smb::timeline::Finish().ok(), "finish");
  Check(!smb::timeline::On(), "off after Finish");
  const std::string text = Read(path);
  Check(text.rfind("{\"traceEvents\":[\n", 0) == 0 && text.find("\"final\":true") != std::string::npos,
        "a whole document: " + text.substr(0, 40));
  for (int r = 0; r < kWorld; ++r) {
    const std::string rank = "\"pid\":" + std::to_string(r) + ",";
    const std::vector<std::string> lines = Lines(text);
    int allreduces = 0, broadcasts = 0, barriers = 0, ticks = 0;
    std::vector<std::pair<double, double>> collectives;
    for (const std::string& line : lines) {
      if (line.find(rank) == std::string::npos) continue;
      if (line.find("\"cat\":\"collective\"") != std::string::npos) {
        allreduces += line.find("\"name\":\"allreduce grads\"") != std::string::npos;
        broadcasts += line.find("\"name\":\"broadcast weights\"") != std::string::npos;
        barriers += line.find("\"name\":\"barrier sync\"") != std::string::npos;
        collectives.emplace_back(Field(line, "ts"), Field(line, "ts") + Field(line, "dur"));
      }
      ticks += line.find("\"name\":\"clock tick wait\"") != std::string::npos;
    }
    Check(allreduces == kRounds && broadcasts == kRounds && barriers == kRounds,
          "rank " + std::to_string(r) + ": one event per collective: " +
              std::to_string(allreduces) + " " + std::to_string(broadcasts) + " " +
              std::to_string(barriers));
    Check(ticks == kRounds, "rank " + std::to_string(r) + " clock ticks: " + std::to_string(ticks));
    // Every phase of the rank lies inside one of its collectives.
    std::sort(collectives.begin(), collectives.end());
    int outside = 0, phases = 0;
    for (const std::string& line : lines) {
      if (line.find(rank) == std::string::npos ||
          line.find("\"cat\":\"phase\"") == std::string::npos) {
        continue;
      }
      ++phases;
      const double start = Field(line, "ts"), end = start + Field(line, "dur");
      const bool inside = std::any_of(collectives.begin(), collectives.end(), [&](auto c) {
        return c.first - 0.0015 <= start && end <= c.second + 0.0015;
      });
      outside += !inside;
    }
    Check(phases > 6 * kRounds && outside == 0,
          "rank " + std::to_string(r) + ": " + std::to_string(outside) + " of " +
              std::to_string(phases) + " phases outside their collective");
  }
  Check(Count(text, "\"name\":\"process_name\"") == kWorld, "a process per rank");
  Check(Count(text, "\"args\":{\"name\":\"extra\"}") == 1, "a track added by name");
  Check(text.find("step \\\"1\\\"") != std::string::npos, "names escaped");
  // Recording after Finish changes nothing.
  smb::timeline::Record(0, smb::timeline::kSteps, "late", "step", 1, 2);
  std::string written;
  Check(smb::timeline::Flush(&written).ok() && written.empty(), "flush after finish");
}

// `clock`: the part's boot_id and realtime_ahead_ns fields, if any.
void WritePart(const std::string& path, int rank, bool final, const std::string& clock = "") {
  std::ofstream out(path + ".parts/job.rank" + std::to_string(rank) + ".json");
  out << "{\"traceEvents\":[\n"
      << "{\"name\":\"step\",\"cat\":\"step\",\"ph\":\"X\",\"pid\":" << rank
      << ",\"tid\":0,\"ts\":1.000,\"dur\":2.000}\n"
      << "],\"displayTimeUnit\":\"ms\",\"otherData\":{\"tf_smb_job\":\"job\",\"world\":3,"
      << "\"rank\":" << rank << ",\"final\":" << (final ? "true" : "false") << clock << "}}\n";
}

// Parts of other hosts (another boot id) move by the difference of the hosts'
// real-time leads; parts of rank 0's host stay.
void TestMergeAcrossHosts(const std::string& dir) {
  const std::string path = dir + "/hosts.json";
  Check(system(("mkdir -p " + path + ".parts").c_str()) == 0, "mkdir");
  WritePart(path, 0, true, ",\"boot_id\":\"a\",\"realtime_ahead_ns\":5000000");
  WritePart(path, 1, true, ",\"boot_id\":\"a\",\"realtime_ahead_ns\":5000700");
  WritePart(path, 2, true, ",\"boot_id\":\"b\",\"realtime_ahead_ns\":7500250");
  smb::Status s = smb::timeline::MergeParts(path, "job", 3, 30, nullptr);
  const std::string text = Read(path);
  Check(s.ok() && Count(text, "\"ts\":1.000,") == 2 && Count(text, "\"ts\":2501.250,") == 1,
        "another host's events moved by 2500.25 us: " + s.message() + "\n" + text);
}

void TestMerge(const std::string& dir) {
  const std::string path = dir + "/merged.json";
  Check(system(("mkdir -p " + path + ".parts").c_str()) == 0, "mkdir");
  WritePart(path, 0, true);
  WritePart(path, 1, true);
  // Rank 2 is gone without a part: no waiting for the full 30 s.
  auto start = std::chrono::steady_clock::now();
  smb::Status s = smb::timeline::MergeParts(path, "job", 3, 30, [](int r) { return r == 2; });
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string text = Read(path);
  Check(!s.ok() && s.message().find("[2]") != std::string::npos, "missing rank named: " + s.message());
  Check(took < 5 && Count(text, "\"cat\":\"step\"") == 2 &&
            text.find("\"missing_ranks\":[2]") != std::string::npos,
        "merged without the gone rank");
  // A flushed part of a live rank is waited for until the timeout, then merged.
  WritePart(path, 2, false);
  s = smb::timeline::MergeParts(path, "job", 3, 0.2, nullptr);
  text = Read(path);
  Check(!s.ok() && text.find("\"partial_ranks\":[2]") != std::string::npos &&
            Count(text, "\"cat\":\"step\"") == 3,
        "a flushed part counts as partial: " + s.message());
  WritePart(path, 2, true);
  s = smb::timeline::MergeParts(path, "job", 3, 30, nullptr);
  text = Read(path);
  Check(s.ok() && Count(text, "\"cat\":\"step\"") == 3 &&
            text.find("\"missing_ranks\":[],\"partial_ranks\":[]") != std::string::npos,
        "all parts merged: " + s.message());
  std::ifstream gone(path + ".parts/job.rank0.json");
  Check(!gone, "parts removed after a complete merge");
}

}  // namespace

int main(int argc, char** argv) {
  char tmpl[] = "/tmp/tf_smb_timeline_test_XXXXXX";
  const std::string dir = argc > 1 ? argv[1] : mkdtemp(tmpl);
  TestRecording(dir);
  TestMerge(dir);
  TestMergeAcrossHosts(dir);
  return smb_test::Report("timeline_test");
}
