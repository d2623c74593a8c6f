// The one calling convention of hugeembed's native kernels (hugeembed/_native.py::call).
//
// Every exported kernel is `int64_t he_<name>(he_call* call)`:
//   bufs    the tensors it reads or writes, in the order its comment lists them, each as
//           (data, element count, element type); the kernel checks the count and type of
//           every buffer it uses (Call::buf), so none is read past its end;
//   ints    integer arguments; reals  floating-point arguments (double: a kernel rounds a
//           float32 hyperparameter once, as ctypes' c_float did);
//   nthreads the thread budget (torch.get_num_threads()).
// It returns its result (a count, or an outcome the caller acts on, named in an enum next
// to the kernel) with status HE_OK; or it fails: status says how, `message` what, and
// `detail` where (which entry, which value; the kernel's comment says), and the kernel has
// changed nothing.  A kernel never throws across the boundary: HE_KERNEL catches
// everything.
#pragma once

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <new>
#include <type_traits>

#define HE_API extern "C" __attribute__((visibility("default")))

extern "C" {

// Element type of a buffer.  Must match hugeembed/_native.py::_TYPES.
enum he_type : int64_t { HE_BYTES = 0, HE_I8 = 1, HE_I32 = 2, HE_I64 = 3, HE_F32 = 4, HE_F64 = 5 };

struct he_buf {
  void* data;  // null only when numel == 0
  int64_t numel;
  int64_t type;
};

// How a call ended.  Must match hugeembed/_native.py::Status.
enum he_status : int64_t {
  HE_OK = 0,
  HE_BAD_CALL = 1,   // the caller broke the convention (a missing buffer, wrong type or length): our bug
  HE_BAD_VALUE = 2,  // a value in the input is invalid (a slot out of range, an id, a count): detail says where
  HE_NO_MEMORY = 3,
  HE_IO_ERROR = 4,   // detail[0] = errno
};

constexpr int64_t kDetail = 6;
constexpr int64_t kMessage = 232;

struct he_call {
  const he_buf* bufs;
  int64_t nbufs;
  const int64_t* ints;
  int64_t nints;
  const double* reals;
  int64_t nreals;
  int64_t nthreads;
  int64_t status;           // out
  int64_t detail[kDetail];  // out
  char message[kMessage];   // out
};
}

namespace he {

struct Failed {};  // thrown by Call::fail, caught by HE_KERNEL

template <class T>
constexpr int64_t type_of() {
  if constexpr (std::is_same_v<T, int8_t>) return HE_I8;
  else if constexpr (std::is_same_v<T, int32_t>) return HE_I32;
  else if constexpr (std::is_same_v<T, int64_t>) return HE_I64;
  else if constexpr (std::is_same_v<T, float>) return HE_F32;
  else if constexpr (std::is_same_v<T, double>) return HE_F64;
  else return HE_BYTES;  // char, void: raw bytes of any element type
}

class Call {
 public:
  explicit Call(he_call* c, const char* kernel) : c_(c), kernel_(kernel) {}

  // Buffer k as T*, holding at least `min_numel` elements of T's type (HE_BYTES: any type,
  // counted in bytes by the caller).  Null when min_numel == 0 and the buffer is empty.
  template <class T>
  T* buf(int64_t k, int64_t min_numel, const char* what) const {
    using U = std::remove_const_t<T>;
    if (k < 0 || k >= c_->nbufs) fail(HE_BAD_CALL, "buffer %lld (%s) not given (%lld buffers)", (long long)k, what,
                                      (long long)c_->nbufs);
    const he_buf& b = c_->bufs[k];
    if (type_of<U>() != HE_BYTES && b.type != type_of<U>())
      fail(HE_BAD_CALL, "buffer %lld (%s) has element type %lld, expected %lld", (long long)k, what,
           (long long)b.type, (long long)type_of<U>());
    if (b.numel < min_numel || (b.numel > 0 && b.data == nullptr))
      fail(HE_BAD_CALL, "buffer %lld (%s) holds %lld elements, needs %lld", (long long)k, what, (long long)b.numel,
           (long long)min_numel);
    return b.numel > 0 ? static_cast<T*>(b.data) : nullptr;
  }
  // Like buf, but an empty buffer is allowed (an optional argument: null).
  template <class T>
  T* opt(int64_t k, int64_t numel_if_given, const char* what) const {
    if (k < c_->nbufs && c_->bufs[k].numel == 0) return nullptr;
    return buf<T>(k, numel_if_given, what);
  }
  // Buffer k as raw bytes: it must be HE_BYTES (uint8), at least min_bytes long.
  template <class T>
  T* bytes(int64_t k, int64_t min_bytes, const char* what) const {
    T* p = buf<T>(k, min_bytes, what);
    if (c_->bufs[k].type != HE_BYTES)
      fail(HE_BAD_CALL, "buffer %lld (%s) must be bytes (uint8), has element type %lld", (long long)k, what,
           (long long)c_->bufs[k].type);
    return p;
  }
  int64_t type(int64_t k) const {
    if (k < 0 || k >= c_->nbufs) fail(HE_BAD_CALL, "buffer %lld not given", (long long)k);
    return c_->bufs[k].type;
  }
  int64_t numel(int64_t k) const {
    if (k < 0 || k >= c_->nbufs) fail(HE_BAD_CALL, "buffer %lld not given", (long long)k);
    return c_->bufs[k].numel;
  }
  int64_t nbufs() const { return c_->nbufs; }
  int64_t nints() const { return c_->nints; }
  int64_t i(int64_t k) const {
    if (k < 0 || k >= c_->nints) fail(HE_BAD_CALL, "integer argument %lld not given (%lld)", (long long)k,
                                      (long long)c_->nints);
    return c_->ints[k];
  }
  double r(int64_t k) const {
    if (k < 0 || k >= c_->nreals) fail(HE_BAD_CALL, "real argument %lld not given (%lld)", (long long)k,
                                       (long long)c_->nreals);
    return c_->reals[k];
  }
  int nthreads() const { return (int)std::max<int64_t>(1, std::min<int64_t>(c_->nthreads, 1 << 12)); }
  // Checks that the call gives exactly these many buffers / ints / reals (-1: any).
  void expect(int64_t nbufs, int64_t nints, int64_t nreals) const {
    if ((nbufs >= 0 && c_->nbufs != nbufs) || (nints >= 0 && c_->nints != nints) ||
        (nreals >= 0 && c_->nreals != nreals))
      fail(HE_BAD_CALL, "called with %lld buffers, %lld ints, %lld reals; expects %lld, %lld, %lld",
           (long long)c_->nbufs, (long long)c_->nints, (long long)c_->nreals, (long long)nbufs, (long long)nints,
           (long long)nreals);
  }
  void detail(std::initializer_list<int64_t> d) const {
    int64_t k = 0;
    for (int64_t v : d)
      if (k < kDetail) c_->detail[k++] = v;
  }
  [[noreturn]] __attribute__((format(printf, 3, 4))) void fail(he_status s, const char* fmt, ...) const {
    c_->status = s;
    int used = std::snprintf(c_->message, kMessage, "%s: ", kernel_);
    if (used < 0 || used >= kMessage) used = 0;
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(c_->message + used, kMessage - used, fmt, ap);
    va_end(ap);
    throw Failed{};
  }

  he_call* raw() const { return c_; }

 private:
  he_call* c_;
  const char* kernel_;
};

// Runs body(call) with every exception turned into a status (never across the C boundary).
template <class F>
int64_t run_kernel(he_call* c, const char* kernel, F&& body) {
  c->status = HE_OK;
  c->message[0] = 0;
  for (int64_t k = 0; k < kDetail; ++k) c->detail[k] = 0;
  Call call(c, kernel);
  try {
    return body(call);
  } catch (const Failed&) {
  } catch (const std::bad_alloc&) {
    c->status = HE_NO_MEMORY;
    std::snprintf(c->message, kMessage, "%s: out of memory", kernel);
  } catch (...) {
    c->status = HE_BAD_CALL;
    std::snprintf(c->message, kMessage, "%s: unexpected C++ exception", kernel);
  }
  if (c->status == HE_OK) c->status = HE_BAD_CALL;
  return -1;
}

}  // namespace he

// Defines the exported kernel `name`; the braces that follow are its body, with `call`.
#define HE_KERNEL(name)                                                                   \
  static int64_t name##_body(const he::Call& call);                                       \
  HE_API int64_t name(he_call* c) { return he::run_kernel(c, #name, name##_body); }       \
  static int64_t name##_body(const he::Call& call)
