// A tiny check library for the native tests: no framework, no dependencies.
//
// A failed check prints file:line, the expression and (for the _EQ/_NE/... forms) both values,
// then exits non-zero at once, so ctest reports the test as failed and the sanitizers still
// get to print their own reports for whatever ran before.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <type_traits>

namespace check {

template <typename T>
std::string show(const T& v) {
  std::ostringstream os;
  if constexpr (std::is_pointer_v<T>) {
    os << static_cast<const void*>(v);
  } else if constexpr (std::is_same_v<T, bool>) {
    os << (v ? "true" : "false");
  } else if constexpr (std::is_same_v<T, char> || std::is_same_v<T, signed char> || std::is_same_v<T, unsigned char>) {
    os << static_cast<int>(v);
  } else {
    os << v;
  }
  return os.str();
}

// Integer comparisons that are right across signedness (C++20's std::cmp_* for C++17), so
// CHECK_EQ(stats.bytes_in_use, 0) needs no casts and raises no -Wsign-compare.
template <typename A, typename B>
constexpr bool eq(const A& a, const B& b) {
  if constexpr (std::is_integral_v<A> && std::is_integral_v<B> && !std::is_same_v<A, bool> &&
                !std::is_same_v<B, bool> && std::is_signed_v<A> != std::is_signed_v<B>) {
    if constexpr (std::is_signed_v<A>) {
      return a >= 0 && static_cast<std::make_unsigned_t<A>>(a) == b;
    } else {
      return b >= 0 && a == static_cast<std::make_unsigned_t<B>>(b);
    }
  } else {
    return a == b;
  }
}

template <typename A, typename B>
constexpr bool lt(const A& a, const B& b) {
  if constexpr (std::is_integral_v<A> && std::is_integral_v<B> && !std::is_same_v<A, bool> &&
                !std::is_same_v<B, bool> && std::is_signed_v<A> != std::is_signed_v<B>) {
    if constexpr (std::is_signed_v<A>) {
      return a < 0 || static_cast<std::make_unsigned_t<A>>(a) < b;
    } else {
      return b >= 0 && a < static_cast<std::make_unsigned_t<B>>(b);
    }
  } else {
    return a < b;
  }
}

[[noreturn]] inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
  std::fflush(stderr);
  std::exit(1);
}

template <typename A, typename B>
void compare(bool ok, const A& a, const B& b, const char* ea, const char* op, const char* eb, const char* file,
             int line) {
  if (!ok) fail(file, line, std::string(ea) + " " + op + " " + eb + "  (" + show(a) + " vs " + show(b) + ")");
}

// Runs one named test case and prints how long it took, so a slow case is easy to spot.
template <typename F>
void run(const char* name, F&& f) {
  std::printf("[ RUN  ] %s\n", name);
  std::fflush(stdout);
  const auto t0 = std::chrono::steady_clock::now();
  f();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[  OK  ] %s (%.1f ms)\n", name, ms);
  std::fflush(stdout);
}

}  // namespace check

#define CHECK(cond)                                                     \
  do {                                                                  \
    if (!(cond)) ::check::fail(__FILE__, __LINE__, "CHECK(" #cond ")"); \
  } while (0)

// Like CHECK, with an extra message (anything streamable) for context.
#define CHECK_MSG(cond, msg)                              \
  do {                                                    \
    if (!(cond)) {                                        \
      std::ostringstream check_os_;                       \
      check_os_ << "CHECK(" #cond "): " << msg;           \
      ::check::fail(__FILE__, __LINE__, check_os_.str()); \
    }                                                     \
  } while (0)

#define CHECK_OP_(a, b, op, expr)                                                  \
  do {                                                                             \
    /* copies, not references: (a) may be a reference to a temporary (std::max) */ \
    const auto check_a_ = (a);                                                     \
    const auto check_b_ = (b);                                                     \
    ::check::compare((expr), check_a_, check_b_, #a, op, #b, __FILE__, __LINE__);  \
  } while (0)

#define CHECK_EQ(a, b) CHECK_OP_(a, b, "==", ::check::eq(check_a_, check_b_))
#define CHECK_NE(a, b) CHECK_OP_(a, b, "!=", !::check::eq(check_a_, check_b_))
#define CHECK_LT(a, b) CHECK_OP_(a, b, "<", ::check::lt(check_a_, check_b_))
#define CHECK_LE(a, b) CHECK_OP_(a, b, "<=", !::check::lt(check_b_, check_a_))
#define CHECK_GT(a, b) CHECK_OP_(a, b, ">", ::check::lt(check_b_, check_a_))
#define CHECK_GE(a, b) CHECK_OP_(a, b, ">=", !::check::lt(check_a_, check_b_))

// Checks HostPool::check_invariants and prints the reason when it fails.
#define CHECK_POOL(pool)                                                                                            \
  do {                                                                                                              \
    std::string check_why_;                                                                                         \
    if (!(pool).check_invariants(&check_why_)) ::check::fail(__FILE__, __LINE__, "pool invariants: " + check_why_); \
  } while (0)

// Every block came back: nothing in use, nothing waiting for a copy, invariants hold.
#define CHECK_POOL_EMPTY(pool)                \
  do {                                        \
    const auto check_stats_ = (pool).stats(); \
    CHECK_EQ(check_stats_.bytes_in_use, 0u);  \
    CHECK_EQ(check_stats_.bytes_pending, 0u); \
    CHECK_POOL(pool);                         \
  } while (0)
