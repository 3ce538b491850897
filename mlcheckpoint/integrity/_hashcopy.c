/* Checksum-and-copy in one pass, without the GIL: the copier's inner loop in C.
 *
 * The pure-Python copier (copier.py) makes two ctypes calls per 2 MiB chunk and needs the GIL
 * between them; this does a whole run of chunks per call. For each chunk it feeds
 * SUB_BYTES blocks to xxh3's streaming hash and copies each block right after it was hashed,
 * while it is still in the core's L2 cache. Large copies use non-temporal (streaming) stores:
 * the destination is a shard buffer (or a model tensor) that nobody reads soon, so its lines
 * are written without first being read into cache, which saves a third of the memory traffic.
 *
 * The xxh3 functions are not linked in: the caller passes the addresses of the ones the
 * `xxhash` package's extension exports (see checksum.py), so the digests are exactly that
 * library's, and the format is defined in one place.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_STREAM_STORES 1
#endif

#define SUB_BYTES (512u << 10)   /* hashed then copied while in L2 */
#define STREAM_MIN (256u << 10)  /* smaller copies go through memcpy (the reader may want them) */

typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef uint64_t (*digest_fn)(const void *);

static create_fn xxh_create;
static free_fn xxh_free;
static reset_fn xxh_reset;
static update_fn xxh_update;
static digest_fn xxh_digest;

static void copy_block(uint8_t *dst, const uint8_t *src, size_t n) {
#ifdef HAVE_STREAM_STORES
    if (n >= STREAM_MIN) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;  /* stream stores need 16-byte alignment */
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        for (; n >= 64; n -= 64, src += 64, dst += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
    }
#endif
    memcpy(dst, src, n);
}

/* bind(create, free, reset, update, digest): addresses of XXH3_createState, XXH3_freeState,
 * XXH3_64bits_reset, XXH3_64bits_update, XXH3_64bits_digest. */
static PyObject *bind(PyObject *self, PyObject *args) {
    unsigned long long c, f, r, u, d;
    if (!PyArg_ParseTuple(args, "KKKKK:bind", &c, &f, &r, &u, &d))
        return NULL;
    if (!c || !f || !r || !u || !d) {
        PyErr_SetString(PyExc_ValueError, "bind: null function address");
        return NULL;
    }
    xxh_create = (create_fn)(uintptr_t)c;
    xxh_free = (free_fn)(uintptr_t)f;
    xxh_reset = (reset_fn)(uintptr_t)r;
    xxh_update = (update_fn)(uintptr_t)u;
    xxh_digest = (digest_fn)(uintptr_t)d;
    Py_RETURN_NONE;
}

/* hash_copy(src, dst, nbytes, chunk, digests): for each `chunk`-byte piece of the nbytes at
 * address src (the last one shorter), store its xxh3_64 at digests[i] (uint64) and, unless dst
 * is 0, copy it to dst. One piece at least, even for nbytes == 0 (the empty item's digest). */
static PyObject *hash_copy(PyObject *self, PyObject *args) {
    unsigned long long src_a, dst_a, out_a;
    Py_ssize_t nbytes, chunk;
    if (!PyArg_ParseTuple(args, "KKnnK:hash_copy", &src_a, &dst_a, &nbytes, &chunk, &out_a))
        return NULL;
    if (nbytes < 0 || chunk <= 0 || (!src_a && nbytes > 0) || !out_a) {
        PyErr_SetString(PyExc_ValueError, "hash_copy: bad sizes or addresses");
        return NULL;
    }
    if (!xxh_create) {
        PyErr_SetString(PyExc_RuntimeError, "hash_copy: bind() was not called");
        return NULL;
    }
    const uint8_t *src = (const uint8_t *)(uintptr_t)src_a;
    uint8_t *dst = (uint8_t *)(uintptr_t)dst_a;
    uint64_t *out = (uint64_t *)(uintptr_t)out_a;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    void *state = xxh_create();
    if (!state) {
        failed = 1;
    } else {
        size_t n = (size_t)nbytes, step = (size_t)chunk, i = 0, off = 0;
        do {
            size_t k = n - off < step ? n - off : step;
            xxh_reset(state);
            for (size_t s = 0; s < k; s += SUB_BYTES) {
                size_t m = k - s < SUB_BYTES ? k - s : SUB_BYTES;
                xxh_update(state, src + off + s, m);
                if (dst)
                    copy_block(dst + off + s, src + off + s, m);
            }
            out[i++] = xxh_digest(state);
            off += k;
        } while (off < n);
        xxh_free(state);
#ifdef HAVE_STREAM_STORES
        _mm_sfence();  /* stream stores are weakly ordered: make them visible before returning */
#endif
    }
    Py_END_ALLOW_THREADS
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "Bind the xxh3 streaming functions by address."},
    {"hash_copy", hash_copy, METH_VARARGS,
     "hash_copy(src, dst, nbytes, chunk, digests): checksum (and copy) chunk by chunk."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mlcheckpoint.integrity._hashcopy",
    "Checksum-and-copy of shard bytes in one pass, without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__hashcopy(void) { return PyModule_Create(&module); }
