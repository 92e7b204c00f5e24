#include "cc/smb/communicator.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "cc/smb/hash.h"
#include "cc/smb/process.h"

namespace smb {
namespace {

constexpr int kSpinIterations = 2000;
constexpr double kLivenessPeriodS = 0.02;  // how often waiters look for dead peers
constexpr double kMaxSleepS = 0.01;
constexpr size_t kDescTextBytes = kDescBytes - 16;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

size_t NumElements(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

// A byte range taking part in a collective, seen as one concatenated buffer.
struct Piece {
  const char* in;
  char* out;
  size_t bytes;
};

// Calls fn(piece, offset in the piece, position in the range, bytes) for each
// part of bytes [offset, offset+len) of the concatenation of `pieces`.
template <typename Fn>
void ForRange(const std::vector<Piece>& pieces, size_t offset, size_t len, Fn fn) {
  size_t pos = 0;
  for (const Piece& p : pieces) {
    if (len == 0) return;
    if (offset >= p.bytes) {
      offset -= p.bytes;
      continue;
    }
    const size_t n = std::min(len, p.bytes - offset);
    fn(p, offset, pos, n);
    pos += n;
    len -= n;
    offset = 0;
  }
}

// Copies bytes [offset, offset+len) of the pieces' inputs to dst.
void GatherBytes(const std::vector<Piece>& pieces, size_t offset, size_t len,
                 char* dst) {
  ForRange(pieces, offset, len, [dst](const Piece& p, size_t at, size_t pos, size_t n) {
    std::memcpy(dst + pos, p.in + at, n);
  });
}

// Copies src to bytes [offset, offset+len) of the pieces' outputs.
void ScatterBytes(const char* src, size_t offset, size_t len,
                  const std::vector<Piece>& pieces) {
  ForRange(pieces, offset, len, [src](const Piece& p, size_t at, size_t pos, size_t n) {
    std::memcpy(p.out + at, src + pos, n);
  });
}

// dst (and copy, if not null) = srcs[0] + srcs[1] + ... in rank order, n
// elements. Sums a small block at a time in a local buffer, so dst may be
// any of the sources and the block stays in L1.
void SumRanks(DType dtype, const std::vector<const char*>& srcs, char* dst,
              char* copy, size_t n) {
  alignas(64) char block[16384];
  const size_t elem = DTypeSize(dtype);
  const size_t per = sizeof block / elem;
  for (size_t i = 0; i < n; i += per) {
    const size_t m = std::min(per, n - i);
    const size_t at = i * elem;
    SumInto(dtype, block, srcs[0] + at, srcs[1] + at, m);
    for (size_t q = 2; q < srcs.size(); ++q) {
      SumInto(dtype, block, block, srcs[q] + at, m);
    }
    std::memcpy(dst + at, block, m * elem);
    if (copy != nullptr) std::memcpy(copy + at, block, m * elem);
  }
}

std::string Describe(const char* op, const std::vector<TensorRef>& tensors) {
  std::string desc = op;
  desc += " of " + std::to_string(tensors.size()) + " tensors:";
  for (const TensorRef& t : tensors) {
    desc += " ";
    desc += DTypeName(t.dtype);
    desc += ShapeString(t.shape);
  }
  return desc;
}

Status ValidateTensors(const std::vector<TensorRef>& tensors) {
  for (const TensorRef& t : tensors) {
    if (!IsValidDType(static_cast<int32_t>(t.dtype))) {
      return InvalidArgument("unsupported dtype code " +
                             std::to_string(static_cast<int32_t>(t.dtype)));
    }
    for (int64_t d : t.shape) {
      if (d < 0) return InvalidArgument("negative dimension in shape " +
                                        ShapeString(t.shape));
    }
  }
  return Status::Ok();
}

}  // namespace

Status Communicator::Open(const Options& options,
                          std::unique_ptr<Communicator>* out) {
  if (options.world < 1 || options.world > kMaxWorld) {
    return InvalidArgument("world size must be in [1, " +
                           std::to_string(kMaxWorld) + "], got " +
                           std::to_string(options.world));
  }
  if (options.rank < 0 || options.rank >= options.world) {
    return InvalidArgument("rank must be in [0, " +
                           std::to_string(options.world) + "), got " +
                           std::to_string(options.rank));
  }
  if (!(options.timeout_s > 0)) {
    return InvalidArgument("timeout must be positive, got " +
                           std::to_string(options.timeout_s));
  }
  std::unique_ptr<Box> box;
  if (options.world > 1) {
    if (options.create) {
      Box::Options bo;
      bo.job_id = options.job_id;
      bo.world = options.world;
      bo.staging_bytes = options.staging_bytes;
      bo.heap_bytes = options.heap_bytes;
      SMB_RETURN_IF_ERROR(Box::Create(bo, &box));
    } else {
      SMB_RETURN_IF_ERROR(Box::Attach(options.job_id, options.timeout_s, &box));
    }
    BoxHeader* h = box->header();
    if (static_cast<int>(h->world) != options.world) {
      return InvalidArgument("box of job '" + options.job_id + "' was made for " +
                             std::to_string(h->world) + " workers, this one "
                             "expects " + std::to_string(options.world));
    }
    RankSlot& slot = h->ranks[options.rank];
    const int32_t other = slot.pid.load();
    if (other != 0 && other != getpid() && IsProcessAlive(other)) {
      return Status(Code::kAlreadyExists,
                    "rank " + std::to_string(options.rank) + " of job '" +
                        options.job_id + "' is already taken by pid " +
                        std::to_string(other));
    }
    slot.pid.store(getpid());
  }
  *out = std::make_unique<Communicator>(Key(), options, std::move(box));
  return Status::Ok();
}

Communicator::Communicator(Key, const Options& options, std::shared_ptr<Box> box)
    : box_(std::move(box)),
      rank_(options.rank),
      world_(options.world),
      timeout_s_(options.timeout_s) {}

Communicator::~Communicator() = default;

Status Communicator::AbortedStatus() const {
  const BoxHeader* h = box_->header();
  // The code of the failure that stopped the job, so that every rank (and
  // every later call) sees the original error, not a generic one.
  return Status(static_cast<Code>(h->abort_code.load(std::memory_order_acquire)),
                std::string("job aborted: ") + h->abort_reason);
}

Status Communicator::Fail(const Status& failure) {
  if (box_ == nullptr || failure.ok()) return failure;
  return Abort(failure.code(), failure.message());
}

Status Communicator::JobFailure() const {
  if (box_ == nullptr) return Status::Ok();
  if (box_->header()->aborted.load(std::memory_order_acquire) == 2) return AbortedStatus();
  return Status::Ok();
}

Status Communicator::Abort(Code code, const std::string& reason) {
  BoxHeader* h = box_->header();
  uint32_t expected = 0;
  // First failure wins; 1 = writing the reason, 2 = reason readable.
  if (h->aborted.compare_exchange_strong(expected, 1)) {
    std::strncpy(h->abort_reason, reason.c_str(), sizeof h->abort_reason - 1);
    h->abort_code.store(static_cast<int32_t>(code), std::memory_order_relaxed);
    h->aborted.store(2, std::memory_order_release);
    h->wake.fetch_add(1);
    FutexWakeAll(&h->wake);
  }
  return Status(code, reason);
}

Status Communicator::Sync(const std::string& what) {
  BoxHeader* h = box_->header();
  const uint64_t target = ++seq_;
  h->ranks[rank_].arrive_seq.store(target, std::memory_order_release);
  h->wake.fetch_add(1, std::memory_order_acq_rel);
  FutexWakeAll(&h->wake);

  const double start = MonotonicSeconds();
  const double timeout = timeout_s();
  const double deadline = start + timeout;
  double next_liveness = start + kLivenessPeriodS;
  int spins = 0;
  for (;;) {
    const uint32_t wake = h->wake.load(std::memory_order_acquire);
    if (h->aborted.load(std::memory_order_acquire) == 2) return AbortedStatus();
    bool all = true;
    for (int r = 0; r < world_ && all; ++r) {
      all = h->ranks[r].arrive_seq.load(std::memory_order_acquire) >= target;
    }
    if (all) return Status::Ok();
    if (spins < kSpinIterations) {
      ++spins;
      CpuRelax();
      continue;
    }
    const double now = MonotonicSeconds();
    if (now >= next_liveness) {
      next_liveness = now + kLivenessPeriodS;
      for (int r = 0; r < world_; ++r) {
        const int32_t pid = h->ranks[r].pid.load();
        if (h->ranks[r].arrive_seq.load() < target && pid != 0 &&
            !IsProcessAlive(pid)) {
          return Abort(Code::kAborted,
                       "rank " + std::to_string(r) + " (pid " +
                           std::to_string(pid) + ") exited or died; rank " +
                           std::to_string(rank_) + " was waiting for it in " +
                           what);
        }
      }
    }
    if (now >= deadline) {
      std::string missing;
      for (int r = 0; r < world_; ++r) {
        if (h->ranks[r].arrive_seq.load() < target) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
      }
      return Abort(Code::kDeadlineExceeded,
                   "rank " + std::to_string(rank_) + " timed out after " +
                       std::to_string(static_cast<int>(timeout)) +
                       "s in " + what + " waiting for rank(s) " + missing);
    }
    FutexWait(&h->wake, wake, std::min(kMaxSleepS, deadline - now));
  }
}

Status Communicator::Agree(const std::string& op, const std::string& desc) {
  BoxHeader* h = box_->header();
  const int parity = static_cast<int>(collectives_++ & 1);
  char* slot = h->ranks[rank_].desc[parity];
  const uint64_t hash = StableHash(desc);
  const uint32_t len =
      static_cast<uint32_t>(std::min(desc.size(), kDescTextBytes - 1));
  std::memcpy(slot, &hash, sizeof hash);
  std::memcpy(slot + 8, &len, sizeof len);
  std::memcpy(slot + 12, desc.data(), len);
  slot[12 + len] = '\0';
  SMB_RETURN_IF_ERROR(Sync(op));
  uint64_t root_hash;
  std::memcpy(&root_hash, h->ranks[0].desc[parity], sizeof root_hash);
  for (int r = 1; r < world_; ++r) {
    const char* other = h->ranks[r].desc[parity];
    uint64_t other_hash;
    std::memcpy(&other_hash, other, sizeof other_hash);
    if (other_hash != root_hash) {
      // Every rank reaches the same verdict from the same slots: no hang.
      return InvalidArgument(
          "ranks disagree on a collective: rank 0 called " +
          std::string(h->ranks[0].desc[parity] + 12) + "; rank " +
          std::to_string(r) + " called " + std::string(other + 12));
    }
  }
  return Status::Ok();
}

bool Communicator::RankGone(int r) const {
  const int32_t pid = box_->header()->ranks[r].pid.load();
  return pid != 0 && !IsProcessAlive(pid);
}

template <typename Done, typename Lagging>
Status Communicator::WaitUntil(const std::string& what, Done done, Lagging lagging) {
  BoxHeader* h = box_->header();
  const double timeout = timeout_s();
  const double deadline = MonotonicSeconds() + timeout;
  for (;;) {
    const uint32_t wake = h->wake.load(std::memory_order_acquire);
    if (h->aborted.load(std::memory_order_acquire) == 2) return AbortedStatus();
    if (done()) return Status::Ok();
    const double now = MonotonicSeconds();
    if (now >= deadline) {
      return Status(Code::kDeadlineExceeded,
                    "rank " + std::to_string(rank_) + " timed out after " +
                        std::to_string(static_cast<int>(timeout)) + "s in " +
                        what + " waiting for rank(s) " + lagging());
    }
    // Dead ranks never wake us: re-check liveness at least every period.
    FutexWait(&h->wake, wake, std::min(kLivenessPeriodS, deadline - now));
  }
}

Status Communicator::ClockTick(int64_t staleness, int64_t* gap) {
  *gap = 0;
  if (world_ == 1) return Status::Ok();
  BoxHeader* h = box_->header();
  const uint64_t mine = h->ranks[rank_].clock.fetch_add(1) + 1;
  h->wake.fetch_add(1, std::memory_order_acq_rel);
  FutexWakeAll(&h->wake);
  // Slowest clock among ranks still training (world: none left).
  auto slowest = [&]() -> uint64_t {
    uint64_t low = mine;
    for (int r = 0; r < world_; ++r) {
      if (r == rank_ || h->ranks[r].finished.load() || RankGone(r)) continue;
      low = std::min<uint64_t>(low, h->ranks[r].clock.load(std::memory_order_acquire));
    }
    return low;
  };
  if (staleness >= 0) {
    Status s = WaitUntil(
        "a staleness wait (bound " + std::to_string(staleness) + ")",
        [&] { return mine - slowest() <= static_cast<uint64_t>(staleness); },
        [&] {
          std::string slow;
          for (int r = 0; r < world_; ++r) {
            if (r != rank_ && mine - h->ranks[r].clock.load() >
                                  static_cast<uint64_t>(staleness)) {
              slow += (slow.empty() ? "" : ", ") + std::to_string(r);
            }
          }
          return slow;
        });
    if (!s.ok()) return s;
  }
  *gap = static_cast<int64_t>(mine - slowest());
  return Status::Ok();
}

void Communicator::ClockFinish() {
  if (world_ == 1) return;
  BoxHeader* h = box_->header();
  h->ranks[rank_].finished.store(1, std::memory_order_release);
  h->wake.fetch_add(1, std::memory_order_acq_rel);
  FutexWakeAll(&h->wake);
}

void Communicator::ClockResume() {
  if (world_ == 1) return;
  box_->header()->ranks[rank_].finished.store(0, std::memory_order_release);
}

Status Communicator::WaitAllFinished() {
  if (world_ == 1) return Status::Ok();
  BoxHeader* h = box_->header();
  auto unfinished = [&] {
    std::string list;
    for (int r = 0; r < world_; ++r) {
      if (!h->ranks[r].finished.load() && !RankGone(r)) {
        list += (list.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    return list;
  };
  return WaitUntil("waiting for all ranks to finish training",
                   [&] { return unfinished().empty(); }, unfinished);
}

void Communicator::PublishPending(const std::vector<uint64_t>& keys) {
  if (box_ == nullptr) return;
  RankSlot& slot = box_->header()->ranks[rank_];
  const size_t n = std::min<size_t>(keys.size(), kMaxPending);
  // Rank 0 may read while this changes; it can then see a key this rank ran
  // already, which it never picks (it picks among its own waiting keys, and
  // every key is run once), or miss a new one until the next look.
  for (size_t i = 0; i < n; ++i) slot.pending[i].store(keys[i], std::memory_order_relaxed);
  slot.pending_count.store(static_cast<uint32_t>(n), std::memory_order_release);
  Poke();
}

bool Communicator::NextCollective(const std::vector<uint64_t>& mine, uint64_t* key) {
  if (world_ == 1) {
    if (mine.empty()) return false;
    *key = mine.front();
    return true;
  }
  BoxHeader* h = box_->header();
  const int slot = static_cast<int>(decided_ & 1);
  if (rank_ == 0) {
    for (uint64_t k : mine) {
      if (!RanksWithout(k).empty()) continue;
      h->decision_key[slot].store(k, std::memory_order_relaxed);
      h->decision_seq[slot].store(decided_ + 1, std::memory_order_release);
      ++decided_;
      Poke();
      *key = k;
      return true;
    }
    return false;
  }
  if (h->decision_seq[slot].load(std::memory_order_acquire) != decided_ + 1) return false;
  *key = h->decision_key[slot].load(std::memory_order_relaxed);
  ++decided_;
  return true;
}

std::string Communicator::RanksWithout(uint64_t key) const {
  std::string missing;
  if (box_ == nullptr) return missing;
  const BoxHeader* h = box_->header();
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const RankSlot& slot = h->ranks[r];
    const uint32_t n = std::min<uint32_t>(slot.pending_count.load(std::memory_order_acquire),
                                          kMaxPending);
    bool found = false;
    for (uint32_t i = 0; i < n && !found; ++i) {
      found = slot.pending[i].load(std::memory_order_relaxed) == key;
    }
    if (!found) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  }
  return missing;
}

int Communicator::DeadRank() const {
  for (int r = 0; r < world_ && box_ != nullptr; ++r) {
    if (RankGone(r)) return r;
  }
  return -1;
}

uint32_t Communicator::WakeWord() const {
  return box_ == nullptr ? 0 : box_->header()->wake.load(std::memory_order_acquire);
}

void Communicator::WaitForChange(uint32_t seen, double seconds) const {
  if (box_ == nullptr) return;
  FutexWait(&box_->header()->wake, seen, seconds);
}

void Communicator::Poke() {
  if (box_ == nullptr) return;
  BoxHeader* h = box_->header();
  h->wake.fetch_add(1, std::memory_order_acq_rel);
  FutexWakeAll(&h->wake);
}

Status Communicator::Barrier() {
  if (world_ == 1) return Status::Ok();
  return Agree("barrier", "barrier");
}

ResultHold::~ResultHold() {
  box_->header()->results[buffer_].holders.fetch_sub(1, std::memory_order_release);
}

namespace {

// One rank: every sum is the input itself.
void CopyThrough(const std::vector<TensorRef>& tensors) {
  for (const TensorRef& t : tensors) {
    if (t.in != t.out) {
      std::memcpy(t.out, t.in, NumElements(t.shape) * DTypeSize(t.dtype));
    }
  }
}

}  // namespace

Status Communicator::AllReduceSum(const std::vector<TensorRef>& tensors) {
  SMB_RETURN_IF_ERROR(ValidateTensors(tensors));
  if (world_ == 1) {
    CopyThrough(tensors);
    return Status::Ok();
  }
  SMB_RETURN_IF_ERROR(Agree("allreduce", Describe("allreduce", tensors)));
  return ReduceChunks(tensors, /*shared_out=*/false);
}

Status Communicator::AllReduceSumShared(std::vector<TensorRef> tensors,
                                        const OutputBinder& bind_outputs,
                                        std::vector<void*>* sums,
                                        std::shared_ptr<ResultHold>* hold) {
  sums->clear();
  hold->reset();
  SMB_RETURN_IF_ERROR(ValidateTensors(tensors));
  if (world_ == 1) {
    SMB_RETURN_IF_ERROR(bind_outputs(&tensors));
    CopyThrough(tensors);
    return Status::Ok();
  }
  // Where each sum goes in a result buffer: 64-byte aligned, as TensorFlow
  // wants tensor data.
  std::vector<size_t> at(tensors.size());
  size_t need = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    at[i] = need;
    need = AlignUp(need + NumElements(tensors[i].shape) * DTypeSize(tensors[i].dtype), 64);
  }
  BoxHeader* h = box_->header();
  const int parity = static_cast<int>(collectives_ & 1);  // Agree's parity
  int choice = -1;
  if (rank_ == 0) {
    choice = need >= kSharedMinBytes ? TakeResultBuffer(need) : -1;
    h->ranks[0].result_choice[parity].store(choice, std::memory_order_relaxed);
  }
  Status agreed = Agree("allreduce", Describe("allreduce", tensors));
  if (!agreed.ok()) {
    // No rank took a hold; give the buffer back.
    if (choice >= 0) h->results[choice].holders.store(0);
    return agreed;
  }
  choice = h->ranks[0].result_choice[parity].load(std::memory_order_acquire);
  if (choice < 0) {
    Status bound = bind_outputs(&tensors);
    if (!bound.ok()) {
      // The others are inside the collective already: fail them too, now.
      return Abort(bound.code(), "rank " + std::to_string(rank_) +
                                     " could not allocate all-reduce outputs: " +
                                     bound.message());
    }
    return ReduceChunks(tensors, /*shared_out=*/false);
  }
  *hold = std::make_shared<ResultHold>(box_, choice);
  char* base = box_->base() + h->results[choice].offset;
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].out = base + at[i];
    sums->push_back(tensors[i].out);
  }
  SMB_RETURN_IF_ERROR(ReduceChunks(tensors, /*shared_out=*/true));
  // Every rank's slices are in the buffer before anyone reads them.
  return Sync("allreduce (result)");
}

int Communicator::TakeResultBuffer(size_t bytes) {
  BoxHeader* h = box_->header();
  int best = -1;   // the smallest free buffer that fits
  int spare = -1;  // else a free buffer to give new memory: unused ones first
  for (int k = 0; k < kMaxResults; ++k) {
    ResultBuffer& b = h->results[k];
    if (b.holders.load(std::memory_order_acquire) != 0) continue;
    if (b.bytes >= bytes && (best < 0 || b.bytes < h->results[best].bytes)) best = k;
    if (spare < 0 || b.bytes < h->results[spare].bytes) spare = k;
  }
  if (best < 0 && spare >= 0) {
    // The heap never shrinks: the spare's old memory (if any) stays unused.
    uint64_t offset = 0;
    const uint64_t grown = AlignUp(bytes, size_t{1} << 20);
    if (box_->AllocateHeap(grown, "an all-reduce result buffer", &offset).ok()) {
      h->results[spare].offset = offset;
      h->results[spare].bytes = grown;
      best = spare;
    }
  }
  if (best >= 0) h->results[best].holders.store(world_, std::memory_order_relaxed);
  return best;
}

Status Communicator::ReduceChunks(const std::vector<TensorRef>& tensors,
                                  bool shared_out) {
  const size_t staging = box_->header()->staging_bytes;
  std::vector<const char*> sources(world_);
  // One pass per dtype over all tensors of that dtype: tensor fusion.
  for (int32_t code = 1; code <= kNumDTypes; ++code) {
    const DType dtype = static_cast<DType>(code);
    const size_t elem = DTypeSize(dtype);
    std::vector<Piece> pieces;
    size_t total = 0;
    for (const TensorRef& t : tensors) {
      if (t.dtype != dtype) continue;
      const size_t bytes = NumElements(t.shape) * elem;
      if (bytes == 0) continue;
      pieces.push_back({static_cast<const char*>(t.in),
                        static_cast<char*>(t.out), bytes});
      total += bytes;
    }
    const size_t chunk = staging / elem * elem;
    for (size_t offset = 0; offset < total; offset += chunk) {
      const size_t len = std::min(chunk, total - offset);
      const int buffer = static_cast<int>(chunks_++ & 1);
      // Rank q sums bytes [lo(q), lo(q + 1)) of the chunk for everyone.
      const size_t n = len / elem;
      auto lo = [&](int q) { return n * q / world_ * elem; };
      const size_t my_lo = lo(rank_), my_hi = lo(rank_ + 1);
      char* mine = box_->staging(buffer, rank_);
      GatherBytes(pieces, offset, my_lo, mine);
      GatherBytes(pieces, offset + my_hi, len - my_hi, mine + my_hi);
      SMB_RETURN_IF_ERROR(Sync("allreduce (staging)"));
      ForRange(pieces, offset + my_lo, my_hi - my_lo,
               [&](const Piece& p, size_t at, size_t pos, size_t bytes) {
                 for (int q = 0; q < world_; ++q) {
                   sources[q] = q == rank_ ? p.in + at
                                           : box_->staging(buffer, q) + my_lo + pos;
                 }
                 // Copied out, the others take this slice from my staging.
                 SumRanks(dtype, sources, p.out + at,
                          shared_out ? nullptr : mine + my_lo + pos, bytes / elem);
               });
      if (shared_out) continue;
      SMB_RETURN_IF_ERROR(Sync("allreduce (reduction)"));
      for (int q = 0; q < world_; ++q) {
        if (q == rank_) continue;
        ScatterBytes(box_->staging(buffer, q) + lo(q), offset + lo(q),
                     lo(q + 1) - lo(q), pieces);
      }
    }
  }
  return Status::Ok();
}

Status Communicator::Broadcast(int root, const std::vector<TensorRef>& tensors) {
  SMB_RETURN_IF_ERROR(ValidateTensors(tensors));
  if (root < 0 || root >= world_) {
    return InvalidArgument("broadcast root must be in [0, " +
                           std::to_string(world_) + "), got " +
                           std::to_string(root));
  }
  std::vector<Piece> pieces;
  size_t total = 0;
  for (const TensorRef& t : tensors) {
    const size_t bytes = NumElements(t.shape) * DTypeSize(t.dtype);
    if (bytes == 0) continue;
    pieces.push_back({static_cast<const char*>(t.in), static_cast<char*>(t.out),
                      bytes});
    total += bytes;
  }
  if (rank_ == root) {
    for (const Piece& p : pieces) {
      if (p.in != p.out) std::memcpy(p.out, p.in, p.bytes);
    }
  }
  if (world_ == 1) return Status::Ok();
  SMB_RETURN_IF_ERROR(Agree(
      "broadcast",
      Describe(("broadcast from rank " + std::to_string(root)).c_str(), tensors)));
  const size_t chunk = box_->header()->staging_bytes;
  for (size_t offset = 0; offset < total; offset += chunk) {
    const size_t len = std::min(chunk, total - offset);
    const int buffer = static_cast<int>(chunks_++ & 1);
    if (rank_ == root) GatherBytes(pieces, offset, len, box_->staging(buffer, 0));
    SMB_RETURN_IF_ERROR(Sync("broadcast"));
    if (rank_ != root) ScatterBytes(box_->staging(buffer, 0), offset, len, pieces);
  }
  return Status::Ok();
}

}  // namespace smb
