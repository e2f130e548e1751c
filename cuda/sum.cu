// k-way element-wise sums for the cuda backend's reduce: one kernel per element representation, summing the
// inputs strictly in list order and rounding to the element type after every add, as PyTorch's a + b + c does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels.h"

namespace {

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
  __device__ __forceinline__ __half first(__half a) const { return a; }
  __device__ __forceinline__ __half operator()(__half a, __half b) const {
    return __float2half_rn(__half2float(a) + __half2float(b));
  }
};

struct AddBf16 {
  __device__ __forceinline__ __nv_bfloat16 first(__nv_bfloat16 a) const { return a; }
  __device__ __forceinline__ __nv_bfloat16 operator()(__nv_bfloat16 a, __nv_bfloat16 b) const {
    return __float2bfloat16_rn(__bfloat162float(a) + __bfloat162float(b));
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
FDP_SUM(f16, __half, AddHalf)
FDP_SUM(bf16, __nv_bfloat16, AddBf16)
FDP_SUM(f32, float, AddFloat<float>)
FDP_SUM(f64, double, AddFloat<double>)

}  // extern "C"
