#include "cc/smb/segment/segment_table.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

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

// A request to a segment's home node about `name`; callers set the rest.
SegmentRequest Request(SegmentRequest::Kind kind, const std::string& name, DType dtype,
                       const std::vector<int64_t>& shape) {
  SegmentRequest request;
  request.kind = kind;
  request.name = name;
  request.dtype = dtype;
  request.shape = shape;
  return request;
}

}  // namespace

SegmentTable::SegmentTable(std::shared_ptr<Peers> peers, NodeLink* link)
    : peers_(std::move(peers)),
      link_(link),
      node_bytes_(link ? link->nodes() : 1, 0),
      moved_from_(link ? link->nodes() : 1, false) {
  const char* combine = std::getenv("TF_SMB_COMBINE_PUSHES");
  // A node's ranks are bits of one 64-bit word (NodeCombiner).
  if (link_ != nullptr && peers_->box() != nullptr && peers_->world() < 63 &&
      !(combine != nullptr && std::string(combine) == "0")) {
    combiner_ = std::make_unique<NodeCombiner>(
        peers_, [this](const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                       const void* delta, void* fresh, double timeout_s) {
          return PushAndFetch(name, dtype, shape, delta, fresh, timeout_s);
        });
    combining_ = true;
  }
}

Status SegmentTable::Create(const std::string& name, DType dtype,
                            const std::vector<int64_t>& shape, const void* value, bool write,
                            double timeout_s) {
  if (link_ != nullptr) link_->KeepGoingWithoutLostRanks();  // see the top
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = placed_.find(name);
    if (it == placed_.end()) {
      const int home = static_cast<int>(
          std::min_element(node_bytes_.begin(), node_bytes_.end()) - node_bytes_.begin());
      node_bytes_[home] += Bytes(dtype, shape);
      placed_[name] = {home, dtype, shape};
      order_.push_back(name);
      if (Remote(home) && value != nullptr) KeepCopy(name, value, Bytes(dtype, shape));
    }
  }
  const bool writes = write && value != nullptr;
  return AtHome(
      name, dtype, shape, timeout_s,
      [&](const Segment& segment) {
        return writes ? AssignSegment(segment, value) : Status::Ok();
      },
      [&](int home) {
        if (!writes) return Status::Ok();  // the writer creates it at home
        SegmentRequest request = Request(SegmentRequest::Kind::kCreate, name, dtype, shape);
        request.write = true;
        return link_->CallSegmentServer(home, request, value, Bytes(dtype, shape), nullptr, 0,
                                        timeout_s);
      });
}

Status SegmentTable::Read(const std::string& name, DType dtype,
                          const std::vector<int64_t>& shape, ReadMode mode, void* dst,
                          double timeout_s, bool bulk) {
  int home = -1;
  if (combining_) {
    SMB_RETURN_IF_ERROR(CurrentHome(name, dtype, shape, timeout_s, &home));
    bool taken = false;
    if (Remote(home)) {
      SMB_RETURN_IF_ERROR(combiner_->Read(name, dtype, shape, mode, dst, timeout_s, &taken));
    }
    if (taken) return Status::Ok();
  }
  return AtHome(
      name, dtype, shape, timeout_s,
      [&](const Segment& segment) { return ReadSegment(segment, dst, mode, bulk); },
      [&](int home) {
        SegmentRequest request = Request(SegmentRequest::Kind::kRead, name, dtype, shape);
        request.consistent = mode == ReadMode::kConsistent;
        const size_t bytes = Bytes(dtype, shape);
        Status read = link_->CallSegmentServer(home, request, nullptr, 0, dst, bytes, timeout_s);
        if (read.ok()) {
          std::lock_guard<std::mutex> lock(mu_);
          KeepCopy(name, dst, bytes);
        }
        return read;
      },
      home);
}

Status SegmentTable::Update(const std::string& name, DType dtype,
                            const std::vector<int64_t>& shape, const UpdateOptions& options,
                            const void* update, double learning_rate, double timeout_s,
                            void* read_back, bool bulk) {
  int home = -1;
  if (combining_ && NodeCombiner::Combines(options)) {
    SMB_RETURN_IF_ERROR(CurrentHome(name, dtype, shape, timeout_s, &home));
    if (Remote(home)) {
      SMB_RETURN_IF_ERROR(
          combiner_->Push(name, dtype, shape, options, update, learning_rate, timeout_s));
      if (read_back == nullptr) return Status::Ok();
      return Read(name, dtype, shape, ReadMode::kConsistent, read_back, timeout_s, bulk);
    }
  }
  bool pushed_remotely = false;
  Status updated = AtHome(
      name, dtype, shape, timeout_s,
      [&](const Segment& segment) {
        return UpdateLocal(name, segment, options, update, learning_rate, read_back, bulk);
      },
      [&](int home) {
        SegmentRequest request = Request(SegmentRequest::Kind::kUpdate, name, dtype, shape);
        request.rule = static_cast<int32_t>(options.rule);
        request.momentum = options.momentum;
        request.learning_rate = learning_rate;
        Status pushed = link_->CallSegmentServer(home, request, update, Bytes(dtype, shape),
                                                 nullptr, 0, timeout_s);
        pushed_remotely = pushed.ok();
        return pushed;
      },
      home);
  if (updated.ok() && pushed_remotely && read_back != nullptr) {
    // A second call, never retried with the push: other ranks' pushes may land
    // in between, as they may between any push and read.
    return Read(name, dtype, shape, ReadMode::kConsistent, read_back, timeout_s, bulk);
  }
  return updated;
}

Status SegmentTable::PushAndFetch(const std::string& name, DType dtype,
                                  const std::vector<int64_t>& shape, const void* delta,
                                  void* fresh, double timeout_s) {
  return AtHome(
      name, dtype, shape, timeout_s,
      [&](const Segment& segment) {  // its home moved here from a lost node
        return UpdateLocal(name, segment, {UpdateRule::kDelta}, delta, 0.0, fresh);
      },
      [&](int home) {
        SegmentRequest request = Request(SegmentRequest::Kind::kUpdate, name, dtype, shape);
        request.rule = static_cast<int32_t>(UpdateRule::kDelta);
        request.read_back = true;
        // No KeepCopy: the node's copy (NodeCombiner::LastFetched) holds `fresh`.
        const size_t bytes = Bytes(dtype, shape);
        return link_->CallSegmentServer(home, request, delta, bytes, fresh, bytes, timeout_s);
      });
}

Status SegmentTable::FlushCombined(double timeout_s) {
  return combiner_ == nullptr ? Status::Ok() : combiner_->FlushAll(timeout_s);
}

Status SegmentTable::StopCombining(double timeout_s) {
  if (!combining_.exchange(false)) return Status::Ok();
  return combiner_->FlushAll(timeout_s);
}

void SegmentTable::ForgetCombinedReads() {
  if (combiner_ != nullptr) combiner_->ForgetReads();
}

bool SegmentTable::RetryAfterLoss(const Status& call, int attempt) const {
  // A call whose server was lost ends with kAborted while the job runs on:
  // the next attempt goes to another rank of that node, or to the segment's
  // new home once the whole node is lost.
  return !call.ok() && call.code() == Code::kAborted && attempt < kMaxAttempts &&
         link_->Failure().ok();
}

int SegmentTable::Home(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = placed_.find(name);
  return it == placed_.end() ? -1 : it->second.home;
}

Status SegmentTable::CurrentHome(const std::string& name, DType dtype,
                                 const std::vector<int64_t>& shape, double timeout_s,
                                 int* home) {
  SMB_RETURN_IF_ERROR(Placed(name, dtype, shape, home));
  if (!Remote(*home) || !link_->NodeLost(*home)) return Status::Ok();
  SMB_RETURN_IF_ERROR(MoveFromLostNodes(timeout_s));
  return Placed(name, dtype, shape, home);
}

Status SegmentTable::MoveFromLostNodes(double timeout_s) {
  std::lock_guard<std::mutex> moving(move_mu_);
  const int nodes = link_->nodes();
  std::vector<bool> lost(nodes, false);
  bool news = false;
  for (int n = 0; n < nodes; ++n) {
    lost[n] = link_->NodeLost(n);
    news = news || (lost[n] && !moved_from_[n]);
  }
  if (!news) return Status::Ok();  // another thread moved them
  struct Move {
    std::string name;
    Placement placement;
    std::vector<char> value;
  };
  std::vector<Move> moves;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& name : order_) {
      Placement& p = placed_[name];
      if (!lost[p.home]) continue;
      // The next live node after the home, in node order: every rank gets
      // the same answer, however the losses it saw were grouped.
      int to = p.home;
      do to = (to + 1) % nodes; while (lost[to]);
      node_bytes_[p.home] -= Bytes(p.dtype, p.shape);
      node_bytes_[to] += Bytes(p.dtype, p.shape);
      p.home = to;
      Move move{name, p, {}};
      // The value the node's last combined push fetched is as fresh as any
      // this rank read. (Not the node's copy, which also holds the sum of a
      // push in flight: its retry, at the new home, adds that sum.)
      std::vector<char> fetched;
      if (combiner_ != nullptr && combiner_->LastFetched(name, &fetched)) {
        KeepCopy(name, fetched.data(), fetched.size());
      }
      auto copy = copies_.find(name);
      if (copy == copies_.end()) {
        return Internal("rank " + std::to_string(link_->job_rank()) +
                        " kept no copy of segment '" + name + "' to move it from a lost node");
      }
      if (Remote(to)) {
        move.value = copy->second;
      } else {
        move.value.swap(copy->second);  // at home now: no copy to keep
        copies_.erase(copy);
      }
      moves.push_back(std::move(move));
    }
  }
  std::string from, to, names;
  for (int n = 0; n < nodes; ++n) {
    if (lost[n] && !moved_from_[n]) from += (from.empty() ? "" : ", ") + std::to_string(n);
    moved_from_[n] = lost[n];
  }
  std::vector<bool> target(nodes, false);
  for (size_t i = 0; i < moves.size(); ++i) {
    const Move& m = moves[i];
    target[m.placement.home] = true;
    if (i < 5) names += (i ? ", '" : "'") + m.name + "'";
    // The first rank to arrive creates it from its copy; the others find it.
    if (!Remote(m.placement.home)) {
      Segment segment;
      SMB_RETURN_IF_ERROR(Local(m.name, m.placement.dtype, m.placement.shape, &segment,
                                m.value.data()));
      continue;
    }
    SegmentRequest request = Request(SegmentRequest::Kind::kCreate, m.name, m.placement.dtype,
                                     m.placement.shape);
    request.write = false;
    SMB_RETURN_IF_ERROR(link_->CallSegmentServer(m.placement.home, request, m.value.data(),
                                                 m.value.size(), nullptr, 0, timeout_s));
  }
  for (int n = 0; n < nodes; ++n) {
    if (target[n]) to += (to.empty() ? "" : ", ") + std::to_string(n);
  }
  if (moves.size() > 5) names += " and " + std::to_string(moves.size() - 5) + " more";
  std::fprintf(stderr,
               "tf_smb: rank %d: node(s) %s lost, with its box: its %zu segment(s) (%s) live on "
               "node(s) %s now, restarted from the values rank %d last read; the updates they "
               "took in since then are lost\n",
               link_->job_rank(), from.c_str(), moves.size(), names.c_str(),
               to.empty() ? "-" : to.c_str(), link_->job_rank());
  return Status::Ok();
}

void SegmentTable::KeepCopy(const std::string& name, const void* value, size_t bytes) {
  std::vector<char>& copy = copies_[name];
  copy.resize(bytes);
  if (bytes != 0) std::memcpy(copy.data(), value, bytes);
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
      if (payload_bytes != 0 && payload_bytes != bytes) break;
      if (request.write) {
        if (payload_bytes != bytes) break;
        SMB_RETURN_IF_ERROR(Local(request.name, request.dtype, request.shape, &segment));
        return AssignSegment(segment, payload);
      }
      // Created from the payload unless it exists (a segment moved from a lost node).
      return Local(request.name, request.dtype, request.shape, &segment,
                   payload_bytes != 0 ? payload : nullptr);
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
      if (request.read_back) reply->resize(bytes);
      return UpdateLocal(request.name, segment, options, payload, request.learning_rate,
                         request.read_back ? reply->data() : nullptr);
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
                           const std::vector<int64_t>& shape, Segment* out,
                           const void* initial) {
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
  SMB_RETURN_IF_ERROR(box->CreateSegment(name, dtype, shape, &key, initial));
  SMB_RETURN_IF_ERROR(box->AttachSegment(key, dtype, shape, out));
  local_[name] = *out;
  return Status::Ok();
}

Status SegmentTable::UpdateLocal(const std::string& name, const Segment& segment,
                                 const UpdateOptions& options, const void* update,
                                 double learning_rate, void* read_back, bool bulk) {
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
  return updater->Apply(segment, update, learning_rate, read_back, bulk);
}

}  // namespace smb
