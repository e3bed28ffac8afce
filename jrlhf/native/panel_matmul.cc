// Few-row matmul over packed weight panels for XLA:CPU, called through the XLA FFI
// (jrlhf/native/matmul.py builds this file on first use and registers the handler).
//
// out[m, n] = sum_k x[m, k] * w[k, n] for a few token rows x (a decode step's: tens of rows)
// and a weight stored as panels of 16 output columns: panels[p, k, j] = w[k, 16 p + j].
//
// Why: XLA:CPU's dots reach a third of this machine's matmul rate at a decode step's few rows
// (they pack the weight for every call, or stream it output-major at 9-13 GB/s:
// docs/performance.md), and the weights are what a decode step reads. Here each panel is one
// contiguous run of memory, read once, front to back: for each k its 16 columns are one vector,
// multiplied by 8 rows' x[m, k] at a time into 8 x 3 vector accumulators (3 panels at once, so
// the multiply-adds outnumber the loads), and the panels are shared out over XLA's intra-op
// threads. Each output is a sum over k in order, in float32.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "share_out.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;  // a panel's columns: one AVX-512 vector of float32
#if defined(__AVX512F__)
// 24 accumulators and 3 weight vectors of the 32 vector registers.
constexpr int64_t kPanelsPerBlock = 3;
constexpr int kRowBlock = 8;
#else
// Narrower registers hold a panel's 16 columns in two or four: fewer accumulators fit.
constexpr int64_t kPanelsPerBlock = 1;
constexpr int kRowBlock = 4;
#endif

// A vector of the panel's columns (the compiler lowers it to the widest registers it has).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes Load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// How far a block's k-steps are walked at a time by all its row passes (see AllRows), and how
// many k-steps ahead of the first pass each panel's stream is prefetched.
constexpr int64_t kChunk = 64;
constexpr int64_t kAhead = 32;

// Rows [0, R) of x (row stride k) times P consecutive panels over k-steps [i0, i1), added to
// the sums in out (row stride n) at columns [n0, n0 + 16 P), or written there if `fresh`. If
// `prefetch` (a chunk's first pass), each panel's line kAhead k-steps on is prefetched, which
// past the block's last k-step is the corresponding line of the `ahead_panels` panels at
// `ahead` (the run's next block; none if it is null).
template <int R, int P>
void Block(const float* x, int64_t k, const float* panels, float* out, int64_t n, int64_t n0,
           int64_t i0, int64_t i1, bool fresh, bool prefetch, const float* ahead,
           int64_t ahead_panels) {
  const int64_t panel_stride = k * kLanes;
  Lanes acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      if (fresh)
        acc[r][p] = Lanes{};
      else
        acc[r][p] = Load(out + r * n + n0 + p * kLanes);
  for (int64_t i = i0; i < i1; ++i) {
    Lanes w[P];
    for (int p = 0; p < P; ++p) w[p] = Load(panels + p * panel_stride + i * kLanes);
    if (prefetch) {  // one k-step of a panel is one cache line
      if (i + kAhead < k) {
        for (int p = 0; p < P; ++p)
          __builtin_prefetch(panels + p * panel_stride + (i + kAhead) * kLanes, 0, 0);
      } else if (ahead != nullptr) {
        for (int64_t p = 0; p < ahead_panels; ++p)
          __builtin_prefetch(ahead + p * panel_stride + (i + kAhead - k) * kLanes, 0, 0);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float s = x[r * k + i];
      for (int p = 0; p < P; ++p) acc[r][p] += w[p] * s;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      std::memcpy(out + r * n + n0 + p * kLanes, &acc[r][p], sizeof(Lanes));
}

// All rows times P panels. The k-steps are walked kChunk at a time, each chunk by every pass of
// kRowBlock rows in turn, the running sums kept in `out` between chunks: the first pass reads
// the chunk's lines from memory (prefetched kAhead k-steps before) and the others from L1, so
// the weights stream at one steady rate instead of in bursts a pass apart, with more of them in
// flight (on a 2-core AMD EPYC, bench decode's steps 1.17x faster, paired over 8 alternations;
// BUILD.md's journal, stop 56, in git history). Each output is still one sum over k in order.
template <int P>
void AllRows(int64_t rows, const float* x, int64_t k, const float* panels, float* out, int64_t n,
             int64_t n0, const float* ahead, int64_t ahead_panels) {
  for (int64_t i0 = 0; i0 < k; i0 += kChunk) {
    const int64_t i1 = std::min(k, i0 + kChunk);
    const bool fresh = i0 == 0;
    int64_t r = 0;
    for (; r + kRowBlock <= rows; r += kRowBlock)
      Block<kRowBlock, P>(x + r * k, k, panels, out + r * n, n, n0, i0, i1, fresh, r == 0, ahead,
                          ahead_panels);
    const float* xr = x + r * k;
    float* o = out + r * n;
    const bool pf = r == 0;
    switch (rows - r) {
      case 1: Block<1, P>(xr, k, panels, o, n, n0, i0, i1, fresh, pf, ahead, ahead_panels); break;
      case 2: Block<2, P>(xr, k, panels, o, n, n0, i0, i1, fresh, pf, ahead, ahead_panels); break;
      case 3: Block<3, P>(xr, k, panels, o, n, n0, i0, i1, fresh, pf, ahead, ahead_panels); break;
      case 4: Block<4, P>(xr, k, panels, o, n, n0, i0, i1, fresh, pf, ahead, ahead_panels); break;
      case 5: Block<5, P>(xr, k, panels, o, n, n0, i0, i1, fresh, pf, ahead, ahead_panels); break;
      case 6: Block<6, P>(xr, k, panels, o, n, n0, i0, i1, fresh, pf, ahead, ahead_panels); break;
      case 7: Block<7, P>(xr, k, panels, o, n, n0, i0, i1, fresh, pf, ahead, ahead_panels); break;
      default: break;
    }
  }
}

// One weight of a call: its panels, its output (rows, 16 * num_panels) and its blocks of
// kPanelsPerBlock panels (the last one may have fewer).
struct Weight {
  const float* panels;
  float* out;
  int64_t num_panels, blocks;
  const float* Block(int64_t block, int64_t k) const {
    return panels + block * kPanelsPerBlock * k * kLanes;
  }
  int64_t Count(int64_t block) const {
    return std::min(kPanelsPerBlock, num_panels - block * kPanelsPerBlock);
  }
};

// Block `block` of weight `w`, with `ahead_panels` panels at `ahead` prefetched meanwhile.
void PanelBlock(const float* x, int64_t rows, int64_t k, const Weight& w, int64_t block,
                const float* ahead, int64_t ahead_panels) {
  const float* first = w.Block(block, k);
  const int64_t n = w.num_panels * kLanes, n0 = block * kPanelsPerBlock * kLanes;
  const int64_t count = w.Count(block);
  if (count == 3)
    AllRows<3>(rows, x, k, first, w.out, n, n0, ahead, ahead_panels);
  else if (count == 2)
    AllRows<2>(rows, x, k, first, w.out, n, n0, ahead, ahead_panels);
  else
    AllRows<1>(rows, x, k, first, w.out, n, n0, ahead, ahead_panels);
}

// x times each weight of the call (the projections that read the same rows, such as a layer's
// query, key and value, in one call: a call's hand-off to the pool's threads costs ~6 us, as
// much as a small product's multiply-adds, and more blocks balance better between threads).
ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs panels,
                       ffi::RemainingRets outs) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("panel matmul: x of wrong rank");
  if (panels.size() == 0 || panels.size() != outs.size())
    return ffi::Error::InvalidArgument("panel matmul: one output for each weight");
  const int64_t rows = xd[0], k = xd[1];
  std::vector<Weight> weights;
  int64_t blocks = 0;
  for (size_t i = 0; i < panels.size(); ++i) {
    auto w = panels.get<ffi::Buffer<ffi::F32>>(i);
    auto o = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !o.has_value())
      return ffi::Error::InvalidArgument("panel matmul: float32 weights and outputs only");
    auto pd = w->dimensions(), od = (*o)->dimensions();
    if (pd.size() != 3 || od.size() != 2)
      return ffi::Error::InvalidArgument("panel matmul: panels or out of wrong rank");
    if (pd[2] != kLanes || pd[1] != k || od[0] != rows || od[1] != pd[0] * kLanes)
      return ffi::Error::InvalidArgument("panel matmul: shapes do not agree");
    const int64_t weight_blocks = (pd[0] + kPanelsPerBlock - 1) / kPanelsPerBlock;
    if (weight_blocks > 0)  // (a weight of no columns has no output to write)
      weights.push_back({w->typed_data(), (*o)->typed_data(), pd[0], weight_blocks});
    blocks += weight_blocks;
    if (k == 0) std::fill((*o)->typed_data(), (*o)->typed_data() + rows * od[1], 0.0f);
  }
  if (rows == 0 || blocks == 0 || k == 0) return ffi::Error::Success();
  // Each thread (the calling one and the pool's) takes one contiguous run of the call's blocks
  // (weight after weight), so that while it multiplies a block it can prefetch the next: the
  // hardware's prefetchers alone left the weights' stream waiting on memory between the
  // multiply-adds (16 x 512 x 1408 with the weights streamed: 147 us against 178 us without).
  const int64_t runs = std::min<int64_t>(blocks, std::max<int64_t>(1, pool.num_threads()));
  jrlhf::ShareOut(pool, runs, [&](int64_t run, std::vector<float>&) {
    const int64_t first = blocks * run / runs, last = blocks * (run + 1) / runs;
    size_t i = 0;  // block `first` of the call is block b of weights[i]
    int64_t b = first;
    while (b >= weights[i].blocks) b -= weights[i++].blocks;
    for (int64_t g = first; g < last; ++g) {
      const float* ahead = nullptr;
      int64_t ahead_panels = 0;
      if (g + 1 < last) {  // the run's next block: in this weight, or the next weight's first
        const bool here = b + 1 < weights[i].blocks;
        const Weight& next = here ? weights[i] : weights[i + 1];
        ahead = next.Block(here ? b + 1 : 0, k);
        ahead_panels = next.Count(here ? b + 1 : 0);
      }
      PanelBlock(x.typed_data(), rows, k, weights[i], b, ahead, ahead_panels);
      if (++b == weights[i].blocks) b = 0, ++i;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JrlhfPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
