// The block formats' own operations (formats: quant_formats.h): rows dequantized
// (`dequantize`, the embedding lookup), Q5_0 repacked at load into Q5_0R, each format's block
// size and bytes, and the checks of a weight's and activations' shapes. Declared in quant.h
// and quant_formats.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant.h"
#include "quant_formats.h"
#include "quant_paths.h"

namespace vserve_quant {

int64_t block_size(int64_t qtype) {
  return with_format(qtype, [](auto fmt) -> int64_t { return decltype(fmt)::kBlock; });
}

int64_t block_bytes(int64_t qtype) {
  return with_format(qtype, [](auto fmt) -> int64_t { return decltype(fmt)::kBytes; });
}

void check_weight(const at::Tensor& data, int64_t qtype, int64_t k) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 2 &&
              data.is_contiguous(), "weight data must be a contiguous CPU uint8 [N, row_bytes]");
  TORCH_CHECK(qtype != kQ5_0R || vserve_quant::q5_0r_supported(),
              "Q5_0R weights need the quad gemv (AVX512-VNNI, VBMI and BITALG)");
  int64_t block = block_size(qtype);
  TORCH_CHECK(k > 0 && k % block == 0, "k = ", k, " must be a positive multiple of ", block);
  TORCH_CHECK(data.size(1) == k / block * block_bytes(qtype), "row_bytes ", data.size(1),
              " does not match k = ", k, " for GGML type ", qtype);
}

void check_activations(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k && x.is_contiguous() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a contiguous CPU fp32 or bf16 [M, K] with K = ", k);
}

void check_out_dtype(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be fp32 or bf16");
}

// at least ~64 KB of weight per thread: smaller slices cost more to start than to stream
int64_t row_grain(int64_t row_bytes) { return std::max<int64_t>(1, (64 << 10) / row_bytes); }

at::Tensor dequantize(const at::Tensor& data, int64_t qtype, int64_t k, at::ScalarType dtype) {
  check_weight(data, qtype, k);
  check_out_dtype(dtype);
  int64_t n = data.size(0), row_bytes = data.size(1);
  auto out = at::empty({n, k}, data.options().dtype(dtype));
  const uint8_t* d = data.data_ptr<uint8_t>();
  at::parallel_for(0, n, row_grain(row_bytes), [&](int64_t lo, int64_t hi) {
    if (dtype == at::kFloat)
      dequant_rows(d, qtype, k, row_bytes, nullptr, lo, hi, out.data_ptr<float>() + lo * k);
    else
      dequant_rows(d, qtype, k, row_bytes, nullptr, lo, hi, out.data_ptr<bf16>() + lo * k);
  });
  return out;
}

at::Tensor embedding(const at::Tensor& data, int64_t qtype, int64_t k, const at::Tensor& ids,
                     at::ScalarType dtype) {
  check_weight(data, qtype, k);
  check_out_dtype(dtype);
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1,
              "ids must be a CPU int64 [T]");
  auto idc = ids.contiguous();
  int64_t t = idc.size(0), n = data.size(0), row_bytes = data.size(1);
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "id ", ip[i], " out of range [0, ", n, ")");
  auto out = at::empty({t, k}, data.options().dtype(dtype));
  const uint8_t* d = data.data_ptr<uint8_t>();
  at::parallel_for(0, t, std::max<int64_t>(1, 16384 / k), [&](int64_t lo, int64_t hi) {
    if (dtype == at::kFloat)
      dequant_rows(d, qtype, k, row_bytes, ip, lo, hi, out.data_ptr<float>() + lo * k);
    else
      dequant_rows(d, qtype, k, row_bytes, ip, lo, hi, out.data_ptr<bf16>() + lo * k);
  });
  return out;
}

bool q5_0r_supported() {
#if defined(QUANT_VNNI) && defined(QUANT_QUADS)
  return true;
#else
  return false;
#endif
}

at::Tensor repack_q5_0(const at::Tensor& data, int64_t k) {
  check_weight(data, kQ5_0, k);
  TORCH_CHECK(q5_0r_supported(), "repack_q5_0: this build's gemv does not read Q5_0R");
  TORCH_CHECK(k % Q5_0R::kBlock == 0, "repack_q5_0: K = ", k, " is not a multiple of 128");
  const int64_t n = data.size(0), quads = n * (k / Q5_0R::kBlock);
  auto out = at::empty({n, k / Q5_0R::kBlock * Q5_0R::kBytes}, data.options());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, quads, 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t q = lo; q < hi; ++q) {
      const uint8_t* b = src + q * 4 * Q5_0::kBytes;  // (rows are whole quads)
      uint8_t* o = dst + q * Q5_0R::kBytes;
      for (int i = 0; i < 4; ++i, b += Q5_0::kBytes) {
        std::memcpy(o + 16 * i, b + 6, 16);                   // nibbles
        std::memcpy(o + Q5_0R::kLowBits + 2 * i, b + 2, 2);   // fifth bits of weights 0-15
        std::memcpy(o + Q5_0R::kHighBits + 2 * i, b + 4, 2);  // of weights 16-31
        std::memcpy(o + Q5_0R::kScales + 2 * i, b, 2);        // d
      }
    }
  });
  return out;
}

at::Tensor q5_0_as_q8_0(const at::Tensor& data, int64_t k) {
  check_weight(data, kQ5_0, k);
  const int64_t n = data.size(0), blocks = n * (k / Q5_0::kBlock);
  auto out = at::empty({n, k / Q8_0::kBlock * Q8_0::kBytes}, data.options());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  // on the loading thread (the embedded model's 44 MB take milliseconds): a worker's thread
  // team is not started before its thread count and placement are set
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* b = src + i * Q5_0::kBytes;
    uint8_t* o = dst + i * Q8_0::kBytes;
    uint32_t high;
    std::memcpy(&high, b + 2, sizeof(high));
    std::memcpy(o, b, 2);  // d, as it is
    for (int j = 0; j < 16; ++j) {  // weight j: low nibble of byte j, j + 16: its high one
      const int lo5 = (b[6 + j] & 15) | (((high >> j) & 1) << 4);
      const int hi5 = (b[6 + j] >> 4) | (((high >> (j + 16)) & 1) << 4);
      o[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(lo5 - 16));
      o[18 + j] = static_cast<uint8_t>(static_cast<int8_t>(hi5 - 16));
    }
  }
  return out;
}

bool supported_qtype(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: case kQ5_0: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: return true;
    case kQ5_0R: return q5_0r_supported();
  }
  return false;
}

int64_t row_bytes_of(int64_t qtype, int64_t k) {
  return k % block_size(qtype) == 0 ? k / block_size(qtype) * block_bytes(qtype) : -1;
}

}  // namespace vserve_quant
