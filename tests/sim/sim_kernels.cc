// fastdp's real kernels (cuda/sum.cu, cuda/copy.cu, compiled as host C++ with kernel_host.h) run on the host for
// cuLaunchKernel: every thread of every block of the grid the launch asks for, one after another, with
// blockIdx/threadIdx/blockDim/gridDim set for each. A kernel that leaves elements to threads that do not exist (no
// grid-stride loop) leaves them unwritten; one that strays outside its memory faults on a guard page, which is
// caught here and reported as the launch's failure instead of ending the process. The kernel sources are compiled
// with every typed access checked for alignment (build.py: -fsanitize=alignment, trapping), as the GPU faults on
// a wide element read or written at an address that is not a multiple of its size: that trap is caught the same
// way.
#include "backend/cuda/kernels.h"

#include <csetjmp>
#include <csignal>
#include <cstring>

thread_local fdp_host_dim3 blockIdx, threadIdx, blockDim, gridDim;

extern "C" {
#define SIM_SUM_KERNEL(name) void fdp_sum_##name(fdp_sum_args_t a);
SIM_SUM_KERNEL(bool)
SIM_SUM_KERNEL(u8)
SIM_SUM_KERNEL(u16)
SIM_SUM_KERNEL(u32)
SIM_SUM_KERNEL(u64)
SIM_SUM_KERNEL(f16)
SIM_SUM_KERNEL(bf16)
SIM_SUM_KERNEL(f32)
SIM_SUM_KERNEL(f64)
void fdp_copy_1(const void *s, void *d, fdp_copy_args_t a);
void fdp_copy_2(const void *s, void *d, fdp_copy_args_t a);
void fdp_copy_4(const void *s, void *d, fdp_copy_args_t a);
void fdp_copy_8(const void *s, void *d, fdp_copy_args_t a);
void fdp_copy_16(const void *s, void *d, fdp_copy_args_t a);
}

namespace {

struct SumKernel {
  const char *name;
  void (*fn)(fdp_sum_args_t);
};
const SumKernel k_sums[] = {{"fdp_sum_bool", fdp_sum_bool}, {"fdp_sum_u8", fdp_sum_u8},   {"fdp_sum_u16", fdp_sum_u16},
                            {"fdp_sum_u32", fdp_sum_u32},   {"fdp_sum_u64", fdp_sum_u64}, {"fdp_sum_f16", fdp_sum_f16},
                            {"fdp_sum_bf16", fdp_sum_bf16}, {"fdp_sum_f32", fdp_sum_f32}, {"fdp_sum_f64", fdp_sum_f64}};

struct CopyKernel {
  const char *name;
  void (*fn)(const void *, void *, fdp_copy_args_t);
};
const CopyKernel k_copies[] = {{"fdp_copy_1", fdp_copy_1}, {"fdp_copy_2", fdp_copy_2}, {"fdp_copy_4", fdp_copy_4},
                               {"fdp_copy_8", fdp_copy_8}, {"fdp_copy_16", fdp_copy_16}};

thread_local sigjmp_buf *t_jump;
thread_local void *volatile t_fault;
thread_local volatile int t_signal;
struct sigaction g_previous_segv, g_previous_ill;
bool g_installed;

void on_fault(int sig, siginfo_t *info, void *uc) {
  if (t_jump != nullptr) {
    t_fault = info->si_addr;
    t_signal = sig;
    siglongjmp(*t_jump, 1);
  }
  // Not inside a kernel: whoever handled it before (a sanitizer, or the default action).
  const struct sigaction &previous = sig == SIGILL ? g_previous_ill : g_previous_segv;
  if (previous.sa_flags & SA_SIGINFO)
    previous.sa_sigaction(sig, info, uc);
  else if (previous.sa_handler != SIG_IGN && previous.sa_handler != SIG_DFL)
    previous.sa_handler(sig);
  else {
    signal(sig, SIG_DFL);
    raise(sig);
  }
}

template <typename Body>
int run_grid(const unsigned int grid[3], const unsigned int block[3], void **fault, Body body) {
  if (!g_installed) {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous_segv);
    sigaction(SIGILL, &sa, &g_previous_ill); // the alignment check's trap
    g_installed = true;
  }
  sigjmp_buf jump;
  if (sigsetjmp(jump, 1) != 0) {
    t_jump = nullptr;
    *fault = t_fault;
    return t_signal == SIGILL ? -2 : -1;
  }
  t_jump = &jump;
  gridDim = {grid[0], grid[1], grid[2]};
  blockDim = {block[0], block[1], block[2]};
  for (unsigned int bz = 0; bz < grid[2]; bz++)
    for (unsigned int by = 0; by < grid[1]; by++)
      for (unsigned int bx = 0; bx < grid[0]; bx++)
        for (unsigned int tz = 0; tz < block[2]; tz++)
          for (unsigned int ty = 0; ty < block[1]; ty++)
            for (unsigned int tx = 0; tx < block[0]; tx++) {
              blockIdx = {bx, by, bz};
              threadIdx = {tx, ty, tz};
              body();
            }
  t_jump = nullptr;
  return 0;
}

}  // namespace

// Runs kernel `name` over the grid with its parameters, whose pointers are host addresses already. Returns 0, -1
// when it faulted (*fault: the address), or -2 when it accessed an element at an address not aligned to its size
// (*fault: the instruction).
extern "C" int sim_kernel_run(const char *name, const unsigned int grid[3], const unsigned int block[3],
                              fdp_sum_args_t *sum, const void *src, void *dst, const fdp_copy_args_t *copy,
                              void **fault) {
  for (const SumKernel &k : k_sums)
    if (std::strcmp(k.name, name) == 0) return run_grid(grid, block, fault, [&] { k.fn(*sum); });
  for (const CopyKernel &k : k_copies)
    if (std::strcmp(k.name, name) == 0) return run_grid(grid, block, fault, [&] { k.fn(src, dst, *copy); });
  return -1;
}
