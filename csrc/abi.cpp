// ABI version of the kernel library.  hugeembed/_native.py refuses a library whose
// version differs from the one it was written against (a stale build after a pull),
// instead of calling a function whose signature has changed.  Bump it whenever a
// kernel's arguments or semantics change.  The one function outside call.h's
// convention: it is what tells the caller that the convention holds.
#include "common.h"

HE_API int64_t he_abi_version() { return 6; }

// Exposed so the tests can check that the torch twin in hugeembed/_hashing.py
// hashes exactly as the kernels do.
// bufs: keys int64 [n], out int64 [n].
HE_KERNEL(he_mix64) {
  call.expect(2, 0, 0);
  const int64_t n = call.numel(0);
  const int64_t* keys = call.buf<const int64_t>(0, n, "keys");
  int64_t* out = call.buf<int64_t>(1, n, "out");
  for (int64_t i = 0; i < n; ++i) out[i] = (int64_t)he::mix64((uint64_t)keys[i]);
  return 0;
}
