// The online-softmax step of every attention kernel, written once over a vector-ops struct
// VO (vec_*.h). Included by attn_kernel_impl.h, inside each ISA TU's anonymous namespace.
//
// Per block of keys, for each query row:
//   s = q.k -> scale, or softcap (softcap_scores) -> + ALiBi slope * (key - query position)
//     -> -inf for keys the row cannot see                           (ScoreTransform)
//   running max m: moves only past m + lazy; mu = m, or 0 while m = -inf;
//     corr = exp(m_old - mu) where it moved, else 1                 (max_step)
//   p = exp(s - mu) and the step's row sums                          (exp_sum)
//   l = l * corr + sum; the row's accumulators *= corr where it moved (rescale)
// Two data layouts use these, and only decide where scores and row state live:
// - keys in lanes (AttnKernel::softmax_row): one query row, a vector = W consecutive keys;
//   the row's m and l are scalars, so its max rule runs on VecScalar.
// - rows in lanes (lanes_softmax_block below, the prefill kernels of prefill_lanes_*.h): a
//   vector = W query rows, one key per step; m and l are vectors.

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Lazy max of the rows-in-lanes kernels: a row keeps its old (finite) max unless a block's
// exceeds it by more than this, so probabilities stay <= e^8 (exact enough in fp32 and as
// bf16) and O^T is rescaled far less often. The keys-in-lanes path keeps the exact max.
constexpr float kLazyMax = 8.f;
constexpr float kExactMax = 0.f;

// Softcapped scores: cap * tanh(s * scale / cap), accurate over the whole range.
// 1 - 2 / (exp(2x) + 1) alone has an absolute error ~1e-7, i.e. no relative precision
// once |x| << 1 (cap 1e6 over scores ~1 gave output errors ~0.1). So x = a + b with
// a = clamp(x, -c, c) and tanh(x) = (tanh a + tanh b) / (1 + tanh a tanh b): tanh a from
// its odd series (relative error < 1e-8 for |a| <= c), tanh b from the exp formula, which
// is exactly 0 for b = 0 (|x| <= c) and otherwise adds an absolute error ~1e-7 next to
// |tanh x| >= tanh c. Saturates to +-1 at +-inf. scale_over_cap = scale / cap (finite,
// checked by the binding).
template <class VO>
inline typename VO::V softcap_scores(typename VO::V s, typename VO::V scale_over_cap,
                                     typename VO::V cap) {
  using V = typename VO::V;
  const V x = VO::mul(s, scale_over_cap);
  const V neg = VO::set1(-1.f), one = VO::set1(1.f), minus_c = VO::set1(-0.25f);
  // a = min(max(x, -c), c), written with max only: min(u, v) = -max(-u, -v).
  const V a = VO::mul(neg, VO::max(VO::mul(neg, VO::max(x, minus_c)), minus_c));
  const V b = VO::add(x, VO::mul(neg, a));
  const V a2 = VO::mul(a, a);
  V series = VO::set1(62.f / 2835.f);  // tanh a = a (1 - a^2/3 + 2a^4/15 - 17a^6/315 + ...)
  series = VO::fma(series, a2, VO::set1(-17.f / 315.f));
  series = VO::fma(series, a2, VO::set1(2.f / 15.f));
  series = VO::fma(series, a2, VO::set1(-1.f / 3.f));
  series = VO::fma(series, a2, one);
  const V ta = VO::mul(a, series);
  const V e = VO::exp(VO::add(b, b));
  const V tb = VO::add(one, VO::mul(neg, VO::div(VO::set1(2.f), VO::add(e, one))));
  return VO::mul(cap, VO::div(VO::add(ta, tb), VO::fma(ta, tb, one)));
}

// Raw scores -> logits, one vector at a time: the layout supplies the ALiBi slope and the
// int32 distances key - query position (exact in int32; fp32 positions lose bits past
// 2^24) and the visible range of each lane's row as int32 key indices.
template <class VO>
struct ScoreTransform {
  using V = typename VO::V;
  using VI = typename VO::VI;
  bool softcap, alibi;
  // Logits are the plain positive scale times the scores: callers may fold the scale into
  // the exp's FMA and take the max of the raw scores.
  bool plain_scale;
  V scale, over, cap;  // over = scale / softcap

  explicit ScoreTransform(const AttnParams& p)
      : softcap(p.softcap > 0.f), alibi(p.alibi != nullptr),
        plain_scale(!softcap && !alibi && p.scale > 0.f), scale(VO::set1(p.scale)),
        over(VO::set1(p.softcap > 0.f ? p.scale / p.softcap : 0.f)), cap(VO::set1(p.softcap)) {}

  V scaled(V s) const { return softcap ? softcap_scores<VO>(s, over, cap) : VO::mul(s, scale); }
  static V add_alibi(V s, V slope, VI dist) { return VO::fma(slope, VO::cvti(dist), s); }
  // -inf where key < lo or key > hi.
  static V hide(V s, VI lo, VI key, VI hi) {
    return VO::select(VO::outside(lo, key, hi), VO::set1(kNegInf), s);
  }
};

// The running-max rule, lane by lane: m_old the max so far (-inf: nothing seen yet), mx the
// max of m_old and this step's logits. The max moves only when mx exceeds m_old + lazy
// (lazy 0: to the exact max). A row with nothing visible yet keeps m = -inf and subtracts
// mu = 0 (exp(-inf - 0) = 0); corr rescales what the row summed before the max moved.
template <class VO>
struct MaxStep {
  typename VO::V m, mu, corr;
  typename VO::M moved;
};
template <class VO>
inline MaxStep<VO> max_step(typename VO::V m_old, typename VO::V mx, float lazy) {
  using V = typename VO::V;
  MaxStep<VO> r;
  r.moved = VO::lt(VO::add(m_old, VO::set1(lazy)), mx);
  r.m = VO::select(r.moved, mx, m_old);
  r.mu = VO::select(VO::eq(r.m, VO::set1(kNegInf)), VO::zero(), r.m);
  const V one = VO::set1(1.f);
  r.corr = VO::any(r.moved) ? VO::select(r.moved, VO::exp(VO::sub(m_old, r.mu)), one) : one;
  return r;
}

// p = exp(x * sv - mu) for x = logit(i), i = begin, begin + step, ... < end, KP of them at a
// time (the KP probabilities are added together before the running sum); put(i, p) gets
// them as p[0..KP). sv is 1 except where the caller folded the scale into this FMA
// (x * 1 - mu rounds exactly like x - mu). Returns the vector of sums.
template <class VO, int KP, class Logit, class Put>
inline typename VO::V exp_sum(int begin, int end, int step, typename VO::V sv,
                              typename VO::V neg_mu, Logit logit, Put put) {
  static_assert(KP == 1 || KP == 2, "one or two steps at a time");
  using V = typename VO::V;
  V sum = VO::zero();
  for (int i = begin; i < end; i += KP * step) {
    V p[KP];
    for (int k = 0; k < KP; ++k) p[k] = VO::exp(VO::fma(logit(i + k * step), sv, neg_mu));
    sum = VO::add(sum, KP == 1 ? p[0] : VO::add(p[0], p[1]));
    put(i, p);
  }
  return sum;
}

// n accumulator vectors `stride` floats apart *= corr.
template <class VO>
inline void rescale(float* acc, int64_t stride, int n, typename VO::V corr) {
  for (int i = 0; i < n; ++i) VO::store(acc + i * stride, VO::mul(VO::load(acc + i * stride), corr));
}

// Row state of a rows-in-lanes prefill item (prefill_lanes_*.h; init_lane_rows fills it),
// [Rp] each, rows token-major and padded to Rp: each row's visible keys [lo, hi] (empty,
// 1 > 0, for padding rows), its negated position and ALiBi slope, running max m and sum l.
struct LaneRows {
  float *m, *l;
  int32_t *lo, *hi, *neg_pos;
  float* slope;
  // The six arrays carved from scratch at p; end() is the first float after them.
  static LaneRows at(float* p, int Rp) {
    LaneRows r;
    r.m = p;
    r.l = p + Rp;
    r.lo = reinterpret_cast<int32_t*>(p + 2 * Rp);
    r.hi = r.lo + Rp;
    r.neg_pos = r.hi + Rp;
    r.slope = reinterpret_cast<float*>(r.neg_pos + Rp);
    return r;
  }
  static constexpr int kFloatsPerRow = 6;
};

// The online-softmax step of a rows-in-lanes item (Rp rows, VO::W per vector) over keys
// [ta, tb) of one block (base: the block's first key position): row r's raw score of key t
// at st[t * Rp + r] becomes its logit there, then a probability, handed to put(o, t, p) for
// rows [o, o + W) and keys t .. t + KP - 1 (p[0..KP); (tb - ta) % KP == 0). ot [D][Rp]:
// the rows' O^T accumulators, rescaled where a row's max moved.
// Not inlined, like AttnKernel::softmax_row: the q.k and P.V tiles around it use nearly
// every vector register, and with the softmax inlined into the same function GCC spilled
// tile registers inside their inner loops (softmax_row inlined into AttnKernel::run cost
// AVX512-BF16 bf16 prefill ~11%). One call per block costs nothing measurable.
template <class VO, int KP, class Put>
__attribute__((noinline)) void lanes_softmax_block(const AttnParams& p, const LaneRows& rows,
                                                   int Rp, int64_t base, int ta, int tb,
                                                   float* st, float* ot, int D, Put put) {
  using V = typename VO::V;
  using VI = typename VO::VI;
  const ScoreTransform<VO> tr(p);
  for (int o = 0; o < Rp; o += VO::W) {
    const VI lo = VO::loadi(rows.lo + o), hi = VO::loadi(rows.hi + o);
    const VI neg_pos = VO::loadi(rows.neg_pos + o);
    const V slope = VO::load(rows.slope + o);
    const V m_old = VO::load(rows.m + o);
    float* so = st + o;
    // Interior blocks (every key visible to every row of the group) skip the mask.
    const bool full = VO::hmaxi(lo) <= base + ta && VO::hmini(hi) >= base + tb - 1;
    V mx = m_old;
    for (int t = ta; t < tb; ++t) {
      const VI key = VO::set1i(static_cast<int32_t>(base + t));  // positions are int32
      V s = tr.scaled(VO::load(so + t * Rp));
      if (tr.alibi) s = tr.add_alibi(s, slope, VO::addi(neg_pos, key));
      if (!full) s = tr.hide(s, lo, key, hi);
      VO::store(so + t * Rp, s);
      mx = VO::max(mx, s);
    }
    const MaxStep<VO> ms = max_step<VO>(m_old, mx, kLazyMax);
    const V sum = exp_sum<VO, KP>(
        ta, tb, 1, VO::set1(1.f), VO::sub(VO::zero(), ms.mu),
        [&](int t) { return VO::load(so + t * Rp); }, [&](int t, const V* e) { put(o, t, e); });
    VO::store(rows.l + o, VO::fma(VO::load(rows.l + o), ms.corr, sum));
    VO::store(rows.m + o, ms.m);
    if (VO::any(ms.moved)) rescale<VO>(ot + o, Rp, D, ms.corr);
  }
}
