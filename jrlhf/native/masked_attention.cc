// Full-sequence masked attention for XLA:CPU, forward and backward, called through the XLA FFI
// (jrlhf/native/attention.py has jrlhf/native/build.py compile this file on first use).
//
// Semantics are those of jrlhf.models.attention.masked_attention: grouped-query attention of
// q (B, T, H, D) over k, v (B, S, KV, D) with a boolean mask (B, T, S); scores q.k times
// D^-1/2, masked scores replaced by `mask_value` (a large finite negative, so a row with nothing
// to attend to averages every value, as the reference does), softmax and the product with v, in
// float32.
//
// Why: on XLA:CPU the reference's products are batched over (batch, KV head) with a contraction
// of head_dim (16 in the `bench rl` model) and scores of tens of keys, which XLA runs as many
// small dots plus a softmax and its backward fused around them; together they took about a
// quarter of a GRPO train step (docs/performance.md). Here one work item is a (sequence, KV
// head): its K and V are copied once into both row- and column-major scratch, so every loop
// below runs over a contiguous axis (keys or head_dim) and vectorizes, and the items are shared
// out over XLA's intra-op threads. The forward saves each query row's score maximum and the
// reciprocal of its exponentials' sum, so the backward recomputes the same probabilities.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "share_out.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Dims {
  int64_t batch, queries, keys, heads, kv_heads, head_dim, groups, padded_keys;
  float scale, mask_value;
};

// Keys are padded to a multiple of 16 (one vector, jrlhf::Lanes), and head dimensions that are
// multiples of 16 run in vectors.
using jrlhf::Lanes;
using jrlhf::Load;
using jrlhf::Store;

// out[s] = sum_i x[i] cols[i, s] for s in [0, padded keys): x (dim,) against (dim, padded keys)
// columns, each 16 keys' sum held in a register over i, four blocks of 16 at a time (so that the
// chains of dependent multiply-adds overlap).
template <int64_t kDim>
void RowTimesColumns(const Dims& d, const float* __restrict__ x, const float* __restrict__ cols,
                     float* __restrict__ out) {
  const int64_t dim = kDim ? kDim : d.head_dim, sp = d.padded_keys;
  int64_t s = 0;
  for (; s + 64 <= sp; s += 64) {
    Lanes a0{}, a1{}, a2{}, a3{};
    for (int64_t i = 0; i < dim; ++i) {
      const float* c = cols + i * sp + s;
      a0 += Load(c) * x[i], a1 += Load(c + 16) * x[i];
      a2 += Load(c + 32) * x[i], a3 += Load(c + 48) * x[i];
    }
    Store(out + s, a0), Store(out + s + 16, a1), Store(out + s + 32, a2), Store(out + s + 48, a3);
  }
  for (; s < sp; s += 16) {
    Lanes acc{};
    for (int64_t i = 0; i < dim; ++i) acc += Load(cols + i * sp + s) * x[i];
    Store(out + s, acc);
  }
}

// out[0, dim) = sum_s w[s] rows[s, 0, dim) over the first `d.keys` rows, in four interleaved
// partial sums (each a chain of dependent multiply-adds a quarter as long).
template <int64_t kDim>
void WeightedRowSum(const Dims& d, const float* __restrict__ w, const float* __restrict__ rows,
                    float* __restrict__ out) {
  const int64_t n = d.keys;
  if constexpr (kDim > 0 && kDim % 16 == 0) {
    constexpr int64_t kVecs = kDim / 16;
    Lanes acc[4][kVecs] = {};
    int64_t s = 0;
    for (; s + 4 <= n; s += 4)
      for (int part = 0; part < 4; ++part)
        for (int64_t j = 0; j < kVecs; ++j)
          acc[part][j] += Load(rows + (s + part) * kDim + 16 * j) * w[s + part];
    for (; s < n; ++s)
      for (int64_t j = 0; j < kVecs; ++j) acc[0][j] += Load(rows + s * kDim + 16 * j) * w[s];
    for (int64_t j = 0; j < kVecs; ++j)
      Store(out + 16 * j, (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]));
  } else {
    const int64_t dim = d.head_dim;
    for (int64_t i = 0; i < dim; ++i) out[i] = 0.0f;
    for (int64_t s = 0; s < n; ++s)
      for (int64_t i = 0; i < dim; ++i) out[i] += w[s] * rows[s * dim + i];
  }
}

// Sequence b's KV head g of a (B, S, KV, D) array as rows (S, D) and/or as columns (D, S
// padded with zeros); either may be null.
void LoadHead(const float* src, const Dims& d, int64_t b, int64_t g, float* rows, float* cols) {
  for (int64_t s = 0; s < d.keys; ++s) {
    const float* from = src + ((b * d.keys + s) * d.kv_heads + g) * d.head_dim;
    for (int64_t i = 0; i < d.head_dim; ++i) {
      if (rows) rows[s * d.head_dim + i] = from[i];
      if (cols) cols[i * d.padded_keys + s] = from[i];
    }
  }
  if (cols)
    for (int64_t i = 0; i < d.head_dim; ++i)
      for (int64_t s = d.keys; s < d.padded_keys; ++s) cols[i * d.padded_keys + s] = 0.0f;
}

// Scores of one query row over every key: scaled products, masked ones set to mask_value, the
// padding keys up to a multiple of 16 to -inf (their probabilities are then exactly 0, also in a
// row whose keys are all masked, so every loop after this runs over whole blocks of 16).
template <int64_t kDim>
void Scores(const Dims& d, const float* __restrict__ q, const float* __restrict__ k_cols,
            const bool* __restrict__ mask, float* __restrict__ out) {
  RowTimesColumns<kDim>(d, q, k_cols, out);
  for (int64_t s = 0; s < d.keys; ++s) out[s] = mask[s] ? out[s] * d.scale : d.mask_value;
  for (int64_t s = d.keys; s < d.padded_keys; ++s) out[s] = -INFINITY;
}

ffi::Error CheckDims(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                     ffi::Buffer<ffi::PRED>& mask, float mask_value, Dims* d) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 3)
    return ffi::Error::InvalidArgument("masked attention: q, k, v or mask of wrong rank");
  d->batch = qd[0], d->queries = qd[1], d->heads = qd[2], d->head_dim = qd[3];
  d->keys = kd[1], d->kv_heads = kd[2];
  for (int i = 0; i < 4; ++i)
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("masked attention: k and v differ");
  if (kd[0] != d->batch || kd[3] != d->head_dim || d->kv_heads < 1 || d->heads % d->kv_heads ||
      md[0] != d->batch || md[1] != d->queries || md[2] != d->keys)
    return ffi::Error::InvalidArgument("masked attention: shapes do not agree");
  d->groups = d->heads / d->kv_heads;
  d->padded_keys = (d->keys + 15) / 16 * 16;
  d->scale = 1.0f / std::sqrt(static_cast<float>(d->head_dim));
  d->mask_value = mask_value;
  return ffi::Error::Success();
}

// Row (b, t, h) of a (B, T, H, D) array, and its (b, h, t) entry in a (B, H, T) one.
inline int64_t RowOffset(const Dims& d, int64_t b, int64_t t, int64_t h) {
  return ((b * d.queries + t) * d.heads + h) * d.head_dim;
}
inline int64_t StatOffset(const Dims& d, int64_t b, int64_t t, int64_t h) {
  return (b * d.heads + h) * d.queries + t;
}

// Probabilities of one query row from its scores (padded keys included): exp(score - max) / sum,
// with the max and the reciprocal sum returned (the forward) or given (the backward: the same
// values again).
void Probabilities(const Dims& d, float* __restrict__ scores, float* row_max, float* inv_sum,
                   bool given) {
  const int64_t sp = d.padded_keys;
  float m = *row_max;
  if (!given) {
    Lanes top = Load(scores);
    for (int64_t s = 16; s < sp; s += 16) {
      const Lanes x = Load(scores + s);
      top = x > top ? x : top;
    }
    m = top[0];
    for (int j = 1; j < 16; ++j) m = top[j] > m ? top[j] : m;
  }
  Lanes total{};
  for (int64_t s = 0; s < sp; s += 16) {
    float* block = scores + s;
    for (int j = 0; j < 16; ++j) block[j] = jrlhf::ExpNonPositive(block[j] - m);
    total += Load(block);
  }
  float inv = *inv_sum;
  if (!given) {
    float sum = 0.0f;
    for (int j = 0; j < 16; ++j) sum += total[j];
    inv = 1.0f / sum;
  }
  for (int64_t s = 0; s < sp; s += 16) Store(scores + s, Load(scores + s) * inv);
  *row_max = m, *inv_sum = inv;
}

struct Arrays {
  const float *q, *k, *v, *row_max_in, *inv_sum_in, *d_out;
  const bool* mask;
  float *out, *row_max, *inv_sum, *d_q, *d_k, *d_v;
};

// One (sequence, KV head) of the forward. kDim: the head dimension when known at compile time
// (the common sizes, whose loops the compiler then unrolls), else 0.
template <int64_t kDim>
void ForwardItem(const Dims& d, const Arrays& a, int64_t item, std::vector<float>& scratch) {
  const int64_t b = item / d.kv_heads, g = item % d.kv_heads;
  const int64_t dim = kDim ? kDim : d.head_dim, sp = d.padded_keys;
  scratch.resize(2 * sp * dim + sp);
  float* __restrict__ k_cols = scratch.data();
  float* __restrict__ v_rows = k_cols + sp * dim;
  float* __restrict__ p = v_rows + sp * dim;
  LoadHead(a.k, d, b, g, nullptr, k_cols);
  LoadHead(a.v, d, b, g, v_rows, nullptr);
  for (int64_t h = g * d.groups; h < (g + 1) * d.groups; ++h)
    for (int64_t t = 0; t < d.queries; ++t) {
      const int64_t row = RowOffset(d, b, t, h), stat = StatOffset(d, b, t, h);
      Scores<kDim>(d, a.q + row, k_cols, a.mask + (b * d.queries + t) * d.keys, p);
      Probabilities(d, p, a.row_max + stat, a.inv_sum + stat, false);
      WeightedRowSum<kDim>(d, p, v_rows, a.out + row);
    }
}

// One (sequence, KV head) of the backward: dQ of its query heads' rows, then its dK and dV as
// products over those rows (dK = dS^T Q, dV = P^T dO) from their probabilities and score
// gradients kept for the whole item, so that no key's gradient row is read and written again
// for every query row.
template <int64_t kDim>
void BackwardItem(const Dims& d, const Arrays& a, int64_t item, std::vector<float>& scratch) {
  const int64_t b = item / d.kv_heads, g = item % d.kv_heads;
  const int64_t dim = kDim ? kDim : d.head_dim, sp = d.padded_keys;
  const int64_t rows = d.groups * d.queries;  // r = (head in the group, query)
  scratch.resize(3 * sp * dim + 2 * rows * sp + 2 * rows * dim + 2 * rows);
  float* __restrict__ k_rows = scratch.data();
  float* __restrict__ k_cols = k_rows + sp * dim;
  float* __restrict__ v_cols = k_cols + sp * dim;
  float* __restrict__ probs = v_cols + sp * dim;  // (rows, padded keys)
  float* __restrict__ d_scores = probs + rows * sp;  // (rows, padded keys)
  float* __restrict__ q_rows = d_scores + rows * sp;  // (rows, dim)
  float* __restrict__ do_rows = q_rows + rows * dim;
  LoadHead(a.k, d, b, g, k_rows, k_cols);
  LoadHead(a.v, d, b, g, nullptr, v_cols);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = g * d.groups + r / d.queries, t = r % d.queries;
    const int64_t row = RowOffset(d, b, t, h), stat = StatOffset(d, b, t, h);
    const bool* m = a.mask + (b * d.queries + t) * d.keys;
    float* __restrict__ p = probs + r * sp;
    float* __restrict__ dp = d_scores + r * sp;
    std::copy(a.q + row, a.q + row + dim, q_rows + r * dim);
    std::copy(a.d_out + row, a.d_out + row + dim, do_rows + r * dim);
    float row_m = a.row_max_in[stat], inv = a.inv_sum_in[stat];
    Scores<kDim>(d, q_rows + r * dim, k_cols, m, p);
    Probabilities(d, p, &row_m, &inv, true);
    // dP = dO . V over every key, then the softmax's backward: dS = P (dP - sum(P dP)),
    // zero where the mask replaced the score (its gradient does not reach q or k).
    RowTimesColumns<kDim>(d, do_rows + r * dim, v_cols, dp);
    Lanes products{};
    for (int64_t s = 0; s < sp; s += 16) products += Load(p + s) * Load(dp + s);
    float delta = 0.0f;
    for (int j = 0; j < 16; ++j) delta += products[j];
    for (int64_t s = 0; s < d.keys; ++s) dp[s] = m[s] ? p[s] * (dp[s] - delta) * d.scale : 0.0f;
    for (int64_t s = d.keys; s < sp; ++s) dp[s] = 0.0f;
    WeightedRowSum<kDim>(d, dp, k_rows, a.d_q + row);
  }
  // dK[s] = sum_r dS[r, s] Q[r] and dV[s] = sum_r P[r, s] dO[r]: the weights of key s are
  // column s of the (rows, keys) arrays, gathered into one contiguous row first.
  Dims over_rows = d;
  over_rows.keys = rows;
  float* __restrict__ column = do_rows + rows * dim;  // (2 rows,)
  for (int64_t s = 0; s < d.keys; ++s) {
    for (int64_t r = 0; r < rows; ++r) {
      column[r] = d_scores[r * sp + s];
      column[rows + r] = probs[r * sp + s];
    }
    const int64_t at = ((b * d.keys + s) * d.kv_heads + g) * dim;
    WeightedRowSum<kDim>(over_rows, column, q_rows, a.d_k + at);
    WeightedRowSum<kDim>(over_rows, column + rows, do_rows, a.d_v + at);
  }
}

template <template <int64_t> class Item>
void Dispatch(ffi::ThreadPool& pool, const Dims& d, const Arrays& a) {
  const int64_t items = d.batch * d.kv_heads;
  auto run = [&](auto dim) {
    jrlhf::ShareOut(pool, items, [&](int64_t i, std::vector<float>& scratch) {
      Item<decltype(dim)::value>::Run(d, a, i, scratch);
    });
  };
  switch (d.head_dim) {
    case 16: return run(std::integral_constant<int64_t, 16>{});
    case 32: return run(std::integral_constant<int64_t, 32>{});
    case 64: return run(std::integral_constant<int64_t, 64>{});
    case 128: return run(std::integral_constant<int64_t, 128>{});
    default: return run(std::integral_constant<int64_t, 0>{});
  }
}

template <int64_t kDim>
struct ForwardOf {
  static void Run(const Dims& d, const Arrays& a, int64_t i, std::vector<float>& scratch) {
    ForwardItem<kDim>(d, a, i, scratch);
  }
};
template <int64_t kDim>
struct BackwardOf {
  static void Run(const Dims& d, const Arrays& a, int64_t i, std::vector<float>& scratch) {
    BackwardItem<kDim>(d, a, i, scratch);
  }
};

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask,
                   ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> row_max,
                   ffi::Result<ffi::Buffer<ffi::F32>> row_inv_sum, float mask_value) {
  Dims d;
  if (auto err = CheckDims(q, k, v, mask, mask_value, &d); err.failure()) return err;
  if (d.batch * d.queries * d.heads == 0) return ffi::Error::Success();
  Arrays a{};
  a.q = q.typed_data(), a.k = k.typed_data(), a.v = v.typed_data(), a.mask = mask.typed_data();
  a.out = out->typed_data(), a.row_max = row_max->typed_data();
  a.inv_sum = row_inv_sum->typed_data();
  Dispatch<ForwardOf>(pool, d, a);
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask,
                    ffi::Buffer<ffi::F32> row_max, ffi::Buffer<ffi::F32> row_inv_sum,
                    ffi::Buffer<ffi::F32> d_out, ffi::Result<ffi::Buffer<ffi::F32>> d_q,
                    ffi::Result<ffi::Buffer<ffi::F32>> d_k, ffi::Result<ffi::Buffer<ffi::F32>> d_v,
                    float mask_value) {
  Dims d;
  if (auto err = CheckDims(q, k, v, mask, mask_value, &d); err.failure()) return err;
  Arrays a{};
  a.q = q.typed_data(), a.k = k.typed_data(), a.v = v.typed_data(), a.mask = mask.typed_data();
  a.row_max_in = row_max.typed_data(), a.inv_sum_in = row_inv_sum.typed_data();
  a.d_out = d_out.typed_data();
  a.d_q = d_q->typed_data(), a.d_k = d_k->typed_data(), a.d_v = d_v->typed_data();
  Dispatch<BackwardOf>(pool, d, a);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JrlhfMaskedAttentionForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("mask_value"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JrlhfMaskedAttentionBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("mask_value"));
