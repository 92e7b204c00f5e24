// The ranks of a job as one rank sees them: barriers, agreement on what every
// rank is about to do, failure that stops every rank alike, and which
// collective runs next. Written against Peers (peers.h), so it works the
// same for processes sharing a box and for threads of one process.
//
//   smb::Group group(peers, /*timeout_s=*/600);
//   SMB_RETURN_IF_ERROR(group.Agree("allreduce", "allreduce of 2 tensors: ..."));
//   SMB_RETURN_IF_ERROR(group.Sync("allreduce (staging)"));
//
// Calls that wait (Sync, Agree, WaitUntil) come from one thread at a time;
// the clock's waits (clock.h) may run on other threads, since they use only
// WaitUntil's read-only checks and atomics.
#ifndef TF_SMB_CC_SMB_GROUP_H_
#define TF_SMB_CC_SMB_GROUP_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cc/smb/node_link.h"
#include "cc/smb/peers.h"
#include "cc/smb/status.h"

namespace smb {

// What a rank may send along with its verdict in AgreeAcrossNodes.
constexpr size_t kAgreePayloadBytes = 1024;

class Group {
 public:
  // `peers` null: a group of one (every call succeeds at once). `link`: the
  // job spans nodes (node_link.h); then peers are this node's ranks, the
  // agreement, the order of collectives and failure are job-wide, and the
  // algorithms combine the nodes through the link.
  Group(std::shared_ptr<Peers> peers, double timeout_s, std::shared_ptr<NodeLink> link = nullptr);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  // This node's ranks (the job's, on one node).
  int rank() const { return rank_; }
  int world() const { return world_; }
  // The whole job's.
  int job_rank() const { return link_ ? link_->job_rank() : rank_; }
  int job_world() const { return link_ ? link_->job_world() : world_; }
  // A group of one rank on one node: collectives are copies.
  bool alone() const { return world_ == 1 && !link_; }
  // The job rank of this node's rank `local`.
  int JobRankOf(int local) const { return link_ ? link_->JobRank(link_->node(), local) : local; }
  // How errors name this node's rank `local`: "rank 1 (pid 123)"; across
  // nodes by its job rank, "rank 3 (node 1, pid 123)".
  std::string PeerName(int local) const;
  NodeLink* link() const { return link_.get(); }
  // How many slices a collective's data is cut into: one per rank, but across
  // nodes one per local rank with a counterpart on every node
  // (NodeLink::streams); the ranks beyond get empty slices.
  int slices() const { return link_ ? std::min(world_, link_->streams()) : world_; }
  Peers* peers() const { return peers_.get(); }
  const std::shared_ptr<Peers>& shared_peers() const { return peers_; }
  double timeout_s() const { return timeout_s_.load(std::memory_order_relaxed); }
  void set_timeout(double seconds) { timeout_s_.store(seconds, std::memory_order_relaxed); }

  // Arrives at the next barrier and waits for every rank to arrive too.
  Status Sync(const std::string& what);
  // Publishes `desc`, syncs, and fails on every rank alike if any rank
  // published another description ("ranks disagree on a collective: ...").
  Status Agree(const std::string& op, const std::string& desc);
  // Agree() in two halves, for a collective whose data rides on the
  // agreement across nodes (a small all-reduce: one exchange instead of two).
  // AgreeHere checks this node's ranks only (*verdict: whether they agree;
  // the returned status fails only when the wait does). AgreeAcrossNodes
  // must follow on every rank, also after a disagreement: it exchanges the
  // node's verdict and `payload` (at most kAgreePayloadBytes) with this
  // rank's counterparts; *payloads then holds every node's, in node order.
  Status AgreeHere(const std::string& op, const std::string& desc, Status* verdict);
  Status AgreeAcrossNodes(const std::string& desc, const Status& local,
                          const void* payload = nullptr, size_t payload_bytes = 0,
                          std::vector<char>* payloads = nullptr);
  // Makes the next collective's disagreement recoverable (Horovod's
  // semantics): its agreement also compares `agreement`, "NAME\nfield=value;
  // field=value;...", and when the ranks differ in it (or in anything else)
  // every rank fails that collective alike with kFailedPrecondition, "NAME: the
  // ranks disagree on the FIELD (rank 0: a, rank 1: b). ...", before any data
  // moves, and the group goes on. Called on the collectives' thread, just
  // before the collective; the collective's first agreement consumes it.
  void SetNextAgreement(std::string agreement) { next_agreement_ = std::move(agreement); }
  // The parity of the next Agree: per-collective slots (result_choice) use it.
  int AgreeParity() const { return static_cast<int>(collectives_ & 1); }
  // Which staging buffer (0 or 1) the next chunk uses: double buffering.
  int NextStagingBuffer() { return static_cast<int>(chunks_++ & 1); }
  // This rank's buffer of at least `bytes` for its share of an all-reduce
  // across nodes (private: the link sends and receives in it), kept for the
  // next one and grown when too small.
  char* Carrier(size_t bytes) {
    if (carrier_.size() < bytes) carrier_ = std::vector<char>(bytes);
    return carrier_.data();
  }
  // After a failed cross-node all-reduce: the link may still write into the
  // carrier (an operation no counterpart finished), so it is kept as it is
  // and the next all-reduce takes a new one.
  void RetireCarrier() { retired_carriers_.push_back(std::move(carrier_)); carrier_.clear(); }

  // Waits until done() holds, re-checking whenever the group's control words
  // change; fails on the group's failure, or after the timeout naming the
  // ranks that lagging() lists.
  Status WaitUntil(const std::string& what, const std::function<bool()>& done,
                   const std::function<std::string()>& lagging);
  bool RankGone(int rank) const;
  // The first rank found gone, or -1.
  int GoneRank() const;
  // The first rank found gone or left the job (Peers::Left), or -1.
  int AbsentRank() const;
  // How local rank `local` went, as a failure says it after its name:
  // " exited or died", or " left the job: ..." (Peers::Left).
  std::string GoneHow(int local) const;
  // Wakes every rank's waiters (something this rank publishes changed).
  void Poke();
  uint32_t WakeWord() const;
  // Returns when the control words change (after WakeWord() gave `seen`), or
  // after `seconds`.
  void WaitForChange(uint32_t seen, double seconds) const;

  // Stops the group's collectives for good: every rank's current and later
  // collectives fail with this error (the first failure wins).
  Status Fail(const Status& failure);
  // OK while the group runs; the failure that stopped it afterwards.
  Status Failure() const;

  // ---- Which collective runs next (see scheduler.h) ----
  // Publishes the keys of this rank's waiting collectives, oldest first.
  void PublishPending(const std::vector<uint64_t>& keys);
  // True once the group's next collective is chosen, with its key: rank 0
  // chooses the oldest of `mine` (its waiting keys) that every rank has
  // published; the others read rank 0's choice. False: not yet.
  bool NextCollective(const std::vector<uint64_t>& mine, uint64_t* key);
  // The ranks that have not published `key`, e.g. "1, 2". A rank that has
  // joined counts as having every key.
  std::string RanksWithout(uint64_t key) const;

  // ---- Join (Horovod's hvd.join) ----
  // Marks this rank joined: it has nothing left to submit but its join, and
  // serves the others' collectives (algorithms/joined.h) until every rank
  // has joined. ClearJoined ends that and returns the rank's join order: 0 if
  // it had not joined; else larger for a later join, comparable across nodes
  // (the collectives the rank had taken part in, then the order on its node).
  void MarkJoined();
  uint64_t ClearJoined();
  bool Joined(int rank) const;
  // Every rank of this node has joined.
  bool AllJoinedHere() const;
  // Across nodes, for a rank whose whole node has joined: takes part, saying
  // "joined", in the exchange of the nodes' verdicts that opens the
  // collective the others run next, and gives the description a node still
  // training sent (as PeekNextDescription does on one node; one too long for
  // a verdict follows it whole, broadcast from that node). That
  // collective's own AgreeAcrossNodes then uses this exchange.
  Status LearnAcrossNodes(std::string* text, bool* complete);
  // Then, before any data moves: tells the training nodes whether this rank
  // takes part (`taking_part` OK) or why it cannot; they fail the collective
  // with that reason (their AgreeAcrossNodes takes part in the same exchange,
  // answering OK). Returns the first reason any wholly joined node gave.
  Status AnswerAcrossNodes(const Status& taking_part);
  // The description (with its agreement) that a rank still training published
  // for the collective this rank is about to run, once it has: what a joined
  // rank needs to take part with zeros. *complete: false when the box's slot
  // cut it short (kDescBytes).
  Status PeekNextDescription(std::string* text, bool* complete);

 private:
  GroupControl* control() const { return peers_->control(); }
  // Nodes of different sizes: a rank beyond link_->streams() has no
  // counterpart on every node and takes no part in exchanges across nodes;
  // after each, every rank of its node calls Relay, and local rank 0's
  // outcome (status, text, flag) reaches it through the box.
  bool Relayed() const { return link_ && rank_ >= link_->streams(); }
  Status Relay(const Status& outcome, std::string* text, uint32_t* flag);
  // The exchanges themselves (what the public calls do where nothing is relayed).
  Status ExchangeVerdicts(const std::string& desc, const Status& local, const void* payload,
                          size_t payload_bytes, std::vector<char>* payloads);
  Status LearnFromNodes(std::string* text, bool* complete);
  Status AnswerNodes(const Status& taking_part);
  std::vector<uint64_t> PublishedBy(int rank) const;
  // Another rank of this group that has not joined (hvd.join).
  bool OtherTraining(int rank) const;

  std::shared_ptr<Peers> peers_;
  std::shared_ptr<NodeLink> link_;
  int rank_;
  int world_;
  std::atomic<double> timeout_s_;
  uint64_t seq_ = 0;          // barriers passed
  uint64_t collectives_ = 0;  // Agree() calls, for descriptor parity
  uint64_t chunks_ = 0;       // chunks moved, for staging buffer parity
  uint64_t relays_ = 0;       // Relay calls, for the relay slot's parity
  uint64_t decided_ = 0;      // collectives whose turn NextCollective found
  uint64_t join_order_ = 0;   // see MarkJoined
  // Rank 0: the keys it chose last. Having joined, it chooses from another
  // rank's published keys, which may still list one that just ran.
  static constexpr int kRecent = 8;
  uint64_t recent_[kRecent] = {};
  std::string next_agreement_;  // see SetNextAgreement
  std::string agreement_;       // the current collective's, from AgreeHere to AgreeAcrossNodes
  std::vector<char> learned_;   // the nodes' verdicts LearnAcrossNodes got, for AgreeAcrossNodes
  std::vector<char> carrier_;   // see Carrier
  std::vector<std::vector<char>> retired_carriers_;  // see RetireCarrier
};

}  // namespace smb

#endif  // TF_SMB_CC_SMB_GROUP_H_
