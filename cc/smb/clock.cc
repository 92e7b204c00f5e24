#include "cc/smb/clock.h"

#include <algorithm>
#include <string>

#include "cc/smb/timeline.h"

namespace smb {

Status StepClock::Tick(int64_t staleness, int64_t* lead) {
  *lead = 0;
  const int world = group_->world();
  if (world == 1) return Status::Ok();
  const int me = group_->rank();
  timeline::Scope scope(me, timeline::kClock, "clock tick wait", "clock");
  RankControl* ranks = group_->peers()->control()->ranks;
  const uint64_t mine = ranks[me].clock.fetch_add(1) + 1;
  group_->Poke();
  // Slowest clock among ranks still training (mine: none left).
  auto slowest = [&]() -> uint64_t {
    uint64_t low = mine;
    for (int r = 0; r < world; ++r) {
      if (r == me || ranks[r].finished.load() || group_->RankGone(r)) continue;
      low = std::min<uint64_t>(low, ranks[r].clock.load(std::memory_order_acquire));
    }
    return low;
  };
  if (staleness >= 0) {
    SMB_RETURN_IF_ERROR(group_->WaitUntil(
        "a staleness wait (bound " + std::to_string(staleness) + ")",
        [&] { return mine - slowest() <= static_cast<uint64_t>(staleness); },
        [&] {
          std::string slow;
          for (int r = 0; r < world; ++r) {
            if (r != me && mine - ranks[r].clock.load() > static_cast<uint64_t>(staleness)) {
              slow += (slow.empty() ? "" : ", ") + std::to_string(r);
            }
          }
          return slow;
        }));
  }
  *lead = static_cast<int64_t>(mine - slowest());
  if (scope.active()) scope.set_arg("lead", *lead);
  return Status::Ok();
}

void StepClock::Finish() {
  if (group_->world() == 1) return;
  group_->peers()->control()->ranks[group_->rank()].finished.store(1, std::memory_order_release);
  group_->Poke();
}

void StepClock::Resume() {
  if (group_->world() == 1) return;
  group_->peers()->control()->ranks[group_->rank()].finished.store(0, std::memory_order_release);
}

Status StepClock::WaitAllFinished() {
  const int world = group_->world();
  if (world == 1) return Status::Ok();
  timeline::Scope scope(group_->rank(), timeline::kClock, "wait all finished", "clock");
  RankControl* ranks = group_->peers()->control()->ranks;
  auto unfinished = [&] {
    std::string list;
    for (int r = 0; r < world; ++r) {
      if (!ranks[r].finished.load() && !group_->RankGone(r)) {
        list += (list.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    return list;
  };
  return group_->WaitUntil("waiting for all ranks to finish training",
                           [&] { return unfinished().empty(); }, unfinished);
}

uint64_t StepClock::Steps(int rank) const {
  if (group_->world() == 1) return 0;
  return group_->peers()->control()->ranks[rank].clock.load();
}

}  // namespace smb
