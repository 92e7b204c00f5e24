#include "cc/smb/communicator.h"

#include <algorithm>

#include "cc/smb/algorithms/broadcast.h"
#include "cc/smb/link/transport_link.h"
#include "cc/smb/transport/mpi_transport.h"
#include "cc/smb/transport/shm_peers.h"

namespace smb {

Status Communicator::Open(const Options& options, std::unique_ptr<Communicator>* out) {
  if (options.world < 1 || options.world > kMaxWorld) {
    return InvalidArgument("world size must be in [1, " + std::to_string(kMaxWorld) +
                           "], got " + std::to_string(options.world));
  }
  if (options.rank < 0 || options.rank >= options.world) {
    return InvalidArgument("rank must be in [0, " + std::to_string(options.world) +
                           "), got " + std::to_string(options.rank));
  }
  if (!(options.timeout_s > 0)) {
    return InvalidArgument("timeout must be positive, got " +
                           std::to_string(options.timeout_s));
  }
  if (!options.members.empty() &&
      (!options.across_nodes || static_cast<int>(options.members.size()) != options.world)) {
    return InvalidArgument("members are given for a process set spanning nodes, one job rank "
                           "per rank of it: expected " + std::to_string(options.world) +
                           " with across_nodes, got " + std::to_string(options.members.size()) +
                           (options.across_nodes ? "" : " without across_nodes"));
  }
  if (options.across_nodes) return OpenAcrossNodes(options, out);
  std::unique_ptr<ShmPeers> peers;
  if (options.world > 1) {
    std::unique_ptr<Box> box;
    if (options.create) {
      Box::Options bo;
      bo.job_id = options.job_id;
      bo.world = options.world;
      bo.staging_bytes = options.staging_bytes;
      bo.heap_bytes = options.heap_bytes;
      SMB_RETURN_IF_ERROR(Box::Create(bo, &box));
    } else {
      SMB_RETURN_IF_ERROR(Box::Attach(options.job_id, options.timeout_s, &box));
    }
    const uint32_t world = box->header()->world;
    if (static_cast<int>(world) != options.world) {
      return InvalidArgument("box of job '" + options.job_id + "' was made for " +
                             std::to_string(world) + " workers, this one expects " +
                             std::to_string(options.world));
    }
    SMB_RETURN_IF_ERROR(ShmPeers::Join(std::move(box), options.rank, &peers));
  }
  *out = std::make_unique<Communicator>(Token(), std::move(peers), nullptr, options.timeout_s);
  return Status::Ok();
}

Status Communicator::OpenAcrossNodes(const Options& options, std::unique_ptr<Communicator>* out) {
  std::unique_ptr<Transport> mpi;
  SMB_RETURN_IF_ERROR(MakeMpiTransport(&mpi, options.members));
  LinkOptions lo;
  lo.rank = options.rank;
  lo.world = options.world;
  lo.timeout_s = options.timeout_s;
  std::shared_ptr<NodeLink> link;
  SMB_RETURN_IF_ERROR(StartTransportLink(std::move(mpi), lo, &link));
  // One box per node, named by the node's index: boxes of two nodes never
  // collide, even where nodes share /dev/shm.
  const std::string job_id =
      options.job_id.substr(0, 90) + "-node" + std::to_string(link->node());
  std::unique_ptr<Box> box;
  if (link->local_rank() == 0) {
    Box::Options bo;
    bo.job_id = job_id;
    bo.world = link->local_size();
    bo.staging_bytes = options.staging_bytes;
    bo.heap_bytes = options.heap_bytes;
    SMB_RETURN_IF_ERROR(Box::Create(bo, &box));
  } else {
    SMB_RETURN_IF_ERROR(Box::Attach(job_id, options.timeout_s, &box));
  }
  std::unique_ptr<ShmPeers> peers;
  SMB_RETURN_IF_ERROR(ShmPeers::Join(std::move(box), link->local_rank(), &peers));
  *out = std::make_unique<Communicator>(Token(), std::move(peers), std::move(link),
                                        options.timeout_s);
  return Status::Ok();
}

std::unique_ptr<Communicator> Communicator::Create(std::shared_ptr<Peers> peers,
                                                   double timeout_s,
                                                   std::shared_ptr<NodeLink> link) {
  // A rank alone on one node needs no peers (every call succeeds at once); a
  // rank alone on its node but linked to others keeps them (the link's
  // callbacks and decisions go through its control words).
  if (peers && peers->world() == 1 && link == nullptr) peers = nullptr;
  return std::make_unique<Communicator>(Token(), std::move(peers), std::move(link), timeout_s);
}

Communicator::Communicator(Token, std::shared_ptr<Peers> peers, std::shared_ptr<NodeLink> link,
                           double timeout_s)
    : group_(std::move(peers), timeout_s, std::move(link)), clock_(&group_) {
  Peers* p = group_.peers();
  if (p == nullptr || p->box() == nullptr) return;
  segments_ = std::make_shared<SegmentTable>(group_.shared_peers(), group_.link());
  if (NodeLink* l = group_.link()) {
    // This rank serves its counterparts on other nodes the segments homed
    // here, until the link stops at exit (when every rank is leaving), even
    // after this communicator is gone: the server keeps the table and box.
    std::shared_ptr<SegmentTable> table = segments_;
    l->SetSegmentServer([table](const SegmentRequest& request, const void* payload,
                                size_t bytes, std::vector<char>* reply) {
      return table->Serve(request, payload, bytes, reply);
    });
  }
}

Communicator::~Communicator() = default;

Status Communicator::AllReduceSum(const std::vector<TensorRef>& tensors) {
  return smb::AllReduceSum(group_, tensors);
}

Status Communicator::AllReduceSumShared(std::vector<TensorRef> tensors, OpContext* context,
                                        std::vector<void*>* sums,
                                        std::shared_ptr<ResultHold>* hold) {
  return smb::AllReduceSumShared(group_, std::move(tensors), context, sums, hold);
}

Status Communicator::Broadcast(int root, const std::vector<TensorRef>& tensors) {
  return smb::Broadcast(group_, root, tensors);
}

Status Communicator::Barrier() {
  if (group_.alone()) return Status::Ok();
  // Past a barrier every push made before it is home and read back (the
  // asynchronous mode's pushes combined per node: NodeCombiner).
  if (segments_ != nullptr) SMB_RETURN_IF_ERROR(segments_->FlushCombined(timeout_s()));
  SMB_RETURN_IF_ERROR(group_.Agree("barrier", "barrier"));
  if (segments_ != nullptr) segments_->ForgetCombinedReads();
  return Status::Ok();
}

Status Communicator::FinishJoin(int* last_rank) {
  // Each rank's join order, summed into place: the largest joined last.
  std::vector<int64_t> orders(world(), 0);
  orders[rank()] = static_cast<int64_t>(group_.ClearJoined());
  SMB_RETURN_IF_ERROR(AllReduceSum(
      {{DType::kInt64, {static_cast<int64_t>(orders.size())}, orders.data(), orders.data()}}));
  *last_rank = static_cast<int>(std::max_element(orders.begin(), orders.end()) - orders.begin());
  return Status::Ok();
}

}  // namespace smb
