// Calls the maskedbranch ops through the dispatcher, as any libtorch program would, and
// checks them against values worked out by hand. Runs on the CPU, and on the GPU too when
// the library has CUDA kernels and a GPU is visible. Exit status 0 means every check passed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <cstdio>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace {

int failures = 0;
int checks = 0;

#define EXPECT(cond, msg)                                                            \
  do {                                                                               \
    ++checks;                                                                        \
    if (!(cond)) {                                                                   \
      ++failures;                                                                    \
      std::ostringstream os_;                                                        \
      os_ << msg;                                                                    \
      std::fprintf(stderr, "  FAILED %s:%d: %s\n    %s\n", __FILE__, __LINE__, #cond, \
                   os_.str().c_str());                                               \
    }                                                                                \
  } while (0)

// Exact comparison on the host (the expected values are small integers and halves, which
// every dtype used here represents exactly).
void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  auto g = got.cpu();
  bool same = g.sizes() == want.sizes() && g.scalar_type() == want.scalar_type() && at::equal(g, want);
  EXPECT(same, what << ": got\n" << g << "\nexpected\n" << want);
}

at::Tensor longs(std::vector<int64_t> v) { return at::tensor(v, at::kLong); }

using Plan = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

Plan plan(const at::Tensor& gate, int64_t num_branches) {
  static auto handle = op("maskedbranch::plan").typed<Plan(const at::Tensor&, int64_t)>();
  return handle.call(gate, num_branches);
}

std::vector<at::Tensor> gather(const at::Tensor& x, const at::Tensor& rows, const std::optional<at::Tensor>& weights,
                               std::vector<int64_t> counts) {
  static auto handle = op("maskedbranch::gather")
                           .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                          const std::optional<at::Tensor>&, c10::SymIntArrayRef)>();
  return handle.call(x, rows, weights, c10::fromIntArrayRefSlow(counts));
}

at::Tensor combine(const std::optional<at::Tensor>& base, at::TensorList ys,
                   const std::optional<at::Tensor>& weights, const Plan& p) {
  static auto handle =
      op("maskedbranch::combine")
          .typed<at::Tensor(const std::optional<at::Tensor>&, at::TensorList, const std::optional<at::Tensor>&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return handle.call(base, ys, weights, std::get<2>(p), std::get<3>(p), std::get<4>(p));
}

using CombineWeightsBackward = at::Tensor(const at::Tensor&, at::TensorList, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&);

at::Tensor combine_weights_backward(const at::Tensor& grad, at::TensorList ys, const Plan& p) {
  static auto handle = op("maskedbranch::combine_weights_backward").typed<CombineWeightsBackward>();
  return handle.call(grad, ys, std::get<2>(p), std::get<3>(p), std::get<4>(p));
}

// ---- the checks -------------------------------------------------------------------------------

// Branch ids [1, 0, 1, -1, 0] over 3 branches: branch 0 serves rows 1 and 4, branch 1 rows 0
// and 2, branch 2 nothing, row 3 no branch.
void test_plan_ids(const at::Device& dev) {
  auto p = plan(longs({1, 0, 1, -1, 0}).to(dev), 3);
  auto [offsets, rows, row_offsets, row_branch, row_pos] = p;
  EXPECT(offsets.device().is_cpu(), "offsets must live on the host, got " << offsets.device());
  EXPECT(rows.device() == dev, "rows must live on the gate's device, got " << rows.device());
  expect_equal(offsets, longs({0, 2, 4, 4}), "plan(ids).offsets");
  expect_equal(rows, longs({1, 4, 0, 2}), "plan(ids).rows");
  expect_equal(row_offsets, longs({0, 1, 2, 3, 3, 4}), "plan(ids).row_offsets");
  expect_equal(row_branch, longs({1, 0, 1, 0}), "plan(ids).row_branch");
  expect_equal(row_pos, longs({2, 0, 3, 1}), "plan(ids).row_pos");
  // int32 ids give the same plan.
  expect_equal(std::get<1>(plan(at::tensor({1, 0, 1, -1, 0}, at::kInt).to(dev), 3)), longs({1, 4, 0, 2}),
               "plan(int32 ids).rows");
}

// A weighted mask [[0.5, 0, 2], [0, 0, 0], [1, 1, 0]].
void test_plan_mask(const at::Device& dev) {
  auto gate = at::tensor({0.5f, 0.f, 2.f, 0.f, 0.f, 0.f, 1.f, 1.f, 0.f}).view({3, 3}).to(dev);
  auto [offsets, rows, row_offsets, row_branch, row_pos] = plan(gate, 3);
  expect_equal(offsets, longs({0, 2, 3, 4}), "plan(mask).offsets");
  expect_equal(rows, longs({0, 2, 2, 0}), "plan(mask).rows");
  expect_equal(row_offsets, longs({0, 2, 2, 4}), "plan(mask).row_offsets");
  expect_equal(row_branch, longs({0, 2, 0, 1}), "plan(mask).row_branch");
  expect_equal(row_pos, longs({0, 3, 1, 2}), "plan(mask).row_pos");
  auto bool_plan = plan(gate.ne(0), 3);
  expect_equal(std::get<1>(bool_plan), longs({0, 2, 2, 0}), "plan(bool mask).rows");
}

// x[b] = [10 b, 10 b + 1] routed by ids [1, 0, 1, -1, 0].
at::Tensor rows_x(const at::Device& dev) {
  return at::tensor({0.f, 1.f, 10.f, 11.f, 20.f, 21.f, 30.f, 31.f, 40.f, 41.f}).view({5, 2}).to(dev);
}

void test_gather(const at::Device& dev) {
  auto p = plan(longs({1, 0, 1, -1, 0}).to(dev), 3);
  auto parts = gather(rows_x(dev), std::get<1>(p), std::nullopt, {2, 2, 0});
  EXPECT(parts.size() == 3, "gather returned " << parts.size() << " tensors");
  if (parts.size() != 3) return;
  expect_equal(parts[0], at::tensor({10.f, 11.f, 40.f, 41.f}).view({2, 2}), "gather[0]");
  expect_equal(parts[1], at::tensor({0.f, 1.f, 20.f, 21.f}).view({2, 2}), "gather[1]");
  expect_equal(parts[2], at::empty({0, 2}), "gather[2]");
  EXPECT(!parts[1].is_view() && parts[0].data_ptr() != parts[1].data_ptr(), "gather: the parts share memory");
  // Weighted by weights[row, branch]: combine's backward with respect to the branch outputs.
  auto w = at::tensor({0.f, 2.f, 0.f, 0.5f, 0.f, 0.f, 0.f, 4.f, 0.f, 0.f, 0.f, 0.f, 1.f, 0.f, 0.f}).view({5, 3});
  auto scaled = gather(rows_x(dev), std::get<1>(p), w.to(dev), {2, 2, 0});
  expect_equal(scaled[0], at::tensor({5.f, 5.5f, 40.f, 41.f}).view({2, 2}), "gather(weights)[0]");
  expect_equal(scaled[1], at::tensor({0.f, 2.f, 80.f, 84.f}).view({2, 2}), "gather(weights)[1]");
}

void test_combine(const at::Device& dev) {
  auto p = plan(longs({1, 0, 1, -1, 0}).to(dev), 3);
  auto opts = at::TensorOptions().dtype(at::kFloat).device(dev);
  auto y0 = at::tensor({20.f, 22.f, 80.f, 82.f}).view({2, 2}).to(dev);   // rows 1, 4
  auto y1 = at::tensor({0.f, -1.f, -20.f, -21.f}).view({2, 2}).to(dev);  // rows 0, 2
  auto y2 = at::empty({0, 2}, opts);                                     // no rows
  auto base = at::full({5, 2}, 100.f, opts);
  expect_equal(combine(base, {y0, y1, y2}, std::nullopt, p),
               at::tensor({100.f, 99.f, 120.f, 122.f, 80.f, 79.f, 100.f, 100.f, 180.f, 182.f}).view({5, 2}),
               "combine(base, ids)");
  // gather's backward: the parts' gradients summed back to rows (row 3: no branch, zeros).
  expect_equal(combine(std::nullopt, gather(rows_x(dev), std::get<1>(p), std::nullopt, {2, 2, 0}), std::nullopt, p),
               rows_x(at::kCPU) * at::tensor({1.f, 1.f, 1.f, 0.f, 1.f}).view({5, 1}), "combine(gather(x))");

  // Weighted: out[0] = 0.5 * 1 + 2 * 4, out[1] = 0 (no base, no branch), out[2] = 1 * 2 + 1 * 3.
  auto gate = at::tensor({0.5f, 0.f, 2.f, 0.f, 0.f, 0.f, 1.f, 1.f, 0.f}).view({3, 3}).to(dev);
  auto pm = plan(gate, 3);
  auto z0 = at::tensor({1.f, 2.f}).view({2, 1}).to(dev);  // rows 0, 2
  auto z1 = at::tensor({3.f}).view({1, 1}).to(dev);       // row 2
  auto z2 = at::tensor({4.f}).view({1, 1}).to(dev);       // row 0
  expect_equal(combine(std::nullopt, {z0, z1, z2}, gate, pm), at::tensor({8.5f, 0.f, 5.f}).view({3, 1}),
               "combine(weights)");
  // The weights' gradient: <grad[b], z_i[...]> at live entries, zero elsewhere, in float32.
  auto grad = at::tensor({1.f, 10.f, 100.f}).view({3, 1}).to(dev);
  expect_equal(combine_weights_backward(grad, {z0, z1, z2}, pm),
               at::tensor({1.f, 0.f, 4.f, 0.f, 0.f, 0.f, 200.f, 300.f, 0.f}).view({3, 3}), "combine_weights_backward");
  expect_equal(combine_weights_backward(grad.to(at::kHalf), {z0.to(at::kHalf), z1.to(at::kHalf), z2.to(at::kHalf)}, pm),
               at::tensor({1.f, 0.f, 4.f, 0.f, 0.f, 0.f, 200.f, 300.f, 0.f}).view({3, 3}),
               "combine_weights_backward(half) is float32");
}

template <typename Error>
void expect_throws(const std::function<void()>& fn, const std::string& needle, const std::string& what) {
  try {
    fn();
    EXPECT(false, what << ": no error was raised");
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    EXPECT(dynamic_cast<const Error*>(&e) != nullptr, what << ": raised the wrong c10::Error subclass: " << msg);
    EXPECT(msg.find(needle) != std::string::npos, what << ": message lacks '" << needle << "': " << msg);
  }
}

void test_errors(const at::Device& dev) {
  expect_throws<c10::IndexError>([&] { plan(longs({0, 3}).to(dev), 3); }, "gate: branch id 3 at row 1 is out of range",
                                 "plan(id 3 of 3 branches)");
  expect_throws<c10::IndexError>([&] { plan(longs({-2}).to(dev), 3); }, "out of range", "plan(id -2)");
  expect_throws<c10::ValueError>([&] { plan(at::zeros({2, 4}).to(dev), 3); }, "[B, 3]",
                                 "plan(mask with 4 columns for 3 branches)");
  expect_throws<c10::TypeError>([&] { plan(at::zeros({2}).to(dev), 3); }, "integer", "plan(float ids)");
  auto p = plan(longs({1, 0, 1, -1, 0}).to(dev), 3);
  expect_throws<c10::TypeError>(
      [&] { gather(at::empty({5, 2}, at::TensorOptions().dtype(at::kFloat8_e4m3fn).device(dev)), std::get<1>(p),
                   std::nullopt, {2, 2, 0}); },
      "x: expected float64, float32, float16 or bfloat16, got Float8_e4m3fn", "gather(float8 x)");
  expect_throws<c10::ValueError>([&] { gather(rows_x(dev), std::get<1>(p), std::nullopt, {2, 1, 0}); },
                                 "counts: they add up to 3 rows but rows holds 4", "gather(bad counts)");
  if (!dev.is_cpu()) return;  // hand-made plans trip device asserts on a GPU (tests/test_ops_checks.py)
  expect_throws<c10::IndexError>([&] { gather(at::zeros({2, 2}), longs({5}), std::nullopt, {1}); },
                                 "rows: entry 0 = 5 is out of range [0, 2)", "gather(row 5 of 2)");
  // A plan that ends before its last entry (would drop it silently without the check).
  Plan short_plan{longs({0, 2}), longs({0, 1}), longs({0, 1, 1}), longs({0, 0}), longs({0, 1})};
  expect_throws<c10::ValueError>([&] { combine(std::nullopt, {at::ones({2, 1})}, std::nullopt, short_plan); },
                                 "row_offsets: expected to run from 0 to 2, got 0 to 1", "combine(short row_offsets)");
}

// A build without CUDA kernels answers the CUDA dispatch key with a clear error (here reached
// by redispatching host tensors to it, so no GPU is needed).
void test_cuda_key(const at::Device& dev) {
  static auto with_cuda = op("maskedbranch::with_cuda").typed<bool()>();
#ifdef MASKEDBRANCH_WITH_CUDA
  EXPECT(with_cuda.call(), "with_cuda() is false in a CUDA build");
#else
  EXPECT(!with_cuda.call(), "with_cuda() is true in a CPU-only build");
  if (!dev.is_cpu()) return;
  static auto handle = op("maskedbranch::plan").typed<Plan(const at::Tensor&, int64_t)>();
  expect_throws<c10::Error>([&] { handle.redispatch(c10::DispatchKeySet(c10::DispatchKey::CUDA), longs({0}), 1); },
                            "maskedbranch::plan: this maskedbranch build has no CUDA kernels", "plan on the CUDA key");
#endif
}

// The CPU kernels fork onto torch's threads (the library is compiled with OpenMP when torch's
// parallel backend is OpenMP; without it ATen's parallel_for runs every kernel on one thread).
void test_cpu_threads(const at::Device& dev) {
  if (!dev.is_cpu()) return;
  static auto threads = op("maskedbranch::cpu_kernel_threads").typed<int64_t()>();
  const int before = at::get_num_threads();
  for (int n : {1, 2, 3}) {
    at::set_num_threads(n);
    EXPECT(threads.call() == n, "cpu_kernel_threads() = " << threads.call() << " at " << n << " threads");
  }
  at::set_num_threads(before);
}

void run_all(const at::Device& dev) {
  const std::vector<std::pair<const char*, void (*)(const at::Device&)>> tests = {
      {"plan_ids", test_plan_ids},
      {"plan_mask", test_plan_mask},
      {"gather", test_gather},
      {"combine", test_combine},
      {"errors", test_errors},
      {"cuda_key", test_cuda_key},
      {"cpu_threads", test_cpu_threads},
  };
  for (const auto& [name, fn] : tests) {
    const int before = failures;
    try {
      fn(dev);
    } catch (const std::exception& e) {
      ++failures;
      std::fprintf(stderr, "  FAILED %s: unexpected exception: %s\n", name, e.what());
    }
    std::printf("[%s] %-22s %s\n", dev.str().c_str(), name, failures == before ? "ok" : "FAILED");
  }
}

}  // namespace

int main() {
  // The library registers its ops when it is loaded; a missing schema means it was not linked.
  if (!c10::Dispatcher::singleton().findSchema({"maskedbranch::plan", ""}).has_value()) {
    std::fprintf(stderr, "maskedbranch ops are not registered (is libmaskedbranch linked/loaded?)\n");
    return 1;
  }
  run_all(at::Device(at::kCPU));
#ifdef MASKEDBRANCH_WITH_CUDA
  if (torch::cuda::is_available()) {
    run_all(at::Device(at::kCUDA, 0));
  } else {
    std::printf("no GPU visible: CUDA kernels not exercised\n");
  }
#endif
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
