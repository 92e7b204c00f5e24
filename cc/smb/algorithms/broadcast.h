// Broadcast through the staging buffers: the root copies a chunk into its
// staging buffer, every rank copies it out after a barrier; double-buffered.
// Across nodes the root's local rank on every node first gets the data
// through the node link, then broadcasts it on its node.
//
//   SMB_RETURN_IF_ERROR(smb::Broadcast(group, /*root=*/0, tensors));
#ifndef TF_SMB_CC_SMB_ALGORITHMS_BROADCAST_H_
#define TF_SMB_CC_SMB_ALGORITHMS_BROADCAST_H_

#include <vector>

#include "cc/smb/group.h"
#include "cc/smb/tensor.h"

namespace smb {

// out = root's in, for every tensor, on every rank of the job (`root` is a job rank).
Status Broadcast(Group& group, int root, const std::vector<TensorRef>& tensors);

}  // namespace smb

#endif  // TF_SMB_CC_SMB_ALGORITHMS_BROADCAST_H_
