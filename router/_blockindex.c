/* The prefix index's hot table (router/block_index.py) in C: block hash -> bitset over worker slots.
 *
 * The pure-Python core keeps a dict of int masks and a set per worker; every block then costs a
 * dict and a set operation on boxed ints, and a lookup chases the stored key object. Here:
 *
 * - buckets: open addressing (linear probing, backward-shift deletion, no tombstones) of
 *   {u64 key, u32 row + 1} (0: empty), 16 B, so a probe touches one cache line.
 * - rows: a dense array of `words` u64s per distinct hash; bit s is set iff the worker in slot s
 *   holds the hash. Rows are never all zero while in use; a row that empties is deleted by moving
 *   the last row into its place (row_key says which bucket to repoint). Dense rows keep the table's
 *   slack to 16 B a bucket however wide the bitsets are, and growing the table moves no row.
 * - rows widen (words doubles) when a slot beyond the width arrives.
 *
 * There is no per-worker list of hashes: a worker's hashes are found by scanning the rows (clear,
 * hashes, dump), which only a worker leaving or a full re-sync does. Per-slot counts say when a
 * worker holds nothing any more without scanning.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifdef __linux__
#include <sys/mman.h>
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "rows are turned into Python ints as little-endian bytes"
#endif

#define MIN_CAP 1024
#define CHUNK 16 /* prompt hashes looked up (and prefetched) together */
#define MAX_SLOT (1 << 20)
#define MAX_ROWS 0xFFFFFFFE

typedef struct {
    uint64_t key;
    uint32_t row; /* row index + 1; 0: empty bucket */
    uint32_t pad;
} Bucket;

typedef struct {
    PyObject_HEAD
    Bucket *buckets;
    Py_ssize_t cap;     /* a power of two */
    int shift;          /* 64 - log2(cap) */
    uint64_t *rows;     /* row_cap * words */
    uint64_t *row_key;  /* row -> its hash */
    Py_ssize_t nrows;   /* rows in use: the distinct hashes */
    Py_ssize_t row_cap;
    Py_ssize_t words;
    uint64_t *run;      /* match scratch: the running AND, words long */
    uint64_t *cut;      /* match scratch: bits that dropped out, words long */
    Py_ssize_t *counts; /* slot -> hashes held, words * 64 long */
} Core;

/* Zeroed arrays. Big ones (rows, buckets) are mmap-ed with transparent huge pages asked for: at
 * 1,000 slots (128-byte rows) the page faults of a growing table were most of the ingest time, and
 * 2 MB pages fault 512x less often. Small ones stay on PyMem, so an empty index maps nothing. */
#define BIG ((size_t)1 << 21)
#define ROUND_BIG(n) (((n) + BIG - 1) & ~(BIG - 1))

static void *zalloc(size_t bytes) {
#ifdef __linux__
    if (bytes >= BIG) {
        void *p = mmap(NULL, ROUND_BIG(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return NULL;
        madvise(p, ROUND_BIG(bytes), MADV_HUGEPAGE); /* a hint: without THP, 4 KB pages do */
        return p;
    }
#endif
    return PyMem_Calloc(bytes ? bytes : 1, 1);
}

static void zfree(void *p, size_t bytes) {
    if (p == NULL) return;
#ifdef __linux__
    if (bytes >= BIG) {
        munmap(p, ROUND_BIG(bytes));
        return;
    }
#endif
    (void)bytes;
    PyMem_Free(p);
}

/* Grow a zalloc-ed array from `old` to `bytes` (> old); the new tail is zero. */
static void *zrealloc(void *p, size_t old, size_t bytes) {
#ifdef __linux__
    if (old >= BIG) {
        void *q = mremap(p, ROUND_BIG(old), ROUND_BIG(bytes), MREMAP_MAYMOVE);
        if (q == MAP_FAILED) return NULL;
        madvise(q, ROUND_BIG(bytes), MADV_HUGEPAGE);
        return q; /* pages past the old mapping are fresh zero pages */
    }
    if (bytes >= BIG) {
        void *q = zalloc(bytes);
        if (q == NULL) return NULL;
        memcpy(q, p, old);
        PyMem_Free(p);
        return q;
    }
#endif
    unsigned char *q = PyMem_Realloc(p, bytes);
    if (q == NULL) return NULL;
    memset(q + old, 0, bytes - old);
    return q;
}

static inline Py_ssize_t home(const Core *c, uint64_t key) {
    return (Py_ssize_t)((key * 0x9E3779B97F4A7C15ULL) >> c->shift); /* Fibonacci hashing */
}

static inline int row_empty(const uint64_t *row, Py_ssize_t words) {
    for (Py_ssize_t w = 0; w < words; w++)
        if (row[w]) return 0;
    return 1;
}

/* The bucket holding `key`, or -1. */
static Py_ssize_t find(const Core *c, uint64_t key) {
    Py_ssize_t mask = c->cap - 1;
    for (Py_ssize_t i = home(c, key);; i = (i + 1) & mask) {
        if (!c->buckets[i].row) return -1;
        if (c->buckets[i].key == key) return i;
    }
}

/* Rehash every key into `cap` buckets (rows stay where they are). */
static int resize(Core *c, Py_ssize_t cap) {
    Bucket *buckets = zalloc((size_t)cap * sizeof(Bucket));
    if (buckets == NULL) return PyErr_NoMemory(), -1;
    int shift = 64;
    for (Py_ssize_t n = cap; n > 1; n >>= 1) shift--;
    Bucket *old = c->buckets;
    Py_ssize_t old_cap = c->cap;
    c->buckets = buckets;
    c->cap = cap;
    c->shift = shift;
    for (Py_ssize_t i = 0; i < old_cap; i++) {
        if (!old[i].row) continue;
        Py_ssize_t j = home(c, old[i].key);
        while (buckets[j].row) j = (j + 1) & (cap - 1);
        buckets[j] = old[i];
    }
    zfree(old, (size_t)old_cap * sizeof(Bucket));
    return 0;
}

/* Room for `rows` rows of `words` words (new space zeroed). */
static int reserve_rows(Core *c, Py_ssize_t rows, Py_ssize_t words) {
    if (rows <= c->row_cap && words == c->words) return 0;
    if (rows > MAX_ROWS) return PyErr_SetString(PyExc_MemoryError, "prefix index full"), -1;
    Py_ssize_t row_cap = c->row_cap;
    while (row_cap < rows) row_cap *= 2;
    uint64_t *keys = PyMem_Realloc(c->row_key, (size_t)row_cap * sizeof(uint64_t));
    if (keys == NULL) return PyErr_NoMemory(), -1;
    c->row_key = keys;
    uint64_t *next;
    if (words == c->words) {
        next = zrealloc(c->rows, (size_t)(c->row_cap * words) * 8, (size_t)(row_cap * words) * 8);
        if (next == NULL) return PyErr_NoMemory(), -1;
    } else {
        next = zalloc((size_t)(row_cap * words) * 8);
        if (next == NULL) return PyErr_NoMemory(), -1;
        for (Py_ssize_t r = 0; r < c->nrows; r++)
            memcpy(next + r * words, c->rows + r * c->words, (size_t)c->words * sizeof(uint64_t));
        zfree(c->rows, (size_t)(c->row_cap * c->words) * 8);
    }
    c->rows = next;
    c->row_cap = row_cap;
    return 0;
}

/* Make room for slot `slot`: double the row width until it fits. */
static int ensure_slot(Core *c, Py_ssize_t slot) {
    Py_ssize_t words = c->words;
    while (slot >= words * 64) words *= 2;
    if (words == c->words) return 0;
    uint64_t *run = PyMem_Realloc(c->run, (size_t)words * sizeof(uint64_t));
    if (run == NULL) return PyErr_NoMemory(), -1;
    c->run = run;
    uint64_t *cut = PyMem_Realloc(c->cut, (size_t)words * sizeof(uint64_t));
    if (cut == NULL) return PyErr_NoMemory(), -1;
    c->cut = cut;
    Py_ssize_t *counts = PyMem_Realloc(c->counts, (size_t)words * 64 * sizeof(Py_ssize_t));
    if (counts == NULL) return PyErr_NoMemory(), -1;
    memset(counts + c->words * 64, 0, (size_t)(words - c->words) * 64 * sizeof(Py_ssize_t));
    c->counts = counts;
    if (reserve_rows(c, c->row_cap, words) < 0) return -1;
    c->words = words;
    return 0;
}

/* Delete the key in bucket i, whose row is empty: shift its probe run back, then move the last
 * row into the freed row and repoint that row's bucket. */
static void delete_at(Core *c, Py_ssize_t i) {
    Py_ssize_t mask = c->cap - 1, words = c->words;
    Py_ssize_t freed = (Py_ssize_t)c->buckets[i].row - 1;
    for (Py_ssize_t j = (i + 1) & mask; c->buckets[j].row; j = (j + 1) & mask) {
        Py_ssize_t h = home(c, c->buckets[j].key);
        /* The key at j may move to i unless its home lies cyclically in (i, j]. */
        int stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (stays) continue;
        c->buckets[i] = c->buckets[j];
        i = j;
    }
    c->buckets[i].row = 0;
    Py_ssize_t last = --c->nrows;
    if (freed != last) {
        memcpy(c->rows + freed * words, c->rows + last * words, (size_t)words * sizeof(uint64_t));
        c->row_key[freed] = c->row_key[last];
        c->buckets[find(c, c->row_key[freed])].row = (uint32_t)(freed + 1);
    }
    memset(c->rows + last * words, 0, (size_t)words * sizeof(uint64_t));
}

static int hash_error(PyObject *item) {
    PyErr_Clear();
    PyObject *repr = PyObject_Repr(item);
    if (repr != NULL) {
        PyErr_Format(PyExc_ValueError, "block hashes must be integers in [0, 2**64): got %U", repr);
        Py_DECREF(repr);
    }
    return -1;
}

static inline int as_hash(PyObject *item, uint64_t *out) {
    if (!PyLong_Check(item)) return hash_error(item);
    unsigned long long v = PyLong_AsUnsignedLongLong(item);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return hash_error(item);
    *out = (uint64_t)v;
    return 0;
}

/* Every item of `hashes` as a u64 in a fresh buffer (*n long), or NULL with ValueError set.
 * Converting all before touching the table keeps a call that fails from changing anything. */
static uint64_t *read_hashes(PyObject *hashes, Py_ssize_t *n) {
    PyObject *seq = PySequence_Fast(hashes, "block hashes must be an iterable of ints");
    if (seq == NULL) return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t *out = PyMem_Malloc((size_t)(*n > 0 ? *n : 1) * sizeof(uint64_t));
    if (out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        if (as_hash(items[i], out + i) < 0) {
            PyMem_Free(out);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return out;
}

static int parse_slot(PyObject *arg, Py_ssize_t *slot) {
    *slot = PyLong_AsSsize_t(arg);
    if (*slot == -1 && PyErr_Occurred()) return -1;
    if (*slot < 0 || *slot > MAX_SLOT) {
        PyErr_Format(PyExc_ValueError, "slot must be in [0, %d], got %zd", MAX_SLOT, *slot);
        return -1;
    }
    return 0;
}

/* store(slot, hashes) -> int: how many of `hashes` the slot did not hold before. */
static PyObject *core_store(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot, n;
    if (nargs != 2) return PyErr_SetString(PyExc_TypeError, "store(slot, hashes)"), NULL;
    if (parse_slot(args[0], &slot) < 0) return NULL;
    uint64_t *hs = read_hashes(args[1], &n);
    if (hs == NULL) return NULL;
    if (ensure_slot(c, slot) < 0 || reserve_rows(c, c->nrows + n, c->words) < 0) goto fail;
    while ((c->nrows + n) * 4 > c->cap * 3) /* keep the load under 3/4 */
        if (resize(c, c->cap * 2) < 0) goto fail;
    for (Py_ssize_t k = 0; k < n; k++) __builtin_prefetch(c->buckets + home(c, hs[k]));
    Py_ssize_t added = 0, words = c->words, mask = c->cap - 1, w = slot >> 6;
    uint64_t bit = 1ULL << (slot & 63);
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t i = home(c, hs[k]);
        while (c->buckets[i].row && c->buckets[i].key != hs[k]) i = (i + 1) & mask;
        if (!c->buckets[i].row) {
            c->buckets[i].key = hs[k];
            c->row_key[c->nrows] = hs[k];
            c->buckets[i].row = (uint32_t)(++c->nrows);
        }
        uint64_t *word = c->rows + (Py_ssize_t)(c->buckets[i].row - 1) * words + w;
        if (!(*word & bit)) {
            *word |= bit;
            added++;
        }
    }
    c->counts[slot] += added;
    PyMem_Free(hs);
    return PyLong_FromSsize_t(added);
fail:
    PyMem_Free(hs);
    return NULL;
}

/* remove(slot, hashes) -> int: how many of `hashes` the slot held (and no longer does). */
static PyObject *core_remove(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot, n;
    if (nargs != 2) return PyErr_SetString(PyExc_TypeError, "remove(slot, hashes)"), NULL;
    if (parse_slot(args[0], &slot) < 0) return NULL;
    uint64_t *hs = read_hashes(args[1], &n);
    if (hs == NULL) return NULL;
    Py_ssize_t removed = 0, words = c->words, w = slot >> 6;
    uint64_t bit = 1ULL << (slot & 63);
    if (slot < words * 64) {
        for (Py_ssize_t k = 0; k < n; k++) {
            Py_ssize_t i = find(c, hs[k]);
            if (i < 0) continue;
            uint64_t *row = c->rows + (Py_ssize_t)(c->buckets[i].row - 1) * words;
            if (!(row[w] & bit)) continue;
            row[w] &= ~bit;
            removed++;
            if (row_empty(row, words)) delete_at(c, i);
        }
        c->counts[slot] -= removed;
    }
    PyMem_Free(hs);
    return PyLong_FromSsize_t(removed);
}

/* clear(slot) -> int: drop every hash of the slot; how many it held. Scans the rows. */
static PyObject *core_clear(Core *c, PyObject *arg) {
    Py_ssize_t slot;
    if (parse_slot(arg, &slot) < 0) return NULL;
    if (slot >= c->words * 64 || c->counts[slot] == 0) return PyLong_FromLong(0);
    Py_ssize_t words = c->words, w = slot >> 6;
    uint64_t bit = 1ULL << (slot & 63);
    for (Py_ssize_t r = 0; r < c->nrows;) {
        uint64_t *row = c->rows + r * words;
        if (row[w] & bit) {
            row[w] &= ~bit;
            if (row_empty(row, words)) {
                delete_at(c, find(c, c->row_key[r])); /* moves the last row (not yet seen) to r */
                continue;
            }
        }
        r++;
    }
    Py_ssize_t held = c->counts[slot];
    c->counts[slot] = 0;
    return PyLong_FromSsize_t(held);
}

/* count(slot) -> int: hashes the slot holds. */
static PyObject *core_count(Core *c, PyObject *arg) {
    Py_ssize_t slot;
    if (parse_slot(arg, &slot) < 0) return NULL;
    return PyLong_FromSsize_t(slot < c->words * 64 ? c->counts[slot] : 0);
}

/* dump(nslots) -> list[list[int]]: per slot below nslots, the hashes it holds (row order). */

/* list.append(int(key)); -1 with an exception set on failure. */
static int append_key(PyObject *list, uint64_t key) {
    PyObject *h = PyLong_FromUnsignedLongLong(key);
    if (h == NULL) return -1;
    int err = PyList_Append(list, h);
    Py_DECREF(h);
    return err;
}

static PyObject *core_dump(Core *c, PyObject *arg) {
    Py_ssize_t nslots;
    if (parse_slot(arg, &nslots) < 0) return NULL;
    PyObject *out = PyList_New(nslots);
    if (out == NULL) return NULL;
    for (Py_ssize_t s = 0; s < nslots; s++) {
        PyObject *l = PyList_New(0);
        if (l == NULL) goto fail;
        PyList_SET_ITEM(out, s, l);
    }
    for (Py_ssize_t r = 0; r < c->nrows; r++) {
        const uint64_t *row = c->rows + r * c->words;
        for (Py_ssize_t w = 0; w < c->words; w++) {
            for (uint64_t bits = row[w]; bits; bits &= bits - 1) {
                Py_ssize_t s = w * 64 + __builtin_ctzll(bits);
                if (s >= nslots) break;
                if (append_key(PyList_GET_ITEM(out, s), c->row_key[r]) < 0) goto fail;
            }
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* hashes(slot) -> list[int]: the hashes the slot holds (row order). Scans the rows. */
static PyObject *core_hashes(Core *c, PyObject *arg) {
    Py_ssize_t slot;
    if (parse_slot(arg, &slot) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL || slot >= c->words * 64 || c->counts[slot] == 0) return out;
    Py_ssize_t w = slot >> 6;
    uint64_t bit = 1ULL << (slot & 63);
    for (Py_ssize_t r = 0; r < c->nrows; r++) {
        if (!(c->rows[r * c->words + w] & bit)) continue;
        if (append_key(out, c->row_key[r]) < 0) goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *row_to_int(const uint64_t *row, Py_ssize_t words) {
    return _PyLong_FromByteArray((const unsigned char *)row, (size_t)words * 8, 1, 0);
}

/* Append (bits, depth) to cuts. */
static int add_cut(PyObject *cuts, const uint64_t *bits, Py_ssize_t words, Py_ssize_t depth) {
    PyObject *mask = row_to_int(bits, words);
    if (mask == NULL) return -1;
    PyObject *pair = Py_BuildValue("(Nn)", mask, depth);
    if (pair == NULL) return -1;
    int err = PyList_Append(cuts, pair);
    Py_DECREF(pair);
    return err;
}

/* match(hashes) -> (matched, cuts) | None.
 *
 * Walks the leading hashes that somebody holds, AND-ing their rows. `cuts` lists (bits, depth)
 * where bits are the slots whose prefix ends at depth (the last entry: those holding the whole
 * walk); `matched` is their union, the slots holding the first block. None when nobody holds the
 * first block. A hash that is not a u64 is held by nobody, so the walk ends there. After the first
 * hash, lookups go a chunk at a time, prefetching the chunk's buckets and then its rows, so their
 * cache misses overlap instead of following one another. */
static PyObject *core_match(Core *c, PyObject *hashes) {
    PyObject *seq = PySequence_Fast(hashes, "block hashes must be an iterable of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), words = c->words, depth = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *cuts = NULL, *matched = NULL;
    uint64_t *run = c->run, *cut = c->cut;
    int done = 0;
    while (!done && depth < n) {
        uint64_t key[CHUNK];
        const uint64_t *rows[CHUNK];
        /* The first hash alone: most prompts nobody holds end there, after one lookup. */
        Py_ssize_t m = depth == 0 ? 1 : (n - depth < CHUNK ? n - depth : CHUNK), got = 0;
        for (Py_ssize_t k = 0; k < m; k++) {
            PyObject *item = items[depth + k];
            unsigned long long v = PyLong_Check(item) ? PyLong_AsUnsignedLongLong(item) : 0;
            if (!PyLong_Check(item) || (v == (unsigned long long)-1 && PyErr_Occurred())) {
                PyErr_Clear();
                m = k;
                done = 1;
                break;
            }
            key[k] = v;
            __builtin_prefetch(c->buckets + home(c, v));
        }
        for (; got < m; got++) {
            Py_ssize_t i = find(c, key[got]);
            if (i < 0) break;
            rows[got] = c->rows + (Py_ssize_t)(c->buckets[i].row - 1) * words;
            __builtin_prefetch(rows[got]);
        }
        if (got < m) done = 1;
        for (Py_ssize_t k = 0; k < got; k++, depth++) {
            const uint64_t *row = rows[k];
            if (depth == 0) {
                memcpy(run, row, (size_t)words * sizeof(uint64_t));
                if ((matched = row_to_int(row, words)) == NULL || (cuts = PyList_New(0)) == NULL) goto fail;
                continue;
            }
            uint64_t lost = 0, left = 0;
            for (Py_ssize_t w = 0; w < words; w++) {
                cut[w] = run[w] & ~row[w];
                lost |= cut[w];
                run[w] &= row[w];
                left |= run[w];
            }
            if (lost && add_cut(cuts, cut, words, depth) < 0) goto fail;
            if (!left) {
                Py_DECREF(seq);
                return Py_BuildValue("(NN)", matched, cuts);
            }
        }
    }
    Py_DECREF(seq);
    if (depth == 0) Py_RETURN_NONE;
    if (add_cut(cuts, run, words, depth) < 0) {
        Py_DECREF(matched);
        Py_DECREF(cuts);
        return NULL;
    }
    return Py_BuildValue("(NN)", matched, cuts);
fail:
    Py_DECREF(seq);
    Py_XDECREF(matched);
    Py_XDECREF(cuts);
    return NULL;
}

static Py_ssize_t core_len(Core *c) { return c->nrows; }

static PyObject *core_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds)))
        return PyErr_SetString(PyExc_TypeError, "Core() takes no arguments"), NULL;
    Core *c = (Core *)type->tp_alloc(type, 0);
    if (c == NULL) return NULL;
    c->cap = MIN_CAP;
    c->shift = 64 - 10;
    c->words = 1;
    c->row_cap = MIN_CAP;
    c->buckets = zalloc(MIN_CAP * sizeof(Bucket));
    c->rows = zalloc(MIN_CAP * sizeof(uint64_t));
    c->row_key = PyMem_Calloc(MIN_CAP, sizeof(uint64_t));
    c->run = PyMem_Calloc(1, sizeof(uint64_t));
    c->cut = PyMem_Calloc(1, sizeof(uint64_t));
    c->counts = PyMem_Calloc(64, sizeof(Py_ssize_t));
    if (!c->buckets || !c->rows || !c->row_key || !c->run || !c->cut || !c->counts) {
        Py_DECREF(c);
        return PyErr_NoMemory();
    }
    return (PyObject *)c;
}

static void core_dealloc(Core *c) {
    zfree(c->buckets, (size_t)c->cap * sizeof(Bucket));
    zfree(c->rows, (size_t)(c->row_cap * c->words) * 8);
    PyMem_Free(c->row_key);
    PyMem_Free(c->run);
    PyMem_Free(c->cut);
    PyMem_Free(c->counts);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* name_bits(names, bits, depth, out): out[names[s]] = depth for every set bit s of `bits`. */
static PyObject *name_bits(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4 || !PyList_Check(args[0]) || !PyLong_Check(args[1]) || !PyDict_Check(args[3]))
        return PyErr_SetString(PyExc_TypeError, "name_bits(names: list, bits: int, depth, out: dict)"), NULL;
    PyObject *names = args[0], *depth = args[2], *out = args[3];
    if (_PyLong_Sign(args[1]) < 0) return PyErr_SetString(PyExc_ValueError, "bits must be >= 0"), NULL;
    size_t words = (_PyLong_NumBits(args[1]) + 63) / 64;
    uint64_t *buf = PyMem_Calloc(words ? words : 1, sizeof(uint64_t));
    if (buf == NULL) return PyErr_NoMemory();
    if (_PyLong_AsByteArray((PyLongObject *)args[1], (unsigned char *)buf, words * 8, 1, 0) < 0) goto fail;
    for (size_t w = 0; w < words; w++) {
        for (uint64_t b = buf[w]; b; b &= b - 1) {
            Py_ssize_t s = (Py_ssize_t)(w * 64) + __builtin_ctzll(b);
            if (s >= PyList_GET_SIZE(names)) {
                PyErr_Format(PyExc_IndexError, "bit %zd names no slot", s);
                goto fail;
            }
            if (PyDict_SetItem(out, PyList_GET_ITEM(names, s), depth) < 0) goto fail;
        }
    }
    PyMem_Free(buf);
    Py_RETURN_NONE;
fail:
    PyMem_Free(buf);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"name_bits", (PyCFunction)(void (*)(void))name_bits, METH_FASTCALL,
     "name_bits(names, bits, depth, out): out[names[s]] = depth for each set bit s"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef core_methods[] = {
    {"store", (PyCFunction)(void (*)(void))core_store, METH_FASTCALL, "store(slot, hashes) -> newly held"},
    {"remove", (PyCFunction)(void (*)(void))core_remove, METH_FASTCALL, "remove(slot, hashes) -> dropped"},
    {"clear", (PyCFunction)core_clear, METH_O, "clear(slot) -> dropped"},
    {"count", (PyCFunction)core_count, METH_O, "count(slot) -> hashes held"},
    {"dump", (PyCFunction)core_dump, METH_O, "dump(nslots) -> per slot, its hashes"},
    {"hashes", (PyCFunction)core_hashes, METH_O, "hashes(slot) -> its hashes"},
    {"match", (PyCFunction)core_match, METH_O, "match(hashes) -> (matched, [(bits, depth)]) | None"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods core_as_sequence = {.sq_length = (lenfunc)core_len};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router._blockindex.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "block hash -> bitset over worker slots",
    .tp_new = core_new,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_methods = core_methods,
    .tp_as_sequence = &core_as_sequence,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockindex", NULL, -1, module_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__blockindex(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
