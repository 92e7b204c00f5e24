// Parameters living in the box (the asynchronous mode): reads that never see a
// half-written stripe, and writes one writer per stripe at a time, so that
// concurrent pushes are never lost. A segment is locked in stripes of
// kStripeBytes (box.h): pushes of several ranks to one large segment run at
// once on different stripes, and a consistent read copies each stripe as one
// whole version (a read of a segment of several stripes may take some stripes
// from before a concurrent push and the rest from after it). How a push
// changes a segment is an updater's business (updaters.h); this is the
// locking they all share.
//
//   smb::Segment w;  // from Box::AttachSegment
//   SMB_RETURN_IF_ERROR(smb::ReadSegment(w, local, smb::ReadMode::kConsistent));
//   SMB_RETURN_IF_ERROR(smb::WriteSegment(w, [&](size_t offset, size_t bytes) {
//     /* change bytes [offset, offset + bytes) of w.data */ }));
#ifndef TF_SMB_CC_SMB_STORE_SEGMENT_IO_H_
#define TF_SMB_CC_SMB_STORE_SEGMENT_IO_H_

#include <functional>

#include "cc/smb/box.h"
#include "cc/smb/status.h"

namespace smb {

enum class ReadMode {
  kConsistent,  // seqlock: the copy of each stripe is one whole version of it
  kHogwild,     // plain copy: may mix two updates, never blocks on writers
};

// `bulk`: see UseStreamingCopy (copy.h).
Status ReadSegment(const Segment& segment, void* dst, ReadMode mode, bool bulk = false);
// segment = src.
Status AssignSegment(const Segment& segment, const void* src);
// Runs `write(offset, bytes)` on each stripe of the segment in turn, while
// holding that stripe's write lock with the stripe marked as being written
// (consistent readers of it retry meanwhile).
Status WriteSegment(const Segment& segment,
                    const std::function<void(size_t offset, size_t bytes)>& write);

}  // namespace smb

#endif  // TF_SMB_CC_SMB_STORE_SEGMENT_IO_H_
