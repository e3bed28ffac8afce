// Paged decode attention for XLA:CPU, called through the XLA FFI (jrlhf/native/paged_attention.py
// has jrlhf/native/build.py compile this file on first use and registers the handler).
//
// Why a compiled kernel on CPU: written in JAX, one decode step's attention is a while loop of page
// gathers (copies of every page read, transposed for the contractions) and small batched products,
// which XLA:CPU runs as many short ops; together they took about 40% of a decode call of the bench
// model (docs/performance.md). Here each sequence reads its own pages in place, once for the
// scores and once for the values, with no copies: the work is the K/V bytes read.
//
// Semantics are those of paged_attention_reference (jrlhf/decode/kernels/reference.py): one query
// token per sequence at position lengths[b] - 1, keys at positions [0, lengths[b]) (the last
// `sliding_window` of them when it is > 0), scores soft-capped (softcap * tanh(score / softcap), when
// `softcap` > 0: Gemma 2), page ids clipped into the pool, float32 arithmetic, and
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

using jrlhf::Lanes;
using jrlhf::Load;
using jrlhf::Store;

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

// Rows [pos, pos + n) of sequence-relative pool positions, as float32: the pool's own rows for a
// float32 pool (a block never crosses a page, so its rows are contiguous there), else converted
// into `buffer`.
inline const float* Rows(const void* base, bool bf16, int64_t offset, int64_t count,
                         float* buffer) {
  if (!bf16) return static_cast<const float*>(base) + offset;
  const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
  for (int64_t i = 0; i < count; ++i) buffer[i] = Bf16ToFloat(src[i]);
  return buffer;
}

// Asks for `bytes` from `at` to be brought into L2 ahead of use. The pool's pages are scattered,
// so the hardware's prefetchers, which follow one address stream, see each page start as a miss;
// a decode step's K/V (tens of MB) comes from memory, not cache, so those misses were most of
// the kernel's time (20.3 GB/s of K/V with the pool in cache, 11.8 after 256 MiB read between
// calls, as a decode step's weights are).
inline void Prefetch(const void* at, int64_t bytes) {
  const char* c = static_cast<const char*>(at);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

// Part `part` of `parts` of Prefetch(at, bytes), whole cache lines: issued a part at a time
// between pieces of work, the requests keep the memory busy without stalling one piece.
inline void PrefetchPart(const void* at, int64_t bytes, int64_t part, int64_t parts) {
  const int64_t lines = (bytes + 63) / 64;
  const int64_t from = lines * part / parts, to = lines * (part + 1) / parts;
  Prefetch(static_cast<const char*>(at) + 64 * from, 64 * (to - from));
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
  float softcap;  // 0: none
};

constexpr int64_t kBlock = 16;  // positions a block of scores is computed for (one vector)

// Sequence b's keys: positions [start, end) (the window counts back from the query, lengths[b] - 1,
// even where the table holds fewer positions than that, as in the reference), with the pool
// offset of each position's row (all KV heads of one position are contiguous in a page).
struct Span {
  int64_t start, end;
  const int32_t* pages;
  const Problem* p;
  Span(const Problem& problem, int64_t b) : p(&problem) {
    const int64_t length = problem.lengths[b];
    end = std::min<int64_t>(length, problem.max_pages * problem.page_size);
    start = problem.window > 0 ? std::max<int64_t>(0, length - problem.window) : 0;
    end = std::max(end, start);
    pages = problem.table + b * problem.max_pages;
  }
  // The end of the block starting at `pos`: at most kBlock positions, within one page.
  int64_t BlockEnd(int64_t pos) const {
    return std::min({end, pos + kBlock, (pos / p->page_size + 1) * p->page_size});
  }
  // The element offset of (layer, page of pos, slot of pos, 0, 0) in a pool.
  int64_t Offset(int64_t pos) const {
    const int64_t page = std::clamp<int64_t>(pages[pos / p->page_size], 0, p->pages - 1);
    return ((p->layer * p->pages + page) * p->page_size + pos % p->page_size) * p->kv_heads *
           p->head_dim;
  }
};

// Attention of every query head of sequence `b` over its keys, read in place, in blocks of up to
// 16 positions within a page. Scores: for each head, 16 vector partial products (one per
// position, over the head dimension) summed across lanes at once (SumEach16), instead of one
// horizontal sum per position and head. Values: a head's output accumulates in registers over a
// block's positions. While a block's scores are computed, the next block's keys and this block's
// values are prefetched (a part before each head); while the values are summed, the first keys
// of `next` (the sequence this thread takes next, or -1). kFixed: the head dimension when known
// at compile time (the common sizes, whose loops the compiler then unrolls), else 0.
template <int64_t kFixed>
void AttendOne(const Problem& p, int64_t b, int64_t next, std::vector<float>& scratch) {
  const int64_t d = kFixed ? kFixed : p.head_dim, h = p.heads, groups = p.heads / p.kv_heads;
  const int64_t vecs = d / 16, row_len = p.kv_heads * d;
  const int64_t elem = p.pool_bf16 ? 2 : 4, row_bytes = row_len * elem;
  const Span span(p, b);
  const int64_t count = span.end - span.start;
  scratch.resize(2 * h * d + kBlock * row_len + h * std::max<int64_t>(count, 1) + h);
  float* q = scratch.data();  // (heads, d), scaled
  float* acc = q + h * d;  // (heads, d)
  float* buffer = acc + h * d;  // (kBlock, kv_heads * d): a bfloat16 block converted
  float* scores = buffer + kBlock * row_len;  // (heads, count)
  float* total = scores + h * std::max<int64_t>(count, 1);  // (heads,)
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t q_row = b * h * d;
  if (p.q_bf16)
    Rows(p.q, true, q_row, h * d, q);
  else
    std::memcpy(q, static_cast<const float*>(p.q) + q_row, h * d * sizeof(float));
  for (int64_t i = 0; i < h * d; ++i) q[i] *= scale;
  std::fill(acc, acc + h * d, 0.0f);
  const char* k_bytes = static_cast<const char*>(p.k_pool);
  const char* v_bytes = static_cast<const char*>(p.v_pool);

  for (int64_t pos = span.start; pos < span.end;) {
    const int64_t stop = span.BlockEnd(pos), n = stop - pos, off = span.Offset(pos);
    const char* next_k = k_bytes + (stop < span.end ? span.Offset(stop) * elem : 0);
    const int64_t next_k_bytes = stop < span.end ? (span.BlockEnd(stop) - stop) * row_bytes : 0;
    const float* k = Rows(p.k_pool, p.pool_bf16, off, n * row_len, buffer);
    for (int64_t head = 0; head < h; ++head) {
      // The next block's keys and this block's values, an h-th before each head's scores
      PrefetchPart(next_k, next_k_bytes, head, h);
      PrefetchPart(v_bytes + off * elem, n * row_bytes, head, h);
      const float* qh = q + head * d;
      const float* kh = k + head / groups * d;
      Lanes part[kBlock];
      for (int64_t j = 0; j < kBlock; ++j) {
        Lanes a{};
        if (j < n) {
          const float* kr = kh + j * row_len;
          for (int64_t c = 0; c < vecs; ++c) a += Load(qh + 16 * c) * Load(kr + 16 * c);
          float tail = 0.0f;
          for (int64_t i = 16 * vecs; i < d; ++i) tail += qh[i] * kr[i];
          a[0] += tail;
        }
        part[jrlhf::kSumSlot[j]] = a;
      }
      const Lanes s = jrlhf::SumEach16(part);
      std::memcpy(scores + head * count + (pos - span.start), &s, n * sizeof(float));
    }
    pos = stop;
  }
  for (int64_t head = 0; head < h; ++head) {
    float* row = scores + head * count;
    if (p.softcap > 0.0f)
      for (int64_t s = 0; s < count; ++s) row[s] = p.softcap * std::tanh(row[s] / p.softcap);
    const float m = jrlhf::MaxOf(row, count);
    for (int64_t s = 0; s < count; ++s) row[s] = jrlhf::ExpNonPositive(row[s] - m);
    total[head] = jrlhf::SumOf(row, count);
  }
  const Span after = next >= 0 ? Span(p, next) : Span(p, b);
  int64_t ahead = next >= 0 ? after.start : after.end;  // the next sequence's keys to prefetch
  for (int64_t pos = span.start; pos < span.end;) {
    const int64_t stop = span.BlockEnd(pos), n = stop - pos;
    if (ahead < after.end && pos - span.start < 2 * kBlock) {
      const int64_t ahead_stop = after.BlockEnd(ahead);
      Prefetch(k_bytes + after.Offset(ahead) * elem, (ahead_stop - ahead) * row_bytes);
      ahead = ahead_stop;
    }
    const float* v = Rows(p.v_pool, p.pool_bf16, span.Offset(pos), n * row_len, buffer);
    const int64_t rel = pos - span.start;
    for (int64_t head = 0; head < h; ++head) {
      const float* w = scores + head * count + rel;
      const float* vh = v + head / groups * d;
      float* a = acc + head * d;
      if constexpr (kFixed > 0 && kFixed % 16 == 0 && kFixed <= 256) {
        constexpr int64_t kVecs = kFixed / 16;
        Lanes sum[kVecs];
        for (int64_t c = 0; c < kVecs; ++c) sum[c] = Load(a + 16 * c);
        for (int64_t j = 0; j < n; ++j)
          for (int64_t c = 0; c < kVecs; ++c) sum[c] += Load(vh + j * row_len + 16 * c) * w[j];
        for (int64_t c = 0; c < kVecs; ++c) Store(a + 16 * c, sum[c]);
      } else {
        for (int64_t j = 0; j < n; ++j)
          for (int64_t i = 0; i < d; ++i) a[i] += w[j] * vh[j * row_len + i];
      }
    }
    pos = stop;
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

void Attend(const Problem& p, int64_t b, int64_t next, std::vector<float>& scratch) {
  switch (p.head_dim) {
    case 16: return AttendOne<16>(p, b, next, scratch);
    case 32: return AttendOne<32>(p, b, next, scratch);
    case 64: return AttendOne<64>(p, b, next, scratch);
    case 96: return AttendOne<96>(p, b, next, scratch);
    case 128: return AttendOne<128>(p, b, next, scratch);
    case 256: return AttendOne<256>(p, b, next, scratch);
    default: return AttendOne<0>(p, b, next, scratch);
  }
}

bool IsBf16(ffi::DataType t) { return t == ffi::DataType::BF16; }
bool Supported(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pool,
                          ffi::AnyBuffer v_pool, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
                          ffi::Result<ffi::AnyBuffer> out, int64_t sliding_window,
                          float softcap) {
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
  p.softcap = softcap;
  // A negative layer counts from the end, as array indexing does; others clip into the pool.
  const int64_t index = layer.typed_data()[0];
  p.layer = std::clamp<int64_t>(index < 0 ? index + kd[0] : index, 0, kd[0] - 1);

  // The threads take runs of consecutive sequences, so that each knows which one it attends
  // over next and can prefetch its keys; four runs a thread, so that one that starts late
  // leaves the others less to wait for (over 8 layers at context ~128: 1.69 against 1.82-1.84 ms
  // with one or two runs a thread, all with the prefetches spread over the heads).
  const int64_t runs = std::min<int64_t>(p.batch, 4 * std::max<int64_t>(1, pool.num_threads()));
  jrlhf::ShareOut(pool, runs, [&p, runs](int64_t run, std::vector<float>& scratch) {
    const int64_t first = p.batch * run / runs, last = p.batch * (run + 1) / runs;
    for (int64_t b = first; b < last; ++b) Attend(p, b, b + 1 < last ? b + 1 : -1, scratch);
  });
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
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("softcap"));
