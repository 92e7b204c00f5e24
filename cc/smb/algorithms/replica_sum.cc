#include "cc/smb/algorithms/replica_sum.h"

#include <algorithm>
#include <cstring>
#include <thread>

namespace smb {
namespace {

// Elements [begin, end) of the tensors laid end to end, summed over replicas.
void SumRange(const std::vector<ReplicaSumTensor>& tensors, size_t begin, size_t end) {
  size_t offset = 0;  // of the current tensor's first element
  for (const ReplicaSumTensor& t : tensors) {
    const size_t first = std::max(begin, offset);
    const size_t last = std::min(end, offset + t.elements);
    if (first < last) {
      const size_t item = DTypeSize(t.dtype);
      const size_t skip = (first - offset) * item;
      const size_t n = last - first;
      char* out = static_cast<char*>(t.out) + skip;
      auto at = [&](size_t r) { return static_cast<const char*>(t.replicas[r]) + skip; };
      if (t.replicas.size() == 1) {
        if (out != at(0)) std::memcpy(out, at(0), n * item);
      } else {
        SumInto(t.dtype, out, at(0), at(1), n);
        for (size_t r = 2; r < t.replicas.size(); ++r) SumInto(t.dtype, out, out, at(r), n);
      }
    }
    offset += t.elements;
    if (offset >= end) break;
  }
}

}  // namespace

void RunPartsOnThreads(int parts, const std::function<void(int)>& part) {
  std::vector<std::thread> threads;
  threads.reserve(parts > 1 ? parts - 1 : 0);
  for (int p = 1; p < parts; ++p) threads.emplace_back(part, p);
  if (parts > 0) part(0);
  for (std::thread& t : threads) t.join();
}

Status ReplicaSum(const std::vector<ReplicaSumTensor>& tensors, int parts,
                  const PartRunner& run) {
  if (parts < 1) {
    return Status(Code::kInvalidArgument,
                  "replica sum: parts must be >= 1, got " + std::to_string(parts));
  }
  size_t total = 0;
  for (const ReplicaSumTensor& t : tensors) {
    if (t.replicas.empty()) {
      return Status(Code::kInvalidArgument, "replica sum: a tensor has no replicas");
    }
    total += t.elements;
  }
  if (total == 0) return Status::Ok();
  // Parts of whole cache lines (16 float32s) where there are enough elements.
  constexpr size_t kGrain = 16;
  const size_t share = (total + parts - 1) / static_cast<size_t>(parts);
  const size_t per_part = (share + kGrain - 1) / kGrain * kGrain;
  const int used = static_cast<int>((total + per_part - 1) / per_part);  // <= parts
  run(used, [&](int p) {
    const size_t begin = static_cast<size_t>(p) * per_part;
    SumRange(tensors, begin, std::min(total, begin + per_part));
  });
  return Status::Ok();
}

}  // namespace smb
