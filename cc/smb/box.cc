#include "cc/smb/box.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "cc/smb/process.h"

namespace smb {
namespace {

constexpr uint64_t kMagic = 0x534d42424f583031ull;  // "SMBBOX01"
constexpr uint32_t kLayoutVersion = 7;
constexpr size_t kPage = 4096;
constexpr char kShmDir[] = "/dev/shm/";
// A box still being set up is never reclaimed before this age.
constexpr double kSetupGraceSeconds = 60.0;

// A mutex that works across processes and survives its holder's death.
Status InitSharedMutex(pthread_mutex_t* mu) {
  pthread_mutexattr_t attr;
  int rc = pthread_mutexattr_init(&attr);
  if (rc == 0) rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  if (rc == 0) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  if (rc == 0) rc = pthread_mutex_init(mu, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) {
    return Internal("cannot make a process-shared robust mutex: " +
                    std::string(std::strerror(rc)));
  }
  return Status::Ok();
}

std::string UserPrefix() {
  return "tf_smb_" + std::to_string(static_cast<unsigned>(getuid())) + "_";
}

// Maps the first `bytes` of an open shm fd.
void* MapFd(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// True if the box file `entry` (a name under /dev/shm) belongs to no live
// process and may be removed.
bool IsStale(const std::string& entry) {
  const std::string shm_name = "/" + entry;
  int fd = shm_open(shm_name.c_str(), O_RDWR, 0);
  if (fd < 0) return false;
  struct stat st;
  bool stale = false;
  if (fstat(fd, &st) == 0 && st.st_uid == getuid()) {
    const double age = static_cast<double>(time(nullptr) - st.st_mtime);
    if (static_cast<size_t>(st.st_size) < sizeof(BoxHeader)) {
      stale = age > kSetupGraceSeconds;  // creator died before ftruncate
    } else if (void* p = MapFd(fd, sizeof(BoxHeader))) {
      auto* h = static_cast<BoxHeader*>(p);
      if (h->magic != kMagic || h->ready.load() == 0) {
        stale = !IsProcessAlive(h->creator_pid) && age > 1.0;
      } else {
        bool any_alive = IsProcessAlive(h->creator_pid);
        for (uint32_t r = 0; r < h->world && r < kMaxWorld && !any_alive; ++r) {
          any_alive = IsProcessAlive(h->pids[r].load());
        }
        stale = !any_alive;
      }
      munmap(p, sizeof(BoxHeader));
    }
  }
  close(fd);
  return stale;
}

}  // namespace

Status Box::ValidateJobId(const std::string& job_id) {
  if (job_id.empty() || job_id.size() > 100) {
    return InvalidArgument("job id must have 1 to 100 characters, got " +
                           std::to_string(job_id.size()));
  }
  for (char c : job_id) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' ||
          c == '.')) {
      return InvalidArgument("job id may hold only letters, digits, '-', '_' "
                             "and '.', got '" + job_id + "'");
    }
  }
  return Status::Ok();
}

std::string Box::ShmName(const std::string& job_id) {
  return "/" + UserPrefix() + job_id;
}

int Box::ReclaimStale() {
  const std::string prefix = UserPrefix();
  std::vector<std::string> stale;
  if (DIR* dir = opendir(kShmDir)) {
    while (dirent* e = readdir(dir)) {
      const std::string entry = e->d_name;
      if (entry.compare(0, prefix.size(), prefix) == 0 && IsStale(entry)) {
        stale.push_back(entry);
      }
    }
    closedir(dir);
  }
  for (const std::string& entry : stale) shm_unlink(("/" + entry).c_str());
  return static_cast<int>(stale.size());
}

Status Box::Create(const Options& options, std::unique_ptr<Box>* out) {
  SMB_RETURN_IF_ERROR(ValidateJobId(options.job_id));
  if (options.world < 1 || options.world > kMaxWorld) {
    return InvalidArgument("world size must be in [1, " +
                           std::to_string(kMaxWorld) + "], got " +
                           std::to_string(options.world));
  }
  if (options.staging_bytes < 64) {
    return InvalidArgument("staging_bytes must be at least 64, got " +
                           std::to_string(options.staging_bytes));
  }
  ReclaimStale();
  const std::string name = ShmName(options.job_id);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST) {
    return Status(Code::kAlreadyExists,
                  "a running job already uses job id '" + options.job_id +
                      "' (shared memory " + name + ")");
  }
  if (fd < 0) return SystemError("shm_open(" + name + ")");
  // Whatever the umask, private to this user; a box others could open is
  // never used.
  if (fchmod(fd, 0600) != 0) {
    Status s = SystemError("fchmod(" + name + ", 0600)");
    close(fd);
    shm_unlink(name.c_str());
    return s;
  }

  const size_t staging = AlignUp(options.staging_bytes, 64);
  const size_t header_bytes = AlignUp(sizeof(BoxHeader), kPage);
  const size_t staging_total = AlignUp(2 * options.world * staging, kPage);
  const size_t heap = AlignUp(options.heap_bytes, kPage);
  const size_t total = header_bytes + staging_total + heap;
  if (ftruncate(fd, static_cast<off_t>(total)) != 0) {
    Status s = SystemError("ftruncate(" + name + ")");
    close(fd);
    shm_unlink(name.c_str());
    return s;
  }
  void* p = MapFd(fd, total);
  close(fd);
  if (p == nullptr) {
    shm_unlink(name.c_str());
    return SystemError("mmap(" + name + ")");
  }
  auto* h = static_cast<BoxHeader*>(p);
  h->creator_pid = getpid();
  h->owner_uid = getuid();
  h->magic = kMagic;
  h->layout_version = kLayoutVersion;
  h->world = static_cast<uint32_t>(options.world);
  h->staging_bytes = staging;
  h->staging_offset = header_bytes;
  h->heap_offset = header_bytes + staging_total;
  h->heap_bytes = heap;
  h->total_bytes = total;
  std::strncpy(h->job_id, options.job_id.c_str(), sizeof h->job_id - 1);
  Status locked = InitSharedMutex(&h->table_lock);
  if (!locked.ok()) {
    munmap(p, total);
    shm_unlink(name.c_str());
    return locked;
  }
  h->attached.store(1);
  h->ready.store(1, std::memory_order_release);
  *out = std::make_unique<Box>(Token(), name, h, total);
  return Status::Ok();
}

Status Box::Attach(const std::string& job_id, double timeout_s,
                   std::unique_ptr<Box>* out) {
  SMB_RETURN_IF_ERROR(ValidateJobId(job_id));
  const std::string name = ShmName(job_id);
  const double deadline = MonotonicSeconds() + timeout_s;
  for (;;) {
    int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd >= 0) {
      struct stat st;
      if (fstat(fd, &st) == 0 &&
          static_cast<size_t>(st.st_size) >= sizeof(BoxHeader)) {
        void* hp = MapFd(fd, sizeof(BoxHeader));
        auto* h = static_cast<BoxHeader*>(hp);
        // A box whose creator is gone belongs to a dead job with the same
        // id: wait for this job's creator to reclaim and remake it.
        if (h != nullptr && h->ready.load(std::memory_order_acquire) &&
            h->magic == kMagic && IsProcessAlive(h->creator_pid)) {
          const size_t total = h->total_bytes;
          const uint32_t layout = h->layout_version;
          munmap(hp, sizeof(BoxHeader));
          if (layout != kLayoutVersion) {
            close(fd);
            return InvalidArgument("box " + name + " has layout version " +
                                   std::to_string(layout) +
                                   ", this build expects " +
                                   std::to_string(kLayoutVersion));
          }
          void* p = MapFd(fd, total);
          close(fd);
          if (p == nullptr) return SystemError("mmap(" + name + ")");
          auto* full = static_cast<BoxHeader*>(p);
          full->attached.fetch_add(1);
          *out = std::make_unique<Box>(Token(), name, full, total);
          return Status::Ok();
        }
        if (hp != nullptr) munmap(hp, sizeof(BoxHeader));
      }
      close(fd);
    }
    if (MonotonicSeconds() >= deadline) {
      return Status(Code::kDeadlineExceeded,
                    "no box for job '" + job_id + "' (" + name +
                        ") appeared within " + std::to_string(timeout_s) +
                        "s; is rank 0 or the launcher running?");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

Box::~Box() {
  if (header_->attached.fetch_sub(1) == 1) shm_unlink(name_.c_str());
  munmap(header_, mapped_bytes_);
}

void Box::Unlink() { shm_unlink(name_.c_str()); }

char* Box::staging(int buffer, int rank) const {
  const size_t index = static_cast<size_t>(buffer) * header_->world + rank;
  return base() + header_->staging_offset + index * header_->staging_bytes;
}

Status Box::LockTable() {
  int rc = pthread_mutex_lock(&header_->table_lock);
  if (rc == EOWNERDEAD) {
    // The holder died; the table is only written after all checks pass, so
    // what it holds is consistent.
    rc = pthread_mutex_consistent(&header_->table_lock);
  }
  if (rc != 0) return Internal("cannot lock the segment table: " +
                               std::string(std::strerror(rc)));
  return Status::Ok();
}

void Box::UnlockTable() { pthread_mutex_unlock(&header_->table_lock); }

Status Box::CreateSegment(const std::string& name, DType dtype,
                          const std::vector<int64_t>& shape, uint64_t* key,
                          const void* initial) {
  if (name.empty() || name.size() >= kSegmentNameBytes) {
    return InvalidArgument("segment name must have 1 to " +
                           std::to_string(kSegmentNameBytes - 1) +
                           " characters, got " + std::to_string(name.size()));
  }
  if (shape.size() > static_cast<size_t>(kMaxDims)) {
    return InvalidArgument("a segment has at most " + std::to_string(kMaxDims) +
                           " dimensions, got " +
                           std::to_string(shape.size()));
  }
  uint64_t bytes = DTypeSize(dtype);
  for (int64_t d : shape) {
    if (d < 0) return InvalidArgument("negative dimension in shape " +
                                      ShapeString(shape));
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) {
      return InvalidArgument("segment shape " + ShapeString(shape) +
                             " has more bytes than a 64-bit size can hold");
    }
  }
  SMB_RETURN_IF_ERROR(LockTable());
  BoxHeader* h = header_;
  for (uint32_t i = 0; i < h->segment_count; ++i) {
    SegmentEntry& e = h->segments[i];
    if (name == e.name) {
      const std::vector<int64_t> have(e.dims, e.dims + e.num_dims);
      const DType have_dtype = static_cast<DType>(e.dtype);
      UnlockTable();
      if (have_dtype != dtype || have != shape) {
        return InvalidArgument("segment '" + name + "' exists as " +
                               DTypeName(have_dtype) + ShapeString(have) +
                               ", cannot create it as " + DTypeName(dtype) +
                               ShapeString(shape));
      }
      *key = e.key;
      return Status::Ok();
    }
  }
  if (h->segment_count >= static_cast<uint32_t>(kMaxSegments)) {
    UnlockTable();
    return Status(Code::kResourceExhausted,
                  "box segment table full: " + std::to_string(kMaxSegments) +
                      " segments, cannot add '" + name + "'");
  }
  uint64_t offset = 0, stripes_offset = 0;
  const uint64_t stripes = NumStripes(bytes);
  Status allocated = AllocateHeapLocked(bytes, "segment '" + name + "'", &offset);
  if (allocated.ok()) {
    allocated = AllocateHeapLocked(stripes * sizeof(StripeLock),
                                   "the locks of segment '" + name + "'", &stripes_offset);
  }
  if (!allocated.ok()) {
    UnlockTable();
    return allocated;
  }
  const uint32_t index = h->segment_count;
  SegmentEntry& e = h->segments[index];
  std::strncpy(e.name, name.c_str(), kSegmentNameBytes - 1);
  e.dtype = static_cast<int32_t>(dtype);
  e.num_dims = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) e.dims[i] = shape[i];
  e.offset = offset;
  e.bytes = bytes;
  e.stripes_offset = stripes_offset;
  // The key binds the slot to this box, so a key from another job fails.
  e.key = (static_cast<uint64_t>(h->creator_pid) << 32) | (index + 1);
  auto* locks = reinterpret_cast<StripeLock*>(base() + stripes_offset);
  for (uint64_t k = 0; k < stripes; ++k) {
    locks[k].version.store(0);
    Status locked = InitSharedMutex(&locks[k].write_lock);
    if (!locked.ok()) {
      UnlockTable();  // the heap bytes stay taken; the slot stays unpublished
      return locked;
    }
  }
  if (initial != nullptr && bytes != 0) std::memcpy(base() + offset, initial, bytes);
  h->segment_count = index + 1;  // publish last
  *key = e.key;
  UnlockTable();
  return Status::Ok();
}

Status Box::AllocateHeapLocked(uint64_t bytes, const std::string& what,
                               uint64_t* offset) {
  BoxHeader* h = header_;
  const uint64_t start = AlignUp(h->heap_used, 64);
  if (start > h->heap_bytes || bytes > h->heap_bytes - start) {
    return Status(Code::kResourceExhausted,
                  "box heap full: " + what + " needs " + std::to_string(bytes) +
                      " bytes, " +
                      std::to_string(h->heap_bytes -
                                     std::min<uint64_t>(start, h->heap_bytes)) +
                      " left (raise heap_bytes)");
  }
  h->heap_used = start + bytes;
  *offset = h->heap_offset + start;
  return Status::Ok();
}

Status Box::AllocateHeap(uint64_t bytes, const std::string& what,
                         uint64_t* offset) {
  SMB_RETURN_IF_ERROR(LockTable());
  Status s = AllocateHeapLocked(bytes, what, offset);
  UnlockTable();
  return s;
}

Status Box::LookupSegment(const std::string& name, uint64_t* key) {
  SMB_RETURN_IF_ERROR(LockTable());
  for (uint32_t i = 0; i < header_->segment_count; ++i) {
    if (name == header_->segments[i].name) {
      *key = header_->segments[i].key;
      UnlockTable();
      return Status::Ok();
    }
  }
  UnlockTable();
  return Status(Code::kNotFound, "no segment named '" + name + "' in the box");
}

Status Box::AttachSegment(uint64_t key, DType dtype,
                          const std::vector<int64_t>& shape, Segment* out) {
  const uint32_t index = static_cast<uint32_t>(key & 0xffffffffu) - 1;
  SMB_RETURN_IF_ERROR(LockTable());
  const bool valid = index < header_->segment_count &&
                     header_->segments[index].key == key;
  UnlockTable();
  if (!valid) {
    return Status(Code::kNotFound, "no segment with creation key " +
                                       std::to_string(key) + " in this box");
  }
  SegmentEntry& e = header_->segments[index];
  const std::vector<int64_t> have(e.dims, e.dims + e.num_dims);
  const DType have_dtype = static_cast<DType>(e.dtype);
  if (have_dtype != dtype || have != shape) {
    return InvalidArgument("segment '" + std::string(e.name) + "' holds " +
                           DTypeName(have_dtype) + ShapeString(have) +
                           " but was attached as " + DTypeName(dtype) +
                           ShapeString(shape));
  }
  out->key = key;
  out->dtype = dtype;
  out->shape = have;
  out->data = base() + e.offset;
  out->bytes = e.bytes;
  out->stripes = reinterpret_cast<StripeLock*>(base() + e.stripes_offset);
  return Status::Ok();
}

}  // namespace smb
