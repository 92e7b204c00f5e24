// Peers that are the processes of one node, meeting in the node's box.
//
//   std::unique_ptr<smb::ShmPeers> peers;
//   SMB_RETURN_IF_ERROR(smb::ShmPeers::Join(box, rank, &peers));
#ifndef TF_SMB_CC_SMB_TRANSPORT_SHM_PEERS_H_
#define TF_SMB_CC_SMB_TRANSPORT_SHM_PEERS_H_

#include <memory>
#include <string>

#include "cc/smb/box.h"
#include "cc/smb/peers.h"

namespace smb {

class ShmPeers : public Peers {
 public:
  // Takes rank `rank` of the box's group; fails if a live process has it.
  static Status Join(std::shared_ptr<Box> box, int rank, std::unique_ptr<ShmPeers>* out);

  int rank() const override { return rank_; }
  int world() const override;
  GroupControl* control() const override;
  char* staging(int buffer, int rank) const override;
  size_t staging_bytes() const override;
  char* base() const override;
  Status AllocateShared(uint64_t bytes, const std::string& what, uint64_t* offset) override;
  bool Gone(int rank) const override;
  std::string Identity(int rank) const override;
  int Left(int rank) const override;
  void Leave(int how) override;
  Box* box() const override { return box_.get(); }

  // Only Join() makes the token: use it.
  class Token {
    friend class ShmPeers;
    Token() = default;
  };
  ShmPeers(Token, std::shared_ptr<Box> box, int rank) : box_(std::move(box)), rank_(rank) {}

 private:
  std::shared_ptr<Box> box_;
  int rank_;
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_TRANSPORT_SHM_PEERS_H_
