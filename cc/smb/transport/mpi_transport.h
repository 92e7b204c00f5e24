// The transport between nodes over Open MPI (see transport.h). It finds the
// node layout with MPI_Comm_split_type(MPI_COMM_TYPE_SHARED), sends the
// engine's messages point to point on a duplicate of MPI_COMM_WORLD (so they
// never match a collective's traffic), and runs the collectives among a
// rank's counterparts as nonblocking MPI operations on their own
// communicator. tf_smb opens no socket of its own: all traffic is MPI's.
// A transport among some of the job's ranks (a process set spanning nodes)
// does the same on a communicator of those ranks; it needs MPI initialized
// with MPI_THREAD_MULTIPLE (the job's transport asks for it), since each
// link's thread calls MPI on its own.
//
// Built only where mpi.h was found (TF_SMB_WITH_MPI); elsewhere
// MakeMpiTransport says how to get it.
#ifndef TF_SMB_CC_SMB_TRANSPORT_MPI_TRANSPORT_H_
#define TF_SMB_CC_SMB_TRANSPORT_MPI_TRANSPORT_H_

#include <memory>
#include <vector>

#include "cc/smb/status.h"
#include "cc/smb/transport/transport.h"

namespace smb {

// True when this build has the MPI transport.
bool MpiAvailable();

// An MPI transport, not started yet (MPI_Init_thread runs in Start, on the
// engine's thread). `members`: the job ranks it joins, in their order (their
// index is the rank Start expects); empty: the whole job, which also
// initializes and finally finalizes MPI. The job's transport starts first.
Status MakeMpiTransport(std::unique_ptr<Transport>* out, std::vector<int> members = {});

}  // namespace smb

#endif  // TF_SMB_CC_SMB_TRANSPORT_MPI_TRANSPORT_H_
