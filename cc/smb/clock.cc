#include "cc/smb/clock.h"

#include <algorithm>
#include <string>

#include "cc/smb/timeline.h"

namespace smb {

Status StepClock::Tick(int64_t staleness, int64_t* lead) {
  return WaitWithin(Advance(), staleness, lead);
}

uint64_t StepClock::Advance() {
  if (group_->alone()) return 0;
  RankControl& mine = group_->peers()->control()->ranks[group_->rank()];
  // A step after Finish starts the next round of training (a custom loop
  // that trains again).
  uint64_t phase = mine.phase.load(std::memory_order_relaxed);
  if (PhaseFinished(phase)) mine.phase.store(++phase, std::memory_order_release);
  const uint64_t step = mine.clock.fetch_add(1) + 1;
  group_->Poke();
  if (group_->link() != nullptr) group_->link()->PublishClock(step, phase);
  return step;
}

uint64_t StepClock::Slowest(uint64_t step) const {
  // Among ranks still training (mine: none left), on this node and, across
  // nodes, as last heard from the others.
  const RankControl* ranks = group_->peers()->control()->ranks;
  uint64_t low = step;
  for (int r = 0; r < group_->world(); ++r) {
    if (r == group_->rank() || PhaseFinished(ranks[r].phase.load()) || group_->RankGone(r)) {
      continue;
    }
    low = std::min<uint64_t>(low, ranks[r].clock.load(std::memory_order_acquire));
  }
  if (group_->link() != nullptr) {
    for (const RemoteClock& c : group_->link()->RemoteClocks()) {
      if (!PhaseFinished(c.phase)) low = std::min<uint64_t>(low, c.steps);
    }
  }
  return low;
}

bool StepClock::Within(uint64_t step, int64_t staleness, int64_t* lead) const {
  *lead = 0;
  if (group_->alone()) return true;
  // A failed group answers through WaitWithin's error.
  if (!group_->Failure().ok()) return false;
  const uint64_t ahead = step - Slowest(step);
  if (staleness >= 0 && ahead > static_cast<uint64_t>(staleness)) return false;
  *lead = static_cast<int64_t>(ahead);
  timeline::Scope scope(group_->job_rank(), timeline::kClock, "clock tick wait", "clock");
  if (scope.active()) scope.set_arg("lead", *lead);
  return true;
}

Status StepClock::WaitWithin(uint64_t step, int64_t staleness, int64_t* lead) {
  *lead = 0;
  if (group_->alone()) return Status::Ok();
  const int me = group_->rank();
  timeline::Scope scope(group_->job_rank(), timeline::kClock, "clock tick wait", "clock");
  if (staleness >= 0) {
    const RankControl* ranks = group_->peers()->control()->ranks;
    NodeLink* link = group_->link();
    const auto bound = static_cast<uint64_t>(staleness);
    SMB_RETURN_IF_ERROR(group_->WaitUntil(
        "a staleness wait (bound " + std::to_string(staleness) + ")",
        [&] { return step - Slowest(step) <= bound; },
        [&] {
          std::string slow;
          for (int r = 0; r < group_->world(); ++r) {
            if (r != me && step - ranks[r].clock.load() > bound) {
              slow += (slow.empty() ? "" : ", ") + std::to_string(group_->JobRankOf(r));
            }
          }
          if (link != nullptr) {
            for (const RemoteClock& c : link->RemoteClocks()) {
              if (!PhaseFinished(c.phase) && step - c.steps > bound) {
                slow += (slow.empty() ? "" : ", ") + std::to_string(c.rank);
              }
            }
          }
          return slow;
        }));
  }
  *lead = static_cast<int64_t>(step - Slowest(step));
  if (scope.active()) scope.set_arg("lead", *lead);
  return Status::Ok();
}

void StepClock::Finish() { MoveTo(/*finished=*/true); }

void StepClock::Resume() { MoveTo(/*finished=*/false); }

void StepClock::MoveTo(bool finished) {
  if (group_->alone()) return;
  // Only this rank writes its phase word.
  RankControl& mine = group_->peers()->control()->ranks[group_->rank()];
  uint64_t phase = mine.phase.load(std::memory_order_relaxed);
  if (PhaseFinished(phase) == finished) return;
  mine.phase.store(++phase, std::memory_order_release);
  group_->Poke();
  if (group_->link() != nullptr) group_->link()->PublishClock(mine.clock.load(), phase);
}

Status StepClock::WaitAllFinished() {
  const int world = group_->world();
  if (group_->alone()) return Status::Ok();
  timeline::Scope scope(group_->job_rank(), timeline::kClock, "wait all finished", "clock");
  RankControl* ranks = group_->peers()->control()->ranks;
  NodeLink* link = group_->link();
  // This rank's rounds of training: a rank counts as finished once it has
  // finished as many (a rank that has not yet started this round's training,
  // still in the round before, is waited for).
  const uint64_t round = RoundsFinished(ranks[group_->rank()].phase.load());
  auto unfinished = [&] {
    std::string list;
    for (int r = 0; r < world; ++r) {
      if (RoundsFinished(ranks[r].phase.load()) < round && !group_->RankGone(r)) {
        list += (list.empty() ? "" : ", ") + std::to_string(group_->JobRankOf(r));
      }
    }
    if (link != nullptr) {
      for (const RemoteClock& c : link->RemoteClocks()) {
        if (RoundsFinished(c.phase) < round) {
          list += (list.empty() ? "" : ", ") + std::to_string(c.rank);
        }
      }
    }
    return list;
  };
  return group_->WaitUntil(
      "waiting for all ranks to finish training round " + std::to_string(round),
      [&] { return unfinished().empty(); }, unfinished);
}

uint64_t StepClock::Steps(int rank) const {
  if (group_->alone()) return 0;
  return group_->peers()->control()->ranks[rank].clock.load();
}

}  // namespace smb
