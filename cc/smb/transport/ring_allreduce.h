// The bandwidth-optimal all-reduce among a rank's counterparts (one rank on
// each node), built on a transport's point-to-point pair, Gloo-style: a
// reduce-scatter around the ring of nodes, then an all-gather. Each node
// sends and receives 2 (N - 1) / N of the data, the minimum, in 2 (N - 1)
// steps; node n sums block n + 1 (every node's part of it, in ring order)
// and passes the sum on, so every node gets the same bits.
//
// A RingAllReduce is a Transfer: the transport starts it and moves it on
// from Test (never blocking), so many run at once on the link's thread and
// the link stays busy while one waits for its next message.
#ifndef TF_SMB_CC_SMB_TRANSPORT_RING_ALLREDUCE_H_
#define TF_SMB_CC_SMB_TRANSPORT_RING_ALLREDUCE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "cc/smb/dtype.h"
#include "cc/smb/status.h"
#include "cc/smb/transport/transport.h"

namespace smb {

// Nonblocking sends and receives between this rank and its counterparts,
// addressed by node, kept apart from the transport's other messages. A
// message sent with a tag is received by the receive with the same tag; two
// with the same tag between the same pair arrive in the order sent.
class PointToPoint {
 public:
  virtual ~PointToPoint() = default;
  virtual int node() const = 0;
  virtual int nodes() const = 0;
  // The largest tag (at least 32767, as MPI promises).
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

class RingAllReduce : public Transfer {
 public:
  // data = sum over nodes of data, `count` elements of `dtype`, in place.
  // `sequence`: this ring's number, the same on every counterpart (rings are
  // started in the same order on each): it keeps concurrent rings' messages apart.
  RingAllReduce(PointToPoint* link, uint64_t sequence, DType dtype, void* data, size_t count);

  // Posts the first step.
  Status Start();
  bool started() const { return started_; }
  // Moves on as far as the messages that arrived allow; true once finished,
  // with *error its outcome. Never waits.
  bool Progress(Status* error);

 private:
  // Posts step `step_`'s send and receive.
  Status Post();
  size_t BlockStart(int block) const;
  size_t BlockBytes(int block) const { return BlockStart(block + 1) - BlockStart(block); }
  int Tag() const;

  PointToPoint* const link_;
  const uint64_t sequence_;
  const DType dtype_;
  char* const data_;
  const size_t count_;
  const int nodes_, node_;
  int step_ = 0;  // 0 .. 2 (nodes - 1) - 1; reduce-scatter first, then all-gather
  std::unique_ptr<Transfer> send_, receive_;
  bool sent_ = false, received_ = false;
  std::vector<char> incoming_;  // a reduce-scatter step's block, before it is summed in
  Status error_;
  bool done_ = false;
  bool started_ = false;
};

// Rings started in order, at most `window` of them posted at a time: enough
// that the link is busy while one sums what arrived, few enough that they
// finish in the order started (the caller copies out each as it comes) and
// that a receive is posted before its message arrives.
class RingQueue {
 public:
  explicit RingQueue(int window) : window_(window) {}
  // Queues `ring` (posted once fewer than `window` run); it stays alive
  // until Progress says it finished.
  void Add(RingAllReduce* ring);
  // Progress of `ring` (a queued one); posts queued ones as others finish.
  bool Progress(RingAllReduce* ring, Status* error);

 private:
  Status PostQueued();
  const int window_;
  int running_ = 0;
  std::vector<RingAllReduce*> queued_;  // in order; not yet posted
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_TRANSPORT_RING_ALLREDUCE_H_
