// Parameters living in the box (the asynchronous mode): reads that never see a
// half-written tensor, and updates applied near the memory, one writer per
// segment at a time so that concurrent pushes are never lost.
//
//   smb::Segment w;  // from Box::AttachSegment
//   SMB_RETURN_IF_ERROR(smb::ReadSegment(w, local, smb::ReadMode::kConsistent));
//   SMB_RETURN_IF_ERROR(smb::Accumulate(w, delta));          // w += delta
//   SMB_RETURN_IF_ERROR(smb::Axpy(w, -learning_rate, grad));  // w += a * g
#ifndef TF_SMB_CC_SMB_STORE_H_
#define TF_SMB_CC_SMB_STORE_H_

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
// segment += delta (every dtype; integers wrap).
Status Accumulate(const Segment& segment, const void* delta);
// segment += alpha * x (floating dtypes only).
Status Axpy(const Segment& segment, double alpha, const void* x);
// Server-side momentum SGD: velocity = momentum * velocity - lr * grad;
// segment += velocity. Both segments must have the same dtype and shape.
Status MomentumStep(const Segment& segment, const Segment& velocity, double lr,
                    double momentum, const void* grad);

}  // namespace smb

#endif  // TF_SMB_CC_SMB_STORE_H_
