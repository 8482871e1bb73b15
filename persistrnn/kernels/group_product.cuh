// The FFMA row product of one work group, shared by the recurrence kernel
// (recurrence.cu) and the planner's calibration micro-benchmark
// (model_bench.cu), so the model is fitted on the code that runs.
//
// Needs PRNN_BT (batch columns per weight load), PRNN_WGS (lanes per work
// group) and PRNN_THREADS (threads per block: the stride of shared weights);
// PRNN_KVEC (operand columns per load, below) defaults to 1.

#define PRNN_FULL_MASK 0xffffffffu

#ifndef PRNN_KVEC
#define PRNN_KVEC 1
#endif

// The operand column of a lane's chunk j of a row. PRNN_KVEC 1: lane + j * WGS,
// one float per load, the group's lanes on consecutive columns. PRNN_KVEC 4
// (the host sets it where an operand row is one float, a slice of one
// sequence at batch tile 1): each lane takes four consecutive columns with one
// 16-byte load, a quarter of the load instructions for the same bytes (at
// batch 1 the product issued 32 scalar loads per thread a step, the shared
// memory pipe's busiest work). Weights are laid out by the same function.
__device__ __forceinline__ int prnn_chunk_column(int lane, int j) {
    return (j / PRNN_KVEC * PRNN_WGS + lane) * PRNN_KVEC + j % PRNN_KVEC;
}

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
// w[r][j], prnn_chunk_column(lane, j) the column) and each tile of BT batch columns
// b0, b0 + 1, ... in [0, Bc), the dot products with the operand's columns,
// reduced over the group's lanes; then finish(b0, sums), sums[r][bb] the
// product of row r and column b0 + bb, which every lane holds.
template <int RPW, int KCH, int KREG, typename Finish>
__device__ __forceinline__ void prnn_group_sums(const float (&w)[RPW][KREG > 0 ? KREG : 1], const float* w_shared,
                                                const float* operand, int lane, int BP, int Bc, Finish finish) {
    static_assert(PRNN_KVEC == 1 || (PRNN_KVEC == 4 && PRNN_BT == 1 && KCH % 4 == 0),
                  "four columns per load need batch tile 1 and whole fours of chunks");
    for (int b0 = 0; b0 < Bc; b0 += PRNN_BT) {
        float acc[RPW][PRNN_BT];
#pragma unroll
        for (int r = 0; r < RPW; ++r)
#pragma unroll
            for (int bb = 0; bb < PRNN_BT; ++bb) acc[r][bb] = 0.0f;
#pragma unroll
        for (int j0 = 0; j0 < KCH; j0 += PRNN_KVEC) {
            // hv[q]: batch columns b0.. of column prnn_chunk_column(lane, j0 + q).
            float hv[PRNN_KVEC][PRNN_BT];
            if constexpr (PRNN_KVEC == 4) {
                // BP is 1 here (the host's condition), so the four columns are consecutive floats.
                const float4 f = *reinterpret_cast<const float4*>(operand + prnn_chunk_column(lane, j0) + b0);
                hv[0][0] = f.x, hv[1][0] = f.y, hv[2][0] = f.z, hv[3][0] = f.w;
            } else {
                prnn_load_columns<PRNN_BT>(operand + prnn_chunk_column(lane, j0) * BP + b0, hv[0]);
            }
#pragma unroll
            for (int q = 0; q < PRNN_KVEC; ++q) {
                const int j = j0 + q;
#pragma unroll
                for (int r = 0; r < RPW; ++r) {
                    // j is a constant once unrolled, so this picks registers or
                    // shared memory at compile time (the clamp keeps the dead
                    // branch's index in bounds).
                    const float wv =
                        j < KREG ? w[r][j < KREG ? j : 0] : w_shared[((j - KREG) * RPW + r) * PRNN_THREADS];
#pragma unroll
                    for (int bb = 0; bb < PRNN_BT; ++bb) acc[r][bb] = fmaf(wv, hv[q][bb], acc[r][bb]);
                }
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

