// Small OS helpers shared by the core: liveness of peer processes, futex
// waits on words in shared memory, monotonic time.
#ifndef TF_SMB_CC_SMB_PROCESS_H_
#define TF_SMB_CC_SMB_PROCESS_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>

namespace smb {

// True while `pid` exists and is not a zombie.
bool IsProcessAlive(pid_t pid);

// Sleeps until *word != expected, a wake, or timeout_s passes (spurious
// returns are fine: callers re-check their condition).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, double timeout_s);
void FutexWakeAll(std::atomic<uint32_t>* word);

double MonotonicSeconds();

}  // namespace smb

#endif  // TF_SMB_CC_SMB_PROCESS_H_
