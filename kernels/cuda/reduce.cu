// Chunk reduction with a progress mark (DESIGN §5).
//
//   dst[i] <- op(dst[i], src[i])   for i < n, then publish `mark` to *mark_slot
//
// `mark_slot` points into host-mapped pinned memory (cudaHostAllocMapped). The mark is
// written by the LAST block of the grid to finish (a per-chunk "blocks done" counter in
// device memory), after a system-scope fence, so a host that reads the slot sees the mark
// only once every element of the chunk has been reduced - even if the stream never
// returns afterwards (an NCCL kernel queued behind it hangs and is aborted). The counter is
// reset by that last block, so a slot can be reused by the next launch on the same stream.
// One slot must not be used by two launches that can run at the same time.
//
// Loaded at run time by CuPy's RawModule (NVRTC) and compiled by nvcc in the tests, so it
// sticks to what both accept: no standard-library headers, only cuda_fp16.h/cuda_bf16.h.
//
// Semantics match torch's elementwise ops, so CPU and GPU results are bit-identical:
//   * float16/bfloat16: computed in float32 and rounded once to nearest-even (the same
//     as torch; float32 carries >= 2p+2 bits, so this is the correctly rounded result);
//   * min/max propagate NaN (like torch.minimum/torch.maximum, unlike fminf);
//   * int32/int64 sum and prod wrap modulo 2^32/2^64 (two's complement, like torch),
//     computed in the unsigned type so that overflow is defined behaviour;
//   * AVG is not here: it sums (the collective divides once by its contributor count).
//
// Loads and stores are 16 bytes wide (uint4) where dst and src are 16-byte aligned; the
// tail (and unaligned buffers) fall back to one element per thread. Grid-stride loops,
// so any grid size is correct.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace resilient {

typedef unsigned long long u64;

// ---- element operations ----------------------------------------------------------------

template <typename T> struct Compute {            // float, double
    typedef T type;
    __device__ static type up(T x) { return x; }
    __device__ static T down(type x) { return x; }
};
template <> struct Compute<__half> {
    typedef float type;
    __device__ static float up(__half x) { return __half2float(x); }
    __device__ static __half down(float x) { return __float2half_rn(x); }
};
template <> struct Compute<__nv_bfloat16> {
    typedef float type;
    __device__ static float up(__nv_bfloat16 x) { return __bfloat162float(x); }
    __device__ static __nv_bfloat16 down(float x) { return __float2bfloat16_rn(x); }
};

template <typename F> __device__ __forceinline__ bool is_nan(F x) { return x != x; }

struct OpSum {
    template <typename T> __device__ static T apply(T a, T b) {
        typedef Compute<T> C;
        return C::down(C::up(a) + C::up(b));
    }
    __device__ static int apply(int a, int b) { return (int)((unsigned int)a + (unsigned int)b); }
    __device__ static long long apply(long long a, long long b) { return (long long)((u64)a + (u64)b); }
};

struct OpProd {
    template <typename T> __device__ static T apply(T a, T b) {
        typedef Compute<T> C;
        return C::down(C::up(a) * C::up(b));
    }
    __device__ static int apply(int a, int b) { return (int)((unsigned int)a * (unsigned int)b); }
    __device__ static long long apply(long long a, long long b) { return (long long)((u64)a * (u64)b); }
};

struct OpMin {
    template <typename T> __device__ static T apply(T a, T b) {
        typedef Compute<T> C;
        typename C::type x = C::up(a), y = C::up(b);
        if (is_nan(x)) return a;
        if (is_nan(y)) return b;
        return y < x ? b : a;
    }
    __device__ static int apply(int a, int b) { return b < a ? b : a; }
    __device__ static long long apply(long long a, long long b) { return b < a ? b : a; }
};

struct OpMax {
    template <typename T> __device__ static T apply(T a, T b) {
        typedef Compute<T> C;
        typename C::type x = C::up(a), y = C::up(b);
        if (is_nan(x)) return a;
        if (is_nan(y)) return b;
        return y > x ? b : a;
    }
    __device__ static int apply(int a, int b) { return b > a ? b : a; }
    __device__ static long long apply(long long a, long long b) { return b > a ? b : a; }
};

// ---- the chunk reduction -----------------------------------------------------------------

template <typename T, typename Op>
__device__ __forceinline__ void reduce_body(T* __restrict__ dst, const T* __restrict__ src, u64 n) {
    const int V = 16 / sizeof(T);                  // elements per 16-byte vector
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const bool aligned = ((((u64)dst) | ((u64)src)) & 15ull) == 0;
    const u64 nvec = aligned ? n / V : 0;

    uint4* dv = reinterpret_cast<uint4*>(dst);
    const uint4* sv = reinterpret_cast<const uint4*>(src);
    for (u64 i = tid; i < nvec; i += stride) {
        uint4 a = dv[i];
        const uint4 b = __ldg(sv + i);
        T* pa = reinterpret_cast<T*>(&a);
        const T* pb = reinterpret_cast<const T*>(&b);
#pragma unroll
        for (int k = 0; k < V; ++k) pa[k] = Op::apply(pa[k], pb[k]);
        dv[i] = a;
    }
    for (u64 i = nvec * V + tid; i < n; i += stride) dst[i] = Op::apply(dst[i], src[i]);
}

// Called by every thread after its share of the chunk: the last block to finish publishes.
__device__ __forceinline__ void publish_mark(unsigned int* done_blocks, volatile u64* mark_slot, u64 mark) {
    if (mark_slot == 0) return;
    __threadfence();        // this thread's element writes are visible device-wide ...
    __syncthreads();        // ... for every thread of the block, before thread 0 counts it
    if (threadIdx.x == 0) {
        const unsigned int prev = atomicAdd(done_blocks, 1u);
        if (prev == gridDim.x - 1) {               // every block of the chunk is done
            __threadfence_system();                // all reductions ordered before the mark
            *mark_slot = mark;                     // host-mapped: visible to the host
            __threadfence_system();
            *done_blocks = 0u;                     // ready for the next launch on this slot
        }
    }
}

template <typename T, typename Op>
__device__ __forceinline__ void reduce_chunk(T* dst, const T* src, u64 n, unsigned int* done_blocks,
                                             u64* mark_slot, u64 mark) {
    reduce_body<T, Op>(dst, src, n);
    publish_mark(done_blocks, mark_slot, mark);
}

}  // namespace resilient

// ---- exported kernels: resilient_reduce_<op>_<dtype> (AVG uses sum) ----------------------

#define RESILIENT_REDUCE_KERNEL(OPNAME, OP, DTNAME, T)                                         \
    extern "C" __global__ void resilient_reduce_##OPNAME##_##DTNAME(                           \
        T* dst, const T* src, unsigned long long n, unsigned int* done_blocks,               \
        unsigned long long* mark_slot, unsigned long long mark) {                            \
        resilient::reduce_chunk<T, resilient::OP>(dst, src, n, done_blocks, mark_slot, mark); \
    }

#define RESILIENT_REDUCE_ALL_OPS(DTNAME, T)                  \
    RESILIENT_REDUCE_KERNEL(sum, OpSum, DTNAME, T)           \
    RESILIENT_REDUCE_KERNEL(prod, OpProd, DTNAME, T)         \
    RESILIENT_REDUCE_KERNEL(min, OpMin, DTNAME, T)           \
    RESILIENT_REDUCE_KERNEL(max, OpMax, DTNAME, T)

RESILIENT_REDUCE_ALL_OPS(float32, float)
RESILIENT_REDUCE_ALL_OPS(float64, double)
RESILIENT_REDUCE_ALL_OPS(float16, __half)
RESILIENT_REDUCE_ALL_OPS(bfloat16, __nv_bfloat16)
RESILIENT_REDUCE_ALL_OPS(int32, int)
RESILIENT_REDUCE_ALL_OPS(int64, long long)
