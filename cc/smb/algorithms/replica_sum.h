// SingleCaffe's partitioned reduction among the replicas of one process:
// every replica's tensors are already in this process's memory, so nothing is
// staged. The elements of all tensors, laid end to end, are cut into `parts`
// contiguous parts; part p sums every replica's elements of part p into the
// output. Parts write disjoint bytes, so they run on parallel threads with no
// locks; the caller's runner is the barrier (it returns when all are done).
//
//   smb::ReplicaSumTensor t{DType::kFloat32, n, {a, b, c}, out};
//   SMB_RETURN_IF_ERROR(smb::ReplicaSum({t}, /*parts=*/3, smb::RunPartsOnThreads));
#ifndef TF_SMB_CC_SMB_ALGORITHMS_REPLICA_SUM_H_
#define TF_SMB_CC_SMB_ALGORITHMS_REPLICA_SUM_H_

#include <cstddef>
#include <functional>
#include <vector>

#include "cc/smb/dtype.h"
#include "cc/smb/status.h"

namespace smb {

struct ReplicaSumTensor {
  DType dtype;
  size_t elements;
  std::vector<const void*> replicas;  // every replica's data, same dtype and size
  void* out;                          // may alias replicas[0]
};

// Runs part(0) ... part(parts - 1), possibly in parallel, and returns when
// all have returned.
using PartRunner = std::function<void(int parts, const std::function<void(int)>& part)>;

// One thread per part beyond the first (the caller's thread runs part 0).
void RunPartsOnThreads(int parts, const std::function<void(int)>& part);

// out = sum over replicas, for every tensor. Fails (InvalidArgument) when a
// tensor has no replicas or `parts` < 1.
Status ReplicaSum(const std::vector<ReplicaSumTensor>& tensors, int parts,
                  const PartRunner& run);

}  // namespace smb

#endif  // TF_SMB_CC_SMB_ALGORITHMS_REPLICA_SUM_H_
