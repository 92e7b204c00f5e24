// Runs the collectives that many threads of a process submit, one at a time,
// in one order that all ranks agree on: collectives are matched by key, not
// by the order in which they happen to arrive.
//
//   auto scheduler = smb::CollectiveScheduler::Start(comm);  // shared_ptr<Communicator>
//   scheduler->Submit("train/SmbAllReduce|0:3", "allreduce of 2 tensors",
//                     [&](smb::Communicator* c) { return c->AllReduceSum(refs); },
//                     [&](const smb::Status& s) { /* finished, ok or not */ });
//
// Why: a TensorFlow graph may hold collectives with no data dependency
// between them (a multi-step while loop, a cond, a TF1 session.run), and
// TensorFlow may run them in a different order on different ranks. Pairing
// them by arrival would then sum unrelated tensors. Each rank publishes the
// keys it has waiting in the box; rank 0 picks the oldest of its own that
// every rank has, and every rank runs that one next (Horovod negotiates by
// tensor name the same way). A key names the call site and, with a count the
// scheduler appends, which call of it this is.
//
// After any failed collective the job stops for good (except a recoverable
// disagreement, Group::SetNextAgreement, which fails that collective alike on
// every rank and nothing else): every rank's waiting
// and later collectives fail at once with the first error (Communicator::Fail)
// rather than pairing what is left in another order. A key no other rank
// submits within the timeout fails the job, naming the ranks without it.
#ifndef TF_SMB_CC_SMB_SCHEDULER_H_
#define TF_SMB_CC_SMB_SCHEDULER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "cc/smb/communicator.h"
#include "cc/smb/status.h"

namespace smb {

class CollectiveScheduler {
 public:
  // `run` does the collective (on the scheduler's thread); `done` gets its
  // status, or the job's failure without `run` having been called.
  using Run = std::function<Status(Communicator*)>;
  using Done = std::function<void(const Status&)>;

  static std::unique_ptr<CollectiveScheduler> Start(std::shared_ptr<Communicator> comm);
  // Stops the thread; at process exit in the middle of a collective it is
  // left to the OS rather than waiting on peers that may never come.
  ~CollectiveScheduler();
  CollectiveScheduler(const CollectiveScheduler&) = delete;
  CollectiveScheduler& operator=(const CollectiveScheduler&) = delete;

  // `key` names the call site; calls with the same key are told apart by
  // how many came before on this rank. `what` describes it in errors.
  void Submit(const std::string& key, const std::string& what, Run run, Done done);
  // This rank's join (Horovod's hvd.join; one node): while it is the only
  // thing this rank has waiting, the rank counts as having joined and takes
  // part in the others' collectives with zeros (algorithms/joined.h); `run`
  // runs once every rank has joined. The calls of every key are counted
  // afresh after it (ranks that joined early ran fewer of them).
  void SubmitJoin(Run run, Done done);

  Communicator* comm() const;

  struct State;  // shared with the thread, which may outlive this object
  // Only Start() can make the token: use it.
  class Token {
    friend class CollectiveScheduler;
    Token() = default;
  };
  CollectiveScheduler(Token, std::shared_ptr<State> state);

 private:
  std::shared_ptr<State> state_;
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_SCHEDULER_H_
