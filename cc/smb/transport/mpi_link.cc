#include "cc/smb/transport/mpi_link.h"

#ifndef TF_SMB_WITH_MPI

namespace smb {

bool MpiLinkAvailable() { return false; }

Status StartMpiLink(const MpiLinkOptions&, std::shared_ptr<NodeLink>*) {
  return Status(Code::kInternal,
                "this job spans several nodes, but tf_smb's library was built without MPI "
                "(mpi.h was not found when it was compiled): install Open MPI's development "
                "files (apt-get install libopenmpi-dev) and remove ~/.cache/tf_smb/ops (or "
                "reinstall tf_smb) so that it is rebuilt with MPI");
}

}  // namespace smb

#else  // TF_SMB_WITH_MPI

#include <mpi.h>
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

#include "cc/smb/process.h"

namespace smb {
namespace {

// Point-to-point control messages (on a duplicate of MPI_COMM_WORLD, so they
// never match a collective's traffic).
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
// heard from for kLostAfterS is lost (its node died or was cut off). Only
// matters where mpirun lets the others run on (--enable-recovery): by
// default mpirun ends the whole job when a rank dies.
constexpr double kHeartbeatS = 0.5;
constexpr double kLostAfterS = 10;
// A watchdog tick this much later than due (the process was stopped or
// starved), or an MPI call of the link's thread this long that then ended (a
// blocking receive of a large message): the others' silence meanwhile says
// nothing.
constexpr double kStalledS = 2;
// The link's thread inside one MPI call this long is stuck there for good.
constexpr double kStuckS = 3 * kLostAfterS;

// A segment request on the wire: this header, then the payload.
struct WireRequest {
  uint64_t id;
  int32_t kind, dtype, num_dims, rule;
  uint32_t write, consistent, read_back, unused;
  double learning_rate, momentum;
  int64_t dims[8];
  char name[128];
};
// A reply: this header, then the data (a read's value).
struct WireReply {
  uint64_t id;
  int32_t code;
  uint32_t message_len;
  char message[496];
};

std::vector<char> Words(const std::vector<uint64_t>& words) {
  std::vector<char> bytes(words.size() * sizeof(uint64_t));
  if (!words.empty()) std::memcpy(bytes.data(), words.data(), bytes.size());
  return bytes;
}

constexpr double kWaitSliceS = 0.02;  // how often waiters look at the job's failure
constexpr double kFailedFinalizeWaitS = 60;  // exit's wait for MPI_Finalize after a failure

std::string MpiError(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, len);
}

// dst = src + dst, for float16/bfloat16 carried as 16-bit words.
void SumHalf(void* in, void* inout, int* len, MPI_Datatype*) {
  SumInto(DType::kFloat16, inout, in, inout, static_cast<size_t>(*len));
}
void SumBFloat16(void* in, void* inout, int* len, MPI_Datatype*) {
  SumInto(DType::kBFloat16, inout, in, inout, static_cast<size_t>(*len));
}

// One MPI operation a caller waits for, started and completed on the thread.
struct Op : LinkOp {
  std::function<int(MPI_Request*)> start;
  MPI_Request request = MPI_REQUEST_NULL;
  bool done = false;
  int error = MPI_SUCCESS;
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

class MpiLink : public NodeLink, public std::enable_shared_from_this<MpiLink> {
 public:
  Status Begin(const MpiLinkOptions& options);
  void Stop();
  ~MpiLink() override { Stop(); }

  int node() const override { return node_; }
  int nodes() const override { return nodes_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  int job_rank() const override { return rank_; }
  int job_world() const override { return world_; }
  int JobRank(int node, int local) const override { return job_rank_of_[node * local_size_ + local]; }
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
  void SendToRankZero(std::vector<char> bytes) override { Post(0, kTagToRankZero, std::move(bytes)); }
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
    for (int local = 0; local < local_size_; ++local) {
      if (!lost_[JobRank(node, local)]) return false;
    }
    return true;
  }

 private:
  Status Setup(const MpiLinkOptions& options);  // on the thread
  // The thread; `self` keeps the link alive while it runs.
  static void Loop(std::shared_ptr<MpiLink> self, MpiLinkOptions options);
  void Work(const MpiLinkOptions& options);
  // The watchdog thread: finds the other nodes' silent ranks, and notices the
  // link's thread stuck inside MPI (Open MPI may hang after a peer dies).
  void Watch();
  void StopWatch();
  Status Run(const std::shared_ptr<Op>& op, const std::string& what, double timeout_s);
  Status Enqueue(const std::shared_ptr<Op>& op);
  Status Await(const Op& op, const std::string& what, double timeout_s);
  void SetFailure(const Status& failure);  // mu_ held
  // The job failed here (a lost rank, or another rank's word): records it and
  // tells the group (failed_cb_). mu_ not held.
  void Fail(const Status& failure);
  Status LostCollective() const {  // mu_ held
    return Status(Code::kAborted, "rank " + std::to_string(rank_) +
                                      ": a collective across nodes cannot run after rank(s) " +
                                      lost_names_ + " were lost");
  }
  // On the thread:
  bool Receive();
  void Offer(int node, const std::vector<uint64_t>& message);
  void Decide();
  // Skips a lost rank unless `even_if_lost`.
  void Send(int to, int tag, std::vector<char> bytes, bool even_if_lost = false);
  // From any thread: the link's thread sends it.
  void Post(int to, int tag, std::vector<char> bytes);
  // False: no server yet (this rank is still starting); ask again later.
  bool Serve(int from, const std::vector<char>& message);
  void Answer(const std::vector<char>& message);

  // Layout, fixed once Begin() returns.
  int rank_ = 0, world_ = 1, node_ = 0, nodes_ = 1, local_rank_ = 0, local_size_ = 1;
  std::vector<int> job_rank_of_;      // [node * local_size + local] -> job rank
  std::vector<int> node_of_, local_of_;  // job rank -> node, local rank
  MPI_Comm cross_ = MPI_COMM_NULL;    // my counterparts, ranked by node
  MPI_Comm control_ = MPI_COMM_NULL;  // point-to-point control messages
  MPI_Op sum_half_ = MPI_OP_NULL, sum_bfloat16_ = MPI_OP_NULL;

  std::thread thread_;
  std::thread watchdog_;
  std::atomic<uint64_t> passes_{0};  // of the thread's loop, for the watchdog
  std::atomic<bool> polling_{true};  // the thread is in its loop (not finalizing)
  mutable std::mutex mu_;
  std::condition_variable watch_cv_;  // wakes the watchdog to end
  bool watch_stop_ = false;
  // The thread made no pass for kStuckS while the process ran: it is stuck
  // inside MPI, and the exit does not wait for it (mu_).
  bool stuck_ = false;
  std::condition_variable work_cv_;  // wakes the thread
  std::condition_variable done_cv_;  // wakes callers
  bool started_ = false;             // Setup finished (see setup_)
  Status setup_;
  bool stop_ = false;
  bool finished_ = false;            // the thread returned
  double finalize_wait_s_ = 600;     // how long exit waits for MPI_Finalize
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
  // Node 0's leader only (thread only): every node's offer and the keys
  // decided that an offer may still name.
  std::vector<std::vector<uint64_t>> offers_;
  std::vector<uint64_t> applied_by_node_;
  std::unordered_map<uint64_t, uint64_t> decided_;  // key -> decision number
  uint64_t decisions_made_ = 0;
  // Sends in flight (thread only), and sends other threads posted (mu_).
  struct Sending {
    MPI_Request request;
    int to, tag;
    std::shared_ptr<std::vector<char>> buffer;
  };
  std::vector<Sending> sends_;
  struct Outgoing {
    int to, tag;
    std::vector<char> bytes;
  };
  std::deque<Outgoing> outbox_;
  // The memory server, segment calls waiting for replies, other nodes' clocks (mu_).
  SegmentServer server_;
  uint64_t next_call_ = 1;
  std::unordered_map<uint64_t, PendingCall*> calls_;
  std::unordered_map<int, RemoteClock> clocks_;
  // Exit: a rank keeps serving its segments until every rank is leaving
  // (thread only).
  std::deque<std::pair<int, std::vector<char>>> unserved_;  // requests before a server
  bool sent_leaving_ = false;
  int leaving_ = 0;
  // Liveness of the other nodes' ranks, by job rank: the thread hears, the
  // watchdog judges (atomics: both read them without mu_).
  std::unique_ptr<std::atomic<double>[]> last_heard_;
  std::unique_ptr<std::atomic<bool>[]> left_;  // sent kTagLeaving
  std::unique_ptr<std::atomic<bool>[]> lost_;  // set by the watchdog, under mu_
  std::vector<bool> told_lost_;     // sent kTagDeclaredLost (thread only)
  double next_heartbeat_ = 0;
  std::atomic<bool> peers_lost_{false};  // a rank is gone: never MPI_Finalize
  std::atomic<bool> keep_going_{false};  // see KeepGoingWithoutLostRanks
  std::string lost_names_;               // "2 (node 1), 3 (node 1)" (mu_)
  void CheckLiveness(double now, bool link_stuck);  // on the watchdog
  bool Lost(int rank) const { return lost_[rank]; }
  // Every other rank sent kTagLeaving or is lost (thread only).
  bool OthersGone() const;
};

Status MpiLink::Begin(const MpiLinkOptions& options) {
  finalize_wait_s_ = options.timeout_s;
  thread_ = std::thread(&MpiLink::Loop, shared_from_this(), options);
  std::unique_lock<std::mutex> lock(mu_);
  // MPI_Init waits for every rank: one that never joins must not hang this one.
  if (!done_cv_.wait_for(lock, std::chrono::duration<double>(options.timeout_s),
                         [&] { return started_; })) {
    thread_.detach();  // it keeps the link alive; the OS ends it
    return Status(Code::kDeadlineExceeded,
                  "rank " + std::to_string(options.rank) + " timed out after " +
                      std::to_string(static_cast<int>(options.timeout_s)) +
                      "s starting MPI between nodes: do all " + std::to_string(options.world) +
                      " ranks create tf_smb.SMBStrategy() (or call tf_smb.init())?");
  }
  if (setup_.ok() && nodes_ > 1) watchdog_ = std::thread(&MpiLink::Watch, this);
  return setup_;
}

Status MpiLink::Setup(const MpiLinkOptions& options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) return Status(Code::kInternal, "MPI_Init_thread failed: " + MpiError(rc));
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_);
  if (rank_ != options.rank || world_ != options.world) {
    return InvalidArgument("the launcher's environment says rank " + std::to_string(options.rank) +
                           " of " + std::to_string(options.world) + ", but MPI says rank " +
                           std::to_string(rank_) + " of " + std::to_string(world_) +
                           " (were these processes started by one mpirun/srun?)");
  }
  // The ranks that share memory with this one are its node.
  MPI_Comm node_comm;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node_comm);
  MPI_Comm_rank(node_comm, &local_rank_);
  MPI_Comm_size(node_comm, &local_size_);
  MPI_Comm leaders;
  MPI_Comm_split(MPI_COMM_WORLD, local_rank_ == 0 ? 0 : MPI_UNDEFINED, rank_, &leaders);
  int where[2] = {0, 0};  // node index, nodes
  if (local_rank_ == 0) {
    MPI_Comm_rank(leaders, &where[0]);
    MPI_Comm_size(leaders, &where[1]);
    MPI_Comm_free(&leaders);
  }
  MPI_Bcast(where, 2, MPI_INT, 0, node_comm);
  MPI_Comm_free(&node_comm);
  node_ = where[0];
  nodes_ = where[1];
  // Every rank's place: (node, local rank, local size).
  const int mine[3] = {node_, local_rank_, local_size_};
  std::vector<int> all(3 * static_cast<size_t>(world_));
  MPI_Allgather(mine, 3, MPI_INT, all.data(), 3, MPI_INT, MPI_COMM_WORLD);
  std::string sizes;
  bool uneven = false;
  std::vector<int> per_node(nodes_, 0);
  for (int r = 0; r < world_; ++r) {
    per_node[all[3 * r]] = all[3 * r + 2];
    if (all[3 * r + 2] != local_size_) uneven = true;
  }
  if (uneven) {
    for (int n = 0; n < nodes_; ++n) {
      sizes += (n ? ", " : "") + std::to_string(per_node[n]) + " on node " + std::to_string(n);
    }
    return InvalidArgument("every node of a job must run the same number of workers, got " + sizes);
  }
  job_rank_of_.assign(world_, 0);
  node_of_.assign(world_, 0);
  local_of_.assign(world_, 0);
  for (int r = 0; r < world_; ++r) {
    node_of_[r] = all[3 * r];
    local_of_[r] = all[3 * r + 1];
    job_rank_of_[node_of_[r] * local_size_ + local_of_[r]] = r;
  }
  MPI_Comm_split(MPI_COMM_WORLD, local_rank_, node_, &cross_);
  MPI_Comm_set_errhandler(cross_, MPI_ERRORS_RETURN);
  MPI_Comm_dup(MPI_COMM_WORLD, &control_);
  MPI_Comm_set_errhandler(control_, MPI_ERRORS_RETURN);
  MPI_Op_create(&SumHalf, /*commute=*/1, &sum_half_);
  MPI_Op_create(&SumBFloat16, /*commute=*/1, &sum_bfloat16_);
  if (node_ == 0 && local_rank_ == 0) {
    offers_.assign(nodes_, {});
    applied_by_node_.assign(nodes_, 0);
  }
  last_heard_ = std::make_unique<std::atomic<double>[]>(world_);
  left_ = std::make_unique<std::atomic<bool>[]>(world_);
  lost_ = std::make_unique<std::atomic<bool>[]>(world_);
  const double now = MonotonicSeconds();
  for (int r = 0; r < world_; ++r) {
    last_heard_[r] = now;
    left_[r] = false;
    lost_[r] = false;
  }
  told_lost_.assign(world_, false);
  return Status::Ok();
}

// Named, so that a debugger, top -H or a test finds them.
void NameThisThread(const char* name) {
#ifdef __linux__
  pthread_setname_np(pthread_self(), name);
#endif
}

void MpiLink::Loop(std::shared_ptr<MpiLink> self, MpiLinkOptions options) {
  NameThisThread("smb_link");
  self->Work(options);
}

void MpiLink::Work(const MpiLinkOptions& options) {
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
  // Sleeps grow while nothing happens: up to 1 ms when idle, but only up to
  // 50 us while anything is in flight (an MPI operation, a segment call, or
  // an offer awaiting its decision): MPI progresses, and a message is seen,
  // only when this thread polls. (Measured: a fit step of a 0.67M-parameter
  // MLP, 2 nodes x 2 workers, 5 Gbit/s, took 33 ms at 1 ms, 24 ms at 50 us.)
  constexpr double kIdleSleepS = 1e-3, kInFlightSleepS = 50e-6;
  double idle_s = 0;
  for (;;) {
    ++passes_;
    bool busy = false;
    std::deque<std::shared_ptr<Op>> starting;
    std::vector<uint64_t> offer;
    bool have_offer = false, stop = false;
    Status to_send;
    std::deque<Outgoing> outgoing;
    {
      std::lock_guard<std::mutex> lock(mu_);
      starting.swap(queue_);
      if (offer_pending_) {
        offer.swap(offer_);
        offer_pending_ = false;
        have_offer = true;
      }
      to_send = failure_to_send_;
      failure_to_send_ = Status::Ok();
      stop = stop_;
      outgoing.swap(outbox_);
    }
    for (Outgoing& o : outgoing) {
      Send(o.to, o.tag, std::move(o.bytes));
      busy = true;
    }
    if (!to_send.ok()) {
      const std::string& m = to_send.message();
      std::vector<uint64_t> words(1 + (m.size() + 8) / 8, 0);
      words[0] = static_cast<uint64_t>(to_send.code());
      std::memcpy(words.data() + 1, m.data(), m.size());
      for (int r = 0; r < world_; ++r) {
        if (r != rank_) Send(r, kTagFailure, Words(words));
      }
      busy = true;
    }
    for (auto& op : starting) {
      op->error = op->start(&op->request);
      if (op->error != MPI_SUCCESS) {
        std::lock_guard<std::mutex> lock(mu_);
        op->done = true;
        done_cv_.notify_all();
      } else {
        active_.push_back(op);
      }
      busy = true;
    }
    if (have_offer) {
      if (node_ == 0) {
        Offer(0, offer);
      } else {
        Send(JobRank(0, 0), kTagCandidates, Words(offer));
      }
      busy = true;
    }
    for (size_t i = 0; i < active_.size();) {
      int flag = 0;
      const int rc = MPI_Test(&active_[i]->request, &flag, MPI_STATUS_IGNORE);
      if (rc == MPI_SUCCESS && !flag) {
        ++i;
        continue;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        active_[i]->error = rc;
        active_[i]->done = true;
      }
      done_cv_.notify_all();
      active_.erase(active_.begin() + i);
      busy = true;
    }
    for (size_t i = 0; i < sends_.size();) {
      int flag = 0;
      const int rc = MPI_Test(&sends_[i].request, &flag, MPI_STATUS_IGNORE);
      if (rc == MPI_SUCCESS && !flag) {
        ++i;
        continue;
      }
      sends_.erase(sends_.begin() + i);
    }
    while (Receive()) busy = true;
    // Requests that came before this rank's server existed, in order.
    while (!unserved_.empty() && Serve(unserved_.front().first, unserved_.front().second)) {
      unserved_.pop_front();
      busy = true;
    }
    if (nodes_ > 1) {
      const double now = MonotonicSeconds();
      if (now >= next_heartbeat_) {
        next_heartbeat_ = now + kHeartbeatS;
        // One heartbeat in flight per rank: to a rank that died, each new
        // send would be another failed connect in Open MPI's TCP transport.
        std::vector<bool> beating(world_, false);
        for (const Sending& s : sends_) {
          if (s.tag == kTagHeartbeat) beating[s.to] = true;
        }
        for (int r = 0; r < world_; ++r) {
          if (node_of_[r] != node_ && !beating[r]) Send(r, kTagHeartbeat, {});
        }
      }
    }
    if (stop) {
      const bool failed = !Failure().ok();
      if (!failed && nodes_ > 1 && !sent_leaving_) {
        for (int r = 0; r < world_; ++r) {
          if (r != rank_) Send(r, kTagLeaving, {});
        }
        sent_leaving_ = true;
        busy = true;
      }
      const bool others_left = nodes_ == 1 || OthersGone();
      // Sends to lost ranks never complete: they do not hold the exit.
      const bool sent = std::all_of(sends_.begin(), sends_.end(),
                                    [&](const Sending& s) { return Lost(s.to); });
      if (failed || (others_left && active_.empty() && sent)) break;
    }
    if (busy) {
      idle_s = 0;
      continue;
    }
    std::unique_lock<std::mutex> lock(mu_);
    const bool in_flight = !active_.empty() || !calls_.empty() || awaiting_ > 0;
    idle_s = std::min(in_flight ? kInFlightSleepS : kIdleSleepS, std::max(2e-5, idle_s * 2));
    work_cv_.wait_for(lock, std::chrono::duration<double>(idle_s), [&] {
      // Once leaving, a stopping link still sleeps between polls.
      return !queue_.empty() || offer_pending_ || (stop_ && !sent_leaving_) ||
             !failure_to_send_.ok() || !outbox_.empty();
    });
  }
  polling_ = false;  // MPI_Finalize may block a while: not a stuck call
  // Every rank finalizes (else mpirun calls the job failed), unless an
  // operation is stuck on a peer, or a peer is gone: MPI_Finalize would wait
  // for it forever.
  if (active_.empty() && !peers_lost_) {
    MPI_Op_free(&sum_half_);
    MPI_Op_free(&sum_bfloat16_);
    MPI_Comm_free(&cross_);
    MPI_Comm_free(&control_);
    MPI_Finalize();
  }
  std::lock_guard<std::mutex> lock(mu_);
  finished_ = true;
  done_cv_.notify_all();
}

bool MpiLink::OthersGone() const {
  for (int r = 0; r < world_; ++r) {
    // Once a rank is lost nobody finalizes, and this node's ranks never call
    // this rank's server (they share the box): only other nodes' ranks count.
    const bool needed = !(peers_lost_ && node_of_[r] == node_);
    if (r != rank_ && needed && !left_[r] && !lost_[r]) return false;
  }
  return true;
}

void MpiLink::Watch() {
  NameThisThread("smb_watchdog");
  const auto excuse_silence = [this](double now) {  // nobody could be heard
    for (int r = 0; r < world_; ++r) last_heard_[r] = std::max(last_heard_[r].load(), now);
  };
  uint64_t seen = passes_;
  double last_tick = MonotonicSeconds(), moved_at = last_tick;
  std::unique_lock<std::mutex> lock(mu_);
  while (!watch_stop_) {
    watch_cv_.wait_for(lock, std::chrono::duration<double>(kHeartbeatS));
    // !polling_: the link thread left its loop (finalizing, or failed).
    if (watch_stop_ || !polling_) break;
    const double now = MonotonicSeconds();
    const uint64_t passes = passes_;
    if (now - last_tick > kStalledS) {  // the process was stopped or starved
      excuse_silence(now);
      moved_at = now;
    }
    if (passes != seen) {
      if (now - moved_at > kStalledS) excuse_silence(now);  // a long MPI call ended
      moved_at = now;
    }
    seen = passes;
    last_tick = now;
    // The thread polls at least every millisecond; a long pass is a blocking
    // MPI call (receiving a large message), and one that never returns is
    // stuck (seen with Open MPI 4.1's TCP transport after a peer died
    // mid-message): that thread hears no one any more.
    const double still_s = now - moved_at;
    const bool link_stuck = still_s >= kStuckS;
    if (link_stuck && !stuck_) {
      stuck_ = true;
      done_cv_.notify_all();  // the exit stops waiting for the thread
    }
    if (still_s > kStalledS && !link_stuck) continue;  // cannot hear: cannot judge yet
    lock.unlock();
    CheckLiveness(now, link_stuck);
    lock.lock();
  }
}

void MpiLink::StopWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    watch_stop_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

void MpiLink::CheckLiveness(double now, bool link_stuck) {
  if (!Failure().ok()) return;
  std::vector<int> silent;
  std::string lost;
  for (int r = 0; r < world_; ++r) {
    if (node_of_[r] == node_ || left_[r] || lost_[r] || now - last_heard_[r] < kLostAfterS) {
      continue;
    }
    silent.push_back(r);
    lost += (lost.empty() ? "" : ", ") + std::to_string(r) + " (node " +
            std::to_string(node_of_[r]) + ")";
  }
  if (silent.empty()) return;
  peers_lost_ = true;
  const std::string what =
      "rank(s) " + lost + " sent nothing for " + std::to_string(static_cast<int>(kLostAfterS)) +
      " s: lost (their node died or was cut off" +
      (link_stuck ? "; this rank's MPI thread is stuck in an MPI call, as Open MPI can be "
                    "after a peer died, so it hears no one)"
                  : ")");
  if (keep_going_) {
    // The asynchronous mode goes on without them: their clocks count as
    // finished, calls waiting on them end (SegmentTable moves the segments
    // of a node whose every rank is lost), and collectives across nodes fail.
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int r : silent) lost_[r] = true;
      lost_names_ += (lost_names_.empty() ? "" : ", ") + lost;
      for (auto it = calls_.begin(); it != calls_.end();) {
        PendingCall* call = it->second;
        if (!lost_[call->server]) {
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

void MpiLink::Stop() {
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
  // Never hang the exit on peers that are gone, nor on a thread stuck in MPI:
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

void MpiLink::Send(int to, int tag, std::vector<char> bytes, bool even_if_lost) {
  if (!even_if_lost && Lost(to)) return;  // nobody would take it
  auto buffer = std::make_shared<std::vector<char>>(std::move(bytes));
  MPI_Request request;
  if (MPI_Isend(buffer->data(), static_cast<int>(buffer->size()), MPI_BYTE, to, tag, control_,
                &request) == MPI_SUCCESS) {
    sends_.push_back({request, to, tag, std::move(buffer)});
  }
}

void MpiLink::Post(int to, int tag, std::vector<char> bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    outbox_.push_back({to, tag, std::move(bytes)});
  }
  work_cv_.notify_all();
}

bool MpiLink::Receive() {
  int flag = 0;
  MPI_Status status;
  if (MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, control_, &flag, &status) != MPI_SUCCESS || !flag) {
    return false;
  }
  int bytes = 0;
  MPI_Get_count(&status, MPI_BYTE, &bytes);
  std::vector<char> message(std::max(bytes, 1));
  MPI_Recv(message.data(), bytes, MPI_BYTE, status.MPI_SOURCE, status.MPI_TAG, control_,
           MPI_STATUS_IGNORE);
  message.resize(bytes);
  last_heard_[status.MPI_SOURCE] = MonotonicSeconds();
  if (status.MPI_TAG == kTagDeclaredLost) {
    // This rank was silent long enough for another to go on without it (it
    // stalled, or the network did): the others moved on, so it must stop,
    // loudly, rather than train on a copy of the parameters no one else sees.
    const Status failure(Code::kAborted,
                         "rank " + std::to_string(rank_) + " (node " + std::to_string(node_) +
                             ") sent nothing for " + std::to_string(static_cast<int>(kLostAfterS)) +
                             " s, so rank " + std::to_string(status.MPI_SOURCE) +
                             " went on without it (the asynchronous mode survives lost nodes); "
                             "this rank stops");
    // The others count this rank as gone and will not finalize with it:
    // MPI_Finalize would wait for them (the exit's whole failed-job wait).
    peers_lost_ = true;
    Fail(failure);
    return true;
  }
  if (Lost(status.MPI_SOURCE)) {
    if (!told_lost_[status.MPI_SOURCE]) {
      told_lost_[status.MPI_SOURCE] = true;
      Send(status.MPI_SOURCE, kTagDeclaredLost, {}, /*even_if_lost=*/true);
    }
    return true;  // what a lost rank says no longer counts
  }
  if (status.MPI_TAG == kTagHeartbeat) return true;
  if (status.MPI_TAG == kTagSegmentRequest) {
    if (!unserved_.empty() || !Serve(status.MPI_SOURCE, message)) {
      unserved_.emplace_back(status.MPI_SOURCE, std::move(message));
    }
    return true;
  }
  if (status.MPI_TAG == kTagSegmentReply) {
    Answer(message);
    return true;
  }
  if (status.MPI_TAG == kTagToRankZero) {
    std::function<void(int, std::vector<char>)> receiver;
    {
      std::lock_guard<std::mutex> lock(mu_);
      receiver = rank_zero_receiver_;
    }
    if (receiver) {
      receiver(status.MPI_SOURCE, std::move(message));
    } else {
      std::fprintf(stderr, "tf_smb: rank 0 dropped %d bytes from rank %d: nothing takes them\n",
                   bytes, status.MPI_SOURCE);
    }
    return true;
  }
  if (status.MPI_TAG == kTagLeaving) {
    if (!left_[status.MPI_SOURCE]) ++leaving_;
    left_[status.MPI_SOURCE] = true;
    return true;
  }
  std::vector<uint64_t> words(bytes / sizeof(uint64_t));
  if (!words.empty()) std::memcpy(words.data(), message.data(), words.size() * sizeof(uint64_t));
  const int count = static_cast<int>(words.size());
  if (status.MPI_TAG == kTagClock && count == 2) {
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      clocks_[status.MPI_SOURCE] = {status.MPI_SOURCE, words[0], words[1]};
      wake = wake_cb_;
    }
    if (wake) wake();
  } else if (status.MPI_TAG == kTagCandidates) {
    Offer(node_of_[status.MPI_SOURCE], words);
  } else if (status.MPI_TAG == kTagDecision && count == 2) {
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      decisions_.push_back(words[1]);
      wake = wake_cb_;
    }
    if (wake) wake();
  } else if (status.MPI_TAG == kTagFailure && count >= 1) {
    std::string text(reinterpret_cast<const char*>(words.data() + 1),
                     (words.size() - 1) * sizeof(uint64_t));
    text.resize(std::strlen(text.c_str()));
    Status failure(static_cast<Code>(words[0]), text);
    Fail(failure);
  }
  return true;
}

void MpiLink::Offer(int node, const std::vector<uint64_t>& message) {
  if (message.empty()) return;
  applied_by_node_[node] = message[0];
  offers_[node].assign(message.begin() + 1, message.end());
  Decide();
}

void MpiLink::Decide() {
  // Decisions every node has taken can no longer appear in any offer.
  const uint64_t taken = *std::min_element(applied_by_node_.begin(), applied_by_node_.end());
  for (auto it = decided_.begin(); it != decided_.end();) {
    it = it->second <= taken ? decided_.erase(it) : std::next(it);
  }
  auto offers = [&](int n, uint64_t key) {
    return std::find(offers_[n].begin(), offers_[n].end(), key) != offers_[n].end();
  };
  // The order is that of the first node still training (whose every rank has
  // not joined); a node whose every rank has joined takes any collective.
  int source = 0;
  while (source < nodes_ && offers(source, kAnyCollective)) ++source;
  // Every node has joined: only the join is left, which every node must offer.
  const bool training = source < nodes_;
  if (!training) source = 0;
  for (uint64_t key : offers_[source]) {
    if (key == kAnyCollective || decided_.count(key)) continue;
    bool everywhere = true;
    for (int n = 0; n < nodes_ && everywhere; ++n) {
      everywhere = offers(n, key) || (training && offers(n, kAnyCollective));
    }
    if (!everywhere) continue;
    decided_[key] = ++decisions_made_;
    for (int n = 1; n < nodes_; ++n) {
      Send(JobRank(n, 0), kTagDecision, Words({decisions_made_, key}));
    }
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      decisions_.push_back(key);
      wake = wake_cb_;
    }
    if (wake) wake();
  }
}

void MpiLink::OfferCandidates(const std::vector<uint64_t>& keys) {
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

bool MpiLink::NextDecision(uint64_t* key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (decisions_.empty()) return false;
  *key = decisions_.front();
  decisions_.pop_front();
  ++applied_;
  if (awaiting_ > 0) --awaiting_;
  return true;
}

void MpiLink::SetFailure(const Status& failure) {
  if (failure_.ok() && !failure.ok()) failure_ = failure;
  done_cv_.notify_all();
}

void MpiLink::Fail(const Status& failure) {
  std::function<void(const Status&)> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    SetFailure(failure);
    failed = failed_cb_;
  }
  if (failed) failed(failure);
}

void MpiLink::SendFailure(const Status& failure) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.ok()) return;  // failed already: the others know
  SetFailure(failure);
  failure_to_send_ = failure;
  work_cv_.notify_all();
}

void MpiLink::SetCallbacks(std::function<void(const Status&)> failed, std::function<void()> wake,
                           std::function<Status()> local_failure) {
  std::lock_guard<std::mutex> lock(mu_);
  failed_cb_ = std::move(failed);
  wake_cb_ = std::move(wake);
  local_failure_cb_ = std::move(local_failure);
}

Status MpiLink::Run(const std::shared_ptr<Op>& op, const std::string& what, double timeout_s) {
  SMB_RETURN_IF_ERROR(Enqueue(op));
  return Await(*op, what, timeout_s);
}

Status MpiLink::Enqueue(const std::shared_ptr<Op>& op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) return failure_;
    if (!lost_names_.empty()) return LostCollective();
    queue_.push_back(op);
  }
  work_cv_.notify_all();
  return Status::Ok();
}

Status MpiLink::Await(const Op& op, const std::string& what, double timeout_s) {
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
        if (op.error == MPI_SUCCESS) return Status::Ok();
        peers_lost_ = true;
        const Status failed(Code::kAborted, "rank " + std::to_string(rank_) + " (node " +
                                                std::to_string(node_) + ") lost its link to " +
                                                "the other nodes in " + what + ": " +
                                                MpiError(op.error));
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

void MpiLink::SetSegmentServer(SegmentServer server) {
  std::lock_guard<std::mutex> lock(mu_);
  server_ = std::move(server);
}

Status MpiLink::CallSegmentServer(int home, const SegmentRequest& request, const void* payload,
                                  size_t payload_bytes, void* reply, size_t reply_bytes,
                                  double timeout_s) {
  if (request.name.size() >= sizeof(WireRequest::name) || request.shape.size() > 8) {
    return InvalidArgument("segment name or shape too long for a remote call: '" +
                           request.name + "'");
  }
  WireRequest wire{};
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
  PendingCall call{reply, reply_bytes, -1};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) return failure_;
    // The home node's rank with this local rank serves it, or the next live one.
    for (int k = 0; k < local_size_ && call.server < 0; ++k) {
      const int r = JobRank(home, (local_rank_ + k) % local_size_);
      if (!lost_[r]) call.server = r;
    }
    if (call.server < 0) {
      return Status(Code::kAborted, "every rank of node " + std::to_string(home) +
                                        ", the home of segment '" + request.name +
                                        "', was lost");
    }
    wire.id = next_call_++;
    calls_[wire.id] = &call;
  }
  const int server = call.server;
  std::vector<char> message(sizeof wire + payload_bytes);
  std::memcpy(message.data(), &wire, sizeof wire);
  if (payload_bytes) std::memcpy(message.data() + sizeof wire, payload, payload_bytes);
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
        calls_.erase(wire.id);  // a late reply finds no one to write to
        return failed;
      }
    }
    if (local_failure) {
      failed = local_failure();
      if (!failed.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        calls_.erase(wire.id);
        return failed;
      }
    }
  }
}

bool MpiLink::Serve(int from, const std::vector<char>& message) {
  SegmentServer server;
  {
    std::lock_guard<std::mutex> lock(mu_);
    server = server_;
  }
  if (!server) return false;
  WireReply answer{};
  std::vector<char> data;
  Status status;
  if (message.size() < sizeof(WireRequest)) {
    status = InvalidArgument("a segment request of " + std::to_string(message.size()) + " bytes");
  } else {
    WireRequest wire;
    std::memcpy(&wire, message.data(), sizeof wire);
    answer.id = wire.id;
    SegmentRequest request;
    request.kind = static_cast<SegmentRequest::Kind>(wire.kind);
    request.name.assign(wire.name, strnlen(wire.name, sizeof wire.name));
    request.dtype = static_cast<DType>(wire.dtype);
    request.shape.assign(wire.dims, wire.dims + std::min(8, std::max(0, wire.num_dims)));
    request.write = wire.write != 0;
    request.consistent = wire.consistent != 0;
    request.read_back = wire.read_back != 0;
    request.rule = wire.rule;
    request.learning_rate = wire.learning_rate;
    request.momentum = wire.momentum;
    status = server(request, message.data() + sizeof wire, message.size() - sizeof wire, &data);
  }
  answer.code = static_cast<int32_t>(status.code());
  const std::string& text = status.message();
  answer.message_len = static_cast<uint32_t>(std::min(text.size(), sizeof answer.message));
  std::memcpy(answer.message, text.data(), answer.message_len);
  std::vector<char> reply(sizeof answer + (status.ok() ? data.size() : 0));
  std::memcpy(reply.data(), &answer, sizeof answer);
  if (status.ok() && !data.empty()) std::memcpy(reply.data() + sizeof answer, data.data(), data.size());
  Send(from, kTagSegmentReply, std::move(reply));
  return true;
}

void MpiLink::Answer(const std::vector<char>& message) {
  if (message.size() < sizeof(WireReply)) return;
  WireReply answer;
  std::memcpy(&answer, message.data(), sizeof answer);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(answer.id);
  if (it == calls_.end()) return;  // its caller gave up
  PendingCall* call = it->second;
  calls_.erase(it);
  const size_t data = message.size() - sizeof answer;
  if (answer.code != 0) {
    call->status = Status(static_cast<Code>(answer.code),
                          std::string(answer.message, std::min<size_t>(answer.message_len,
                                                                       sizeof answer.message)));
  } else if (data != call->reply_bytes) {
    call->status = Internal("a segment reply of " + std::to_string(data) + " bytes, expected " +
                            std::to_string(call->reply_bytes));
  } else if (data != 0) {
    std::memcpy(call->reply, message.data() + sizeof answer, data);
  }
  call->done = true;
  done_cv_.notify_all();
}

void MpiLink::PublishClock(uint64_t steps, uint64_t phase) {
  for (int n = 0; n < nodes_; ++n) {
    if (n == node_) continue;
    for (int local = 0; local < local_size_; ++local) {
      Post(JobRank(n, local), kTagClock, Words({steps, phase}));
    }
  }
}

std::vector<RemoteClock> MpiLink::RemoteClocks() const {
  std::vector<RemoteClock> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (int r = 0; r < world_; ++r) {
    if (node_of_[r] == node_) continue;
    auto it = clocks_.find(r);
    out.push_back(it == clocks_.end() ? RemoteClock{r, 0, 0} : it->second);
    if (lost_[r]) out.back().phase = kPhaseDoneForGood;  // it will not tick again
  }
  return out;
}

MPI_Datatype MpiType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return MPI_FLOAT;
    case DType::kFloat64: return MPI_DOUBLE;
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kUInt16: return MPI_UINT16_T;
    case DType::kInt32: return MPI_INT32_T;
    case DType::kInt64: return MPI_INT64_T;
    case DType::kInt8: return MPI_INT8_T;
    case DType::kUInt8: return MPI_UINT8_T;
    case DType::kInt16: return MPI_INT16_T;
  }
  return MPI_BYTE;
}

Status MpiLink::AllReduceSum(DType dtype, void* data, size_t count, double timeout_s) {
  std::shared_ptr<LinkOp> op;
  SMB_RETURN_IF_ERROR(StartAllReduceSum(dtype, data, count, &op));
  return Wait(op, timeout_s);
}

Status MpiLink::Wait(const std::shared_ptr<LinkOp>& op, double timeout_s) {
  if (op == nullptr) return Status::Ok();  // nothing was started
  return Await(static_cast<const Op&>(*op), "the cross-node all-reduce", timeout_s);
}

Status MpiLink::StartAllReduceSum(DType dtype, void* data, size_t count,
                                  std::shared_ptr<LinkOp>* started) {
  started->reset();
  if (nodes_ == 1 || count == 0) return Status::Ok();
  if (count > static_cast<size_t>(INT32_MAX)) {
    return InvalidArgument("a cross-node slice of " + std::to_string(count) +
                           " elements is too large for one MPI call");
  }
  MPI_Op op = dtype == DType::kFloat16    ? sum_half_
              : dtype == DType::kBFloat16 ? sum_bfloat16_
                                          : MPI_SUM;
  const MPI_Datatype type = MpiType(dtype);
  MPI_Comm comm = cross_;
  auto run = std::make_shared<Op>();
  run->start = [=](MPI_Request* request) {
    return MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), type, op, comm, request);
  };
  SMB_RETURN_IF_ERROR(Enqueue(run));
  *started = std::move(run);
  return Status::Ok();
}

Status MpiLink::AllGather(const void* in, size_t bytes, void* out, double timeout_s) {
  if (nodes_ == 1) {
    std::memcpy(out, in, bytes);
    return Status::Ok();
  }
  auto run = std::make_shared<Op>();
  run->buffer.resize(bytes * (nodes_ + 1));
  std::memcpy(run->buffer.data(), in, bytes);
  char* base = run->buffer.data();
  MPI_Comm comm = cross_;
  const int n = static_cast<int>(bytes);
  run->start = [=](MPI_Request* request) {
    return MPI_Iallgather(base, n, MPI_BYTE, base + n, n, MPI_BYTE, comm, request);
  };
  SMB_RETURN_IF_ERROR(Run(run, "the cross-node agreement", timeout_s));
  std::memcpy(out, run->buffer.data() + bytes, bytes * nodes_);
  return Status::Ok();
}

Status MpiLink::Broadcast(void* data, size_t bytes, int root, double timeout_s) {
  if (nodes_ == 1 || bytes == 0) return Status::Ok();
  if (bytes > static_cast<size_t>(INT32_MAX)) {
    return InvalidArgument("a cross-node broadcast of " + std::to_string(bytes) +
                           " bytes is too large for one MPI call");
  }
  auto run = std::make_shared<Op>();
  run->buffer.assign(static_cast<char*>(data), static_cast<char*>(data) + bytes);
  char* base = run->buffer.data();
  MPI_Comm comm = cross_;
  const int n = static_cast<int>(bytes);
  run->start = [=](MPI_Request* request) {
    return MPI_Ibcast(base, n, MPI_BYTE, root, comm, request);
  };
  SMB_RETURN_IF_ERROR(Run(run, "the cross-node broadcast", timeout_s));
  std::memcpy(data, run->buffer.data(), bytes);
  return Status::Ok();
}

// Links alive in this process, stopped (MPI finalized) at exit.
std::mutex links_mu;
std::vector<std::weak_ptr<MpiLink>>& Links() {
  // Constructed before the atexit handler is registered: destroyed after it runs.
  static std::vector<std::weak_ptr<MpiLink>> links;
  return links;
}

void StopLinksAtExit() {
  std::vector<std::shared_ptr<MpiLink>> alive;
  {
    std::lock_guard<std::mutex> lock(links_mu);
    for (auto& weak : Links()) {
      if (auto link = weak.lock()) alive.push_back(link);
    }
  }
  for (auto& link : alive) link->Stop();
}

}  // namespace

bool MpiLinkAvailable() { return true; }

Status StartMpiLink(const MpiLinkOptions& options, std::shared_ptr<NodeLink>* out) {
  auto link = std::make_shared<MpiLink>();
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

#endif  // TF_SMB_WITH_MPI
