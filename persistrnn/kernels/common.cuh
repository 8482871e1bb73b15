// Shared device helpers for persistrnn kernels: bounded barriers and the
// Hopper cluster primitives (mapa, st.async, mbarrier) written as PTX, so the
// kernels need no toolkit headers beyond what NVRTC bundles.

typedef unsigned int prnn_u32;
typedef unsigned long long prnn_u64;

// Status codes a kernel leaves in its status word; the host raises on them.
#define PRNN_STATUS_OK 0
#define PRNN_STATUS_GRID_BARRIER_TIMEOUT 1
#define PRNN_STATUS_CLUSTER_WAIT_TIMEOUT 2
#define PRNN_STATUS_PIPELINE_WAIT_TIMEOUT 3
// Test hook only: the abandoned block waited the whole bound and no peer
// failed (no block waits on it, e.g. a lone block or a pipeline's last layer).
#define PRNN_STATUS_ABANDON_TIMEOUT 4

// What every wait needs to give up, passed from the kernel's arguments:
//   status      per-launch device word, zero at launch start: the first code
//               of a failure (prnn_fail), which tells the launch's other
//               blocks to give up too;
//   report      host-mapped pinned word (or nullptr) that a failing block
//               copies the first code into, for the host to read without
//               synchronising (prnn_report);
//   timeout_ns  how long a wait goes on without progress before it fails.
struct prnn_watch {
    int* status;
    int* report;
    prnn_u64 timeout_ns;
};

// Two clock reads of one spinning thread further apart than this mean that
// the kernel was not running in between (preemption, MPS or time-slice
// scheduling, a debugger): its peers could not make progress then either, so
// the gap does not count against the wait's bound. A wait reads the clock on
// every poll (a try_wait or an L2 load, microseconds at most), so a gap this
// long is never the wait itself.
#define PRNN_MAX_CLOCK_GAP_NS 1000000u

__device__ __forceinline__ prnn_u32 prnn_globaltimer_lo() {
    prnn_u32 t;
    asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(t));
    return t;
}

// Time a wait went on without progress, clock jumps left out; two registers,
// as few as the bound's old start time: spinning threads hold every weight
// register of the step loop too, and some kernels sit at 255.
//   last     the previous read of the clock's low 32 bits, whose differences
//            are exact for gaps below 4 s (longer ones are jumps anyway);
//   stalled  time counted, in 1024 ns units (32 bits reach 73 min). Each
//            poll adds the change of the clock's 1024 ns count, so the sum
//            stays within a unit of the time, however short the polls.
// A wait looks at the status word and at its bound only when the clock has
// crossed a 65.5 us boundary since the last poll: a status read is an L2
// round trip, too slow to do on every poll, and counting polls instead would
// take a third register.
struct prnn_stall_clock {
    prnn_u32 last, stalled;

    __device__ __forceinline__ void restart() {
        last = prnn_globaltimer_lo();
        stalled = 0;
    }
    // One poll's clock read; true when it is time to check.
    __device__ __forceinline__ bool tick() {
        const prnn_u32 now = prnn_globaltimer_lo();
        if (now - last < PRNN_MAX_CLOCK_GAP_NS) stalled += ((now >> 10) - (last >> 10)) & 0x3fffffu;
        const bool check = ((now ^ last) >> 16) != 0;
        last = now;
        return check;
    }
    __device__ __forceinline__ bool expired(prnn_u64 timeout_ns) const {
        return ((prnn_u64)stalled << 10) > timeout_ns;
    }
};

// First failure wins; later ones keep the first code.
__device__ __forceinline__ void prnn_fail(int* status, int code) { atomicCAS(status, PRNN_STATUS_OK, code); }

__device__ __forceinline__ int prnn_status(const int* status) {
    return *reinterpret_cast<const volatile int*>(status);
}

__device__ __forceinline__ bool prnn_failed(const int* status) { return prnn_status(status) != PRNN_STATUS_OK; }

// Called by thread 0 of a block that leaves because of a failure (its own or
// a peer's, so the status word already holds the first code): copy that code
// to the host's report word, visible there without a synchronise. The waits
// call it where they fail: code after the step loop that ran only on failure
// cost registers in kernels at their limit (ptxas then spilled in the weight
// loads before the loop).
__device__ __forceinline__ void prnn_report(const prnn_watch& w) {
    if (w.report == nullptr) return;
    *reinterpret_cast<volatile int*>(w.report) = prnn_status(w.status);
    __threadfence_system();
}

// Test hook: the abandoned block waits until a block that waits for it fails;
// with none waiting for it (a lone block, a pipeline's last layer), it fails
// itself. Its bound is twice the peers': it starts waiting before they do
// (they are still computing the step it skipped), so with the same bound it
// would give up first, and the failure would name the hook instead of the
// stage that waited. By thread 0; reports.
__device__ __forceinline__ void prnn_wait_for_failure(const prnn_watch& w) {
    prnn_stall_clock clock;
    clock.restart();
    while (!prnn_failed(w.status)) {
        if (clock.tick() && clock.expired(2 * w.timeout_ns)) {
            prnn_fail(w.status, PRNN_STATUS_ABANDON_TIMEOUT);
            break;
        }
    }
    prnn_report(w);
}

__device__ __forceinline__ prnn_u32 prnn_ld_acquire_gpu(const prnn_u32* p) {
    prnn_u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void prnn_red_release_gpu_add(prnn_u32* p, prnn_u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Grid-wide barrier over a counter that only grows: arrival k of every block
// waits until the counter reaches blocks * k. Never reset inside a launch, so
// no block can mistake an old generation for a new one. Split in two so that a
// block can do independent work between its arrival and its wait.
__device__ __forceinline__ void prnn_grid_arrive(prnn_u32* counter) {
    __syncthreads();  // the block's writes precede its arrival
    if (threadIdx.x == 0) prnn_red_release_gpu_add(counter, 1u);
}

// Wait until *counter reaches target (acquire), by thread 0. Fails (code into
// the status word) once the counter has not grown for the watch's timeout,
// and gives up at once, keeping the first code, when another block has
// failed; reports either way. *seen gets the count read last.
__device__ __forceinline__ bool prnn_wait_counter(const prnn_u32* counter, prnn_u32 target, const prnn_watch& w,
                                                  int code, prnn_u32* seen) {
    prnn_u32 v = prnn_ld_acquire_gpu(counter);
    if (v >= target) {
        *seen = v;
        return true;
    }
    prnn_stall_clock clock;
    clock.restart();
    prnn_u32 progress = v;
    while ((v = prnn_ld_acquire_gpu(counter)) < target) {
        const bool check = clock.tick();
        if (v != progress) {  // the counter grew: the peers are running
            progress = v;
            clock.stalled = 0;
        }
        if (check) {
            if (clock.expired(w.timeout_ns)) prnn_fail(w.status, code);
            if (prnn_failed(w.status)) {
                prnn_report(w);
                break;
            }
        }
    }
    *seen = v;
    return v >= target;
}

// Tagged words (NCCL's LL protocol): a float and its exchange's tag in one
// 64-bit word, stored and loaded single-copy atomic at GPU scope, so a
// reader that sees the tag has the value, with no release and no barrier.
// The buffer starts zeroed each launch and tags start at 1. Used by the
// forward's and the backward's grid exchanges in one L2 round trip.
__device__ __forceinline__ void prnn_st_tagged(prnn_u64* p, float v, prnn_u32 tag) {
    const prnn_u64 word = ((prnn_u64)tag << 32) | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(word) : "memory");
}

__device__ __forceinline__ prnn_u64 prnn_ld_tagged(const prnn_u64* p) {
    prnn_u64 v;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// A polling wait's check, on each poll: false once the wait must give up
// (no progress for the watch's timeout, which fails the launch with `code`,
// or another block's failure), reported; true while it may go on.
__device__ __forceinline__ bool prnn_wait_goes_on(prnn_stall_clock& clock, const prnn_watch& w, int code) {
    if (!clock.tick()) return true;
    if (clock.expired(w.timeout_ns)) prnn_fail(w.status, code);
    if (!prnn_failed(w.status)) return true;
    prnn_report(w);
    return false;
}

// Poll *p until its tag is `tag` (the word into *word). The bound restarts
// with each word, so it measures a lack of progress. False when it runs out
// (the status word set) or another block failed; the thread reports.
__device__ __forceinline__ bool prnn_wait_tagged(const prnn_u64* p, prnn_u32 tag, const prnn_watch& w, prnn_u64* word) {
    prnn_stall_clock clock;
    clock.restart();
    while ((prnn_u32)((*word = prnn_ld_tagged(p)) >> 32) != tag)
        if (!prnn_wait_goes_on(clock, w, PRNN_STATUS_GRID_BARRIER_TIMEOUT)) return false;
    return true;
}

// A float another block stored during this launch: through L2 only (.cg),
// never from a stale L1 line.
__device__ __forceinline__ float prnn_ld_cg_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ float4 prnn_ld_cg_v4(const float* p) {  // likewise, 16 bytes (16-byte aligned)
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p)
                 : "memory");
    return v;
}

// Returns false (and the status word holds a failure) if the other blocks
// did not arrive.
__device__ __forceinline__ bool prnn_grid_wait(prnn_u32* counter, prnn_u32 target, const prnn_watch& w) {
    __shared__ int arrived;
    prnn_u32 seen;
    if (threadIdx.x == 0) arrived = prnn_wait_counter(counter, target, w, PRNN_STATUS_GRID_BARRIER_TIMEOUT, &seen);
    __syncthreads();
    return arrived;
}

__device__ __forceinline__ bool prnn_grid_barrier(prnn_u32* counter, prnn_u32 target, const prnn_watch& w) {
    prnn_grid_arrive(counter);
    return prnn_grid_wait(counter, target, w);
}

// ---- thread-block clusters -------------------------------------------------

__device__ __forceinline__ prnn_u32 prnn_cluster_rank() {
    prnn_u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ prnn_u32 prnn_cluster_size() {
    prnn_u32 n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
}

// cluster.sync(): every thread of every block in the cluster arrives (release)
// and waits (acquire). The hardware co-schedules a cluster, so it cannot hang.
__device__ __forceinline__ void prnn_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ prnn_u32 prnn_smem_addr(const void* p) {
    return static_cast<prnn_u32>(__cvta_generic_to_shared(p));
}

// Address of the same shared-memory location in cluster block `rank`.
__device__ __forceinline__ prnn_u32 prnn_peer_addr(prnn_u32 local_addr, prnn_u32 rank) {
    prnn_u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local_addr), "r"(rank));
    return r;
}

__device__ __forceinline__ void prnn_st_cluster_v4(prnn_u32 addr, float4 v) {
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z),
                 "f"(v.w)
                 : "memory");
}

__device__ __forceinline__ void prnn_st_cluster_s64(prnn_u32 addr, long long v) {
    asm volatile("st.shared::cluster.s64 [%0], %1;" ::"r"(addr), "l"(v) : "memory");
}

// ---- host memory (pinned, mapped: the same address on host and device) -----

__device__ __forceinline__ long long prnn_ld_acquire_sys(const long long* p) {
    long long v;
    asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void prnn_st_release_sys(long long* p, long long v) {
    asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ prnn_u64 prnn_globaltimer() {
    prnn_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ---- mbarrier + st.async ---------------------------------------------------

__device__ __forceinline__ void prnn_mbar_init(prnn_u64* bar, prnn_u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(prnn_smem_addr(bar)), "r"(arrivals) : "memory");
}

// Makes mbarrier.init visible to the other blocks of the cluster, which will
// complete transactions on it remotely.
__device__ __forceinline__ void prnn_fence_mbar_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrive once and announce `bytes` of incoming st.async data for this phase.
// Peers' complete_tx may land before this; the phase still waits for both.
__device__ __forceinline__ void prnn_mbar_arrive_expect_tx(prnn_u64* bar, prnn_u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(prnn_smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ bool prnn_mbar_try_wait_cluster(prnn_u64* bar, prnn_u32 parity) {
    prnn_u32 done;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(prnn_smem_addr(bar)), "r"(parity)
        : "memory");
    return done;
}

// Wait for phase `parity` of a local mbarrier whose data come from peers.
// The phase shows no partial progress, so the bound is on the time this wait
// takes (clock jumps left out). Fails (status word set) when it runs out, and
// gives up at once when another block has failed: false either way, and
// thread 0 reports.
__device__ __forceinline__ bool prnn_mbar_wait_cluster(prnn_u64* bar, prnn_u32 parity, const prnn_watch& w) {
    if (prnn_mbar_try_wait_cluster(bar, parity)) return true;
    prnn_stall_clock clock;
    clock.restart();
    while (!prnn_mbar_try_wait_cluster(bar, parity)) {
        if (clock.tick()) {
            if (clock.expired(w.timeout_ns)) prnn_fail(w.status, PRNN_STATUS_CLUSTER_WAIT_TIMEOUT);
            if (prnn_failed(w.status)) {
                if (threadIdx.x == 0) prnn_report(w);
                return false;
            }
        }
    }
    return true;
}

// 16 bytes into a peer's shared memory; the peer's mbarrier counts the bytes
// (complete_tx carries release semantics at cluster scope).
__device__ __forceinline__ void prnn_st_async_v4(prnn_u32 remote_addr, float4 v, prnn_u32 remote_bar) {
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
            remote_addr),
        "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote_bar)
        : "memory");
}

// ---- asynchronous global -> shared copies ---------------------------------

// 4 bytes, bypassing registers; completes with the group it is committed in.
__device__ __forceinline__ void prnn_cp_async_4(void* smem_dst, const void* global_src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(prnn_smem_addr(smem_dst)), "l"(global_src)
                 : "memory");
}

// 16 bytes through L2 only (.cg): data another SM wrote during this launch
// must not be served from a stale L1 line.
__device__ __forceinline__ void prnn_cp_async_16_cg(void* smem_dst, const void* global_src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(prnn_smem_addr(smem_dst)), "l"(global_src)
                 : "memory");
}

__device__ __forceinline__ void prnn_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most `pending` committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void prnn_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory");
}

// ---- element types without toolkit headers ---------------------------------
// 16-bit floats travel as raw bits and are converted with PTX cvt, so no
// cuda_fp16.h / cuda_bf16.h is needed at run-time compile.

struct prnn_f16 { unsigned short bits; };
struct prnn_bf16 { unsigned short bits; };

__device__ __forceinline__ float prnn_to_float(float v) { return v; }
__device__ __forceinline__ float prnn_to_float(prnn_f16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}
__device__ __forceinline__ float prnn_to_float(prnn_bf16 v) {
    float f;
    asm("cvt.f32.bf16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T prnn_from_float(float v);
template <> __device__ __forceinline__ float prnn_from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ prnn_f16 prnn_from_float<prnn_f16>(float v) {
    prnn_f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
}
template <> __device__ __forceinline__ prnn_bf16 prnn_from_float<prnn_bf16>(float v) {
    prnn_bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
}

// ---- the pointwise functions of cells.py's expression language ------------

// The pointwise phase is on every step's critical path, so the sigmoid uses
// the hardware exponential and an approximate reciprocal (MUFU ex2 and rcp):
// within ~1.5e-6 relative for |x| <= 10, far inside the 1e-5 fp32 budget, and
// exact at both limits (e^-x -> inf gives 0, e^-x -> 0 gives 1). tanh stays
// the precise tanhf: 1 - 2/(e^2x + 1) loses relative accuracy near 0.
__device__ __forceinline__ float prnn_sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }
__device__ __forceinline__ float prnn_relu(float x) { return fmaxf(x, 0.0f); }
// x clamped to [-1, 1] (a clipped cell's gates, cells.with_clip); comparisons, not fminf/fmaxf, so that a
// NaN stays NaN instead of becoming a bound.
__device__ __forceinline__ float prnn_hardtanh(float x) { return x < -1.0f ? -1.0f : (x > 1.0f ? 1.0f : x); }
// 1 where x > 0, 0 where x <= 0, NaN kept (ONNX's ThresholdedRelu, cells.with_activations).
__device__ __forceinline__ float prnn_step(float x) { return x > 0.0f ? 1.0f : (x <= 0.0f ? 0.0f : x); }
// The derivatives the backward kernels' generated statements call (adjoint.RELU_GRAD, HARDTANH_GRAD):
// 0 at 0 and at the bounds, as torch's.
__device__ __forceinline__ float prnn_relu_grad(float x) { return x > 0.0f ? 1.0f : 0.0f; }
__device__ __forceinline__ float prnn_hardtanh_grad(float x) { return x > -1.0f && x < 1.0f ? 1.0f : 0.0f; }

// ---- tensor cores ------------------------------------------------------------

// Two floats as one 16-bit pair: lo in bits 0-15, hi in bits 16-31 (cvt's
// first source lands in the upper half).
template <typename T> __device__ __forceinline__ prnn_u32 prnn_pack2(float lo, float hi);
template <> __device__ __forceinline__ prnn_u32 prnn_pack2<prnn_f16>(float lo, float hi) {
    prnn_u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ prnn_u32 prnn_pack2<prnn_bf16>(float lo, float hi) {
    prnn_u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// fp32 -> TF32 (10-bit mantissa), rounded to nearest, ties away (cvt.rna):
// what cuBLAS and cuDNN round to; a plain fp32 operand would be truncated.
__device__ __forceinline__ prnn_u32 prnn_tf32(float v) {
    prnn_u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return r;
}

// d += a * b with a: 16x8 (row), b: 8x8 (col), TF32 inputs, fp32 accumulation.
__device__ __forceinline__ void prnn_mma_1688_tf32(float (&d)[4], prnn_u32 a0, prnn_u32 a1, prnn_u32 a2, prnn_u32 a3,
                                                   prnn_u32 b0, prnn_u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <typename T> struct prnn_mma_16816;
// d += a * b with a: 16x16 (row), b: 16x8 (col), fp32 accumulation.
template <> struct prnn_mma_16816<prnn_f16> {
    static __device__ __forceinline__ void run(float (&d)[4], const prnn_u32 (&a)[4], prnn_u32 b0, prnn_u32 b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct prnn_mma_16816<prnn_bf16> {
    static __device__ __forceinline__ void run(float (&d)[4], const prnn_u32 (&a)[4], prnn_u32 b0, prnn_u32 b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
