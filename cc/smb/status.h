// Error values of the box core. Kept free of TensorFlow so the core builds and
// tests on its own; the TF layer maps Code onto tensorflow::error codes.
#ifndef TF_SMB_CC_SMB_STATUS_H_
#define TF_SMB_CC_SMB_STATUS_H_

#include <string>
#include <utility>

namespace smb {

enum class Code {
  kOk = 0,
  kInvalidArgument,    // bad input, or ranks disagree on what to do
  kDeadlineExceeded,   // a wait ran past its timeout
  kAborted,            // a peer died or the job was aborted
  kAlreadyExists,      // a box or segment name is taken
  kNotFound,
  kResourceExhausted,  // the box has no room left
  kInternal,           // a system call failed
  // Ranks disagree on a collective that asked for recoverable agreement
  // (Group::SetNextAgreement): it did not run on any rank, the job goes on.
  kFailedPrecondition,
};

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message)
      : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return Status(Code::kInvalidArgument, std::move(m));
}
inline Status Internal(std::string m) {
  return Status(Code::kInternal, std::move(m));
}

// Errno-carrying error for a failed system call.
Status SystemError(const std::string& what);

#define SMB_RETURN_IF_ERROR(expr)          \
  do {                                     \
    ::smb::Status _smb_status = (expr);    \
    if (!_smb_status.ok()) return _smb_status; \
  } while (0)

}  // namespace smb

#endif  // TF_SMB_CC_SMB_STATUS_H_
