#include "cc/smb/scheduler.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cc/smb/algorithms/joined.h"
#include "cc/smb/hash.h"
#include "cc/smb/group.h"
#include "cc/smb/process.h"
#include "cc/smb/timeline.h"

namespace smb {
namespace {

constexpr double kLivenessPeriodS = 0.02;  // how often waits look for dead ranks
constexpr int kSpinIterations = 200;       // polls before sleeping on the box

struct Item {
  std::string key;  // with its count: unique in this process
  std::string what;
  uint64_t hash;
  CollectiveScheduler::Run run;
  CollectiveScheduler::Done done;
  double since;
  bool join = false;  // SubmitJoin's
};

// Timeline: the collective `item` as one event from the start of its
// negotiation (when it was submitted, or when the previous one ended if that
// was later) to `end_ns`, named by its op and call site, and its "negotiate"
// phase: waiting for its turn, until `picked_ns`.
void RecordCollective(int rank, const Item& item, int64_t previous_end_ns, int64_t picked_ns,
                      int64_t end_ns) {
  const int64_t start_ns =
      std::max(previous_end_ns, static_cast<int64_t>(item.since * 1e9));
  const size_t hash_mark = item.key.rfind('#');
  const std::string site = item.key.substr(0, hash_mark);
  const int64_t call =
      hash_mark == std::string::npos ? 0 : std::atoll(item.key.c_str() + hash_mark + 1);
  timeline::Record(rank, timeline::kCollectives, item.what + " " + site, "collective",
                   start_ns, end_ns, "call", call);
  timeline::Record(rank, timeline::kCollectives, "negotiate", "phase", start_ns,
                   std::max(start_ns, picked_ns));
}

}  // namespace

struct CollectiveScheduler::State {
  std::shared_ptr<Communicator> comm;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Item> items;  // submitted, not yet run; oldest first
  // How many calls of each key this process has submitted.
  std::unordered_map<std::string, uint64_t> counts;
  std::thread thread;
  bool busy = false;
  bool stop = false;
};

namespace {

void FailAll(CollectiveScheduler::State* st, const Status& failure) {
  std::deque<Item> items;
  {
    std::lock_guard<std::mutex> lock(st->mu);
    items.swap(st->items);
  }
  for (Item& item : items) item.done(failure);
}

// Takes the waiting item with `hash` out of the queue.
bool Take(CollectiveScheduler::State* st, uint64_t hash, Item* out) {
  std::lock_guard<std::mutex> lock(st->mu);
  for (auto it = st->items.begin(); it != st->items.end(); ++it) {
    if (it->hash != hash) continue;
    *out = std::move(*it);
    st->items.erase(it);
    st->busy = true;
    return true;
  }
  return false;
}

// Why nothing could run for too long, or a dead rank; OK otherwise.
Status CheckStalled(Group& group, const Item& oldest, double now) {
  const int gone = group.AbsentRank();
  if (gone >= 0) {
    return Status(Code::kAborted,
                  group.PeerName(gone) + group.GoneHow(gone) + "; rank " +
                      std::to_string(group.job_rank()) + " was waiting for it to start " +
                      oldest.what + " ('" + oldest.key + "')");
  }
  if (now - oldest.since < group.timeout_s()) return Status::Ok();
  const std::string missing = group.RanksWithout(oldest.hash);
  return Status(Code::kDeadlineExceeded,
                "rank " + std::to_string(group.rank()) + " timed out after " +
                    std::to_string(static_cast<int>(group.timeout_s())) +
                    "s waiting to start " + oldest.what + " ('" + oldest.key +
                    "'): rank(s) " + (missing.empty() ? std::string("?") : missing) +
                    " never called it (do all ranks run the same collectives?)");
}

void Enqueue(CollectiveScheduler::State* st, const std::string& key, const std::string& what,
             CollectiveScheduler::Run run, CollectiveScheduler::Done done, bool join) {
  Status failure = st->comm->group().Failure();
  if (!failure.ok()) {
    done(failure);  // fail fast: the job stopped at an earlier error
    return;
  }
  {
    std::lock_guard<std::mutex> lock(st->mu);
    const uint64_t count = st->counts[key]++;
    Item item;
    item.key = key + "#" + std::to_string(count);
    item.what = what;
    item.hash = StableHash(item.key);
    item.run = std::move(run);
    item.done = std::move(done);
    item.since = MonotonicSeconds();
    item.join = join;
    st->items.push_back(std::move(item));
  }
  st->cv.notify_one();
  st->comm->group().Poke();  // the thread may sleep on the box rather than on cv
}

void Loop(std::shared_ptr<CollectiveScheduler::State> st) {
  Communicator* comm = st->comm.get();
  Group& group = comm->group();
  std::vector<uint64_t> published;
  double next_liveness = 0;
  int spins = 0;
  int64_t previous_end_ns = 0;  // timeline only: when the last collective ended
  double served_at = 0;         // when this rank, joined, last took part in one
  for (;;) {
    const uint32_t seen = group.WakeWord();
    std::vector<uint64_t> waiting;
    Item oldest;
    bool only_join = false;
    {
      std::unique_lock<std::mutex> lock(st->mu);
      st->busy = false;
      st->cv.wait(lock, [&] { return st->stop || !st->items.empty(); });
      if (st->items.empty()) return;  // stopping, nothing left to run
      for (const Item& item : st->items) waiting.push_back(item.hash);
      oldest.key = st->items.front().key;
      oldest.what = st->items.front().what;
      oldest.hash = st->items.front().hash;
      // A joined rank waits as long as the others keep it busy.
      oldest.since = std::max(st->items.front().since, served_at);
      only_join = st->items.size() == 1 && st->items.front().join;
    }
    if (only_join) group.MarkJoined();
    Status failure = group.Failure();
    if (!failure.ok()) {
      FailAll(st.get(), failure);
      continue;
    }
    if (waiting.size() > static_cast<size_t>(kMaxPending)) {
      FailAll(st.get(), group.Fail(Status(
          Code::kResourceExhausted,
          "rank " + std::to_string(group.rank()) + " has " +
              std::to_string(waiting.size()) + " collectives waiting at once; at most " +
              std::to_string(kMaxPending) + " are supported")));
      continue;
    }
    if (waiting != published) {
      group.PublishPending(waiting);
      published = waiting;
    }
    uint64_t next = 0;
    if (group.NextCollective(waiting, &next)) {
      Item item;
      const bool mine = Take(st.get(), next, &item);
      if (!mine && group.Joined(group.rank())) {
        Status s = ServeAsJoined(group);
        served_at = MonotonicSeconds();
        spins = 0;
        if (!s.ok() && s.code() != Code::kFailedPrecondition) {
          const Status earlier = group.Failure();
          FailAll(st.get(), earlier.ok() ? group.Fail(s) : earlier);
        }
        continue;
      }
      if (!mine) {
        FailAll(st.get(), group.Fail(Status(
            Code::kInternal, "rank " + std::to_string(group.rank()) +
                                 " was told to run a collective it never submitted")));
        continue;
      }
      spins = 0;
      const int64_t picked_ns = timeline::On() ? timeline::NowNs() : 0;
      Status s = item.run(comm);
      if (picked_ns != 0) {
        const int64_t end_ns = timeline::NowNs();
        RecordCollective(group.job_rank(), item, previous_end_ns, picked_ns, end_ns);
        previous_end_ns = end_ns;
      }
      if (!s.ok() && s.code() != Code::kFailedPrecondition) {
        // The first failure names its call site; the job then stops with it.
        // (kFailedPrecondition: the ranks disagreed on a recoverable
        // collective, which ran nowhere; the job goes on.)
        const Status earlier = group.Failure();
        s = earlier.ok() ? group.Fail(Status(s.code(), s.message() + " (in " + item.what +
                                                           " '" + item.key + "')"))
                         : earlier;
      }
      {
        // Not busy before done(): whoever done() wakes may destroy the
        // scheduler, which then joins this thread instead of leaving it.
        std::lock_guard<std::mutex> lock(st->mu);
        st->busy = false;
        if (item.join) st->counts.clear();  // every rank, at the same point
      }
      item.done(s);
      continue;
    }
    if (spins < kSpinIterations) {
      ++spins;
      std::this_thread::yield();
      continue;
    }
    const double now = MonotonicSeconds();
    if (now >= next_liveness) {
      next_liveness = now + kLivenessPeriodS;
      Status stalled = CheckStalled(group, oldest, now);
      if (!stalled.ok()) {
        FailAll(st.get(), group.Fail(stalled));
        continue;
      }
    }
    group.WaitForChange(seen, kLivenessPeriodS);
  }
}

}  // namespace

std::unique_ptr<CollectiveScheduler> CollectiveScheduler::Start(
    std::shared_ptr<Communicator> comm) {
  auto state = std::make_shared<State>();
  state->comm = std::move(comm);
  state->thread = std::thread(Loop, state);
  return std::make_unique<CollectiveScheduler>(Token(), std::move(state));
}

CollectiveScheduler::CollectiveScheduler(Token, std::shared_ptr<State> state)
    : state_(std::move(state)) {}

CollectiveScheduler::~CollectiveScheduler() {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->stop = true;
  state_->cv.notify_all();
  if (state_->busy || !state_->items.empty()) {
    // Exiting mid-collective: never block exit on peers. The thread keeps
    // the state (and the Communicator) alive; the OS ends it.
    state_->thread.detach();
    return;
  }
  lock.unlock();
  state_->thread.join();
}

void CollectiveScheduler::Submit(const std::string& key, const std::string& what,
                                 Run run, Done done) {
  Enqueue(state_.get(), key, what, std::move(run), std::move(done), /*join=*/false);
}

void CollectiveScheduler::SubmitJoin(Run run, Done done) {
  Enqueue(state_.get(), "hvd.join", "hvd.join", std::move(run), std::move(done), /*join=*/true);
}

Communicator* CollectiveScheduler::comm() const { return state_->comm.get(); }

}  // namespace smb
