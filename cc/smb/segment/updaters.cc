#include "cc/smb/segment/updaters.h"

#include "cc/smb/copy.h"
#include "cc/smb/segment/segment_io.h"

namespace smb {
namespace {

bool IsFloating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat64 || dtype == DType::kFloat16 ||
         dtype == DType::kBFloat16;
}

template <typename T>
void Axpy(void* y, double alpha, const void* x, size_t n) {
  T* w = static_cast<T*>(y);
  const T* v = static_cast<const T*>(x);
  const T a = static_cast<T>(alpha);
  for (size_t i = 0; i < n; ++i) w[i] += a * v[i];
}

template <typename T>
void Momentum(void* w_data, void* v_data, double lr, double momentum, const void* g_data,
              size_t n) {
  T* w = static_cast<T*>(w_data);
  T* v = static_cast<T*>(v_data);
  const T* g = static_cast<const T*>(g_data);
  const T m = static_cast<T>(momentum), a = static_cast<T>(lr);
  for (size_t i = 0; i < n; ++i) {
    v[i] = m * v[i] - a * g[i];
    w[i] += v[i];
  }
}

class RuleUpdater : public Updater {
 public:
  RuleUpdater(UpdateOptions options, Segment velocity)
      : options_(options), velocity_(std::move(velocity)) {}

  Status Apply(const Segment& param, const void* update, double learning_rate,
               void* read_back, bool bulk) override {
    Status result;
    const size_t elem = DTypeSize(param.dtype);
    const CopyFn copy = CopyFor(param.bytes, bulk);
    // Each stripe of the parameter locks that stripe of its velocity too.
    Status written = WriteSegment(param, [&](size_t offset, size_t bytes) {
      if (!result.ok()) return;
      result = ApplyRule(options_, param.dtype, static_cast<char*>(param.data) + offset,
                         velocity_.data == nullptr
                             ? nullptr
                             : static_cast<char*>(velocity_.data) + offset,
                         static_cast<const char*>(update) + offset, learning_rate,
                         bytes / elem);
      if (read_back == nullptr || !result.ok()) return;
      copy(static_cast<char*>(read_back) + offset, static_cast<const char*>(param.data) + offset,
           bytes);
    });
    if (read_back != nullptr) StreamingFence();
    return written.ok() ? result : written;
  }

 private:
  UpdateOptions options_;
  Segment velocity_;  // kMomentum only
};

}  // namespace

Status ApplyRule(const UpdateOptions& options, DType dtype, void* w, void* velocity,
                 const void* update, double learning_rate, size_t n) {
  if (options.rule == UpdateRule::kDelta) {
    SumInto(dtype, w, w, update, n);
    return Status::Ok();
  }
  if (!IsFloating(dtype)) {
    return Status(Code::kInvalidArgument,
                  std::string("an SGD step needs a floating dtype, got ") + DTypeName(dtype));
  }
  if (options.rule == UpdateRule::kSgd) {
    const double alpha = -learning_rate;
    switch (dtype) {
      case DType::kFloat32: Axpy<float>(w, alpha, update, n); break;
      case DType::kFloat64: Axpy<double>(w, alpha, update, n); break;
      default:
        AxpyHalfLike(dtype, static_cast<uint16_t*>(w), alpha,
                     static_cast<const uint16_t*>(update), n);
    }
    return Status::Ok();
  }
  switch (dtype) {
    case DType::kFloat32:
      Momentum<float>(w, velocity, learning_rate, options.momentum, update, n);
      break;
    case DType::kFloat64:
      Momentum<double>(w, velocity, learning_rate, options.momentum, update, n);
      break;
    default:
      MomentumHalfLike(dtype, static_cast<uint16_t*>(w), static_cast<uint16_t*>(velocity),
                       learning_rate, options.momentum, static_cast<const uint16_t*>(update), n);
  }
  return Status::Ok();
}

Status MakeUpdater(Box* box, const std::string& param_name, const Segment& param,
                   const UpdateOptions& options, std::unique_ptr<Updater>* out) {
  if (options.rule == UpdateRule::kDelta) {
    *out = std::make_unique<RuleUpdater>(options, Segment());
    return Status::Ok();
  }
  if (!IsFloating(param.dtype)) {
    return InvalidArgument("an SGD update needs a floating segment; '" + param_name +
                           "' holds " + DTypeName(param.dtype));
  }
  if (options.rule == UpdateRule::kSgd) {
    *out = std::make_unique<RuleUpdater>(options, Segment());
    return Status::Ok();
  }
  if (!(options.momentum >= 0.0 && options.momentum < 1.0)) {
    return InvalidArgument("momentum must be in [0, 1), got " + std::to_string(options.momentum));
  }
  // The velocity is this updater's state: named after its parameter, made
  // once, zero at first (the heap is zero-filled).
  uint64_t key = 0;
  Segment velocity;
  SMB_RETURN_IF_ERROR(box->CreateSegment(param_name + "/velocity", param.dtype, param.shape, &key));
  SMB_RETURN_IF_ERROR(box->AttachSegment(key, param.dtype, param.shape, &velocity));
  *out = std::make_unique<RuleUpdater>(options, std::move(velocity));
  return Status::Ok();
}

}  // namespace smb
