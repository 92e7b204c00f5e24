// Peers that are threads of one process, meeting in plain memory: for many
// replicas in one process (SingleCaffe's design) and for testing the
// collectives with ranks as threads (under ThreadSanitizer, AddressSanitizer).
//
//   smb::ThreadGroup group(/*world=*/3);
//   // in thread r:
//   std::unique_ptr<smb::Communicator> comm;
//   smb::Communicator::Create(group.Join(r), /*timeout_s=*/30, &comm);
#ifndef TF_SMB_CC_SMB_TRANSPORT_THREAD_PEERS_H_
#define TF_SMB_CC_SMB_TRANSPORT_THREAD_PEERS_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cc/smb/peers.h"

namespace smb {

class ThreadGroup {
 public:
  explicit ThreadGroup(int world, size_t staging_bytes = size_t{1} << 20,
                       size_t heap_bytes = size_t{64} << 20);
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;

  // The group as rank `rank` sees it; the group must outlive it. When the
  // returned object is destroyed, the rank counts as gone for the others.
  std::shared_ptr<Peers> Join(int rank);
  int world() const { return world_; }

 private:
  friend class ThreadPeers;
  int world_;
  size_t staging_bytes_;
  std::unique_ptr<GroupControl> control_;
  std::vector<char> memory_;  // staging, then the heap; 64-byte aligned inside
  char* staging_ = nullptr;
  char* heap_ = nullptr;
  size_t heap_bytes_;
  std::mutex heap_mu_;
  size_t heap_used_ = 0;
  std::unique_ptr<std::atomic<bool>[]> gone_;
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_TRANSPORT_THREAD_PEERS_H_
