// erpo-jax's decode product for XLA's CPU: y [out, N] = W [out, in] @ x [in, N] in float32, for the few dozen
// columns N of a decode step. W comes packed in panels of kRows rows stored k-major,
// panel[p][k][i] = W[p * kRows + i, k] (zero rows pad the last panel), so each panel is one contiguous stream
// and the weights are read once, in order. Panels are shared out over XLA's intra-op thread pool.
// Built on first use by erpo_jax/model/cpu_kernel.py with -march=native (AVX-512F, or AVX2 with FMA).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kRows = 12;
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Splat(float f) { return _mm512_set1_ps(f); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRows = 6;
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Splat(float f) { return _mm256_set1_ps(f); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#else
#error "needs AVX-512F, or AVX2 with FMA"
#endif

constexpr int kVecs = 2;
constexpr int kCols = kVecs * kLanes;  // columns of x per block
constexpr int kAhead = 32;             // panel rows prefetched ahead

// One panel (kRows rows of W, stored k-major: panel[k * kRows + i] = W[row0 + i, k]) times one column
// block of x (kCols columns, row stride ldx) into acc.
inline void PanelBlock(const float* panel, const float* x, int64_t ldx, int64_t in, float* out, int64_t ldo,
                       int rows) {
  Vec acc[kRows][kVecs];
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < kVecs; ++v) acc[i][v] = Zero();
  for (int64_t k = 0; k < in; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kAhead) * kRows), _MM_HINT_T0);
    Vec xv[kVecs];
    for (int v = 0; v < kVecs; ++v) xv[v] = Load(x + k * ldx + v * kLanes);
    const float* w = panel + k * kRows;
    for (int i = 0; i < kRows; ++i) {
      Vec b = Splat(w[i]);
      for (int v = 0; v < kVecs; ++v) acc[i][v] = Fma(b, xv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < rows; ++i)
    for (int v = 0; v < kVecs; ++v) Store(out + i * ldo + v * kLanes, acc[i][v]);
}

struct Job {
  const float* w;
  const float* x;  // [in, ldx]: x itself, or (N not a multiple of kCols) a zero-padded copy of it
  int64_t ldx;
  float* y;
  int64_t in, n, out;
};

void RunPanels(const Job& job, int64_t p0, int64_t p1) {
  float tile[kRows * kCols];
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = job.w + p * job.in * kRows;
    const int64_t row0 = p * kRows;
    const int rows = static_cast<int>(std::min<int64_t>(kRows, job.out - row0));
    for (int64_t c0 = 0; c0 < job.n; c0 += kCols) {
      const int64_t cols = std::min<int64_t>(kCols, job.n - c0);
      if (rows == kRows && cols == kCols) {
        PanelBlock(panel, job.x + c0, job.ldx, job.in, job.y + row0 * job.n + c0, job.n, rows);
      } else {
        PanelBlock(panel, job.x + c0, job.ldx, job.in, tile, kCols, rows);
        for (int i = 0; i < rows; ++i) std::memcpy(job.y + (row0 + i) * job.n + c0, tile + i * kCols, cols * 4);
      }
    }
  }
}

// Runs fn(p0, p1) over chunks of [0, panels): the calling thread and the pool's helpers claim chunks until none
// is left, and the caller waits only for chunks already claimed, which are being computed. A helper that starts
// late (the pool busy with other ops) finds nothing left and returns, so a call never waits on the pool's queue.
template <typename F>
void SharePanels(ffi::ThreadPool& pool, int64_t panels, F fn) {
  struct Share {
    std::atomic<int64_t> next{0}, done{0};
    int64_t chunks, panels;
  };
  auto share = std::make_shared<Share>();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  share->panels = panels;
  share->chunks = std::min<int64_t>(panels, threads * 4);
  auto run = [share, fn] {
    for (;;) {
      const int64_t c = share->next.fetch_add(1, std::memory_order_relaxed);
      if (c >= share->chunks) return;
      fn(share->panels * c / share->chunks, share->panels * (c + 1) / share->chunks);
      share->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < std::min<int64_t>(threads, share->chunks) - 1; ++h) {
    auto task = run;  // Schedule takes its task by value
    pool.Schedule(std::move(task));
  }
  run();
  while (share->done.load(std::memory_order_acquire) < share->chunks) _mm_pause();
}

ffi::Error DecodeMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x,
                        ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions();
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (wd.size() != 3 || xd.size() != 2 || yd.size() != 2 || wd[2] != kRows || wd[1] != xd[0] ||
      yd[1] != xd[1] || (yd[0] + kRows - 1) / kRows != wd[0]) {
    return ffi::Error::InvalidArgument("erpo_decode_matmul_v1: expects W [ceil(out/R), in, R], x [in, N], y [out, N]");
  }
  Job job{w.typed_data(), x.typed_data(), xd[1], y->typed_data(), xd[0], xd[1], yd[0]};
  std::vector<float> padded;  // the kernel reads x in whole blocks of kCols columns
  if (job.n % kCols) {
    job.ldx = (job.n + kCols - 1) / kCols * kCols;
    padded.assign(job.in * job.ldx, 0.0f);
    for (int64_t k = 0; k < job.in; ++k) std::memcpy(padded.data() + k * job.ldx, job.x + k * job.n, job.n * 4);
    job.x = padded.data();
  }
  SharePanels(pool, wd[0], [&job](int64_t p0, int64_t p1) { RunPanels(job, p0, p1); });
  return ffi::Error::Success();
}

// The panels DecodeMatmul reads, from W as stored, [in, out] (w_rows false), or as rows, [out, in].
ffi::Error PackPanels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> panels,
                      bool w_rows) {
  auto wd = w.dimensions();
  auto pd = panels->dimensions();
  if (wd.size() != 2 || pd.size() != 3 || pd[2] != kRows) {
    return ffi::Error::InvalidArgument("erpo_pack_panels_v1: expects W [in, out] or [out, in], panels [P, in, R]");
  }
  const int64_t in = w_rows ? wd[1] : wd[0], out = w_rows ? wd[0] : wd[1];
  if (pd[1] != in || pd[0] != (out + kRows - 1) / kRows) {
    return ffi::Error::InvalidArgument("erpo_pack_panels_v1: panels must be [ceil(out/R), in, R]");
  }
  const float* src = w.typed_data();
  float* dst = panels->typed_data();
  SharePanels(pool, pd[0], [=](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* panel = dst + p * in * kRows;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, out - p * kRows));
      for (int64_t k = 0; k < in; ++k) {
        float* to = panel + k * kRows;
        if (w_rows) {
          for (int i = 0; i < rows; ++i) to[i] = src[(p * kRows + i) * in + k];
        } else {
          std::memcpy(to, src + k * out + p * kRows, rows * 4);
        }
        for (int i = rows; i < kRows; ++i) to[i] = 0.0f;
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" int erpo_panel_rows() { return kRows; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(ErpoDecodeMatmul, DecodeMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ErpoPackPanels, PackPanels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("w_rows"));
