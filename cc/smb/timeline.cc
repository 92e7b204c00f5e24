#include "cc/smb/timeline.h"

#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace smb {
namespace timeline {
namespace internal {
std::atomic<bool> on{false};
}  // namespace internal

namespace {

constexpr size_t kMaxNames = 65536;  // distinct names kept; later ones share one
constexpr int kMaxTracks = 16;
constexpr int kMaxLanes = 16;        // lanes of a flat track; tid = track * 16 + lane
constexpr std::streamoff kTailBytes = 1024;  // a part's end: its otherData
constexpr double kPollS = 0.02;      // how often rank 0 looks for the others' parts

const char* const kBuiltinTracks[kNumTracks] = {"steps", "collectives", "clock", "segments"};

struct Event {
  int64_t start_ns;
  int64_t dur_ns;
  int64_t arg;
  uint32_t name;
  uint32_t category;
  uint32_t arg_name;  // 0: no argument; else name id + 1
  int32_t rank;
  int32_t track;
};

struct Recorder {
  std::mutex mu;
  // Held while a snapshot is taken and written: writes of one process never
  // interleave, and a later snapshot is never overwritten by an earlier one.
  std::mutex write_mu;
  bool started = false;
  bool finished = false;
  pid_t pid = 0;  // the process that started it (a forked child never writes)
  Options options;
  std::deque<Event> events;
  uint64_t dropped = 0;
  // Interned names: ids index `names`; the map's keys view those strings
  // (a deque never moves its elements).
  std::deque<std::string> names;
  std::unordered_map<std::string_view, uint32_t> ids;
  std::vector<std::string> tracks{kBuiltinTracks, kBuiltinTracks + kNumTracks};

  uint32_t Intern(std::string_view s) {
    auto it = ids.find(s);
    if (it != ids.end()) return it->second;
    if (names.size() >= kMaxNames && s != "(other)") return Intern("(other)");
    names.emplace_back(s);
    const uint32_t id = static_cast<uint32_t>(names.size() - 1);
    ids.emplace(std::string_view(names.back()), id);
    return id;
  }
};

// Never destroyed: threads that outlive main (a detached scheduler thread)
// may still try to record at exit.
Recorder& R() {
  static Recorder* recorder = new Recorder();
  return *recorder;
}

void Append(int rank, int track, std::string_view name, const char* category,
            int64_t start_ns, int64_t end_ns, const char* arg_name, int64_t arg) {
  Recorder& r = R();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.started || r.finished) return;
  if (r.events.size() >= r.options.max_events) {
    ++r.dropped;
    return;
  }
  Event e;
  e.start_ns = start_ns;
  e.dur_ns = std::max<int64_t>(0, end_ns - start_ns);
  e.arg = arg;
  e.name = r.Intern(name);
  e.category = r.Intern(category != nullptr ? category : "");
  e.arg_name = arg_name != nullptr ? r.Intern(arg_name) + 1 : 0;
  e.rank = rank == kThisProcess ? r.options.rank : rank;
  e.track = track >= 0 && track < static_cast<int>(r.tracks.size()) ? track : kSteps;
  r.events.push_back(e);
}

void AppendJsonString(std::string* out, std::string_view s) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out->append(buf);
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

// Microseconds with nanosecond digits, as the trace format counts time.
void AppendMicros(std::string* out, int64_t ns) {
  char buf[40];
  const char* sign = ns < 0 ? "-" : "";
  const int64_t a = ns < 0 ? -ns : ns;
  std::snprintf(buf, sizeof buf, "%s%lld.%03lld", sign, static_cast<long long>(a / 1000),
                static_cast<long long>(a % 1000));
  out->append(buf);
}

// Writes a trace document's lines, a megabyte at a time: a line is built in
// `line`, then EndLine() adds it (after a comma, unless it is the first).
struct Writer {
  static constexpr size_t kChunk = size_t{1} << 20;
  explicit Writer(FILE* file) : f(file) {}
  explicit Writer(std::vector<char>* bytes) : memory(bytes) {}
  void EndLine() {
    if (!first) buf.append(",\n");
    first = false;
    buf.append(line);
    line.clear();
    if (buf.size() >= kChunk) Drain();
  }
  void Drain() {
    if (memory != nullptr) {
      memory->insert(memory->end(), buf.begin(), buf.end());
    } else if (!buf.empty() && std::fwrite(buf.data(), 1, buf.size(), f) != buf.size()) {
      ok = false;
    }
    buf.clear();
  }
  FILE* f = nullptr;
  std::vector<char>* memory = nullptr;  // set: the document goes here, not to f
  std::string line;
  std::string buf;
  bool first = true;
  bool ok = true;
};

void AppendMetadata(Writer* w, const char* what, int pid, int tid, const char* key,
                    const std::string& value, bool quoted) {
  std::string* out = &w->line;
  out->append("{\"name\":\"").append(what).append("\",\"ph\":\"M\",\"pid\":");
  out->append(std::to_string(pid)).append(",\"tid\":").append(std::to_string(tid));
  out->append(",\"args\":{\"").append(key).append("\":");
  if (quoted) {
    AppendJsonString(out, value);
  } else {
    out->append(value);
  }
  out->append("}}");
  w->EndLine();
}

// A snapshot of the recorder, taken under its lock, written without it.
struct Snapshot {
  Options options;
  std::vector<Event> events;
  uint64_t dropped = 0;
  std::vector<std::string> names;
  std::vector<std::string> tracks;
};

bool IsFlat(int track) { return track == kClock || track == kSegments; }

// The events as trace lines, metadata first: a process per rank, a thread
// per track (and lane).
void Lines(const Snapshot& s, Writer* w) {
  // Lanes of the flat tracks: each event goes to the first lane free at its
  // start, so that no two events of a lane overlap.
  std::vector<size_t> order(s.events.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const Event &x = s.events[a], &y = s.events[b];
    if (x.rank != y.rank) return x.rank < y.rank;
    if (x.track != y.track) return x.track < y.track;
    return x.start_ns < y.start_ns;
  });
  std::vector<int> tid(s.events.size());
  std::vector<std::pair<int, int>> threads;  // (rank, tid) in use
  std::vector<int64_t> lane_end;
  int group_rank = -1, group_track = -1;
  for (size_t i : order) {
    const Event& e = s.events[i];
    if (e.rank != group_rank || e.track != group_track) {
      group_rank = e.rank;
      group_track = e.track;
      lane_end.clear();
    }
    int lane = 0;
    if (IsFlat(e.track)) {
      while (lane < static_cast<int>(lane_end.size()) && lane_end[lane] > e.start_ns) ++lane;
      if (lane >= kMaxLanes) lane = kMaxLanes - 1;
      if (lane >= static_cast<int>(lane_end.size())) lane_end.resize(lane + 1, 0);
      lane_end[lane] = std::max(lane_end[lane], e.start_ns + e.dur_ns);
    }
    tid[i] = e.track * kMaxLanes + lane;
    if (threads.empty() || threads.back() != std::make_pair(e.rank, tid[i])) {
      threads.emplace_back(e.rank, tid[i]);
    }
  }
  std::sort(threads.begin(), threads.end());
  threads.erase(std::unique(threads.begin(), threads.end()), threads.end());

  std::string& out = w->line;
  std::vector<int> ranks{s.options.rank};
  for (const auto& t : threads) ranks.push_back(t.first);
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  for (int rank : ranks) {
    AppendMetadata(w, "process_name", rank, 0, "name", "rank " + std::to_string(rank), true);
    AppendMetadata(w, "process_sort_index", rank, 0, "sort_index", std::to_string(rank),
                   false);
    if (rank == s.options.rank && s.dropped > 0) {
      AppendMetadata(w, "process_labels", rank, 0, "labels",
                     "timeline full: " + std::to_string(s.dropped) +
                         " later events dropped (TF_SMB_TIMELINE_MAX_EVENTS)",
                     true);
    }
  }
  for (const auto& t : threads) {
    const int track = t.second / kMaxLanes, lane = t.second % kMaxLanes;
    std::string name = s.tracks[track];
    if (lane > 0) name += " #" + std::to_string(lane + 1);
    AppendMetadata(w, "thread_name", t.first, t.second, "name", name, true);
    AppendMetadata(w, "thread_sort_index", t.first, t.second, "sort_index",
                   std::to_string(t.second), false);
  }
  for (size_t i = 0; i < s.events.size(); ++i) {
    const Event& e = s.events[i];
    out.append("{\"name\":");
    AppendJsonString(&out, s.names[e.name]);
    out.append(",\"cat\":");
    AppendJsonString(&out, s.names[e.category]);
    out.append(",\"ph\":\"X\",\"pid\":").append(std::to_string(e.rank));
    out.append(",\"tid\":").append(std::to_string(tid[i]));
    out.append(",\"ts\":");
    AppendMicros(&out, e.start_ns);
    out.append(",\"dur\":");
    AppendMicros(&out, e.dur_ns);
    if (e.arg_name != 0) {
      out.append(",\"args\":{");
      AppendJsonString(&out, s.names[e.arg_name - 1]);
      out.append(":").append(std::to_string(e.arg)).append("}");
    }
    out.append("}");
    w->EndLine();
  }
}

std::string OtherData(const std::string& job_id, int world, const std::string& extra) {
  std::string out = ",\"otherData\":{\"tf_smb_job\":";
  AppendJsonString(&out, job_id);
  out.append(",\"world\":").append(std::to_string(world)).append(extra).append("}");
  return out;
}

// Writes {"traceEvents":[ <the lines `body` writes> ], ...}: a part or the job's file.
void Compose(Writer* w, const std::string& other_data, const std::function<void(Writer*)>& body) {
  w->buf = "{\"traceEvents\":[\n";
  body(w);
  w->buf.append("\n],\"displayTimeUnit\":\"ms\"").append(other_data).append("}\n");
  w->Drain();
}

// Replaces `path` (atomically) by what `write` puts into the file.
Status ReplaceFile(const std::string& path, const std::function<bool(FILE*)>& write) {
  const std::string tmp = path + ".tmp-" + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return SystemError("cannot write the timeline to " + tmp);
  const bool written = write(f);
  if (std::fclose(f) != 0 || !written) {
    std::remove(tmp.c_str());
    return SystemError("cannot write the timeline to " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return SystemError("cannot move the timeline to " + path);
  }
  return Status::Ok();
}

Status WriteDocument(const std::string& path, const std::string& other_data,
                     const std::function<void(Writer*)>& body) {
  return ReplaceFile(path, [&](FILE* f) {
    Writer w(f);
    Compose(&w, other_data, body);
    return w.ok;
  });
}

std::string PartsDir(const std::string& path) { return path + ".parts"; }

// mkdir -p: `dir` and the directories above it.
Status MakeDirs(const std::string& dir) {
  for (size_t slash = dir.find('/', 1); ; slash = dir.find('/', slash + 1)) {
    const std::string prefix = dir.substr(0, slash);
    if (!prefix.empty() && ::mkdir(prefix.c_str(), 0777) != 0 && errno != EEXIST) {
      return SystemError("cannot make the timeline's directory " + prefix);
    }
    if (slash == std::string::npos) return Status::Ok();
  }
}

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

std::string PartPath(const std::string& path, const std::string& job_id, int rank) {
  return PartsDir(path) + "/" + job_id + ".rank" + std::to_string(rank) + ".json";
}

// Which clock a part's times are on: CLOCK_MONOTONIC, shared by the
// processes of one boot of one host (its boot id), and how far that host's
// CLOCK_REALTIME was ahead of it. A merge moves the events of another host's
// parts by the difference, so hosts whose real-time clocks agree (NTP) line up.
std::string ClockData() {
  std::string boot_id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot_id);
  timespec real, mono;
  clock_gettime(CLOCK_REALTIME, &real);
  clock_gettime(CLOCK_MONOTONIC, &mono);
  const int64_t ahead = (static_cast<int64_t>(real.tv_sec) - mono.tv_sec) * 1000000000 +
                        (real.tv_nsec - mono.tv_nsec);
  std::string out = ",\"boot_id\":";
  AppendJsonString(&out, boot_id);
  return out + ",\"realtime_ahead_ns\":" + std::to_string(ahead);
}

// The last `bytes` of file `path` ("" when it cannot be read).
std::string Tail(const std::string& path, std::streamoff bytes) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return "";
  const std::streamoff size = in.tellg();
  const std::streamoff tail = std::min<std::streamoff>(size, bytes);
  std::string end(static_cast<size_t>(tail), '\0');
  in.seekg(size - tail);
  in.read(&end[0], tail);
  return end;
}

// The text of `"key":` in `json` up to the next ',' or '}' ("" if absent).
std::string Field(const std::string& json, const std::string& key) {
  const std::string tag = "\"" + key + "\":";
  const size_t at = json.rfind(tag);
  if (at == std::string::npos) return "";
  const size_t start = at + tag.size();
  const size_t end = json.find_first_of(",}", start);
  return json.substr(start, end == std::string::npos ? std::string::npos : end - start);
}

// Nanoseconds to add to the times of the part whose tail is `part_tail` to
// put them on the clock of the part whose tail is `reference_tail`: 0 on one
// host (one boot), or when either part does not say.
int64_t ClockShiftNs(const std::string& part_tail, const std::string& reference_tail) {
  const std::string boot = Field(part_tail, "boot_id"), ref_boot = Field(reference_tail, "boot_id");
  const std::string ahead = Field(part_tail, "realtime_ahead_ns");
  const std::string ref_ahead = Field(reference_tail, "realtime_ahead_ns");
  if (boot.empty() || ref_boot.empty() || boot == ref_boot || ahead.empty() || ref_ahead.empty()) {
    return 0;
  }
  return std::strtoll(ahead.c_str(), nullptr, 10) - std::strtoll(ref_ahead.c_str(), nullptr, 10);
}

// Moves the event on `line` (if it has a "ts") by `shift_ns`.
void ShiftTime(std::string* line, int64_t shift_ns) {
  const std::string tag = ",\"ts\":";
  const size_t at = line->find(tag);
  if (shift_ns == 0 || at == std::string::npos) return;
  const size_t start = at + tag.size();
  const size_t end = line->find_first_of(",}", start);
  if (end == std::string::npos) return;
  const std::string micros = line->substr(start, end - start);
  const size_t dot = micros.find('.');
  const bool negative = !micros.empty() && micros[0] == '-';
  int64_t ns = std::strtoll(micros.substr(negative, dot - negative).c_str(), nullptr, 10) * 1000;
  if (dot != std::string::npos) ns += std::strtoll(micros.substr(dot + 1, 3).c_str(), nullptr, 10);
  std::string moved;
  AppendMicros(&moved, (negative ? -ns : ns) + shift_ns);
  line->replace(start, end - start, moved);
}

// Whether `part` is there and holds its rank's final events (written at its
// exit, not by a Flush() along the way): its last line says so.
bool IsFinalPart(const std::string& part) {
  return Tail(part, kTailBytes).find("\"final\":true") != std::string::npos;
}

Snapshot Take() {
  Recorder& r = R();
  std::lock_guard<std::mutex> lock(r.mu);
  Snapshot s;
  s.options = r.options;
  s.events.assign(r.events.begin(), r.events.end());
  s.dropped = r.dropped;
  s.names.assign(r.names.begin(), r.names.end());
  s.tracks = r.tracks;
  return s;
}

// `final`: the events of the whole run (at exit), not a Flush() on the way.
Status Write(const Snapshot& s, bool final, std::string* written) {
  const Options& o = s.options;
  const std::string other = OtherData(
      o.job_id, o.world,
      ",\"rank\":" + std::to_string(o.rank) + ",\"final\":" + (final ? "true" : "false") +
          ",\"dropped_events\":" + std::to_string(s.dropped) + ClockData());
  if (o.world <= 1) {
    *written = o.path;
    SMB_RETURN_IF_ERROR(MakeDirs(DirOf(o.path)));
    return WriteDocument(o.path, other, [&s](Writer* w) { Lines(s, w); });
  }
  if (final && o.send_final_part) {  // rank 0 may not see this process's files
    std::vector<char> part;
    Writer w(&part);
    Compose(&w, other, [&s](Writer* w) { Lines(s, w); });
    *written = "rank 0's " + PartPath(o.path, o.job_id, o.rank);
    return o.send_final_part(std::move(part));
  }
  SMB_RETURN_IF_ERROR(MakeDirs(PartsDir(o.path)));
  *written = PartPath(o.path, o.job_id, o.rank);
  return WriteDocument(*written, other, [&s](Writer* w) { Lines(s, w); });
}

void AtExit() {
  {
    Recorder& r = R();
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.pid != getpid()) return;  // a forked child: the part is its parent's
  }
  Status s = Finish();
  if (!s.ok()) std::fprintf(stderr, "tf_smb timeline: %s\n", s.message().c_str());
}

template <typename T>
T EnvNumber(const char* name, T fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  const double v = std::strtod(value, &end);
  if (end == value || *end != '\0' || !(v >= 0)) {
    std::fprintf(stderr, "tf_smb timeline: ignoring %s=%s (not a number >= 0)\n", name, value);
    return fallback;
  }
  return static_cast<T>(v);
}

}  // namespace

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

Status Start(const Options& options) {
  if (options.path.empty()) return InvalidArgument("the timeline needs a file path");
  if (options.world < 1 || options.rank < 0 || options.rank >= options.world) {
    return InvalidArgument("timeline: rank " + std::to_string(options.rank) +
                           " is not in a world of " + std::to_string(options.world));
  }
  Recorder& r = R();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.started) return Status::Ok();
    r.started = true;
    r.options = options;
    r.pid = getpid();
  }
  std::atexit(AtExit);
  internal::on.store(true, std::memory_order_release);
  return Status::Ok();
}

bool StartFromEnvironment(const std::string& job_id, int rank, int world,
                          std::function<bool(int)> rank_gone,
                          std::function<Status(std::vector<char>)> send_final_part) {
  const char* path = std::getenv("TF_SMB_TIMELINE");
  if (path == nullptr || *path == '\0') return false;
  Options o;
  o.path = path;
  o.job_id = job_id;
  o.rank = rank;
  o.world = world;
  o.max_events = EnvNumber<size_t>("TF_SMB_TIMELINE_MAX_EVENTS", o.max_events);
  o.merge_wait_s = EnvNumber<double>("TF_SMB_TIMELINE_WAIT_S", o.merge_wait_s);
  o.rank_gone = std::move(rank_gone);
  o.send_final_part = std::move(send_final_part);
  Status s = Start(o);
  if (!s.ok()) {
    std::fprintf(stderr, "tf_smb timeline: not recording: %s\n", s.message().c_str());
    return false;
  }
  return true;
}

void Record(int rank, int track, const std::string& name, const char* category,
            int64_t start_ns, int64_t end_ns, const char* arg_name, int64_t arg) {
  if (!On()) return;
  Append(rank, track, name, category, start_ns, end_ns, arg_name, arg);
}

int TrackId(const std::string& name) {
  Recorder& r = R();
  std::lock_guard<std::mutex> lock(r.mu);
  for (size_t i = 0; i < r.tracks.size(); ++i) {
    if (r.tracks[i] == name) return static_cast<int>(i);
  }
  if (r.tracks.size() >= static_cast<size_t>(kMaxTracks)) return kSteps;
  r.tracks.push_back(name);
  return static_cast<int>(r.tracks.size() - 1);
}

Status Flush(std::string* written) {
  written->clear();
  Recorder& r = R();
  std::lock_guard<std::mutex> write_lock(r.write_mu);
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.started || r.finished) return Status::Ok();
  }
  return Write(Take(), /*final=*/false, written);
}

Status Finish() {
  Recorder& r = R();
  std::unique_lock<std::mutex> write_lock(r.write_mu);
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.started || r.finished) return Status::Ok();
    r.finished = true;
  }
  internal::on.store(false, std::memory_order_relaxed);
  const Snapshot s = Take();
  std::string written;
  SMB_RETURN_IF_ERROR(Write(s, /*final=*/true, &written));
  write_lock.unlock();
  if (s.options.world > 1 && s.options.rank == 0) {
    return MergeParts(s.options.path, s.options.job_id, s.options.world,
                      s.options.merge_wait_s, s.options.rank_gone);
  }
  return Status::Ok();
}

Status StorePart(int rank, const std::vector<char>& part) {
  Options o;
  {
    Recorder& r = R();
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.started) {
      return Status(Code::kNotFound,
                    "rank " + std::to_string(rank) + " sent its timeline, but rank 0 records "
                    "none: set TF_SMB_TIMELINE for every rank");
    }
    o = r.options;
  }
  if (rank <= 0 || rank >= o.world) {
    return InvalidArgument("a timeline part from rank " + std::to_string(rank) +
                           ", expected 1.." + std::to_string(o.world - 1));
  }
  SMB_RETURN_IF_ERROR(MakeDirs(PartsDir(o.path)));
  return ReplaceFile(PartPath(o.path, o.job_id, rank), [&part](FILE* f) {
    return std::fwrite(part.data(), 1, part.size(), f) == part.size();
  });
}

Status MergeParts(const std::string& path, const std::string& job_id, int world,
                  double wait_s, const std::function<bool(int)>& rank_gone) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  std::vector<int> missing, partial, exited;
  std::vector<std::string> present;
  for (int rank = 0; rank < world; ++rank) {
    const std::string part = PartPath(path, job_id, rank);
    // Gone before its final part appeared: it never writes one. (A rank
    // writes its part before it exits, so look at the part after learning
    // that it left.)
    bool final = IsFinalPart(part);
    while (!final) {
      const bool gone = rank_gone && rank_gone(rank);
      final = IsFinalPart(part);
      if (!final && gone) exited.push_back(rank);
      if (final || gone || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::duration<double>(kPollS));
    }
    if (!std::ifstream(part)) {
      missing.push_back(rank);
      continue;
    }
    if (!final) partial.push_back(rank);  // only what it flushed along the way
    present.push_back(part);
  }
  // Events and metadata, one per line: all lines of the parts but their
  // documents' first and last.
  // Times on the clock of the first part (rank 0's): see ClockData.
  const std::string reference = present.empty() ? "" : Tail(present[0], kTailBytes);
  auto body = [&present, &reference](Writer* w) {
    for (const std::string& part : present) {
      const int64_t shift_ns = ClockShiftNs(Tail(part, kTailBytes), reference);
      std::ifstream in(part);
      std::string& line = w->line;
      while (std::getline(in, line)) {
        if (line.empty() || line[0] != '{' || line.rfind("{\"traceEvents\"", 0) == 0) continue;
        if (line.back() == ',') line.pop_back();
        ShiftTime(&line, shift_ns);
        w->EndLine();
      }
      line.clear();
    }
  };
  auto json_list = [](const std::vector<int>& ranks) {
    std::string out = "[";
    for (size_t i = 0; i < ranks.size(); ++i) out += (i ? "," : "") + std::to_string(ranks[i]);
    return out + "]";
  };
  const std::string extra = ",\"missing_ranks\":" + json_list(missing) +
                            ",\"partial_ranks\":" + json_list(partial);
  SMB_RETURN_IF_ERROR(WriteDocument(path, OtherData(job_id, world, extra), body));
  if (!missing.empty() || !partial.empty()) {
    std::vector<int> incomplete = missing;
    incomplete.insert(incomplete.end(), partial.begin(), partial.end());
    std::sort(incomplete.begin(), incomplete.end());
    const bool all_exited = exited.size() == incomplete.size();
    return Status(Code::kDeadlineExceeded,
                  "wrote " + path + " without the final events of rank(s) " +
                      json_list(incomplete) +
                      (all_exited ? std::string(" (exited without writing them)")
                                  : " (none within " + std::to_string(static_cast<int>(wait_s)) +
                                        " s; exited without: " + json_list(exited) + ")") +
                      "; the parts stay in " + PartsDir(path) +
                      ": merge them later with `python -m tf_smb.timeline merge " + path + "`");
  }
  for (int rank = 0; rank < world; ++rank) std::remove(PartPath(path, job_id, rank).c_str());
  ::rmdir(PartsDir(path).c_str());  // fails while other jobs' parts are there: fine
  return Status::Ok();
}

void Scope::Begin(int rank, int track, const char* name, const char* category) {
  rank_ = rank;
  track_ = track;
  name_ = name;
  category_ = category;
  start_ns_ = NowNs();
}

void Scope::End() {
  const int64_t end = NowNs();
  if (!dynamic_name_.empty()) {
    Append(rank_, track_, dynamic_name_, category_, start_ns_, end, arg_name_, arg_);
  } else {
    Append(rank_, track_, name_, category_, start_ns_, end, arg_name_, arg_);
  }
}

}  // namespace timeline
}  // namespace smb
