// The test library's ops: the CUDA ops of csrc/cuda, run on CPU tensors by the emulation, under
// their own namespace (maskedbranch_cuda_emu) so that they sit beside the CPU kernels of the
// real library; and the emulation's controls for the tests.
#include <torch/library.h>

#include <string>
#include <vector>

#include "../../csrc/cuda/ops.h"
#include "cuda_emulation.h"

namespace {

mbemu::Schedule schedule_named(const std::string& name) {
  if (name == "parallel") return mbemu::Schedule::Parallel;
  if (name == "forward") return mbemu::Schedule::Forward;
  if (name == "reverse") return mbemu::Schedule::Reverse;
  if (name == "shuffled") return mbemu::Schedule::Shuffled;
  TORCH_CHECK_VALUE(false, "schedule: expected parallel, forward, reverse or shuffled, got '", name, "'");
  return mbemu::Schedule::Parallel;
}

void set_schedule(const std::string& name, int64_t seed) {
  mbemu::set_schedule(schedule_named(name), static_cast<uint64_t>(seed));
}

// -1 keeps the device's limit.
void set_limits(int64_t grid_blocks, int64_t int32_plan_entries) {
  auto& l = mbemu::limits();
  l = mbemu::Limits{};
  if (grid_blocks >= 0) l.grid_blocks = std::max<int64_t>(1, grid_blocks);
  if (int32_plan_entries >= 0) l.int32_plan_entries = int32_plan_entries;
}

// One line per kernel instantiation the library can launch: name, launches, blocks, threads.
std::vector<std::string> kernels() {
  std::vector<std::string> out;
  for (const auto* k : mbemu::kernel_records()) {
    out.push_back(k->name + "\t" + std::to_string(k->launches) + "\t" + std::to_string(k->blocks) + "\t" +
                  std::to_string(k->threads));
  }
  return out;
}

}  // namespace

namespace mbemu_selftest {
void selftest(const std::string& name, const at::Tensor& out);
}

TORCH_LIBRARY(maskedbranch_cuda_emu, m) {
  // The schemas of csrc/maskedbranch.cpp (test_emu_layer.py checks that they stay equal).
  m.def("plan(Tensor gate, int num_branches) -> "
        "(Tensor offsets, Tensor rows, Tensor row_offsets, Tensor row_branch, Tensor row_pos)");
  m.def("gather(Tensor x, Tensor rows, Tensor? weights, SymInt[] counts) -> Tensor[]");
  m.def("combine(Tensor? base, Tensor[] ys, Tensor? weights, Tensor row_offsets, Tensor row_branch, "
        "Tensor row_pos) -> Tensor");
  m.def("combine_weights_backward(Tensor grad, Tensor[] ys, Tensor row_offsets, Tensor row_branch, "
        "Tensor row_pos) -> Tensor");
  m.def("pick(Tensor[] tensors, Tensor index, int branches) -> Tensor[]");
  m.def("pick_backward(Tensor[] grads, Tensor index, int branches) -> Tensor[]");
  m.def("put_(Tensor(a!)[] tensors, Tensor index, int branches, Tensor[] values) -> ()");
  m.def("set_schedule(str name, int seed) -> ()", &set_schedule);
  m.def("set_limits(int grid_blocks, int int32_plan_entries) -> ()", &set_limits);
  m.def("kernels() -> str[]", &kernels);
  m.def("selftest(str name, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(maskedbranch_cuda_emu, CPU, m) {
  m.impl("plan", &maskedbranch::cuda::plan_cuda);
  m.impl("gather", &maskedbranch::cuda::gather_cuda);
  m.impl("combine", &maskedbranch::cuda::combine_cuda);
  m.impl("combine_weights_backward", &maskedbranch::cuda::combine_weights_backward_cuda);
  m.impl("pick", &maskedbranch::cuda::pick_cuda);
  m.impl("pick_backward", &maskedbranch::cuda::pick_backward_cuda);
  m.impl("put_", &maskedbranch::cuda::put_cuda);
  m.impl("selftest", &mbemu_selftest::selftest);
}
