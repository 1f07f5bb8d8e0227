// Native CPU codecs: the group-wise formats of hilore_verl/kernels/formats.py, bit for bit.
//
// Plain C ABI over raw pointers (loaded with ctypes, no torch headers). The input is n_groups
// contiguous groups of GS elements (a row-major (R, D) tensor with GS dividing D); per group, in fp32:
//
//   absmax = max |x|                  taken on the bits: for non-negative floats the bit order is
//                                     the value order, and |x| bits >= 0x7F800000 means inf / nan
//   scale  = absmax / QMAX            IEEE division (the build disables FMA contraction)
//   y      = x / (scale > 0 ? scale : 1), or 0 in a flagged group (flag 1, scale nan)
//   int8   code = rne(y) | floor(y + u), clamped to [-127, 127]
//   int4   the same clamped to [-7, 7], +8, two per byte (even element in the low nibble)
//   fp8    e4m3fn by integer arithmetic, rounding on the mantissa grid
//   decode value(code) * scale, clamped to +-FLT_MAX, rounded half-even to the output dtype
//
// u = hash(seed, flat element index) in [0, 1). Loops are written for the compiler to vectorize;
// OpenMP splits groups over threads.

#include <cstdint>
#include <cstring>
#include <cmath>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
enum { FMT_INT8 = 0, FMT_FP8 = 1, FMT_INT4 = 2 };

constexpr float kFltMax = 3.40282346638528859812e+38F;
constexpr uint32_t kNaN = 0x7FC00000u;
constexpr uint32_t kIdxMul = 0x61C88647u, kMix1 = 0x7FEB352Du, kMix2 = 0x5A2C4E6Bu;

inline uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// round half to even for |y| < 2**22 (|y| <= 2 * QMAX here): exact in the default rounding mode
inline float rne(float y) {
    const float magic = 12582912.0f;  // 1.5 * 2**23
    return (y + magic) - magic;
}
inline float floor_small(float y) {
    float r = rne(y);
    return r > y ? r - 1.0f : r;
}

inline float uniform(uint32_t smix, uint32_t index) {
    uint32_t h = index * kIdxMul + smix;
    h ^= h >> 16;
    h *= kMix1;
    h ^= h >> 15;
    h *= kMix2;
    h ^= h >> 16;
    return (float)(int32_t)(h >> 8) * (1.0f / 16777216.0f);
}

// ---- dtype conversions (exact widening; narrowing rounds half to even, as torch does) ----

inline float half_to_float(uint16_t h) {
#if defined(__FLT16_MAX__)
    _Float16 v; std::memcpy(&v, &h, 2); return (float)v;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    float mag;
    if (e == 0) mag = (float)m * 5.9604644775390625e-8f;  // m * 2**-24, exact
    else if (e == 31) mag = from_bits(0x7F800000u | (m << 13));
    else mag = from_bits(((e + 112) << 23) | (m << 13));
    return from_bits(bits(mag) | sign);
#endif
}

inline uint16_t float_to_half(float f) {
#if defined(__FLT16_MAX__)
    _Float16 v = (_Float16)f; uint16_t h; std::memcpy(&h, &v, 2); return h;
#else
    uint32_t u = bits(f), sign = (u >> 16) & 0x8000, a = u & 0x7FFFFFFF;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00);
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);  // rounds past 65504: inf
    if (a < 0x38800000u) {  // fp16 subnormal or zero: a + 0.5 rounds at 2**-24 granularity
        float r = from_bits(a) + 0.5f;
        return (uint16_t)(sign | (bits(r) - bits(0.5f)));
    }
    uint32_t lsb = (a >> 13) & 1;
    return (uint16_t)(sign | ((a - 0x38000000u + 0xFFFu + lsb) >> 13));
#endif
}

inline uint16_t float_to_bf16(float f, uint16_t nan16) {
    uint32_t u = bits(f);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
    return (u & 0x7FFFFFFF) > 0x7F800000u ? nan16 : r;
}

template <int DT> inline float load(const void* p, int64_t i) {
    if (DT == DT_F32) return static_cast<const float*>(p)[i];
    if (DT == DT_F16) return half_to_float(static_cast<const uint16_t*>(p)[i]);
    return from_bits((uint32_t)static_cast<const uint16_t*>(p)[i] << 16);
}

// ---- encode / decode of one value ----

template <bool SR> inline float round_code(float y, float u) { return SR ? floor_small(y + u) : rne(y); }

// an integral float (|r| < 2**22) to int32, clamped to [-lim, lim]: exact, and clamps as integers vectorize well
inline int32_t clamp_int(float r, int32_t lim) {
    int32_t i = (int32_t)r;
    i = i < -lim ? -lim : i;
    return i > lim ? lim : i;
}

// e4m3fn bits of y, |y| <= 2 * 448. Normal (|y| >= 2**-6): the fraction f = |y| / 2**e - 1 on the grid
// of 1/8, q = rne(8 f) | floor(8 f + u) in [0, 8], code = ((e + 7) << 3) + q (q = 8 carries into the
// exponent); rne is done on the bits (the round bit is bit 20). Subnormal: q = rne(512 |y|) | floor(...).
// 8 f and 512 |y| are exact in fp32, so these are the reference's values; codes past 448 clamp to 0x7E.
template <bool SR> inline uint8_t fp8_code(float y, float u) {
    const float a = std::fabs(y);
    const uint32_t b = bits(a);
    const bool normal = b >= (121u << 23);
    int32_t code;
    if (SR) {
        const uint32_t keep = 0u - (uint32_t)normal;  // all ones where normal: a select without branches
        const float f8n = (float)(int32_t)(b & 0x7FFFFF) * 9.5367431640625e-07f, f8s = a * 512.0f;  // 2**-20
        const float f8 = from_bits((bits(f8n) & keep) | (bits(f8s) & ~keep));
        code = (int32_t)((((b >> 23) - 120) << 3) & keep) + (int32_t)floor_small(f8 + u);
    } else {
        const int32_t cn = (int32_t)((b + 0x7FFFFu + ((b >> 20) & 1)) >> 20) - (120 << 3);
        const int32_t cs = (int32_t)rne(a * 512.0f);
        code = normal ? cn : cs;
    }
    code = code < 0x7E ? code : 0x7E;  // 448, the largest finite e4m3fn
    return (uint8_t)(code | (y < 0.0f ? 0x80 : 0));
}

inline float fp8_value(uint8_t c) {
    uint32_t e = (c >> 3) & 0xF, q = c & 7;
    float mag = e == 0 ? (float)(int32_t)q * 0.001953125f : from_bits(((e + 120) << 23) | (q << 20));
    return from_bits(bits(mag) | ((uint32_t)(c & 0x80) << 24));
}

inline float saturate(float v) { return v > kFltMax ? kFltMax : (v < -kFltMax ? -kFltMax : v); }

// Blocks of 16 where the compiler does not vectorize the scalar form (fp16 conversions, fp8 and int4
// decode): AVX-512 when built for it, else the scalar functions above (the same results).
template <int DT> inline void load16(const void* p, int64_t i, float* v) {
#if defined(__AVX512F__)
    if (DT == DT_F16) {
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
        _mm512_store_ps(v, _mm512_cvtph_ps(h));
        return;
    }
#endif
    for (int j = 0; j < 16; ++j) v[j] = load<DT>(p, i + j);
}

inline void store_half16(const float* w, uint16_t* o) {
#if defined(__AVX512F__)
    __m512 x = _mm512_load_ps(w);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    __m512 t = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-kFltMax)), _mm512_set1_ps(kFltMax));
    t = _mm512_mask_mov_ps(t, nan, _mm512_castsi512_ps(_mm512_set1_epi32((int)kNaN)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtps_ph(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int j = 0; j < 16; ++j) {
        float t = saturate(w[j]);
        o[j] = float_to_half(t != t ? from_bits(kNaN) : t);
    }
#endif
}

inline void fp8_decode16(const uint8_t* c, float s, float* w) {
#if defined(__AVX512F__)
    __m512i k = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(k, _mm512_set1_epi32(0x7F)), 20),
                                      _mm512_set1_epi32(120 << 23));
    __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(k, _mm512_set1_epi32(7))),
                               _mm512_set1_ps(0.001953125f));
    __mmask16 is_sub = _mm512_testn_epi32_mask(k, _mm512_set1_epi32(0x78));
    __m512i mag = _mm512_mask_blend_epi32(is_sub, normal, _mm512_castps_si512(sub));
    __m512i v = _mm512_or_si512(mag, _mm512_slli_epi32(_mm512_and_si512(k, _mm512_set1_epi32(0x80)), 24));
    _mm512_store_ps(w, _mm512_mul_ps(_mm512_castsi512_ps(v), _mm512_set1_ps(s)));
#else
    for (int j = 0; j < 16; ++j) w[j] = fp8_value(c[j]) * s;
#endif
}

// 8 bytes -> 16 values, the low nibble first
inline void int4_decode16(const uint8_t* c, float s, float* w) {
#if defined(__AVX512F__)
    __m512i k = _mm512_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));  // bytes 0..7 in lanes 0..7
    __m512i lo = _mm512_and_si512(k, _mm512_set1_epi32(0xF)), hi = _mm512_srli_epi32(k, 4);
    __m512i idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512i n = _mm512_sub_epi32(_mm512_permutex2var_epi32(lo, idx, hi), _mm512_set1_epi32(8));
    _mm512_store_ps(w, _mm512_mul_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(s)));
#else
    for (int j = 0; j < 8; ++j) {
        w[2 * j] = (float)((int32_t)(c[j] & 0xF) - 8) * s;
        w[2 * j + 1] = (float)((int32_t)(c[j] >> 4) - 8) * s;
    }
#endif
}

// ---- one group ----

template <int DT, int FMT, int GS, bool SR>
void quantize_groups(const void* x, int64_t g0, int64_t g1, uint32_t smix, void* codes, float* scales,
                     uint8_t* flags) {
    constexpr float qmax = FMT == FMT_INT8 ? 127.0f : (FMT == FMT_FP8 ? 448.0f : 7.0f);
    alignas(64) float v[GS], y[GS], u[GS];
    for (int64_t g = g0; g < g1; ++g) {
        const int64_t base = g * GS;
        uint32_t m = 0;
        if (DT == DT_F16)
            for (int j = 0; j < GS; j += 16) load16<DT>(x, base + j, v + j);
        else
            for (int j = 0; j < GS; ++j) v[j] = load<DT>(x, base + j);
        for (int j = 0; j < GS; ++j) {
            uint32_t a = bits(v[j]) & 0x7FFFFFFFu;
            m = a > m ? a : m;
        }
        const bool finite = m < 0x7F800000u;
        const float scale = from_bits(m) / qmax;
        const float safe = scale > 0.0f ? scale : 1.0f;
        if (finite) {
            for (int j = 0; j < GS; ++j) y[j] = v[j] / safe;
        } else {
            for (int j = 0; j < GS; ++j) y[j] = 0.0f;
        }
        for (int j = 0; j < GS; ++j) u[j] = SR ? uniform(smix, (uint32_t)(base + j)) : 0.0f;
        if (FMT == FMT_INT8) {
            int8_t* c = static_cast<int8_t*>(codes) + base;
            for (int j = 0; j < GS; ++j) c[j] = (int8_t)clamp_int(round_code<SR>(y[j], u[j]), 127);
        } else if (FMT == FMT_FP8) {
            uint8_t* c = static_cast<uint8_t*>(codes) + base;
            for (int j = 0; j < GS; ++j) c[j] = fp8_code<SR>(y[j], u[j]);
        } else {
            uint8_t* c = static_cast<uint8_t*>(codes) + base / 2;
            for (int j = 0; j < GS / 2; ++j) {
                const int32_t lo = clamp_int(round_code<SR>(y[2 * j], u[2 * j]), 7) + 8;
                const int32_t hi = clamp_int(round_code<SR>(y[2 * j + 1], u[2 * j + 1]), 7) + 8;
                c[j] = (uint8_t)(lo | (hi << 4));
            }
        }
        scales[g] = finite ? scale : from_bits(kNaN);
        flags[g] = finite ? 0 : 1;
    }
}

template <int DT, int FMT, int GS>
void dequantize_groups(const void* codes, const float* scales, int64_t g0, int64_t g1, void* out,
                       uint16_t nan16) {
    alignas(64) float w[GS];
    for (int64_t g = g0; g < g1; ++g) {
        const int64_t base = g * GS;
        const float s = scales[g];
        if (FMT == FMT_INT8) {
            const int8_t* c = static_cast<const int8_t*>(codes) + base;
            for (int j = 0; j < GS; ++j) w[j] = (float)c[j] * s;
        } else if (FMT == FMT_FP8) {
            const uint8_t* c = static_cast<const uint8_t*>(codes) + base;
            for (int j = 0; j < GS; j += 16) fp8_decode16(c + j, s, w + j);
        } else {
            const uint8_t* c = static_cast<const uint8_t*>(codes) + base / 2;
            for (int j = 0; j < GS; j += 16) int4_decode16(c + j / 2, s, w + j);
        }
        if (DT == DT_F32) {
            float* o = static_cast<float*>(out) + base;
            for (int j = 0; j < GS; ++j) {
                float t = saturate(w[j]);
                o[j] = t != t ? from_bits(kNaN) : t;
            }
        } else if (DT == DT_F16) {
            uint16_t* o = static_cast<uint16_t*>(out) + base;
            for (int j = 0; j < GS; j += 16) store_half16(w + j, o + j);
        } else {
            uint16_t* o = static_cast<uint16_t*>(out) + base;
            for (int j = 0; j < GS; ++j) o[j] = float_to_bf16(saturate(w[j]), nan16);
        }
    }
}

// ---- dispatch: runtime arguments to template instances ----

using QFn = void (*)(const void*, int64_t, int64_t, uint32_t, void*, float*, uint8_t*);
using DFn = void (*)(const void*, const float*, int64_t, int64_t, void*, uint16_t);

template <int DT, int FMT, int GS> QFn pick_q(bool sr) {
    return sr ? quantize_groups<DT, FMT, GS, true> : quantize_groups<DT, FMT, GS, false>;
}
template <int DT, int FMT> QFn pick_q(int gs, bool sr) {
    return gs == 32 ? pick_q<DT, FMT, 32>(sr) : gs == 64 ? pick_q<DT, FMT, 64>(sr)
         : gs == 128 ? pick_q<DT, FMT, 128>(sr) : nullptr;
}
template <int DT> QFn pick_q(int fmt, int gs, bool sr) {
    return fmt == FMT_INT8 ? pick_q<DT, FMT_INT8>(gs, sr) : fmt == FMT_FP8 ? pick_q<DT, FMT_FP8>(gs, sr)
         : fmt == FMT_INT4 ? pick_q<DT, FMT_INT4>(gs, sr) : nullptr;
}
template <int DT, int FMT> DFn pick_d(int gs) {
    return gs == 32 ? dequantize_groups<DT, FMT, 32> : gs == 64 ? dequantize_groups<DT, FMT, 64>
         : gs == 128 ? dequantize_groups<DT, FMT, 128> : nullptr;
}
template <int DT> DFn pick_d(int fmt, int gs) {
    return fmt == FMT_INT8 ? pick_d<DT, FMT_INT8>(gs) : fmt == FMT_FP8 ? pick_d<DT, FMT_FP8>(gs)
         : fmt == FMT_INT4 ? pick_d<DT, FMT_INT4>(gs) : nullptr;
}

// Groups per thread chunk, and below how many elements one thread does it all.
constexpr int64_t kChunkElems = 1 << 14, kSerialElems = 1 << 16;

template <class F> void parallel_groups(int64_t n_groups, int gs, int n_threads, F body) {
    const int64_t chunk = kChunkElems / gs;
    const int64_t n_chunks = (n_groups + chunk - 1) / chunk;
    if (n_threads <= 1 || n_groups * gs < kSerialElems) {
        body(0, n_groups);
        return;
    }
#pragma omp parallel for num_threads(n_threads) schedule(dynamic, 1)
    for (int64_t k = 0; k < n_chunks; ++k) {
        const int64_t g1 = (k + 1) * chunk;
        body(k * chunk, g1 < n_groups ? g1 : n_groups);
    }
}

// A large output that the caller has just allocated is usually fresh mmap'd memory (glibc maps blocks
// above 32 MiB itself): asking for transparent huge pages there turns ~16k page faults per 64 MiB
// into 32. Advice only: where THP is off or the range is not eligible, nothing changes.
void advise_huge(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    constexpr uintptr_t kHuge = uintptr_t(1) << 21;
    if (bytes < (int64_t)(8 * kHuge)) return;
    const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + (uintptr_t)bytes) & ~(kHuge - 1);
    if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);
#else
    (void)p; (void)bytes;
#endif
}

}  // namespace

extern "C" {

int hv_abi_version() { return 1; }

// Returns 0, or -1 for an unsupported (dtype, fmt, group size).
int hv_quantize(const void* x, int dtype, int64_t n_groups, int gs, int fmt, int stochastic, uint32_t smix,
                void* codes, float* scales, uint8_t* flags, int n_threads) {
    const bool sr = stochastic != 0;
    QFn fn = dtype == DT_F32 ? pick_q<DT_F32>(fmt, gs, sr) : dtype == DT_F16 ? pick_q<DT_F16>(fmt, gs, sr)
           : dtype == DT_BF16 ? pick_q<DT_BF16>(fmt, gs, sr) : nullptr;
    if (!fn) return -1;
    advise_huge(codes, fmt == FMT_INT4 ? n_groups * gs / 2 : n_groups * gs);
    parallel_groups(n_groups, gs, n_threads,
                    [&](int64_t g0, int64_t g1) { fn(x, g0, g1, smix, codes, scales, flags); });
    return 0;
}

int hv_dequantize(const void* codes, const float* scales, int64_t n_groups, int gs, int fmt, int dtype,
                  void* out, int bf16_nan, int n_threads) {
    DFn fn = dtype == DT_F32 ? pick_d<DT_F32>(fmt, gs) : dtype == DT_F16 ? pick_d<DT_F16>(fmt, gs)
           : dtype == DT_BF16 ? pick_d<DT_BF16>(fmt, gs) : nullptr;
    if (!fn) return -1;
    advise_huge(out, n_groups * gs * (dtype == DT_F32 ? 4 : 2));
    parallel_groups(n_groups, gs, n_threads,
                    [&](int64_t g0, int64_t g1) { fn(codes, scales, g0, g1, out, (uint16_t)bf16_nan); });
    return 0;
}

}  // extern "C"
