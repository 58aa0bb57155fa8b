// Row I/O of key_value tables (recshard/lookup/row_store.py) in one call per batch.
//
// A file holds fixed-size rows back to back; a buffer holds fixed-size slots back to back.
// rs_rows_io moves rows[i] of the file to/from slots[i] of the buffer (slot i when slots is
// null), one preadv/pwritev per run of consecutive rows (at most IOV_MAX slots each), so a
// batch costs one foreign call (ctypes drops the GIL for it) and one syscall per run instead
// of a Python loop. Every row and slot is checked against the file's and buffer's row counts
// before anything moves: nothing is read or written past either end.
//
// Returns 0, or RS_BAD_ROW / RS_BAD_SLOT (position in *detail), RS_SYSCALL (errno in *detail)
// or RS_SHORT (the file ended first, or a write moved nothing).

#include <cerrno>
#include <climits>
#include <cstdint>
#include <sys/uio.h>
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

}  // namespace

extern "C" int rs_rows_io(int write, int fd, int64_t row_bytes, int64_t file_rows,
                          const int64_t* rows, int64_t count, char* buffer, int64_t buffer_rows,
                          const int64_t* slots, int64_t* detail) {
  *detail = 0;
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
  iov.reserve(count < kMaxIov ? count : kMaxIov);
  int64_t i = 0;
  while (i < count) {
    const int64_t first = rows[i];
    iov.clear();
    do {  // a run of consecutive rows; adjacent slots join one iovec
      char* at = buffer + (slots ? slots[i] : i) * row_bytes;
      if (!iov.empty() && static_cast<char*>(iov.back().iov_base) + iov.back().iov_len == at) {
        iov.back().iov_len += static_cast<size_t>(row_bytes);
      } else {
        iov.push_back({at, static_cast<size_t>(row_bytes)});
      }
      ++i;
    } while (i < count && rows[i] == rows[i - 1] + 1 && static_cast<int>(iov.size()) < kMaxIov);
    int code = transfer(fd, iov.data(), static_cast<int>(iov.size()),
                        static_cast<off_t>(first * row_bytes), write != 0, detail);
    if (code != RS_OK) return code;
  }
  return RS_OK;
}
