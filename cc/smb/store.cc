#include "cc/smb/store.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

namespace smb {
namespace {

constexpr int kOptimisticReads = 64;  // then read under the writers' lock

size_t Elements(const Segment& s) { return s.bytes / DTypeSize(s.dtype); }

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

template <typename T>
void AxpyTyped(void* w, double alpha, const void* x, size_t n) {
  T* y = static_cast<T*>(w);
  const T* v = static_cast<const T*>(x);
  const T a = static_cast<T>(alpha);
  for (size_t i = 0; i < n; ++i) y[i] += a * v[i];
}

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
  WriteGuard guard(segment);
  if (!guard.ok()) return Locked();
  std::memcpy(segment.data, src, segment.bytes);
  return Status::Ok();
}

Status Accumulate(const Segment& segment, const void* delta) {
  WriteGuard guard(segment);
  if (!guard.ok()) return Locked();
  SumInto(segment.dtype, segment.data, segment.data, delta, Elements(segment));
  return Status::Ok();
}

Status Axpy(const Segment& segment, double alpha, const void* x) {
  const size_t n = Elements(segment);
  switch (segment.dtype) {
    case DType::kFloat32:
    case DType::kFloat64:
    case DType::kFloat16:
    case DType::kBFloat16:
      break;
    default:
      return InvalidArgument(std::string("axpy needs a floating segment, got ") +
                             DTypeName(segment.dtype));
  }
  WriteGuard guard(segment);
  if (!guard.ok()) return Locked();
  switch (segment.dtype) {
    case DType::kFloat32: AxpyTyped<float>(segment.data, alpha, x, n); break;
    case DType::kFloat64: AxpyTyped<double>(segment.data, alpha, x, n); break;
    default:
      AxpyHalfLike(segment.dtype, static_cast<uint16_t*>(segment.data), alpha,
                   static_cast<const uint16_t*>(x), n);
      break;
  }
  return Status::Ok();
}

Status MomentumStep(const Segment& segment, const Segment& velocity, double lr,
                    double momentum, const void* grad) {
  if (velocity.dtype != segment.dtype || velocity.bytes != segment.bytes) {
    return InvalidArgument("velocity segment does not match its parameter");
  }
  switch (segment.dtype) {
    case DType::kFloat32:
    case DType::kFloat64:
    case DType::kFloat16:
    case DType::kBFloat16:
      break;
    default:
      return InvalidArgument(std::string("momentum needs a floating segment, got ") +
                             DTypeName(segment.dtype));
  }
  WriteGuard guard(segment);  // the parameter's lock also covers its velocity
  if (!guard.ok()) return Locked();
  const size_t n = Elements(segment);
  if (segment.dtype == DType::kFloat32) {
    float* w = static_cast<float*>(segment.data);
    float* v = static_cast<float*>(velocity.data);
    const float* g = static_cast<const float*>(grad);
    const float m = static_cast<float>(momentum), a = static_cast<float>(lr);
    for (size_t i = 0; i < n; ++i) {
      v[i] = m * v[i] - a * g[i];
      w[i] += v[i];
    }
  } else if (segment.dtype != DType::kFloat64) {
    MomentumHalfLike(segment.dtype, static_cast<uint16_t*>(segment.data),
                     static_cast<uint16_t*>(velocity.data), lr, momentum,
                     static_cast<const uint16_t*>(grad), n);
  } else {
    double* w = static_cast<double*>(segment.data);
    double* v = static_cast<double*>(velocity.data);
    const double* g = static_cast<const double*>(grad);
    for (size_t i = 0; i < n; ++i) {
      v[i] = momentum * v[i] - lr * g[i];
      w[i] += v[i];
    }
  }
  return Status::Ok();
}

}  // namespace smb
