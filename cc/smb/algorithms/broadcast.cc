#include "cc/smb/algorithms/broadcast.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "cc/smb/algorithms/pieces.h"
#include "cc/smb/timeline.h"

namespace smb {

namespace {

// Node rank `from`'s data reaches every rank of the node, through the
// staging buffers: `outputs` are the pieces' outputs (from's holds the data).
Status ShareOnNode(Group& group, int from, size_t total, const std::vector<Piece>& outputs) {
  const int rank = group.rank();
  const std::vector<Piece>& pieces = outputs;
  if (group.world() == 1) return Status::Ok();
  Peers* peers = group.peers();
  const size_t chunk = peers->staging_bytes();
  for (size_t offset = 0; offset < total; offset += chunk) {
    const size_t len = std::min(chunk, total - offset);
    const int buffer = group.NextStagingBuffer();
    if (rank == from) {
      timeline::Scope phase(group.job_rank(), timeline::kCollectives, "stage");
      GatherBytes(pieces, offset, len, peers->staging(buffer, 0));
    }
    SMB_RETURN_IF_ERROR(group.Sync("broadcast"));
    if (rank != from) {
      timeline::Scope phase(group.job_rank(), timeline::kCollectives, "copy out");
      ScatterBytes(peers->staging(buffer, 0), offset, len, pieces);
    }
  }
  return Status::Ok();
}

}  // namespace

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
  // From here the data is read from and written to the outputs (the root's
  // hold it now).
  for (Piece& p : pieces) p.in = p.out;
  // The rank of each node that carries the data across nodes: the root's
  // local rank, unless a node has fewer ranks than that (nodes of different
  // sizes): then local rank 0, after the root shared the data on its node.
  const int carrier = link != nullptr && local_root >= link->streams() ? 0 : local_root;
  const bool shared_first = has_data && carrier != local_root;
  if (shared_first) SMB_RETURN_IF_ERROR(ShareOnNode(group, local_root, total, pieces));
  if (link != nullptr && rank == carrier) {
    timeline::Scope phase(group.job_rank(), timeline::kCollectives, "across nodes");
    std::vector<char> data(total);
    if (has_data) GatherBytes(pieces, 0, total, data.data());
    SMB_RETURN_IF_ERROR(link->Broadcast(data.data(), total, root_node, group.timeout_s()));
    if (!has_data) ScatterBytes(data.data(), 0, total, pieces);
  }
  if (shared_first) return Status::Ok();
  return ShareOnNode(group, carrier, total, pieces);
}

}  // namespace smb
