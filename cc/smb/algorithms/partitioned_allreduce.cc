#include "cc/smb/algorithms/partitioned_allreduce.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "cc/smb/algorithms/pieces.h"
#include "cc/smb/copy.h"
#include "cc/smb/timeline.h"

namespace smb {
namespace {

size_t AlignTo64(size_t n) { return (n + 63) / 64 * 64; }

// Across nodes, a rank's share goes over the network in pieces: each piece
// starts as soon as its bytes are summed on the node, so summing the next
// overlaps the transfer, and the link has the next pieces at hand (the
// transport keeps many in flight: nodes_allreduce.h's AllReduceQueue). A piece is
// at least kLinkPieceMinBytes per node (the messages of a NodesAllReduce stay
// past per-message costs: 1 MB at 4 x 1 took 15 ms in 4 rings, 11 ms in one) and,
// within that, a sixteenth of the share (the first starts early), at most
// kLinkPieceMaxBytes.
constexpr size_t kLinkPieceMinBytes = size_t{256} << 10;
constexpr size_t kLinkPieceMaxBytes = size_t{8} << 20;

size_t LinkPieceBytes(int nodes, size_t share, size_t elem) {
  const size_t least = kLinkPieceMinBytes * static_cast<size_t>(nodes);
  const size_t bytes = std::max(least, std::min(kLinkPieceMaxBytes, share / 16));
  return std::max(elem, bytes / elem * elem);
}

// dst (and copy, if not null) = srcs[0] + srcs[1] + ... in rank order, n
// elements. Sums a small block at a time in a local buffer, so dst may be
// any of the sources and the block stays in L1. `stream`: dst is written
// with CopyStreaming (copy.h; the caller fences).
void SumRanks(DType dtype, const std::vector<const char*>& srcs, char* dst, char* copy,
              size_t n, bool stream = false) {
  alignas(64) char block[16384];
  const size_t elem = DTypeSize(dtype);
  const size_t per = sizeof block / elem;
  if (srcs.size() == 1) {  // one rank on this node (the nodes sum it)
    std::memcpy(dst, srcs[0], n * elem);
    if (copy != nullptr) std::memcpy(copy, srcs[0], n * elem);
    return;
  }
  for (size_t i = 0; i < n; i += per) {
    const size_t m = std::min(per, n - i);
    const size_t at = i * elem;
    SumInto(dtype, block, srcs[0] + at, srcs[1] + at, m);
    for (size_t q = 2; q < srcs.size(); ++q) SumInto(dtype, block, block, srcs[q] + at, m);
    if (stream) {
      CopyStreaming(dst + at, block, m * elem);
    } else {
      std::memcpy(dst + at, block, m * elem);
    }
    if (copy != nullptr) std::memcpy(copy + at, block, m * elem);
  }
}

// One rank: every sum is the input itself.
void CopyThrough(const std::vector<TensorRef>& tensors) {
  for (const TensorRef& t : tensors) {
    if (t.in != t.out) std::memcpy(t.out, t.in, NumBytes(t));
  }
}

// The reduction of tensors that passed Agree(), on one node; with
// `shared_out` the outputs are in a result buffer every rank reads. Chunk by
// chunk through the staging buffers: rank q sums slice q of the chunk for
// everyone, and the others copy it out.
Status ReduceChunksOnNode(Group& group, const std::vector<TensorRef>& tensors, bool shared_out) {
  Peers* peers = group.peers();
  const int world = group.world(), rank = group.rank();
  const int trace_rank = group.job_rank();  // the timeline's rows are job ranks
  const size_t staging = peers->staging_bytes();
  std::vector<const char*> sources(world);
  // One pass per dtype over all tensors of that dtype: tensor fusion.
  for (int32_t code = 1; code <= kNumDTypes; ++code) {
    const DType dtype = static_cast<DType>(code);
    const size_t elem = DTypeSize(dtype);
    size_t total = 0;
    std::vector<Piece> pieces = PiecesOf(tensors, &total, dtype);
    const size_t chunk = staging / elem * elem;
    for (size_t offset = 0; offset < total; offset += chunk) {
      const size_t len = std::min(chunk, total - offset);
      const int buffer = group.NextStagingBuffer();
      // Rank q sums bytes [lo(q), lo(q + 1)) of the chunk for everyone.
      const size_t n = len / elem;
      auto lo = [&](int q) { return n * q / world * elem; };
      const size_t my_lo = lo(rank), my_hi = lo(rank + 1);
      char* mine = peers->staging(buffer, rank);
      {
        timeline::Scope phase(trace_rank, timeline::kCollectives, "stage");
        GatherBytes(pieces, offset, my_lo, mine);
        GatherBytes(pieces, offset + my_hi, len - my_hi, mine + my_hi);
      }
      SMB_RETURN_IF_ERROR(group.Sync("allreduce (staging)"));
      {
        timeline::Scope phase(trace_rank, timeline::kCollectives, "reduce");
        // A large result buffer is read from memory anyway, not from a cache.
        const bool stream = shared_out && total >= kStreamingCopyBytes;
        ForRange(pieces, offset + my_lo, my_hi - my_lo,
                 [&](const Piece& p, size_t at, size_t pos, size_t bytes) {
                   for (int q = 0; q < world; ++q) {
                     sources[q] =
                         q == rank ? p.in + at : peers->staging(buffer, q) + my_lo + pos;
                   }
                   // Copied out, the others take this slice from my staging.
                   SumRanks(dtype, sources, p.out + at,
                            shared_out ? nullptr : mine + my_lo + pos, bytes / elem, stream);
                 });
      }
      if (shared_out) continue;
      SMB_RETURN_IF_ERROR(group.Sync("allreduce (reduction)"));
      timeline::Scope phase(trace_rank, timeline::kCollectives, "copy out");
      for (int q = 0; q < world; ++q) {
        if (q == rank) continue;
        ScatterBytes(peers->staging(buffer, q) + lo(q), offset + lo(q), lo(q + 1) - lo(q),
                     pieces);
      }
    }
  }
  return Status::Ok();
}

// The same across nodes. Rank q < slices sums slice q of each chunk on its
// node (staging as above) into its carrier (Group::Carrier): its share of the
// whole all-reduce, which the link sums with local rank q of every other node
// in pieces (LinkPieceBytes), each handed to the link as soon as it is summed,
// while the next chunks are summed. Each piece's sums go to the rank's
// outputs as it comes back; once all are back, they go (unless the outputs
// are shared) through its staging to the node's other ranks, chunk by chunk.
Status ReduceChunksAcrossNodes(Group& group, const std::vector<TensorRef>& tensors,
                               bool shared_out) {
  Peers* peers = group.peers();
  NodeLink* link = group.link();
  const int world = group.world(), rank = group.rank();
  // On a node larger than the job's smallest, ranks >= slices have empty slices.
  const int slices = group.slices();
  const int trace_rank = group.job_rank();
  const size_t staging = peers->staging_bytes();
  std::vector<const char*> sources(world);
  for (int32_t code = 1; code <= kNumDTypes; ++code) {
    const DType dtype = static_cast<DType>(code);
    const size_t elem = DTypeSize(dtype);
    size_t total = 0;
    std::vector<Piece> pieces = PiecesOf(tensors, &total, dtype);
    if (total == 0) continue;
    const size_t chunk = staging / elem * elem;
    // Rank q sums bytes [lo(len, q), lo(len, q + 1)) of a chunk of len bytes.
    auto lo = [&](size_t len, int q) {
      return len / elem * static_cast<size_t>(std::min(q, slices)) / slices * elem;
    };
    size_t share = 0;  // my bytes over all chunks
    for (size_t offset = 0; offset < total; offset += chunk) {
      const size_t len = std::min(chunk, total - offset);
      share += lo(len, rank + 1) - lo(len, rank);
    }
    char* carrier = group.Carrier(share);
    const size_t piece = LinkPieceBytes(link->nodes(), share, elem);
    std::vector<std::shared_ptr<LinkOp>> in_flight;
    size_t summed = 0, sent = 0;  // carrier bytes summed on the node, handed to the link
    auto send = [&](size_t upto) -> Status {
      while (sent < upto) {
        const size_t bytes = std::min(piece, upto - sent);
        in_flight.emplace_back();
        SMB_RETURN_IF_ERROR(
            link->StartAllReduceSum(dtype, carrier + sent, bytes / elem, &in_flight.back()));
        sent += bytes;
      }
      return Status::Ok();
    };
    Status status;
    for (size_t offset = 0; offset < total && status.ok(); offset += chunk) {
      const size_t len = std::min(chunk, total - offset);
      const size_t my_lo = lo(len, rank), my_hi = lo(len, rank + 1);
      if (world > 1) {
        const int buffer = group.NextStagingBuffer();
        char* mine = peers->staging(buffer, rank);
        {
          timeline::Scope phase(trace_rank, timeline::kCollectives, "stage");
          GatherBytes(pieces, offset, my_lo, mine);
          GatherBytes(pieces, offset + my_hi, len - my_hi, mine + my_hi);
        }
        status = group.Sync("allreduce (staging)");
        if (!status.ok()) break;
        timeline::Scope phase(trace_rank, timeline::kCollectives, "reduce");
        ForRange(pieces, offset + my_lo, my_hi - my_lo,
                 [&](const Piece& p, size_t at, size_t pos, size_t bytes) {
                   for (int q = 0; q < world; ++q) {
                     sources[q] =
                         q == rank ? p.in + at : peers->staging(buffer, q) + my_lo + pos;
                   }
                   SumRanks(dtype, sources, carrier + summed + pos, nullptr, bytes / elem);
                 });
      } else {
        timeline::Scope phase(trace_rank, timeline::kCollectives, "stage");
        GatherBytes(pieces, offset, len, carrier + summed);
      }
      summed += my_hi - my_lo;
      // Whole pieces go now; the last one once the share is summed.
      status = send(summed == share ? share : summed / piece * piece);
    }
    // Writes carrier bytes [from, to) to my outputs: the carrier holds my
    // slice of each chunk in turn.
    auto write_out = [&](size_t from, size_t to) {
      size_t at = 0;
      for (size_t offset = 0; offset < total && at < to; offset += chunk) {
        const size_t len = std::min(chunk, total - offset);
        const size_t my_lo = lo(len, rank), mine = lo(len, rank + 1) - my_lo;
        const size_t a = std::max(at, from), b = std::min(at + mine, to);
        if (a < b) ScatterBytes(carrier + a, offset + my_lo + (a - at), b - a, pieces);
        at += mine;
      }
    };
    // Each piece is written out as it comes back (they come in order), while
    // the later ones are still in flight; the node's other ranks read them
    // after the last one (below), unless the outputs are shared.
    for (size_t i = 0; i < in_flight.size(); ++i) {
      timeline::Scope phase(trace_rank, timeline::kCollectives, "across nodes");
      Status waited = link->Wait(in_flight[i], group.timeout_s());
      if (status.ok()) status = std::move(waited);
      if (status.ok()) write_out(i * piece, std::min(share, (i + 1) * piece));
    }
    if (!status.ok()) {
      group.RetireCarrier();  // (every piece waited for: none is in flight now)
      return status;
    }
    if (shared_out || world == 1) continue;
    timeline::Scope phase(trace_rank, timeline::kCollectives, "copy out");
    size_t at = 0;  // in the carrier
    for (size_t offset = 0; offset < total; offset += chunk) {
      const size_t len = std::min(chunk, total - offset);
      const size_t my_lo = lo(len, rank), my_hi = lo(len, rank + 1);
      const int buffer = group.NextStagingBuffer();
      if (my_hi > my_lo) {
        std::memcpy(peers->staging(buffer, rank) + my_lo, carrier + at, my_hi - my_lo);
      }
      SMB_RETURN_IF_ERROR(group.Sync("allreduce (reduction)"));
      for (int q = 0; q < world; ++q) {
        if (q == rank) continue;
        ScatterBytes(peers->staging(buffer, q) + lo(len, q), offset + lo(len, q),
                     lo(len, q + 1) - lo(len, q), pieces);
      }
      at += my_hi - my_lo;
    }
  }
  return Status::Ok();
}

Status ReduceChunks(Group& group, const std::vector<TensorRef>& tensors, bool shared_out) {
  return group.link() != nullptr ? ReduceChunksAcrossNodes(group, tensors, shared_out)
                                 : ReduceChunksOnNode(group, tensors, shared_out);
}

// Whether `tensors` take ReduceSmallAcrossNodes (*dtype: their one dtype):
// across nodes, at most kAgreePayloadBytes of one dtype. The same answer on
// every rank that describes them alike.
bool SmallAcrossNodes(const Group& group, const std::vector<TensorRef>& tensors, DType* dtype) {
  if (group.link() == nullptr) return false;
  size_t total = 0;
  bool any = false;
  for (const TensorRef& t : tensors) {
    const size_t bytes = NumBytes(t);
    if (bytes == 0) continue;
    if (any && t.dtype != *dtype) return false;
    *dtype = t.dtype;
    any = true;
    total += bytes;
  }
  return any && total <= kAgreePayloadBytes && total <= group.peers()->staging_bytes();
}

// A small all-reduce across nodes rides on the agreement: rank r's
// node-partial sum of its slice travels with the node's verdict to local
// rank r of the other nodes, one exchange instead of an agreement and then
// an all-reduce (a round trip saved: what a small collective costs across
// nodes). Every node sums the nodes' partials in node order, so all get the
// same bits. On a disagreement nothing is written to the outputs.
Status ReduceSmallAcrossNodes(Group& group, const std::vector<TensorRef>& tensors, DType dtype) {
  const std::string desc = Describe("allreduce", tensors);
  const int trace_rank = group.job_rank();
  Status verdict;
  {
    timeline::Scope phase(trace_rank, timeline::kCollectives, "agree");
    SMB_RETURN_IF_ERROR(group.AgreeHere("allreduce", desc, &verdict));
  }
  if (!verdict.ok()) return group.AgreeAcrossNodes(desc, verdict);
  Peers* peers = group.peers();
  NodeLink* link = group.link();
  const int world = group.world(), rank = group.rank();
  // Rank q < slices sums slice q for everyone (and carries it across nodes);
  // on a node larger than the job's smallest, the other ranks' slices are empty.
  const int slices = group.slices();
  const size_t elem = DTypeSize(dtype);
  size_t total = 0;
  std::vector<Piece> pieces = PiecesOf(tensors, &total);
  const size_t n = total / elem;
  auto lo = [&](int q) { return n * std::min(q, slices) / slices * elem; };
  const size_t my_lo = lo(rank), my_hi = lo(rank + 1), mine_bytes = my_hi - my_lo;
  const int buffer = group.NextStagingBuffer();
  char* mine = peers->staging(buffer, rank);
  {
    timeline::Scope phase(trace_rank, timeline::kCollectives, "stage");
    GatherBytes(pieces, 0, my_lo, mine);
    GatherBytes(pieces, my_hi, total - my_hi, mine + my_hi);
  }
  SMB_RETURN_IF_ERROR(group.Sync("allreduce (staging)"));
  std::vector<const char*> sources(world);
  {
    timeline::Scope phase(trace_rank, timeline::kCollectives, "reduce");
    ForRange(pieces, my_lo, mine_bytes, [&](const Piece& p, size_t at, size_t pos, size_t bytes) {
      for (int q = 0; q < world; ++q) {
        sources[q] = q == rank ? p.in + at : peers->staging(buffer, q) + my_lo + pos;
      }
      SumRanks(dtype, sources, mine + my_lo + pos, nullptr, bytes / elem);
    });
  }
  std::vector<char> partials;
  {
    timeline::Scope phase(trace_rank, timeline::kCollectives, "across nodes");
    SMB_RETURN_IF_ERROR(
        group.AgreeAcrossNodes(desc, Status::Ok(), mine + my_lo, mine_bytes, &partials));
  }
  if (mine_bytes > 0) {
    char* sum = mine + my_lo;
    std::memcpy(sum, partials.data(), mine_bytes);
    for (int node = 1; node < link->nodes(); ++node) {
      SumInto(dtype, sum, sum, partials.data() + node * mine_bytes, mine_bytes / elem);
    }
    ScatterBytes(sum, my_lo, mine_bytes, pieces);
  }
  SMB_RETURN_IF_ERROR(group.Sync("allreduce (reduction)"));
  timeline::Scope phase(trace_rank, timeline::kCollectives, "copy out");
  for (int q = 0; q < world; ++q) {
    if (q == rank) continue;
    ScatterBytes(peers->staging(buffer, q) + lo(q), lo(q), lo(q + 1) - lo(q), pieces);
  }
  return Status::Ok();
}

// Rank 0: a free result buffer of at least `bytes`, now held by every rank;
// -1 when none is free or the heap is full.
int TakeResultBuffer(Group& group, size_t bytes) {
  Peers* peers = group.peers();
  ResultBuffer* results = peers->control()->results;
  int best = -1;   // the smallest free buffer that fits
  int spare = -1;  // else a free buffer to give new memory: unused ones first
  for (int k = 0; k < kMaxResults; ++k) {
    ResultBuffer& b = results[k];
    if (b.holders.load(std::memory_order_acquire) != 0) continue;
    if (b.bytes >= bytes && (best < 0 || b.bytes < results[best].bytes)) best = k;
    if (spare < 0 || b.bytes < results[spare].bytes) spare = k;
  }
  if (best < 0 && spare >= 0) {
    // The heap never shrinks: the spare's old memory (if any) stays unused.
    uint64_t offset = 0;
    const uint64_t grown = (bytes + (size_t{1} << 20) - 1) / (size_t{1} << 20) * (size_t{1} << 20);
    if (peers->AllocateShared(grown, "an all-reduce result buffer", &offset).ok()) {
      results[spare].offset = offset;
      results[spare].bytes = grown;
      best = spare;
    }
  }
  if (best >= 0) results[best].holders.store(group.world(), std::memory_order_relaxed);
  return best;
}

}  // namespace

ResultHold::~ResultHold() {
  peers_->control()->results[buffer_].holders.fetch_sub(1, std::memory_order_release);
}

Status AllReduceSum(Group& group, const std::vector<TensorRef>& tensors) {
  SMB_RETURN_IF_ERROR(ValidateTensors(tensors));
  if (group.alone()) {
    timeline::Scope phase(group.job_rank(), timeline::kCollectives, "copy out");
    CopyThrough(tensors);
    return Status::Ok();
  }
  DType dtype;
  if (SmallAcrossNodes(group, tensors, &dtype)) return ReduceSmallAcrossNodes(group, tensors, dtype);
  SMB_RETURN_IF_ERROR(group.Agree("allreduce", Describe("allreduce", tensors)));
  return ReduceChunks(group, tensors, /*shared_out=*/false);
}

Status AllReduceSumShared(Group& group, std::vector<TensorRef> tensors, OpContext* context,
                          std::vector<void*>* sums, std::shared_ptr<ResultHold>* hold) {
  sums->clear();
  hold->reset();
  SMB_RETURN_IF_ERROR(ValidateTensors(tensors));
  if (group.alone()) {
    SMB_RETURN_IF_ERROR(context->AllocateOutputs(&tensors));
    timeline::Scope phase(group.job_rank(), timeline::kCollectives, "copy out");
    CopyThrough(tensors);
    return Status::Ok();
  }
  // Where each sum goes in a result buffer: 64-byte aligned, as TensorFlow
  // wants tensor data.
  std::vector<size_t> at(tensors.size());
  size_t need = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    at[i] = need;
    need = AlignTo64(need + NumBytes(tensors[i]));
  }
  DType dtype;
  if (SmallAcrossNodes(group, tensors, &dtype)) {
    Status bound = context->AllocateOutputs(&tensors);
    if (!bound.ok()) {
      return group.Fail(Status(bound.code(), "rank " + std::to_string(group.rank()) +
                                                 " could not allocate all-reduce outputs: " +
                                                 bound.message()));
    }
    return ReduceSmallAcrossNodes(group, tensors, dtype);
  }
  Peers* peers = group.peers();
  GroupControl* g = peers->control();
  const int parity = group.AgreeParity();
  int choice = -1;
  if (group.rank() == 0) {
    choice = need >= kSharedResultMinBytes ? TakeResultBuffer(group, need) : -1;
    g->ranks[0].result_choice[parity].store(choice, std::memory_order_relaxed);
  }
  Status agreed = group.Agree("allreduce", Describe("allreduce", tensors));
  if (!agreed.ok()) {
    // No rank took a hold; give the buffer back.
    if (choice >= 0) g->results[choice].holders.store(0);
    return agreed;
  }
  choice = g->ranks[0].result_choice[parity].load(std::memory_order_acquire);
  if (choice < 0) {
    Status bound = context->AllocateOutputs(&tensors);
    if (!bound.ok()) {
      // The others are inside the collective already: fail them too, now.
      return group.Fail(Status(bound.code(), "rank " + std::to_string(group.rank()) +
                                                 " could not allocate all-reduce outputs: " +
                                                 bound.message()));
    }
    return ReduceChunks(group, tensors, /*shared_out=*/false);
  }
  *hold = std::make_shared<ResultHold>(group.shared_peers(), choice);
  char* base = peers->base() + g->results[choice].offset;
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].out = base + at[i];
    sums->push_back(tensors[i].out);
  }
  SMB_RETURN_IF_ERROR(ReduceChunks(group, tensors, /*shared_out=*/true));
  StreamingFence();
  // Every rank's slices are in the buffer before anyone reads them.
  return group.Sync("allreduce (result)");
}

}  // namespace smb
