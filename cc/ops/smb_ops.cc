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

// Output i has the shape of input i * replicas (the first replica's part).
Status FirstReplicaShapes(shape_inference::InferenceContext* c) {
  int replicas = 0;
  TF_RETURN_IF_ERROR(c->GetAttr("replicas", &replicas));
  for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i * replicas));
  return OkStatus();
}

// Output i has input i's shape, with any number of rows (first dimension).
Status AnyRowsShapes(shape_inference::InferenceContext* c) {
  shape_inference::ShapeHandle counts;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(c->num_inputs() - 1), 2, &counts));
  for (int i = 0; i < c->num_outputs(); ++i) {
    shape_inference::ShapeHandle in, out;
    TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(i), 1, &in));
    TF_RETURN_IF_ERROR(c->ReplaceDim(in, 0, c->UnknownDim(), &out));
    c->set_output(i, out);
  }
  return OkStatus();
}

}  // namespace

REGISTER_OP("SmbReplicaSum")
    .Input("parts: T")
    .Output("sums: S")
    .Attr("T: list({float, double, half, bfloat16, int8, uint8, int16, uint16, int32, int64}) >= 1")
    .Attr("S: list({float, double, half, bfloat16, int8, uint8, int16, uint16, int32, int64}) >= 1")
    .Attr("replicas: int >= 1")
    .SetShapeFn(FirstReplicaShapes)
    .Doc(R"doc(
Sums the local replicas' parts of every value inside this process (SingleCaffe's
partitioned reduction: one thread per replica sums its slice of all values from
every replica). `parts` holds value 0's part from replica 0, 1, ..., then value
1's, and so on; sums[i] is value i's sum (dtype S[i] == T[i * replicas]).
)doc");

REGISTER_OP("SmbServerPush")
    .Input("variable: resource")
    .Input("update: T")
    .Input("learning_rate: float")
    .Attr("T: {float, double, half, bfloat16, int32, int64}")
    .Attr("rule: {'delta', 'sgd', 'momentum'} = 'delta'")
    .Attr("momentum: float = 0.0")
    .Attr("consistent: bool = true")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Hands an update of `variable` to this process's parameter-server thread and
returns at once (local replicas, asynchronous mode). The thread applies updates
one at a time in the order they came: delta (w += update), sgd
(w -= learning_rate * update) or momentum. `consistent`: a value already read
is never changed (copy-on-write, as TensorFlow's own updates); else in place.
)doc");

REGISTER_OP("SmbServerPushSegment")
    .Input("update: T")
    .Input("learning_rate: float")
    .Attr("T: {float, double, half, bfloat16, int32, int64}")
    .Attr("segment: string")
    .Attr("rule: {'delta', 'sgd', 'momentum'} = 'delta'")
    .Attr("momentum: float = 0.0")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Hands an update of box segment `segment` to this process's parameter-server
thread and returns at once; the thread applies it in the box (atomically per
segment, as SmbSegmentPush and SmbSegmentApplySgd do), after the updates that
came before it.
)doc");

REGISTER_OP("SmbServerWait")
    .Input("max_pending: int64")
    .Output("applied: int64")
    .Attr("timeout_seconds: float = 600")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
Waits until the parameter-server thread has at most `max_pending` updates left
(0: all applied); returns how many it applied so far. Fails with the first
failed update's error, or DeadlineExceeded after timeout_seconds.
)doc");

REGISTER_OP("SmbInit")
    .Attr("job_id: string")
    .Attr("rank: int")
    .Attr("world: int")
    .Attr("timeout_seconds: float")
    .Attr("create: bool")
    .Attr("staging_bytes: int")
    .Attr("heap_bytes: int")
    .Attr("across_nodes: bool")
    .Attr("process_set: int = 0")
    .Attr("members: list(int) = []")
    .Attr("rejoin: bool = false")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Joins this process to the job's box as `rank` of `world`. Run once, eagerly,
before any other SMB op; `create` makes the box (rank 0 without a launcher).
`across_nodes`: the job spans nodes; MPI finds the nodes, each node's local
rank 0 creates its box, and the boxes are joined over MPI.
`process_set` > 0 opens a process set instead: a group of some of the job's
processes, with a box of its own named by `job_id` (one per node), which the
collectives with that `process_set` use. A set spanning nodes gives
`across_nodes` and its `members` (job ranks; `rank` is the index among them).
`rejoin` first leaves the job (and process sets) this process joined, so that
it joins another: elastic training, after the membership changed.
The Python wrapper passes every attribute (defaults: cc/smb/defaults.h).
)doc");

REGISTER_OP("SmbCloseProcessSet")
    .Attr("process_set: int")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Leaves a process set opened by SmbInit; its collectives fail afterwards.");

// `key` names a collective's call site in a graph (empty for eager ops): the
// ranks match collectives by it, so independent collectives may run in any
// order on each rank (see cc/smb/scheduler.h). `process_set` (all three
// collectives): 0 for the whole job, or a process set SmbInit opened; the
// collective then runs among that set's ranks only (root: a rank of the set).
REGISTER_OP("SmbAllReduce")
    .Input("tensors: T")
    .Output("sums: T")
    .Attr("T: list({float, double, half, bfloat16, int8, uint8, int16, uint16, int32, int64}) >= 1")
    .Attr("key: string = ''")
    .Attr("agreement: string = ''")
    .Attr("process_set: int = 0")
    .SetIsStateful()
    .SetShapeFn(SameShapesAsInputs)
    .Doc(R"doc(
Sums every tensor over all ranks through the box, all tensors fused in one
collective. Every rank must pass the same dtypes and shapes for the same key.
A non-empty `agreement` ("NAME\nfield=value;...") makes a disagreement of the
ranks recoverable (FailedPreconditionError on every rank; the job goes on).
)doc");

REGISTER_OP("SmbBroadcast")
    .Input("tensors: T")
    .Output("values: T")
    .Attr("T: list({float, double, half, bfloat16, int8, uint8, int16, uint16, int32, int64}) >= 1")
    .Attr("root: int = 0")
    .Attr("key: string = ''")
    .Attr("agreement: string = ''")
    .Attr("process_set: int = 0")
    .SetIsStateful()
    .SetShapeFn(SameShapesAsInputs)
    .Doc("Every rank receives rank `root`'s tensors (`agreement`: as SmbAllReduce's).");

// Gathering on the box's sum (tf_smb.horovod's allgather, alltoall and its
// Min, Max and Product, which gather and then reduce locally): each rank
// places its rows of tensor i, at its own offset, in zeros; the sum over ranks
// then holds every rank's rows in rank order. counts[r, i] is rank r's
// number of rows (first dimension) of tensor i.
REGISTER_OP("SmbPlaceRows")
    .Input("tensors: T")
    .Input("counts: int64")
    .Output("placed: T")
    .Attr("T: list(type) >= 1")
    .Attr("rank: int >= 0")
    .SetShapeFn(AnyRowsShapes)
    .Doc(R"doc(
placed[i] has sum(counts[:, i]) rows: zeros, with tensors[i] (counts[rank, i]
rows) from row sum(counts[:rank, i]).
)doc");

REGISTER_OP("SmbTakeRows")
    .Input("tensors: T")
    .Input("counts: int64")
    .Output("rows: T")
    .Attr("T: list(type) >= 1")
    .Attr("rank: int >= 0")
    .SetShapeFn(AnyRowsShapes)
    .Doc("SmbPlaceRows' inverse: rank `rank`'s rows of each tensor (sum(counts[:, i]) rows).");

REGISTER_OP("SmbReceivedRows")
    .Input("total: T")
    .Input("matrix: int64")
    .Output("received: T")
    .Attr("T: type")
    .Attr("rank: int >= 0")
    .SetShapeFn(AnyRowsShapes)
    .Doc(R"doc(
An all-to-all on the box's sum (tf_smb.horovod's alltoall): matrix[r, j] rows go
from rank r to rank j, and `total` holds every rank's sent rows in rank order
(rank r's rows for rank j after its rows for ranks before j). Returns the rows
rank `rank` receives, in rank order of the senders.
)doc");

REGISTER_OP("SmbBarrier")
    .Attr("key: string = ''")
    .Attr("agreement: string = ''")
    .Attr("process_set: int = 0")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Returns once every rank has reached this barrier.");

REGISTER_OP("SmbJoin")
    .Output("last_rank: int32")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
Horovod's join: this rank has no more data. Until every rank of the job has
joined, it takes part in the others' all-reduces (adding zeros), broadcasts and
barriers; then returns the job rank that joined last. One node only.
)doc");

}  // namespace tensorflow

// ---- Asynchronous mode: parameters living in the box ----------------------

namespace tensorflow {

REGISTER_OP("SmbSegmentCreate")
    .Input("value: T")
    .Attr("T: {float, double, half, bfloat16, int32, int64}")
    .Attr("segment: string")
    .Attr("write: bool = false")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Creates (or attaches to) the box segment `segment` with value's dtype and shape;
with `write`, stores `value` in it. Attaching with another dtype or shape fails.
)doc");

REGISTER_OP("SmbSegmentRead")
    .Output("value: T")
    .Attr("T: {float, double, half, bfloat16, int32, int64}")
    .Attr("shape: shape")
    .Attr("segment: string")
    .Attr("consistent: bool = true")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ExplicitShape)
    .Doc(R"doc(
Reads segment `segment`. `consistent` (a seqlock per 256 KiB stripe) never
returns a half-written stripe; false reads without waiting for writers (hogwild).
)doc");

REGISTER_OP("SmbSegmentsPushRead")
    .Input("variables: N * resource")
    .Input("deltas: T")
    .Attr("N: int >= 1")
    .Attr("T: list({float, double, half, bfloat16, int32, int64}) >= 0")
    .Attr("segments: list(string)")
    .Attr("read: bool = true")
    .Attr("consistent: bool = true")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
One op for a step's box traffic over many variables (one op each cost more
than the copies of a model's small tensors). Variable i's segment is
`segments[i]`. The first len(T) segments take `deltas` (segment += delta, as
SmbSegmentPush); then, with `read`, every variable gets its segment's value,
a pushed one in the same pass as its push (each stripe's value right after
this push). Reads go straight into the variable's buffer, or into a new one
when a value read before still holds the old one (copy-on-write, as
TensorFlow's own updates). Each variable and delta must have its segment's
dtype and shape. `consistent` as in SmbSegmentRead (reads of pushed segments
are consistent either way).
)doc");

REGISTER_OP("SmbNodesOfRanks")
    .Output("nodes: int32")
    .SetIsStateful()
    .SetShapeFn(shape_inference::UnknownShape)
    .Doc(R"doc(
The node of each job rank (ranks sharing a box share a node, numbered as the
link numbers them), a vector of the job's size; all zeros on one node.
)doc");

REGISTER_OP("SmbSegmentHome")
    .Output("node: int32")
    .Attr("segment: string")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
The node whose box holds segment `segment`: 0 on one node; across nodes each
segment goes, in creation order, to the node holding the fewest segment bytes
(ties: the lowest node). -1 when this process did not create it.
)doc");

REGISTER_OP("SmbSegmentPush")
    .Input("delta: T")
    .Attr("T: {float, double, half, bfloat16, int32, int64}")
    .Attr("segment: string")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Adds `delta` to segment `segment` in the box, atomically per segment.");

REGISTER_OP("SmbSegmentApplySgd")
    .Input("grad: T")
    .Input("learning_rate: float")
    .Attr("T: {float, double, half, bfloat16}")
    .Attr("segment: string")
    .Attr("momentum: float = 0")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
The box applies an SGD step to segment `segment`: w -= learning_rate * grad, or
with momentum v = momentum * v - learning_rate * grad; w += v (v in the box).
)doc");

REGISTER_OP("SmbClockTick")
    .Output("gap: int64")
    .Attr("staleness: int = -1")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
Starts this worker's next step; waits while it is more than `staleness` steps
ahead of the slowest live worker (-1: never). Returns how far ahead it is.
)doc");

REGISTER_OP("SmbClockFinish")
    .Attr("finished: bool = true")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Marks this worker finished (no longer holding others back) or not.");

REGISTER_OP("SmbLeave")
    .Attr("raised: bool = false")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Marks this worker's program as ending (normally, or with an uncaught error):
a worker still waiting for it in a collective fails at once, saying so.
)doc");

REGISTER_OP("SmbWaitAllFinished")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Waits until every live worker has finished training.");

}  // namespace tensorflow

// ---- Timeline (cc/smb/timeline.h; tf_smb/timeline.py) ----------------------

namespace tensorflow {

REGISTER_OP("SmbTimelineRecord")
    .Input("names: string")
    .Input("starts_ns: int64")
    .Input("ends_ns: int64")
    .Input("args: int64")
    .Attr("track: string")
    .Attr("category: string")
    .Attr("arg_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Adds events (vectors of equal length; times from CLOCK_MONOTONIC, e.g. Python's
time.monotonic_ns()) of this process's rank to the timeline's track `track`,
when TF_SMB_TIMELINE was set as the process joined its job; else does nothing.
)doc");

REGISTER_OP("SmbTimelineFlush")
    .Output("written: string")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
Writes this process's timeline events so far (its part of the job's timeline,
or with one worker the timeline itself) and returns the file's path; "" while
the timeline is off.
)doc");

}  // namespace tensorflow
