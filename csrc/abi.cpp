// ABI version of the kernel library.  hugeembed/_native.py refuses a library whose
// version differs from the one it was written against (a stale build after a pull),
// instead of calling a function whose signature has changed.  Bump it whenever a
// kernel's signature or semantics change.
#include "common.h"

HE_API int64_t he_abi_version() { return 3; }

// Exposed so the tests can check that the torch twin in hugeembed/_hashing.py
// hashes exactly as the kernels do.
HE_API void he_mix64(const int64_t* keys, int64_t n, int64_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = (int64_t)he::mix64((uint64_t)keys[i]);
}
