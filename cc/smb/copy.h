// Copies into large destinations that no cache holds: non-temporal stores
// write the bytes without first reading every cache line of the destination
// (which plain stores do), so such a copy moves 2 bytes per byte, not 3.
//
//   smb::CopyStreaming(dst, src, bytes);  // any number of these, then
//   smb::StreamingFence();                // before another thread or rank reads dst
#ifndef TF_SMB_CC_SMB_COPY_H_
#define TF_SMB_CC_SMB_COPY_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace smb {

// Destinations from this size on are written with CopyStreaming: smaller
// ones may still be in a cache when they are read.
constexpr size_t kStreamingCopyBytes = size_t{8} << 20;

// Whether a copy of `bytes` to a destination uses CopyStreaming; `bulk`: it
// is one of many copies that add up to kStreamingCopyBytes or more (a
// step's reads of a model's segments), whose first ones will have left the
// cache when the last is done.
inline bool UseStreamingCopy(size_t bytes, bool bulk) {
  return bulk || bytes >= kStreamingCopyBytes;
}

inline void CopyStreaming(char* dst, const char* src, size_t bytes) {
#if defined(__SSE2__)
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    size_t i = 0;
    for (; i + 64 <= bytes; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, bytes - i);
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

inline void CopyPlain(char* dst, const char* src, size_t bytes) { std::memcpy(dst, src, bytes); }

using CopyFn = void (*)(char* dst, const char* src, size_t bytes);

// The copy for a destination of `bytes` (see UseStreamingCopy); after a
// CopyStreaming, StreamingFence before the bytes are read elsewhere.
inline CopyFn CopyFor(size_t bytes, bool bulk) {
  return UseStreamingCopy(bytes, bulk) ? CopyStreaming : CopyPlain;
}

// Orders every streaming store before the stores that follow (a barrier's
// arrival, a seqlock's release).
inline void StreamingFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace smb

#endif  // TF_SMB_CC_SMB_COPY_H_
