#include "cc/smb/tensor.h"

namespace smb {

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string Describe(const std::string& op, const std::vector<TensorRef>& tensors) {
  std::string desc = op + " of " + std::to_string(tensors.size()) + " tensors:";
  for (const TensorRef& t : tensors) {
    desc += " ";
    desc += DTypeName(t.dtype);
    desc += ShapeString(t.shape);
  }
  return desc;
}

Status ValidateTensors(const std::vector<TensorRef>& tensors) {
  for (const TensorRef& t : tensors) {
    if (!IsValidDType(static_cast<int32_t>(t.dtype))) {
      return InvalidArgument("unsupported dtype code " +
                             std::to_string(static_cast<int32_t>(t.dtype)));
    }
    for (int64_t d : t.shape) {
      if (d < 0) return InvalidArgument("negative dimension in shape " + ShapeString(t.shape));
    }
  }
  return Status::Ok();
}

}  // namespace smb
