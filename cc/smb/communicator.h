// One rank's handle on its job's collectives: a Group of peers (any
// transport), the collective algorithms run over it, and the asynchronous
// mode's step clock. This is what the framework adapters (cc/kernels/ for
// TensorFlow, cc/python/ for pybind) use.
//
//   smb::Communicator::Options o;
//   o.job_id = "job42"; o.rank = rank; o.world = 2;
//   std::unique_ptr<smb::Communicator> comm;
//   SMB_RETURN_IF_ERROR(smb::Communicator::Open(o, &comm));   // processes, one box
//   SMB_RETURN_IF_ERROR(comm->AllReduceSum({{DType::kFloat32, {n}, in, out}}));
//
//   smb::ThreadGroup threads(3);                                // or threads
//   auto comm = smb::Communicator::Create(threads.Join(r), /*timeout_s=*/60);
//
// Collectives are collective: every rank makes the same calls in the same
// order, one thread at a time (CollectiveScheduler's thread in the TF layer,
// which also agrees that order with the other ranks). The clock's calls and
// set_timeout may come from other threads: they touch only atomics.
#ifndef TF_SMB_CC_SMB_COMMUNICATOR_H_
#define TF_SMB_CC_SMB_COMMUNICATOR_H_

#include <memory>
#include <string>
#include <vector>

#include "cc/smb/algorithms/partitioned_allreduce.h"
#include "cc/smb/box.h"
#include "cc/smb/clock.h"
#include "cc/smb/defaults.h"
#include "cc/smb/group.h"
#include "cc/smb/segment/segment_table.h"
#include "cc/smb/status.h"
#include "cc/smb/tensor.h"

namespace smb {

class Communicator {
 public:
  struct Options {
    std::string job_id;
    int rank = 0;
    int world = 1;
    // Every wait fails after this long, naming the ranks that did not arrive.
    double timeout_s = kDefaultTimeoutS;
    // Create the box (rank 0 when no launcher made it); others attach.
    bool create = false;
    size_t staging_bytes = kDefaultStagingBytes;
    size_t heap_bytes = kDefaultHeapBytes;
    // The job spans nodes: MPI (transport/mpi_transport.h) finds each rank's node,
    // each node's local rank 0 creates the node's box (`create` is ignored),
    // and the nodes are joined through MPI.
    bool across_nodes = false;
    // With across_nodes: the job ranks this communicator joins (a process set
    // spanning nodes; `rank` and `world` count within it); empty: the job.
    std::vector<int> members;
  };

  // The processes of one node, through the job's box (world 1: no box), and
  // with across_nodes the boxes of several nodes.
  static Status Open(const Options& options, std::unique_ptr<Communicator>* out);
  // Any transport's peers (see peers.h), and other nodes through `link`.
  static std::unique_ptr<Communicator> Create(std::shared_ptr<Peers> peers, double timeout_s,
                                              std::shared_ptr<NodeLink> link = nullptr);

  // Only Open() and Create() can make the token: use them.
  class Token {
    friend class Communicator;
    Token() = default;
  };
  Communicator(Token, std::shared_ptr<Peers> peers, std::shared_ptr<NodeLink> link,
               double timeout_s);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // out = sum over ranks of in, for every tensor (any mix of dtypes).
  Status AllReduceSum(const std::vector<TensorRef>& tensors);
  // The sums may stay in a result buffer every rank reads: see
  // algorithms/partitioned_allreduce.h.
  Status AllReduceSumShared(std::vector<TensorRef> tensors, OpContext* context,
                            std::vector<void*>* sums, std::shared_ptr<ResultHold>* hold);
  // out = root's in, for every tensor.
  Status Broadcast(int root, const std::vector<TensorRef>& tensors);
  // Every rank of the group arrives (pushes combined per node go home first).
  Status Barrier();
  // The collective that ends a join (CollectiveScheduler::SubmitJoin), once
  // every rank has joined: no rank takes part for another any more, and
  // *last_rank is the job rank that joined last.
  Status FinishJoin(int* last_rank);

  Group& group() { return group_; }
  StepClock& clock() { return clock_; }
  // The job's rank and size (group().rank() and world() are this node's).
  int rank() const { return group_.job_rank(); }
  int world() const { return group_.job_world(); }
  // The node's box (segments for the asynchronous mode); null for world 1
  // and for transports without one.
  bool across_nodes() const { return group_.link() != nullptr; }
  // The asynchronous mode's segments (null without a box): in this node's
  // box, or across nodes on their home node's.
  SegmentTable* segments() const { return segments_.get(); }
  // The timeout of every wait.
  double timeout_s() const { return group_.timeout_s(); }
  Box* box() const { return group_.peers() ? group_.peers()->box() : nullptr; }
  void set_timeout(double seconds) { group_.set_timeout(seconds); }
  // This rank leaves the job (Peers::Leave: kLeftFinished, kLeftRaised, kLeftRejoined).
  void Leave(int how) {
    if (group_.peers() != nullptr) group_.peers()->Leave(how);
  }

 private:
  static Status OpenAcrossNodes(const Options& options, std::unique_ptr<Communicator>* out);

  Group group_;
  StepClock clock_;
  std::shared_ptr<SegmentTable> segments_;  // shared with the link's memory server
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_COMMUNICATOR_H_
