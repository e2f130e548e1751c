// Element-wise strided copy for layouts the copy engines cannot express (innermost dim strided on either
// side), and the pack/unpack steps of staged cross-device copies. One kernel per element size.
#include "kernels.h"

namespace {

template <typename T>
__device__ __forceinline__ void copy_body(const T *src, T *dst, const fdp_copy_args_t &a) {
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  const int last = a.ndim - 1;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.numel; i += step) {
    long long rest = i, so = 0, dof = 0;
    for (int d = last; d > 0; d--) {
      const long long size = a.sizes[d];
      const long long c = rest % size;
      rest /= size;
      so += c * a.src_strides[d];
      dof += c * a.dst_strides[d];
    }
    so += rest * a.src_strides[0];
    dof += rest * a.dst_strides[0];
    dst[dof] = src[so];
  }
}

}  // namespace

extern "C" {

__global__ void __launch_bounds__(256) fdp_copy_1(const void *s, void *d, fdp_copy_args_t a) {
  copy_body(static_cast<const unsigned char *>(s), static_cast<unsigned char *>(d), a);
}
__global__ void __launch_bounds__(256) fdp_copy_2(const void *s, void *d, fdp_copy_args_t a) {
  copy_body(static_cast<const unsigned short *>(s), static_cast<unsigned short *>(d), a);
}
__global__ void __launch_bounds__(256) fdp_copy_4(const void *s, void *d, fdp_copy_args_t a) {
  copy_body(static_cast<const unsigned int *>(s), static_cast<unsigned int *>(d), a);
}
__global__ void __launch_bounds__(256) fdp_copy_8(const void *s, void *d, fdp_copy_args_t a) {
  copy_body(static_cast<const unsigned long long *>(s), static_cast<unsigned long long *>(d), a);
}
__global__ void __launch_bounds__(256) fdp_copy_16(const void *s, void *d, fdp_copy_args_t a) {
  copy_body(static_cast<const uint4 *>(s), static_cast<uint4 *>(d), a);
}

}  // extern "C"
