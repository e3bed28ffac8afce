// Few-row matmul over packed weight panels for XLA:CPU, called through the XLA FFI
// (jrlhf/native/matmul.py builds this file on first use and registers the handler).
//
// out[m, n] = sum_k x[m, k] * w[k, n] for a few token rows x (a decode step's: tens of rows)
// and a weight stored as panels of 16 output columns: panels[p, k, j] = w[k, 16 p + j].
//
// Why: XLA:CPU's dots reach a third of this machine's matmul rate at a decode step's few rows
// (they pack the weight for every call, or stream it output-major at 9-13 GB/s: BUILD.md,
// "Benchmarks"), and the weights are what a decode step reads. Here each panel is one
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

// Rows [0, R) of x (row stride k) times P consecutive panels, into out (row stride n) at
// columns [n0, n0 + 16 P).
template <int R, int P>
void Block(const float* x, int64_t k, const float* panels, float* out, int64_t n, int64_t n0) {
  const int64_t panel_stride = k * kLanes;
  Lanes acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = Lanes{};
  for (int64_t i = 0; i < k; ++i) {
    Lanes w[P];
    for (int p = 0; p < P; ++p) w[p] = Load(panels + p * panel_stride + i * kLanes);
    for (int r = 0; r < R; ++r) {
      const float s = x[r * k + i];
      for (int p = 0; p < P; ++p) acc[r][p] += w[p] * s;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      std::memcpy(out + r * n + n0 + p * kLanes, &acc[r][p], sizeof(Lanes));
}

template <int P>
void AllRows(int64_t rows, const float* x, int64_t k, const float* panels, float* out, int64_t n,
             int64_t n0) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock)
    Block<kRowBlock, P>(x + r * k, k, panels, out + r * n, n, n0);
  const float* xr = x + r * k;
  float* o = out + r * n;
  switch (rows - r) {
    case 1: return Block<1, P>(xr, k, panels, o, n, n0);
    case 2: return Block<2, P>(xr, k, panels, o, n, n0);
    case 3: return Block<3, P>(xr, k, panels, o, n, n0);
    case 4: return Block<4, P>(xr, k, panels, o, n, n0);
    case 5: return Block<5, P>(xr, k, panels, o, n, n0);
    case 6: return Block<6, P>(xr, k, panels, o, n, n0);
    case 7: return Block<7, P>(xr, k, panels, o, n, n0);
    default: return;
  }
}

// Panels [16 p0, ...) of the product: one block of kPanelsPerBlock (fewer at the end).
void PanelBlock(const float* x, const float* panels, float* out, int64_t rows, int64_t k,
                int64_t n, int64_t num_panels, int64_t block) {
  const int64_t p0 = block * kPanelsPerBlock;
  const float* first = panels + p0 * k * kLanes;
  const int64_t n0 = p0 * kLanes;
  const int64_t count = std::min(kPanelsPerBlock, num_panels - p0);
  if (count == 3)
    AllRows<3>(rows, x, k, first, out, n, n0);
  else if (count == 2)
    AllRows<2>(rows, x, k, first, out, n, n0);
  else
    AllRows<1>(rows, x, k, first, out, n, n0);
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<ffi::F32> panels, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto xd = x.dimensions(), pd = panels.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || od.size() != 2)
    return ffi::Error::InvalidArgument("panel matmul: x, panels or out of wrong rank");
  if (pd[2] != kLanes || pd[1] != xd[1] || od[0] != xd[0] || od[1] != pd[0] * kLanes)
    return ffi::Error::InvalidArgument("panel matmul: shapes do not agree");
  const float* xp = x.typed_data();
  const float* pp = panels.typed_data();
  float* op = out->typed_data();
  const int64_t rows = xd[0], k = xd[1], n = od[1], num_panels = pd[0];
  const int64_t blocks = (num_panels + kPanelsPerBlock - 1) / kPanelsPerBlock;
  if (rows == 0 || blocks == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(op, op + rows * n, 0.0f);
    return ffi::Error::Success();
  }
  // Blocks of panels are claimed one at a time by the calling thread and the pool's.
  jrlhf::ShareOut(pool, blocks, [=](int64_t block, std::vector<float>&) {
    PanelBlock(xp, pp, op, rows, k, n, num_panels, block);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JrlhfPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
