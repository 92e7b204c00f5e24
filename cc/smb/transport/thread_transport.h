// A transport (transport.h) whose ranks are threads of one process: `nodes`
// x `local_size` ranks, rank r on node r / local_size; or nodes of the given
// sizes, filled in rank order. The link between nodes
// (link/transport_link.h) runs over it unchanged, so its coordination (the
// job-wide order, the memory server, clocks, lost ranks, failures) is tested
// in one process, under ThreadSanitizer and AddressSanitizer
// (cc/tests/collectives_test.cc), with the nodes' boxes as ThreadGroups.
//
//   smb::ThreadNetwork network(/*nodes=*/2, /*local_size=*/2);
//   // in thread r:
//   std::shared_ptr<smb::NodeLink> link;
//   smb::StartTransportLink(network.Connect(r), {r, 4}, &link);
#ifndef TF_SMB_CC_SMB_TRANSPORT_THREAD_TRANSPORT_H_
#define TF_SMB_CC_SMB_TRANSPORT_THREAD_TRANSPORT_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "cc/smb/transport/transport.h"

namespace smb {

class ThreadNetwork {
 public:
  ThreadNetwork(int nodes, int local_size);
  explicit ThreadNetwork(std::vector<int> sizes);
  ThreadNetwork(const ThreadNetwork&) = delete;
  ThreadNetwork& operator=(const ThreadNetwork&) = delete;

  // Rank `rank`'s transport; the network must outlive it.
  std::unique_ptr<Transport> Connect(int rank);
  // From now on nothing reaches rank `rank` and nothing it sends arrives, as
  // if its node died or was cut off.
  void Cut(int rank);
  // From Stall until Resume, rank `rank`'s link thread waits in its next
  // Receive while messages to it queue up, as if its process were stopped
  // (SIGSTOP) and then continued.
  void Stall(int rank);
  void Resume(int rank);
  // Puts a message in rank `to`'s inbox as if rank `from` had sent it (a test
  // of what the link does with a message it cannot read).
  void Inject(int from, int to, int tag, std::vector<char> bytes);

  int nodes() const { return nodes_; }
  int world() const { return static_cast<int>(node_of_.size()); }
  int node_of(int rank) const { return node_of_[rank]; }
  int local_of(int rank) const { return local_of_[rank]; }

 private:
  friend class ThreadTransport;
  enum class Kind { kAllReduceSum, kAllGather, kBroadcast };
  struct Message {
    int from, tag;
    std::vector<char> bytes;
  };
  // One collective among the counterparts of a local rank: the n-th of each.
  struct Round {
    Kind kind;
    DType dtype;
    size_t bytes;  // each node's input
    int root;
    std::vector<std::vector<char>> inputs;  // by node
    int arrived = 0, taken = 0;
    std::vector<char> result;
    Status error;  // the counterparts disagree on the collective
  };

  const std::vector<int> sizes_;  // ranks on each node
  const int nodes_;
  std::vector<int> node_of_, local_of_;  // by rank
  std::mutex mu_;
  std::condition_variable started_cv_;
  std::condition_variable resumed_cv_;
  int started_ = 0;
  std::vector<std::deque<Message>> inboxes_;  // by rank
  std::vector<bool> cut_;
  std::vector<bool> stalled_;
  std::vector<std::map<uint64_t, Round>> rounds_;  // by local rank, then round number
  // Point-to-point messages (the ring all-reduce's) by (to, from, tag), in order.
  std::map<std::tuple<int, int, int>, std::deque<std::vector<char>>> mail_;
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_TRANSPORT_THREAD_TRANSPORT_H_
