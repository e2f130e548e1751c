/* SPDX-License-Identifier: MIT */
/* NVRTC kernel images, once per process and cached on disk: one file per (source hash, NVRTC version,
 * architecture), written atomically (temporary file + rename) and checked on read (header with key, length
 * and checksum), so a torn, corrupt or foreign file is rebuilt rather than handed to the driver. */
#include "backend/cuda/kernel_image.h"

#include "fastdp.h"

#include "backend/cuda/kernels.h"
#include "dl/nvrtc.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_ARCHS 32
#define MAGIC "FDPKIMG1"
/* Part of every key: bump it when fdp__nvrtc_compile's options change, so that old entries read as stale. */
#define KEY_FORMAT "fastdp-kernels/1"

/* The on-disk header, followed by `size` bytes of image. Native byte order: the cache is per machine. */
typedef struct header {
  char magic[8];
  char key[112];
  uint64_t size;
  uint64_t checksum;
  uint32_t arch;
  uint32_t ptx;
} header_t;

/* An image's bytes, shared by the cache and every caller reading them: the last reference frees them. */
typedef struct shared_bytes {
  atomic_int refs;
  unsigned char *data;
} shared_bytes_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static fdp_kimage_t g_images[MAX_ARCHS]; /* each holds the cache's own reference */
static int g_cc[MAX_ARCHS];
static int g_count;
static atomic_uint g_tmp_serial;

static uint64_t fnv1a(const void *p, size_t n) {
  const unsigned char *b = p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) {
    h ^= b[i];
    h *= 1099511628211ull;
  }
  return h;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

const char *fdp__kimage_cache_dir(char *buf, size_t len) {
  const char *dir = fdp_param_str(FDP_PARAM_CACHE_DIR), *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
  buf[0] = '\0';
  if (!fdp_param(FDP_PARAM_KERNEL_CACHE)) return buf;
  if (dir)
    snprintf(buf, len, "%s", dir);
  else if (xdg && xdg[0] == '/')
    snprintf(buf, len, "%s/fastdp/kernels", xdg);
  else if (home && *home)
    snprintf(buf, len, "%s/.cache/fastdp/kernels", home);
  return buf;
}

/* mkdir -p; 0 on success (or when it exists). */
static int make_dirs(const char *dir) {
  char p[1024];
  if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p) return -1;
  for (char *s = p + 1; *s; s++) {
    if (*s != '/') continue;
    *s = '\0';
    if (mkdir(p, 0755) != 0 && errno != EEXIST) return -1;
    *s = '/';
  }
  return mkdir(p, 0755) == 0 || errno == EEXIST ? 0 : -1;
}

static int read_all(int fd, void *buf, size_t n) {
  for (size_t done = 0; done < n;) {
    ssize_t k = read(fd, (char *)buf + done, n - done);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    done += (size_t)k;
  }
  return 0;
}

static int write_all(int fd, const void *buf, size_t n) {
  for (size_t done = 0; done < n;) {
    ssize_t k = write(fd, (const char *)buf + done, n - done);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    done += (size_t)k;
  }
  return 0;
}

/* Reads the entry at `file` when its header matches `key` and its bytes their checksum. Returns 1 on a hit
 * (img->data malloc'ed), 0 when there is no file, -1 when the file is unusable (`img->note` says why). */
static int cache_read(const char *file, const char *key, fdp_kimage_t *img) {
  int fd = open(file, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  header_t h;
  struct stat st;
  unsigned char *data = NULL;
  const char *bad = NULL;
  if (fstat(fd, &st) != 0 || read_all(fd, &h, sizeof h) != 0 || memcmp(h.magic, MAGIC, 8) != 0)
    bad = "not a fastdp kernel cache entry";
  else if (strncmp(h.key, key, sizeof h.key) != 0)
    bad = "stale (written for another source, NVRTC or architecture)";
  else if ((uint64_t)st.st_size != sizeof h + h.size || h.size == 0)
    bad = "truncated or overlong";
  else if ((data = malloc((size_t)h.size + 1)) == NULL || read_all(fd, data, (size_t)h.size) != 0)
    bad = "unreadable";
  else if (fnv1a(data, (size_t)h.size) != h.checksum)
    bad = "checksum mismatch";
  close(fd);
  if (bad) {
    free(data);
    snprintf(img->note, sizeof img->note, "cache entry %.160s was %s; rebuilt", file, bad);
    fdp__log("kernel cache: %s", img->note);
    return -1;
  }
  data[h.size] = '\0';
  img->data = data;
  img->size = (size_t)h.size;
  img->arch = (int)h.arch;
  img->ptx = (int)h.ptx;
  return 1;
}

/* Writes the entry atomically: a reader sees the old file, no file, or the whole new one. 0 on success;
 * otherwise -1 with the reason in img->note. */
static int cache_write(const char *dir, const char *file, const char *key, fdp_kimage_t *img) {
  char tmp[1100];
  header_t h;
  memset(&h, 0, sizeof h);
  memcpy(h.magic, MAGIC, 8);
  snprintf(h.key, sizeof h.key, "%s", key);
  h.size = img->size;
  h.checksum = fnv1a(img->data, img->size);
  h.arch = (uint32_t)img->arch;
  h.ptx = (uint32_t)img->ptx;
  if (make_dirs(dir) != 0) {
    snprintf(img->note, sizeof img->note, "memory only: cannot create %.160s (%s)", dir, strerror(errno));
    return -1;
  }
  snprintf(tmp, sizeof tmp, "%.1000s.tmp.%ld.%u", file, (long)getpid(), atomic_fetch_add(&g_tmp_serial, 1));
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    snprintf(img->note, sizeof img->note, "memory only: cannot write in %.160s (%s)", dir, strerror(errno));
    return -1;
  }
  int ok = write_all(fd, &h, sizeof h) == 0 && write_all(fd, img->data, img->size) == 0;
  int err = errno;
  ok = close(fd) == 0 && ok;
  if (ok && rename(tmp, file) != 0) {
    ok = 0;
    err = errno;
  }
  if (!ok) {
    unlink(tmp);
    snprintf(img->note, sizeof img->note, "memory only: writing %.160s failed (%s)", file, strerror(err));
    return -1;
  }
  return 0;
}

/* Disk, then NVRTC, for one architecture; fills *img (data malloc'ed) on success. */
static fdp_result_t produce(int cc, fdp_kimage_t *img) {
  const fdp_nvrtc_t *nv;
  char dir[1024], key[sizeof((header_t *)0)->key];
  FDP_CHECK(fdp__nvrtc_load(&nv, NULL));
  memset(img, 0, sizeof *img);
  double t0 = now();
  uint64_t src = fnv1a(fdp__kernels_source, fdp__kernels_source_size);
  snprintf(key, sizeof key, KEY_FORMAT " src=%016llx nvrtc=%d.%d cc=%d", (unsigned long long)src, nv->major,
           nv->minor, cc);
  fdp__kimage_cache_dir(dir, sizeof dir);
  if (dir[0]) {
    snprintf(img->file, sizeof img->file, "%.900s/%016llx-nvrtc%d.%d-cc%d.bin", dir, (unsigned long long)src, nv->major,
             nv->minor, cc);
    if (cache_read(img->file, key, img) == 1) {
      img->origin = FDP_KIMAGE_DISK;
      img->seconds = now() - t0;
      return FDP_OK;
    }
  } else {
    snprintf(img->note, sizeof img->note, "memory only: %s",
             fdp_param(FDP_PARAM_KERNEL_CACHE) ? "no cache folder (set FASTDP_CACHE_DIR or HOME)"
                                                : "FASTDP_KERNEL_CACHE=0");
  }
  unsigned char *data = NULL;
  FDP_CHECK(fdp__nvrtc_compile(fdp__kernels_source, cc, &data, &img->size, &img->arch, &img->ptx));
  img->data = data;
  img->seconds = now() - t0;
  img->origin = FDP_KIMAGE_COMPILED;
  if (dir[0] && cache_write(dir, img->file, key, img) != 0) {
    fdp__log("kernel cache: %s", img->note);
    img->origin = FDP_KIMAGE_MEMORY;
    img->file[0] = '\0';
  } else if (!dir[0]) {
    img->origin = FDP_KIMAGE_MEMORY;
  }
  return FDP_OK;
}

/* Makes img's malloc'ed bytes shared, with the cache's reference; frees them when that is impossible. */
static fdp_result_t share(fdp_kimage_t *img) {
  shared_bytes_t *s = malloc(sizeof *s);
  if (s == NULL) {
    free((void *)img->data);
    img->data = NULL;
    return fdp__fail(FDP_NOMEM, "no memory to keep a kernel image");
  }
  atomic_init(&s->refs, 1);
  s->data = (unsigned char *)img->data;
  img->shared = s;
  return FDP_OK;
}

fdp_result_t fdp__kimage_get(int cc, fdp_kimage_t *out) {
  fdp_result_t r = FDP_OK;
  pthread_mutex_lock(&g_lock);
  int i = 0;
  while (i < g_count && g_cc[i] != cc)
    i++;
  if (i == g_count) {
    if (g_count == MAX_ARCHS) {
      r = fdp__fail(FDP_INTERNAL, "more than %d GPU architectures in one process", MAX_ARCHS);
    } else {
      r = produce(cc, &g_images[i]);
      if (r == FDP_OK) r = share(&g_images[i]);
      if (r == FDP_OK) g_cc[g_count++] = cc;
    }
  }
  if (r == FDP_OK) {
    /* The caller's own reference: a concurrent fdp__kimage_forget drops only the cache's. */
    atomic_fetch_add_explicit(&((shared_bytes_t *)g_images[i].shared)->refs, 1, memory_order_relaxed);
    *out = g_images[i];
  }
  pthread_mutex_unlock(&g_lock);
  return r;
}

void fdp__kimage_put(fdp_kimage_t *img) {
  shared_bytes_t *s = img->shared;
  img->shared = NULL;
  img->data = NULL;
  if (s == NULL || atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1) return;
  free(s->data);
  free(s);
}

void fdp__kimage_forget(void) {
  pthread_mutex_lock(&g_lock);
  for (int i = 0; i < g_count; i++)
    fdp__kimage_put(&g_images[i]);
  memset(g_images, 0, sizeof g_images);
  g_count = 0;
  pthread_mutex_unlock(&g_lock);
}

/* ---- public facts (fastdp.h) ---- */

void fdp_kernels_facts(fdp_kernels_facts_t *out) {
  const fdp_nvrtc_t *nv = NULL;
  const char *why = "";
  memset(out, 0, sizeof *out);
  out->fatbin_bytes = fdp__kernels_fatbin_size;
  out->source_bytes = fdp__kernels_source_size;
  if (fdp__nvrtc_load(&nv, &why) == FDP_OK) {
    out->nvrtc_major = nv->major;
    out->nvrtc_minor = nv->minor;
    snprintf(out->nvrtc_library, sizeof out->nvrtc_library, "%s", nv->path);
  } else {
    snprintf(out->nvrtc_why, sizeof out->nvrtc_why, "%s", why);
  }
  fdp__kimage_cache_dir(out->cache_dir, sizeof out->cache_dir);
}

fdp_result_t fdp_nvrtc_search_dirs(const char *dirs) {
  return fdp__nvrtc_set_dirs(dirs);
}

fdp_result_t fdp_kernels_image(int cc, int forget, fdp_kernels_image_info_t *out) {
  fdp_kimage_t img;
  memset(out, 0, sizeof *out);
  if (cc <= 0 || cc > 10000) return fdp__fail(FDP_INVALID, "compute capability %d is not major * 10 + minor", cc);
  if (forget) fdp__kimage_forget();
  FDP_CHECK(fdp__kimage_get(cc, &img));
  fdp__kimage_put(&img); /* the facts below are copies */
  out->bytes = img.size;
  out->arch = img.arch;
  out->ptx = img.ptx;
  out->origin = (int)img.origin;
  out->seconds = img.seconds;
  snprintf(out->file, sizeof out->file, "%s", img.file);
  snprintf(out->note, sizeof out->note, "%s", img.note);
  return FDP_OK;
}
