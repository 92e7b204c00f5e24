#include "cc/smb/segment/updaters.h"

#include "cc/smb/segment/segment_io.h"

namespace smb {
namespace {

size_t Elements(const Segment& s) { return s.bytes / DTypeSize(s.dtype); }

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

class DeltaUpdater : public Updater {
 public:
  Status Apply(const Segment& param, const void* delta, double) override {
    return WriteSegment(param, [&] {
      SumInto(param.dtype, param.data, param.data, delta, Elements(param));
    });
  }
};

class SgdUpdater : public Updater {
 public:
  Status Apply(const Segment& param, const void* grad, double learning_rate) override {
    const size_t n = Elements(param);
    const double alpha = -learning_rate;
    return WriteSegment(param, [&] {
      switch (param.dtype) {
        case DType::kFloat32: return Axpy<float>(param.data, alpha, grad, n);
        case DType::kFloat64: return Axpy<double>(param.data, alpha, grad, n);
        default:
          return AxpyHalfLike(param.dtype, static_cast<uint16_t*>(param.data), alpha,
                              static_cast<const uint16_t*>(grad), n);
      }
    });
  }
};

class MomentumUpdater : public Updater {
 public:
  MomentumUpdater(Segment velocity, double momentum)
      : velocity_(std::move(velocity)), momentum_(momentum) {}

  Status Apply(const Segment& param, const void* grad, double learning_rate) override {
    const size_t n = Elements(param);
    void* v = velocity_.data;
    // The parameter's lock also covers its velocity.
    return WriteSegment(param, [&] {
      switch (param.dtype) {
        case DType::kFloat32:
          return Momentum<float>(param.data, v, learning_rate, momentum_, grad, n);
        case DType::kFloat64:
          return Momentum<double>(param.data, v, learning_rate, momentum_, grad, n);
        default:
          return MomentumHalfLike(param.dtype, static_cast<uint16_t*>(param.data),
                                  static_cast<uint16_t*>(v), learning_rate, momentum_,
                                  static_cast<const uint16_t*>(grad), n);
      }
    });
  }

 private:
  Segment velocity_;
  double momentum_;
};

}  // namespace

Status MakeUpdater(Box* box, const std::string& param_name, const Segment& param,
                   const UpdateOptions& options, std::unique_ptr<Updater>* out) {
  if (options.rule == UpdateRule::kDelta) {
    *out = std::make_unique<DeltaUpdater>();
    return Status::Ok();
  }
  if (!IsFloating(param.dtype)) {
    return InvalidArgument("an SGD update needs a floating segment; '" + param_name +
                           "' holds " + DTypeName(param.dtype));
  }
  if (options.rule == UpdateRule::kSgd) {
    *out = std::make_unique<SgdUpdater>();
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
  *out = std::make_unique<MomentumUpdater>(std::move(velocity), options.momentum);
  return Status::Ok();
}

}  // namespace smb
