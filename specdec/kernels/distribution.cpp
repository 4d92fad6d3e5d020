// Reductions of logits over the vocabulary, a row at a time.
//
// argmax_rows: the index of each row's first maximum, as torch.argmax gives it (a NaN counts as
// the maximum), in one vectorized pass for the maximum and a scan that stops at it, several times
// faster than PyTorch's argmax over a vocabulary.
//
// draft_distribution: what a head's training keeps of the target's distribution at each position
// (training/heads.py's target views): the most likely token of the whole vocabulary, and the k
// most likely tokens of the draft vocabulary with their probabilities under the softmax over the
// whole vocabulary. One pass a row for the maximum, one for the sum of exp(x - max), one over the
// draft tokens for the k best (a small heap), where PyTorch's argmax, softmax, gather and top-k
// each made a [positions, vocabulary] pass or copy. reference.py has both in PyTorch, bit for bit.

#include "pool.h"
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {

// The largest value of x[0 .. n) (n >= 1) and the first index holding it; with a NaN in the row,
// NaN and the first NaN's index, as torch.argmax.
__attribute__((target("avx2,fma")))
std::pair<float, int64_t> first_max(const float* x, int64_t n) {
    __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        top = _mm256_max_ps(top, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    float m = *std::max_element(lanes, lanes + 8);
    bool any_nan = _mm256_movemask_ps(nan) != 0;
    for (; i < n; ++i) {
        m = std::max(m, x[i]);
        any_nan = any_nan || std::isnan(x[i]);
    }
    int64_t at = 0;
    if (any_nan) {
        while (!std::isnan(x[at])) ++at;
        return {x[at], at};
    }
    const __m256 target = _mm256_set1_ps(m);
    for (; at + 8 <= n; at += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + at), target, _CMP_EQ_OQ));
        if (hits) return {m, at + __builtin_ctz(hits)};
    }
    while (x[at] != m) ++at;
    return {m, at};
}

// The sum of exp(x - m) over x[0 .. n), in 8 lanes (simd.h's exponential), then folded.
__attribute__((target("avx2,fma")))
double sum_exp(const float* x, int64_t n, float m) {
    __m256 total = _mm256_setzero_ps();
    const __m256 shift = _mm256_set1_ps(m);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) total = _mm256_add_ps(total, specdec::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift)));
    double sum = specdec::horizontal_sum(total);
    for (; i < n; ++i) sum += std::exp(static_cast<double>(x[i]) - m);
    return sum;
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "x must be [rows, n] float32 with n >= 1");
    specdec::require_avx2();
    const at::Tensor xc = x.contiguous();
    const int64_t rows = xc.size(0), n = xc.size(1);
    auto out = at::empty({rows}, at::kLong);
    const float* xp = xc.data_ptr<float>();
    int64_t* op = out.data_ptr<int64_t>();
    // A row is a few microseconds: split only passes of many rows.
    specdec::parallel_chunks(rows, 8, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) op[r] = first_max(xp + r * n, n).second;
    });
    return out;
}

std::vector<at::Tensor> draft_distribution(const at::Tensor& logits, const at::Tensor& draft_ids, int64_t k) {
    TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be [positions, vocab] float32");
    TORCH_CHECK(draft_ids.dim() == 1 && draft_ids.scalar_type() == at::kLong, "draft_ids must be [draft] int64");
    const int64_t rows = logits.size(0), vocab = logits.size(1), draft = draft_ids.size(0);
    TORCH_CHECK(vocab > 0 && k >= 1 && k <= draft, "need 1 <= k <= the draft tokens and a vocabulary");
    specdec::require_avx2();
    const at::Tensor x = logits.contiguous(), ids = draft_ids.contiguous();
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t j = 0; j < draft; ++j) TORCH_CHECK(id[j] >= 0 && id[j] < vocab, "a draft token is outside the vocabulary");
    auto top = at::empty({rows}, at::kLong);
    auto index = at::empty({rows, k}, at::kLong);
    auto values = at::empty({rows, k}, at::kFloat);
    const float* xp = x.data_ptr<float>();
    int64_t* tp = top.data_ptr<int64_t>();
    int64_t* ip = index.data_ptr<int64_t>();
    float* vp = values.data_ptr<float>();
    specdec::parallel_chunks(rows, 4, [&](int64_t begin, int64_t end) {
        // The k best draft positions so far, as a heap whose front is the worst of them: a lower
        // logit, or the same logit at a later draft position (ties go to the earlier one).
        using Entry = std::pair<float, int64_t>;
        auto better = [](const Entry& a, const Entry& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
        std::vector<Entry> heap;
        heap.reserve(k);
        for (int64_t r = begin; r < end; ++r) {
            const float* row = xp + r * vocab;
            const auto [m, at] = first_max(row, vocab);
            const double normalizer = m + std::log(sum_exp(row, vocab, m));
            heap.clear();
            for (int64_t j = 0; j < draft; ++j) {
                const Entry e{row[id[j]], j};
                if (static_cast<int64_t>(heap.size()) < k) {
                    heap.push_back(e);
                    std::push_heap(heap.begin(), heap.end(), better);
                } else if (better(e, heap.front())) {
                    std::pop_heap(heap.begin(), heap.end(), better);
                    heap.back() = e;
                    std::push_heap(heap.begin(), heap.end(), better);
                }
            }
            std::sort(heap.begin(), heap.end(), better);  // best first
            tp[r] = at;
            for (int64_t i = 0; i < k; ++i) {
                ip[r * k + i] = heap[i].second;
                vp[r * k + i] = static_cast<float>(std::exp(static_cast<double>(heap[i].first) - normalizer));
            }
        }
    });
    return {top, index, values};
}
