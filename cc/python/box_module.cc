// tf_smb._box: the box core for Python without TensorFlow. The launcher uses
// it to create and remove a job's box; tests use it to check the core alone.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cc/smb/box.h"
#include "cc/smb/communicator.h"
#include "cc/smb/segment/segment_io.h"
#include "cc/smb/segment/updaters.h"

namespace py = pybind11;

namespace {

void ThrowIfError(const smb::Status& s) {
  if (s.ok()) return;
  switch (s.code()) {
    case smb::Code::kInvalidArgument: throw py::value_error(s.ToString());
    case smb::Code::kNotFound: throw py::key_error(s.ToString());
    default: break;
  }
  if (s.code() == smb::Code::kDeadlineExceeded) {
    PyErr_SetString(PyExc_TimeoutError, s.ToString().c_str());
    throw py::error_already_set();
  }
  throw std::runtime_error(s.ToString());
}

smb::DType DTypeOf(const py::array& a) {
  smb::DType dtype;
  // numpy names bfloat16 (from ml_dtypes) "bfloat16"; the others match ours.
  ThrowIfError(smb::ParseDType(py::str(a.dtype().attr("name")), &dtype));
  return dtype;
}

std::vector<int64_t> ShapeOf(const py::array& a) {
  return std::vector<int64_t>(a.shape(), a.shape() + a.ndim());
}

// Builds refs and fresh outputs for a list of arrays (made C-contiguous).
std::vector<smb::TensorRef> Refs(const std::vector<py::array>& inputs,
                                 std::vector<py::array>* outputs) {
  std::vector<smb::TensorRef> refs;
  for (const py::array& raw : inputs) {
    py::array a = py::array::ensure(raw, py::array::c_style);
    if (!a) throw py::value_error("expected arrays");
    py::array out(a.dtype(), std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()));
    refs.push_back({DTypeOf(a), ShapeOf(a), a.data(), out.mutable_data()});
    outputs->push_back(a);  // keep inputs alive alongside outputs
    outputs->push_back(out);
  }
  return refs;
}

// The pybind adapter's side of a collective (smb::OpContext): the inputs as
// C-contiguous arrays and their numpy outputs, made up front because numpy
// needs the GIL, which the collective runs without.
class NumpyOutputs : public smb::OpContext {
 public:
  explicit NumpyOutputs(const std::vector<py::array>& arrays) {
    for (const py::array& raw : arrays) {
      py::array a = py::array::ensure(raw, py::array::c_style);
      if (!a) throw py::value_error("expected arrays");
      inputs_.push_back(a);
      outputs_.emplace_back(a.dtype(), std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()));
      refs_.push_back({DTypeOf(a), ShapeOf(a), a.data(), nullptr});
      out_.push_back(outputs_.back().mutable_data());
    }
  }
  const std::vector<smb::TensorRef>& refs() const { return refs_; }
  smb::Status AllocateOutputs(std::vector<smb::TensorRef>* refs) override {
    for (size_t i = 0; i < refs->size(); ++i) (*refs)[i].out = out_[i];
    return smb::Status::Ok();
  }
  // Copies sums the core kept in the box into the outputs.
  void CopyFrom(const std::vector<void*>& sums) {
    for (size_t i = 0; i < refs_.size(); ++i) {
      std::memcpy(out_[i], sums[i], smb::NumBytes(refs_[i]));
    }
  }
  const std::vector<py::array>& arrays() const { return outputs_; }

 private:
  std::vector<py::array> inputs_;
  std::vector<py::array> outputs_;
  std::vector<smb::TensorRef> refs_;
  std::vector<void*> out_;
};

std::vector<py::array> EveryOther(const std::vector<py::array>& v) {
  std::vector<py::array> out;
  for (size_t i = 1; i < v.size(); i += 2) out.push_back(v[i]);
  return out;
}

// The segment `key` checked against an array's dtype and shape.
smb::Segment SegmentFor(smb::Communicator& c, uint64_t key, const py::array& a) {
  if (c.box() == nullptr) throw py::value_error("no box with world size 1");
  smb::Segment seg;
  ThrowIfError(c.box()->AttachSegment(key, DTypeOf(a), ShapeOf(a), &seg));
  return seg;
}

template <typename Fn>
void WithoutGil(Fn fn) {
  smb::Status s;
  {
    py::gil_scoped_release release;
    s = fn();
  }
  ThrowIfError(s);
}

// Applies one push to segment `key` with an updater of `options`' rule.
void ApplyUpdate(smb::Communicator& c, uint64_t key, const py::array& update,
                 const smb::UpdateOptions& options, double learning_rate) {
  py::array a = py::array::ensure(update, py::array::c_style);
  smb::Segment seg = SegmentFor(c, key, a);
  std::unique_ptr<smb::Updater> updater;
  ThrowIfError(smb::MakeUpdater(c.box(), "key " + std::to_string(key), seg, options, &updater));
  const void* src = a.data();
  WithoutGil([&] { return updater->Apply(seg, src, learning_rate, nullptr, false); });
}

class BoxHandle {
 public:
  explicit BoxHandle(std::unique_ptr<smb::Box> box) : box_(std::move(box)) {}
  std::string name() const { return box_->name(); }
  void unlink() { box_->Unlink(); }
  void close() { box_.reset(); }
 private:
  std::unique_ptr<smb::Box> box_;
};

}  // namespace

PYBIND11_MODULE(_box, m) {
  m.doc() = "The Soft Memory Box core (no TensorFlow): boxes and collectives.";
  // The job defaults (cc/smb/defaults.h), for the Python package and launcher.
  m.attr("DEFAULT_TIMEOUT_S") = smb::kDefaultTimeoutS;
  m.attr("DEFAULT_STAGING_BYTES") = smb::kDefaultStagingBytes;
  m.attr("DEFAULT_HEAP_BYTES") = smb::kDefaultHeapBytes;
  m.attr("STRIPE_BYTES") = smb::kStripeBytes;

  m.def("shm_name", &smb::Box::ShmName, py::arg("job_id"),
        "Name of the job's shared-memory region.");
  m.def("reclaim_stale", &smb::Box::ReclaimStale,
        "Removes this user's boxes whose processes are all gone; returns the count.");
  m.def(
      "create_box",
      [](const std::string& job_id, int world, size_t staging_bytes,
         size_t heap_bytes) {
        smb::Box::Options o;
        o.job_id = job_id;
        o.world = world;
        o.staging_bytes = staging_bytes;
        o.heap_bytes = heap_bytes;
        std::unique_ptr<smb::Box> box;
        ThrowIfError(smb::Box::Create(o, &box));
        return std::make_unique<BoxHandle>(std::move(box));
      },
      py::arg("job_id"), py::arg("world"), py::arg("staging_bytes") = smb::kDefaultStagingBytes,
      py::arg("heap_bytes") = smb::kDefaultHeapBytes,
      "Creates a job's box (mode 0600); it is removed when the last user closes.");

  py::class_<BoxHandle>(m, "Box")
      .def_property_readonly("name", &BoxHandle::name)
      .def("unlink", &BoxHandle::unlink, "Removes the box's name now.")
      .def("close", &BoxHandle::close, "Unmaps the box.");

  py::class_<smb::Communicator>(m, "Communicator")
      .def(py::init([](const std::string& job_id, int rank, int world,
                       double timeout_s, bool create, size_t staging_bytes,
                       size_t heap_bytes) {
             smb::Communicator::Options o;
             o.job_id = job_id;
             o.rank = rank;
             o.world = world;
             o.timeout_s = timeout_s;
             o.create = create;
             o.staging_bytes = staging_bytes;
             o.heap_bytes = heap_bytes;
             std::unique_ptr<smb::Communicator> comm;
             smb::Status s;
             {
               py::gil_scoped_release release;
               s = smb::Communicator::Open(o, &comm);
             }
             ThrowIfError(s);
             return comm;
           }),
           py::arg("job_id"), py::arg("rank"), py::arg("world"),
           py::arg("timeout_s") = smb::kDefaultTimeoutS, py::arg("create") = false,
           py::arg("staging_bytes") = smb::kDefaultStagingBytes,
           py::arg("heap_bytes") = smb::kDefaultHeapBytes)
      .def_property_readonly("rank", &smb::Communicator::rank)
      .def_property_readonly("world", &smb::Communicator::world)
      .def("allreduce",
           [](smb::Communicator& c, const std::vector<py::array>& arrays) {
             NumpyOutputs outputs(arrays);
             std::vector<void*> sums;
             std::shared_ptr<smb::ResultHold> hold;
             smb::Status s;
             {
               py::gil_scoped_release release;
               s = c.AllReduceSumShared(outputs.refs(), &outputs, &sums, &hold);
             }
             ThrowIfError(s);
             if (hold != nullptr) outputs.CopyFrom(sums);  // sums kept in the box
             return outputs.arrays();
           },
           "Sum of each array over all ranks, fused in one collective.")
      .def("broadcast",
           [](smb::Communicator& c, const std::vector<py::array>& arrays,
              int root) {
             std::vector<py::array> keep;
             auto refs = Refs(arrays, &keep);
             smb::Status s;
             {
               py::gil_scoped_release release;
               s = c.Broadcast(root, refs);
             }
             ThrowIfError(s);
             return EveryOther(keep);
           },
           py::arg("arrays"), py::arg("root") = 0)
      .def("barrier",
           [](smb::Communicator& c) {
             smb::Status s;
             {
               py::gil_scoped_release release;
               s = c.Barrier();
             }
             ThrowIfError(s);
           })
      .def("create_segment",
           [](smb::Communicator& c, const std::string& name,
              const std::string& dtype_name, const std::vector<int64_t>& shape) {
             if (c.box() == nullptr) throw py::value_error("no box with world size 1");
             smb::DType dtype;
             ThrowIfError(smb::ParseDType(dtype_name, &dtype));
             uint64_t key = 0;
             ThrowIfError(c.box()->CreateSegment(name, dtype, shape, &key));
             return key;
           })
      .def("lookup_segment",
           [](smb::Communicator& c, const std::string& name) {
             if (c.box() == nullptr) throw py::value_error("no box with world size 1");
             uint64_t key = 0;
             ThrowIfError(c.box()->LookupSegment(name, &key));
             return key;
           })
      .def("attach_segment",
           [](py::object self, uint64_t key, const std::string& dtype_name,
              const std::vector<int64_t>& shape) {
             auto& c = self.cast<smb::Communicator&>();
             if (c.box() == nullptr) throw py::value_error("no box with world size 1");
             smb::DType dtype;
             ThrowIfError(smb::ParseDType(dtype_name, &dtype));
             smb::Segment seg;
             ThrowIfError(c.box()->AttachSegment(key, dtype, shape, &seg));
             py::object np_dtype = py::module_::import("numpy").attr("dtype");
             py::dtype dt = dtype == smb::DType::kBFloat16
                                ? py::dtype::from_args(
                                      py::module_::import("ml_dtypes").attr("bfloat16"))
                                : py::dtype::from_args(np_dtype(dtype_name));
             // A view into the box; `self` keeps the mapping alive.
             return py::array(dt, std::vector<py::ssize_t>(shape.begin(), shape.end()),
                              seg.data, self);
           },
           "A numpy view of a segment, checked against the dtype and shape given.")
      .def("read",
           [](smb::Communicator& c, uint64_t key, py::array out, bool consistent) {
             py::array a = py::array::ensure(out, py::array::c_style);
             smb::Segment seg = SegmentFor(c, key, a);
             void* dst = a.mutable_data();
             WithoutGil([&] {
               return smb::ReadSegment(seg, dst, consistent ? smb::ReadMode::kConsistent
                                                            : smb::ReadMode::kHogwild);
             });
             return a;
           },
           py::arg("key"), py::arg("out"), py::arg("consistent") = true,
           "Reads segment `key` into `out` (same dtype and shape).")
      .def("assign",
           [](smb::Communicator& c, uint64_t key, py::array value) {
             py::array a = py::array::ensure(value, py::array::c_style);
             smb::Segment seg = SegmentFor(c, key, a);
             const void* src = a.data();
             WithoutGil([&] { return smb::AssignSegment(seg, src); });
           })
      .def("accumulate",
           [](smb::Communicator& c, uint64_t key, py::array delta) {
             ApplyUpdate(c, key, delta, {smb::UpdateRule::kDelta}, 0.0);
           },
           "segment += delta, atomically per segment.")
      .def("axpy",
           [](smb::Communicator& c, uint64_t key, double alpha, py::array x) {
             // An SGD step with learning rate -alpha is segment += alpha * x.
             ApplyUpdate(c, key, x, {smb::UpdateRule::kSgd}, -alpha);
           },
           "segment += alpha * x, atomically per segment.")
      .def("clock_tick",
           [](smb::Communicator& c, int64_t staleness) {
             int64_t gap = 0;
             WithoutGil([&] { return c.clock().Tick(staleness, &gap); });
             return gap;
           },
           py::arg("staleness") = -1)
      .def("clock_finish", [](smb::Communicator& c) { c.clock().Finish(); })
      .def("clocks",
           [](smb::Communicator& c) {
             std::vector<uint64_t> clocks;
             if (c.world() == 1) return clocks;
             for (int r = 0; r < c.world(); ++r) clocks.push_back(c.clock().Steps(r));
             return clocks;
           },
           "Every rank's step clock, read straight from the box.")
      .def("wait_all_finished", [](smb::Communicator& c) {
        WithoutGil([&] { return c.clock().WaitAllFinished(); });
      });
}
