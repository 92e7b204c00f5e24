// The partitioned all-reduce (SingleCaffe's lock-free reduction, across the
// group's ranks): rank r sums slice r of every chunk, reading its own slice
// straight from its input and the other ranks' slices from their staging
// buffers (each rank stages only what the others sum), between barriers.
// The sums then either go back to every rank's output (AllReduceSum) or stay
// in a result buffer every rank reads in place (AllReduceSumShared: no copy
// out). Tensors larger than the staging buffer go through in chunks,
// double-buffered, so the staging memory stays small.
//
//   SMB_RETURN_IF_ERROR(smb::AllReduceSum(group, {{DType::kFloat32, {n}, in, out}}));
#ifndef TF_SMB_CC_SMB_ALGORITHMS_PARTITIONED_ALLREDUCE_H_
#define TF_SMB_CC_SMB_ALGORITHMS_PARTITIONED_ALLREDUCE_H_

#include <memory>
#include <vector>

#include "cc/smb/group.h"
#include "cc/smb/tensor.h"

namespace smb {

// One rank's hold on a result buffer. The buffer is not reused while any
// rank holds it; the hold ends when this object is destroyed.
class ResultHold {
 public:
  ResultHold(std::shared_ptr<Peers> peers, int buffer)
      : peers_(std::move(peers)), buffer_(buffer) {}
  ~ResultHold();
  ResultHold(const ResultHold&) = delete;
  ResultHold& operator=(const ResultHold&) = delete;

 private:
  std::shared_ptr<Peers> peers_;  // keeps the memory alive while sums are read
  int buffer_;
};

// Below this many bytes the sums are copied out: a result buffer gains
// nothing for small collectives.
constexpr size_t kSharedResultMinBytes = size_t{256} << 10;

// out = sum over ranks of in, for every tensor (any mix of dtypes).
Status AllReduceSum(Group& group, const std::vector<TensorRef>& tensors);

// Like AllReduceSum, but when rank 0 finds a free result buffer (and the
// tensors are large enough to gain from it), the sums stay in it: (*sums)[i]
// is tensor i's sum, 64-byte aligned, the same memory on every rank, valid
// and unchanged while *hold lives. Else *hold is null, and the sums go to
// outputs that context->AllocateOutputs gives first (only then is it called,
// so adapters allocate outputs only when they are needed).
Status AllReduceSumShared(Group& group, std::vector<TensorRef> tensors, OpContext* context,
                          std::vector<void*>* sums, std::shared_ptr<ResultHold>* hold);

}  // namespace smb

#endif  // TF_SMB_CC_SMB_ALGORITHMS_PARTITIONED_ALLREDUCE_H_
