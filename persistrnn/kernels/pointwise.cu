// Fused pointwise kernels of the non-persistent (fallback) path: one launch
// per stage per time step, between cuBLAS GEMMs (persistrnn/fallback.py).
//
// Per step the host runs, for each stage k of the cell,
//   hg_k = operand_k @ W_hh[rows of stage k]^T + b_hh[rows]   (torch.addmm, fp32 out)
// and after every stage but the last prnn_fallback_between, which writes
// the next stage's operand (r * h for the reset-before GRU); after the last,
// prnn_fallback_pointwise turns the gate pre-activations into the new state.
// One thread per (batch row b, hidden unit j): consecutive threads take
// consecutive units, so every load and store below is coalesced.
//
// The states h and c stay fp32 between steps, as in the persistent kernel;
// only the GEMM operand (out[t], the next step's A matrix) and the outputs are
// rounded to the layer's dtype. A 16-bit c or h carried across steps would add
// one rounding per step to the recurrence (c_t = f * c_{t-1} + ...).
//
// Configuration macros come from fallback.py: PRNN_G (gates), PRNN_HAS_C,
// PRNN_STAGES, PRNN_IO_T (the layer's dtype), PRNN_THREADS; the generated
// prnn_hg_index, prnn_between and prnn_pointwise come from the cell's spec.

typedef PRNN_IO_T io_t;

// ---- kernels ----

// The gate values of (b, j): this step's input projections and the stage
// products (b_hh already added by the GEMM). Before the last stage, the
// products of later stages hold the previous step's values (zeros at first);
// the between-stage statements never read them, so the compiler drops those loads.
__device__ __forceinline__ void prnn_load_gates(const float* __restrict__ xw, const float* __restrict__ hg, int b,
                                                int j, int H, int B, float (&xg)[PRNN_G], float (&hgv)[PRNN_G]) {
#pragma unroll
    for (int g = 0; g < PRNN_G; ++g) {
        xg[g] = xw[b * (PRNN_G * H) + g * H + j];
        hgv[g] = hg[prnn_hg_index(g, b, j, H, B)];
    }
}

extern "C" __global__ void __launch_bounds__(PRNN_THREADS)
    prnn_fallback_pointwise(const float* __restrict__ xw,  // [B][G*H] x_t W_ih^T + b_ih
                            const float* __restrict__ hg,  // stage products, see prnn_hg_index
                            float* __restrict__ h,         // [B][H] fp32 state: h_{t-1} in, h_t out
                            const float* c_in,             // [B][H] fp32 cell state c_{t-1} (PRNN_HAS_C)
                            float* c_out,                  // [B][H] c_t: c_in itself, or a training forward's saved c[t]
                            io_t* __restrict__ out,        // [B][H] out[t], the layer's dtype
                            float* __restrict__ saved_gates,  // [B][G*H] a training forward's gates[t], or null
                            int H, int B) {
    const int n = blockIdx.x * PRNN_THREADS + threadIdx.x;
    if (n >= B * H) return;
    const int b = n / H, j = n - b * H;
    float xg[PRNN_G], hgv[PRNN_G];
    prnn_load_gates(xw, hg, b, j, H, B, xg, hgv);
    if (saved_gates != nullptr) {  // every stage's product with its b_hh, as the backward reads them
#pragma unroll
        for (int g = 0; g < PRNN_G; ++g) saved_gates[b * (PRNN_G * H) + g * H + j] = hgv[g];
    }
    float h_new;
#if PRNN_HAS_C
    float c_new;
    prnn_pointwise(xg, hgv, h[n], c_in[n], h_new, c_new);
    c_out[n] = c_new;
#else
    prnn_pointwise(xg, hgv, h[n], h_new);
#endif
    h[n] = h_new;
    out[n] = prnn_from_float<io_t>(h_new);
}

#if PRNN_STAGES > 1
// After stage `stage`: the operand of stage `stage + 1`, rounded to the
// layer's dtype because it is the next GEMM's A matrix.
extern "C" __global__ void __launch_bounds__(PRNN_THREADS)
    prnn_fallback_between(const float* __restrict__ xw, const float* __restrict__ hg,
                          const float* __restrict__ h,  // [B][H] fp32 h_{t-1}
                          io_t* __restrict__ operand,   // [B][H]
                          int stage, int H, int B) {
    const int n = blockIdx.x * PRNN_THREADS + threadIdx.x;
    if (n >= B * H) return;
    const int b = n / H, j = n - b * H;
    float xg[PRNN_G], hgv[PRNN_G];
    prnn_load_gates(xw, hg, b, j, H, B, xg, hgv);
    operand[n] = prnn_from_float<io_t>(prnn_between(stage, xg, hgv, h[n]));
}
#endif
