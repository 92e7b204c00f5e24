// The job-wide order of collectives across nodes, decided by node 0's leader
// (local rank 0) from every node leader's offer: the keys its ranks have
// waiting, oldest first (NodeLink::OfferCandidates). A key is decided once
// every node offers it; the order is that of the first node still training,
// and a node whose every rank has joined (hvd.join) offers kAnyCollective: it
// takes part in whatever the others run. Transport-independent and without
// threads: the link's thread calls it.
#ifndef TF_SMB_CC_SMB_LINK_DECIDER_H_
#define TF_SMB_CC_SMB_LINK_DECIDER_H_

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace smb {

struct Decision {
  uint64_t number;  // 1, 2, ... in decision order
  uint64_t key;
};

class Decider {
 public:
  explicit Decider(int nodes) : offers_(nodes), applied_by_node_(nodes, 0) {}

  // Node `node` offers `message` = [decisions it has taken, keys...] (the
  // latest offer replaces the node's earlier one). Returns what is decided
  // now, in order.
  std::vector<Decision> Offer(int node, const std::vector<uint64_t>& message);

 private:
  bool Offers(int node, uint64_t key) const;

  std::vector<std::vector<uint64_t>> offers_;
  std::vector<uint64_t> applied_by_node_;
  // Keys decided that an offer may still name (a node has not taken them yet).
  std::unordered_map<uint64_t, uint64_t> decided_;  // key -> decision number
  uint64_t decisions_made_ = 0;
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_LINK_DECIDER_H_
