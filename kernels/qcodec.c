/* resilient.kernels._qcodec: the exact compressed allreduce's codec in one pass per stage.
 *
 * The same arithmetic, element for element, as the torch code of
 * resilient/collectives/quantization.py (which stays the reference and the fallback where
 * this extension was not built): IEEE float32/float64 multiplies, subtractions and
 * divisions in the same order, round half to even, no contraction into FMA (built with
 * -ffp-contract=off), so both give the same bits and members with and without the
 * extension interoperate. tests/test_qcodec.py checks every function against the torch
 * code bitwise.
 *
 * Wire format of one part of `count` int32 values at width w (quantization.py's
 * `planes`): 32 and 16 are little-endian integers; any other width is cut into planes of
 * p in {8, 4, 2, 1} bits (8 first when w > 8, then 4, 2, 1 as needed: w = 6 is 4 + 2),
 * lowest bits first. A plane holds bits [shift, shift + p) of each value's two's
 * complement; an 8-bit plane one byte per value; a narrower one per = 8 / p fields per
 * byte and K = ceil(count / per) bytes, field j (bits [p*j, p*j + p)) of byte i being value
 * i + j*K (0 past the end: contiguous runs of values per field, which both the C loops
 * and torch's whole-tensor ops handle without strided passes). The last plane's fields
 * are the value's top bits (sign-extended when decoded). Planes follow one another.
 *
 * Functions (addresses as integers; the GIL is released; ranges must not overlap unless
 * said; the callers in resilient/collectives/quantization.py, through kernels/qcodec.py,
 * pass only live tensors' own bytes and check the sizes first):
 *   pack(dst, src_i32, count, width)
 *   unpack_add(dst_i32, wire, count, width, addend_i32 or 0)       dst = decode (+ addend)
 *   unpack_add_pack(dst_i32, wire, count, w_in, addend_i32, out_wire, w_out)
 *       dst = decode(wire) + addend, and dst encoded at w_out into out_wire: one ring
 *       receive of the reduce-scatter and the send it feeds, in one call (the range is
 *       decoded, then encoded)
 *   quantize(x_f32, q_i32, res_f32 or 0, count, scales_f32, bucket, pos0, qmax, fine)
 *   dequantize(q_i32, out_f32, count, scales_f32, bucket, pos0, fine, divisor)
 *   maxima(x_f32, count, bucket, out_f32)                          max |x| per bucket
 * pos0: the first element's position inside its bucket (scales[0] is that bucket's).
 * Failure behaviour: none at run time (no allocation, no error path).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <stdint.h>
#include <string.h>

/* float and double operations must round to their own precision (no x87 extended
 * intermediates): otherwise the build fails and the torch code runs */
#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "qcodec.c needs FLT_EVAL_METHOD == 0 to give the torch code's bits"
#endif

/* the hot loops are also compiled for AVX2 and picked at load time where the CPU has it
 * (no FMA: the results are bitwise those of the baseline build) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HOT __attribute__((target_clones("avx2", "default")))
#else
#define HOT
#endif

#define BLK 2048 /* elements decoded/encoded per block (a multiple of 8: planes stay byte aligned) */

typedef struct {
    int n;
    int p[4];
    int shift[4];
} planes_t;

/* The planes of width w (see the header); 0 for a width there is no format for. */
static int planes_of(int w, planes_t *pl)
{
    pl->n = 0;
    if (w == 32 || w == 16 || w == 8) {
        pl->p[0] = w;
        pl->shift[0] = 0;
        pl->n = 1;
        return 1;
    }
    if (w < 1 || w > 15)
        return 0;
    int left = w, sh = 0;
    if (w > 8) {
        pl->p[pl->n] = 8;
        pl->shift[pl->n++] = 0;
        left -= 8;
        sh = 8;
    }
    static const int sizes[3] = {4, 2, 1};
    for (int i = 0; i < 3; i++) {
        if (left >= sizes[i]) {
            pl->p[pl->n] = sizes[i];
            pl->shift[pl->n++] = sh;
            sh += sizes[i];
            left -= sizes[i];
        }
    }
    return 1;
}

static size_t plane_bytes(size_t count, int p)
{
    if (p >= 8)
        return count * (size_t)(p / 8);
    size_t per = (size_t)(8 / p);
    return (count + per - 1) / per;
}

/* Encode plane (p, shift) of the `count` values v into d, byte-major: with
 * per = 8 / p values to a byte and K = plane_bytes(count, p), field j of byte i is value
 * i + j * K (0 past the end). */
HOT static void enc_plane(uint8_t *d, const int32_t *v, size_t count, int p, int shift)
{
    size_t i;
    if (p == 32) {
        memcpy(d, v, count * 4);
        return;
    }
    if (p == 16) {
        for (i = 0; i < count; i++) {
            int16_t t = (int16_t)v[i];
            memcpy(d + 2 * i, &t, 2);
        }
        return;
    }
    if (p == 8) {
        for (i = 0; i < count; i++)
            d[i] = (uint8_t)((uint32_t)v[i] >> shift);
        return;
    }
    size_t per = (size_t)(8 / p), K = plane_bytes(count, p);
    uint32_t mask = (1u << p) - 1u;
    /* bytes whose every field is a value: i + (per - 1) * K < count */
    size_t full = count > (per - 1) * K ? count - (per - 1) * K : 0;
#define F(j) ((((uint32_t)v[i + (j) * K] >> shift) & mask) << (p * (j)))
    switch (p) {
    case 4:
        for (i = 0; i < full; i++)
            d[i] = (uint8_t)(F(0) | F(1));
        break;
    case 2:
        for (i = 0; i < full; i++)
            d[i] = (uint8_t)(F(0) | F(1) | F(2) | F(3));
        break;
    case 1:
        for (i = 0; i < full; i++)
            d[i] = (uint8_t)(F(0) | F(1) | F(2) | F(3) | F(4) | F(5) | F(6) | F(7));
        break;
    }
#undef F
    for (i = full; i < K; i++) {
        uint32_t b = 0;
        for (size_t j = 0; j < per && i + j * K < count; j++)
            b |= (((uint32_t)v[i + j * K] >> shift) & mask) << (p * j);
        d[i] = (uint8_t)b;
    }
}

/* t[k] (=, or += when add) field of value e0 + k of plane (p, shift) (sign-extended when
 * top), for m values that stay inside one field index j (e0 / K == (e0 + m - 1) / K). */
HOT static void dec_run(int32_t *t, const uint8_t *s, size_t count, size_t e0, size_t m, int p, int shift, int top,
                    int add)
{
    size_t k;
    if (p == 32) {
        const uint8_t *q = s + 4 * e0;
        if (add)
            for (k = 0; k < m; k++) {
                int32_t x;
                memcpy(&x, q + 4 * k, 4);
                t[k] += x;
            }
        else
            memcpy(t, q, m * 4);
        return;
    }
    if (p == 16) {
        const uint8_t *q = s + 2 * e0;
        for (k = 0; k < m; k++) {
            int16_t x;
            memcpy(&x, q + 2 * k, 2);
            t[k] = add ? t[k] + x : x;
        }
        return;
    }
    size_t K = plane_bytes(count, p);
    size_t j = p == 8 ? 0 : e0 / K;
    const uint8_t *q = s + (e0 - j * K);
    int lo = p * (int)j, up = 32 - p;
    uint32_t mask = (1u << p) - 1u;
    if (top) {
        if (add)
            for (k = 0; k < m; k++)
                t[k] += (int32_t)((uint32_t)((int32_t)((((uint32_t)q[k] >> lo) & mask) << up) >> up) << shift);
        else
            for (k = 0; k < m; k++)
                t[k] = (int32_t)((uint32_t)((int32_t)((((uint32_t)q[k] >> lo) & mask) << up) >> up) << shift);
    } else {
        if (add)
            for (k = 0; k < m; k++)
                t[k] += (int32_t)((((uint32_t)q[k] >> lo) & mask) << shift);
        else
            for (k = 0; k < m; k++)
                t[k] = (int32_t)((((uint32_t)q[k] >> lo) & mask) << shift);
    }
}

static void do_pack(uint8_t *dst, const int32_t *src, size_t count, const planes_t *pl)
{
    size_t base = 0;
    for (int j = 0; j < pl->n; j++) {
        enc_plane(dst + base, src, count, pl->p[j], pl->shift[j]);
        base += plane_bytes(count, pl->p[j]);
    }
}

/* dst = decode(wire) (+ addend), position-major in runs that stay inside one field index of
 * every plane; then dst encoded at plo into out (when out). */
static void do_unpack(int32_t *dst, const uint8_t *wire, size_t count, const planes_t *pl, const int32_t *addend,
                      uint8_t *out, const planes_t *plo)
{
    size_t base[4], K[4];
    size_t b = 0;
    for (int j = 0; j < pl->n; j++) {
        base[j] = b;
        K[j] = pl->p[j] < 8 ? plane_bytes(count, pl->p[j]) : count;
        b += plane_bytes(count, pl->p[j]);
    }
    size_t e0 = 0;
    while (e0 < count) {
        size_t m = count - e0 < BLK ? count - e0 : BLK;
        for (int j = 0; j < pl->n; j++) {
            size_t edge = (e0 / K[j] + 1) * K[j]; /* the next field index of plane j */
            if (edge - e0 < m)
                m = edge - e0;
        }
        int32_t *t = dst + e0;
        for (int j = 0; j < pl->n; j++)
            dec_run(t, wire + base[j], count, e0, m, pl->p[j], pl->shift[j], j == pl->n - 1, j > 0);
        if (addend != NULL)
            for (size_t k = 0; k < m; k++)
                t[k] += addend[e0 + k];
        e0 += m;
    }
    if (out != NULL)
        do_pack(out, dst, count, plo);
}

/* round half to even of |r| < 2**22 (float) / 2**51 (double): exact in the default mode */
/* (IEEE addition does not associate: without -ffast-math the compiler keeps both ops) */
static inline float rne_f(float r)
{
    return (r + 12582912.0f) - 12582912.0f; /* 1.5 * 2**23 */
}

static inline double rne_d(double r)
{
    return (r + 6755399441055744.0) - 6755399441055744.0; /* 1.5 * 2**52 */
}

/* Elements from i on that share i's bucket (the first bucket starts pos0 in). */
static inline size_t bucket_run(size_t i, size_t pos0, size_t count, size_t bucket)
{
    size_t m = i == 0 ? bucket - pos0 : bucket;
    return m < count - i ? m : count - i;
}

/* quantize.py's per-element ops: r = x * inv (inv = 1/s, 0 for s <= 0), NaN -> 0,
 * clamp to +-qmax, round half to even; residual x - fl32(s * q). */
HOT static void do_quantize(const float *x, int32_t *q, float *res, size_t count, const float *sc, size_t bucket,
                        size_t pos0, double qm, int fine)
{
    for (size_t i = 0, b = 0, m; i < count; i += m, b++) {
        m = bucket_run(i, pos0, count, bucket);
        float s = sc[b];
        if (!fine) {
            float inv = s > 0.0f ? 1.0f / s : 0.0f;
            float qf = (float)qm;
            for (size_t k = i; k < i + m; k++) {
                float r = x[k] * inv;
                r = r != r ? 0.0f : r;
                r = r < -qf ? -qf : r;
                r = r > qf ? qf : r;
                int32_t v = (int32_t)rne_f(r);
                q[k] = v;
                if (res != NULL)
                    res[k] = x[k] - (float)v * s;
            }
        } else {
            double sd = (double)s;
            double inv = sd > 0.0 ? 1.0 / sd : 0.0;
            for (size_t k = i; k < i + m; k++) {
                double r = (double)x[k] * inv;
                r = r != r ? 0.0 : r;
                r = r < -qm ? -qm : r;
                r = r > qm ? qm : r;
                int32_t v = (int32_t)rne_d(r);
                q[k] = v;
                if (res != NULL)
                    res[k] = x[k] - (float)((double)v * sd);
            }
        }
    }
}

HOT static void do_dequantize(const int32_t *q, float *out, size_t count, const float *sc, size_t bucket, size_t pos0,
                          int fine, int divisor)
{
    float dv = (float)divisor;
    for (size_t i = 0, b = 0, m; i < count; i += m, b++) {
        m = bucket_run(i, pos0, count, bucket);
        float s = sc[b];
        if (!fine) {
            if (divisor > 0)
                for (size_t k = i; k < i + m; k++)
                    out[k] = ((float)q[k] * s) / dv;
            else
                for (size_t k = i; k < i + m; k++)
                    out[k] = (float)q[k] * s;
        } else {
            double sd = (double)s;
            for (size_t k = i; k < i + m; k++) {
                float d = (float)((double)q[k] * sd);
                out[k] = divisor > 0 ? d / dv : d;
            }
        }
    }
}

/* max |x| per bucket from the bit patterns: with the sign bit cleared, finite and infinite
 * floats order as their bits do, and any pattern above +inf's is a NaN (then the bucket's
 * maximum is a NaN, as torch's amax gives: clean_maxima maps every NaN alike). An integer
 * reduction, which the compiler vectorizes (a float max reduction it may not reorder). */
HOT static void do_maxima(const float *x, size_t count, size_t bucket, float *out)
{
    size_t b = 0;
    for (size_t i = 0; i < count; i += bucket, b++) {
        size_t m = count - i < bucket ? count - i : bucket;
        const uint32_t *u = (const uint32_t *)(const void *)(x + i);
        int32_t mx = 0;
        for (size_t k = 0; k < m; k++) {
            int32_t a = (int32_t)(u[k] & 0x7fffffffu);
            mx = a > mx ? a : mx;
        }
        uint32_t bits = (uint32_t)mx > 0x7f800000u ? 0x7fc00000u : (uint32_t)mx;
        memcpy(out + b, &bits, 4);
    }
}

#define PTR(T, v) ((T)(uintptr_t)(v))

static int width_planes(int w, planes_t *pl)
{
    if (!planes_of(w, pl)) {
        PyErr_Format(PyExc_ValueError, "no wire format for width %d", w);
        return 0;
    }
    return 1;
}

static PyObject *py_pack(PyObject *self, PyObject *args)
{
    unsigned long long dst, src;
    Py_ssize_t count;
    int w;
    planes_t pl;
    if (!PyArg_ParseTuple(args, "KKni", &dst, &src, &count, &w) || !width_planes(w, &pl))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    do_pack(PTR(uint8_t *, dst), PTR(const int32_t *, src), (size_t)count, &pl);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_unpack_add(PyObject *self, PyObject *args)
{
    unsigned long long dst, wire, addend;
    Py_ssize_t count;
    int w;
    planes_t pl;
    if (!PyArg_ParseTuple(args, "KKniK", &dst, &wire, &count, &w, &addend) || !width_planes(w, &pl))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    do_unpack(PTR(int32_t *, dst), PTR(const uint8_t *, wire), (size_t)count, &pl, PTR(const int32_t *, addend), NULL,
              NULL);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_unpack_add_pack(PyObject *self, PyObject *args)
{
    unsigned long long dst, wire, addend, out;
    Py_ssize_t count;
    int w, wo;
    planes_t pl, plo;
    if (!PyArg_ParseTuple(args, "KKniKKi", &dst, &wire, &count, &w, &addend, &out, &wo) || !width_planes(w, &pl)
        || !width_planes(wo, &plo))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    do_unpack(PTR(int32_t *, dst), PTR(const uint8_t *, wire), (size_t)count, &pl, PTR(const int32_t *, addend),
              PTR(uint8_t *, out), &plo);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_quantize(PyObject *self, PyObject *args)
{
    unsigned long long x, q, res, sc;
    Py_ssize_t count, bucket, pos0;
    double qm;
    int fine;
    if (!PyArg_ParseTuple(args, "KKKnKnndp", &x, &q, &res, &count, &sc, &bucket, &pos0, &qm, &fine))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    do_quantize(PTR(const float *, x), PTR(int32_t *, q), PTR(float *, res), (size_t)count, PTR(const float *, sc),
                (size_t)bucket, (size_t)pos0, qm, fine);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_dequantize(PyObject *self, PyObject *args)
{
    unsigned long long q, out, sc;
    Py_ssize_t count, bucket, pos0;
    int fine, divisor;
    if (!PyArg_ParseTuple(args, "KKnKnnpi", &q, &out, &count, &sc, &bucket, &pos0, &fine, &divisor))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    do_dequantize(PTR(const int32_t *, q), PTR(float *, out), (size_t)count, PTR(const float *, sc), (size_t)bucket,
                  (size_t)pos0, fine, divisor);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_maxima(PyObject *self, PyObject *args)
{
    unsigned long long x, out;
    Py_ssize_t count, bucket;
    if (!PyArg_ParseTuple(args, "KnnK", &x, &count, &bucket, &out))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    do_maxima(PTR(const float *, x), (size_t)count, (size_t)bucket, PTR(float *, out));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"pack", py_pack, METH_VARARGS, "pack(dst, src_i32, count, width)"},
    {"unpack_add", py_unpack_add, METH_VARARGS, "unpack_add(dst_i32, wire, count, width, addend_or_0)"},
    {"unpack_add_pack", py_unpack_add_pack, METH_VARARGS,
     "unpack_add_pack(dst_i32, wire, count, width, addend, out_wire, out_width)"},
    {"quantize", py_quantize, METH_VARARGS, "quantize(x, q, res_or_0, count, scales, bucket, pos0, qmax, fine)"},
    {"dequantize", py_dequantize, METH_VARARGS, "dequantize(q, out, count, scales, bucket, pos0, fine, divisor)"},
    {"maxima", py_maxima, METH_VARARGS, "maxima(x, count, bucket, out)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qcodec", NULL, -1, methods};

PyMODINIT_FUNC PyInit__qcodec(void)
{
    return PyModule_Create(&module);
}
