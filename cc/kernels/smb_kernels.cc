// AsyncOpKernels for the SMB ops. Collective kernels submit their work to the
// process's CollectiveScheduler, whose one thread runs collectives in the
// order all ranks agree on (matched by key, whatever order TensorFlow runs
// independent ops in), and call done() when it finishes, so TensorFlow's
// inter-op threads never block.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cc/smb/algorithms/replica_sum.h"
#include "cc/smb/communicator.h"
#include "cc/smb/copy.h"
#include "cc/smb/node_link.h"
#include "cc/smb/param_server.h"
#include "cc/smb/scheduler.h"
#include "cc/smb/segment/segment_io.h"
#include "cc/smb/segment/updaters.h"
#include "cc/smb/timeline.h"
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace {

absl::Status ToTfStatus(const smb::Status& s) {
  switch (s.code()) {
    case smb::Code::kOk: return absl::OkStatus();
    case smb::Code::kInvalidArgument:
      return absl::InvalidArgumentError(s.message());
    case smb::Code::kDeadlineExceeded:
      return absl::DeadlineExceededError(s.message());
    case smb::Code::kAborted: return absl::AbortedError(s.message());
    case smb::Code::kAlreadyExists: return absl::AlreadyExistsError(s.message());
    case smb::Code::kNotFound: return absl::NotFoundError(s.message());
    case smb::Code::kResourceExhausted:
      return absl::ResourceExhaustedError(s.message());
    case smb::Code::kInternal: return absl::InternalError(s.message());
    case smb::Code::kFailedPrecondition:
      return absl::FailedPreconditionError(s.message());
  }
  return absl::UnknownError(s.message());
}

smb::Status FromTfStatus(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk: return smb::Status::Ok();
    case absl::StatusCode::kInvalidArgument:
      return smb::Status(smb::Code::kInvalidArgument, std::string(s.message()));
    case absl::StatusCode::kDeadlineExceeded:
      return smb::Status(smb::Code::kDeadlineExceeded, std::string(s.message()));
    case absl::StatusCode::kAborted:
      return smb::Status(smb::Code::kAborted, std::string(s.message()));
    case absl::StatusCode::kAlreadyExists:
      return smb::Status(smb::Code::kAlreadyExists, std::string(s.message()));
    case absl::StatusCode::kNotFound:
      return smb::Status(smb::Code::kNotFound, std::string(s.message()));
    case absl::StatusCode::kResourceExhausted:
      return smb::Status(smb::Code::kResourceExhausted, std::string(s.message()));
    case absl::StatusCode::kFailedPrecondition:
      return smb::Status(smb::Code::kFailedPrecondition, std::string(s.message()));
    default:
      return smb::Status(smb::Code::kInternal, std::string(s.message()));
  }
}

bool ToSmbDType(DataType dt, smb::DType* out) {
  switch (dt) {
    case DT_FLOAT: *out = smb::DType::kFloat32; return true;
    case DT_DOUBLE: *out = smb::DType::kFloat64; return true;
    case DT_HALF: *out = smb::DType::kFloat16; return true;
    case DT_BFLOAT16: *out = smb::DType::kBFloat16; return true;
    case DT_INT32: *out = smb::DType::kInt32; return true;
    case DT_INT64: *out = smb::DType::kInt64; return true;
    case DT_INT8: *out = smb::DType::kInt8; return true;
    case DT_UINT8: *out = smb::DType::kUInt8; return true;
    case DT_INT16: *out = smb::DType::kInt16; return true;
    case DT_UINT16: *out = smb::DType::kUInt16; return true;
    default: return false;
  }
}

// The process's membership in a job: the Communicator and the scheduler
// whose thread runs its collectives in the order the ranks agree on.
class SmbContext {
 public:
  static SmbContext& Get() {
    static SmbContext context;
    return context;
  }

  absl::Status Init(const smb::Communicator::Options& options, int process_set = 0,
                    bool rejoin = false) {
    if (process_set != 0) return OpenProcessSet(options, process_set);
    if (rejoin) Leave();
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ != nullptr) {
      if (comm_->rank() == options.rank && comm_->world() == options.world &&
          job_id_ == options.job_id) {
        comm_->set_timeout(options.timeout_s);
        return absl::OkStatus();
      }
      return absl::FailedPreconditionError(
          "this process already joined job '" + job_id_ + "' as rank " +
          std::to_string(comm_->rank()) + " of " +
          std::to_string(comm_->world()) + "; cannot join job '" +
          options.job_id + "' as rank " + std::to_string(options.rank) +
          " of " + std::to_string(options.world));
    }
    std::unique_ptr<smb::Communicator> comm;
    absl::Status s = ToTfStatus(smb::Communicator::Open(options, &comm));
    if (!s.ok()) return s;
    comm_ = std::move(comm);
    job_id_ = options.job_id;
    scheduler_ = smb::CollectiveScheduler::Start(comm_);
    // TF_SMB_TIMELINE: record this process's part of the job's timeline. At
    // exit rank 0 stops waiting for a rank's part once that rank is gone.
    std::weak_ptr<smb::Communicator> weak = comm_;
    smb::timeline::StartFromEnvironment(options.job_id, options.rank, options.world,
                                        [weak](int rank) {
                                          auto c = weak.lock();
                                          return c != nullptr && c->group().RankGone(rank);
                                        },
                                        TimelineOverTheLink(comm_));
    return absl::OkStatus();
  }

  // Leaves the job this process joined, and its process sets, so that it can
  // join another (elastic training: the job's membership changed). Collectives
  // submitted afterwards fail until it joins again; a thread still waiting on
  // the old job keeps its Communicator until it returns. The box goes when its
  // last member leaves (or its launcher removes it).
  void Leave() {
    std::shared_ptr<smb::Communicator> comm;
    std::unique_ptr<smb::CollectiveScheduler> scheduler;
    std::map<int, ProcessSet> sets;
    {
      std::lock_guard<std::mutex> lock(mu_);
      comm = std::move(comm_);
      scheduler = std::move(scheduler_);
      sets = std::move(process_sets_);
      comm_ = nullptr;
      process_sets_.clear();
      job_id_.clear();
    }
    // The schedulers stop here, unlocked (a stopping one may still call done()).
    sets.clear();
    scheduler.reset();
    // A rank still waiting for this one in the old job fails at once, saying why.
    if (comm != nullptr) comm->Leave(smb::kLeftRejoined);
  }

  // Runs the collective `run` once every rank submitted `key` and it is its
  // turn, then `done` (on the scheduler's thread).
  // `process_set` 0: the job's; otherwise a set this process opened.
  absl::Status Submit(int process_set, const std::string& key, const std::string& what,
                      smb::CollectiveScheduler::Run run,
                      smb::CollectiveScheduler::Done done) {
    std::lock_guard<std::mutex> lock(mu_);
    smb::CollectiveScheduler* scheduler = scheduler_.get();
    if (process_set != 0) {
      auto it = process_sets_.find(process_set);
      if (it == process_sets_.end()) return NotInProcessSet(process_set);
      scheduler = it->second.scheduler.get();
    }
    if (scheduler == nullptr) return NotJoined();
    scheduler->Submit(key, what, std::move(run), std::move(done));
    return absl::OkStatus();
  }

  // Horovod's join, on the job's scheduler (see CollectiveScheduler::SubmitJoin).
  absl::Status SubmitJoin(smb::CollectiveScheduler::Run run,
                          smb::CollectiveScheduler::Done done) {
    std::lock_guard<std::mutex> lock(mu_);
    if (scheduler_ == nullptr) return NotJoined();
    scheduler_->SubmitJoin(std::move(run), std::move(done));
    return absl::OkStatus();
  }

  // A process set: some of the job's processes, with a box (one per node, and
  // across nodes a link of their own) and a collective order of their own
  // (Horovod's process sets). Opening waits
  // for the set's first rank to make the box, as joining the job does.
  absl::Status OpenProcessSet(const smb::Communicator::Options& options, int process_set) {
    if (process_set < 0) {
      return absl::InvalidArgumentError("process set ids are positive (0 is the whole job), "
                                        "got " + std::to_string(process_set));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (process_sets_.count(process_set) != 0) {
        return absl::AlreadyExistsError("process set " + std::to_string(process_set) +
                                        " is already open in this process");
      }
    }
    // Outside the lock: attaching waits for the set's first rank.
    std::unique_ptr<smb::Communicator> opened;
    TF_RETURN_IF_ERROR(ToTfStatus(smb::Communicator::Open(options, &opened)));
    ProcessSet set;
    set.comm = std::move(opened);
    set.scheduler = smb::CollectiveScheduler::Start(set.comm);
    std::lock_guard<std::mutex> lock(mu_);
    if (!process_sets_.emplace(process_set, std::move(set)).second) {
      return absl::AlreadyExistsError("process set " + std::to_string(process_set) +
                                      " was opened twice at once in this process");
    }
    return absl::OkStatus();
  }

  // Leaves a process set: its collectives fail from now on; the box goes
  // when its last member leaves (collectives running keep it meanwhile).
  absl::Status CloseProcessSet(int process_set) {
    ProcessSet closing;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = process_sets_.find(process_set);
      if (it == process_sets_.end()) return NotInProcessSet(process_set);
      closing = std::move(it->second);
      process_sets_.erase(it);
    }
    return absl::OkStatus();  // `closing` stops the set's scheduler here, unlocked
  }

  // The Communicator, shared: a thread that waits on it keeps it alive even
  // when the process exits meanwhile.
  absl::Status Shared(std::shared_ptr<smb::Communicator>* out) {
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ == nullptr) return NotJoined();
    *out = comm_;
    return absl::OkStatus();
  }

  // The job's segments (the asynchronous mode), shared like the Communicator.
  absl::Status Segments(std::shared_ptr<smb::Communicator>* comm, smb::SegmentTable** out) {
    TF_RETURN_IF_ERROR(Shared(comm));
    if ((*comm)->segments() == nullptr) {
      return absl::FailedPreconditionError(
          "box segments need a job of 2 or more workers joined with tf_smb.init()");
    }
    *out = (*comm)->segments();
    return absl::OkStatus();
  }

 private:
  SmbContext() = default;

  // Across nodes no filesystem need be shared: ranks on other nodes than rank
  // 0's send their final timeline part to rank 0 through the link, and rank
  // 0 stores it among the parts it merges. Null (write the part) otherwise.
  static std::function<smb::Status(std::vector<char>)> TimelineOverTheLink(
      const std::shared_ptr<smb::Communicator>& comm) {
    smb::NodeLink* link = comm->group().link();
    if (link == nullptr) return nullptr;
    if (comm->rank() == 0) {
      link->SetRankZeroReceiver([](int from, std::vector<char> part) {
        smb::Status s = smb::timeline::StorePart(from, part);
        if (!s.ok()) std::fprintf(stderr, "tf_smb timeline: %s\n", s.message().c_str());
      });
    }
    int node_of_rank0 = 0, local = 0;
    link->Locate(0, &node_of_rank0, &local);
    if (link->node() == node_of_rank0) return nullptr;
    std::weak_ptr<smb::Communicator> weak = comm;
    return [weak](std::vector<char> part) {
      auto c = weak.lock();
      if (c == nullptr) return smb::Status(smb::Code::kAborted, "the job's link is gone");
      c->group().link()->SendToRankZero(std::move(part));
      return smb::Status::Ok();
    };
  }

  static absl::Status NotJoined() {
    return absl::FailedPreconditionError(
        "SMB ops need the process to join a job first: create "
        "tf_smb.SMBStrategy() (or call tf_smb.init()) before running them");
  }

  static absl::Status NotInProcessSet(int process_set) {
    return absl::InvalidArgumentError(
        "process set " + std::to_string(process_set) + " is not open in this process: "
        "expected a set this rank belongs to (opened, and not removed)");
  }

  struct ProcessSet {
    std::shared_ptr<smb::Communicator> comm;
    std::unique_ptr<smb::CollectiveScheduler> scheduler;
  };

  std::mutex mu_;
  std::shared_ptr<smb::Communicator> comm_;
  std::unique_ptr<smb::CollectiveScheduler> scheduler_;
  std::string job_id_;
  std::map<int, ProcessSet> process_sets_;
};

// Runs `wait` (a blocking wait on the other ranks that is not a collective)
// on a thread of its own, so it neither blocks TensorFlow's threads nor holds
// back the collectives; the thread shares the Communicator, so it stays
// valid even if the process exits meanwhile.
template <typename Wait>
void RunBlocking(OpKernelContext* c, AsyncOpKernel::DoneCallback done, Wait wait) {
  std::shared_ptr<smb::Communicator> comm;
  OP_REQUIRES_OK_ASYNC(c, SmbContext::Get().Shared(&comm), done);
  std::thread([c, comm, wait, done] {
    c->SetStatus(ToTfStatus(wait(comm.get())));
    done();
  }).detach();
}

// What the scheduler matches a collective by. Ops made in a graph carry the
// key of their call site (graph path and op, from the Python wrapper); the
// node's name and its loop frame and iteration tell apart the copies a
// function call or a while loop makes of it. Eager ops run one at a time in
// program order, so their order alone matches them.
std::string CollectiveKey(OpKernelContext* c, const std::string& site) {
  // Test hook: pair collectives by arrival, as tf_smb did before keys, so a
  // test can show that its checks catch the mix-ups keys prevent.
  static const bool by_arrival = std::getenv("TF_SMB_TEST_MATCH_BY_ARRIVAL") != nullptr;
  if (site.empty() || by_arrival) return "eager";
  const FrameAndIter where = c->frame_iter();
  return site + "|" + c->op_kernel().name() + "|" + std::to_string(where.frame_id) +
         ":" + std::to_string(where.iter_id);
}

// The attributes every collective op has, read once when its kernel is built.
//   key:         its call site (see CollectiveKey);
//   agreement:   non-empty makes the ranks' disagreement on it recoverable
//                (Group::SetNextAgreement, set on the scheduler's thread right
//                before the run);
//   process_set: the scheduler it runs on (0: the job's).
struct CollectiveAttrs {
  std::string site;
  std::string agreement;
  int process_set = 0;

  absl::Status Read(OpKernelConstruction* c) {
    TF_RETURN_IF_ERROR(c->GetAttr("key", &site));
    TF_RETURN_IF_ERROR(c->GetAttr("agreement", &agreement));
    return c->GetAttr("process_set", &process_set);
  }
};

// Submits a collective whose run sets the op's status; calls done() after.
void SubmitCollective(OpKernelContext* c, AsyncOpKernel::DoneCallback done,
                      const CollectiveAttrs& attrs, const std::string& what,
                      std::function<absl::Status(smb::Communicator*)> run) {
  const std::string& agreement = attrs.agreement;
  OP_REQUIRES_OK_ASYNC(
      c,
      SmbContext::Get().Submit(
          attrs.process_set, CollectiveKey(c, attrs.site), what,
          [c, run, agreement](smb::Communicator* comm) {
            if (!agreement.empty()) comm->group().SetNextAgreement(agreement);
            absl::Status s = run(comm);
            return s.ok() ? smb::Status::Ok() : FromTfStatus(s);
          },
          [c, done](const smb::Status& s) {
            c->SetStatus(ToTfStatus(s));
            done();
          }),
      done);
}

class SmbInitOp : public OpKernel {
 public:
  explicit SmbInitOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("job_id", &options_.job_id));
    OP_REQUIRES_OK(c, c->GetAttr("rank", &options_.rank));
    OP_REQUIRES_OK(c, c->GetAttr("world", &options_.world));
    float timeout;
    OP_REQUIRES_OK(c, c->GetAttr("timeout_seconds", &timeout));
    options_.timeout_s = timeout;
    OP_REQUIRES_OK(c, c->GetAttr("create", &options_.create));
    OP_REQUIRES_OK(c, c->GetAttr("across_nodes", &options_.across_nodes));
    OP_REQUIRES_OK(c, c->GetAttr("process_set", &process_set_));
    OP_REQUIRES_OK(c, c->GetAttr("rejoin", &rejoin_));
    std::vector<int32_t> members;
    OP_REQUIRES_OK(c, c->GetAttr("members", &members));
    options_.members.assign(members.begin(), members.end());
    int64_t staging, heap;
    OP_REQUIRES_OK(c, c->GetAttr("staging_bytes", &staging));
    OP_REQUIRES_OK(c, c->GetAttr("heap_bytes", &heap));
    OP_REQUIRES(c, staging > 0 && heap >= 0,
                absl::InvalidArgumentError(
                    "staging_bytes must be positive and heap_bytes "
                    "non-negative, got " + std::to_string(staging) + " and " +
                    std::to_string(heap)));
    options_.staging_bytes = static_cast<size_t>(staging);
    options_.heap_bytes = static_cast<size_t>(heap);
  }
  void Compute(OpKernelContext* c) override {
    OP_REQUIRES_OK(c, SmbContext::Get().Init(options_, process_set_, rejoin_));
  }

 private:
  smb::Communicator::Options options_;
  int process_set_ = 0;
  bool rejoin_ = false;
};

class SmbCloseProcessSetOp : public OpKernel {
 public:
  explicit SmbCloseProcessSetOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("process_set", &process_set_));
  }
  void Compute(OpKernelContext* c) override {
    OP_REQUIRES_OK(c, SmbContext::Get().CloseProcessSet(process_set_));
  }

 private:
  int process_set_ = 0;
};

// Shared by the list ops: the TensorRefs the core reads (outputs unset).
absl::Status DescribeInputs(OpKernelContext* c, std::vector<smb::TensorRef>* refs) {
  OpInputList inputs;
  TF_RETURN_IF_ERROR(c->input_list("tensors", &inputs));
  for (int i = 0; i < inputs.size(); ++i) {
    const Tensor& in = inputs[i];
    smb::DType dtype;
    if (!ToSmbDType(in.dtype(), &dtype)) {
      return absl::InvalidArgumentError(
          "unsupported dtype " + DataTypeString(in.dtype()) +
          "; expected float32, float64, float16, bfloat16, int8, uint8, int16, "
          "uint16, int32 or int64");
    }
    const auto dims = in.shape().dim_sizes();
    std::vector<int64_t> shape(dims.begin(), dims.end());
    refs->push_back({dtype, std::move(shape), in.tensor_data().data(), nullptr});
  }
  return absl::OkStatus();
}

// Allocates the outputs (reusing input buffers where TF allows) and points
// the refs' `out` at them.
absl::Status BindOutputs(OpKernelContext* c, std::vector<smb::TensorRef>* refs) {
  for (size_t i = 0; i < refs->size(); ++i) {
    const int index = static_cast<int>(i);
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(c->forward_input_or_allocate_output(
        {index}, index, c->input(index).shape(), &out));
    (*refs)[i].out = const_cast<char*>(out->tensor_data().data());
  }
  return absl::OkStatus();
}

// The core's view of a TF op: outputs allocated (or forwarded from inputs)
// by TensorFlow when the core asks for them.
class TfOpContext : public smb::OpContext {
 public:
  explicit TfOpContext(OpKernelContext* c) : c_(c) {}
  smb::Status AllocateOutputs(std::vector<smb::TensorRef>* tensors) override {
    return FromTfStatus(BindOutputs(c_, tensors));
  }

 private:
  OpKernelContext* c_;
};

// An all-reduce sum that stays in the box: the output tensor points into a
// result buffer that every rank reads. It does not own that memory, so
// TensorFlow never hands it to an op to write in place (Tensor::RefCountIsOne
// is false for it).
class BoxSumBuffer : public TensorBuffer {
 public:
  BoxSumBuffer(std::shared_ptr<smb::ResultHold> hold, void* data, size_t bytes)
      : TensorBuffer(data), hold_(std::move(hold)), bytes_(bytes) {}
  size_t size() const override { return bytes_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(AllocationDescription* proto) const override {
    proto->set_requested_bytes(bytes_);
    proto->set_allocator_name("tf_smb_box");
  }
  bool OwnsMemory() const override { return false; }

 private:
  std::shared_ptr<smb::ResultHold> hold_;  // the buffer stays ours while we live
  size_t bytes_;
};

class SmbAllReduceOp : public AsyncOpKernel {
 public:
  explicit SmbAllReduceOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, attrs_.Read(c));
  }
  void ComputeAsync(OpKernelContext* c, DoneCallback done) override {
    auto refs = std::make_shared<std::vector<smb::TensorRef>>();
    OP_REQUIRES_OK_ASYNC(c, DescribeInputs(c, refs.get()), done);
    SubmitCollective(c, done, attrs_, "allreduce", [c, refs](smb::Communicator* comm) {
      std::vector<void*> sums;
      std::shared_ptr<smb::ResultHold> hold;
      TfOpContext context(c);
      TF_RETURN_IF_ERROR(ToTfStatus(comm->AllReduceSumShared(*refs, &context, &sums, &hold)));
      if (hold == nullptr) return absl::OkStatus();
      // The sums are in the box already: outputs point at them.
      for (size_t i = 0; i < sums.size(); ++i) {
        const int index = static_cast<int>(i);
        const Tensor& in = c->input(index);
        if (in.NumElements() == 0) {
          Tensor* empty = nullptr;
          TF_RETURN_IF_ERROR(c->allocate_output(index, in.shape(), &empty));
          continue;
        }
        // TensorBuffers are reference counted by TensorFlow: Tensor owns it.
        core::RefCountPtr<TensorBuffer> buffer(
            new BoxSumBuffer(hold, sums[i], in.TotalBytes()));
        c->set_output(index, Tensor(in.dtype(), in.shape(), std::move(buffer)));
      }
      return absl::OkStatus();
    });
  }

 private:
  CollectiveAttrs attrs_;
};

class SmbBroadcastOp : public AsyncOpKernel {
 public:
  explicit SmbBroadcastOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root", &root_));
    OP_REQUIRES_OK(c, attrs_.Read(c));
  }
  void ComputeAsync(OpKernelContext* c, DoneCallback done) override {
    auto refs = std::make_shared<std::vector<smb::TensorRef>>();
    OP_REQUIRES_OK_ASYNC(c, DescribeInputs(c, refs.get()), done);
    OP_REQUIRES_OK_ASYNC(c, BindOutputs(c, refs.get()), done);
    const int root = root_;
    SubmitCollective(c, done, attrs_, "broadcast", [refs, root](smb::Communicator* comm) {
                       return ToTfStatus(comm->Broadcast(root, *refs));
                     });
  }

 private:
  int root_;
  CollectiveAttrs attrs_;
};

class SmbBarrierOp : public AsyncOpKernel {
 public:
  explicit SmbBarrierOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, attrs_.Read(c));
  }
  void ComputeAsync(OpKernelContext* c, DoneCallback done) override {
    SubmitCollective(c, done, attrs_, "barrier", [](smb::Communicator* comm) {
      return ToTfStatus(comm->Barrier());
    });
  }

 private:
  CollectiveAttrs attrs_;
};

class SmbJoinOp : public AsyncOpKernel {
 public:
  explicit SmbJoinOp(OpKernelConstruction* c) : AsyncOpKernel(c) {}
  void ComputeAsync(OpKernelContext* c, DoneCallback done) override {
    Tensor* last = nullptr;
    OP_REQUIRES_OK_ASYNC(c, c->allocate_output(0, TensorShape({}), &last), done);
    OP_REQUIRES_OK_ASYNC(
        c,
        SmbContext::Get().SubmitJoin(
            [last](smb::Communicator* comm) {
              int last_rank = -1;
              SMB_RETURN_IF_ERROR(comm->FinishJoin(&last_rank));
              last->scalar<int32_t>()() = last_rank;
              return smb::Status::Ok();
            },
            [c, done](const smb::Status& s) {
              c->SetStatus(ToTfStatus(s));
              done();
            }),
        done);
  }
};

// Local replicas (SingleCaffe's mode): their parts are summed in this process,
// one part per replica, run on TensorFlow's intra-op threads.
class SmbReplicaSumOp : public OpKernel {
 public:
  explicit SmbReplicaSumOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("replicas", &replicas_));
  }
  void Compute(OpKernelContext* c) override {
    const int values = c->num_outputs();
    OP_REQUIRES(c, c->num_inputs() == values * replicas_,
                absl::InvalidArgumentError(
                    "SmbReplicaSum: expected " + std::to_string(values) + " values x " +
                    std::to_string(replicas_) + " replicas = " +
                    std::to_string(values * replicas_) + " parts, got " +
                    std::to_string(c->num_inputs())));
    std::vector<smb::ReplicaSumTensor> tensors(values);
    for (int i = 0; i < values; ++i) {
      const Tensor& first = c->input(i * replicas_);
      smb::ReplicaSumTensor& t = tensors[i];
      OP_REQUIRES(c, ToSmbDType(first.dtype(), &t.dtype),
                  absl::InvalidArgumentError("SmbReplicaSum: unsupported dtype " +
                                             DataTypeString(first.dtype())));
      OP_REQUIRES(c, c->expected_output_dtype(i) == first.dtype(),
                  absl::InvalidArgumentError(
                      "SmbReplicaSum: value " + std::to_string(i) + " is " +
                      DataTypeString(first.dtype()) + " but its sum was declared " +
                      DataTypeString(c->expected_output_dtype(i))));
      t.elements = static_cast<size_t>(first.NumElements());
      for (int r = 0; r < replicas_; ++r) {
        const Tensor& part = c->input(i * replicas_ + r);
        OP_REQUIRES(c, part.dtype() == first.dtype() && part.shape() == first.shape(),
                    absl::InvalidArgumentError(
                        "SmbReplicaSum: every replica's part of value " + std::to_string(i) +
                        " must be " + DataTypeString(first.dtype()) +
                        first.shape().DebugString() + " like replica 0's; replica " +
                        std::to_string(r) + " gave " + DataTypeString(part.dtype()) +
                        part.shape().DebugString()));
        t.replicas.push_back(part.tensor_data().data());
      }
      Tensor* out = nullptr;
      OP_REQUIRES_OK(c, c->forward_input_or_allocate_output({i * replicas_}, i,
                                                            first.shape(), &out));
      t.out = const_cast<char*>(out->tensor_data().data());
    }
    auto* workers = c->device()->tensorflow_cpu_worker_threads()->workers;
    const smb::Status s = smb::ReplicaSum(
        tensors, replicas_, [workers](int parts, const std::function<void(int)>& part) {
          // One block per part: each part is a thread's whole share.
          workers->TransformRangeConcurrently(
              1, parts, [&part](int64_t begin, int64_t end) {
                for (int64_t p = begin; p < end; ++p) part(static_cast<int>(p));
              });
        });
    OP_REQUIRES_OK(c, ToTfStatus(s));
  }

 private:
  int replicas_;
};

// The process's parameter-server thread (local replicas, asynchronous mode).
smb::ParamServer& ProcessParamServer() {
  static smb::ParamServer server;
  return server;
}

// A variable's velocity for the momentum rule. Used on the server thread
// only; it keeps its variable alive, so an address is never reused.
struct Velocity {
  std::shared_ptr<core::RefCountPtr<Var>> variable;
  Tensor value;
};

Tensor* VelocityOf(const std::shared_ptr<core::RefCountPtr<Var>>& variable, const Tensor& w) {
  static std::unordered_map<const Var*, Velocity> velocities;
  Velocity& v = velocities[variable->get()];
  if (v.variable == nullptr || v.value.shape() != w.shape() || v.value.dtype() != w.dtype()) {
    v.variable = variable;
    v.value = Tensor(w.dtype(), w.shape());
    std::memset(const_cast<char*>(v.value.tensor_data().data()), 0, v.value.TotalBytes());
  }
  return &v.value;
}

// The server ops' "rule" and "momentum" attributes.
absl::Status GetUpdateOptions(OpKernelConstruction* c, smb::UpdateOptions* options) {
  std::string rule;
  TF_RETURN_IF_ERROR(c->GetAttr("rule", &rule));
  options->rule = rule == "delta" ? smb::UpdateRule::kDelta
                  : rule == "sgd" ? smb::UpdateRule::kSgd
                                  : smb::UpdateRule::kMomentum;
  float momentum = 0;
  TF_RETURN_IF_ERROR(c->GetAttr("momentum", &momentum));
  options->momentum = momentum;
  return absl::OkStatus();
}

class SmbServerPushOp : public OpKernel {
 public:
  explicit SmbServerPushOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, GetUpdateOptions(c, &options_));
    OP_REQUIRES_OK(c, c->GetAttr("consistent", &consistent_));
  }
  void Compute(OpKernelContext* c) override {
    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(c, LookupResource(c, HandleFromInput(c, 0), &var));
    const Tensor& update = c->input(1);
    const float learning_rate = c->input(2).scalar<float>()();
    {
      tf_shared_lock lock(*var->mu());
      const Tensor* w = var->tensor();
      OP_REQUIRES(c, var->is_initialized && w->dtype() == update.dtype() &&
                         w->shape() == update.shape(),
                  absl::InvalidArgumentError(
                      "SmbServerPush: the update must match its variable: expected " +
                      DataTypeString(w->dtype()) + w->shape().DebugString() + ", got " +
                      DataTypeString(update.dtype()) + update.shape().DebugString()));
    }
    smb::DType dtype;
    OP_REQUIRES(c, ToSmbDType(update.dtype(), &dtype),
                absl::InvalidArgumentError("SmbServerPush: unsupported dtype " +
                                           DataTypeString(update.dtype())));
    auto variable = std::make_shared<core::RefCountPtr<Var>>(std::move(var));
    const smb::UpdateOptions options = options_;
    const bool consistent = consistent_;
    ProcessParamServer().Submit([variable, update, learning_rate, options, consistent,
                                 dtype]() -> smb::Status {
      Var* v = variable->get();
      mutex_lock lock(*v->mu());
      Tensor* w = v->tensor();
      if (consistent && !w->RefCountIsOne()) {
        // Someone holds the value read before: update a copy instead, as
        // TensorFlow's own variable updates do.
        Tensor copy(w->dtype(), w->shape());
        std::memcpy(const_cast<char*>(copy.tensor_data().data()), w->tensor_data().data(),
                    w->TotalBytes());
        *w = copy;
      }
      void* velocity = nullptr;
      if (options.rule == smb::UpdateRule::kMomentum) {
        velocity = const_cast<char*>(VelocityOf(variable, *w)->tensor_data().data());
      }
      return smb::ApplyRule(options, dtype, const_cast<char*>(w->tensor_data().data()),
                            velocity, update.tensor_data().data(), learning_rate,
                            static_cast<size_t>(w->NumElements()));
    });
  }

 private:
  smb::UpdateOptions options_;
  bool consistent_ = true;
};

// Defined with the asynchronous mode's kernels below.
absl::Status DescribeTensor(const Tensor& t, smb::DType* dtype, std::vector<int64_t>* shape);

class SmbServerPushSegmentOp : public OpKernel {
 public:
  explicit SmbServerPushSegmentOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("segment", &name_));
    OP_REQUIRES_OK(c, GetUpdateOptions(c, &options_));
  }
  void Compute(OpKernelContext* c) override;

 private:
  std::string name_;
  smb::UpdateOptions options_;
};

class SmbServerWaitOp : public OpKernel {
 public:
  explicit SmbServerWaitOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("timeout_seconds", &timeout_s_));
  }
  void Compute(OpKernelContext* c) override {
    const int64_t max_pending = c->input(0).scalar<int64_t>()();
    OP_REQUIRES(c, max_pending >= 0,
                absl::InvalidArgumentError("SmbServerWait: max_pending must be >= 0, got " +
                                           std::to_string(max_pending)));
    smb::ParamServer& server = ProcessParamServer();
    OP_REQUIRES_OK(c, ToTfStatus(server.WaitPending(static_cast<uint64_t>(max_pending),
                                                    timeout_s_)));
    Tensor* applied = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(0, TensorShape({}), &applied));
    applied->scalar<int64_t>()() = static_cast<int64_t>(server.applied());
  }

 private:
  float timeout_s_ = 600;
};

// ---- Asynchronous mode ------------------------------------------------------

absl::Status DescribeTensor(const Tensor& t, smb::DType* dtype,
                            std::vector<int64_t>* shape) {
  if (!ToSmbDType(t.dtype(), dtype)) {
    return absl::InvalidArgumentError("unsupported dtype " +
                                      DataTypeString(t.dtype()));
  }
  const auto dims = t.shape().dim_sizes();
  shape->assign(dims.begin(), dims.end());
  return absl::OkStatus();
}

// The op's `consistent` attribute as a read mode.
absl::Status GetReadMode(OpKernelConstruction* c, smb::ReadMode* mode) {
  bool consistent;
  TF_RETURN_IF_ERROR(c->GetAttr("consistent", &consistent));
  *mode = consistent ? smb::ReadMode::kConsistent : smb::ReadMode::kHogwild;
  return absl::OkStatus();
}

// *out = segment `name`'s value (out's dtype and shape must be the segment's).
absl::Status ReadSegmentInto(smb::SegmentTable* segments, const std::string& name,
                             smb::ReadMode mode, Tensor* out, double timeout_s, bool bulk) {
  smb::DType dtype;
  std::vector<int64_t> shape;
  TF_RETURN_IF_ERROR(DescribeTensor(*out, &dtype, &shape));
  return ToTfStatus(segments->Read(name, dtype, shape, mode,
                                   const_cast<char*>(out->tensor_data().data()), timeout_s,
                                   bulk));
}

class SmbSegmentCreateOp : public OpKernel {
 public:
  explicit SmbSegmentCreateOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("segment", &name_));
    OP_REQUIRES_OK(c, c->GetAttr("write", &write_));
  }
  void Compute(OpKernelContext* c) override {
    const Tensor& value = c->input(0);
    smb::DType dtype;
    std::vector<int64_t> shape;
    OP_REQUIRES_OK(c, DescribeTensor(value, &dtype, &shape));
    std::shared_ptr<smb::Communicator> comm;
    smb::SegmentTable* segments = nullptr;
    OP_REQUIRES_OK(c, SmbContext::Get().Segments(&comm, &segments));
    OP_REQUIRES_OK(c, ToTfStatus(segments->Create(name_, dtype, shape,
                                                  value.tensor_data().data(), write_,
                                                  comm->timeout_s())));
  }

 private:
  std::string name_;
  bool write_;
};

class SmbSegmentReadOp : public OpKernel {
 public:
  explicit SmbSegmentReadOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("segment", &name_));
    OP_REQUIRES_OK(c, c->GetAttr("shape", &shape_));
    OP_REQUIRES_OK(c, GetReadMode(c, &mode_));
  }
  void Compute(OpKernelContext* c) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(0, shape_, &out));
    std::shared_ptr<smb::Communicator> comm;
    smb::SegmentTable* segments = nullptr;
    OP_REQUIRES_OK(c, SmbContext::Get().Segments(&comm, &segments));
    smb::timeline::Scope scope(smb::timeline::kThisProcess, smb::timeline::kSegments,
                               "segment read", "segment");
    if (scope.active()) scope.set_name("segment read " + name_);
    OP_REQUIRES_OK(c, ReadSegmentInto(segments, name_, mode_, out, comm->timeout_s(), false));
  }

 private:
  std::string name_;
  TensorShape shape_;
  smb::ReadMode mode_;
};

class SmbSegmentsPushReadOp : public OpKernel {
 public:
  explicit SmbSegmentsPushReadOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("segments", &names_));
    OP_REQUIRES_OK(c, c->GetAttr("read", &read_));
    OP_REQUIRES_OK(c, GetReadMode(c, &mode_));
  }

  void Compute(OpKernelContext* c) override {
    OpInputList deltas;
    OP_REQUIRES_OK(c, c->input_list("deltas", &deltas));
    const int n = c->num_inputs() - deltas.size();
    OP_REQUIRES(c, static_cast<int>(names_.size()) == n && deltas.size() <= n,
                absl::InvalidArgumentError(
                    "SmbSegmentsPushRead: expected one segment name per variable and at "
                    "most one delta per variable, got " + std::to_string(names_.size()) +
                    " names, " + std::to_string(n) + " variables and " +
                    std::to_string(deltas.size()) + " deltas"));
    std::shared_ptr<smb::Communicator> comm;
    smb::SegmentTable* segments = nullptr;
    OP_REQUIRES_OK(c, SmbContext::Get().Segments(&comm, &segments));
    smb::timeline::Scope scope(smb::timeline::kThisProcess, smb::timeline::kSegments,
                               read_ ? "push+read" : "push", "segment");
    if (scope.active()) {
      scope.set_name((read_ ? "push+read (" : "push (") + std::to_string(deltas.size()) +
                     " pushes" + (read_ ? ", " + std::to_string(n) + " reads)" : ")"));
    }
    if (!read_) {
      for (int i = 0; i < deltas.size(); ++i) {
        OP_REQUIRES_OK(c, Push(names_[i], deltas[i], segments, comm->timeout_s(), nullptr,
                               false));
      }
      return;
    }
    std::vector<core::RefCountPtr<Var>> vars(n);
    size_t read_bytes = 0;
    for (int i = 0; i < n; ++i) {
      OP_REQUIRES_OK(c, LookupResource(c, HandleFromInput(c, i), &vars[i]));
      tf_shared_lock lock(*vars[i]->mu());
      read_bytes += vars[i]->tensor()->TotalBytes();
    }
    // Reads of a whole model's segments: non-temporal stores once they add up
    // (the first ones would have left the cache by the last).
    const bool bulk = smb::UseStreamingCopy(read_bytes, false);
    for (int i = 0; i < n; ++i) {
      const Tensor* delta = i < deltas.size() ? &deltas[i] : nullptr;
      OP_REQUIRES_OK(c, PushReadInto(c, i, vars[i].get(), delta, segments, comm->timeout_s(),
                                     bulk));
    }
  }

 private:
  // segment += delta; `read_back` (optional): then the segment's value.
  static absl::Status Push(const std::string& name, const Tensor& delta,
                           smb::SegmentTable* segments, double timeout_s, Tensor* read_back,
                           bool bulk) {
    smb::DType dtype;
    std::vector<int64_t> shape;
    TF_RETURN_IF_ERROR(DescribeTensor(delta, &dtype, &shape));
    return ToTfStatus(segments->Update(
        name, dtype, shape, {smb::UpdateRule::kDelta}, delta.tensor_data().data(), 0.0,
        timeout_s,
        read_back == nullptr ? nullptr : const_cast<char*>(read_back->tensor_data().data()),
        bulk));
  }

  // Variable i (`var`) = its segment's value, after `delta` (optional) is pushed.
  absl::Status PushReadInto(OpKernelContext* c, int i, Var* var, const Tensor* delta,
                            smb::SegmentTable* segments, double timeout_s, bool bulk) const {
    mutex_lock lock(*var->mu());
    Tensor* w = var->tensor();
    if (!var->is_initialized) {
      return absl::InvalidArgumentError("SmbSegmentsPushRead: the variable of segment '" +
                                        names_[i] + "' is not initialized");
    }
    if (delta != nullptr &&
        (delta->dtype() != w->dtype() || delta->shape() != w->shape())) {
      return absl::InvalidArgumentError(
          "SmbSegmentsPushRead: the delta for segment '" + names_[i] +
          "' must have its variable's dtype and shape: expected " +
          DataTypeString(w->dtype()) + w->shape().DebugString() + ", got " +
          DataTypeString(delta->dtype()) + delta->shape().DebugString());
    }
    Tensor target;
    if (w->RefCountIsOne() && !var->copy_on_read_mode.load()) {
      target = *w;  // the variable alone holds its buffer: overwrite it
    } else {
      // A value read before still holds this buffer: it must not change.
      TF_RETURN_IF_ERROR(c->allocate_temp(w->dtype(), w->shape(), &target));
    }
    if (delta != nullptr) {
      TF_RETURN_IF_ERROR(Push(names_[i], *delta, segments, timeout_s, &target, bulk));
    } else {
      TF_RETURN_IF_ERROR(ReadSegmentInto(segments, names_[i], mode_, &target, timeout_s, bulk));
    }
    *w = target;
    return absl::OkStatus();
  }

  std::vector<std::string> names_;
  bool read_;
  smb::ReadMode mode_;
};

// Applies one push to a segment: `update` (input 0) with the updater of the
// op's rule; ApplySgd also takes the learning rate (input 1).
absl::Status PushUpdate(OpKernelContext* c, const std::string& name,
                        const smb::UpdateOptions& options, double learning_rate) {
  const Tensor& update = c->input(0);
  smb::DType dtype;
  std::vector<int64_t> shape;
  TF_RETURN_IF_ERROR(DescribeTensor(update, &dtype, &shape));
  std::shared_ptr<smb::Communicator> comm;
  smb::SegmentTable* segments = nullptr;
  TF_RETURN_IF_ERROR(SmbContext::Get().Segments(&comm, &segments));
  return ToTfStatus(segments->Update(name, dtype, shape, options, update.tensor_data().data(),
                                     learning_rate, comm->timeout_s()));
}

void SmbServerPushSegmentOp::Compute(OpKernelContext* c) {
  const Tensor& update = c->input(0);
  const float learning_rate = c->input(1).scalar<float>()();
  auto shape = std::make_shared<std::vector<int64_t>>();
  smb::DType dtype;
  OP_REQUIRES_OK(c, DescribeTensor(update, &dtype, shape.get()));
  std::shared_ptr<smb::Communicator> comm;
  smb::SegmentTable* segments = nullptr;
  OP_REQUIRES_OK(c, SmbContext::Get().Segments(&comm, &segments));
  const std::string name = name_;
  const smb::UpdateOptions options = options_;
  // The closure holds the communicator (and with it the segment table) and
  // the update tensor until the server thread has applied it.
  ProcessParamServer().Submit([comm, segments, name, dtype, shape, options, update,
                               learning_rate]() -> smb::Status {
    return segments->Update(name, dtype, *shape, options, update.tensor_data().data(),
                            learning_rate, comm->timeout_s());
  });
}

// The node of each job rank (zeros on one node).
class SmbNodesOfRanksOp : public OpKernel {
 public:
  explicit SmbNodesOfRanksOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* c) override {
    std::shared_ptr<smb::Communicator> comm;
    OP_REQUIRES_OK(c, SmbContext::Get().Shared(&comm));
    const int world = comm->world();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(0, TensorShape({world}), &out));
    auto nodes = out->vec<int32>();
    const smb::NodeLink* link = comm->group().link();
    for (int r = 0; r < world; ++r) {
      int node = 0, local = r;
      if (link != nullptr) link->Locate(r, &node, &local);
      nodes(r) = node;
    }
  }
};

// The node whose box holds segment `name` (0 on one node; -1: not created here).
class SmbSegmentHomeOp : public OpKernel {
 public:
  explicit SmbSegmentHomeOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("segment", &name_));
  }
  void Compute(OpKernelContext* c) override {
    std::shared_ptr<smb::Communicator> comm;
    smb::SegmentTable* segments = nullptr;
    OP_REQUIRES_OK(c, SmbContext::Get().Segments(&comm, &segments));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(0, TensorShape({}), &out));
    out->scalar<int32>()() = segments->Home(name_);
  }

 private:
  std::string name_;
};

class SmbSegmentPushOp : public OpKernel {
 public:
  explicit SmbSegmentPushOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("segment", &name_));
  }
  void Compute(OpKernelContext* c) override {
    smb::timeline::Scope scope(smb::timeline::kThisProcess, smb::timeline::kSegments, "push",
                               "segment");
    if (scope.active()) scope.set_name("push " + name_);
    OP_REQUIRES_OK(c, PushUpdate(c, name_, {smb::UpdateRule::kDelta}, 0.0));
  }

 private:
  std::string name_;
};

class SmbSegmentApplySgdOp : public OpKernel {
 public:
  explicit SmbSegmentApplySgdOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("segment", &name_));
    float momentum;
    OP_REQUIRES_OK(c, c->GetAttr("momentum", &momentum));
    options_.rule = momentum == 0.0f ? smb::UpdateRule::kSgd : smb::UpdateRule::kMomentum;
    options_.momentum = momentum;
  }
  void Compute(OpKernelContext* c) override {
    const Tensor& lr = c->input(1);
    OP_REQUIRES(c, TensorShapeUtils::IsScalar(lr.shape()),
                absl::InvalidArgumentError("learning_rate must be a scalar, got shape " +
                                           lr.shape().DebugString()));
    smb::timeline::Scope scope(smb::timeline::kThisProcess, smb::timeline::kSegments,
                               "apply_sgd", "segment");
    if (scope.active()) scope.set_name("apply_sgd " + name_);
    OP_REQUIRES_OK(c, PushUpdate(c, name_, options_, lr.scalar<float>()()));
  }

 private:
  std::string name_;
  smb::UpdateOptions options_;
};

class SmbClockTickOp : public AsyncOpKernel {
 public:
  explicit SmbClockTickOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("staleness", &staleness_));
  }
  void ComputeAsync(OpKernelContext* c, DoneCallback done) override {
    Tensor* gap = nullptr;
    OP_REQUIRES_OK_ASYNC(c, c->allocate_output(0, TensorShape({}), &gap), done);
    std::shared_ptr<smb::Communicator> comm;
    OP_REQUIRES_OK_ASYNC(c, SmbContext::Get().Shared(&comm), done);
    const int64_t staleness = staleness_;
    if (staleness >= 0 && comm->segments() != nullptr) {
      // A bound on drift: a step's pushes reach home before it ends.
      OP_REQUIRES_OK_ASYNC(c, ToTfStatus(comm->segments()->StopCombining(comm->timeout_s())),
                           done);
    }
    const uint64_t step = comm->clock().Advance();
    if (comm->clock().Within(step, staleness, &gap->scalar<int64_t>()())) {
      done();  // most steps: no wait, so no thread
      return;
    }
    // Not on the collective thread: a staleness wait must not hold back
    // another op's collective, and it touches only atomics in the box.
    RunBlocking(c, done, [gap, step, staleness](smb::Communicator* comm) {
      int64_t g = 0;
      smb::Status s = comm->clock().WaitWithin(step, staleness, &g);
      gap->scalar<int64_t>()() = g;
      return s;
    });
  }

 private:
  int64_t staleness_;
};

class SmbClockFinishOp : public OpKernel {
 public:
  explicit SmbClockFinishOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("finished", &finished_));
  }
  void Compute(OpKernelContext* c) override {
    std::shared_ptr<smb::Communicator> comm;
    OP_REQUIRES_OK(c, SmbContext::Get().Shared(&comm));
    if (finished_) {
      // What this node combined goes home before the others see this rank
      // finished (they then read the final values).
      if (comm->segments() != nullptr) {
        OP_REQUIRES_OK(c, ToTfStatus(comm->segments()->FlushCombined(comm->timeout_s())));
      }
      comm->clock().Finish();
    } else {
      comm->clock().Resume();
    }
  }

 private:
  bool finished_;
};

class SmbLeaveOp : public OpKernel {
 public:
  explicit SmbLeaveOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("raised", &raised_));
  }
  void Compute(OpKernelContext* c) override {
    std::shared_ptr<smb::Communicator> comm;
    OP_REQUIRES_OK(c, SmbContext::Get().Shared(&comm));
    comm->Leave(raised_ ? smb::kLeftRaised : smb::kLeftFinished);
  }

 private:
  bool raised_;
};

class SmbWaitAllFinishedOp : public AsyncOpKernel {
 public:
  explicit SmbWaitAllFinishedOp(OpKernelConstruction* c) : AsyncOpKernel(c) {}
  void ComputeAsync(OpKernelContext* c, DoneCallback done) override {
    RunBlocking(c, done, [](smb::Communicator* comm) {
      smb::Status finished = comm->clock().WaitAllFinished();
      // Everyone's updates are home: the next reads fetch them.
      if (finished.ok() && comm->segments() != nullptr) comm->segments()->ForgetCombinedReads();
      return finished;
    });
  }
};

// ---- Timeline ---------------------------------------------------------------

// Events the Python layer measured (training steps), into this process's
// timeline; nothing while the timeline is off.
class SmbTimelineRecordOp : public OpKernel {
 public:
  explicit SmbTimelineRecordOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("track", &track_));
    OP_REQUIRES_OK(c, c->GetAttr("category", &category_));
    OP_REQUIRES_OK(c, c->GetAttr("arg_name", &arg_name_));
  }
  void Compute(OpKernelContext* c) override {
    if (!smb::timeline::On()) return;
    const Tensor &names = c->input(0), &starts = c->input(1), &ends = c->input(2),
                 &args = c->input(3);
    const int64_t n = names.NumElements();
    OP_REQUIRES(c, starts.NumElements() == n && ends.NumElements() == n &&
                       args.NumElements() == n,
                absl::InvalidArgumentError("names, starts_ns, ends_ns and args must have "
                                           "the same number of elements"));
    const int track = smb::timeline::TrackId(track_);
    const auto name = names.flat<tstring>();
    const auto start = starts.flat<int64_t>(), end = ends.flat<int64_t>(),
               arg = args.flat<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      smb::timeline::Record(smb::timeline::kThisProcess, track, std::string(name(i)),
                            category_.c_str(), start(i), end(i),
                            arg_name_.empty() ? nullptr : arg_name_.c_str(), arg(i));
    }
  }

 private:
  std::string track_, category_, arg_name_;
};

class SmbTimelineFlushOp : public OpKernel {
 public:
  explicit SmbTimelineFlushOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* c) override {
    std::string written;
    OP_REQUIRES_OK(c, ToTfStatus(smb::timeline::Flush(&written)));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(0, TensorShape({}), &out));
    out->scalar<tstring>()() = written;
  }
};

REGISTER_KERNEL_BUILDER(Name("SmbTimelineRecord").Device(DEVICE_CPU), SmbTimelineRecordOp);
REGISTER_KERNEL_BUILDER(Name("SmbTimelineFlush").Device(DEVICE_CPU), SmbTimelineFlushOp);

REGISTER_KERNEL_BUILDER(Name("SmbSegmentCreate").Device(DEVICE_CPU), SmbSegmentCreateOp);
REGISTER_KERNEL_BUILDER(Name("SmbSegmentRead").Device(DEVICE_CPU), SmbSegmentReadOp);
REGISTER_KERNEL_BUILDER(Name("SmbSegmentsPushRead").Device(DEVICE_CPU), SmbSegmentsPushReadOp);
REGISTER_KERNEL_BUILDER(Name("SmbSegmentPush").Device(DEVICE_CPU), SmbSegmentPushOp);
REGISTER_KERNEL_BUILDER(Name("SmbSegmentApplySgd").Device(DEVICE_CPU), SmbSegmentApplySgdOp);
REGISTER_KERNEL_BUILDER(Name("SmbClockTick").Device(DEVICE_CPU), SmbClockTickOp);
REGISTER_KERNEL_BUILDER(Name("SmbClockFinish").Device(DEVICE_CPU), SmbClockFinishOp);
REGISTER_KERNEL_BUILDER(Name("SmbLeave").Device(DEVICE_CPU), SmbLeaveOp);
REGISTER_KERNEL_BUILDER(Name("SmbWaitAllFinished").Device(DEVICE_CPU), SmbWaitAllFinishedOp);
REGISTER_KERNEL_BUILDER(Name("SmbSegmentHome").Device(DEVICE_CPU), SmbSegmentHomeOp);

// ---- Gathering on the box's sum: SmbPlaceRows, SmbTakeRows, SmbReceivedRows --
// The local halves of tf_smb.horovod's allgather, reducescatter, alltoall and
// Min/Max/Product (gathered, then reduced locally), one kernel each (for a whole list of tensors), so a grouped allgather is a
// few graph nodes, not dozens: graph-mode runs pay for every node of a growing
// graph. (Here, not in a file of their own: each file that includes
// TensorFlow's headers adds ~10 s of CPU to every fresh build of the op library.)

// Bytes of one row (first-dimension slice) of `t`.
int64_t RowBytes(const Tensor& t) {
  int64_t elements = 1;
  for (int d = 1; d < t.dims(); ++d) elements *= t.dim_size(d);
  return elements * DataTypeSize(t.dtype());
}

absl::Status CheckRowsCopyable(const std::string& op, int i, const Tensor& t) {
  if (t.dims() < 1 || !DataTypeCanUseMemcpy(t.dtype())) {
    return absl::InvalidArgumentError(
        op + ": expected tensors of at least one dimension and a numeric or bool dtype, "
        "got tensor " + std::to_string(i) + " of " + DataTypeString(t.dtype()) + " " +
        t.shape().DebugString());
  }
  return absl::OkStatus();
}

// `t`'s shape with `rows` rows.
TensorShape WithRows(const Tensor& t, int64_t rows) {
  TensorShape shape = t.shape();
  shape.set_dim(0, rows);
  return shape;
}

// SmbPlaceRows (kPlace) and SmbTakeRows (kTake): rank `rank`'s rows of each
// tensor into zeros of all ranks' rows, or out of them. counts[r, i]: rank r's
// rows of tensor i.
class MoveRowsOp : public OpKernel {
 public:
  enum Direction { kPlace, kTake };
  MoveRowsOp(OpKernelConstruction* c, Direction direction)
      : OpKernel(c), direction_(direction) {
    OP_REQUIRES_OK(c, c->GetAttr("rank", &rank_));
  }

  void Compute(OpKernelContext* c) override {
    const int tensors = c->num_inputs() - 1;
    std::vector<int64_t> offsets, mine, totals;
    OP_REQUIRES_OK(c, ReadCounts(c->input(tensors), tensors, &offsets, &mine, &totals));
    const bool place = direction_ == kPlace;
    for (int i = 0; i < tensors; ++i) {
      const Tensor& in = c->input(i);
      OP_REQUIRES_OK(c, CheckRowsCopyable(name(), i, in));
      const int64_t expected = place ? mine[i] : totals[i];
      OP_REQUIRES(c, in.dim_size(0) == expected,
                  absl::InvalidArgumentError(
                      name() + ": tensor " + std::to_string(i) + " was counted with " +
                      std::to_string(expected) +
                      (place ? " rows on rank " + std::to_string(rank_) : " rows over all ranks") +
                      ", got " + std::to_string(in.dim_size(0))));
      Tensor* out = nullptr;
      OP_REQUIRES_OK(c, c->allocate_output(i, WithRows(in, place ? totals[i] : mine[i]), &out));
      char* to = const_cast<char*>(out->tensor_data().data());
      const char* from = in.tensor_data().data();
      const int64_t at = offsets[i] * RowBytes(in);
      if (place) {
        // All-zero bytes are zero for every numeric dtype and false for bool.
        std::memset(to, 0, out->TotalBytes());
        if (in.TotalBytes() > 0) std::memcpy(to + at, from, in.TotalBytes());
      } else if (out->TotalBytes() > 0) {
        std::memcpy(to, from + at, out->TotalBytes());
      }
    }
  }

 private:
  // Rows of each tensor before rank_ (offsets), of rank_ (mine) and in all.
  absl::Status ReadCounts(const Tensor& counts, int tensors, std::vector<int64_t>* offsets,
                          std::vector<int64_t>* mine, std::vector<int64_t>* totals) const {
    if (counts.dims() != 2 || counts.dim_size(1) != tensors || counts.dim_size(0) <= rank_) {
      return absl::InvalidArgumentError(
          name() + ": expected counts of shape [ranks > " + std::to_string(rank_) + ", " +
          std::to_string(tensors) + "] (rows of each tensor on each rank), got " +
          counts.shape().DebugString());
    }
    const auto m = counts.matrix<int64_t>();
    offsets->assign(tensors, 0);
    mine->assign(tensors, 0);
    totals->assign(tensors, 0);
    for (int64_t r = 0; r < counts.dim_size(0); ++r) {
      for (int i = 0; i < tensors; ++i) {
        if (m(r, i) < 0) {
          return absl::InvalidArgumentError(
              name() + ": expected non-negative row counts, got " + std::to_string(m(r, i)) +
              " for rank " + std::to_string(r) + ", tensor " + std::to_string(i));
        }
        if (m(r, i) > std::numeric_limits<int64_t>::max() - (*totals)[i]) {
          return absl::InvalidArgumentError(name() + ": row counts of tensor " +
                                            std::to_string(i) + " overflow int64");
        }
        if (r < rank_) (*offsets)[i] += m(r, i);
        if (r == rank_) (*mine)[i] = m(r, i);
        (*totals)[i] += m(r, i);
      }
    }
    return absl::OkStatus();
  }

  const Direction direction_;
  int rank_ = 0;
};

class SmbPlaceRowsOp : public MoveRowsOp {
 public:
  explicit SmbPlaceRowsOp(OpKernelConstruction* c) : MoveRowsOp(c, kPlace) {}
};

class SmbTakeRowsOp : public MoveRowsOp {
 public:
  explicit SmbTakeRowsOp(OpKernelConstruction* c) : MoveRowsOp(c, kTake) {}
};

// The rows rank `rank` receives in an all-to-all (matrix[r, j]: rows from r to j).
class SmbReceivedRowsOp : public OpKernel {
 public:
  explicit SmbReceivedRowsOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("rank", &rank_));
  }
  void Compute(OpKernelContext* c) override {
    const Tensor& total = c->input(0);
    const Tensor& matrix = c->input(1);
    OP_REQUIRES_OK(c, CheckRowsCopyable(name(), 0, total));
    OP_REQUIRES(c, matrix.dims() == 2 && matrix.dim_size(0) == matrix.dim_size(1) &&
                       matrix.dim_size(0) > rank_,
                absl::InvalidArgumentError(
                    name() + ": expected a square matrix of rows from rank to rank, of more "
                    "than " + std::to_string(rank_) + " ranks, got " +
                    matrix.shape().DebugString()));
    const auto m = matrix.matrix<int64_t>();
    const int64_t ranks = matrix.dim_size(0);
    // Where each sender's block for `rank_` starts in `total`, and how long it is.
    std::vector<int64_t> starts(ranks), lengths(ranks);
    int64_t at = 0, received = 0;
    for (int64_t r = 0; r < ranks; ++r) {
      for (int64_t j = 0; j < ranks; ++j) {
        OP_REQUIRES(c, m(r, j) >= 0 && m(r, j) <= total.dim_size(0) - at,
                    absl::InvalidArgumentError(
                        name() + ": expected non-negative row counts summing to the " +
                        std::to_string(total.dim_size(0)) + " rows sent, got " +
                        std::to_string(m(r, j)) + " from rank " + std::to_string(r) +
                        " to rank " + std::to_string(j) + " after " + std::to_string(at)));
        if (j == rank_) {
          starts[r] = at;
          lengths[r] = m(r, j);
          received += m(r, j);
        }
        at += m(r, j);
      }
    }
    OP_REQUIRES(c, at == total.dim_size(0),
                absl::InvalidArgumentError(
                    name() + ": the matrix counts " + std::to_string(at) +
                    " rows sent, got " + std::to_string(total.dim_size(0))));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(0, WithRows(total, received), &out));
    const int64_t row_bytes = RowBytes(total);
    char* to = const_cast<char*>(out->tensor_data().data());
    const char* from = total.tensor_data().data();
    for (int64_t r = 0; r < ranks; ++r) {
      if (lengths[r] == 0) continue;
      std::memcpy(to, from + starts[r] * row_bytes, lengths[r] * row_bytes);
      to += lengths[r] * row_bytes;
    }
  }
 private:
  int rank_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("SmbInit").Device(DEVICE_CPU), SmbInitOp);
REGISTER_KERNEL_BUILDER(Name("SmbNodesOfRanks").Device(DEVICE_CPU), SmbNodesOfRanksOp);
REGISTER_KERNEL_BUILDER(Name("SmbReplicaSum").Device(DEVICE_CPU), SmbReplicaSumOp);
REGISTER_KERNEL_BUILDER(Name("SmbServerPush").Device(DEVICE_CPU), SmbServerPushOp);
REGISTER_KERNEL_BUILDER(Name("SmbServerWait").Device(DEVICE_CPU), SmbServerWaitOp);
REGISTER_KERNEL_BUILDER(Name("SmbServerPushSegment").Device(DEVICE_CPU), SmbServerPushSegmentOp);
REGISTER_KERNEL_BUILDER(Name("SmbAllReduce").Device(DEVICE_CPU), SmbAllReduceOp);
REGISTER_KERNEL_BUILDER(Name("SmbBroadcast").Device(DEVICE_CPU), SmbBroadcastOp);
REGISTER_KERNEL_BUILDER(Name("SmbBarrier").Device(DEVICE_CPU), SmbBarrierOp);
REGISTER_KERNEL_BUILDER(Name("SmbJoin").Device(DEVICE_CPU), SmbJoinOp);
REGISTER_KERNEL_BUILDER(Name("SmbCloseProcessSet").Device(DEVICE_CPU), SmbCloseProcessSetOp);
REGISTER_KERNEL_BUILDER(Name("SmbPlaceRows").Device(DEVICE_CPU), SmbPlaceRowsOp);
REGISTER_KERNEL_BUILDER(Name("SmbTakeRows").Device(DEVICE_CPU), SmbTakeRowsOp);
REGISTER_KERNEL_BUILDER(Name("SmbReceivedRows").Device(DEVICE_CPU), SmbReceivedRowsOp);

}  // namespace
}  // namespace tensorflow
