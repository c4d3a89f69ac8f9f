// Force-included into src/cli/config_file.cpp in the fuzz build: toml++'s assertions off, as
// in the library moecore links (Debian's libtomlplusplus, built by GCC with NDEBUG, where
// TOML_ASSERT and TOML_ASSERT_ASSUME compile to nothing). toml++ 3.3.0 asserts in parse_key on a
// table header whose first character cannot start a key ("[:]", "[=]"); the shipped library
// reports that input as a parse error instead ("expected bare key starting character"), which
// config_file.cpp turns into a [config] error (tests/fuzz/regressions/config_file/).
#pragma once
#define TOML_ASSERT(expr) static_assert(true)
