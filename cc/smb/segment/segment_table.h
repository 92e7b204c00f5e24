// The asynchronous mode's named segments as one rank sees them. On one node
// every segment lives in the node's box. Across nodes each segment has a home
// node: segments go, in creation order, to the node holding the fewest
// segment bytes so far (ties: the lowest node), which every rank computes
// alike since every rank creates the same segments in the same order. Ranks
// on the home node read and update the segment in their box directly; the
// others through the node link's memory server (NodeLink::CallSegmentServer),
// whose requests Serve() applies to the box under the same locks, so remote
// and local updates are never lost and reads are never torn.
//
// A node whose every rank is lost (NodeLink::NodeLost) takes its box with it.
// The job goes on (the asynchronous mode survives lost nodes): each rank
// moves the lost node's segments to the live nodes by the same rule, in
// creation order, and recreates each one there from the value it last read
// (kept for every segment homed on another node); the first rank to arrive
// sets it. What the lost node's box took in after that is lost, and each rank
// says so on stderr.
//
//   smb::SegmentTable table(peers, link);
//   SMB_RETURN_IF_ERROR(table.Create("dense/kernel", DType::kFloat32, {4, 3}, initial,
//                                    /*write=*/rank == 0, timeout_s));
//   SMB_RETURN_IF_ERROR(table.Update("dense/kernel", DType::kFloat32, {4, 3},
//                                    {UpdateRule::kDelta}, delta, 0.0, timeout_s));
#ifndef TF_SMB_CC_SMB_SEGMENT_SEGMENT_TABLE_H_
#define TF_SMB_CC_SMB_SEGMENT_SEGMENT_TABLE_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cc/smb/box.h"
#include "cc/smb/node_link.h"
#include "cc/smb/peers.h"
#include "cc/smb/segment/node_combiner.h"
#include "cc/smb/segment/segment_io.h"
#include "cc/smb/segment/updaters.h"
#include "cc/smb/status.h"

namespace smb {

class SegmentTable {
 public:
  // `peers` must have a box; `link` null on one node.
  SegmentTable(std::shared_ptr<Peers> peers, NodeLink* link);

  // Places `name` and creates it in its home box (or finds it there, when
  // another rank of the home node created it); `write`: sets it to `value`.
  // `value` is this rank's copy either way (kept while the home is remote).
  Status Create(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                const void* value, bool write, double timeout_s);
  // dst = the segment's current value. `bulk`: see UseStreamingCopy (copy.h).
  Status Read(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
              ReadMode mode, void* dst, double timeout_s, bool bulk = false);
  // Applies `update` (a delta, or a gradient for the SGD rules) to the segment;
  // `read_back` (optional): then the segment's value, as a consistent read
  // would give it (in the same pass on the home node, see Updater::Apply).
  Status Update(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                const UpdateOptions& options, const void* update, double learning_rate,
                double timeout_s, void* read_back = nullptr, bool bulk = false);
  // Pushes what this node's ranks combined and not yet pushed (a rank that
  // finishes training calls it: see NodeCombiner).
  Status FlushCombined(double timeout_s);
  // Pushes what is pending and combines no more: this rank's pushes and reads
  // go to the segments' homes (a staleness bound: the others see a push once
  // its step ends, as the bound promises).
  Status StopCombining(double timeout_s);
  // This rank's next reads of remote segments fetch them from their homes
  // (once every rank finished: the node's copy may predate the last pushes).
  void ForgetCombinedReads();
  // The segment's home node; -1 when this rank did not create it.
  int Home(const std::string& name) const;

  // The memory server's side: another node's request for a segment homed here.
  Status Serve(const SegmentRequest& request, const void* payload, size_t payload_bytes,
               std::vector<char>* reply);

 private:
  struct Placement {
    int home;
    DType dtype;
    std::vector<int64_t> shape;
  };
  // The segment where this rank placed it, checked against dtype and shape.
  Status Placed(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                int* home) const;
  // The segment in this node's box (created, or found and attached).
  // `initial`: the bytes a segment this call creates starts with (else zeros).
  Status Local(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
               Segment* out, const void* initial = nullptr);
  // The segment's home now, after moving the segments of lost nodes.
  Status CurrentHome(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                     double timeout_s, int* home);
  // Moves the segments of nodes lost since the last call (see the top).
  Status MoveFromLostNodes(double timeout_s);
  bool Remote(int home) const { return link_ != nullptr && home != link_->node(); }
  // Whether a call that ended with `call` on attempt `attempt` goes again.
  bool RetryAfterLoss(const Status& call, int attempt) const;
  static constexpr int kMaxAttempts = 3;
  // Runs `local(segment)` when the segment's home is this node, else
  // `remote(home)`, a call to the home's memory server, again while
  // RetryAfterLoss says so (the home may move to another node meanwhile).
  // `known_home`: the home a caller just found with CurrentHome (-1: none).
  template <typename LocalFn, typename RemoteFn>
  Status AtHome(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                double timeout_s, LocalFn local, RemoteFn remote, int known_home = -1) {
    for (int attempt = 0;; ++attempt) {
      int home = known_home;
      if (attempt > 0 || home < 0) {
        SMB_RETURN_IF_ERROR(CurrentHome(name, dtype, shape, timeout_s, &home));
      }
      if (!Remote(home)) {
        Segment segment;
        SMB_RETURN_IF_ERROR(Local(name, dtype, shape, &segment));
        return local(segment);
      }
      Status called = remote(home);
      if (!RetryAfterLoss(called, attempt)) return called;
    }
  }
  // segment += delta at its home, then fresh = its value (one round trip).
  Status PushAndFetch(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                      const void* delta, void* fresh, double timeout_s);
  // Keeps `value` as this rank's last copy of remote segment `name` (mu_ held).
  void KeepCopy(const std::string& name, const void* value, size_t bytes);
  Status UpdateLocal(const std::string& name, const Segment& segment,
                     const UpdateOptions& options, const void* update, double learning_rate,
                     void* read_back = nullptr, bool bulk = false);

  std::shared_ptr<Peers> peers_;
  NodeLink* link_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Placement> placed_;
  std::vector<std::string> order_;    // names in creation order
  std::vector<uint64_t> node_bytes_;  // segment bytes placed on each node
  // The last value this rank read of each segment homed on another node.
  std::unordered_map<std::string, std::vector<char>> copies_;
  std::mutex move_mu_;                // one move at a time
  std::vector<bool> moved_from_;      // nodes whose segments were moved (move_mu_)
  std::unordered_map<std::string, Segment> local_;
  std::unordered_map<std::string, std::unique_ptr<Updater>> updaters_;
  // Across nodes: this node's pushes to remote segments combined (null: off,
  // TF_SMB_COMBINE_PUSHES=0).
  std::unique_ptr<NodeCombiner> combiner_;
  std::atomic<bool> combining_{false};
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_SEGMENT_SEGMENT_TABLE_H_
