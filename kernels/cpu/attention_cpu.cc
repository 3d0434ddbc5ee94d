// Fused attention on a CPU (C ABI in kernels/include/bmt_kernels.h): forward and backward in the model's
// layout, q [b, sq, h, d], k/v [b, sk, hk, d], grouped-query (query head j uses kv head j / (h/hk)).
// Causal (sq == sk: a query sees the keys at the same or an earlier index) or not (every key), optionally
// restricted to equal segment ids (query ids [b, sq], key ids [b, sk]). The model's causal attention
// passes one array of ids for both; a ring attention's block pair (parallel/ring_attention.py) passes the
// ids of its query chunk and of its key chunk, causal on the diagonal pair and not before it, and a sliding
// window where the layer has one: query i, `offset` positions after key 0 (the distance of the chunks'
// starts in the sequence), sees only the keys j with i + offset - j < window; and a soft cap where the layer's
// scores have one (Gemma 2): the scaled scores become cap * tanh(s scale / cap) before the mask, and the
// backward multiplies dS by the cap's derivative 1 - tanh^2. A query that
// sees no key of the call gets a zero output and the log-sum-exp kEmptyLse (finite: its weight in a
// log-sum-exp merge underflows to zero). The backward takes the log-sum-exp and D = dO . O from the
// caller, so a block pair's gradients are taken against the merged (global) statistics.
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

constexpr double kEmptyLse = -1e30;  // the log-sum-exp of a query that sees no key

constexpr int64_t kItems = 64;  // work items wanted for a parallel call (enough for 16 threads x 4)

struct Shape {
  int64_t b, sq, s, h, hk, d, rep;  // sq queries, s keys
  bool causal;
  int64_t sp, dp;  // s and d rounded up to whole tiles
  bool parallel;
  int64_t chunks;  // chunks per (batch, kv head) item
  int64_t window = 0;  // > 0: query i sees only the keys j with i + offset - j < window
  int64_t offset = 0;
  double softcap = 0;  // > 0: the scaled scores become softcap * tanh(s / softcap) before the mask
  int64_t qblocks() const { return (sq + kQB - 1) / kQB; }
  int64_t items() const { return b * hk * chunks; }
  int64_t qrow(int64_t bb, int64_t i, int64_t head) const { return ((bb * sq + i) * h + head) * d; }
  int64_t krow(int64_t bb, int64_t j, int64_t g) const { return ((bb * s + j) * hk + g) * d; }
};

Shape make_shape(int64_t b, int64_t sq, int64_t s, int64_t h, int64_t hk, int64_t d, bool causal) {
  Shape sh{b, sq, s, h, hk, d, h / hk, causal, round_up(s, kKB), round_up(d, kDC), false, 1};
  // multiply-adds of one score pass: tiny calls stay on one thread (parallel.h)
  sh.parallel = b * h * (causal ? s * (s + 1) / 2 : sq * s) * d >= bmt::kParallelMin;
  const int64_t pairs = b * hk;
  if (sh.parallel && pairs < kItems)
    sh.chunks = std::min((kItems + pairs - 1) / pairs, std::max<int64_t>(1, sh.rep * sh.qblocks()));
  return sh;
}

// The segment ids a call attends with: of the queries [b, sq] and of the keys [b, s] (both null: none).
struct Segments {
  const int64_t* q;
  const int64_t* k;
};

// The K/V of one (batch, kv head), packed and zero-padded; the segment ids of its keys and queries and,
// per query, the first key that may be visible (the first key of its segment id, s where none; 0 without
// segments; no earlier than the window's first key, s where the window holds no key of the call).
template <typename T>
struct Item {
  std::vector<T> kt, vt, kp, vp;     // [dp, sp] transposed, [sp, dp] row-major
  std::vector<int64_t> seg, qseg, lo;  // [s], [sq], [sq]

  void pack(const Shape& sh, const T* k, const T* v, Segments segs, int64_t bb, int64_t g, bool trans_v,
            bool rows_k) {
    kt.assign(sh.dp * sh.sp, T(0));
    vp.assign(sh.sp * sh.dp, T(0));
    if (trans_v) vt.assign(sh.dp * sh.sp, T(0));
    if (rows_k) kp.assign(sh.sp * sh.dp, T(0));
    for (int64_t j = 0; j < sh.s; ++j) {
      const T* kr = k + sh.krow(bb, j, g);
      const T* vr = v + sh.krow(bb, j, g);
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
          kc[u] = k[sh.krow(bb, j0 + u, g) + c];
          if (vc) vc[u] = v[sh.krow(bb, j0 + u, g) + c];
        }
      }
    }
    seg.assign(sh.s, 0);
    qseg.assign(sh.sq, 0);
    lo.assign(sh.sq, 0);
    if (segs.k != nullptr) {
      std::unordered_map<int64_t, int64_t> first;
      for (int64_t j = 0; j < sh.s; ++j) {
        seg[j] = segs.k[bb * sh.s + j];
        first.emplace(seg[j], j);
      }
      for (int64_t i = 0; i < sh.sq; ++i) {
        qseg[i] = segs.q[bb * sh.sq + i];
        const auto at = first.find(qseg[i]);
        lo[i] = at == first.end() ? sh.s : at->second;
      }
    }
    if (sh.window > 0)
      for (int64_t i = 0; i < sh.sq; ++i) lo[i] = std::min(std::max(lo[i], i + sh.offset - sh.window + 1), sh.s);
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
  const int64_t n = std::min<int64_t>(kQB, sh.sq - i0);
  int64_t lo = it.lo[i0];
  for (int64_t q = 1; q < n; ++q) lo = std::min(lo, it.lo[i0 + q]);
  const int64_t j1 = sh.causal ? round_up(i0 + n, kKB) : sh.sp;
  return Block{g * sh.rep + r, i0, n, std::min(lo / kKB * kKB, j1), j1};
}

// Rows of a [b, s, heads, d] tensor into a zero-padded [kQB, dp] tile.
template <typename T>
void load_rows(const Shape& sh, const T* x, int64_t bb, const Block& blk, T* tile) {
  std::fill(tile, tile + kQB * sh.dp, T(0));
  for (int64_t q = 0; q < blk.n; ++q) {
    const T* xr = x + sh.qrow(bb, blk.i0 + q, blk.head);
    std::copy(xr, xr + sh.d, tile + q * sh.dp);
  }
}

template <typename T>
void store_rows(const Shape& sh, const T* tile, int64_t bb, const Block& blk, T* x) {
  for (int64_t q = 0; q < blk.n; ++q)
    std::copy(tile + q * sh.dp, tile + q * sh.dp + sh.d, x + sh.qrow(bb, blk.i0 + q, blk.head));
}

// Row q of the block's scores -> probabilities in place (0 where the key is not visible). Forward
// (lse_in null): normalised by their sum, whose log-sum-exp goes to *lse_out (a row that sees no key: all
// 0, kEmptyLse); backward: exp(x - lse_in). ``causal``: keys after the query are not visible.
template <typename T>
void probabilities(const Item<T>& it, const Block& blk, int64_t q, bool causal, T scale, T* row, const T* lse_in,
                   T* lse_out) {
  const T ninf = -std::numeric_limits<T>::infinity();
  if (q >= blk.n) {
    std::fill(row + blk.j0, row + blk.j1, T(0));
    return;
  }
  const int64_t i = blk.i0 + q;
  const int64_t lo = it.lo[i], si = it.qseg[i];
  const int64_t last = causal ? i : static_cast<int64_t>(it.seg.size());  // the last key that may be visible
  const int64_t* seg = it.seg.data();
  const int64_t jend = std::min<int64_t>(blk.j1, static_cast<int64_t>(it.seg.size()));
  std::fill(row + jend, row + blk.j1, T(0));
  if (lse_in != nullptr) {
    const T l = *lse_in;
#pragma omp simd
    for (int64_t j = blk.j0; j < jend; ++j) {
      const bool ok = (j >= lo) & (j <= last) & (seg[j] == si);  // no short circuit: a plain load vectorises
      const T e = bmt::exp_approx(row[j] * scale - l);
      row[j] = ok ? e : T(0);
    }
    return;
  }
  // the mask first, then a plain max: GCC 12 with -fno-trapping-math miscompiled one loop taking
  // max(m, ok ? x : -inf) (garbage maxima from s = 80 on)
#pragma omp simd
  for (int64_t j = blk.j0; j < jend; ++j) {
    const bool ok = (j >= lo) & (j <= last) & (seg[j] == si);  // no short circuit: a plain load vectorises
    row[j] = ok ? row[j] * scale : ninf;
  }
  T m = ninf;
#pragma omp simd reduction(max : m)
  for (int64_t j = blk.j0; j < jend; ++j) m = std::max(m, row[j]);
  if (m == ninf) {  // nothing visible (only where the query's segment has no key in the call)
    std::fill(row + blk.j0, row + jend, T(0));
    *lse_out = static_cast<T>(kEmptyLse);
    return;
  }
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

// Row q's raw scores q.k -> the scores the probabilities take: returns the scale they still need (``scale``
// without a cap); with a cap the row becomes cap * tanh(s scale / cap) in place (scale 1 then) and ``slope``
// (if not null) the cap's derivative 1 - tanh^2 at each key.
template <typename T>
T capped(const Shape& sh, const Block& blk, T scale, T* row, T* slope) {
  if (sh.softcap <= 0) return scale;
  const T cap = static_cast<T>(sh.softcap), over = scale / cap;
  if (slope == nullptr) {
#pragma omp simd
    for (int64_t j = blk.j0; j < blk.j1; ++j) row[j] = cap * bmt::tanh_approx(row[j] * over);
    return T(1);
  }
#pragma omp simd
  for (int64_t j = blk.j0; j < blk.j1; ++j) {
    const T t = bmt::tanh_approx(row[j] * over);
    row[j] = cap * t;
    slope[j] = T(1) - t * t;
  }
  return T(1);
}

template <typename T>
void attention_fwd(const Shape& sh, const T* q, const T* k, const T* v, Segments seg, T* out, T* lse,
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
          T* l = lse + (bb * sh.h + blk.head) * sh.sq + blk.i0 + r;
          T* row = p.data() + r * sh.sp;
          const T by = capped(sh, blk, scale, row, static_cast<T*>(nullptr));
          probabilities(it, blk, r, sh.causal, by, row, static_cast<const T*>(nullptr), l);
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
    T* dkr = dk + sh.krow(bb, j, g);
    T* dvr = dv + sh.krow(bb, j, g);
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
void attention_bwd(const Shape& sh, const T* q, const T* k, const T* v, Segments seg, const T* lse,
                   const T* delta, const T* dout, T* dq, T* dk, T* dv, T scale) {
  const int64_t kv_elems = sh.sp * sh.dp;
  // chunked items keep their K/V gradients until every chunk is done; whole items use a thread's buffer
  std::vector<T> chunked(sh.chunks > 1 ? static_cast<size_t>(sh.items()) * 2 * kv_elems : 0, T(0));
#pragma omp parallel if (sh.parallel)
  {
    Item<T> it;
    std::vector<T> qt(kQB * sh.dp), dot(kQB * sh.dp), dqt(kQB * sh.dp), p(kQB * sh.sp), ds(kQB * sh.sp);
    std::vector<T> slope(sh.softcap > 0 ? sh.sp : 0);
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
          const int64_t at = (bb * sh.h + blk.head) * sh.sq + blk.i0 + r;
          const T* l = r < blk.n ? lse + at : nullptr;
          const T by = capped(sh, blk, scale, pr, slope.data());
          probabilities(it, blk, r, sh.causal, by, pr, l, static_cast<T*>(nullptr));
          const T di = r < blk.n ? delta[at] : T(0);  // D_i = dO_i . O_i
#pragma omp simd
          for (int64_t j = blk.j0; j < blk.j1; ++j) dr[j] = pr[j] * (dr[j] - di) * scale;
          if (sh.softcap > 0)  // through the cap: d(cap * tanh(x / cap)) = (1 - tanh^2) dx
#pragma omp simd
            for (int64_t j = blk.j0; j < blk.j1; ++j) dr[j] *= slope[j];
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

// D = dO . O per query [b, h, s] (the causal entry point's backward: the caller gives O, not D).
template <typename T>
std::vector<T> row_dots(const Shape& sh, const T* out, const T* dout) {
  std::vector<T> delta(static_cast<size_t>(sh.b * sh.h * sh.sq));
#pragma omp parallel for schedule(static) if (sh.parallel)
  for (int64_t bh = 0; bh < sh.b * sh.h; ++bh) {
    const int64_t bb = bh / sh.h, head = bh % sh.h;
    for (int64_t i = 0; i < sh.sq; ++i) {
      const T* o = out + sh.qrow(bb, i, head);
      const T* g = dout + sh.qrow(bb, i, head);
      T acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t c = 0; c < sh.d; ++c) acc += g[c] * o[c];
      delta[bh * sh.sq + i] = acc;
    }
  }
  return delta;
}

template <typename T>
int run_forward(const Shape& sh, const void* q, const void* k, const void* v, Segments seg, void* out, void* lse,
            double scale) {
  attention_fwd(sh, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), seg,
                static_cast<T*>(out), static_cast<T*>(lse), static_cast<T>(scale));
  return BMT_OK;
}

template <typename T>
int run_backward(const Shape& sh, const void* q, const void* k, const void* v, Segments seg, const void* out,
             const void* delta, const void* lse, const void* dout, void* dq, void* dk, void* dv, double scale) {
  std::vector<T> dots;
  if (delta == nullptr) {
    dots = row_dots(sh, static_cast<const T*>(out), static_cast<const T*>(dout));
    delta = dots.data();
  }
  attention_bwd(sh, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), seg,
                static_cast<const T*>(lse), static_cast<const T*>(delta), static_cast<const T*>(dout),
                static_cast<T*>(dq), static_cast<T*>(dk), static_cast<T*>(dv), static_cast<T>(scale));
  return BMT_OK;
}

Shape ruled(Shape sh, int64_t window, int64_t offset, double softcap) {
  sh.window = window;
  sh.offset = offset;
  sh.softcap = softcap;
  return sh;
}

bool bad_shape(int64_t b, int64_t sq, int64_t s, int64_t h, int64_t hk, int64_t d, int causal) {
  return b < 0 || sq < 0 || s < 0 || h <= 0 || hk <= 0 || d <= 0 || h % hk != 0 || (causal && sq != s);
}

}  // namespace

extern "C" {

int bmt_cpu_attention_fwd(int dtype, const void* q, const void* k, const void* v, const int64_t* segment_ids,
                          void* out, void* lse, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                          int64_t dim, double scale) {
  return bmt_cpu_attention_pair_fwd(dtype, q, k, v, segment_ids, segment_ids, 1, 0, 0, 0.0, out, lse, batch, seq,
                                    seq, heads, kv_heads, dim, scale);
}

int bmt_cpu_attention_bwd(int dtype, const void* q, const void* k, const void* v, const int64_t* segment_ids,
                          const void* out, const void* lse, const void* dout, void* dq, void* dk, void* dv,
                          int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t dim, double scale) {
  if (bad_shape(batch, seq, seq, heads, kv_heads, dim, 1)) return BMT_ERR_SHAPE;
  const Shape sh = make_shape(batch, seq, seq, heads, kv_heads, dim, true);
  const Segments seg{segment_ids, segment_ids};
  if (dtype == BMT_F32) return run_backward<float>(sh, q, k, v, seg, out, nullptr, lse, dout, dq, dk, dv, scale);
  if (dtype == BMT_F64) return run_backward<double>(sh, q, k, v, seg, out, nullptr, lse, dout, dq, dk, dv, scale);
  return BMT_ERR_DTYPE;
}

int bmt_cpu_attention_pair_fwd(int dtype, const void* q, const void* k, const void* v, const int64_t* q_segment_ids,
                               const int64_t* k_segment_ids, int causal, int64_t window, int64_t offset,
                               double softcap, void* out, void* lse, int64_t batch, int64_t q_len, int64_t k_len, int64_t heads,
                               int64_t kv_heads, int64_t dim, double scale) {
  if (bad_shape(batch, q_len, k_len, heads, kv_heads, dim, causal) ||
      (q_segment_ids == nullptr) != (k_segment_ids == nullptr) || window < 0 || !(softcap >= 0))
    return BMT_ERR_SHAPE;
  const Shape sh =
      ruled(make_shape(batch, q_len, k_len, heads, kv_heads, dim, causal != 0), window, offset, softcap);
  const Segments seg{q_segment_ids, k_segment_ids};
  if (dtype == BMT_F32) return run_forward<float>(sh, q, k, v, seg, out, lse, scale);
  if (dtype == BMT_F64) return run_forward<double>(sh, q, k, v, seg, out, lse, scale);
  return BMT_ERR_DTYPE;
}

int bmt_cpu_attention_pair_bwd(int dtype, const void* q, const void* k, const void* v, const int64_t* q_segment_ids,
                               const int64_t* k_segment_ids, int causal, int64_t window, int64_t offset,
                               double softcap, const void* lse, const void* delta, const void* dout, void* dq, void* dk, void* dv,
                               int64_t batch, int64_t q_len, int64_t k_len, int64_t heads, int64_t kv_heads,
                               int64_t dim, double scale) {
  if (bad_shape(batch, q_len, k_len, heads, kv_heads, dim, causal) ||
      (q_segment_ids == nullptr) != (k_segment_ids == nullptr) || window < 0 || !(softcap >= 0))
    return BMT_ERR_SHAPE;
  const Shape sh =
      ruled(make_shape(batch, q_len, k_len, heads, kv_heads, dim, causal != 0), window, offset, softcap);
  const Segments seg{q_segment_ids, k_segment_ids};
  if (dtype == BMT_F32) return run_backward<float>(sh, q, k, v, seg, nullptr, delta, lse, dout, dq, dk, dv, scale);
  if (dtype == BMT_F64) return run_backward<double>(sh, q, k, v, seg, nullptr, delta, lse, dout, dq, dk, dv, scale);
  return BMT_ERR_DTYPE;
}

}  // extern "C"
