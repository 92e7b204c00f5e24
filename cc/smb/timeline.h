// A timeline of what each rank did, in the Chrome trace / Perfetto JSON format
// (Horovod's HOROVOD_TIMELINE, for tf_smb): each collective with its phases
// (negotiate, agree, stage, wait, reduce, copy out), the asynchronous mode's
// segment reads and pushes and clock waits, and the training steps that the
// Python layer reports. Off unless started; then every process keeps its
// events in memory (bounded) and writes them at exit or on Flush().
//
//   smb::timeline::Options o;            // or StartFromEnvironment(), which
//   o.path = "/tmp/trace.json";          // reads TF_SMB_TIMELINE
//   o.job_id = "job42"; o.rank = 1; o.world = 2;
//   smb::timeline::Start(o);
//   {
//     smb::timeline::Scope scope(rank, smb::timeline::kCollectives, "reduce");
//     ...                                // recorded when the scope ends
//   }
//
// Files. With one rank the process writes `path` itself. With more, every
// process writes its part, `<path>.parts/<job>.rank<r>.json` (replaced
// atomically), and the process of rank 0, at its exit, waits for the others'
// parts (until each has appeared, its rank is gone, or TF_SMB_TIMELINE_WAIT_S
// seconds, default 60, have passed), merges them into `path` and removes
// them. `python -m tf_smb.timeline merge PATH` merges parts left behind (e.g.
// when rank 0 died first). Ranks whose files rank 0 may not see (on another
// node, where no filesystem need be shared) hand their final part to rank 0
// instead (Options::send_final_part, StorePart), through the job's link.
//
// Cost. Off: On() is one relaxed load of a flag and a branch, in Scope's
// constructor and destructor; no clock reads, no allocation. On: two clock
// reads and a short locked append per event (~0.1-0.2 us). Memory: at most
// TF_SMB_TIMELINE_MAX_EVENTS events (default 1,000,000, ~40 MB) per process;
// later ones are counted and dropped (the part says how many). Writing
// copies the events once and streams the JSON (~150 bytes an event) to the
// file a megabyte at a time.
//
// Thread safety: every function may be called from any thread.
#ifndef TF_SMB_CC_SMB_TIMELINE_H_
#define TF_SMB_CC_SMB_TIMELINE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cc/smb/status.h"

namespace smb {
namespace timeline {

// The rows ("threads") of a rank in the trace. Events of one track nest (the
// collectives of a rank run one at a time on one thread); events of the
// flat tracks (segments, clock) may overlap, and are spread over numbered
// lanes when written.
enum Track : int {
  kSteps = 0,        // training steps and epochs (from Python)
  kCollectives = 1,  // collectives and their phases
  kClock = 2,        // asynchronous mode: step clock waits
  kSegments = 3,     // asynchronous mode: segment reads and pushes
  kNumTracks = 4,
};

// A rank for events of the process's own rank (the one Start was given).
constexpr int kThisProcess = -1;

struct Options {
  std::string path;    // the job's JSON file
  std::string job_id;  // names the parts: parts of other jobs are never merged
  int rank = 0;        // this process's rank
  int world = 1;
  size_t max_events = 1000000;
  double merge_wait_s = 60.0;
  // Whether rank r's process is gone (then rank 0 stops waiting for its
  // part); null: never known, wait the full time.
  std::function<bool(int)> rank_gone;
  // Set: this rank's final part goes to rank 0 through it (there StorePart
  // writes it into the parts), not into this process's parts directory.
  std::function<Status(std::vector<char> part)> send_final_part;
};

namespace internal {
extern std::atomic<bool> on;
}  // namespace internal

// True while the timeline records. The one check on every hook's path.
inline bool On() { return internal::on.load(std::memory_order_relaxed); }

// Nanoseconds of CLOCK_MONOTONIC (Python's time.monotonic_ns(): the same
// clock, shared by the processes of a node).
int64_t NowNs();

// Starts recording (once per process; a second call changes nothing and
// returns OK). Registers the write (and rank 0's merge) at process exit.
Status Start(const Options& options);
// Start() with path $TF_SMB_TIMELINE, if set and not empty (limits from
// $TF_SMB_TIMELINE_MAX_EVENTS and $TF_SMB_TIMELINE_WAIT_S); true when it
// started (or was already on).
bool StartFromEnvironment(const std::string& job_id, int rank, int world,
                          std::function<bool(int)> rank_gone,
                          std::function<Status(std::vector<char>)> send_final_part = nullptr);

// One complete event of `rank` ([start_ns, end_ns)) on `track`; `category`
// is the trace's "cat" (e.g. "phase"). An `arg_name` adds {"arg_name": arg}.
// Does nothing while off.
void Record(int rank, int track, const std::string& name, const char* category,
            int64_t start_ns, int64_t end_ns, const char* arg_name = nullptr,
            int64_t arg = 0);
// The id of the track named `name` (a built-in one, or a new one).
int TrackId(const std::string& name);

// Writes this process's events so far: its part, or with one rank the job's
// file (`*written` names it). Recording goes on. OK and "" while off.
Status Flush(std::string* written);
// The final write at exit (also run by Start's exit handler): stops
// recording, writes, and on rank 0 merges the job's parts into the path.
Status Finish();
// On rank 0: writes the final part another rank of this job sent
// (send_final_part) among this process's timeline's parts, for its merge.
// NotFound when this process records no timeline.
Status StorePart(int rank, const std::vector<char>& part);
// Merges the parts of `job_id` (ranks 0..world-1) in `path`.parts into
// `path`, waiting for missing ones as Options describes; removes the parts.
Status MergeParts(const std::string& path, const std::string& job_id, int world,
                  double wait_s, const std::function<bool(int)>& rank_gone);

// Records the time from its construction to its end as an event, when the
// timeline is on at construction.
class Scope {
 public:
  Scope(int rank, int track, const char* name, const char* category = "phase")
      : active_(On()) {
    if (active_) Begin(rank, track, name, category);
  }
  ~Scope() {
    if (active_) End();
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

  bool active() const { return active_; }
  // Only while active(): a name built at run time, an argument.
  void set_name(std::string name) { dynamic_name_ = std::move(name); }
  void set_arg(const char* name, int64_t value) {
    arg_name_ = name;
    arg_ = value;
  }

 private:
  void Begin(int rank, int track, const char* name, const char* category);
  void End();

  const bool active_;
  int rank_ = 0;
  int track_ = 0;
  const char* name_ = nullptr;
  const char* category_ = nullptr;
  const char* arg_name_ = nullptr;
  int64_t arg_ = 0;
  int64_t start_ns_ = 0;
  std::string dynamic_name_;
};

}  // namespace timeline
}  // namespace smb

#endif  // TF_SMB_CC_SMB_TIMELINE_H_
