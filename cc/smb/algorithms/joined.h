// A rank that has joined (Horovod's hvd.join: it ran out of data) takes part
// in the collectives the other ranks still run, with zeros: it reads what the
// collective is from the description a training rank publishes for it
// (Group::PeekNextDescription; when every rank of its node has joined, from
// another node's verdict: Group::LearnAcrossNodes) and runs the same algorithm on zero tensors of
// those dtypes and shapes (all-reduces as AllReduceSumShared, the form every
// framework adapter uses). All-reduces then sum the others' tensors only,
// broadcasts and barriers complete as usual; a broadcast from a joined root
// has no data to send and fails the job, naming the root.
//
//   if (group.Joined(group.rank())) SMB_RETURN_IF_ERROR(smb::ServeAsJoined(group));
#ifndef TF_SMB_CC_SMB_ALGORITHMS_JOINED_H_
#define TF_SMB_CC_SMB_ALGORITHMS_JOINED_H_

#include <string>
#include <vector>

#include "cc/smb/group.h"
#include "cc/smb/tensor.h"

namespace smb {

// Takes part, with zeros, in the collective the group runs next.
Status ServeAsJoined(Group& group);

// What a description made by Describe() (after an agreement's lines, if any)
// says: the op ("allreduce", "broadcast from rank 2", "barrier") and its
// tensors' dtypes and shapes (`in` and `out` null).
Status ParseDescription(const std::string& desc, std::string* op,
                        std::vector<TensorRef>* tensors);

}  // namespace smb

#endif  // TF_SMB_CC_SMB_ALGORITHMS_JOINED_H_
