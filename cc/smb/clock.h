// The asynchronous mode's step clock (stale-synchronous parallel): each rank
// counts the training steps it started in the group's control words; a rank
// more than `staleness` steps ahead of the slowest rank that is still
// training waits. Finished or gone ranks no longer hold the others back.
//
//   smb::StepClock clock(&group);
//   int64_t lead = 0;
//   SMB_RETURN_IF_ERROR(clock.Tick(/*staleness=*/2, &lead));   // each step
//   clock.Finish();                                             // when done
//   SMB_RETURN_IF_ERROR(clock.WaitAllFinished());
//
// Not a collective: its calls touch only atomics and may come from any
// thread, alongside the group's collectives.
#ifndef TF_SMB_CC_SMB_CLOCK_H_
#define TF_SMB_CC_SMB_CLOCK_H_

#include <cstdint>

#include "cc/smb/group.h"
#include "cc/smb/status.h"

namespace smb {

class StepClock {
 public:
  explicit StepClock(Group* group) : group_(group) {}

  // Starts this rank's next step, first waiting while it would be more than
  // `staleness` steps ahead of the slowest rank still training (staleness < 0:
  // never wait). *lead is how far ahead it then is.
  Status Tick(int64_t staleness, int64_t* lead);
  // Tick in two halves, so that only a wait that must block needs a thread of
  // its own: Advance starts the next step and returns its number; Within is
  // true when step `step` need not wait (it then sets *lead and records the
  // tick on the timeline, as Tick does); else WaitWithin waits as Tick does.
  uint64_t Advance();
  bool Within(uint64_t step, int64_t staleness, int64_t* lead) const;
  Status WaitWithin(uint64_t step, int64_t staleness, int64_t* lead);
  // Finished ranks no longer hold the others back; Resume (or the next
  // step) starts the next round of training. Each call is idempotent.
  void Finish();
  void Resume();
  // Waits until every rank that is not gone has finished as many rounds of
  // training as this one (so a rank that has not yet started this round is
  // waited for, not taken for finished).
  Status WaitAllFinished();
  // Steps rank r has started.
  uint64_t Steps(int rank) const;

 private:
  // The slowest step among the ranks still training, at most `step`.
  uint64_t Slowest(uint64_t step) const;
  void MoveTo(bool finished);

  Group* group_;
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_CLOCK_H_
