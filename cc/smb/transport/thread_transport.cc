#include "cc/smb/transport/thread_transport.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "cc/smb/transport/nodes_allreduce.h"

namespace smb {
namespace {

// A send (done when made) or a collective (done once every counterpart's
// input arrived and this rank copied the result out).
struct ThreadTransfer : Transfer {
  bool collective = false;
  bool receive = false;  // a point-to-point receive: from, tag, out, out_bytes
  int from = 0, tag = 0;
  uint64_t round = 0;
  void* out = nullptr;
  size_t out_bytes = 0;
};

}  // namespace

class ThreadTransport : public Transport, public PointToPoint {
 public:
  ThreadTransport(ThreadNetwork* network, int rank) : net_(network), rank_(rank) {}

  std::string name() const override { return "threads"; }

  Status Start(int rank, int world, Layout* layout) override {
    if (rank != rank_ || world != net_->world()) {
      return InvalidArgument("a thread network of " + std::to_string(net_->world()) +
                             " ranks connected rank " + std::to_string(rank_) +
                             ", but the link was told rank " + std::to_string(rank) + " of " +
                             std::to_string(world));
    }
    layout->rank = rank;
    layout->world = world;
    layout->nodes = net_->nodes_;
    layout->node_of = net_->node_of_;
    layout->local_of = net_->local_of_;
    layout->local_size_of.resize(world);
    for (int r = 0; r < world; ++r) layout->local_size_of[r] = net_->sizes_[net_->node_of_[r]];
    // Like MPI_Init, joining waits for every rank.
    std::unique_lock<std::mutex> lock(net_->mu_);
    ++net_->started_;
    net_->started_cv_.notify_all();
    net_->started_cv_.wait(lock, [&] { return net_->started_ == world; });
    return Status::Ok();
  }

  Status Send(int to, int tag, std::shared_ptr<const std::vector<char>> bytes,
              std::unique_ptr<Transfer>* out) override {
    {
      std::lock_guard<std::mutex> lock(net_->mu_);
      if (!net_->cut_[rank_] && !net_->cut_[to]) {
        net_->inboxes_[to].push_back({rank_, tag, *bytes});
      }
    }
    *out = std::make_unique<ThreadTransfer>();
    return Status::Ok();
  }

  bool Receive(int* from, int* tag, std::vector<char>* bytes) override {
    std::unique_lock<std::mutex> lock(net_->mu_);
    net_->resumed_cv_.wait(lock, [&] { return !net_->stalled_[rank_]; });
    std::deque<ThreadNetwork::Message>& inbox = net_->inboxes_[rank_];
    if (inbox.empty() || net_->cut_[rank_]) return false;
    *from = inbox.front().from;
    *tag = inbox.front().tag;
    *bytes = std::move(inbox.front().bytes);
    inbox.pop_front();
    return true;
  }

  // All-reduces are NodesAllReduces (the MPI transport's for large ones), so
  // they run under the sanitizers with the link on top.
  Status StartAllReduceSum(DType dtype, void* data, size_t count,
                           std::unique_ptr<Transfer>* out) override {
    if (net_->nodes_ > 1 && count > 0) {
      auto op = std::make_unique<NodesAllReduce>(this, all_reduces_++, dtype, data, count);
      in_flight_.Add(op.get());
      *out = std::move(op);
      return Status::Ok();
    }
    return Join(ThreadNetwork::Kind::kAllReduceSum, dtype, data, count * DTypeSize(dtype), 0,
                data, count * DTypeSize(dtype), out);
  }

  Status StartAllGather(const void* in, size_t bytes, void* out,
                        std::unique_ptr<Transfer>* transfer) override {
    return Join(ThreadNetwork::Kind::kAllGather, DType::kUInt8, in, bytes, 0, out,
                bytes * net_->nodes_, transfer);
  }

  Status StartBroadcast(void* data, size_t bytes, int root,
                        std::unique_ptr<Transfer>* out) override {
    return Join(ThreadNetwork::Kind::kBroadcast, DType::kUInt8, data, bytes, root, data, bytes,
                out);
  }

  bool Test(Transfer* transfer, Status* error) override {
    if (auto* op = dynamic_cast<NodesAllReduce*>(transfer)) {
      return in_flight_.Progress(op, error);
    }
    return TestTransfer(transfer, error);
  }

  // PointToPoint: local rank `local_of_[rank_]` of each node.
  int node() const override { return net_->node_of_[rank_]; }
  int nodes() const override { return net_->nodes_; }
  int max_tag() const override { return 32767; }

  Status StartSendTo(int node, int tag, const void* data, size_t bytes,
                     std::unique_ptr<Transfer>* out) override {
    const char* from = static_cast<const char*>(data);
    {
      std::lock_guard<std::mutex> lock(net_->mu_);
      const int to = Counterpart(node);
      if (!net_->cut_[rank_] && !net_->cut_[to]) {
        net_->mail_[{to, rank_, tag}].emplace_back(from, from + bytes);
      }
    }
    *out = std::make_unique<ThreadTransfer>();
    return Status::Ok();
  }

  Status StartReceiveFrom(int node, int tag, void* data, size_t bytes,
                          std::unique_ptr<Transfer>* out) override {
    auto transfer = std::make_unique<ThreadTransfer>();
    transfer->receive = true;
    transfer->from = Counterpart(node);
    transfer->tag = tag;
    transfer->out = data;
    transfer->out_bytes = bytes;
    *out = std::move(transfer);
    return Status::Ok();
  }

  bool TestTransfer(Transfer* transfer, Status* error) override {
    auto* mine = static_cast<ThreadTransfer*>(transfer);
    *error = Status::Ok();
    if (mine->receive) {
      std::lock_guard<std::mutex> lock(net_->mu_);
      auto it = net_->mail_.find({rank_, mine->from, mine->tag});
      if (it == net_->mail_.end()) return false;
      std::vector<char>& message = it->second.front();
      if (message.size() != mine->out_bytes) {
        *error = Status(Code::kInternal, "rank " + std::to_string(rank_) + " expected " +
                                             std::to_string(mine->out_bytes) + " bytes from rank " +
                                             std::to_string(mine->from) + " with tag " +
                                             std::to_string(mine->tag) + ", got " +
                                             std::to_string(message.size()));
      } else if (!message.empty()) {
        std::memcpy(mine->out, message.data(), message.size());
      }
      it->second.pop_front();
      if (it->second.empty()) net_->mail_.erase(it);
      return true;
    }
    if (!mine->collective) return true;
    std::lock_guard<std::mutex> lock(net_->mu_);
    auto& rounds = net_->rounds_[net_->local_of_[rank_]];
    ThreadNetwork::Round& round = rounds.at(mine->round);
    if (round.arrived < net_->nodes_) return false;
    if (round.error.ok() && round.result.empty() && mine->out_bytes > 0) Combine(&round);
    *error = round.error;
    if (round.error.ok() && mine->out_bytes > 0) {
      std::memcpy(mine->out, round.result.data(), mine->out_bytes);
    }
    if (++round.taken == net_->nodes_) rounds.erase(mine->round);
    return true;
  }

  void Finish() override {}

 private:
  // Adds this node's input to its next round (mu_ not held).
  Status Join(ThreadNetwork::Kind kind, DType dtype, const void* in, size_t bytes, int root,
              void* out, size_t out_bytes, std::unique_ptr<Transfer>* started) {
    auto transfer = std::make_unique<ThreadTransfer>();
    transfer->collective = true;
    transfer->round = next_round_++;
    transfer->out = out;
    transfer->out_bytes = out_bytes;
    const int node = net_->node_of_[rank_];
    {
      std::lock_guard<std::mutex> lock(net_->mu_);
      auto& rounds = net_->rounds_[net_->local_of_[rank_]];
      auto it = rounds.find(transfer->round);
      if (it == rounds.end()) {
        ThreadNetwork::Round round{kind, dtype, bytes, root, {}};
        round.inputs.resize(net_->nodes_);
        it = rounds.emplace(transfer->round, std::move(round)).first;
      }
      ThreadNetwork::Round& round = it->second;
      if (round.kind != kind || round.dtype != dtype || round.bytes != bytes ||
          round.root != root) {
        round.error = InvalidArgument("the counterparts of rank " + std::to_string(rank_) +
                                      " started different collectives as round " +
                                      std::to_string(transfer->round));
      }
      if (kind != ThreadNetwork::Kind::kBroadcast || node == root) {
        const char* bytes_in = static_cast<const char*>(in);
        round.inputs[node].assign(bytes_in, bytes_in + bytes);
      }
      ++round.arrived;
    }
    *started = std::move(transfer);
    return Status::Ok();
  }

  // The round's result, from every node's input (mu_ held).
  void Combine(ThreadNetwork::Round* round) {
    const int nodes = net_->nodes_;
    switch (round->kind) {
      case ThreadNetwork::Kind::kAllReduceSum:
        round->result = round->inputs[0];
        for (int n = 1; n < nodes; ++n) {
          SumInto(round->dtype, round->result.data(), round->result.data(),
                  round->inputs[n].data(), round->bytes / DTypeSize(round->dtype));
        }
        break;
      case ThreadNetwork::Kind::kAllGather:
        for (int n = 0; n < nodes; ++n) {
          round->result.insert(round->result.end(), round->inputs[n].begin(),
                               round->inputs[n].end());
        }
        break;
      case ThreadNetwork::Kind::kBroadcast:
        round->result = round->inputs[round->root];
        break;
    }
  }

  // The rank with my local rank on `node`.
  int Counterpart(int node) const {
    int first = 0;
    for (int n = 0; n < node; ++n) first += net_->sizes_[n];
    return first + net_->local_of_[rank_];
  }

  ThreadNetwork* net_;
  const int rank_;
  uint64_t next_round_ = 0;  // the link's thread only
  AllReduceQueue in_flight_{2};
  uint64_t all_reduces_ = 0;  // the link's thread only
};

ThreadNetwork::ThreadNetwork(int nodes, int local_size)
    : ThreadNetwork(std::vector<int>(nodes, local_size)) {}

ThreadNetwork::ThreadNetwork(std::vector<int> sizes)
    : sizes_(std::move(sizes)), nodes_(static_cast<int>(sizes_.size())) {
  for (int n = 0; n < nodes_; ++n) {
    for (int local = 0; local < sizes_[n]; ++local) {
      node_of_.push_back(n);
      local_of_.push_back(local);
    }
  }
  const size_t world = node_of_.size();
  inboxes_.resize(world);
  cut_.assign(world, false);
  stalled_.assign(world, false);
  // Counterparts: local rank r of every node, for the r every node has.
  rounds_.resize(sizes_.empty() ? 0 : *std::min_element(sizes_.begin(), sizes_.end()));
}

std::unique_ptr<Transport> ThreadNetwork::Connect(int rank) {
  return std::make_unique<ThreadTransport>(this, rank);
}

void ThreadNetwork::Cut(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  cut_[rank] = true;
  inboxes_[rank].clear();
}

void ThreadNetwork::Inject(int from, int to, int tag, std::vector<char> bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  inboxes_[to].push_back({from, tag, std::move(bytes)});
}

void ThreadNetwork::Stall(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  stalled_[rank] = true;
}

void ThreadNetwork::Resume(int rank) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stalled_[rank] = false;
  }
  resumed_cv_.notify_all();
}

}  // namespace smb
