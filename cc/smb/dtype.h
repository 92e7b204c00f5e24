// Element types the box can hold and reduce.
#ifndef TF_SMB_CC_SMB_DTYPE_H_
#define TF_SMB_CC_SMB_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "cc/smb/status.h"

namespace smb {

enum class DType : int32_t {
  kFloat32 = 1,
  kFloat64 = 2,
  kFloat16 = 3,
  kBFloat16 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kInt8 = 7,
  kUInt8 = 8,
  kInt16 = 9,
  kUInt16 = 10,
};
// DType values run from 1 to kNumDTypes.
constexpr int32_t kNumDTypes = 10;

size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);
// Parses a DTypeName: "float32", "int8", "uint16", ...
Status ParseDType(const std::string& name, DType* out);
bool IsValidDType(int32_t value);

// dst[i] = a[i] + b[i] for n elements of `dtype`. dst may alias a or b.
// float16/bfloat16 are summed in float32 and rounded once (to nearest even).
void SumInto(DType dtype, void* dst, const void* a, const void* b, size_t n);

// y[i] += alpha * x[i] for float16/bfloat16: computed in float32, rounded
// once (to nearest even).
void AxpyHalfLike(DType dtype, uint16_t* y, double alpha, const uint16_t* x,
                  size_t n);
// v[i] = momentum * v[i] - lr * g[i]; w[i] += v[i] for float16/bfloat16:
// computed in float32, each stored value rounded once.
void MomentumHalfLike(DType dtype, uint16_t* w, uint16_t* v, double lr,
                      double momentum, const uint16_t* g, size_t n);

}  // namespace smb

#endif  // TF_SMB_CC_SMB_DTYPE_H_
