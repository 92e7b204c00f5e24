// Collectives through the box. All-reduce is partitioned: rank r sums slice r
// of every chunk, reading its own slice straight from its input and the other
// ranks' slices from their staging buffers (each rank stages only what the
// others sum). The sums then either go back to every rank's output
// (AllReduceSum) or stay in a result buffer of the box that every rank reads
// in place (AllReduceSumShared: no copy out). Tensors larger than the staging
// buffer go through in chunks, double-buffered, so the box stays small.
//
//   smb::Communicator::Options o;
//   o.job_id = "job42"; o.rank = rank; o.world = 2;
//   std::unique_ptr<smb::Communicator> comm;
//   SMB_RETURN_IF_ERROR(smb::Communicator::Open(o, &comm));
//   SMB_RETURN_IF_ERROR(comm->AllReduceSum({{DType::kFloat32, {n}, in, out}}));
//
// Calls are collective: every rank makes the same calls in the same order.
// Collectives are made from one thread at a time (CollectiveScheduler's
// thread in the TF layer, which also agrees the order with the other ranks);
// the clock calls (ClockTick, ClockFinish, WaitAllFinished) and set_timeout
// may come from other threads, since they touch only atomics in the box.
#ifndef TF_SMB_CC_SMB_COMMUNICATOR_H_
#define TF_SMB_CC_SMB_COMMUNICATOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cc/smb/box.h"
#include "cc/smb/dtype.h"
#include "cc/smb/status.h"

namespace smb {

// A tensor taking part in a collective: `in` is read, `out` written (they may
// be the same buffer). Both hold NumElements(shape) elements of dtype.
struct TensorRef {
  DType dtype;
  std::vector<int64_t> shape;
  const void* in;
  void* out;
};

// One rank's hold on a result buffer of the box. The buffer is not reused
// while any rank holds it; the hold ends when this object is destroyed.
class ResultHold {
 public:
  ResultHold(std::shared_ptr<Box> box, int buffer) : box_(std::move(box)), buffer_(buffer) {}
  ~ResultHold();
  ResultHold(const ResultHold&) = delete;
  ResultHold& operator=(const ResultHold&) = delete;

 private:
  std::shared_ptr<Box> box_;  // keeps the mapping alive while sums are read
  int buffer_;
};

class Communicator {
 public:
  struct Options {
    std::string job_id;
    int rank = 0;
    int world = 1;
    // Every wait fails after this long, naming the ranks that did not arrive.
    double timeout_s = 600.0;
    // Create the box (rank 0 when no launcher made it); others attach.
    bool create = false;
    size_t staging_bytes = kDefaultStagingBytes;
    size_t heap_bytes = size_t{4} << 30;
  };

  static Status Open(const Options& options, std::unique_ptr<Communicator>* out);
  // Only Open() can make the key: use it.
  class Key {
    friend class Communicator;
    Key() = default;
  };
  Communicator(Key, const Options& options, std::shared_ptr<Box> box);
  ~Communicator();

  // out = sum over ranks of in, for every tensor (any mix of dtypes).
  Status AllReduceSum(const std::vector<TensorRef>& tensors);
  // Like AllReduceSum, but when rank 0 finds a free result buffer (and the
  // tensors are large enough to gain from it), the sums stay in the box:
  // (*sums)[i] is tensor i's sum, 64-byte aligned, the same memory on every
  // rank, valid and unchanged while *hold lives. Else *hold is null, and the
  // sums go to the `out` pointers that bind_outputs sets first (only then is
  // it called, so callers allocate outputs only when they are needed).
  using OutputBinder = std::function<Status(std::vector<TensorRef>*)>;
  Status AllReduceSumShared(std::vector<TensorRef> tensors,
                            const OutputBinder& bind_outputs,
                            std::vector<void*>* sums,
                            std::shared_ptr<ResultHold>* hold);
  // out = root's in, for every tensor.
  Status Broadcast(int root, const std::vector<TensorRef>& tensors);
  Status Barrier();

  // Asynchronous mode (stale-synchronous parallel). ClockTick starts this
  // rank's next step, first waiting while it would be more than `staleness`
  // steps ahead of the slowest rank that is alive and not finished
  // (staleness < 0: never wait). *gap is how far ahead it then is.
  Status ClockTick(int64_t staleness, int64_t* gap);
  // Finished ranks no longer hold the others back; Resume undoes Finish.
  void ClockFinish();
  void ClockResume();
  // Waits until every rank that is alive has finished.
  Status WaitAllFinished();

  // ---- Which collective runs next (see CollectiveScheduler) ----
  // Publishes the keys of the collectives this rank has waiting, oldest first
  // (at most kMaxPending), and wakes the other ranks.
  void PublishPending(const std::vector<uint64_t>& keys);
  // True once the job's next collective is chosen, with its key: rank 0
  // chooses the oldest of `mine` (its waiting keys) that every rank has
  // published; the others read rank 0's choice. False: not yet, wait.
  bool NextCollective(const std::vector<uint64_t>& mine, uint64_t* key);
  // The ranks that have not published `key`, e.g. "1, 2".
  std::string RanksWithout(uint64_t key) const;
  // The first rank found dead, or -1.
  int DeadRank() const;
  // The box's wake word and a wait on it: WaitForChange(WakeWord(), s)
  // returns when anything in the box changes, or after s seconds.
  uint32_t WakeWord() const;
  void WaitForChange(uint32_t seen, double seconds) const;
  // Wakes every rank's waiters (something this rank publishes changed).
  void Poke();

  // Stops the job's collectives for good: every rank's current and later
  // collectives fail with this error (the first failure wins). Called after
  // any failed collective, so no rank ever pairs later collectives wrongly.
  Status Fail(const Status& failure);
  // OK while the job runs; the failure that stopped it afterwards.
  Status JobFailure() const;

  int rank() const { return rank_; }
  int world() const { return world_; }
  double timeout_s() const { return timeout_s_.load(std::memory_order_relaxed); }
  Box* box() const { return box_.get(); }
  // Below this many bytes the sums are copied out: a result buffer gains
  // nothing for small collectives.
  static constexpr size_t kSharedMinBytes = size_t{256} << 10;
  void set_timeout(double seconds) { timeout_s_.store(seconds, std::memory_order_relaxed); }

 private:
  // Arrive at the next barrier and wait for every rank to arrive too.
  Status Sync(const std::string& what);
  // Publish `desc`, sync, and fail on every rank alike if any rank disagrees.
  Status Agree(const std::string& op, const std::string& desc);
  Status Abort(Code code, const std::string& reason);
  // Waits until done() holds, re-checking on every wake of the box; fails on
  // abort or after the timeout, naming the ranks that `lagging()` lists.
  template <typename Done, typename Lagging>
  Status WaitUntil(const std::string& what, Done done, Lagging lagging);
  bool RankGone(int r) const;
  // The partitioned reduction of tensors that passed Agree(); with
  // `shared_out` the outputs are in a result buffer every rank reads.
  Status ReduceChunks(const std::vector<TensorRef>& tensors, bool shared_out);
  // Rank 0: a free result buffer of at least `bytes`, now held by every rank;
  // -1 when none is free or the heap is full.
  int TakeResultBuffer(size_t bytes);
  Status AbortedStatus() const;

  std::shared_ptr<Box> box_;
  int rank_;
  int world_;
  std::atomic<double> timeout_s_;  // set_timeout may come from another thread
  uint64_t seq_ = 0;          // barriers passed
  uint64_t decided_ = 0;      // collectives whose turn NextCollective found
  uint64_t collectives_ = 0;  // Agree() calls, for descriptor parity
  uint64_t chunks_ = 0;       // chunks moved, for staging buffer parity
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_COMMUNICATOR_H_
