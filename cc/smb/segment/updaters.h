// How a push changes a parameter segment in the box, applied near the memory
// under the segment's write lock (segment_io.h), so concurrent pushes are
// never lost and consistent reads never see half of one. Each updater owns
// the state it needs: the momentum updater keeps a velocity segment of its
// own beside the parameter.
//
//   std::unique_ptr<smb::Updater> sgd;
//   SMB_RETURN_IF_ERROR(smb::MakeUpdater(box, "dense/kernel", w, {smb::UpdateRule::kSgd}, &sgd));
//   SMB_RETURN_IF_ERROR(sgd->Apply(w, grad, /*learning_rate=*/0.1, /*read_back=*/nullptr,
//                                  /*bulk=*/false));
//   SMB_RETURN_IF_ERROR(sgd->Apply(w, grad, 0.1, /*read_back=*/local, false));  // local = w
#ifndef TF_SMB_CC_SMB_STORE_UPDATERS_H_
#define TF_SMB_CC_SMB_STORE_UPDATERS_H_

#include <memory>
#include <string>

#include "cc/smb/box.h"
#include "cc/smb/status.h"

namespace smb {

enum class UpdateRule {
  kDelta,     // w += update (a change the worker's optimizer computed); any dtype
  kSgd,       // w -= learning_rate * gradient; floating dtypes
  kMomentum,  // v = momentum * v - learning_rate * gradient; w += v
};

struct UpdateOptions {
  UpdateRule rule = UpdateRule::kDelta;
  double momentum = 0.0;  // kMomentum only
};

// Applies `rule` to n elements in plain memory, with no lock: w += update
// (kDelta); w -= learning_rate * update (kSgd); v = momentum * v -
// learning_rate * update, w += v (kMomentum, `velocity` holding v). float16 and
// bfloat16 are computed in float32 and rounded once per stored value.
// kSgd and kMomentum need a floating dtype (InvalidArgument otherwise).
Status ApplyRule(const UpdateOptions& options, DType dtype, void* w, void* velocity,
                 const void* update, double learning_rate, size_t n);

class Updater {
 public:
  virtual ~Updater() = default;
  // `update` holds the segment's dtype and shape: a delta or a gradient.
  // `learning_rate` is unused by kDelta. `read_back` (optional, the
  // segment's size): each stripe's value right after this update, copied
  // while the stripe is still locked and in cache (a push and the next
  // read in one pass); `bulk` as in UseStreamingCopy (copy.h).
  virtual Status Apply(const Segment& param, const void* update, double learning_rate,
                       void* read_back, bool bulk) = 0;
};

// An updater for the parameter segment `param` named `param_name` in `box`.
// kMomentum creates (or, on other ranks, attaches) its velocity segment.
Status MakeUpdater(Box* box, const std::string& param_name, const Segment& param,
                   const UpdateOptions& options, std::unique_ptr<Updater>* out);

}  // namespace smb

#endif  // TF_SMB_CC_SMB_STORE_UPDATERS_H_
