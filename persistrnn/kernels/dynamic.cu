// The dynamic-network interpreter (VPPS): every block is a virtual processor
// that runs its own script of fixed-width instructions (persistrnn/dynamic/
// script.py) from shared memory. Each weight matrix lives on its own subset
// of the blocks, a slice of rows per block in shared memory for the whole
// launch, with its gradient beside it when training; forward, backward and
// the optimiser update run in one launch. An instruction is one op over a
// list of operands (all nodes of one depth, op and size on this block, or all
// matvecs of one matrix in one stage). Blocks order their stages through one
// counter that only grows (signal: +1 after a stage's work; wait: until the
// counter reaches the number of signals of all earlier stages), with bounded
// waits.
//
// The generated prelude defines (persistrnn/dynamic/kernel.py):
//   PRNN_DYN_THREADS, PRNN_DYN_CHUNK (instructions fetched into shared memory
//   at a time), PRNN_DYN_GROUP (vectors a matvec takes at a time),
//   PRNN_DYN_MATRICES, PRNN_DYN_MAX_COLS, PRNN_DYN_MAX_ROWS (rows of one
//   matrix on one block), PRNN_DYN_WEIGHT_FLOATS (cache floats per block),
//   PRNN_DYN_TRAIN, PRNN_DYN_PROFILE (an instrumented build, below),
//   PRNN_DYN_REPLICATED (some matrix has replicas), the opcodes PRNN_OP_*,
//   and prnn_dyn_matrix[k] = {rows, cols, rows per block, parameter offset,
//   cache offset, first block, holders, replicas, gates}: matrix k is on the
//   holders * replicas blocks from the first on, modulo the grid, the i-th
//   of them holder i % holders of replica i / holders. Its rows are gates
//   blocks of rows / gates units; a holder keeps all gates of its units, gate
//   after gate (MatrixLayout.block_rows), so that a cell over the matvec
//   (PRNN_OP_LSTM_MATVEC, PRNN_OP_TREE_MATVEC) finishes its units' cells on
//   the holder, without a barrier between the products and the cell.

#define PRNN_DYN_WORDS 4
#define PRNN_DYN_WARPS (PRNN_DYN_THREADS / 32)
// Elements a thread loads before it stores any (forward instructions): their
// trips to memory overlap instead of following each other.
#define PRNN_DYN_UNROLL 4

// The instrumented build: thread 0 of every block adds up the SM cycles of
// each instruction by opcode, from its start to the block barrier that ends
// it (a wait: until the block leaves it; a signal: thread 0's red), and
// counts them; slot 0 is the fetch of script chunks. It writes per block
// profile[block][PRNN_DYN_PROFILE_SLOTS][2] (cycles, count), then the loop's
// cycles and nanoseconds (globaltimer), to convert cycles per block.
#if PRNN_DYN_PROFILE
#define PRNN_DYN_PROFILE_PARAM , unsigned long long* __restrict__ profile
#define PRNN_DYN_MARK(start) const prnn_u32 start = (prnn_u32)clock()
#define PRNN_DYN_COUNT(slot, start)                              \
    if (tid == 0) {                                              \
        profile_cycles[slot] += (prnn_u32)clock() - (start);     \
        profile_count[slot] += 1;                                \
    }
#else
#define PRNN_DYN_PROFILE_PARAM
#define PRNN_DYN_MARK(start)
#define PRNN_DYN_COUNT(slot, start)
#endif

// Gradients are accumulated by atomics in L2, also by this block within a
// stage, so an L1 line read earlier in the stage would be stale: read them
// through L2 (.cg).
__device__ __forceinline__ float prnn_dyn_ld(const float* p) { return __ldcg(p); }

// Values are written once, by plain stores. Within a stage a block reads only
// values written by its own threads before a block barrier (or in earlier
// stages); values of other blocks are read only after a counter wait, whose
// acquire invalidates this SM's L1. So plain loads, which may hit L1, are safe.
__device__ __forceinline__ float prnn_dyn_value(const float* p) { return *p; }

// The precise form: the gradients are checked to 1e-5 against float64.
__device__ __forceinline__ float prnn_dyn_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float prnn_dyn_warp_sum(float s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

// This block's rows of a matrix: span units from unit begin, of each of its
// count / span gates (count 0 where it holds none); the matrix has units
// units a gate.
struct prnn_dyn_rows {
    int cols, begin, count, cache, replica, span, units;
    // the matrix row of this block's row r (its cache order)
    __device__ __forceinline__ int row(int r) const { return span == count ? begin + r : r / span * units + begin + r % span; }
    // the parameter float of this block's cache float i, for a matrix at offset
    __device__ __forceinline__ int param(int offset, int i) const {
        const int run = span * cols;  // a gate's rows of this block: contiguous in the parameter
        return span == count ? offset + begin * cols + i : offset + (i / run * units + begin) * cols + i % run;
    }
};

// This block's rows of matrix k and its replica, worked out once per launch
// into prnn_dyn_rows_of (divisions by run-time values: not in every matvec).
__shared__ prnn_dyn_rows prnn_dyn_rows_of[PRNN_DYN_MATRICES];
__device__ __forceinline__ prnn_dyn_rows prnn_dyn_block_rows(int k) {
    const int gates = prnn_dyn_matrix[k][8], units = prnn_dyn_matrix[k][0] / gates;
    const int per_block = prnn_dyn_matrix[k][2] / gates, holders = prnn_dyn_matrix[k][6];
    const int at = ((int)blockIdx.x - prnn_dyn_matrix[k][5] + (int)gridDim.x) % (int)gridDim.x;
    const bool holds = at < holders * prnn_dyn_matrix[k][7];
    const int begin = holds ? at % holders * per_block : 0, span = holds ? min(begin + per_block, units) - begin : 0;
    return {prnn_dyn_matrix[k][1], begin, span * gates, prnn_dyn_matrix[k][4], at / holders, span, units};
}

// Column c of a matvec's vector: a plain vector at a; for a cell over its
// matvec with two carried states [h; c] at a and b, their h halves.
__device__ __forceinline__ int prnn_dyn_input(int4 o, int c, int units, int carried) {
    return carried == 2 && c >= units ? o.z + c - units : o.y + c;
}

// Operand j of an instruction: {out, a, b, p}. The script is read-only for
// the whole launch, so the read-only path may cache it.
__device__ __forceinline__ int4 prnn_dyn_operand(const int* program, int first, int j) {
    return __ldg(reinterpret_cast<const int4*>(program) + first + j);
}

// log-sum-exp of z[0:n] minus z[label], by one thread: the classes of a
// node's loss are few (5 sentiments, 5 tags).
__device__ __forceinline__ void prnn_dyn_softmax(const float* z, int n, float* top, float* total) {
    float m = prnn_dyn_value(z);
    for (int i = 1; i < n; ++i) m = fmaxf(m, prnn_dyn_value(z + i));
    float s = 0.0f;
    for (int i = 0; i < n; ++i) s += expf(prnn_dyn_value(z + i) - m);
    *top = m;
    *total = s;
}

// A matvec's forward rows: this block's rows of matrix m times the group's
// first G vectors in vec (G a power of two at least in_group, so that a group
// of one vector does one vector's work), a warp per R rows, lanes along the
// rows, a shuffle reduction per row and vector; first is the group's first
// operand. R = 8 / G rows at once: their loads and reductions overlap, where
// one row after another made a holder's rows cost as much as its vectors at
// a few vectors a group (perf-notes dynamic §38-39). CELL: a cell over the
// matvec; each row's sum plus the addend's row (operand p) is the gate's
// pre-activation, kept after the state [h; c] (for the backward) and in
// gates[vector][row] for the cell.
template <int G, bool CELL>
__device__ __forceinline__ void prnn_dyn_matvec_rows(const prnn_dyn_rows& m, const float* weights, const float* vec,
                                                     float* values, float* gates, const int* program, int first,
                                                     int in_group) {
    constexpr int R = G >= 8 ? 1 : 8 / G;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r0 = warp * R; r0 < m.count; r0 += PRNN_DYN_WARPS * R) {
        float s[R][G];
#pragma unroll
        for (int q = 0; q < R; ++q)
#pragma unroll
            for (int j = 0; j < G; ++j) s[q][j] = 0.0f;
        for (int c = lane; c < m.cols; c += 32) {
            float x[G];
#pragma unroll
            for (int j = 0; j < G; ++j) x[j] = vec[j * PRNN_DYN_MAX_COLS + c];
#pragma unroll
            for (int q = 0; q < R; ++q) {
                const float wc = r0 + q < m.count ? weights[m.cache + (r0 + q) * m.cols + c] : 0.0f;
#pragma unroll
                for (int j = 0; j < G; ++j) s[q][j] = fmaf(wc, x[j], s[q][j]);
            }
        }
#pragma unroll
        for (int q = 0; q < R; ++q) {
            const int row = r0 + q < m.count ? m.row(r0 + q) : 0;
#pragma unroll
            for (int j = 0; j < G; ++j) {
                const float total = prnn_dyn_warp_sum(s[q][j]);
                if (lane == 0 && j < in_group && r0 + q < m.count) {
                    const int4 o = prnn_dyn_operand(program, first, j);
                    if (CELL) {
                        const float z = total + gates[j * PRNN_DYN_MAX_ROWS + r0 + q];  // the addend's row
                        values[o.x + 2 * m.units + row] = z;
                        gates[j * PRNN_DYN_MAX_ROWS + r0 + q] = z;
                    } else {
                        values[o.x + row] = total;
                    }
                }
            }
        }
    }
}

// The gates of a cell over its matvec, from a unit's pre-activation rows
// (this block's row q * span + u is gate q of its unit u): i, f, g, o for an
// LSTM; i, o, u (as g) and a forget gate per carried cell for a tree.
template <bool LSTM>
struct prnn_dyn_cell_rows {
    static constexpr int i = 0, g = 2, o = LSTM ? 3 : 1;
    __device__ __forceinline__ static int f(int k) { return LSTM ? 1 : 3 + k; }
};

// A cell over its matvec, forward, after every group's rows: a thread per
// (vector, unit of this block) of the whole instruction, so that the cells
// of many vectors run side by side (one pass per group of 8 vectors put a
// few threads' chain of loads and activations on every group: perf-notes
// dynamic §40). direct: one group whose gates are still in gates[vector][row]
// and whose carried cells thread (vector, unit) loaded before the products
// (kept); otherwise both are read from global memory. The carried cells are
// the c halves of the states at a (and b).
template <bool LSTM>
__device__ __forceinline__ void prnn_dyn_cell_matvec_forward(const prnn_dyn_rows& m, int carried, bool direct,
                                                             const float* gates, const float (&kept)[2],
                                                             float* values, const int* program, int first,
                                                             int count) {
    using Z = prnn_dyn_cell_rows<LSTM>;
    for (int e = threadIdx.x; e < count * m.span; e += PRNN_DYN_THREADS) {
        const int j = e / m.span, u = e - j * m.span, unit = m.begin + u;
        const int4 o = prnn_dyn_operand(program, first, j);
        // gate q's pre-activation at z[q * stride]
        const float* z = direct ? gates + j * PRNN_DYN_MAX_ROWS + u : values + o.x + 2 * m.units + unit;
        const int stride = direct ? m.span : m.units;
        float c = prnn_dyn_sigmoid(z[Z::i * stride]) * tanhf(z[Z::g * stride]);
#pragma unroll
        for (int k = 0; k < 2; ++k)  // constant bounds: kept stays in registers
            if (k < carried)
                c += prnn_dyn_sigmoid(z[Z::f(k) * stride]) *
                     (direct ? kept[k] : prnn_dyn_value(values + (k ? o.z : o.y) + m.units + unit));
        values[o.x + m.units + unit] = c;
        values[o.x + unit] = prnn_dyn_sigmoid(z[Z::o * stride]) * tanhf(c);
    }
}

#if PRNN_DYN_TRAIN
// A cell over its matvec, backward, before the transposed products: a thread
// per (vector, unit of this block) turns the state's gradients into its
// gates' and adds them into the addend's gradient, and the forget terms into
// the carried cells'. direct (one group): the gates' gradients go to
// dy[vector][row] (slots vectors, zeros past the group's count); otherwise to
// the node's gradient at its gates' storage, which each group then loads.
template <bool LSTM>
__device__ __forceinline__ void prnn_dyn_cell_matvec_backward(const prnn_dyn_rows& m, int carried, bool direct,
                                                              int slots, const float* values, float* grads,
                                                              float* dy, const int* program, int first, int count) {
    using Z = prnn_dyn_cell_rows<LSTM>;
    const int gate_count = m.count / max(m.span, 1);
    for (int e = threadIdx.x; e < (direct ? slots : count) * m.span; e += PRNN_DYN_THREADS) {
        const int j = e / m.span, u = e - j * m.span, unit = m.begin + u;
        if (j >= count) {
            for (int q = 0; q < gate_count; ++q) dy[j * PRNN_DYN_MAX_ROWS + q * m.span + u] = 0.0f;
            continue;
        }
        const int4 o = prnn_dyn_operand(program, first, j);
        // gate q's gradient at d[q * stride]
        float* d = direct ? dy + j * PRNN_DYN_MAX_ROWS + u : grads + o.x + 2 * m.units + unit;
        const int stride = direct ? m.span : m.units;
        const float* z = values + o.x + 2 * m.units + unit;  // gate q's pre-activation at z[q * units]
        const float gh = prnn_dyn_ld(grads + o.x + unit), t = tanhf(prnn_dyn_value(values + o.x + m.units + unit));
        const float so = prnn_dyn_sigmoid(prnn_dyn_value(z + Z::o * m.units));
        float dz[5];  // i, f / o, g, ... by gate row; a tree's gates are at most 3 + 2
        dz[Z::o] = gh * t * so * (1.0f - so);
        const float dc = prnn_dyn_ld(grads + o.x + m.units + unit) + gh * so * (1.0f - t * t);
        const float si = prnn_dyn_sigmoid(prnn_dyn_value(z + Z::i * m.units));
        const float tg = tanhf(prnn_dyn_value(z + Z::g * m.units));
        dz[Z::i] = dc * tg * si * (1.0f - si);
        dz[Z::g] = dc * si * (1.0f - tg * tg);
        if (LSTM && carried == 0) dz[Z::f(0)] = 0.0f;  // the zero state's forget gate has no effect
#pragma unroll
        for (int k = 0; k < 2; ++k) {  // constant bounds: dz stays in registers
            if (k >= carried) continue;
            const int kept = (k ? o.z : o.y) + m.units + unit;
            const float sf = prnn_dyn_sigmoid(prnn_dyn_value(z + Z::f(k) * m.units));
            dz[Z::f(k)] = dc * prnn_dyn_value(values + kept) * sf * (1.0f - sf);
            atomicAdd(grads + kept, dc * sf);
        }
#pragma unroll
        for (int q = 0; q < 5; ++q)
            if (q < gate_count) {
                d[q * stride] = dz[q];
                atomicAdd(grads + o.w + q * m.units + unit, dz[q]);
            }
    }
}
#endif

#if PRNN_DYN_TRAIN
// A matvec's backward columns: a thread per column of this block's rows of
// matrix m, its part of W^T dy for the group's first G vectors (atomics:
// other blocks hold the other rows) and its column of sum_j dy_j x_j^T into
// the cached gradient. G as the forward's: a group of one vector does one
// vector's work (every group did all 8 slots' before, zeros past the group;
// perf-notes dynamic §39).
template <int G>
__device__ __forceinline__ void prnn_dyn_matvec_columns(const prnn_dyn_rows& m, const float* weights, float* wgrads,
                                                        const float* vec, const float* dy, float* grads,
                                                        const int* program, int first, int in_group, int carried) {
    for (int c = threadIdx.x; c < m.cols; c += PRNN_DYN_THREADS) {
        float s[G], x[G];
#pragma unroll
        for (int j = 0; j < G; ++j) {
            s[j] = 0.0f;
            x[j] = vec[j * PRNN_DYN_MAX_COLS + c];
        }
        for (int r = 0; r < m.count; ++r) {
            const int at = m.cache + r * m.cols + c;
            const float w = weights[at];
            float acc = wgrads[at];
#pragma unroll
            for (int j = 0; j < G; ++j) {
                const float d = dy[j * PRNN_DYN_MAX_ROWS + r];
                s[j] = fmaf(w, d, s[j]);
                acc = fmaf(d, x[j], acc);
            }
            wgrads[at] = acc;
        }
#pragma unroll
        for (int j = 0; j < G; ++j)
            if (j < in_group) atomicAdd(grads + prnn_dyn_input(prnn_dyn_operand(program, first, j), c, m.units, carried), s[j]);
    }
}
#endif

// A matvec instruction (op PRNN_OP_MATVEC, n its columns) or a cell over its
// matvec (PRNN_OP_LSTM_MATVEC, PRNN_OP_TREE_MATVEC, n = 4 * matrix + carried
// cells): this block's rows of matrix k times every listed vector,
// PRNN_DYN_GROUP vectors at a time so that each weight read from shared
// memory serves the whole group. Forward: prnn_dyn_matvec_rows, then the
// cells of this block's units; backward: the cells' gate gradients, then
// prnn_dyn_matvec_columns.
__device__ __forceinline__ void prnn_dyn_matvec(int op, int n, const int* program, int first, int count,
                                                float* values, float* grads, float* vec, float* dy,
                                                const float* weights, float* wgrads) {
    const bool backward = op >= PRNN_OP_BACKWARD;
    const int kind = op % PRNN_OP_BACKWARD;  // PRNN_OP_MATVEC, PRNN_OP_LSTM_MATVEC or PRNN_OP_TREE_MATVEC
    const bool cell = kind != PRNN_OP_MATVEC;
    const int k = cell ? n / 4 : prnn_dyn_operand(program, first, 0).w, carried = cell ? n % 4 : 0;
    const prnn_dyn_rows m = prnn_dyn_rows_of[k];
    const int tid = threadIdx.x;
    // A cell's instruction of one group whose (vector, unit) pairs fit the
    // block keeps its gates in shared memory and its carried cells in the
    // registers of the thread that finishes the cell, loaded beside the
    // vectors: no trip to memory between the products and the cell.
    const bool direct = cell && count <= PRNN_DYN_GROUP && count * m.span <= PRNN_DYN_THREADS;
    float kept[2] = {0.0f, 0.0f};
#if PRNN_DYN_TRAIN
    if (backward && cell && !direct) {  // every vector's gate gradients first, by all threads, into global memory
        if (kind == PRNN_OP_LSTM_MATVEC)
            prnn_dyn_cell_matvec_backward<true>(m, carried, false, 0, values, grads, dy, program, first, count);
        else
            prnn_dyn_cell_matvec_backward<false>(m, carried, false, 0, values, grads, dy, program, first, count);
        __syncthreads();
    }
#endif
    for (int g0 = 0; g0 < count; g0 += PRNN_DYN_GROUP) {
        const int in_group = min(PRNN_DYN_GROUP, count - g0);
        // Both directions read the first `slots` vectors; vectors past the
        // group's end are zeros (they add nothing to the gradient).
        const int slots = in_group <= 1 ? 1 : in_group <= 2 ? 2 : in_group <= 4 ? 4 : 8;
        // A cell's addend rows, which the products add to, and (direct) its
        // carried cells: loaded before the vectors' stores wait for their
        // loads, so that all are one trip to memory (after them, the group
        // paid a second: perf-notes dynamic §40).
        constexpr int ADDEND = (PRNN_DYN_GROUP * PRNN_DYN_MAX_ROWS + PRNN_DYN_THREADS - 1) / PRNN_DYN_THREADS;
        float addend[ADDEND];
        if (!backward && cell) {
#pragma unroll
            for (int i = 0; i < ADDEND; ++i) {
                const int e = tid + i * PRNN_DYN_THREADS, j = e / m.count, r = e - j * m.count;
                addend[i] = j < in_group ? prnn_dyn_value(values + prnn_dyn_operand(program, first, g0 + j).w +
                                                          m.row(r))
                                         : 0.0f;
            }
            if (direct && tid < count * m.span) {
                const int j = tid / m.span, unit = m.begin + tid - j * m.span;
                const int4 o = prnn_dyn_operand(program, first, j);
#pragma unroll
                for (int q = 0; q < 2; ++q)  // constant bounds: kept stays in registers
                    if (q < carried) kept[q] = prnn_dyn_value(values + (q ? o.z : o.y) + m.units + unit);
            }
        }
        // A thread's columns, all vectors' loads of a column before its
        // stores (no division by the column count: ~20 instructions each).
        for (int c = tid; c < m.cols; c += PRNN_DYN_THREADS) {
            float x[PRNN_DYN_GROUP];
#pragma unroll
            for (int j = 0; j < PRNN_DYN_GROUP; ++j)
                x[j] = j < in_group ? prnn_dyn_value(values + prnn_dyn_input(prnn_dyn_operand(program, first, g0 + j),
                                                                             c, m.units, carried))
                                    : 0.0f;
#pragma unroll
            for (int j = 0; j < PRNN_DYN_GROUP; ++j)
                if (j < slots) vec[j * PRNN_DYN_MAX_COLS + c] = x[j];
        }
        if (!backward && cell)
#pragma unroll
            for (int i = 0; i < ADDEND; ++i) {
                const int e = tid + i * PRNN_DYN_THREADS, j = e / m.count;
                if (j < in_group) dy[j * PRNN_DYN_MAX_ROWS + e - j * m.count] = addend[i];
            }
#if PRNN_DYN_TRAIN
        if (backward && direct && kind == PRNN_OP_LSTM_MATVEC)
            prnn_dyn_cell_matvec_backward<true>(m, carried, true, slots, values, grads, dy, program, first, count);
        else if (backward && direct)
            prnn_dyn_cell_matvec_backward<false>(m, carried, true, slots, values, grads, dy, program, first, count);
        else if (backward)  // a matvec's output gradient; a cell's gates' (from the pass above)
            for (int e = tid; e < slots * m.count; e += PRNN_DYN_THREADS) {
                const int j = e / m.count, r = e - j * m.count;
                dy[j * PRNN_DYN_MAX_ROWS + r] =
                    j < in_group ? prnn_dyn_ld(grads + prnn_dyn_operand(program, first, g0 + j).x +
                                               (cell ? 2 * m.units : 0) + m.row(r))
                                 : 0.0f;
            }
#endif
        __syncthreads();
        static_assert(PRNN_DYN_GROUP == 8, "the slot counts below are the powers of two up to 8");
        if (!backward) {
#define PRNN_DYN_ROWS(G)                                                                                      \
    if (cell) prnn_dyn_matvec_rows<G, true>(m, weights, vec, values, dy, program, first + g0, in_group);      \
    else prnn_dyn_matvec_rows<G, false>(m, weights, vec, values, dy, program, first + g0, in_group)
            if (slots == 1) { PRNN_DYN_ROWS(1); }
            else if (slots == 2) { PRNN_DYN_ROWS(2); }
            else if (slots == 4) { PRNN_DYN_ROWS(4); }
            else { PRNN_DYN_ROWS(8); }
#undef PRNN_DYN_ROWS
        }
#if PRNN_DYN_TRAIN
        else {
#define PRNN_DYN_COLUMNS(G) \
    prnn_dyn_matvec_columns<G>(m, weights, wgrads, vec, dy, grads, program, first + g0, in_group, carried)
            if (slots == 1) PRNN_DYN_COLUMNS(1);
            else if (slots == 2) PRNN_DYN_COLUMNS(2);
            else if (slots == 4) PRNN_DYN_COLUMNS(4);
            else PRNN_DYN_COLUMNS(8);
#undef PRNN_DYN_COLUMNS
        }
#endif
        __syncthreads();  // the group's buffers are free for the next; a cell's gates are all written
    }
    if (cell && !backward) {
        if (kind == PRNN_OP_LSTM_MATVEC)
            prnn_dyn_cell_matvec_forward<true>(m, carried, direct, dy, kept, values, program, first, count);
        else
            prnn_dyn_cell_matvec_forward<false>(m, carried, direct, dy, kept, values, program, first, count);
        __syncthreads();  // the next instruction's loads overwrite dy
    }
}

// A forward elementwise op on x (a's element; a lookup's parameter) and y (b's).
__device__ __forceinline__ float prnn_dyn_apply(int op, float x, float y) {
    switch (op) {
    case PRNN_OP_ADD: return x + y;
    case PRNN_OP_MUL: return x * y;
    case PRNN_OP_TANH: return tanhf(x);
    case PRNN_OP_SIGMOID: return prnn_dyn_sigmoid(x);
    case PRNN_OP_RELU: return fmaxf(x, 0.0f);
    case PRNN_OP_SIGMOID_MUL: return prnn_dyn_sigmoid(x) * y;
    case PRNN_OP_SIGMOID_MUL_TANH: return prnn_dyn_sigmoid(x) * tanhf(y);
    default: return x;  // lookup, copy
    }
}

// A forward instruction of op OP, by every thread of the block over the
// flattened (operand, element) range: PRNN_DYN_UNROLL elements per thread
// load before any stores, which is safe because no node of an instruction
// reads another's output (they have one depth) and every node has its own
// storage. OP is a template argument so that each op's element loop carries
// no test of it.
template <int OP>
__device__ __forceinline__ void prnn_dyn_forward(int n, int count, const int* program, int first, float* values,
                                                 const float* params) {
    constexpr bool binary = OP == PRNN_OP_ADD || OP == PRNN_OP_MUL || OP == PRNN_OP_SIGMOID_MUL ||
                            OP == PRNN_OP_SIGMOID_MUL_TANH;
    for (int e0 = threadIdx.x; e0 < count * n; e0 += PRNN_DYN_UNROLL * PRNN_DYN_THREADS) {
        float x[PRNN_DYN_UNROLL], y[PRNN_DYN_UNROLL];
        int out[PRNN_DYN_UNROLL];
#pragma unroll
        for (int u = 0; u < PRNN_DYN_UNROLL; ++u) {
            const int e = e0 + u * PRNN_DYN_THREADS, j = e / n, i = e - j * n;
            out[u] = -1;
            x[u] = y[u] = 0.0f;
            if (e < count * n) {
                const int4 o = prnn_dyn_operand(program, first, j);
                out[u] = o.x + i;
                x[u] = OP == PRNN_OP_LOOKUP ? params[o.w + i] : prnn_dyn_value(values + o.y + i);
                if (binary) y[u] = prnn_dyn_value(values + o.z + i);
            }
        }
#pragma unroll
        for (int u = 0; u < PRNN_DYN_UNROLL; ++u)
            if (out[u] >= 0) values[out[u]] = prnn_dyn_apply(OP, x[u], y[u]);
    }
}

// A cell (Graph.lstm_cell, TREE false; Graph.tree_cell, TREE true) over its
// operands' n / 2 units: out[0:m] = h, out[m:2m] = c from the gates' pre-
// activations at a, [i, f, g, o] (LSTM) or [i, o, u, f_1, f_2] (TREE), and,
// where p is 1, the carried cell(s) at b. One pass where the gated products
// took five instructions on the chain of a step (perf-notes dynamic §37).
template <bool TREE>
struct prnn_dyn_cell_gates {
    int i, o, g, m;
    __device__ __forceinline__ prnn_dyn_cell_gates(int a, int n) : i(a), o(a + (TREE ? n / 2 : 3 * (n / 2))),
                                                                   g(a + 2 * (n / 2)), m(n / 2) {}
    // the forget gate of carried cell k
    __device__ __forceinline__ int f(int k) const { return i + (TREE ? (3 + k) * m : m); }
    static constexpr int carried = TREE ? 2 : 1;
};

template <bool TREE>
__device__ __forceinline__ void prnn_dyn_cell_forward(int n, int count, const int* program, int first,
                                                      float* values) {
    const int m = n / 2;
    for (int e = threadIdx.x; e < count * m; e += PRNN_DYN_THREADS) {
        const int j = e / m, u = e - j * m;
        const int4 o = prnn_dyn_operand(program, first, j);
        const prnn_dyn_cell_gates<TREE> z(o.y + u, n);
        float c = prnn_dyn_sigmoid(prnn_dyn_value(values + z.i)) * tanhf(prnn_dyn_value(values + z.g));
        if (o.w)
#pragma unroll
            for (int k = 0; k < z.carried; ++k)
                c += prnn_dyn_sigmoid(prnn_dyn_value(values + z.f(k))) * prnn_dyn_value(values + o.z + k * m + u);
        values[o.x + m + u] = c;
        values[o.x + u] = prnn_dyn_sigmoid(prnn_dyn_value(values + z.o)) * tanhf(c);
    }
}

#if PRNN_DYN_TRAIN
template <bool TREE>
__device__ __forceinline__ void prnn_dyn_cell_backward(int n, int count, const int* program, int first,
                                                       const float* values, float* grads) {
    const int m = n / 2;
    for (int e = threadIdx.x; e < count * m; e += PRNN_DYN_THREADS) {
        const int j = e / m, u = e - j * m;
        const int4 o = prnn_dyn_operand(program, first, j);
        const prnn_dyn_cell_gates<TREE> z(o.y + u, n);
        const float gh = prnn_dyn_ld(grads + o.x + u), t = tanhf(prnn_dyn_value(values + o.x + m + u));
        const float so = prnn_dyn_sigmoid(prnn_dyn_value(values + z.o));
        atomicAdd(grads + z.o, gh * t * so * (1.0f - so));
        const float dc = prnn_dyn_ld(grads + o.x + m + u) + gh * so * (1.0f - t * t);
        const float si = prnn_dyn_sigmoid(prnn_dyn_value(values + z.i)), tg = tanhf(prnn_dyn_value(values + z.g));
        atomicAdd(grads + z.i, dc * tg * si * (1.0f - si));
        atomicAdd(grads + z.g, dc * si * (1.0f - tg * tg));
        if (o.w)
#pragma unroll
            for (int k = 0; k < z.carried; ++k) {
                const int carried = o.z + k * m + u;
                const float sf = prnn_dyn_sigmoid(prnn_dyn_value(values + z.f(k)));
                atomicAdd(grads + z.f(k), dc * prnn_dyn_value(values + carried) * sf * (1.0f - sf));
                atomicAdd(grads + carried, dc * sf);
            }
    }
}

// A backward instruction of op OP (a forward op + PRNN_OP_BACKWARD), by every
// thread of the block over the flattened (operand, element) range.
template <int OP>
__device__ __forceinline__ void prnn_dyn_backward(int n, int count, const int* program, int first,
                                                  const float* values, float* grads, float* param_grads) {
    for (int e = threadIdx.x; e < count * n; e += PRNN_DYN_THREADS) {
        const int j = e / n, i = e - j * n;
        const int4 o = prnn_dyn_operand(program, first, j);
        const int out = o.x + i, a = o.y + i, b = o.z + i;
        switch (OP) {
        // Backward: a node's gradient gathers from every consumer, which may
        // run on other blocks, so every accumulation is an atomic add in L2.
        case PRNN_OP_LOOKUP + PRNN_OP_BACKWARD: atomicAdd(param_grads + o.w + i, prnn_dyn_ld(grads + out)); break;
        case PRNN_OP_ADD + PRNN_OP_BACKWARD: {
            const float g = prnn_dyn_ld(grads + out);
            atomicAdd(grads + a, g);
            atomicAdd(grads + b, g);
            break;
        }
        case PRNN_OP_MUL + PRNN_OP_BACKWARD: {
            const float g = prnn_dyn_ld(grads + out);
            atomicAdd(grads + a, g * prnn_dyn_value(values + b));
            atomicAdd(grads + b, g * prnn_dyn_value(values + a));
            break;
        }
        case PRNN_OP_TANH + PRNN_OP_BACKWARD: {
            const float y = prnn_dyn_value(values + out);
            atomicAdd(grads + a, prnn_dyn_ld(grads + out) * (1.0f - y * y));
            break;
        }
        case PRNN_OP_SIGMOID + PRNN_OP_BACKWARD: {
            const float y = prnn_dyn_value(values + out);
            atomicAdd(grads + a, prnn_dyn_ld(grads + out) * y * (1.0f - y));
            break;
        }
        case PRNN_OP_RELU + PRNN_OP_BACKWARD:
            if (prnn_dyn_value(values + out) > 0.0f) atomicAdd(grads + a, prnn_dyn_ld(grads + out));
            break;
        // The fused gated products recompute sigmoid(a) (and tanh(b)) from
        // their inputs: their output is the product, not the factors.
        case PRNN_OP_SIGMOID_MUL + PRNN_OP_BACKWARD: {
            const float g = prnn_dyn_ld(grads + out), s = prnn_dyn_sigmoid(prnn_dyn_value(values + a));
            const float y = prnn_dyn_value(values + b);
            atomicAdd(grads + a, g * y * s * (1.0f - s));
            atomicAdd(grads + b, g * s);
            break;
        }
        case PRNN_OP_SIGMOID_MUL_TANH + PRNN_OP_BACKWARD: {
            const float g = prnn_dyn_ld(grads + out), s = prnn_dyn_sigmoid(prnn_dyn_value(values + a));
            const float t = tanhf(prnn_dyn_value(values + b));
            atomicAdd(grads + a, g * t * s * (1.0f - s));
            atomicAdd(grads + b, g * s * (1.0f - t * t));
            break;
        }
        case PRNN_OP_COPY + PRNN_OP_BACKWARD: atomicAdd(grads + a, prnn_dyn_ld(grads + out)); break;
        case PRNN_OP_LOSS + PRNN_OP_BACKWARD: {
            float top, total;
            prnn_dyn_softmax(values + o.y, n, &top, &total);
            atomicAdd(grads + a, expf(prnn_dyn_value(values + a) - top) / total - (i == o.w ? 1.0f : 0.0f));
            break;
        }
        default: break;
        }
    }
}
#endif

// Any other instruction, by every thread of the block; the caller
// synchronises the block after it.
__device__ __forceinline__ void prnn_dyn_elementwise(int op, int n, int count, const int* program, int first,
                                                     float* values, float* grads, const float* params,
                                                     float* param_grads, float* loss) {
    const int tid = threadIdx.x;
    if (op == PRNN_OP_LOSS) {
        for (int j = tid; j < count; j += PRNN_DYN_THREADS) {
            const int4 o = prnn_dyn_operand(program, first, j);
            float top, total;
            prnn_dyn_softmax(values + o.y, n, &top, &total);
            const float l = top + logf(total) - prnn_dyn_value(values + o.y + o.w);
            values[o.x] = l;
            atomicAdd(loss, l);
        }
        return;
    }
    // One element loop per op (a template argument): the loops carry no test of the op, which measured 6%
    // of a training launch at every batch (perf-notes dynamic §27).
#define PRNN_DYN_FORWARD(OP) \
    case OP: return prnn_dyn_forward<OP>(n, count, program, first, values, params)
    switch (op) {
        PRNN_DYN_FORWARD(PRNN_OP_LOOKUP);
        PRNN_DYN_FORWARD(PRNN_OP_ADD);
        PRNN_DYN_FORWARD(PRNN_OP_MUL);
        PRNN_DYN_FORWARD(PRNN_OP_TANH);
        PRNN_DYN_FORWARD(PRNN_OP_SIGMOID);
        PRNN_DYN_FORWARD(PRNN_OP_RELU);
        PRNN_DYN_FORWARD(PRNN_OP_COPY);
        PRNN_DYN_FORWARD(PRNN_OP_SIGMOID_MUL);
        PRNN_DYN_FORWARD(PRNN_OP_SIGMOID_MUL_TANH);
    case PRNN_OP_LSTM_CELL: return prnn_dyn_cell_forward<false>(n, count, program, first, values);
    case PRNN_OP_TREE_CELL: return prnn_dyn_cell_forward<true>(n, count, program, first, values);
    default: break;
    }
#undef PRNN_DYN_FORWARD
#if PRNN_DYN_TRAIN
#define PRNN_DYN_BACKWARD(OP) \
    case OP + PRNN_OP_BACKWARD: \
        return prnn_dyn_backward<OP + PRNN_OP_BACKWARD>(n, count, program, first, values, grads, param_grads)
    switch (op) {
        PRNN_DYN_BACKWARD(PRNN_OP_LOOKUP);
        PRNN_DYN_BACKWARD(PRNN_OP_ADD);
        PRNN_DYN_BACKWARD(PRNN_OP_MUL);
        PRNN_DYN_BACKWARD(PRNN_OP_TANH);
        PRNN_DYN_BACKWARD(PRNN_OP_SIGMOID);
        PRNN_DYN_BACKWARD(PRNN_OP_RELU);
        PRNN_DYN_BACKWARD(PRNN_OP_COPY);
        PRNN_DYN_BACKWARD(PRNN_OP_LOSS);
        PRNN_DYN_BACKWARD(PRNN_OP_SIGMOID_MUL);
        PRNN_DYN_BACKWARD(PRNN_OP_SIGMOID_MUL_TANH);
    case PRNN_OP_LSTM_CELL + PRNN_OP_BACKWARD:
        return prnn_dyn_cell_backward<false>(n, count, program, first, values, grads);
    case PRNN_OP_TREE_CELL + PRNN_OP_BACKWARD:
        return prnn_dyn_cell_backward<true>(n, count, program, first, values, grads);
    default: break;
    }
#undef PRNN_DYN_BACKWARD
#endif
}

#if PRNN_DYN_TRAIN
// SGD (beta1 == 0) or Adam with torch.optim's formulas; correction1 is
// 1 / (1 - beta1^t), correction2 is sqrt(1 / (1 - beta2^t)).
__device__ __forceinline__ float prnn_dyn_update(float p, float g, int i, float* adam_m, float* adam_v, float lr,
                                                 float beta1, float beta2, float eps, float correction1,
                                                 float correction2) {
    if (beta1 == 0.0f) return p - lr * g;
    const float m = beta1 * adam_m[i] + (1.0f - beta1) * g;
    const float v = beta2 * adam_v[i] + (1.0f - beta2) * g * g;
    adam_m[i] = m;
    adam_v[i] = v;
    return p - lr * correction1 * m / (sqrtf(v) * correction2 + eps);
}
#endif

// ---- kernel ----

extern "C" __global__ void __launch_bounds__(PRNN_DYN_THREADS, 1)
dynamic_interpreter(const int* __restrict__ program, const int* __restrict__ starts, float* values, float* grads,
                    float* params, float* param_grads, float* adam_m, float* adam_v, float* loss,
                    prnn_u32* counter, int dense_begin, int dense_end, float lr, float beta1, float beta2, float eps,
                    float correction1, float correction2, int* status, int* report,
                    prnn_u64 timeout_ns PRNN_DYN_PROFILE_PARAM) {
    extern __shared__ float4 prnn_dyn_shared[];
    int* script = reinterpret_cast<int*>(prnn_dyn_shared);
    float* vec = reinterpret_cast<float*>(script + PRNN_DYN_CHUNK * PRNN_DYN_WORDS);
    float* dy = vec + PRNN_DYN_GROUP * PRNN_DYN_MAX_COLS;
    float* weights = dy + PRNN_DYN_GROUP * PRNN_DYN_MAX_ROWS;
    float* wgrads = PRNN_DYN_TRAIN ? weights + PRNN_DYN_WEIGHT_FLOATS : nullptr;
    __shared__ int failed;
    const prnn_watch watch{status, report, timeout_ns};
    const int tid = threadIdx.x;

    for (int k = tid; k < PRNN_DYN_MATRICES; k += PRNN_DYN_THREADS) prnn_dyn_rows_of[k] = prnn_dyn_block_rows(k);
    __syncthreads();
    for (int k = 0; k < PRNN_DYN_MATRICES; ++k) {
        const prnn_dyn_rows m = prnn_dyn_rows_of[k];
        for (int i = tid; i < m.count * m.cols; i += PRNN_DYN_THREADS) {
            weights[m.cache + i] = params[m.param(prnn_dyn_matrix[k][3], i)];
            if (PRNN_DYN_TRAIN) wgrads[m.cache + i] = 0.0f;
        }
    }
    if (tid == 0) failed = 0;
#if PRNN_DYN_PROFILE
    __shared__ unsigned long long profile_cycles[PRNN_DYN_PROFILE_SLOTS], profile_count[PRNN_DYN_PROFILE_SLOTS];
    if (tid < PRNN_DYN_PROFILE_SLOTS) profile_cycles[tid] = profile_count[tid] = 0;
    const prnn_u32 loop_cycles = (prnn_u32)clock();
    const prnn_u64 loop_ns = prnn_globaltimer();
#endif
    __syncthreads();

    const int begin = starts[blockIdx.x], end = starts[blockIdx.x + 1];
    prnn_u32 closing = 0;  // the last wait's target: every block's closing wait in training
    for (int base = begin; base < end; base += PRNN_DYN_CHUNK) {
        const int count = min(PRNN_DYN_CHUNK, end - base);
        PRNN_DYN_MARK(fetched);
        for (int i = tid; i < count * PRNN_DYN_WORDS; i += PRNN_DYN_THREADS)
            script[i] = program[(long long)base * PRNN_DYN_WORDS + i];
        __syncthreads();
        PRNN_DYN_COUNT(0, fetched);
        for (int k = 0; k < count; ++k) {
            const int* in = script + k * PRNN_DYN_WORDS;
            PRNN_DYN_MARK(started);
            if (in[0] == PRNN_OP_WAIT) {
                closing = (prnn_u32)in[3];
                prnn_u32 seen;
                if (tid == 0 && !prnn_wait_counter(counter, (prnn_u32)in[3], watch, PRNN_STATUS_GRID_BARRIER_TIMEOUT,
                                                   &seen))
                    failed = 1;
                __syncthreads();
                if (failed) return;
            } else if (in[0] == PRNN_OP_SIGNAL) {
                // Every thread's writes of the level precede this (the
                // barrier after each instruction); the release publishes them.
                if (tid == 0) prnn_red_release_gpu_add(counter, 1u);
            } else if (const int kind = in[0] % PRNN_OP_BACKWARD;
                       kind == PRNN_OP_MATVEC || kind == PRNN_OP_LSTM_MATVEC || kind == PRNN_OP_TREE_MATVEC) {
                prnn_dyn_matvec(in[0], in[1], program, in[3], in[2], values, grads, vec, dy, weights, wgrads);
            } else {
                prnn_dyn_elementwise(in[0], in[1], in[2], program, in[3], values, grads, params, param_grads, loss);
                __syncthreads();
            }
            PRNN_DYN_COUNT(in[0], started);
        }
        __syncthreads();  // every thread is done with the chunk before the next overwrites it
    }
#if PRNN_DYN_PROFILE
    if (tid == 0) {
        unsigned long long* mine = profile + (long long)blockIdx.x * (2 * PRNN_DYN_PROFILE_SLOTS + 2);
        for (int s = 0; s < PRNN_DYN_PROFILE_SLOTS; ++s) {
            mine[2 * s] = profile_cycles[s];
            mine[2 * s + 1] = profile_count[s];
        }
        mine[2 * PRNN_DYN_PROFILE_SLOTS] = (prnn_u32)clock() - loop_cycles;
        mine[2 * PRNN_DYN_PROFILE_SLOTS + 1] = prnn_globaltimer() - loop_ns;
    }
#endif

#if PRNN_DYN_TRAIN
#if PRNN_DYN_REPLICATED
    // A matrix with replicas: every replica adds its rows' gradient into
    // param_grads (zeroed before the launch); past one more arrival of every
    // block, the first replica updates the rows from the sum (below).
    for (int k = 0; k < PRNN_DYN_MATRICES; ++k) {
        const prnn_dyn_rows m = prnn_dyn_rows_of[k];
        if (prnn_dyn_matrix[k][7] > 1)
            for (int i = tid; i < m.count * m.cols; i += PRNN_DYN_THREADS)
                atomicAdd(param_grads + m.param(prnn_dyn_matrix[k][3], i), wgrads[m.cache + i]);
    }
    __syncthreads();
    if (tid == 0) {
        prnn_u32 seen;
        prnn_red_release_gpu_add(counter, 1u);
        if (!prnn_wait_counter(counter, closing + gridDim.x, watch, PRNN_STATUS_GRID_BARRIER_TIMEOUT, &seen))
            failed = 1;
    }
    __syncthreads();
    if (failed) return;
#endif
    // Matrices: this block's rows, from its caches; the gradient is written
    // out too, for the caller to read (a replicated matrix's is the sum).
    for (int k = 0; k < PRNN_DYN_MATRICES; ++k) {
        const prnn_dyn_rows m = prnn_dyn_rows_of[k];
        const int offset = prnn_dyn_matrix[k][3];
        const bool replicated = prnn_dyn_matrix[k][7] > 1;
        if (replicated && m.replica != 0) continue;
        // The update loops load PRNN_DYN_UNROLL elements a thread before they store any: one element at a time,
        // each waiting for its trip to memory, they cost a training launch 14-19 µs more at the kernel's tail
        // (perf-notes dynamic §29; the copy into shared memory above measured no gain from the same change).
        const int n = m.count * m.cols;
        for (int i0 = tid; i0 < n; i0 += PRNN_DYN_UNROLL * PRNN_DYN_THREADS) {
            float g[PRNN_DYN_UNROLL];
#pragma unroll
            for (int u = 0; u < PRNN_DYN_UNROLL; ++u) {
                const int i = i0 + u * PRNN_DYN_THREADS;
                g[u] = i >= n ? 0.0f : replicated ? prnn_dyn_ld(param_grads + m.param(offset, i)) : wgrads[m.cache + i];
            }
#pragma unroll
            for (int u = 0; u < PRNN_DYN_UNROLL; ++u) {
                const int i = i0 + u * PRNN_DYN_THREADS;
                if (i >= n) continue;
                const int at = m.param(offset, i);
                if (!replicated) param_grads[at] = g[u];
                params[at] = prnn_dyn_update(weights[m.cache + i], g[u], at, adam_m, adam_v, lr, beta1, beta2, eps,
                                             correction1, correction2);
            }
        }
    }
    // Biases and embeddings, after the script's closing barrier of every
    // block: their gradients are complete and nobody reads them any more.
    const int stride = (int)gridDim.x * PRNN_DYN_THREADS;
    for (int i0 = dense_begin + (int)blockIdx.x * PRNN_DYN_THREADS + tid; i0 < dense_end;
         i0 += PRNN_DYN_UNROLL * stride) {
        float p[PRNN_DYN_UNROLL], g[PRNN_DYN_UNROLL];
#pragma unroll
        for (int u = 0; u < PRNN_DYN_UNROLL; ++u) {
            const int i = i0 + u * stride;
            p[u] = i < dense_end ? params[i] : 0.0f;
            g[u] = i < dense_end ? prnn_dyn_ld(param_grads + i) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < PRNN_DYN_UNROLL; ++u) {
            const int i = i0 + u * stride;
            if (i < dense_end)
                params[i] = prnn_dyn_update(p[u], g[u], i, adam_m, adam_v, lr, beta1, beta2, eps, correction1,
                                            correction2);
        }
    }
#endif
}
