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

/* ---------------------------------------------------------------- wsum64 (integrity/wsum.py)
 *
 * The host engine of the digest the device computes with tensor ops. A chunk's sum is
 *     s = sum over its rows r of U[r] * (sum over the row's words j of v[j] * W[j])  (mod 2^64)
 * where v are the bytes as signed 32-bit little-endian words (the last one zero-padded), W the
 * column weights (odd int32) and U the row weights (odd uint64); wsum.py defines them and
 * hands them over once (wsum_bind). Each product of two int32 is exact in 64 bits; the sums
 * wrap, as the device's int64 sums do, so both engines agree bit for bit whatever the order
 * of the additions. */

#define WSUM_ROW_WORDS 1024u
#define WSUM_ROW_BYTES (4u * WSUM_ROW_WORDS)
#define WSUM_MAX_ROWS 4096u

static int32_t wsum_w[WSUM_ROW_WORDS];
/* The column weights again, each odd one moved down a word (wsum_w_odd[2k] = W[2k + 1]): the
 * vector loops multiply the low 32 bits of 64-bit lanes, the data's odd words shifted down and
 * these loaded as they are. */
static int32_t wsum_w_odd[WSUM_ROW_WORDS];
static uint64_t wsum_u[WSUM_MAX_ROWS];
static size_t wsum_rows_per_chunk;  /* 0: not bound */

static uint64_t row_sum_scalar(const uint8_t *p, size_t words, size_t first) {
    uint64_t acc = 0;
    for (size_t j = 0; j < words; j++) {
        int32_t v;
        memcpy(&v, p + 4 * j, 4);  /* unaligned-safe load */
        acc += (uint64_t)((int64_t)v * (int64_t)wsum_w[first + j]);
    }
    return acc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_WSUM_VECTORS 1
/* Sixteen words a step: _mm256_mul_epi32 multiplies the low signed 32 bits of each 64-bit
 * lane into a 64-bit product, once for the even words and once (shifted down) for the odd
 * ones. The loops start at an even word (`first` is even wherever a row is whole). */
__attribute__((target("avx2"))) static uint64_t row_sum_avx2(const uint8_t *p, size_t words, size_t first) {
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    __m256i a2 = _mm256_setzero_si256(), a3 = _mm256_setzero_si256();
    size_t j = 0;
    if (first % 2 == 0) {
        for (; j + 16 <= words; j += 16) {
            __m256i v0 = _mm256_loadu_si256((const __m256i *)(p + 4 * j));
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(p + 4 * j + 32));
            a0 = _mm256_add_epi64(a0, _mm256_mul_epi32(v0, _mm256_loadu_si256((const __m256i *)(wsum_w + first + j))));
            a1 = _mm256_add_epi64(a1, _mm256_mul_epi32(_mm256_srli_epi64(v0, 32),
                                                       _mm256_loadu_si256((const __m256i *)(wsum_w_odd + first + j))));
            a2 = _mm256_add_epi64(a2, _mm256_mul_epi32(v1, _mm256_loadu_si256((const __m256i *)(wsum_w + first + j + 8))));
            a3 = _mm256_add_epi64(a3, _mm256_mul_epi32(_mm256_srli_epi64(v1, 32),
                                                       _mm256_loadu_si256((const __m256i *)(wsum_w_odd + first + j + 8))));
        }
    }
    __m256i acc = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, acc);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + row_sum_scalar(p + 4 * j, words - j, first + j);
}

/* The same, thirty-two words a step. */
__attribute__((target("avx512f"))) static uint64_t row_sum_avx512(const uint8_t *p, size_t words, size_t first) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    __m512i a2 = _mm512_setzero_si512(), a3 = _mm512_setzero_si512();
    size_t j = 0;
    if (first % 2 == 0) {
        for (; j + 32 <= words; j += 32) {
            __m512i v0 = _mm512_loadu_si512((const void *)(p + 4 * j));
            __m512i v1 = _mm512_loadu_si512((const void *)(p + 4 * j + 64));
            a0 = _mm512_add_epi64(a0, _mm512_mul_epi32(v0, _mm512_loadu_si512((const void *)(wsum_w + first + j))));
            a1 = _mm512_add_epi64(a1, _mm512_mul_epi32(_mm512_srli_epi64(v0, 32),
                                                       _mm512_loadu_si512((const void *)(wsum_w_odd + first + j))));
            a2 = _mm512_add_epi64(a2, _mm512_mul_epi32(v1, _mm512_loadu_si512((const void *)(wsum_w + first + j + 16))));
            a3 = _mm512_add_epi64(a3, _mm512_mul_epi32(_mm512_srli_epi64(v1, 32),
                                                       _mm512_loadu_si512((const void *)(wsum_w_odd + first + j + 16))));
        }
    }
    uint64_t total = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
    return total + row_sum_scalar(p + 4 * j, words - j, first + j);
}

typedef uint64_t (*row_sum_fn)(const uint8_t *, size_t, size_t);
static row_sum_fn row_sum_best;  /* chosen once, at wsum_bind */
#endif

static uint64_t row_sum(const uint8_t *p, size_t words, size_t first) {
#ifdef HAVE_WSUM_VECTORS
    return row_sum_best(p, words, first);
#else
    return row_sum_scalar(p, words, first);
#endif
}

/* The sum of the nbytes at p, which start at word `pos` of a chunk and end inside it (a last
 * partial word is zero-padded). */
static uint64_t wsum_part(const uint8_t *p, size_t nbytes, size_t pos) {
    uint64_t s = 0;
    size_t words = nbytes / 4, tail = nbytes % 4;
    while (words) {
        size_t row = pos / WSUM_ROW_WORDS, col = pos % WSUM_ROW_WORDS;
        size_t k = WSUM_ROW_WORDS - col < words ? WSUM_ROW_WORDS - col : words;
        s += wsum_u[row] * row_sum(p, k, col);
        p += 4 * k, pos += k, words -= k;
    }
    if (tail) {
        uint8_t last[4] = {0, 0, 0, 0};
        memcpy(last, p, tail);
        s += wsum_u[pos / WSUM_ROW_WORDS] * row_sum_scalar(last, 1, pos % WSUM_ROW_WORDS);
    }
    return s;
}

/* wsum_bind(w, u, rows_per_chunk): addresses of the column weights (1024 int32) and the row
 * weights (rows_per_chunk uint64), copied here. */
static PyObject *wsum_bind(PyObject *self, PyObject *args) {
    unsigned long long w_a, u_a;
    Py_ssize_t rows;
    if (!PyArg_ParseTuple(args, "KKn:wsum_bind", &w_a, &u_a, &rows))
        return NULL;
    if (!w_a || !u_a || rows <= 0 || (size_t)rows > WSUM_MAX_ROWS) {
        PyErr_SetString(PyExc_ValueError, "wsum_bind: bad tables");
        return NULL;
    }
    memcpy(wsum_w, (const void *)(uintptr_t)w_a, sizeof wsum_w);
    for (size_t j = 0; j < WSUM_ROW_WORDS; j++)
        wsum_w_odd[j] = j % 2 == 0 && j + 1 < WSUM_ROW_WORDS ? wsum_w[j + 1] : 0;
    memcpy(wsum_u, (const void *)(uintptr_t)u_a, (size_t)rows * sizeof(uint64_t));
#ifdef HAVE_WSUM_VECTORS
    __builtin_cpu_init();
    row_sum_best = __builtin_cpu_supports("avx512f") ? row_sum_avx512
                 : __builtin_cpu_supports("avx2") ? row_sum_avx2 : row_sum_scalar;
#endif
    wsum_rows_per_chunk = (size_t)rows;
    Py_RETURN_NONE;
}

static int wsum_ready(void) {
    if (!wsum_rows_per_chunk) {
        PyErr_SetString(PyExc_RuntimeError, "wsum: wsum_bind() was not called");
        return 0;
    }
    return 1;
}

/* wsum_copy(src, dst, nbytes, sums): for each chunk of the nbytes at src (which start a chunk;
 * the last one shorter), store its sum at sums[i] (uint64) and, unless dst is 0, copy it to
 * dst, a piece at a time while it is in cache. One chunk at least: sums[0] = 0 for nbytes 0. */
static PyObject *wsum_copy(PyObject *self, PyObject *args) {
    unsigned long long src_a, dst_a, out_a;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "KKnK:wsum_copy", &src_a, &dst_a, &nbytes, &out_a))
        return NULL;
    if (nbytes < 0 || (!src_a && nbytes > 0) || !out_a) {
        PyErr_SetString(PyExc_ValueError, "wsum_copy: bad sizes or addresses");
        return NULL;
    }
    if (!wsum_ready())
        return NULL;
    const uint8_t *src = (const uint8_t *)(uintptr_t)src_a;
    uint8_t *dst = (uint8_t *)(uintptr_t)dst_a;
    uint64_t *out = (uint64_t *)(uintptr_t)out_a;
    Py_BEGIN_ALLOW_THREADS
    size_t n = (size_t)nbytes, chunk = wsum_rows_per_chunk * WSUM_ROW_BYTES, off = 0, i = 0;
    do {
        size_t k = n - off < chunk ? n - off : chunk;
        uint64_t s = 0;
        for (size_t b = 0; b < k; b += SUB_BYTES) {
            size_t m = k - b < SUB_BYTES ? k - b : SUB_BYTES;
            s += wsum_part(src + off + b, m, b / 4);  /* SUB_BYTES is a multiple of 4 */
            if (dst)
                copy_block(dst + off + b, src + off + b, m);
        }
        out[i++] = s;
        off += k;
    } while (off < n);
#ifdef HAVE_STREAM_STORES
    if (dst)
        _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* wsum_span(src, nbytes, pos) -> int: the part of a chunk's sum that the nbytes at src add,
 * starting at word `pos` of the chunk (they end inside it). A receiver's streaming view. */
static PyObject *wsum_span(PyObject *self, PyObject *args) {
    unsigned long long src_a;
    Py_ssize_t nbytes, pos;
    if (!PyArg_ParseTuple(args, "Knn:wsum_span", &src_a, &nbytes, &pos))
        return NULL;
    if (!wsum_ready())
        return NULL;
    if (nbytes < 0 || pos < 0 || (!src_a && nbytes > 0)
            || (size_t)pos * 4 + (size_t)nbytes > wsum_rows_per_chunk * WSUM_ROW_BYTES) {
        PyErr_SetString(PyExc_ValueError, "wsum_span: bad sizes or addresses");
        return NULL;
    }
    uint64_t s;
    Py_BEGIN_ALLOW_THREADS
    s = wsum_part((const uint8_t *)(uintptr_t)src_a, (size_t)nbytes, (size_t)pos);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(s);
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "Bind the xxh3 streaming functions by address."},
    {"hash_copy", hash_copy, METH_VARARGS,
     "hash_copy(src, dst, nbytes, chunk, digests): checksum (and copy) chunk by chunk."},
    {"wsum_bind", wsum_bind, METH_VARARGS, "Hand over wsum64's weight tables (integrity/wsum.py)."},
    {"wsum_copy", wsum_copy, METH_VARARGS,
     "wsum_copy(src, dst, nbytes, sums): wsum64 chunk sums (and a copy), chunk by chunk."},
    {"wsum_span", wsum_span, METH_VARARGS,
     "wsum_span(src, nbytes, pos): the part of a chunk's wsum64 sum of bytes from word pos on."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mlcheckpoint.integrity._hashcopy",
    "Checksum-and-copy of shard bytes in one pass, without the GIL (xxh3 and wsum64).", -1, methods,
};

PyMODINIT_FUNC PyInit__hashcopy(void) { return PyModule_Create(&module); }
