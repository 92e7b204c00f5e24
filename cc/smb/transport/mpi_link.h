// The link between nodes over Open MPI (see node_link.h): one communication
// thread per process makes every MPI call (MPI_Init_thread included), so
// TensorFlow's threads never call MPI. It finds the node layout with
// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED), runs the collectives among a
// rank's counterparts on other nodes as nonblocking MPI operations, and
// carries the job-wide collective order and failures as point-to-point
// messages (tf_smb opens no socket of its own: all traffic is MPI's).
//
//   std::shared_ptr<smb::NodeLink> link;
//   SMB_RETURN_IF_ERROR(smb::StartMpiLink({rank, world, timeout_s}, &link));
//
// Built only where mpi.h was found (TF_SMB_WITH_MPI); elsewhere
// StartMpiLink says how to get it. At process exit the thread calls
// MPI_Finalize (every rank must, or mpirun reports the job as failed),
// unless the job failed.
#ifndef TF_SMB_CC_SMB_TRANSPORT_MPI_LINK_H_
#define TF_SMB_CC_SMB_TRANSPORT_MPI_LINK_H_

#include <memory>

#include "cc/smb/node_link.h"
#include "cc/smb/status.h"

namespace smb {

struct MpiLinkOptions {
  int rank = 0;   // what the launcher said: MPI must agree
  int world = 1;
  double timeout_s = 600;  // for starting up
};

// True when this build has the MPI transport.
bool MpiLinkAvailable();

// Starts MPI and the communication thread; fails with what was expected
// and what came (launcher and MPI disagree, nodes of different sizes).
Status StartMpiLink(const MpiLinkOptions& options, std::shared_ptr<NodeLink>* out);

}  // namespace smb

#endif  // TF_SMB_CC_SMB_TRANSPORT_MPI_LINK_H_
