#include "cc/smb/param_server.h"

#include <chrono>
#include <string>
#include <utility>

namespace smb {

ParamServer::ParamServer() : thread_([this] { Serve(); }) {}

ParamServer::~ParamServer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  queued_.notify_all();
  thread_.join();
}

void ParamServer::Submit(std::function<Status()> update) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(update));
    ++pending_;
  }
  queued_.notify_one();
}

Status ParamServer::WaitPending(uint64_t max_pending, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  if (!drained_.wait_until(lock, deadline, [&] { return pending_ <= max_pending; })) {
    return Status(Code::kDeadlineExceeded,
                  "parameter server: " + std::to_string(pending_) +
                      " updates still pending after " + std::to_string(timeout_s) +
                      " s (waited for at most " + std::to_string(max_pending) + ")");
  }
  return failure_;
}

uint64_t ParamServer::applied() const {
  std::lock_guard<std::mutex> lock(mu_);
  return applied_;
}

void ParamServer::Serve() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    queued_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    std::function<Status()> update = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    Status s = update();
    update = nullptr;  // release what the update held before counting it applied
    lock.lock();
    if (!s.ok() && failure_.ok()) failure_ = s;
    --pending_;
    ++applied_;
    drained_.notify_all();
  }
}

}  // namespace smb
