// A decode step's token choice from its logits on CPU, called from XLA:CPU through the XLA FFI
// (jrlhf/native/token_pick.py): for each row the first maximum of the logits (greedy) or of
// logits / temperature + Gumbel noise (sampling), and the chosen token's log-probs, under the
// raw logits and under the scaled ones.
//
// XLA:CPU runs the same as a handful of reductions over the (rows, vocab) logits: a max, an
// index select, a min, a logsumexp per distribution, each a pass over the logits and a program
// step of its own (0.4-0.5 ms of a ~9 ms step of bench decode's model, 16 rows of 8192). Here a
// row is read once for its maximum and once more from cache for each exp-sum, and rows are
// shared out over the intra-op threads.
//
// Semantics are those of jrlhf/decode/sampling.py: the first index of the maximum, a NaN
// counting as the maximum (so the first NaN wins); the log-prob of a token is its logit less
// the row's logsumexp, which is computed about the row's maximum (0 where that is not finite,
// as jax.nn.logsumexp does).

#include <cmath>
#include <cstdint>
#include <vector>

#include "share_out.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Pick {
  int64_t index;
  float value;
};

// The first index of the maximum of f(i) over [0, n), a NaN counting as the maximum: 16 lanes
// each keep their own first maximum, then the lanes with the largest value give their least
// index. f is inlined, so a row's transform (x / t + g) costs no second pass.
template <typename F>
Pick FirstMax(int64_t n, F f) {
  float best[16];
  int32_t at[16];
  int32_t nan[16];
  for (int j = 0; j < 16; ++j) best[j] = -INFINITY, at[j] = j, nan[j] = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) {
      const float v = f(i + j);
      const bool up = v > best[j];
      best[j] = up ? v : best[j];
      at[j] = up ? static_cast<int32_t>(i + j) : at[j];
      nan[j] |= v != v;
    }
  }
  bool any_nan = false;
  for (int j = 0; j < 16; ++j) any_nan |= nan[j] != 0;
  Pick pick{n > 0 ? 0 : -1, -INFINITY};
  if (i > 0) {  // the lanes' results, ties to the least index
    pick = {at[0], best[0]};
    for (int j = 1; j < 16; ++j)
      if (best[j] > pick.value || (best[j] == pick.value && at[j] < pick.index))
        pick = {at[j], best[j]};
  }
  for (; i < n; ++i) {  // the tail past the last 16, after every lane's index
    const float v = f(i);
    any_nan |= v != v;
    if (v > pick.value) pick = {i, v};
  }
  if (any_nan)
    for (int64_t k = 0; k < n; ++k)
      if (f(k) != f(k)) return {k, NAN};
  return pick;
}

// log(sum(exp(f(i)))) over [0, n) about `top`, the maximum of f (NaN when f has a NaN).
template <typename F>
float LogSumExp(int64_t n, float top, F f) {
  if (std::isnan(top)) return NAN;
  const float shift = std::isfinite(top) ? top : 0.0f;
  float part[16] = {0};
  int64_t i = 0;
  if (std::isfinite(top)) {  // every f(i) - top <= 0
    for (; i + 16 <= n; i += 16)
      for (int j = 0; j < 16; ++j) part[j] += jrlhf::ExpNonPositive(f(i + j) - shift);
    for (int j = 0; i < n; ++i, ++j) part[j] += jrlhf::ExpNonPositive(f(i) - shift);
  } else {  // all -inf (a sum of 0) or an infinite maximum: rare, so plain exp
    for (int j = 0; i < n; ++i, j = (j + 1) % 16) part[j] += std::exp(f(i) - shift);
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) part[j] += part[j + w];
  return std::log(part[0]) + shift;
}

ffi::Error TokenPick(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                     ffi::Buffer<ffi::F32> noise, ffi::Buffer<ffi::F32> temperature,
                     ffi::Result<ffi::Buffer<ffi::S32>> tokens,
                     ffi::Result<ffi::Buffer<ffi::F32>> sampling_lp,
                     ffi::Result<ffi::Buffer<ffi::F32>> raw_lp) {
  auto ld = logits.dimensions(), nd = noise.dimensions();
  if (ld.size() != 2 || nd.size() != 2)
    return ffi::Error::InvalidArgument("token pick: logits and noise of rank 2");
  const int64_t rows = ld[0], vocab = ld[1];
  const bool greedy = nd[0] == 0;  // no noise: the argmax of the logits
  if (!greedy && (nd[0] != rows || nd[1] != vocab))
    return ffi::Error::InvalidArgument("token pick: noise and logits of different shapes");
  if (temperature.element_count() != 1)
    return ffi::Error::InvalidArgument("token pick: one temperature");
  if (tokens->element_count() != rows || sampling_lp->element_count() != rows ||
      raw_lp->element_count() != rows)
    return ffi::Error::InvalidArgument("token pick: one output per row");
  if (vocab < 1) return ffi::Error::InvalidArgument("token pick: an empty vocabulary");
  const float* x_all = logits.typed_data();
  const float* g_all = noise.typed_data();
  const float t = temperature.typed_data()[0];
  int32_t* tok = tokens->typed_data();
  float* slp = sampling_lp->typed_data();
  float* rlp = raw_lp->typed_data();
  jrlhf::ShareOut(pool, rows, [&](int64_t r, std::vector<float>&) {
    const float* x = x_all + r * vocab;
    auto raw = [x](int64_t i) { return x[i]; };
    if (greedy) {
      const Pick p = FirstMax(vocab, raw);
      tok[r] = static_cast<int32_t>(p.index);
      slp[r] = 0.0f;  // the point mass greedy samples from
      rlp[r] = x[p.index] - LogSumExp(vocab, p.value, raw);
      return;
    }
    const float* g = g_all + r * vocab;
    // x / t, not x * (1 / t): the same floats as the XLA program's division
    auto scaled = [x, t](int64_t i) { return x[i] / t; };
    const Pick p = FirstMax(vocab, [x, g, t](int64_t i) { return x[i] / t + g[i]; });
    const int64_t k = p.index;
    tok[r] = static_cast<int32_t>(k);
    const Pick top_raw = FirstMax(vocab, raw);
    rlp[r] = x[k] - LogSumExp(vocab, top_raw.value, raw);
    if (t == 1.0f) {
      slp[r] = rlp[r];
    } else {
      const Pick top_scaled = FirstMax(vocab, scaled);
      slp[r] = x[k] / t - LogSumExp(vocab, top_scaled.value, scaled);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JrlhfTokenPick, TokenPick,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
