// C ABI of the bmtrain-cli fused kernels: raw pointers, sizes and (for CUDA) a stream.
//
// Every launcher returns 0 on success and a non-zero code otherwise (see BMT_ERR_*). Tensors are dense,
// row-major and contiguous. The Paddle operators in kernels/paddle/fused_ops.cc check shapes, dtypes and
// contiguity and then call these; benchmarks/gpu_check.py calls the CUDA ones directly (no Paddle).
//
//   rms_norm:   x, y [rows, cols]; w [cols]; rstd [rows] (fp32, saved for backward)
//               y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps)
//   rotary:     q [batch, seq, q_heads, dim], k [batch, seq, k_heads, dim]; cos, sin [cos_batch, seq, dim]
//               with cos_batch 1 or batch ("rotate half" convention, dim even)
//   swiglu:     out = silu(gate) * up, all [n]
//   softmax_xent: logits [rows, vocab] (fp32/fp64), labels [rows] int64; loss [rows] (0 where ignored);
//               dlogits (optional) = softmax(logits) - onehot(label), 0 on ignored rows. Labels outside
//               [0, vocab) other than ignore_index give BMT_ERR_LABEL.
//   adamw_multi: count tensors, one dtype; per tensor t: param, grad, moment1, moment2 [sizes[t]] and its
//               beta powers b1^t, b2^t (one element each), updated in place (kernels/cpu/adamw_cpu.cc):
//               g = grad_scale * grad; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//               p = p (1 - lr wd) - lr sqrt(1-b2^t) / (1-b1^t) * m / (sqrt(v) + eps sqrt(1-b2^t)),
//               then b1^t *= b1, b2^t *= b2. A power outside [0, 1) gives BMT_ERR_VALUE before any write.
//   sum_squares: count tensors ptrs[t] of sizes[t] elements, one dtype; *out = sum of every x^2 (in double)
//               (kernels/cpu/grad_norm_cpu.cc: the global gradient norm)
//   attention:  q [b, s, h, d], k, v [b, s, hk, d] (hk divides h; query head j uses kv head j / (h / hk)),
//               optional segment_ids [b, s] (NULL: plain causal); out [b, s, h, d], lse [b, h, s] in the
//               dtype of q (kernels/cpu/attention_cpu.cc). Causal: query i sees the keys j <= i whose
//               segment id equals its own. bwd: dq, dk, dv from out, lse and dout (probabilities recomputed).
//   attention_pair: one (query chunk, key chunk) pair of a ring attention: q [b, sq, h, d], k, v [b, sk, hk, d];
//               causal 1 (the diagonal pair, sq == sk: query i sees the keys j <= i) or 0 (every key);
//               q_segment_ids [b, sq] and k_segment_ids [b, sk] both NULL or both given (a query sees only
//               keys with its id); window > 0 (0: none) with offset (query i sits offset positions after
//               key 0 in the sequence): query i sees only the keys j with i + offset - j < window;
//               softcap > 0 (0: none): the scaled scores become softcap * tanh(S scale / softcap) before
//               the mask (Gemma 2), and dS is multiplied by 1 - tanh^2 in the backward.
//               fwd: out [b, sq, h, d], lse [b, h, sq] (a query that sees no key: out 0, lse -1e30). bwd: from the caller's lse and delta [b, h, sq] (the merged log-sum-exp of the
//               whole attention and D = rowsum(dO * O) of its output), dq, dk, dv of this pair's share:
//               P = exp(S scale - lse), dS = P (dP - D) scale, dq = dS K, dk = dS^T Q, dv = P^T dO.
//   quant_dequant_rows: rows r0..r1 of a weight w [n, k] (Hugging Face's layout) stored as codes into
//               out [r1 - r0, k] fp32 (kernels/cpu/quant_cpu.cc): element e = r * k + c of w is
//               levels[code(e)] * scale, code(e) the e-th byte (bits 8) or nibble (bits 4, two per byte,
//               even e in the high nibble); scale = scales[e / block] (row_groups 0: blocks over the
//               flattened weight) or scales[r * ceil(k / block) + c / block] (row_groups 1: groups within
//               each row). levels holds 2^bits values. The quantised linear layer multiplies such tiles,
//               never the whole weight (bmtrain_cli/ops/quant_linear.py).
//   moe_swiglu: the routed experts of an MoE layer (kernels/cpu/moe_cpu.cc, fp32): x [rows, h] sorted by
//               expert, counts[e] rows for expert e (in order); gate[e], up[e] [h, f] and down[e] [f, h]
//               (Paddle's [in, out] layout). fwd: gate_up [rows, 2f] = [x gate_e | x up_e] (saved for
//               bwd) and y [rows, h] = (silu(G) * U) down_e. bwd from dy: dx [rows, h] and every expert's
//               dgate, dup, ddown (overwritten; zeros for an expert without rows; dgate, dup and ddown
//               all NULL: dx only).
//   grouped_gemm: the same experts' products on a GPU, one projection at a time (kernels/cuda/moe_cuda.cu):
//               x [rows, k] sorted by expert, counts[e] rows for expert e; w_e [k, n] (trans_w 0, Paddle's
//               [in, out]) or [n, k] (trans_w 1). fwd: y_e = x_e w_e ([rows, n]); dx: dx_e = dy_e w_e^T
//               ([rows, k]); dw: dw_e = x_e^T dy_e (trans_w 1: dy_e^T x_e), overwritten, zeros for an expert
//               without rows. (The transposes apply to the stored layout of trans_w 0.)
#ifndef BMT_KERNELS_H_
#define BMT_KERNELS_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum bmt_dtype { BMT_F32 = 0, BMT_F16 = 1, BMT_BF16 = 2, BMT_F64 = 3 };
enum bmt_status {
  BMT_OK = 0,
  BMT_ERR_DTYPE = 1,
  BMT_ERR_SHAPE = 2,
  BMT_ERR_LABEL = 3,
  BMT_ERR_CUDA = 4,
  BMT_ERR_VALUE = 5
};

/* ---- CPU (kernels/cpu/fused_cpu.cc): dtypes BMT_F32, BMT_F64; parallel over rows with OpenMP ---- */
int bmt_cpu_rms_norm_fwd(int dtype, const void* x, const void* w, void* y, float* rstd, int64_t rows,
                         int64_t cols, float eps);
/* dw must hold cols elements of the dtype; it is overwritten (not accumulated). */
int bmt_cpu_rms_norm_bwd(int dtype, const void* dy, const void* x, const void* w, const float* rstd, void* dx,
                         void* dw, int64_t rows, int64_t cols);
/* backward != 0 applies the transposed rotation (the gradient). q_out/k_out may not alias q/k. */
int bmt_cpu_rotary(int dtype, const void* q, const void* k, const void* cos, const void* sin, void* q_out,
                   void* k_out, int64_t batch, int64_t seq, int64_t q_heads, int64_t k_heads, int64_t dim,
                   int64_t cos_batch, int backward);
int bmt_cpu_swiglu_fwd(int dtype, const void* gate, const void* up, void* out, int64_t n);
int bmt_cpu_swiglu_bwd(int dtype, const void* gate, const void* up, const void* dout, void* dgate, void* dup,
                       int64_t n);
/* dlogits may be NULL (loss only). */
int bmt_cpu_softmax_xent(int dtype, const void* logits, const int64_t* labels, void* loss, void* dlogits,
                         int64_t rows, int64_t vocab, int64_t ignore_index);
int bmt_cpu_adamw_multi(int dtype, int64_t count, void* const* params, const void* const* grads,
                        void* const* moment1, void* const* moment2, void* const* beta1_pow, void* const* beta2_pow,
                        const int64_t* sizes, double lr, double weight_decay, double beta1, double beta2,
                        double epsilon, double grad_scale);
int bmt_cpu_sum_squares(int dtype, const void* const* ptrs, const int64_t* sizes, int64_t count, double* out);
int bmt_cpu_attention_fwd(int dtype, const void* q, const void* k, const void* v, const int64_t* segment_ids,
                          void* out, void* lse, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                          int64_t dim, double scale);
int bmt_cpu_attention_bwd(int dtype, const void* q, const void* k, const void* v, const int64_t* segment_ids,
                          const void* out, const void* lse, const void* dout, void* dq, void* dk, void* dv,
                          int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t dim, double scale);
int bmt_cpu_attention_pair_fwd(int dtype, const void* q, const void* k, const void* v, const int64_t* q_segment_ids,
                               const int64_t* k_segment_ids, int causal, int64_t window, int64_t offset,
                               double softcap, void* out, void* lse, int64_t batch, int64_t q_len, int64_t k_len, int64_t heads,
                               int64_t kv_heads, int64_t dim, double scale);
int bmt_cpu_attention_pair_bwd(int dtype, const void* q, const void* k, const void* v, const int64_t* q_segment_ids,
                               const int64_t* k_segment_ids, int causal, int64_t window, int64_t offset,
                               double softcap, const void* lse, const void* delta, const void* dout, void* dq, void* dk, void* dv,
                               int64_t batch, int64_t q_len, int64_t k_len, int64_t heads, int64_t kv_heads,
                               int64_t dim, double scale);

/* Gated delta rule (kernels/cpu/delta_rule_cpu.cc): q, k [b, s, h, dk], v [b, s, h, dv], g (log decay) and
   beta [b, s, h]; out [b, s, h, dv]; states [b, h, ceil(s / chunk), dk, dv] (the state before each chunk,
   for the backward); final_state [b, h, dk, dv]. The state starts at zero. bwd: dfinal [b, h, dk, dv] the
   final state's gradient; dq, dk, dv, dg, dbeta in the shapes of their inputs. */
int bmt_cpu_delta_rule_fwd(int dtype, const void* q, const void* k, const void* v, const void* g, const void* beta,
                           void* out, void* states, void* final_state, int64_t batch, int64_t seq, int64_t heads,
                           int64_t dk, int64_t dv, int64_t chunk);
int bmt_cpu_delta_rule_bwd(int dtype, const void* q, const void* k, const void* v, const void* g, const void* beta,
                           const void* states, const void* dout, const void* dfinal, void* dq, void* dk, void* dv,
                           void* dg, void* dbeta, int64_t batch, int64_t seq, int64_t heads, int64_t dk_dim,
                           int64_t dv_dim, int64_t chunk);

/* ---- CUDA (kernels/cuda/fused_cuda.cu): dtypes BMT_F32, BMT_F16, BMT_BF16 (softmax_xent: BMT_F32);
   stream is a cudaStream_t (NULL = default stream). Asynchronous: errors of the launch are returned,
   errors inside a kernel (bad labels) are reported through the optional int flag `bad_label`. ---- */
int bmt_cuda_rms_norm_fwd(int dtype, const void* x, const void* w, void* y, float* rstd, int64_t rows,
                          int64_t cols, float eps, void* stream);
/* workspace: bmt_cuda_rms_norm_bwd_workspace(rows, cols) bytes of device memory (fp32 partial dw sums). */
int64_t bmt_cuda_rms_norm_bwd_workspace(int64_t rows, int64_t cols);
int bmt_cuda_rms_norm_bwd(int dtype, const void* dy, const void* x, const void* w, const float* rstd, void* dx,
                          void* dw, void* workspace, int64_t rows, int64_t cols, void* stream);
int bmt_cuda_rotary(int dtype, const void* q, const void* k, const void* cos, const void* sin, void* q_out,
                    void* k_out, int64_t batch, int64_t seq, int64_t q_heads, int64_t k_heads, int64_t dim,
                    int64_t cos_batch, int backward, void* stream);
int bmt_cuda_swiglu_fwd(int dtype, const void* gate, const void* up, void* out, int64_t n, void* stream);
int bmt_cuda_swiglu_bwd(int dtype, const void* gate, const void* up, const void* dout, void* dgate, void* dup,
                        int64_t n, void* stream);
int bmt_cuda_softmax_xent(int dtype, const void* logits, const int64_t* labels, void* loss, void* dlogits,
                          int64_t rows, int64_t vocab, int64_t ignore_index, int* bad_label, void* stream);

/* ---- CUDA (kernels/cuda/moe_cuda.cu): the grouped GEMM of the MoE experts, dtypes BMT_F32, BMT_F16,
   BMT_BF16 (fp32 accumulation). counts (experts values) and w / dw (experts device pointers) are HOST
   arrays; workspace holds bmt_cuda_grouped_gemm_workspace(experts) bytes of device memory, into which the
   launcher copies the offsets and pointers on the stream (so it must stay allocated until the launch has
   run: allocate it from the stream's allocator). A negative count or a size <= 0 gives BMT_ERR_SHAPE. ---- */
int64_t bmt_cuda_grouped_gemm_workspace(int64_t experts);
int bmt_cuda_grouped_gemm_fwd(int dtype, const void* x, const void* const* w, void* y, const int64_t* counts,
                              int64_t experts, int64_t k, int64_t n, int trans_w, void* workspace, void* stream);
int bmt_cuda_grouped_gemm_dx(int dtype, const void* dy, const void* const* w, void* dx, const int64_t* counts,
                             int64_t experts, int64_t k, int64_t n, int trans_w, void* workspace, void* stream);
int bmt_cuda_grouped_gemm_dw(int dtype, const void* x, const void* dy, void* const* dw, const int64_t* counts,
                             int64_t experts, int64_t k, int64_t n, int trans_w, void* workspace, void* stream);

/* ---- CPU (kernels/cpu/quant_cpu.cc): rows r0..r1 of a 4- or 8-bit quantised weight [n, k] into fp32
   out [r1 - r0, k], the rows split over OpenMP threads ---- */
int bmt_cpu_quant_dequant_rows(const uint8_t* codes, int bits, const float* levels, const float* scales,
                               int64_t block, int row_groups, float* out, int64_t n, int64_t k, int64_t r0,
                               int64_t r1);
/* The routed experts' quantised weights W_e [n, k] (one layout, codes[e] and scales[e] each) over rows
   sorted by expert, counts[e] each: y [rows, n] = X_e W_e^T, and the input gradient dx [rows, k] = dY_e W_e,
   each expert's weight dequantised a tile at a time (OpenMP over (expert, tile) blocks). */
int bmt_cpu_quant_grouped_fwd(const float* x, const int64_t* counts, int64_t experts, const uint8_t* const* codes,
                              const float* const* scales, const float* levels, int bits, int64_t block,
                              int row_groups, int64_t n, int64_t k, float* y);
int bmt_cpu_quant_grouped_dx(const float* dy, const int64_t* counts, int64_t experts, const uint8_t* const* codes,
                             const float* const* scales, const float* levels, int bits, int64_t block,
                             int row_groups, int64_t n, int64_t k, float* dx);

/* ---- CPU (kernels/cpu/moe_cpu.cc): fp32, OpenMP over (expert, row tile) and (expert, weight tile) ---- */
int bmt_cpu_moe_swiglu_fwd(const float* x, const int64_t* counts, int64_t experts, const float* const* gate,
                           const float* const* up, const float* const* down, float* gate_up, float* y,
                           int64_t hidden, int64_t inter);
int bmt_cpu_moe_swiglu_bwd(const float* x, const int64_t* counts, int64_t experts, const float* const* gate,
                           const float* const* up, const float* const* down, const float* gate_up, const float* dy,
                           float* dx, float* const* dgate, float* const* dup, float* const* ddown, int64_t hidden,
                           int64_t inter);

#ifdef __cplusplus
}
#endif

#endif  // BMT_KERNELS_H_
