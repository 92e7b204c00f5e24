// SingleCaffe's parameter-server thread: a process's replica threads hand it
// their updates and go on; its one thread applies them to the process's one
// copy of the parameters, one at a time, in the order they came, so none is
// lost. How an update is applied (locks, copy-on-write) is the submitter's:
// the TensorFlow adapter applies Keras variables' updates under each
// variable's own lock (cc/kernels/).
//
//   smb::ParamServer server;
//   server.Submit([&] { w += 1; });         // returns at once
//   SMB_RETURN_IF_ERROR(server.WaitPending(/*max_pending=*/0, /*timeout_s=*/60));
#ifndef TF_SMB_CC_SMB_PARAM_SERVER_H_
#define TF_SMB_CC_SMB_PARAM_SERVER_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "cc/smb/status.h"

namespace smb {

class ParamServer {
 public:
  ParamServer();
  // Applies what is still queued, then stops the thread.
  ~ParamServer();
  ParamServer(const ParamServer&) = delete;
  ParamServer& operator=(const ParamServer&) = delete;

  // Queues `update` for the server thread; returns at once. An update's
  // failure is kept: the next WaitPending returns the first one.
  void Submit(std::function<Status()> update);
  // Returns once at most `max_pending` updates are queued or being applied
  // (0: all applied); DeadlineExceeded after timeout_s.
  Status WaitPending(uint64_t max_pending, double timeout_s);
  // Updates applied so far.
  uint64_t applied() const;

 private:
  void Serve();

  mutable std::mutex mu_;
  std::condition_variable queued_;   // the server: work or stop
  std::condition_variable drained_;  // waiters: pending went down
  std::deque<std::function<Status()>> queue_;
  uint64_t pending_ = 0;  // queued + being applied
  uint64_t applied_ = 0;
  Status failure_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest is ready
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_PARAM_SERVER_H_
