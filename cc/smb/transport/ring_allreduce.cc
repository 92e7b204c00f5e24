#include "cc/smb/transport/ring_allreduce.h"

#include <string>

namespace smb {

RingAllReduce::RingAllReduce(PointToPoint* link, uint64_t sequence, DType dtype, void* data,
                             size_t count)
    : link_(link),
      sequence_(sequence),
      dtype_(dtype),
      data_(static_cast<char*>(data)),
      count_(count),
      nodes_(link->nodes()),
      node_(link->node()) {}

size_t RingAllReduce::BlockStart(int block) const {
  // Block b: elements [count b / N, count (b + 1) / N).
  return count_ * static_cast<size_t>(block) / static_cast<size_t>(nodes_) * DTypeSize(dtype_);
}

int RingAllReduce::Tag() const {
  // Each step of each ring in flight its own tag, so a message never meets
  // another step's receive.
  const uint64_t steps = 2 * static_cast<uint64_t>(nodes_);
  const uint64_t rings = static_cast<uint64_t>(link_->max_tag()) / steps;
  return static_cast<int>((sequence_ % rings) * steps + static_cast<uint64_t>(step_));
}

Status RingAllReduce::Start() {
  started_ = true;
  if (nodes_ == 1 || count_ == 0) {
    done_ = true;
    return Status::Ok();
  }
  incoming_.resize(BlockBytes(nodes_ - 1) + DTypeSize(dtype_));  // the largest block
  error_ = Post();
  if (!error_.ok()) done_ = true;
  return error_;
}

Status RingAllReduce::Post() {
  // Step s < N - 1 (reduce-scatter): send block node - s, receive block
  // node - s - 1 and add it in. Step N - 1 + s (all-gather): send block
  // node + 1 - s (summed, or received the step before), receive block node - s
  // in place.
  const int next = (node_ + 1) % nodes_, prev = (node_ + nodes_ - 1) % nodes_;
  const bool scatter = step_ < nodes_ - 1;
  const int s = scatter ? step_ : step_ - (nodes_ - 1);
  const int out = ((scatter ? node_ - s : node_ + 1 - s) % nodes_ + nodes_) % nodes_;
  const int in = ((scatter ? node_ - s - 1 : node_ - s) % nodes_ + nodes_) % nodes_;
  sent_ = received_ = false;
  SMB_RETURN_IF_ERROR(
      link_->StartReceiveFrom(prev, Tag(), scatter ? incoming_.data() : data_ + BlockStart(in),
                              BlockBytes(in), &receive_));
  return link_->StartSendTo(next, Tag(), data_ + BlockStart(out), BlockBytes(out), &send_);
}

bool RingAllReduce::Progress(Status* error) {
  while (!done_) {
    Status outcome;
    if (!received_ && link_->TestTransfer(receive_.get(), &outcome)) {
      received_ = true;
      if (!outcome.ok()) error_ = outcome;
    }
    if (!sent_ && link_->TestTransfer(send_.get(), &outcome)) {
      sent_ = true;
      if (!outcome.ok()) error_ = outcome;
    }
    // A failed transfer ends the ring once the other one finished too (a
    // receive still posted would write into incoming_ after it is gone).
    if (!(sent_ && received_)) break;
    if (!error_.ok()) {
      done_ = true;
      break;
    }
    if (step_ < nodes_ - 1) {
      const int in = ((node_ - step_ - 1) % nodes_ + nodes_) % nodes_;
      char* block = data_ + BlockStart(in);
      SumInto(dtype_, block, block, incoming_.data(), BlockBytes(in) / DTypeSize(dtype_));
    }
    if (++step_ == 2 * (nodes_ - 1)) {
      done_ = true;
      break;
    }
    error_ = Post();
    if (!error_.ok()) done_ = true;
  }
  *error = error_;
  return done_;
}

void RingQueue::Add(RingAllReduce* ring) {
  queued_.push_back(ring);
  // A ring that fails to post reports it when tested.
  (void)PostQueued();
}

Status RingQueue::PostQueued() {
  size_t posted = 0;
  Status status;
  while (posted < queued_.size() && running_ < window_) {
    ++running_;
    status = queued_[posted++]->Start();
    if (!status.ok()) break;
  }
  queued_.erase(queued_.begin(), queued_.begin() + static_cast<std::ptrdiff_t>(posted));
  return status;
}

bool RingQueue::Progress(RingAllReduce* ring, Status* error) {
  if (!ring->started()) {
    *error = Status::Ok();
    return false;
  }
  if (!ring->Progress(error)) return false;
  --running_;
  (void)PostQueued();  // a ring that fails to post reports it when tested
  return true;
}

}  // namespace smb
