#include "cc/smb/link/transport_link.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "cc/smb/link/decider.h"
#include "cc/smb/link/liveness.h"
#include "cc/smb/link/segment_wire.h"
#include "cc/smb/process.h"

namespace smb {
namespace {

// The link's messages (the transport keeps them apart from collectives).
constexpr int kTagCandidates = 11;  // leader -> node 0's leader: [applied, keys...]
constexpr int kTagDecision = 12;    // node 0's leader -> leaders: [seq, key]
constexpr int kTagFailure = 13;     // anyone -> everyone: [code, message]
constexpr int kTagSegmentRequest = 14;  // a client -> the home node's server
constexpr int kTagSegmentReply = 15;    // the server -> the client
constexpr int kTagClock = 16;           // a rank -> the other nodes' ranks: [steps, phase]
constexpr int kTagLeaving = 17;         // a rank at exit -> everyone: []
constexpr int kTagHeartbeat = 18;       // every rank -> the other nodes' ranks: []
constexpr int kTagDeclaredLost = 19;    // a survivor -> a rank it had found lost: []
constexpr int kTagToRankZero = 20;      // a rank -> rank 0: bytes (SendToRankZero)

// Every rank tells the ranks of other nodes it is alive this often; one not
// heard from for LinkOptions::lost_after_s is lost (its node died or was cut
// off). Only matters where the launcher lets the others run on (mpirun
// --enable-recovery): by default mpirun ends the whole job when a rank dies.
constexpr double kHeartbeatS = 0.5;

// Updates and writing creates: served twice (a stale copy and its retry),
// they would count twice or undo what came between.
bool ChangesValues(const SegmentRequest& request) {
  return request.kind == SegmentRequest::Kind::kUpdate ||
         (request.kind == SegmentRequest::Kind::kCreate && request.write);
}

std::vector<char> Words(const std::vector<uint64_t>& words) {
  std::vector<char> bytes(words.size() * sizeof(uint64_t));
  if (!words.empty()) std::memcpy(bytes.data(), words.data(), bytes.size());
  return bytes;
}

std::vector<uint64_t> WordsOf(const std::vector<char>& bytes) {
  std::vector<uint64_t> words(bytes.size() / sizeof(uint64_t));
  if (!words.empty()) std::memcpy(words.data(), bytes.data(), words.size() * sizeof(uint64_t));
  return words;
}

// A failure on the wire (kTagFailure): [code, message bytes, zero-padded].
std::vector<char> EncodeFailure(const Status& failure) {
  const std::string& m = failure.message();
  std::vector<uint64_t> words(1 + (m.size() + 8) / 8, 0);
  words[0] = static_cast<uint64_t>(failure.code());
  std::memcpy(words.data() + 1, m.data(), m.size());
  return Words(words);
}

Status DecodeFailure(const std::vector<uint64_t>& words) {
  std::string text(reinterpret_cast<const char*>(words.data() + 1),
                   (words.size() - 1) * sizeof(uint64_t));
  text.resize(std::strlen(text.c_str()));
  return Status(static_cast<Code>(words[0]), text);
}

constexpr double kWaitSliceS = 0.02;  // how often waiters look at the job's failure
constexpr double kFailedFinalizeWaitS = 60;  // exit's wait for the thread after a failure
constexpr double kFailedSettleS = 5;  // a failed job's wait for operations in flight

// One collective a caller waits for, started and completed on the thread.
struct Op : LinkOp {
  std::function<Status(Transport&, std::unique_ptr<Transfer>*)> start;
  std::unique_ptr<Transfer> transfer;  // thread only
  bool done = false;
  Status error;
  std::vector<char> buffer;  // memory the operation owns (outlives an abandoned wait)
};

// A segment call waiting for its reply (mu_ guards it).
struct PendingCall {
  void* reply;
  size_t reply_bytes;
  int server;
  bool done = false;
  Status status;
};

class TransportLink : public NodeLink, public std::enable_shared_from_this<TransportLink> {
 public:
  explicit TransportLink(std::unique_ptr<Transport> transport)
      : transport_(std::move(transport)), transport_name_(transport_->name()) {}
  Status Begin(const LinkOptions& options);
  void Stop() override;
  ~TransportLink() override { Stop(); }

  int node() const override { return node_; }
  int nodes() const override { return nodes_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  int job_rank() const override { return rank_; }
  int job_world() const override { return world_; }
  int NodeSize(int node) const override { return LocalSize(node); }
  int streams() const override { return streams_; }
  int JobRank(int node, int local) const override { return job_rank_of_[first_of_[node] + local]; }
  void Locate(int rank, int* node, int* local) const override {
    *node = node_of_[rank];
    *local = local_of_[rank];
  }

  Status AllReduceSum(DType dtype, void* data, size_t count, double timeout_s) override;
  Status StartAllReduceSum(DType dtype, void* data, size_t count,
                           std::shared_ptr<LinkOp>* op) override;
  Status Wait(const std::shared_ptr<LinkOp>& op, double timeout_s) override;
  Status AllGather(const void* in, size_t bytes, void* out, double timeout_s) override;
  Status Broadcast(void* data, size_t bytes, int root, double timeout_s) override;
  void OfferCandidates(const std::vector<uint64_t>& keys) override;
  bool NextDecision(uint64_t* key) override;
  void SendFailure(const Status& failure) override;
  void SetCallbacks(std::function<void(const Status&)> failed, std::function<void()> wake,
                    std::function<Status()> local_failure) override;
  void SetSegmentServer(SegmentServer server) override;
  Status CallSegmentServer(int home, const SegmentRequest& request, const void* payload,
                           size_t payload_bytes, void* reply, size_t reply_bytes,
                           double timeout_s) override;
  void SendToRankZero(std::vector<char> bytes) override {
    Post(0, kTagToRankZero, std::move(bytes));
  }
  void SetRankZeroReceiver(std::function<void(int, std::vector<char>)> receiver) override {
    std::lock_guard<std::mutex> lock(mu_);
    rank_zero_receiver_ = std::move(receiver);
  }
  void PublishClock(uint64_t steps, uint64_t phase) override;
  std::vector<RemoteClock> RemoteClocks() const override;
  Status Failure() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  }
  void KeepGoingWithoutLostRanks() override { keep_going_ = true; }
  bool NodeLost(int node) const override {
    for (int local = 0; local < LocalSize(node); ++local) {
      if (!liveness_->lost(JobRank(node, local))) return false;
    }
    return true;
  }

 private:
  Status Setup(const LinkOptions& options);  // on the thread
  // The thread; `self` keeps the link alive while it runs.
  static void Loop(std::shared_ptr<TransportLink> self, LinkOptions options);
  void Work(const LinkOptions& options);
  // The watchdog thread: every heartbeat, asks liveness_ which of the other
  // nodes' ranks fell silent, and whether the link's thread is stuck inside
  // the transport (Open MPI may hang after a peer dies).
  void Watch();
  void StopWatch();
  Status Run(const std::shared_ptr<Op>& op, const std::string& what, double timeout_s);
  Status Enqueue(const std::shared_ptr<Op>& op);
  Status Await(const Op& op, const std::string& what, double timeout_s);
  void SetFailure(const Status& failure);  // mu_ held
  // The job failed here (a lost rank, or another rank's word): records it and
  // tells the group (failed_cb_). mu_ not held.
  void Fail(const Status& failure);
  Status NoCounterparts() const {
    return Internal("rank " + std::to_string(rank_) + " is local rank " +
                    std::to_string(local_rank_) + " of node " + std::to_string(node_) +
                    ", but a node of the job runs only " + std::to_string(streams_) +
                    " rank(s): collectives across nodes go through local ranks below that");
  }
  Status LostCollective() const {  // mu_ held
    return Status(Code::kAborted, "rank " + std::to_string(rank_) +
                                      ": a collective across nodes cannot run after rank(s) " +
                                      lost_names_ + " were lost");
  }
  // On the thread, a pass of Work's loop, step by step (each true: it did something).
  struct Pass;                  // what other threads handed the thread since the last pass
  Pass TakePass();              // (mu_ not held)
  bool SendPosted(Pass& pass);  // their sends, the failure to tell, the leader's offer
  bool StartOps(Pass& pass);
  bool TestOps();               // completes the collectives that finished
  void TestSends();
  bool ServeWaiting();          // requests that came before this rank's server
  void SendHeartbeats();
  // Stopping: says leaving once, and whether the loop may end (`failed_since`:
  // when it first saw the job failed, or < 0).
  bool MayEnd(bool* busy, double* failed_since);
  void Sleep(double* idle_s);   // waits for work, longer while nothing happens
  // A message from another rank, read and acted upon.
  bool Receive();
  void DeclaredLost(int from);
  void Deliver(int from, int tag, std::vector<char> message);
  void DeliverToRankZero(int from, std::vector<char> message);
  // Node 0's leader: takes node `node`'s offer, sends what it decides.
  void Offer(int node, const std::vector<uint64_t>& message);
  // Skips a lost rank unless `even_if_lost`.
  void Send(int to, int tag, std::vector<char> bytes, bool even_if_lost = false);
  // From any thread: the link's thread sends it.
  void Post(int to, int tag, std::vector<char> bytes);
  // False: no server yet (this rank is still starting); ask again later.
  bool Serve(int from, const std::vector<char>& message);
  void Answer(const std::vector<char>& message);

  std::unique_ptr<Transport> transport_;  // called on the thread only
  const std::string transport_name_;      // for messages
  double lost_after_s_ = 10;
  // Layout, fixed once Begin() returns.
  int rank_ = 0, world_ = 1, node_ = 0, nodes_ = 1, local_rank_ = 0, local_size_ = 1;
  int streams_ = 1;                   // the fewest ranks on a node (see NodeLink::streams)
  std::vector<int> first_of_;         // node -> its local rank 0's index in job_rank_of_
  std::vector<int> job_rank_of_;      // [first_of_[node] + local] -> job rank
  std::vector<int> node_of_, local_of_;  // job rank -> node, local rank
  int LocalSize(int node) const { return first_of_[node + 1] - first_of_[node]; }

  std::thread thread_;
  std::thread watchdog_;
  std::atomic<uint64_t> passes_{0};  // of the thread's loop, for the watchdog
  std::atomic<bool> polling_{true};  // the thread is in its loop (not finalizing)
  mutable std::mutex mu_;
  std::condition_variable watch_cv_;  // wakes the watchdog to end
  bool watch_stop_ = false;
  // The thread made no pass for Liveness::kStuckLostAfters x lost_after_s while the
  // process ran: it is stuck inside the transport, and the exit does not
  // wait for it (mu_).
  bool stuck_ = false;
  std::condition_variable work_cv_;  // wakes the thread
  std::condition_variable done_cv_;  // wakes callers
  bool started_ = false;             // Setup finished (see setup_)
  Status setup_;
  bool stop_ = false;
  bool finished_ = false;            // the thread returned
  double finalize_wait_s_ = 600;     // how long exit waits for the others to leave
  std::deque<std::shared_ptr<Op>> queue_;
  std::vector<std::shared_ptr<Op>> active_;  // thread only
  // Leader: what to offer next (latest wins), decisions not yet taken.
  bool offer_pending_ = false;
  std::vector<uint64_t> offer_;       // [applied, keys...]
  std::vector<uint64_t> last_offer_;
  size_t awaiting_ = 0;               // keys offered and not yet decided
  std::deque<uint64_t> decisions_;
  uint64_t applied_ = 0;              // decisions taken by NextDecision
  // Failure.
  Status failure_;
  Status failure_to_send_;
  std::function<void(const Status&)> failed_cb_;
  std::function<void()> wake_cb_;
  std::function<void(int, std::vector<char>)> rank_zero_receiver_;  // SetRankZeroReceiver
  std::function<Status()> local_failure_cb_;
  // Node 0's leader only (thread only).
  std::unique_ptr<Decider> decider_;
  // Sends in flight (thread only), and sends other threads posted (mu_).
  struct Sending {
    std::unique_ptr<Transfer> transfer;
    int to, tag;
  };
  std::vector<Sending> sends_;
  struct Outgoing {
    int to, tag;
    std::vector<char> bytes;
  };
  std::deque<Outgoing> outbox_;
  struct Pass {
    std::deque<std::shared_ptr<Op>> starting;
    std::vector<uint64_t> offer;
    bool have_offer = false;
    bool stop = false;
    Status to_send;
    std::deque<Outgoing> outgoing;
  };
  // The memory server, segment calls waiting for replies, other nodes' clocks (mu_).
  SegmentServer server_;
  std::atomic<uint64_t> next_call_{1};
  std::unordered_map<uint64_t, PendingCall*> calls_;
  std::unordered_map<int, RemoteClock> clocks_;
  // Exit: a rank keeps serving its segments until every rank is leaving
  // (thread only).
  std::deque<std::pair<int, std::vector<char>>> unserved_;  // requests before a server
  bool sent_leaving_ = false;
  // Liveness of the other nodes' ranks, by job rank: the thread hears, the
  // watchdog judges; lost ranks are marked under mu_.
  std::unique_ptr<Liveness> liveness_;
  std::vector<bool> told_lost_;     // sent kTagDeclaredLost (thread only)
  double next_heartbeat_ = 0;
  double last_heartbeats_s_ = 0;  // when the thread last sent them (thread only)
  std::atomic<bool> peers_lost_{false};  // a rank is gone: never finish the transport
  std::atomic<bool> keep_going_{false};  // see KeepGoingWithoutLostRanks
  std::string lost_names_;               // "2 (node 1), 3 (node 1)" (mu_)
  void CheckLiveness(double now, bool link_stuck);  // on the watchdog
  // Whether the nodes this rank still hears from, with `silent` counted out,
  // may go on without the rest (the majority side); *heard names them.
  bool HearsMajority(const std::vector<int>& silent, std::string* heard) const;
  bool Lost(int rank) const { return liveness_->lost(rank); }
  // Every other rank sent kTagLeaving or is lost (thread only).
  bool OthersGone() const;
};

Status TransportLink::Begin(const LinkOptions& options) {
  finalize_wait_s_ = options.timeout_s;
  lost_after_s_ = options.lost_after_s;
  thread_ = std::thread(&TransportLink::Loop, shared_from_this(), options);
  std::unique_lock<std::mutex> lock(mu_);
  // Starting waits for every rank: one that never joins must not hang this one.
  if (!done_cv_.wait_for(lock, std::chrono::duration<double>(options.timeout_s),
                         [&] { return started_; })) {
    thread_.detach();  // it keeps the link alive; the OS ends it
    return Status(Code::kDeadlineExceeded,
                  "rank " + std::to_string(options.rank) + " timed out after " +
                      std::to_string(static_cast<int>(options.timeout_s)) +
                      "s starting " + transport_name_ + " between nodes: do all " +
                      std::to_string(options.world) +
                      " ranks create tf_smb.SMBStrategy() (or call tf_smb.init())?");
  }
  if (setup_.ok() && nodes_ > 1) watchdog_ = std::thread(&TransportLink::Watch, this);
  return setup_;
}

Status TransportLink::Setup(const LinkOptions& options) {
  Layout layout;
  SMB_RETURN_IF_ERROR(transport_->Start(options.rank, options.world, &layout));
  rank_ = layout.rank;
  world_ = layout.world;
  nodes_ = layout.nodes;
  node_ = layout.node_of[rank_];
  local_rank_ = layout.local_of[rank_];
  local_size_ = layout.local_size_of[rank_];
  // Nodes may run different numbers of ranks (what a scheduler hands out).
  std::vector<int> per_node(nodes_, 0);
  for (int r = 0; r < world_; ++r) per_node[layout.node_of[r]] = layout.local_size_of[r];
  first_of_.assign(nodes_ + 1, 0);
  for (int n = 0; n < nodes_; ++n) first_of_[n + 1] = first_of_[n] + per_node[n];
  if (first_of_[nodes_] != world_) {
    return Internal("the transport's layout places " + std::to_string(first_of_[nodes_]) +
                    " ranks on its nodes, but the job has " + std::to_string(world_));
  }
  streams_ = *std::min_element(per_node.begin(), per_node.end());
  node_of_ = layout.node_of;
  local_of_ = layout.local_of;
  job_rank_of_.assign(world_, 0);
  for (int r = 0; r < world_; ++r) job_rank_of_[first_of_[node_of_[r]] + local_of_[r]] = r;
  if (node_ == 0 && local_rank_ == 0) decider_ = std::make_unique<Decider>(nodes_);
  std::vector<bool> remote(world_);
  for (int r = 0; r < world_; ++r) remote[r] = node_of_[r] != node_;
  liveness_ = std::make_unique<Liveness>(std::move(remote), lost_after_s_, MonotonicSeconds());
  told_lost_.assign(world_, false);
  return Status::Ok();
}

// Named, so that a debugger, top -H or a test finds them.
void NameThisThread(const char* name) {
#ifdef __linux__
  pthread_setname_np(pthread_self(), name);
#endif
}

void TransportLink::Loop(std::shared_ptr<TransportLink> self, LinkOptions options) {
  NameThisThread("smb_link");
  self->Work(options);
}

void TransportLink::Work(const LinkOptions& options) {
  Status setup = Setup(options);
  {
    std::lock_guard<std::mutex> lock(mu_);
    setup_ = setup;
    started_ = true;
  }
  done_cv_.notify_all();
  if (!setup.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
    done_cv_.notify_all();
    return;
  }
  double idle_s = 0;
  double failed_since = -1;  // when the loop, stopping, first saw the job failed
  last_heartbeats_s_ = MonotonicSeconds();  // the first go out on the first pass
  for (;;) {
    ++passes_;
    Pass pass = TakePass();
    bool busy = SendPosted(pass);
    busy |= StartOps(pass);
    busy |= TestOps();
    TestSends();
    while (Receive()) busy = true;
    busy |= ServeWaiting();
    if (nodes_ > 1) SendHeartbeats();
    if (pass.stop && MayEnd(&busy, &failed_since)) break;
    if (busy) {
      idle_s = 0;
      continue;
    }
    Sleep(&idle_s);
  }
  polling_ = false;  // finishing may block a while: not a stuck call
  // Every rank finishes the transport (else mpirun calls the job failed),
  // unless a peer is gone: MPI_Finalize would wait for it forever. An operation
  // still in flight after a failure does not hold it: a counterpart that learned
  // of the failure before starting the same operation never will (its link
  // refuses new operations), and Open MPI 4.1 frees the communicators and
  // finalizes with such an unmatched collective pending (measured: an
  // Iallgather or a 40 MB Iallreduce on a duplicated communicator, started by
  // one of 4 ranks; every rank's Comm_free and Finalize returned). Leaving MPI
  // unfinished made mpirun fail a job whose every rank had reported the failure.
  if (!peers_lost_) transport_->Finish();
  std::lock_guard<std::mutex> lock(mu_);
  finished_ = true;
  done_cv_.notify_all();
}

TransportLink::Pass TransportLink::TakePass() {
  Pass pass;
  std::lock_guard<std::mutex> lock(mu_);
  pass.starting.swap(queue_);
  if (offer_pending_) {
    pass.offer.swap(offer_);
    offer_pending_ = false;
    pass.have_offer = true;
  }
  pass.to_send = failure_to_send_;
  failure_to_send_ = Status::Ok();
  pass.stop = stop_;
  pass.outgoing.swap(outbox_);
  return pass;
}

bool TransportLink::SendPosted(Pass& pass) {
  bool busy = false;
  for (Outgoing& o : pass.outgoing) {
    Send(o.to, o.tag, std::move(o.bytes));
    busy = true;
  }
  if (!pass.to_send.ok()) {
    const std::vector<char> message = EncodeFailure(pass.to_send);
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) Send(r, kTagFailure, message);
    }
    busy = true;
  }
  if (pass.have_offer) {
    if (node_ == 0) {
      Offer(0, pass.offer);
    } else {
      Send(JobRank(0, 0), kTagCandidates, Words(pass.offer));
    }
    busy = true;
  }
  return busy;
}

bool TransportLink::StartOps(Pass& pass) {
  for (auto& op : pass.starting) {
    Status started = op->start(*transport_, &op->transfer);
    if (!started.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      op->error = std::move(started);
      op->done = true;
      done_cv_.notify_all();
    } else {
      active_.push_back(op);
    }
  }
  return !pass.starting.empty();
}

bool TransportLink::TestOps() {
  bool busy = false;
  for (size_t i = 0; i < active_.size();) {
    Status outcome;
    if (!transport_->Test(active_[i]->transfer.get(), &outcome)) {
      ++i;
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      active_[i]->error = std::move(outcome);
      active_[i]->done = true;
    }
    done_cv_.notify_all();
    active_.erase(active_.begin() + i);
    busy = true;
  }
  return busy;
}

void TransportLink::TestSends() {
  for (size_t i = 0; i < sends_.size();) {
    Status outcome;  // a failed send: its peer is gone, which liveness finds
    if (!transport_->Test(sends_[i].transfer.get(), &outcome)) {
      ++i;
      continue;
    }
    sends_.erase(sends_.begin() + i);
  }
}

bool TransportLink::ServeWaiting() {
  bool busy = false;
  while (!unserved_.empty() && Serve(unserved_.front().first, unserved_.front().second)) {
    unserved_.pop_front();
    busy = true;
  }
  return busy;
}

void TransportLink::SendHeartbeats() {
  const double now = MonotonicSeconds();
  if (now < next_heartbeat_) return;
  next_heartbeat_ = now + kHeartbeatS;
  last_heartbeats_s_ = now;
  // One heartbeat in flight per rank: to a rank that died, each new send
  // would be another failed connect (in Open MPI's TCP transport).
  std::vector<bool> beating(world_, false);
  for (const Sending& s : sends_) {
    if (s.tag == kTagHeartbeat) beating[s.to] = true;
  }
  for (int r = 0; r < world_; ++r) {
    if (node_of_[r] != node_ && !beating[r]) Send(r, kTagHeartbeat, {});
  }
}

bool TransportLink::MayEnd(bool* busy, double* failed_since) {
  const bool failed = !Failure().ok();
  if (!failed && nodes_ > 1 && !sent_leaving_) {
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) Send(r, kTagLeaving, {});
    }
    sent_leaving_ = true;
    *busy = true;
  }
  if (failed) {
    // The other ranks failed too and started the same cross-node operations
    // (or none): let those in flight complete, briefly (what is still in
    // flight then, no counterpart started: finishing goes on without it).
    if (*failed_since < 0) *failed_since = MonotonicSeconds();
    return active_.empty() || peers_lost_ || MonotonicSeconds() - *failed_since >= kFailedSettleS;
  }
  const bool others_left = nodes_ == 1 || OthersGone();
  // Sends to lost ranks never complete: they do not hold the exit. Nor do
  // sends to ranks that left once a rank was lost: nobody finishes MPI then,
  // so such a rank may have exited with the send unreceived (survivors on
  // two nodes; measured: 1 exit in 4 at 1+2+1 waited out its whole timeout).
  const bool sent = std::all_of(sends_.begin(), sends_.end(), [&](const Sending& s) {
    return Lost(s.to) || (peers_lost_ && liveness_->left(s.to));
  });
  return others_left && active_.empty() && sent;
}

void TransportLink::Sleep(double* idle_s) {
  // Sleeps grow while nothing happens: up to 1 ms when idle, but only up to
  // 50 us while anything is in flight (a collective, a segment call, or an
  // offer awaiting its decision): the transport progresses (MPI does), and a
  // message is seen, only when this thread polls. (Measured: a fit step of a
  // 0.67M-parameter MLP, 2 nodes x 2 workers, 5 Gbit/s, took 33 ms at 1 ms,
  // 24 ms at 50 us.)
  constexpr double kIdleSleepS = 1e-3, kInFlightSleepS = 50e-6;
  std::unique_lock<std::mutex> lock(mu_);
  const bool in_flight = !active_.empty() || !calls_.empty() || awaiting_ > 0;
  *idle_s = std::min(in_flight ? kInFlightSleepS : kIdleSleepS, std::max(2e-5, *idle_s * 2));
  work_cv_.wait_for(lock, std::chrono::duration<double>(*idle_s), [&] {
    // Once leaving (or settling after a failure), a stopping link still sleeps
    // between polls.
    return !queue_.empty() || offer_pending_ || (stop_ && !sent_leaving_ && failure_.ok()) ||
           !failure_to_send_.ok() || !outbox_.empty();
  });
}

bool TransportLink::OthersGone() const {
  for (int r = 0; r < world_; ++r) {
    // Once a rank is lost nobody finalizes, and this node's ranks never call
    // this rank's server (they share the box): only other nodes' ranks count.
    const bool needed = !(peers_lost_ && node_of_[r] == node_);
    if (r != rank_ && needed && !liveness_->left(r) && !liveness_->lost(r)) return false;
  }
  return true;
}

void TransportLink::Watch() {
  NameThisThread("smb_watchdog");
  std::unique_lock<std::mutex> lock(mu_);
  while (!watch_stop_) {
    watch_cv_.wait_for(lock, std::chrono::duration<double>(kHeartbeatS));
    // !polling_: the link thread left its loop (finalizing, or failed).
    if (watch_stop_ || !polling_) break;
    const double now = MonotonicSeconds();
    const Liveness::Tick tick = liveness_->Ticked(now, passes_);
    if (tick.stuck && !stuck_) {
      stuck_ = true;
      done_cv_.notify_all();  // the exit stops waiting for the thread
    }
    if (!tick.judge) continue;  // cannot hear: cannot judge yet
    lock.unlock();
    CheckLiveness(now, tick.stuck);
    lock.lock();
  }
}

void TransportLink::StopWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    watch_stop_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

void TransportLink::CheckLiveness(double now, bool link_stuck) {
  if (!Failure().ok()) return;
  const std::vector<int> silent = liveness_->Silent(now);
  if (silent.empty()) return;
  std::string lost;
  for (int r : silent) {
    lost += (lost.empty() ? "" : ", ") + std::to_string(r) + " (node " +
            std::to_string(node_of_[r]) + ")";
  }
  peers_lost_ = true;
  const std::string what =
      "rank(s) " + lost + " sent nothing for " + std::to_string(static_cast<int>(lost_after_s_)) +
      " s: lost (their node died or was cut off" +
      (link_stuck ? "; this rank's " + transport_name_ + " thread is stuck in an " +
                        transport_name_ + " call, as Open MPI can be after a peer died, so it " +
                        "hears no one)"
                  : ")");
  if (keep_going_) {
    std::string cut_off;
    if (!HearsMajority(silent, &cut_off)) {
      // Silence cannot tell "they died" from "I am cut off" (or "my MPI
      // thread is stuck"): only the side that still hears most of the nodes
      // goes on, or so a job would split into two that each train alone.
      peers_lost_ = true;
      Fail(Status(Code::kAborted, what + "; rank " + std::to_string(rank_) + " (node " +
                                      std::to_string(node_) + ") hears " + cut_off +
                                      ": it is cut off from the rest of the job, which goes on "
                                      "without it, so it stops rather than train apart"));
      return;
    }
    // The asynchronous mode goes on without them: their clocks count as
    // finished, calls waiting on them end (SegmentTable moves the segments
    // of a node whose every rank is lost), and collectives across nodes fail.
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int r : silent) liveness_->MarkLost(r);
      lost_names_ += (lost_names_.empty() ? "" : ", ") + lost;
      for (auto it = calls_.begin(); it != calls_.end();) {
        PendingCall* call = it->second;
        if (!liveness_->lost(call->server)) {
          ++it;
          continue;
        }
        call->status = Status(Code::kAborted, "rank " + std::to_string(call->server) +
                                                  " was lost before it answered");
        call->done = true;
        it = calls_.erase(it);
      }
      wake = wake_cb_;
      done_cv_.notify_all();
    }
    std::fprintf(stderr, "tf_smb: rank %d (node %d): %s; the asynchronous mode goes on without "
                 "them\n", rank_, node_, what.c_str());
    if (wake) wake();
    return;
  }
  const Status failure(Code::kAborted,
                       what + "; rank " + std::to_string(rank_) +
                           " stops (a synchronous job cannot go on without them)");
  Fail(failure);
}

bool TransportLink::HearsMajority(const std::vector<int>& silent, std::string* heard) const {
  // The nodes alive so far (not every rank lost) and those of them this rank
  // still hears from (its own always: its ranks share the box).
  std::vector<bool> quiet(world_, false);
  for (int r : silent) quiet[r] = true;
  int alive = 0, hearing = 0, lowest = -1;
  bool hears_lowest = false;
  std::string names;
  for (int n = 0; n < nodes_; ++n) {
    if (NodeLost(n)) continue;
    ++alive;
    bool heard_n = n == node_;
    for (int local = 0; local < LocalSize(n) && !heard_n; ++local) {
      const int r = JobRank(n, local);
      heard_n = !quiet[r] && !liveness_->lost(r);
    }
    if (lowest < 0) {
      lowest = n;
      hears_lowest = heard_n;
    }
    if (heard_n) {
      ++hearing;
      names += (names.empty() ? "" : ", ") + std::to_string(n);
    }
  }
  *heard = "only node(s) " + names + " of the " + std::to_string(alive) + " alive";
  // A strict majority, or exactly half that holds the lowest node alive: the
  // two halves of an even split agree on which one goes on.
  return 2 * hearing > alive || (2 * hearing == alive && hears_lowest);
}

void TransportLink::Stop() {
  std::unique_lock<std::mutex> lock(mu_);
  if (!thread_.joinable()) return;
  if (std::this_thread::get_id() == thread_.get_id()) {
    lock.unlock();
    StopWatch();
    thread_.detach();  // the thread let go of the last reference: it is ending
    return;
  }
  stop_ = true;
  work_cv_.notify_all();
  // Never hang the exit on peers that are gone, nor on a thread stuck in the
  // transport:
  // after the wait (short when the job failed), leave the thread (which keeps
  // the link alive) to the OS.
  const double wait_s = failure_.ok() ? finalize_wait_s_ : kFailedFinalizeWaitS;
  const bool finished = done_cv_.wait_for(lock, std::chrono::duration<double>(wait_s),
                                          [&] { return finished_ || stuck_; }) &&
                        finished_;
  lock.unlock();
  StopWatch();
  if (finished) {
    thread_.join();
  } else {
    thread_.detach();
  }
}

void TransportLink::Send(int to, int tag, std::vector<char> bytes, bool even_if_lost) {
  if (!even_if_lost && Lost(to)) return;  // nobody would take it
  std::unique_ptr<Transfer> transfer;
  // A send that fails to start: its peer is gone, which liveness finds.
  if (transport_->Send(to, tag, std::make_shared<const std::vector<char>>(std::move(bytes)),
                       &transfer).ok()) {
    sends_.push_back({std::move(transfer), to, tag});
  }
}

void TransportLink::Post(int to, int tag, std::vector<char> bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    outbox_.push_back({to, tag, std::move(bytes)});
  }
  work_cv_.notify_all();
}

bool TransportLink::Receive() {
  int from = 0, tag = 0;
  std::vector<char> message;
  if (!transport_->Receive(&from, &tag, &message)) return false;
  liveness_->Heard(from, MonotonicSeconds());
  if (tag == kTagDeclaredLost) {
    DeclaredLost(from);
    return true;
  }
  if (Lost(from)) {
    if (!told_lost_[from]) {
      told_lost_[from] = true;
      Send(from, kTagDeclaredLost, {}, /*even_if_lost=*/true);
    }
    return true;  // what a lost rank says no longer counts
  }
  Deliver(from, tag, std::move(message));
  return true;
}

void TransportLink::DeclaredLost(int from) {
  // This rank was silent long enough for another to go on without it (it
  // stalled, or the network did): the others moved on, so it must stop,
  // loudly, rather than train on a copy of the parameters no one else sees.
  const Status failure(Code::kAborted,
                       "rank " + std::to_string(rank_) + " (node " + std::to_string(node_) +
                           ") sent nothing for " +
                           std::to_string(static_cast<int>(lost_after_s_)) + " s, so rank " +
                           std::to_string(from) +
                           " went on without it (the asynchronous mode survives lost nodes); "
                           "this rank stops");
  // The others count this rank as gone and will not finish the transport
  // with it: MPI_Finalize would wait for them (the exit's whole failed-job
  // wait). Its own node's ranks, which never judge it, must not wait for it
  // at their exit either.
  peers_lost_ = true;
  Fail(failure);
  for (int local = 0; local < local_size_; ++local) {
    const int r = JobRank(node_, local);
    if (r != rank_) Send(r, kTagLeaving, {});
  }
}

void TransportLink::Deliver(int from, int tag, std::vector<char> message) {
  switch (tag) {
    case kTagHeartbeat:
      return;
    case kTagLeaving:
      liveness_->Left(from);
      return;
    case kTagSegmentRequest:
      if (!unserved_.empty() || !Serve(from, message)) {
        unserved_.emplace_back(from, std::move(message));
      }
      return;
    case kTagSegmentReply:
      Answer(message);
      return;
    case kTagToRankZero:
      DeliverToRankZero(from, std::move(message));
      return;
    default:
      break;
  }
  const std::vector<uint64_t> words = WordsOf(message);
  std::function<void()> wake;
  switch (tag) {
    case kTagCandidates:
      Offer(node_of_[from], words);
      return;
    case kTagFailure:
      if (words.empty()) break;
      Fail(DecodeFailure(words));
      return;
    case kTagClock:
      if (words.size() != 2) break;
      {
        std::lock_guard<std::mutex> lock(mu_);
        clocks_[from] = {from, words[0], words[1]};
        wake = wake_cb_;
      }
      if (wake) wake();
      return;
    case kTagDecision:
      if (words.size() != 2) break;
      {
        std::lock_guard<std::mutex> lock(mu_);
        decisions_.push_back(words[1]);
        wake = wake_cb_;
      }
      if (wake) wake();
      return;
    default:
      break;
  }
  // A message no rank of this build sends: the ranks run different builds of
  // tf_smb, or a bug. Every rank stops, saying what came.
  const Status unreadable(Code::kInternal,
                          "rank " + std::to_string(rank_) + " got a message it cannot read from "
                          "rank " + std::to_string(from) + ": tag " + std::to_string(tag) +
                          ", " + std::to_string(message.size()) +
                          " bytes (do all ranks run the same tf_smb build?)");
  SendFailure(unreadable);
  Fail(unreadable);
}

void TransportLink::DeliverToRankZero(int from, std::vector<char> message) {
  std::function<void(int, std::vector<char>)> receiver;
  {
    std::lock_guard<std::mutex> lock(mu_);
    receiver = rank_zero_receiver_;
  }
  if (receiver) {
    receiver(from, std::move(message));
  } else {
    std::fprintf(stderr, "tf_smb: rank 0 dropped %zu bytes from rank %d: nothing takes them\n",
                 message.size(), from);
  }
}

void TransportLink::Offer(int node, const std::vector<uint64_t>& message) {
  for (const Decision& decision : decider_->Offer(node, message)) {
    for (int n = 1; n < nodes_; ++n) {
      Send(JobRank(n, 0), kTagDecision, Words({decision.number, decision.key}));
    }
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      decisions_.push_back(decision.key);
      wake = wake_cb_;
    }
    if (wake) wake();
  }
}

void TransportLink::OfferCandidates(const std::vector<uint64_t>& keys) {
  std::lock_guard<std::mutex> lock(mu_);
  awaiting_ = keys.size();
  std::vector<uint64_t> message;
  message.reserve(keys.size() + 1);
  message.push_back(applied_);
  message.insert(message.end(), keys.begin(), keys.end());
  if (message == last_offer_) return;
  last_offer_ = message;
  offer_ = std::move(message);
  offer_pending_ = true;
  work_cv_.notify_all();
}

bool TransportLink::NextDecision(uint64_t* key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (decisions_.empty()) return false;
  *key = decisions_.front();
  decisions_.pop_front();
  ++applied_;
  if (awaiting_ > 0) --awaiting_;
  return true;
}

void TransportLink::SetFailure(const Status& failure) {
  if (failure_.ok() && !failure.ok()) failure_ = failure;
  done_cv_.notify_all();
}

void TransportLink::Fail(const Status& failure) {
  std::function<void(const Status&)> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    SetFailure(failure);
    failed = failed_cb_;
  }
  if (failed) failed(failure);
}

void TransportLink::SendFailure(const Status& failure) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.ok()) return;  // failed already: the others know
  SetFailure(failure);
  failure_to_send_ = failure;
  work_cv_.notify_all();
}

void TransportLink::SetCallbacks(std::function<void(const Status&)> failed,
                                 std::function<void()> wake,
                                 std::function<Status()> local_failure) {
  std::lock_guard<std::mutex> lock(mu_);
  failed_cb_ = std::move(failed);
  wake_cb_ = std::move(wake);
  local_failure_cb_ = std::move(local_failure);
}

Status TransportLink::Run(const std::shared_ptr<Op>& op, const std::string& what,
                          double timeout_s) {
  SMB_RETURN_IF_ERROR(Enqueue(op));
  return Await(*op, what, timeout_s);
}

Status TransportLink::Enqueue(const std::shared_ptr<Op>& op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) return failure_;
    if (!lost_names_.empty()) return LostCollective();
    queue_.push_back(op);
  }
  work_cv_.notify_all();
  return Status::Ok();
}

Status TransportLink::Await(const Op& op, const std::string& what, double timeout_s) {
  std::function<Status()> local_failure;
  {
    std::lock_guard<std::mutex> lock(mu_);
    local_failure = local_failure_cb_;
  }
  const double deadline = MonotonicSeconds() + timeout_s;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      done_cv_.wait_for(lock, std::chrono::duration<double>(kWaitSliceS),
                        [&] { return op.done || !failure_.ok(); });
      if (op.done) {
        if (op.error.ok()) return Status::Ok();
        peers_lost_ = true;
        const Status failed(Code::kAborted, "rank " + std::to_string(rank_) + " (node " +
                                                std::to_string(node_) + ") lost its link to " +
                                                "the other nodes in " + what + ": " +
                                                op.error.message());
        SetFailure(failed);
        return failed;
      }
      if (!failure_.ok()) return failure_;
      // A collective with a lost rank never completes.
      if (!lost_names_.empty()) return LostCollective();
    }
    if (local_failure) {
      Status failed = local_failure();
      if (!failed.ok()) return failed;
    }
    if (MonotonicSeconds() >= deadline) {
      std::string others;
      for (int n = 0; n < nodes_; ++n) {
        if (n == node_) continue;
        others += (others.empty() ? "" : ", ") + std::to_string(JobRank(n, local_rank_));
      }
      return Status(Code::kDeadlineExceeded,
                    "rank " + std::to_string(rank_) + " (node " + std::to_string(node_) +
                        ") timed out after " + std::to_string(static_cast<int>(timeout_s)) +
                        "s in " + what + " waiting for rank(s) " + others + " on other nodes");
    }
  }
}

void TransportLink::SetSegmentServer(SegmentServer server) {
  std::lock_guard<std::mutex> lock(mu_);
  server_ = std::move(server);
}

Status TransportLink::CallSegmentServer(int home, const SegmentRequest& request,
                                        const void* payload, size_t payload_bytes, void* reply,
                                        size_t reply_bytes, double timeout_s) {
  // The id first: the message is built once, outside the lock.
  const uint64_t id = next_call_++;
  std::vector<char> message;
  SMB_RETURN_IF_ERROR(EncodeSegmentRequest(id, request, payload, payload_bytes, &message));
  PendingCall call{reply, reply_bytes, -1};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) return failure_;
    // The home node's rank with this local rank serves it (on a node of fewer
    // ranks, the one it wraps to), or the next live one.
    const int home_size = LocalSize(home);
    for (int k = 0; k < home_size && call.server < 0; ++k) {
      const int r = JobRank(home, (local_rank_ + k) % home_size);
      if (!liveness_->lost(r)) call.server = r;
    }
    if (call.server < 0) {
      return Status(Code::kAborted, "every rank of node " + std::to_string(home) +
                                        ", the home of segment '" + request.name +
                                        "', was lost");
    }
    calls_[id] = &call;
  }
  const int server = call.server;
  Post(server, kTagSegmentRequest, std::move(message));
  std::function<Status()> local_failure;
  {
    std::lock_guard<std::mutex> lock(mu_);
    local_failure = local_failure_cb_;
  }
  const double deadline = MonotonicSeconds() + timeout_s;
  for (;;) {
    Status failed;
    {
      std::unique_lock<std::mutex> lock(mu_);
      done_cv_.wait_for(lock, std::chrono::duration<double>(kWaitSliceS),
                        [&] { return call.done || !failure_.ok(); });
      if (call.done) return call.status;
      failed = failure_;
      if (failed.ok() && MonotonicSeconds() >= deadline) {
        failed = Status(Code::kDeadlineExceeded,
                        "rank " + std::to_string(rank_) + " timed out after " +
                            std::to_string(static_cast<int>(timeout_s)) +
                            "s waiting for rank " + std::to_string(server) + " (node " +
                            std::to_string(home) + ") to serve segment '" + request.name + "'");
      }
      if (!failed.ok()) {
        calls_.erase(id);  // a late reply finds no one to write to
        return failed;
      }
    }
    if (local_failure) {
      failed = local_failure();
      if (!failed.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        calls_.erase(id);
        return failed;
      }
    }
  }
}

bool TransportLink::Serve(int from, const std::vector<char>& message) {
  SegmentServer server;
  {
    std::lock_guard<std::mutex> lock(mu_);
    server = server_;
  }
  if (!server) return false;
  uint64_t id = 0;
  SegmentRequest request;
  const char* payload = nullptr;
  size_t payload_bytes = 0;
  std::vector<char> data;
  Status status;
  if (!DecodeSegmentRequest(message, &id, &request, &payload, &payload_bytes)) {
    status = InvalidArgument("a segment request of " + std::to_string(message.size()) + " bytes");
  } else if (const double quiet_s = MonotonicSeconds() - last_heartbeats_s_;
             ChangesValues(request) && quiet_s >= kHeartbeatS + lost_after_s_ / 2) {
    // This rank said nothing for that long (its process was stopped or
    // starved, or this thread was held up): the caller may have counted it
    // lost and sent this again to another rank of this node, which shares
    // the box. Applying it here too would count it twice; a caller that still
    // waits asks again (SegmentTable retries kAborted), and gets an answer.
    status = Status(Code::kAborted,
                    "rank " + std::to_string(rank_) + " (node " + std::to_string(node_) +
                        ") sent nothing for " + std::to_string(static_cast<int>(quiet_s)) +
                        " s, so the caller may have sent this request again elsewhere: not "
                        "applied, ask again");
  } else {
    status = server(request, payload, payload_bytes, &data);
  }
  std::vector<char> reply = EncodeSegmentReply(id, status, data);
  Send(from, kTagSegmentReply, std::move(reply));
  return true;
}

void TransportLink::Answer(const std::vector<char>& message) {
  uint64_t id = 0;
  Status status;
  const char* data = nullptr;
  size_t data_bytes = 0;
  if (!DecodeSegmentReply(message, &id, &status, &data, &data_bytes)) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(id);
  if (it == calls_.end()) return;  // its caller gave up
  PendingCall* call = it->second;
  calls_.erase(it);
  if (!status.ok()) {
    call->status = std::move(status);
  } else if (data_bytes != call->reply_bytes) {
    call->status = Internal("a segment reply of " + std::to_string(data_bytes) +
                            " bytes, expected " + std::to_string(call->reply_bytes));
  } else if (data_bytes != 0) {
    std::memcpy(call->reply, data, data_bytes);
  }
  call->done = true;
  done_cv_.notify_all();
}

void TransportLink::PublishClock(uint64_t steps, uint64_t phase) {
  for (int n = 0; n < nodes_; ++n) {
    if (n == node_) continue;
    for (int local = 0; local < LocalSize(n); ++local) {
      Post(JobRank(n, local), kTagClock, Words({steps, phase}));
    }
  }
}

std::vector<RemoteClock> TransportLink::RemoteClocks() const {
  std::vector<RemoteClock> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (int r = 0; r < world_; ++r) {
    if (node_of_[r] == node_) continue;
    auto it = clocks_.find(r);
    out.push_back(it == clocks_.end() ? RemoteClock{r, 0, 0} : it->second);
    if (liveness_->lost(r)) out.back().phase = kPhaseDoneForGood;  // it will not tick again
  }
  return out;
}

Status TransportLink::AllReduceSum(DType dtype, void* data, size_t count, double timeout_s) {
  std::shared_ptr<LinkOp> op;
  SMB_RETURN_IF_ERROR(StartAllReduceSum(dtype, data, count, &op));
  return Wait(op, timeout_s);
}

Status TransportLink::Wait(const std::shared_ptr<LinkOp>& op, double timeout_s) {
  if (op == nullptr) return Status::Ok();  // nothing was started
  return Await(static_cast<const Op&>(*op), "the cross-node all-reduce", timeout_s);
}

Status TransportLink::StartAllReduceSum(DType dtype, void* data, size_t count,
                                        std::shared_ptr<LinkOp>* started) {
  started->reset();
  if (nodes_ == 1 || count == 0) return Status::Ok();
  if (local_rank_ >= streams_) return NoCounterparts();
  auto run = std::make_shared<Op>();
  run->start = [=](Transport& transport, std::unique_ptr<Transfer>* transfer) {
    return transport.StartAllReduceSum(dtype, data, count, transfer);
  };
  SMB_RETURN_IF_ERROR(Enqueue(run));
  *started = std::move(run);
  return Status::Ok();
}

Status TransportLink::AllGather(const void* in, size_t bytes, void* out, double timeout_s) {
  if (nodes_ == 1) {
    std::memcpy(out, in, bytes);
    return Status::Ok();
  }
  if (local_rank_ >= streams_) return NoCounterparts();
  auto run = std::make_shared<Op>();
  run->buffer.resize(bytes * (nodes_ + 1));
  std::memcpy(run->buffer.data(), in, bytes);
  char* base = run->buffer.data();
  run->start = [=](Transport& transport, std::unique_ptr<Transfer>* transfer) {
    return transport.StartAllGather(base, bytes, base + bytes, transfer);
  };
  SMB_RETURN_IF_ERROR(Run(run, "the cross-node agreement", timeout_s));
  std::memcpy(out, run->buffer.data() + bytes, bytes * nodes_);
  return Status::Ok();
}

Status TransportLink::Broadcast(void* data, size_t bytes, int root, double timeout_s) {
  if (nodes_ == 1 || bytes == 0) return Status::Ok();
  if (local_rank_ >= streams_) return NoCounterparts();
  auto run = std::make_shared<Op>();
  run->buffer.assign(static_cast<char*>(data), static_cast<char*>(data) + bytes);
  char* base = run->buffer.data();
  run->start = [=](Transport& transport, std::unique_ptr<Transfer>* transfer) {
    return transport.StartBroadcast(base, bytes, root, transfer);
  };
  SMB_RETURN_IF_ERROR(Run(run, "the cross-node broadcast", timeout_s));
  std::memcpy(data, run->buffer.data(), bytes);
  return Status::Ok();
}

// Links alive in this process, stopped (the transport finished) at exit.
std::mutex links_mu;
std::vector<std::weak_ptr<TransportLink>>& Links() {
  // Constructed before the atexit handler is registered: destroyed after it runs.
  static std::vector<std::weak_ptr<TransportLink>> links;
  return links;
}

void StopLinksAtExit() {
  std::vector<std::shared_ptr<TransportLink>> alive;
  {
    std::lock_guard<std::mutex> lock(links_mu);
    for (auto& weak : Links()) {
      if (auto link = weak.lock()) alive.push_back(link);
    }
  }
  // Newest first: a process set's link finishes before the job's, which
  // finalizes the transport (MPI) under it.
  for (auto it = alive.rbegin(); it != alive.rend(); ++it) (*it)->Stop();
}

}  // namespace

Status StartTransportLink(std::unique_ptr<Transport> transport, const LinkOptions& options,
                          std::shared_ptr<NodeLink>* out) {
  auto link = std::make_shared<TransportLink>(std::move(transport));
  Status started = link->Begin(options);
  if (!started.ok()) return started;
  {
    std::lock_guard<std::mutex> lock(links_mu);
    if (Links().empty()) std::atexit(StopLinksAtExit);
    Links().push_back(link);
  }
  *out = std::move(link);
  return Status::Ok();
}

}  // namespace smb
