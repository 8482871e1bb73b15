// Persistent recurrence: one launch runs every time step of one RNN layer.
//
// The input projection x @ W_ih^T + b_ih of all steps is one GEMM before this
// kernel (xw below); the kernel runs only h_t = cell(xw_t, W_hh h_{t-1} + b_hh).
//
// Output-based tiling (GRNN section 5): block `blk` owns hidden units
// [blk*U, blk*U + U) and every gate row of those units, so the cell's pointwise
// math is local and a step ends with one exchange of the new h slice. A cell
// whose matrix products depend on each other (reset-before GRU) runs them as
// stages, one exchange after each.
//
// Thread mapping (GRNN section 6): the block's THREADS threads form NWG work
// groups of WGS lanes. A work group owns RPW rows of a stage (rows wg,
// wg + NWG, ...); lane l holds the weights of columns l, l + WGS, ... of those
// rows, so one row's dot product is WGS partial sums reduced with shuffles.
// Weights live in registers under compile-time indices; the last SHARED_K of a
// thread's KPT column chunks live in shared memory instead.
//
// PRNN_ONE_SYNC (reset-before GRU, GRNN Fig. 7b) removes the exchange between
// r and U_n (r * h): U_r is partitioned by columns instead, so right after a
// block computes its slice of h_t it multiplies U_r[:, slice] by it, for every
// row, and sends these partial sums (with its own units' x_r + b_r folded in)
// along with the slice. After the one exchange every block sums the partials
// into r for every unit, and runs U_z h and U_n (r * h) for its own rows.
//
// PRNN_FUSED (one-stage cells, work groups = units per block): work group
// wg holds every gate row of unit wg, so the pointwise update runs in the
// lanes right after the group's reduction, with no gates buffer and no
// barrier between product and pointwise (see the stage loop).
//
// With PRNN_MMA the matrix product runs on tensor cores instead (16-bit
// weights, mma.sync m16n8k16, fp32 accumulation; fp32 weights as TF32,
// PRNN_TF32, two m16n8k8 per 16-column tile): a warp is the work group, and
// PRNN_KS warps split a row tile's K, each leaving a partial product that
// the pointwise phase sums.
//
// Exchange, by PRNN_SYNC:
//   0 single block: __syncthreads;
//   1 cluster: each block st.async-pushes its slice into every peer's shared
//     memory, completing on the receiver's mbarrier (one per buffer);
//   2 grid: slices go to a global double buffer, then a counter barrier that
//     only grows; every block then reads the whole vector back. With
//     PRNN_TAGGED each h value goes to the buffer with its exchange's tag in
//     one 64-bit word instead, and every block polls the whole vector back
//     (prnn_read_tagged): one L2 round trip, no barrier.
// h travels in shared memory as [KPAD][BP]: row k holds unit k for every batch
// column, so a block's slice is one contiguous run and BT batch columns are
// one vector load. Exchange e (stage s of step t is e = t * STAGES + s) lands
// in buffer e & 1; the initial state is exchange -1, buffer 1. A grid block of
// a one-stage cell without tagged words keeps one buffer (PRNN_HBUFS 1): its
// values go to L2, not to its shared h, and every read of h_{t-1} (product,
// pointwise) precedes the barrier before its arrival, after which the copy
// of h_t from L2 may overwrite it. At H = 1024 the second buffer was most of a
// block's shared memory, so this doubles the sequences a launch holds.
//
// Instances (PRNN_INSTANCES > 1): one launch runs several independent
// recurrences on disjoint blocks (sync 'single': a block each; 'cluster': a
// cluster each), each with its own pointers (the generated PRNN_INSTANCE_*
// parameters), e.g. the two directions of a bidirectional layer. A reverse
// instance runs its sequence from the last step to the first.
//
// Batch slices (blockIdx.y): the launch's `batch` sequences run as
// independent slices of B, each on its own blocks (a block, a cluster, or
// the instances' blocks), all at once where the GPU holds them: a batch
// that one cluster runs step by step at B columns a product instead runs at
// the cost of one slice (the planner picks B). Slice y reads and writes
// sequences [y * B, y * B + B) of the same tensors; the last slice may be
// shorter. Slices never wait for each other (grid sync runs
// one slice: its barrier spans the launch).
//
// PRNN_PIPELINE: the instances are consecutive layers, fused. Instance i
// also multiplies the next layer's input weights by its own new h (one step
// late, beside its own product on the same operand), adds b_ih, and writes
// the result to `pipe` in the next instance's shared-memory slot layout
// [T][NB][G*U][BP], then counts the steps in progress[i] (release, every
// RELEASE_EVERY steps). Instance i + 1 prefetches its projections from there
// instead of xw, once all NB producer blocks counted the step (acquire). So
// layer l + 1 runs up to DEPTH + RELEASE_EVERY steps behind layer l: L layers
// take about T + (L - 1) * (DEPTH + RELEASE_EVERY) steps instead of L * T.
// A producer never waits
// for its consumer (pipe holds every step), so the fused launch cannot
// deadlock even if its instances are not all resident at once.
//
// PRNN_RESIDENT: the launch stays and serves ticks of a serving engine
// (persistrnn.serve, resident mode): the weights load once, then per tick
// block 0 waits for the tick's doorbell in pinned host memory, the blocks
// compute the tick's input projections from input rows read straight from
// host memory (W_ih from global memory, through L1), gather each row's
// states from a slot of the engine's state pool, run the tick's steps,
// write the output rows to host memory and the new states to their slots,
// and block 0 echoes the tick's number (see prnn_next_tick). One instance,
// sync 'single' or 'cluster', one batch slice.
//
// Configuration macros come from persistrnn/persistent.py (KernelConfig),
// together with the cell's generated pointwise functions and the instance
// parameter lists.

#define PRNN_NWG (PRNN_THREADS / PRNN_WGS)

typedef PRNN_IO_T io_t;  // h0, c0, outputs and weights: the layer's dtype

struct prnn_smem_layout {
    float* hbuf;    // [HBUFS][KPAD][BP]
    float* gates;   // [KS][G][U][BP]  recurrent products W_hh h, KS partials (b_hh is added pointwise)
    float* bias;    // [G][U]          b_hh of this block's rows, then [G][U] b_ih's (PRNN_XW_BIAS)
    float* xw;      // [DEPTH+1][G][U][BP]  input projections, prefetched DEPTH steps ahead
    float* c;       // [U][BP]         cell state (cells that carry one)
    float* w;       // weights that do not fit in registers
    float* part;    // one-sync: [2][NB][PROWS][BP] every block's partial sums of U_r h (+ x_r + b_r)
    float* rh;      // one-sync: [KPAD][BP] r * h for every unit
    float* bias_next;  // pipeline: [G][U] b_ih of the next layer's rows
    float* w_next;     // pipeline: the next layer's input weights that do not fit in registers
    int* slots;        // resident: [2][BP] per row the slot its states are read from, then written to
    float* w_ih;       // resident: [XROWS][I] W_ih's rows of this block's units (g*U + u), then b_ih's [XROWS]
};

// b_ih of this block's rows, added to xw (zeros where xw holds it); an
// offset from L.bias rather than a pointer of its own, which would hold a
// register through the step loop (a two-instance build spilled with one).
#define PRNN_XW_BIAS (L.bias + PRNN_BIAS_FLOATS)

#define PRNN_HBUF(e) (L.hbuf + (PRNN_HBUFS == 2 ? (e) & 1 : 0) * PRNN_KPAD * BP)  // exchange e's h

__device__ __forceinline__ prnn_smem_layout prnn_layout(float* base, int BP) {
    prnn_smem_layout L;
    L.hbuf = base;
    L.gates = L.hbuf + PRNN_HBUFS * PRNN_KPAD * BP;
    L.xw = L.gates + PRNN_KS * PRNN_G * PRNN_U * BP;
    L.c = L.xw + (PRNN_XW_DEPTH + 1) * PRNN_G * PRNN_U * BP;
    L.bias = L.c + (PRNN_HAS_C ? PRNN_U * BP : 0);
    L.w = L.bias + 2 * PRNN_BIAS_FLOATS;
    L.part = L.w + PRNN_SHARED_W_FLOATS;
    L.rh = L.part + (PRNN_ONE_SYNC ? 2 * PRNN_NB * PRNN_PROWS * BP : 0);
    L.bias_next = L.rh + (PRNN_ONE_SYNC ? PRNN_KPAD * BP : 0);
    L.w_next = L.bias_next + (PRNN_PIPELINE ? PRNN_BIAS_FLOATS : 0);
    L.slots = reinterpret_cast<int*>(L.w_next);  // a resident kernel runs no pipeline: w_next's region is empty
    L.w_ih = reinterpret_cast<float*>(L.slots + (PRNN_RESIDENT ? 2 * BP : 0));
    return L;
}

// The generated prnn_stage_gate, prnn_between and prnn_pointwise go here.
// ---- kernel ----

// One stage's matrix product for this thread's work group:
// gates[gate][u][b] = W_hh[gate*H + u, :] . operand[:, b]
// for the stage's rows and batch columns [0, Bc).
template <int STAGE, int NG, int RPW, int KREG>
__device__ __forceinline__ void prnn_stage_matmul(const float (&w)[RPW][KREG > 0 ? KREG : 1],
                                                  const float* w_shared, const float* operand, float* gates,
                                                  int wg, int lane, int BP, int Bc) {
    // The stage's gates are consecutive, so its rows are consecutive in
    // `gates` and a row's address needs no division (per-row divisions were
    // hoisted out of the time loop into registers, and spilled).
    float* stage_gates = gates + (prnn_stage_gate(STAGE, 0) * PRNN_U + wg) * BP;
    const int rows = (NG * PRNN_U - wg + PRNN_NWG - 1) / PRNN_NWG;  // this group's valid rows
    prnn_group_product<RPW, PRNN_KPT, KREG>(w, w_shared, operand, lane, BP, Bc, rows, [&](int r, int b, float v) {
        stage_gates[r * PRNN_NWG * BP + b] = v;
    });
}

// Registers (and shared overflow) of this thread's rows of NG consecutive
// gates from `first_gate` (one stage's, or the next layer's input weights).
template <int NG, int RPW, int KREG>
__device__ __forceinline__ void prnn_load_row_weights(const io_t* __restrict__ w_hh, int first_gate,
                                                      float (&w)[RPW][KREG > 0 ? KREG : 1], float* w_shared,
                                                      int blk, int wg, int lane) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int row = wg + r * PRNN_NWG;
        const int unit = blk * PRNN_U + row % PRNN_U;
        const bool valid = row < NG * PRNN_U && unit < PRNN_H;
        const int grow = valid ? (first_gate + row / PRNN_U) * PRNN_H + unit : 0;
#pragma unroll
        for (int j = 0; j < PRNN_KPT; ++j) {
            const int k = lane + j * PRNN_WGS;
            const float v = valid && k < PRNN_H ? prnn_to_float(w_hh[(long long)grow * PRNN_H + k]) : 0.0f;
            if (j < KREG)
                w[r][j < KREG ? j : 0] = v;
            else
                w_shared[((j - KREG) * RPW + r) * PRNN_THREADS] = v;
        }
    }
}

#if PRNN_MMA
// Tensor-core product. Warp w is K-group w % KS of row group w / KS; it holds
// the A fragments of MTW 16-row tiles (tiles m, m + WM, ...) by KTW 16-column
// tiles in registers. B is 8 batch columns of the operand, rounded to 16 bits
// as it is read. Fragment layout (PTX ISA, mma.m16n8k16), lane = 4*gid + tig:
//   A rows gid, gid+8 x columns 2tig+{0,1}, 2tig+8+{0,1} (registers 0-3:
//     (gid, k), (gid+8, k), (gid, k+8), (gid+8, k+8));
//   B batch column gid x rows 2tig+{0,1}, 2tig+8+{0,1};
//   C rows gid, gid+8 x batch columns 2tig+{0,1}.
// TF32 (PRNN_TF32: fp32 weights, mma.m16n8k8 on each 8-column half h of a
// tile): A register 4h + i holds one value, rows gid, gid+8 x columns
// 8h + tig, 8h + tig + 4 (i as above); B rows 8h + tig, 8h + tig + 4 of
// batch column gid; C as above. Weights are rounded to TF32 once, at load;
// h as it is read.
#define PRNN_WM (PRNN_THREADS / 32 / PRNN_KS)
#define PRNN_AREGS (PRNN_TF32 ? 8 : 4)  // A registers per 16 x 16 tile

template <int STAGE, int NG, int MTW>
__device__ __forceinline__ void prnn_load_stage_fragments(const io_t* __restrict__ w_hh,
                                                          prnn_u32 (&a)[MTW][PRNN_KTW][PRNN_AREGS], int blk,
                                                          int warp, int lane) {
    const int mgroup = warp / PRNN_KS, kgroup = warp % PRNN_KS, gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int m = 0; m < MTW; ++m)
#pragma unroll
        for (int kt = 0; kt < PRNN_KTW; ++kt)
#pragma unroll
            for (int i = 0; i < PRNN_AREGS; ++i) {
                const int row = (mgroup + m * PRNN_WM) * 16 + gid + (i & 1) * 8;
                const int unit = blk * PRNN_U + row % PRNN_U;
                const bool valid = row < NG * PRNN_U && unit < PRNN_H;
                const long long base = valid ? (long long)(prnn_stage_gate(STAGE, row / PRNN_U) * PRNN_H + unit) * PRNN_H : 0;
#if PRNN_TF32
                const int k = (kgroup * PRNN_KTW + kt) * 16 + (i >> 2) * 8 + tig + (i >> 1 & 1) * 4;
                a[m][kt][i] = valid && k < PRNN_H ? prnn_tf32(w_hh[base + k]) : 0u;
#else
                const int k = (kgroup * PRNN_KTW + kt) * 16 + 2 * tig + (i >> 1) * 8;
                const prnn_u32 lo = valid && k < PRNN_H ? w_hh[base + k].bits : 0u;
                const prnn_u32 hi = valid && k + 1 < PRNN_H ? w_hh[base + k + 1].bits : 0u;
                a[m][kt][i] = lo | hi << 16;
#endif
            }
}

template <int STAGE, int NG, int MTW>
__device__ __forceinline__ void prnn_stage_mma(const prnn_u32 (&a)[MTW][PRNN_KTW][PRNN_AREGS], const float* operand,
                                               float* gates, int warp, int lane, int BP, int Bc) {
    constexpr int ROWS = NG * PRNN_U, MT = (ROWS + 15) / 16;
    const int mgroup = warp / PRNN_KS, kgroup = warp % PRNN_KS, gid = lane >> 2, tig = lane & 3;
    float* part = gates + (kgroup * PRNN_G + prnn_stage_gate(STAGE, 0)) * PRNN_U * BP;
    const float* column = operand + (kgroup * PRNN_KTW * 16 + (PRNN_TF32 ? tig : 2 * tig)) * BP + gid;
    for (int b0 = 0; b0 < Bc; b0 += 8) {
        // Two accumulators per tile, alternating by k tile (TF32: by 8-column
        // half), halve the chain of dependent mma latencies.
        float acc[MTW][2][4];
#pragma unroll
        for (int m = 0; m < MTW; ++m)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[m][i / 4][i % 4] = 0.0f;
#pragma unroll
        for (int kt = 0; kt < PRNN_KTW; ++kt) {
            const float* p = column + kt * 16 * BP + b0;
#if PRNN_TF32
            const prnn_u32 b0_lo = prnn_tf32(p[0]), b0_hi = prnn_tf32(p[4 * BP]);
            const prnn_u32 b1_lo = prnn_tf32(p[8 * BP]), b1_hi = prnn_tf32(p[12 * BP]);
#pragma unroll
            for (int m = 0; m < MTW; ++m)
                if (mgroup + m * PRNN_WM < MT) {
                    const prnn_u32(&f)[PRNN_AREGS] = a[m][kt];
                    prnn_mma_1688_tf32(acc[m][0], f[0], f[1], f[2], f[3], b0_lo, b0_hi);
                    prnn_mma_1688_tf32(acc[m][1], f[4], f[5], f[6], f[7], b1_lo, b1_hi);
                }
#else
            const prnn_u32 b_lo = prnn_pack2<io_t>(p[0], p[BP]);
            const prnn_u32 b_hi = prnn_pack2<io_t>(p[8 * BP], p[9 * BP]);
#pragma unroll
            for (int m = 0; m < MTW; ++m)
                if (mgroup + m * PRNN_WM < MT) prnn_mma_16816<io_t>::run(acc[m][kt & 1], a[m][kt], b_lo, b_hi);
#endif
        }
#pragma unroll
        for (int m = 0; m < MTW; ++m) {
            const int row = (mgroup + m * PRNN_WM) * 16 + gid;
            float* dst = part + row * BP + b0 + 2 * tig;
            if (row < ROWS) {
                dst[0] = acc[m][0][0] + acc[m][1][0];
                dst[1] = acc[m][0][1] + acc[m][1][1];
            }
            if (row + 8 < ROWS) {
                dst[8 * BP] = acc[m][0][2] + acc[m][1][2];
                dst[8 * BP + 1] = acc[m][0][3] + acc[m][1][3];
            }
        }
    }
}
#endif

// This thread's share of the (row, batch column) pairs i = row * B + b,
// i = tid, tid + THREADS, ...: the first pair and the stride, divided once.
// Dividing by the run-time B inside the step loops cost ~20 instructions per
// division on the critical path of every step.
struct prnn_walk {
    int row0, b0, drow, db;
};

// Pairs (row, column < columns) dealt to `count` threads, this one the
// index-th: index, index + count, ... in row-major order.
__device__ __forceinline__ prnn_walk prnn_walk_of(int columns, int index, int count) {
    return {index / columns, index % columns, count / columns, count % columns};
}

__device__ __forceinline__ prnn_walk prnn_make_walk(int columns) {
    return prnn_walk_of(columns, (int)threadIdx.x, PRNN_THREADS);
}

// Warps 0 .. prnn_busy_warps(B) - 1 run the pointwise update of B columns
// (a thread per unit and column).
__device__ __forceinline__ int prnn_busy_warps(int B) { return (PRNN_U * B + 31) / 32; }

// Warps that copy the next projections during the pointwise update of B
// columns (PRNN_EARLY_PREFETCH): those on the schedulers (warp w on w % 4)
// that no updating warp issues on. 0: none. A copying warp's rank among
// them: prnn_copier_rank.
__device__ __forceinline__ int prnn_copying_warps(int B) {
    const int busy = prnn_busy_warps(B), warps = PRNN_THREADS / 32;
    return warps / 4 * max(4 - busy, 0) + max(warps % 4 - busy, 0);
}

__device__ __forceinline__ int prnn_copier_rank(int B, int warp) {
    const int busy = prnn_busy_warps(B);
    return (warp / 4) * (4 - busy) + warp % 4 - busy;
}

#define PRNN_FOR_PAIRS(walk, rows, B, row, b)                                                   \
    for (int row = (walk).row0, b = (walk).b0; row < (rows);                                    \
         row += (walk).drow, b += (walk).db, row += b >= (B) ? 1 : 0, b -= b >= (B) ? (B) : 0)

// The sequence position column b reads at step t: t, or for a reverse
// instance its last valid position first (len - 1 - t). A step at or past
// the column's length (it keeps its state) reads position t.
// Steps of column b: its length where PRNN_LENGTHS compiled them in, else T
// (a constant then, so launches without lengths carry none of their code).
__device__ __forceinline__ int prnn_length(const int* __restrict__ lengths, int b, int T) {
#if PRNN_LENGTHS
    return __ldg(lengths + b);
#else
    return T;
#endif
}

__device__ __forceinline__ int prnn_position(int t, int b, bool reverse, const int* __restrict__ lengths, int T) {
    const int len = prnn_length(lengths, b, T);
    return reverse && t < len ? len - 1 - t : t;
}

// xw[position][b][g*H + u] for this block's units -> slot t of xs,
// [g][u][b], asynchronously.
__device__ __forceinline__ void prnn_prefetch_xw(const float* __restrict__ xw, float* xs, int t, bool reverse,
                                                 const int* __restrict__ lengths, int T, int B, int BP,
                                                 long long step_stride, int blk, prnn_walk walk, int slice0) {
    xs += (t % (PRNN_XW_DEPTH + 1)) * PRNN_G * PRNN_U * BP;
    PRNN_FOR_PAIRS(walk, PRNN_G * PRNN_U, B, gu, b) {
        const int u = gu % PRNN_U, g = gu / PRNN_U, unit = blk * PRNN_U + u;
        const int seq = slice0 + b;
        const float* src = xw + prnn_position(t, seq, reverse, lengths, T) * step_stride;
        if (unit < PRNN_H) prnn_cp_async_4(xs + gu * BP + b, src + (long long)seq * PRNN_G * PRNN_H + g * PRNN_H + unit);
    }
    prnn_cp_async_commit();
}

#if PRNN_FUSED
// Fused step: thread (wg, lane) copies exactly the projections it updates,
// unit wg's gates for batch columns lane, lane + BT, ... (lane < BT), so its
// own cp.async wait is all that orders them before its reads.
__device__ __forceinline__ void prnn_prefetch_xw_owned(const float* __restrict__ xw, float* xs, int t, bool reverse,
                                                       const int* __restrict__ lengths, int T, int B, int BP,
                                                       long long step_stride, int blk, int wg, int lane, int slice0) {
    xs += (t % (PRNN_XW_DEPTH + 1)) * PRNN_G * PRNN_U * BP;
    const int unit = blk * PRNN_U + wg;
    if (lane < PRNN_BT && unit < PRNN_H)
        for (int b = lane; b < B; b += PRNN_BT) {
            const int seq = slice0 + b;
            const float* src = xw + prnn_position(t, seq, reverse, lengths, T) * step_stride +
                               (long long)seq * PRNN_G * PRNN_H + unit;
#pragma unroll
            for (int g = 0; g < PRNN_G; ++g) prnn_cp_async_4(xs + (g * PRNN_U + wg) * BP + b, src + g * PRNN_H);
        }
    prnn_cp_async_commit();
}
#endif

#if PRNN_SYNC == 2 && !PRNN_TAGGED
// Grid mode: the whole exchanged vector, L2 -> shared, every step. Loads go
// out PRNN_COPY_BATCH at a time before any store: one load per loop trip
// paid a full L2 round trip each (~5 µs per step at H=256, batch 20).
#define PRNN_COPY_BATCH 8
__device__ __forceinline__ void prnn_copy_from_l2(float4* dst, const float4* src, int n) {
    for (int q0 = threadIdx.x; q0 < n; q0 += PRNN_THREADS * PRNN_COPY_BATCH) {
        float4 v[PRNN_COPY_BATCH];
#pragma unroll
        for (int c = 0; c < PRNN_COPY_BATCH; ++c)
            if (q0 + c * PRNN_THREADS < n) v[c] = __ldcg(src + q0 + c * PRNN_THREADS);
#pragma unroll
        for (int c = 0; c < PRNN_COPY_BATCH; ++c)
            if (q0 + c * PRNN_THREADS < n) dst[q0 + c * PRNN_THREADS] = v[c];
    }
}
#endif

#if PRNN_TAGGED
// Grid exchange in one L2 round trip (NCCL's LL protocol): each h value goes
// to L2 with its exchange's tag (e + 1; the buffer starts zeroed each launch)
// in one 64-bit word, single-copy atomic, so a reader that sees the tag has
// the value: no release, no counter barrier, no second read. At LSTM 1024
// batch 1 the barrier's exchange cost ~1.1 us of a 1.8 us step (a GPU-scope
// release 0.36, the barrier and the copy 0.62-0.77), this one 0.66 us
// (perf-notes §50, §51); with more words per thread than one round of loads
// it is slower than the copy's float4s, so the planner offers it only for
// exchanges of up to PRNN_READ_BATCH words per thread. Two buffers by
// parity: a block writes exchange e + 2 over e only after reading every
// block's e + 1, which each wrote after reading e. (The words: common.cuh.)
// Exchange `tag`'s h, every unit and the slice's B columns, from the tagged
// words at src into dst (both [KPAD][BP]), this thread's pairs of `walk`.
// PRNN_READ_BATCH loads go out before any is checked, as the copy's do.
// False if a wait failed.
__device__ __forceinline__ bool prnn_read_tagged(float* dst, const prnn_u64* src, prnn_u32 tag, int B, int BP,
                                                 prnn_walk walk, const prnn_watch& w) {
    int k = walk.row0, b = walk.b0;
    while (k < PRNN_H) {
        int at[PRNN_READ_BATCH];
        prnn_u64 word[PRNN_READ_BATCH];
#pragma unroll
        for (int c = 0; c < PRNN_READ_BATCH; ++c) {
            at[c] = k < PRNN_H ? k * BP + b : -1;
            if (at[c] >= 0) word[c] = prnn_ld_tagged(src + at[c]);
            k += walk.drow;
            b += walk.db;
            if (b >= B) {
                b -= B;
                ++k;
            }
        }
#pragma unroll
        for (int c = 0; c < PRNN_READ_BATCH; ++c) {
            if (at[c] < 0) break;
            if ((prnn_u32)(word[c] >> 32) != tag && !prnn_wait_tagged(src + at[c], tag, w, &word[c])) return false;
            dst[at[c]] = __uint_as_float((prnn_u32)word[c]);
        }
    }
    return true;
}
#endif

#if PRNN_PIPELINE
// Step t's projections from the previous layer's producer blocks:
// pipe[t][blk] (already in the slot layout) -> slot t of xs. Warp 0 waits
// for every producer block's count of step t, then copies 16 bytes a lane.
// Thread 0 keeps the count it saw last in *seen and reads the counter again
// only when that is not enough: an acquire is an L2 round trip, and each one
// on every step measured ~0.4 us per step. False (in warp 0) if the wait
// failed.
__device__ __forceinline__ bool prnn_prefetch_pipe(const float* __restrict__ pipe, const prnn_u32* progress, float* xs,
                                                   int t, int BP, int blk, const prnn_watch& watch, prnn_u32* seen) {
    const int floats = PRNN_G * PRNN_U * BP;  // a multiple of 4: U % 4 == 0 or BP % 4 == 0
    int ready = 1;
    if (threadIdx.x < 32) {
        const prnn_u32 target = (prnn_u32)(PRNN_NB * (t + 1));
        if (threadIdx.x == 0 && *seen < target)
            ready = prnn_wait_counter(progress, target, watch, PRNN_STATUS_PIPELINE_WAIT_TIMEOUT, seen);
        ready = __shfl_sync(PRNN_FULL_MASK, ready, 0);
        if (ready) {
            const float* src = pipe + ((long long)t * PRNN_NB + blk) * floats;
            float* dst = xs + (t % (PRNN_XW_DEPTH + 1)) * floats;
            for (int q = threadIdx.x * 4; q < floats; q += 32 * 4) prnn_cp_async_16_cg(dst + q, src + q);
        }
    }
    prnn_cp_async_commit();
    return ready;
}
#endif

#if PRNN_SYNC == 1
// `vectors` float4s at `mine` into the same place in every peer's shared
// memory, completing on the peers' `bar`. One (peer, vector) pair per thread
// and pass, consecutive threads storing consecutive vectors to one peer, so a
// warp's stores coalesce (a warp whose stores went to 15 peers cost +0.25 us
// per step; a loop over peers inside one thread serialised them).
__device__ __forceinline__ void prnn_push_to_peers(const float* mine, prnn_u64* bar, int blk, int vectors,
                                                   prnn_walk walk) {
    const prnn_u32 addr = prnn_smem_addr(mine), bar_addr = prnn_smem_addr(bar);
    PRNN_FOR_PAIRS(walk, PRNN_NB - 1, vectors, p, q) {
        const prnn_u32 rank = (blk + 1 + p) % PRNN_NB;
        const float4 v = reinterpret_cast<const float4*>(mine)[q];
        prnn_st_async_v4(prnn_peer_addr(addr + 16 * q, rank), v, prnn_peer_addr(bar_addr, rank));
    }
}
#endif

#if PRNN_RESIDENT
// Warp 0 of block 0: lane w's word of tick `tick`'s descriptor (PRNN_CTL_*
// words of the control block `ctl`, int64 in pinned host memory: steps,
// rows, and the addresses of the input rows, output rows, gather and
// scatter slots and the projections' scratch), once the host has rung the
// tick's doorbell; steps 0 (lane 0's word) to leave, when the stop word is
// set, when no doorbell came for idle_ns, or when the launch has run
// lifetime_ns (a device-wide synchronise elsewhere in the process waits for
// this launch, so it must not run on forever; the host launches again for
// the next tick). Lane 0 polls; the lanes then read the words at once, one
// host round trip (read one after another by one thread, ~7 µs a tick).
__device__ __forceinline__ long long prnn_next_tick(const long long* ctl, long long tick, prnn_u64 launched,
                                                    prnn_u64 idle_ns, prnn_u64 lifetime_ns) {
    const volatile long long* words = ctl;
    const int lane = threadIdx.x % 32;
    int go = 0;
    if (lane == 0) {
        const prnn_u64 idle_from = prnn_globaltimer();
        for (;;) {
            const prnn_u64 now = prnn_globaltimer();
            if (now - launched > lifetime_ns || words[PRNN_CTL_STOP]) break;
            if (prnn_ld_acquire_sys(ctl + PRNN_CTL_DOORBELL) >= tick) {
                go = 1;
                break;
            }
            if (now - idle_from > idle_ns) break;
            __nanosleep(64);
        }
    }
    go = __shfl_sync(PRNN_FULL_MASK, go, 0);
    __syncwarp();
    return go && lane < PRNN_TICK_WORDS ? words[PRNN_CTL_TICK + lane] : 0;
}

// The block's projection rows (g*U + u for its units), padded to a multiple
// of PRNN_XW_ROWS: a resident launch keeps them in shared memory, W_ih's row
// g*H + unit each, then b_ih's values (zeros past H and past G*U).
#define PRNN_XROWS ((PRNN_G * PRNN_U + PRNN_XW_ROWS - 1) / PRNN_XW_ROWS * PRNN_XW_ROWS)
#define PRNN_HOST_BATCH 16  // host-memory loads a thread has in flight at once
__device__ __forceinline__ void prnn_load_input_weights(const io_t* __restrict__ w_ih, const io_t* __restrict__ b_ih,
                                                        float* w, int blk) {
    for (int i = threadIdx.x; i < PRNN_XROWS * (PRNN_I + 1); i += PRNN_THREADS) {
        const bool bias = i >= PRNN_XROWS * PRNN_I;
        const int gu = bias ? i - PRNN_XROWS * PRNN_I : i / PRNN_I, k = i % PRNN_I;
        const int unit = blk * PRNN_U + gu % PRNN_U;
        const bool valid = gu < PRNN_G * PRNN_U && unit < PRNN_H;
        const long long row = (long long)(gu / PRNN_U) * PRNN_H + unit;
        w[i] = valid ? prnn_to_float(bias ? b_ih[row] : w_ih[row * PRNN_I + k]) : 0.0f;
    }
}

// This block's rows of a tick's input projections, xw[t][b][g*H + unit] =
// b_ih + W_ih x[b][t], from the input rows x [B][T][I] in host memory and
// W_ih in shared memory (`w`, prnn_load_input_weights). The input rows come
// to shared memory `xs` (the projections' prefetch buffer, unused until the
// prefetch; xs_floats of it) in passes, one coalesced read each, at a row
// stride of I | 1 (odd: a warp's 32 rows on 32 banks). A warp takes
// PRNN_XW_ROWS projection rows and 32 input rows at a time, a lane an input
// row: W_ih's values are the same for the whole warp (a broadcast), and the
// lane's sums over I are PRNN_XW_ROWS independent chains. (W_ih read from
// global memory, a lane per projection row, cost ~25 µs a tick at H=128,
// I=128 on an H100: uncoalesced, and its rows did not stay in L1.) Stored to
// L2 (__stcg), where the prefetch's cp.async.cg reads them.
__device__ __forceinline__ void prnn_tick_projections(const io_t* __restrict__ x, const float* w,
                                                      float* __restrict__ xw, float* xs, int xs_floats, int T, int B,
                                                      int blk) {
    constexpr int stride = PRNN_I | 1, tasks_per_group = PRNN_XROWS / PRNN_XW_ROWS;
    const float* bias = w + PRNN_XROWS * PRNN_I;
    const int pairs = T * B, per_pass = xs_floats / stride;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int p0 = 0; p0 < pairs; p0 += per_pass) {
        const int n = min(per_pass, pairs - p0);
        __syncthreads();  // the previous pass's reads are done
        // PRNN_HOST_BATCH loads in flight per thread before any store: a load
        // from host memory is a PCIe round trip (~2.5 µs on an H100 host), and
        // one load per loop trip (a store to xs between, which may alias x)
        // cost one each: ~60 µs for 64 rows at I = 128.
        const io_t* src = x + (long long)p0 * PRNN_I;
        for (int i0 = threadIdx.x; i0 < n * PRNN_I; i0 += PRNN_THREADS * PRNN_HOST_BATCH) {
            float v[PRNN_HOST_BATCH];
#pragma unroll
            for (int c = 0; c < PRNN_HOST_BATCH; ++c) {
                const int i = i0 + c * PRNN_THREADS;
                v[c] = i < n * PRNN_I ? prnn_to_float(src[i]) : 0.0f;
            }
#pragma unroll
            for (int c = 0; c < PRNN_HOST_BATCH; ++c) {
                const int i = i0 + c * PRNN_THREADS;
                if (i < n * PRNN_I) xs[(i / PRNN_I) * stride + i % PRNN_I] = v[c];
            }
        }
        __syncthreads();
        for (int task = warp; task < tasks_per_group * ((n + 31) / 32); task += PRNN_THREADS / 32) {
            const int gu0 = task % tasks_per_group * PRNN_XW_ROWS, q = task / tasks_per_group * 32 + lane;
            if (q >= n) continue;
            const float* wr = w + gu0 * PRNN_I;
            const float* xq = xs + q * stride;
            float acc[PRNN_XW_ROWS];
#pragma unroll
            for (int r = 0; r < PRNN_XW_ROWS; ++r) acc[r] = bias[gu0 + r];
#pragma unroll 4
            for (int i = 0; i < PRNN_I; ++i) {
                const float xi = xq[i];
#pragma unroll
                for (int r = 0; r < PRNN_XW_ROWS; ++r) acc[r] += wr[r * PRNN_I + i] * xi;
            }
            const int p = p0 + q;
            float* dst = xw + ((long long)(p % T) * B + p / T) * PRNN_G * PRNN_H;
#pragma unroll
            for (int r = 0; r < PRNN_XW_ROWS; ++r) {
                const int gu = gu0 + r, unit = blk * PRNN_U + gu % PRNN_U;
                if (gu < PRNN_G * PRNN_U && unit < PRNN_H) __stcg(dst + gu / PRNN_U * PRNN_H + unit, acc[r]);
            }
        }
    }
}

// This block's units of a tick's outputs, staged by the steps (emit) in the
// projections' scratch, to the output rows `out` [B][T][H] in host memory:
// consecutive threads take consecutive units of one (row, step), so a
// warp's stores form runs of U values, where emit's stores went to a
// different row per thread. (Not measured apart: the step of a 64-row tick
// at H=128 took ~41 µs with either, the configuration's own step time.)
__device__ __forceinline__ void prnn_copy_tick_outputs(const float* stage, io_t* __restrict__ out, int T, int B,
                                                       int blk) {
    __syncthreads();  // the block's staged values are written
    const int units = min(PRNN_U, PRNN_H - blk * PRNN_U);
    for (int i = threadIdx.x; i < B * T * units; i += PRNN_THREADS) {
        const int u = i % units, bt = i / units, b = bt / T, t = bt % T, unit = blk * PRNN_U + u;
        out[(long long)bt * PRNN_H + unit] =
            prnn_from_float<io_t>(__ldcg(stage + ((long long)t * B + b) * PRNN_G * PRNN_H + unit));
    }
}
#endif

#if PRNN_RESIDENT && PRNN_SYNC == 1
// prnn_push_to_peers for the first `columns` float4s of each of the U unit
// rows (a row is BP floats) of the slice at `mine`.
__device__ __forceinline__ void prnn_push_columns_to_peers(const float* mine, prnn_u64* bar, int blk, int columns,
                                                           int BP, prnn_walk walk) {
    const prnn_u32 addr = prnn_smem_addr(mine), bar_addr = prnn_smem_addr(bar);
    PRNN_FOR_PAIRS(walk, PRNN_NB - 1, PRNN_U * columns, p, q) {
        const prnn_u32 rank = (blk + 1 + p) % PRNN_NB;
        const int offset = q / columns * BP + q % columns * 4;
        const float4 v = *reinterpret_cast<const float4*>(mine + offset);
        prnn_st_async_v4(prnn_peer_addr(addr + 4 * offset, rank), v, prnn_peer_addr(bar_addr, rank));
    }
}
#endif

// Per instance i, as PRNN_INSTANCE_PARAMS lists them (suffix _i):
//   xw      [T][ld][G*H] input projection x W_ih^T, fp32 (unused by a pipeline consumer)
//   w_hh    [G*H][H], b_hh [G*H]
//   h0, c0  [ld][H] (c0: cells with a cell state; h0 null: both zeros)
//   out     [T][ld][out_row], this instance's H columns (null: not written)
//   h_n, c_n [ld][H]
//   reverse 1: run positions T-1 .. 0
//   xw_bias [G*H]: b_ih, added to xw (null: xw includes it)
//   w_next  [G*H][H], b_next [G*H]: the next layer's W_ih, b_ih (pipeline; null for the last)
//   saved_gates [T][ld][G*H], saved_c [T][ld][H]: fp32, what training's backward reads (PRNN_SAVE_GATES)
// and for the launch:
//   status      int32 device word, 0 at launch: the first failure's code
//               (PRNN_STATUS_*), which also tells the other blocks to give up
//   report      int32 host-mapped pinned word (null: none): a block that gives
//               up copies the first code here, for the host to read without
//               synchronising
//   timeout_ns  a wait that sees no progress for this long fails
//   T, B, batch  steps; sequences per slice; sequences of the launch (gridDim.y slices of B, the last
//               one possibly shorter)
//   ld, out_row  sequences between steps of xw/out (the whole batch's); out's row length
//   abandon_block  test hook, -1 for none: block blockIdx.x == abandon_block
//               stops taking part after step 0, so its peers time out on it
// and, resident (PRNN_RESIDENT_PARAMS; h0 and h_n, c0 and c_n are then the
// engine's state pools, xw and out unused: each tick's descriptor has them):
//   w_ih [G*H][I], b_ih [G*H]
//   ctl          the control block (prnn_next_tick)
//   first_tick   the tick number this launch serves first
//   generation   written to ctl[PRNN_CTL_EXITED] when the launch leaves
//   idle_ns, lifetime_ns  when it leaves unasked (prnn_next_tick)
//   T, B, batch, ld, out_row: B and batch are the most rows a tick has (the
//               shared layout's size); the others come with each tick
// and last, instrumented (PRNN_STEP_PROFILE, PRNN_PROFILE_PARAMS):
//   profile      [gridDim.y][gridDim.x][PHASES + 2]: per block, thread 0's
//               SM cycles in each phase of the step loop (PRNN_MARK), then
//               the loop's cycles and its nanoseconds (globaltimer)
extern "C" __global__ void __launch_bounds__(PRNN_THREADS, 1)
prnn_recurrence(PRNN_INSTANCE_PARAMS PRNN_RESIDENT_PARAMS,
                float* __restrict__ exchange,    // grid mode: [2][KPAD][BP] (tagged: 64-bit words)
                prnn_u32* __restrict__ counters, // grid-barrier arrivals, exits, then each instance's progress
                float* __restrict__ pipe,        // pipeline: [INSTANCES-1][T][NB][G*U][BP]
                const int* __restrict__ lengths, // [batch] steps of each sequence, 1..T (null: all T)
                int T, int PRNN_SLICE_PARAM, int batch, int ld, int out_row, int* __restrict__ status,
                int* __restrict__ report,
                unsigned long long timeout_ns, int abandon_block PRNN_PROFILE_PARAMS) {
    extern __shared__ __align__(16) float smem[];
    const prnn_watch watch{status, report, timeout_ns};
    // This thread's waits all succeeded. A cluster wait (every thread waits)
    // or warp 0's wait for the previous layer can fail in some threads only,
    // so the block leaves together at the first __syncthreads after the wait,
    // made a __syncthreads_or(!ok) (PRNN_SYNC_OR_LEAVE).
    bool ok = true;
#if PRNN_SLICE_SEQUENCES
    // Every slice holds this many sequences, known here: every loop over a
    // slice's columns and every index scaled by BP folds (perf-notes §64).
    constexpr int B = PRNN_SLICE_SEQUENCES;
#endif
    // Every slice has the full slice's shared layout (the host sized it), so
    // BP comes from B before the last slice's B shrinks to what it holds.
    const int BP = (B + PRNN_BP_ALIGN - 1) / PRNN_BP_ALIGN * PRNN_BP_ALIGN + PRNN_BP_PAD;
    // This slice's first sequence: per-sequence memory is indexed with
    // slice0 + b (b the slice's column). Offsetting the pointers instead
    // made them registers, and kernels at their register limit spilled.
    const int slice0 = blockIdx.y * B;
#if !PRNN_SLICE_SEQUENCES
    B = min(B, batch - slice0);
#endif
#if PRNN_PIPELINE
    counters += blockIdx.y * (2 + PRNN_INSTANCES);  // each slice's own barrier counts and progress
#endif
#if PRNN_RESIDENT
#define PRNN_PER_TICK  // each tick sets these anew
#define PRNN_STATE_IN(b) ((long long)L.slots[b])
#define PRNN_STATE_OUT(b) ((long long)L.slots[BP + (b)])
#else
#define PRNN_PER_TICK const
#define PRNN_STATE_IN(b) ((long long)(slice0 + (b)))
#define PRNN_STATE_OUT(b) ((long long)(slice0 + (b)))
#endif
    PRNN_PER_TICK int Bc = (B + PRNN_BT - 1) / PRNN_BT * PRNN_BT;
    const prnn_smem_layout L = prnn_layout(smem, BP);
    const int tid = threadIdx.x, wg = tid / PRNN_WGS, lane = tid % PRNN_WGS;  // a warp under PRNN_MMA
#if PRNN_SYNC == 1
    const int blk = (int)prnn_cluster_rank();
    const int inst = blockIdx.x / PRNN_NB;
    __shared__ prnn_u64 bars[2];
#elif PRNN_SYNC == 2
    const int blk = blockIdx.x;
    const int inst = 0;
#else
    const int blk = 0;
    const int inst = blockIdx.x;
#endif
    PRNN_SELECT_INSTANCE  // this instance's pointers: xw, w_hh, ..., reverse (and w_next, b_next)
    PRNN_PER_TICK long long step_stride = (long long)ld * PRNN_G * PRNN_H;
    PRNN_PER_TICK long long out_step = (long long)ld * out_row;
    PRNN_PER_TICK prnn_walk walk = prnn_make_walk(B);
#if PRNN_PIPELINE
    const bool produces = inst + 1 < PRNN_INSTANCES;  // computes the next layer's projections
    const bool consumes = inst > 0;                   // reads its projections from the previous layer
    const long long pipe_stride = (long long)T * PRNN_NB * PRNN_G * PRNN_U * BP;  // one producer's steps
    float* pipe_out = pipe + (blockIdx.y * (PRNN_INSTANCES - 1) + inst) * pipe_stride;
    const float* pipe_in = pipe_out - pipe_stride;
    prnn_u32* progress = counters + 2;
    prnn_u32 seen_progress = 0;  // thread 0 of a consumer: the producer's count it read last
#define PRNN_PREFETCH(t)                                                                                \
    if (consumes) {                                                                                     \
        if (!prnn_prefetch_pipe(pipe_in, progress + inst - 1, L.xw, t, BP, blk, watch, &seen_progress)) \
            ok = false;                                                                                 \
    } else                                                                                              \
        prnn_prefetch_xw(xw, L.xw, t, reverse, lengths, T, B, BP, step_stride, blk, walk, slice0)
#elif PRNN_FUSED
#define PRNN_PREFETCH(t) \
    prnn_prefetch_xw_owned(xw, L.xw, t, reverse, lengths, T, B, BP, step_stride, blk, wg, lane, slice0)
#else
#define PRNN_PREFETCH(t) prnn_prefetch_xw(xw, L.xw, t, reverse, lengths, T, B, BP, step_stride, blk, walk, slice0)
#endif

    // A step is shorter than a global load's latency, so the projections are
    // fetched DEPTH steps ahead (one step ahead measured ~1.2 us per step, the
    // latency itself). Groups past T are empty, keeping the wait count uniform.
    // Step t's copy for step t + DEPTH is issued while the block waits for its
    // exchange: its address arithmetic (~100 instructions per warp at batch 8)
    // then costs no time on the step's critical path.
#define PRNN_PREFETCH_FIRST()                   \
    _Pragma("unroll") for (int t = 0; t < PRNN_XW_DEPTH; ++t) { \
        if (t < T) {                            \
            PRNN_PREFETCH(t);                   \
        } else {                                \
            prnn_cp_async_commit();             \
        }                                       \
    }
    // The biases are read once per (gate, unit, column) in the pointwise
    // phase; in registers they would cost every thread two registers per row.
    // b_ih comes apart from xw (xw_bias) where the input projection is a
    // plain GEMM: with the bias in its epilogue, cuBLASLt ran small layers'
    // projections split-K, a memset and three kernels (perf-notes §68).
    // Loaded before the weights: after them, the extra loads made kernels at
    // the register limit spill.
    for (int i = tid; i < PRNN_G * PRNN_U; i += PRNN_THREADS) {
        const int unit = blk * PRNN_U + i % PRNN_U, row = (i / PRNN_U) * PRNN_H + unit;
        L.bias[i] = unit < PRNN_H ? prnn_to_float(b_hh[row]) : 0.0f;
        PRNN_XW_BIAS[i] = unit < PRNN_H && xw_bias ? prnn_to_float(xw_bias[row]) : 0.0f;
    }
#if !PRNN_RESIDENT
    PRNN_PREFETCH_FIRST();  // a resident kernel's come with each tick
#endif

#if PRNN_MMA
    prnn_u32 w0[PRNN_S0_MTW][PRNN_KTW][PRNN_AREGS];
    prnn_load_stage_fragments<0, PRNN_S0_NG, PRNN_S0_MTW>(w_hh, w0, blk, wg, lane);
#define PRNN_STAGE_PRODUCT(s) prnn_stage_mma<s, PRNN_S##s##_NG, PRNN_S##s##_MTW>(w##s, operand, L.gates, wg, lane, BP, Bc)
#if PRNN_STAGES > 1
    prnn_u32 w1[PRNN_S1_MTW][PRNN_KTW][PRNN_AREGS];
    prnn_load_stage_fragments<1, PRNN_S1_NG, PRNN_S1_MTW>(w_hh, w1, blk, wg, lane);
#endif
#else
    float w0[PRNN_S0_RPW][PRNN_S0_KREG > 0 ? PRNN_S0_KREG : 1];
    float* w0_shared = L.w + tid;
    prnn_load_row_weights<PRNN_S0_NG, PRNN_S0_RPW, PRNN_S0_KREG>(w_hh, prnn_stage_gate(0, 0), w0, w0_shared, blk, wg,
                                                                 lane);
#define PRNN_STAGE_PRODUCT(s)                                                                              \
    prnn_stage_matmul<s, PRNN_S##s##_NG, PRNN_S##s##_RPW, PRNN_S##s##_KREG>(w##s, w##s##_shared, operand, L.gates, \
                                                                           wg, lane, BP, Bc)
#if PRNN_STAGES > 1
    float w1[PRNN_S1_RPW][PRNN_S1_KREG > 0 ? PRNN_S1_KREG : 1];
    float* w1_shared = w0_shared + (PRNN_KPT - PRNN_S0_KREG) * PRNN_S0_RPW * PRNN_THREADS;
    prnn_load_row_weights<PRNN_S1_NG, PRNN_S1_RPW, PRNN_S1_KREG>(w_hh, prnn_stage_gate(1, 0), w1, w1_shared, blk, wg,
                                                                 lane);
#endif
#endif
#if PRNN_PIPELINE
    // The next layer's W_ih rows of this block's units, every gate (G*U rows),
    // and its b_ih; the last instance has none.
    float wn[PRNN_N_RPW][PRNN_N_KREG > 0 ? PRNN_N_KREG : 1];
    float* wn_shared = L.w_next + tid;
    if (produces) {
        prnn_load_row_weights<PRNN_G, PRNN_N_RPW, PRNN_N_KREG>(w_next, 0, wn, wn_shared, blk, wg, lane);
        for (int i = tid; i < PRNN_G * PRNN_U; i += PRNN_THREADS) {
            const int unit = blk * PRNN_U + i % PRNN_U;
            L.bias_next[i] = unit < PRNN_H ? prnn_to_float(b_next[(i / PRNN_U) * PRNN_H + unit]) : 0.0f;
        }
    }
    const int next_rows = (PRNN_G * PRNN_U - wg + PRNN_NWG - 1) / PRNN_NWG;  // this group's valid rows
    // The next layer's projections of position p from h_p (complete in
    // `operand`) into pipe_out[p][blk]; the caller counts them in
    // progress[inst] once the block's stores are done.
    auto next_layer_product = [&](const float* operand, int p) {
        float* dst = pipe_out + ((long long)p * PRNN_NB + blk) * PRNN_G * PRNN_U * BP + wg * BP;
        prnn_group_product<PRNN_N_RPW, PRNN_KPT, PRNN_N_KREG>(
            wn, wn_shared, operand, lane, BP, Bc, next_rows, [&](int r, int b, float v) {
                __stcg(dst + r * PRNN_NWG * BP + b, v + L.bias_next[wg + r * PRNN_NWG]);
            });
    };
#endif
#if PRNN_ONE_SYNC
    // U_r[:, this block's units] (r is gate 0): rows wg, wg + NWG, ...; columns
    // lane, lane + WGS, ... of the block's slice.
    float wc[PRNN_C_RPW][PRNN_CPT];
#pragma unroll
    for (int r = 0; r < PRNN_C_RPW; ++r)
#pragma unroll
        for (int c = 0; c < PRNN_CPT; ++c) {
            const int row = wg + r * PRNN_NWG, col = lane + c * PRNN_WGS, unit = blk * PRNN_U + col;
            wc[r][c] = row < PRNN_H && col < PRNN_U && unit < PRNN_H
                           ? prnn_to_float(w_hh[(long long)row * PRNN_H + unit]) : 0.0f;
        }
    const int column_rows = (PRNN_H - wg + PRNN_NWG - 1) / PRNN_NWG;
    // Partial sums of U_r h for every row from this block's slice of h, plus
    // x_r + b_r of its own units (xs_r: gate 0 of a step's projections).
    auto column_product = [&](const float* h, const float* xs_r, float* part) {
        prnn_group_product<PRNN_C_RPW, PRNN_CPT, PRNN_CPT>(
            wc, nullptr, h + blk * PRNN_U * BP, lane, BP, Bc, column_rows, [&](int r, int b, float v) {
                const int row = wg + r * PRNN_NWG, u = row - blk * PRNN_U;
                if (u >= 0 && u < PRNN_U) v += xs_r[u * BP + b] + PRNN_XW_BIAS[u] + L.bias[u];
                part[row * BP + b] = v;
            });
    };
    const int part_floats = PRNN_PROWS * BP;  // one block's partial sums
#endif
    // The h buffers start as zeros (the padding rows and columns stay zero);
    // exchange -1's (buffer 1, or the only one) then receives h0.
    for (int i = tid; i < PRNN_HBUFS * PRNN_KPAD * BP; i += PRNN_THREADS) L.hbuf[i] = 0.0f;
#if PRNN_ONE_SYNC
    for (int i = tid; i < 2 * PRNN_NB * part_floats + PRNN_KPAD * BP; i += PRNN_THREADS) L.part[i] = 0.0f;
#endif
    __syncthreads();
    // h0 into buffer 1 (exchange -1) and c0 into the cell state; a null h0
    // means zero states, h and c (no fill launched before the kernel). A
    // resident tick also zeroes columns B..Bc of h0, which hold an earlier
    // tick's values: the product reads them (its results there are dropped).
    auto load_states = [&]() {
        // One null test for both states: a test of each pointer made a
        // two-instance build spill. (The h buffers are zeros already.)
        const bool given = h0 != nullptr;
        if (given) for (int i = tid; i < PRNN_H * (PRNN_RESIDENT ? Bc : B); i += PRNN_THREADS) {
            const int b = i / PRNN_H, k = i % PRNN_H;
            const bool row = !PRNN_RESIDENT || b < B;  // (a constant unless resident: no select then)
            L.hbuf[(PRNN_HBUFS - 1) * PRNN_KPAD * BP + k * BP + b] =  // PRNN_HBUF(-1)
                row ? prnn_to_float(h0[PRNN_STATE_IN(b) * PRNN_H + k]) : 0.0f;
        }
#if PRNN_HAS_C
        for (int i = tid; i < PRNN_U * B; i += PRNN_THREADS) {
            const int b = i % B, u = i / B, unit = blk * PRNN_U + u;
            L.c[u * BP + b] = given && unit < PRNN_H ? prnn_to_float(c0[PRNN_STATE_IN(b) * PRNN_H + unit]) : 0.0f;
        }
#endif
    };
#if !PRNN_RESIDENT
    load_states();
#endif
#if PRNN_SYNC == 1
    if (tid == 0) {
        prnn_mbar_init(&bars[0], 1);
        prnn_mbar_init(&bars[1], 1);
        prnn_fence_mbar_init();
    }
    prnn_cluster_sync();  // barriers initialised everywhere before any peer pushes
#else
    __syncthreads();
#endif

    const int slice_floats = PRNN_U * BP;  // one block's part of an exchanged vector
    int e = 0;                             // exchange index
#if PRNN_SYNC == 1
#if PRNN_RESIDENT
    // A resident tick pushes only its columns of each unit row (whole float4s)
    // where BP keeps rows 16-byte aligned, else the whole slice: the layout
    // holds BP columns for the kernel's most rows.
    int push_columns = BP;
    prnn_walk push_walk = prnn_make_walk(slice_floats / 4);
#define PRNN_PUSH_SLICE(mine, bar)                                                       \
    if (BP % 4)                                                                          \
        prnn_push_to_peers(mine, bar, blk, slice_floats / 4, push_walk);                 \
    else                                                                                 \
        prnn_push_columns_to_peers(mine, bar, blk, push_columns / 4, BP, push_walk)
#define PRNN_PUSH_FLOATS (PRNN_U * push_columns)
#else
    const prnn_walk push_walk = prnn_make_walk(slice_floats / 4);
#define PRNN_PUSH_SLICE(mine, bar) prnn_push_to_peers(mine, bar, blk, slice_floats / 4, push_walk)
#define PRNN_PUSH_FLOATS slice_floats
#endif
    prnn_u32 phases = 0;  // bit i: the parity the next wait on bars[i] completes
    auto wait_exchange = [&](int i) {
        if (!prnn_mbar_wait_cluster(&bars[i], (phases >> i) & 1u, watch)) ok = false;
        phases ^= 1u << i;
    };
#endif
#if PRNN_SYNC == 1 || PRNN_PIPELINE || PRNN_TAGGED
// Past it every ok is true; saying so ends ok's live range here (kept from
// one step's wait to the next, it cost a register, and spilled at 255).
// Thread 0 reported where its own wait failed. (Only if the phase completed
// between its last poll and another thread's does the block leave without a
// report; reporting here for that cost a kernel at its register limit 16
// bytes of spills.)
#define PRNN_SYNC_OR_LEAVE()        \
    if (__syncthreads_or(!ok)) {    \
        ok = false;                 \
        goto leave;                 \
    }                               \
    ok = true
#else
#define PRNN_SYNC_OR_LEAVE() __syncthreads()
#endif
#if PRNN_ONE_SYNC && PRNN_SYNC == 1
    const prnn_walk part_walk = prnn_make_walk(part_floats / 4);
#endif
#if PRNN_RESIDENT
#if PRNN_SYNC == 1
#define PRNN_TICK_SYNC() prnn_cluster_sync()
#else
#define PRNN_TICK_SYNC() __syncthreads()
#endif
    // A tick: block 0 waits for its doorbell and hands its descriptor to
    // every block's tick_desc; after a barrier all blocks run it (or all
    // leave). A tick's rows read their states from one slot and write them
    // to another (the engine alternates each stream's two slots), so a block
    // that writes its new states before a peer has read the old ones (a
    // one-step tick has no exchange between) does not change them.
    __shared__ long long tick_desc[PRNN_TICK_WORDS];
    const prnn_u64 launched = prnn_globaltimer();
    prnn_load_input_weights(w_ih, b_ih, L.w_ih, blk);  // read after the first tick's barriers
    for (long long tick = first_tick;; ++tick) {
        if (blk == 0 && tid < 32) {
            const long long word = prnn_next_tick(ctl, tick, launched, idle_ns, lifetime_ns);
            if (tid < PRNN_TICK_WORDS) {
#if PRNN_SYNC == 1
                for (int r = 0; r < PRNN_NB; ++r)
                    prnn_st_cluster_s64(prnn_peer_addr(prnn_smem_addr(tick_desc + tid), r), word);
#else
                tick_desc[tid] = word;
#endif
            }
        }
        PRNN_TICK_SYNC();
        T = (int)tick_desc[0];
        if (T == 0) break;  // every block alike
        B = (int)tick_desc[1];
        ld = B;
        out_row = T * PRNN_H;  // out is [B][T][H]
        Bc = (B + PRNN_BT - 1) / PRNN_BT * PRNN_BT;
        walk = prnn_make_walk(B);
#if PRNN_SYNC == 1
        push_columns = BP % 4 ? BP : min((Bc + 3) / 4 * 4, BP);  // the whole slice where rows are not aligned
        push_walk = prnn_make_walk(BP % 4 ? slice_floats / 4 : PRNN_U * push_columns / 4);
#endif
        step_stride = (long long)ld * PRNN_G * PRNN_H;
        out_step = PRNN_H;
        out = reinterpret_cast<io_t*>(tick_desc[3]);
        xw = reinterpret_cast<const float*>(tick_desc[6]);
        {
            const long long* gather = reinterpret_cast<const long long*>(tick_desc[4]);
            const long long* scatter = reinterpret_cast<const long long*>(tick_desc[5]);
            for (int i = tid; i < B; i += PRNN_THREADS) {
                L.slots[i] = (int)gather[i];
                L.slots[BP + i] = (int)scatter[i];
            }
        }
        prnn_tick_projections(reinterpret_cast<const io_t*>(tick_desc[2]), L.w_ih, const_cast<float*>(xw), L.xw,
                              (PRNN_XW_DEPTH + 1) * PRNN_G * PRNN_U * BP, T, B, blk);
        __threadfence_block();
        __syncthreads();  // the slots and this block's projections are in place
        PRNN_PREFETCH_FIRST();
        load_states();
        __syncthreads();
        e = 0;
#endif
#if PRNN_ONE_SYNC
    // Exchange -1 (buffer 1): the partial sums of U_r h0 for r at step 0
    // (h0 itself every block read whole).
    {
        float* part = L.part + (PRNN_NB + blk) * part_floats;
#if PRNN_SYNC == 1
        if (tid == 0) prnn_mbar_arrive_expect_tx(&bars[1], (prnn_u32)((PRNN_NB - 1) * part_floats * sizeof(float)));
#endif
        prnn_cp_async_wait<PRNN_XW_DEPTH - 1>();  // step 0's projections, x_r among them
        __syncthreads();
        column_product(L.hbuf + PRNN_KPAD * BP, L.xw, part);  // PRNN_HBUF(-1): one-sync keeps two
        __syncthreads();
#if PRNN_SYNC == 1
        prnn_push_to_peers(part, &bars[1], blk, part_floats / 4, part_walk);
        wait_exchange(1);
#endif
    }
#endif
#if PRNN_STEP_PROFILE
    // Thread 0's SM cycles per phase (32-bit %clock: differences are exact
    // modulo 2^32, ~2 s at 2 GHz). Every index is a compile-time constant,
    // so the counters stay in registers; the clock reads are volatile, so
    // they keep their places among the step's barriers and waits.
    prnn_u32 phase_cycles[PRNN_PROFILE_PHASES] = {};
    const prnn_u32 loop_cycles = (prnn_u32)clock();
    const prnn_u64 loop_ns = prnn_globaltimer();
    prnn_u32 mark = loop_cycles;
#define PRNN_MARK(phase)                                 \
    do {                                                 \
        const prnn_u32 now = (prnn_u32)clock();          \
        phase_cycles[PRNN_PHASE_##phase] += now - mark;  \
        mark = now;                                      \
    } while (0)
#else
#define PRNN_MARK(phase) \
    do {                 \
    } while (0)
#endif
#if PRNN_EARLY_PREFETCH
    // The warps that hold no (unit, column) of the pointwise update copy the
    // projections of step t + DEPTH while the others update, instead of
    // every thread after the update: there the copies' issue was on the
    // step's chain, since a single block has no exchange to hide them in
    // (~0.13 us of a ~0.5 us step at LSTM 64, batch 1; perf-notes §101;
    // the host compiles it in for single blocks only). Only warps
    // on schedulers with no updating warp copy (warp w issues on scheduler
    // w % 4): copies on an updating warp's scheduler took its issue slots,
    // and the update ran ~0.05 us longer. Where the update leaves no
    // scheduler idle, every thread copies after it, as before.
    // Only this flag lives through the loop: the copiers' walk is remade
    // where they copy (kept, it cost kernels at their register limit up to
    // 4 registers).
    const bool early_prefetch = prnn_copying_warps(B) > 0;
#else
    constexpr bool early_prefetch = false;
#endif
    for (int t = 0; t < T; ++t) {
        // Test hook (abandon_block >= 0 only): from step 1 on, the abandoned
        // block pushes and arrives no more, so that its peers time out on it,
        // and leaves like a failed block. In a grid it skips its arrival and
        // its own barrier wait fails like theirs; otherwise it waits for the
        // failure here. (Where each sits was measured: a wait loop of its own
        // in grid kernels, or skipping the pushes in cluster kernels, made
        // ptxas spill in kernels at their register limit.)
#if PRNN_TEST_HOOK
        const bool quit = t > 0 && (int)blockIdx.x == abandon_block;
#else
        // Compiled without the hook (every launch but a test's): none of its
        // code is in the kernel, whose registers are at the limit in places.
        constexpr bool quit = false;
#endif
#if PRNN_SYNC != 2
        if (quit) {
            if (tid == 0) prnn_wait_for_failure(watch);
            ok = false;
            goto leave;
        }
#endif
        const float* xs = L.xw + (t % (PRNN_XW_DEPTH + 1)) * PRNN_G * PRNN_U * BP;
        const float* h_prev = PRNN_HBUF(e - 1);
#if PRNN_ONE_SYNC
        {
            // r_t * h_{t-1} for every unit, from every block's partial sums.
            const float* parts = L.part + ((e - 1) & 1) * PRNN_NB * part_floats;
            PRNN_FOR_PAIRS(walk, PRNN_H, B, k, b) {
                float pre = 0.0f;
#pragma unroll
                for (int q = 0; q < PRNN_NB; ++q) pre += parts[q * part_floats + k * BP + b];
                L.rh[k * BP + b] = prnn_sigmoid(pre) * h_prev[k * BP + b];
            }
            PRNN_MARK(POINTWISE);
            PRNN_SYNC_OR_LEAVE();  // the first since the last exchange's wait
            PRNN_MARK(PRODUCT_BARRIER);
            // U_z h_{t-1} and U_n (r * h_{t-1}) for this block's rows, then
            // only the last stage's pointwise and exchange.
            {
                const float* operand = h_prev;
                PRNN_STAGE_PRODUCT(0);
            }
            {
                const float* operand = L.rh;
                PRNN_STAGE_PRODUCT(1);
            }
            PRNN_MARK(PRODUCT);
        }
#endif

#pragma unroll
        for (int stage = PRNN_FIRST_STAGE; stage < PRNN_STAGES; ++stage, ++e) {
            const float* operand = PRNN_HBUF(e - 1);
            float* next = PRNN_HBUF(e);
            // One (unit u, batch column b)'s update from its gates' inputs (xg:
            // projections; hg: recurrent products with b_hh), its outputs, and
            // its value for the exchange.
            const bool last_stage = stage == PRNN_STAGES - 1;
            auto emit = [&](int u, int b, const float (&xg)[PRNN_G], const float (&hg)[PRNN_G]) {
                const int unit = blk * PRNN_U + u;
                const float h = h_prev[unit * BP + b];
                float value;
#if PRNN_STAGES > 1
                if (!last_stage) {
                    value = prnn_between(stage, xg, hg, h);
                } else
#endif
                {
                    // Past its length a column keeps its state and outputs
                    // zeros, as torch does for a packed sequence.
                    const int seq = slice0 + b;
                    const int len = prnn_length(lengths, seq, T);
#if PRNN_HAS_C
                    float c_new;
                    prnn_pointwise(xg, hg, h, L.c[u * BP + b], value, c_new);
                    if (t >= len) c_new = L.c[u * BP + b];
                    L.c[u * BP + b] = c_new;
                    if (t == T - 1) c_n[PRNN_STATE_OUT(b) * PRNN_H + unit] = prnn_from_float<io_t>(c_new);
#else
                    prnn_pointwise(xg, hg, h, value);
#endif
                    if (t >= len) value = h;
#if PRNN_RESIDENT
                    // Staged where this block's gate-0 projection of (t, b) was, already read
                    // (prnn_copy_tick_outputs sends the rows to host memory).
                    __stcg(const_cast<float*>(xw) + ((long long)t * B + b) * PRNN_G * PRNN_H + unit, value);
#else
                    if (out) out[prnn_position(t, seq, reverse, lengths, T) * out_step + (long long)seq * out_row + unit] =
                                 prnn_from_float<io_t>(t < len ? value : 0.0f);
#endif
                    if (t == T - 1) h_n[PRNN_STATE_OUT(b) * PRNN_H + unit] = prnn_from_float<io_t>(value);
#if PRNN_SAVE_GATES
                    // Training: what the backward needs at this position,
                    // fp32, laid out as xw ([T][ld][G*H]; c: [T][ld][H]):
                    // every gate's recurrent product with b_hh (hg), and
                    // the new cell state.
                    {
                        const long long position = prnn_position(t, seq, reverse, lengths, T);
                        float* gates_at = saved_gates + position * step_stride + (long long)seq * PRNN_G * PRNN_H + unit;
#pragma unroll
                        for (int g = 0; g < PRNN_G; ++g) gates_at[g * PRNN_H] = hg[g];
#if PRNN_HAS_C
                        saved_c[(position * ld + seq) * PRNN_H + unit] = c_new;
#endif
                    }
#endif
                }
#if PRNN_TAGGED
                // The hook's block tags its values 0, which no reader waits
                // for (as the barrier's hook block arrives with 0).
                prnn_st_tagged(reinterpret_cast<prnn_u64*>(exchange) + (e & 1) * PRNN_KPAD * BP + unit * BP + b, value,
                               quit ? 0u : (prnn_u32)e + 1u);
#elif PRNN_SYNC == 2
                __stcg(exchange + (e & 1) * PRNN_KPAD * BP + unit * BP + b, value);
#else
                next[unit * BP + b] = value;
#endif
            };
#if PRNN_FUSED
            // Fused step: work group wg holds every gate row of unit wg, so
            // after its reduction each lane has all gates of the unit, and
            // lane bb updates batch columns bb, bb + BT, ... in registers: no
            // gates round trip through shared memory, no barrier between
            // product and pointwise. A thread reads only projections it
            // copied itself (prnn_prefetch_xw_owned), so its own cp.async
            // wait makes them visible.
            prnn_cp_async_wait<PRNN_XW_DEPTH - 1>();
            PRNN_MARK(PROJECTION_WAIT);
            prnn_group_sums<PRNN_S0_RPW, PRNN_KPT, PRNN_S0_KREG>(
                w0, w0_shared, operand, lane, BP, Bc, [&](int b0, const float (&sums)[PRNN_S0_RPW][PRNN_BT]) {
                    if (blk * PRNN_U + wg >= PRNN_H) return;
#pragma unroll
                    for (int bb = 0; bb < PRNN_BT; ++bb) {
                        const int b = b0 + bb;
                        if (bb != lane || b >= B) continue;
                        float xg[PRNN_G], hg[PRNN_G];
#pragma unroll
                        for (int g = 0; g < PRNN_G; ++g) {
                            xg[g] = xs[(g * PRNN_U + wg) * BP + b] + PRNN_XW_BIAS[g * PRNN_U + wg];
                            hg[g] = L.bias[g * PRNN_U + wg] + sums[g][bb];
                        }
                        emit(wg, b, xg, hg);
                    }
                });
            PRNN_MARK(PRODUCT);
#else
#if !PRNN_ONE_SYNC
            if (stage == 0)
                PRNN_STAGE_PRODUCT(0);
#if PRNN_STAGES > 1
            else
                PRNN_STAGE_PRODUCT(1);
#endif
#endif
#if PRNN_PIPELINE
            // h_{t-1} is stage 0's operand: the next layer's input at t - 1.
            const bool forwards = produces && stage == 0 && t > 0;
            if (forwards) next_layer_product(operand, t - 1);
#endif
            PRNN_MARK(PRODUCT);
            // Groups for steps 0 .. t + DEPTH - 1 are committed: this step's
            // has landed once at most DEPTH - 1 remain in flight.
            if (stage == PRNN_FIRST_STAGE) prnn_cp_async_wait<PRNN_XW_DEPTH - 1>();
            PRNN_MARK(PROJECTION_WAIT);
#if PRNN_ONE_SYNC
            __syncthreads();
#else
            PRNN_SYNC_OR_LEAVE();  // the first since the last exchange's wait
#endif
            PRNN_MARK(PRODUCT_BARRIER);
#endif  // PRNN_FUSED

#if !PRNN_FUSED
            // Pointwise: one (unit, batch column) per thread and pass.
            PRNN_FOR_PAIRS(walk, PRNN_U, B, u, b) {
                if (blk * PRNN_U + u >= PRNN_H) continue;
                float xg[PRNN_G], hg[PRNN_G];
#pragma unroll
                for (int g = 0; g < PRNN_G; ++g) {
                    xg[g] = xs[(g * PRNN_U + u) * BP + b] + PRNN_XW_BIAS[g * PRNN_U + u];
                    hg[g] = L.bias[g * PRNN_U + u];
#pragma unroll
                    for (int ks = 0; ks < PRNN_KS; ++ks) hg[g] += L.gates[((ks * PRNN_G + g) * PRNN_U + u) * BP + b];
                }
                emit(u, b, xg, hg);
            }
#if PRNN_EARLY_PREFETCH
            // Into the slot step t - 1 read, before the barrier that ended it.
            if (last_stage && early_prefetch) {
                const int warp = tid / 32;
                if (warp % 4 >= prnn_busy_warps(B) && t + PRNN_XW_DEPTH < T)
                    prnn_prefetch_xw(xw, L.xw, t + PRNN_XW_DEPTH, reverse, lengths, T, B, BP, step_stride, blk,
                                     prnn_walk_of(B, prnn_copier_rank(B, warp) * 32 + tid % 32,
                                                  prnn_copying_warps(B) * 32),
                                     slice0);
                else
                    prnn_cp_async_commit();  // one group a step in every thread
            }
#endif
            PRNN_MARK(POINTWISE);
#endif

            // While the exchange is in flight: the projections of step
            // t + DEPTH, into the slot step t - 1 read (the exchange's
            // __syncthreads orders that read before these writes).
// A producer counts the next layer's projections it stored here, in the
// exchange's shadow, and only every PRNN_RELEASE_EVERY steps: the release
// waits for the block's stores to reach L2 (one every step measured ~0.25 us
// per step of a 3-layer pipeline).
#if PRNN_PIPELINE
#define PRNN_RELEASE_FORWARDED()                                                         \
    if (produces && t > 0 && t % PRNN_RELEASE_EVERY == 0 && tid == 0)                    \
        prnn_red_release_gpu_add(progress + inst, PRNN_RELEASE_EVERY);
#else
#define PRNN_RELEASE_FORWARDED()
#endif
#define PRNN_PREFETCH_AHEAD()                 \
    if (last_stage && !early_prefetch) {      \
        PRNN_RELEASE_FORWARDED()              \
        if (t + PRNN_XW_DEPTH < T) {          \
            PRNN_PREFETCH(t + PRNN_XW_DEPTH); \
        } else {                              \
            prnn_cp_async_commit();           \
        }                                     \
    }
            // One-sync: the partial sums for r at step t + 1 travel with this
            // exchange; they need step t + 1's x_r (this thread's copies
            // waited for here, everyone's visible after the next barrier).
#if PRNN_ONE_SYNC
            const bool partials = t + 1 < T;
            float* part = L.part + ((e & 1) * PRNN_NB + blk) * part_floats;
            const float* xs_next = L.xw + ((t + 1) % (PRNN_XW_DEPTH + 1)) * PRNN_G * PRNN_U * BP;
            if (partials) prnn_cp_async_wait<PRNN_XW_DEPTH - 2>();
#endif
            // Exchange this block's slice of `next`.
#if PRNN_SYNC == 0
            __syncthreads();
            PRNN_MARK(SLICE_BARRIER);
#if PRNN_ONE_SYNC
            if (partials) {
                column_product(next, xs_next, part);
                __syncthreads();
            }
            PRNN_MARK(PRODUCT);
#endif
            PRNN_PREFETCH_AHEAD();
            PRNN_MARK(PREFETCH);
#elif PRNN_SYNC == 1
            if (tid == 0) {
                const int floats = PRNN_PUSH_FLOATS + (PRNN_ONE_SYNC && t + 1 < T ? PRNN_PROWS * BP : 0);
                prnn_mbar_arrive_expect_tx(&bars[e & 1], (prnn_u32)((PRNN_NB - 1) * floats * sizeof(float)));
            }
#if PRNN_FUSED
            PRNN_SYNC_OR_LEAVE();  // the slice is complete; the first since the last exchange's wait
#else
            __syncthreads();  // the slice is complete
#endif
            PRNN_MARK(SLICE_BARRIER);
            PRNN_PUSH_SLICE(next + blk * slice_floats, &bars[e & 1]);
            PRNN_MARK(PUSH);
#if PRNN_ONE_SYNC
            if (partials) {
                column_product(next, xs_next, part);
                __syncthreads();
                prnn_push_to_peers(part, &bars[e & 1], blk, part_floats / 4, part_walk);
            }
            PRNN_MARK(PRODUCT);
#endif
            PRNN_PREFETCH_AHEAD();
            PRNN_MARK(PREFETCH);
            wait_exchange(e & 1);
            PRNN_MARK(EXCHANGE_WAIT);
#elif PRNN_TAGGED
            // The values went to L2 with their tag in emit: no barrier and no
            // push. The prefetch goes first, in the exchange's shadow.
            PRNN_PREFETCH_AHEAD();
            PRNN_MARK(PREFETCH);
            // Rows past H and columns past B stay as initialised (zero).
            if (!prnn_read_tagged(next, reinterpret_cast<const prnn_u64*>(exchange) + (e & 1) * PRNN_KPAD * BP,
                                  (prnn_u32)e + 1u, B, BP, walk, watch))
                ok = false;
            PRNN_SYNC_OR_LEAVE();  // every thread's part of h is in `next`
            PRNN_MARK(EXCHANGE_WAIT);
#else
            __syncthreads();  // the block's writes precede its arrival
            PRNN_MARK(SLICE_BARRIER);
            // The hook's block adds 0 (a branch on quit instead made ptxas spill
            // in kernels at their register limit).
            if (tid == 0) prnn_red_release_gpu_add(&counters[0], (prnn_u32)!quit);
            PRNN_MARK(PUSH);
            PRNN_PREFETCH_AHEAD();
            PRNN_MARK(PREFETCH);
            if (!prnn_grid_wait(&counters[0], (prnn_u32)(PRNN_NB * (e + 1)), watch)) {
                ok = false;  // the whole block's: one thread waited for it
                goto leave;
            }
            PRNN_MARK(EXCHANGE_WAIT);
            {
                const float4* src = reinterpret_cast<const float4*>(exchange + (e & 1) * PRNN_KPAD * BP);
                float4* dst = reinterpret_cast<float4*>(next);
                // Rows past H stay as initialised (zero): the buffer's are never written.
                prnn_copy_from_l2(dst, src, (PRNN_H * BP + 3) / 4);
                __syncthreads();
            }
            PRNN_MARK(EXCHANGE_COPY);
#endif
        }
    }
#if PRNN_STEP_PROFILE
    if (tid == 0) {
        unsigned long long* mine = profile + ((long long)blockIdx.y * gridDim.x + blockIdx.x) * (PRNN_PROFILE_PHASES + 2);
#pragma unroll
        for (int i = 0; i < PRNN_PROFILE_PHASES; ++i) mine[i] = phase_cycles[i];
        mine[PRNN_PROFILE_PHASES] = (prnn_u32)clock() - loop_cycles;
        mine[PRNN_PROFILE_PHASES + 1] = prnn_globaltimer() - loop_ns;
    }
#endif
#if PRNN_RESIDENT
        prnn_copy_tick_outputs(xw, out, T, B, blk);
        // The tick's output rows are in host memory and its new states in
        // their slots before block 0 says so: each thread's own writes
        // (fence), then every block's (barrier). A block that left on a
        // failure met this barrier at its leave: the others then leave too,
        // without another barrier (no peer pushes any more).
        __threadfence_system();
        PRNN_TICK_SYNC();
        if (prnn_failed(status)) goto left;
        if (blk == 0 && tid == 0) prnn_st_release_sys(ctl + PRNN_CTL_DONE, tick);
    }
#endif
leave:
#if PRNN_PIPELINE
    // The next layer's input at the last position, from h_{T-1}, unless the
    // block left on a failure or a thread's last wait failed (decided by the
    // whole block: the branch holds a barrier).
    if (!__syncthreads_or(!ok) && produces) {
        next_layer_product(PRNN_HBUF(e - 1), T - 1);
        __syncthreads();
        if (tid == 0) prnn_red_release_gpu_add(progress + inst, T - (T - 1) / PRNN_RELEASE_EVERY * PRNN_RELEASE_EVERY);
    }
#endif
    prnn_cp_async_wait<0>();
#if PRNN_SYNC == 1
    prnn_cluster_sync();  // no block leaves while a peer may still write its shared memory
#endif
#if PRNN_SYNC == 2 || PRNN_PIPELINE
    // The last block out resets the counters: every block has passed every
    // barrier and read every count by then, so the next launch (or graph
    // replay) starts from zero.
    __syncthreads();
    if (tid == 0 && atomicAdd(&counters[1], 1u) == PRNN_NB * PRNN_INSTANCES - 1) {
        counters[0] = 0;
        counters[1] = 0;
        for (int i = 0; i < PRNN_INSTANCES; ++i) counters[2 + i] = 0;
        __threadfence();
    }
#endif
#if PRNN_RESIDENT
left:
    if (blk == 0 && tid == 0) {
        __threadfence_system();
        prnn_st_release_sys(ctl + PRNN_CTL_EXITED, generation);
    }
#endif
}
