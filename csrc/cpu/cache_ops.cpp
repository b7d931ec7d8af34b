// cpu_attn_reshape_and_cache: scatter new keys/values into the paged cache (natural layout:
// key_cache[b, h, o, :] is the key of slot b * block_size + o). A plain row copy, or for
// fp8 caches a row quantisation (x / scale, saturated, rounded to nearest even: fp8.h); it
// needs no ISA-specific code; all validation happens before the first write.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "binding_utils.h"
#include "work_pool.h"

namespace pagedattn {
namespace {
#include "fp8.h"

template <class F, class T>
void quantize_row(uint8_t* dst, const T* src, int64_t n, float scale) {
  for (int64_t d = 0; d < n; ++d) dst[d] = fp8_encode<F>(static_cast<float>(src[d]) / scale);
}

template <class F>
void quantize_row_any(uint8_t* dst, const char* src, at::ScalarType t, int64_t n, float scale) {
  switch (t) {
    case at::kFloat: return quantize_row<F>(dst, reinterpret_cast<const float*>(src), n, scale);
    case at::kBFloat16:
      return quantize_row<F>(dst, reinterpret_cast<const at::BFloat16*>(src), n, scale);
    default: return quantize_row<F>(dst, reinterpret_cast<const at::Half*>(src), n, scale);
  }
}

// Byte addresses of the key/value rows of a token and of the cache rows of its slot.
struct SlotRows {
  const at::Tensor &key, &value, &key_cache, &value_cache;
  const int64_t kvh, bs, es, ces;
  const char *kp, *vp;
  char *kc, *vc;
  SlotRows(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache)
      : key(k), value(v), key_cache(k_cache), value_cache(v_cache), kvh(k_cache.size(1)),
        bs(k_cache.size(2)), es(k.element_size()), ces(k_cache.element_size()),
        kp(static_cast<const char*>(k.data_ptr())), vp(static_cast<const char*>(v.data_ptr())),
        kc(static_cast<char*>(k_cache.data_ptr())), vc(static_cast<char*>(v_cache.data_ptr())) {}

  // Calls row(k_dst, k_src, v_dst, v_src) for each kv head of token i, cached at slot >= 0.
  template <class F>
  void token(int64_t i, int64_t slot, const F& row) const {
    const int64_t blk = slot / bs, off = slot % bs;
    for (int64_t h = 0; h < kvh; ++h)
      row(kc + (blk * key_cache.stride(0) + h * key_cache.stride(1) + off * key_cache.stride(2)) * ces,
          kp + (i * key.stride(0) + h * key.stride(1)) * es,
          vc + (blk * value_cache.stride(0) + h * value_cache.stride(1) + off * value_cache.stride(2)) * ces,
          vp + (i * value.stride(0) + h * value.stride(1)) * es);
  }
};

// One key row and one value row into the cache: copied, or for fp8 caches quantised.
struct RowWriter {
  void (*quantize)(uint8_t*, const char*, at::ScalarType, int64_t, float) = nullptr;
  at::ScalarType src;
  int64_t hs, row_bytes;
  float ks, vs;
  RowWriter(DType cache_dt, const at::Tensor& key, int64_t head_size, double k_scale,
            double v_scale)
      : src(key.scalar_type()), hs(head_size), row_bytes(head_size * key.element_size()),
        ks(static_cast<float>(k_scale)), vs(static_cast<float>(v_scale)) {
    if (is_fp8(cache_dt))
      quantize = cache_dt == DType::kFp8E4m3 ? &quantize_row_any<Fp8E4m3> : &quantize_row_any<Fp8E5m2>;
  }
  // Tokens per thread chunk: a quantised row costs more than a copied one.
  int64_t grain() const { return quantize != nullptr ? 16 : 64; }
  void operator()(char* kdst, const char* ksrc, char* vdst, const char* vsrc) const {
    if (quantize != nullptr) {
      quantize(reinterpret_cast<uint8_t*>(kdst), ksrc, src, hs, ks);
      quantize(reinterpret_cast<uint8_t*>(vdst), vsrc, src, hs, vs);
    } else {
      std::memcpy(kdst, ksrc, row_bytes);
      std::memcpy(vdst, vsrc, row_bytes);
    }
  }
};
}  // namespace

void cpu_attn_reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                                at::Tensor& key_cache, at::Tensor& value_cache,
                                const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  check_cache_pair(key_cache, value_cache);
  check_cpu(key, "key");
  check_cpu(value, "value");
  TORCH_CHECK_VALUE(key.dim() == 3, "key must be 3-D [num_tokens, num_kv_heads, head_size], got shape ",
                    key.sizes());
  TORCH_CHECK_VALUE(value.sizes() == key.sizes(), "value shape ", value.sizes(),
                    " must equal key shape ", key.sizes());
  const DType cache_dt = to_cache_dtype(key_cache.scalar_type(), "key_cache");
  TORCH_CHECK_TYPE(key.scalar_type() == value.scalar_type() &&
                       (key.scalar_type() == key_cache.scalar_type() ||
                        (is_fp8(cache_dt) && (key.scalar_type() == at::kFloat ||
                                              key.scalar_type() == at::kBFloat16 ||
                                              key.scalar_type() == at::kHalf))),
                   "key/value dtypes (", key.scalar_type(), ", ", value.scalar_type(),
                   ") must equal the cache dtype ", key_cache.scalar_type(),
                   " (fp8 caches: float32, bfloat16 or float16 key/value)");
  check_kv_scale(k_scale, "k_scale");
  check_kv_scale(v_scale, "v_scale");
  const int64_t num_blocks = key_cache.size(0), kvh = key_cache.size(1);
  const int64_t bs = key_cache.size(2), hs = key_cache.size(3);
  TORCH_CHECK_VALUE(key.size(1) == kvh && key.size(2) == hs, "key shape ", key.sizes(),
                    " does not match the cache's num_kv_heads ", kvh, " and head_size ", hs);
  check_head_size(hs, "kv cache");
  check_block_size(bs, "kv cache");
  for (const auto* t : {&key, &value})
    TORCH_CHECK_VALUE(t->size(2) <= 1 || t->stride(2) == 1,
                      "key/value last dim must be contiguous, got strides ", t->strides());
  check_index_tensor(slot_mapping, "slot_mapping", at::kLong, 1);
  const int64_t n = slot_mapping.numel();
  TORCH_CHECK_VALUE(n <= key.size(0), "slot_mapping has ", n, " entries but key has only ",
                    key.size(0), " tokens");

  const at::Tensor slots_c = slot_mapping.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  const int64_t num_slots = num_blocks * bs;
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(slots[i] < num_slots, "slot_mapping[", i, "] (", slots[i],
                      ") is out of range for a cache of ", num_blocks, " blocks x ", bs,
                      " slots (max ", num_slots - 1, "; negative = padding)");
  if (n == 0) return;

  const SlotRows rows(key, value, key_cache, value_cache);
  const RowWriter write(cache_dt, key, hs, k_scale, v_scale);
  pool_parallel_for(0, n, write.grain(), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      if (slots[i] >= 0) rows.token(i, slots[i], write);  // negative: PAD_SLOT_ID
  });
}

void rotate_and_cache_unchecked(const int64_t* positions, const float* cos_sin, at::Tensor& query,
                                at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                                at::Tensor& value_cache, const int64_t* slots, int64_t n,
                                double k_scale, double v_scale) {
  const int64_t tokens = query.size(0), heads = query.size(1), kvh = key.size(1);
  const int64_t hs = key_cache.size(3), half = hs / 2;
  const DType dtype = query.scalar_type() == at::kFloat ? DType::kF32 : DType::kBF16;
  const int64_t es = query.element_size();
  char* q = static_cast<char*>(query.data_ptr());
  char* k = static_cast<char*>(key.data_ptr());
  const SlotRows rows(key, value, key_cache, value_cache);
  const RowWriter write(to_cache_dtype(key_cache.scalar_type(), "key_cache"), key, hs, k_scale,
                        v_scale);
  const KernelTable* kt = current_kernels();
  const int64_t grain = std::max<int64_t>(1, 65536 / ((heads + 2 * kvh) * hs));
  pool_parallel_for(0, tokens, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* cos = cos_sin + positions[t] * hs;
      kt->rotate_heads(q + t * query.stride(0) * es, dtype, heads, query.stride(1), cos,
                       cos + half, half);
      kt->rotate_heads(k + t * key.stride(0) * es, dtype, kvh, key.stride(1), cos, cos + half,
                       half);
      // negative: PAD_SLOT_ID; past n: a token without a slot
      if (t < n && slots[t] >= 0) rows.token(t, slots[t], write);
    }
  });
}

}  // namespace pagedattn

TORCH_LIBRARY_FRAGMENT(pagedattn, m) {
  m.def(
      "cpu_attn_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slot_mapping, float k_scale=1.0, "
      "float v_scale=1.0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedattn, CPU, m) {
  m.impl("cpu_attn_reshape_and_cache", &pagedattn::cpu_attn_reshape_and_cache);
}
