// q4_kernel_supported (q4_weights.h), built without AVX-512 flags so that the check itself runs on any x86 CPU.
#include "q4_weights.h"

namespace pocket {

bool q4_kernel_supported() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

}  // namespace pocket
