// The link between nodes (node_link.h) over any transport (transport/
// transport.h): one thread per process makes every transport call, so
// TensorFlow's threads never do. On that thread it runs the collectives among
// a rank's counterparts, carries the job-wide collective order (Decider),
// the memory server's calls (segment_wire.h), step clocks, each rank's files
// for rank 0 and failures as messages, and tells every rank of the other
// nodes it is alive; a watchdog thread finds ranks that fell silent (lost)
// and the link's thread stuck inside the transport.
//
//   std::unique_ptr<smb::Transport> mpi;
//   SMB_RETURN_IF_ERROR(smb::MakeMpiTransport(&mpi));
//   std::shared_ptr<smb::NodeLink> link;
//   SMB_RETURN_IF_ERROR(smb::StartTransportLink(std::move(mpi), {rank, world}, &link));
//
// At process exit (or when the last reference goes) the link tells the
// others it leaves, waits until every other rank has left too (a rank keeps
// serving its segments until then), and finishes the transport, unless the
// job failed.
#ifndef TF_SMB_CC_SMB_LINK_TRANSPORT_LINK_H_
#define TF_SMB_CC_SMB_LINK_TRANSPORT_LINK_H_

#include <memory>

#include "cc/smb/node_link.h"
#include "cc/smb/status.h"
#include "cc/smb/transport/transport.h"

namespace smb {

struct LinkOptions {
  int rank = 0;   // what the launcher said: the transport must agree
  int world = 1;
  double timeout_s = 600;  // for starting up, and for the exit's wait for the others
  // A rank of another node that sends nothing this long is lost (its node
  // died or was cut off).
  double lost_after_s = 10;
};

// Starts the transport on the link's thread; fails with what was expected
// and what came (launcher and transport disagree, nodes of different sizes).
Status StartTransportLink(std::unique_ptr<Transport> transport, const LinkOptions& options,
                          std::shared_ptr<NodeLink>* out);

}  // namespace smb

#endif  // TF_SMB_CC_SMB_LINK_TRANSPORT_LINK_H_
