#include "cc/smb/segment/segment_io.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

namespace smb {
namespace {

constexpr int kOptimisticReads = 64;  // then read under the writers' lock

// Takes a segment's write lock. If its holder died mid-update, the partial
// update stays (as a lost or partial push would in any asynchronous scheme)
// and the seqlock is made even again.
bool LockWriters(SegmentEntry* e) {
  int rc = pthread_mutex_lock(&e->write_lock);
  if (rc == EOWNERDEAD) {
    rc = pthread_mutex_consistent(&e->write_lock);
    if (rc != 0) {
      pthread_mutex_unlock(&e->write_lock);
      return false;
    }
    const uint64_t v = e->version.load(std::memory_order_relaxed);
    if (v & 1) e->version.store(v + 1, std::memory_order_relaxed);
  }
  return rc == 0;
}

// Holds a segment's write lock and marks the segment odd (being written)
// for as long as it lives.
class WriteGuard {
 public:
  explicit WriteGuard(const Segment& s) : entry_(s.entry) {
    ok_ = LockWriters(entry_);
    if (ok_) {
      entry_->version.fetch_add(1, std::memory_order_relaxed);  // now odd
      std::atomic_thread_fence(std::memory_order_release);
    }
  }
  ~WriteGuard() {
    if (!ok_) return;
    entry_->version.fetch_add(1, std::memory_order_release);  // even again
    pthread_mutex_unlock(&entry_->write_lock);
  }
  bool ok() const { return ok_; }

 private:
  SegmentEntry* entry_;
  bool ok_ = false;
};

Status Locked() { return Internal("cannot lock a segment for writing"); }

}  // namespace

Status ReadSegment(const Segment& segment, void* dst, ReadMode mode) {
  SegmentEntry* e = segment.entry;
  if (mode == ReadMode::kHogwild) {
    std::memcpy(dst, segment.data, segment.bytes);
    return Status::Ok();
  }
  for (int attempt = 0; attempt < kOptimisticReads; ++attempt) {
    const uint64_t before = e->version.load(std::memory_order_acquire);
    if (before & 1) {
      std::this_thread::yield();
      continue;
    }
    std::memcpy(dst, segment.data, segment.bytes);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (e->version.load(std::memory_order_relaxed) == before) return Status::Ok();
  }
  // Writers keep overlapping this read: take their lock so it finishes.
  if (!LockWriters(e)) return Locked();
  std::memcpy(dst, segment.data, segment.bytes);
  pthread_mutex_unlock(&e->write_lock);
  return Status::Ok();
}

Status AssignSegment(const Segment& segment, const void* src) {
  return WriteSegment(segment, [&] { std::memcpy(segment.data, src, segment.bytes); });
}

Status WriteSegment(const Segment& segment, const std::function<void()>& write) {
  WriteGuard guard(segment);
  if (!guard.ok()) return Locked();
  write();
  return Status::Ok();
}

}  // namespace smb
