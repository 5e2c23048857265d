// Building message text without iostreams (Note [No iostreams in the extension]).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace ckpt_offload {

// Note [No iostreams in the extension]
// Messages (errors, warnings, invariant reports) are built with std::string, std::to_string and
// these helpers, never with std::ostringstream or another iostream of ours. torch's wheels are
// linked against a toolchain whose newer libstdc++ pieces are copied into libc10 and
// libtorch_cpu and exported from there (std::ostringstream's constructor, basic_stringbuf::str(),
// exception_ptr's reference counting): the dynamic linker binds the extension's references to
// those copies, which come before the system's libstdc++ in its lookup order, so an
// ostringstream of ours is built by torch's copy of libstdc++ and used and destroyed by the
// system's. Whether that mix works depends on the machine's libstdc++ and the compiler we were
// built with, not on this code. On the GPU machine of 2026-12-04 (Ubuntu 24.04, torch 2.11) every
// path that built its message with an ostringstream died by SIGSEGV as it raised (PoolFullError,
// the in-place check of a saved tensor, on the CPU and on autograd's CUDA thread alike), while
// the errors whose messages were built from strings were raised fine. That is the suspected
// cause, not yet a backtrace; strings cost nothing, so they are the rule. And setup.py names
// libstdc++ first among the libraries the extension needs, so that its libstdc++ references are
// versioned and bind to libstdc++ itself, torch's headers' own inline ostringstreams included.
// tests/core/test_packaging.py checks both: csrc/ uses no iostream, and at import no libstdc++
// symbol of the extension binds to a torch library.

// "0x1f2e3d4c": a 32-bit value in hex (checksums).
inline std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", static_cast<unsigned>(v));
  return buf;
}

// One decimal: "1.5".
inline std::string fixed1(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

}  // namespace ckpt_offload
