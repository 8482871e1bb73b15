// The FFMA row product of one work group, shared by the recurrence kernel
// (recurrence.cu) and the planner's calibration micro-benchmark
// (model_bench.cu), so the model is fitted on the code that runs.
//
// Needs PRNN_BT (batch columns per weight load), PRNN_WGS (lanes per work
// group) and PRNN_THREADS (threads per block: the stride of shared weights).

#define PRNN_FULL_MASK 0xffffffffu

// BT consecutive floats of one h row (BP is a multiple of 4 and of BT, so the
// vector loads are aligned).
template <int BT>
__device__ __forceinline__ void prnn_load_columns(const float* p, float (&v)[BT]) {
    if constexpr (BT % 4 == 0) {
#pragma unroll
        for (int q = 0; q < BT; q += 4) {
            const float4 f = *reinterpret_cast<const float4*>(p + q);
            v[q] = f.x, v[q + 1] = f.y, v[q + 2] = f.z, v[q + 3] = f.w;
        }
    } else if constexpr (BT == 2) {
        const float2 f = *reinterpret_cast<const float2*>(p);
        v[0] = f.x, v[1] = f.y;
    } else {
        v[0] = *p;
    }
}

// This work group's rows times the operand: for each of its rows r (weights
// w[r][j], lane + j * WGS the column) and each tile of BT batch columns
// b0, b0 + 1, ... in [0, Bc), the dot products with the operand's columns,
// reduced over the group's lanes; then finish(b0, sums), sums[r][bb] the
// product of row r and column b0 + bb, which every lane holds.
template <int RPW, int KCH, int KREG, typename Finish>
__device__ __forceinline__ void prnn_group_sums(const float (&w)[RPW][KREG > 0 ? KREG : 1], const float* w_shared,
                                                const float* operand, int lane, int BP, int Bc, Finish finish) {
    for (int b0 = 0; b0 < Bc; b0 += PRNN_BT) {
        float acc[RPW][PRNN_BT];
#pragma unroll
        for (int r = 0; r < RPW; ++r)
#pragma unroll
            for (int bb = 0; bb < PRNN_BT; ++bb) acc[r][bb] = 0.0f;
#pragma unroll
        for (int j = 0; j < KCH; ++j) {
            float hv[PRNN_BT];
            prnn_load_columns<PRNN_BT>(operand + (lane + j * PRNN_WGS) * BP + b0, hv);
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                // j is a constant once unrolled, so this picks registers or
                // shared memory at compile time (the clamp keeps the dead
                // branch's index in bounds).
                const float wv = j < KREG ? w[r][j < KREG ? j : 0] : w_shared[((j - KREG) * RPW + r) * PRNN_THREADS];
#pragma unroll
                for (int bb = 0; bb < PRNN_BT; ++bb) acc[r][bb] = fmaf(wv, hv[bb], acc[r][bb]);
            }
        }
#pragma unroll
        for (int offset = PRNN_WGS / 2; offset > 0; offset /= 2)
#pragma unroll
            for (int r = 0; r < RPW; ++r)
#pragma unroll
                for (int bb = 0; bb < PRNN_BT; ++bb)
                    acc[r][bb] += __shfl_xor_sync(PRNN_FULL_MASK, acc[r][bb], offset);
        finish(b0, acc);
    }
}

// prnn_group_sums, then store(r, b, value) on one lane per value, for r < rows.
template <int RPW, int KCH, int KREG, typename Store>
__device__ __forceinline__ void prnn_group_product(const float (&w)[RPW][KREG > 0 ? KREG : 1], const float* w_shared,
                                                   const float* operand, int lane, int BP, int Bc, int rows,
                                                   Store store) {
    prnn_group_sums<RPW, KCH, KREG>(w, w_shared, operand, lane, BP, Bc, [&](int b0, const float (&acc)[RPW][PRNN_BT]) {
        // Every lane holds every sum; spread the stores over the lanes.
#pragma unroll
        for (int r = 0; r < RPW; ++r)
            if (r < rows)
#pragma unroll
                for (int bb = 0; bb < PRNN_BT; ++bb)
                    if ((r * PRNN_BT + bb) % PRNN_WGS == lane) store(r, b0 + bb, acc[r][bb]);
    });
}

