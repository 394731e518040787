/* The prefix index's hot table (router/block_index.py) in C: block hash -> the worker slots holding it.
 *
 * Sized for 1,000 workers x 16 k blocks in well under 2 GB (docs/router_index.md, "Memory per
 * entry"). Most blocks are held by one to three workers and a few popular prefixes by many, so:
 *
 * - buckets: open addressing (linear probing, backward-shift deletion, no tombstones) of 16 B:
 *   {u64 key, holders}. Holders are inline, up to INLINE slot ids (u16, slot + 1, packed first, 0
 *   after; slot[0] == 0: empty bucket). A hash gaining holder INLINE + 1 is promoted to a bitset row
 *   ({WIDE, count, row}); a row that drops to DEMOTE holders goes back inline.
 * - rows: a dense array of `words` u64s per promoted hash; bit s is set iff slot s holds it. A freed
 *   row is filled by the last one (row_key says which bucket to repoint). Rows widen (words doubles)
 *   when a slot beyond the width arrives; only promoted hashes pay for the width.
 * - per slot: a log of the hashes it gained, so clearing, listing and dumping a worker cost what it
 *   holds, not a scan of the table; and its digest (count, XOR of its hashes), kept as hashes come
 *   and go. The log is appended to and never searched: a removal leaves its entry behind, and the
 *   log is compacted (entries the slot no longer holds dropped, then duplicates) when it is full and
 *   at least half stale, or a quarter live after removals. Appending is what ingest pays; a per-slot
 *   hash set cost it a random access per block, a third of the time.
 *
 * Every change of one (slot, hash) pair is whole or not at all: memory is reserved before a pair is
 * written, so a MemoryError half-way through a call leaves earlier pairs applied and counted.
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
#define MIN_ROWS 64
#define MIN_LOG 16
#define CHUNK 16 /* prompt hashes looked up (and prefetched) together */
#define AHEAD 16 /* how far store/remove prefetch ahead */
#define INLINE 4
#define DEMOTE 3 /* a row with this many holders goes back inline: 5 -> 4 stays, no flapping */
#define WIDE 0xFFFF
#define MAX_SLOT 0xFFFD /* slot + 1 must stay below WIDE */
#define MAX_ROWS 0xFFFFFFFE

typedef struct {
    uint64_t key;
    union {
        uint16_t slot[INLINE]; /* slot + 1, packed first; slot[0] == 0: the bucket is empty */
        struct {
            uint16_t tag; /* WIDE */
            uint16_t n;   /* holders */
            uint32_t row;
        } wide;
    } h;
} Bucket;

_Static_assert(sizeof(Bucket) == 16, "a bucket is 16 bytes: four to a cache line");

/* One slot: every hash it holds is in keys[0..n), along with stale and repeated ones. */
typedef struct {
    uint64_t *keys;
    Py_ssize_t n, cap;
    Py_ssize_t count; /* hashes held */
    uint64_t xor;     /* of the hashes held */
} Owned;

typedef struct {
    PyObject_HEAD
    Bucket *buckets;
    Py_ssize_t cap; /* a power of two */
    int shift;      /* 64 - log2(cap) */
    uint64_t seed[2]; /* the bucket hash's secret key, from os.urandom: see bucket_hash */
    Py_ssize_t nkeys;
    uint64_t *rows;    /* row_cap * words */
    uint64_t *row_key; /* row -> its hash */
    Py_ssize_t nrows, row_cap, words;
    uint64_t *run; /* match scratch, words long */
    uint64_t *cut; /* match scratch, words long */
    Owned *owned;  /* slot -> its log and digest, nslots long */
    Py_ssize_t nslots;
    Py_ssize_t entries;     /* (slot, hash) pairs */
    Py_ssize_t owned_bytes; /* sum of the logs' capacities */
} Core;

/* Zeroed arrays. Big ones (buckets, rows) are mmap-ed with transparent huge pages asked for: page
 * faults of a growing table were most of the ingest time, and 2 MB pages fault 512x less often.
 * Small ones stay on PyMem, so an empty index maps nothing. */
#define BIG ((size_t)1 << 21)
#define ROUND_BIG(n) (((n) + BIG - 1) & ~(BIG - 1))

static size_t footprint(size_t bytes) {
#ifdef __linux__
    if (bytes >= BIG) return ROUND_BIG(bytes);
#endif
    return bytes;
}

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

static inline int log2_of(Py_ssize_t cap) { return __builtin_ctzll((unsigned long long)cap); }

/* Block hashes come from workers, who could pick them (DESIGN.md: the router cannot check them).
 * Unkeyed, the home bucket is a public function: one worker could send hashes that all share one
 * probe run, and every insert, lookup and deletion then walks it, quadratic work on every router's
 * event loop. So the key is mixed with two secret words drawn from os.urandom per core, one before
 * and one inside murmur3's fmix64 (multiply-xorshift, full avalanche): without them, which hashes
 * share a bucket cannot be worked out. SipHash-1-3 was measured first: store 25-40% slower (a
 * key is hashed once to probe and about twice more as the table grows), too close to the 5x-Dynamo
 * ingest target (docs/router_index.md, "Keyed buckets and the worker cap"). Only placement depends
 * on the key. */
static inline uint64_t bucket_hash(const Core *c, uint64_t key) {
    uint64_t x = key ^ c->seed[0];
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= c->seed[1];
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

static inline Py_ssize_t home(const Core *c, uint64_t key) { return (Py_ssize_t)(bucket_hash(c, key) >> c->shift); }

/* --- holders of one bucket ------------------------------------------------------------------ */

static inline int is_wide(const Bucket *b) { return b->h.slot[0] == WIDE; }

static inline int inline_count(const Bucket *b) {
    int k = 0;
    while (k < INLINE && b->h.slot[k]) k++;
    return k;
}

static inline int row_has(const uint64_t *row, Py_ssize_t slot) { return (int)((row[slot >> 6] >> (slot & 63)) & 1); }

static inline uint64_t *row_of(const Core *c, const Bucket *b) { return c->rows + (Py_ssize_t)b->h.wide.row * c->words; }

static inline int holds(const Core *c, const Bucket *b, Py_ssize_t slot) {
    if (is_wide(b)) return slot < c->words * 64 && row_has(row_of(c, b), slot);
    uint16_t me = (uint16_t)(slot + 1);
    for (int k = 0; k < INLINE; k++)
        if (b->h.slot[k] == me) return 1;
    return 0;
}

/* --- the bucket table ------------------------------------------------------------------------- */

/* The bucket holding `key`, or -1. */
static Py_ssize_t find(const Core *c, uint64_t key) {
    Py_ssize_t mask = c->cap - 1;
    for (Py_ssize_t i = home(c, key);; i = (i + 1) & mask) {
        if (!c->buckets[i].h.slot[0]) return -1;
        if (c->buckets[i].key == key) return i;
    }
}

/* The bucket holding `key`, or the empty one where it would go, probing from bucket i. */
static Py_ssize_t probe_from(const Core *c, uint64_t key, Py_ssize_t i) {
    Py_ssize_t mask = c->cap - 1;
    while (c->buckets[i].h.slot[0] && c->buckets[i].key != key) i = (i + 1) & mask;
    return i;
}

static Py_ssize_t probe(const Core *c, uint64_t key) { return probe_from(c, key, home(c, key)); }

/* Rehash every key into `cap` buckets (rows stay where they are). */
static int resize(Core *c, Py_ssize_t cap) {
    Bucket *buckets = zalloc((size_t)cap * sizeof(Bucket));
    if (buckets == NULL) return PyErr_NoMemory(), -1;
    Bucket *old = c->buckets;
    Py_ssize_t old_cap = c->cap;
    c->buckets = buckets;
    c->cap = cap;
    c->shift = 64 - log2_of(cap);
    for (Py_ssize_t i = 0; i < old_cap; i++) {
        if (!old[i].h.slot[0]) continue;
        Py_ssize_t j = home(c, old[i].key);
        while (buckets[j].h.slot[0]) j = (j + 1) & (cap - 1);
        buckets[j] = old[i];
    }
    zfree(old, (size_t)old_cap * sizeof(Bucket));
    return 0;
}

/* Empty bucket i: shift its probe run back over it (backward-shift deletion). */
static void delete_bucket(Core *c, Py_ssize_t i) {
    Py_ssize_t mask = c->cap - 1;
    for (Py_ssize_t j = (i + 1) & mask; c->buckets[j].h.slot[0]; j = (j + 1) & mask) {
        Py_ssize_t h = home(c, c->buckets[j].key);
        /* The key at j may move to i unless its home lies cyclically in (i, j]. */
        int stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (stays) continue;
        c->buckets[i] = c->buckets[j];
        i = j;
    }
    memset(&c->buckets[i], 0, sizeof(Bucket));
    c->nkeys--;
}

/* Halve the table while it is under 1/8 full (best effort: a failed allocation keeps it as is). */
static void maybe_shrink(Core *c) {
    while (c->cap > MIN_CAP && c->nkeys * 8 < c->cap) {
        if (resize(c, c->cap / 2) < 0) {
            PyErr_Clear();
            return;
        }
    }
}

/* --- rows --------------------------------------------------------------------------------------- */

static size_t rows_bytes(Py_ssize_t row_cap, Py_ssize_t words) { return (size_t)(row_cap * words) * sizeof(uint64_t); }

/* Move the rows into a fresh array of row_cap x words (row_cap >= nrows, words >= c->words). */
static int reshape_rows(Core *c, Py_ssize_t row_cap, Py_ssize_t words) {
    uint64_t *next = zalloc(rows_bytes(row_cap, words));
    if (next == NULL) return PyErr_NoMemory(), -1;
    uint64_t *keys = PyMem_Realloc(c->row_key, (size_t)row_cap * sizeof(uint64_t));
    if (keys == NULL && row_cap > c->row_cap) {
        zfree(next, rows_bytes(row_cap, words));
        return PyErr_NoMemory(), -1;
    }
    if (keys != NULL) c->row_key = keys; /* a smaller block that could not be had: keep the big one */
    for (Py_ssize_t r = 0; r < c->nrows; r++)
        memcpy(next + r * words, c->rows + r * c->words, (size_t)c->words * sizeof(uint64_t));
    zfree(c->rows, rows_bytes(c->row_cap, c->words));
    c->rows = next;
    c->row_cap = row_cap;
    c->words = words;
    return 0;
}

/* Room for one more row. */
static int reserve_row(Core *c) {
    if (c->nrows < c->row_cap) return 0;
    if (c->row_cap * 2 > MAX_ROWS) return PyErr_SetString(PyExc_MemoryError, "prefix index full"), -1;
    return reshape_rows(c, c->row_cap * 2, c->words);
}

/* Promote the full inline bucket b to a fresh row (reserve_row first). */
static void promote(Core *c, Bucket *b) {
    Py_ssize_t r = c->nrows++;
    uint64_t *row = c->rows + r * c->words;
    for (int k = 0; k < INLINE; k++) {
        Py_ssize_t s = b->h.slot[k] - 1;
        row[s >> 6] |= 1ULL << (s & 63);
    }
    c->row_key[r] = b->key;
    b->h.wide.tag = WIDE;
    b->h.wide.n = INLINE;
    b->h.wide.row = (uint32_t)r;
}

/* Turn wide bucket b (DEMOTE holders) back inline, and fill its row with the last one. */
static void demote(Core *c, Bucket *b) {
    Py_ssize_t r = b->h.wide.row, words = c->words, k = 0;
    uint64_t *row = c->rows + r * words;
    uint16_t slots[INLINE] = {0};
    for (Py_ssize_t w = 0; w < words; w++)
        for (uint64_t bits = row[w]; bits; bits &= bits - 1) slots[k++] = (uint16_t)(w * 64 + __builtin_ctzll(bits) + 1);
    memcpy(b->h.slot, slots, sizeof(slots));
    Py_ssize_t last = --c->nrows;
    if (r != last) {
        memcpy(row, c->rows + last * words, (size_t)words * sizeof(uint64_t));
        c->row_key[r] = c->row_key[last];
        c->buckets[find(c, c->row_key[r])].h.wide.row = (uint32_t)r;
    }
    memset(c->rows + last * words, 0, (size_t)words * sizeof(uint64_t));
    if (c->row_cap > MIN_ROWS && c->nrows * 8 < c->row_cap && reshape_rows(c, c->row_cap / 2, words) < 0)
        PyErr_Clear(); /* best effort: keep the bigger array */
}

/* --- per-slot logs ---------------------------------------------------------------------------- */

static int log_resize(Core *c, Owned *o, Py_ssize_t cap) {
    uint64_t *keys = PyMem_Realloc(o->keys, (size_t)cap * sizeof(uint64_t));
    if (keys == NULL) return PyErr_NoMemory(), -1;
    c->owned_bytes += (cap - o->cap) * (Py_ssize_t)sizeof(uint64_t);
    o->keys = keys;
    o->cap = cap;
    return 0;
}

static void log_free(Core *c, Owned *o) {
    PyMem_Free(o->keys);
    c->owned_bytes -= o->cap * (Py_ssize_t)sizeof(uint64_t);
    memset(o, 0, sizeof(*o));
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Keep only the hashes slot `slot` holds, once each: afterwards keys[0..n) is exactly its set. */
static void log_compact(Core *c, Py_ssize_t slot) {
    Owned *o = &c->owned[slot];
    Py_ssize_t kept = 0;
    for (Py_ssize_t r = 0; r < o->n; r++) {
        if (r + AHEAD < o->n) __builtin_prefetch(c->buckets + home(c, o->keys[r + AHEAD]));
        Py_ssize_t i = find(c, o->keys[r]);
        if (i >= 0 && holds(c, &c->buckets[i], slot)) o->keys[kept++] = o->keys[r];
    }
    if (kept > o->count) { /* a hash dropped and gained again is in twice */
        qsort(o->keys, (size_t)kept, sizeof(uint64_t), cmp_u64);
        Py_ssize_t w = 1;
        for (Py_ssize_t r = 1; r < kept; r++)
            if (o->keys[r] != o->keys[w - 1]) o->keys[w++] = o->keys[r];
        kept = w;
    }
    o->n = kept;
}

/* Room in the slot's log for one more entry: compact it if at least half is stale, else grow. */
static int log_reserve(Core *c, Py_ssize_t slot) {
    Owned *o = &c->owned[slot];
    if (o->n < o->cap) return 0;
    if (o->n && o->count * 2 <= o->n) log_compact(c, slot);
    if (o->n < o->cap) return 0;
    return log_resize(c, o, o->cap ? o->cap * 2 : MIN_LOG);
}

/* After removals: free an empty log, compact and shrink one under a quarter live. */
static void log_trim(Core *c, Py_ssize_t slot) {
    Owned *o = &c->owned[slot];
    if (!o->count) {
        log_free(c, o);
        return;
    }
    if (o->count * 4 >= o->n) return;
    log_compact(c, slot);
    Py_ssize_t cap = MIN_LOG;
    while (cap < o->n * 2) cap *= 2;
    if (cap < o->cap && log_resize(c, o, cap) < 0) PyErr_Clear(); /* best effort: keep the bigger one */
}

/* --- slots ------------------------------------------------------------------------------------- */

/* Make room for slot `slot`: per-slot sets up to it, and rows at least slot + 1 bits wide. */
static int ensure_slot(Core *c, Py_ssize_t slot) {
    if (slot >= c->nslots) {
        Py_ssize_t n = c->nslots ? c->nslots : 64;
        while (n <= slot) n *= 2;
        Owned *owned = PyMem_Realloc(c->owned, (size_t)n * sizeof(Owned));
        if (owned == NULL) return PyErr_NoMemory(), -1;
        memset(owned + c->nslots, 0, (size_t)(n - c->nslots) * sizeof(Owned));
        c->owned = owned;
        c->nslots = n;
    }
    Py_ssize_t words = c->words;
    while (slot >= words * 64) words *= 2;
    if (words == c->words) return 0;
    uint64_t *run = PyMem_Realloc(c->run, (size_t)words * sizeof(uint64_t));
    if (run == NULL) return PyErr_NoMemory(), -1;
    c->run = run;
    uint64_t *cut = PyMem_Realloc(c->cut, (size_t)words * sizeof(uint64_t));
    if (cut == NULL) return PyErr_NoMemory(), -1;
    c->cut = cut;
    return reshape_rows(c, c->row_cap, words);
}

/* --- Python-facing argument parsing ----------------------------------------------------------- */

static int hash_error(PyObject *item) {
    PyErr_Clear();
    PyObject *repr = PyObject_Repr(item);
    if (repr != NULL) {
        PyErr_Format(PyExc_ValueError, "block hashes must be integers in [0, 2**64): got %U", repr);
        Py_DECREF(repr);
    }
    return -1;
}

/* *out = item if it is an int in [0, 2**64), else -1 (no exception set).
 *
 * PyLong_AsUnsignedLongLong goes through _PyLong_AsByteArray, a third of store's time. Up to 3.11
 * an int is its sign-and-size and 30-bit digits, read here directly; later versions take the mask
 * variant (which reads the digits but wraps), with the range checked first. */
static inline int to_u64(PyObject *item, uint64_t *out) {
    if (!PyLong_Check(item)) return -1;
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    const digit *d = ((PyLongObject *)item)->ob_digit;
    switch (Py_SIZE(item)) {
    case 0:
        *out = 0;
        return 0;
    case 1:
        *out = d[0];
        return 0;
    case 2:
        *out = (uint64_t)d[0] | (uint64_t)d[1] << 30;
        return 0;
    case 3:
        if (d[2] >> 4) return -1; /* 2**64 or more */
        *out = (uint64_t)d[0] | (uint64_t)d[1] << 30 | (uint64_t)d[2] << 60;
        return 0;
    default:
        return -1; /* negative, or 2**90 and more */
    }
#else
    if (_PyLong_Sign(item) < 0 || _PyLong_NumBits(item) > 64) return -1;
    *out = (uint64_t)PyLong_AsUnsignedLongLongMask(item);
    return 0;
#endif
}

static inline int as_hash(PyObject *item, uint64_t *out) { return to_u64(item, out) < 0 ? hash_error(item) : 0; }

/* Packed hashes (protocol.packed: little-endian u64s in a bytes) copied out, no int created. */
static uint64_t *read_packed(PyObject *hashes, Py_ssize_t *n) {
    Py_ssize_t len = PyBytes_GET_SIZE(hashes);
    if (len % 8) {
        PyErr_Format(PyExc_ValueError, "packed block hashes must be a multiple of 8 bytes, got %zd", len);
        return NULL;
    }
    *n = len / 8;
    uint64_t *out = PyMem_Malloc((size_t)(*n > 0 ? *n : 1) * sizeof(uint64_t));
    if (out == NULL) return (uint64_t *)PyErr_NoMemory();
    memcpy(out, PyBytes_AS_STRING(hashes), (size_t)len);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (Py_ssize_t i = 0; i < *n; i++) out[i] = __builtin_bswap64(out[i]);
#endif
    return out;
}

/* Every item of `hashes` as a u64 in a fresh buffer (*n long), or NULL with ValueError set.
 * Converting all before touching the table keeps a call that fails from changing anything. */
static uint64_t *read_hashes(PyObject *hashes, Py_ssize_t *n) {
    if (PyBytes_Check(hashes)) return read_packed(hashes, n);
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

/* --- mutation ----------------------------------------------------------------------------------- */

/* Slot `slot` now holds `key` (it did not). Returns -1 with MemoryError set, changing nothing. */
static int add_pair(Core *c, Py_ssize_t slot, uint64_t key, Py_ssize_t i) {
    Owned *o = &c->owned[slot];
    Bucket *b = &c->buckets[i];
    int full = !is_wide(b) && b->h.slot[INLINE - 1];
    if (!b->h.slot[0] && (c->nkeys + 1) * 4 > c->cap * 3) { /* keep the load under 3/4 */
        if (resize(c, c->cap * 2) < 0) return -1;
        b = &c->buckets[probe(c, key)];
    }
    if ((full && reserve_row(c) < 0) || log_reserve(c, slot) < 0) return -1;
    if (!b->h.slot[0]) {
        b->key = key;
        b->h.slot[0] = (uint16_t)(slot + 1);
        c->nkeys++;
    } else if (is_wide(b)) {
        row_of(c, b)[slot >> 6] |= 1ULL << (slot & 63);
        b->h.wide.n++;
    } else if (full) {
        promote(c, b);
        row_of(c, b)[slot >> 6] |= 1ULL << (slot & 63);
        b->h.wide.n++;
    } else {
        b->h.slot[inline_count(b)] = (uint16_t)(slot + 1);
    }
    o->keys[o->n++] = key;
    o->count++;
    o->xor ^= key;
    c->entries++;
    return 0;
}

/* Slot `slot` no longer holds the key in bucket i (it did); the bucket goes when nobody holds it.
 * The slot's log keeps the key until it is next compacted. */
static void drop_pair(Core *c, Py_ssize_t slot, Py_ssize_t i) {
    Bucket *b = &c->buckets[i];
    Owned *o = &c->owned[slot];
    o->count--;
    o->xor ^= b->key;
    if (is_wide(b)) {
        row_of(c, b)[slot >> 6] &= ~(1ULL << (slot & 63));
        if (--b->h.wide.n == DEMOTE) demote(c, b);
    } else {
        uint16_t me = (uint16_t)(slot + 1);
        int n = inline_count(b), k = 0;
        while (b->h.slot[k] != me) k++;
        b->h.slot[k] = b->h.slot[n - 1]; /* the last holder fills the hole */
        b->h.slot[n - 1] = 0;
        if (n == 1) delete_bucket(c, i);
    }
    c->entries--;
}

/* store(slot, hashes) -> int: how many of `hashes` the slot did not hold before. */
static PyObject *core_store(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot, n, added = 0;
    if (nargs != 2) return PyErr_SetString(PyExc_TypeError, "store(slot, hashes)"), NULL;
    if (parse_slot(args[0], &slot) < 0) return NULL;
    uint64_t *hs = read_hashes(args[1], &n);
    if (hs == NULL) return NULL;
    if (ensure_slot(c, slot) < 0) goto fail;
    Owned *o = &c->owned[slot];
    uint64_t ahead[AHEAD]; /* bucket hashes of the keys prefetched, by k % AHEAD: hashed once */
    for (Py_ssize_t k = 0; k < n && k < AHEAD; k++) {
        ahead[k] = bucket_hash(c, hs[k]);
        __builtin_prefetch(c->buckets + (ahead[k] >> c->shift));
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t key = hs[k], h = ahead[k % AHEAD];
        if (k + AHEAD < n) {
            ahead[k % AHEAD] = bucket_hash(c, hs[k + AHEAD]);
            __builtin_prefetch(c->buckets + (ahead[k % AHEAD] >> c->shift));
        }
        Py_ssize_t i = probe_from(c, key, (Py_ssize_t)(h >> c->shift));
        Bucket *b = &c->buckets[i];
        if (!b->h.slot[0] && (c->nkeys + 1) * 4 <= c->cap * 3 && o->n < o->cap) {
            /* The usual case, a hash nobody holds, with room for it: add_pair's first branch. */
            b->key = key;
            b->h.slot[0] = (uint16_t)(slot + 1);
            c->nkeys++;
            o->keys[o->n++] = key;
            o->count++;
            o->xor ^= key;
            c->entries++;
            added++;
            continue;
        }
        if (b->h.slot[0] && holds(c, b, slot)) continue;
        if (add_pair(c, slot, key, i) < 0) goto fail;
        added++;
    }
    PyMem_Free(hs);
    return PyLong_FromSsize_t(added);
fail:
    PyMem_Free(hs);
    return NULL;
}

/* remove(slot, hashes) -> int: how many of `hashes` the slot held (and no longer does). */
static PyObject *core_remove(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot, n, removed = 0;
    if (nargs != 2) return PyErr_SetString(PyExc_TypeError, "remove(slot, hashes)"), NULL;
    if (parse_slot(args[0], &slot) < 0) return NULL;
    uint64_t *hs = read_hashes(args[1], &n);
    if (hs == NULL) return NULL;
    if (slot < c->nslots && c->owned[slot].count) {
        for (Py_ssize_t k = 0; k < n && k < AHEAD; k++) __builtin_prefetch(c->buckets + home(c, hs[k]));
        for (Py_ssize_t k = 0; k < n; k++) {
            if (k + AHEAD < n) __builtin_prefetch(c->buckets + home(c, hs[k + AHEAD]));
            Py_ssize_t i = find(c, hs[k]);
            if (i < 0 || !holds(c, &c->buckets[i], slot)) continue;
            drop_pair(c, slot, i);
            removed++;
        }
        log_trim(c, slot);
        maybe_shrink(c);
    }
    PyMem_Free(hs);
    return PyLong_FromSsize_t(removed);
}

/* clear(slot) -> int: drop every hash of the slot; how many it held. */
static PyObject *core_clear(Core *c, PyObject *arg) {
    Py_ssize_t slot;
    if (parse_slot(arg, &slot) < 0) return NULL;
    if (slot >= c->nslots) return PyLong_FromLong(0);
    Owned *o = &c->owned[slot];
    Py_ssize_t held = o->count;
    for (Py_ssize_t k = 0; k < o->n; k++) {
        if (k + AHEAD < o->n) __builtin_prefetch(c->buckets + home(c, o->keys[k + AHEAD]));
        Py_ssize_t i = find(c, o->keys[k]);
        if (i >= 0 && holds(c, &c->buckets[i], slot)) drop_pair(c, slot, i); /* stale or repeated: skip */
    }
    log_free(c, o);
    maybe_shrink(c);
    return PyLong_FromSsize_t(held);
}

/* --- reading ----------------------------------------------------------------------------------- */

/* count(slot) -> int: hashes the slot holds. */
static PyObject *core_count(Core *c, PyObject *arg) {
    Py_ssize_t slot;
    if (parse_slot(arg, &slot) < 0) return NULL;
    return PyLong_FromSsize_t(slot < c->nslots ? c->owned[slot].count : 0);
}

/* digest(slot) -> (count, xor): hashes the slot holds and their XOR. */
static PyObject *core_digest(Core *c, PyObject *arg) {
    Py_ssize_t slot;
    if (parse_slot(arg, &slot) < 0) return NULL;
    if (slot >= c->nslots) return Py_BuildValue("(ii)", 0, 0);
    return Py_BuildValue("(nK)", c->owned[slot].count, (unsigned long long)c->owned[slot].xor);
}

/* The slot's hashes as a new list (log order), compacting its log first. */
static PyObject *slot_list(Core *c, Py_ssize_t slot) {
    if (slot >= c->nslots) return PyList_New(0);
    Owned *o = &c->owned[slot];
    if (o->n != o->count) log_compact(c, slot);
    PyObject *out = PyList_New(o->n);
    if (out == NULL) return NULL;
    for (Py_ssize_t k = 0; k < o->n; k++) {
        PyObject *h = PyLong_FromUnsignedLongLong(o->keys[k]);
        if (h == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, h);
    }
    return out;
}

/* hashes(slot) -> list[int]: the hashes the slot holds. */
static PyObject *core_hashes(Core *c, PyObject *arg) {
    Py_ssize_t slot;
    if (parse_slot(arg, &slot) < 0) return NULL;
    return slot_list(c, slot);
}

/* dump(nslots) -> list[list[int]]: per slot below nslots, the hashes it holds. */
static PyObject *core_dump(Core *c, PyObject *arg) {
    Py_ssize_t nslots = PyLong_AsSsize_t(arg);
    if (nslots == -1 && PyErr_Occurred()) return NULL;
    if (nslots < 0 || nslots > MAX_SLOT + 1)
        return PyErr_Format(PyExc_ValueError, "nslots must be in [0, %d], got %zd", MAX_SLOT + 1, nslots);
    PyObject *out = PyList_New(nslots);
    if (out == NULL) return NULL;
    for (Py_ssize_t s = 0; s < nslots; s++) {
        PyObject *l = slot_list(c, s);
        if (l == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, s, l);
    }
    return out;
}

/* memory() -> int: bytes the core has allocated (big arrays as mapped, in 2 MB pages). */
static PyObject *core_memory(Core *c, PyObject *Py_UNUSED(ignored)) {
    size_t bytes = footprint((size_t)c->cap * sizeof(Bucket)) + footprint(rows_bytes(c->row_cap, c->words)) +
                   (size_t)c->row_cap * sizeof(uint64_t) + (size_t)c->nslots * sizeof(Owned) +
                   2 * (size_t)c->words * sizeof(uint64_t) + (size_t)c->owned_bytes + sizeof(Core);
    return PyLong_FromSize_t(bytes);
}

static PyObject *bits_to_int(const uint64_t *bits, Py_ssize_t words) {
    return _PyLong_FromByteArray((const unsigned char *)bits, (size_t)words * 8, 1, 0);
}

/* The int with bits slots[0..n) set, built in scratch (words long). */
static PyObject *slots_to_int(uint64_t *scratch, const Py_ssize_t *slots, int n) {
    Py_ssize_t top = 0;
    for (int k = 0; k < n; k++)
        if (slots[k] >> 6 > top) top = slots[k] >> 6;
    memset(scratch, 0, (size_t)(top + 1) * sizeof(uint64_t));
    for (int k = 0; k < n; k++) scratch[slots[k] >> 6] |= 1ULL << (slots[k] & 63);
    return bits_to_int(scratch, top + 1);
}

/* Append (bits, depth) to cuts, stealing the reference to bits. */
static int add_cut(PyObject *cuts, PyObject *bits, Py_ssize_t depth) {
    if (bits == NULL) return -1;
    PyObject *pair = Py_BuildValue("(Nn)", bits, depth);
    if (pair == NULL) return -1;
    int err = PyList_Append(cuts, pair);
    Py_DECREF(pair);
    return err;
}

/* The walk's running set of slots still holding every block so far: a few slot ids (`few`, n of
 * them) while n >= 0, else the bitset `run` (words long). It starts as a bitset only when the first
 * block is promoted, and a bitset turns into a few ids at the first inline block. */
typedef struct {
    Py_ssize_t few[INLINE];
    int n;
} Walk;

/* Intersect the walk with bucket b's holders; the cut (who dropped out) goes to cuts at `depth`.
 * Returns 1 if someone is left, 0 if not, -1 on error. */
static int step(Core *c, Walk *walk, const Bucket *b, PyObject *cuts, Py_ssize_t depth) {
    Py_ssize_t words = c->words;
    if (walk->n >= 0) {
        Py_ssize_t lost[INLINE];
        int kept = 0, nlost = 0;
        for (int k = 0; k < walk->n; k++) {
            if (holds(c, b, walk->few[k])) walk->few[kept++] = walk->few[k];
            else lost[nlost++] = walk->few[k];
        }
        walk->n = kept;
        if (nlost && add_cut(cuts, slots_to_int(c->cut, lost, nlost), depth) < 0) return -1;
        return kept > 0;
    }
    uint64_t *run = c->run, *cut = c->cut;
    if (is_wide(b)) {
        const uint64_t *row = row_of(c, b);
        uint64_t lost = 0, left = 0;
        for (Py_ssize_t w = 0; w < words; w++) {
            cut[w] = run[w] & ~row[w];
            lost |= cut[w];
            run[w] &= row[w];
            left |= run[w];
        }
        if (lost && add_cut(cuts, bits_to_int(cut, words), depth) < 0) return -1;
        return left != 0;
    }
    /* Inline holders: the ones still running become the few; the rest of the bitset is the cut. */
    int kept = 0;
    for (int k = 0; k < INLINE && b->h.slot[k]; k++) {
        Py_ssize_t s = b->h.slot[k] - 1;
        if (row_has(run, s)) {
            walk->few[kept++] = s;
            run[s >> 6] &= ~(1ULL << (s & 63));
        }
    }
    uint64_t lost = 0;
    for (Py_ssize_t w = 0; w < words; w++) lost |= run[w];
    walk->n = kept;
    if (lost && add_cut(cuts, bits_to_int(run, words), depth) < 0) return -1;
    return kept > 0;
}

/* match(hashes) -> (matched, cuts) | None.
 *
 * Walks the leading hashes that somebody holds, intersecting their holders. `cuts` lists
 * (bits, depth) where bits are the slots whose prefix ends at depth (the last entry: those holding
 * the whole walk); `matched` is their union, the slots holding the first block. None when nobody
 * holds the first block. A hash that is not a u64 is held by nobody, so the walk ends there. After
 * the first hash, lookups go a chunk at a time, prefetching the chunk's buckets and then its rows,
 * so their cache misses overlap instead of following one another. */
static PyObject *core_match(Core *c, PyObject *hashes) {
    PyObject *seq = PySequence_Fast(hashes, "block hashes must be an iterable of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), depth = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *cuts = NULL, *matched = NULL;
    Walk walk = {.n = 0};
    int done = 0;
    while (!done && depth < n) {
        uint64_t key[CHUNK];
        const Bucket *found[CHUNK];
        /* The first hash alone: most prompts nobody holds end there, after one lookup. */
        Py_ssize_t m = depth == 0 ? 1 : (n - depth < CHUNK ? n - depth : CHUNK), got = 0;
        for (Py_ssize_t k = 0; k < m; k++) {
            if (to_u64(items[depth + k], &key[k]) < 0) {
                m = k;
                done = 1;
                break;
            }
            __builtin_prefetch(c->buckets + home(c, key[k]));
        }
        for (; got < m; got++) {
            Py_ssize_t i = find(c, key[got]);
            if (i < 0) break;
            found[got] = &c->buckets[i];
            if (is_wide(found[got])) __builtin_prefetch(row_of(c, found[got]));
        }
        if (got < m) done = 1;
        for (Py_ssize_t k = 0; k < got; k++, depth++) {
            const Bucket *b = found[k];
            if (depth == 0) {
                if ((cuts = PyList_New(0)) == NULL) goto fail;
                if (is_wide(b)) {
                    walk.n = -1;
                    memcpy(c->run, row_of(c, b), (size_t)c->words * sizeof(uint64_t));
                    matched = bits_to_int(c->run, c->words);
                } else {
                    walk.n = inline_count(b);
                    for (int j = 0; j < walk.n; j++) walk.few[j] = b->h.slot[j] - 1;
                    matched = slots_to_int(c->cut, walk.few, walk.n);
                }
                if (matched == NULL) goto fail;
                continue;
            }
            int left = step(c, &walk, b, cuts, depth);
            if (left < 0) goto fail;
            if (!left) {
                Py_DECREF(seq);
                return Py_BuildValue("(NN)", matched, cuts);
            }
        }
    }
    Py_DECREF(seq);
    if (depth == 0) Py_RETURN_NONE;
    PyObject *last = walk.n >= 0 ? slots_to_int(c->cut, walk.few, walk.n) : bits_to_int(c->run, c->words);
    if (add_cut(cuts, last, depth) < 0) {
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

/* longest_run() -> int: the most buckets taken in a row. A lookup, insertion or deletion walks at
 * most one such run, so this bounds what each costs (for tests; a scan of the whole table). */
static PyObject *core_longest_run(Core *c, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t mask = c->cap - 1, start = 0, run = 0, longest = 0;
    while (c->buckets[start].h.slot[0]) start++; /* the load stays under 3/4: an empty bucket exists */
    for (Py_ssize_t k = 1; k <= c->cap; k++) {
        run = c->buckets[(start + k) & mask].h.slot[0] ? run + 1 : 0;
        if (run > longest) longest = run;
    }
    return PyLong_FromSsize_t(longest);
}

static Py_ssize_t core_len(Core *c) { return c->nkeys; }

static PyObject *core_entries(Core *c, void *Py_UNUSED(closure)) { return PyLong_FromSsize_t(c->entries); }

/* The bucket hash's key: 16 bytes of os.urandom (the OS's CSPRNG). */
static int draw_seed(Core *c) {
    PyObject *os = PyImport_ImportModule("os");
    if (os == NULL) return -1;
    PyObject *seed = PyObject_CallMethod(os, "urandom", "i", (int)sizeof(c->seed));
    Py_DECREF(os);
    if (seed == NULL) return -1;
    if (!PyBytes_Check(seed) || PyBytes_GET_SIZE(seed) != sizeof(c->seed)) {
        Py_DECREF(seed);
        return PyErr_SetString(PyExc_RuntimeError, "os.urandom gave the wrong number of bytes"), -1;
    }
    memcpy(c->seed, PyBytes_AS_STRING(seed), sizeof(c->seed));
    Py_DECREF(seed);
    return 0;
}

static PyObject *core_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds)))
        return PyErr_SetString(PyExc_TypeError, "Core() takes no arguments"), NULL;
    Core *c = (Core *)type->tp_alloc(type, 0);
    if (c == NULL) return NULL;
    if (draw_seed(c) < 0) {
        Py_DECREF(c);
        return NULL;
    }
    c->cap = MIN_CAP;
    c->shift = 64 - log2_of(MIN_CAP);
    c->words = 1;
    c->row_cap = MIN_ROWS;
    c->buckets = zalloc(MIN_CAP * sizeof(Bucket));
    c->rows = zalloc(rows_bytes(MIN_ROWS, 1));
    c->row_key = PyMem_Calloc(MIN_ROWS, sizeof(uint64_t));
    c->run = PyMem_Calloc(1, sizeof(uint64_t));
    c->cut = PyMem_Calloc(1, sizeof(uint64_t));
    if (!c->buckets || !c->rows || !c->row_key || !c->run || !c->cut) {
        Py_DECREF(c);
        return PyErr_NoMemory();
    }
    return (PyObject *)c;
}

static void core_dealloc(Core *c) {
    zfree(c->buckets, (size_t)c->cap * sizeof(Bucket));
    zfree(c->rows, rows_bytes(c->row_cap, c->words));
    PyMem_Free(c->row_key);
    PyMem_Free(c->run);
    PyMem_Free(c->cut);
    for (Py_ssize_t s = 0; s < c->nslots; s++) PyMem_Free(c->owned[s].keys);
    PyMem_Free(c->owned);
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
    {"digest", (PyCFunction)core_digest, METH_O, "digest(slot) -> (hashes held, XOR of them)"},
    {"dump", (PyCFunction)core_dump, METH_O, "dump(nslots) -> per slot, its hashes"},
    {"hashes", (PyCFunction)core_hashes, METH_O, "hashes(slot) -> its hashes"},
    {"match", (PyCFunction)core_match, METH_O, "match(hashes) -> (matched, [(bits, depth)]) | None"},
    {"memory", (PyCFunction)core_memory, METH_NOARGS, "memory() -> bytes allocated"},
    {"longest_run", (PyCFunction)core_longest_run, METH_NOARGS, "longest_run() -> most buckets taken in a row"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef core_getset[] = {
    {"entries", (getter)core_entries, NULL, "(slot, hash) pairs held", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods core_as_sequence = {.sq_length = (lenfunc)core_len};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router._blockindex.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "block hash -> the worker slots holding it",
    .tp_new = core_new,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_methods = core_methods,
    .tp_getset = core_getset,
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
