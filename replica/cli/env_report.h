// `replica env`: the facts a bug report needs (like `accelerate env`).
#pragma once

#include <string>

namespace replica::cli {

// Human-readable report, or JSON when `json` is true.
std::string env_report(bool json);

// The BLAS library mapped into this process, e.g. ".../openblas-pthread/libblas.so.3", and
// whether it is the slow reference implementation.
struct BlasInfo {
  std::string path;
  std::string name;  // openblas | reference | mkl | blis | unknown
};
BlasInfo loaded_blas();

}  // namespace replica::cli
