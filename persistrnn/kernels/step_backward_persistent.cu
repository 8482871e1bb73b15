// The backward recurrence of one layer direction in one launch, on one
// cluster (PRNN_GRID 0) or on a cooperative grid of up to one block per SM
// (PRNN_GRID 1: layers whose W_hh a cluster's shared memory does not hold)
// (persistrnn/training_kernel.py renders and launches it; persistrnn/adjoint.py
// generates the step's statements from the cell spec).
//
// Block `rank` of the launch owns hidden units [u0, u0 + units) (PRNN_UNITS
// each, the last blocks fewer, possibly none) and keeps the W_hh rows of its
// units' gates in shared memory for the whole launch, transposed: gate g of
// unit u0 + j is row prnn_gate_row0(g) + j at column r of w[k][.]; each
// stage's rows start at a multiple of 4 (the product reads them as float4).
// Per step, in the direction's backward order, for each statement block of
// the cell (the last first; one for LSTM, GRU and RNN, two for the
// reset-before GRU, whose r * h waits for r) and then its stage's product:
//   1. for each (batch row b, owned unit): the adjoints the product before
//      left, summed from the launch's partials in a fixed order
//      (deterministic, no atomics): dh_t at a step's first block (plus the part that did
//      not go through W, GRU's z * dh), or a stage operand's adjoint (the
//      reset-before GRU's d(r * h)) into its carry plane; then the block's
//      generated statements: d xg, d gates (global, for the weight gradients
//      after the kernel, and shared, for the product), dc_{t-1} (shared, in
//      place), the direct part of dh_{t-1}, carry planes, and the stage
//      operands dW_hh needs (global);
//   2. the block's partial product of its stage, p[b][k] = sum over the
//      stage's rows r of d_gates[b][r] * W[r][k], for every column k, stored
//      at slot [parity][rank]: in a cluster into the shared memory of k's
//      owner (DSMEM stores), summed there in block order; in a grid into the
//      global exchange buffer, from which each owner gathers its units'
//      partials after the barrier (float4 loads of 4 units; lanes split the
//      blocks, each adds its blocks in order, then one thread per element
//      adds the lanes);
//   3. one barrier: the slots of this exchange's parity are complete, and
//      those of the other parity, which the next exchange fills, were read
//      by every owner before it arrived.
// The step's forward values (xg, gates, h, c, d_out) do not depend on the
// recurrence: each thread copies the next step's into shared memory (cp.async)
// while the products and the barriers run, so no global load is on the chain.
//
// In a cluster only the hardware cluster barrier waits, and the hardware
// co-schedules a cluster, so nothing can wait for a block that is not
// running. A grid's barrier is a counter that only grows (common.cuh): its
// wait is bounded by the watch (no progress for the timeout fails the
// launch, and a peer's failure ends it at once), and the launch is
// cooperative, so the host checked that every block is resident.
//
// Configuration macros from training_kernel.py: PRNN_G (gates), PRNN_H
// (hidden), PRNN_BLOCKS (blocks in the launch), PRNN_GRID (grid sync),
// PRNN_UNITS (units per block),
// PRNN_ROWS (every stage's PRNN_UNITS rows per gate, each stage rounded up to
// 4), PRNN_W_STRIDE (floats from one column of the transposed slice to the
// next), PRNN_THREADS, PRNN_BATCH_TILE (batch rows per product thread),
// PRNN_CELL_STATE (the cell carries c), PRNN_DIRECT_DH (the statements store
// a part of dh_{t-1}), PRNN_LENGTHS (the statements read step_runs: a cell
// with lengths), PRNN_CARRY (carry planes: adjoints that cross blocks
// otherwise than through dh, dc or the gates), PRNN_EXCHANGES (products per
// step: the cell's stages) and PRNN_GATE_ROW0(g).
//
// The statements name their values prnn_v<k>, prnn_g<k> and prnn_d<k>_<name>
// besides the cell's own names, which never start with prnn_: no parameter or
// local below has any of these forms.

// The slice row of gate g's first owned unit (PRNN_GATE_ROW0: each stage's rows start at a multiple of 4).
__device__ __forceinline__ constexpr int prnn_gate_row0(int g) { return PRNN_GATE_ROW0(g); }

// The statements address gate g of their element at [prnn_row + g * prnn_hidden];
// here prnn_row is 0 and each pointer starts at the thread's element, so the
// index is g * PRNN_H, a compile-time constant, and these views turn it into
// the shared layouts' gate stride.
struct prnn_gate_view {  // reads a staged plane set: gate g at base[g * stride]
    const float* base;
    int stride;
    __device__ __forceinline__ float operator[](int index) const { return base[index / PRNN_H * stride]; }
};

struct prnn_gate_tee {  // writes d gates to global (gate stride H) and to the block's shared rows
    float* global;
    float* shared;
    struct element {
        float* global;
        float* shared;
        __device__ __forceinline__ void operator=(float value) const {
            *global = value;
            *shared = value;
        }
    };
    __device__ __forceinline__ element operator[](int index) const {
        return {global + index, shared + prnn_gate_row0(index / PRNN_H)};
    }
};

struct prnn_carry_view {  // the statements' carry plane k at index k * B * H: plane k of this element
    float* base;
    int plane;     // B * H: the statements' plane stride
    int elements;  // B * PRNN_UNITS: the shared planes' stride
    __device__ __forceinline__ float& operator[](int index) const { return base[index / plane * elements]; }
};

__device__ __forceinline__ void prnn_st_cluster_f32(prnn_u32 addr, float value) {
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(addr), "f"(value) : "memory");
}

// Planes staged per step and batch row (each [B][PRNN_UNITS]): xg's gates,
// the gates' recurrent products, h_{t-1}, d_out, then c_{t-1} (cells with one)
// and step_runs (cells with lengths).
#define PRNN_PLANE_XG 0
#define PRNN_PLANE_GATES PRNN_G
#define PRNN_PLANE_H (2 * PRNN_G)
#define PRNN_PLANE_DOUT (2 * PRNN_G + 1)
#define PRNN_PLANE_C (2 * PRNN_G + 2)
#define PRNN_PLANE_RUNS (2 * PRNN_G + 2 + PRNN_CELL_STATE)
#define PRNN_PLANES (PRNN_PLANE_RUNS + PRNN_LENGTHS)

// Shared floats per element for what the exchange brings: in a cluster the
// partials of both parities from every block; in a grid the gathered sum.
#if PRNN_GRID
#define PRNN_RECV_SLOTS 1
#define PRNN_UNIT_QUADS ((PRNN_UNITS + 3) / 4)  // the exchange's units per block and row, in float4s
// A tagged exchange (PRNN_TAGGED) stores each partial with its exchange's tag
// in one 64-bit word (common.cuh) and each owner waits for the words
// themselves: no release, no counter barrier. Its buffer starts zeroed each
// launch. Two parities suffice: a block stores exchange k + 2 over k only
// after gathering every block's k + 1, which each stored after gathering k.
#if PRNN_TAGGED
typedef prnn_u64 prnn_exchange_word;
#define PRNN_TAGGED_SOURCES 4  // blocks whose words a gather lane loads before it checks any
#else
typedef float prnn_exchange_word;
#endif
#else
#define PRNN_RECV_SLOTS (2 * PRNN_BLOCKS)
#endif

extern "C" __global__ void __launch_bounds__(PRNN_THREADS, 1)
    prnn_step_backward_persistent(const float* __restrict__ prnn_xw_all,     // [T][B][G*H]
                                  const float* __restrict__ prnn_gates_all,  // [T][B][G*H]
                                  const float* __restrict__ prnn_h_all,      // [T][B][H] h each step started from
                                  const float* __restrict__ prnn_c_all,      // [T][B][H] c likewise (cells with one)
                                  const float* __restrict__ prnn_w_hh,       // [G*H][H]
                                  const float* __restrict__ prnn_dout_all,   // [T][B][H]
                                  const float* __restrict__ prnn_dh_last,    // [B][H] dL/dh_n
                                  const float* __restrict__ prnn_dc_last,    // [B][H] dL/dc_n
                                  const float* __restrict__ prnn_step_runs_all,  // [T][B] 1 where the row's
                                                       // sequence runs the step, 0 past its length (cells with lengths)
                                  float* __restrict__ prnn_dxw_all,          // [T][B][G*H]
                                  float* __restrict__ prnn_dgates_all,       // [T][B][G*H]
                                  float* __restrict__ prnn_operands_all,     // [stages - 1][T][B][H] stage operands
                                  float* __restrict__ prnn_dh_first,         // [B][H] dL/dh_0
                                  float* __restrict__ prnn_dc_first,         // [B][H] dL/dc_0
                                  float* __restrict__ prnn_exchange,  // grid: [2][owner][B][block][units]
                                  prnn_u32* prnn_counters,  // grid: the barrier's counter, zero at launch
                                  int* prnn_status, int* prnn_report, prnn_u64 prnn_timeout_ns,  // grid: the watch
                                  int prnn_steps, int prnn_batch, int prnn_reverse) {
    extern __shared__ float4 prnn_shared4[];
#if PRNN_GRID
    const int prnn_rank = (int)blockIdx.x;
    const prnn_watch prnn_watch_{prnn_status, prnn_report, prnn_timeout_ns};
#else
    const int prnn_rank = (int)prnn_cluster_rank();
#endif
    const int prnn_u0 = prnn_rank * PRNN_UNITS;
    const int prnn_owned = max(0, min(PRNN_UNITS, PRNN_H - prnn_u0));
    const int prnn_elements = prnn_batch * PRNN_UNITS;  // (b, j) at b * PRNN_UNITS + j; j >= prnn_owned idle
    float* prnn_w = reinterpret_cast<float*>(prnn_shared4);    // [PRNN_H][PRNN_W_STRIDE]
    float* prnn_dg = prnn_w + PRNN_H * PRNN_W_STRIDE;          // [B][PRNN_ROWS]
#if PRNN_GRID
    // The gather's lane sums (float4s, 16-byte aligned: every size before is a multiple of 4 floats).
    const int prnn_lane_quads = max(PRNN_THREADS, prnn_batch * PRNN_UNIT_QUADS);
    float4* prnn_lane_sums = reinterpret_cast<float4*>(prnn_dg + prnn_batch * PRNN_ROWS);
    float* prnn_recv = prnn_dg + prnn_batch * PRNN_ROWS + 4 * prnn_lane_quads;  // [B * PRNN_UNITS]
#else
    float* prnn_recv = prnn_dg + prnn_batch * PRNN_ROWS;       // [PRNN_RECV_SLOTS][B * PRNN_UNITS]
#endif
    float* prnn_stage = prnn_recv + PRNN_RECV_SLOTS * prnn_elements;  // [2][PRNN_PLANES][B * PRNN_UNITS]
    float* prnn_dc_state = prnn_stage + 2 * PRNN_PLANES * prnn_elements;  // [B * PRNN_UNITS] (cells with c)
    float* prnn_direct = prnn_dc_state + PRNN_CELL_STATE * prnn_elements;  // [B * PRNN_UNITS] (PRNN_DIRECT_DH)
    float* prnn_carry_planes = prnn_direct + PRNN_DIRECT_DH * prnn_elements;  // [PRNN_CARRY][B * PRNN_UNITS]
    constexpr int prnn_gh = PRNN_G * PRNN_H;
    [[maybe_unused]] const size_t prnn_operand_stride = (size_t)prnn_steps * prnn_batch * PRNN_H;

    // The slice, transposed; rows past the block's units and a stage's
    // padding stay zero (as do their d gates), so every block runs the same
    // product loop.
    for (int prnn_i = threadIdx.x; prnn_i < PRNN_ROWS * PRNN_H; prnn_i += PRNN_THREADS)
        prnn_w[prnn_i / PRNN_ROWS * PRNN_W_STRIDE + prnn_i % PRNN_ROWS] = 0.0f;
    for (int prnn_i = threadIdx.x; prnn_i < prnn_batch * PRNN_ROWS; prnn_i += PRNN_THREADS) prnn_dg[prnn_i] = 0.0f;
    __syncthreads();
    for (int prnn_i = threadIdx.x; prnn_i < PRNN_G * PRNN_UNITS * PRNN_H; prnn_i += PRNN_THREADS) {
        const int prnn_k = prnn_i % PRNN_H, prnn_gj = prnn_i / PRNN_H;
        const int prnn_gate = prnn_gj / PRNN_UNITS, prnn_j = prnn_gj % PRNN_UNITS;
        if (prnn_j < prnn_owned)
            prnn_w[prnn_k * PRNN_W_STRIDE + prnn_gate_row0(prnn_gate) + prnn_j] =
                prnn_w_hh[(size_t)(prnn_gate * PRNN_H + prnn_u0 + prnn_j) * PRNN_H + prnn_k];
    }

    // Copy position prnn_p's forward values of this thread's elements into
    // staging buffer prnn_parity; the same thread reads them, after its wait.
    auto prnn_stage_position = [&](int prnn_p, int prnn_parity) {
        float* prnn_planes = prnn_stage + prnn_parity * PRNN_PLANES * prnn_elements;
        for (int prnn_e = threadIdx.x; prnn_e < prnn_elements; prnn_e += PRNN_THREADS) {
            const int prnn_b = prnn_e / PRNN_UNITS, prnn_j = prnn_e % PRNN_UNITS;
            if (prnn_j >= prnn_owned) continue;
            const size_t prnn_gate_at = ((size_t)prnn_p * prnn_batch + prnn_b) * prnn_gh + prnn_u0 + prnn_j;
            const size_t prnn_unit_at = ((size_t)prnn_p * prnn_batch + prnn_b) * PRNN_H + prnn_u0 + prnn_j;
#pragma unroll
            for (int prnn_gate = 0; prnn_gate < PRNN_G; ++prnn_gate) {
                prnn_cp_async_4(prnn_planes + (PRNN_PLANE_XG + prnn_gate) * prnn_elements + prnn_e,
                                prnn_xw_all + prnn_gate_at + prnn_gate * PRNN_H);
                prnn_cp_async_4(prnn_planes + (PRNN_PLANE_GATES + prnn_gate) * prnn_elements + prnn_e,
                                prnn_gates_all + prnn_gate_at + prnn_gate * PRNN_H);
            }
            prnn_cp_async_4(prnn_planes + PRNN_PLANE_H * prnn_elements + prnn_e, prnn_h_all + prnn_unit_at);
            prnn_cp_async_4(prnn_planes + PRNN_PLANE_DOUT * prnn_elements + prnn_e, prnn_dout_all + prnn_unit_at);
#if PRNN_CELL_STATE
            prnn_cp_async_4(prnn_planes + PRNN_PLANE_C * prnn_elements + prnn_e, prnn_c_all + prnn_unit_at);
#endif
#if PRNN_LENGTHS
            prnn_cp_async_4(prnn_planes + PRNN_PLANE_RUNS * prnn_elements + prnn_e,
                            prnn_step_runs_all + (size_t)prnn_p * prnn_batch + prnn_b);
#endif
        }
        prnn_cp_async_commit();
    };

#if PRNN_GRID
    // The exchange buffer is laid out [parity][owner][b][source block][unit,
    // padded to PRNN_UNIT_QUADS float4s]: an owner's partials from every
    // block are one contiguous run, read as float4s, each 32-byte sector once
    // (a layout by source block would read a sector per float).
    const size_t prnn_run = (size_t)prnn_batch * PRNN_BLOCKS * 4 * PRNN_UNIT_QUADS;  // one owner's partials
    // Lanes per quad of units: as many as keep the block's threads busy (a
    // power of two), so that every thread has its loads in flight at once.
    int prnn_lanes = 32;
    while (prnn_lanes > 1 && prnn_batch * PRNN_UNIT_QUADS * prnn_lanes > PRNN_THREADS) prnn_lanes >>= 1;
    // Every owned element's partials of exchange prnn_k, summed into
    // prnn_recv: lane l of quad (b, q) adds the blocks l, l + lanes, ... in
    // order (consecutive threads read consecutive quads, then blocks:
    // coalesced), then one thread per element adds its lanes in order. A
    // fixed order: the sums are deterministic. False in every thread when a
    // thread's wait for a tagged word gave up (the status word holds why).
    auto prnn_gather = [&](int prnn_k) {
        const prnn_exchange_word* prnn_mine =
            reinterpret_cast<const prnn_exchange_word*>(prnn_exchange) + ((prnn_k & 1) * PRNN_BLOCKS + prnn_rank) * prnn_run;
        bool prnn_ok = true;
        for (int prnn_t = threadIdx.x; prnn_t < prnn_batch * PRNN_UNIT_QUADS * prnn_lanes; prnn_t += PRNN_THREADS) {
            const int prnn_q = prnn_t % PRNN_UNIT_QUADS, prnn_lane = prnn_t / PRNN_UNIT_QUADS % prnn_lanes;
            const int prnn_b = prnn_t / (PRNN_UNIT_QUADS * prnn_lanes);
            float4 prnn_sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (4 * prnn_q < prnn_owned) {  // padding past the owned units is never written, and never used
                const prnn_exchange_word* prnn_from =
                    prnn_mine + ((size_t)prnn_b * PRNN_BLOCKS * PRNN_UNIT_QUADS + prnn_q) * 4;
#if PRNN_TAGGED
                // PRNN_TAGGED_SOURCES blocks' words go out at once; every word
                // whose tag is not there yet is loaded again, all at once,
                // until none is missing (one L2 round trip per round, not one
                // per word). Units past the owned ones are never stored: they
                // count as arrived zeros.
                const prnn_u32 prnn_tag = (prnn_u32)prnn_k + 1u;
                const int prnn_valid = min(4, prnn_owned - 4 * prnn_q);
                for (int prnn_src0 = prnn_lane; prnn_src0 < PRNN_BLOCKS && prnn_ok;
                     prnn_src0 += PRNN_TAGGED_SOURCES * prnn_lanes) {
                    prnn_u64 prnn_word[PRNN_TAGGED_SOURCES][4];
                    auto prnn_load = [&](bool prnn_first) {
                        int prnn_missing = 0;
#pragma unroll
                        for (int prnn_s = 0; prnn_s < PRNN_TAGGED_SOURCES; ++prnn_s) {
                            const int prnn_src = prnn_src0 + prnn_s * prnn_lanes;
#pragma unroll
                            for (int prnn_u = 0; prnn_u < 4; ++prnn_u) {
                                prnn_u64& prnn_w = prnn_word[prnn_s][prnn_u];
                                if (prnn_first && (prnn_src >= PRNN_BLOCKS || prnn_u >= prnn_valid))
                                    prnn_w = (prnn_u64)prnn_tag << 32;  // nothing to wait for: a zero
                                else if (prnn_first || (prnn_u32)(prnn_w >> 32) != prnn_tag)
                                    prnn_w = prnn_ld_tagged(prnn_from + prnn_src * 4 * PRNN_UNIT_QUADS + prnn_u);
                            }
                        }
#pragma unroll
                        for (int prnn_s = 0; prnn_s < PRNN_TAGGED_SOURCES; ++prnn_s)
#pragma unroll
                            for (int prnn_u = 0; prnn_u < 4; ++prnn_u)
                                prnn_missing += (prnn_u32)(prnn_word[prnn_s][prnn_u] >> 32) != prnn_tag;
                        return prnn_missing;
                    };
                    int prnn_missing = prnn_load(true);
                    if (prnn_missing) {  // bounded as every wait: no word arriving for the timeout fails the launch
                        prnn_stall_clock prnn_clock;
                        prnn_clock.restart();
                        while (prnn_missing) {
                            const int prnn_left = prnn_load(false);
                            if (prnn_left < prnn_missing) prnn_clock.stalled = 0;  // words arrived: progress
                            prnn_missing = prnn_left;
                            if (prnn_missing &&
                                !prnn_wait_goes_on(prnn_clock, prnn_watch_, PRNN_STATUS_GRID_BARRIER_TIMEOUT)) {
                                prnn_ok = false;
                                break;
                            }
                        }
                    }
#pragma unroll
                    for (int prnn_s = 0; prnn_s < PRNN_TAGGED_SOURCES; ++prnn_s) {
                        prnn_sum.x += __uint_as_float((prnn_u32)prnn_word[prnn_s][0]);
                        prnn_sum.y += __uint_as_float((prnn_u32)prnn_word[prnn_s][1]);
                        prnn_sum.z += __uint_as_float((prnn_u32)prnn_word[prnn_s][2]);
                        prnn_sum.w += __uint_as_float((prnn_u32)prnn_word[prnn_s][3]);
                    }
                }
#else
#pragma unroll 16
                for (int prnn_src = prnn_lane; prnn_src < PRNN_BLOCKS; prnn_src += prnn_lanes) {
                    const float4 prnn_v = prnn_ld_cg_v4(prnn_from + prnn_src * 4 * PRNN_UNIT_QUADS);
                    prnn_sum.x += prnn_v.x;
                    prnn_sum.y += prnn_v.y;
                    prnn_sum.z += prnn_v.z;
                    prnn_sum.w += prnn_v.w;
                }
#endif
            }
            prnn_lane_sums[prnn_t] = prnn_sum;  // [b][lane][q]
        }
        if (!__syncthreads_and(prnn_ok)) return false;
        for (int prnn_e = threadIdx.x; prnn_e < prnn_elements; prnn_e += PRNN_THREADS) {
            const int prnn_b = prnn_e / PRNN_UNITS, prnn_j = prnn_e % PRNN_UNITS;
            const float* prnn_from = reinterpret_cast<const float*>(
                prnn_lane_sums + prnn_b * prnn_lanes * PRNN_UNIT_QUADS + prnn_j / 4) + prnn_j % 4;
            float prnn_sum = 0.0f;
#pragma unroll 8
            for (int prnn_lane = 0; prnn_lane < prnn_lanes; ++prnn_lane)
                prnn_sum += prnn_from[4 * prnn_lane * PRNN_UNIT_QUADS];
            prnn_recv[prnn_e] = prnn_sum;
        }
        __syncthreads();
        return true;
    };
    auto prnn_gathered = [&](int, int prnn_e) { return prnn_recv[prnn_e]; };
    // Arrive at exchange prnn_k's barrier and wait for every block; false
    // (the status word holds why) when the wait gave up. Tagged words need
    // neither: each reader waits for the words themselves (prnn_gather).
#if PRNN_TAGGED
    auto prnn_exchanged = [](int) { return true; };
#else
    auto prnn_exchanged = [&](int prnn_k) {
        prnn_grid_arrive(prnn_counters);
        bool prnn_arrived = true;
        prnn_u32 prnn_seen;
        if (threadIdx.x == 0)
            prnn_arrived = prnn_wait_counter(prnn_counters, (prnn_u32)(PRNN_BLOCKS * (prnn_k + 1)), prnn_watch_,
                                             PRNN_STATUS_GRID_BARRIER_TIMEOUT, &prnn_seen);
        return __syncthreads_and(prnn_arrived) != 0;
    };
#endif
#else
    auto prnn_gather = [](int) { return true; };  // each owner sums its slots where it reads them
    // The cluster's partial products of exchange parity prnn_parity for
    // element prnn_e, summed in block order.
    auto prnn_gathered = [&](int prnn_parity, int prnn_e) {
        float prnn_sum = 0.0f;
        const float* prnn_slots = prnn_recv + prnn_parity * PRNN_BLOCKS * prnn_elements + prnn_e;
#pragma unroll
        for (int prnn_src = 0; prnn_src < PRNN_BLOCKS; ++prnn_src) prnn_sum += prnn_slots[prnn_src * prnn_elements];
        return prnn_sum;
    };
    auto prnn_exchanged = [](int) {
        prnn_cluster_sync();
        return true;
    };
#endif
    // dh_{t-1} of element prnn_e: the direct part, then the partials.
    auto prnn_gathered_dh = [&](int prnn_parity, int prnn_e) {
        return (PRNN_DIRECT_DH ? prnn_direct[prnn_e] : 0.0f) + prnn_gathered(prnn_parity, prnn_e);
    };

    // The block's partial product of the rows [prnn_r0, prnn_r1) (one stage;
    // prnn_r0 and the count multiples of 4) into every owner's slot of
    // exchange prnn_k (parity prnn_k & 1): one column and PRNN_BATCH_TILE
    // batch rows per item, a float4 of the column's weights and a float4 of
    // each row's d gates (the same address across the warp: a broadcast) per 4 rows.
    auto prnn_product = [&](int prnn_r0, int prnn_r1, int prnn_k) {
        const int prnn_items = (prnn_batch + PRNN_BATCH_TILE - 1) / PRNN_BATCH_TILE * PRNN_H;
#if PRNN_GRID
        // [owner][b][this block][j] of this parity (see the gather)
        prnn_exchange_word* prnn_slot = reinterpret_cast<prnn_exchange_word*>(prnn_exchange) +
                                        (prnn_k & 1) * PRNN_BLOCKS * prnn_run + prnn_rank * 4 * PRNN_UNIT_QUADS;
#else
        const prnn_u32 prnn_slot = prnn_smem_addr(prnn_recv + ((prnn_k & 1) * PRNN_BLOCKS + prnn_rank) * prnn_elements);
#endif
        for (int prnn_item = threadIdx.x; prnn_item < prnn_items; prnn_item += PRNN_THREADS) {
            const int prnn_col = prnn_item % PRNN_H, prnn_b0 = prnn_item / PRNN_H * PRNN_BATCH_TILE;
            const float* prnn_column = prnn_w + prnn_col * PRNN_W_STRIDE;
            const float* prnn_rows[PRNN_BATCH_TILE];
            float prnn_acc[PRNN_BATCH_TILE];
#pragma unroll
            for (int prnn_t = 0; prnn_t < PRNN_BATCH_TILE; ++prnn_t) {
                // A tile past the batch reads the last row again and stores nothing.
                prnn_rows[prnn_t] = prnn_dg + min(prnn_b0 + prnn_t, prnn_batch - 1) * PRNN_ROWS;
                prnn_acc[prnn_t] = 0.0f;
            }
#pragma unroll 4
            for (int prnn_r = prnn_r0; prnn_r < prnn_r1; prnn_r += 4) {
                const float4 prnn_wv = *reinterpret_cast<const float4*>(prnn_column + prnn_r);
#pragma unroll
                for (int prnn_t = 0; prnn_t < PRNN_BATCH_TILE; ++prnn_t) {
                    const float4 prnn_dv = *reinterpret_cast<const float4*>(prnn_rows[prnn_t] + prnn_r);
                    prnn_acc[prnn_t] = fmaf(prnn_dv.x, prnn_wv.x, prnn_acc[prnn_t]);
                    prnn_acc[prnn_t] = fmaf(prnn_dv.y, prnn_wv.y, prnn_acc[prnn_t]);
                    prnn_acc[prnn_t] = fmaf(prnn_dv.z, prnn_wv.z, prnn_acc[prnn_t]);
                    prnn_acc[prnn_t] = fmaf(prnn_dv.w, prnn_wv.w, prnn_acc[prnn_t]);
                }
            }
#if PRNN_GRID
            prnn_exchange_word* prnn_to = prnn_slot + (size_t)(prnn_col / PRNN_UNITS) * prnn_run + prnn_col % PRNN_UNITS;
#pragma unroll
            for (int prnn_t = 0; prnn_t < PRNN_BATCH_TILE; ++prnn_t) {
                const int prnn_b = prnn_b0 + prnn_t;
#if PRNN_TAGGED
                if (prnn_b < prnn_batch)
                    prnn_st_tagged(prnn_to + prnn_b * PRNN_BLOCKS * 4 * PRNN_UNIT_QUADS, prnn_acc[prnn_t],
                                   (prnn_u32)prnn_k + 1u);
#else
                if (prnn_b < prnn_batch) prnn_to[prnn_b * PRNN_BLOCKS * 4 * PRNN_UNIT_QUADS] = prnn_acc[prnn_t];
#endif
            }
#else
            const int prnn_owner = prnn_col / PRNN_UNITS, prnn_j = prnn_col % PRNN_UNITS;
#pragma unroll
            for (int prnn_t = 0; prnn_t < PRNN_BATCH_TILE; ++prnn_t) {
                const int prnn_b = prnn_b0 + prnn_t;
                if (prnn_b < prnn_batch)
                    prnn_st_cluster_f32(prnn_peer_addr(prnn_slot + 4u * (prnn_b * PRNN_UNITS + prnn_j), prnn_owner),
                                        prnn_acc[prnn_t]);
            }
#endif
        }
    };

    auto prnn_position = [&](int prnn_i) { return prnn_reverse ? prnn_i : prnn_steps - 1 - prnn_i; };
    for (int prnn_e = threadIdx.x; prnn_e < prnn_elements; prnn_e += PRNN_THREADS) {
        const int prnn_b = prnn_e / PRNN_UNITS, prnn_j = prnn_e % PRNN_UNITS;
        if (PRNN_CELL_STATE && prnn_j < prnn_owned)
            prnn_dc_state[prnn_e] = prnn_dc_last[prnn_b * PRNN_H + prnn_u0 + prnn_j];
    }
    prnn_stage_position(prnn_position(0), 0);
#if PRNN_GRID
    __syncthreads();  // the block's slice and zeros are in place
#else
    // Every block has started (DSMEM stores need their target running) and
    // its slice and zeros are in place.
    prnn_cluster_sync();
#endif

    for (int prnn_i = 0; prnn_i < prnn_steps; ++prnn_i) {
        const int prnn_p = prnn_position(prnn_i);
        const float* prnn_planes = prnn_stage + (prnn_i & 1) * PRNN_PLANES * prnn_elements;
        prnn_cp_async_wait<0>();
        // ---- the step's blocks ----
    }

    // The last exchange's parity: PRNN_EXCHANGES per step.
    const int prnn_last = prnn_steps * PRNN_EXCHANGES - 1;
    if (!prnn_gather(prnn_last)) return;
    for (int prnn_e = threadIdx.x; prnn_e < prnn_elements; prnn_e += PRNN_THREADS) {
        const int prnn_b = prnn_e / PRNN_UNITS, prnn_j = prnn_e % PRNN_UNITS;
        if (prnn_j >= prnn_owned) continue;
        prnn_dh_first[prnn_b * PRNN_H + prnn_u0 + prnn_j] = prnn_gathered_dh(prnn_last & 1, prnn_e);
        if (PRNN_CELL_STATE) prnn_dc_first[prnn_b * PRNN_H + prnn_u0 + prnn_j] = prnn_dc_state[prnn_e];
    }
}
