// The CUDA C++ that fastdp's kernels (cuda/*.cu) use, for compiling them as host C++ inside the simulated GPU
// (build.py force-includes this header and defines FDP_HOST_EMULATION). Launch qualifiers vanish, the built-in
// index variables are per-thread globals that sim_kernels.cc sets for every block and thread of a launch's grid,
// and the PTX conversions (the only inline assembly) have host equivalents: cuda/sum.cu calls these under
// FDP_HOST_EMULATION. Device code runs unchanged otherwise.
#ifndef FASTDP_SIM_KERNEL_HOST_H
#define FASTDP_SIM_KERNEL_HOST_H

#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __CUDA_ARCH__ 900 /* the simulated devices are compute capability 9.0 */

struct fdp_host_dim3 {
  unsigned int x, y, z;
};
extern thread_local fdp_host_dim3 blockIdx, threadIdx, blockDim, gridDim;

// As CUDA's vector type: 16-byte aligned, so that a 16-byte access the kernels make is checked at that width.
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};

inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// cvt.f32.f16, cvt.rn.f16.f32 and cvt.rn.bf16.f32: exact widening, and rounding to nearest even (NaN stays NaN).
extern "C" float sim_half_to_float(unsigned short h);
extern "C" unsigned short sim_float_to_half(float f);
extern "C" unsigned short sim_float_to_bf16(float f);

#endif
