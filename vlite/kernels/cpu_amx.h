// AMX (Intel Advanced Matrix Extensions) helpers shared by the packed GEMM and the decode
// attention kernel: whether this process may use the tile state, and the one tile configuration
// both use (all 8 tiles 16 rows x 64 bytes: 16 x 32 bfloat16 operands, 16 x 16 float32 sums).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define VLITE_HAVE_AMX 1

namespace vlite_cpu {

struct TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// The CPU has AMX-BF16 and AMX-TILE, and Linux granted this process the tile state (asked once
// with arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)).
inline bool amx_permitted() {
  static const bool ok = [] {
    unsigned eax, ebx, ecx, edx;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool cpu = (edx >> 22 & 1) && (edx >> 24 & 1);  // AMX-BF16, AMX-TILE
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return cpu && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Every tile 16 rows x 64 bytes, on the calling thread (pair with _tile_release()).
inline void configure_tiles() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace vlite_cpu

#endif  // AMX
