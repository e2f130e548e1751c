/* SPDX-License-Identifier: MIT */
/* NOTE [dict tags from 3.12]: the kept replicas skip, every step, the modules whose dicts nobody changed, by
 * comparing version tags (NOTE [refresh records] in refresh.c, the owned-dict records in edits.c, NOTE [structure
 * records] in structure_records.c). Up to CPython 3.11 every dict carries one (PEP 509). From 3.12 the field is
 * deprecated (PEP 699), and dict watchers (new in 3.12: PyDict_AddWatcher) report changes instead: a dict asked for
 * its tag is watched from then on and gets a tag from one process-wide counter, and every change the watcher reports
 * gives it the next one. So a tag is unique and new on every change, as PEP 509's was. A deallocated dict leaves the
 * table, so a new dict at its address is watched afresh with a tag no record holds. The watcher also counts, per
 * role, the changes of the dicts asked through fdp__dict_tag_counted: refresh's (module and hook dicts), the
 * owned-dict records' (a replica's own dicts) and the structure records' (the master modules' instance and slot
 * dicts). While a role's count stands still none of its dicts changed, and its records are taken whole instead of
 * reading each dict's tag. When the interpreter has no watcher left (it has eight), there are no tags: every pair
 * is walked, every value reinstalled and every module's structure compared, as before watchers existed. */
#include "binding.h"

#if PY_VERSION_HEX >= 0x030C0000

#include <stdlib.h>

int fdp__dict_watcher = -1;

typedef struct {
  PyObject *dict; /* NULL: a free slot; the dict itself is not referenced (its deallocation removes it) */
  uint64_t tag;
  unsigned roles; /* the counts its changes go to (FDP_TAG_* bits, fdp__dict_tag_counted) */
} tag_slot_t;

/* An open-addressing table by address, linear probing, at most half full. */
static tag_slot_t *g_slots;
static size_t g_mask, g_used;                         /* capacity - 1 (a power of two), occupied slots */
static uint64_t g_last;                               /* the last tag given */
static uint64_t g_counted[FDP_TAG_ROLES] = {1, 1, 1}; /* changes seen per role, from 1 (0 is no count) */

static size_t home_of(const PyObject *d) {
  uint64_t x = (uint64_t)(uintptr_t)d;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull; /* a 64-bit mix: objects sit at 16-byte strides */
  x ^= x >> 33;
  return (size_t)x & g_mask;
}

/* The slot holding `d`, or the free slot where it would go. */
static tag_slot_t *slot_of(const PyObject *d) {
  size_t i = home_of(d);
  while (g_slots[i].dict && g_slots[i].dict != d)
    i = (i + 1) & g_mask;
  return &g_slots[i];
}

static int grow(void) {
  size_t old_cap = g_slots ? g_mask + 1 : 0, cap = old_cap ? 2 * old_cap : 1024;
  tag_slot_t *old = g_slots, *fresh = calloc(cap, sizeof *fresh);
  if (!fresh) return -1;
  g_slots = fresh;
  g_mask = cap - 1;
  for (size_t i = 0; i < old_cap; i++)
    if (old[i].dict) *slot_of(old[i].dict) = old[i];
  free(old);
  return 0;
}

/* Removes the entry at slot index `i`, moving later entries of its probe run back (no tombstones). */
static void erase_at(size_t i) {
  size_t j = i;
  g_slots[i].dict = NULL;
  g_used--;
  for (;;) {
    j = (j + 1) & g_mask;
    if (!g_slots[j].dict) return;
    size_t home = home_of(g_slots[j].dict);
    /* the entry at j may fill the hole at i when its home does not lie cyclically in (i, j] */
    if (((j - home) & g_mask) >= ((j - i) & g_mask)) {
      g_slots[i] = g_slots[j];
      g_slots[j].dict = NULL;
      i = j;
    }
  }
}

static int on_dict_event(PyDict_WatchEvent event, PyObject *d, PyObject *key, PyObject *value) {
  (void)key;
  (void)value;
  if (!g_slots) return 0;
  tag_slot_t *s = slot_of(d);
  if (!s->dict) return 0; /* watched before a failed growth, or not by this table */
  for (int r = 0; r < FDP_TAG_ROLES; r++)
    if (s->roles & (1u << r)) g_counted[r]++;
  if (event == PyDict_EVENT_DEALLOCATED)
    erase_at((size_t)(s - g_slots));
  else
    s->tag = ++g_last;
  return 0;
}

/* d's slot, made (and d watched) on first sight; NULL where no tag can be given. */
static tag_slot_t *tagged(PyObject *d) {
  if (fdp__dict_watcher < 0 || !PyDict_Check(d)) return NULL;
  if (g_slots) {
    tag_slot_t *s = slot_of(d);
    if (s->dict) return s;
  }
  if ((!g_slots || 2 * (g_used + 1) > g_mask + 1) && grow() < 0) return NULL;
  if (PyDict_Watch(fdp__dict_watcher, d) < 0) {
    PyErr_Clear(); /* only for a bad watcher id or a non-dict, both excluded above */
    return NULL;
  }
  tag_slot_t *s = slot_of(d);
  s->dict = d;
  s->tag = ++g_last;
  s->roles = 0;
  g_used++;
  return s;
}

uint64_t fdp__dict_tag(PyObject *d) {
  tag_slot_t *s = tagged(d);
  return s ? s->tag : 0; /* 0, no tag: the caller compares contents */
}

uint64_t fdp__dict_tag_counted(PyObject *d, int role) {
  tag_slot_t *s = tagged(d);
  if (!s) return 0;
  s->roles |= 1u << role;
  return s->tag;
}

uint64_t fdp__counted_changes(int role) {
  return g_counted[role];
}

int fdp__dict_tags_init(void) {
  if (fdp__dict_watcher >= 0) return 0;
  fdp__dict_watcher = PyDict_AddWatcher(on_dict_event);
  if (fdp__dict_watcher < 0) PyErr_Clear(); /* every watcher taken: no tags (see the note) */
  return 0;
}

#else

int fdp__dict_tags_init(void) {
  return 0;
}

#endif
