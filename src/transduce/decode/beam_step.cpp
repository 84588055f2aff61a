// One step of beam search's choice in one call: search.best_extensions' operators (the
// log-softmax, the scores' addition, the 2K best extensions of each sentence, which of
// them go on and in which slot) for rows of a few sentences, where PyTorch's two dozen
// small operators cost far more in dispatch than in arithmetic.
//
// The log-softmax is ATen's own call, and each candidate is the same float addition, so
// the values are search.best_extensions' to the bit; equal candidates rank by position
// (beam, then token), which torch.topk leaves open.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;   // candidates tested against the threshold at once

// The `count` best of n candidates row[i] + score, best first, ties by position.
// values and positions hold `count` entries; filled says how many are set.
struct Best {
  float* values;
  int64_t* positions;
  int64_t count;
  int64_t filled = 0;

  void offer(float value, int64_t position) {
    if (filled == count && !(value > values[count - 1])) return;
    int64_t slot = std::min(filled, count - 1);
    while (slot > 0 && values[slot - 1] < value) {      // after every equal or better one
      values[slot] = values[slot - 1];
      positions[slot] = positions[slot - 1];
      --slot;
    }
    values[slot] = value;
    positions[slot] = position;
    filled = std::min(filled + 1, count);
  }
};

// Whether any of the kBlock candidates row[j] + score beats the threshold.
inline bool any_above(const float* row, float score, float threshold) {
#ifdef __AVX512F__
  const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(row), _mm512_set1_ps(score));
  return _mm512_cmp_ps_mask(sum, _mm512_set1_ps(threshold), _CMP_GT_OQ) != 0;
#else
  int any = 0;
  for (int64_t j = 0; j < kBlock; ++j) any |= (row[j] + score > threshold);
  return any != 0;
#endif
}

// row (V,) + score: every candidate offered, blocks wholly below the threshold skipped.
void scan(Best& best, const float* row, float score, int64_t vocab, int64_t offset) {
  int64_t t = 0;
  for (; t + kBlock <= vocab; t += kBlock) {
    if (best.filled == best.count && !any_above(row + t, score, best.values[best.count - 1]))
      continue;
    for (int64_t j = 0; j < kBlock; ++j) best.offer(row[t + j] + score, offset + t + j);
  }
  for (; t < vocab; ++t) best.offer(row[t] + score, offset + t);
}

// search._stable_slots for one sentence: source_beam (K,) -> order (K,): slot s gets
// kept candidate order[s]. A beam's first candidate keeps the beam's slot; the others
// take the free slots in rank order.
void stable_slots(const int64_t* source_beam, int64_t beam, int64_t* order) {
  std::vector<char> claimed(beam, 0);
  for (int64_t i = 0; i < beam; ++i) claimed[source_beam[i]] = 1;
  std::vector<int64_t> free_slots;
  for (int64_t p = 0; p < beam; ++p) if (!claimed[p]) free_slots.push_back(p);
  for (int64_t p = 0; p < beam; ++p) if (claimed[p]) free_slots.push_back(p);
  int64_t later = 0;
  for (int64_t i = 0; i < beam; ++i) {
    bool first = true;
    for (int64_t j = 0; j < i; ++j) first = first && source_beam[j] != source_beam[i];
    int64_t slot = first ? source_beam[i] : free_slots[later++];
    order[slot] = i;
  }
}

}  // namespace

// logits (A * K, V), scores (A, K) float32, eos_ids (E,) int64 ->
// top_scores (A, 2K), top_beam, top_token (A, 2K) int64, is_eos (A, 2K) bool,
// next_scores (A, K), next_beam, next_token (A, K) int64: search.Extensions.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
beam_extensions(const at::Tensor& logits, const at::Tensor& scores, int64_t beam,
                const at::Tensor& eos_ids) {
  TORCH_CHECK(logits.dim() == 2 && scores.dim() == 2 && scores.size(1) == beam &&
              logits.size(0) == scores.size(0) * beam,
              "beam_extensions: logits (A * K, V) and scores (A, K) expected");
  TORCH_CHECK(scores.scalar_type() == at::kFloat, "beam_extensions: float32 scores expected");
  TORCH_CHECK(eos_ids.scalar_type() == at::kLong && eos_ids.dim() == 1,
              "beam_extensions: eos_ids (E,) int64 expected");
  const at::Tensor log_probs = at::log_softmax(logits, -1, at::kFloat).contiguous();
  const at::Tensor score = scores.contiguous();
  const at::Tensor eos = eos_ids.contiguous();
  const int64_t sentences = scores.size(0), vocab = logits.size(1), wide = 2 * beam;
  TORCH_CHECK(beam * vocab >= wide, "beam_extensions: fewer candidates than 2 * beam");
  const auto longs = scores.options().dtype(at::kLong);
  at::Tensor top_scores = at::empty({sentences, wide}, scores.options());
  at::Tensor top_beam = at::empty({sentences, wide}, longs);
  at::Tensor top_token = at::empty({sentences, wide}, longs);
  at::Tensor is_eos = at::empty({sentences, wide}, scores.options().dtype(at::kBool));
  at::Tensor next_scores = at::empty({sentences, beam}, scores.options());
  at::Tensor next_beam = at::empty({sentences, beam}, longs);
  at::Tensor next_token = at::empty({sentences, beam}, longs);

  const float* lp = log_probs.data_ptr<float>();
  const float* sc = score.data_ptr<float>();
  const int64_t* eos_id = eos.data_ptr<int64_t>();
  const int64_t eos_count = eos.numel();
  float* ts = top_scores.data_ptr<float>();
  int64_t* tb = top_beam.data_ptr<int64_t>();
  int64_t* tt = top_token.data_ptr<int64_t>();
  bool* te = is_eos.data_ptr<bool>();
  float* ns = next_scores.data_ptr<float>();
  int64_t* nb = next_beam.data_ptr<int64_t>();
  int64_t* nt = next_token.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (beam * vocab));
  at::parallel_for(0, sentences, grain, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> position(wide), keep(beam), source(beam), order(beam);
    for (int64_t a = begin; a < end; ++a) {
      Best best{ts + a * wide, position.data(), wide};
      for (int64_t k = 0; k < beam; ++k)
        scan(best, lp + (a * beam + k) * vocab, sc[a * beam + k], vocab, k * vocab);
      int64_t kept = 0;
      for (int64_t r = 0; r < wide; ++r) {
        const int64_t token = position[r] % vocab;
        tb[a * wide + r] = position[r] / vocab;
        tt[a * wide + r] = token;
        te[a * wide + r] = std::find(eos_id, eos_id + eos_count, token) != eos_id + eos_count;
        if (!te[a * wide + r] && kept < beam) keep[kept++] = r;
      }
      for (int64_t r = 0; r < wide && kept < beam; ++r)    // too few go on: eos ones too
        if (te[a * wide + r]) keep[kept++] = r;
      for (int64_t i = 0; i < beam; ++i) source[i] = tb[a * wide + keep[i]];
      stable_slots(source.data(), beam, order.data());
      for (int64_t s = 0; s < beam; ++s) {
        const int64_t r = keep[order[s]];
        ns[a * beam + s] = ts[a * wide + r];
        nb[a * beam + s] = tb[a * wide + r];
        nt[a * beam + s] = tt[a * wide + r];
      }
    }
  });
  return {top_scores, top_beam, top_token, is_eos, next_scores, next_beam, next_token};
}

TORCH_LIBRARY_FRAGMENT(transduce, m) {
  m.def("beam_extensions(Tensor logits, Tensor scores, int beam, Tensor eos_ids) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(transduce, CPU, m) {
  m.impl("beam_extensions", &beam_extensions);
}
