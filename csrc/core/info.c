/* SPDX-License-Identifier: MIT */
/* Machine facts for `python -m fastdp info`, asked of the backends through their tables: each backend answers for
 * its own library, and the one that owns the GPUs for the devices. */
#include "backend.h"

#include <string.h>

void fdp_library_facts(fdp_backend_id_t id, fdp_library_facts_t *out) {
  const fdp_backend_t *b = fdp__backend(id);
  memset(out, 0, sizeof *out);
  out->library = "";
  if (b && b->library_facts) b->library_facts(out);
}

/* The backend that answers for devices: the first in the table with device facts. */
static const fdp_backend_t *device_owner(void) {
  for (int i = 0; i < FDP_BACKEND_COUNT; i++) {
    const fdp_backend_t *b = fdp__backend((fdp_backend_id_t)i);
    if (b && b->device_facts) return b;
  }
  return NULL;
}

fdp_result_t fdp_device_facts(int device, fdp_free_read_t free_read, fdp_device_facts_t *out) {
  const fdp_backend_t *b = device_owner();
  memset(out, 0, sizeof *out);
  out->kernels_source = "";
  if ((unsigned)free_read > FDP_FREE_ALWAYS)
    return fdp__fail(FDP_INVALID, "free_read %d is not an fdp_free_read_t", (int)free_read);
  if (!b) return fdp__fail(FDP_UNAVAILABLE, "no backend with devices in this build");
  return b->device_facts(device, free_read, out);
}

int fdp_device_can_access_peer(int device, int peer) {
  const fdp_backend_t *b = device_owner();
  return b && b->can_access_peer ? b->can_access_peer(device, peer) : 0;
}
