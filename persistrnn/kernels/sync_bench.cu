// Synchronisation floors: the per-step cost of each way a persistent kernel
// can end a timestep. Every exchange kernel computes a checkable recurrence
//     h_0[j] = j,    h_s[j] = h_{s-1}[(j + 1) mod H] + 1
// so h_S[j] = ((j + S) mod H) + S exactly in fp32; a race shows as a wrong value.
#include <cooperative_groups.h>

extern "C" __global__ void empty_kernel() {}

// h_s[j .. j+3] of the recurrence from h_{s-1}; j + 4 <= H. The wrap is a
// compare, not a modulo: an integer division on the critical path of a
// 0.3 µs step is measurable.
__device__ __forceinline__ float4 next_state(const float* prev, int j, int H) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int src = j + 1 + i;
        v[i] = prev[src < H ? src : src - H] + 1.0f;
    }
    return make_float4(v[0], v[1], v[2], v[3]);
}

// cooperative_groups grid.sync(); needs a cooperative launch.
extern "C" __global__ void grid_sync_cg(int steps) {
    cooperative_groups::grid_group grid = cooperative_groups::this_grid();
    for (int s = 0; s < steps; ++s) grid.sync();
}

// The kernels that wait take the wait's bound as arguments after `status`:
// `report` (a host-mapped word, or null) receives the first failure code from
// a block that gives up (its waits write it), and `timeout_ns` bounds a wait
// without progress (see prnn_watch).

// Our release/acquire counter barrier. *counter must be 0 at launch.
extern "C" __global__ void grid_barrier_counter(prnn_u32* counter, int steps, int* status, int* report,
                                                unsigned long long timeout_ns) {
    const prnn_watch w{status, report, timeout_ns};
    for (int s = 1; s <= steps; ++s)
        if (!prnn_grid_barrier(counter, gridDim.x * s, w)) return;
}

// Counter barrier plus broadcast of an H-float state through a global double
// buffer: each block writes its slice of h_s, then every block reads all of
// h_s into shared memory (L2 only: other SMs wrote it). hbuf holds 2*H floats,
// hbuf[0:H] = h_0 at launch; h_S ends in hbuf[(S & 1) * H].
extern "C" __global__ void grid_exchange(float* hbuf, int H, prnn_u32* counter, int steps, int* status, int* report,
                                         unsigned long long timeout_ns) {
    extern __shared__ float h_prev[];
    const prnn_watch w{status, report, timeout_ns};
    const int lo = (int)((long long)H * blockIdx.x / gridDim.x);
    const int hi = (int)((long long)H * (blockIdx.x + 1) / gridDim.x);
    for (int s = 1; s <= steps; ++s) {
        const float* src = hbuf + ((s - 1) & 1) * H;
        float* dst = hbuf + (s & 1) * H;
        for (int j = threadIdx.x; j < H; j += blockDim.x) h_prev[j] = __ldcg(src + j);
        __syncthreads();
        for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) dst[j] = h_prev[j + 1 < H ? j + 1 : 0] + 1.0f;
        if (!prnn_grid_barrier(counter, gridDim.x * s, w)) return;
    }
}

// cluster.sync() alone.
extern "C" __global__ void cluster_barrier(int steps) {
    for (int s = 0; s < steps; ++s) prnn_cluster_sync();
}

// Shared layout of the cluster exchange kernels: two H-float buffers (parity
// double buffering: a fast block writes buffer s&1 while a slow one still
// reads (s-1)&1), then, for st.async, one mbarrier per buffer.
// Each block owns H / cluster_size consecutive elements, in float4 groups;
// H must be a multiple of 4 * cluster_size. out receives h_S from rank 0.

// Plain remote stores into every peer, then cluster.sync().
extern "C" __global__ void cluster_exchange_dsmem(float* out, int H, int steps) {
    extern __shared__ __align__(16) float h_buf[];
    const prnn_u32 rank = prnn_cluster_rank(), n = prnn_cluster_size();
    const int slice = H / n, groups = slice / 4;
    for (int j = threadIdx.x; j < H; j += blockDim.x) h_buf[j] = (float)j;
    prnn_cluster_sync();
    for (int s = 1; s <= steps; ++s) {
        const float* prev = h_buf + ((s - 1) & 1) * H;
        float* next = h_buf + (s & 1) * H;
        for (int g = threadIdx.x; g < groups; g += blockDim.x) {
            const int j = rank * slice + 4 * g;
            const float4 v = next_state(prev, j, H);
            const prnn_u32 addr = prnn_smem_addr(next + j);
            for (prnn_u32 peer = 0; peer < n; ++peer) prnn_st_cluster_v4(prnn_peer_addr(addr, peer), v);
        }
        prnn_cluster_sync();
    }
    if (rank == 0 && blockIdx.x == 0)
        for (int j = threadIdx.x; j < H; j += blockDim.x) out[j] = h_buf[(steps & 1) * H + j];
}

// st.async into every peer, completing on the peer's mbarrier; each block
// waits only for its own barrier (acquire at cluster scope). No cluster-wide
// barrier inside the loop.
extern "C" __global__ void cluster_exchange_stasync(float* out, int H, int steps, int* status, int* report,
                                                    unsigned long long timeout_ns) {
    extern __shared__ __align__(16) float h_buf[];
    const prnn_watch w{status, report, timeout_ns};
    prnn_u64* bar = reinterpret_cast<prnn_u64*>(h_buf + 2 * H);
    const prnn_u32 rank = prnn_cluster_rank(), n = prnn_cluster_size();
    const int slice = H / n, groups = slice / 4;
    for (int j = threadIdx.x; j < H; j += blockDim.x) h_buf[j] = (float)j;
    if (threadIdx.x == 0) {
        prnn_mbar_init(&bar[0], 1);
        prnn_mbar_init(&bar[1], 1);
        prnn_fence_mbar_init();
    }
    prnn_cluster_sync();  // barriers initialised everywhere before any peer stores
    for (int s = 1; s <= steps; ++s) {
        const float* prev = h_buf + ((s - 1) & 1) * H;
        float* next = h_buf + (s & 1) * H;
        prnn_u64* next_bar = &bar[s & 1];
        // Every element of `next` arrives by st.async, ours included.
        if (threadIdx.x == 0) prnn_mbar_arrive_expect_tx(next_bar, (prnn_u32)(H * sizeof(float)));
        for (int g = threadIdx.x; g < groups; g += blockDim.x) {
            const int j = rank * slice + 4 * g;
            const float4 v = next_state(prev, j, H);
            const prnn_u32 addr = prnn_smem_addr(next + j), bar_addr = prnn_smem_addr(next_bar);
            for (prnn_u32 peer = 0; peer < n; ++peer)
                prnn_st_async_v4(prnn_peer_addr(addr, peer), v, prnn_peer_addr(bar_addr, peer));
        }
        // Phase k of buffer b is used at step s = 2k + 2 - b, so its parity is ((s - 1) >> 1) & 1.
        if (!prnn_mbar_wait_cluster(next_bar, ((s - 1) >> 1) & 1, w)) break;
    }
    prnn_cluster_sync();  // no block leaves while a peer may still address its shared memory
    if (rank == 0 && blockIdx.x == 0)
        for (int j = threadIdx.x; j < H; j += blockDim.x) out[j] = h_buf[(steps & 1) * H + j];
}
