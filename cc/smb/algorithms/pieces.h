// Byte ranges of a list of tensors seen as one concatenated buffer: how the
// collective algorithms fuse many tensors into one pass.
#ifndef TF_SMB_CC_SMB_ALGORITHMS_PIECES_H_
#define TF_SMB_CC_SMB_ALGORITHMS_PIECES_H_

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <optional>
#include <vector>

#include "cc/smb/tensor.h"

namespace smb {

struct Piece {
  const char* in;
  char* out;
  size_t bytes;
};

// The non-empty tensors (of dtype `only`, if given) as pieces, in order;
// *total = their bytes.
inline std::vector<Piece> PiecesOf(const std::vector<TensorRef>& tensors, size_t* total,
                                   std::optional<DType> only = std::nullopt) {
  std::vector<Piece> pieces;
  *total = 0;
  for (const TensorRef& t : tensors) {
    if (only && t.dtype != *only) continue;
    const size_t bytes = NumBytes(t);
    if (bytes == 0) continue;
    pieces.push_back({static_cast<const char*>(t.in), static_cast<char*>(t.out), bytes});
    *total += bytes;
  }
  return pieces;
}

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
inline void GatherBytes(const std::vector<Piece>& pieces, size_t offset, size_t len, char* dst) {
  ForRange(pieces, offset, len, [dst](const Piece& p, size_t at, size_t pos, size_t n) {
    std::memcpy(dst + pos, p.in + at, n);
  });
}

// Copies src to bytes [offset, offset+len) of the pieces' outputs.
inline void ScatterBytes(const char* src, size_t offset, size_t len,
                         const std::vector<Piece>& pieces) {
  ForRange(pieces, offset, len, [src](const Piece& p, size_t at, size_t pos, size_t n) {
    std::memcpy(p.out + at, src + pos, n);
  });
}

}  // namespace smb

#endif  // TF_SMB_CC_SMB_ALGORITHMS_PIECES_H_
