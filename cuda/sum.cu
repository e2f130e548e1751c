// k-way element-wise sums for the cuda backend's reduce: one kernel per element representation, summing the
// inputs strictly in list order and rounding to the element type after every add, as PyTorch's a + b + c does.
// No header beyond kernels.h: the same text is compiled by nvcc at build time and by NVRTC at run time, and
// NVRTC has no host or toolkit headers. Half and bfloat16 are therefore handled here as raw 16-bit patterns.
#include "kernels.h"

namespace {

// IEEE half <-> float through the PTX conversions every architecture has (cvt.rn is round to nearest even).
// FDP_HOST_EMULATION: the simulated GPU (tests/sim) compiles this file as host C++, where PTX cannot run; its
// header supplies the same conversions.
__device__ __forceinline__ float half_to_float(unsigned short h) {
#ifdef FDP_HOST_EMULATION
  return sim_half_to_float(h);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}
__device__ __forceinline__ unsigned short float_to_half(float f) {
#ifdef FDP_HOST_EMULATION
  return sim_float_to_half(f);
#else
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#endif
}

// bfloat16 is the top half of a float. Rounding to nearest even: the hardware conversion from sm_80 on, the
// same rule in integer arithmetic before (NaN kept quiet; the bias carries into the exponent as it should).
__device__ __forceinline__ float bf16_to_float(unsigned short b) {
  return __uint_as_float(static_cast<unsigned int>(b) << 16);
}
__device__ __forceinline__ unsigned short float_to_bf16(float f) {
#if defined(FDP_HOST_EMULATION)
  return sim_float_to_bf16(f);
#elif __CUDA_ARCH__ >= 800
  unsigned short b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
  return b;
#else
  const unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);
  return static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

// Each Add is the element type's `+` as PyTorch computes it, plus `first`, which normalises the first input.

// Signed integers are summed as their unsigned twins: two's-complement wrapping without signed-overflow UB,
// and the very bits PyTorch's wrapping int add produces.
template <typename T>
struct AddWrap {
  __device__ __forceinline__ T first(T a) const { return a; }
  __device__ __forceinline__ T operator()(T a, T b) const { return static_cast<T>(a + b); }
};

// bool + bool in PyTorch is a logical or; an input byte may hold any nonzero value for true.
struct AddBool {
  __device__ __forceinline__ unsigned char first(unsigned char a) const { return a != 0; }
  __device__ __forceinline__ unsigned char operator()(unsigned char a, unsigned char b) const {
    return (a | b) != 0;
  }
};

// Half types add in float and round to nearest even once per add: what PyTorch's CUDA add kernel (float
// opmath, alpha = 1, so no FMA can change the sum) stores for each intermediate of a + b + c.
struct AddHalf {
  __device__ __forceinline__ unsigned short first(unsigned short a) const { return a; }
  __device__ __forceinline__ unsigned short operator()(unsigned short a, unsigned short b) const {
    return float_to_half(half_to_float(a) + half_to_float(b));
  }
};

struct AddBf16 {
  __device__ __forceinline__ unsigned short first(unsigned short a) const { return a; }
  __device__ __forceinline__ unsigned short operator()(unsigned short a, unsigned short b) const {
    return float_to_bf16(bf16_to_float(a) + bf16_to_float(b));
  }
};

template <typename T>
struct AddFloat {
  __device__ __forceinline__ T first(T a) const { return a; }
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

template <typename T, typename Add>
__device__ __forceinline__ void sum_body(const fdp_sum_args_t &a) {
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  const Add add;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.n; i += step) {
    T acc = add.first(static_cast<const T *>(a.in[0])[i]);
    for (int j = 1; j < a.k; j++) acc = add(acc, static_cast<const T *>(a.in[j])[i]);
    static_cast<T *>(a.out)[i] = acc;
  }
}

}  // namespace

// Names follow the element representation; the backend maps int8 to u8, int16 to u16, and so on.
extern "C" {

#define FDP_SUM(name, T, Add) \
  __global__ void __launch_bounds__(256) fdp_sum_##name(fdp_sum_args_t a) { sum_body<T, Add>(a); }

FDP_SUM(bool, unsigned char, AddBool)
FDP_SUM(u8, unsigned char, AddWrap<unsigned char>)
FDP_SUM(u16, unsigned short, AddWrap<unsigned short>)
FDP_SUM(u32, unsigned int, AddWrap<unsigned int>)
FDP_SUM(u64, unsigned long long, AddWrap<unsigned long long>)
FDP_SUM(f16, unsigned short, AddHalf)
FDP_SUM(bf16, unsigned short, AddBf16)
FDP_SUM(f32, float, AddFloat<float>)
FDP_SUM(f64, double, AddFloat<double>)

}  // extern "C"
