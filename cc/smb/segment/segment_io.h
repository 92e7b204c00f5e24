// Parameters living in the box (the asynchronous mode): reads that never see a
// half-written tensor, and writes one writer per segment at a time, so that
// concurrent pushes are never lost. How a push changes a segment is an
// updater's business (updaters.h); this is the locking they all share.
//
//   smb::Segment w;  // from Box::AttachSegment
//   SMB_RETURN_IF_ERROR(smb::ReadSegment(w, local, smb::ReadMode::kConsistent));
//   SMB_RETURN_IF_ERROR(smb::WriteSegment(w, [&] { /* change w.data */ }));
#ifndef TF_SMB_CC_SMB_STORE_SEGMENT_IO_H_
#define TF_SMB_CC_SMB_STORE_SEGMENT_IO_H_

#include <functional>

#include "cc/smb/box.h"
#include "cc/smb/status.h"

namespace smb {

enum class ReadMode {
  kConsistent,  // seqlock: the copy is one whole version of the segment
  kHogwild,     // plain copy: may mix two updates, never blocks on writers
};

Status ReadSegment(const Segment& segment, void* dst, ReadMode mode);
// segment = src.
Status AssignSegment(const Segment& segment, const void* src);
// Runs `write` while holding the segment's write lock, with the segment
// marked as being written (consistent readers retry meanwhile).
Status WriteSegment(const Segment& segment, const std::function<void()>& write);

}  // namespace smb

#endif  // TF_SMB_CC_SMB_STORE_SEGMENT_IO_H_
