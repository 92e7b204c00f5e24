// A stable 64-bit string hash (FNV-1a): equal on every rank and every run,
// unlike std::hash, so ranks can compare hashes of what they are about to do.
#ifndef TF_SMB_CC_SMB_HASH_H_
#define TF_SMB_CC_SMB_HASH_H_

#include <cstdint>
#include <string>

namespace smb {

inline uint64_t StableHash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace smb

#endif  // TF_SMB_CC_SMB_HASH_H_
