#include "cc/smb/algorithms/broadcast.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "cc/smb/algorithms/pieces.h"
#include "cc/smb/timeline.h"

namespace smb {

Status Broadcast(Group& group, int root, const std::vector<TensorRef>& tensors) {
  SMB_RETURN_IF_ERROR(ValidateTensors(tensors));
  if (root < 0 || root >= group.world()) {
    return InvalidArgument("broadcast root must be in [0, " + std::to_string(group.world()) +
                           "), got " + std::to_string(root));
  }
  std::vector<Piece> pieces;
  size_t total = 0;
  for (const TensorRef& t : tensors) {
    const size_t bytes = NumBytes(t);
    if (bytes == 0) continue;
    pieces.push_back({static_cast<const char*>(t.in), static_cast<char*>(t.out), bytes});
    total += bytes;
  }
  const int rank = group.rank();
  if (rank == root) {
    timeline::Scope phase(rank, timeline::kCollectives, "copy out");
    for (const Piece& p : pieces) {
      if (p.in != p.out) std::memcpy(p.out, p.in, p.bytes);
    }
  }
  if (group.world() == 1) return Status::Ok();
  SMB_RETURN_IF_ERROR(group.Agree(
      "broadcast", Describe("broadcast from rank " + std::to_string(root), tensors)));
  Peers* peers = group.peers();
  const size_t chunk = peers->staging_bytes();
  for (size_t offset = 0; offset < total; offset += chunk) {
    const size_t len = std::min(chunk, total - offset);
    const int buffer = group.NextStagingBuffer();
    if (rank == root) {
      timeline::Scope phase(rank, timeline::kCollectives, "stage");
      GatherBytes(pieces, offset, len, peers->staging(buffer, 0));
    }
    SMB_RETURN_IF_ERROR(group.Sync("broadcast"));
    if (rank != root) {
      timeline::Scope phase(rank, timeline::kCollectives, "copy out");
      ScatterBytes(peers->staging(buffer, 0), offset, len, pieces);
    }
  }
  return Status::Ok();
}

}  // namespace smb
