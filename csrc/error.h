// NVFP4_CHECK: the ops' error reporting. The message is built with std::to_string, not std::ostream
// (torch's STD_TORCH_CHECK streams into an ostringstream, which segfaulted in std::ostream::_M_insert<long>
// where the extension was built by a separate GCC installation from the one torch's libstdc++ came with).
#pragma once

#include <torch/headeronly/core/ScalarType.h>

#include <stdexcept>
#include <string>
#include <type_traits>

namespace vllm_nvfp4 {

inline std::string to_text(const char* s) { return s; }
inline std::string to_text(const std::string& s) { return s; }
inline std::string to_text(torch::headeronly::ScalarType t) { return torch::headeronly::toString(t); }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
std::string to_text(T v) {
  return std::to_string(v);
}

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::string message;
  ((message += to_text(args)), ...);
  throw std::runtime_error(message);
}

}  // namespace vllm_nvfp4

#define NVFP4_CHECK(cond, ...)                          \
  do {                                                  \
    if (!(cond)) ::vllm_nvfp4::fail(__VA_ARGS__);       \
  } while (0)
