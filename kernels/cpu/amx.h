// AMX (Intel's tile unit) on Linux: a process gets the tiles' 8 KB of register state only after asking for it
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), once for all its threads. Included by the kernels that use tiles.
#pragma once
#if defined(__AMX_TILE__) && defined(__linux__)
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace specviz_amx {

// Whether this process may use the tiles (asked once; where the kernel or a hypervisor refuses, false)
inline bool permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

// LDTILECFG's 64 bytes: palette 1, then each tile register's bytes per row and rows
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};  // bytes per row of tmm0 … tmm7
    uint8_t rows[16] = {};
    TileConfig& set(int t, int r, int bytes) {
        rows[t] = static_cast<uint8_t>(r);
        colsb[t] = static_cast<uint16_t>(bytes);
        return *this;
    }
};

}  // namespace specviz_amx
#endif
