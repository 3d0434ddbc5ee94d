// The gated delta rule on a CPU (C ABI in kernels/include/bmt_kernels.h): Gated DeltaNet's recurrence,
// forward and backward, in the model's layout q, k [b, s, h, dk], v [b, s, h, dv], g, beta [b, s, h].
// Per (batch, head) with the state S [dk, dv], token by token:
//   S' = exp(g) S;  u = beta (v - S'^T k);  S = S' + k u^T;  o = S^T q.
// The forward keeps S before every chunk of `chunk` tokens (states [b, h, chunks, dk, dv]); the backward
// walks the chunks from the last, recomputes one chunk's S' and u from its saved state into a private
// buffer and runs the recurrence's adjoint backwards through it:
//   dq = S dO;  dS += q dO^T;  dk += dS u;  du = dS^T k;  r = v - S'^T k;  dbeta = du . r;
//   dv = beta du;  dS' = dS - beta k du^T;  dk -= beta S' du;  dg = sum(dS' o S');  dS = exp(g) dS'.
// Work items are the (batch, head) pairs (each writes only its own rows), so the results do not depend
// on the thread count. Exact to the chunked rule of bmtrain_cli/ops/reference.py (same arithmetic up to
// rounding).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bmt_kernels.h"
#include "parallel.h"

namespace {

struct Dims {
  int64_t b, s, h, dk, dv, chunk;
  int64_t chunks() const { return (s + chunk - 1) / chunk; }
  int64_t row(int64_t bb, int64_t t, int64_t hh) const { return (bb * s + t) * h + hh; }  // of [b, s, h]
  bool parallel() const { return b * s * h * dk * dv * 4 >= bmt::kParallelMin; }
};

// One token forward: S <- exp(g) S, u = beta (v - S^T k), S += k u^T; o = S^T q (when o is given).
template <typename T>
void step(T* S, const T* q, const T* k, const T* v, T g, T beta, T* u, T* o, int64_t dk, int64_t dv) {
  const T a = std::exp(g);
  for (int64_t j = 0; j < dv; ++j) u[j] = 0;
  for (int64_t i = 0; i < dk; ++i) {
    T* Si = S + i * dv;
    const T ki = k[i];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      Si[j] *= a;
      u[j] += Si[j] * ki;
    }
  }
  for (int64_t j = 0; j < dv; ++j) u[j] = beta * (v[j] - u[j]);
  if (o != nullptr)
    for (int64_t j = 0; j < dv; ++j) o[j] = 0;
  for (int64_t i = 0; i < dk; ++i) {
    T* Si = S + i * dv;
    const T ki = k[i], qi = q[i];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      Si[j] += ki * u[j];
      if (o != nullptr) o[j] += Si[j] * qi;
    }
  }
}

template <typename T>
void forward_pair(const Dims& d, int64_t bb, int64_t hh, const T* q, const T* k, const T* v, const T* g,
                  const T* beta, T* out, T* states, T* final_state) {
  const int64_t area = d.dk * d.dv;
  std::vector<T> S(area, T(0)), u(d.dv);
  T* saved = states + (bb * d.h + hh) * d.chunks() * area;
  for (int64_t t = 0; t < d.s; ++t) {
    if (t % d.chunk == 0) std::copy(S.begin(), S.end(), saved + (t / d.chunk) * area);
    const int64_t r = d.row(bb, t, hh);
    step(S.data(), q + r * d.dk, k + r * d.dk, v + r * d.dv, g[r], beta[r], u.data(), out + r * d.dv, d.dk, d.dv);
  }
  std::copy(S.begin(), S.end(), final_state + (bb * d.h + hh) * area);
}

template <typename T>
void backward_pair(const Dims& d, int64_t bb, int64_t hh, const T* q, const T* k, const T* v, const T* g,
                   const T* beta, const T* states, const T* dout, const T* dfinal, T* dq, T* dk, T* dv, T* dg,
                   T* dbeta) {
  const int64_t area = d.dk * d.dv, C = d.chunk;
  std::vector<T> dS(dfinal + (bb * d.h + hh) * area, dfinal + (bb * d.h + hh + 1) * area);
  std::vector<T> pre(C * area), us(C * d.dv), S(area), du(d.dv), dkv(d.dv);
  const T* saved = states + (bb * d.h + hh) * d.chunks() * area;
  for (int64_t c = d.chunks() - 1; c >= 0; --c) {
    const int64_t t0 = c * C, n = std::min(C, d.s - t0);
    std::copy(saved + c * area, saved + (c + 1) * area, S.begin());
    for (int64_t i = 0; i < n; ++i) {  // recompute S' (before the update) and u of each token
      const int64_t r = d.row(bb, t0 + i, hh);
      const T a = std::exp(g[r]);
      for (int64_t e = 0; e < area; ++e) pre[i * area + e] = S[e] * a;
      step(S.data(), q + r * d.dk, k + r * d.dk, v + r * d.dv, g[r], beta[r], us.data() + i * d.dv,
           static_cast<T*>(nullptr), d.dk, d.dv);
    }
    for (int64_t i = n - 1; i >= 0; --i) {
      const int64_t r = d.row(bb, t0 + i, hh);
      const T* Sp = pre.data() + i * area;
      const T* u = us.data() + i * d.dv;
      const T *qt = q + r * d.dk, *kt = k + r * d.dk, *vt = v + r * d.dv, *dot = dout + r * d.dv;
      T *dqt = dq + r * d.dk, *dkt = dk + r * d.dk, *dvt = dv + r * d.dv;
      T u_do = 0;
      for (int64_t j = 0; j < d.dv; ++j) u_do += u[j] * dot[j];
      for (int64_t j = 0; j < d.dv; ++j) du[j] = 0;
      for (int64_t j = 0; j < d.dv; ++j) dkv[j] = 0;  // S'^T k (the prediction of v)
      for (int64_t m = 0; m < d.dk; ++m) {
        const T* Spm = Sp + m * d.dv;
        T* dSm = dS.data() + m * d.dv;
        const T qm = qt[m], km = kt[m];
        T dq_m = 0, dk_m = 0;
#pragma omp simd reduction(+ : dq_m, dk_m)
        for (int64_t j = 0; j < d.dv; ++j) {
          dq_m += Spm[j] * dot[j];     // S = S' + k u^T, so S dO = S' dO + k (u . dO)
          dSm[j] += qm * dot[j];       // o = S^T q
          dk_m += dSm[j] * u[j];       // S = S' + k u^T
          du[j] += dSm[j] * km;
          dkv[j] += Spm[j] * km;
        }
        dqt[m] = dq_m + km * u_do;
        dkt[m] = dk_m;
      }
      const T bt = beta[r];
      T db = 0;
      for (int64_t j = 0; j < d.dv; ++j) {
        db += du[j] * (vt[j] - dkv[j]);
        dvt[j] = bt * du[j];
        dkv[j] = -bt * du[j];  // now the gradient of S'^T k
      }
      dbeta[r] = db;
      const T a = std::exp(g[r]);
      T dgt = 0;
      for (int64_t m = 0; m < d.dk; ++m) {
        const T* Spm = Sp + m * d.dv;
        T* dSm = dS.data() + m * d.dv;
        const T km = kt[m];
        T dk_m = 0, dg_m = 0;
#pragma omp simd reduction(+ : dk_m, dg_m)
        for (int64_t j = 0; j < d.dv; ++j) {
          dk_m += Spm[j] * dkv[j];
          dSm[j] += km * dkv[j];  // dS'
          dg_m += dSm[j] * Spm[j];
          dSm[j] *= a;            // dS of the previous token
        }
        dkt[m] += dk_m;
        dgt += dg_m;
      }
      dg[r] = dgt;
    }
  }
}

template <typename T>
int run_fwd(const Dims& d, const void* q, const void* k, const void* v, const void* g, const void* beta, void* out,
            void* states, void* final_state) {
#pragma omp parallel for schedule(static) if (d.parallel())
  for (int64_t p = 0; p < d.b * d.h; ++p)
    forward_pair<T>(d, p / d.h, p % d.h, static_cast<const T*>(q), static_cast<const T*>(k),
                    static_cast<const T*>(v), static_cast<const T*>(g), static_cast<const T*>(beta),
                    static_cast<T*>(out), static_cast<T*>(states), static_cast<T*>(final_state));
  return BMT_OK;
}

template <typename T>
int run_bwd(const Dims& d, const void* q, const void* k, const void* v, const void* g, const void* beta,
            const void* states, const void* dout, const void* dfinal, void* dq, void* dk, void* dv, void* dg,
            void* dbeta) {
#pragma omp parallel for schedule(static) if (d.parallel())
  for (int64_t p = 0; p < d.b * d.h; ++p)
    backward_pair<T>(d, p / d.h, p % d.h, static_cast<const T*>(q), static_cast<const T*>(k),
                     static_cast<const T*>(v), static_cast<const T*>(g), static_cast<const T*>(beta),
                     static_cast<const T*>(states), static_cast<const T*>(dout), static_cast<const T*>(dfinal),
                     static_cast<T*>(dq), static_cast<T*>(dk), static_cast<T*>(dv), static_cast<T*>(dg),
                     static_cast<T*>(dbeta));
  return BMT_OK;
}

}  // namespace

extern "C" {

int bmt_cpu_delta_rule_fwd(int dtype, const void* q, const void* k, const void* v, const void* g, const void* beta,
                           void* out, void* states, void* final_state, int64_t batch, int64_t seq, int64_t heads,
                           int64_t dk, int64_t dv, int64_t chunk) {
  if (chunk <= 0 || dk <= 0 || dv <= 0) return BMT_ERR_SHAPE;
  const Dims d{batch, seq, heads, dk, dv, chunk};
  if (dtype == BMT_F32) return run_fwd<float>(d, q, k, v, g, beta, out, states, final_state);
  if (dtype == BMT_F64) return run_fwd<double>(d, q, k, v, g, beta, out, states, final_state);
  return BMT_ERR_DTYPE;
}

int bmt_cpu_delta_rule_bwd(int dtype, const void* q, const void* k, const void* v, const void* g, const void* beta,
                           const void* states, const void* dout, const void* dfinal, void* dq, void* dk, void* dv,
                           void* dg, void* dbeta, int64_t batch, int64_t seq, int64_t heads, int64_t dk_dim,
                           int64_t dv_dim, int64_t chunk) {
  if (chunk <= 0 || dk_dim <= 0 || dv_dim <= 0) return BMT_ERR_SHAPE;
  const Dims d{batch, seq, heads, dk_dim, dv_dim, chunk};
  if (dtype == BMT_F32) return run_bwd<float>(d, q, k, v, g, beta, states, dout, dfinal, dq, dk, dv, dg, dbeta);
  if (dtype == BMT_F64) return run_bwd<double>(d, q, k, v, g, beta, states, dout, dfinal, dq, dk, dv, dg, dbeta);
  return BMT_ERR_DTYPE;
}

}  // extern "C"
