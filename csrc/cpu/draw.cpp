// keep_draw: the residual drop paths' Bernoulli(keep_prob) draws on the host, as an op that
// torch.compile keeps opaque and in program order.
//
// Eager mode draws with torch.empty(n).bernoulli_(keep_prob) from torch's default CPU generator
// (the stream timm's per-sample mask uses). Traced, that random op would be replaced by the
// compiler's own random stream; this op runs the same draw, so compiled and eager runs see the
// same masks for the same seed. `order` is a token every draw mutates: the mutation chains the
// draws of one graph in program order (a compiler may reorder independent ops), and the tag
// keeps two draws from being merged.
//
// keep_prob is a 0-d float64 CPU tensor, not a `float`: under torch.compile a drop rate that
// changes between calls (per-block rates across recompiles of one frame, a schedule) becomes a
// symbolic float, and a `float` argument of an op is specialized to its value while the graph
// is traced, a value that the FX graph / AOTAutograd caches then reuse for other rates (the graph
// is the same for every rate): blocks drew with another block's rate. As a tensor the rate stays
// data: one graph serves every rate, and the draw reads it here.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace maskedbranch {
namespace {

at::Tensor keep_draw(at::Tensor& order, int64_t n, const at::Tensor& keep_prob_t) {
  TORCH_CHECK_VALUE(n >= 0, "keep_draw: n must be non-negative, got ", n);
  TORCH_CHECK_VALUE(keep_prob_t.device().is_cpu() && keep_prob_t.numel() == 1 && keep_prob_t.scalar_type() == at::kDouble,
                    "keep_draw: keep_prob must be a one-element float64 CPU tensor");
  const double keep_prob = keep_prob_t.item<double>();
  TORCH_CHECK_VALUE(keep_prob >= 0.0 && keep_prob <= 1.0, "keep_draw: keep_prob must lie in [0, 1], got ", keep_prob);
  TORCH_CHECK_VALUE(order.device().is_cpu() && order.numel() == 1, "keep_draw: order must be a one-element CPU tensor");
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kFloat)).bernoulli_(keep_prob);
  order.add_(1);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(maskedbranch, m) {
  // n Bernoulli(keep_prob) draws (float32 0/1, on the host) from torch's default CPU generator.
  m.def("keep_draw(Tensor(a!) order, int n, Tensor keep_prob) -> Tensor", {at::Tag::nondeterministic_seeded});
}

TORCH_LIBRARY_IMPL(maskedbranch, CPU, m) { m.impl("keep_draw", &keep_draw); }

}  // namespace maskedbranch
