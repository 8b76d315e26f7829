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

// ---------------------------------------------------------------- pack / unpack
//
// The unpacked tensor is seen as `outer` rows of `row` words (a word is 1 to 16 bytes,
// chosen so that every offset below is a whole number of words). Chunk r is the column
// range [table[r], table[r + 1]) of every row; in the packed buffer it starts at word
// table[n_chunks + 1 + r] and holds its rows one after another (`outer` x len words;
// anything after that, up to the next chunk, is padding that is neither read nor written).
// blockIdx.y picks the chunk; the x threads stride over its words in packed order.

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

#define SBP_MOVE_KERNELS(NAME, WORD)                                                     \
  extern "C" __global__ void sbp_pack_##NAME(const WORD* src, WORD* dst, const i64* table, \
                                             i64 n_chunks, i64 outer, i64 row) {         \
    move_chunks<WORD, true>(src, dst, table, n_chunks, outer, row);                       \
  }                                                                                       \
  extern "C" __global__ void sbp_unpack_##NAME(const WORD* src, WORD* dst,                \
                                               const i64* table, i64 n_chunks, i64 outer, \
                                               i64 row) {                                 \
    move_chunks<WORD, false>(src, dst, table, n_chunks, outer, row);                      \
  }

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

// V elements moved as one aligned load or store (V * sizeof(T) == 16 in the _v kernels).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
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
