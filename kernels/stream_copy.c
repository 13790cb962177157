/* resilient.kernels._stream_copy: one memory copy with non-temporal (streaming) stores.
 *
 * Why by hand: torch's copy kernel writes through the cache, and glibc's memcpy streams
 * only above a threshold it derives from the cache size (on a VM that reports a huge L3,
 * never) and that only GLIBC_TUNABLES can change, before the process starts and for the
 * whole process. A copy of many MiB whose destination is not read again soon (an input
 * published into a shared-memory segment, a result handed back to the caller) runs at
 * DRAM speed through the cache and ~1.5x faster streamed (docs/bench.md). Python wrapper
 * and its fallbacks: kernels/copy.py.
 *
 * copy(dst, src, nbytes): addresses as integers; the GIL is released for the copy;
 * copy2(dst, dst2, src, nbytes): the same into two destinations, the source read once. The
 * ranges must not overlap (the wrapper checks). On x86-64 the body is copied 64 bytes at a
 * time with SSE2 streaming stores (every x86-64 CPU has SSE2), then an sfence: every store
 * is globally visible before the call returns, so a caller may publish a flag word after it
 * (streaming stores are weakly ordered otherwise). Elsewhere it is memcpy. STREAMING says
 * which. Failure behaviour: none at run time (no allocation, no error path); bad addresses
 * are the caller's (the wrapper passes only a live tensor's own bytes).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STREAMING 1

/* One 64-byte line of streaming stores at d (16-byte aligned). */
static inline void stream_line(char *d, __m128i a, __m128i b, __m128i c, __m128i e)
{
    _mm_stream_si128((__m128i *)d, a);
    _mm_stream_si128((__m128i *)(d + 16), b);
    _mm_stream_si128((__m128i *)(d + 32), c);
    _mm_stream_si128((__m128i *)(d + 48), e);
}

/* n bytes from s to d, and to d2 as well unless it is NULL (d2 then at d's offset modulo
 * 16: the streaming store needs 16-byte alignment). The head up to d's next 64-byte line
 * and the tail are memcpy; the lines between are streamed, the source read once. */
static void stream_lines(char *d, char *d2, const char *s, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)d) & 63;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    if (d2 != NULL) {
        memcpy(d2, s, head);
        d2 += head;
    }
    d += head;
    s += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        stream_line(d + i, a, b, c, e);
        if (d2 != NULL)
            stream_line(d2 + i, a, b, c, e);
    }
    _mm_sfence();
    memcpy(d + body, s + body, n - body);
    if (d2 != NULL)
        memcpy(d2 + body, s + body, n - body);
}

static void stream_copy(char *d, const char *s, size_t n)
{
    stream_lines(d, NULL, s, n);
}

/* The same bytes into two destinations: one streamed pass when they sit at one offset
 * modulo 16, otherwise two copies. */
static void stream_copy2(char *d, char *d2, const char *s, size_t n)
{
    if ((((uintptr_t)d ^ (uintptr_t)d2) & 15) != 0) {
        stream_lines(d, NULL, s, n);
        stream_lines(d2, NULL, s, n);
        return;
    }
    stream_lines(d, d2, s, n);
}
#else
#define STREAMING 0

static void stream_copy(char *d, const char *s, size_t n)
{
    memcpy(d, s, n);
}

static void stream_copy2(char *d, char *d2, const char *s, size_t n)
{
    memcpy(d, s, n);
    memcpy(d2, s, n);
}
#endif

static PyObject *py_copy(PyObject *self, PyObject *args)
{
    unsigned long long dst, src;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKn:copy", &dst, &src, &n))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "copy: nbytes must be >= 0");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_copy2(PyObject *self, PyObject *args)
{
    unsigned long long dst, dst2, src;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKn:copy2", &dst, &dst2, &src, &n))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "copy2: nbytes must be >= 0");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy2((char *)(uintptr_t)dst, (char *)(uintptr_t)dst2, (const char *)(uintptr_t)src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", py_copy, METH_VARARGS,
     "copy(dst, src, nbytes): copy nbytes from address src to address dst (no overlap) with "
     "streaming stores, fenced before it returns; the GIL is released meanwhile."},
    {"copy2", py_copy2, METH_VARARGS,
     "copy2(dst, dst2, src, nbytes): copy's bytes into two destinations, the source read once "
     "(no two of the ranges overlap)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_stream_copy",
    "A memory copy with non-temporal stores (kernels/stream_copy.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__stream_copy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
