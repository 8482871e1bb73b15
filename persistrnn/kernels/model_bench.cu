// Calibration micro-benchmarks of the planner's cost model
// (persistrnn/plan/model.py), run once per device on one block (one SM).
//
// The product kernels build with PRNN_BENCH_MMA 0 and PRNN_BT, PRNN_WGS and
// PRNN_KCH set; the others with PRNN_BENCH_MMA 1 and PRNN_KCH (k tiles).
//
// Each kernel repeats one phase of a recurrence step `iterations` times; the
// host times two iteration counts and takes the difference, which cancels the
// launch and the prologue. The block size is a launch parameter, so one binary
// measures every count of warps per scheduler.
//
//   prnn_product_bench_R<RPW>_<reg|shared>: prnn_group_product (the kernel's
//       own FFMA row product) of RPW rows by PRNN_KCH column chunks per lane,
//       PRNN_BT batch columns per weight load, reduced over PRNN_WGS lanes;
//       weights in registers or in shared memory;
//   prnn_mma_bench_M<MTW>: MTW 16-row tiles by PRNN_KCH 16-column tiles of
//       bf16 mma.sync per warp, B fragments read from shared memory, two
//       accumulator chains per tile (as the recurrence kernel runs them);
//   prnn_barrier_bench: __syncthreads alone;
//   prnn_pointwise_bench: one LSTM-like pointwise element per thread (three
//       sigmoids, two tanh, shared-memory operands).
//
// Results land in `sink` so the compiler keeps the work; their values are
// meaningless. PRNN_THREADS, the stride of shared weights, is the run-time
// block size here (the host defines it as blockDim.x).

extern __shared__ __align__(16) float bench_smem[];

// A compiler barrier: operands are read again every iteration, as in a
// recurrence step where they changed.
#define PRNN_CLOBBER() asm volatile("" ::: "memory")

#if !PRNN_BENCH_MMA
template <int RPW, int KREG>
__device__ __forceinline__ void prnn_product_bench(const float* __restrict__ w_in, float* __restrict__ sink,
                                                   int iterations) {
    const int tid = threadIdx.x, lane = tid % PRNN_WGS, wg = tid / PRNN_WGS;
    const int operand_floats = PRNN_KCH * PRNN_WGS * PRNN_BT;
    float* operand = bench_smem;
    float* out = operand + operand_floats;                          // [threads / WGS * RPW][BT]
    float* w_shared = out + blockDim.x / PRNN_WGS * RPW * PRNN_BT;  // [(KCH - KREG) * RPW][threads]
    float w[RPW][KREG > 0 ? KREG : 1];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int j = 0; j < PRNN_KCH; ++j) {
            const float v = w_in[(tid * RPW + r) * PRNN_KCH + j];
            if (j < KREG)
                w[r][j < KREG ? j : 0] = v;
            else
                w_shared[((j - KREG) * RPW + r) * blockDim.x + tid] = v;
        }
    for (int i = tid; i < operand_floats; i += blockDim.x) operand[i] = w_in[i] * 0.5f;
    __syncthreads();
    for (int it = 0; it < iterations; ++it) {
        PRNN_CLOBBER();
        prnn_group_product<RPW, PRNN_KCH, KREG>(w, w_shared + tid, operand, lane, PRNN_BT, PRNN_BT, RPW,
                                                [&](int r, int b, float v) { out[(wg * RPW + r) * PRNN_BT + b] = v; });
    }
    __syncthreads();
    sink[tid] = out[tid % (blockDim.x / PRNN_WGS * RPW * PRNN_BT)];
}

#define PRNN_PRODUCT_BENCH(RPW)                                                                                   \
    extern "C" __global__ void prnn_product_bench_R##RPW##_reg(const float* w, float* sink, int iterations) {    \
        prnn_product_bench<RPW, PRNN_KCH>(w, sink, iterations);                                                   \
    }                                                                                                             \
    extern "C" __global__ void prnn_product_bench_R##RPW##_shared(const float* w, float* sink, int iterations) { \
        prnn_product_bench<RPW, 0>(w, sink, iterations);                                                          \
    }
PRNN_PRODUCT_BENCH(1)
PRNN_PRODUCT_BENCH(2)
PRNN_PRODUCT_BENCH(4)
PRNN_PRODUCT_BENCH(8)

#else  // PRNN_BENCH_MMA: the tensor-core product and the other phases

template <int MTW>
__device__ __forceinline__ void prnn_mma_bench(const prnn_u32* __restrict__ a_in, float* __restrict__ sink,
                                               int iterations) {
    const int tid = threadIdx.x, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
    prnn_u32 a[MTW][PRNN_KCH][4];
#pragma unroll
    for (int m = 0; m < MTW; ++m)
#pragma unroll
        for (int k = 0; k < PRNN_KCH; ++k)
#pragma unroll
            for (int i = 0; i < 4; ++i) a[m][k][i] = a_in[((tid * MTW + m) * PRNN_KCH + k) * 4 + i];
    // The operand as the kernel holds it: [16 * KCH rows][8 + 4 columns].
    constexpr int BP = 12;
    for (int i = tid; i < PRNN_KCH * 16 * BP; i += blockDim.x) bench_smem[i] = (float)(i % 7) * 0.125f;
    __syncthreads();
    float total = 0.0f;
    for (int it = 0; it < iterations; ++it) {
        PRNN_CLOBBER();
        float acc[MTW][2][4] = {};
#pragma unroll
        for (int k = 0; k < PRNN_KCH; ++k) {
            const float* col = bench_smem + (k * 16 + 2 * tig) * BP + gid;
            const prnn_u32 b_lo = prnn_pack2<prnn_bf16>(col[0], col[BP]);
            const prnn_u32 b_hi = prnn_pack2<prnn_bf16>(col[8 * BP], col[9 * BP]);
#pragma unroll
            for (int m = 0; m < MTW; ++m) prnn_mma_16816<prnn_bf16>::run(acc[m][k & 1], a[m][k], b_lo, b_hi);
        }
#pragma unroll
        for (int m = 0; m < MTW; ++m)
#pragma unroll
            for (int i = 0; i < 4; ++i) total += acc[m][0][i] + acc[m][1][i];
    }
    sink[tid] = total;
}

#define PRNN_MMA_BENCH(MTW)                                                                             \
    extern "C" __global__ void prnn_mma_bench_M##MTW(const prnn_u32* a, float* sink, int iterations) { \
        prnn_mma_bench<MTW>(a, sink, iterations);                                                       \
    }
PRNN_MMA_BENCH(1)
PRNN_MMA_BENCH(2)
PRNN_MMA_BENCH(4)
PRNN_MMA_BENCH(8)

extern "C" __global__ void prnn_barrier_bench(const float* w_in, float* sink, int iterations) {
    for (int it = 0; it < iterations; ++it) __syncthreads();
    sink[threadIdx.x] = w_in[threadIdx.x];
}

extern "C" __global__ void prnn_pointwise_bench(const float* w_in, float* sink, int iterations) {
    const int tid = threadIdx.x, n = blockDim.x;
    for (int g = 0; g < 5; ++g) bench_smem[g * n + tid] = w_in[g * n + tid];
    __syncthreads();
    for (int it = 0; it < iterations; ++it) {
        PRNN_CLOBBER();
        const float i = prnn_sigmoid(bench_smem[tid]), f = prnn_sigmoid(bench_smem[n + tid]);
        const float g = tanhf(bench_smem[2 * n + tid]), o = prnn_sigmoid(bench_smem[3 * n + tid]);
        const float c = f * bench_smem[4 * n + tid] + i * g;
        bench_smem[4 * n + tid] = c;
        bench_smem[tid] = o * tanhf(c);
    }
    sink[tid] = bench_smem[tid];
}
#endif
