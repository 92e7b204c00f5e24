// What the link between nodes (link/node_link_engine.h) needs from a network,
// and nothing more: where every rank sits, tagged messages between any two
// ranks, and nonblocking collectives among a rank's counterparts (the ranks
// with its local rank on every node). The coordination on top (the job-wide
// collective order, the memory server's calls, step clocks, lost ranks,
// failures) is the engine's, the same over every transport.
//
// Implementations: transport/mpi_transport.h (Open MPI, across hosts) and
// transport/thread_transport.h (ranks as threads of one process, for tests).
// Every call comes from the engine's one thread, so an implementation needs no
// locking of its own against the engine (MPI's thread level is MULTIPLE only
// because a process set's link is a second engine). Only Start and Finish may
// block.
#ifndef TF_SMB_CC_SMB_TRANSPORT_TRANSPORT_H_
#define TF_SMB_CC_SMB_TRANSPORT_TRANSPORT_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "cc/smb/dtype.h"
#include "cc/smb/status.h"

namespace smb {

// Where every rank of the job sits, as the transport found it.
struct Layout {
  int rank = 0;
  int world = 1;
  int nodes = 1;
  std::vector<int> node_of;        // job rank -> node (0 .. nodes - 1)
  std::vector<int> local_of;       // job rank -> local rank on its node
  std::vector<int> local_size_of;  // job rank -> ranks on its node
};

// A nonblocking send or collective in flight (see Transport::Test).
class Transfer {
 public:
  virtual ~Transfer() = default;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // For messages: "MPI", "threads".
  virtual std::string name() const = 0;

  // Joins the job (blocks until every rank has); `rank` and `world` are what
  // the launcher said, and a transport that finds otherwise says so.
  virtual Status Start(int rank, int world, Layout* layout) = 0;

  // Sends `bytes` to job rank `to`, with `tag` (>= 0); `bytes` stays alive
  // until the transfer finished.
  virtual Status Send(int to, int tag, std::shared_ptr<const std::vector<char>> bytes,
                      std::unique_ptr<Transfer>* out) = 0;
  // A message that has arrived, if any (never waits). Messages from one rank
  // arrive in the order they were sent.
  virtual bool Receive(int* from, int* tag, std::vector<char>* bytes) = 0;

  // Collectives among my counterparts, in the same order on each of them.
  // The memory given stays valid until the transfer finished.
  // data = sum over nodes of data (`count` elements); every node gets the same bits.
  virtual Status StartAllReduceSum(DType dtype, void* data, size_t count,
                                   std::unique_ptr<Transfer>* out) = 0;
  // out[n * bytes, (n + 1) * bytes) = node n's `in`.
  virtual Status StartAllGather(const void* in, size_t bytes, void* out,
                                std::unique_ptr<Transfer>* transfer) = 0;
  // data = node `root`'s data.
  virtual Status StartBroadcast(void* data, size_t bytes, int root,
                                std::unique_ptr<Transfer>* out) = 0;

  // True when `transfer` finished, with *error its outcome (not OK: the
  // transport lost the peer); false while it is in flight.
  virtual bool Test(Transfer* transfer, Status* error) = 0;

  // Leaves the job. Called only when the job ended cleanly (every rank
  // calls it): after a failure the others may never call it, and waiting for
  // them would hang the exit.
  virtual void Finish() = 0;
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_TRANSPORT_TRANSPORT_H_
