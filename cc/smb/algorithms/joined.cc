#include "cc/smb/algorithms/joined.h"

#include <cstdlib>
#include <cstring>
#include <memory>

#include "cc/smb/algorithms/broadcast.h"
#include "cc/smb/algorithms/partitioned_allreduce.h"

namespace smb {
namespace {

// Outputs a joined rank discards.
class ScratchOutputs : public OpContext {
 public:
  Status AllocateOutputs(std::vector<TensorRef>* tensors) override {
    for (TensorRef& t : *tensors) {
      buffers_.emplace_back(NumBytes(t));
      t.out = buffers_.back().data();
    }
    return Status::Ok();
  }

 private:
  std::vector<std::vector<char>> buffers_;
};

Status ParseShape(const std::string& text, std::vector<int64_t>* shape) {
  // "[17,3]" or "[]"
  if (text.size() < 2 || text.front() != '[' || text.back() != ']') {
    return InvalidArgument("bad shape '" + text + "'");
  }
  size_t at = 1;
  while (at < text.size() - 1) {
    char* end = nullptr;
    const long long d = std::strtoll(text.c_str() + at, &end, 10);
    const size_t stop = static_cast<size_t>(end - text.c_str());
    if (stop == at || d < 0) return InvalidArgument("bad shape '" + text + "'");
    shape->push_back(d);
    at = text[stop] == ',' ? stop + 1 : stop;
  }
  return Status::Ok();
}

// The value of `name` in an agreement's "NAME\nfield=value;field=value;..."
// (Group::SetNextAgreement), or "".
std::string AgreementField(const std::string& agreement, const std::string& name) {
  const std::string marker = name + "=";
  size_t at = agreement.find('\n');
  while (at != std::string::npos) {
    ++at;
    if (agreement.compare(at, marker.size(), marker) == 0) {
      const size_t start = at + marker.size();
      const size_t stop = agreement.find_first_of(";\n", start);
      return agreement.substr(start, stop == std::string::npos ? std::string::npos : stop - start);
    }
    at = agreement.find_first_of(";\n", at);
  }
  return "";
}

}  // namespace

Status ParseDescription(const std::string& desc, std::string* op,
                        std::vector<TensorRef>* tensors) {
  tensors->clear();
  const size_t of = desc.rfind(" of ");
  if (of == std::string::npos) {
    *op = desc;  // "barrier"
    return Status::Ok();
  }
  *op = desc.substr(0, of);
  const size_t colon = desc.find(':', of);
  if (colon == std::string::npos) return InvalidArgument("no tensors in '" + desc + "'");
  size_t at = colon + 1;
  while (at < desc.size()) {
    if (desc[at] == ' ') {
      ++at;
      continue;
    }
    size_t stop = desc.find(' ', at);
    if (stop == std::string::npos) stop = desc.size();
    const std::string item = desc.substr(at, stop - at);
    const size_t bracket = item.find('[');
    if (bracket == std::string::npos) return InvalidArgument("bad tensor '" + item + "'");
    TensorRef t{DType::kFloat32, {}, nullptr, nullptr};
    SMB_RETURN_IF_ERROR(ParseDType(item.substr(0, bracket), &t.dtype));
    SMB_RETURN_IF_ERROR(ParseShape(item.substr(bracket), &t.shape));
    tensors->push_back(std::move(t));
    at = stop;
  }
  return Status::Ok();
}

namespace {

// What a joined rank takes part in, read from the description it got.
struct JoinedCollective {
  std::string agreement, desc, op;
  std::vector<TensorRef> tensors;  // `in` and `out` null
  int root = -1;                   // a broadcast's
};

// Reads `text` (a description after its agreement's lines); not OK, with
// the reason, when this rank cannot take part with zeros.
Status ReadJoinedCollective(const Group& group, const std::string& text, bool complete,
                            const std::string& who, JoinedCollective* c) {
  if (!complete) {
    // Very many tensors in one collective: their list does not fit the slot.
    return Status(Code::kInvalidArgument,
                  who + ", and the others' collective is too long to describe for it to take "
                        "part (" + text.substr(text.rfind('\n') + 1, 60) +
                      "...): 300-500 tensors fit; fuse fewer tensors per collective");
  }
  const size_t line = text.rfind('\n');
  c->agreement = line == std::string::npos ? "" : text.substr(0, line);
  c->desc = line == std::string::npos ? text : text.substr(line + 1);
  Status parsed = ParseDescription(c->desc, &c->op, &c->tensors);
  if (!parsed.ok()) {
    return Status(Code::kInternal, who + " and cannot read the collective it must take part "
                                         "in: " + parsed.message());
  }
  // Zeros leave sums alone, not minima, maxima or products (Horovod's ops
  // name theirs in the agreement's fields: "...;reduce op=Min;...").
  const std::string reduce_op = AgreementField(c->agreement, "reduce op");
  if (reduce_op == "Min" || reduce_op == "Max" || reduce_op == "Product") {
    return Status(Code::kInvalidArgument,
                  who + " and cannot take part in an all-reduce with op " + reduce_op +
                      ": a joined rank adds zeros, which only Sum and Average leave alone");
  }
  if (c->desc != "barrier" && Describe(c->op, c->tensors) != c->desc) {
    return Status(Code::kInternal, who + " and misread the collective it must take part in: '" +
                                       c->desc.substr(0, 80) + "'");
  }
  if (c->op.rfind("broadcast from rank ", 0) == 0) {
    c->root = std::atoi(c->op.c_str() + std::strlen("broadcast from rank "));
    if (c->root == group.job_rank()) {
      return Status(Code::kInvalidArgument,
                    who + ", so it has nothing to broadcast as the root of " + c->desc);
    }
  } else if (c->op != "allreduce" && c->op != "barrier") {
    return Status(Code::kInvalidArgument,
                  who + " and cannot take part in " + c->desc +
                      ": a joined rank takes part in all-reduces, broadcasts and barriers only");
  }
  return Status::Ok();
}

}  // namespace

Status ServeAsJoined(Group& group) {
  std::string text;
  bool complete = false;
  // No rank of this node trains: the description comes from another node.
  const bool learned = group.link() != nullptr && group.AllJoinedHere();
  if (learned) {
    SMB_RETURN_IF_ERROR(group.LearnAcrossNodes(&text, &complete));
  } else {
    SMB_RETURN_IF_ERROR(group.PeekNextDescription(&text, &complete));
  }
  const std::string who = "rank " + std::to_string(group.job_rank()) + " has joined (hvd.join)";
  JoinedCollective c;
  const Status ready = ReadJoinedCollective(group, text, complete, who, &c);
  if (learned) {
    // The training nodes hear whether this node takes part before any data
    // moves: a sum riding on the exchange would otherwise end without it.
    const Status answered = group.AnswerAcrossNodes(ready);
    if (ready.ok() && !answered.ok()) return answered;
  }
  if (!ready.ok()) return group.Fail(ready);
  // Zeros in, scratch out: what this rank adds to a sum is nothing.
  std::vector<std::vector<char>> zeros;
  for (TensorRef& t : c.tensors) {
    zeros.emplace_back(NumBytes(t), 0);
    t.in = zeros.back().data();
  }
  group.SetNextAgreement(c.agreement);
  if (c.op == "allreduce") {
    ScratchOutputs outputs;
    std::vector<void*> sums;
    std::shared_ptr<ResultHold> hold;  // released at once: nothing reads the sums here
    return AllReduceSumShared(group, c.tensors, &outputs, &sums, &hold);
  }
  if (c.op == "barrier") return group.Agree("barrier", "barrier");
  ScratchOutputs outputs;
  SMB_RETURN_IF_ERROR(outputs.AllocateOutputs(&c.tensors));
  return Broadcast(group, c.root, c.tensors);
}

}  // namespace smb
