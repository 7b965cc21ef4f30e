// The extension's Python module: the bindings of every translation unit of vserve/cpu_ops
// (built into one extension by vserve/cpu_ops/__init__.py, whose docstring maps the files),
// and the decoder layer's glue to Python: the all-reduce a tensor-parallel rank calls back.
// The only file that includes torch's pybind11 glue; the others include ATen alone. Not
// torch/extension.h: it adds the C++ frontend (torch::nn and the rest), which this file does
// not use, and doubles its compile time (40 s here against 23 s).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "decode.h"
#include "layer_rows.h"
#include "park.h"
#include "quant.h"
#include "sample.h"

namespace {

// linear(i, x) from product(i, x, bias). One rank (`all_reduce` None): every linear whole,
// its bias in the product. A tensor-parallel rank: qkv and gate_up (0, 2) are
// column-parallel, whole; o and down (1, 3) are row-parallel: their partial products are
// summed by `all_reduce` (called back with the GIL held), then their bias is added.
template <class Product>
auto row_parallel(const Product& product, const std::vector<std::optional<at::Tensor>>& biases,
                  const py::object& all_reduce) {
  return [&product, &biases, &all_reduce](int i, const at::Tensor& x) {
    if (i == 0 || i == 2 || all_reduce.is_none()) return product(i, x, biases[i]);
    auto y = all_reduce(product(i, x, std::nullopt)).template cast<at::Tensor>();
    return biases[i].has_value() && biases[i]->defined() ? y + *biases[i] : y;
  };
}

// decoder_layer on the 4 linears' weights[i] and plain[i] (each its own bias), as
// linear_fn(x, weights[i], plain[i], bias) takes them: packed bf16 (linear) or GGUF blocks
// (quant_linear). `all_reduce`: None on one rank; on one tensor-parallel rank's shard (its
// heads and MLP columns: its num_heads / num_kv_heads, o and down row-parallel) the model's
// TPComm.all_reduce, which sums o's and down's partial products (called back with the GIL
// held, as the per-op RowParallelLinear calls it) before their biases are added; the norms
// and residuals that follow (Gemma's post-attention and post-feedforward norms too) see the
// summed output.
template <class W, class P,
          at::Tensor (*linear_fn)(const at::Tensor&, const W&, const P&,
                                  const std::optional<at::Tensor>&)>
at::Tensor decoder_layer_of(const at::Tensor& h, const std::vector<W>& weights,
                            const std::vector<P>& plain,
                            const std::vector<std::optional<at::Tensor>>& biases,
                            const std::vector<at::Tensor>& norms, const at::Tensor& kv_cache,
                            const at::Tensor& slots, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& cos,
                            const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t window, double scale, double softcap,
                            double eps, int64_t style, int64_t act, const py::object& all_reduce) {
  TORCH_CHECK(weights.size() == 4 && plain.size() == 4 && biases.size() == 4,
              "decoder_layer: 4 linears");
  auto product = [&](int i, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
    return linear_fn(x, weights[i], plain[i], bias);
  };
  return vserve_decode::layer(h, row_parallel(product, biases, all_reduce), norms, kv_cache,
                              slots, block_tables, seq_lens, cos, sin, num_heads, num_kv_heads,
                              head_dim, window, scale, softcap, eps, style, act);
}

}  // namespace

// decoder_layer on packed bf16 weights: packed (oneDNN) for several rows, plain (row-major
// [N, K]) for gemv
constexpr auto decoder_layer =
    &decoder_layer_of<at::Tensor, at::Tensor, vserve_decode::linear>;

// decoder_layer on GGUF-block weights: parts[i] / qtypes[i] are the i-th linear's parts as
// QuantLinear holds them
constexpr auto decoder_layer_q =
    &decoder_layer_of<std::vector<at::Tensor>, std::vector<int64_t>, vserve_decode::quant_linear>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &vserve_decode::rms_norm);
  m.def("rotary", &vserve_decode::rotary);
  m.def("act_mul", &vserve_decode::act_mul);
  m.def("decode_attention", &vserve_decode::decode_attention);
  m.def("decoder_layer", decoder_layer);
  m.def("gemv", &vserve_decode::gemv);
  m.def("linear", &vserve_decode::linear);
  m.def("shared_linear", &vserve_decode::shared_linear);
  m.def("decoder_layer_q", decoder_layer_q);
  m.def(
      "parked",
      [](const py::function& fn) {
        py::object out;  // the GIL stays with this thread: the parked ones never take it
        vserve_park::run_parked(at::get_num_threads(), [&] { out = fn(); });
        return out;
      },
      "fn() with the other threads of torch's OpenMP pool asleep (park.h)");
  m.def("unpark", &vserve_park::unpark,
        "from inside parked(fn): the parked threads wake now and spin until fn returns");
  using vserve_layer::DecodeStackApi;
  py::class_<DecodeStackApi>(m, "DecodeStack")
      .def(py::init(&vserve_layer::make_decode_stack))
      .def("add_layer", &DecodeStackApi::add_layer)
      .def("run", &DecodeStackApi::run, py::call_guard<py::gil_scoped_release>())
      .def_static("_fail_chunks", &vserve_layer::set_stack_fail_chunks);
  auto quant = m.def_submodule("quant", "GGUF block-format kernels (quant_*.cpp)");
  quant.def("dequantize", &vserve_quant::dequantize, py::arg("data"), py::arg("qtype"),
            py::arg("k"), py::arg("dtype") = at::kFloat);
  quant.def("gemv", &vserve_quant::gemv, py::arg("x"), py::arg("data"), py::arg("qtype"),
            py::arg("k"));
  quant.def("matmul", &vserve_quant::matmul, py::arg("x"), py::arg("data"), py::arg("qtype"),
            py::arg("k"));
  quant.def("amx_gemm", &vserve_quant::amx_gemm);
  quant.def("q5_0r_supported", &vserve_quant::q5_0r_supported);
  quant.def("repack_q5_0", &vserve_quant::repack_q5_0, py::arg("data"), py::arg("k"));
  quant.def("q5_0_as_q8_0", &vserve_quant::q5_0_as_q8_0, py::arg("data"), py::arg("k"));
  quant.def("int8_gemv", &vserve_quant::int8_gemv);
  quant.def("int8_activations", &vserve_quant::int8_activations, py::arg("dtype"));
  quant.def("gemv_avx2", &vserve_quant::gemv_avx2_checked, py::arg("x"), py::arg("data"),
            py::arg("qtype"), py::arg("k"));
  quant.def("gemm_avx2", &vserve_quant::gemm_avx2_checked, py::arg("x"), py::arg("data"),
            py::arg("qtype"), py::arg("k"));
  quant.def("embedding", &vserve_quant::embedding, py::arg("data"), py::arg("qtype"),
            py::arg("k"), py::arg("ids"), py::arg("dtype") = at::kFloat);
  quant.def(
      "set_options",
      [](std::optional<bool> exact, std::optional<bool> amx) {
        const vserve_quant::Options now = vserve_quant::options();
        vserve_quant::set_options({exact.value_or(now.exact), amx.value_or(now.amx)});
      },
      py::kw_only(), py::arg("exact") = std::nullopt, py::arg("amx") = std::nullopt,
      "the options of quant.h (each left out: unchanged); vserve/cpu_ops/__init__.py sets them "
      "once at load from vserve/envs.py");
  quant.def("options", [] {
    const vserve_quant::Options now = vserve_quant::options();
    return py::dict(py::arg("exact") = now.exact, py::arg("amx") = now.amx);
  });
  auto sample = m.def_submodule("sample", "fused sampling over the vocabulary (sample.cpp)");
  sample.def("sample", &vserve_sample::sample);
  sample.def("logprobs", &vserve_sample::logprobs);
  sample.def("argmax", &vserve_sample::argmax);
  sample.def("exp_for_test", &vserve_sample::exp_for_test);
}
