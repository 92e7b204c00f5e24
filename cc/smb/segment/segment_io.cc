#include "cc/smb/segment/segment_io.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include "cc/smb/copy.h"

namespace smb {
namespace {

#if defined(__SANITIZE_THREAD__)
// ThreadSanitizer cannot tell a sequence-number retry from a race: under it,
// every consistent read takes the writers' lock.
constexpr int kOptimisticReads = 0;
#else
constexpr int kOptimisticReads = 64;  // then read under the writers' lock
#endif

// Takes a stripe's write lock. If its holder died mid-update, the partial
// update stays (as a lost or partial push would in any asynchronous scheme)
// and the seqlock is made even again.
bool LockWriters(StripeLock* s) {
  int rc = pthread_mutex_lock(&s->write_lock);
  if (rc == EOWNERDEAD) {
    rc = pthread_mutex_consistent(&s->write_lock);
    if (rc != 0) {
      pthread_mutex_unlock(&s->write_lock);
      return false;
    }
    const uint64_t v = s->version.load(std::memory_order_relaxed);
    if (v & 1) s->version.store(v + 1, std::memory_order_relaxed);
  }
  return rc == 0;
}

// Holds a stripe's write lock and marks the stripe odd (being written) for
// as long as it lives.
class WriteGuard {
 public:
  explicit WriteGuard(StripeLock* s) : stripe_(s) {
    ok_ = LockWriters(stripe_);
    if (ok_) {
      stripe_->version.fetch_add(1, std::memory_order_relaxed);  // now odd
      std::atomic_thread_fence(std::memory_order_release);
    }
  }
  ~WriteGuard() {
    if (!ok_) return;
    stripe_->version.fetch_add(1, std::memory_order_release);  // even again
    pthread_mutex_unlock(&stripe_->write_lock);
  }
  bool ok() const { return ok_; }

 private:
  StripeLock* stripe_;
  bool ok_ = false;
};

Status Locked() { return Internal("cannot lock a segment stripe for writing"); }

// dst = src, `bytes` of one stripe, as one whole version of it.
Status ReadStripe(StripeLock* s, const char* src, char* dst, size_t bytes, CopyFn copy) {
  for (int attempt = 0; attempt < kOptimisticReads; ++attempt) {
    const uint64_t before = s->version.load(std::memory_order_acquire);
    if (before & 1) {
      std::this_thread::yield();
      continue;
    }
    copy(dst, src, bytes);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s->version.load(std::memory_order_relaxed) == before) return Status::Ok();
  }
  // Writers keep overlapping this read: take their lock so it finishes.
  if (!LockWriters(s)) return Locked();
  copy(dst, src, bytes);
  pthread_mutex_unlock(&s->write_lock);
  return Status::Ok();
}

}  // namespace

Status ReadSegment(const Segment& segment, void* dst, ReadMode mode, bool bulk) {
  if (mode == ReadMode::kHogwild) {
    std::memcpy(dst, segment.data, segment.bytes);
    return Status::Ok();
  }
  const char* src = static_cast<const char*>(segment.data);
  char* out = static_cast<char*>(dst);
  const CopyFn copy = CopyFor(segment.bytes, bulk);
  Status read;
  for (uint64_t k = 0, n = NumStripes(segment.bytes); k < n && read.ok(); ++k) {
    const size_t at = k * kStripeBytes;
    read = ReadStripe(&segment.stripes[k], src + at, out + at,
                      std::min(kStripeBytes, segment.bytes - at), copy);
  }
  StreamingFence();
  return read;
}

Status AssignSegment(const Segment& segment, const void* src) {
  return WriteSegment(segment, [&](size_t offset, size_t bytes) {
    std::memcpy(static_cast<char*>(segment.data) + offset,
                static_cast<const char*>(src) + offset, bytes);
  });
}

Status WriteSegment(const Segment& segment,
                    const std::function<void(size_t offset, size_t bytes)>& write) {
  for (uint64_t k = 0, n = NumStripes(segment.bytes); k < n; ++k) {
    const size_t at = k * kStripeBytes;
    WriteGuard guard(&segment.stripes[k]);
    if (!guard.ok()) return Locked();
    write(at, std::min(kStripeBytes, segment.bytes - at));
  }
  return Status::Ok();
}

}  // namespace smb
