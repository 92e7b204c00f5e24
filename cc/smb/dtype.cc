#include "cc/smb/dtype.h"

#include <cerrno>
#include <cstring>

namespace smb {

std::string Status::ToString() const {
  static const char* const kNames[] = {
      "OK",           "INVALID_ARGUMENT",  "DEADLINE_EXCEEDED", "ABORTED",
      "ALREADY_EXISTS", "NOT_FOUND", "RESOURCE_EXHAUSTED", "INTERNAL",
      "FAILED_PRECONDITION"};
  return std::string(kNames[static_cast<int>(code_)]) + ": " + message_;
}

Status SystemError(const std::string& what) {
  return Status(Code::kInternal, what + ": " + std::strerror(errno));
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kInt8: return 1;
    case DType::kUInt8: return 1;
    case DType::kInt16: return 2;
    case DType::kUInt16: return 2;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kInt16: return "int16";
    case DType::kUInt16: return "uint16";
  }
  return "invalid";
}

bool IsValidDType(int32_t value) { return value >= 1 && value <= kNumDTypes; }

Status ParseDType(const std::string& name, DType* out) {
  for (int32_t v = 1; v <= kNumDTypes; ++v) {
    if (name == DTypeName(static_cast<DType>(v))) {
      *out = static_cast<DType>(v);
      return Status::Ok();
    }
  }
  std::string names;
  for (int32_t v = 1; v <= kNumDTypes; ++v) {
    names += std::string(v > 1 ? ", " : "") + DTypeName(static_cast<DType>(v));
  }
  return InvalidArgument("unsupported dtype '" + name + "'; expected one of " + names);
}

namespace {

inline float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline uint32_t FloatToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// IEEE binary16 <-> binary32, round to nearest even; NaN and Inf preserved.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: value = mant * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

inline uint16_t FloatToHalf(float f) {
  const uint32_t bits = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // Inf or NaN
    return sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: Inf
  if (abs < 0x38800000u) {
    // Result is subnormal or zero: scale so the float's rounding does ours.
    const float scaled = BitsToFloat(abs) * 16777216.0f;  // * 2^24
    const float rounded = scaled + 12582912.0f - 12582912.0f;  // nearest even
    return sign | static_cast<uint16_t>(rounded);
  }
  // Normal: drop 13 mantissa bits with round to nearest even.
  uint32_t v = abs - 0x38000000u;  // rebias exponent 127 -> 15
  v += 0x0fffu + ((v >> 13) & 1u);
  return sign | static_cast<uint16_t>(v >> 13);
}

inline float BFloat16ToFloat(uint16_t b) {
  return BitsToFloat(static_cast<uint32_t>(b) << 16);
}

inline uint16_t FloatToBFloat16(float f) {
  uint32_t bits = FloatToBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

template <typename T>
void SumPlain(void* dst, const void* a, const void* b, size_t n) {
  T* d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) d[i] = x[i] + y[i];
}

// Integers wrap on overflow (two's complement), as TensorFlow's do, without
// the undefined behaviour of signed overflow.
template <typename T, typename U>
void SumWrapping(void* dst, const void* a, const void* b, size_t n) {
  T* d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) {
    d[i] = static_cast<T>(static_cast<U>(x[i]) + static_cast<U>(y[i]));
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void SumHalfLike(void* dst, const void* a, const void* b, size_t n) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) d[i] = FromFloat(ToFloat(x[i]) + ToFloat(y[i]));
}

}  // namespace

namespace {

// Converters of one half-like dtype: float16 or bfloat16.
struct HalfLike {
  float (*to_float)(uint16_t);
  uint16_t (*from_float)(float);
};

HalfLike ConvertersOf(DType dtype) {
  if (dtype == DType::kFloat16) return {HalfToFloat, FloatToHalf};
  return {BFloat16ToFloat, FloatToBFloat16};
}

}  // namespace

void AxpyHalfLike(DType dtype, uint16_t* y, double alpha, const uint16_t* x,
                  size_t n) {
  const HalfLike c = ConvertersOf(dtype);
  const float a = static_cast<float>(alpha);
  for (size_t i = 0; i < n; ++i) y[i] = c.from_float(c.to_float(y[i]) + a * c.to_float(x[i]));
}

void MomentumHalfLike(DType dtype, uint16_t* w, uint16_t* v, double lr,
                      double momentum, const uint16_t* g, size_t n) {
  const HalfLike c = ConvertersOf(dtype);
  const float m = static_cast<float>(momentum), a = static_cast<float>(lr);
  for (size_t i = 0; i < n; ++i) {
    const uint16_t velocity = c.from_float(m * c.to_float(v[i]) - a * c.to_float(g[i]));
    v[i] = velocity;
    w[i] = c.from_float(c.to_float(w[i]) + c.to_float(velocity));
  }
}

void SumInto(DType dtype, void* dst, const void* a, const void* b, size_t n) {
  switch (dtype) {
    case DType::kFloat32: return SumPlain<float>(dst, a, b, n);
    case DType::kFloat64: return SumPlain<double>(dst, a, b, n);
    case DType::kInt32: return SumWrapping<int32_t, uint32_t>(dst, a, b, n);
    case DType::kInt64: return SumWrapping<int64_t, uint64_t>(dst, a, b, n);
    case DType::kInt8: return SumWrapping<int8_t, uint8_t>(dst, a, b, n);
    case DType::kUInt8: return SumWrapping<uint8_t, uint8_t>(dst, a, b, n);
    case DType::kInt16: return SumWrapping<int16_t, uint16_t>(dst, a, b, n);
    case DType::kUInt16: return SumWrapping<uint16_t, uint16_t>(dst, a, b, n);
    case DType::kFloat16:
      return SumHalfLike<HalfToFloat, FloatToHalf>(dst, a, b, n);
    case DType::kBFloat16:
      return SumHalfLike<BFloat16ToFloat, FloatToBFloat16>(dst, a, b, n);
  }
}

}  // namespace smb
