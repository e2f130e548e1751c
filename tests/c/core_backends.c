/* SPDX-License-Identifier: MIT */
/* test_core's suites on what the core says about the machine without a GPU: the backends compiled and usable, the
 * route of each device list, the tensor helpers, CUDA descriptors refused without CUDA, and libtorch's C shim in a
 * process that loaded no libtorch. */
#include "core_harness.h"

#include <stdio.h>
#include <string.h>

/* ---- backends ---- */

void test_backends(void) {
  const char *why = "untouched";
  CHECK(fdp_backend_compiled(FDP_BACKEND_HOST) == 1);
  CHECK(fdp_backend_usable(FDP_BACKEND_HOST, &why) == 1);
  CHECK(why != NULL);
  CHECK(fdp_backend_usable(FDP_BACKEND_HOST, NULL) == 1);
  fdp_backend_id_t gpu[] = {FDP_BACKEND_CUDA, FDP_BACKEND_NCCL};
  for (int i = 0; i < 2; i++) {
    why = NULL;
    CHECKF(fdp_backend_compiled(gpu[i]) == 1, "%s", fdp_backend_name(gpu[i])); /* always built; no driver here */
    CHECKF(fdp_backend_usable(gpu[i], &why) == 0, "%s", fdp_backend_name(gpu[i]));
    CHECKF(why && why[0], "%s: empty reason", fdp_backend_name(gpu[i]));
    CHECK(fdp_backend_usable(gpu[i], NULL) == 0);
  }
  CHECK(strcmp(fdp_backend_name(FDP_BACKEND_HOST), "host") == 0);
  CHECK(strcmp(fdp_backend_name(FDP_BACKEND_CUDA), "cuda") == 0);
  CHECK(strcmp(fdp_backend_name(FDP_BACKEND_NCCL), "nccl") == 0);
  CHECK(fdp_backend_name(FDP_BACKEND_COUNT) != NULL);
  CHECK(fdp_backend_compiled(FDP_BACKEND_COUNT) == 0);
  why = NULL;
  CHECK(fdp_backend_usable(FDP_BACKEND_COUNT, &why) == 0 && why && why[0]);
}

/* The route on a CPU-only machine: host buffers go to the host backend; CUDA buffers have no usable backend, and
 * the error names the one that could run them; bad arguments are refused. */
void test_route(void) {
  int host[3] = {FDP_HOST, FDP_HOST, FDP_HOST}, cuda[2] = {0, 1}, bad[2] = {FDP_HOST, FDP_MAX_DEVICES};
  fdp_backend_id_t id = FDP_BACKEND_COUNT;
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, host, 3, FDP_DTYPE_F32, &id), FDP_OK);
  CHECK(id == FDP_BACKEND_HOST);
  id = FDP_BACKEND_COUNT;
  EXPECT(fdp_route_devices(FDP_OP_REDUCE, host, 2, FDP_DTYPE_BF16, &id), FDP_OK);
  CHECK(id == FDP_BACKEND_HOST);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, host, 1, FDP_DTYPE_U8, &id), FDP_OK);
  CHECK(id == FDP_BACKEND_HOST);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, cuda, 2, FDP_DTYPE_F32, &id), FDP_UNAVAILABLE);
  CHECKF(strstr(fdp_last_error(), "backend is not usable"), "%s", fdp_last_error());
  EXPECT(fdp_route_devices(FDP_OP_REDUCE, cuda, 2, FDP_DTYPE_F32, &id), FDP_UNAVAILABLE);
  EXPECT(fdp_route_devices(FDP_OP_COPY, host, 2, FDP_DTYPE_F32, &id), FDP_INVALID);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, host, 0, FDP_DTYPE_F32, &id), FDP_INVALID);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, host, FDP_MAX_DEVICES + 1, FDP_DTYPE_F32, &id), FDP_INVALID);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, host, 2, FDP_DTYPE_COUNT, &id), FDP_INVALID);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, bad, 2, FDP_DTYPE_F32, &id), FDP_INVALID);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, NULL, 2, FDP_DTYPE_F32, &id), FDP_INVALID);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, host, 2, FDP_DTYPE_F32, NULL), FDP_INVALID);
}

/* ---- tensor helpers ---- */

void test_tensor_helpers(void) {
  char buf[64];
  int64_t s23[] = {2, 3}, c23[] = {3, 1}, t23[] = {1, 2}, g23[] = {4, 1}, s0[] = {2, 0, 3}, st0[] = {7, 9, 11};
  fdp_tensor_t c = make(buf, FDP_DTYPE_F32, 4, 2, s23, c23), t = make(buf, FDP_DTYPE_F32, 4, 2, s23, t23),
               g = make(buf, FDP_DTYPE_F32, 4, 2, s23, g23), z = make(buf, FDP_DTYPE_F32, 4, 3, s0, st0),
               scalar = make(buf, FDP_DTYPE_F32, 4, 0, NULL, NULL);
  CHECK(fdp_tensor_numel(&c) == 6 && fdp_tensor_numel(&z) == 0 && fdp_tensor_numel(&scalar) == 1);
  CHECK(fdp_tensor_is_contiguous(&c) && fdp_tensor_is_dense(&c));
  CHECK(!fdp_tensor_is_contiguous(&t) && fdp_tensor_is_dense(&t));
  CHECK(!fdp_tensor_is_contiguous(&g) && !fdp_tensor_is_dense(&g));
  /* An empty tensor is contiguous whatever its strides (as in PyTorch), wherever its zero-size dim is. */
  CHECKF(fdp_tensor_is_contiguous(&z) && fdp_tensor_is_dense(&z), "empty [2, 0, 3] with strides [7, 9, 11]");
  CHECK(fdp_tensor_is_contiguous(&scalar) && fdp_tensor_is_dense(&scalar));
  fdp_tensor_t n;
  fdp_tensor_narrow(&c, 1, 1, 2, &n);
  CHECK(n.data == buf + 4 && n.sizes[1] == 2 && n.sizes[0] == 2 && n.strides[0] == 3 && n.strides[1] == 1);
  fdp_tensor_narrow(&t, 0, 1, 1, &n);
  CHECK(n.data == buf + 4 && n.sizes[0] == 1 && n.sizes[1] == 3);
}

/* ---- device kinds: CUDA descriptors without CUDA ---- */

void test_devices(void) {
  float a[12] = {0}, b[12] = {0}, c[12] = {0};
  int64_t s12[] = {12};
  fdp_tensor_t h[3] = {make_contig(a, FDP_DTYPE_F32, 4, 1, s12), make_contig(b, FDP_DTYPE_F32, 4, 1, s12),
                       make_contig(c, FDP_DTYPE_F32, 4, 1, s12)};
  fdp_tensor_t g[3];
  for (int i = 0; i < 3; i++) {
    g[i] = h[i]; /* real host memory behind CUDA-labelled descriptors: a wrong copy cannot crash, only show */
    g[i].device = i == 2 ? 1 : 0;
  }
  /* A sum over host and CUDA descriptors: FDP_INVALID. */
  fdp_tensor_t mix[2] = {h[0], g[1]};
  EXPECT(fdp_op_reduce(mix, 2, &h[2], NULL), FDP_INVALID);
  EXPECT(fdp_op_reduce(h, 2, &g[2], NULL), FDP_INVALID);
  /* Any copy touching CUDA, no CUDA compiled: FDP_UNAVAILABLE, never a crash. Copies may cross between host
   * and CUDA memory, so a host-to-CUDA copy is unavailable here rather than invalid. */
  a[0] = 1.0f;
  EXPECT(fdp_op_copy(&g[0], &h[1], 1, NULL), FDP_UNAVAILABLE);
  EXPECT(fdp_op_copy(&h[0], &g[1], 1, NULL), FDP_UNAVAILABLE);
  EXPECT(fdp_op_broadcast(&h[0], &g[1], 1, NULL), FDP_UNAVAILABLE);
  EXPECT(fdp_op_copy(&g[1], &g[0], 1, NULL), FDP_UNAVAILABLE);
  CHECKF(b[0] == 0.0f, "a CUDA copy without CUDA wrote memory");
  EXPECT(fdp_op_broadcast(&g[0], &g[1], 2, NULL), FDP_UNAVAILABLE);
  fdp_tensor_t same_dev[2] = {g[0], g[1]};
  EXPECT(fdp_op_reduce(same_dev, 2, &g[0], NULL), FDP_UNAVAILABLE);
  fdp_tensor_t multi[2] = {g[0], g[2]};
  EXPECT(fdp_op_reduce(multi, 2, &g[1], NULL), FDP_UNAVAILABLE);
  int64_t chunks[] = {6, 6}, s6[] = {6};
  fdp_tensor_t halves[2] = {make_contig(b, FDP_DTYPE_F32, 4, 1, s6), make_contig(c, FDP_DTYPE_F32, 4, 1, s6)};
  halves[0].device = 0;
  halves[1].device = 1;
  EXPECT(fdp_op_scatter(&g[0], 0, chunks, halves, 2, NULL), FDP_UNAVAILABLE);
  EXPECT(fdp_op_gather(halves, 2, 0, &g[0], NULL), FDP_UNAVAILABLE);
  EXPECT(fdp_op_scatter(&h[0], 0, chunks, halves, 2, NULL), FDP_UNAVAILABLE);
  EXPECT(fdp_op_gather(halves, 2, 0, &h[0], NULL), FDP_UNAVAILABLE);
  CHECKF(a[1] == 0.0f && b[0] == 0.0f && c[0] == 0.0f, "a refused call wrote memory");
  /* The process stays usable. */
  EXPECT(fdp_op_copy(&h[1], &h[0], 1, NULL), FDP_OK);
  CHECK(b[0] == 1.0f);
  fdp_shutdown();
  EXPECT(fdp_op_copy(&h[2], &h[0], 1, NULL), FDP_OK);
  CHECK(c[0] == 1.0f);

  /* Machine facts read as absent without a CUDA driver. */
  fdp_library_facts_t lib = {.version = 7, .library = "junk", .devices = 7};
  fdp_library_facts(FDP_BACKEND_CUDA, &lib);
  CHECK(lib.version == 0 && lib.library != NULL && lib.library[0] == 0 && lib.devices == 0);
  lib.version = 7;
  fdp_library_facts(FDP_BACKEND_NCCL, &lib);
  CHECK(lib.version == 0 && lib.library != NULL && lib.library[0] == 0 && lib.devices == 0);
  fdp_library_facts(FDP_BACKEND_HOST, &lib);
  CHECK(lib.version == 0 && lib.library[0] == 0 && lib.devices == 0);
  CHECK(fdp_device_can_access_peer(0, 1) == 0);
  fdp_device_facts_t dev;
  memset(&dev, 0x5a, sizeof dev);
  EXPECT(fdp_device_facts(0, FDP_FREE_ALWAYS, &dev), FDP_UNAVAILABLE);
  CHECK(dev.name[0] == 0 && dev.total_bytes == 0 && dev.free_read == 0 && dev.kernels_source[0] == 0);
  EXPECT(fdp_device_facts(0, (fdp_free_read_t)3, &dev), FDP_INVALID);
}

/* ---- libtorch's C shim: this program loads no libtorch ---- */

void test_torch_shim(void) {
  const char *names[2] = {"aoti_torch_get_data_ptr", NULL};
  void *syms[2] = {&syms, &syms};
  EXPECT(fdp_torch_shim_resolve(NULL, names, 2, syms), FDP_UNAVAILABLE);
  CHECK(syms[0] == NULL && syms[1] == NULL);
  CHECKF(strstr(fdp_last_error(), "libtorch_cpu.so is not loaded"), "%s", fdp_last_error());
  syms[0] = &syms;
  EXPECT(fdp_torch_shim_resolve("/nowhere/torch/_C.so", names, 1, syms), FDP_UNAVAILABLE);
  CHECK(syms[0] == NULL);
  EXPECT(fdp_torch_shim_resolve(NULL, NULL, 1, syms), FDP_INVALID);
  EXPECT(fdp_torch_shim_resolve(NULL, names, 1, NULL), FDP_INVALID);
  EXPECT(fdp_torch_shim_resolve(NULL, names, -1, syms), FDP_INVALID);
}
