// One decoding step's attention on a CPU: every (row, kv head) reads only its own range
// of a cache's keys. See one_query.py for why and how it is built.
//
// transduce::one_query_attention(q, k, v, starts, ends, scale)
//   q (B, Hkv, G, D) float32: the G queries that share a kv head (GQA's group);
//   k, v (B, Hkv, T, D) float32, unit stride along D (views of a cache's buffers);
//   starts, ends (B,) int64: row b attends keys [starts[b], ends[b]), 0 <= s <= e <= T
//   -> (B, Hkv, G, D): softmax(q k^T * scale) v over those keys; zeros where s == e.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// The G queries of one (row, kv head) against keys [0, n) of `keys`/`values` (row
// stride `kt` / `vt`): scores, their softmax, then the weighted sum of the values. kD > 0
// fixes the head size at compile time (the loops over it unroll, the sums stay in
// registers); 0 reads it from `dim`.
template <int64_t kD>
void attend_range(const float* __restrict__ queries, const float* __restrict__ keys,
                  const float* __restrict__ values, int64_t n, int64_t kt, int64_t vt,
                  int64_t G, int64_t dim, float scale, std::vector<float>& scores,
                  float* __restrict__ out) {
  const int64_t D = kD > 0 ? kD : dim;
  if (n <= 0 || kD == 0) std::fill(out, out + G * D, 0.f);   // kD > 0 sums in registers
  if (n <= 0) return;
  scores.resize(G * n);
  for (int64_t t = 0; t < n; ++t) {              // each key is read once for all G queries
    const float* key = keys + t * kt;
    for (int64_t g = 0; g < G; ++g) {
      const float* query = queries + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += query[d] * key[d];
      scores[g * n + t] = dot * scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores.data() + g * n;
    const float largest = *std::max_element(row, row + n);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < n; ++t) {
      row[t] = expf(row[t] - largest);
      total += row[t];
    }
    const float inverse = 1.f / total;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) row[t] *= inverse;
  }
  for (int64_t g = 0; g < G; ++g) {
    const float* weights = scores.data() + g * n;
    float fixed[kD > 0 ? kD : 1] = {};
    float* sum = kD > 0 ? fixed : out + g * D;
    for (int64_t t = 0; t < n; ++t) {
      const float* value = values + t * vt;
      const float w = weights[t];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) sum[d] += w * value[d];
    }
    if (kD > 0) std::copy(fixed, fixed + D, out + g * D);
  }
}

using RangeFn = void (*)(const float*, const float*, const float*, int64_t, int64_t,
                         int64_t, int64_t, int64_t, float, std::vector<float>&, float*);

RangeFn for_head_size(int64_t D) {
  switch (D) {
    case 32: return &attend_range<32>;
    case 64: return &attend_range<64>;
    case 128: return &attend_range<128>;
    default: return &attend_range<0>;
  }
}

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
           const at::Tensor& starts, const at::Tensor& ends) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4,
                "one_query_attention: q, k and v must be 4-d float32 CPU tensors");
  }
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
                  q.size(3) == k.size(3),
              "one_query_attention: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(),
              " must be (B, Hkv, G, D), (B, Hkv, T, D), (B, Hkv, T, D)");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1,
              "one_query_attention: k and v need unit stride along D");
  for (const at::Tensor* t : {&starts, &ends}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == q.size(0),
                "one_query_attention: starts and ends must be int64 (B,), B = ", q.size(0));
  }
  const int64_t* s = starts.data_ptr<int64_t>();
  const int64_t* e = ends.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(0 <= s[b] && s[b] <= e[b] && e[b] <= k.size(2), "one_query_attention: row ",
                b, " reads keys [", s[b], ", ", e[b], ") of ", k.size(2));
  }
}

at::Tensor one_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& starts, const at::Tensor& ends,
                               double scale) {
  const at::Tensor s = starts.contiguous(), e = ends.contiguous();
  check(q, k, v, s, e);
  const at::Tensor queries = q.contiguous();
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  at::Tensor out = at::empty({B, H, G, D}, q.options());
  const float* qp = queries.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* ep = e.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const RangeFn attend = for_head_size(D);
  // Tasks of at least 2^15 multiply-adds over the widest row's keys: a thread woken
  // for less costs more than it saves.
  int64_t widest = 1;
  for (int64_t b = 0; b < B; ++b) widest = std::max(widest, ep[b] - sp[b]);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (2 * G * D * widest));
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, first = sp[b];
      attend(qp + bh * G * D, kp + b * k.stride(0) + h * k.stride(1) + first * k.stride(2),
             vp + b * v.stride(0) + h * v.stride(1) + first * v.stride(2),
             ep[b] - first, k.stride(2), v.stride(2), G, D,
             static_cast<float>(scale), scores, op + bh * G * D);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(transduce, m) {
  m.def("one_query_attention(Tensor q, Tensor k, Tensor v, Tensor starts, Tensor ends, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(transduce, CPU, m) {
  m.impl("one_query_attention", &one_query_attention);
}
