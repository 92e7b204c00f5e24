// The Soft Memory Box on one node: a POSIX shared-memory region holding a
// segment table, the ranks' control words (GroupControl, see peers.h),
// collective staging buffers and a heap for named segments and result buffers.
//
//   smb::Box::Options opts;
//   opts.job_id = "job42"; opts.world = 2;
//   std::unique_ptr<smb::Box> box;
//   SMB_RETURN_IF_ERROR(smb::Box::Create(opts, &box));     // launcher / rank 0
//   SMB_RETURN_IF_ERROR(smb::Box::Attach("job42", 30.0, &box));  // workers
//
// The region is created with mode 0600 under the name "/tf_smb_<uid>_<job_id>",
// removed when the last user detaches, and reclaimed by the next Create() on
// the node when every process that used it is gone (a job killed by SIGKILL).
#ifndef TF_SMB_CC_SMB_BOX_H_
#define TF_SMB_CC_SMB_BOX_H_

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cc/smb/defaults.h"
#include "cc/smb/dtype.h"
#include "cc/smb/peers.h"
#include "cc/smb/status.h"
#include "cc/smb/tensor.h"

namespace smb {

constexpr int kMaxSegments = 4096;
constexpr int kMaxDims = 8;            // dimensions of a segment's shape
constexpr size_t kSegmentNameBytes = 128;

// A segment is locked in stripes of this many bytes (the last one may be
// shorter), so that pushes to one large segment from several ranks run at
// once, each rank on another stripe, rather than one after another.
constexpr size_t kStripeBytes = size_t{256} << 10;

inline uint64_t NumStripes(uint64_t segment_bytes) {
  return segment_bytes == 0 ? 1 : (segment_bytes + kStripeBytes - 1) / kStripeBytes;
}

struct alignas(64) StripeLock {
  // Seqlock word: odd while an update of the stripe is being written.
  // Readers retry until they copied the stripe between two equal even values.
  std::atomic<uint64_t> version;
  pthread_mutex_t write_lock;  // robust, process-shared: one writer at a time
};

struct SegmentEntry {
  char name[kSegmentNameBytes];
  int32_t dtype;
  int32_t num_dims;
  int64_t dims[kMaxDims];
  uint64_t offset;          // from the start of the region
  uint64_t bytes;
  uint64_t key;             // creation key handed to attachers
  uint64_t stripes_offset;  // StripeLock[NumStripes(bytes)], from the start of the region
};

struct BoxHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t world;
  uint64_t staging_bytes;   // per rank and per buffer
  uint64_t staging_offset;  // 2 buffers x world x staging_bytes
  uint64_t heap_offset;
  uint64_t heap_bytes;
  uint64_t total_bytes;
  int32_t creator_pid;
  uid_t owner_uid;
  std::atomic<uint32_t> ready;     // set last by the creator
  std::atomic<uint32_t> attached;  // processes mapping the box right now
  char job_id[128];
  pthread_mutex_t table_lock;      // robust, process-shared
  uint64_t heap_used;
  uint32_t segment_count;
  SegmentEntry segments[kMaxSegments];
  std::atomic<int32_t> pids[kMaxWorld];  // 0 until the rank attaches
  std::atomic<int32_t> left[kMaxWorld];  // Peers::Left: how the rank left, 0 until then
  GroupControl group;  // the ranks' collectives (see peers.h)
};

// A named segment's place in this process's mapping of the box.
struct Segment {
  uint64_t key = 0;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  void* data = nullptr;
  size_t bytes = 0;
  StripeLock* stripes = nullptr;  // NumStripes(bytes) of them
};

class Box {
 public:
  struct Options {
    std::string job_id;
    int world = 1;
    // Staging memory per rank and per buffer; all-reduce and broadcast work in
    // chunks of this size, so tensors of any size fit a bounded box.
    size_t staging_bytes = kDefaultStagingBytes;
    // Room for result buffers and named segments (sparse; see defaults.h).
    size_t heap_bytes = kDefaultHeapBytes;
  };

  // Creates the job's box. Fails with kAlreadyExists if a live job uses the
  // name; first removes boxes on this node whose processes are all gone.
  static Status Create(const Options& options, std::unique_ptr<Box>* out);
  // Maps an existing box, waiting up to timeout_s for its creator.
  static Status Attach(const std::string& job_id, double timeout_s,
                       std::unique_ptr<Box>* out);
  // Removes this user's boxes whose processes are all dead; returns how many.
  static int ReclaimStale();
  static Status ValidateJobId(const std::string& job_id);
  static std::string ShmName(const std::string& job_id);

  // Only Create() and Attach() can make the token: use those.
  class Token {
    friend class Box;
    Token() = default;
  };
  Box(Token, std::string name, BoxHeader* header, size_t bytes)
      : name_(std::move(name)), header_(header), mapped_bytes_(bytes) {}
  ~Box();
  Box(const Box&) = delete;
  Box& operator=(const Box&) = delete;

  BoxHeader* header() const { return header_; }
  const std::string& name() const { return name_; }
  char* base() const { return reinterpret_cast<char*>(header_); }
  // Staging buffer `buffer` (0 or 1) of rank `rank`.
  char* staging(int buffer, int rank) const;

  // Removes the name now (the mapping stays valid until destruction).
  void Unlink();

  // Segment table. Create returns the creation key that Attach takes; creating
  // an existing name with the same dtype and shape returns its key. A new
  // segment holds `initial` (its bytes) before any rank can see it, else zeros.
  Status CreateSegment(const std::string& name, DType dtype,
                       const std::vector<int64_t>& shape, uint64_t* key,
                       const void* initial = nullptr);
  Status LookupSegment(const std::string& name, uint64_t* key);
  Status AttachSegment(uint64_t key, DType dtype,
                       const std::vector<int64_t>& shape, Segment* out);
  // Takes `bytes` (64-byte aligned) from the heap; *offset is from the start
  // of the region. The heap never shrinks.
  Status AllocateHeap(uint64_t bytes, const std::string& what, uint64_t* offset);

 private:
  Status LockTable();
  void UnlockTable();
  Status AllocateHeapLocked(uint64_t bytes, const std::string& what,
                            uint64_t* offset);

  std::string name_;
  BoxHeader* header_;
  size_t mapped_bytes_;
};

inline size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace smb

#endif  // TF_SMB_CC_SMB_BOX_H_
