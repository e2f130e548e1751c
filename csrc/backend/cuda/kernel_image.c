/* SPDX-License-Identifier: MIT */
/* NVRTC kernel images, once per process and cached on disk: one file per (source, options and target, NVRTC
 * version, architecture), written atomically (temporary file + rename) and checked on read (header with key, length
 * and checksum), so a torn, corrupt or foreign file is rebuilt rather than handed to the driver. The same key finds
 * an image in memory: an image is never served for other source, other options or another target. */
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

#define MAX_IMAGES 32
#define MAGIC "FDPKIMG1"
/* Part of every key: bump it when the layout of an entry changes. The options and target are in the key itself. */
#define KEY_FORMAT "fastdp-kernels/2"
#define KEY_BYTES 112

/* The on-disk header, followed by `size` bytes of image. Native byte order: the cache is per machine. */
typedef struct header {
  char magic[8];
  char key[KEY_BYTES];
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
static fdp_kimage_t g_images[MAX_IMAGES]; /* each holds the cache's own reference */
static char g_keys[MAX_IMAGES][KEY_BYTES]; /* what each was built from */
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

/* What an image is built from: the source, NVRTC's version, the options and target, the device's architecture.
 * `key` gets the text a cache entry carries; `name` the file name it is stored under. */
typedef struct recipe {
  const char *source;
  size_t source_size;
  int cc;
  const char *extra; /* options beyond fastdp's own; NULL for none */
  fdp_nvrtc_plan_t plan;
  char key[KEY_BYTES];
  char name[128];
} recipe_t;

static fdp_result_t recipe_init(recipe_t *rc) {
  const fdp_nvrtc_t *nv;
  FDP_CHECK(fdp__nvrtc_load(&nv, NULL));
  FDP_CHECK(fdp__nvrtc_plan(rc->cc, rc->extra, &rc->plan));
  unsigned long long src = fnv1a(rc->source, rc->source_size);
  unsigned long long opt = fnv1a(rc->plan.text, strlen(rc->plan.text));
  snprintf(rc->key, sizeof rc->key, KEY_FORMAT " src=%016llx opt=%016llx nvrtc=%d.%d cc=%d", src, opt, nv->major,
           nv->minor, rc->cc);
  snprintf(rc->name, sizeof rc->name, "%016llx-%016llx-nvrtc%d.%d-cc%d.bin", src, opt, nv->major, nv->minor, rc->cc);
  return FDP_OK;
}

/* Disk, then NVRTC, for one recipe; fills *img (data malloc'ed) on success. */
static fdp_result_t produce(const recipe_t *rc, fdp_kimage_t *img) {
  char dir[1024], file[sizeof img->file];
  memset(img, 0, sizeof *img);
  double t0 = now();
  snprintf(img->options, sizeof img->options, "%s", rc->plan.text);
  fdp__kimage_cache_dir(dir, sizeof dir);
  if (dir[0]) {
    snprintf(file, sizeof file, "%.880s/%s", dir, rc->name);
    snprintf(img->file, sizeof img->file, "%s", file);
    if (cache_read(file, rc->key, img) == 1) {
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
  FDP_CHECK(fdp__nvrtc_compile(rc->source, &rc->plan, &data, &img->size));
  img->data = data;
  img->arch = rc->plan.arch;
  img->ptx = rc->plan.ptx;
  img->seconds = now() - t0;
  img->origin = FDP_KIMAGE_COMPILED;
  if (dir[0] && cache_write(dir, file, rc->key, img) != 0) {
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

fdp_result_t fdp__kimage_get_for(const char *source, size_t source_size, int cc, const char *extra,
                                 fdp_kimage_t *out) {
  recipe_t rc;
  memset(&rc, 0, sizeof rc);
  rc.source = source;
  rc.source_size = source_size;
  rc.cc = cc;
  rc.extra = extra;
  FDP_CHECK(recipe_init(&rc));
  fdp_result_t r = FDP_OK;
  pthread_mutex_lock(&g_lock);
  int i = 0;
  while (i < g_count && strcmp(g_keys[i], rc.key) != 0)
    i++;
  if (i == g_count) {
    if (g_count == MAX_IMAGES) {
      r = fdp__fail(FDP_INTERNAL, "more than %d kernel images in one process", MAX_IMAGES);
    } else {
      r = produce(&rc, &g_images[i]);
      if (r == FDP_OK) r = share(&g_images[i]);
      if (r == FDP_OK) snprintf(g_keys[g_count++], KEY_BYTES, "%s", rc.key);
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

fdp_result_t fdp__kimage_get(int cc, fdp_kimage_t *out) {
  return fdp__kimage_get_for(fdp__kernels_source, fdp__kernels_source_size, cc, NULL, out);
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
  snprintf(out->options, sizeof out->options, "%s", img.options);
  snprintf(out->file, sizeof out->file, "%s", img.file);
  snprintf(out->note, sizeof out->note, "%s", img.note);
  return FDP_OK;
}
