// The bandwidth-optimal all-reduce among a rank's counterparts (one rank on
// each node), built on a transport's point-to-point pair, Gloo-style: a
// reduce-scatter, then an all-gather, each node sending and receiving
// 2 (N - 1) / N of the data, the minimum. Three schedules of the same bytes:
//   * two nodes, at most kHalvingMaxBytes: one exchange of everything;
//   * for a power-of-two number of nodes and at most kHalvingMaxBytes,
//     recursive halving then doubling (as Open MPI's Rabenseifner): 2 log2 N
//     steps, each with one partner: fewer steps where latency counts;
//   * otherwise a ring: 2 (N - 1) steps, sending to the next node and
//     receiving from the previous one, in messages of 1/N of the data (the
//     halving's first are 1/2: measured slower on large all-reduces, ResNet-50's
//     gradients at 4 x 1, 1 Gbit/s, 1.17x the ring's time).
// Each block's sum is made on one node and passed on, so every node gets the
// same bits.
//
// A NodesAllReduce is a Transfer: the transport starts it and moves it on
// from Test (never blocking), so many run at once on the link's thread and
// the link stays busy while one waits for its next message.
#ifndef TF_SMB_CC_SMB_TRANSPORT_NODES_ALLREDUCE_H_
#define TF_SMB_CC_SMB_TRANSPORT_NODES_ALLREDUCE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "cc/smb/dtype.h"
#include "cc/smb/status.h"
#include "cc/smb/transport/transport.h"

namespace smb {

constexpr size_t kHalvingMaxBytes = size_t{2} << 20;

// Nonblocking sends and receives between this rank and its counterparts,
// addressed by node, kept apart from the transport's other messages. A
// message sent with a tag is received by the receive with the same tag; two
// with the same tag between the same pair arrive in the order sent.
class PointToPoint {
 public:
  virtual ~PointToPoint() = default;
  virtual int node() const = 0;
  virtual int nodes() const = 0;
  // The largest tag (at least 32767, as MPI promises). All-reduces' tags
  // repeat every max_tag / (2 nodes) of them: at least as many as run at once.
  virtual int max_tag() const = 0;
  // `data` stays valid (and unchanged) until the transfer finished.
  virtual Status StartSendTo(int node, int tag, const void* data, size_t bytes,
                             std::unique_ptr<Transfer>* out) = 0;
  // Exactly `bytes` into `data`; a message of another size is an error.
  virtual Status StartReceiveFrom(int node, int tag, void* data, size_t bytes,
                                  std::unique_ptr<Transfer>* out) = 0;
  // True when `transfer` finished, with *error its outcome.
  virtual bool TestTransfer(Transfer* transfer, Status* error) = 0;
};

class NodesAllReduce : public Transfer {
 public:
  // data = sum over nodes of data, `count` elements of `dtype`, in place.
  // `sequence`: this all-reduce's number, the same on every counterpart (they
  // are started in the same order on each): it keeps concurrent ones apart.
  NodesAllReduce(PointToPoint* link, uint64_t sequence, DType dtype, void* data, size_t count);

  // Posts the first step.
  Status Start();
  bool started() const { return started_; }
  // Moves on as far as the messages that arrived allow; true once finished,
  // with *error its outcome. Never waits.
  bool Progress(Status* error);
  // The steps (for tests): 2 log2 N or 2 (N - 1).
  size_t steps() const { return steps_.size(); }

 private:
  // One exchange: elements [send_at, send_at + send_count) to node `to`, and
  // [recv_at, recv_at + recv_count) from node `from`, summed in or copied.
  struct Step {
    int to, from;
    size_t send_at, send_count, recv_at, recv_count;
    bool sum;
  };
  void PlanRing();
  void PlanHalvingDoubling();
  // Posts step `step_`'s send and receive.
  Status Post();
  int Tag() const;

  PointToPoint* const link_;
  const uint64_t sequence_;
  const DType dtype_;
  const size_t elem_;
  char* const data_;
  const size_t count_;
  const int nodes_, node_;
  std::vector<Step> steps_;
  size_t step_ = 0;
  std::unique_ptr<Transfer> send_, receive_;
  bool sent_ = false, received_ = false;
  std::vector<char> incoming_;  // a reduce-scatter step's elements, before they are summed in
  Status error_;
  bool done_ = false;
  bool started_ = false;
};

// All-reduces started in order, at most `window` of them posted at a time:
// enough that the link is busy while one sums what arrived, few enough that
// they finish in the order started (the caller copies out each as it comes)
// and that a receive is posted before its message arrives.
class AllReduceQueue {
 public:
  explicit AllReduceQueue(int window) : window_(window) {}
  // Queues `op` (posted once fewer than `window` run); it stays alive until
  // Progress says it finished.
  void Add(NodesAllReduce* op);
  // Progress of `op` (a queued one); posts queued ones as others finish.
  bool Progress(NodesAllReduce* op, Status* error);

 private:
  Status PostQueued();
  const int window_;
  int running_ = 0;
  std::vector<NodesAllReduce*> queued_;  // in order; not yet posted
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_TRANSPORT_NODES_ALLREDUCE_H_
