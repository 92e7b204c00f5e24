#include "cc/smb/transport/mpi_transport.h"

#ifndef TF_SMB_WITH_MPI

namespace smb {

bool MpiAvailable() { return false; }

Status MakeMpiTransport(std::unique_ptr<Transport>*, std::vector<int>) {
  return Status(Code::kInternal,
                "this job spans several nodes, but tf_smb's library was built without MPI "
                "(mpi.h was not found when it was compiled): install Open MPI's development "
                "files (apt-get install libopenmpi-dev) and remove ~/.cache/tf_smb/ops (or "
                "reinstall tf_smb) so that it is rebuilt with MPI");
}

}  // namespace smb

#else  // TF_SMB_WITH_MPI

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <utility>

#include "cc/smb/transport/nodes_allreduce.h"

namespace smb {
namespace {

std::string MpiError(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, len);
}

// dst = src + dst, for float16/bfloat16 carried as 16-bit words.
void SumHalf(void* in, void* inout, int* len, MPI_Datatype*) {
  SumInto(DType::kFloat16, inout, in, inout, static_cast<size_t>(*len));
}
void SumBFloat16(void* in, void* inout, int* len, MPI_Datatype*) {
  SumInto(DType::kBFloat16, inout, in, inout, static_cast<size_t>(*len));
}

MPI_Datatype MpiType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return MPI_FLOAT;
    case DType::kFloat64: return MPI_DOUBLE;
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kUInt16: return MPI_UINT16_T;
    case DType::kInt32: return MPI_INT32_T;
    case DType::kInt64: return MPI_INT64_T;
    case DType::kInt8: return MPI_INT8_T;
    case DType::kUInt8: return MPI_UINT8_T;
    case DType::kInt16: return MPI_INT16_T;
  }
  return MPI_BYTE;
}

struct MpiTransfer : Transfer {
  MPI_Request request = MPI_REQUEST_NULL;
  std::shared_ptr<const std::vector<char>> bytes;  // a send's message
};

Status Started(int rc, const char* what, std::unique_ptr<MpiTransfer> transfer,
               std::unique_ptr<Transfer>* out) {
  if (rc != MPI_SUCCESS) return Status(Code::kAborted, std::string(what) + ": " + MpiError(rc));
  *out = std::move(transfer);
  return Status::Ok();
}

Status TooLarge(size_t n, const char* what) {
  return InvalidArgument(std::string("a cross-node ") + what + " of " + std::to_string(n) +
                         " elements is too large for one MPI call");
}

// An all-reduce across nodes of at least this many bytes is a NodesAllReduce
// (nodes_allreduce.h): bandwidth-optimal, where Open MPI's nonblocking
// all-reduce (libnbc) on MPI_IN_PLACE reduces to one rank and broadcasts back,
// every byte through one node twice. Smaller ones are latency-bound: one
// MPI_Iallreduce, fewer steps.
constexpr size_t kScheduledMinBytes = size_t{64} << 10;
// All-reduces posted at once (AllReduceQueue). Open MPI's TCP transport moves
// a large message a few fragments at a time, each needing the link's next
// poll: many messages in flight keep the link busy (measured, ResNet-50's
// gradients at 2 x 1, 1 Gbit/s: 1 at a time 1.75x the floor, 4 1.44x, 16 1.12x).
constexpr int kAllReducesInFlight = 16;

class MpiTransport : public Transport, public PointToPoint {
 public:
  std::string name() const override { return "MPI"; }

  explicit MpiTransport(std::vector<int> members) : members_(std::move(members)) {}

  Status Start(int rank, int world, Layout* layout) override {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!members_.empty()) {
      SMB_RETURN_IF_ERROR(JoinMembers(initialized != 0));
    } else if (!initialized) {
      int provided = 0;
      // MULTIPLE: a process set's link calls MPI from a thread of its own.
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) {
        return Status(Code::kInternal, "MPI_Init_thread failed: " + MpiError(rc));
      }
    }
    const MPI_Comm base = members_.empty() ? MPI_COMM_WORLD : members_comm_;
    MPI_Comm_set_errhandler(base, MPI_ERRORS_RETURN);
    int my_rank = 0, size = 0;
    MPI_Comm_rank(base, &my_rank);
    MPI_Comm_size(base, &size);
    if (my_rank != rank || size != world) {
      return InvalidArgument("the launcher's environment says rank " + std::to_string(rank) +
                             " of " + std::to_string(world) + ", but MPI says rank " +
                             std::to_string(my_rank) + " of " + std::to_string(size) +
                             " (were these processes started by one mpirun/srun?)");
    }
    // The ranks that share memory with this one are its node.
    MPI_Comm node_comm;
    MPI_Comm_split_type(base, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node_comm);
    int local_rank = 0, local_size = 0;
    MPI_Comm_rank(node_comm, &local_rank);
    MPI_Comm_size(node_comm, &local_size);
    MPI_Comm leaders;
    MPI_Comm_split(base, local_rank == 0 ? 0 : MPI_UNDEFINED, rank, &leaders);
    int where[2] = {0, 0};  // node index, nodes
    if (local_rank == 0) {
      MPI_Comm_rank(leaders, &where[0]);
      MPI_Comm_size(leaders, &where[1]);
      MPI_Comm_free(&leaders);
    }
    MPI_Bcast(where, 2, MPI_INT, 0, node_comm);
    MPI_Comm_free(&node_comm);
    // Every rank's place: (node, local rank, local size).
    const int mine[3] = {where[0], local_rank, local_size};
    std::vector<int> all(3 * static_cast<size_t>(world));
    MPI_Allgather(mine, 3, MPI_INT, all.data(), 3, MPI_INT, base);
    layout->rank = rank;
    layout->world = world;
    layout->nodes = where[1];
    layout->node_of.assign(world, 0);
    layout->local_of.assign(world, 0);
    layout->local_size_of.assign(world, 0);
    for (int r = 0; r < world; ++r) {
      layout->node_of[r] = all[3 * r];
      layout->local_of[r] = all[3 * r + 1];
      layout->local_size_of[r] = all[3 * r + 2];
    }
    // Counterparts: local rank r of every node, for the r that every node has
    // (nodes may run different numbers of ranks; a larger node's other ranks
    // take no part in collectives across nodes).
    const int streams = *std::min_element(layout->local_size_of.begin(),
                                          layout->local_size_of.end());
    MPI_Comm_split(base, local_rank < streams ? local_rank : MPI_UNDEFINED, where[0], &cross_);
    if (cross_ != MPI_COMM_NULL) {
      MPI_Comm_set_errhandler(cross_, MPI_ERRORS_RETURN);
      MPI_Comm_rank(cross_, &cross_rank_);
      MPI_Comm_size(cross_, &cross_size_);
      int* tag_ub = nullptr;
      int found = 0;
      MPI_Comm_get_attr(cross_, MPI_TAG_UB, &tag_ub, &found);
      if (found && tag_ub != nullptr) max_tag_ = *tag_ub;
    }
    MPI_Comm_dup(base, &control_);
    MPI_Comm_set_errhandler(control_, MPI_ERRORS_RETURN);
    MPI_Op_create(&SumHalf, /*commute=*/1, &sum_half_);
    MPI_Op_create(&SumBFloat16, /*commute=*/1, &sum_bfloat16_);
    return Status::Ok();
  }

  Status Send(int to, int tag, std::shared_ptr<const std::vector<char>> bytes,
              std::unique_ptr<Transfer>* out) override {
    auto transfer = std::make_unique<MpiTransfer>();
    transfer->bytes = std::move(bytes);
    const std::vector<char>& message = *transfer->bytes;
    const int rc = MPI_Isend(message.data(), static_cast<int>(message.size()), MPI_BYTE, to, tag,
                             control_, &transfer->request);
    return Started(rc, "MPI_Isend", std::move(transfer), out);
  }

  bool Receive(int* from, int* tag, std::vector<char>* bytes) override {
    int flag = 0;
    MPI_Status status;
    if (MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, control_, &flag, &status) != MPI_SUCCESS || !flag) {
      return false;
    }
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    bytes->resize(std::max(count, 1));
    MPI_Recv(bytes->data(), count, MPI_BYTE, status.MPI_SOURCE, status.MPI_TAG, control_,
             MPI_STATUS_IGNORE);
    bytes->resize(count);
    *from = status.MPI_SOURCE;
    *tag = status.MPI_TAG;
    return true;
  }

  Status StartAllReduceSum(DType dtype, void* data, size_t count,
                           std::unique_ptr<Transfer>* out) override {
    if (count * DTypeSize(dtype) >= kScheduledMinBytes && cross_size_ > 1) {
      if (count * DTypeSize(dtype) / static_cast<size_t>(cross_size_) + 1 >
          static_cast<size_t>(INT_MAX)) {
        return TooLarge(count, "all-reduce");
      }
      auto op = std::make_unique<NodesAllReduce>(this, all_reduces_++, dtype, data, count);
      in_flight_.Add(op.get());
      *out = std::move(op);
      return Status::Ok();
    }
    if (count > static_cast<size_t>(INT_MAX)) return TooLarge(count, "all-reduce");
    MPI_Op op = dtype == DType::kFloat16    ? sum_half_
                : dtype == DType::kBFloat16 ? sum_bfloat16_
                                            : MPI_SUM;
    auto transfer = std::make_unique<MpiTransfer>();
    const int rc = MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), MpiType(dtype), op,
                                  cross_, &transfer->request);
    return Started(rc, "MPI_Iallreduce", std::move(transfer), out);
  }

  Status StartAllGather(const void* in, size_t bytes, void* out,
                        std::unique_ptr<Transfer>* started) override {
    if (bytes > static_cast<size_t>(INT_MAX)) return TooLarge(bytes, "all-gather");
    auto transfer = std::make_unique<MpiTransfer>();
    const int n = static_cast<int>(bytes);
    const int rc = MPI_Iallgather(in, n, MPI_BYTE, out, n, MPI_BYTE, cross_, &transfer->request);
    return Started(rc, "MPI_Iallgather", std::move(transfer), started);
  }

  Status StartBroadcast(void* data, size_t bytes, int root,
                        std::unique_ptr<Transfer>* out) override {
    if (bytes > static_cast<size_t>(INT_MAX)) return TooLarge(bytes, "broadcast");
    auto transfer = std::make_unique<MpiTransfer>();
    const int rc = MPI_Ibcast(data, static_cast<int>(bytes), MPI_BYTE, root, cross_,
                              &transfer->request);
    return Started(rc, "MPI_Ibcast", std::move(transfer), out);
  }

  bool Test(Transfer* transfer, Status* error) override {
    if (auto* op = dynamic_cast<NodesAllReduce*>(transfer)) {
      return in_flight_.Progress(op, error);
    }
    return TestTransfer(transfer, error);
  }

  // PointToPoint, among my counterparts (cross_ ranks them by node).
  int node() const override { return cross_rank_; }
  int nodes() const override { return cross_size_; }
  int max_tag() const override { return max_tag_; }

  Status StartSendTo(int node, int tag, const void* data, size_t bytes,
                     std::unique_ptr<Transfer>* out) override {
    auto transfer = std::make_unique<MpiTransfer>();
    const int rc = MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, node, tag, cross_,
                             &transfer->request);
    return Started(rc, "MPI_Isend", std::move(transfer), out);
  }

  Status StartReceiveFrom(int node, int tag, void* data, size_t bytes,
                          std::unique_ptr<Transfer>* out) override {
    auto transfer = std::make_unique<MpiTransfer>();
    const int rc = MPI_Irecv(data, static_cast<int>(bytes), MPI_BYTE, node, tag, cross_,
                             &transfer->request);
    return Started(rc, "MPI_Irecv", std::move(transfer), out);
  }

  bool TestTransfer(Transfer* transfer, Status* error) override {
    auto* mpi = static_cast<MpiTransfer*>(transfer);
    int flag = 0;
    const int rc = MPI_Test(&mpi->request, &flag, MPI_STATUS_IGNORE);
    if (rc == MPI_SUCCESS && !flag) return false;
    *error = rc == MPI_SUCCESS ? Status::Ok() : Status(Code::kAborted, MpiError(rc));
    return true;
  }

  void Finish() override {
    MPI_Op_free(&sum_half_);
    MPI_Op_free(&sum_bfloat16_);
    if (cross_ != MPI_COMM_NULL) MPI_Comm_free(&cross_);
    MPI_Comm_free(&control_);
    if (!members_.empty()) {
      MPI_Comm_free(&members_comm_);
      return;  // the job's transport finalizes
    }
    // Every rank finalizes, or mpirun calls the job failed.
    MPI_Finalize();
  }

 private:
  // members_comm_ = a communicator of the members (only they call this).
  Status JoinMembers(bool initialized) {
    int provided = 0;
    if (initialized) MPI_Query_thread(&provided);
    if (!initialized || provided < MPI_THREAD_MULTIPLE) {
      return Status(Code::kFailedPrecondition,
                    "a process set spanning nodes needs MPI initialized with "
                    "MPI_THREAD_MULTIPLE by the job's own link first; MPI is " +
                        std::string(initialized ? "initialized with a lower thread level "
                                                  "(by another library?)"
                                                : "not initialized"));
    }
    MPI_Group world_group = MPI_GROUP_NULL, members_group = MPI_GROUP_NULL;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    int rc = MPI_Group_incl(world_group, static_cast<int>(members_.size()), members_.data(),
                            &members_group);
    if (rc != MPI_SUCCESS) {
      MPI_Group_free(&world_group);
      return InvalidArgument("a process set's ranks must be distinct ranks of the job: " +
                             MpiError(rc));
    }
    rc = MPI_Comm_create_group(MPI_COMM_WORLD, members_group, /*tag=*/0, &members_comm_);
    MPI_Group_free(&members_group);
    MPI_Group_free(&world_group);
    if (rc != MPI_SUCCESS) {
      return Status(Code::kAborted, "MPI_Comm_create_group failed: " + MpiError(rc));
    }
    return Status::Ok();
  }

  const std::vector<int> members_;      // job ranks; empty: the whole job
  MPI_Comm members_comm_ = MPI_COMM_NULL;
  MPI_Comm cross_ = MPI_COMM_NULL;    // my counterparts, ranked by node
  int cross_rank_ = 0, cross_size_ = 1;
  int max_tag_ = 32767;  // MPI's least MPI_TAG_UB
  AllReduceQueue in_flight_{kAllReducesInFlight};
  uint64_t all_reduces_ = 0;  // NodesAllReduces started (the same order on every counterpart)
  MPI_Comm control_ = MPI_COMM_NULL;  // point-to-point messages
  MPI_Op sum_half_ = MPI_OP_NULL, sum_bfloat16_ = MPI_OP_NULL;
};

}  // namespace

bool MpiAvailable() { return true; }

Status MakeMpiTransport(std::unique_ptr<Transport>* out, std::vector<int> members) {
  *out = std::make_unique<MpiTransport>(std::move(members));
  return Status::Ok();
}

}  // namespace smb

#endif  // TF_SMB_WITH_MPI
