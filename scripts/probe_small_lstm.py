"""What one SM can do for an LSTM of hidden size 64: a probe, not library code.

A stand-alone kernel (CuPy) of the simplest single-block design: a thread
per gate row (256 threads), its 64 weights in registers, h_{t-1} broadcast
from shared memory as float4, a unit's four gates on adjacent lanes gathered
with shuffles, the projections of step t + 4 loaded into registers at step t,
one block barrier per step; optionally batch slices (a block per slice).
Compiled in variants that remove one piece of the step at a time (-D flags
below), each checked against float64 and timed at T = 100 and 1000 (CUDA
events, median of 7), so the difference gives µs per step without the
launch. perf-notes §62 has the numbers.

    python scripts/probe_small_lstm.py      (needs CuPy and a GPU)
"""

import cupy as cp
import numpy as np

H = 64
SOURCE = r'''
#define H 64
template <int B>
__device__ void run(const float* __restrict__ xw, const float* __restrict__ w, const float* __restrict__ bias_hh,
                    const float* __restrict__ h0, const float* __restrict__ c0, float* __restrict__ out, int T) {
  __shared__ __align__(16) float hs[2][H * B];   // [k][b]
  const int tid = threadIdx.x, u = tid >> 2, g = tid & 3, row = g * H + u, lane = tid & 31;
  const int col0 = blockIdx.x * B;  // batch slice
  float wr[H];
#pragma unroll
  for (int k = 0; k < H; ++k) wr[k] = w[row * H + k];
  const float bias = bias_hh[row];
  for (int i = tid; i < H * B; i += blockDim.x) hs[0][i] = h0[(col0 + i % B) * H + i / B];
  float c[B];
#pragma unroll
  for (int b = 0; b < B; ++b) c[b] = c0[(col0 + b) * H + u];
  constexpr int D = 4;
  float xr[D][B];
#pragma unroll
  for (int d = 0; d < D; ++d)
#pragma unroll
    for (int b = 0; b < B; ++b) xr[d][b] = d < T ? xw[((long long)d * gridDim.x * B + col0 + b) * 4 * H + row] : 0.f;
  __syncthreads();
  for (int t0 = 0; t0 < T; t0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int t = t0 + d;
      if (t >= T) break;
      float acc[B][4];
#pragma unroll
      for (int b = 0; b < B; ++b) { acc[b][0] = xr[d][b] + bias; acc[b][1] = acc[b][2] = acc[b][3] = 0.f; }
      if (t + D < T) {
#pragma unroll
        for (int b = 0; b < B; ++b)
          xr[d][b] = __ldg(xw + ((long long)(t + D) * gridDim.x * B + col0 + b) * 4 * H + row);
      }
      const float* hp = hs[t & 1];
#if NO_PRODUCT
      if (true) { acc[0][1] = hp[u]; } else
#endif
      if (B == 1) {
        const float4* h4 = reinterpret_cast<const float4*>(hp);
#pragma unroll
        for (int k = 0; k < H / 4; ++k) { float4 v = h4[k];
          acc[0][0] = fmaf(wr[4*k], v.x, acc[0][0]); acc[0][1] = fmaf(wr[4*k+1], v.y, acc[0][1]);
          acc[0][2] = fmaf(wr[4*k+2], v.z, acc[0][2]); acc[0][3] = fmaf(wr[4*k+3], v.w, acc[0][3]); }
      } else {
#pragma unroll
        for (int k = 0; k < H; ++k) {
#pragma unroll
          for (int b = 0; b < B; ++b) acc[b][k & 3] = fmaf(wr[k], hp[k * B + b], acc[b][k & 3]);
        }
      }
      float* hn = hs[(t + 1) & 1];
#pragma unroll
      for (int b = 0; b < B; ++b) {
        float pre = (acc[b][0] + acc[b][1]) + (acc[b][2] + acc[b][3]);
        #if FAST_ACT
        float act = g == 2 ? 2.f * __fdividef(1.f, 1.f + __expf(-2.f * pre)) - 1.f
                           : __fdividef(1.f, 1.f + __expf(-pre));
#elif UNIFORM_ACT
        const float s2 = g == 2 ? 2.f : 1.f;
        float act = fmaf(s2, __fdividef(1.f, 1.f + __expf(-s2 * pre)), 1.f - s2);
#else
        float act = g == 2 ? tanhf(pre) : 1.f / (1.f + __expf(-pre));
#endif
        const int base = lane & ~3;
        float ig = __shfl_sync(0xffffffffu, act, base), fg = __shfl_sync(0xffffffffu, act, base + 1);
        float gg = __shfl_sync(0xffffffffu, act, base + 2), og = __shfl_sync(0xffffffffu, act, base + 3);
        c[b] = fg * c[b] + ig * gg;
        #if FAST_ACT || UNIFORM_ACT
        float h = og * (2.f * __fdividef(1.f, 1.f + __expf(-2.f * c[b])) - 1.f);
#else
        float h = og * tanhf(c[b]);
#endif
        if (g == b % 4) { hn[u * B + b] = h;
#if !NO_OUT
          out[((long long)t * gridDim.x * B + col0 + b) * H + u] = h;
#endif
        }
      }
#if !NO_BARRIER
      __syncthreads();
#endif
    }
  }
}
#define PRNN_PROBE_ENTRY(B)                                                                        \
  extern "C" __global__ void __launch_bounds__(256, 1) small##B(const float* xw, const float* w, const float* b, \
                                                               const float* h0, const float* c0, float* out,   \
                                                               int T) {                                         \
    run<B>(xw, w, b, h0, c0, out, T);                                                                           \
  }
PRNN_PROBE_ENTRY(1)
PRNN_PROBE_ENTRY(2)
PRNN_PROBE_ENTRY(4)
'''

# name -> -D flags: each removes or cheapens one piece of the step.
VARIANTS = {
    "base": (),
    "fast activations": ("-DFAST_ACT=1",),  # tanh and sigmoid as ex2 + approximate reciprocal
    "one activation per lane": ("-DUNIFORM_ACT=1",),  # no divergence between the tanh and sigmoid lanes
    "fast, no output store": ("-DFAST_ACT=1", "-DNO_OUT=1"),
    "fast, no barrier": ("-DFAST_ACT=1", "-DNO_BARRIER=1"),
    "fast, no product": ("-DFAST_ACT=1", "-DNO_PRODUCT=1"),
    "fast, no product, no barrier": ("-DFAST_ACT=1", "-DNO_PRODUCT=1", "-DNO_BARRIER=1"),
}


def reference(xw, w, b, h0, c0):
    h, c, outs = h0.astype(np.float64), c0.astype(np.float64), []
    for t in range(xw.shape[0]):
        z = xw[t] + h @ w.T.astype(np.float64) + b
        i, f, g, o = (z[:, k * H:(k + 1) * H] for k in range(4))
        c = 1 / (1 + np.exp(-f)) * c + 1 / (1 + np.exp(-i)) * np.tanh(g)
        h = 1 / (1 + np.exp(-o)) * np.tanh(c)
        outs.append(h)
    return np.stack(outs)


def median_ms(run, rounds: int = 7, calls: int = 10) -> float:
    for _ in range(20):
        run()
    start, end, times = cp.cuda.Event(), cp.cuda.Event(), []
    for _ in range(rounds):
        start.record()
        for _ in range(calls):
            run()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / calls)
    return float(np.median(times))


def main() -> None:
    rng = np.random.default_rng(0)
    for name, flags in VARIANTS.items():
        module = cp.RawModule(code=SOURCE, options=("-std=c++17", *flags))
        cases = ((1, 1), (2, 1)) if name in ("base", "fast activations") else ((1, 1),)
        for per_block, slices in cases:
            kernel = module.get_function(f"small{per_block}")
            batch = per_block * slices
            w = (rng.standard_normal((4 * H, H)) / 8).astype(np.float32)
            b = rng.standard_normal(4 * H).astype(np.float32)

            def launcher(steps, kernel=kernel, slices=slices, batch=batch, w=w, b=b):
                xw = rng.standard_normal((steps, batch, 4 * H)).astype(np.float32)
                h0, c0 = (rng.standard_normal((batch, H)).astype(np.float32) for _ in range(2))
                args = [cp.asarray(a) for a in (xw, w, b, h0, c0)]
                out = cp.full((steps, batch, H), np.nan, np.float32)
                return (lambda: kernel((slices,), (256,), (*args, out, np.int32(steps)))), (xw, h0, c0), out

            run, (xw, h0, c0), out = launcher(100)
            run()
            cp.cuda.runtime.deviceSynchronize()
            err = np.abs(cp.asnumpy(out) - reference(xw, w, b, h0, c0)).max()
            short, long = (median_ms(launcher(steps)[0]) for steps in (100, 1000))
            print(f"{name:30s} batch {batch} ({slices} slice(s)): T=100 {short * 1e3:.1f} µs, "
                  f"{(long - short) / 900 * 1e3:.3f} µs per step, largest error {err:.2e}")


if __name__ == "__main__":
    main()
