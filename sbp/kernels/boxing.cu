// Pack, unpack and reduce of boxing buffers, one pass over memory each.
//
// Built two ways from this one text: by NVRTC (through CuPy) for the GPU, and by g++ with
// host_shim.h for the CPU tests, which run every thread of the grid in loops. So the bodies
// stay plain C++: no shared memory, no __syncthreads, no intrinsics the shim lacks. Entry
// points are instantiated by the SBP_MOVE_KERNELS / SBP_REDUCE_KERNELS lines that
// sbp/kernels/raw.py appends (one word width or one dtype per compiled module).

#ifndef SBP_HOST_SHIM
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#define SBP_DEVICE __device__ __forceinline__

typedef long long i64;

// V elements moved as one aligned load or store (V * sizeof(T) == 16 wherever it is used).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// ---------------------------------------------------------------- pack / unpack
//
// The unpacked tensor is seen as `outer` rows of `row` words (a word is 1 to 16 bytes,
// chosen so that every offset below is a whole number of words). Chunk r is the column
// range [table[r], table[r + 1]) of every row; in the packed buffer it starts at word
// table[n_chunks + 1 + r] and holds its rows one after another (`outer` x len words;
// anything after that, up to the next chunk, is padding that is neither read nor written).
//
// Three schemes with the same arguments and the same result; raw.py picks one per call:
//   linear (sbp_pack_w4, ...)       any shape: blockIdx.y picks the chunk, the x threads
//                                   stride over its words in packed order;
//   rows   (sbp_pack_rows_w4, ...)  many long rows of narrow words: a team of lanes moves
//                                   one row of one chunk, with 16-byte accesses;
//   flat   (sbp_pack_flat_w4, ...)  outer == 1, each chunk one contiguous range: a copy with
//                                   16-byte accesses.

template <typename Word, bool kPack, typename I>
SBP_DEVICE void move_words(const Word* __restrict__ src, Word* __restrict__ dst, I col, I len,
                           I base, I total, I row) {
  const I stride = (I)gridDim.x * blockDim.x;
  I j = (I)blockIdx.x * blockDim.x + threadIdx.x;  // word j of the chunk, packed order
  if (j >= total) return;
  // Divide once; afterwards step the (column, unpacked index) pair by the grid stride.
  I c = j % len;
  I u = (j / len) * row + col + c;  // index of word j in the unpacked tensor
  const I step_c = stride % len;
  const I step_u = (stride / len) * row + step_c;
#pragma unroll 4  // lets several loads be in flight per thread
  for (; j < total; j += stride) {
    if (kPack) {
      dst[base + j] = src[u];
    } else {
      dst[u] = src[base + j];
    }
    c += step_c;
    u += step_u;
    if (c >= len) {  // carried into the next row
      c -= len;
      u += row - len;
    }
  }
}

// Index arithmetic in 32 bits where every index fits: a thread often moves a single word,
// and its four divisions above cost more than the move in 64 bits. (The CPU tests also
// build with SBP_NARROW_INDEX_LIMIT=0, which takes the 64-bit path for every size.)
#ifndef SBP_NARROW_INDEX_LIMIT
#define SBP_NARROW_INDEX_LIMIT 0x7fffffff
#endif

template <typename Word, bool kPack>
SBP_DEVICE void move_chunks(const Word* __restrict__ src, Word* __restrict__ dst,
                            const i64* __restrict__ table, i64 n_chunks, i64 outer, i64 row) {
  const i64 r = blockIdx.y;
  const i64 col = table[r];
  const i64 len = table[r + 1] - col;
  const i64 base = table[n_chunks + 1 + r];
  const i64 total = outer * len;
  // j + stride stays below 2^31
  const i64 limit = (i64)SBP_NARROW_INDEX_LIMIT - (i64)gridDim.x * blockDim.x;
  if (outer * row <= limit && base + total <= limit) {
    move_words<Word, kPack, unsigned>(src, dst, (unsigned)col, (unsigned)len, (unsigned)base,
                                      (unsigned)total, (unsigned)row);
  } else {
    move_words<Word, kPack, i64>(src, dst, col, len, base, total, row);
  }
}

// Words each thread moves per round in the rows and flat schemes (raw.py's MOVE_UNROLL),
// all its loads issued before its first store. (An enum: a constexpr int would be emitted
// as a global of the module.)
enum { kMoveUnroll = 8 };

// n words from s to d. Work is cut into slots, the 16-byte granules of d that the n words
// touch; a thread moves slots lane, lane + team, ..., K at a time. A slot is written with one
// 16-byte store when the n words cover it, word by word at the two ends. Its words come from
// one or two 16-byte loads of s: D, how far s's words sit from d's within their granules, is
// a template argument, so that picking them out of the loads is register moves.
template <typename Word, int V, int D, int K>
SBP_DEVICE void move_slots(const Vec<Word, V>* __restrict__ sg, Vec<Word, V>* __restrict__ dg,
                           i64 lo, i64 hi, i64 lane, i64 team) {
  // The words moved are [lo, hi) counted from the start of granule dg[0], whose word j comes
  // from sg[0] (its word j + D) or sg[1] (word j + D - V).
  const i64 slots = (hi + V - 1) / V;
  for (i64 b0 = lane; b0 < slots; b0 += K * team) {
    Vec<Word, V> x[K], y[K];
#pragma unroll
    for (int e = 0; e < K; ++e) {
      const i64 b = b0 + e * team, first = b * V;
      if (b < slots) {
        if (first + V - D > lo) x[e] = sg[b];  // the slot needs one of sg[b]'s words
        if (D > 0 && first + V - D < hi) y[e] = sg[b + 1];
      }
    }
#pragma unroll
    for (int e = 0; e < K; ++e) {
      const i64 b = b0 + e * team, first = b * V;
      if (b < slots) {
        Vec<Word, V> w;
#pragma unroll
        for (int j = 0; j < V; ++j) w.v[j] = j + D < V ? x[e].v[j + D] : y[e].v[j + D - V];
        if (first >= lo && first + V <= hi) {
          dg[b] = w;
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            if (first + j >= lo && first + j < hi) dg[b].v[j] = w.v[j];
          }
        }
      }
    }
  }
}

template <typename Word, int V, int K, int D = 0>
SBP_DEVICE void move_shifted(int d, const Vec<Word, V>* sg, Vec<Word, V>* dg, i64 lo, i64 hi,
                             i64 lane, i64 team) {
  if (d == D) {
    move_slots<Word, V, D, K>(sg, dg, lo, hi, lane, team);
  } else if constexpr (D + 1 < V) {
    move_shifted<Word, V, K, D + 1>(d, sg, dg, lo, hi, lane, team);
  }
}

// n words from s to d (any alignment): 16-byte slots of 4-, 8- and 16-byte words, K of them
// a round (kMoveUnroll words); 1- and 2-byte words one word a slot (V shifts would be V
// copies of move_slots, for little use).
template <typename Word>
SBP_DEVICE void move_piece(const Word* s, Word* d, i64 n, i64 lane, i64 team) {
  constexpr int V = 16 / sizeof(Word);
  if constexpr (V > 4) {
    typedef Vec<Word, 1> W;
    move_slots<Word, 1, 0, kMoveUnroll>(reinterpret_cast<const W*>(s), reinterpret_cast<W*>(d),
                                        0, n, lane, team);
  } else {
    constexpr int K = kMoveUnroll / V;
    typedef Vec<Word, V> G;
    const i64 sa = (i64)(reinterpret_cast<unsigned long long>(s) % 16 / sizeof(Word));
    const i64 da = (i64)(reinterpret_cast<unsigned long long>(d) % 16 / sizeof(Word));
    const i64 g = sa < da ? 1 : 0;  // s's word j sits in granule -g, at D = sa - da + g * V
    move_shifted<Word, V, K>((int)(sa - da + g * V), reinterpret_cast<const G*>(s - sa) - g,
                             reinterpret_cast<G*>(d - da), da, da + n, lane, team);
  }
}

// Rows scheme. A team of lanes (table[2 * n_chunks + 1] of them, a power of two that divides
// the block) moves one row of one chunk, a piece: piece r * n_chunks + k is chunk k of row r.
// The grid has a team for every piece, so consecutive teams, which run together, sweep the
// unpacked tensor front to back and each packed chunk in step.
template <typename Word, bool kPack>
SBP_DEVICE void move_rows(const Word* __restrict__ src, Word* __restrict__ dst,
                          const i64* __restrict__ table, i64 n_chunks, i64 outer, i64 row) {
  const i64 team = table[2 * n_chunks + 1];
  const i64 piece = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / team;
  if (piece >= outer * n_chunks) return;
  const i64 r = piece / n_chunks, k = piece % n_chunks;
  const i64 col = table[k];
  const i64 len = table[k + 1] - col;
  const i64 u = r * row + col;                      // unpacked index of the piece
  const i64 p = table[n_chunks + 1 + k] + r * len;  // packed index of the piece
  move_piece<Word>(src + (kPack ? u : p), dst + (kPack ? p : u), len, threadIdx.x % team,
                   team);
}

// Flat scheme (outer == 1): chunk blockIdx.y is one contiguous range on both sides, which all
// the x threads move as one team.
template <typename Word, bool kPack>
SBP_DEVICE void move_flat(const Word* __restrict__ src, Word* __restrict__ dst,
                          const i64* __restrict__ table, i64 n_chunks) {
  const i64 r = blockIdx.y;
  const i64 col = table[r];
  const i64 len = table[r + 1] - col;
  const i64 base = table[n_chunks + 1 + r];
  move_piece<Word>(src + (kPack ? col : base), dst + (kPack ? base : col), len,
                   (i64)blockIdx.x * blockDim.x + threadIdx.x, (i64)gridDim.x * blockDim.x);
}

#define SBP_MOVE_ENTRY(KIND, NAME, WORD, CALL)                                                \
  extern "C" __global__ void sbp_##KIND##_##NAME(const WORD* src, WORD* dst, const i64* table, \
                                                 i64 n_chunks, i64 outer, i64 row) {         \
    CALL;                                                                                    \
  }

#define SBP_MOVE_KERNELS(NAME, WORD)                                                      \
  SBP_MOVE_ENTRY(pack, NAME, WORD, (move_chunks<WORD, true>(src, dst, table, n_chunks,     \
                                                            outer, row)))                 \
  SBP_MOVE_ENTRY(unpack, NAME, WORD, (move_chunks<WORD, false>(src, dst, table, n_chunks,  \
                                                               outer, row)))              \
  SBP_MOVE_ENTRY(pack_rows, NAME, WORD, (move_rows<WORD, true>(src, dst, table, n_chunks,  \
                                                               outer, row)))              \
  SBP_MOVE_ENTRY(unpack_rows, NAME, WORD, (move_rows<WORD, false>(src, dst, table,         \
                                                                  n_chunks, outer, row))) \
  SBP_MOVE_ENTRY(pack_flat, NAME, WORD, (move_flat<WORD, true>(src, dst, table, n_chunks))) \
  SBP_MOVE_ENTRY(unpack_flat, NAME, WORD, (move_flat<WORD, false>(src, dst, table, n_chunks)))

// ---------------------------------------------------------------- reduce
//
// out[i] = op(in[0 * chunk + i], ..., in[(k - 1) * chunk + i]) in chunk order, as torch's
// reference does it. Half and bfloat16 accumulate in float and round once at the end.

template <typename T>
struct Arith {
  typedef T Acc;
  static SBP_DEVICE Acc load(T x) { return x; }
  static SBP_DEVICE T store(Acc a) { return a; }
};

template <>
struct Arith<__half> {
  typedef float Acc;
  static SBP_DEVICE float load(__half x) { return __half2float(x); }
  static SBP_DEVICE __half store(float a) { return __float2half_rn(a); }
};

template <>
struct Arith<__nv_bfloat16> {
  typedef float Acc;
  static SBP_DEVICE float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static SBP_DEVICE __nv_bfloat16 store(float a) { return __float2bfloat16_rn(a); }
};

struct SumOp {
  template <typename A>
  static SBP_DEVICE A apply(A a, A b) { return a + b; }
  // Integers wrap around as torch's do (signed overflow is undefined in C++).
  static SBP_DEVICE int apply(int a, int b) { return (int)((unsigned)a + (unsigned)b); }
  static SBP_DEVICE i64 apply(i64 a, i64 b) {
    return (i64)((unsigned long long)a + (unsigned long long)b);
  }
  static SBP_DEVICE bool apply(bool a, bool b) { return a || b; }
};

// NaN wins, as in torch.maximum / torch.minimum: `a != a` only holds for NaN, and a NaN b
// fails both comparisons, so b is kept.
struct MaxOp {
  template <typename A>
  static SBP_DEVICE A apply(A a, A b) { return (a != a || a > b) ? a : b; }
  static SBP_DEVICE bool apply(bool a, bool b) { return a || b; }
};

struct MinOp {
  template <typename A>
  static SBP_DEVICE A apply(A a, A b) { return (a != a || a < b) ? a : b; }
  static SBP_DEVICE bool apply(bool a, bool b) { return a && b; }
};

template <typename T, typename Op, int V>
SBP_DEVICE void reduce_chunks(const T* __restrict__ in, T* __restrict__ out, i64 k, i64 chunk,
                              i64 n) {
  typedef Vec<T, V> VT;
  typedef typename Arith<T>::Acc Acc;
  const VT* vin = reinterpret_cast<const VT*>(in);  // chunk and n count whole VTs
  VT* vout = reinterpret_cast<VT*>(out);
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    VT x = vin[i];
    Acc acc[V];
    for (int e = 0; e < V; ++e) acc[e] = Arith<T>::load(x.v[e]);
#pragma unroll 4
    for (i64 c = 1; c < k; ++c) {
      x = vin[c * chunk + i];
      for (int e = 0; e < V; ++e) acc[e] = Op::apply(acc[e], Arith<T>::load(x.v[e]));
    }
    for (int e = 0; e < V; ++e) x.v[e] = Arith<T>::store(acc[e]);
    vout[i] = x;
  }
}

#define SBP_REDUCE_KERNEL(OP, OPNAME, NAME, T, V, SUFFIX)                                \
  extern "C" __global__ void sbp_reduce_##OPNAME##_##NAME##SUFFIX(const T* in, T* out,   \
                                                                  i64 k, i64 chunk, i64 n) { \
    reduce_chunks<T, OP, V>(in, out, k, chunk, n);                                        \
  }

#define SBP_REDUCE_KERNELS(NAME, T)                                \
  SBP_REDUCE_KERNEL(SumOp, sum, NAME, T, 1, )                      \
  SBP_REDUCE_KERNEL(MaxOp, max, NAME, T, 1, )                      \
  SBP_REDUCE_KERNEL(MinOp, min, NAME, T, 1, )                      \
  SBP_REDUCE_KERNEL(SumOp, sum, NAME, T, 16 / sizeof(T), _v)       \
  SBP_REDUCE_KERNEL(MaxOp, max, NAME, T, 16 / sizeof(T), _v)       \
  SBP_REDUCE_KERNEL(MinOp, min, NAME, T, 16 / sizeof(T), _v)
