// Lets g++ build boxing.cu for the CPU tests: CUDA qualifiers vanish, the grid and block
// indices are globals that launch_grid() steps through every thread of the grid in turn,
// and the CUDA types the kernels use get host equivalents with the same conversions
// (round to nearest even, NaN kept). Kernels never talk between threads, so running the
// threads one after another computes what the GPU computes.
#pragma once
#include <cstdint>
#include <cstring>

#define SBP_HOST_SHIM 1
#define __global__
#define __device__
#define __forceinline__ inline

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
static dim3 blockIdx, threadIdx, blockDim, gridDim;

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

// IEEE binary16 through the compiler's _Float16 (correctly rounded conversions).
struct __half {
  _Float16 h;
};
inline float __half2float(__half x) { return (float)x.h; }
inline __half __float2half_rn(float f) { return __half{(_Float16)f}; }

// bfloat16 is the top half of a float.
struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 x) {
  uint32_t u = (uint32_t)x.bits << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{(uint16_t)(u >> 16)};
}

// Run kernel(args...) once for every (block, thread) of the grid.
template <typename... P, typename... A>
void launch_grid(void (*kernel)(P...), unsigned gx, unsigned gy, unsigned bx, A... args) {
  gridDim = dim3{gx, gy, 1};
  blockDim = dim3{bx, 1, 1};
  for (unsigned y = 0; y < gy; ++y)
    for (unsigned x = 0; x < gx; ++x)
      for (unsigned t = 0; t < bx; ++t) {
        blockIdx = dim3{x, y, 0};
        threadIdx = dim3{t, 0, 0};
        kernel((P)args...);
      }
}

typedef long long i64;

// One C entry for each kernel shape, called through ctypes with the kernel's address.
extern "C" void launch_move(void* kernel, unsigned gx, unsigned gy, unsigned bx, const void* src,
                            void* dst, const i64* table, i64 n_chunks, i64 outer, i64 row) {
  typedef void (*F)(const void*, void*, const i64*, i64, i64, i64);
  launch_grid((F)kernel, gx, gy, bx, src, dst, table, n_chunks, outer, row);
}

extern "C" void launch_reduce(void* kernel, unsigned gx, unsigned gy, unsigned bx, const void* in,
                              void* out, i64 k, i64 chunk, i64 n) {
  typedef void (*F)(const void*, void*, i64, i64, i64);
  launch_grid((F)kernel, gx, gy, bx, in, out, k, chunk, n);
}
