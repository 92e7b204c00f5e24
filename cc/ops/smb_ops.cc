// Registrations of the SMB TensorFlow ops. Kernels live in cc/kernels/.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

Status SameShapesAsInputs(shape_inference::InferenceContext* c) {
  for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
  return OkStatus();
}

}  // namespace

REGISTER_OP("SmbInit")
    .Attr("job_id: string")
    .Attr("rank: int")
    .Attr("world: int")
    .Attr("timeout_seconds: float = 600")
    .Attr("create: bool = false")
    .Attr("staging_bytes: int = 16777216")
    .Attr("heap_bytes: int = 268435456")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Joins this process to the job's box as `rank` of `world`. Run once, eagerly,
before any other SMB op; `create` makes the box (rank 0 without a launcher).
)doc");

REGISTER_OP("SmbAllReduce")
    .Input("tensors: T")
    .Output("sums: T")
    .Attr("T: list({float, double, half, bfloat16, int32, int64}) >= 1")
    .SetIsStateful()
    .SetShapeFn(SameShapesAsInputs)
    .Doc(R"doc(
Sums every tensor over all ranks through the box, all tensors fused in one
collective. Every rank must pass the same dtypes and shapes in the same order.
)doc");

REGISTER_OP("SmbBroadcast")
    .Input("tensors: T")
    .Output("values: T")
    .Attr("T: list({float, double, half, bfloat16, int32, int64}) >= 1")
    .Attr("root: int = 0")
    .SetIsStateful()
    .SetShapeFn(SameShapesAsInputs)
    .Doc("Every rank receives rank `root`'s tensors.");

REGISTER_OP("SmbBarrier")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Returns once every rank has reached this barrier.");

}  // namespace tensorflow
