// Int8 products for x86 CPUs with AVX512-VNNI, giving the bits of Int8Linear's oneDNN
// path (int8.py): each row quantized to uint8 by its own largest magnitude, multiplied
// by int8 weights in exact int32 sums, rescaled to float32. See int8_vnni.py for why.
//
// transduce::int8_vnni_linear(x, weight, compensation, weight_scale, bias, relu)
//   x (..., K) float32, its M rows (M, K) below;
//   weight (Np / 64, Kp / 4, 64, 4) int8, contiguous: N output channels' rows padded with
//   zeros to Kp columns (a multiple of 4) and Np rows (a multiple of 64), each block of
//   64 channels laid out four columns at a time (layout());
//   compensation (N,) int32: 128 times the sum of each channel's weights;
//   weight_scale (N,) float32; bias (N,) float32 or None; relu: max(0, .) of the result
//   -> (..., N) float32, in the order of operations of Int8Linear.forward:
//     s[r] = max(max_k |x[r, k]|, FLT_MIN) / 127;
//     u[r, k] = round-half-even(x[r, k] / s[r]) + 128;
//     p[r, j] = float(sum_k u[r, k] w[j, k] - compensation[j]) * weight_scale[j];
//     y[r, j] = p[r, j] * s[r], or with a bias fma(p[r, j], s[r], bias[j]) (addcmul's
//     one rounding).
//
// The sums are exact, so a row's result depends on that row alone, never on the other
// rows of the call, the tiles that computed it or the threads; and each float operation
// is the one oneDNN and PyTorch's operators perform, so the result is theirs bit for bit
// (tested). Built without -ffast-math and with -ffp-contract=off for that.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;      // output channels a block: four registers of 16
constexpr int kRowsPerTile = 6;     // rows sharing each weight register
constexpr int kZeroPoint = 128;     // the rows' uint8 zero point (8 bits on a CPU with VNNI)
constexpr float kLevels = 127.f;

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)

// One row of K floats -> Kp uint8 values (zero point 128; zeros past K, whose weights are
// zero); returns its scale. The float operations are quantize_rows's, element by element.
float quantize_row(const float* x, int64_t K, int64_t Kp, uint8_t* values) {
  __m512 largest16 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    largest16 = _mm512_max_ps(largest16, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  float largest = _mm512_reduce_max_ps(largest16);
  for (; k < K; ++k) largest = std::max(largest, std::fabs(x[k]));
  const float scale = std::max(largest, FLT_MIN) / kLevels;
  const __m512 scale16 = _mm512_set1_ps(scale);
  const __m512i zero_point16 = _mm512_set1_epi32(kZeroPoint);
  k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), scale16),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(q), zero_point16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(values + k), _mm512_cvtepi32_epi8(u));
  }
  for (; k < K; ++k)
    values[k] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(x[k] / scale)) +
                                     kZeroPoint);
  std::memset(values + K, 0, Kp - K);
  return scale;
}

// R rows (row stride Kp) times one block of 64 channels: the exact sums, less the zero
// point's compensation, into sums[r][64]. Each weight register serves the R rows.
template <int R>
void dot_tile(const uint8_t* values, const int8_t* weights, int64_t Kp, int32_t* sums) {
  __m512i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_si512();
  for (int64_t k = 0; k < Kp; k += 4) {
    const int8_t* w = weights + k * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(w + 2048), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 2048 + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 2048 + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 2048 + 192), _MM_HINT_T0);
    __m512i w4[4];
    for (int c = 0; c < 4; ++c) w4[c] = _mm512_loadu_si512(w + c * 64);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, values + r * Kp + k, 4);
      const __m512i a = _mm512_set1_epi32(four);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], a, w4[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_si512(sums + r * kBlock + c * 16, acc[r][c]);
}

void dot_rows(const uint8_t* values, const int8_t* weights, int64_t Kp, int64_t rows,
              int32_t* sums) {
  switch (rows) {
    case 6: dot_tile<6>(values, weights, Kp, sums); break;
    case 5: dot_tile<5>(values, weights, Kp, sums); break;
    case 4: dot_tile<4>(values, weights, Kp, sums); break;
    case 3: dot_tile<3>(values, weights, Kp, sums); break;
    case 2: dot_tile<2>(values, weights, Kp, sums); break;
    default: dot_tile<1>(values, weights, Kp, sums); break;
  }
}

// One row's sums over channels [j0, j0 + channels) -> its outputs, in Int8Linear's order.
void rescale(const int32_t* sums, const int32_t* compensation, const float* weight_scale,
             const float* bias, float row_scale, bool relu, int64_t channels, float* out) {
  for (int64_t c = 0; c < channels; ++c) {
    const float product = static_cast<float>(sums[c] - compensation[c]) * weight_scale[c];
    // addcmul(bias, product, scale) rounds once: a fused multiply-add
    const float y = bias != nullptr ? std::fma(product, row_scale, bias[c]) : product * row_scale;
    out[c] = relu ? (y < 0.f ? 0.f : y) : y;   // relu_ keeps -0.0 and NaN as they are
  }
}

at::Tensor int8_vnni_linear(const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& compensation, const at::Tensor& weight_scale,
                            const c10::optional<at::Tensor>& bias, bool relu) {
  TORCH_CHECK(input.dim() >= 1 && input.scalar_type() == at::kFloat && input.device().is_cpu(),
              "int8_vnni_linear: x must be (..., K) float32 on the CPU");
  const at::Tensor x = input.reshape({-1, input.size(-1)}).contiguous();   // (M, K)
  TORCH_CHECK(weight.dim() == 4 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
              weight.size(2) == kBlock && weight.size(3) == 4,
              "int8_vnni_linear: weight must be (Np / 64, Kp / 4, 64, 4) int8, contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight_scale.numel();
  const int64_t blocks = weight.size(0), Kp = weight.size(1) * 4;
  TORCH_CHECK(Kp >= K && Kp - K < 4, "int8_vnni_linear: the weight's rows must be x's width "
              "padded to a multiple of 4 (x has ", K, ", the weight ", Kp, ")");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.dim() == 1 &&
              weight_scale.is_contiguous() && blocks * kBlock >= N && blocks * kBlock - N < kBlock,
              "int8_vnni_linear: weight_scale must be (N,) float32, for the weight's ",
              blocks * kBlock, " rows padded to a multiple of 64 (it has ", N, ")");
  TORCH_CHECK(compensation.scalar_type() == at::kInt && compensation.numel() == N &&
              compensation.is_contiguous(), "int8_vnni_linear: compensation must be (N,) int32");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == N &&
                                    bias->is_contiguous()),
              "int8_vnni_linear: bias must be (N,) float32");
  std::vector<int64_t> out_sizes = input.sizes().vec();
  out_sizes.back() = N;
  auto out = at::empty(out_sizes, x.options());                              // (..., N)
  if (M == 0 || N == 0) return out;
  // The quantized rows and their scales, in buffers the calling thread keeps: two
  // tensors allocated at every call cost about a microsecond, an eighth of a small call.
  thread_local std::vector<uint8_t> values;
  thread_local std::vector<float> scales;
  values.resize(M * Kp);
  scales.resize(M);
  const float* xp = x.data_ptr<float>();
  uint8_t* vp = values.data();
  float* sp = scales.data();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) sp[r] = quantize_row(xp + r * K, K, Kp, vp + r * Kp);
  });
  float* op = out.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const int32_t* cp = compensation.data_ptr<int32_t>();
  const float* wsp = weight_scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  // A task of at least 2^18 products (weights x rows): a thread woken for less costs
  // more than it saves (one row of 256 x 1,024 took 11.7 us on two threads, 8.9 on one).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (Kp * kBlock * M));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t sums[kRowsPerTile * kBlock];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t j0 = b * kBlock, channels = std::min<int64_t>(kBlock, N - j0);
      for (int64_t r0 = 0; r0 < M; r0 += kRowsPerTile) {
        const int64_t rows = std::min<int64_t>(kRowsPerTile, M - r0);
        dot_rows(vp + r0 * Kp, wp + b * Kp * kBlock, Kp, rows, sums);
        for (int64_t r = 0; r < rows; ++r)
          rescale(sums + r * kBlock, cp + j0, wsp + j0, bp == nullptr ? nullptr : bp + j0,
                  sp[r0 + r], relu, channels, op + (r0 + r) * N + j0);
      }
    }
  });
  return out;
}

#else

at::Tensor int8_vnni_linear(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const c10::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false, "int8_vnni_linear: built for a CPU without AVX512-VNNI");
}

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(transduce, m) {
  m.def("int8_vnni_linear(Tensor x, Tensor weight, Tensor compensation, Tensor weight_scale, "
        "Tensor? bias, bool relu) -> Tensor");
}

TORCH_LIBRARY_IMPL(transduce, CPU, m) {
  m.impl("int8_vnni_linear", &int8_vnni_linear);
}
