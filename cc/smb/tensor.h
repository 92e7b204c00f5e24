// A tensor taking part in a collective, as the core sees it: dtype, shape
// and where its data is. Framework adapters (the TF kernels, the pybind
// module) describe their tensors this way.
#ifndef TF_SMB_CC_SMB_TENSOR_H_
#define TF_SMB_CC_SMB_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cc/smb/dtype.h"
#include "cc/smb/status.h"

namespace smb {

// `in` is read, `out` written (they may be the same buffer). Both hold
// NumElements(shape) elements of dtype.
struct TensorRef {
  DType dtype;
  std::vector<int64_t> shape;
  const void* in;
  void* out;
};

inline size_t NumElements(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

inline size_t NumBytes(const TensorRef& t) { return NumElements(t.shape) * DTypeSize(t.dtype); }

// "allreduce of 2 tensors: float32[3] int64[]": what ranks compare to agree.
std::string Describe(const std::string& op, const std::vector<TensorRef>& tensors);

// What a framework adapter (the TF kernels, the pybind module) gives the core
// for one op, beyond its input tensors: output memory on demand. Errors keep
// their codes (the adapter maps its own status onto smb::Status).
class OpContext {
 public:
  virtual ~OpContext() = default;
  // Points every tensor's `out` at output memory of its dtype and shape
  // (fresh, or an input's buffer the framework lets the op reuse).
  virtual Status AllocateOutputs(std::vector<TensorRef>* tensors) = 0;
};

// Valid dtypes, no negative dimension.
Status ValidateTensors(const std::vector<TensorRef>& tensors);

std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace smb

#endif  // TF_SMB_CC_SMB_TENSOR_H_
