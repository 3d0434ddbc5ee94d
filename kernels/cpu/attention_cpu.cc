// Fused causal attention on a CPU (C ABI in kernels/include/bmt_kernels.h): forward and backward in the
// model's layout, q [b, s, h, d], k/v [b, s, hk, d], grouped-query (query head j uses kv head j / (h/hk)),
// optional segment ids [b, s] (a query sees the keys at the same or an earlier index with its segment id).
//
// FlashAttention's scheme without an s x s tensor: the forward keeps only the per-query log-sum-exp
// lse [b, h, s]; the backward recomputes the probabilities of one block of kQB queries at a time from it
// (P = exp(S scale - lse), D_i = dO_i . O_i, dS = P (dP - D) scale). Per block the scratch is [kQB, s].
//
// Work items are (batch, kv head[, chunk]): an item packs its K and V once (K^T and V^T [d, s] for the
// score tiles, K and V [s, d] for the row products, zero-padded to whole tiles) and runs every block of
// its rep query heads, so its K/V gradients are private (a thread's buffer, written out at the item's
// end). When b * hk is below kItems (threads would idle), an item's query blocks are dealt round-robin to
// several chunks, each with its own K/V gradient buffers, summed in chunk order after the parallel loop.
// The chunking depends on the shape alone, never on the thread count, so the gradients are the same bits
// for any OMP_NUM_THREADS and any scheduling. The micro-kernels
// hold a kQB x kKB (or kQB x kDC) accumulator tile in registers (compile-time sizes, so GCC unrolls and
// vectorises them); the exp is simd_math.h's.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

#include "bmt_kernels.h"
#include "parallel.h"
#include "simd_math.h"

namespace {

constexpr int kQB = 8;   // queries per block: rows of every micro-kernel tile
constexpr int kKB = 16;  // keys per score tile (one AVX-512 register of fp32)
constexpr int kDC = 16;  // head-dim columns per row-product tile

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr int64_t kItems = 64;  // work items wanted for a parallel call (enough for 16 threads x 4)

struct Shape {
  int64_t b, s, h, hk, d, rep;
  int64_t sp, dp;  // s and d rounded up to whole tiles
  bool parallel;
  int64_t chunks;  // chunks per (batch, kv head) item
  int64_t qblocks() const { return (s + kQB - 1) / kQB; }
  int64_t items() const { return b * hk * chunks; }
  int64_t row(int64_t bb, int64_t i, int64_t head, int64_t heads) const { return ((bb * s + i) * heads + head) * d; }
};

Shape make_shape(int64_t b, int64_t s, int64_t h, int64_t hk, int64_t d) {
  Shape sh{b, s, h, hk, d, h / hk, round_up(s, kKB), round_up(d, kDC), false, 1};
  // multiply-adds of one causal score pass: tiny calls stay on one thread (parallel.h)
  sh.parallel = b * h * s * (s + 1) / 2 * d >= bmt::kParallelMin;
  const int64_t pairs = b * hk;
  if (sh.parallel && pairs < kItems)
    sh.chunks = std::min((kItems + pairs - 1) / pairs, std::max<int64_t>(1, sh.rep * sh.qblocks()));
  return sh;
}

// The K/V of one (batch, kv head), packed and zero-padded; the segment ids of its row and, per query,
// the first index that may be visible (the first key of its segment id; 0 without segments).
template <typename T>
struct Item {
  std::vector<T> kt, vt, kp, vp;  // [dp, sp] transposed, [sp, dp] row-major
  std::vector<int64_t> seg, lo;   // [s]

  void pack(const Shape& sh, const T* k, const T* v, const int64_t* segs, int64_t bb, int64_t g, bool trans_v,
            bool rows_k) {
    kt.assign(sh.dp * sh.sp, T(0));
    vp.assign(sh.sp * sh.dp, T(0));
    if (trans_v) vt.assign(sh.dp * sh.sp, T(0));
    if (rows_k) kp.assign(sh.sp * sh.dp, T(0));
    for (int64_t j = 0; j < sh.s; ++j) {
      const T* kr = k + sh.row(bb, j, g, sh.hk);
      const T* vr = v + sh.row(bb, j, g, sh.hk);
      std::copy(vr, vr + sh.d, vp.data() + j * sh.dp);
      if (rows_k) std::copy(kr, kr + sh.d, kp.data() + j * sh.dp);
    }
    // the transposes a kKB-key tile at a time: each write fills a run of kKB contiguous keys
    for (int64_t j0 = 0; j0 < sh.s; j0 += kKB) {
      const int64_t n = std::min<int64_t>(kKB, sh.s - j0);
      for (int64_t c = 0; c < sh.d; ++c) {
        T* kc = kt.data() + c * sh.sp + j0;
        T* vc = trans_v ? vt.data() + c * sh.sp + j0 : nullptr;
        for (int64_t u = 0; u < n; ++u) {
          kc[u] = k[sh.row(bb, j0 + u, g, sh.hk) + c];
          if (vc) vc[u] = v[sh.row(bb, j0 + u, g, sh.hk) + c];
        }
      }
    }
    seg.assign(sh.s, 0);
    lo.assign(sh.s, 0);
    if (segs == nullptr) return;
    std::unordered_map<int64_t, int64_t> first;
    for (int64_t i = 0; i < sh.s; ++i) {
      seg[i] = segs[bb * sh.s + i];
      lo[i] = first.emplace(seg[i], i).first->second;
    }
  }
};

// out[r, j] = sum_c a[r, c] bt[c, j] for the kQB rows and the keys [j0, j1) (whole kKB tiles).
template <typename T>
void score_tiles(const T* a, const T* bt, int64_t dp, int64_t sp, int64_t j0, int64_t j1, T* out) {
  for (int64_t j = j0; j < j1; j += kKB) {
    T acc[kQB][kKB] = {};
    for (int64_t c = 0; c < dp; ++c) {
      const T* br = bt + c * sp + j;
      for (int r = 0; r < kQB; ++r) {
        const T av = a[r * dp + c];
#pragma omp simd
        for (int t = 0; t < kKB; ++t) acc[r][t] += av * br[t];
      }
    }
    for (int r = 0; r < kQB; ++r)
#pragma omp simd
      for (int t = 0; t < kKB; ++t) out[r * sp + j + t] = acc[r][t];
  }
}

// out[r, :] = sum_{j in [j0, j1)} p[r, j] m[j, :] for the kQB rows (m [sp, dp] row-major).
template <typename T>
void row_products(const T* p, const T* m, int64_t sp, int64_t dp, int64_t j0, int64_t j1, T* out) {
  for (int64_t c0 = 0; c0 < dp; c0 += kDC) {
    T acc[kQB][kDC] = {};
    for (int64_t j = j0; j < j1; ++j) {
      const T* mr = m + j * dp + c0;
      for (int r = 0; r < kQB; ++r) {
        const T pv = p[r * sp + j];
#pragma omp simd
        for (int t = 0; t < kDC; ++t) acc[r][t] += pv * mr[t];
      }
    }
    for (int r = 0; r < kQB; ++r)
#pragma omp simd
      for (int t = 0; t < kDC; ++t) out[r * dp + c0 + t] = acc[r][t];
  }
}

// dst[j, :] += sum_r p[r, j] a[r, :] for the keys [j0, j1) (dst [sp, dp], a [kQB, dp]).
template <typename T>
void key_products(const T* p, const T* a, int64_t sp, int64_t dp, int64_t j0, int64_t j1, T* dst) {
  for (int64_t j = j0; j < j1; ++j) {
    T pj[kQB];
    for (int r = 0; r < kQB; ++r) pj[r] = p[r * sp + j];
    T* dr = dst + j * dp;
    for (int64_t c0 = 0; c0 < dp; c0 += kDC) {
      T acc[kDC];
#pragma omp simd
      for (int t = 0; t < kDC; ++t) acc[t] = dr[c0 + t];
      for (int r = 0; r < kQB; ++r) {
#pragma omp simd
        for (int t = 0; t < kDC; ++t) acc[t] += pj[r] * a[r * dp + c0 + t];
      }
#pragma omp simd
      for (int t = 0; t < kDC; ++t) dr[c0 + t] = acc[t];
    }
  }
}

// One block: queries i0 .. i0 + n - 1 of query head `head`, the keys it needs [j0, j1).
struct Block {
  int64_t head, i0, n, j0, j1;
};

template <typename T>
Block make_block(const Shape& sh, const Item<T>& it, int64_t g, int64_t index) {
  const int64_t r = index / sh.qblocks(), i0 = (index % sh.qblocks()) * kQB;
  const int64_t n = std::min<int64_t>(kQB, sh.s - i0);
  int64_t lo = it.lo[i0];
  for (int64_t q = 1; q < n; ++q) lo = std::min(lo, it.lo[i0 + q]);
  return Block{g * sh.rep + r, i0, n, lo / kKB * kKB, round_up(i0 + n, kKB)};
}

// Rows of a [b, s, heads, d] tensor into a zero-padded [kQB, dp] tile.
template <typename T>
void load_rows(const Shape& sh, const T* x, int64_t bb, const Block& blk, T* tile) {
  std::fill(tile, tile + kQB * sh.dp, T(0));
  for (int64_t q = 0; q < blk.n; ++q) {
    const T* xr = x + sh.row(bb, blk.i0 + q, blk.head, sh.h);
    std::copy(xr, xr + sh.d, tile + q * sh.dp);
  }
}

template <typename T>
void store_rows(const Shape& sh, const T* tile, int64_t bb, const Block& blk, T* x) {
  for (int64_t q = 0; q < blk.n; ++q)
    std::copy(tile + q * sh.dp, tile + q * sh.dp + sh.d, x + sh.row(bb, blk.i0 + q, blk.head, sh.h));
}

// Row q of the block's scores -> probabilities in place (0 where the key is not visible). Forward
// (lse_in null): normalised by their sum, whose log-sum-exp goes to *lse_out; backward: exp(x - lse_in).
template <typename T>
void probabilities(const Item<T>& it, const Block& blk, int64_t q, T scale, T* row, const T* lse_in, T* lse_out) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const int64_t i = blk.i0 + q;
  const int64_t lo = it.lo[i], si = it.seg[i];
  const int64_t* seg = it.seg.data();
  const int64_t jend = std::min<int64_t>(blk.j1, static_cast<int64_t>(it.seg.size()));
  if (q >= blk.n) {
    std::fill(row + blk.j0, row + blk.j1, T(0));
    return;
  }
  std::fill(row + jend, row + blk.j1, T(0));
  if (lse_in != nullptr) {
    const T l = *lse_in;
#pragma omp simd
    for (int64_t j = blk.j0; j < jend; ++j) {
      const bool ok = (j >= lo) & (j <= i) & (seg[j] == si);  // no short circuit: a plain load vectorises
      const T e = bmt::exp_approx(row[j] * scale - l);
      row[j] = ok ? e : T(0);
    }
    return;
  }
  // the mask first, then a plain max: GCC 12 with -fno-trapping-math miscompiled one loop taking
  // max(m, ok ? x : -inf) (garbage maxima from s = 80 on)
#pragma omp simd
  for (int64_t j = blk.j0; j < jend; ++j) {
    const bool ok = (j >= lo) & (j <= i) & (seg[j] == si);  // no short circuit: a plain load vectorises
    row[j] = ok ? row[j] * scale : ninf;
  }
  T m = ninf;
#pragma omp simd reduction(max : m)
  for (int64_t j = blk.j0; j < jend; ++j) m = std::max(m, row[j]);
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = blk.j0; j < jend; ++j) {
    const T e = bmt::exp_approx(row[j] - m);
    row[j] = row[j] == ninf ? T(0) : e;
    sum += row[j];
  }
  const T inv = T(1) / sum;
#pragma omp simd
  for (int64_t j = blk.j0; j < jend; ++j) row[j] *= inv;
  *lse_out = m + std::log(sum);
}

template <typename T>
void attention_fwd(const Shape& sh, const T* q, const T* k, const T* v, const int64_t* seg, T* out, T* lse,
                   T scale) {
#pragma omp parallel if (sh.parallel)
  {
    Item<T> it;
    std::vector<T> qt(kQB * sh.dp), ot(kQB * sh.dp), p(kQB * sh.sp);
    int64_t packed = -1;
#pragma omp for schedule(monotonic : dynamic, 1)
    for (int64_t item = 0; item < sh.items(); ++item) {
      const int64_t pair = item / sh.chunks, chunk = item % sh.chunks;
      const int64_t bb = pair / sh.hk, g = pair % sh.hk;
      if (packed != pair) it.pack(sh, k, v, seg, bb, g, false, false);
      packed = pair;
      for (int64_t index = chunk; index < sh.rep * sh.qblocks(); index += sh.chunks) {
        const Block blk = make_block(sh, it, g, index);
        load_rows(sh, q, bb, blk, qt.data());
        score_tiles(qt.data(), it.kt.data(), sh.dp, sh.sp, blk.j0, blk.j1, p.data());
        for (int64_t r = 0; r < kQB; ++r) {
          T* l = lse + (bb * sh.h + blk.head) * sh.s + blk.i0 + r;
          probabilities(it, blk, r, scale, p.data() + r * sh.sp, static_cast<const T*>(nullptr), l);
        }
        row_products(p.data(), it.vp.data(), sh.sp, sh.dp, blk.j0, blk.j1, ot.data());
        store_rows(sh, ot.data(), bb, blk, out);
      }
    }
  }
}

// An item's K/V gradients [sp, dp] into dk, dv (rows of [b, s, hk, d]), summed over its `parts` buffers.
template <typename T>
void store_kv_grads(const Shape& sh, const T* const* parts, int64_t nparts, int64_t bb, int64_t g, T* dk, T* dv) {
  const int64_t kv_elems = sh.sp * sh.dp;
  for (int64_t j = 0; j < sh.s; ++j) {
    T* dkr = dk + sh.row(bb, j, g, sh.hk);
    T* dvr = dv + sh.row(bb, j, g, sh.hk);
    for (int64_t c = 0; c < sh.d; ++c) {
      T sk = 0, sv = 0;
      for (int64_t i = 0; i < nparts; ++i) {
        sk += parts[i][j * sh.dp + c];
        sv += parts[i][kv_elems + j * sh.dp + c];
      }
      dkr[c] = sk;
      dvr[c] = sv;
    }
  }
}

template <typename T>
void attention_bwd(const Shape& sh, const T* q, const T* k, const T* v, const int64_t* seg, const T* out,
                   const T* lse, const T* dout, T* dq, T* dk, T* dv, T scale) {
  const int64_t kv_elems = sh.sp * sh.dp;
  // chunked items keep their K/V gradients until every chunk is done; whole items use a thread's buffer
  std::vector<T> chunked(sh.chunks > 1 ? static_cast<size_t>(sh.items()) * 2 * kv_elems : 0, T(0));
#pragma omp parallel if (sh.parallel)
  {
    Item<T> it;
    std::vector<T> qt(kQB * sh.dp), dot(kQB * sh.dp), dqt(kQB * sh.dp), p(kQB * sh.sp), ds(kQB * sh.sp);
    std::vector<T> own(sh.chunks > 1 ? 0 : 2 * kv_elems);
    int64_t packed = -1;
#pragma omp for schedule(monotonic : dynamic, 1)
    for (int64_t item = 0; item < sh.items(); ++item) {
      const int64_t pair = item / sh.chunks, chunk = item % sh.chunks;
      const int64_t bb = pair / sh.hk, g = pair % sh.hk;
      if (packed != pair) it.pack(sh, k, v, seg, bb, g, true, true);
      packed = pair;
      T* gk = sh.chunks > 1 ? chunked.data() + item * 2 * kv_elems : own.data();
      T* gv = gk + kv_elems;
      if (sh.chunks == 1) std::fill(own.begin(), own.end(), T(0));
      for (int64_t index = chunk; index < sh.rep * sh.qblocks(); index += sh.chunks) {
        const Block blk = make_block(sh, it, g, index);
        load_rows(sh, q, bb, blk, qt.data());
        load_rows(sh, dout, bb, blk, dot.data());
        score_tiles(qt.data(), it.kt.data(), sh.dp, sh.sp, blk.j0, blk.j1, p.data());
        score_tiles(dot.data(), it.vt.data(), sh.dp, sh.sp, blk.j0, blk.j1, ds.data());
        for (int64_t r = 0; r < kQB; ++r) {
          T* pr = p.data() + r * sh.sp;
          T* dr = ds.data() + r * sh.sp;
          const T* l = lse + (bb * sh.h + blk.head) * sh.s + blk.i0 + r;
          probabilities(it, blk, r, scale, pr, r < blk.n ? l : nullptr, static_cast<T*>(nullptr));
          T delta = 0;  // D_i = dO_i . O_i
          if (r < blk.n) {
            const T* orow = out + sh.row(bb, blk.i0 + r, blk.head, sh.h);
            const T* drow = dot.data() + r * sh.dp;
#pragma omp simd reduction(+ : delta)
            for (int64_t c = 0; c < sh.d; ++c) delta += drow[c] * orow[c];
          }
#pragma omp simd
          for (int64_t j = blk.j0; j < blk.j1; ++j) dr[j] = pr[j] * (dr[j] - delta) * scale;
        }
        row_products(ds.data(), it.kp.data(), sh.sp, sh.dp, blk.j0, blk.j1, dqt.data());
        store_rows(sh, dqt.data(), bb, blk, dq);
        key_products(p.data(), dot.data(), sh.sp, sh.dp, blk.j0, blk.j1, gv);
        key_products(ds.data(), qt.data(), sh.sp, sh.dp, blk.j0, blk.j1, gk);
      }
      if (sh.chunks == 1) {
        const T* parts[1] = {gk};
        store_kv_grads(sh, parts, 1, bb, g, dk, dv);
      }
    }
  }
  if (sh.chunks == 1) return;
  // sum the chunks of each (batch, kv head) into dk, dv
#pragma omp parallel for schedule(static) if (sh.parallel)
  for (int64_t pair = 0; pair < sh.b * sh.hk; ++pair) {
    std::vector<const T*> parts(sh.chunks);
    for (int64_t ch = 0; ch < sh.chunks; ++ch) parts[ch] = chunked.data() + (pair * sh.chunks + ch) * 2 * kv_elems;
    store_kv_grads(sh, parts.data(), sh.chunks, pair / sh.hk, pair % sh.hk, dk, dv);
  }
}

bool bad_shape(int64_t b, int64_t s, int64_t h, int64_t hk, int64_t d) {
  return b < 0 || s < 0 || h <= 0 || hk <= 0 || d <= 0 || h % hk != 0;
}

}  // namespace

extern "C" {

int bmt_cpu_attention_fwd(int dtype, const void* q, const void* k, const void* v, const int64_t* segment_ids,
                          void* out, void* lse, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                          int64_t dim, double scale) {
  if (bad_shape(batch, seq, heads, kv_heads, dim)) return BMT_ERR_SHAPE;
  const Shape sh = make_shape(batch, seq, heads, kv_heads, dim);
  if (dtype == BMT_F32)
    attention_fwd(sh, static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(v),
                  segment_ids, static_cast<float*>(out), static_cast<float*>(lse), static_cast<float>(scale));
  else if (dtype == BMT_F64)
    attention_fwd(sh, static_cast<const double*>(q), static_cast<const double*>(k), static_cast<const double*>(v),
                  segment_ids, static_cast<double*>(out), static_cast<double*>(lse), scale);
  else
    return BMT_ERR_DTYPE;
  return BMT_OK;
}

int bmt_cpu_attention_bwd(int dtype, const void* q, const void* k, const void* v, const int64_t* segment_ids,
                          const void* out, const void* lse, const void* dout, void* dq, void* dk, void* dv,
                          int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t dim, double scale) {
  if (bad_shape(batch, seq, heads, kv_heads, dim)) return BMT_ERR_SHAPE;
  const Shape sh = make_shape(batch, seq, heads, kv_heads, dim);
  if (dtype == BMT_F32)
    attention_bwd(sh, static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(v),
                  segment_ids, static_cast<const float*>(out), static_cast<const float*>(lse),
                  static_cast<const float*>(dout), static_cast<float*>(dq), static_cast<float*>(dk),
                  static_cast<float*>(dv), static_cast<float>(scale));
  else if (dtype == BMT_F64)
    attention_bwd(sh, static_cast<const double*>(q), static_cast<const double*>(k), static_cast<const double*>(v),
                  segment_ids, static_cast<const double*>(out), static_cast<const double*>(lse),
                  static_cast<const double*>(dout), static_cast<double*>(dq), static_cast<double*>(dk),
                  static_cast<double*>(dv), scale);
  else
    return BMT_ERR_DTYPE;
  return BMT_OK;
}

}  // extern "C"
