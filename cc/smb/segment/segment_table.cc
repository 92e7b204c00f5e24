#include "cc/smb/segment/segment_table.h"

#include <algorithm>

#include "cc/smb/tensor.h"

namespace smb {
namespace {

size_t Bytes(DType dtype, const std::vector<int64_t>& shape) {
  size_t n = DTypeSize(dtype);
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

std::string Describe(DType dtype, const std::vector<int64_t>& shape) {
  return std::string(DTypeName(dtype)) + ShapeString(shape);
}

}  // namespace

SegmentTable::SegmentTable(std::shared_ptr<Peers> peers, NodeLink* link)
    : peers_(std::move(peers)), link_(link), node_bytes_(link ? link->nodes() : 1, 0) {}

Status SegmentTable::Create(const std::string& name, DType dtype,
                            const std::vector<int64_t>& shape, const void* value,
                            double timeout_s) {
  int home = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = placed_.find(name);
    if (it != placed_.end()) {
      home = it->second.home;
    } else {
      home = static_cast<int>(std::min_element(node_bytes_.begin(), node_bytes_.end()) -
                              node_bytes_.begin());
      node_bytes_[home] += Bytes(dtype, shape);
      placed_[name] = {home, dtype, shape};
    }
  }
  if (link_ == nullptr || home == link_->node()) {
    Segment segment;
    SMB_RETURN_IF_ERROR(Local(name, dtype, shape, &segment));
    return value == nullptr ? Status::Ok() : AssignSegment(segment, value);
  }
  if (value == nullptr) return Status::Ok();  // the writer creates it at home
  SegmentRequest request;
  request.kind = SegmentRequest::Kind::kCreate;
  request.name = name;
  request.dtype = dtype;
  request.shape = shape;
  request.write = true;
  return link_->CallSegmentServer(home, request, value, Bytes(dtype, shape), nullptr, 0,
                                  timeout_s);
}

Status SegmentTable::Read(const std::string& name, DType dtype,
                          const std::vector<int64_t>& shape, ReadMode mode, void* dst,
                          double timeout_s) {
  int home = 0;
  SMB_RETURN_IF_ERROR(Placed(name, dtype, shape, &home));
  if (link_ == nullptr || home == link_->node()) {
    Segment segment;
    SMB_RETURN_IF_ERROR(Local(name, dtype, shape, &segment));
    return ReadSegment(segment, dst, mode);
  }
  SegmentRequest request;
  request.kind = SegmentRequest::Kind::kRead;
  request.name = name;
  request.dtype = dtype;
  request.shape = shape;
  request.consistent = mode == ReadMode::kConsistent;
  return link_->CallSegmentServer(home, request, nullptr, 0, dst, Bytes(dtype, shape), timeout_s);
}

Status SegmentTable::Update(const std::string& name, DType dtype,
                            const std::vector<int64_t>& shape, const UpdateOptions& options,
                            const void* update, double learning_rate, double timeout_s) {
  int home = 0;
  SMB_RETURN_IF_ERROR(Placed(name, dtype, shape, &home));
  if (link_ == nullptr || home == link_->node()) {
    Segment segment;
    SMB_RETURN_IF_ERROR(Local(name, dtype, shape, &segment));
    return UpdateLocal(name, segment, options, update, learning_rate);
  }
  SegmentRequest request;
  request.kind = SegmentRequest::Kind::kUpdate;
  request.name = name;
  request.dtype = dtype;
  request.shape = shape;
  request.rule = static_cast<int32_t>(options.rule);
  request.momentum = options.momentum;
  request.learning_rate = learning_rate;
  return link_->CallSegmentServer(home, request, update, Bytes(dtype, shape), nullptr, 0,
                                  timeout_s);
}

int SegmentTable::Home(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = placed_.find(name);
  return it == placed_.end() ? -1 : it->second.home;
}

Status SegmentTable::Serve(const SegmentRequest& request, const void* payload,
                           size_t payload_bytes, std::vector<char>* reply) {
  if (!IsValidDType(static_cast<int32_t>(request.dtype))) {
    return InvalidArgument("a segment request with dtype code " +
                           std::to_string(static_cast<int32_t>(request.dtype)));
  }
  const size_t bytes = Bytes(request.dtype, request.shape);
  Segment segment;
  switch (request.kind) {
    case SegmentRequest::Kind::kCreate:
      SMB_RETURN_IF_ERROR(Local(request.name, request.dtype, request.shape, &segment));
      if (!request.write) return Status::Ok();
      if (payload_bytes != bytes) break;
      return AssignSegment(segment, payload);
    case SegmentRequest::Kind::kRead:
      SMB_RETURN_IF_ERROR(Local(request.name, request.dtype, request.shape, &segment));
      reply->resize(bytes);
      return ReadSegment(segment, reply->data(),
                         request.consistent ? ReadMode::kConsistent : ReadMode::kHogwild);
    case SegmentRequest::Kind::kUpdate: {
      SMB_RETURN_IF_ERROR(Local(request.name, request.dtype, request.shape, &segment));
      if (payload_bytes != bytes) break;
      UpdateOptions options;
      options.rule = static_cast<UpdateRule>(request.rule);
      options.momentum = request.momentum;
      return UpdateLocal(request.name, segment, options, payload, request.learning_rate);
    }
    default:
      return InvalidArgument("an unknown segment request kind " +
                             std::to_string(static_cast<int32_t>(request.kind)));
  }
  return InvalidArgument("a segment request for '" + request.name + "' " +
                         Describe(request.dtype, request.shape) + " carried " +
                         std::to_string(payload_bytes) + " bytes, expected " +
                         std::to_string(bytes));
}

Status SegmentTable::Placed(const std::string& name, DType dtype,
                            const std::vector<int64_t>& shape, int* home) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = placed_.find(name);
  if (it == placed_.end()) {
    return Status(Code::kNotFound,
                  "no box segment '" + name + "' in this process; create it first");
  }
  const Placement& p = it->second;
  if (p.dtype != dtype || p.shape != shape) {
    return InvalidArgument("box segment '" + name + "' holds " + Describe(p.dtype, p.shape) +
                           ", got " + Describe(dtype, shape));
  }
  *home = p.home;
  return Status::Ok();
}

Status SegmentTable::Local(const std::string& name, DType dtype,
                           const std::vector<int64_t>& shape, Segment* out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = local_.find(name);
  if (it != local_.end()) {
    if (it->second.dtype != dtype || it->second.shape != shape) {
      return InvalidArgument("box segment '" + name + "' holds " +
                             Describe(it->second.dtype, it->second.shape) + ", got " +
                             Describe(dtype, shape));
    }
    *out = it->second;
    return Status::Ok();
  }
  Box* box = peers_->box();
  uint64_t key = 0;
  SMB_RETURN_IF_ERROR(box->CreateSegment(name, dtype, shape, &key));
  SMB_RETURN_IF_ERROR(box->AttachSegment(key, dtype, shape, out));
  local_[name] = *out;
  return Status::Ok();
}

Status SegmentTable::UpdateLocal(const std::string& name, const Segment& segment,
                                 const UpdateOptions& options, const void* update,
                                 double learning_rate) {
  Updater* updater = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string key = name + "|" + std::to_string(static_cast<int>(options.rule)) + "|" +
                            std::to_string(options.momentum);
    auto it = updaters_.find(key);
    if (it == updaters_.end()) {
      std::unique_ptr<Updater> made;
      SMB_RETURN_IF_ERROR(MakeUpdater(peers_->box(), name, segment, options, &made));
      it = updaters_.emplace(key, std::move(made)).first;
    }
    updater = it->second.get();
  }
  return updater->Apply(segment, update, learning_rate);
}

}  // namespace smb
