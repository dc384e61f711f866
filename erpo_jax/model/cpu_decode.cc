// erpo-jax's kernels for XLA's CPU, in float32: the product y [out, N] = W [out, in] @ x [in, N] for the few
// dozen columns N of a decode step, the attention of one new token per row over a group cache, and the update's
// group attention forward and backward (below, "The update's attention").
//
// The product: W comes packed in panels of kRows rows stored k-major,
// panel[p][k][i] = W[p * kRows + i, k] (zero rows pad the last panel), so each panel is one contiguous stream
// and the weights are read once, in order. Panels are shared out over XLA's intra-op thread pool.
// The attention (GroupDecodeAttention, below) writes each row's new key and value into its response slot and
// attends over the slots its mask marks, reading no slot past the last marked one.
// Built on first use by erpo_jax/model/cpu_kernel.py with -march=native (AVX-512F, or AVX2 with FMA).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
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
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec Round(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec TimesPow2(Vec y, Vec n) {  // y * 2^n for integral n in [-127, 127]
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(y), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23)));
}
inline Vec ZeroBelow(Vec y, Vec x, float lo) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, Splat(lo), _CMP_GE_OQ), y); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRows = 6;
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Splat(float f) { return _mm256_set1_ps(f); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float Sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec Round(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec TimesPow2(Vec y, Vec n) {  // y * 2^n for integral n in [-127, 127]
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
}
inline Vec ZeroBelow(Vec y, Vec x, float lo) { return _mm256_and_ps(_mm256_cmp_ps(x, Splat(lo), _CMP_GE_OQ), y); }
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
void SharePanels(ffi::ThreadPool& pool, int64_t panels, F fn, int64_t chunks_per_thread = 4) {
  struct Share {
    std::atomic<int64_t> next{0}, done{0};
    int64_t chunks, panels;
  };
  auto share = std::make_shared<Share>();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  share->panels = panels;
  share->chunks = std::min<int64_t>(panels, threads * chunks_per_thread);
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

// The panels DecodeMatmul reads, from layer `layer` of W as stored, [L, in, out] (w_rows false), or as rows,
// [L, out, in]: the layer's matrix is read in place from the stack, not sliced out first.
ffi::Error PackPanels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> panels,
                      bool w_rows, int64_t layer) {
  auto wd = w.dimensions();
  auto pd = panels->dimensions();
  if (wd.size() != 3 || pd.size() != 3 || pd[2] != kRows || layer < 0 || layer >= wd[0]) {
    return ffi::Error::InvalidArgument("erpo_pack_panels_v2: expects W [L, in, out] or [L, out, in], panels [P, in, R]");
  }
  const int64_t in = w_rows ? wd[2] : wd[1], out = w_rows ? wd[1] : wd[2];
  if (pd[1] != in || pd[0] != (out + kRows - 1) / kRows) {
    return ffi::Error::InvalidArgument("erpo_pack_panels_v2: panels must be [ceil(out/R), in, R]");
  }
  const float* src = w.typed_data() + layer * in * out;
  float* dst = panels->typed_data();
  SharePanels(pool, pd[0], [=](int64_t p0, int64_t p1) {
    if (w_rows) {  // panel p reads R rows of W, each from k = 0 on
      for (int64_t p = p0; p < p1; ++p) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, out - p * kRows));
        for (int64_t k = 0; k < in; ++k)
          for (int i = 0; i < kRows; ++i) dst[(p * in + k) * kRows + i] = i < rows ? src[(p * kRows + i) * in + k] : 0.0f;
      }
      return;
    }
    // Row k of W holds row k of every panel: read each row once, along its length.
    for (int64_t k = 0; k < in; ++k)
      for (int64_t p = p0; p < p1; ++p) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, out - p * kRows));
        float* to = dst + (p * in + k) * kRows;
        const float* from = src + k * out + p * kRows;
        for (int i = 0; i < kRows; ++i) to[i] = i < rows ? from[i] : 0.0f;
      }
  });
  return ffi::Error::Success();
}


// --- The attention

// exp(x) for x <= 0 (Cephes' polynomial after x = n ln2 + r, |r| <= ln2 / 2; within 2 ulp), and exactly 0 where
// x < kExpLow: a masked slot's weight, as XLA's softmax gives exp(dtype min - max) = 0.
constexpr float kExpLow = -87.0f;
inline Vec ExpNonPositive(Vec x) {
  const Vec xc = Max(x, Splat(kExpLow));
  const Vec n = Round(xc * Splat(1.44269504088896341f));
  Vec r = Fma(n, Splat(-0.693359375f), xc);
  r = Fma(n, Splat(2.12194440e-4f), r);
  Vec p = Splat(1.9875691500e-4f);
  p = Fma(p, r, Splat(1.3981999507e-3f));
  p = Fma(p, r, Splat(8.3334519073e-3f));
  p = Fma(p, r, Splat(4.1665795894e-2f));
  p = Fma(p, r, Splat(1.6666665459e-1f));
  p = Fma(p, r, Splat(5.0000001201e-1f));
  const Vec y = Fma(p * r, r, r + Splat(1.0f));  // 1 + r + r^2 p(r)
  return ZeroBelow(TimesPow2(y, n), x, kExpLow);
}

inline float MaxOf(Vec v) {
  alignas(64) float lanes[kLanes];
  Store(lanes, v);
  return *std::max_element(lanes, lanes + kLanes);
}

inline float Dot(const float* a, const float* b, int64_t n) {
  Vec acc = Zero();
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) acc = Fma(Load(a + d), Load(b + d), acc);
  float s = Sum(acc);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// out[0, V kLanes) += sum_i w[i] rows[i ld, i ld + V kLanes), skipping zero weights (masked slots).
template <int V>
void AddWeightedRowsV(const float* w, const float* rows, int64_t count, int64_t ld, float* out) {
  Vec acc[V];
  for (int v = 0; v < V; ++v) acc[v] = Load(out + v * kLanes);
  for (int64_t i = 0; i < count; ++i) {
    if (w[i] == 0.0f) continue;
    const Vec a = Splat(w[i]);
    for (int v = 0; v < V; ++v) acc[v] = Fma(a, Load(rows + i * ld + v * kLanes), acc[v]);
  }
  for (int v = 0; v < V; ++v) Store(out + v * kLanes, acc[v]);
}

void AddWeightedRows(const float* w, const float* rows, int64_t count, int64_t ld, float* out, int64_t width) {
  switch (width % kLanes ? 0 : width / kLanes) {
    case 1: return AddWeightedRowsV<1>(w, rows, count, ld, out);
    case 2: return AddWeightedRowsV<2>(w, rows, count, ld, out);
    case 4: return AddWeightedRowsV<4>(w, rows, count, ld, out);
    case 8: return AddWeightedRowsV<8>(w, rows, count, ld, out);
    case 16: return AddWeightedRowsV<16>(w, rows, count, ld, out);
    default:
      for (int64_t i = 0; i < count; ++i)
        if (w[i] != 0.0f)
          for (int64_t d = 0; d < width; ++d) out[d] += w[i] * rows[i * ld + d];
  }
}

constexpr int kQueries = 8;  // queries per register tile of the prompt's scores

// scores[j ld + p] = q_j . keys[:, p] for the Q queries qs [Qpad, Dh] (Qpad a multiple of kQueries, zero rows
// after Q) and prompt slots p < count of keys [Dh, P] (slot-minor). Whole tiles may write up to kLanes - 1
// scores past count, inside the row's ld.
void PromptScores(const float* qs, int64_t Qpad, int64_t Dh, const float* keys, int64_t P, int64_t count,
                  float* scores, int64_t ld) {
  int64_t p0 = 0;
  for (; p0 < count && p0 + kLanes <= P; p0 += kLanes) {
    for (int64_t j0 = 0; j0 < Qpad; j0 += kQueries) {
      Vec acc[kQueries];
      for (int i = 0; i < kQueries; ++i) acc[i] = Zero();
      for (int64_t d = 0; d < Dh; ++d) {
        const Vec k = Load(keys + d * P + p0);
        for (int i = 0; i < kQueries; ++i) acc[i] = Fma(Splat(qs[(j0 + i) * Dh + d]), k, acc[i]);
      }
      for (int i = 0; i < kQueries; ++i) Store(scores + (j0 + i) * ld + p0, acc[i]);
    }
  }
  for (; p0 < count; ++p0)
    for (int64_t j = 0; j < Qpad; ++j) {
      float s = 0.0f;
      for (int64_t d = 0; d < Dh; ++d) s += qs[j * Dh + d] * keys[d * P + p0];
      scores[j * ld + p0] = s;
    }
}

struct Attention {
  const float *q, *k_new, *v_new;  // [H Dh, N], [K Dh, N], [K Dh, N]: the step's columns, q and k before RoPE
  const float *cos, *sin;          // [Dh, N]: each row's RoPE table (half-split layout)
  const float *pk, *pv;            // the prompts' keys [B, K, Dh, P] and values [B, K, P, Dh]
  float *rk, *rv;                  // the rows' response keys and values, [N, K, M, Dh] each
  const bool* attend;              // [N, P + M]
  float* o;                        // [H Dh, N]
  int64_t N, B, G, K, g, Dh, P, M, slot;  // slot: the response slot this step writes, in [0, M)
};

// Feature d of head h of column n of x [heads Dh, N], rotated: x cos + rotate_half(x) sin, as llama.apply_rope.
inline float Roped(const Attention& a, const float* x, int64_t h, int64_t d, int64_t n) {
  const int64_t Dh = a.Dh, half = Dh / 2, N = a.N;
  const float turned = d < half ? -x[(h * Dh + d + half) * N + n] : x[(h * Dh + d - half) * N + n];
  return x[(h * Dh + d) * N + n] * a.cos[d * N + n] + turned * a.sin[d * N + n];
}

// Prompt b's G rows and kv head kh: writes their new keys (RoPE applied) and values, then their G g queries
// (RoPE applied) attend.
void AttendGroupHead(const Attention& a, int64_t b, int64_t kh) {
  const int64_t N = a.N, Dh = a.Dh, P = a.P, M = a.M, T = P + M, Q = a.G * a.g;
  const int64_t Qpad = (Q + kQueries - 1) / kQueries * kQueries;
  const int64_t n0 = b * a.G;  // the group's rows are columns n0 .. n0 + G - 1: contiguous in every column array
  for (int64_t d = 0; d < Dh; ++d)
    for (int64_t r = 0; r < a.G; ++r) {
      const int64_t at = (((n0 + r) * a.K + kh) * M + a.slot) * Dh + d;
      a.rk[at] = Roped(a, a.k_new, kh, d, n0 + r);
      a.rv[at] = a.v_new[(kh * Dh + d) * N + n0 + r];
    }
  int64_t prompt_end = 0;  // slots [0, prompt_end) hold every prompt slot a row of the group attends to
  std::vector<int64_t> response_end(a.G, 0);
  for (int64_t r = 0; r < a.G; ++r) {
    const bool* mask = a.attend + (n0 + r) * T;
    for (int64_t t = P; t > prompt_end; --t)
      if (mask[t - 1]) {
        prompt_end = t;
        break;
      }
    for (int64_t s = M; s > 0; --s)
      if (mask[P + s - 1]) {
        response_end[r] = s;
        break;
      }
  }
  const int64_t ld = prompt_end + M + kLanes;  // a query's scores: prompt slots, then response slots
  std::vector<float> qs(Qpad * Dh, 0.0f), scores(Qpad * ld), outs(Qpad * Dh, 0.0f);
  for (int64_t i = 0; i < a.g; ++i)
    for (int64_t d = 0; d < Dh; ++d)
      for (int64_t r = 0; r < a.G; ++r) qs[(r * a.g + i) * Dh + d] = Roped(a, a.q, kh * a.g + i, d, n0 + r);
  const float* pk = a.pk + (b * a.K + kh) * Dh * P;
  const float* pv = a.pv + (b * a.K + kh) * P * Dh;
  PromptScores(qs.data(), Qpad, Dh, pk, P, prompt_end, scores.data(), ld);
  const float scale = static_cast<float>(std::sqrt(static_cast<double>(Dh)));
  for (int64_t r = 0; r < a.G; ++r) {
    const int64_t n = n0 + r, count = prompt_end + response_end[r];
    const bool* mask = a.attend + n * T;
    const float* rk = a.rk + (n * a.K + kh) * M * Dh;
    const float* rv = a.rv + (n * a.K + kh) * M * Dh;
    for (int64_t i = 0; i < a.g; ++i) {
      float* x = scores.data() + (r * a.g + i) * ld;
      const float* q = qs.data() + (r * a.g + i) * Dh;
      for (int64_t s = 0; s < response_end[r]; ++s) x[prompt_end + s] = Dot(q, rk + s * Dh, Dh);
      for (int64_t t = 0; t < prompt_end; ++t) x[t] = mask[t] ? x[t] / scale : -INFINITY;
      for (int64_t s = 0; s < response_end[r]; ++s) x[prompt_end + s] = mask[P + s] ? x[prompt_end + s] / scale : -INFINITY;
      float top = -INFINITY;
      {
        Vec tops = Splat(-INFINITY);
        int64_t t = 0;
        for (; t + kLanes <= count; t += kLanes) tops = Max(tops, Load(x + t));
        top = MaxOf(tops);
        for (; t < count; ++t) top = std::max(top, x[t]);
      }
      Vec total = Zero();
      int64_t t = 0;
      for (; t + kLanes <= count; t += kLanes) {
        const Vec e = ExpNonPositive(Load(x + t) - Splat(top));
        Store(x + t, e);
        total = total + e;
      }
      float sum = Sum(total);
      for (; t < count; ++t) {
        x[t] = x[t] == -INFINITY ? 0.0f : std::exp(x[t] - top);
        sum += x[t];
      }
      const float inv = 1.0f / sum;
      for (t = 0; t < count; ++t) x[t] *= inv;
      float* out = outs.data() + (r * a.g + i) * Dh;
      AddWeightedRows(x, pv, prompt_end, Dh, out, Dh);
      AddWeightedRows(x + prompt_end, rv, response_end[r], Dh, out, Dh);
    }
  }
  for (int64_t i = 0; i < a.g; ++i)
    for (int64_t d = 0; d < Dh; ++d)
      for (int64_t r = 0; r < a.G; ++r) a.o[((kh * a.g + i) * Dh + d) * N + n0 + r] = outs[(r * a.g + i) * Dh + d];
}

template <typename A, typename B>
bool SameDims(const A& a, const B& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

ffi::Error GroupDecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                                ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                                ffi::Buffer<ffi::F32> pk, ffi::Buffer<ffi::F32> pv,
                                ffi::Buffer<ffi::F32> rk, ffi::Buffer<ffi::F32> rv, ffi::Buffer<ffi::PRED> attend,
                                ffi::Buffer<ffi::S32> slot, ffi::ResultBuffer<ffi::F32> o,
                                ffi::ResultBuffer<ffi::F32> rk_out, ffi::ResultBuffer<ffi::F32> rv_out) {
  auto qd = q.dimensions(), kd = k_new.dimensions(), pkd = pk.dimensions(), rkd = rk.dimensions();
  auto ad = attend.dimensions();
  const bool ranks = qd.size() == 2 && kd.size() == 2 && pkd.size() == 4 && rkd.size() == 4 && ad.size() == 2 &&
                     slot.dimensions().size() == 0;
  if (!ranks) return ffi::Error::InvalidArgument("erpo_group_decode_attention_v1: operand ranks");
  const int64_t N = qd[1], B = pkd[0], K = pkd[1], Dh = pkd[2], P = pkd[3], M = rkd[2];
  const std::vector<int64_t> pv_dims{B, K, P, Dh}, table_dims{Dh, N};
  if (N % B || Dh % 2 || kd[0] != K * Dh || kd[1] != N || qd[0] % (K * Dh) || rkd[0] != N || rkd[1] != K ||
      rkd[3] != Dh || ad[0] != N || ad[1] != P + M || !SameDims(v_new.dimensions(), kd) ||
      !SameDims(pv.dimensions(), pv_dims) || !SameDims(rv.dimensions(), rkd) || !SameDims(o->dimensions(), qd) ||
      !SameDims(cos.dimensions(), table_dims) || !SameDims(sin.dimensions(), table_dims)) {
    return ffi::Error::InvalidArgument("erpo_group_decode_attention_v1: expects q [H Dh, N], k, v [K Dh, N], "
                                       "cos, sin [Dh, N], prompt k [B, K, Dh, P], v [B, K, P, Dh], "
                                       "response k, v [N, K, M, Dh], attend [N, P + M]");
  }
  const int64_t s = slot.typed_data()[0] - P;
  if (s < 0 || s >= M) return ffi::Error::InvalidArgument("erpo_group_decode_attention_v1: slot outside the response");
  const size_t bytes = N * K * M * Dh * sizeof(float);
  if (rk_out->typed_data() != rk.typed_data()) std::memcpy(rk_out->typed_data(), rk.typed_data(), bytes);
  if (rv_out->typed_data() != rv.typed_data()) std::memcpy(rv_out->typed_data(), rv.typed_data(), bytes);
  Attention a{q.typed_data(), k_new.typed_data(), v_new.typed_data(), cos.typed_data(), sin.typed_data(), pk.typed_data(), pv.typed_data(),
              rk_out->typed_data(), rv_out->typed_data(), attend.typed_data(), o->typed_data(),
              N, B, N / B, K, qd[0] / (K * Dh), Dh, P, M, s};
  SharePanels(pool, B * K, [&a](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) AttendGroupHead(a, u / a.K, u % a.K);
  });
  return ffi::Error::Success();
}



// --- The update's attention: a group's response rows over their shared prompt's keys and their own

// Forward and backward of model/group_attention.py's softmax attention, one unit of work per (prompt b, key
// head k): the unit copies its prompt's keys and values once, each row's response keys and values after them,
// and walks the query heads of k and the response positions in tiles of kTile queries. A query at response
// position r sees the prompt's first L = prompt_len[b] slots and response slots r' <= r; the tile reads no key
// past its last query's. The backward recomputes the probabilities from the forward's log-sum-exp.
constexpr int kTile = 4;  // queries per tile

struct TrainAttention {
  const float *q, *kp, *vp, *kr, *vr;  // [N, R, H, Dh], [B, P, K, Dh] x 2, [N, R, K, Dh] x 2
  const int32_t* prompt_len;           // [B]
  const float *o, *lse, *dout;         // backward: the forward's [N, R, H, Dh], [N, R, H]; the cotangent
  float *out, *out_lse;                // forward: [N, R, H, Dh], [N, R, H]
  float *dq, *dkp, *dvp, *dkr, *dvr;   // backward: the shapes of q, kp, vp, kr, vr
  int64_t N, B, G, R, H, K, Dh, P;
  float scale;
};

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// c[i][0, N kLanes) = sum_{k < K} a[i][k] b[k ldb + (0, N kLanes)] for the kTile rows a[i]: the attentions'
// one micro-kernel, N vectors of columns held in registers for each row. N is a compile-time count so that the
// kTile x N accumulators stay in registers (with a count known only at run time they lived on the stack).
template <int N>
inline void TileProduct(const float* const* a, int64_t K, const float* b, int64_t ldb, float* c, int64_t ldc) {
  Vec acc[kTile][N];
  for (int i = 0; i < kTile; ++i)
    for (int v = 0; v < N; ++v) acc[i][v] = Zero();
  for (int64_t k = 0; k < K; ++k) {
    Vec r[N];
    for (int v = 0; v < N; ++v) r[v] = Load(b + k * ldb + v * kLanes);
    for (int i = 0; i < kTile; ++i) {
      const Vec x = Splat(a[i][k]);
      for (int v = 0; v < N; ++v) acc[i][v] = Fma(x, r[v], acc[i][v]);
    }
  }
  for (int i = 0; i < kTile; ++i)
    for (int v = 0; v < N; ++v) Store(c + i * ldc + v * kLanes, acc[i][v]);
}

// Vectors of columns a tile holds per row: kTile x kTileVecs accumulators and kTileVecs loads fit the register
// file (32 vector registers with AVX-512, 16 with AVX2).
constexpr int kTileVecs = kLanes == 16 ? 4 : 2;

// s[i][j] = x_i . cols[:, j] for the kTile rows x_i (Dh floats each), j < T (T a multiple of kLanes), cols
// [Dh, ld]; two vectors of slots at a time.
inline void TileScores(const float* const* x, int64_t Dh, const float* cols, int64_t ld, int64_t T, float* s,
                       int64_t lds) {
  int64_t j0 = 0;
  for (; j0 + 2 * kLanes <= T; j0 += 2 * kLanes) TileProduct<2>(x, Dh, cols + j0, ld, s + j0, lds);
  if (j0 < T) TileProduct<1>(x, Dh, cols + j0, ld, s + j0, lds);
}

// y[i][0, Dp) = sum_{j < T} w[i][j] rows[j][0, Dp) for i < kTile; Dp a multiple of kLanes.
inline void TileWeightedRows(const float* w, int64_t ldw, const float* rows, int64_t Dp, int64_t T, float* y,
                             int64_t ldy) {
  const float* wi[kTile];
  for (int i = 0; i < kTile; ++i) wi[i] = w + i * ldw;
  int64_t d0 = 0;
  for (; d0 + kTileVecs * kLanes <= Dp; d0 += kTileVecs * kLanes)
    TileProduct<kTileVecs>(wi, T, rows + d0, Dp, y + d0, ldy);
  for (; d0 < Dp; d0 += kLanes) TileProduct<1>(wi, T, rows + d0, Dp, y + d0, ldy);
}

// rows[j][d0, d0 + V kLanes) += sum_i w[i][j] x_i[d0, d0 + V kLanes) for j < T, the kTile rows' vectors held in
// registers.
template <int V>
inline void AddOuterBlock(const float* w, int64_t ldw, const float* const* x, int64_t d0, int64_t Dp, int64_t T,
                          float* rows) {
  Vec xs[kTile][V];
  for (int i = 0; i < kTile; ++i)
    for (int v = 0; v < V; ++v) xs[i][v] = Load(x[i] + d0 + v * kLanes);
  for (int64_t j = 0; j < T; ++j) {
    float* row = rows + j * Dp + d0;
    Vec acc[V];
    for (int v = 0; v < V; ++v) acc[v] = Load(row + v * kLanes);
    for (int i = 0; i < kTile; ++i) {
      const Vec a = Splat(w[i * ldw + j]);
      for (int v = 0; v < V; ++v) acc[v] = Fma(a, xs[i][v], acc[v]);
    }
    for (int v = 0; v < V; ++v) Store(row + v * kLanes, acc[v]);
  }
}

// rows[j][0, Dp) += sum_i w[i][j] x_i[0, Dp) for j < T; Dp a multiple of kLanes.
inline void AddOuter(const float* w, int64_t ldw, const float* const* x, int64_t Dp, int64_t T, float* rows) {
  int64_t d0 = 0;
  for (; d0 + kTileVecs * kLanes <= Dp; d0 += kTileVecs * kLanes)
    AddOuterBlock<kTileVecs>(w, ldw, x, d0, Dp, T, rows);
  for (; d0 < Dp; d0 += kLanes) AddOuterBlock<1>(w, ldw, x, d0, Dp, T, rows);
}

// Pointers to the tile's rows of x (row r0 + i at x + (r0 + i) * stride, Dh floats): in place when Dh fills
// whole vectors, else copied into buf [kTile, Dp] with zeros after Dh; rows past R point to zeros.
inline void TileRows(const float* x, int64_t stride, int64_t r0, int64_t R, int64_t Dh, int64_t Dp, float* buf,
                     const float* rows[kTile]) {
  const int64_t n = std::min<int64_t>(kTile, R - r0);
  if (Dh != Dp || n < kTile) std::fill(buf, buf + kTile * Dp, 0.0f);
  for (int64_t i = 0; i < kTile; ++i) {
    if (i < n && Dh == Dp) {
      rows[i] = x + (r0 + i) * stride;
    } else {
      if (i < n) std::memcpy(buf + i * Dp, x + (r0 + i) * stride, Dh * sizeof(float));
      rows[i] = buf + i * Dp;
    }
  }
}

// The unit's keys and values: slots [0, L) the prompt's, [L, L + R) row n's responses; as rows [Tp, Dp] and
// as columns [Dh, Tp], zero past them. The forward reads keys as columns and values as rows; the backward keys
// both ways and values as columns.
struct UnitKeys {
  bool backward;
  int64_t L, Tp, Dp;
  std::vector<float> k_rows, v_rows, k_cols, v_cols;
};

// Slots [j0, j0 + count) from x + i * stride (i < count, Dh floats each) into the unit's layouts.
void CopySlots(const float* x, int64_t stride, int64_t count, int64_t j0, int64_t Dh, UnitKeys& u, bool keys) {
  const bool as_rows = keys ? u.backward : !u.backward, as_cols = keys || u.backward;
  float* rows = (keys ? u.k_rows : u.v_rows).data();
  float* cols = (keys ? u.k_cols : u.v_cols).data();
  if (as_rows)
    for (int64_t i = 0; i < count; ++i) std::memcpy(rows + (j0 + i) * u.Dp, x + i * stride, Dh * sizeof(float));
  if (as_cols)
    for (int64_t d = 0; d < Dh; ++d)
      for (int64_t i = 0; i < count; ++i) cols[d * u.Tp + j0 + i] = x[i * stride + d];
}

void LoadPrompt(const TrainAttention& a, int64_t b, int64_t k, UnitKeys& u) {
  u.L = std::min<int64_t>(std::max<int32_t>(a.prompt_len[b], 0), a.P);
  u.Tp = RoundUp(u.L + a.R, kLanes);
  u.Dp = RoundUp(a.Dh, kLanes);
  for (auto* m : {&u.k_rows, &u.v_rows}) m->assign(u.Tp * u.Dp, 0.0f);
  for (auto* m : {&u.k_cols, &u.v_cols}) m->assign(a.Dh * u.Tp, 0.0f);
  const int64_t at = (b * a.P * a.K + k) * a.Dh, stride = a.K * a.Dh;
  CopySlots(a.kp + at, stride, u.L, 0, a.Dh, u, true);
  CopySlots(a.vp + at, stride, u.L, 0, a.Dh, u, false);
}

void LoadResponses(const TrainAttention& a, int64_t n, int64_t k, UnitKeys& u) {
  const int64_t at = (n * a.R * a.K + k) * a.Dh, stride = a.K * a.Dh;
  CopySlots(a.kr + at, stride, a.R, u.L, a.Dh, u, true);
  CopySlots(a.vr + at, stride, a.R, u.L, a.Dh, u, false);
}

// The tile's scaled scores (T slots of each of its queries; -inf past a query's last slot) and pointers to its
// queries (TileRows).
int64_t TileQueries(const TrainAttention& a, const UnitKeys& u, int64_t n, int64_t head, int64_t r0, float* qbuf,
                    const float* qs[kTile], float* s, int64_t lds) {
  TileRows(a.q + (n * a.R * a.H + head) * a.Dh, a.H * a.Dh, r0, a.R, a.Dh, u.Dp, qbuf, qs);
  const int64_t T = RoundUp(u.L + std::min<int64_t>(a.R, r0 + kTile), kLanes);
  TileScores(qs, a.Dh, u.k_cols.data(), u.Tp, T, s, lds);
  for (int i = 0; i < kTile; ++i) {
    float* si = s + i * lds;
    for (int64_t j = 0; j < T; j += kLanes) Store(si + j, Load(si + j) * Splat(a.scale));
    for (int64_t j = u.L + r0 + i + 1; j < T; ++j) si[j] = -INFINITY;  // past the query's last slot
  }
  return T;
}

// p[i][j] = exp(s[i][j] - m_i) over j < T (0 where s is -inf).
inline void ExpShifted(float* s, int64_t T, float m) {
  for (int64_t j = 0; j < T; j += kLanes) Store(s + j, ExpNonPositive(Load(s + j) - Splat(m)));
}

void ForwardUnit(const TrainAttention& a, int64_t b, int64_t k, UnitKeys& u) {
  LoadPrompt(a, b, k, u);
  const int64_t Dh = a.Dh, hk = a.H / a.K, lds = u.Tp;
  std::vector<float> qbuf(kTile * u.Dp), s(kTile * lds), y(kTile * u.Dp);
  const float* qs[kTile];
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t n = b * a.G + g;
    LoadResponses(a, n, k, u);
    for (int64_t hh = 0; hh < hk; ++hh) {
      const int64_t head = k * hk + hh;
      for (int64_t r0 = 0; r0 < a.R; r0 += kTile) {
        const int64_t T = TileQueries(a, u, n, head, r0, qbuf.data(), qs, s.data(), lds);
        float sums[kTile], tops[kTile];
        for (int i = 0; i < kTile; ++i) {
          float* si = s.data() + i * lds;
          Vec m = Splat(-INFINITY);
          for (int64_t j = 0; j < T; j += kLanes) m = Max(m, Load(si + j));
          tops[i] = MaxOf(m);
          ExpShifted(si, T, tops[i]);
          Vec acc = Zero();
          for (int64_t j = 0; j < T; j += kLanes) acc = acc + Load(si + j);
          sums[i] = Sum(acc);
        }
        TileWeightedRows(s.data(), lds, u.v_rows.data(), u.Dp, T, y.data(), u.Dp);
        for (int64_t i = 0; i < std::min<int64_t>(kTile, a.R - r0); ++i) {
          const int64_t at = (n * a.R + r0 + i) * a.H + head;
          for (int64_t d = 0; d < Dh; ++d) a.out[at * Dh + d] = y[i * u.Dp + d] / sums[i];
          a.out_lse[at] = tops[i] + std::log(sums[i]);
        }
      }
    }
  }
}

void BackwardUnit(const TrainAttention& a, int64_t b, int64_t k, UnitKeys& u) {
  LoadPrompt(a, b, k, u);
  const int64_t Dh = a.Dh, hk = a.H / a.K, lds = u.Tp, Dp = u.Dp, L = u.L;
  std::vector<float> qbuf(kTile * Dp), dobuf(kTile * Dp), s(kTile * lds), dp(kTile * lds), dqs(kTile * Dp);
  const float *qs[kTile], *dos[kTile];
  std::vector<float> dk(u.Tp * Dp), dv(u.Tp * Dp);  // slots [0, L) summed over the group's rows
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t n = b * a.G + g;
    LoadResponses(a, n, k, u);
    std::fill(dk.begin() + L * Dp, dk.end(), 0.0f);
    std::fill(dv.begin() + L * Dp, dv.end(), 0.0f);
    for (int64_t hh = 0; hh < hk; ++hh) {
      const int64_t head = k * hk + hh;
      for (int64_t r0 = 0; r0 < a.R; r0 += kTile) {
        const int64_t T = TileQueries(a, u, n, head, r0, qbuf.data(), qs, s.data(), lds);
        const int64_t rows = std::min<int64_t>(kTile, a.R - r0);
        TileRows(a.dout + (n * a.R * a.H + head) * Dh, a.H * Dh, r0, a.R, Dh, Dp, dobuf.data(), dos);
        float delta[kTile] = {}, lse[kTile] = {};
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t at = (n * a.R + r0 + i) * a.H + head;
          delta[i] = Dot(a.dout + at * Dh, a.o + at * Dh, Dh);
          lse[i] = a.lse[at];
        }
        for (int i = 0; i < kTile; ++i) ExpShifted(s.data() + i * lds, T, i < rows ? lse[i] : INFINITY);
        // s holds the probabilities p; dp = dout . v_j; ds = p (dp - delta)
        TileScores(dos, Dh, u.v_cols.data(), u.Tp, T, dp.data(), lds);
        for (int i = 0; i < kTile; ++i) {
          const Vec dl = Splat(delta[i]), sc = Splat(a.scale);
          for (int64_t j = 0; j < T; j += kLanes) {
            float* at = dp.data() + i * lds + j;
            Store(at, Load(s.data() + i * lds + j) * (Load(at) - dl) * sc);
          }
        }
        TileWeightedRows(dp.data(), lds, u.k_rows.data(), Dp, T, dqs.data(), Dp);
        for (int64_t i = 0; i < rows; ++i)
          std::memcpy(a.dq + ((n * a.R + r0 + i) * a.H + head) * Dh, dqs.data() + i * Dp, Dh * sizeof(float));
        AddOuter(dp.data(), lds, qs, Dp, T, dk.data());
        AddOuter(s.data(), lds, dos, Dp, T, dv.data());
      }
    }
    for (int64_t r = 0; r < a.R; ++r) {
      const int64_t at = ((n * a.R + r) * a.K + k) * Dh;
      std::memcpy(a.dkr + at, dk.data() + (L + r) * Dp, Dh * sizeof(float));
      std::memcpy(a.dvr + at, dv.data() + (L + r) * Dp, Dh * sizeof(float));
    }
  }
  for (int64_t p = 0; p < a.P; ++p) {
    const int64_t at = ((b * a.P + p) * a.K + k) * Dh;
    for (int64_t d = 0; d < Dh; ++d) {
      a.dkp[at + d] = p < L ? dk[p * Dp + d] : 0.0f;
      a.dvp[at + d] = p < L ? dv[p * Dp + d] : 0.0f;
    }
  }
}

// Checks the operands' shapes and fills the fields both directions share; an error message, or empty.
const char* TrainShapes(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& kp, ffi::Buffer<ffi::F32>& vp,
                        ffi::Buffer<ffi::F32>& kr, ffi::Buffer<ffi::F32>& vr, ffi::Buffer<ffi::S32>& prompt_len,
                        TrainAttention& a) {
  auto qd = q.dimensions(), kd = kp.dimensions(), rd = kr.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || rd.size() != 4 || prompt_len.dimensions().size() != 1)
    return "operand ranks";
  a.N = qd[0], a.R = qd[1], a.H = qd[2], a.Dh = qd[3], a.B = kd[0], a.P = kd[1], a.K = kd[2];
  const std::vector<int64_t> r_dims{a.N, a.R, a.K, a.Dh};
  if (a.B < 1 || a.N % a.B || a.K < 1 || a.H % a.K || kd[3] != a.Dh || !SameDims(vp.dimensions(), kd) ||
      !SameDims(rd, r_dims) || !SameDims(vr.dimensions(), r_dims) || prompt_len.dimensions()[0] != a.B)
    return "expects q [N, R, H, Dh], prompt k, v [B, P, K, Dh], response k, v [N, R, K, Dh], prompt_len [B]";
  a.G = a.N / a.B;
  a.scale = 1.0f / std::sqrt(static_cast<float>(a.Dh));
  a.q = q.typed_data(), a.kp = kp.typed_data(), a.vp = vp.typed_data(), a.kr = kr.typed_data();
  a.vr = vr.typed_data(), a.prompt_len = prompt_len.typed_data();
  return "";
}

template <typename F>
void ShareUnits(ffi::ThreadPool& pool, const TrainAttention& a, bool backward, F unit) {
  SharePanels(pool, a.B * a.K, [&a, &unit, backward](int64_t u0, int64_t u1) {
    UnitKeys keys{backward};
    for (int64_t u = u0; u < u1; ++u) unit(a, u / a.K, u % a.K, keys);
  }, a.B * a.K);  // one unit a chunk: a few dozen units of unequal prompts
}

ffi::Error GroupAttentionForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kp,
                                 ffi::Buffer<ffi::F32> vp, ffi::Buffer<ffi::F32> kr, ffi::Buffer<ffi::F32> vr,
                                 ffi::Buffer<ffi::S32> prompt_len, ffi::ResultBuffer<ffi::F32> out,
                                 ffi::ResultBuffer<ffi::F32> lse) {
  TrainAttention a{};
  const std::string why = TrainShapes(q, kp, vp, kr, vr, prompt_len, a);
  if (!why.empty()) return ffi::Error::InvalidArgument("erpo_group_attention_fwd_v1: " + why);
  const std::vector<int64_t> lse_dims{a.N, a.R, a.H};
  if (!SameDims(out->dimensions(), q.dimensions()) || !SameDims(lse->dimensions(), lse_dims))
    return ffi::Error::InvalidArgument("erpo_group_attention_fwd_v1: expects out like q, lse [N, R, H]");
  a.out = out->typed_data(), a.out_lse = lse->typed_data();
  ShareUnits(pool, a, false, ForwardUnit);
  return ffi::Error::Success();
}

ffi::Error GroupAttentionBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kp,
                                  ffi::Buffer<ffi::F32> vp, ffi::Buffer<ffi::F32> kr, ffi::Buffer<ffi::F32> vr,
                                  ffi::Buffer<ffi::S32> prompt_len, ffi::Buffer<ffi::F32> o,
                                  ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                                  ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dkp,
                                  ffi::ResultBuffer<ffi::F32> dvp, ffi::ResultBuffer<ffi::F32> dkr,
                                  ffi::ResultBuffer<ffi::F32> dvr) {
  TrainAttention a{};
  const std::string why = TrainShapes(q, kp, vp, kr, vr, prompt_len, a);
  if (!why.empty()) return ffi::Error::InvalidArgument("erpo_group_attention_bwd_v1: " + why);
  const std::vector<int64_t> lse_dims{a.N, a.R, a.H};
  if (!SameDims(o.dimensions(), q.dimensions()) || !SameDims(dout.dimensions(), q.dimensions()) ||
      !SameDims(lse.dimensions(), lse_dims) || !SameDims(dq->dimensions(), q.dimensions()) ||
      !SameDims(dkp->dimensions(), kp.dimensions()) || !SameDims(dvp->dimensions(), kp.dimensions()) ||
      !SameDims(dkr->dimensions(), kr.dimensions()) || !SameDims(dvr->dimensions(), kr.dimensions()))
    return ffi::Error::InvalidArgument("erpo_group_attention_bwd_v1: expects o, dout, dq like q, lse [N, R, H], "
                                       "the key and value gradients like the keys and values");
  a.o = o.typed_data(), a.lse = lse.typed_data(), a.dout = dout.typed_data();
  a.dq = dq->typed_data(), a.dkp = dkp->typed_data(), a.dvp = dvp->typed_data();
  a.dkr = dkr->typed_data(), a.dvr = dvr->typed_data();
  ShareUnits(pool, a, true, BackwardUnit);
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
                                  .Attr<bool>("w_rows")
                                  .Attr<int64_t>("layer"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ErpoGroupDecodeAttention, GroupDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The operands both directions of the update's attention take first: q, prompt k, v, response k, v, prompt_len.
static auto BindTrainAttention() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ErpoGroupAttentionForward, GroupAttentionForward,
                              BindTrainAttention().Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ErpoGroupAttentionBackward, GroupAttentionBackward,
                              BindTrainAttention()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
