// Decode attention on a CPU: one query token per row over its paged K/V cache, read in place.
//
// Built and loaded by kernels/cpu_native.py (plain C ABI, no torch headers, so it compiles in
// about a second); `paged_attention_ref` in kernels/attention.py is the oracle it is tested
// against. Layouts, all contiguous:
//   query   [rows, kv_heads, group, head_dim] float32 (query head h reads KV head h / group)
//   cache   [num_blocks, 2, block_size, kv_heads, head_dim] float32 or bfloat16 (K then V)
//   tables  [rows, table_width] int64 block ids; seq_lens [rows] int64 (query position + 1)
//   out     [rows, kv_heads, group, head_dim] float32
// A row attends to keys max(0, seq_len - window) .. seq_len - 1 (window <= 0: all of them).
//
// Per row: every query head's scores in one pass over the keys (each key row, all KV heads, is
// loaded once), an exact softmax, then one pass over the values accumulating every head's
// output; the row's blocks are prefetched by hand (NextRow). The inner loops run over head_dim
// with unit stride, which the compiler vectorizes (built with -O3 -march=native -ffast-math; nothing
// here produces an infinity or a NaN from finite inputs, so fast-math's assumptions hold).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }

inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Shape {
  int64_t kv_heads, group, head_dim, block_size, table_width;
  float scale;
  int64_t window;
};

inline int64_t first_key(int64_t last, const Shape& s) {
  return s.window > 0 ? std::max<int64_t>(0, last - s.window) : 0;
}

// Locality 3 fetches into L1, 2 into L2.
template <int Locality, typename T>
[[gnu::always_inline]] inline void prefetch(const T* start, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(start);
  for (int64_t byte = 0; byte < elements * int64_t(sizeof(T)); byte += 64) {
    __builtin_prefetch(p + byte, 0, Locality);
  }
}

// A row's blocks are anywhere in the cache, and the keys' or values' part of a block is one page
// for the embedded model (4 KiB), where the hardware prefetcher stops. So the next row's blocks
// are fetched into L2 while this row's keys are read, one of its blocks per block of this row
// (all at once, a burst stalls on the miss buffers), and each next block's part into L1 while
// this block is worked on.
template <typename T>
struct NextRow {
  const T* cache;
  const int64_t* table;
  int64_t block, end, block_elements;

  NextRow(const T* cache_, const int64_t* table_, int64_t last, const Shape& s)
      : cache(cache_), table(table_), block(first_key(last, s) / s.block_size),
        end(table_ ? (last + s.block_size - 1) / s.block_size : 0),
        block_elements(2 * s.block_size * s.kv_heads * s.head_dim) {}

  void fetch(int64_t blocks) {  // the next `blocks` of its blocks, both K and V
    for (const int64_t stop = std::min(end, block + blocks); block < stop; ++block) {
      prefetch<2>(cache + table[block] * block_elements, block_elements);
    }
  }
};

// Calls visit(i, rows, run) for each stretch of a row's tokens first .. last - 1 that lies in
// one block, in order: i is the stretch's first token counted from `first`, rows its K (part 0)
// or V (part 1) rows of all KV heads, `run` tokens of kv_heads * head_dim elements each.
template <typename T, typename Visit>
inline void for_each_block(const T* cache, const int64_t* table, int part, int64_t first,
                           int64_t last, const Shape& s, Visit visit) {
  const int64_t token_stride = s.kv_heads * s.head_dim;
  const int64_t part_elements = s.block_size * token_stride;
  for (int64_t t = first; t < last;) {
    const int64_t index = t / s.block_size, offset = t % s.block_size;
    const int64_t run = std::min(s.block_size - offset, last - t);
    if (t + run < last) {
      prefetch<3>(cache + (2 * table[index + 1] + part) * part_elements, part_elements);
    }
    visit(t - first, cache + (2 * table[index] + part) * part_elements + offset * token_stride,
          run);
    t += run;
  }
}

// D: the head dimension when known at compile time (the loops then unroll, and the sums below
// stay in vector registers), 0 for any other (`d`, read from the shape).
template <int D, typename T>
inline void dots(const float* q, const T* keys, int64_t run, int64_t stride, int64_t d,
                 float* scores) {
  // A horizontal sum per key: a transpose-and-add tree over 16 keys at a time measured no
  // faster, the loads from L3 or memory bound this loop.
  for (int64_t j = 0; j < run; ++j) {
    const T* k = keys + j * stride;
    float dot = 0.0f;
    for (int64_t e = 0; e < (D ? D : d); ++e) dot += q[e] * to_float(k[e]);
    scores[j] = dot;
  }
}

// out += sum over the run of probs[j] * values[j]; summed in a local array, not through `out`
// (a store and a reload per token would chain every add on store-to-load forwarding).
template <int D, typename T>
inline void weighted_sum(const float* probs, const T* values, int64_t run, int64_t stride,
                         int64_t d, float* out) {
  if constexpr (D > 0) {
    float acc[D];
    for (int64_t e = 0; e < D; ++e) acc[e] = out[e];
    for (int64_t j = 0; j < run; ++j) {
      const T* v = values + j * stride;
      for (int64_t e = 0; e < D; ++e) acc[e] += probs[j] * to_float(v[e]);
    }
    for (int64_t e = 0; e < D; ++e) out[e] = acc[e];
  } else {
    for (int64_t j = 0; j < run; ++j) {
      for (int64_t e = 0; e < d; ++e) out[e] += probs[j] * to_float(values[j * stride + e]);
    }
  }
}

template <int D, typename T>
void decode_row(const float* q, const T* cache, const int64_t* table, int64_t first,
                int64_t last, const Shape& s, NextRow<T>& next, float* scores, float* norm,
                float* out) {
  const int64_t d = D ? D : s.head_dim, heads = s.kv_heads * s.group, n = last - first;
  const int64_t stride = s.kv_heads * d;
  // scores [heads, n], a block at a time: its keys stay in L1 for every query head.
  for_each_block(cache, table, 0, first, last, s, [&](int64_t i, const T* keys, int64_t run) {
    next.fetch(1);
    for (int64_t h = 0; h < heads; ++h) {
      dots<D>(q + h * d, keys + (h / s.group) * d, run, stride, d, scores + h * n + i);
    }
  });
  next.fetch(next.end);  // a longer next row: the rest of it
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = scores + h * n;
    const float top = *std::max_element(sh, sh + n);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      sh[i] = std::exp(sh[i] - top);
      sum += sh[i];
    }
    norm[h] = 1.0f / sum;
  }
  std::fill(out, out + heads * d, 0.0f);
  for_each_block(cache, table, 1, first, last, s, [&](int64_t i, const T* values, int64_t run) {
    for (int64_t h = 0; h < heads; ++h) {
      weighted_sum<D>(scores + h * n + i, values + (h / s.group) * d, run, stride, d, out + h * d);
    }
  });
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t e = 0; e < d; ++e) out[h * d + e] *= norm[h];
  }
}

template <int D, typename T>
void decode(const float* query, const T* cache, const int64_t* tables, const int64_t* seq_lens,
            float* out, int64_t rows, const Shape& s) {
  const int64_t per_row = s.kv_heads * s.group * s.head_dim;
  // Rows in parallel over torch's OpenMP threads (one runtime: torch loaded it first).
#pragma omp parallel for schedule(dynamic, 1) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    thread_local std::vector<float> q, scores, norm;
    const int64_t last = seq_lens[r];
    const int64_t first = first_key(last, s);
    float* o = out + r * per_row;
    if (last <= first) {
      std::fill(o, o + per_row, 0.0f);
      continue;
    }
    // With several threads row r + 1 may be another thread's: a wasted prefetch, no more.
    const bool more = r + 1 < rows;
    NextRow<T> next(cache, more ? tables + (r + 1) * s.table_width : nullptr,
                    more ? seq_lens[r + 1] : 0, s);
    q.resize(per_row);
    for (int64_t i = 0; i < per_row; ++i) q[i] = query[r * per_row + i] * s.scale;
    scores.resize(s.kv_heads * s.group * (last - first));
    norm.resize(s.kv_heads * s.group);
    decode_row<D>(q.data(), cache, tables + r * s.table_width, first, last, s, next,
                  scores.data(), norm.data(), o);
  }
}

template <typename T>
void dispatch(const float* query, const T* cache, const int64_t* tables,
              const int64_t* seq_lens, float* out, int64_t rows, const Shape& s) {
  switch (s.head_dim) {
    case 32: return decode<32>(query, cache, tables, seq_lens, out, rows, s);
    case 64: return decode<64>(query, cache, tables, seq_lens, out, rows, s);
    case 128: return decode<128>(query, cache, tables, seq_lens, out, rows, s);
    default: return decode<0>(query, cache, tables, seq_lens, out, rows, s);
  }
}

}  // namespace

extern "C" {

// cache_is_bf16: 0 for a float32 cache, 1 for bfloat16. Returns 0.
int pagedserve_decode_attention(const float* query, const void* cache, int cache_is_bf16,
                                const int64_t* tables, const int64_t* seq_lens, float* out,
                                int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim,
                                int64_t block_size, int64_t table_width, float scale,
                                int64_t window) {
  const Shape s{kv_heads, group, head_dim, block_size, table_width, scale, window};
  if (cache_is_bf16) {
    dispatch(query, static_cast<const uint16_t*>(cache), tables, seq_lens, out, rows, s);
  } else {
    dispatch(query, static_cast<const float*>(cache), tables, seq_lens, out, rows, s);
  }
  return 0;
}

}  // extern "C"
