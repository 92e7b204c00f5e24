#include "cc/smb/clock.h"

#include <algorithm>
#include <string>

#include "cc/smb/timeline.h"

namespace smb {

Status StepClock::Tick(int64_t staleness, int64_t* lead) {
  *lead = 0;
  const int world = group_->world();
  if (group_->alone()) return Status::Ok();
  const int me = group_->rank();
  timeline::Scope scope(me, timeline::kClock, "clock tick wait", "clock");
  RankControl* ranks = group_->peers()->control()->ranks;
  const uint64_t mine = ranks[me].clock.fetch_add(1) + 1;
  group_->Poke();
  NodeLink* link = group_->link();
  if (link != nullptr) link->PublishClock(mine, false);
  // Slowest clock among ranks still training (mine: none left), on this
  // node and, across nodes, as last heard from the others.
  auto slowest = [&]() -> uint64_t {
    uint64_t low = mine;
    for (int r = 0; r < world; ++r) {
      if (r == me || ranks[r].finished.load() || group_->RankGone(r)) continue;
      low = std::min<uint64_t>(low, ranks[r].clock.load(std::memory_order_acquire));
    }
    if (link != nullptr) {
      for (const RemoteClock& c : link->RemoteClocks()) {
        if (!c.finished) low = std::min<uint64_t>(low, c.steps);
      }
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
              slow += (slow.empty() ? "" : ", ") + std::to_string(group_->JobRankOf(r));
            }
          }
          if (link != nullptr) {
            for (const RemoteClock& c : link->RemoteClocks()) {
              if (!c.finished && mine - c.steps > static_cast<uint64_t>(staleness)) {
                slow += (slow.empty() ? "" : ", ") + std::to_string(c.rank);
              }
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
  if (group_->alone()) return;
  RankControl& mine = group_->peers()->control()->ranks[group_->rank()];
  mine.finished.store(1, std::memory_order_release);
  group_->Poke();
  if (group_->link() != nullptr) group_->link()->PublishClock(mine.clock.load(), true);
}

void StepClock::Resume() {
  if (group_->alone()) return;
  RankControl& mine = group_->peers()->control()->ranks[group_->rank()];
  mine.finished.store(0, std::memory_order_release);
  if (group_->link() != nullptr) group_->link()->PublishClock(mine.clock.load(), false);
}

Status StepClock::WaitAllFinished() {
  const int world = group_->world();
  if (group_->alone()) return Status::Ok();
  timeline::Scope scope(group_->rank(), timeline::kClock, "wait all finished", "clock");
  RankControl* ranks = group_->peers()->control()->ranks;
  NodeLink* link = group_->link();
  auto unfinished = [&] {
    std::string list;
    for (int r = 0; r < world; ++r) {
      if (!ranks[r].finished.load() && !group_->RankGone(r)) {
        list += (list.empty() ? "" : ", ") + std::to_string(group_->JobRankOf(r));
      }
    }
    if (link != nullptr) {
      for (const RemoteClock& c : link->RemoteClocks()) {
        if (!c.finished) list += (list.empty() ? "" : ", ") + std::to_string(c.rank);
      }
    }
    return list;
  };
  return group_->WaitUntil("waiting for all ranks to finish training",
                           [&] { return unfinished().empty(); }, unfinished);
}

uint64_t StepClock::Steps(int rank) const {
  if (group_->alone()) return 0;
  return group_->peers()->control()->ranks[rank].clock.load();
}

}  // namespace smb
