// Int8 products for x86 CPUs with AVX2: each row of x quantized to 8 bits by its own
// largest magnitude, multiplied by int8 weights in exact int32 sums, rescaled to float32.
// See int8_rows.py for why and where it is used.
//
// transduce::int8_rows_linear(x, weight, weight_scale, bias, relu)
//   x (M, K) float32, contiguous;
//   weight (Np, Kp) int8, contiguous: N output channels' rows padded with zeros to Kp
//   columns (K <= Kp < K + 32, a multiple of 32) and Np rows (N <= Np < N + 4, a multiple
//   of 4), laid out in blocks of four channels interleaved by 32 columns (interleave());
//   weight_scale (N,) float32; bias (N,) float32 or None; relu: max(0, .) of the result
//   -> (M, N) float32: y[r, j] = float(sum_k q[r, k] w[j, k]) * (s[r] * weight_scale[j])
//   (+ bias[j]), where s[r] = max(max_k |x[r, k]|, FLT_MIN) / 127 and
//   q[r, k] = round-half-even(x[r, k] / s[r]) in [-127, 127].
//
// The sums are exact, so a row's result depends on that row alone: never on the other
// rows of the call, the tiles that computed it, or the threads. Built without
// -ffast-math and with -ffp-contract=off, so that the quantization and the rescaling are
// the IEEE operations written here (the tests repeat them in PyTorch, bit for bit).
//
// AVX2 has no instruction that sums u8 x s8 products in int32 (VNNI's vpdpbusd):
// vpmaddubsw sums pairs of them in int16, saturating past 32,767. Multiplying |q| (u8)
// by w carrying q's sign (vpsignb) keeps each pair within 2 x 127 x 127 = 32,258, so the
// rows take 8 bits where oneDNN's AVX2 kernels must give them 7.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kStep = 32;      // int8 values in one AVX2 register
constexpr int kRows = 2;           // a tile: rows x channels, each sum in a register
constexpr int kChannels = 4;
constexpr int64_t kPrefetch = 1024; // bytes of a block's weights read ahead

// One row of K floats -> Kp int8 values (zeros past K); returns its scale.
float quantize_row(const float* x, int64_t K, int64_t Kp, int8_t* values) {
  float largest = 0.f;
  for (int64_t k = 0; k < K; ++k) largest = std::max(largest, std::fabs(x[k]));
  const float scale = std::max(largest, FLT_MIN) / 127.f;
  for (int64_t k = 0; k < K; ++k) {
    const float q = std::nearbyint(x[k] / scale);              // round half to even
    values[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  std::fill(values + K, values + Kp, int8_t{0});
  return scale;
}

inline int32_t horizontal_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// The exact sums of R rows' values (row stride Kp) times a block of four channels'
// interleaved weights: sums[r * kChannels + c]. Each weight register serves the R rows,
// and the block is read in one stream (four streams of a row each read from memory at
// a third of the speed: 5 against 14 GB/s for float32's products at one row).
template <int R>
void dot_tile(const int8_t* values, const int8_t* weights, int64_t Kp, int32_t* sums) {
  constexpr int C = kChannels;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_si256();
  for (int64_t k = 0; k < Kp; k += kStep) {
    _mm_prefetch(reinterpret_cast<const char*>(weights + k * C + kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(weights + k * C + kPrefetch + 64), _MM_HINT_T0);
    __m256i v[R], magnitude[R];
    for (int r = 0; r < R; ++r) {
      v[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + r * Kp + k));
      magnitude[r] = _mm256_abs_epi8(v[r]);
    }
    for (int c = 0; c < C; ++c) {
      const __m256i w = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(weights + k * C + c * kStep));
      for (int r = 0; r < R; ++r) {
        // |q| * (w with q's sign): q * w, pairs summed in int16 without saturating
        const __m256i pairs = _mm256_maddubs_epi16(magnitude[r], _mm256_sign_epi8(w, v[r]));
        acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r * kChannels + c] = horizontal_sum(acc[r][c]);
}

// The sums of `rows` rows (at most kRows) times a block of four channels.
void dot_block(const int8_t* values, const int8_t* weights, int64_t Kp, int64_t rows,
               int32_t* sums) {
  if (rows == kRows) {
    dot_tile<kRows>(values, weights, Kp, sums);
  } else {
    for (int64_t r = 0; r < rows; ++r)
      dot_tile<1>(values + r * Kp, weights, Kp, sums + r * kChannels);
  }
}

at::Tensor int8_rows_linear(const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& weight_scale, const c10::optional<at::Tensor>& bias,
                            bool relu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
              x.device().is_cpu(), "int8_rows_linear: x must be (M, K) float32, contiguous");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_rows_linear: weight must be (Np, Kp) int8, contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight_scale.numel();
  const int64_t Np = weight.size(0), Kp = weight.size(1);
  TORCH_CHECK(Kp % kStep == 0 && Kp >= K && Kp - K < kStep,
              "int8_rows_linear: the weight's rows must be x's width padded to a multiple of ",
              kStep, " (x has ", K, ", the weight ", Kp, ")");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.dim() == 1 &&
              weight_scale.is_contiguous() && Np % kChannels == 0 && Np >= N &&
              Np - N < kChannels,
              "int8_rows_linear: weight_scale must be (N,) float32, for the weight's ", Np,
              " rows padded to a multiple of ", kChannels, " (it has ", N, ")");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == N &&
                                    bias->is_contiguous()),
              "int8_rows_linear: bias must be (N,) float32");
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  auto values = at::empty({M, Kp}, x.options().dtype(at::kChar));
  std::vector<float> scales(M);
  const float* xp = x.data_ptr<float>();
  int8_t* vp = values.data_ptr<int8_t>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) scales[r] = quantize_row(xp + r * K, K, Kp, vp + r * Kp);
  });
  float* op = out.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = weight_scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t blocks = Np / kChannels;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    int32_t sums[kRows * kChannels];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t j0 = b * kChannels, channels = std::min<int64_t>(kChannels, N - j0);
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, M - r0);
        dot_block(vp + r0 * Kp, wp + j0 * Kp, Kp, rows, sums);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < channels; ++c) {
            float y = static_cast<float>(sums[r * kChannels + c]) * (scales[r0 + r] * sp[j0 + c]);
            if (bp != nullptr) y = y + bp[j0 + c];
            op[(r0 + r) * N + j0 + c] = relu ? std::max(y, 0.f) : y;
          }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(transduce, m) {
  m.def("int8_rows_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, "
        "bool relu) -> Tensor");
}

TORCH_LIBRARY_IMPL(transduce, CPU, m) {
  m.impl("int8_rows_linear", &int8_rows_linear);
}
