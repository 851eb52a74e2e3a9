// A linear layer on a CPU for a few rows: y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), float32,
// the weight in its plain row-major layout, for the M = 1..32 rows of a decode step.
//
// Built beside the decode attention by kernels/cpu_native.py; `x @ w.T + b` is its oracle. At so
// few rows the step is bound by reading the weight from memory once: each thread takes whole
// groups of 5 weight rows (4 for a single row), which stay in L1 while every row of x passes
// over them, 2 at a time: per step along K, 5 weight vectors held in registers and 2 of x feed
// 10 accumulators (16 vector registers on AVX2; 3 rows of x by 4 read each weight vector again
// per row, load-bound). Every weight byte is read from memory once and in order, which the
// hardware prefetcher follows. oneDNN's blocked layout read ~1.4x slower than this at M = 1 on
// an AVX2 EPYC (docs/cpu_avx.md). The vector width is the build's: 16 floats where the variant
// has AVX-512, 8 otherwise.

#include <cstdint>
#include <cstring>

namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}

inline float lane_sum(Vec v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// MR rows of x (stride K) against NR rows of w (stride K): y[i * ldy + j], plus bias[j].
template <int MR, int NR>
inline void tile(const float* x, const float* w, const float* bias, float* y, int64_t K,
                 int64_t ldy) {
  Vec acc[MR][NR] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) {
      wv[j] = load(w + j * K + k);
      if constexpr (MR > 1) asm("" : "+v"(wv[j]));  // in a register, not re-read per row
    }
    for (int i = 0; i < MR; ++i) {
      Vec xv = load(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] += wv[j] * xv;
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = lane_sum(acc[i][j]) + (bias ? bias[j] : 0.0f);
      for (int64_t t = k; t < K; ++t) s += x[i * K + t] * w[j * K + t];
      y[i * ldy + j] = s;
    }
  }
}

// Every row of x against weight rows n .. n + NR - 1.
template <int NR>
void weight_rows(const float* x, const float* w, const float* bias, float* y, int64_t M,
                 int64_t N, int64_t K, int64_t n) {
  const float* b = bias ? bias + n : nullptr;
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) tile<2, NR>(x + m * K, w + n * K, b, y + m * N + n, K, N);
  if (M - m == 1) tile<1, NR>(x + m * K, w + n * K, b, y + m * N + n, K, N);
}

// Groups of NR weight rows across the threads, then the rows left over.
template <int NR>
void each_group(const float* x, const float* w, const float* bias, float* y, int64_t M,
                int64_t N, int64_t K) {
  const int64_t groups = N / NR;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) weight_rows<NR>(x, w, bias, y, M, N, K, NR * g);
  for (int64_t n = NR * groups; n < N; ++n) weight_rows<1>(x, w, bias, y, M, N, K, n);
}

}  // namespace

extern "C" {

// x [M, K], w [N, K], bias [N] or null, y [M, N]: all contiguous float32. Returns 0.
int pagedserve_small_linear(const float* x, const float* w, const float* bias, float* y,
                            int64_t M, int64_t N, int64_t K) {
  if (M == 1) {
    each_group<4>(x, w, bias, y, M, N, K);
  } else {
    each_group<5>(x, w, bias, y, M, N, K);
  }
  return 0;
}

}  // extern "C"
