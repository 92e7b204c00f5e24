#include "cc/smb/transport/thread_peers.h"

#include <cstdint>

namespace smb {
namespace {

size_t Align64(size_t n) { return (n + 63) / 64 * 64; }

}  // namespace

class ThreadPeers : public Peers {
 public:
  ThreadPeers(ThreadGroup* group, int rank) : group_(group), rank_(rank) {}
  ~ThreadPeers() override { group_->gone_[rank_].store(true); }

  int rank() const override { return rank_; }
  int world() const override { return group_->world_; }
  GroupControl* control() const override { return group_->control_.get(); }
  char* staging(int buffer, int rank) const override {
    const size_t index = static_cast<size_t>(buffer) * group_->world_ + rank;
    return group_->staging_ + index * group_->staging_bytes_;
  }
  size_t staging_bytes() const override { return group_->staging_bytes_; }
  char* base() const override { return group_->heap_; }
  Status AllocateShared(uint64_t bytes, const std::string& what, uint64_t* offset) override {
    std::lock_guard<std::mutex> lock(group_->heap_mu_);
    const size_t start = Align64(group_->heap_used_);
    if (start > group_->heap_bytes_ || bytes > group_->heap_bytes_ - start) {
      return Status(Code::kResourceExhausted, "thread group heap full: cannot allocate " +
                                                  std::to_string(bytes) + " bytes for " + what);
    }
    group_->heap_used_ = start + bytes;
    *offset = start;
    return Status::Ok();
  }
  bool Gone(int rank) const override { return group_->gone_[rank].load(); }
  std::string Identity(int) const override { return "thread"; }

 private:
  ThreadGroup* group_;
  int rank_;
};

ThreadGroup::ThreadGroup(int world, size_t staging_bytes, size_t heap_bytes)
    : world_(world),
      staging_bytes_(Align64(staging_bytes)),
      control_(std::make_unique<GroupControl>()),
      heap_bytes_(heap_bytes),
      gone_(std::make_unique<std::atomic<bool>[]>(world)) {
  const size_t staging_total = 2 * static_cast<size_t>(world) * staging_bytes_;
  memory_.resize(64 + staging_total + heap_bytes_);
  const uintptr_t raw = reinterpret_cast<uintptr_t>(memory_.data());
  staging_ = memory_.data() + (Align64(raw) - raw);
  heap_ = staging_ + staging_total;
  for (int r = 0; r < world; ++r) gone_[r].store(false);
}

std::shared_ptr<Peers> ThreadGroup::Join(int rank) {
  return std::make_shared<ThreadPeers>(this, rank);
}

}  // namespace smb
