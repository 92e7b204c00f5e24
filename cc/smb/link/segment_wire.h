// The memory server's calls on the wire (NodeLink::CallSegmentServer): a
// request is a fixed header and the payload (an update, an initial value);
// a reply is a fixed header (the call's status) and the data a read returns.
// Both sides run the same build, so headers travel as plain structs.
#ifndef TF_SMB_CC_SMB_LINK_SEGMENT_WIRE_H_
#define TF_SMB_CC_SMB_LINK_SEGMENT_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cc/smb/node_link.h"
#include "cc/smb/status.h"

namespace smb {

// Fails (InvalidArgument) for a name or shape the header cannot carry.
Status EncodeSegmentRequest(uint64_t id, const SegmentRequest& request, const void* payload,
                            size_t payload_bytes, std::vector<char>* out);
// False for a message too short to be a request.
bool DecodeSegmentRequest(const std::vector<char>& message, uint64_t* id,
                          SegmentRequest* request, const char** payload, size_t* payload_bytes);

// The reply carries `data` only when `status` is OK.
std::vector<char> EncodeSegmentReply(uint64_t id, const Status& status,
                                     const std::vector<char>& data);
// False for a message too short to be a reply.
bool DecodeSegmentReply(const std::vector<char>& message, uint64_t* id, Status* status,
                        const char** data, size_t* data_bytes);

}  // namespace smb

#endif  // TF_SMB_CC_SMB_LINK_SEGMENT_WIRE_H_
