// Paged decode attention for XLA:CPU, called through the XLA FFI (jrlhf/decode/kernels/native_cpu.py
// has jrlhf/native/build.py compile this file on first use and registers the handler).
//
// Why a compiled kernel on CPU: written in JAX, one decode step's attention is a while loop of page
// gathers (copies of every page read, transposed for the contractions) and small batched products,
// which XLA:CPU runs as many short ops; together they took about 40% of a decode call of the bench
// model (BUILD.md, "Benchmarks"). Here each sequence reads its own pages in place, once for the
// scores and once for the values, with no copies: the work is the K/V bytes read.
//
// Semantics are those of paged_attention_reference (jrlhf/decode/kernels/reference.py): one query
// token per sequence at position lengths[b] - 1, keys at positions [0, lengths[b]) (the last
// `sliding_window` of them when it is > 0), page ids clipped into the pool, float32 arithmetic, and
// zeros for a sequence with no key to attend to (an idle slot, of length 0), where the pure-JAX
// kernels average masked keys.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "share_out.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float Bf16ToFloat(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline uint16_t FloatToBf16(float value) {  // round to nearest even, as XLA converts
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// A row of `n` pool or query elements as float32: the row itself for float32 arrays (no copy),
// else converted into `buffer`.
inline const float* Row(const void* base, bool bf16, int64_t offset, int64_t n, float* buffer) {
  if (!bf16) return static_cast<const float*>(base) + offset;
  const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
  for (int64_t i = 0; i < n; ++i) buffer[i] = Bf16ToFloat(src[i]);
  return buffer;
}

// q . k over `n` elements in sixteen independent partial sums (which the compiler vectorizes
// without reordering any one of them), added up as a tree: a serial sum of the sixteen would be a
// chain of dependent additions longer than the products themselves.
template <int64_t kFixed>
inline float Dot(const float* a, const float* b, int64_t n_runtime) {
  const int64_t n = kFixed ? kFixed : n_runtime;
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  for (int j = 0; i < n; ++i, ++j) acc[j] += a[i] * b[i];
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

struct Problem {
  const void* q;  // (batch, heads, head_dim)
  const void* k_pool;  // (layers, pages, page_size, kv_heads, head_dim)
  const void* v_pool;
  const int32_t* table;  // (batch, max_pages)
  const int32_t* lengths;  // (batch,)
  void* out;  // (batch, heads, head_dim), q's dtype
  bool q_bf16, pool_bf16;
  int64_t batch, heads, head_dim, pages, page_size, kv_heads, max_pages, window;
  int64_t layer;
};

// Attention of every query head of sequence `b` over its pages, read in place in position order
// (a page's positions and KV heads are contiguous in the pool). kFixed: the head dimension when
// known at compile time (the common sizes, whose loops the compiler then unrolls: at head_dim
// 32, the `bench rl` model's, a layer's attention over 32 sequences at context 45 took 94 us
// against 112 us through the runtime-sized loops), else 0.
template <int64_t kFixed>
void AttendOne(const Problem& p, int64_t b, std::vector<float>& scratch) {
  const int64_t d = kFixed ? kFixed : p.head_dim, h = p.heads, groups = p.heads / p.kv_heads;
  const int64_t row_len = p.kv_heads * d;  // one position's K (or V) for every KV head
  // Keys at positions [start, end): the window counts back from the query (lengths[b] - 1) even
  // where the table holds fewer positions than that, as in the reference.
  const int64_t length = p.lengths[b];
  const int64_t end = std::min<int64_t>(length, p.max_pages * p.page_size);
  const int64_t start = p.window > 0 ? std::max<int64_t>(0, length - p.window) : 0;
  const int64_t count = std::max<int64_t>(0, end - start);
  scratch.resize(2 * h * d + row_len + h * std::max<int64_t>(count, 1) + h);
  float* q = scratch.data();  // (heads, d), scaled
  float* acc = q + h * d;  // (heads, d)
  float* buffer = acc + h * d;  // (kv_heads * d,): a bfloat16 row converted
  float* scores = buffer + row_len;  // (heads, count)
  float* total = scores + h * std::max<int64_t>(count, 1);  // (heads,)
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t q_row = b * h * d;
  if (p.q_bf16)
    Row(p.q, true, q_row, h * d, q);
  else
    std::memcpy(q, static_cast<const float*>(p.q) + q_row, h * d * sizeof(float));
  for (int64_t i = 0; i < h * d; ++i) q[i] *= scale;
  std::fill(acc, acc + h * d, 0.0f);

  // Offset of (layer, page, slot in page, 0, 0) in a pool.
  const int32_t* pages = p.table + b * p.max_pages;
  auto offset = [&](int64_t pos) {
    const int64_t page = std::clamp<int64_t>(pages[pos / p.page_size], 0, p.pages - 1);
    return ((p.layer * p.pages + page) * p.page_size + pos % p.page_size) * row_len;
  };

  for (int64_t s = 0; s < count; ++s) {
    const float* k = Row(p.k_pool, p.pool_bf16, offset(start + s), row_len, buffer);
    for (int64_t head = 0; head < h; ++head)
      scores[head * count + s] = Dot<kFixed>(q + head * d, k + head / groups * d, d);
  }
  for (int64_t head = 0; head < h; ++head) {
    float* row = scores + head * count;
    const float m = jrlhf::MaxOf(row, count);
    for (int64_t s = 0; s < count; ++s) row[s] = jrlhf::ExpNonPositive(row[s] - m);
    total[head] = jrlhf::SumOf(row, count);
  }
  for (int64_t s = 0; s < count; ++s) {
    const float* v = Row(p.v_pool, p.pool_bf16, offset(start + s), row_len, buffer);
    for (int64_t head = 0; head < h; ++head) {
      const float w = scores[head * count + s];
      const float* vh = v + head / groups * d;
      float* a = acc + head * d;
      for (int64_t i = 0; i < d; ++i) a[i] += w * vh[i];
    }
  }
  for (int64_t head = 0; head < h; ++head) {
    const float inv = count > 0 ? 1.0f / total[head] : 0.0f;
    const int64_t out_row = q_row + head * d;
    for (int64_t i = 0; i < d; ++i) {
      const float value = acc[head * d + i] * inv;
      if (p.q_bf16)
        static_cast<uint16_t*>(p.out)[out_row + i] = FloatToBf16(value);
      else
        static_cast<float*>(p.out)[out_row + i] = value;
    }
  }
}

void Attend(const Problem& p, int64_t b, std::vector<float>& scratch) {
  switch (p.head_dim) {
    case 16: return AttendOne<16>(p, b, scratch);
    case 32: return AttendOne<32>(p, b, scratch);
    case 64: return AttendOne<64>(p, b, scratch);
    case 96: return AttendOne<96>(p, b, scratch);
    case 128: return AttendOne<128>(p, b, scratch);
    case 256: return AttendOne<256>(p, b, scratch);
    default: return AttendOne<0>(p, b, scratch);
  }
}

bool IsBf16(ffi::DataType t) { return t == ffi::DataType::BF16; }
bool Supported(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pool,
                          ffi::AnyBuffer v_pool, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
                          ffi::Result<ffi::AnyBuffer> out, int64_t sliding_window) {
  auto qd = q.dimensions(), kd = k_pool.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || lengths.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("paged attention: q, pools, table or lengths of wrong rank");
  if (!Supported(q.element_type()) || !Supported(k_pool.element_type()) ||
      k_pool.element_type() != v_pool.element_type() || out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("paged attention: float32 or bfloat16 arrays only");
  Problem p;
  p.batch = qd[0], p.heads = qd[1], p.head_dim = qd[2];
  p.pages = kd[1], p.page_size = kd[2], p.kv_heads = kd[3];
  p.max_pages = td[1];
  auto vd = v_pool.dimensions();
  bool same_pools = vd.size() == kd.size();
  for (size_t i = 0; same_pools && i < kd.size(); ++i) same_pools = vd[i] == kd[i];
  if (!same_pools || kd[4] != p.head_dim || td[0] != p.batch ||
      lengths.dimensions()[0] != p.batch || p.kv_heads < 1 || p.heads % p.kv_heads ||
      kd[0] < 1 || p.pages < 1 || p.page_size < 1)
    return ffi::Error::InvalidArgument("paged attention: shapes do not agree");
  p.q = q.untyped_data(), p.k_pool = k_pool.untyped_data(), p.v_pool = v_pool.untyped_data();
  p.table = table.typed_data(), p.lengths = lengths.typed_data();
  p.out = out->untyped_data();
  p.q_bf16 = IsBf16(q.element_type()), p.pool_bf16 = IsBf16(k_pool.element_type());
  p.window = sliding_window;
  // A negative layer counts from the end, as array indexing does; others clip into the pool.
  const int64_t index = layer.typed_data()[0];
  p.layer = std::clamp<int64_t>(index < 0 ? index + kd[0] : index, 0, kd[0] - 1);

  jrlhf::ShareOut(pool, p.batch,
                  [&p](int64_t b, std::vector<float>& scratch) { Attend(p, b, scratch); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JrlhfPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("sliding_window"));
