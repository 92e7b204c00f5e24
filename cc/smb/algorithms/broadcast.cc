#include "cc/smb/algorithms/broadcast.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "cc/smb/algorithms/pieces.h"
#include "cc/smb/timeline.h"

namespace smb {

Status Broadcast(Group& group, int root, const std::vector<TensorRef>& tensors) {
  SMB_RETURN_IF_ERROR(ValidateTensors(tensors));
  if (root < 0 || root >= group.job_world()) {
    return InvalidArgument("broadcast root must be in [0, " + std::to_string(group.job_world()) +
                           "), got " + std::to_string(root));
  }
  const std::string what = "broadcast from rank " + std::to_string(root);
  NodeLink* link = group.link();
  int root_node = 0, local_root = root;
  if (link != nullptr) link->Locate(root, &root_node, &local_root);
  const bool has_data = link == nullptr || link->node() == root_node;
  size_t total = 0;
  std::vector<Piece> pieces = PiecesOf(tensors, &total);
  const int rank = group.rank();
  if (rank == local_root && has_data) {
    timeline::Scope phase(group.job_rank(), timeline::kCollectives, "copy out");
    for (const Piece& p : pieces) {
      if (p.in != p.out) std::memcpy(p.out, p.in, p.bytes);
    }
  }
  if (group.alone()) return Status::Ok();
  SMB_RETURN_IF_ERROR(group.Agree("broadcast", Describe(what, tensors)));
  if (link != nullptr && rank == local_root) {
    timeline::Scope phase(group.job_rank(), timeline::kCollectives, "across nodes");
    std::vector<char> data(total);
    if (has_data) GatherBytes(pieces, 0, total, data.data());
    SMB_RETURN_IF_ERROR(link->Broadcast(data.data(), total, root_node, group.timeout_s()));
    if (!has_data) ScatterBytes(data.data(), 0, total, pieces);
  }
  // From here the local root's outputs hold the data on every node.
  if (rank == local_root) {
    for (Piece& p : pieces) p.in = p.out;
  }
  if (group.world() == 1) return Status::Ok();
  Peers* peers = group.peers();
  const size_t chunk = peers->staging_bytes();
  for (size_t offset = 0; offset < total; offset += chunk) {
    const size_t len = std::min(chunk, total - offset);
    const int buffer = group.NextStagingBuffer();
    if (rank == local_root) {
      timeline::Scope phase(group.job_rank(), timeline::kCollectives, "stage");
      GatherBytes(pieces, offset, len, peers->staging(buffer, 0));
    }
    SMB_RETURN_IF_ERROR(group.Sync("broadcast"));
    if (rank != local_root) {
      timeline::Scope phase(group.job_rank(), timeline::kCollectives, "copy out");
      ScatterBytes(peers->staging(buffer, 0), offset, len, pieces);
    }
  }
  return Status::Ok();
}

}  // namespace smb
