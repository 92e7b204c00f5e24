#include "cc/smb/transport/shm_peers.h"

#include <unistd.h>

#include "cc/smb/process.h"

namespace smb {

Status ShmPeers::Join(std::shared_ptr<Box> box, int rank, std::unique_ptr<ShmPeers>* out) {
  BoxHeader* h = box->header();
  if (rank < 0 || rank >= static_cast<int>(h->world)) {
    return InvalidArgument("rank must be in [0, " + std::to_string(h->world) + "), got " +
                           std::to_string(rank));
  }
  const int32_t other = h->pids[rank].load();
  if (other != 0 && other != getpid() && IsProcessAlive(other)) {
    return Status(Code::kAlreadyExists, "rank " + std::to_string(rank) + " of job '" +
                                            h->job_id + "' is already taken by pid " +
                                            std::to_string(other));
  }
  h->left[rank].store(0);
  h->pids[rank].store(getpid());
  *out = std::make_unique<ShmPeers>(Token(), std::move(box), rank);
  return Status::Ok();
}

int ShmPeers::world() const { return static_cast<int>(box_->header()->world); }

GroupControl* ShmPeers::control() const { return &box_->header()->group; }

char* ShmPeers::staging(int buffer, int rank) const { return box_->staging(buffer, rank); }

size_t ShmPeers::staging_bytes() const { return box_->header()->staging_bytes; }

char* ShmPeers::base() const { return box_->base(); }

Status ShmPeers::AllocateShared(uint64_t bytes, const std::string& what, uint64_t* offset) {
  return box_->AllocateHeap(bytes, what, offset);
}

bool ShmPeers::Gone(int rank) const {
  const int32_t pid = box_->header()->pids[rank].load();
  return pid != 0 && !IsProcessAlive(pid);
}

int ShmPeers::Left(int rank) const { return box_->header()->left[rank].load(); }

void ShmPeers::Leave(int how) {
  box_->header()->left[rank_].store(how);
  control()->wake.fetch_add(1, std::memory_order_release);
  FutexWakeAll(&control()->wake);
}

std::string ShmPeers::Identity(int rank) const {
  return "pid " + std::to_string(box_->header()->pids[rank].load());
}

}  // namespace smb
