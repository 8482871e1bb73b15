// The dynamic-network interpreter (VPPS): every block is a virtual processor
// that runs its own script of fixed-width instructions (persistrnn/dynamic/
// script.py) from shared memory. The rows of every weight matrix are spread
// over the blocks and cached in shared memory for the whole launch, with their
// gradients beside them when training; forward, backward and the optimiser
// update run in one launch. Blocks order their work through one counter that
// only grows (signal: +1 after a level's work; wait: until the counter reaches
// the number of signals of all earlier levels), with bounded waits.
//
// The generated prelude defines (persistrnn/dynamic/kernel.py):
//   PRNN_DYN_THREADS, PRNN_DYN_CHUNK (instructions fetched into shared memory
//   at a time), PRNN_DYN_MATRICES, PRNN_DYN_MAX_COLS, PRNN_DYN_MAX_ROWS (rows
//   of one matrix on one block), PRNN_DYN_WEIGHT_FLOATS (cache floats per
//   block), PRNN_DYN_TRAIN, the opcodes PRNN_OP_*, and
//   prnn_dyn_matrix[k] = {rows, cols, rows per block, parameter offset, cache offset}.

#define PRNN_DYN_WORDS 8
#define PRNN_DYN_WARPS (PRNN_DYN_THREADS / 32)

// Values and gradients are written by other SMs during the launch: read them
// through L2 (.cg) so that no stale L1 line serves them.
__device__ __forceinline__ float prnn_dyn_ld(const float* p) { return __ldcg(p); }

__device__ __forceinline__ float prnn_dyn_warp_sum(float s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

struct prnn_dyn_rows {
    int cols, begin, count, cache;
};

// This block's rows of matrix k.
__device__ __forceinline__ prnn_dyn_rows prnn_dyn_block_rows(int k) {
    const int rows = prnn_dyn_matrix[k][0], per_block = prnn_dyn_matrix[k][2];
    const int begin = min((int)blockIdx.x * per_block, rows);
    return {prnn_dyn_matrix[k][1], begin, min(begin + per_block, rows) - begin, prnn_dyn_matrix[k][4]};
}

// log-sum-exp of z[0:n] minus z[label], by one thread: the classes of a
// node's loss are few (5 sentiments, 5 tags).
__device__ __forceinline__ void prnn_dyn_softmax(const float* z, int n, float* top, float* total) {
    float m = prnn_dyn_ld(z);
    for (int i = 1; i < n; ++i) m = fmaxf(m, prnn_dyn_ld(z + i));
    float s = 0.0f;
    for (int i = 0; i < n; ++i) s += expf(prnn_dyn_ld(z + i) - m);
    *top = m;
    *total = s;
}

// One instruction other than wait/signal, by every thread of the block; the
// caller synchronises the block after it.
__device__ __forceinline__ void prnn_dyn_execute(const int* in, float* values, float* grads, const float* params,
                                                 float* param_grads, float* loss, float* vec, float* dy,
                                                 const float* weights, float* wgrads) {
    const int op = in[0], n = in[1], out = in[2], a = in[3], b = in[4], p0 = in[5];
    const int tid = threadIdx.x;
    switch (op) {
    case PRNN_OP_LOOKUP:
        for (int i = tid; i < n; i += PRNN_DYN_THREADS) values[out + i] = params[p0 + i];
        break;
    case PRNN_OP_MATVEC: {
        const prnn_dyn_rows m = prnn_dyn_block_rows(p0);
        for (int i = tid; i < m.cols; i += PRNN_DYN_THREADS) vec[i] = prnn_dyn_ld(values + a + i);
        __syncthreads();
        // A warp per row: lanes stride the row in shared memory (consecutive
        // banks), then a shuffle reduction.
        const int warp = tid / 32, lane = tid % 32;
        for (int r = warp; r < m.count; r += PRNN_DYN_WARPS) {
            const float* w = weights + m.cache + r * m.cols;
            float s = 0.0f;
            for (int c = lane; c < m.cols; c += 32) s = fmaf(w[c], vec[c], s);
            s = prnn_dyn_warp_sum(s);
            if (lane == 0) values[out + m.begin + r] = s;
        }
        break;
    }
    case PRNN_OP_ADD:
        for (int i = tid; i < n; i += PRNN_DYN_THREADS)
            values[out + i] = prnn_dyn_ld(values + a + i) + prnn_dyn_ld(values + b + i);
        break;
    case PRNN_OP_MUL:
        for (int i = tid; i < n; i += PRNN_DYN_THREADS)
            values[out + i] = prnn_dyn_ld(values + a + i) * prnn_dyn_ld(values + b + i);
        break;
    case PRNN_OP_TANH:
        for (int i = tid; i < n; i += PRNN_DYN_THREADS) values[out + i] = tanhf(prnn_dyn_ld(values + a + i));
        break;
    case PRNN_OP_SIGMOID:
        // The precise form: the gradients are checked to 1e-5 against float64.
        for (int i = tid; i < n; i += PRNN_DYN_THREADS)
            values[out + i] = 1.0f / (1.0f + expf(-prnn_dyn_ld(values + a + i)));
        break;
    case PRNN_OP_RELU:
        for (int i = tid; i < n; i += PRNN_DYN_THREADS) values[out + i] = fmaxf(prnn_dyn_ld(values + a + i), 0.0f);
        break;
    case PRNN_OP_COPY:
        for (int i = tid; i < n; i += PRNN_DYN_THREADS) values[out + i] = prnn_dyn_ld(values + a + i);
        break;
    case PRNN_OP_LOSS:
        if (tid == 0) {
            float top, total;
            prnn_dyn_softmax(values + a, n, &top, &total);
            const float l = top + logf(total) - prnn_dyn_ld(values + a + p0);
            values[out] = l;
            atomicAdd(loss, l);
        }
        break;
#if PRNN_DYN_TRAIN
    // Backward: a node's gradient gathers from every consumer, which may run
    // on other blocks in the same level, so every accumulation is an atomic
    // add in L2.
    case PRNN_OP_LOOKUP + PRNN_OP_BACKWARD:
        for (int i = tid; i < n; i += PRNN_DYN_THREADS) atomicAdd(param_grads + p0 + i, prnn_dyn_ld(grads + out + i));
        break;
    case PRNN_OP_MATVEC + PRNN_OP_BACKWARD: {
        const prnn_dyn_rows m = prnn_dyn_block_rows(p0);
        for (int i = tid; i < m.cols; i += PRNN_DYN_THREADS) vec[i] = prnn_dyn_ld(values + a + i);
        for (int r = tid; r < m.count; r += PRNN_DYN_THREADS) dy[r] = prnn_dyn_ld(grads + out + m.begin + r);
        __syncthreads();
        // A thread per column: its part of W^T dy over this block's rows,
        // and its column of the outer product dy x^T into the cached gradient.
        for (int c = tid; c < m.cols; c += PRNN_DYN_THREADS) {
            const float x = vec[c];
            float s = 0.0f;
            for (int r = 0; r < m.count; ++r) {
                const int at = m.cache + r * m.cols + c;
                s = fmaf(weights[at], dy[r], s);
                wgrads[at] = fmaf(dy[r], x, wgrads[at]);
            }
            atomicAdd(grads + a + c, s);
        }
        break;
    }
    case PRNN_OP_ADD + PRNN_OP_BACKWARD:
        for (int i = tid; i < n; i += PRNN_DYN_THREADS) {
            const float g = prnn_dyn_ld(grads + out + i);
            atomicAdd(grads + a + i, g);
            atomicAdd(grads + b + i, g);
        }
        break;
    case PRNN_OP_MUL + PRNN_OP_BACKWARD:
        for (int i = tid; i < n; i += PRNN_DYN_THREADS) {
            const float g = prnn_dyn_ld(grads + out + i);
            atomicAdd(grads + a + i, g * prnn_dyn_ld(values + b + i));
            atomicAdd(grads + b + i, g * prnn_dyn_ld(values + a + i));
        }
        break;
    case PRNN_OP_TANH + PRNN_OP_BACKWARD:
        for (int i = tid; i < n; i += PRNN_DYN_THREADS) {
            const float y = prnn_dyn_ld(values + out + i);
            atomicAdd(grads + a + i, prnn_dyn_ld(grads + out + i) * (1.0f - y * y));
        }
        break;
    case PRNN_OP_SIGMOID + PRNN_OP_BACKWARD:
        for (int i = tid; i < n; i += PRNN_DYN_THREADS) {
            const float y = prnn_dyn_ld(values + out + i);
            atomicAdd(grads + a + i, prnn_dyn_ld(grads + out + i) * y * (1.0f - y));
        }
        break;
    case PRNN_OP_RELU + PRNN_OP_BACKWARD:
        for (int i = tid; i < n; i += PRNN_DYN_THREADS)
            if (prnn_dyn_ld(values + out + i) > 0.0f) atomicAdd(grads + a + i, prnn_dyn_ld(grads + out + i));
        break;
    case PRNN_OP_COPY + PRNN_OP_BACKWARD:
        for (int i = tid; i < n; i += PRNN_DYN_THREADS) atomicAdd(grads + a + i, prnn_dyn_ld(grads + out + i));
        break;
    case PRNN_OP_LOSS + PRNN_OP_BACKWARD: {
        float top, total;
        prnn_dyn_softmax(values + a, n, &top, &total);
        for (int i = tid; i < n; i += PRNN_DYN_THREADS)
            atomicAdd(grads + a + i, expf(prnn_dyn_ld(values + a + i) - top) / total - (i == p0 ? 1.0f : 0.0f));
        break;
    }
#endif
    default:
        break;
    }
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
                    float correction1, float correction2, int* status, int* report, prnn_u64 timeout_ns) {
    extern __shared__ float4 prnn_dyn_shared[];
    int* script = reinterpret_cast<int*>(prnn_dyn_shared);
    float* vec = reinterpret_cast<float*>(script + PRNN_DYN_CHUNK * PRNN_DYN_WORDS);
    float* dy = vec + PRNN_DYN_MAX_COLS;
    float* weights = dy + PRNN_DYN_MAX_ROWS;
    float* wgrads = PRNN_DYN_TRAIN ? weights + PRNN_DYN_WEIGHT_FLOATS : nullptr;
    __shared__ int failed;
    const prnn_watch watch{status, report, timeout_ns};
    const int tid = threadIdx.x;

    for (int k = 0; k < PRNN_DYN_MATRICES; ++k) {
        const prnn_dyn_rows m = prnn_dyn_block_rows(k);
        const float* source = params + prnn_dyn_matrix[k][3] + m.begin * m.cols;
        for (int i = tid; i < m.count * m.cols; i += PRNN_DYN_THREADS) {
            weights[m.cache + i] = source[i];
            if (PRNN_DYN_TRAIN) wgrads[m.cache + i] = 0.0f;
        }
    }
    if (tid == 0) failed = 0;
    __syncthreads();

    const int begin = starts[blockIdx.x], end = starts[blockIdx.x + 1];
    for (int base = begin; base < end; base += PRNN_DYN_CHUNK) {
        const int count = min(PRNN_DYN_CHUNK, end - base);
        for (int i = tid; i < count * PRNN_DYN_WORDS; i += PRNN_DYN_THREADS)
            script[i] = program[(long long)base * PRNN_DYN_WORDS + i];
        __syncthreads();
        for (int k = 0; k < count; ++k) {
            const int* in = script + k * PRNN_DYN_WORDS;
            if (in[0] == PRNN_OP_WAIT) {
                prnn_u32 seen;
                if (tid == 0 && !prnn_wait_counter(counter, (prnn_u32)in[5], watch, PRNN_STATUS_GRID_BARRIER_TIMEOUT,
                                                   &seen))
                    failed = 1;
                __syncthreads();
                if (failed) return;
            } else if (in[0] == PRNN_OP_SIGNAL) {
                // Every thread's writes of the level precede this (the
                // barrier after each instruction); the release publishes them.
                if (tid == 0) prnn_red_release_gpu_add(counter, 1u);
            } else {
                prnn_dyn_execute(in, values, grads, params, param_grads, loss, vec, dy, weights, wgrads);
                __syncthreads();
            }
        }
        __syncthreads();  // every thread is done with the chunk before the next overwrites it
    }

#if PRNN_DYN_TRAIN
    // Matrices: this block's rows, from its caches; the gradient is written
    // out too, for the caller to read.
    for (int k = 0; k < PRNN_DYN_MATRICES; ++k) {
        const prnn_dyn_rows m = prnn_dyn_block_rows(k);
        const int first = prnn_dyn_matrix[k][3] + m.begin * m.cols;
        for (int i = tid; i < m.count * m.cols; i += PRNN_DYN_THREADS) {
            const float g = wgrads[m.cache + i];
            param_grads[first + i] = g;
            params[first + i] = prnn_dyn_update(weights[m.cache + i], g, first + i, adam_m, adam_v, lr, beta1, beta2,
                                                eps, correction1, correction2);
        }
    }
    // Biases and embeddings, after the script's closing barrier of every
    // block: their gradients are complete and nobody reads them any more.
    for (int i = dense_begin + (int)blockIdx.x * PRNN_DYN_THREADS + tid; i < dense_end;
         i += (int)gridDim.x * PRNN_DYN_THREADS)
        params[i] = prnn_dyn_update(params[i], prnn_dyn_ld(param_grads + i), i, adam_m, adam_v, lr, beta1, beta2, eps,
                                    correction1, correction2);
#endif
}
