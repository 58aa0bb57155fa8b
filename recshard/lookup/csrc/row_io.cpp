// Row I/O of key_value tables (recshard/lookup/row_store.py) in one call per batch.
//
// A file holds fixed-size rows back to back; a buffer holds fixed-size slots back to back.
// rs_rows_io moves rows[i] of the file to/from slots[i] of the buffer (slot i when slots is
// null), one preadv/pwritev per run of consecutive rows (at most IOV_MAX slots each), so a
// batch costs one foreign call (ctypes drops the GIL for it) and one syscall per run instead
// of a Python loop. Every row and slot is checked against the file's and buffer's row counts
// before anything moves: nothing is read or written past either end.
//
// Reads with depth > 1 first try every run without blocking (preadv2 RWF_NOWAIT: served from
// the page cache or not at all); the runs the device must serve are then read by up to `depth`
// threads at once (one read in flight each), so a batch of cold rows waits about one device
// latency per `depth` rows instead of one per row. Only when no two rows of the batch go to one
// slot (checked; else every run is read in batch order): the buffer then ends the same whatever
// order the reads finish in. Writes go one after another, in batch order.
//
// Returns 0, or RS_BAD_ROW / RS_BAD_SLOT (position in *detail), RS_SYSCALL (errno in *detail;
// ENOMEM when the batch's bookkeeping cannot be allocated) or RS_SHORT (the file ended first, or
// a write moved nothing); with several threads, the error of the first failing run in batch
// order. After an error some slots may hold rows and others not: the caller trusts none of
// them. No C++ exception crosses the C boundary (it would abort the process).

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <new>
#include <sys/uio.h>
#include <system_error>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

constexpr int RS_OK = 0;
constexpr int RS_BAD_ROW = 1;
constexpr int RS_BAD_SLOT = 2;
constexpr int RS_SYSCALL = 3;
constexpr int RS_SHORT = 4;

#ifdef IOV_MAX
constexpr int kMaxIov = IOV_MAX;
#else
constexpr int kMaxIov = 1024;
#endif

// Moves all of iov[0..count) at `offset`, resuming after partial transfers and EINTR.
int transfer(int fd, struct iovec* iov, int count, off_t offset, bool write, int64_t* detail) {
  while (count > 0) {
    ssize_t moved = write ? pwritev(fd, iov, count, offset) : preadv(fd, iov, count, offset);
    if (moved < 0) {
      if (errno == EINTR) continue;
      *detail = errno;
      return RS_SYSCALL;
    }
    if (moved == 0) return RS_SHORT;
    offset += moved;
    while (count > 0 && static_cast<size_t>(moved) >= iov->iov_len) {
      moved -= static_cast<ssize_t>(iov->iov_len);
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + moved;
      iov->iov_len -= static_cast<size_t>(moved);
    }
  }
  return RS_OK;
}

// A run of consecutive rows: iovecs [iov_begin, iov_end) of the batch's, `bytes` in all, at
// `offset` of the file.
struct Run {
  size_t iov_begin, iov_end;
  off_t offset;
  size_t bytes;
};

// Whether `run` was read whole from the page cache without waiting for the device.
bool read_cached(int fd, std::vector<struct iovec>& iov, const Run& run) {
  ssize_t moved = preadv2(fd, &iov[run.iov_begin], static_cast<int>(run.iov_end - run.iov_begin),
                          run.offset, RWF_NOWAIT);
  return moved >= 0 && static_cast<size_t>(moved) == run.bytes;
}

// Whether no two of slots[0..count) are the same slot.
bool distinct(const int64_t* slots, int64_t count) {
  std::vector<int64_t> sorted(slots, slots + count);
  std::sort(sorted.begin(), sorted.end());
  return std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
}

// Reads `runs` with up to `depth` threads (this one among them); the first failing run's error.
int read_in_parallel(int fd, std::vector<struct iovec>& iov, const std::vector<Run>& runs,
                     int depth, int64_t* detail) {
  std::vector<int> codes(runs.size(), RS_OK);
  std::vector<int64_t> details(runs.size(), 0);
  std::atomic<size_t> next{0};
  auto work = [&]() {
    for (size_t k = next++; k < runs.size(); k = next++) {
      const Run& run = runs[k];
      codes[k] = transfer(fd, &iov[run.iov_begin], static_cast<int>(run.iov_end - run.iov_begin),
                          run.offset, false, &details[k]);
    }
  };
  std::vector<std::thread> helpers;
  const size_t count = std::min(runs.size(), static_cast<size_t>(depth)) - 1;
  helpers.reserve(count);  // may throw bad_alloc, but before any thread runs
  for (size_t t = 0; t < count; ++t) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {  // no thread to spare: the others read its runs
      break;
    }
  }
  work();
  for (std::thread& helper : helpers) helper.join();
  for (size_t k = 0; k < runs.size(); ++k) {
    if (codes[k] != RS_OK) {
      *detail = details[k];
      return codes[k];
    }
  }
  return RS_OK;
}

int rows_io(int write, int fd, int64_t row_bytes, int64_t file_rows, const int64_t* rows,
            int64_t count, char* buffer, int64_t buffer_rows, const int64_t* slots, int depth,
            int64_t* detail) {
  if (row_bytes <= 0) return RS_SHORT;
  for (int64_t i = 0; i < count; ++i) {
    if (rows[i] < 0 || rows[i] >= file_rows) {
      *detail = i;
      return RS_BAD_ROW;
    }
    int64_t slot = slots ? slots[i] : i;
    if (slot < 0 || slot >= buffer_rows) {
      *detail = i;
      return RS_BAD_SLOT;
    }
  }
  std::vector<struct iovec> iov;
  std::vector<Run> runs;
  int64_t i = 0;
  while (i < count) {  // runs of consecutive rows; adjacent slots join one iovec
    Run run{iov.size(), iov.size(), static_cast<off_t>(rows[i] * row_bytes), 0};
    do {
      char* at = buffer + (slots ? slots[i] : i) * row_bytes;
      if (iov.size() > run.iov_begin &&
          static_cast<char*>(iov.back().iov_base) + iov.back().iov_len == at) {
        iov.back().iov_len += static_cast<size_t>(row_bytes);
      } else {
        iov.push_back({at, static_cast<size_t>(row_bytes)});
      }
      run.bytes += static_cast<size_t>(row_bytes);
      ++i;
    } while (i < count && rows[i] == rows[i - 1] + 1 &&
             static_cast<int>(iov.size() - run.iov_begin) < kMaxIov);
    run.iov_end = iov.size();
    runs.push_back(run);
  }
  // reads in any order land the same only when no two rows go to one slot
  const bool parallel = !write && depth > 1 && (slots == nullptr || distinct(slots, count));
  std::vector<Run> from_device;  // runs the page cache did not serve (all of them in order
                                 // unless parallel)
  for (const Run& run : runs) {
    if (!parallel || !read_cached(fd, iov, run)) from_device.push_back(run);
  }
  if (parallel && from_device.size() > 1)
    return read_in_parallel(fd, iov, from_device, depth, detail);
  for (const Run& run : from_device) {
    int code = transfer(fd, &iov[run.iov_begin], static_cast<int>(run.iov_end - run.iov_begin),
                        run.offset, write != 0, detail);
    if (code != RS_OK) return code;
  }
  return RS_OK;
}

}  // namespace

extern "C" int rs_rows_io(int write, int fd, int64_t row_bytes, int64_t file_rows,
                          const int64_t* rows, int64_t count, char* buffer, int64_t buffer_rows,
                          const int64_t* slots, int depth, int64_t* detail) {
  *detail = 0;
  try {
    return rows_io(write, fd, row_bytes, file_rows, rows, count, buffer, buffer_rows, slots,
                   depth, detail);
  } catch (const std::bad_alloc&) {  // before any helper thread starts (reserved)
    *detail = ENOMEM;
    return RS_SYSCALL;
  }
}
