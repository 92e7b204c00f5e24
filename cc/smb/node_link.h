// The job's other nodes, as one rank sees them. A job spans nodes of L_n ranks
// each (not necessarily equal); the ranks of a node meet in the node's box
// (peers.h), and local rank r < S = min L_n of every node is linked with local
// rank r of the others: a node-partial sum of slice r crosses the network once
// per node, in S streams at a time.
// Group (group.h) and the algorithms use this interface only; a transport
// implements it (link/transport_link.h, over any transport/transport.h:
// Open MPI's, or threads of one process in the C++ tests).
//
// Collectives here run among "my counterparts": the ranks with this local
// rank on every node, in the order the job's collectives are decided (see
// OfferCandidates), so they always match up.
#ifndef TF_SMB_CC_SMB_NODE_LINK_H_
#define TF_SMB_CC_SMB_NODE_LINK_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cc/smb/dtype.h"
#include "cc/smb/status.h"

namespace smb {

// A request from a rank on another node for a segment (the asynchronous
// mode's parameters) whose home is this node's box: see SegmentTable.
struct SegmentRequest {
  enum class Kind : int32_t { kCreate = 1, kRead = 2, kUpdate = 3 };
  Kind kind = Kind::kRead;
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  bool write = false;       // kCreate: the payload is the initial value
  bool consistent = true;   // kRead: seqlock read (else hogwild)
  int32_t rule = 0;         // kUpdate: an smb::UpdateRule
  bool read_back = false;   // kUpdate: the reply is the segment's value after it
  double learning_rate = 0;
  double momentum = 0;
};

// Serves one request (on the link's thread): the payload is the value or
// update; *reply gets what a read returns.
using SegmentServer = std::function<Status(const SegmentRequest& request, const void* payload,
                                           size_t payload_bytes, std::vector<char>* reply)>;

// A rank's training phase in the asynchronous mode: even while it trains,
// odd once it finished; each Finish or Resume moves it on by one, so a rank
// that trained again is never mistaken for one still in the round before.
constexpr bool PhaseFinished(uint64_t phase) { return (phase & 1) != 0; }
constexpr uint64_t RoundsFinished(uint64_t phase) { return phase / 2 + (phase & 1); }
constexpr uint64_t kPhaseDoneForGood = ~uint64_t{0};  // a lost rank: finished every round

// Another rank's step clock (the asynchronous mode), as last heard.
struct RemoteClock {
  int rank;
  uint64_t steps;
  uint64_t phase;  // StepClock's phase word (odd: finished)
};

// In an offer (NodeLink::OfferCandidates): this node takes any collective.
constexpr uint64_t kAnyCollective = ~uint64_t{0};

// An operation of the link in flight (see NodeLink::StartAllReduceSum).
class LinkOp {
 public:
  virtual ~LinkOp() = default;
};

class NodeLink {
 public:
  virtual ~NodeLink() = default;

  // ---- Where this rank sits ----
  virtual int node() const = 0;
  virtual int nodes() const = 0;
  virtual int local_rank() const = 0;
  virtual int local_size() const = 0;
  virtual int job_rank() const = 0;
  virtual int job_world() const = 0;
  // Ranks on node `node` (nodes may run different numbers).
  virtual int NodeSize(int node) const = 0;
  // Local ranks 0 .. streams() - 1 have a counterpart on every node: the
  // fewest ranks any node runs. Only they take part in the collectives below;
  // a larger node's other ranks learn the outcome through the box (Group).
  virtual int streams() const = 0;
  // The job rank of local rank `local` (< NodeSize(node)) on node `node`.
  virtual int JobRank(int node, int local) const = 0;
  // Where job rank `rank` sits.
  virtual void Locate(int rank, int* node, int* local) const = 0;

  // ---- Collectives among my counterparts (every wait ends after timeout_s,
  // or at once when the job fails) ----
  // data = sum over nodes of data, `count` elements of `dtype`, in place;
  // every node gets the same bits.
  virtual Status AllReduceSum(DType dtype, void* data, size_t count, double timeout_s) = 0;
  // The same, started now and finished by Wait(): several may be in flight
  // (they start in call order), so the next slice's node-local work overlaps
  // this one's network transfer. `data` must stay valid until Wait returns.
  virtual Status StartAllReduceSum(DType dtype, void* data, size_t count,
                                   std::shared_ptr<LinkOp>* op) = 0;
  virtual Status Wait(const std::shared_ptr<LinkOp>& op, double timeout_s) = 0;
  // out[n * bytes, (n + 1) * bytes) = node n's `in`.
  virtual Status AllGather(const void* in, size_t bytes, void* out, double timeout_s) = 0;
  // data = node `root`'s data.
  virtual Status Broadcast(void* data, size_t bytes, int root, double timeout_s) = 0;

  // ---- Which collective runs next, job-wide (node leaders, local rank 0) ----
  // The keys every rank of this node has waiting, oldest first. A node whose
  // every rank has joined (hvd.join) adds kAnyCollective: it takes part in
  // whatever the others run. Node 0's leader decides: the oldest key, in the
  // order of the first node that offers no kAnyCollective (node 0 while
  // any of its ranks trains), that every node offers or takes as any.
  virtual void OfferCandidates(const std::vector<uint64_t>& keys) = 0;
  // The next decided key, in decision order; false: none yet.
  virtual bool NextDecision(uint64_t* key) = 0;

  // ---- The memory server: segments homed on one node, used from all ----
  // Requests from other nodes go to `server` (null: refuse them).
  virtual void SetSegmentServer(SegmentServer server) = 0;
  // Sends `request` with `payload` to node `home` (served by the rank there
  // with this local rank) and waits for the reply, `reply_bytes` into `reply`.
  // kAborted: the server was lost, or (an update, a writing create) it may
  // have been counted lost, so it did not apply it; ask again (as
  // SegmentTable does) and another rank, or the same one, answers.
  virtual Status CallSegmentServer(int home, const SegmentRequest& request, const void* payload,
                                   size_t payload_bytes, void* reply, size_t reply_bytes,
                                   double timeout_s) = 0;

  // ---- The step clock across nodes ----
  // Tells the ranks of the other nodes this rank's steps and training phase.
  virtual void PublishClock(uint64_t steps, uint64_t phase) = 0;
  // What this rank heard from the ranks of the other nodes (a rank not heard
  // from yet is at step 0, training).
  virtual std::vector<RemoteClock> RemoteClocks() const = 0;

  // ---- Files for rank 0 (each rank's timeline at exit: nodes need share no
  // filesystem) ----
  // Sends `bytes` to job rank 0, after what this rank posted before and
  // before it leaves at exit.
  virtual void SendToRankZero(std::vector<char> bytes) = 0;
  // On rank 0: `receiver` gets what each other rank sends with
  // SendToRankZero (on the link's thread).
  virtual void SetRankZeroReceiver(std::function<void(int from, std::vector<char>)> receiver) = 0;

  // ---- Lost ranks (the asynchronous mode) ----
  // A rank of another node that sends nothing for a while is lost (its node
  // died or was cut off). By default that fails the job. After this call it
  // does not: the lost ranks count as finished, segment calls go to a live
  // rank of the home node, calls to a node whose every rank is lost fail at
  // once (SegmentTable then moves its segments), and only collectives across
  // nodes fail.
  virtual void KeepGoingWithoutLostRanks() = 0;
  // Whether every rank of `node` is lost.
  virtual bool NodeLost(int node) const = 0;

  // ---- Failure ----
  // Tells every other rank of the job that the job failed.
  virtual void SendFailure(const Status& failure) = 0;
  // `failed` runs (on the link's thread) when another rank's failure
  // arrives; `wake` whenever something arrived that a waiter may want
  // (a decision); waits also end early when `local_failure` is not OK.
  // Each may be called until SetCallbacks replaces it.
  virtual void SetCallbacks(std::function<void(const Status&)> failed,
                            std::function<void()> wake,
                            std::function<Status()> local_failure) = 0;
  // Why the job failed (another rank's failure or a link error); OK while it runs.
  virtual Status Failure() const = 0;

  // ---- Leaving ----
  // Tells the others this rank leaves, keeps serving its segments until
  // every other rank has left too (or is lost), then ends the link's thread
  // and the transport. Runs at process exit for every link; a test calls it
  // to end links whose transport it is about to take down.
  virtual void Stop() = 0;
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_NODE_LINK_H_
