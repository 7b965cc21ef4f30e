// The bf16 GEMM on AMX tiles over GGUF blocks, more than 8 activation rows (formats:
// quant_formats.h; which rows it takes: kAmxMinRows, kAmxMaxRows in quant_paths.h).
//
// CPUs with a tile unit (Intel Sapphire Rapids and later) multiply 16 x 32 bf16 by 32 x 16
// bf16 into 16 x 16 fp32 in one tdpbf16ps. The int8 GEMM's per-block scaling cannot run on
// the tiles (a block's int32 sums must be scaled before the next block's are added), and
// measured it bounds an AMX int8 kernel to the VNNI one's speed. So here each thread
// dequantizes a tile of 32 weight rows to bf16 (dequant_row: each weight gguf's fp32 value
// rounded once) and multiplies it, as the tiles' first operand and untransposed, with every
// activation tile of 16 rows, paired once per call as the second operand reads them
// (pair_activations); the sums stay in the tiles over all of K and come out transposed
// (untranspose). The result is the exact path's
// (bf16 weights times bf16 activations, summed in fp32) up to the order of the sums; the tile
// unit flushes denormal inputs and outputs to zero.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "quant.h"
#include "quant_formats.h"
#include "quant_paths.h"
#include "quant_vnni.h"
#include "row_shares.h"

#ifdef QUANT_AMX

#include <immintrin.h>

namespace vserve_quant {

// Linux hands a process the tile state only on request (once; oneDNN asks the same)
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// the `amx` option (VSERVE_QUANT_AMX=0: tests compare both) keeps the int8 GEMM
bool amx_enabled() { return options().amx && amx_permitted(); }

}  // namespace vserve_quant

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: fp32 sums (activation tile i, output half g: 2i + g); 4, 5: activations
// [16 rows][32]; 6, 7: weights [16 input pairs][16 rows][2]. A thread's configuration is its
// own and oneDNN sets another between our calls: set at the start of each share.
void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// the next tile's row `row`, into L2 (a tile ahead, one row per row dequantized: measured, a
// burst of the whole next tile's lines per tile stalls on the CPU's fill buffers and streams
// the weight at a third of the bandwidth)
QUANT_INLINE void fetch_row(const uint8_t* w, int64_t row_bytes, int64_t row, int64_t n) {
  if (row >= n) return;
  const char* p = reinterpret_cast<const char*>(w + row * row_bytes);
  for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// weight rows n0 .. n0 + 32 (zeros past n) dequantized to bf16 into rows [32][K]
template <class F>
void dequant_tile(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t n0, int64_t k,
                  bf16* rows) {
  for (int i = 0; i < kTileN; ++i) {
    fetch_row(w, row_bytes, n0 + kTileN + i, n);
    if (n0 + i < n)
      dequant_row<F>(w + (n0 + i) * row_bytes, rows + i * k, k / F::kBlock);
    else
      std::memset(static_cast<void*>(rows + i * k), 0, k * sizeof(bf16));
  }
}

// x [M_pad][K] as the tiles' second operand: per tile of 16 activation rows, their pairs of
// inputs [K / 2][16][2] (one tile's operand is 1 KB in a row), a 16 x 16 transpose of pairs at
// a time (M_pad and K / 2 are multiples of 16)
void pair_activations(const bf16* x, int64_t m_pad, int64_t k, bf16* xt) {
  const int64_t pairs = k / 2;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(x);
  uint32_t* dst = reinterpret_cast<uint32_t*>(xt);
  for (int64_t m0 = 0; m0 < m_pad; m0 += 16)
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (m0 + i) * pairs + p0);
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (m0 / 16 * pairs + p0 + j) * 16, r[j]);
    }
}

// out_t[32 weight rows][16 MT] = rows [32][K] times activation tiles m0 / 16 .. of xt: the
// weight is the tiles' first operand, read as dequantized (no transpose), and the product
// comes out transposed
template <int MT>
void amx_bf16_micro(const bf16* rows, const bf16* xt, int64_t m0, int64_t k, float (*out_t)[32]) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (MT == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const bf16* x0 = xt + m0 * k;  // activation tile m0 / 16: [K / 2][16][2]
  for (int64_t c = 0; c < k / 32; ++c) {
    _tile_loadd(4, rows + 32 * c, 2 * k);
    _tile_loadd(5, rows + 16 * k + 32 * c, 2 * k);
    _tile_loadd(6, x0 + 512 * c, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT == 2) {
      _tile_loadd(7, x0 + 16 * k + 512 * c, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out_t[0], sizeof(out_t[0]));
  _tile_stored(2, out_t[16], sizeof(out_t[0]));
  if constexpr (MT == 2) {
    _tile_stored(1, out_t[0] + 16, sizeof(out_t[0]));
    _tile_stored(3, out_t[16] + 16, sizeof(out_t[0]));
  }
}

// out[m][n] = out_t[n][m] for the 32 x 32 block (two 16 x 16 transposes a quarter)
void untranspose(float (*out_t)[32], float (*out)[kTileN]) {
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(out_t[16 * a + i] + 16 * b);
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(out[16 * b + j] + 16 * a, r[j]);
    }
}

// 64-byte aligned bf16 scratch of a thread (a pool thread keeps its own between calls)
bf16* aligned_scratch(std::vector<bf16>& buf, int64_t elems) {
  buf.resize(elems + 32);
  return reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) &
                                 ~uintptr_t{63});
}

}  // namespace

namespace vserve_quant {

at::Tensor gemm_amx(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k) {
  const int64_t m = x.size(0), n = data.size(0), row_bytes = data.size(1);
  auto out = at::empty({m, n}, x.options());
  // whole tiles of 16 activation columns: the ones past m are zeros
  const int64_t m_pad = (m + 15) / 16 * 16;
  at::Tensor xp = x.contiguous();
  if (m_pad != m) xp = at::cat({xp, at::zeros({m_pad - m, k}, x.options())});
  auto xt = at::empty({m_pad / 16, k / 2, 16, 2}, x.options());
  pair_activations(xp.data_ptr<bf16>(), m_pad, k, xt.data_ptr<bf16>());
  const bf16* xq = xt.data_ptr<bf16>();
  const uint8_t* w = data.data_ptr<uint8_t>();
  void* yp = out.data_ptr();
  const bool stream = m * n * x.element_size() > (16 << 20);
  with_format(qtype, [&](auto fmt) {
    using F = decltype(fmt);
    const int64_t tiles = (n + kTileN - 1) / kTileN;
    vserve_rows::stream_rows(tiles, kTileN * row_bytes, [&](int64_t lo, int64_t hi) {
      thread_local std::vector<bf16> rows_buf;
      bf16* rows = aligned_scratch(rows_buf, kTileN * k);
      alignas(64) float out_t[kTileN][32], tile_out[32][kTileN];
      amx_configure();
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t n0 = t * kTileN, cols = std::min<int64_t>(kTileN, n - n0);
        dequant_tile<F>(w, row_bytes, n, n0, k, rows);
        for (int64_t m0 = 0; m0 < m; m0 += 32) {
          const int64_t rows_here = std::min<int64_t>(32, m - m0);
          if (rows_here > 16)
            amx_bf16_micro<2>(rows, xq, m0, k, out_t);
          else
            amx_bf16_micro<1>(rows, xq, m0, k, out_t);
          untranspose(out_t, tile_out);
          for (int64_t i = 0; i < rows_here; ++i)
            store_cols(tile_out[i], yp, true, n, m0 + i, n0, cols, stream);
        }
      }
      _tile_release();
      if (stream) _mm_sfence();  // this thread's streamed lines before the join
    }, kTileN * row_bytes);
  });
  return out;
}

}  // namespace vserve_quant

#endif  // QUANT_AMX
