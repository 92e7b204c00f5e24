#include "cc/smb/link/decider.h"

#include <algorithm>
#include <iterator>

#include "cc/smb/node_link.h"

namespace smb {

bool Decider::Offers(int node, uint64_t key) const {
  const std::vector<uint64_t>& offer = offers_[node];
  return std::find(offer.begin(), offer.end(), key) != offer.end();
}

std::vector<Decision> Decider::Offer(int node, const std::vector<uint64_t>& message) {
  std::vector<Decision> now;
  if (message.empty()) return now;
  applied_by_node_[node] = message[0];
  offers_[node].assign(message.begin() + 1, message.end());
  // Decisions every node has taken can no longer appear in any offer.
  const uint64_t taken = *std::min_element(applied_by_node_.begin(), applied_by_node_.end());
  for (auto it = decided_.begin(); it != decided_.end();) {
    it = it->second <= taken ? decided_.erase(it) : std::next(it);
  }
  const int nodes = static_cast<int>(offers_.size());
  // The order is that of the first node still training (whose every rank has
  // not joined); a node whose every rank has joined takes any collective.
  int source = 0;
  while (source < nodes && Offers(source, kAnyCollective)) ++source;
  // Every node has joined: only the join is left, which every node must offer.
  const bool training = source < nodes;
  if (!training) source = 0;
  for (uint64_t key : offers_[source]) {
    if (key == kAnyCollective || decided_.count(key)) continue;
    bool everywhere = true;
    for (int n = 0; n < nodes && everywhere; ++n) {
      everywhere = Offers(n, key) || (training && Offers(n, kAnyCollective));
    }
    if (!everywhere) continue;
    decided_[key] = ++decisions_made_;
    now.push_back({decisions_made_, key});
  }
  return now;
}

}  // namespace smb
