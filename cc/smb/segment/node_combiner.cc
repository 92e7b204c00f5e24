#include "cc/smb/segment/node_combiner.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "cc/smb/process.h"

namespace smb {
namespace {

size_t Elements(const Segment& s) { return s.bytes / DTypeSize(s.dtype); }

// Polls `done(bool*)` (which may fail) until it sets its flag, pausing
// `pause` between polls (zero: yield), for at most `timeout_s`; the error
// then says "timed out after Ns <what> '<name>'".
template <typename DoneFn>
Status PollUntil(double timeout_s, std::chrono::microseconds pause, const char* what,
                 const std::string& name, DoneFn done) {
  const double deadline = MonotonicSeconds() + timeout_s;
  for (;;) {
    bool finished = false;
    SMB_RETURN_IF_ERROR(done(&finished));
    if (finished) return Status::Ok();
    if (MonotonicSeconds() > deadline) {
      return Status(Code::kDeadlineExceeded, "timed out after " +
                                                 std::to_string(static_cast<int>(timeout_s)) +
                                                 "s " + what + " '" + name + "'");
    }
    if (pause.count() == 0) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
    }
  }
}

// A buffer of `bytes`: up to kKeptBytes one kept per thread between calls
// (reads and pushes run every step: no allocation each time); above, a
// fresh one, so no thread holds on to a large segment's worth of memory.
class Scratch {
 public:
  static constexpr size_t kKeptBytes = size_t{8} << 20;
  Scratch(int which, size_t bytes) {
    thread_local std::vector<char> kept[2];
    std::vector<char>& buffer = bytes <= kKeptBytes ? kept[which] : own_;
    if (buffer.size() < bytes) buffer.resize(bytes);
    data_ = buffer.data();
  }
  char* data() const { return data_; }

 private:
  std::vector<char> own_;
  char* data_ = nullptr;
};

}  // namespace

NodeCombiner::NodeCombiner(std::shared_ptr<Peers> peers, PushFn push, double idle_flush_s)
    : peers_(std::move(peers)), push_(std::move(push)), idle_flush_s_(idle_flush_s) {}

NodeCombiner::~NodeCombiner() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (pusher_.joinable()) pusher_.join();
}

void NodeCombiner::Enqueue(const std::string& name, Entry* entry, double timeout_s) {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    StartPusher();
    queue_.push_back({name, entry, timeout_s});
  }
  queue_cv_.notify_all();
}

void NodeCombiner::StartPusher() {
  if (pusher_.joinable()) return;
  pusher_ = std::thread([this] { PushLoop(); });
  pusher_started_.store(true, std::memory_order_release);
}

void NodeCombiner::PushLoop() {
  const auto idle = std::chrono::duration<double>(idle_flush_s_);
  for (;;) {
    Job job{"", nullptr, 0.0};
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait_for(lock, idle, [&] { return stopping_ || !queue_.empty(); });
      if (!queue_.empty()) {
        job = queue_.front();
        queue_.pop_front();
      } else if (stopping_) {
        return;
      }
    }
    Status pushed = job.entry != nullptr ? PushPending(job.name, *job.entry, job.timeout_s)
                                         : PushIdle();
    if (!pushed.ok()) {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (failure_.ok()) failure_ = pushed;
    }
  }
}

Status NodeCombiner::PushIdle() {
  std::vector<std::pair<std::string, Entry*>> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& named : entries_) entries.emplace_back(named.first, &named.second);
  }
  for (auto& [name, entry] : entries) {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (stopping_) return Status::Ok();
    }
    // Unchanged since the last look: nobody added, nobody pushed. (Read
    // first: the state is written, so its readers retry, only to claim.)
    auto idle = [&, entry = entry](const int64_t* w) {
      return !PushInFlight(w) && w[kCount] != 0 && w[kFetches] != 0 &&
             w[kCount] == entry->idle_count && w[kFetches] == entry->idle_fetches;
    };
    int64_t seen[kWords];
    SMB_RETURN_IF_ERROR(ReadState(*entry, seen));
    const bool was_idle = idle(seen);
    entry->idle_count = seen[kCount];
    entry->idle_fetches = seen[kFetches];
    if (!was_idle) continue;
    bool turn = false;
    SMB_RETURN_IF_ERROR(ChangeState(*entry, [&](int64_t* w) {
      turn = idle(w);
      if (turn) ClaimPush(w);
    }));
    if (turn) SMB_RETURN_IF_ERROR(PushPending(name, *entry, timeout_s_.load()));
  }
  return Status::Ok();
}

Status NodeCombiner::BackgroundFailure() {
  std::lock_guard<std::mutex> lock(queue_mu_);
  return failure_;
}

Status NodeCombiner::Find(const std::string& name, DType dtype,
                          const std::vector<int64_t>& shape, Entry** entry) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    Entry made{dtype, shape, {}, {}, {}, {}, 0};
    Box* box = peers_->box();
    uint64_t key = 0;
    SMB_RETURN_IF_ERROR(box->CreateSegment(name + "@pending", dtype, shape, &key));
    SMB_RETURN_IF_ERROR(box->AttachSegment(key, dtype, shape, &made.pending));
    SMB_RETURN_IF_ERROR(box->CreateSegment(name + "@cache", dtype, shape, &key));
    SMB_RETURN_IF_ERROR(box->AttachSegment(key, dtype, shape, &made.cache));
    SMB_RETURN_IF_ERROR(box->CreateSegment(name + "@fetched", dtype, shape, &key));
    SMB_RETURN_IF_ERROR(box->AttachSegment(key, dtype, shape, &made.fetched));
    SMB_RETURN_IF_ERROR(box->CreateSegment(name + "@combine", DType::kInt64, {kWords}, &key));
    SMB_RETURN_IF_ERROR(box->AttachSegment(key, DType::kInt64, {kWords}, &made.state));
    it = entries_.emplace(name, std::move(made)).first;
  }
  if (it->second.dtype != dtype || it->second.shape != shape) {
    return InvalidArgument("box segment '" + name + "' is combined as another dtype or shape");
  }
  *entry = &it->second;
  return Status::Ok();
}

Status NodeCombiner::ChangeState(const Entry& entry,
                                 const std::function<void(int64_t* words)>& change) {
  return WriteSegment(entry.state, [&](size_t, size_t) {
    change(static_cast<int64_t*>(entry.state.data));
  });
}

Status NodeCombiner::ReadState(const Entry& entry, int64_t* words) {
  return ReadSegment(entry.state, words, ReadMode::kConsistent);
}

bool NodeCombiner::PushInFlight(const int64_t* words) const {
  // A rank that died pushing took its sum with it; the others push on.
  return words[kPushing] != 0 && !peers_->Gone(static_cast<int>(words[kPushing] - 1));
}

Status NodeCombiner::Push(const std::string& name, DType dtype,
                          const std::vector<int64_t>& shape, const UpdateOptions& options,
                          const void* update, double learning_rate, double timeout_s) {
  Entry* entry = nullptr;
  SMB_RETURN_IF_ERROR(Find(name, dtype, shape, &entry));
  timeout_s_.store(timeout_s);
  if (!pusher_started_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(queue_mu_);
    StartPusher();  // its idle pushes cover this update too
  }
  const size_t element = DTypeSize(dtype);
  Status applied;
  Status added = WriteSegment(entry->pending, [&](size_t offset, size_t bytes) {
    // pending += update (kDelta), or pending -= learning_rate * update (kSgd)
    if (!applied.ok()) return;
    applied = ApplyRule(options, dtype, static_cast<char*>(entry->pending.data) + offset,
                        nullptr, static_cast<const char*>(update) + offset, learning_rate,
                        bytes / element);
  });
  SMB_RETURN_IF_ERROR(added);
  SMB_RETURN_IF_ERROR(applied);
  bool turn = false;
  SMB_RETURN_IF_ERROR(ChangeState(*entry, [&](int64_t* w) {
    w[kAdded] |= int64_t{1} << peers_->rank();
    ++w[kCount];
    // The node's first push goes at once: until a push fetched it, the node
    // has no copy to read.
    turn = !PushInFlight(w) && (w[kCount] >= peers_->world() || w[kFetches] == 0);
    if (turn) ClaimPush(w);
  }));
  if (turn) Enqueue(name, entry, timeout_s);
  return BackgroundFailure();
}

void NodeCombiner::ClaimPush(int64_t* words) const {
  words[kAdded] = 0;
  words[kCount] = 0;
  words[kPushing] = peers_->rank() + 1;
}

Status NodeCombiner::PushPending(const std::string& name, Entry& entry, double timeout_s) {
  const size_t bytes = entry.pending.bytes;
  Scratch sum_buffer(0, bytes), fresh_buffer(1, bytes);
  char* sum = sum_buffer.data();
  char* fresh = fresh_buffer.data();
  Status taken = ChangeState(entry, [](int64_t* w) {
    w[kMoving] = 1;
    ++w[kMoves];
  });
  if (taken.ok()) taken = WriteSegment(entry.pending, [&](size_t offset, size_t n) {
    char* p = static_cast<char*>(entry.pending.data) + offset;
    std::memcpy(sum + offset, p, n);
    std::memset(p, 0, n);
  });
  // Readers take copy + pending: the sum moves into the copy until the home's
  // value replaces it, so no read misses it meanwhile, nor counts it twice
  // (kMoving, kMoves).
  if (taken.ok()) {
    taken = WriteSegment(entry.cache, [&](size_t offset, size_t n) {
      // kDelta adds any dtype: nothing to fail
      (void)ApplyRule({UpdateRule::kDelta}, entry.dtype,
                      static_cast<char*>(entry.cache.data) + offset, nullptr,
                      sum + offset, 0.0, n / DTypeSize(entry.dtype));
    });
  }
  Status moved = ChangeState(entry, [](int64_t* w) { w[kMoving] = 0; });
  if (taken.ok()) taken = moved;
  Status pushed = taken;
  if (pushed.ok()) pushed = push_(name, entry.dtype, entry.shape, sum, fresh, timeout_s);
  if (pushed.ok()) pushed = AssignSegment(entry.fetched, fresh);
  if (pushed.ok()) pushed = AssignSegment(entry.cache, fresh);
  Status released = ChangeState(entry, [&](int64_t* w) {
    w[kPushing] = 0;
    if (pushed.ok()) ++w[kFetches];
  });
  return pushed.ok() ? released : pushed;
}

Status NodeCombiner::Read(const std::string& name, DType dtype,
                          const std::vector<int64_t>& shape, ReadMode mode, void* dst,
                          double timeout_s, bool* taken) {
  *taken = false;
  Entry* entry = nullptr;
  SMB_RETURN_IF_ERROR(Find(name, dtype, shape, &entry));
  int64_t w[kWords];
  // Updates of this node on their way before its first fetch: no copy holds
  // them yet, nor (surely) the home; the push brings one.
  SMB_RETURN_IF_ERROR(PollUntil(
      timeout_s, std::chrono::microseconds(100),
      "waiting for this node's first push of segment", name, [&](bool* done) {
        SMB_RETURN_IF_ERROR(BackgroundFailure());
        SMB_RETURN_IF_ERROR(ReadState(*entry, w));
        *done = w[kFetches] != 0 || !PushInFlight(w);
        return Status::Ok();
      }));
  {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t fetches = static_cast<uint64_t>(w[kFetches]);
    const bool fresh = fetches != entry->last_read_fetch;
    const bool mine_pending = (w[kAdded] & (int64_t{1} << peers_->rank())) != 0;
    if (fetches == 0 || !(fresh || mine_pending || PushInFlight(w))) return Status::Ok();
    entry->last_read_fetch = fetches;
  }
  Scratch pending_buffer(0, entry->pending.bytes);
  char* pending = pending_buffer.data();
  // A move under way by a live rank: wait it out; then read, and again if one
  // started meanwhile.
  auto moving = [&] { return w[kMoving] != 0 && PushInFlight(w); };
  SMB_RETURN_IF_ERROR(PollUntil(
      timeout_s, std::chrono::microseconds(0),
      "reading this node's copy of segment", name, [&](bool* done) {
        if (!moving()) {
          const int64_t moves = w[kMoves];
          SMB_RETURN_IF_ERROR(ReadSegment(entry->cache, dst, mode));
          SMB_RETURN_IF_ERROR(ReadSegment(entry->pending, pending, mode));
          SMB_RETURN_IF_ERROR(ReadState(*entry, w));
          *done = w[kMoves] == moves && !moving();
          return Status::Ok();
        }
        return ReadState(*entry, w);
      }));
  SMB_RETURN_IF_ERROR(
      ApplyRule({UpdateRule::kDelta}, dtype, dst, nullptr, pending, 0.0, Elements(entry->pending)));
  *taken = true;
  return Status::Ok();
}

Status NodeCombiner::FlushAll(double timeout_s) {
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& named : entries_) names.push_back(named.first);
  }
  for (const std::string& name : names) {
    Entry* entry = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      entry = &entries_.at(name);
    }
    SMB_RETURN_IF_ERROR(PollUntil(
        timeout_s, std::chrono::microseconds(200),
        "waiting for another rank of this node to finish pushing the node's updates of "
        "segment",
        name,
        [&](bool* done) {
          bool turn = false, waiting = false;
          SMB_RETURN_IF_ERROR(ChangeState(*entry, [&](int64_t* w) {
            waiting = PushInFlight(w);
            turn = !waiting && w[kCount] != 0;
            if (turn) ClaimPush(w);
          }));
          if (turn) SMB_RETURN_IF_ERROR(PushPending(name, *entry, timeout_s));
          *done = !waiting;
          return Status::Ok();
        }));
  }
  return BackgroundFailure();
}

void NodeCombiner::ForgetReads() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& named : entries_) {
    int64_t w[kWords];
    if (ReadState(named.second, w).ok()) {
      named.second.last_read_fetch = static_cast<uint64_t>(w[kFetches]);
    }
  }
}

bool NodeCombiner::LastFetched(const std::string& name, std::vector<char>* value) {
  Entry* entry = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(name);
    if (it == entries_.end()) return false;
    entry = &it->second;
  }
  int64_t w[kWords];
  if (!ReadState(*entry, w).ok() || w[kFetches] == 0) return false;
  value->resize(entry->fetched.bytes);
  return ReadSegment(entry->fetched, value->data(), ReadMode::kConsistent).ok();
}

}  // namespace smb
