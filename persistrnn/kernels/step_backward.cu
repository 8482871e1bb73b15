// The backward of one statement block of one cell step (persistrnn/adjoint.py
// generates the statements from the cell's spec; persistrnn/training.py runs
// them). Per step the host runs, for each block j from the last to the first,
// this kernel, then one GEMM: the operand of stage j's adjoint (dh_{t-1}, or
// e.g. d(r * h)) += d_product_j @ W_hh[rows of stage j].
//
// One thread per (batch row b, hidden unit u): it reads the forward values of
// its element (the input projections xg and recurrent products the forward
// kept, h_{t-1}, c_{t-1}, and for a cell with lengths whether its row's
// sequence runs the step) and the adjoints the step and the blocks after this
// one left (dh + d_out, dc, the slots), recomputes the forward values the
// block's adjoints need and writes the adjoints the GEMMs and the blocks
// before it read. Consecutive threads take consecutive units, so every load
// and store is coalesced. All in fp32, the training path's compute dtype.
//
// Slots ([B][G*H] row-major, or [B][H]): d xg, d gates (a stage's d_product
// is its gates' columns), dh_{t-1}, dc_{t-1}, and the carry planes (one
// [B][H] plane per name whose adjoint crosses blocks and is none of these,
// e.g. a stage operand's, which the GEMM writes). The operands out hold the
// stage operands (stage s >= 1 at plane s - 1) that dW_hh multiplies.
//
// Configuration macros from adjoint.py: PRNN_G (gates), PRNN_THREADS. The
// statements name their values prnn_v<k>, prnn_g<k> and prnn_d<k>_<name>
// (adjoint.py), besides the cell's own names, which never start with prnn_:
// no parameter or local below has any of these forms.

extern "C" __global__ void __launch_bounds__(PRNN_THREADS)
    prnn_step_backward(const float* __restrict__ prnn_xg,     // [B][G*H] x_t W_ih^T + b_ih
                       const float* __restrict__ prnn_gates,  // [B][G*H] recurrent products with b_hh
                       const float* __restrict__ prnn_h,      // [B][H] h_{t-1}
                       const float* __restrict__ prnn_c,      // [B][H] c_{t-1} (cells with one)
                       const float* __restrict__ prnn_dh,     // [B][H] dL/dh_t through the recurrence
                       const float* __restrict__ prnn_dout,   // [B][H] dL/dh_t through the output
                       const float* __restrict__ prnn_dc,     // [B][H] dL/dc_t
                       const float* __restrict__ prnn_step_runs,  // [B] 1 where the row's sequence runs the
                                                                  // step, 0 past its length (cells with lengths)
                       float* __restrict__ prnn_dxg,          // [B][G*H] slots
                       float* __restrict__ prnn_dgates,       // [B][G*H]
                       float* __restrict__ prnn_dh_prev,      // [B][H]
                       float* __restrict__ prnn_dc_prev,      // [B][H]
                       float* __restrict__ prnn_carry,        // [planes][B][H]
                       float* __restrict__ prnn_operands,     // stage s >= 1 at (s - 1) * operand_stride
                       int prnn_operand_stride, int prnn_batch, int prnn_hidden) {
    const int prnn_n = blockIdx.x * PRNN_THREADS + threadIdx.x;
    if (prnn_n >= prnn_batch * prnn_hidden) return;
    // Element (b, u) of gate g in a [B][G*H] matrix is prnn_row + g * H.
    const int prnn_b = prnn_n / prnn_hidden;
    const int prnn_row = prnn_b * (PRNN_G * prnn_hidden) + prnn_n % prnn_hidden;
    // ---- the block's statements ----
}
