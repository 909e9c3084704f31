// Fused CPU scans for the stabilizers whose token selection dominates their cost (M2PO, BAPO).
//
// Eager PyTorch pays a full pass over the [B, T] batch for every elementwise op, and the selection
// steps (which tokens lie in the trust region, above a threshold, outside a clip interval) take
// several. Each function here makes those decisions row by row in passes over a row that stays in
// L1: a pass the compiler vectorises (no branches), fp64 row sums over fixed lanes (their order is
// fixed, so results do not depend on the machine's vector width), and a scalar look only into the
// 16-token blocks that hold a selected token, which are few. Single-threaded and deterministic.
// On x86-64 each scan is also compiled for AVX2 and picked at load time by the CPU it runs on (no
// -march, so one build serves every machine that shares the cache); without FMA contraction or
// reassociation both versions give the same bits.
//
// Every comparison is made in fp32, on the same fp32 values the torch path in algorithms/ compares,
// so both paths select the same tokens; sums are fp64 (the torch path's are fp32 per row, then fp64).
// The callers in algorithms/native.py check shapes, dtypes and devices; these functions trust them.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define SCAN_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SCAN_CLONES
#endif
#define SCAN_INLINE inline __attribute__((always_inline))

namespace {

constexpr int64_t kBlock = 16;
constexpr int kLanes = 8;

// fp64 sum of a row of fp32 values in kLanes fixed lanes: lane j sums the values at j, j + 8, ...
SCAN_INLINE double lane_sum(const float* values, int64_t n) {
  double lanes[kLanes] = {};
  const int64_t whole = n - n % kLanes;
  for (int64_t t = 0; t < whole; t += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += static_cast<double>(values[t + j]);
  }
  for (int64_t j = 0; j < n - whole; ++j) lanes[j] += static_cast<double>(values[whole + j]);
  double total = 0.0;
  for (int j = 0; j < kLanes; ++j) total += lanes[j];
  return total;
}

// Whether any of the n flags (0/1) is set; n <= kBlock.
SCAN_INLINE bool any_set(const int32_t* flags, int64_t n) {
  int32_t count = 0;
  for (int64_t j = 0; j < n; ++j) count += flags[j];
  return count > 0;
}

SCAN_INLINE float sign_of(float value) { return value > 0.f ? 1.f : (value < 0.f ? -1.f : 0.f); }

// A 1-D tensor holding a copy of `values`.
template <typename T>
torch::Tensor to_tensor(const std::vector<T>& values) {
  const auto dtype = torch::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  return torch::from_blob(const_cast<T*>(values.data()), {static_cast<int64_t>(values.size())}, dtype).clone();
}

}  // namespace

// M2PO's trust region: tokens where sign(A) * l > 0 hold (log r)^2 = l * l (fp32); all others 0.
// Returns how many tokens the region has, the fp64 sum of its values, and the values above
// `threshold` with their flat indices, in flat order. A row whose advantage is 0 (or NaN) has none.
SCAN_CLONES std::tuple<int64_t, double, torch::Tensor, torch::Tensor> m2po_region_scan(
    const torch::Tensor& log_ratio, const torch::Tensor& advantages, double threshold) {
  const int64_t rows = log_ratio.size(0), cols = log_ratio.size(1);
  const float* l = log_ratio.data_ptr<float>();
  const float* a = advantages.data_ptr<float>();
  const float cut = static_cast<float>(threshold);
  std::vector<float> m2(cols), values;
  std::vector<int32_t> above(cols);
  std::vector<int64_t> index;
  int64_t n_region = 0;
  double total = 0.0;
  for (int64_t b = 0; b < rows; ++b) {
    const float s = sign_of(a[b]);
    if (s == 0.f) continue;
    const float* row = l + b * cols;
    int32_t count = 0;
    for (int64_t t = 0; t < cols; ++t) {
      const float v = s * row[t];
      const float w = v > 0.f ? v : 0.f;
      m2[t] = w * w;
      count += v > 0.f;
      above[t] = m2[t] > cut;
    }
    n_region += count;
    total += lane_sum(m2.data(), cols);
    for (int64_t start = 0; start < cols; start += kBlock) {
      const int64_t n = std::min(kBlock, cols - start);
      if (!any_set(above.data() + start, n)) continue;
      for (int64_t t = start; t < start + n; ++t) {
        if (above[t]) {
          values.push_back(m2[t]);
          index.push_back(b * cols + t);
        }
      }
    }
  }
  return {n_region, total, to_tensor(values), to_tensor(index)};
}

// BAPO's movers: the tokens the narrowest clip clips, i.e. l > log_high where A > 0 and l < log_low
// or l > log_c where A < 0 (pass log_c = inf without dual clip). Returns their flat indices, their
// ratios, their bucket keys (see algorithms/bapo.py), the fp64 bucket sums of ratio * |A|, the ratio
// with every mover zeroed ([B, T], the stayers), and the fp64 sums of the stayers' ratio * A over
// A > 0 (pos) and of their ratio * |A| over A < 0 (neg).
// `log_highs` and `log_lows` are the walk's fp32 log bounds; `dual_clip_below_lows` says that
// log_c lies below the last of `log_lows`, where a negative mover above it never counts.
SCAN_CLONES std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double, double>
bapo_movers(
    const torch::Tensor& log_ratio, const torch::Tensor& ratio, const torch::Tensor& advantages, double log_low,
    double log_high, double log_c, const torch::Tensor& log_highs, const torch::Tensor& log_lows,
    bool dual_clip_below_lows) {
  const int64_t rows = log_ratio.size(0), cols = log_ratio.size(1);
  const float* l = log_ratio.data_ptr<float>();
  const float* r = ratio.data_ptr<float>();
  const float* a = advantages.data_ptr<float>();
  const float* highs = log_highs.data_ptr<float>();
  const float* lows = log_lows.data_ptr<float>();
  const int64_t n_highs = log_highs.numel(), n_lows = log_lows.numel();
  const float low = static_cast<float>(log_low), high = static_cast<float>(log_high), c = static_cast<float>(log_c);
  torch::Tensor stayers = torch::empty_like(ratio);
  float* kept_rows = stayers.data_ptr<float>();
  std::vector<float> movers_ratio;
  std::vector<int32_t> moves(cols);
  std::vector<int64_t> index, key;
  std::vector<double> buckets(n_highs + n_lows + 2, 0.0);
  double pos = 0.0, neg = 0.0;
  for (int64_t b = 0; b < rows; ++b) {
    const float s = sign_of(a[b]);
    const float* row = l + b * cols;
    const float* row_ratio = r + b * cols;
    float* kept = kept_rows + b * cols;
    if (s == 0.f) {  // no token of the row can move, and it adds to neither side
      std::copy(row_ratio, row_ratio + cols, kept);
      continue;
    }
    const float lo = s > 0.f ? -INFINITY : low;
    const float hi = s > 0.f ? high : c;
    for (int64_t t = 0; t < cols; ++t) {
      moves[t] = (row[t] < lo) | (row[t] > hi);
      kept[t] = moves[t] ? 0.f : row_ratio[t];
    }
    const double row_sum = lane_sum(kept, cols);
    if (s > 0.f) {
      pos += row_sum * static_cast<double>(a[b]);
    } else {
      neg -= row_sum * static_cast<double>(a[b]);
    }
    const float magnitude = s * a[b];
    for (int64_t start = 0; start < cols; start += kBlock) {
      const int64_t n = std::min(kBlock, cols - start);
      if (!any_set(moves.data() + start, n)) continue;
      for (int64_t t = start; t < start + n; ++t) {
        if (!moves[t]) continue;
        int64_t k = 0;
        if (s > 0.f) {  // counts from highs[k] on: the number of bounds below l
          for (int64_t i = 0; i < n_highs; ++i) k += highs[i] < row[t];
        } else if (dual_clip_below_lows && row[t] > c) {
          k = n_lows + n_highs + 1;  // above the dual clip: never counts
        } else {  // counts for the first k lows: the number of bounds at or below l
          for (int64_t i = 0; i < n_lows; ++i) k += lows[i] <= row[t];
          k += n_highs + 1;
        }
        index.push_back(b * cols + t);
        movers_ratio.push_back(row_ratio[t]);
        key.push_back(k);
        buckets[k] += static_cast<double>(row_ratio[t] * magnitude);
      }
    }
  }
  return {to_tensor(index), to_tensor(movers_ratio), to_tensor(key), to_tensor(buckets), stayers, pos, neg};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("m2po_region_scan", &m2po_region_scan, "M2PO trust-region count, sum and values above a threshold");
  module.def("bapo_movers", &bapo_movers, "BAPO movers, their bucket keys and sums, and the stayers' sums");
}
