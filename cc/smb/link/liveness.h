// Which ranks of the other nodes still speak, for the link between nodes
// (transport_link.h). The link's thread notes each message (Heard) and each
// rank that said it leaves (Left); the link's watchdog calls Tick every
// heartbeat with how many passes the link's thread has made, and then asks
// which ranks fell silent (Silent). Silences this process could not have
// heard are excused: it was stopped or starved (a tick kStalledS late), or
// the link's thread sat inside one transport call that long (MPI receiving a
// large message). A thread inside one call for 3 x lost_after_s is stuck
// there for good (as Open MPI 4.1's TCP transport can be after a peer died
// mid-message): it hears no one, so the silence then counts.
// Transport-independent and without threads of its own; Heard and Left may
// race with Tick (atomics), Tick is called from one thread.
#ifndef TF_SMB_CC_SMB_LINK_LIVENESS_H_
#define TF_SMB_CC_SMB_LINK_LIVENESS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace smb {

class Liveness {
 public:
  static constexpr double kStalledS = 2;
  static constexpr double kStuckLostAfters = 3;

  // `remote[r]`: rank r is on another node (only those are judged).
  Liveness(std::vector<bool> remote, double lost_after_s, double now);

  void Heard(int rank, double now) { last_heard_[rank] = now; }
  void Left(int rank) { left_[rank] = true; }
  bool left(int rank) const { return left_[rank]; }
  bool lost(int rank) const { return lost_[rank]; }
  void MarkLost(int rank) { lost_[rank] = true; }

  struct Tick {
    bool judge;  // Silent() means something now (the thread can hear)
    bool stuck;  // the link's thread is stuck inside the transport for good
  };
  // A watchdog tick at `now`; `passes`: the link thread's loop count.
  Tick Ticked(double now, uint64_t passes);

  // The other nodes' ranks not heard from for lost_after_s that have not
  // left and are not lost yet.
  std::vector<int> Silent(double now) const;

 private:
  void ExcuseSilence(double now);  // nobody could be heard until now

  const std::vector<bool> remote_;
  const double lost_after_s_;
  std::unique_ptr<std::atomic<double>[]> last_heard_;
  std::unique_ptr<std::atomic<bool>[]> left_;
  std::unique_ptr<std::atomic<bool>[]> lost_;
  // The watchdog's view of the link's thread (Ticked only).
  uint64_t seen_passes_ = 0;
  double last_tick_, moved_at_;
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_LINK_LIVENESS_H_
