/* The canonical block hash chain (protocol/hashing.py) in C: the same function, an order of
 * magnitude faster, because packing a Python list of token ids into bytes and calling xxh3 once per
 * block dominate the pure-Python version. Built only where xxhash.h is present (Debian:
 * libxxhash-dev); protocol.hashing falls back to Python otherwise and the tests check both agree,
 * errors included (protocol/hashing.py's docstring has the argument rules).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

static inline void put_u64le(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline void put_u32le(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

/* ValueError "<what>: got <repr(item)>", replacing the error set. */
static void value_error(const char *what, PyObject *item) {
    PyErr_Clear();
    PyObject *repr = PyObject_Repr(item);
    if (repr != NULL) {
        PyErr_Format(PyExc_ValueError, "%s: got %U", what, repr);
        Py_DECREF(repr);
    }
}

/* The branch the hot loop takes for every token: without the hint the check costs ~5% of a hash. */
#if defined(__GNUC__) || defined(__clang__)
#define LIKELY(x) __builtin_expect(!!(x), 1)
#else
#define LIKELY(x) (x)
#endif

#define TOKEN_RANGE "token ids must be integers in [0, 2**32)"
#define PARENT_RANGE "parent must be an integer in [0, 2**64)"

/* An int, or an object with __index__ (a numpy integer), as Python's struct.pack takes them;
 * (unsigned long long)-1 with an error set when it is neither or out of range. */
static unsigned long long as_u64(PyObject *item) {
    if (PyLong_Check(item)) return PyLong_AsUnsignedLongLong(item);
    PyObject *index = PyNumber_Index(item);
    if (index == NULL) return (unsigned long long)-1;
    unsigned long long v = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    return v;
}

/* A token that is no int in [0, 2**32): an int subclass or an object with __index__ (a numpy
 * integer) in range, else a ValueError. */
static int other_token(PyObject *item, uint32_t *out) {
    unsigned long long v = as_u64(item);
    if ((v == (unsigned long long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFULL) {
        value_error(TOKEN_RANGE, item);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* block_hashes(tokens, block_size, parent, seed) -> list[int]: hashes of every full block. */
static PyObject *fast_block_hashes(PyObject *self, PyObject *args) {
    PyObject *tokens, *size_arg, *parent_arg;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OOOK", &tokens, &size_arg, &parent_arg, &seed)) return NULL;
    /* Past PY_SSIZE_T_MAX it clips: no sequence holds a block that long (Python returns []). */
    Py_ssize_t block_size = PyNumber_AsSsize_t(size_arg, NULL);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    if (block_size <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be positive, got %R", size_arg);
        return NULL;
    }
    /* Checked, not wrapped mod 2**64 as the "K" format would. */
    unsigned long long parent = as_u64(parent_arg);
    if (parent == (unsigned long long)-1 && PyErr_Occurred()) {
        value_error(PARENT_RANGE, parent_arg);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(tokens, "tokens must be a sequence of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n_blocks = PySequence_Fast_GET_SIZE(seq) / block_size;
    if (n_blocks == 0) { /* before the block buffer: a huge block_size allocates nothing */
        Py_DECREF(seq);
        return PyList_New(0);
    }
    PyObject *out = PyList_New(n_blocks);
    size_t stride = 8 + 4 * (size_t)block_size;
    unsigned char *buf = PyMem_Malloc(stride);
    if (out == NULL || buf == NULL) {
        Py_XDECREF(out);
        Py_DECREF(seq);
        PyMem_Free(buf);
        return PyErr_NoMemory();
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t prev = (uint64_t)parent;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        put_u64le(buf, prev);
        for (Py_ssize_t i = 0; i < block_size; i++) {
            PyObject *item = items[b * block_size + i];
            uint32_t token;
            unsigned long v;
            if (LIKELY(PyLong_CheckExact(item) && (v = PyLong_AsUnsignedLong(item)) <= 0xFFFFFFFFUL &&
                       !(v == (unsigned long)-1 && PyErr_Occurred()))) {
                token = (uint32_t)v;
            } else {
                PyErr_Clear(); /* the int fast path's overflow, if it was one */
                if (PyList_Check(seq)) {
                    /* Its __index__ (or __repr__, for the error) may run Python code, which may
                     * change the list: the rest is read from a copy of the list as it stands,
                     * as Python's struct.pack reads its arguments. */
                    PyObject *copy = PyList_AsTuple(seq);
                    if (copy == NULL) goto fail;
                    Py_SETREF(seq, copy);
                    items = PySequence_Fast_ITEMS(seq);
                }
                if (other_token(item, &token) < 0) goto fail;
            }
            put_u32le(buf + 8 + 4 * i, token);
        }
        prev = XXH3_64bits_withSeed(buf, stride, (XXH64_hash_t)seed);
        PyObject *h = PyLong_FromUnsignedLongLong(prev);
        if (h == NULL) goto fail;
        PyList_SET_ITEM(out, b, h);
    }
    PyMem_Free(buf);
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(out);
    Py_DECREF(seq);
    PyMem_Free(buf);
    return NULL;
}

static PyMethodDef methods[] = {
    {"block_hashes", fast_block_hashes, METH_VARARGS,
     "block_hashes(tokens, block_size, parent, seed) -> list[int]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fasthash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fasthash(void) { return PyModule_Create(&module); }
