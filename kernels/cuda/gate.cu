// A gate that holds a stream until the host opens it.
//
// Used to interrupt a sequence of chunk reductions on purpose (bench/gpu_check.py, and
// tests of abort paths on GPU machines): launch the reductions of chunks 0..k-1, then
// resilient_wait_gate, then chunks k..n-1. While the gate is closed the stream behaves like
// one stuck behind a hung NCCL kernel, and the progress marks must name exactly chunks
// 0..k-1. `gate` is host-mapped pinned memory; the host opens it by writing non-zero.
//
// `max_spins` bounds the wait (each spin sleeps ~1 us), so a forgotten gate cannot wedge
// the GPU forever; *timed_out (host-mapped too, may be null) reports that it gave up.

extern "C" __global__ void resilient_wait_gate(const volatile unsigned int* gate,
                                               unsigned long long max_spins,
                                               volatile unsigned int* timed_out) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned long long spins = 0;
    while (*gate == 0u) {
        if (++spins > max_spins) {
            if (timed_out != 0) *timed_out = 1u;
            __threadfence_system();
            return;
        }
        __nanosleep(1000);
    }
}
