// y[m, n] = sum_k x[m, k] * w[n, k] for a float32 weight stored [out, in] and few rows (M <= 8).
//
// The case of a decode step or a speculative verification pass on CPU: M = batch x tokens is
// 1..8 while w is megabytes. XLA:CPU's dot packs w for M > 1, so 5 rows cost ~2x one row even
// though both read w once; this kernel streams each row of w once and multiplies it into all M
// rows of x while it sits in registers, so its time follows the bytes of w more than M.
// Built by kernels_cpu/small_matmul.py (-O3 -march=native); AVX-512, AVX2 + FMA, or a portable
// vector-extension path.
//
// Work is split over the rows of w in chunks; XLA's intra-op thread pool runs helpers, and the
// calling thread takes chunks too, so the call finishes even if no helper ever starts. Every
// output element is summed in the same order for any M, so one row and five rows agree bitwise.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One SIMD register of floats and the three operations the kernel needs. The fused multiply-add
// and the reduction are written out (intrinsics, a fixed shuffle tree), so every instantiation
// rounds the same way whatever the compiler's contraction choices.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
typedef __m512 vec;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline __m256 half_sum(vec v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
typedef __m256 vec;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 half_sum(vec v) { return v; }
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(vec v) {
  const __m256 a = half_sum(v);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
inline float sfma(float a, float b, float c) { return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c))); }
#else
// Portable fallback (no AVX2 + FMA): GCC vector extensions, compiled with -ffp-contract=off.
constexpr int kLanes = 8;
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
inline vec vzero() { return vec{}; }
inline vec vload(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline float hsum(vec v) {
  float s[kLanes / 2];
  for (int i = 0; i < kLanes / 2; ++i) s[i] = v[i] + v[i + kLanes / 2];
  return (s[0] + s[2]) + (s[1] + s[3]);
}
inline float sfma(float a, float b, float c) { return a * b + c; }
#endif

// R weight rows [n0, n0 + R) times all M rows of x.
template <int M, int R>
inline void rows(const float* x, const float* w, float* y, int64_t n0, int64_t N, int64_t K) {
  vec acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vzero();
  const int64_t kv = K - K % kLanes;
  for (int64_t k = 0; k < kv; k += kLanes) {
    vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = vload(w + (n0 + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const vec xv = vload(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = vfma(xv, wv[r], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[r][m]);
      for (int64_t k = kv; k < K; ++k) s = sfma(x[m * K + k], w[(n0 + r) * K + k], s);
      y[m * N + n0 + r] = s;
    }
  }
}

// Rows of w per inner step: enough independent accumulators to hide the FMA latency at small M,
// few enough that R * M accumulators + R weight vectors + one x vector fit 16 vector registers.
// Measured (113 MB of [3072, 768] weights, on a 2-core AMD EPYC with AVX2 and a 2-core Intel Xeon
// with AVX-512): 4 rows at M = 1, 1 row for M >= 2 (2 or 4 rows there measured no faster).
template <int M>
constexpr int kRowsPerStep = M == 1 ? 4 : 1;

template <int M>
void chunk(const float* x, const float* w, float* y, int64_t lo, int64_t hi, int64_t N, int64_t K) {
  constexpr int R = kRowsPerStep<M>;
  int64_t n = lo;
  for (; n + R <= hi; n += R) rows<M, R>(x, w, y, n, N, K);
  for (; n < hi; ++n) rows<M, 1>(x, w, y, n, N, K);
}

void run_chunk(int64_t M, const float* x, const float* w, float* y, int64_t lo, int64_t hi,
               int64_t N, int64_t K) {
  switch (M) {
    case 1: chunk<1>(x, w, y, lo, hi, N, K); break;
    case 2: chunk<2>(x, w, y, lo, hi, N, K); break;
    case 3: chunk<3>(x, w, y, lo, hi, N, K); break;
    case 4: chunk<4>(x, w, y, lo, hi, N, K); break;
    case 5: chunk<5>(x, w, y, lo, hi, N, K); break;
    case 6: chunk<6>(x, w, y, lo, hi, N, K); break;
    case 7: chunk<7>(x, w, y, lo, hi, N, K); break;
    case 8: chunk<8>(x, w, y, lo, hi, N, K); break;
  }
}

struct Work {
  int64_t M, N, K, chunk_rows, num_chunks;
  const float* x;
  const float* w;
  float* y;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Takes chunks until none is left.
  void drain() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < num_chunks;) {
      const int64_t lo = c * chunk_rows, hi = std::min(N, lo + chunk_rows);
      run_chunk(M, x, w, y, lo, hi, N, K);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

constexpr int64_t kMaxRows = 8;
constexpr int64_t kChunkBytes = 128 * 1024;  // of w per chunk

ffi::Error SmallMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("small_matmul: x [M, K] and w [N, K] expected");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (M < 1 || M > kMaxRows)
    return ffi::Error::InvalidArgument("small_matmul: 1 <= M <= 8 rows expected");
  auto work = std::make_shared<Work>();
  work->M = M, work->N = N, work->K = K;
  work->chunk_rows = std::max<int64_t>(1, kChunkBytes / (K * int64_t{sizeof(float)}));
  work->num_chunks = (N + work->chunk_rows - 1) / work->chunk_rows;
  work->x = x.typed_data(), work->w = w.typed_data(), work->y = y->typed_data();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->num_chunks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  // Chunks taken by helpers may still be running: wait for them (none is left to take).
  while (work->done.load(std::memory_order_acquire) < work->num_chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RelfSmallMatmul, SmallMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
