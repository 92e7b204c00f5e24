#include "cc/smb/link/segment_wire.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace smb {
namespace {

struct WireRequest {
  uint64_t id;
  int32_t kind, dtype, num_dims, rule;
  uint32_t write, consistent, read_back, unused;
  double learning_rate, momentum;
  int64_t dims[8];
  char name[128];
};

struct WireReply {
  uint64_t id;
  int32_t code;
  uint32_t message_len;
  char message[496];
};

}  // namespace

Status EncodeSegmentRequest(uint64_t id, const SegmentRequest& request, const void* payload,
                            size_t payload_bytes, std::vector<char>* out) {
  WireRequest wire{};
  if (request.name.size() >= sizeof wire.name || request.shape.size() > 8) {
    return InvalidArgument("segment name or shape too long for a remote call: '" +
                           request.name + "'");
  }
  wire.id = id;
  wire.kind = static_cast<int32_t>(request.kind);
  wire.dtype = static_cast<int32_t>(request.dtype);
  wire.num_dims = static_cast<int32_t>(request.shape.size());
  for (size_t i = 0; i < request.shape.size(); ++i) wire.dims[i] = request.shape[i];
  wire.rule = request.rule;
  wire.write = request.write;
  wire.consistent = request.consistent;
  wire.read_back = request.read_back;
  wire.learning_rate = request.learning_rate;
  wire.momentum = request.momentum;
  std::memcpy(wire.name, request.name.data(), request.name.size());
  out->resize(sizeof wire + payload_bytes);
  std::memcpy(out->data(), &wire, sizeof wire);
  if (payload_bytes) std::memcpy(out->data() + sizeof wire, payload, payload_bytes);
  return Status::Ok();
}

bool DecodeSegmentRequest(const std::vector<char>& message, uint64_t* id,
                          SegmentRequest* request, const char** payload, size_t* payload_bytes) {
  WireRequest wire;
  if (message.size() < sizeof wire) return false;
  std::memcpy(&wire, message.data(), sizeof wire);
  *id = wire.id;
  request->kind = static_cast<SegmentRequest::Kind>(wire.kind);
  request->name.assign(wire.name, strnlen(wire.name, sizeof wire.name));
  request->dtype = static_cast<DType>(wire.dtype);
  request->shape.assign(wire.dims, wire.dims + std::min(8, std::max(0, wire.num_dims)));
  request->write = wire.write != 0;
  request->consistent = wire.consistent != 0;
  request->read_back = wire.read_back != 0;
  request->rule = wire.rule;
  request->learning_rate = wire.learning_rate;
  request->momentum = wire.momentum;
  *payload = message.data() + sizeof wire;
  *payload_bytes = message.size() - sizeof wire;
  return true;
}

std::vector<char> EncodeSegmentReply(uint64_t id, const Status& status,
                                     const std::vector<char>& data) {
  WireReply answer{};
  answer.id = id;
  answer.code = static_cast<int32_t>(status.code());
  const std::string& text = status.message();
  answer.message_len = static_cast<uint32_t>(std::min(text.size(), sizeof answer.message));
  std::memcpy(answer.message, text.data(), answer.message_len);
  std::vector<char> reply(sizeof answer + (status.ok() ? data.size() : 0));
  std::memcpy(reply.data(), &answer, sizeof answer);
  if (status.ok() && !data.empty()) {
    std::memcpy(reply.data() + sizeof answer, data.data(), data.size());
  }
  return reply;
}

bool DecodeSegmentReply(const std::vector<char>& message, uint64_t* id, Status* status,
                        const char** data, size_t* data_bytes) {
  WireReply answer;
  if (message.size() < sizeof answer) return false;
  std::memcpy(&answer, message.data(), sizeof answer);
  *id = answer.id;
  *status = answer.code == 0
                ? Status::Ok()
                : Status(static_cast<Code>(answer.code),
                         std::string(answer.message,
                                     std::min<size_t>(answer.message_len, sizeof answer.message)));
  *data = message.data() + sizeof answer;
  *data_bytes = message.size() - sizeof answer;
  return true;
}

}  // namespace smb
