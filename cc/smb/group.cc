#include "cc/smb/group.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "cc/smb/hash.h"
#include "cc/smb/process.h"
#include "cc/smb/timeline.h"

namespace smb {
namespace {

constexpr int kSpinIterations = 2000;
constexpr double kLivenessPeriodS = 0.02;  // how often waiters look for gone peers
constexpr double kMaxSleepS = 0.01;
constexpr size_t kDescTextBytes = kDescBytes - 16;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

void Wake(GroupControl* g) {
  g->wake.fetch_add(1, std::memory_order_acq_rel);
  FutexWakeAll(&g->wake);
}

// Stops the group for good with `failure`; false when another failure came first.
bool Abort(GroupControl* g, const Status& failure) {
  uint32_t expected = 0;
  // First failure wins; 1 = writing the reason, 2 = reason readable.
  if (!g->aborted.compare_exchange_strong(expected, 1)) return false;
  std::strncpy(g->abort_reason, failure.message().c_str(), sizeof g->abort_reason - 1);
  g->abort_code.store(static_cast<int32_t>(failure.code()), std::memory_order_relaxed);
  g->aborted.store(2, std::memory_order_release);
  Wake(g);
  return true;
}

// A recoverable collective's description: its agreement (SetNextAgreement),
// then what the algorithm describes.
std::string WithAgreement(const std::string& agreement, const std::string& desc) {
  return agreement.empty() ? desc : agreement + "\n" + desc;
}

// "field=value;..." of a description made by WithAgreement, in order.
std::vector<std::pair<std::string, std::string>> AgreementFields(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> fields;
  const size_t start = text.find('\n');
  if (start == std::string::npos) return fields;
  const size_t end = std::min(text.find('\n', start + 1), text.size());
  size_t at = start + 1;
  while (at < end) {
    size_t stop = std::min(text.find(';', at), end);
    const std::string item = text.substr(at, stop - at);
    const size_t eq = item.find('=');
    if (eq != std::string::npos) fields.emplace_back(item.substr(0, eq), item.substr(eq + 1));
    at = stop + 1;
  }
  return fields;
}

// The recoverable failure of a collective whose ranks described it
// differently: `who[i]` named the description `texts[i]`; `agreement` is
// this rank's. Names every field that differs with every rank's value, or,
// when the fields agree, every rank's whole description.
Status Disagreement(const std::string& agreement, const std::vector<std::string>& who,
                    const std::vector<std::string>& texts) {
  const std::string name = agreement.substr(0, agreement.find('\n'));
  std::vector<std::vector<std::pair<std::string, std::string>>> fields;
  for (const std::string& t : texts) fields.push_back(AgreementFields(t));
  std::string problems;
  for (size_t f = 0; f < fields[0].size(); ++f) {
    const std::string& field = fields[0][f].first;
    bool differ = false;
    std::string values;
    for (size_t r = 0; r < texts.size(); ++r) {
      const auto& mine = fields[r];
      const std::string value = f < mine.size() && mine[f].first == field ? mine[f].second : "?";
      differ |= value != fields[0][f].second;
      values += (r ? ", " : "") + who[r] + ": " + value;
    }
    if (differ) problems += (problems.empty() ? "" : "; ") + field + " (" + values + ")";
  }
  if (problems.empty()) {
    for (size_t r = 0; r < texts.size(); ++r) {
      std::string text = texts[r];
      std::replace(text.begin(), text.end(), '\n', ' ');
      problems += (r ? "; " : "") + who[r] + " called " + text;
    }
    problems = "collective: " + problems;
  }
  return Status(Code::kFailedPrecondition,
                name + ": the ranks disagree on the " + problems +
                    ". Nothing was sent; every rank raises this error and the job can go on "
                    "with its next collective");
}

// A verdict's text: for messages only (the hash decides), so cut to what a
// message needs and the exchange between nodes stays small.
constexpr size_t kVerdictTextBytes = 2016;

// One node's verdict on a collective, as exchanged between nodes.
struct NodeVerdict {
  uint64_t hash;  // of the description; 0 when the node failed to agree
  uint32_t failed;  // 0, or 1 + the smb::Code of the node's failure
  uint32_t joined;  // 1: every rank of the node has joined; it takes part with zeros
  uint32_t len;
  char text[kVerdictTextBytes];  // the description, or why the node failed
  char payload[kAgreePayloadBytes];  // data riding on the agreement (see AgreeHere)
};

std::string TextOf(const NodeVerdict& v) { return std::string(v.text, v.len); }

// The first failure a node reported in its verdict; OK when none did.
Status FailureIn(const std::vector<NodeVerdict>& all) {
  for (const NodeVerdict& v : all) {
    if (v.failed) return Status(static_cast<Code>(v.failed - 1), TextOf(v));
  }
  return Status::Ok();
}

// A wholly joined node's answer: whether it takes part (AnswerAcrossNodes).
struct JoinedAnswer {
  uint32_t failed;  // 0, or 1 + the smb::Code of why it cannot
  uint32_t len;
  char text[1016];
};

bool AnyJoined(const std::vector<NodeVerdict>& all) {
  return std::any_of(all.begin(), all.end(), [](const NodeVerdict& v) { return v.joined; });
}

// A node whose every rank has joined learns the collective from the first
// training node's verdict (`*root`); when that description is longer than a
// verdict holds, it follows whole, broadcast from that node. Every node sees
// the same verdicts, so every node decides alike.
bool DescriptionFollows(const std::vector<NodeVerdict>& all, int* root) {
  bool joined = false;
  *root = -1;
  for (int n = 0; n < static_cast<int>(all.size()); ++n) {
    if (all[n].joined) {
      joined = true;
    } else if (*root < 0) {
      *root = n;
    }
  }
  return joined && *root >= 0 && StableHash(TextOf(all[*root])) != all[*root].hash;
}

}  // namespace

Group::Group(std::shared_ptr<Peers> peers, double timeout_s, std::shared_ptr<NodeLink> link)
    : peers_(std::move(peers)),
      link_(std::move(link)),
      rank_(peers_ ? peers_->rank() : 0),
      world_(peers_ ? peers_->world() : 1),
      timeout_s_(timeout_s) {
  if (link_ && peers_) {
    // Another node's failure stops this node's ranks too; a decision wakes
    // the scheduler that waits on the box.
    std::shared_ptr<Peers> peers_alive = peers_;
    link_->SetCallbacks(
        [peers_alive](const Status& failure) { Abort(peers_alive->control(), failure); },
        [peers_alive] { Wake(peers_alive->control()); },
        [this] { return Failure(); });
  }
}

Group::~Group() {
  if (link_) link_->SetCallbacks(nullptr, nullptr, nullptr);
}

Status Group::Failure() const {
  if (!peers_) return Status::Ok();
  const GroupControl* g = control();
  if (g->aborted.load(std::memory_order_acquire) != 2) return Status::Ok();
  // The code of the failure that stopped the group, so that every rank (and
  // every later call) sees the original error, not a generic one.
  return Status(static_cast<Code>(g->abort_code.load(std::memory_order_acquire)),
                std::string("job aborted: ") + g->abort_reason);
}

Status Group::Fail(const Status& failure) {
  if (!peers_ || failure.ok()) return failure;
  // The first failure on this node tells the other nodes.
  if (Abort(control(), failure) && link_) link_->SendFailure(failure);
  return failure;
}

Status Group::Sync(const std::string& what) {
  if (world_ == 1) return Status::Ok();
  timeline::Scope scope(job_rank(), timeline::kCollectives, "wait");
  GroupControl* g = control();
  const uint64_t target = ++seq_;
  g->ranks[rank_].arrive_seq.store(target, std::memory_order_release);
  Poke();

  const double start = MonotonicSeconds();
  const double timeout = timeout_s();
  const double deadline = start + timeout;
  double next_liveness = start + kLivenessPeriodS;
  int spins = 0;
  for (;;) {
    const uint32_t wake = g->wake.load(std::memory_order_acquire);
    // Arrivals first: once every rank arrived the phase is done, even if the job
    // failed since (a rank that finished this collective, then another's wait for
    // a rank that left after it, must not fail a rank still on its way out of it;
    // the next phase or collective sees the failure).
    bool all = true;
    for (int r = 0; r < world_ && all; ++r) {
      all = g->ranks[r].arrive_seq.load(std::memory_order_acquire) >= target;
    }
    if (all) return Status::Ok();
    Status failed = Failure();
    if (!failed.ok()) return failed;
    if (spins < kSpinIterations) {
      ++spins;
      CpuRelax();
      continue;
    }
    // A rank that left the job never arrives: fail at once, saying how it left.
    for (int r = 0; r < world_ && peers_; ++r) {
      if (g->ranks[r].arrive_seq.load() < target && peers_->Left(r) != 0) {
        return Fail(Status(Code::kAborted, PeerName(r) + GoneHow(r) + "; rank " +
                                               std::to_string(job_rank()) +
                                               " was waiting for it in " + what));
      }
    }
    const double now = MonotonicSeconds();
    if (now >= next_liveness) {
      next_liveness = now + kLivenessPeriodS;
      for (int r = 0; r < world_; ++r) {
        if (g->ranks[r].arrive_seq.load() < target && peers_->Gone(r)) {
          return Fail(Status(Code::kAborted, PeerName(r) + GoneHow(r) + "; rank " +
                                                 std::to_string(job_rank()) +
                                                 " was waiting for it in " + what));
        }
      }
    }
    if (now >= deadline) {
      std::string missing;
      for (int r = 0; r < world_; ++r) {
        if (g->ranks[r].arrive_seq.load() < target) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
      }
      return Fail(Status(Code::kDeadlineExceeded,
                         "rank " + std::to_string(rank_) + " timed out after " +
                             std::to_string(static_cast<int>(timeout)) + "s in " + what +
                             " waiting for rank(s) " + missing));
    }
    FutexWait(&g->wake, wake, std::min(kMaxSleepS, deadline - now));
  }
}

Status Group::Agree(const std::string& op, const std::string& desc) {
  if (alone()) return Status::Ok();
  timeline::Scope scope(job_rank(), timeline::kCollectives, "agree");
  Status verdict;
  SMB_RETURN_IF_ERROR(AgreeHere(op, desc, &verdict));
  return link_ ? AgreeAcrossNodes(desc, verdict) : verdict;
}

Status Group::AgreeHere(const std::string& op, const std::string& desc, Status* verdict) {
  *verdict = Status::Ok();
  agreement_ = std::move(next_agreement_);
  next_agreement_.clear();
  if (world_ == 1) return Status::Ok();
  GroupControl* g = control();
  const int parity = static_cast<int>(collectives_++ & 1);
  char* slot = g->ranks[rank_].desc[parity];
  const std::string full = WithAgreement(agreement_, desc);
  const uint64_t hash = StableHash(full);
  const uint32_t len = static_cast<uint32_t>(std::min(full.size(), kDescTextBytes - 1));
  std::memcpy(slot, &hash, sizeof hash);
  std::memcpy(slot + 8, &len, sizeof len);
  std::memcpy(slot + 12, full.data(), len);
  slot[12 + len] = '\0';
  SMB_RETURN_IF_ERROR(Sync(op));
  uint64_t root_hash;
  std::memcpy(&root_hash, g->ranks[0].desc[parity], sizeof root_hash);
  for (int r = 1; r < world_; ++r) {
    const char* other = g->ranks[r].desc[parity];
    uint64_t other_hash;
    std::memcpy(&other_hash, other, sizeof other_hash);
    if (other_hash != root_hash) {
      // Every rank reaches the same verdict from the same slots: no hang.
      if (!agreement_.empty()) {
        std::vector<std::string> who, texts;
        for (int q = 0; q < world_; ++q) {
          who.push_back("rank " + std::to_string(JobRankOf(q)));
          texts.emplace_back(g->ranks[q].desc[parity] + 12);
        }
        *verdict = Disagreement(agreement_, who, texts);
        return Status::Ok();
      }
      *verdict = InvalidArgument(
          "ranks disagree on a collective: rank " + std::to_string(JobRankOf(0)) + " called " +
          std::string(g->ranks[0].desc[parity] + 12) + "; rank " +
          std::to_string(JobRankOf(r)) + " called " + std::string(other + 12));
      return Status::Ok();
    }
  }
  return Status::Ok();
}

Status Group::Relay(const Status& outcome, std::string* text, uint32_t* flag) {
  if (world_ <= link_->streams()) return outcome;  // every rank here took part
  GroupControl::RelaySlot& slot = control()->relay[relays_++ & 1];
  if (rank_ == 0) {
    const std::string said = outcome.ok() ? (text != nullptr ? *text : "") : outcome.message();
    slot.code = static_cast<int32_t>(outcome.code());
    slot.flag = flag != nullptr ? *flag : 0;
    slot.len = static_cast<uint32_t>(std::min(said.size(), sizeof slot.text));
    std::memcpy(slot.text, said.data(), slot.len);
  }
  // (Rank 0 writes before it arrives, the others read after all arrived; the
  // slot is written again two relays on, after a barrier they all passed.)
  SMB_RETURN_IF_ERROR(Sync("the outcome across nodes"));
  if (!Relayed()) return outcome;
  std::string said(slot.text, slot.len);
  if (slot.code != 0) return Status(static_cast<Code>(slot.code), said);
  if (text != nullptr) *text = std::move(said);
  if (flag != nullptr) *flag = slot.flag;
  return Status::Ok();
}

Status Group::AgreeAcrossNodes(const std::string& desc, const Status& local, const void* payload,
                               size_t payload_bytes, std::vector<char>* payloads) {
  if (payloads != nullptr) payloads->clear();
  const Status outcome =
      Relayed() ? Status::Ok() : ExchangeVerdicts(desc, local, payload, payload_bytes, payloads);
  return Relay(outcome, nullptr, nullptr);
}

Status Group::ExchangeVerdicts(const std::string& desc, const Status& local, const void* payload,
                               size_t payload_bytes, std::vector<char>* payloads) {
  if (payload_bytes > kAgreePayloadBytes) {
    return Internal("an agreement payload of " + std::to_string(payload_bytes) +
                    " bytes, at most " + std::to_string(kAgreePayloadBytes) + " fit");
  }
  NodeVerdict mine{};
  const std::string full = WithAgreement(agreement_, desc);
  const std::string& text = local.ok() ? full : local.message();
  mine.failed = local.ok() ? 0 : 1 + static_cast<uint32_t>(local.code());
  mine.hash = local.ok() ? StableHash(full) : 0;
  mine.len = static_cast<uint32_t>(std::min(text.size(), sizeof mine.text - 1));
  std::memcpy(mine.text, text.data(), mine.len);
  if (payload_bytes > 0) std::memcpy(mine.payload, payload, payload_bytes);
  const int nodes = link_->nodes();
  std::vector<NodeVerdict> all(nodes);
  if (learned_.size() == sizeof(NodeVerdict) * nodes) {
    std::memcpy(all.data(), learned_.data(), learned_.size());  // LearnAcrossNodes exchanged them
  } else {
    Status exchanged = link_->AllGather(&mine, sizeof mine, all.data(), timeout_s());
    if (!exchanged.ok()) return exchanged;
    SMB_RETURN_IF_ERROR(FailureIn(all));
    int root = -1;
    if (DescriptionFollows(all, &root)) {  // for a joined node (LearnAcrossNodes)
      std::vector<char> whole(kDescTextBytes, 0);
      if (link_->node() == root) {
        std::memcpy(whole.data(), full.data(), std::min(full.size(), whole.size() - 1));
      }
      SMB_RETURN_IF_ERROR(link_->Broadcast(whole.data(), whole.size(), root, timeout_s()));
    }
    // Whether the joined nodes take part, before any data moves.
    if (AnyJoined(all)) SMB_RETURN_IF_ERROR(AnswerNodes(Status::Ok()));
  }
  // (LearnAcrossNodes checked its verdicts for failures as this branch did.)
  learned_.clear();
  // Nodes whose every rank has joined describe nothing of their own.
  int first = 0;
  while (first < nodes - 1 && all[first].joined) ++first;
  for (int n = first + 1; n < nodes; ++n) {
    if (!all[n].joined && all[n].hash != all[first].hash) {
      if (!agreement_.empty()) {
        std::vector<std::string> who, texts;
        for (int q = 0; q < nodes; ++q) {
          if (all[q].joined) continue;
          who.push_back("rank " + std::to_string(link_->JobRank(q, 0)) + " (node " +
                        std::to_string(q) + ")");
          texts.push_back(TextOf(all[q]));
        }
        return Disagreement(agreement_, who, texts);
      }
      return InvalidArgument("ranks disagree on a collective: rank " +
                             std::to_string(link_->JobRank(first, 0)) + " (node " +
                             std::to_string(first) + ") called " + TextOf(all[first]) +
                             "; rank " + std::to_string(link_->JobRank(n, 0)) + " (node " +
                             std::to_string(n) + ") called " + TextOf(all[n]));
    }
  }
  if (payloads != nullptr) {
    // Every node described the same collective, so sent as many bytes.
    payloads->resize(nodes * payload_bytes);
    for (int n = 0; n < nodes; ++n) {
      std::memcpy(payloads->data() + n * payload_bytes, all[n].payload, payload_bytes);
    }
  }
  return Status::Ok();
}

std::string Group::PeerName(int local) const {
  const std::string identity = peers_ ? peers_->Identity(local) : "this process";
  const std::string node = link_ ? "node " + std::to_string(link_->node()) + ", " : "";
  return "rank " + std::to_string(JobRankOf(local)) + " (" + node + identity + ")";
}

bool Group::RankGone(int rank) const { return peers_ && peers_->Gone(rank); }

int Group::GoneRank() const {
  for (int r = 0; r < world_; ++r) {
    if (RankGone(r)) return r;
  }
  return -1;
}

int Group::AbsentRank() const {
  for (int r = 0; r < world_; ++r) {
    if (RankGone(r) || (peers_ && peers_->Left(r) != 0)) return r;
  }
  return -1;
}

std::string Group::GoneHow(int local) const {
  switch (peers_ ? peers_->Left(local) : 0) {
    case kLeftFinished:
      return " left the job: its program ended normally (e.g. its training loop or fit "
             "stopped early, or its script returned) while the others still ran collectives "
             "with it; every rank must run the same steps";
    case kLeftRaised:
      return " left the job: its program ended with an error (see that rank's output)";
    case kLeftRejoined:
      return " left the job for its next generation (elastic training: the members "
             "changed)";
    default:
      return " exited or died";
  }
}

Status Group::WaitUntil(const std::string& what, const std::function<bool()>& done,
                        const std::function<std::string()>& lagging) {
  if (alone()) return Status::Ok();
  GroupControl* g = control();
  const double timeout = timeout_s();
  const double deadline = MonotonicSeconds() + timeout;
  for (;;) {
    const uint32_t wake = g->wake.load(std::memory_order_acquire);
    if (done()) return Status::Ok();  // done before a later failure (as in Sync)
    Status failed = Failure();
    if (!failed.ok()) return failed;
    const double now = MonotonicSeconds();
    if (now >= deadline) {
      return Status(Code::kDeadlineExceeded,
                    "rank " + std::to_string(rank_) + " timed out after " +
                        std::to_string(static_cast<int>(timeout)) + "s in " + what +
                        " waiting for rank(s) " + lagging());
    }
    // Gone ranks never wake us: re-check liveness at least every period.
    FutexWait(&g->wake, wake, std::min(kLivenessPeriodS, deadline - now));
  }
}

void Group::Poke() {
  if (peers_) Wake(control());
}

uint32_t Group::WakeWord() const {
  return peers_ ? control()->wake.load(std::memory_order_acquire) : 0;
}

void Group::WaitForChange(uint32_t seen, double seconds) const {
  if (peers_) FutexWait(&control()->wake, seen, seconds);
}

void Group::PublishPending(const std::vector<uint64_t>& keys) {
  if (!peers_) return;
  RankControl& mine = control()->ranks[rank_];
  const size_t n = std::min<size_t>(keys.size(), kMaxPending);
  // Rank 0 may read while this changes; it can then see a key this rank ran
  // already, which it never picks (it picks among its own waiting keys, and
  // every key is run once), or miss a new one until the next look.
  for (size_t i = 0; i < n; ++i) mine.pending[i].store(keys[i], std::memory_order_relaxed);
  mine.pending_count.store(static_cast<uint32_t>(n), std::memory_order_release);
  Poke();
}

bool Group::NextCollective(const std::vector<uint64_t>& mine, uint64_t* key) {
  if (alone()) {
    if (mine.empty()) return false;
    *key = mine.front();
    return true;
  }
  GroupControl* g = control();
  const int slot = static_cast<int>(decided_ & 1);
  if (rank_ == 0 && link_) {
    // This node's leader: offers what every rank of the node still training
    // has waiting; node 0's leader decides for the whole job. Having joined,
    // it offers the keys of the first rank still training (which may still
    // list one that just ran); once every rank here has joined, its join and
    // "any": the node takes part in whatever the other nodes run next.
    std::vector<uint64_t> theirs;
    const std::vector<uint64_t>* candidates = &mine;
    bool all_joined = Joined(0);
    for (int r = 1; r < world_ && all_joined; ++r) {
      if (Joined(r)) continue;
      theirs = PublishedBy(r);
      candidates = &theirs;
      all_joined = false;
    }
    std::vector<uint64_t> everywhere;
    for (uint64_t k : *candidates) {
      if (!RanksWithout(k).empty()) continue;
      if (candidates == &theirs && std::count(recent_, recent_ + kRecent, k) != 0) continue;
      everywhere.push_back(k);
    }
    if (all_joined) everywhere.push_back(kAnyCollective);
    link_->OfferCandidates(everywhere);
    uint64_t k;
    if (!link_->NextDecision(&k)) return false;
    recent_[decided_ % kRecent] = k;
    g->decision_key[slot].store(k, std::memory_order_relaxed);
    g->decision_seq[slot].store(decided_ + 1, std::memory_order_release);
    ++decided_;
    Poke();
    *key = k;
    return true;
  }
  if (rank_ == 0) {
    // Having joined, rank 0 waits only on its join: it chooses among the keys
    // of the first rank still training (every rank joined: the join).
    std::vector<uint64_t> theirs;
    const std::vector<uint64_t>* candidates = &mine;
    for (int r = 0; r < world_ && Joined(0); ++r) {
      if (Joined(r)) continue;
      theirs = PublishedBy(r);
      candidates = &theirs;
      break;
    }
    for (uint64_t k : *candidates) {
      if (!RanksWithout(k).empty()) continue;
      // Another rank's list may still hold the key that just ran.
      if (candidates == &theirs && std::count(recent_, recent_ + kRecent, k) != 0) continue;
      recent_[decided_ % kRecent] = k;
      g->decision_key[slot].store(k, std::memory_order_relaxed);
      g->decision_seq[slot].store(decided_ + 1, std::memory_order_release);
      ++decided_;
      Poke();
      *key = k;
      return true;
    }
    return false;
  }
  if (g->decision_seq[slot].load(std::memory_order_acquire) != decided_ + 1) return false;
  *key = g->decision_key[slot].load(std::memory_order_relaxed);
  ++decided_;
  return true;
}

namespace {

// Calls fn(key) for each key in a rank's published list, without copying it.
template <typename Fn>
void ForEachPublished(const RankControl& slot, Fn fn) {
  const uint32_t n =
      std::min<uint32_t>(slot.pending_count.load(std::memory_order_acquire), kMaxPending);
  for (uint32_t i = 0; i < n; ++i) fn(slot.pending[i].load(std::memory_order_relaxed));
}

}  // namespace

std::string Group::RanksWithout(uint64_t key) const {
  std::string missing;
  if (!peers_) return missing;
  for (int r = 0; r < world_; ++r) {
    if (!OtherTraining(r)) continue;
    bool found = false;
    ForEachPublished(control()->ranks[r], [&](uint64_t k) { found = found || k == key; });
    if (!found) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  }
  return missing;
}

std::vector<uint64_t> Group::PublishedBy(int rank) const {
  std::vector<uint64_t> keys;
  ForEachPublished(control()->ranks[rank], [&](uint64_t k) { keys.push_back(k); });
  return keys;
}

bool Group::OtherTraining(int rank) const { return rank != rank_ && !Joined(rank); }

void Group::MarkJoined() {
  if (join_order_ != 0) return;
  // Every rank takes part in every decided collective, so the ones taken
  // before joining order joins across nodes; the node's count breaks ties.
  const uint64_t taken = decided_ << 24;
  join_order_ = taken | 1;
  if (!peers_) return;
  join_order_ = taken | (control()->joins.fetch_add(1, std::memory_order_relaxed) % 0xFFFFFF + 1);
  control()->ranks[rank_].joined.store(join_order_, std::memory_order_release);
  Poke();
}

uint64_t Group::ClearJoined() {
  const uint64_t order = join_order_;
  join_order_ = 0;
  std::fill(recent_, recent_ + kRecent, 0);
  if (peers_) control()->ranks[rank_].joined.store(0, std::memory_order_release);
  return order;
}

bool Group::Joined(int rank) const {
  if (!peers_) return rank == rank_ && join_order_ != 0;
  return control()->ranks[rank].joined.load(std::memory_order_acquire) != 0;
}

bool Group::AllJoinedHere() const {
  for (int r = 0; r < world_; ++r) {
    if (!Joined(r)) return false;
  }
  return true;
}

Status Group::LearnAcrossNodes(std::string* text, bool* complete) {
  if (!link_) return InvalidArgument("no other node to learn the collective from");
  *complete = false;
  const Status outcome = Relayed() ? Status::Ok() : LearnFromNodes(text, complete);
  uint32_t flag = *complete ? 1 : 0;
  SMB_RETURN_IF_ERROR(Relay(outcome, text, &flag));
  *complete = flag != 0;
  return Status::Ok();
}

Status Group::LearnFromNodes(std::string* text, bool* complete) {
  NodeVerdict mine{};
  mine.joined = 1;  // zeros in the payload: what a joined node adds to a small sum
  const int nodes = link_->nodes();
  std::vector<NodeVerdict> all(nodes);
  SMB_RETURN_IF_ERROR(link_->AllGather(&mine, sizeof mine, all.data(), timeout_s()));
  SMB_RETURN_IF_ERROR(FailureIn(all));
  int root = -1;
  if (DescriptionFollows(all, &root)) {
    std::vector<char> whole(kDescTextBytes, 0);
    SMB_RETURN_IF_ERROR(link_->Broadcast(whole.data(), whole.size(), root, timeout_s()));
    *text = std::string(whole.data(), strnlen(whole.data(), whole.size()));
  } else if (root >= 0) {
    *text = TextOf(all[root]);
  } else {
    return Internal("every node has joined (hvd.join), yet a collective other than the join runs");
  }
  *complete = StableHash(*text) == all[root].hash;  // the hash is of the whole description
  learned_.resize(sizeof(NodeVerdict) * nodes);
  std::memcpy(learned_.data(), all.data(), learned_.size());
  return Status::Ok();
}

Status Group::AnswerAcrossNodes(const Status& taking_part) {
  if (!link_) return InvalidArgument("no other node to answer");
  return Relay(Relayed() ? Status::Ok() : AnswerNodes(taking_part), nullptr, nullptr);
}

Status Group::AnswerNodes(const Status& taking_part) {
  JoinedAnswer answer{};
  answer.failed = taking_part.ok() ? 0 : 1 + static_cast<uint32_t>(taking_part.code());
  answer.len = static_cast<uint32_t>(std::min(taking_part.message().size(), sizeof answer.text));
  std::memcpy(answer.text, taking_part.message().data(), answer.len);
  std::vector<JoinedAnswer> all(link_->nodes());
  SMB_RETURN_IF_ERROR(link_->AllGather(&answer, sizeof answer, all.data(), timeout_s()));
  for (const JoinedAnswer& a : all) {
    if (a.failed) return Status(static_cast<Code>(a.failed - 1), std::string(a.text, a.len));
  }
  return Status::Ok();
}

Status Group::PeekNextDescription(std::string* text, bool* complete) {
  if (world_ == 1) return InvalidArgument("no other rank to take part with");
  GroupControl* g = control();
  // A rank publishes its description, then arrives at the collective's first
  // barrier: once one still training has arrived, its slot is this one's.
  const uint64_t target = seq_ + 1;
  int from = -1;
  SMB_RETURN_IF_ERROR(WaitUntil(
      "hvd.join (waiting for the collective it takes part in)",
      [&] {
        for (int r = 0; r < world_; ++r) {
          if (!OtherTraining(r)) continue;
          if (g->ranks[r].arrive_seq.load(std::memory_order_acquire) >= target) {
            from = r;
            return true;
          }
        }
        return false;
      },
      [&] {
        std::string training;
        for (int r = 0; r < world_; ++r) {
          if (OtherTraining(r)) training += (training.empty() ? "" : ", ") + std::to_string(r);
        }
        return training;
      }));
  const char* slot = g->ranks[from].desc[collectives_ & 1];
  uint64_t hash = 0;
  uint32_t len = 0;
  std::memcpy(&hash, slot, sizeof hash);
  std::memcpy(&len, slot + 8, sizeof len);
  text->assign(slot + 12, std::min<size_t>(len, kDescTextBytes - 1));
  *complete = StableHash(*text) == hash;  // the hash is of the whole description
  return Status::Ok();
}

}  // namespace smb
