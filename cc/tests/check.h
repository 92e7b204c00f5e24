// The C++ tests' one assertion: a failed check is printed and counted, and the
// test goes on, so one run shows every failure; main ends with Report.
#ifndef TF_SMB_CC_TESTS_CHECK_H_
#define TF_SMB_CC_TESTS_CHECK_H_

#include <cstdio>
#include <mutex>
#include <string>

namespace smb_test {

inline std::mutex failures_mu;
inline int failures = 0;

// From any thread.
inline void Check(bool ok, const std::string& what) {
  if (!ok) {
    std::lock_guard<std::mutex> lock(failures_mu);
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    ++failures;
  }
}

// The exit status; says "<test>: all checks passed" (what tests/sanitized.py
// looks for) when none failed.
inline int Report(const char* test) {
  std::lock_guard<std::mutex> lock(failures_mu);
  if (failures == 0) std::printf("%s: all checks passed\n", test);
  return failures == 0 ? 0 : 1;
}

}  // namespace smb_test

#endif  // TF_SMB_CC_TESTS_CHECK_H_
