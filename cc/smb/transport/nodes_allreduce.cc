#include "cc/smb/transport/nodes_allreduce.h"

#include <algorithm>
#include <string>
#include <utility>

namespace smb {

NodesAllReduce::NodesAllReduce(PointToPoint* link, uint64_t sequence, DType dtype, void* data,
                               size_t count)
    : link_(link),
      sequence_(sequence),
      dtype_(dtype),
      elem_(DTypeSize(dtype)),
      data_(static_cast<char*>(data)),
      count_(count),
      nodes_(link->nodes()),
      node_(link->node()) {
  if (nodes_ < 2 || count_ == 0) return;
  if (nodes_ == 2 && count_ * elem_ <= kHalvingMaxBytes) {
    // Both send everything and add the other's in: the same bytes as halving
    // and doubling at 2 nodes (all of it once each way), in one step; a + b is
    // b + a to the bit, so both get the same sum.
    const int other = 1 - node_;
    steps_.push_back({other, other, 0, count_, 0, count_, true});
  } else if ((nodes_ & (nodes_ - 1)) == 0 && count_ * elem_ <= kHalvingMaxBytes) {
    PlanHalvingDoubling();
  } else {
    PlanRing();
  }
}

void NodesAllReduce::PlanRing() {
  // Block b: elements [count b / N, count (b + 1) / N). Step s < N - 1
  // (reduce-scatter): send block node - s to the next node, receive block
  // node - s - 1 from the previous one and add it in; then node n holds block
  // n + 1's sum. Step N - 1 + s (all-gather): send block node + 1 - s (summed,
  // or received the step before), receive block node - s in place.
  auto start = [&](int block) { return count_ * static_cast<size_t>(block) / nodes_; };
  auto wrap = [&](int b) { return ((b % nodes_) + nodes_) % nodes_; };
  const int next = wrap(node_ + 1), prev = wrap(node_ - 1);
  for (int step = 0; step < 2 * (nodes_ - 1); ++step) {
    const bool scatter = step < nodes_ - 1;
    const int s = scatter ? step : step - (nodes_ - 1);
    const int out = wrap(scatter ? node_ - s : node_ + 1 - s);
    const int in = wrap(scatter ? node_ - s - 1 : node_ - s);
    steps_.push_back({next, prev, start(out), start(out + 1) - start(out), start(in),
                      start(in + 1) - start(in), scatter});
  }
}

void NodesAllReduce::PlanHalvingDoubling() {
  // Reduce-scatter by recursive halving: with partner node ^ d (d = N/2, N/4,
  // ..., 1), both holding the same range, the lower node keeps the lower half
  // and sends the upper one; each adds the partner's half of what it keeps.
  // All-gather by recursive doubling: the splits undone, last first.
  size_t lo = 0, hi = count_;
  std::vector<std::pair<size_t, size_t>> split;  // the range before each split
  for (int d = nodes_ / 2; d >= 1; d /= 2) {
    const int partner = node_ ^ d;
    const size_t mid = lo + (hi - lo) / 2;
    const bool lower = (node_ & d) == 0;
    const size_t keep_lo = lower ? lo : mid, keep_hi = lower ? mid : hi;
    const size_t send_lo = lower ? mid : lo, send_hi = lower ? hi : mid;
    steps_.push_back({partner, partner, send_lo, send_hi - send_lo, keep_lo, keep_hi - keep_lo,
                      true});
    split.emplace_back(lo, hi);
    lo = keep_lo;
    hi = keep_hi;
  }
  for (int d = 1; d < nodes_; d *= 2) {
    const int partner = node_ ^ d;
    const auto [parent_lo, parent_hi] = split.back();
    split.pop_back();
    // The partner holds the rest of the parent range.
    const size_t other_lo = lo == parent_lo ? hi : parent_lo;
    const size_t other_hi = lo == parent_lo ? parent_hi : lo;
    steps_.push_back({partner, partner, lo, hi - lo, other_lo, other_hi - other_lo, false});
    lo = parent_lo;
    hi = parent_hi;
  }
}

int NodesAllReduce::Tag() const {
  // Each step of each all-reduce in flight its own tag, so a message never
  // meets another step's receive.
  const uint64_t steps = 2 * static_cast<uint64_t>(nodes_);
  const uint64_t ops = static_cast<uint64_t>(link_->max_tag()) / steps;
  return static_cast<int>((sequence_ % ops) * steps + step_);
}

Status NodesAllReduce::Start() {
  started_ = true;
  if (steps_.empty()) {
    done_ = true;
    return Status::Ok();
  }
  size_t largest = 0;
  for (const Step& s : steps_) {
    if (s.sum) largest = std::max(largest, s.recv_count);
  }
  incoming_.resize(largest * elem_ + 1);
  error_ = Post();
  if (!error_.ok()) done_ = true;
  return error_;
}

Status NodesAllReduce::Post() {
  const Step& s = steps_[step_];
  sent_ = received_ = false;
  SMB_RETURN_IF_ERROR(link_->StartReceiveFrom(
      s.from, Tag(), s.sum ? incoming_.data() : data_ + s.recv_at * elem_, s.recv_count * elem_,
      &receive_));
  return link_->StartSendTo(s.to, Tag(), data_ + s.send_at * elem_, s.send_count * elem_,
                            &send_);
}

bool NodesAllReduce::Progress(Status* error) {
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
    // A failed transfer ends the all-reduce once the other one finished too
    // (a receive still posted would write into incoming_ after it is gone).
    if (!(sent_ && received_)) break;
    if (!error_.ok()) {
      done_ = true;
      break;
    }
    const Step& s = steps_[step_];
    if (s.sum) {
      char* at = data_ + s.recv_at * elem_;
      SumInto(dtype_, at, at, incoming_.data(), s.recv_count);
    }
    if (++step_ == steps_.size()) {
      done_ = true;
      break;
    }
    error_ = Post();
    if (!error_.ok()) done_ = true;
  }
  *error = error_;
  return done_;
}

void AllReduceQueue::Add(NodesAllReduce* op) {
  queued_.push_back(op);
  (void)PostQueued();  // one that fails to post reports it when tested
}

Status AllReduceQueue::PostQueued() {
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

bool AllReduceQueue::Progress(NodesAllReduce* op, Status* error) {
  if (!op->started()) {
    *error = Status::Ok();
    return false;
  }
  if (!op->Progress(error)) return false;
  --running_;
  (void)PostQueued();  // one that fails to post reports it when tested
  return true;
}

}  // namespace smb
