// The ranks a collective runs among, as one rank sees them: their control
// words, staging buffers and shared heap, and whether a peer is gone. The
// agreement and failure logic (group.h), the collective algorithms
// (algorithms/) and the step clock (clock.h) are written against this alone;
// each transport implements it:
//   transport/shm_peers.h     the processes of one node, through the box
//   transport/thread_peers.h  the threads of one process, in plain memory
// (a transport between nodes, over MPI, fits in the same way).
//
// The control words live in memory every rank maps (GroupControl); ranks
// wait for each other with futex waits on `wake`, which work on shared and
// on private memory alike.
#ifndef TF_SMB_CC_SMB_PEERS_H_
#define TF_SMB_CC_SMB_PEERS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "cc/smb/status.h"

namespace smb {

class Box;

constexpr int kMaxWorld = 128;
// One collective's description per rank: 14-25 bytes a tensor, so 300-500
// tensors fit (a joined rank reads a collective's tensors from it).
constexpr size_t kDescBytes = 8192;
constexpr int kMaxResults = 8;       // all-reduce result buffers in the heap
constexpr int kMaxPending = 256;     // collectives one rank may have waiting to run
// How a rank left the job (Peers::Left).
constexpr int kLeftFinished = 1;  // its program ended (returned, exited)
constexpr int kLeftRaised = 2;    // its program ended with an uncaught error
constexpr int kLeftRejoined = 3;  // it joined the job's next generation (elastic training)

// One rank's control words. Cache-line aligned so ranks do not false-share.
struct alignas(64) RankControl {
  std::atomic<uint64_t> arrive_seq;  // barrier generation this rank reached
  // Asynchronous mode: training steps this rank has started, and its training
  // phase (see StepClock: odd once it finished a round of training, which
  // then no longer holds the others back).
  std::atomic<uint64_t> clock;
  std::atomic<uint64_t> phase;
  // Rank 0's choice of result buffer for a collective (-1: none), by parity.
  std::atomic<int32_t> result_choice[2];
  // What this rank is about to do, double-buffered by the collective's parity
  // so a fast rank never overwrites a description a slow rank still reads.
  char desc[2][kDescBytes];
  // Keys (hashes) of the collectives this rank has submitted and not yet run,
  // oldest first: rank 0 picks the next collective among them (see
  // CollectiveScheduler). Only this rank writes them.
  std::atomic<uint32_t> pending_count;
  std::atomic<uint64_t> pending[kMaxPending];
  // Non-zero while this rank has joined (Horovod's join: it ran out of data
  // and takes part in the others' collectives with zeros): the group's join
  // count when it joined, so the last to join has the largest.
  std::atomic<uint64_t> joined;
};

// Heap memory that holds all-reduce sums every rank reads in place (see
// AllReduceSumShared). Rank 0 hands out a buffer only when no rank holds it.
struct alignas(64) ResultBuffer {
  uint64_t offset;  // from Peers::base(); 0 until first used
  uint64_t bytes;
  std::atomic<int32_t> holders;  // ranks whose outputs still point into it
};

// The control words of a group of ranks, zero-initialised.
struct GroupControl {
  std::atomic<uint32_t> wake;       // futex word bumped on every arrival
  std::atomic<uint32_t> aborted;    // non-zero once a rank failed for good
  std::atomic<int32_t> abort_code;  // the smb::Code of that failure
  char abort_reason[512];
  // Rank 0's choice of the group's n-th collective: decision_key[n % 2] is
  // valid once decision_seq[n % 2] == n + 1 (two slots: rank 0 is never more
  // than one collective ahead of the slowest rank).
  std::atomic<uint64_t> decision_seq[2];
  std::atomic<uint64_t> decision_key[2];
  std::atomic<uint64_t> joins;  // ranks that ever joined (RankControl::joined)
  ResultBuffer results[kMaxResults];
  // Nodes of different sizes: what local rank 0 learned in an exchange across
  // nodes, for the node's ranks that take no part in it (Group::Relay), by
  // the exchange's parity (written before a barrier, read after it).
  struct RelaySlot {
    int32_t code;  // an smb::Code
    uint32_t flag;
    uint32_t len;
    char text[kDescBytes];
  } relay[2];
  RankControl ranks[kMaxWorld];
};

class Peers {
 public:
  virtual ~Peers() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  virtual GroupControl* control() const = 0;
  // Staging buffer `buffer` (0 or 1) of rank `rank`, staging_bytes() long.
  virtual char* staging(int buffer, int rank) const = 0;
  virtual size_t staging_bytes() const = 0;
  // Memory every rank addresses by offset from base(), for result buffers;
  // it never shrinks.
  virtual char* base() const = 0;
  virtual Status AllocateShared(uint64_t bytes, const std::string& what,
                                uint64_t* offset) = 0;
  // True once rank r is gone for good (its process died or exited, its
  // thread left the group).
  virtual bool Gone(int rank) const = 0;
  // What runs rank r, as errors name it: "pid 123" or "thread".
  virtual std::string Identity(int rank) const = 0;
  // How rank r left the job, while its process may still be exiting: 0 not
  // (or not known: killed, or a transport without the word), kLeftFinished
  // once its program ended normally, kLeftRaised once it ended with an error.
  virtual int Left(int rank) const { return 0; }
  // Marks this rank as having left the job (kLeftFinished, kLeftRaised or kLeftRejoined) and
  // wakes the ranks that wait, so one waiting for it fails at once, saying so.
  virtual void Leave(int how) {}
  // The node's box (segment table for the asynchronous mode), if any.
  virtual Box* box() const { return nullptr; }
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_PEERS_H_
