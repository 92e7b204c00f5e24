#include "cc/smb/link/liveness.h"

#include <algorithm>
#include <utility>

namespace smb {

Liveness::Liveness(std::vector<bool> remote, double lost_after_s, double now)
    : remote_(std::move(remote)),
      lost_after_s_(lost_after_s),
      last_heard_(std::make_unique<std::atomic<double>[]>(remote_.size())),
      left_(std::make_unique<std::atomic<bool>[]>(remote_.size())),
      lost_(std::make_unique<std::atomic<bool>[]>(remote_.size())),
      last_tick_(now),
      moved_at_(now) {
  for (size_t r = 0; r < remote_.size(); ++r) {
    last_heard_[r] = now;
    left_[r] = false;
    lost_[r] = false;
  }
}

void Liveness::ExcuseSilence(double now) {
  for (size_t r = 0; r < remote_.size(); ++r) {
    last_heard_[r] = std::max(last_heard_[r].load(), now);
  }
}

Liveness::Tick Liveness::Ticked(double now, uint64_t passes) {
  if (now - last_tick_ > kStalledS) {  // the process was stopped or starved
    ExcuseSilence(now);
    moved_at_ = now;
  }
  if (passes != seen_passes_) {
    if (now - moved_at_ > kStalledS) ExcuseSilence(now);  // a long transport call ended
    moved_at_ = now;
  }
  seen_passes_ = passes;
  last_tick_ = now;
  // The thread polls at least every millisecond: a long pass is one blocking
  // transport call, and one that never returns is stuck.
  const double still_s = now - moved_at_;
  const bool stuck = still_s >= kStuckLostAfters * lost_after_s_;
  return {/*judge=*/still_s <= kStalledS || stuck, stuck};
}

std::vector<int> Liveness::Silent(double now) const {
  std::vector<int> silent;
  for (size_t r = 0; r < remote_.size(); ++r) {
    if (remote_[r] && !left_[r] && !lost_[r] && now - last_heard_[r] >= lost_after_s_) {
      silent.push_back(static_cast<int>(r));
    }
  }
  return silent;
}

}  // namespace smb
