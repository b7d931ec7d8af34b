// The stream_read kernel: every byte of a buffer read once with the ISA's widest loads
// (VT::kStreamBytes: 64 on AVX-512, 32 on AVX2, 16 on NEON and the portable table) and
// summed, so no load can be dropped. It is the bench's DRAM roof (pagedattn/bench/probes.py):
// per load only a byte-sum and an add, four independent accumulators, so nothing but the
// memory limits the rate.
//
// Included inside an anonymous namespace of an ISA TU, after that ISA's vector struct.

// Sum of the bytes p[0, n) as unsigned 8-bit values, modulo 2^64 (exact below 2^56 bytes).
// Any n >= 0 and any alignment: whole vectors, then a scalar tail.
template <class VT>
uint64_t sum_bytes_entry(const uint8_t* p, int64_t n) {
  constexpr int64_t B = VT::kStreamBytes;
  typename VT::SB a0 = VT::stream_zero(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 4 * B <= n; i += 4 * B) {
    a0 = VT::stream_add(a0, p + i);
    a1 = VT::stream_add(a1, p + i + B);
    a2 = VT::stream_add(a2, p + i + 2 * B);
    a3 = VT::stream_add(a3, p + i + 3 * B);
  }
  for (; i + B <= n; i += B) a0 = VT::stream_add(a0, p + i);
  uint64_t total = VT::stream_total(a0) + VT::stream_total(a1) + VT::stream_total(a2) +
                   VT::stream_total(a3);
  for (; i < n; ++i) total += p[i];
  return total;
}

template <class VT>
KernelTable with_stream_kernels(KernelTable table) {
  table.sum_bytes = &sum_bytes_entry<VT>;
  return table;
}
