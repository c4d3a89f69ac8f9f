// The on-disk cache of dataset indices (--data-cache-path), in numpy's .npy format (version 1.0,
// little-endian, C order) so that numpy.load reads them: Megatron's file pattern
// "<hash>-<Class>-<split>-<name>.npy" plus "<hash>-<Class>-<split>-description.txt". The hash is
// FNV-1a over the description, and a cache entry is used only when its description.txt equals
// the description of the indices being built, byte for byte.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moecore::data {

// The dtypes the caches use, as numpy's descr strings.
template <typename T>
const char* npy_descr();

template <typename T>
void write_npy(const std::string& path, const std::vector<T>& values, int64_t rows, int64_t cols);
// Reads a 1-D (cols = 0) or 2-D file of exactly that dtype; nullopt if the file is absent,
// an error if it is present but malformed.
template <typename T>
std::optional<std::vector<T>> read_npy(const std::string& path, int64_t* rows, int64_t* cols);

class IndexCache {
 public:
  // dir empty: caching is off (load() returns false, save() does nothing).
  IndexCache(std::string dir, const std::string& class_name, const std::string& split,
             const std::string& description);
  bool enabled() const { return !dir_.empty(); }
  std::string path_of(const std::string& name) const;  // name: "document_index.npy", ...
  // True when the description file matches (then the arrays are expected to be present).
  bool hit() const;
  void save_description() const;

 private:
  std::string dir_, base_, description_;
};

}  // namespace moecore::data
