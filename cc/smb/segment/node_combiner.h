// Across nodes, the asynchronous mode's pushes to a segment homed on another
// node, combined in this node's box: each local rank adds its update to the
// node's pending sum (`<name>@pending`) and goes on; one push a round carries
// the sum to the home, and its reply (the segment's value after it) becomes
// the node's copy (`<name>@cache`), which the node's ranks read, with the
// pending sum added, instead of each fetching the segment across the link.
// So the link carries one push and one fetch per node per round of steps,
// not one per worker. The reply is kept as it came too (`<name>@fetched`):
// the copy also holds the sum on the wire (below), and a segment whose home
// is lost restarts from the reply, to which the push, retried at the new
// home, adds that sum once (SegmentTable::MoveFromLostNodes).
//
// Who pushes: the first update of the node (which brings the node its first
// copy), then the rank whose update makes as many updates since the last
// push as the node has ranks (one a rank in step; a rank a slower one lags
// behind pushes every few of its own steps: it is never held back). One push
// per segment is in flight at a time; updates meanwhile wait for the next.
//
// The push runs on the combiner's own thread, so the rank whose turn it is
// goes on computing while the sum is on the wire (its next read takes the
// node's copy, which holds the sum already); an error there comes back from
// the next call.
//
// Nothing is lost: an update is in the pending sum, in the push in flight, or
// at the home. FlushAll pushes what is pending (a rank that finishes
// training calls it, so the others read everything once all finished). Nor
// does an update wait for the next: a sum that sat unchanged, with no push
// in flight, for `idle_flush_s` is pushed by any of the node's ranks' threads
// (a node whose ranks stopped pushing, or one that died after adding).
// Reads: a rank takes the node's copy when another rank fetched it since
// this rank's last read, or while an update of its own is pending or in
// flight; otherwise it fetches the segment itself (a rank reading alone, as
// in evaluation, always sees the home's current value).
//
// Only rules that add up are combined: kDelta, and kSgd as the delta
// -learning_rate * gradient. kMomentum keeps one push per update (its
// velocity changes per push).
#ifndef TF_SMB_CC_SMB_SEGMENT_NODE_COMBINER_H_
#define TF_SMB_CC_SMB_SEGMENT_NODE_COMBINER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cc/smb/box.h"
#include "cc/smb/peers.h"
#include "cc/smb/segment/segment_io.h"
#include "cc/smb/segment/updaters.h"
#include "cc/smb/status.h"

namespace smb {

class NodeCombiner {
 public:
  // Applies `delta` at the segment's home and fills `fresh` with the
  // segment's value right after it.
  using PushFn = std::function<Status(const std::string& name, DType dtype,
                                      const std::vector<int64_t>& shape, const void* delta,
                                      void* fresh, double timeout_s)>;

  static constexpr double kIdleFlushS = 0.05;

  // `peers`: this node's ranks (with the box); `push` carries a round's sum.
  NodeCombiner(std::shared_ptr<Peers> peers, PushFn push, double idle_flush_s = kIdleFlushS);
  ~NodeCombiner();
  NodeCombiner(const NodeCombiner&) = delete;
  NodeCombiner& operator=(const NodeCombiner&) = delete;

  static bool Combines(const UpdateOptions& options) {
    return options.rule == UpdateRule::kDelta || options.rule == UpdateRule::kSgd;
  }

  // Adds `update` (as Updater::Apply takes it) to the node's pending sum of
  // segment `name`, and pushes the sum when this rank's turn (see the top).
  Status Push(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
              const UpdateOptions& options, const void* update, double learning_rate,
              double timeout_s);
  // dst = the node's copy plus the pending sum, when this rank may take it
  // (*taken; see the top); else *taken is false and the caller fetches.
  Status Read(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
              ReadMode mode, void* dst, double timeout_s, bool* taken);
  // Pushes every segment's pending sum (waiting for a push in flight first).
  Status FlushAll(double timeout_s);
  // This rank's next reads fetch from the home until another rank pushes.
  void ForgetReads();
  // The segment's value as the node's last push fetched it (without the sum
  // of a push in flight); false when none was.
  bool LastFetched(const std::string& name, std::vector<char>* value);

 private:
  struct Entry {
    DType dtype;
    std::vector<int64_t> shape;
    Segment pending, cache, fetched, state;
    uint64_t last_read_fetch = 0;  // the node's fetch count at this rank's last read
    // The pushing thread's last look (PushIdle): kCount and kFetches.
    int64_t idle_count = 0, idle_fetches = -1;
  };
  // The state segment's words, changed under its stripe lock.
  // kAdded: the ranks (bits) with updates pending; kCount: how many updates;
  // kPushing: 1 + the local rank pushing; kFetches: pushes done (each fetched);
  // kMoving: 1 while the push moves the pending sum into the copy, and
  // kMoves counts such moves: readers of copy + pending retry when one
  // overlapped their read (a flag, not a parity: a rank that died moving
  // leaves it set until the next push, which readers then need not wait for).
  enum Word { kAdded = 0, kPushing, kFetches, kCount, kMoving, kMoves, kWords = 8 };

  Status Find(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
              Entry** entry);
  // Runs `change(words)` under the state segment's lock.
  Status ChangeState(const Entry& entry, const std::function<void(int64_t* words)>& change);
  Status ReadState(const Entry& entry, int64_t* words);
  // Whether a push marked in flight by local rank `words[kPushing] - 1` is
  // still owned by a live rank.
  bool PushInFlight(const int64_t* words) const;
  // Marks the push as this rank's (state lock held).
  void ClaimPush(int64_t* words) const;
  // Takes the pending sum and pushes it (this rank claimed the push).
  Status PushPending(const std::string& name, Entry& entry, double timeout_s);
  // Hands a claimed push to the pushing thread.
  void Enqueue(const std::string& name, Entry* entry, double timeout_s);
  void StartPusher();  // queue_mu_ held
  void PushLoop();
  // Pushes the sums that sat unchanged since the last look (see the top).
  Status PushIdle();
  Status BackgroundFailure();

  std::shared_ptr<Peers> peers_;
  PushFn push_;
  const double idle_flush_s_;
  std::atomic<double> timeout_s_{0.0};  // the latest Push's, for idle pushes
  std::mutex mu_;
  std::map<std::string, Entry> entries_;  // map: entries stay where they are

  struct Job {
    std::string name;
    Entry* entry;
    double timeout_s;
  };
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Job> queue_;       // queue_mu_
  bool stopping_ = false;       // queue_mu_
  Status failure_;              // queue_mu_: the first failed push
  std::thread pusher_;          // started with the first push
  std::atomic<bool> pusher_started_{false};
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_SEGMENT_NODE_COMBINER_H_
