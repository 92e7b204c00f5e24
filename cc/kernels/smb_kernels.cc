// AsyncOpKernels for the SMB ops. Each kernel hands its work to one
// background thread per process that owns the Communicator, and calls done()
// when the collective finishes, so TensorFlow's inter-op threads never block.
// The single thread also runs collectives in the order they were enqueued,
// which the strategy keeps equal on every rank (stateful ops run in program
// order inside tf.function).
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cc/smb/communicator.h"
#include "cc/smb/store.h"
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/op_kernel.h"
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
  }
  return absl::UnknownError(s.message());
}

bool ToSmbDType(DataType dt, smb::DType* out) {
  switch (dt) {
    case DT_FLOAT: *out = smb::DType::kFloat32; return true;
    case DT_DOUBLE: *out = smb::DType::kFloat64; return true;
    case DT_HALF: *out = smb::DType::kFloat16; return true;
    case DT_BFLOAT16: *out = smb::DType::kBFloat16; return true;
    case DT_INT32: *out = smb::DType::kInt32; return true;
    case DT_INT64: *out = smb::DType::kInt64; return true;
    default: return false;
  }
}

// The process's membership in a job: the Communicator and the thread that
// drives it.
class SmbContext {
 public:
  static SmbContext& Get() {
    static SmbContext context;
    return context;
  }

  absl::Status Init(const smb::Communicator::Options& options) {
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
    worker_ = std::thread([this] { Loop(); });
    return absl::OkStatus();
  }

  // Runs `work` on the background thread with the Communicator.
  absl::Status Enqueue(std::function<void(smb::Communicator*)> work) {
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ == nullptr) {
      return absl::FailedPreconditionError(
          "SMB ops need the process to join a job first: create "
          "tf_smb.SMBStrategy() (or call tf_smb.init()) before running them");
    }
    queue_.push_back(std::move(work));
    cv_.notify_one();
    return absl::OkStatus();
  }

  // Creates or attaches the box segment `name` and remembers it.
  absl::Status CreateSegment(const std::string& name, smb::DType dtype,
                             const std::vector<int64_t>& shape,
                             smb::Segment* out) {
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ == nullptr || comm_->box() == nullptr) {
      return absl::FailedPreconditionError(
          "box segments need a job of 2 or more workers joined with "
          "tf_smb.init()");
    }
    uint64_t key = 0;
    absl::Status s = ToTfStatus(comm_->box()->CreateSegment(name, dtype, shape, &key));
    if (s.ok()) s = ToTfStatus(comm_->box()->AttachSegment(key, dtype, shape, out));
    if (s.ok()) segments_[name] = *out;
    return s;
  }

  // The segment `name`, checked against the dtype and shape the caller holds.
  absl::Status FindSegment(const std::string& name, smb::DType dtype,
                           const std::vector<int64_t>& shape, smb::Segment* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = segments_.find(name);
    if (it == segments_.end()) {
      return absl::NotFoundError("no box segment '" + name +
                                 "' in this process; create it first");
    }
    const smb::Segment& seg = it->second;
    if (seg.dtype != dtype || seg.shape != shape) {
      return absl::InvalidArgumentError(
          "box segment '" + name + "' holds " + smb::DTypeName(seg.dtype) +
          smb::ShapeString(seg.shape) + ", got " + smb::DTypeName(dtype) +
          smb::ShapeString(shape));
    }
    *out = seg;
    return absl::OkStatus();
  }

  smb::Communicator* comm() {
    std::lock_guard<std::mutex> lock(mu_);
    return comm_.get();
  }

  ~SmbContext() {
    std::unique_lock<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_one();
    if (!worker_.joinable()) return;
    if (busy_ || !queue_.empty()) {
      // Exiting mid-collective: never block exit on peers. Leave the
      // Communicator mapped (the OS reclaims it) and the thread detached.
      worker_.detach();
      comm_.release();  // NOLINT: intentionally leaked at process exit
      return;
    }
    lock.unlock();
    worker_.join();
  }

 private:
  SmbContext() = default;

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      auto work = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      work(comm_.get());
      lock.lock();
      busy_ = false;
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void(smb::Communicator*)>> queue_;
  std::unique_ptr<smb::Communicator> comm_;
  std::string job_id_;
  std::unordered_map<std::string, smb::Segment> segments_;
  std::thread worker_;
  bool busy_ = false;
  bool stop_ = false;
};

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
    OP_REQUIRES_OK(c, SmbContext::Get().Init(options_));
  }

 private:
  smb::Communicator::Options options_;
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
          "; expected float32, float64, float16, bfloat16, int32 or int64");
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
  explicit SmbAllReduceOp(OpKernelConstruction* c) : AsyncOpKernel(c) {}
  void ComputeAsync(OpKernelContext* c, DoneCallback done) override {
    auto refs = std::make_shared<std::vector<smb::TensorRef>>();
    OP_REQUIRES_OK_ASYNC(c, DescribeInputs(c, refs.get()), done);
    OP_REQUIRES_OK_ASYNC(
        c, SmbContext::Get().Enqueue([c, refs, done](smb::Communicator* comm) {
          std::vector<void*> sums;
          std::shared_ptr<smb::ResultHold> hold;
          auto bind = [c](std::vector<smb::TensorRef>* r) {
            absl::Status s = BindOutputs(c, r);
            return s.ok() ? smb::Status::Ok()
                          : smb::Status(smb::Code::kResourceExhausted,
                                        std::string(s.message()));
          };
          c->SetStatus(ToTfStatus(comm->AllReduceSumShared(*refs, bind, &sums, &hold)));
          if (c->status().ok() && hold != nullptr) {
            // The sums are in the box already: outputs point at them.
            for (size_t i = 0; i < sums.size(); ++i) {
              const int index = static_cast<int>(i);
              const Tensor& in = c->input(index);
              if (in.NumElements() == 0) {
                Tensor* empty = nullptr;
                c->SetStatus(c->allocate_output(index, in.shape(), &empty));
                if (!c->status().ok()) break;
                continue;
              }
              // TensorBuffers are reference counted by TensorFlow: Tensor owns it.
              core::RefCountPtr<TensorBuffer> buffer(
                  new BoxSumBuffer(hold, sums[i], in.TotalBytes()));
              c->set_output(index, Tensor(in.dtype(), in.shape(), std::move(buffer)));
            }
          }
          done();
        }),
        done);
  }
};

class SmbBroadcastOp : public AsyncOpKernel {
 public:
  explicit SmbBroadcastOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root", &root_));
  }
  void ComputeAsync(OpKernelContext* c, DoneCallback done) override {
    auto refs = std::make_shared<std::vector<smb::TensorRef>>();
    OP_REQUIRES_OK_ASYNC(c, DescribeInputs(c, refs.get()), done);
    OP_REQUIRES_OK_ASYNC(c, BindOutputs(c, refs.get()), done);
    const int root = root_;
    OP_REQUIRES_OK_ASYNC(
        c, SmbContext::Get().Enqueue([c, refs, root, done](smb::Communicator* comm) {
          c->SetStatus(ToTfStatus(comm->Broadcast(root, *refs)));
          done();
        }),
        done);
  }

 private:
  int root_;
};

class SmbBarrierOp : public AsyncOpKernel {
 public:
  explicit SmbBarrierOp(OpKernelConstruction* c) : AsyncOpKernel(c) {}
  void ComputeAsync(OpKernelContext* c, DoneCallback done) override {
    OP_REQUIRES_OK_ASYNC(
        c, SmbContext::Get().Enqueue([c, done](smb::Communicator* comm) {
          c->SetStatus(ToTfStatus(comm->Barrier()));
          done();
        }),
        done);
  }
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

class SmbParamCreateOp : public OpKernel {
 public:
  explicit SmbParamCreateOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("segment", &name_));
    OP_REQUIRES_OK(c, c->GetAttr("write", &write_));
  }
  void Compute(OpKernelContext* c) override {
    const Tensor& value = c->input(0);
    smb::DType dtype;
    std::vector<int64_t> shape;
    OP_REQUIRES_OK(c, DescribeTensor(value, &dtype, &shape));
    smb::Segment seg;
    OP_REQUIRES_OK(c, SmbContext::Get().CreateSegment(name_, dtype, shape, &seg));
    if (write_) {
      OP_REQUIRES_OK(c, ToTfStatus(smb::AssignSegment(seg, value.tensor_data().data())));
    }
  }

 private:
  std::string name_;
  bool write_;
};

class SmbParamReadOp : public OpKernel {
 public:
  explicit SmbParamReadOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("segment", &name_));
    OP_REQUIRES_OK(c, c->GetAttr("shape", &shape_));
    OP_REQUIRES_OK(c, c->GetAttr("T", &dtype_));
    bool consistent;
    OP_REQUIRES_OK(c, c->GetAttr("consistent", &consistent));
    mode_ = consistent ? smb::ReadMode::kConsistent : smb::ReadMode::kHogwild;
  }
  void Compute(OpKernelContext* c) override {
    smb::DType dtype;
    OP_REQUIRES(c, ToSmbDType(dtype_, &dtype),
                absl::InvalidArgumentError("unsupported dtype"));
    const auto dims = shape_.dim_sizes();
    std::vector<int64_t> shape(dims.begin(), dims.end());
    smb::Segment seg;
    OP_REQUIRES_OK(c, SmbContext::Get().FindSegment(name_, dtype, shape, &seg));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(0, shape_, &out));
    OP_REQUIRES_OK(c, ToTfStatus(smb::ReadSegment(
                          seg, const_cast<char*>(out->tensor_data().data()), mode_)));
  }

 private:
  std::string name_;
  TensorShape shape_;
  DataType dtype_;
  smb::ReadMode mode_;
};

class SmbParamPushOp : public OpKernel {
 public:
  explicit SmbParamPushOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("segment", &name_));
  }
  void Compute(OpKernelContext* c) override {
    const Tensor& delta = c->input(0);
    smb::DType dtype;
    std::vector<int64_t> shape;
    OP_REQUIRES_OK(c, DescribeTensor(delta, &dtype, &shape));
    smb::Segment seg;
    OP_REQUIRES_OK(c, SmbContext::Get().FindSegment(name_, dtype, shape, &seg));
    OP_REQUIRES_OK(c, ToTfStatus(smb::Accumulate(seg, delta.tensor_data().data())));
  }

 private:
  std::string name_;
};

class SmbParamApplySgdOp : public OpKernel {
 public:
  explicit SmbParamApplySgdOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("segment", &name_));
    OP_REQUIRES_OK(c, c->GetAttr("momentum", &momentum_));
  }
  void Compute(OpKernelContext* c) override {
    const Tensor& grad = c->input(0);
    const Tensor& lr = c->input(1);
    OP_REQUIRES(c, TensorShapeUtils::IsScalar(lr.shape()),
                absl::InvalidArgumentError("learning_rate must be a scalar, got shape " +
                                           lr.shape().DebugString()));
    smb::DType dtype;
    std::vector<int64_t> shape;
    OP_REQUIRES_OK(c, DescribeTensor(grad, &dtype, &shape));
    smb::Segment seg;
    OP_REQUIRES_OK(c, SmbContext::Get().FindSegment(name_, dtype, shape, &seg));
    const double rate = lr.scalar<float>()();
    if (momentum_ == 0.0f) {
      OP_REQUIRES_OK(c, ToTfStatus(smb::Axpy(seg, -rate, grad.tensor_data().data())));
      return;
    }
    smb::Segment velocity;
    OP_REQUIRES_OK(c, SmbContext::Get().CreateSegment(name_ + "/velocity", dtype,
                                                      shape, &velocity));
    OP_REQUIRES_OK(c, ToTfStatus(smb::MomentumStep(seg, velocity, rate, momentum_,
                                                   grad.tensor_data().data())));
  }

 private:
  std::string name_;
  float momentum_;
};

class SmbClockTickOp : public AsyncOpKernel {
 public:
  explicit SmbClockTickOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("staleness", &staleness_));
  }
  void ComputeAsync(OpKernelContext* c, DoneCallback done) override {
    Tensor* gap = nullptr;
    OP_REQUIRES_OK_ASYNC(c, c->allocate_output(0, TensorShape({}), &gap), done);
    const int64_t staleness = staleness_;
    // Not on the collective thread: a staleness wait must not hold back
    // another op's collective, and it touches only atomics in the box.
    smb::Communicator* comm = SmbContext::Get().comm();
    OP_REQUIRES_ASYNC(c, comm != nullptr,
                      absl::FailedPreconditionError("join a job first (tf_smb.init())"),
                      done);
    std::thread([c, gap, comm, staleness, done] {
      int64_t g = 0;
      c->SetStatus(ToTfStatus(comm->ClockTick(staleness, &g)));
      gap->scalar<int64_t>()() = g;
      done();
    }).detach();
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
    smb::Communicator* comm = SmbContext::Get().comm();
    OP_REQUIRES(c, comm != nullptr,
                absl::FailedPreconditionError("join a job first (tf_smb.init())"));
    if (finished_) {
      comm->ClockFinish();
    } else {
      comm->ClockResume();
    }
  }

 private:
  bool finished_;
};

class SmbWaitAllFinishedOp : public AsyncOpKernel {
 public:
  explicit SmbWaitAllFinishedOp(OpKernelConstruction* c) : AsyncOpKernel(c) {}
  void ComputeAsync(OpKernelContext* c, DoneCallback done) override {
    OP_REQUIRES_OK_ASYNC(
        c, SmbContext::Get().Enqueue([c, done](smb::Communicator* comm) {
          c->SetStatus(ToTfStatus(comm->WaitAllFinished()));
          done();
        }),
        done);
  }
};

REGISTER_KERNEL_BUILDER(Name("SmbParamCreate").Device(DEVICE_CPU), SmbParamCreateOp);
REGISTER_KERNEL_BUILDER(Name("SmbParamRead").Device(DEVICE_CPU), SmbParamReadOp);
REGISTER_KERNEL_BUILDER(Name("SmbParamPush").Device(DEVICE_CPU), SmbParamPushOp);
REGISTER_KERNEL_BUILDER(Name("SmbParamApplySgd").Device(DEVICE_CPU), SmbParamApplySgdOp);
REGISTER_KERNEL_BUILDER(Name("SmbClockTick").Device(DEVICE_CPU), SmbClockTickOp);
REGISTER_KERNEL_BUILDER(Name("SmbClockFinish").Device(DEVICE_CPU), SmbClockFinishOp);
REGISTER_KERNEL_BUILDER(Name("SmbWaitAllFinished").Device(DEVICE_CPU), SmbWaitAllFinishedOp);

REGISTER_KERNEL_BUILDER(Name("SmbInit").Device(DEVICE_CPU), SmbInitOp);
REGISTER_KERNEL_BUILDER(Name("SmbAllReduce").Device(DEVICE_CPU), SmbAllReduceOp);
REGISTER_KERNEL_BUILDER(Name("SmbBroadcast").Device(DEVICE_CPU), SmbBroadcastOp);
REGISTER_KERNEL_BUILDER(Name("SmbBarrier").Device(DEVICE_CPU), SmbBarrierOp);

}  // namespace
}  // namespace tensorflow
